"""Attention against a key-value cache (issue 34): ``cache_attention``,
FlashAttention-2's ``flash_attn_with_kvcache`` layouts, contiguous caches
(B, S_max, Hkv, d) and paged ones (num_blocks, block_size, Hkv, d) read
through a block table, with the new keys and values appended in place.

Oracle: ``attention_c.reference.cache_attention`` in float64 (on the
16-bit caches widened), itself checked against ``reference.dot_attention``
sequence by sequence.  Proven here:

* the results against the reference, normwise: d 1, 3, 17, 65 and 128,
  Tq 1 and 3, one sequence and a ragged batch (0, 1, 17 and 300 cached
  keys), grouped (Hq 8, Hkv 2) and multi-head, causal or not, a window
  on the left or on both sides, softcap, ALiBi slopes (Hq,) and (B, Hq),
  sinks, a given scale, all at once; float32 and float64; float16 and
  bfloat16 caches, keys and values of different dtypes;
* a paged cache (blocks of 1, 5, 16 and 64 rows, a shuffled table whose
  unused entries are -1 or garbage) gives bitwise what the contiguous
  cache with the same contents gives, and so does a strided cache;
* the append: exactly the slots cache_seqlens[b] .. + Tn - 1 change, to
  the new rows rounded to the cache's dtype (to nearest even, ties
  included), across block boundaries; cache_seqlens is not changed; the
  other inputs neither;
* a query that sees no key: out 0 and lse -inf, or the sink's logit;
* NaN and infinity in cache rows no query sees reach nothing; a NaN in
  a key reaches exactly the queries (and heads) that see it;
* 16-bit queries: the float32 call's results rounded once (lse float32);
  float32 and 16-bit queries on float64 caches;
* every SIMD path; 1, 2 and 3 threads bitwise on a cache long enough to
  be split;
* bad arguments refused with an error naming the argument, before
  anything is written.

Tolerances: ``testing.TOL`` (normwise relative error, 1e-5 float32, 1e-12
float64) against the float64 reference, with a noise floor from the
inputs' scale (out is a convex combination of values, exactly 0 when no
key is seen; lse can be 0).
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import (HALF_DTYPES, TOL, assert_identical,
                                 assert_rounded, misaligned, noise_floor,
                                 rel_err)

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())
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


# --------------------------------------------------------------------------
# the results against the reference

@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(layout, dtype, kind):
    rng = np.random.default_rng([KINDS.index(kind), layout == "paged16"])
    for shape in SHAPES:
        c = Case(rng, shape, dtype)
        kw = variant_kwargs(kind, rng, c.B, c.Hq, dtype)
        want, _, _ = c.want(**kw)
        if layout == "contiguous":
            got = c.run(**kw)
        else:
            kp, vp, table = c.paged(rng, 16)
            got = c.run(table, (kp, vp), **kw)
        assert_matches(c, got, want, dtype, f"{kind} {shape_id(shape)}")


@pytest.mark.parametrize("layout", ["contiguous", 1, 16, 64],
                         ids=lambda x: x if isinstance(x, str)
                         else f"paged{x}")
@pytest.mark.parametrize("pair", half_pairs(), ids=cache_dtypes_id)
@pytest.mark.parametrize("kind", ["plain", "all"])
def test_half_caches(layout, pair, kind):
    """16-bit caches (keys and values of different dtypes too), float32
    queries: the reference on the widened cache, computed in float32."""
    rng = np.random.default_rng(7)
    for shape in (SHAPES[1], SHAPES[2], SHAPES[4]):
        c = Case(rng, shape, np.float32, *pair)
        kw = variant_kwargs(kind, rng, c.B, c.Hq, np.float32)
        want, _, _ = c.want(**kw)
        if layout == "contiguous":
            got = c.run(**kw)
        else:
            kp, vp, table = c.paged(rng, layout)
            got = c.run(table, (kp, vp), **kw)
        assert_matches(c, got, want, np.float32,
                       f"{cache_dtypes_id(pair)} {shape_id(shape)}")


@pytest.mark.parametrize("qdtype", HALF_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("pair", [(np.float32, np.float32)] + half_pairs()[:4],
                         ids=cache_dtypes_id)
def test_half_queries_round_once(qdtype, pair):
    """16-bit queries: out in their dtype, the float32 queries' out
    rounded once; lse float32, the same bits."""
    rng = np.random.default_rng(8)
    for shape in (SHAPES[1], SHAPES[4]):
        c = Case(rng, shape, np.float32, *pair)
        c.q = c.q.astype(qdtype)
        kw = variant_kwargs("all", rng, c.B, c.Hq, np.float32)
        got = c.run(**kw)
        c.q = c.q.astype(np.float32)                   # exact
        want = c.run(**kw)
        assert_rounded(got, want, qdtype, shape_id(shape), lse=1)


@pytest.mark.parametrize("qdtype", [np.float32] + HALF_DTYPES,
                         ids=lambda d: np.dtype(d).name)
def test_float64_caches_other_queries(qdtype):
    """Any float query with float64 caches: computed in float64, out in
    the query's dtype (each element rounded once: normwise within half an
    ulp of the dtype), lse float64."""
    rng = np.random.default_rng(9)
    u = {"float32": 2.0**-24, "float16": 2.0**-11,
         "bfloat16": 2.0**-8}[np.dtype(qdtype).name]
    for shape in (SHAPES[1], SHAPES[4]):
        c = Case(rng, shape, np.float64)
        c.q = c.q.astype(qdtype)
        kw = variant_kwargs("all", rng, c.B, c.Hq, np.float64)
        (out, lse), (wout, wlse) = c.run(**kw), c.want(**kw)[0]
        assert out.dtype == qdtype and lse.dtype == np.float64
        err = rel_err(out, wout, 1e-30)
        assert err <= 1.01 * u + 1e-12, (shape_id(shape), err)
        finite = np.isfinite(wlse)
        assert np.array_equal(lse[~finite], wlse[~finite])
        assert rel_err(lse[finite], wlse[finite]) <= TOL[np.float64]


def test_nothing_seen():
    """A sequence with no key (cache_seqlens 0, no k) and queries ahead of
    every key (Tq 3 against one causal key): out exactly 0, lse -inf, or
    the sink's logit with sinks; contiguous and paged (a table of -1)."""
    rng = np.random.default_rng(10)
    for dtype in (np.float32, np.float64):
        c = Case(rng, (3, 3, 4, 2, 5, 6, [0, 1, 4], 0), dtype)
        sinks = rng.standard_normal(4).astype(dtype)
        kp, vp, table = c.paged(rng, 2)
        assert (table[0] == -1).all()
        for kw in ({}, {"sinks": sinks}):
            for got in (c.run(**kw), c.run(table, (kp, vp), **kw)):
                out, lse = got
                none = -np.inf if not kw else sinks
                assert np.array_equal(out[0], np.zeros_like(out[0]))
                assert np.array_equal(lse[0], np.broadcast_to(none, (3, 4)))
                # sequence 1: its key sits at the last query's position
                assert np.array_equal(out[1, :2], np.zeros_like(out[1, :2]))
                assert np.array_equal(lse[1, :2],
                                      np.broadcast_to(none, (2, 4)))
                assert np.all(np.isfinite(lse[1:, 2]))
                assert_matches(c, got, c.want(**kw)[0], dtype, str(kw))
                if not kw:
                    # without lse: out alone, the same bits
                    alone = ac.cache_attention(c.q, c.kc, c.vc, c.seqlens)
                    assert type(alone) is np.ndarray
                    assert_same((alone,), (c.run()[0],))


