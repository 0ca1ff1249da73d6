"""The cases of ``cache_attention`` (issue 34), shared by
test_cache_attention.py and test_cache_attention_writes.py (the
variants, the checks and appended_slots by test_cache_int8_attention.py too):
the shapes (``SHAPES``), the cache dtypes with a 16-bit cache
(``half_pairs``), a contiguous cache with garbage past the keys, new rows
and paged copies (``Case``), the variants and their keyword arguments
(``KINDS``, ``variant_kwargs``), and the checks: against the float64
reference with the tolerances of test_cache_attention.py's docstring
(``assert_matches``), and bitwise (``assert_same``); the slots an append
writes (``appended_slots``).
"""

import numpy as np

import attention_c as ac
from attention_c import reference as ref
from attention_c.testing import HALF_DTYPES, TOL, noise_floor, rel_err

F16 = np.dtype(np.float16)
BF16 = next((np.dtype(t) for t in HALF_DTYPES if np.dtype(t) != F16), None)

# (B, Tq, Hq, Hkv, d, dv, cache_seqlens, Tn): odd sizes, one sequence and a
# ragged batch (a sequence with no key, one whose queries but the last see
# nothing when Tq = 3 and causal), grouped and multi-head, with and
# without appended keys
RAGGED = [0, 1, 17, 300]
SHAPES = [
    (1, 1, 1, 1, 1, 1, [7], 0),
    (1, 3, 8, 2, 3, 5, [17], 3),
    (4, 1, 8, 2, 17, 17, RAGGED, 0),
    (4, 3, 4, 4, 65, 3, RAGGED, 0),
    (4, 3, 8, 2, 128, 128, RAGGED, 2),
    (2, 1, 6, 3, 65, 65, [64, 129], 1),
]


def shape_id(shape):
    B, Tq, Hq, Hkv, d, dv, lens, Tn = shape
    return f"B{B}-Tq{Tq}-H{Hq}/{Hkv}-d{d}-dv{dv}-Tn{Tn}"


def cache_dtypes_id(pair):
    return "/".join(np.dtype(t).name for t in pair)


def half_pairs():
    """(k_cache dtype, v_cache dtype) pairs with a 16-bit cache."""
    pairs = [(F16, F16), (F16, np.float32), (np.float32, F16)]
    if BF16 is not None:
        pairs += [(BF16, BF16), (F16, BF16), (BF16, np.float32)]
    return [tuple(np.dtype(t) for t in p) for p in pairs]


