"""Attention against a key-value cache (issue 34): ``cache_attention``,
FlashAttention-2's ``flash_attn_with_kvcache`` layouts, contiguous caches
(B, S_max, Hkv, d) and paged ones (num_blocks, block_size, Hkv, d) read
through a block table, with the new keys and values appended in place.
Its results here; the append and the refused arguments in
test_cache_attention_writes.py; the cases in cache_attention_cases.py.

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
* a query that sees no key: out 0 and lse -inf, or the sink's logit;
* NaN and infinity in cache rows no query sees reach nothing; a NaN in
  a key reaches exactly the queries (and heads) that see it;
* 16-bit queries: the float32 call's results rounded once (lse float32);
  float32 and 16-bit queries on float64 caches;
* every SIMD path; 1, 2 and 3 threads bitwise on a cache long enough to
  be split.

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

from cache_attention_cases import (BF16, Case, KINDS, SHAPES,
                                   assert_matches, assert_same,
                                   cache_dtypes_id, computing, half_pairs,
                                   shape_id, variant_kwargs)

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())

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
