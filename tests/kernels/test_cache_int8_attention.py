"""int8 key/value caches (issue 34, step 2): ``cache_attention`` on
caches stored as int8 numbers with one float32 or float16 scale per
group of g consecutive elements of a row (``k_scales``, ``v_scales``:
the cache's first three axes + (d // g,)), and the append into them.

Oracles: ``cache_attention`` on the float32 caches the int8 ones stand
for (bitwise; made by the contract's formulas ``quantize_plain`` and
``dequantize_plain`` of cache_int8_cases.py), and the float64 reference
``attention_c.reference``'s ``cache_attention`` (which reads an int8
cache as scales * q in float64).  Proven here:

* cache_attention on int8 caches (keys, values, both; int8 keys with
  bfloat16 values; float32 and float16 scales; groups 8, 32 and d for d
  8, 32 and 128, and groups of 24 and 40; int8's -128 among the numbers;
  ragged batches, grouped heads, Tq 1 and 3, causal or not, window,
  softcap, ALiBi, sinks; 16-bit queries) gives bitwise what it gives on
  the float32 caches dequantize_kv makes, contiguous, paged (blocks of 1,
  5, 16 and 64; unowned blocks and rows past the keys with NaN scales)
  and strided, and agrees within ``TOL`` with the float64 reference;
* the accuracy of the int8 cache itself (issue 34's target), against the
  float64 reference on the unquantised Gaussian cache: normwise error of
  out within 1e-2 for g = 32, under 3e-2 for g = 64 and g = d (recorded
  as figures);
* the append into an int8 cache: slot by slot, q and scales are
  quantize_kv's (scales rounded to the scales' dtype), nothing else of
  the caches or scales changes, cache_seqlens is not changed;
* 1, 2 and 3 threads bitwise on a 5000-key cache; every SIMD path;
* bad input refused with an error naming the argument (non-finite new
  rows for an int8 cache: naming them or saying they are not finite),
  caches and scales left as they were, and without a warning.

Tolerances: ``testing.TOL[float32]`` (normwise relative error 1e-5)
against the float64 reference on the dequantized cache, with a noise
floor from the values' size: the checks of test_cache_attention.py
(``assert_matches``, ``assert_same`` of cache_attention_cases.py).

quantize_kv and dequantize_kv themselves: test_cache_int8.py.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import (HALF_DTYPES, assert_identical,
                                 record_figure, rel_err)

from cache_attention_cases import (KINDS, appended_slots, assert_matches,
                                   assert_same, variant_kwargs)
from cache_int8_cases import (BF16, F16, INPUT_DTYPES, dequantize_plain,
                              dtype_id, quantize_plain, tricky_rows)

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())
F32 = np.dtype(np.float32)
I8 = np.dtype(np.int8)


# --------------------------------------------------------------------------
# cache_attention on int8 caches

RAGGED = [0, 1, 17, 300]
# (B, Tq, Hq, Hkv, d, dv, cache_seqlens, Tn, g of the keys, g of the
# values): d 8, 32 and 128 with groups 8, 32 and d, and groups of 24 and
# 40 (a vector and a tail of 8 with 16 lanes); one sequence and a ragged
# batch; grouped and multi-head; with and without appended rows
SHAPES = [
    (1, 1, 1, 1, 8, 8, [7], 0, 8, 8),
    (1, 3, 8, 2, 32, 8, [17], 3, 32, 8),
    (4, 1, 8, 2, 32, 32, RAGGED, 0, 8, 32),
    (4, 3, 4, 4, 128, 32, RAGGED, 2, 128, 8),
    (4, 3, 8, 2, 128, 128, RAGGED, 0, 32, 128),
    (2, 1, 6, 3, 128, 8, [64, 129], 1, 8, 8),
    (3, 3, 4, 2, 48, 40, [5, 0, 33], 2, 24, 40),
]

# the caches' dtypes: (keys, values)
PAIRS = {"keys": (I8, F32), "values": (F32, I8), "both": (I8, I8)}
if BF16 is not None:
    PAIRS["keys_bf16_values"] = (I8, BF16)
    PAIRS["f16_keys_values"] = (F16, I8)


def shape_id(shape):
    B, Tq, Hq, Hkv, d, dv, lens, Tn, gk, gv = shape
    return f"B{B}-Tq{Tq}-H{Hq}/{Hkv}-d{d}/g{gk}-dv{dv}/g{gv}-Tn{Tn}"


class Case:
    """Queries and Gaussian float32 caches (B, S, Hkv, d|dv) (the
    unquantised ``xk``, ``xv``), stored int8 with their scales (of
    ``sdtype``) or in a float dtype; the scales of the rows past every
    sequence's keys (and its appended ones) are NaN: no query reads
    them.  New rows k, v (float32) or None."""

    def __init__(self, rng, shape, pair=(I8, I8), sdtype=np.float32,
                 slack=3):
        B, Tq, Hq, Hkv, d, dv, lens, Tn, gk, gv = shape
        self.B, self.Tq, self.Hq, self.Hkv, self.d, self.dv = (
            B, Tq, Hq, Hkv, d, dv)
        self.Tn, self.gk, self.gv = Tn, gk, gv
        self.sdtype = np.dtype(sdtype)
        self.seqlens = np.array(lens, np.int32)
        self.S = int(self.seqlens.max()) + Tn + slack
        self.q = rng.standard_normal((B, Tq, Hq, d)).astype(np.float32)
        self.xk = rng.standard_normal((B, self.S, Hkv, d)).astype(np.float32)
        self.xv = rng.standard_normal((B, self.S, Hkv, dv)).astype(
            np.float32)
        self.kc, self.ks = self.store(self.xk, pair[0], gk)
        self.vc, self.vs = self.store(self.xv, pair[1], gv)
        self.k = self.v = None
        if Tn:
            self.k = rng.standard_normal((B, Tn, Hkv, d)).astype(np.float32)
            self.v = rng.standard_normal((B, Tn, Hkv, dv)).astype(
                np.float32)

    def store(self, x, dtype, g, minus128=True):
        if dtype != I8:
            return x.astype(dtype), None
        q, s = quantize_plain(x, g)
        s = s.astype(self.sdtype)
        if minus128:   # int8's -128 (not quantize_kv's; a cache's may be)
            q.ravel()[::97] = -128
        for b, n in enumerate(self.lengths):
            s[b, n:] = np.nan
        return q, s

    @property
    def lengths(self):
        return self.seqlens.astype(np.int64) + self.Tn

    def arrays(self):
        return self.kc, self.vc, self.ks, self.vs

    def copies(self, arrays=None):
        return tuple(None if a is None else a.copy()
                     for a in (arrays or self.arrays()))

    def call(self, arrays, table=None, q=None, **kw):
        """cache_attention(..., return_lse=True), writing into arrays =
        (k_cache, v_cache, k_scales, v_scales)."""
        kc, vc, ks, vs = arrays
        return ac.cache_attention(self.q if q is None else q, kc, vc,
                                  self.seqlens, k=self.k, v=self.v,
                                  block_table=table, k_scales=ks,
                                  v_scales=vs, return_lse=True, **kw)

    def run(self, arrays=None, table=None, **kw):
        return self.call(self.copies(arrays), table, **kw)

    def twin(self, q=None, **kw):
        """(results, k_cache, v_cache): cache_attention on the float32
        caches the int8 ones stand for, the new rows those the append
        stands for (quantize, then dequantize)."""
        kc, vc = deq(self.kc, self.ks).copy(), deq(self.vc, self.vs).copy()
        k, v = self.k, self.v
        if self.Tn:
            if self.ks is not None:
                k = requant(k, self.gk, self.ks.dtype)
            if self.vs is not None:
                v = requant(v, self.gv, self.vs.dtype)
        out = ac.cache_attention(self.q if q is None else q, kc, vc,
                                 self.seqlens, k=k, v=v, return_lse=True,
                                 **kw)
        return out, kc, vc

    def want(self, **kw):
        """The float64 reference's (out, lse), on the int8 caches."""
        kc, vc, ks, vs = self.copies()
        return ref.cache_attention(self.q, kc, vc, self.seqlens, k=self.k,
                                   v=self.v, k_scales=ks, v_scales=vs,
                                   return_lse=True, **kw)

    def value_bound(self):
        vals = [np.nanmax(np.abs(deq(self.vc, self.vs).astype(
            np.float32)))]
        if self.v is not None:
            vals.append(np.abs(self.v).max())
        return float(max(vals))


