"""The streamed forward's fused kernel (csrc/simd/flash.inc): the softmax
inside the products, the scores in log2 units, the running max raised
only when a score passes it by 2^8.  It runs for a dot or general score
whose visibility is a range of keys per query (full, causal, window,
packed sequences, sinks; a padding mask too, tests/kernels/
test_padding.py), no other mask, no bias, softcap or ALiBi (dropout in
float32 alone), and
finite inputs, and under float products not at most half its panel of
queries against two panels of keys or more; every case below is one of
those, so the kernel computes it on the SIMD paths (the scalar path runs
the general one).

* sizes that cross its panels of queries (16, 24 or 64 lanes by path),
  its tiles of keys (3 to 8) and blocks of keys (48), against the float64
  reference;
* scores that climb along the keys, so the running max is raised on
  almost every tile, and scores spread over more than the float range of
  exp (weights flushed to exactly 0), against the reference;
* queries that see no key (an empty key segment): out 0, lse -inf;
* a panel whose keys lie more than 2^22 apart (masked one lane at a
  time: float32 does not hold their offsets exactly);
* every SIMD path against the reference; bitwise identical results for
  1, 2 and 3 threads;
* dropout inside it (float32): against the reference with the same keep
  bits, the keep pattern read back bit for bit, threads bitwise.

Tolerance: ``testing.TOL`` normwise (1e-5 float32, 1e-12 float64),
against the float64 reference on the same (cast) values.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import (DTYPES, TOL, assert_all_identical, f64,
                                 rel_err)

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())
dtype_param = pytest.mark.parametrize("dtype", DTYPES,
                                      ids=lambda d: np.dtype(d).name)

# (Tq, T): panels of 16, 24 and 64 queries and one more or less (65: a
# panel of one query), blocks of 48 keys and one more or less, a key
# count that is no multiple of a tile
SIZES = [(9, 1), (17, 3), (63, 47), (65, 49), (64, 48), (130, 97),
         (257, 300)]
VARIANTS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window": (13, 5)},
    "sinks": {"causal": True, "sinks": "yes"},
}


def _inputs(rng, dtype, lead, Tq, T, H=8, Hv=5):
    q = rng.standard_normal(lead + (Tq, H))
    k = rng.standard_normal(lead[:-1] + (1,) + (T, H)) if len(lead) > 1 \
        else rng.standard_normal(lead + (T, H))
    v = rng.standard_normal(k.shape[:-1] + (Hv,))
    return [x.astype(dtype) for x in (q, k, v)]


def _run(fn, q, k, v, kw):
    kw = dict(kw)
    if kw.get("sinks") == "yes":
        kw["sinks"] = np.linspace(-1, 2, q.shape[-3]).astype(q.dtype)
    return fn(q, k, values=v, return_weights=False, **kw)


def _check(q, k, v, kw, dtype, what):
    out, lse = _run(ac.dot_attention, q, k, v, kw)
    want_out, want_lse = _run(ref.dot_attention, f64(q), f64(k), f64(v), kw)
    tol = TOL[dtype]
    assert rel_err(out, want_out, floor=1.0) < tol, f"{what}: out"
    seen = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), seen), f"{what}: lse -inf"
    assert rel_err(lse[seen], want_lse[seen], floor=1.0) < tol, \
        f"{what}: lse"


@dtype_param
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sizes_match_reference(size, variant, dtype):
    """Grouped heads (4 query heads on one key head) over every size."""
    Tq, T = size
    q, k, v = _inputs(np.random.default_rng(Tq * 1000 + T), dtype, (2, 4),
                      Tq, T)
    _check(q, k, v, VARIANTS[variant], dtype, f"{variant} {size}")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@dtype_param
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("Tq", [9, 12, 16, 17, 32, 33])
def test_few_queries_many_keys(Tq, variant, dtype, simd):
    """At most half a panel of queries against two panels of keys or
    more (here 300) run the general path under float products, more the
    kernel (the rule's edges on each path: 12 and 16 on AVX2, 32 and 33
    on AVX-512); either way the reference's results, on every path."""
    _core._set_simd(simd)
    q, k, v = _inputs(np.random.default_rng(Tq), dtype, (2, 4), Tq, 300)
    _check(q, k, v, VARIANTS[variant], dtype, f"{simd} {variant} {Tq}x300")


@dtype_param
@pytest.mark.parametrize("causal", [False, True])
def test_climbing_scores_raise_the_max(causal, dtype):
    """Score s_it = c t (1 + noise): every key passes the running max, by
    more than 2^8 after a few tiles (c = 1.5 per key in natural units),
    so nearly every tile raises it; then a spread of 400 over the keys,
    past exp's range in float32 (the far keys' weights are 0)."""
    rng = np.random.default_rng(3)
    Tq, T, H = 70, 150, 4
    for step in (1.5, 400.0 / T):
        q = np.ones((1, Tq, H)) + 0.01 * rng.standard_normal((1, Tq, H))
        k = (np.arange(T)[:, None] * step / H * np.sqrt(H)
             * np.ones((1, T, H))) + 0.01 * rng.standard_normal((1, T, H))
        v = rng.standard_normal((1, T, 3))
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        _check(q, k, v, {"causal": causal}, dtype, f"step {step}")
        # and falling: the max of the first tile holds to the end
        _check(q, k[:, ::-1].copy(), v, {"causal": causal}, dtype,
               f"step -{step}")