# --------------------------------------------------------------------------
# paged and strided caches: the contiguous cache's bits

@pytest.mark.parametrize("bs", [1, 5, 16, 64])
@pytest.mark.parametrize("pair", [(np.float32, np.float32),
                                  (np.float64, np.float64)]
                         + half_pairs()[3:5] + half_pairs()[:1],
                         ids=cache_dtypes_id)
def test_paged_equals_contiguous(bs, pair):
    """The same rows at the same positions, paged (shuffled blocks; unused
    table entries -1 or garbage; int32 or int64 tables) or contiguous:
    bitwise the same results and the same appended rows."""
    rng = np.random.default_rng(bs)
    comp = computing(*pair)
    kinds = ["all", "plain", "window_both", "alibi_bh", "sinks"]
    for shape, kind in zip(SHAPES[1:], kinds):
        c = Case(rng, shape, comp, *pair)
        kw = variant_kwargs(kind, rng, c.B, c.Hq, comp)
        kc, vc = c.kc.copy(), c.vc.copy()
        want = c.call(kc, vc, **kw)
        for unused, tdtype in (("-1", np.int32), ("garbage", np.int64)):
            kp, vp, table = c.paged(rng, bs, unused, tdtype)
            got = c.call(kp, vp, table, **kw)
            assert_same(got, want, f"{shape_id(shape)} {unused}")
            for b, n in enumerate(c.lengths):          # the rows < N_b
                t = np.arange(n)
                for page, cont in ((kp, kc), (vp, vc)):
                    assert_identical(page[table[b, t // bs], t % bs],
                                     cont[b, :n], f"rows of {b}")


def test_strided_cache_equals_contiguous():
    """Caches that are slices of bigger buffers (every stride but the last
    axis's): the bits of contiguous copies, and the append lands in the
    buffer."""
    rng = np.random.default_rng(11)
    for pair in [(np.float32, np.float32), (np.float64, np.float64)] + \
            half_pairs()[3:4]:
        comp = computing(*pair)
        c = Case(rng, SHAPES[4], comp, *pair)
        kw = variant_kwargs("all", rng, c.B, c.Hq, comp)
        want = c.run(**kw)
        kbuf = np.zeros((c.B + 1, c.S + 4, c.Hkv * 2, c.d + 3), c.kc.dtype)
        vbuf = np.zeros((c.B, c.S, c.Hkv + 1, c.dv + 2), c.vc.dtype)
        kbuf[1:, 2:-2, ::2, 1:-2] = c.kc
        vbuf[:, :, 1:, :-2] = c.vc
        ks, vs = kbuf[1:, 2:-2, ::2, 1:-2], vbuf[:, :, 1:, :-2]
        got = c.call(ks, vs, **kw)
        assert_same(got, want, cache_dtypes_id(pair))
        _, kc, vc = c.want(**kw)
        assert_identical(np.ascontiguousarray(ks), kc, "appended keys")
        assert_identical(np.ascontiguousarray(vs), vc, "appended values")
        # and nothing of the buffers outside the slices
        kbuf[1:, 2:-2, ::2, 1:-2] = 0
        vbuf[:, :, 1:, :-2] = 0
        assert not kbuf.astype(np.float32).any()
        assert not vbuf.astype(np.float32).any()


# --------------------------------------------------------------------------
# the append in place

def is_half(dtype):
    return np.dtype(dtype) == F16 or (BF16 is not None
                                      and np.dtype(dtype) == BF16)


def ties(rng, shape, dtype):
    """float32 values, a third of them exactly halfway between two
    neighbours of the 16-bit dtype (rounding to nearest even decides)."""
    x = rng.standard_normal(shape).astype(np.float32)
    x = (np.sign(x) * (np.abs(x) + 0.01)).astype(np.float32)
    if is_half(dtype):
        low = np.uint32(0x1000 if dtype == F16 else 0x8000)
        base = x.astype(dtype).astype(np.float32).view(np.uint32)
        tie = (base | low).view(np.float32)
        x = np.where(rng.random(shape) < 1 / 3, tie, x)
    return x


def slots_of(c, b, t, table, bs):
    """The (block or sequence, row) slots of positions t of sequence b."""
    if table is None:
        return [(b, int(x)) for x in t]
    return [(int(table[b, x // bs]), int(x % bs)) for x in t]


@pytest.mark.parametrize("layout", ["contiguous", 1, 16],
                         ids=lambda x: x if isinstance(x, str)
                         else f"paged{x}")
@pytest.mark.parametrize("pair", [(np.float32, np.float32),
                                  (np.float64, np.float64)] + half_pairs(),
                         ids=cache_dtypes_id)
def test_append_in_place(layout, pair):
    """Slot by slot: the slots of positions cache_seqlens[b] .. + Tn - 1
    hold the new rows cast to the cache's dtype (16-bit: to nearest even,
    ties included), every other slot its old bits (NaN included); across
    a block boundary; cache_seqlens unchanged."""
    rng = np.random.default_rng(12)
    comp = computing(*pair)
    c = Case(rng, (3, 2, 4, 2, 9, 7, [15, 0, 30], 3), comp, *pair)
    c.k = ties(rng, c.k.shape, pair[0]).astype(c.k.dtype)
    c.v = ties(rng, c.v.shape, pair[1]).astype(c.v.dtype)
    if layout == "contiguous":
        kc, vc, table, bs = c.kc.copy(), c.vc.copy(), None, None
    else:
        bs = layout
        kc, vc, table = c.paged(rng, bs, "garbage")
    before = kc.copy(), vc.copy()
    lens, tab = c.seqlens.copy(), None if table is None else table.copy()
    got = c.call(kc, vc, table)
    assert_identical(c.seqlens, lens, "cache_seqlens")
    if table is not None:
        assert_identical(table, tab, "block_table")
    changed = {}
    for b in range(c.B):
        t = c.seqlens[b] + np.arange(c.Tn)
        for j, slot in enumerate(slots_of(c, b, t, table, bs)):
            changed[slot] = (b, j)
    assert len(changed) == c.B * c.Tn
    for cache, old, new in ((kc, before[0], c.k), (vc, before[1], c.v)):
        for slot in np.ndindex(cache.shape[:2]):
            if slot in changed:
                b, j = changed[slot]
                row = new[b, j].astype(cache.dtype)
                assert_identical(cache[slot], row, f"new slot {slot}")
                assert not np.array_equal(cache[slot], old[slot])
            else:
                assert cache[slot].tobytes() == old[slot].tobytes(), (
                    f"slot {slot} changed")
    assert_matches(c, got, c.want()[0], comp, "after the append")


def test_append_rounding_to_nearest_even():
    """The new rows' 16-bit bits from the float32 bits, written out:
    round to nearest, ties to even (no NumPy cast as oracle)."""
    rng = np.random.default_rng(13)
    for dtype in [t for t in (F16, BF16) if t is not None]:
        c = Case(rng, (1, 1, 2, 1, 64, 64, [0], 1), np.float32, dtype)
        x = ties(rng, c.k.shape, dtype)
        c.k = x
        kc, vc = c.kc.copy(), c.vc.copy()
        c.call(kc, vc)
        bits = kc[0, 0].view(np.uint16).astype(np.uint32).ravel()
        u = x.view(np.uint32).ravel()
        if dtype == BF16:
            want = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        else:                      # normal float16 range: |x| in [0.01, 6)
            sign = (u >> 31) << 15
            exp = ((u >> 23) & 0xFF).astype(np.int64) - 127 + 15
            man = u & 0x7FFFFF
            r = (man + 0xFFF + ((man >> 13) & 1)) >> 13    # may carry
            want = sign + ((exp.astype(np.uint32) << 10) + r)
        assert np.array_equal(bits, want.astype(np.uint32)), dtype


def test_inputs_unchanged():
    """query, k, v, block_table and cache_seqlens (int32 and int64) are
    left as they were; the caches change only by the append."""
    rng = np.random.default_rng(14)
    for lens_dtype in (np.int32, np.int64):
        c = Case(rng, SHAPES[4], np.float32)
        c.seqlens = c.seqlens.astype(lens_dtype)
        kp, vp, table = c.paged(rng, 16, "garbage")
        saved = [x.copy() for x in (c.q, c.k, c.v, table, c.seqlens)]
        kw = variant_kwargs("all", rng, c.B, c.Hq, np.float32)
        extra = [kw["alibi_slopes"].copy(), kw["sinks"].copy()]
        c.call(kp, vp, table, **kw)
        for x, y, name in zip((c.q, c.k, c.v, table, c.seqlens,
                               kw["alibi_slopes"], kw["sinks"]),
                              saved + extra,
                              ("query", "k", "v", "block_table",
                               "cache_seqlens", "alibi_slopes", "sinks")):
            assert_identical(x, y, name)


# --------------------------------------------------------------------------
# what no query sees reaches nothing

@pytest.mark.parametrize("where", ["past_end", "overwritten",
                                   "outside_window"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_nonfinite_unseen(where, layout):
    """NaN and infinity in cache rows no query sees: at positions >= N_b
    (the row right after the last, in the same block), in the slots the
    append overwrites, or before every query's window.  The results are
    finite and the reference's (which never reads those rows)."""
    rng = np.random.default_rng(15)
    for dtype in [np.float32, np.float64] + HALF_DTYPES:
        c = Case(rng, (3, 3, 4, 2, 17, 9, [5, 20, 40], 2),
                 np.float32 if dtype != np.float64 else np.float64, dtype)
        kw = {"window": (4, None)} if where == "outside_window" else {}
        for b, n in enumerate(c.lengths):
            if where == "past_end":
                rows = [int(n), int(n) + 1]
            elif where == "overwritten":
                rows = list(range(int(c.seqlens[b]), int(n)))
            else:                     # the first query sees from n - 3 - 4
                rows = list(range(0, int(n) - 3 - 4))
            for r, bad in zip(rows, [np.nan, np.inf, -np.inf] * 20):
                c.kc[b, r, r % c.Hkv, r % c.d] = bad
                c.vc[b, r, (r + 1) % c.Hkv, r % c.dv] = np.nan
        want, _, _ = c.want(**kw)
        assert np.all(np.isfinite(want[0]))
        if layout == "contiguous":
            got = c.run(**kw)
        else:
            kp, vp, table = c.paged(rng, 16)
            got = c.run(table, (kp, vp), **kw)
        assert np.all(np.isfinite(got[0])), (where, dtype)
        assert_matches(c, got, want, computing(dtype, dtype),
                       f"{where} {np.dtype(dtype).name}")


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_nonfinite_reaches_who_sees_it(layout):
    """A NaN in the last key of each sequence (kv head 0), causal: the
    earlier queries do not see it and get the reference's results; the
    last query's heads that read kv head 0 get a NaN, the others not."""
    rng = np.random.default_rng(19)
    for dtype in [np.float32, np.float64] + HALF_DTYPES:
        comp = computing(dtype, dtype)
        c = Case(rng, (3, 3, 8, 2, 17, 9, [5, 20, 40], 0), comp, dtype)
        for b, n in enumerate(c.lengths):
            c.kc[b, n - 1, 0, 3] = np.nan
        (wout, wlse), _, _ = c.want()
        if layout == "contiguous":
            out, lse = c.run()
        else:
            kp, vp, table = c.paged(rng, 16)
            out, lse = c.run(table, (kp, vp))
        seen = np.zeros(out.shape[:3], bool)            # (B, Tq, Hq)
        seen[:, -1, :4] = True                          # heads of kv head 0
        assert np.all(np.isnan(out[seen]).any(axis=-1)), dtype
        assert np.all(np.isfinite(out[~seen])), dtype
        assert np.all(np.isfinite(lse[~seen])), dtype
        tol = TOL[comp]
        bound = c.value_bound() * np.sqrt(out[~seen].size)
        err = rel_err(out[~seen], wout[~seen], noise_floor(bound, comp, tol))
        assert err <= tol, (dtype, err)
        assert rel_err(lse[~seen], wlse[~seen]) <= tol, dtype


# --------------------------------------------------------------------------
# SIMD paths and threads

@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
def test_every_simd_path(simd):
    """Each path against the reference, paged == contiguous on it."""
    _core._set_simd(simd)
    rng = np.random.default_rng(16)
    pairs = [(np.float32, np.float32), (np.float64, np.float64)]
    pairs += half_pairs()[3:5] + half_pairs()[:1]
    for pair in pairs:
        comp = computing(*pair)
        for shape, kind in ((SHAPES[2], "all"), (SHAPES[4], "plain"),
                            (SHAPES[5], "alibi_h"), (SHAPES[1], "sinks")):
            c = Case(rng, shape, comp, *pair)
            kw = variant_kwargs(kind, rng, c.B, c.Hq, comp)
            got = c.run(**kw)
            what = f"{simd} {cache_dtypes_id(pair)} {shape_id(shape)}"
            assert_matches(c, got, c.want(**kw)[0], comp, what)
            kp, vp, table = c.paged(rng, 16)
            assert_same(c.run(table, (kp, vp), **kw), got, what)


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("d", [64, 128, 65])
@pytest.mark.parametrize("G", [2, 4])
def test_grouped_heads_same_bits_as_alone(simd, d, G):
    """A query head gives the same bits in a group of G heads reading its
    kv head (the scores of blocks of queries and keys reduced together) as
    alone (one kv head per query head, one at a time): float32, bfloat16
    and int8 caches, Tq 1 and 3."""
    _core._set_simd(simd)
    rng = np.random.default_rng(20)
    B, S, Hkv = 2, 203, 2
    lens = np.array([203, 77], np.int32)
    kc = rng.standard_normal((B, S, Hkv, d)).astype(np.float32)
    vc = rng.standard_normal((B, S, Hkv, d)).astype(np.float32)
    caches = [((kc, vc), {})]
    if BF16 is not None:
        caches.append(((kc.astype(BF16), vc.astype(BF16)), {}))
    if d % 8 == 0:
        (kq, ks), (vq, vs) = ac.quantize_kv(kc), ac.quantize_kv(vc)
        caches.append(((kq, vq), {"k_scales": ks, "v_scales": vs}))
    for Tq in (1, 3):
        q = rng.standard_normal((B, Tq, Hkv * G, d)).astype(np.float32)
        for (k, v), kw in caches:
            grouped = ac.cache_attention(q, k, v, lens, return_lse=True, **kw)
            for j in range(G):          # head h G + j of each kv head h
                alone = ac.cache_attention(q[:, :, j::G], k, v, lens,
                                           return_lse=True, **kw)
                assert_same(alone, (grouped[0][:, :, j::G],
                                    grouped[1][:, :, j::G]),
                            f"{simd} d {d} Tq {Tq} {k.dtype} head {j}")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("pair", [(np.float32, np.float32),
                                  (np.float64, np.float64)]
                         + half_pairs()[3:4], ids=cache_dtypes_id)
def test_threads_bitwise(pair):
    """5000 cached keys (split across threads): 1, 2 and 3 threads give
    the same bits, paged or contiguous, and the reference's results."""
    rng = np.random.default_rng(17)
    comp = computing(*pair)
    for Tq in (1, 3):
        c = Case(rng, (2, Tq, 8, 2, 64, 64, [5000, 4321], 2), comp, *pair)
        kw = variant_kwargs("sinks", rng, c.B, c.Hq, comp)
        kp, vp, table = c.paged(rng, 16)
        ac.set_num_threads(1)
        one = c.run(**kw)
        assert_matches(c, one, c.want(**kw)[0], comp, f"Tq {Tq}")
        for n in (1, 2, 3):
            ac.set_num_threads(n)
            assert_same(c.run(**kw), one, f"{n} threads")
            assert_same(c.run(table, (kp, vp), **kw), one,
                        f"{n} threads, paged")


# --------------------------------------------------------------------------
# bad arguments: refused before anything is written

def bad_case(name):
    """(case, caches, block_table, keyword changes, error, pattern)."""
    rng = np.random.default_rng(18)
    c = Case(rng, (3, 2, 4, 2, 8, 6, [3, 16, 5], 2), np.float32)
    kp, vp, table = c.paged(rng, 16)
    contiguous = (c.kc.copy(), c.vc.copy())
    paged = (kp, vp)
    nb = kp.shape[0]
    kw = {}
    if name == "block_out_of_range":
        table[2, 0] = nb
        return c, paged, table, kw, ValueError, "block_table"
    if name == "block_negative_used":
        table[1, 0] = -1
        return c, paged, table, kw, ValueError, "block_table"
    if name == "block_used_by_append_only":
        # sequence 1 fills its first block; the append needs its second
        table[1, 1] = nb + 7
        return c, paged, table, kw, ValueError, "block_table"
    if name == "beyond_capacity":
        c.seqlens[2] = c.S - c.Tn + 1
        return c, contiguous, None, kw, ValueError, "cache_seqlens"
    if name == "beyond_capacity_paged":
        # one more key than the table's blocks hold, every entry valid
        c.seqlens[2] = table.shape[1] * 16 - c.Tn + 1
        kp, vp, table = c.paged(rng, 16)
        assert (table[2] >= 0).all()
        return c, (kp, vp), table, kw, ValueError, "cache_seqlens"
    if name == "negative_seqlens":
        c.seqlens[1] = -1
        return c, contiguous, None, kw, ValueError, "cache_seqlens"
    if name == "heads_not_multiple":
        c.q = rng.standard_normal((3, 2, 3, 8)).astype(np.float32)
        return c, contiguous, None, kw, ValueError, "query|k_cache"
    if name == "k_without_v":
        c.v = None
        return c, contiguous, None, kw, (TypeError, ValueError), r"\bv\b"
    if name == "v_without_k":
        c.k = None
        return c, contiguous, None, kw, (TypeError, ValueError), r"\bk\b"
    if name == "query_d_mismatch":
        c.q = rng.standard_normal((3, 2, 4, 9)).astype(np.float32)
        return c, contiguous, None, kw, ValueError, "query|k_cache"
    if name == "k_d_mismatch":
        c.k = rng.standard_normal((3, 2, 2, 9)).astype(np.float32)
        return c, contiguous, None, kw, ValueError, r"\bk\b"
    if name == "v_dv_mismatch":
        c.v = rng.standard_normal((3, 2, 2, 7)).astype(np.float32)
        return c, contiguous, None, kw, ValueError, r"\bv\b"
    if name == "int16_cache":
        kc = rng.integers(-9, 9, contiguous[0].shape).astype(np.int16)
        return c, (kc, contiguous[1]), None, kw, TypeError, "k_cache"
    if name == "float64_query_float32_cache":
        c.q = c.q.astype(np.float64)
        return c, contiguous, None, kw, TypeError, "query"
    if name == "float64_query_half_cache":
        c.q = c.q.astype(np.float64)
        return (c, tuple(x.astype(np.float16) for x in contiguous), None,
                kw, TypeError, "query")
    if name == "k_cache_last_axis_strided":
        kc = np.repeat(contiguous[0], 2, axis=-1)[..., ::2]
        return c, (kc, contiguous[1]), None, kw, ValueError, "k_cache"
    if name == "v_cache_last_axis_strided":
        vc = np.repeat(contiguous[1], 2, axis=-1)[..., ::2]
        return c, (contiguous[0], vc), None, kw, ValueError, "v_cache"
    if name == "v_cache_read_only":      # k_cache is checked first
        contiguous[1].flags.writeable = False
        return c, contiguous, None, kw, ValueError, "v_cache.*read-only"
    if name == "v_cache_unaligned":
        vc = misaligned(contiguous[1])
        assert not vc.flags.aligned
        return c, (contiguous[0], vc), None, kw, ValueError, "v_cache"
    raise AssertionError(name)


BAD = ["block_out_of_range", "block_negative_used",
       "block_used_by_append_only", "beyond_capacity",
       "beyond_capacity_paged", "negative_seqlens", "heads_not_multiple",
       "k_without_v", "v_without_k", "query_d_mismatch", "k_d_mismatch",
       "v_dv_mismatch", "int16_cache", "float64_query_float32_cache",
       "float64_query_half_cache", "k_cache_last_axis_strided",
       "v_cache_last_axis_strided", "v_cache_read_only",
       "v_cache_unaligned"]


@pytest.mark.parametrize("name", BAD)
def test_refused(name):
    """Each bad argument raises an error naming it, and the caches keep
    their bits: nothing is written before the checks (the other
    sequences' appends included)."""
    c, (kc, vc), table, kw, error, pattern = bad_case(name)
    before = kc.copy(), vc.copy()
    with pytest.raises(error, match=pattern) as info:
        c.call(kc, vc, table, **kw)
    if name == "int16_cache":            # the accepted dtypes named
        for accepted in ["float32", "float64", "float16", "int8"] + (
                ["bfloat16"] if BF16 is not None else []):
            assert accepted in str(info.value), (accepted, str(info.value))
    assert kc.tobytes() == before[0].tobytes(), "k_cache written"
    assert vc.tobytes() == before[1].tobytes(), "v_cache written"


def test_seqlens_beyond_int64_named():
    """A uint64 length past int64 is named as given, not wrapped."""
    c = Case(np.random.default_rng(19), SHAPES[0])
    lens = np.array([2 ** 64 - 1], np.uint64)
    with pytest.raises(ValueError, match=f"cache_seqlens.*{2 ** 64 - 1}"):
        ac.cache_attention(c.q, c.kc, c.vc, lens)


def test_table_shape_is_a_value_error():
    c = Case(np.random.default_rng(19), SHAPES[0])
    with pytest.raises(ValueError, match="block_table must have 2 axes"):
        ac.cache_attention(c.q, c.kc, c.vc, c.seqlens,
                           block_table=np.zeros(3, np.int64))


# --------------------------------------------------------------------------
# layouts the kernel does not take as they are: copied (the small
# arguments) or answered without it

def test_transposed_table_and_unaligned_query():
    """A block table in Fortran order and a query at an odd address give
    the bits of their C-ordered, aligned copies (they are copied; the
    caches never are)."""
    rng = np.random.default_rng(20)
    c = Case(rng, SHAPES[4])
    kp, vp, table = c.paged(rng, 16)
    want = c.run(table, (kp, vp))
    fortran = np.asfortranarray(table)
    assert not fortran.flags.c_contiguous
    assert_same(c.run(fortran, (kp, vp)), want, "Fortran-order table")
    c.q = misaligned(c.q)
    assert not c.q.flags.aligned
    assert_same(c.run(table, (kp, vp)), want, "unaligned query")


@pytest.mark.parametrize("sinks", [False, True])
def test_no_sequence_or_no_row(sinks):
    """B = 0 gives empty results; caches with no row to hold a key (a
    table of no blocks, blocks of no rows) give every query out 0 and
    lse -inf, or its sink's logit, as the reference."""
    rng = np.random.default_rng(21)
    Hq, Hkv, d, dv = 4, 2, 8, 6
    kw = {"sinks": rng.standard_normal(Hq).astype(np.float32)} if sinks \
        else {}
    q0 = np.zeros((0, 2, Hq, d), np.float32)
    out, lse = ac.cache_attention(q0, np.zeros((0, 5, Hkv, d), np.float32),
                                  np.zeros((0, 5, Hkv, dv), np.float32),
                                  np.zeros(0, np.int64), return_lse=True,
                                  **kw)
    assert out.shape == (0, 2, Hq, dv) and lse.shape == (0, 2, Hq)
    q = rng.standard_normal((3, 2, Hq, d)).astype(np.float32)
    lens = np.zeros(3, np.int32)
    caches = [
        (np.zeros((4, 16, Hkv, d), np.float32),
         np.zeros((4, 16, Hkv, dv), np.float32), np.zeros((3, 0), np.int64)),
        (np.zeros((4, 0, Hkv, d), np.float32),
         np.zeros((4, 0, Hkv, dv), np.float32), np.zeros((3, 2), np.int64)),
        (np.zeros((3, 0, Hkv, d), np.float32),
         np.zeros((3, 0, Hkv, dv), np.float32), None),
    ]
    for kc, vc, table in caches:
        got = ac.cache_attention(q, kc, vc, lens, block_table=table,
                                 return_lse=True, **kw)
        want = ref.cache_attention(q, kc, vc, lens, block_table=table,
                                   return_lse=True, **kw)
        for g, w in zip(got, want):
            assert g.dtype == np.float32
            np.testing.assert_array_equal(g, w.astype(np.float32))