def deq(c, s):
    """A cache as the float32 cache it stands for (a float cache as
    itself)."""
    return c if s is None else dequantize_plain(c, s)


def requant(x, g, sdtype):
    return dequantize_plain(*quantize_plain(x, g, sdtype))


def paged(c, rng, bs, unused="-1", table_dtype=np.int32, extra=3):
    """(k_cache, v_cache, k_scales, v_scales) in shuffled blocks of bs
    rows, and the block table: the blocks no sequence owns hold NaN
    (float), NaN scales and garbage q; the table's entries past the
    blocks a sequence uses are -1 or garbage."""
    mb = -(-c.S // bs)
    nb = c.B * mb + extra
    table = rng.permutation(nb)[:c.B * mb].reshape(c.B, mb)
    table = table.astype(table_dtype)
    pages = []
    for a in c.arrays():
        if a is None:
            pages.append(None)
            continue
        shape = (nb, bs) + a.shape[2:]
        if a.dtype == I8:
            p = rng.integers(-128, 128, shape).astype(np.int8)
        else:
            p = np.full(shape, np.nan, a.dtype)
        for b in range(c.B):
            for j in range(mb):
                rows = a[b, j * bs:(j + 1) * bs]
                p[table[b, j], :len(rows)] = rows
        pages.append(p)
    for b, n in enumerate(c.lengths):
        first = -(-int(n) // bs)
        if unused == "-1":
            table[b, first:] = -1
        else:
            info = np.iinfo(table_dtype)
            table[b, first:] = rng.integers(info.min, info.max, mb - first,
                                            table_dtype)
    return tuple(pages), table


def check_case(c, rng, kind, layouts, what):
    """The int8 call in each layout: the float32 twin's bits (and the
    appended caches hold what the twin's hold), the reference's results
    within TOL."""
    kw = variant_kwargs(kind, rng, c.B, c.Hq, np.float32)
    want_bits, tk, tv = c.twin(**kw)
    assert_matches(c, want_bits, c.want(**kw), np.float32, f"{what} twin")
    for layout in layouts:
        if layout == "contiguous":
            arrays, table = c.copies(), None
        else:
            arrays, table = paged(c, rng, layout)
        got = c.call(arrays, table, **kw)
        assert_same(got, want_bits, f"{what} {layout}")
        if layout == "contiguous" and c.Tn:
            kc, vc, ks, vs = arrays
            for b, n in enumerate(c.lengths):
                assert_identical(deq(kc, ks)[b, :n], tk[b, :n], "keys")
                assert_identical(deq(vc, vs)[b, :n], tv[b, :n], "values")


@pytest.mark.parametrize("sdtype", [np.float32, np.float16], ids=dtype_id)
@pytest.mark.parametrize("which", list(PAIRS))
def test_int8_equals_dequantized(which, sdtype):
    """Every shape, two variants each, contiguous and paged (blocks of
    16): the bits of the float32 caches dequantize_kv gives."""
    rng = np.random.default_rng([list(PAIRS).index(which),
                                 int(sdtype == F16)])
    for i, shape in enumerate(SHAPES):
        c = Case(rng, shape, PAIRS[which], sdtype)
        for kind in (KINDS[i % len(KINDS)], KINDS[(i + 5) % len(KINDS)]):
            check_case(c, rng, kind, ["contiguous", 16],
                       f"{which} {kind} {shape_id(shape)}")


@pytest.mark.parametrize("kind", KINDS)
def test_variants(kind):
    """Each variant on int8 keys and values, float16 scales for the
    values: contiguous and paged in blocks of 1, 5 and 64."""
    rng = np.random.default_rng(KINDS.index(kind) + 100)
    for shape in (SHAPES[1], SHAPES[3], SHAPES[4]):
        c = Case(rng, shape, (I8, I8), np.float32)
        c.vs = c.vs.astype(np.float16)
        check_case(c, rng, kind, ["contiguous", 1, 5, 64],
                   f"{kind} {shape_id(shape)}")


@pytest.mark.parametrize("qdtype", HALF_DTYPES, ids=dtype_id)
def test_half_queries(qdtype):
    """16-bit queries on int8 caches: the twin's bits (out in the query's
    dtype, the float32 call's rounded once; lse float32)."""
    rng = np.random.default_rng(21)
    for shape in (SHAPES[1], SHAPES[4]):
        c = Case(rng, shape, (I8, I8))
        q = c.q.astype(qdtype)
        kw = variant_kwargs("all", rng, c.B, c.Hq, np.float32)
        got = c.run(q=q, **kw)
        assert got[0].dtype == qdtype and got[1].dtype == np.float32
        assert_same(got, c.twin(q=q, **kw)[0], shape_id(shape))
        c.q = q.astype(np.float32)
        full = c.run(**kw)
        assert_identical(got[0], full[0].astype(qdtype), "rounded once")
        assert_identical(got[1], full[1], "lse")


@pytest.mark.parametrize("d", [64, 128])
def test_accuracy_unquantised(d):
    """The issue's target: on a Gaussian cache (d 64 and 128, ragged
    lengths up to 1000, grouped heads, Tq 1 and 3), out of the int8 cache
    (keys and values, float32 scales) against the float64 reference on
    the unquantised cache: normwise within 1e-2 for g = 32 and under
    3e-2 for g = 64 and g = d (recorded as figures).  Also the keys alone
    and the values alone with g = 32."""
    rng = np.random.default_rng(d)
    for Tq in (1, 3):
        shape = (3, Tq, 8, 2, d, d, [1, 300, 1000], 0, 32, 32)
        c = Case(rng, shape, (F32, F32))
        kw = variant_kwargs("plain", rng, c.B, c.Hq, np.float32)
        exact = ref.cache_attention(c.q, c.xk, c.xv, c.seqlens,
                                    return_lse=True, **kw)
        for g, limit in ((32, 1e-2), (64, 3e-2), (d, 3e-2)):
            for which in ("both", "keys", "values"):
                if which != "both" and g != 32:
                    continue
                pair = PAIRS[which]
                c.gk = c.gv = g
                c.kc, c.ks = c.store(c.xk, pair[0], g, minus128=False)
                c.vc, c.vs = c.store(c.xv, pair[1], g, minus128=False)
                out, lse = c.run(**kw)
                err = rel_err(out, exact[0])
                finite = np.isfinite(exact[1])         # -inf: sees nothing
                assert np.array_equal(lse[~finite], exact[1][~finite])
                lse_err = rel_err(lse[finite], exact[1][finite])
                record_figure(f"int8 cache ({which}) d {d} g {g} Tq {Tq}: "
                              f"out error vs unquantised", round(err, 5))
                assert err <= limit, (which, d, g, Tq, err)
                assert lse_err <= limit, (which, d, g, Tq, lse_err)
                assert err > 1e-5       # it is quantised


def test_strided_equals_contiguous():
    """int8 caches and scales that are slices of bigger buffers (every
    stride but the last axis's): the bits of the contiguous ones, and the
    append lands in the buffers, nowhere else."""
    rng = np.random.default_rng(22)
    for sdtype in (np.float32, np.float16):
        c = Case(rng, SHAPES[3], (I8, I8), sdtype)
        kw = variant_kwargs("all", rng, c.B, c.Hq, np.float32)
        want = c.run(**kw)
        kc, vc, ks, vs = c.copies()
        c.call((kc, vc, ks, vs), **kw)                  # appended
        bufs, views = [], []
        for a in c.arrays():
            B, S, H, w = a.shape
            buf = np.zeros((B + 1, S + 4, 2 * H, w + 3), a.dtype)
            buf[1:, 2:-2, ::2, 1:-2] = a
            bufs.append(buf)
            views.append(buf[1:, 2:-2, ::2, 1:-2])
        assert all(v.strides[-1] == v.itemsize for v in views)
        got = c.call(tuple(views), **kw)
        assert_same(got, want, dtype_id(sdtype))
        for v, a, name in zip(views, (kc, vc, ks, vs),
                              ("k_cache", "v_cache", "k_scales",
                               "v_scales")):
            assert_identical(np.ascontiguousarray(v), a, f"appended {name}")
        for buf in bufs:
            buf[1:, 2:-2, ::2, 1:-2] = 0
            assert not buf.astype(np.float32).any()


# --------------------------------------------------------------------------
# the append into an int8 cache

APPEND_PAIRS = [("both", (I8, I8), np.float32),
                ("both", (I8, I8), np.float16),
                ("values", (F32, I8), np.float16)]
if BF16 is not None:
    APPEND_PAIRS += [("keys_bf16_values", (I8, BF16), np.float32),
                     ("f16_keys_values", (F16, I8), np.float32)]


@pytest.mark.parametrize("layout", ["contiguous", 1, 16],
                         ids=lambda x: x if isinstance(x, str)
                         else f"paged{x}")
@pytest.mark.parametrize("which,pair,sdtype", APPEND_PAIRS,
                         ids=[f"{w}-{dtype_id(s)}"
                              for w, _, s in APPEND_PAIRS])
def test_append_in_place(layout, which, pair, sdtype):
    """Slot by slot: the slots of positions cache_seqlens[b] .. + Tn - 1
    hold quantize_kv(new row, g)'s q and scales (the scales rounded to
    their dtype; ties, zero groups and underflowing scales among the new
    rows), every other slot of the caches and the scales its old bits
    (NaN included); across block boundaries; cache_seqlens and the table
    unchanged; the results the twin's."""
    rng = np.random.default_rng(31)
    c = Case(rng, (3, 2, 4, 2, 32, 16, [15, 0, 30], 3, 8, 16), pair, sdtype)
    c.k = tricky_rows(rng, c.k.shape, 8)
    c.v = tricky_rows(rng, c.v.shape, 16)
    if layout == "contiguous":
        arrays, table, bs = c.copies(), None, None
    else:
        bs = layout
        arrays, table = paged(c, rng, bs, "garbage")
    before = c.copies(arrays)
    lens, tab = c.seqlens.copy(), None if table is None else table.copy()
    got = c.call(arrays, table)
    assert_identical(c.seqlens, lens, "cache_seqlens")
    if table is not None:
        assert_identical(table, tab, "block_table")
    changed = appended_slots(c.seqlens, c.Tn, table, bs)
    assert len(changed) == c.B * c.Tn
    kc, vc, ks, vs = arrays
    for cache, scales, old_c, old_s, new, g, name in (
            (kc, ks, before[0], before[2], c.k, c.gk, "k"),
            (vc, vs, before[1], before[3], c.v, c.gv, "v")):
        if scales is not None:
            wq, ws = quantize_plain(new, g, sdtype)
            aq, as_ = ac.quantize_kv(new, group=g, scale_dtype=sdtype)
            assert_identical(aq, wq, "quantize_kv")
            assert_identical(as_, ws, "quantize_kv")
        for slot in np.ndindex(cache.shape[:2]):
            if slot in changed:
                b, j = changed[slot]
                if scales is None:
                    assert_identical(cache[slot],
                                     new[b, j].astype(cache.dtype), name)
                    continue
                assert_identical(cache[slot], wq[b, j], f"{name} q {slot}")
                assert_identical(scales[slot], ws[b, j],
                                 f"{name} scales {slot}")
            else:
                assert cache[slot].tobytes() == old_c[slot].tobytes(), (
                    f"{name} cache slot {slot} changed")
                if scales is not None:
                    assert scales[slot].tobytes() == old_s[slot].tobytes(), (
                        f"{name} scales slot {slot} changed")
    assert_same(got, c.twin()[0], "the twin's results")


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=dtype_id)
def test_append_any_float_rows(dtype):
    """New rows of any float dtype: quantize_kv of them (16-bit widened,
    float64 rounded to float32 first)."""
    rng = np.random.default_rng(32)
    c = Case(rng, (2, 1, 4, 2, 16, 16, [3, 9], 2, 8, 16), (I8, I8))
    c.k, c.v = c.k.astype(dtype), c.v.astype(dtype)
    arrays = c.copies()
    c.call(arrays)
    kc, vc, ks, vs = arrays
    for cache, scales, new, g in ((kc, ks, c.k, 8), (vc, vs, c.v, 16)):
        wq, ws = quantize_plain(new, g)
        for b in range(c.B):
            t = slice(c.seqlens[b], c.seqlens[b] + c.Tn)
            assert_identical(cache[b, t], wq[b], dtype_id(dtype))
            assert_identical(scales[b, t], ws[b], dtype_id(dtype))


# --------------------------------------------------------------------------
# threads and SIMD paths

@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("which,sdtype", [("both", np.float32),
                                          ("keys_bf16_values", np.float16)]
                         if BF16 is not None else [("both", np.float32)],
                         ids=lambda x: x if isinstance(x, str)
                         else dtype_id(x))
def test_threads_bitwise(which, sdtype):
    """5000 cached keys (split across threads), g 32: 1, 2 and 3 threads
    give the same bits, paged or contiguous, the twin's, and the
    reference's results."""
    rng = np.random.default_rng(41)
    for Tq in (1, 3):
        c = Case(rng, (2, Tq, 8, 2, 64, 64, [5000, 4321], 2, 32, 32),
                 PAIRS[which], sdtype)
        kw = variant_kwargs("sinks", rng, c.B, c.Hq, np.float32)
        arrays, table = paged(c, rng, 16)
        ac.set_num_threads(1)
        one = c.run(**kw)
        assert_matches(c, one, c.want(**kw), np.float32, f"Tq {Tq}")
        for n in (1, 2, 3):
            ac.set_num_threads(n)
            assert_same(c.twin(**kw)[0], one, f"{n} threads, twin")
            assert_same(c.run(**kw), one, f"{n} threads")
            assert_same(c.run(arrays, table, **kw), one,
                        f"{n} threads, paged")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
def test_every_simd_path(simd):
    """Each path: the twin's bits on that path (contiguous and paged),
    the reference's results."""
    _core._set_simd(simd)
    rng = np.random.default_rng(42)
    for which in PAIRS:
        for sdtype in (np.float32, np.float16):
            for shape, kind in ((SHAPES[2], "all"), (SHAPES[4], "plain"),
                                (SHAPES[5], "alibi_h"),
                                (SHAPES[1], "sinks"),
                                (SHAPES[6], "window_both")):
                c = Case(rng, shape, PAIRS[which], sdtype)
                what = f"{simd} {which} {dtype_id(sdtype)} {shape_id(shape)}"
                check_case(c, rng, kind, ["contiguous", 16], what)


# --------------------------------------------------------------------------
# bad input: refused before anything is written

def bad_case(name):
    """(case, arrays, table, query, error, pattern)."""
    rng = np.random.default_rng(51)
    shape = (3, 2, 4, 2, 16, 16, [3, 16, 5], 2, 8, 8)
    c = Case(rng, shape, (I8, I8))
    kc, vc, ks, vs = c.copies()
    q = None
    if name == "k_int8_without_scales":
        return c, (kc, vc, None, vs), None, q, (TypeError, ValueError), \
            "k_scales"
    if name == "v_int8_without_scales":
        return c, (kc, vc, ks, None), None, q, (TypeError, ValueError), \
            "v_scales"
    if name == "k_scales_with_float_cache":
        return c, (deq(kc, ks), vc, ks, vs), None, q, (TypeError,
                                                       ValueError), "k_scales"
    if name == "v_scales_with_float_cache":
        return c, (kc, deq(vc, vs), ks, vs), None, q, (TypeError,
                                                       ValueError), "v_scales"
    if name == "k_scales_rows":
        return c, (kc, vc, ks[:, :-1], vs), None, q, ValueError, "k_scales"
    if name == "k_scales_batch":
        return c, (kc, vc, ks[:2], vs), None, q, ValueError, "k_scales"
    if name == "v_scales_heads":
        return c, (kc, vc, ks, vs[:, :, :1]), None, q, ValueError, \
            "v_scales"
    if name == "k_scales_three_axes":
        return c, (kc, vc, ks[..., 0], vs), None, q, ValueError, "k_scales"
    if name == "k_group_not_dividing":
        s = np.ones(ks.shape[:3] + (3,), np.float32)
        return c, (kc, vc, s, vs), None, q, ValueError, "k_scales"
    if name == "v_group_not_dividing":
        s = np.ones(vs.shape[:3] + (5,), np.float32)
        return c, (kc, vc, ks, s), None, q, ValueError, "v_scales"
    if name == "k_group_too_small":                 # g = 4
        s = np.ones(ks.shape[:3] + (4,), np.float32)
        return c, (kc, vc, s, vs), None, q, ValueError, "k_scales"
    if name == "k_scales_float64":
        return c, (kc, vc, ks.astype(np.float64), vs), None, q, (
            TypeError, ValueError), "k_scales"
    if name == "v_scales_int":
        return c, (kc, vc, ks, np.ones(vs.shape, np.int32)), None, q, (
            TypeError, ValueError), "v_scales"
    if name == "k_scales_last_axis_strided":
        s = np.repeat(ks, 2, axis=-1)[..., ::2]
        return c, (kc, vc, s, vs), None, q, ValueError, "k_scales"
    if name == "v_scales_last_axis_strided":
        s = np.repeat(vs, 2, axis=-1)[..., ::2]
        return c, (kc, vc, ks, s), None, q, ValueError, "v_scales"
    if name == "k_scales_paged_blocks":
        (pk, pv, pks, pvs), table = paged(c, rng, 16)
        return c, (pk, pv, pks[:-1], pvs), table, q, ValueError, "k_scales"
    if name == "float64_query":
        q = c.q.astype(np.float64)
        return c, (kc, vc, ks, vs), None, q, TypeError, "query"
    if name == "k_nonfinite_new_row":
        c.k[2, 1, 1, 5] = np.nan
        return c, (kc, vc, ks, vs), None, q, ValueError, r"\bk\b|finite"
    if name == "v_infinite_new_row":
        c.v[0, 0, 0, 0] = np.inf
        return c, (kc, vc, ks, vs), None, q, ValueError, r"\bv\b|finite"
    if name == "v_new_row_beyond_float16_scales":
        c = Case(rng, shape, (I8, I8), np.float16)
        c.v[1, 0, 1, 3] = 1e7
        return c, c.copies(), None, q, ValueError, r"\bv\b.*float16"
    if name == "v_cache_read_only":     # k and its scales are checked first
        vc.flags.writeable = False
        return c, (kc, vc, ks, vs), None, q, ValueError, "v_cache"
    if name == "v_scales_read_only":
        vs.flags.writeable = False
        return c, (kc, vc, ks, vs), None, q, ValueError, "v_scales"
    if name == "k_new_row_beyond_float32":      # float64, inf as float32
        c.k = c.k.astype(np.float64)
        c.k[1, 1, 0, 0] = 1e39
        return c, (kc, vc, ks, vs), None, q, ValueError, r"\bk\b|finite"
    raise AssertionError(name)


BAD = ["k_int8_without_scales", "v_int8_without_scales",
       "k_scales_with_float_cache", "v_scales_with_float_cache",
       "k_scales_rows", "k_scales_batch", "v_scales_heads",
       "k_scales_three_axes", "k_group_not_dividing",
       "v_group_not_dividing", "k_group_too_small", "k_scales_float64",
       "v_scales_int", "k_scales_last_axis_strided",
       "v_scales_last_axis_strided", "k_scales_paged_blocks",
       "float64_query", "k_nonfinite_new_row", "v_infinite_new_row",
       "v_new_row_beyond_float16_scales", "v_cache_read_only",
       "v_scales_read_only", "k_new_row_beyond_float32"]


@pytest.mark.parametrize("name", BAD)
def test_refused(name):
    """Each bad argument raises an error naming it; the caches and the
    scales keep their bits (appended rows pending: nothing is written
    before every check passes)."""
    c, arrays, table, q, error, pattern = bad_case(name)
    before = [None if a is None else a.copy() for a in arrays]
    with pytest.raises(error, match=pattern):
        c.call(arrays, table, q=q)
    for a, b, what in zip(arrays, before, ("k_cache", "v_cache",
                                           "k_scales", "v_scales")):
        if a is not None:
            assert a.tobytes() == b.tobytes(), f"{what} written"