class Case:
    """Queries, a contiguous cache (B, S, Hkv, d|dv) whose rows past
    cache_seqlens[b] hold garbage, and new rows k, v (or None)."""

    def __init__(self, rng, shape, qdtype=np.float32, kdtype=None,
                 vdtype=None, slack=5):
        B, Tq, Hq, Hkv, d, dv, lens, Tn = shape
        kdtype = np.dtype(qdtype if kdtype is None else kdtype)
        vdtype = np.dtype(kdtype if vdtype is None else vdtype)
        self.B, self.Tq, self.Hq, self.Hkv, self.d, self.dv = (
            B, Tq, Hq, Hkv, d, dv)
        self.Tn = Tn
        self.seqlens = np.array(lens, np.int32)
        self.S = int(self.seqlens.max()) + Tn + slack
        self.q = rng.standard_normal((B, Tq, Hq, d)).astype(qdtype)
        self.kc = rng.standard_normal((B, self.S, Hkv, d)).astype(kdtype)
        self.vc = rng.standard_normal((B, self.S, Hkv, dv)).astype(vdtype)
        # the new rows in the computing dtype (float64 for float64 caches)
        new = np.float64 if kdtype == np.float64 else np.float32
        self.k = self.v = None
        if Tn:
            self.k = rng.standard_normal((B, Tn, Hkv, d)).astype(new)
            self.v = rng.standard_normal((B, Tn, Hkv, dv)).astype(new)

    @property
    def lengths(self):
        """N_b, the keys each sequence attends."""
        return self.seqlens.astype(np.int64) + self.Tn

    def paged(self, rng, bs, unused="-1", table_dtype=np.int32, extra=3):
        """(k_cache, v_cache, block_table) of blocks of bs rows holding the
        contiguous cache's rows, in shuffled blocks; the blocks no
        sequence owns hold NaN, and the table's entries past the blocks a
        sequence uses are -1 or garbage."""
        mb = -(-self.S // bs)
        nb = self.B * mb + extra
        table = rng.permutation(nb)[:self.B * mb].reshape(self.B, mb)
        table = table.astype(table_dtype)
        pages = []
        for c in (self.kc, self.vc):
            p = np.full((nb, bs) + c.shape[2:], np.nan, c.dtype)
            for b in range(self.B):
                for j in range(mb):
                    rows = c[b, j * bs:(j + 1) * bs]
                    p[table[b, j], :len(rows)] = rows
            pages.append(p)
        for b, n in enumerate(self.lengths):
            first = -(-int(n) // bs)                   # blocks in use
            if unused == "-1":
                table[b, first:] = -1
            else:
                info = np.iinfo(table_dtype)
                table[b, first:] = rng.integers(info.min, info.max,
                                                mb - first, table_dtype)
        return pages[0], pages[1], table

    def call(self, kc, vc, table=None, **kw):
        """cache_attention(..., return_lse=True) writing into kc, vc."""
        return ac.cache_attention(self.q, kc, vc, self.seqlens, k=self.k,
                                  v=self.v, block_table=table,
                                  return_lse=True, **kw)

    def run(self, table=None, caches=None, **kw):
        """(out, lse) on copies of the caches (contiguous, or the given
        paged ones)."""
        kc, vc = (self.kc, self.vc) if caches is None else caches
        return self.call(kc.copy(), vc.copy(), table, **kw)

    def want(self, **kw):
        """The reference's (out, lse) and caches after the append."""
        kc, vc = self.kc.copy(), self.vc.copy()
        out, lse = ref.cache_attention(self.q, kc, vc, self.seqlens,
                                       k=self.k, v=self.v, return_lse=True,
                                       **kw)
        return (out, lse), kc, vc

    def value_bound(self):
        """max |v|: every row of out is a convex combination of values."""
        vals = [np.abs(self.vc.astype(np.float64)).max()]
        if self.v is not None:
            vals.append(np.abs(self.v.astype(np.float64)).max())
        return max(vals)


def computing(kdtype, vdtype):
    both64 = np.dtype(kdtype) == np.float64 and np.dtype(vdtype) == np.float64
    return np.float64 if both64 else np.float32


def assert_matches(case, got, want, comp, what=""):
    """out and lse of a call computed in comp against the reference:
    normwise, out with a floor of ||values|| (where the answer is 0 or
    cancels), lse with one of its terms' size; -inf exactly where the
    reference has it."""
    (out, lse), (wout, wlse) = got, want
    tol = TOL[np.dtype(comp).type]
    assert out.dtype == case.q.dtype, what
    assert lse.dtype == comp, what
    assert out.shape == wout.shape and lse.shape == wlse.shape, what
    bound = case.value_bound() * np.sqrt(out.size)
    err = rel_err(out, wout, noise_floor(bound, comp, tol))
    assert err <= tol, f"{what} out: {err:.3g} > {tol:.3g}"
    finite = np.isfinite(wlse)
    assert np.array_equal(np.isfinite(lse), finite), f"{what} lse finite"
    assert np.array_equal(lse[~finite], wlse[~finite]), f"{what} lse -inf"
    if finite.any():
        n = int(case.lengths.max())
        bound = (np.abs(wlse[finite]).max() + 2 * np.log1p(n)) * np.sqrt(
            finite.sum())
        err = rel_err(lse[finite], wlse[finite],
                      noise_floor(bound, comp, tol))
        assert err <= tol, f"{what} lse: {err:.3g} > {tol:.3g}"


def assert_same(got, want, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, (what, i, g.dtype, w.dtype)
        assert np.array_equal(g, w), (
            f"{what} output {i} not bitwise equal: max |diff| "
            f"{np.max(np.abs(g.astype(float) - w.astype(float)))}")


def appended_slots(seqlens, Tn, table, bs):
    """{slot: (b, j)}: the (block or sequence, row) slot that new row j of
    sequence b goes to, at position seqlens[b] + j (table None: a
    contiguous cache; else pages of bs rows through the block table)."""
    changed = {}
    for b, n in enumerate(seqlens):
        for j in range(Tn):
            x = int(n) + j
            slot = (b, x) if table is None else (int(table[b, x // bs]),
                                                 x % bs)
            changed[slot] = (b, j)
    return changed


# The variants variant_kwargs makes
KINDS = ["plain", "not_causal", "window_left", "window_both",
         "window_both_causal", "softcap", "alibi_h", "alibi_bh", "sinks",
         "all"]


def variant_kwargs(kind, rng, B, Hq, comp):
    """The keyword arguments of kind, in the computing dtype."""
    kw = {}
    if kind == "not_causal":
        kw["causal"] = False
    if kind == "window_left":
        kw["window"] = (5, None)
    if kind == "window_both":
        kw.update(window=(4, 2), causal=False)
    if kind == "window_both_causal":
        kw["window"] = (3, 1)                # causal cuts the right side
    if kind in ("softcap", "all"):
        kw["softcap"] = 2.0
    if kind == "alibi_h":
        kw["alibi_slopes"] = (rng.random(Hq) * 0.5).astype(comp)
    if kind in ("alibi_bh", "all"):
        kw["alibi_slopes"] = (rng.random((B, Hq)) * 0.5).astype(comp)
    if kind in ("sinks", "all"):
        kw["sinks"] = rng.standard_normal(Hq).astype(comp)
    if kind == "all":
        kw.update(window=(7, None), scale=0.3)
    return kw