@dtype_param
def test_query_seeing_nothing(dtype):
    """Packed sequences whose second has no keys: its queries get out 0
    and lse -inf; the others are unchanged."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 40, 8)).astype(dtype)
    k = rng.standard_normal((2, 30, 8)).astype(dtype)
    v = rng.standard_normal((2, 30, 6)).astype(dtype)
    cu_q = np.array([0, 25, 40], dtype=np.int32)
    cu_k = np.array([0, 30, 30], dtype=np.int32)
    kw = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "causal": True}
    out, lse = _run(ac.dot_attention, q, k, v, kw)
    assert np.all(out[:, 25:] == 0) and np.all(lse[:, 25:] == -np.inf)
    _check(q, k, v, kw, dtype, "segments")


def test_key_offsets_past_float_precision():
    """A panel of queries whose keys lie more than 2^22 apart (two packed
    sequences of 9 queries, past decoding's 8, the first with 2^22 + 7
    keys): float32 does not hold the keys' offsets exactly there, so the
    kernel masks its tiles one lane at a time, not by its lane-wise
    compares.  Against the reference, one query at a time (its (Tq, T)
    scores would take 300 MB)."""
    rng = np.random.default_rng(6)
    T0, n = 2**22 + 7, 9
    q = rng.standard_normal((1, 2 * n, 2)).astype(np.float32)
    k = rng.standard_normal((1, T0 + 5, 2)).astype(np.float32)
    v = rng.standard_normal((1, T0 + 5, 3)).astype(np.float32)
    out, lse = ac.dot_attention(
        q, k, values=v, return_weights=False,
        cu_seqlens_q=np.array([0, n, 2 * n], dtype=np.int32),
        cu_seqlens_k=np.array([0, T0, T0 + 5], dtype=np.int32))
    for i in range(2 * n):
        keys = slice(0, T0) if i < n else slice(T0, T0 + 5)
        want, want_lse = ref.dot_attention(
            f64(q[:, i:i + 1]), f64(k[:, keys]), values=f64(v[:, keys]),
            return_weights=False)
        assert rel_err(out[:, i:i + 1], want, floor=1.0) < TOL[np.float32]
        assert rel_err(lse[:, i], want_lse[:, 0], floor=1.0) \
            < TOL[np.float32]


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@dtype_param
@pytest.mark.parametrize("H", [64, 17])
def test_nonfinite_value_row_found_in_its_group(H, dtype, simd):
    """The kernel runs on finite inputs alone; the scan that decides it
    reads contiguous rows in groups of 1024 elements (16 rows of 64, 60
    of 17), a row at a time only in a group that holds a NaN or an
    infinity.  A value row r that holds one, at a group's edges and in
    the last, partial group: causal, the queries before r (some in r's
    panel, where the kernel would give them 0 x NaN) keep the results
    of finite values to rounding, the others do not get a finite
    value there, lse finite throughout."""
    _core._set_simd(simd)
    T = 130
    q, k, v = _inputs(np.random.default_rng(H), dtype, (2,), T, T, H=H,
                      Hv=H)
    clean = _run(ac.dot_attention, q, k, v, {"causal": True})
    group, tol = 1024 // H, TOL[dtype]
    for r in sorted({0, group - 1, group, group + 1, 2 * group, T - 1}):
        for bad in (np.nan, np.inf):
            vb = v.copy()
            vb[1, r, H // 2] = bad
            out, lse = _run(ac.dot_attention, q, k, vb, {"causal": True})
            what = f"{simd} H={H}: {bad} in value row {r}"
            # (the call runs the general path now: the same to rounding)
            assert rel_err(out[0], clean[0][0], floor=1.0) < tol, what
            assert rel_err(out[1, :r], clean[0][1, :r], floor=1.0) < tol, \
                what
            assert not np.isfinite(out[1, r:, H // 2]).any(), what
            assert rel_err(lse, clean[1], floor=1.0) < tol, what


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@dtype_param
def test_simd_paths_match_reference(simd, dtype):
    _core._set_simd(simd)
    for n, (Tq, T) in enumerate([(65, 49), (130, 97)]):
        q, k, v = _inputs(np.random.default_rng(n), dtype, (3,), Tq, T,
                          H=17, Hv=9)
        for name, kw in VARIANTS.items():
            _check(q, k, v, kw, dtype, f"{simd} {name} {Tq}x{T}")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
def test_wide_heads_in_long_tasks(simd):
    """Full and causal rows with enough tasks for FQB (512) queries each
    (causal ones handed out costliest first): the scratch holds the
    kernel's state of that many queries with wide heads (d = dv = 320),
    on every path, in float32 and bf16 products."""
    _core._set_simd(simd)
    q, k, v = _inputs(np.random.default_rng(10), np.float32, (4,), 600,
                      600, H=320, Hv=320)
    for threads, kw in [(1, {}), (2, {}), (2, {"causal": True})]:
        ac.set_num_threads(threads)
        what = f"{simd}, {threads} threads, {kw}"
        _check(q, k, v, kw, np.float32, what)
        ac.set_fp32_precision("bf16")
        out = _run(ac.dot_attention, q, k, v, kw)[0]
        ac.set_fp32_precision("ieee")
        want = _run(ref.dot_attention, f64(q), f64(k), f64(v), kw)[0]
        assert rel_err(out, want, floor=1.0) < 2e-2, f"{what}: bf16"


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("variant", ["full", "causal"])
def test_threads_bitwise_identical(variant):
    """Enough work for 3 threads (2**22 multiply-adds each)."""
    q, k, v = _inputs(np.random.default_rng(9), np.float32, (2, 4), 600,
                      600, H=32, Hv=32)
    ac.set_num_threads(1)
    one = _run(ac.dot_attention, q, k, v, VARIANTS[variant])
    for n in (2, 3):
        ac.set_num_threads(n)
        assert_all_identical(_run(ac.dot_attention, q, k, v,
                                  VARIANTS[variant]), one, f"{n} threads")


# --------------------------------------------------------------------------
# Dropout inside the kernel (float32: float64 and the bf16 products run
# the general path with it)

DROP_SIZES = [(1, 7), (3, 5), (17, 65), (65, 49), (130, 97), (257, 300)]


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dropout_inside_matches_reference(simd, variant):
    """The weights P.V reads carry the keep bits (each lane a query:
    simd/dropout.inc's philox_lanes), the row sums and lse do not: against
    the float64 reference with the same bits, sizes across panels, tiles,
    blocks and groups of 4 keys, a seed with both halves set."""
    _core._set_simd(simd)
    rng = np.random.default_rng(21)
    for Tq, T in DROP_SIZES:
        q, k, v = _inputs(rng, np.float32, (2,), Tq, T)
        kw = dict(VARIANTS[variant], dropout=0.3, seed=2**40 + 5)
        _check(q, k, v, kw, np.float32, f"{simd} {variant} {Tq}x{T}")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("Tq, T", [(65, 259), (300, 7)])
def test_dropout_inside_keep_bits(simd, Tq, T):
    """The keep pattern read back (query 0: every weight 1 / T, values the
    identity, so out_it = keep_it / (T (1 - p))) is reference.dropout_keep
    bit for bit at every flat batch index."""
    _core._set_simd(simd)
    lead, p, seed = (2, 3), 0.5, 2**33 + 7
    q = np.zeros(lead + (Tq, 4), np.float32)
    k = np.random.default_rng(0).standard_normal(lead + (T, 4))
    v = np.broadcast_to(np.eye(T, dtype=np.float32), lead + (T, T))
    out, _ = ac.dot_attention(q, k.astype(np.float32), values=v, dropout=p,
                              seed=seed, return_weights=False)
    kept = out != 0
    assert np.all(out[kept] == out[kept].flat[0])
    b = np.arange(int(np.prod(lead))).reshape(lead)
    assert np.array_equal(kept, ref.dropout_keep(seed, p, b, Tq, T))


@pytest.mark.usefixtures("restore_settings")
def test_dropout_inside_threads_bitwise_identical():
    q, k, v = _inputs(np.random.default_rng(10), np.float32, (2, 4), 600,
                      600, H=32, Hv=32)
    kw = {"causal": True, "dropout": 0.2, "seed": 11}
    ac.set_num_threads(1)
    one = _run(ac.dot_attention, q, k, v, kw)
    for n in (2, 3):
        ac.set_num_threads(n)
        assert_all_identical(_run(ac.dot_attention, q, k, v, kw), one,
                             f"{n} threads")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS[1:])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dropout_inside_16_bit_is_the_widened_call(simd, dtype):
    """16-bit inputs with dropout, on the float products (bfloat16 too
    where the bf16 products would run without dropout: they take none),
    widened as the kernel loads them: the bits of the float32 call on the
    widened arrays, rounded once."""
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(np.float16)
    _core._set_simd(simd)
    ac.set_fp32_precision("ieee")
    q, k, v = _inputs(np.random.default_rng(23), np.float32, (2,), 130, 97)
    q, k, v = (x.astype(dt) for x in (q, k, v))
    kw = {"causal": True, "dropout": 0.25, "seed": 5}
    out, lse = _run(ac.dot_attention, q, k, v, kw)
    want, want_lse = _run(ac.dot_attention, *(x.astype(np.float32)
                                              for x in (q, k, v)), kw)
    assert out.dtype == dt
    assert np.array_equal(out, want.astype(dt))
    assert np.array_equal(lse, want_lse)
