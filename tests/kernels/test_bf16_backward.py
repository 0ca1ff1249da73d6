"""The backward on bf16 products: a streamed backward that may take bf16
products (a bfloat16 call, or a float32 one under
set_fp32_precision("bf16")) runs its five products on the unit chosen:
the dot products (csrc/simd/gemm_dp.inc: AVX512_BF16's vdpbf16ps, Arm's
BFDOT; by default where they beat the FMAs, AMD Zen 4 and later) or
AMX's tiles (csrc/simd/gemm_amx.inc: TDPBF16PS, where the CPU and the OS
give them), summing in float32, the gradients in float32 across blocks
and threads, rounded once.  (The NEON path's BFDOT runs under qemu in
tests/neon.)

* the product (the tests' hook _gemm), bit for bit against its model
  (attention_c.testing.dot_bf16 over K blocks of 256, times alpha, plus
  C when beta = 1): operands read by rows, by columns and by neither
  (strided both ways), sizes around the 12 x 32 tile and its pairs of k
  (1, 3, 17, 65 rows; 1, 31, 32, 33, 65 columns; K of 1, 17, 64, 300),
  rows of B that kmask leaves out (their NaN stays out), a NaN of A
  staying NaN; A, B or both given as bf16 bits (the backward's inputs as
  stored), the bits of the same values widened;
* the product on AMX's tiles (the hook's unit 2), whose order of sums is
  its own: within float32's rounding of the exact sum of the operands
  rounded to bf16, the same bits for every order of the operands in
  memory and for operands given as bf16 bits, kmask's rows left out;
* AMX's product with A split in two bf16 terms (ATT_DP_A_SPLIT, for dQ
  += dS K): within float32 summation's bound plus 2^-16 of the exact
  product on A unrounded, B rounded; refused for bf16 bits of A and for
  an A read neither by rows nor by columns;
* the backward, on each unit this CPU has (skipped where none): within
  BF16_TOL of float64 and beyond float32's rounding (the products did
  run on bf16), full, causal, window, dropout, softcap, ALiBi and sinks
  (their gradients too), grouped heads, packed sequences; one key of
  zeros: dvalues = the sum of grad_out rounded to bf16, exactly; bitwise
  for 1, 2 and 3 threads; inputs unchanged; a non-finite input, or
  another path (AVX2): the float32 products, bitwise the "ieee" call;
* bfloat16 inputs: the float32 call under "bf16" on the widened inputs,
  rounded once, bit for bit.

Tolerances: normwise against float64 with a floor of the inputs' scale,
BF16_TOL = 8e-3 (each rounded operand costs up to 2^-9 relative); the
product exact.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core, _core_tests
from attention_c import reference as ref
from attention_c.testing import (HALF_DTYPES, assert_all_identical,
                                 assert_rounded, dot_bf16, f64, rel_err)
from attention_c.testing import round_bf16 as bf16

pytestmark = pytest.mark.filterwarnings("error")

BF16_TOL = 8e-3
FLOAT32_ERR = 1e-5       # what float32 products stay within (testing.TOL)
# the path with the dot products: AVX-512's (AVX512_BF16) or NEON's (BF16)
DOT_PATH = next((p for p in ("avx512", "neon") if p in _core._simd_paths()),
                None)
HAS_DOT = "dot" in _core._bf16_units() and DOT_PATH is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="this CPU has no bf16 "
                               "dot products (AVX512_BF16, Arm's BF16)")
# the units of bf16 products this CPU has on that path (AMX: AVX-512's)
UNITS = [u for u in ("dot", "amx")
         if DOT_PATH is not None and u in _core._bf16_units()]
needs_amx = pytest.mark.skipif("amx" not in UNITS, reason="this CPU (or "
                               "its OS) gives no AMX tiles")


@pytest.fixture(params=UNITS or [None])
def unit(request, restore_settings):
    """Each unit of bf16 products this CPU has chosen in turn, on its
    path."""
    if request.param is None:
        pytest.skip("this CPU has no bf16 products (AVX512_BF16, AMX, "
                    "Arm's BF16)")
    _core._set_simd(DOT_PATH)
    _core._set_bf16_unit(request.param)
    return request.param


# -- the product ---------------------------------------------------------

def _model(a, b, alpha, beta, c, kmask=None):
    """_gemm's result: A and B rounded to bf16 (rows of B that kmask
    leaves out as 0), dot_bf16 over blocks of 256 of K from k = 0, each
    block times alpha and added to C in float32 (C itself first when
    beta = 1)."""
    a, b = bf16(a), bf16(b)
    if kmask is not None:
        b = np.where(kmask[:, None] != 0, b, np.float32(0))
    out = c.copy() if beta else np.zeros_like(c)
    for k0 in range(0, a.shape[1], 256):
        blk = dot_bf16(a[:, k0:k0 + 256], b[k0:k0 + 256].T.copy())
        x = np.float32(alpha) * blk
        out = x if (k0 == 0 and not beta) else out + x
    return out


def _operand(rng, rows, cols, order):
    """A rows x cols float32 view read by rows ("rows": contiguous along
    a row), by columns ("cols") or by neither ("strided"), with NaNs just
    past its rows and columns in memory, which a product must not read."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if order == "strided":
        big = np.full((2 * rows, 3 * cols), np.nan, np.float32)
        big[::2, ::3] = x
        return big[::2, ::3]
    big = np.full((rows + 1, cols + 1), np.nan, np.float32,
                  order="F" if order == "cols" else "C")
    big[:rows, :cols] = x
    return big[:rows, :cols]


# the product's cases: both operands' orders, sizes around the tile
ORDERS = ("rows", "cols", "strided")
gemm_cases = pytest.mark.parametrize(
    "M, N, K, a_order, b_order",
    [(M, N, K, a, b) for M, N, K in [(1, 1, 1), (3, 31, 17), (17, 32, 64),
                                     (65, 33, 300), (12, 65, 2)]
     for a in ORDERS for b in ORDERS])


@needs_dot
@gemm_cases
def test_gemm_bf16_is_its_model(M, N, K, a_order, b_order):
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    a = _operand(rng, M, K, a_order)
    b = _operand(rng, K, N, b_order)
    for alpha, beta in [(1.0, 0.0), (0.125, 1.0)]:
        c = rng.standard_normal((M, N)).astype(np.float32)
        want = _model(a, b, alpha, beta, c)
        a0, b0 = a.copy(), b.copy()
        _core_tests._gemm(a, b, c, alpha, beta, DOT_PATH, True)
        assert_all_identical([c], [want], f"{M}x{N}x{K} {alpha} {beta}")
        np.testing.assert_array_equal(a, a0)
        np.testing.assert_array_equal(b, b0)


@needs_dot
@pytest.mark.parametrize("b_order", ["rows", "cols", "strided"])
def test_gemm_bf16_kmask_and_nan(b_order):
    """Rows of B that kmask leaves out count as 0, a NaN there too; a NaN
    of A reaches its row of C (the rounding keeps it a NaN)."""
    rng = np.random.default_rng(5)
    M, N, K = 13, 40, 37
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = _operand(rng, K, N, b_order)
    kmask = (rng.random(K) > 0.3).astype(np.uint8)
    b[np.flatnonzero(kmask == 0)[0], 3] = np.nan
    c = np.zeros((M, N), np.float32)
    _core_tests._gemm(a, b, c, 1.0, 0.0, DOT_PATH, True, kmask)
    assert_all_identical([c], [_model(a, b, 1.0, 0.0, c, kmask)], "kmask")
    a[4, 7] = np.nan
    _core_tests._gemm(a, b, c, 1.0, 0.0, DOT_PATH, True, kmask)
    assert np.isnan(c[4]).all() and not np.isnan(np.delete(c, 4, 0)).any()


def _bits(x, order):
    """x rounded to bf16: its bits as a uint16 view read in `order` (as
    _operand's), and the same values in float32."""
    r = bf16(x)
    h = (np.ascontiguousarray(r).view(np.uint32) >> 16).astype(np.uint16)
    if order == "cols":
        h = np.asfortranarray(h)
    elif order == "strided":
        big = np.zeros((2 * h.shape[0], 3 * h.shape[1]), np.uint16)
        big[::2, ::3] = h
        h = big[::2, ::3]
    return h, r


@needs_dot
@gemm_cases
def test_gemm_bf16_takes_operands_as_stored(M, N, K, a_order, b_order):
    """An operand given as bf16 bits (uint16, any order: the backward's
    inputs as stored) gives the bits of the same operand widened to
    float32, A, B or both; kmask's rows of B left out all the same."""
    rng = np.random.default_rng(M * 999 + N * 7 + K)
    a16, a = _bits(_operand(rng, M, K, a_order), a_order)
    b16, b = _bits(_operand(rng, K, N, b_order), b_order)
    kmask = (rng.random(K) > 0.25).astype(np.uint8)
    for km in (None, kmask):
        c0 = rng.standard_normal((M, N)).astype(np.float32)
        want = c0.copy()
        _core_tests._gemm(a, b, want, 0.5, 1.0, DOT_PATH, True, km)
        for x, y in [(a16, b), (a, b16), (a16, b16)]:
            got = c0.copy()
            _core_tests._gemm(x, y, got, 0.5, 1.0, DOT_PATH, True, km)
            assert_all_identical([got], [want],
                                 f"{M}x{N}x{K} {x.dtype} {y.dtype} {km}")


@needs_amx
@gemm_cases
def test_gemm_amx_sums_bf16_products(M, N, K, a_order, b_order):
    """On AMX's tiles each element is within recursive summation's bound
    in float32 (K + 4 roundings of the sum of the magnitudes) of the
    exact alpha A B + beta C on A and B rounded to bf16, kmask's rows of B
    out; the same bits from row-major copies of the operands and from
    their bf16 bits; the operands unchanged."""
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    a = _operand(rng, M, K, a_order)
    b = _operand(rng, K, N, b_order)
    kmask = (rng.random(K) > 0.25).astype(np.uint8)
    a16, _ = _bits(a, a_order)
    b16, _ = _bits(b, b_order)
    for alpha, beta, km in [(1.0, 0.0, None), (0.125, 1.0, kmask)]:
        c0 = rng.standard_normal((M, N)).astype(np.float32)
        c = c0.copy()
        a0, b0 = a.copy(), b.copy()
        _core_tests._gemm(a, b, c, alpha, beta, "avx512", 2, km)
        np.testing.assert_array_equal(a, a0)
        np.testing.assert_array_equal(b, b0)
        bk = f64(bf16(b)) * (1 if km is None else km[:, None])
        exact = alpha * (f64(bf16(a)) @ bk) + beta * f64(c0)
        scale = (abs(alpha) * np.abs(f64(bf16(a))) @ np.abs(bk) +
                 abs(beta) * np.abs(f64(c0)))
        bound = (K + 4) * 2.0**-24 * scale
        assert np.all(np.abs(c - exact) <= bound), (M, N, K)
        for x, y in [(np.ascontiguousarray(a), np.ascontiguousarray(b)),
                     (a16, b), (a, b16), (a16, b16)]:
            got = c0.copy()
            _core_tests._gemm(x, y, got, alpha, beta, "avx512", 2, km)
            assert_all_identical([got], [c], f"{M}x{N}x{K} {x.dtype} "
                                 f"{y.dtype} {x.strides} {y.strides}")


@needs_amx
@pytest.mark.parametrize("a_order", ["rows", "cols"])
@pytest.mark.parametrize("M, N, K", [(1, 1, 1), (17, 32, 64), (65, 33, 300)])
def test_gemm_amx_split(M, N, K, a_order):
    """A split in two bf16 terms (dQ's dS on AMX): within float32's
    bound plus 2^-16 of the exact product on A unrounded, and closer to
    it than A rounded once; refused for A's bf16 bits and a strided A."""
    rng = np.random.default_rng(M + N + K)
    a = _operand(rng, M, K, a_order)
    b = _operand(rng, K, N, "rows")
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    got = c0.copy()
    _core_tests._gemm(a, b, got, 0.5, 1.0, "avx512", 2, None, True)
    once = c0.copy()
    _core_tests._gemm(a, b, once, 0.5, 1.0, "avx512", 2)
    exact = 0.5 * (f64(a) @ f64(bf16(b))) + f64(c0)
    scale = 0.5 * np.abs(f64(a)) @ np.abs(f64(bf16(b))) + np.abs(f64(c0))
    bound = ((K + 8) * 2.0**-24 + 2.0**-16) * scale
    assert np.all(np.abs(got - exact) <= bound), (M, N, K)
    if K > 1:           # rounded once, A costs up to 2^-9 of each term
        assert np.abs(once - exact).max() > np.abs(got - exact).max()
    a16, _ = _bits(a, a_order)
    for x in (a16, _operand(rng, M, K, "strided")):
        with pytest.raises(ValueError, match="split needs AMX"):
            _core_tests._gemm(x, b, got, 1.0, 0.0, "avx512", 2, None, True)


@needs_amx
@pytest.mark.parametrize("case", ["full", "causal"])
def test_amx_backward_splits_ds_for_dq(restore_settings, case):
    """On AMX the backward's dQ += dS K takes dS in two bf16 terms: from
    the exact out and lse, on bf16 inputs (so the scores' products are
    exact), dq is float32-accurate while dk and dv, whose products take P
    and dS rounded once, are not."""
    _core._set_simd("avx512")
    _core._set_bf16_unit("amx")
    rng = np.random.default_rng(1)
    q, k, v, g = (bf16(x) for x in _problem(rng, (4,), 256, 256, 64))
    grads, want = _backward(q, k, v, g, "bf16", **CASES[case])
    errs = [rel_err(x, w, floor=1.0) for x, w in zip(grads[:3], want[:3])]
    assert errs[0] < 1e-4 and min(errs[1:]) > 1e-4, errs


def test_gemm_hook_refuses_what_it_cannot_run():
    a = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="a .M, K., b .K, N."):
        _core_tests._gemm(a, a, np.ones((2, 3), np.float32), 1.0, 0.0,
                          "scalar")
    with pytest.raises(TypeError, match="a must be a 2-D float32"):
        _core_tests._gemm(a.astype(np.float64), a.T, a, 1.0, 0.0, "scalar")
    with pytest.raises(ValueError, match="bf16 dot products on scalar"):
        _core_tests._gemm(a, a.T.copy(), np.ones((2, 2), np.float32), 1.0,
                          0.0, "scalar", True)
    # bf16 bits only for the bf16 products
    with pytest.raises(TypeError, match="a must be a 2-D float32"):
        _core_tests._gemm(a.view(np.uint16)[:, :3], a.T.copy(),
                          np.ones((2, 2), np.float32), 1.0, 0.0, "scalar")


# -- the backward --------------------------------------------------------

CASES = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window": (20, 3)},
    "dropout": {"dropout": 0.2, "seed": 7},
    "softcap": {"softcap": 2.0, "causal": True},
    "alibi": {"alibi_slopes": np.float32([0.5, 0.125])},
    "sinks": {"sinks": np.float32([0.5, -1.0]), "causal": True},
}


def _problem(rng, lead, Tq, T, H, kv_lead=None):
    q = rng.standard_normal(lead + (Tq, H)).astype(np.float32)
    kl = lead if kv_lead is None else kv_lead
    k = rng.standard_normal(kl + (T, H)).astype(np.float32)
    v = rng.standard_normal(kl + (T, H)).astype(np.float32)
    g = rng.standard_normal(lead + (Tq, H)).astype(np.float32)
    return q, k, v, g


def _backward(q, k, v, g, precision, **kw):
    """The backward from the float64 reference's out and lse (as float32),
    under `precision`: only the backward's products differ."""
    out, lse = ref.dot_attention(f64(q), f64(k), values=f64(v),
                                 return_weights=False, **kw)
    out, lse = out.astype(np.float32), lse.astype(np.float32)
    with ac.set_fp32_precision(precision):
        grads = ac.dot_attention_backward(g, q, k, values=v, out=out,
                                          lse=lse, **kw)
    want = ref.dot_attention_backward(f64(g), f64(q), f64(k), values=f64(v),
                                      out=f64(out), lse=f64(lse), **kw)
    return grads, want


@pytest.mark.usefixtures("unit")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("Tq, T", [(1, 3), (17, 65), (300, 257)])
def test_backward_on_bf16_products(case, Tq, T):
    rng = np.random.default_rng(Tq + T)
    # bf16 values (a bfloat16 call's): the error is the products' alone
    # (float32 inputs rounded would move the scores, and the ALiBi slopes'
    # gradient, a sum of dS times distances that mostly cancels, by 3e-2)
    q, k, v, g = (bf16(x) for x in _problem(rng, (2,), Tq, T, 40))
    before = [x.copy() for x in (q, k, v, g)]
    grads, want = _backward(q, k, v, g, "bf16", **CASES[case])
    for x, b in zip((q, k, v, g), before):
        np.testing.assert_array_equal(x, b)
    errs = []
    for name, x, w in zip(("dq", "dk", "dv", "dbias", "dalibi", "dsinks"),
                          grads, want):
        if w is None:
            assert x is None, name
            continue
        err = rel_err(x, w, floor=1.0)
        assert err < BF16_TOL, f"{case} {name}: {err:.2e}"
        errs.append(err)
    if Tq > 1:                          # one query: few products to round
        assert max(errs) > FLOAT32_ERR, f"{case}: float32 products ran"


@pytest.mark.usefixtures("unit")
def test_backward_grouped_and_packed():
    """Grouped query heads (keys shared by 3 heads' queries, their
    gradients summed in float32) and packed sequences."""
    rng = np.random.default_rng(3)
    q, k, v, g = _problem(rng, (2, 6), 40, 50, 32, kv_lead=(2, 2))
    q = q.reshape(2, 2, 3, 40, 32)
    g = g.reshape(2, 2, 3, 40, 32)
    k, v = k[:, :, None], v[:, :, None]
    grads, want = _backward(q, k, v, g, "bf16")
    for x, w in zip(grads[:3], want[:3]):
        assert FLOAT32_ERR < rel_err(x, w, floor=1.0) < BF16_TOL
    cu = np.array([0, 30, 31, 90], np.int64)
    q, k, v, g = _problem(rng, (), 90, 90, 24)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    grads, want = _backward(q, k, v, g, "bf16", **kw)
    for x, w in zip(grads[:3], want[:3]):
        assert FLOAT32_ERR < rel_err(x, w, floor=1.0) < BF16_TOL


@pytest.mark.usefixtures("unit")
def test_one_key_gives_grad_out_rounded():
    """With one key of zeros every weight is exp(0 - 0) = 1: dvalues is
    the sum of the two queries' grad_out, rounded to bf16 and added in
    float32 (in either order, a sum of two from 0 is the same);
    "ieee" adds them unrounded."""
    rng = np.random.default_rng(11)
    q, k, v, g = _problem(rng, (3,), 2, 1, 48)
    k[:] = 0
    grads, _ = _backward(q, k, v, g, "bf16")
    want = bf16(g[:, 1]) + bf16(g[:, 0])
    np.testing.assert_array_equal(grads.values[:, 0], want)
    grads, _ = _backward(q, k, v, g, "ieee")
    np.testing.assert_array_equal(grads.values[:, 0], g[:, 0] + g[:, 1])


@pytest.mark.usefixtures("unit")
@pytest.mark.parametrize("case", ["full", "causal"])
def test_backward_threads_bitwise(case):
    rng = np.random.default_rng(2)
    q, k, v, g = _problem(rng, (3,), 300, 300, 64)
    got = []
    for threads in (1, 2, 3):
        ac.set_num_threads(threads)
        got.append(_backward(q, k, v, g, "bf16", **CASES[case])[0])
    assert_all_identical(got[1], got[0], "2 threads")
    assert_all_identical(got[2], got[0], "3 threads")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("what", ["nan", "inf", "avx2"])
def test_float32_products_where_bf16_cannot(what):
    """A NaN or an infinity among the inputs (the rounding would clamp an
    infinity), or a path without the dot products: the float32 products,
    bitwise the "ieee" call."""
    if what == "avx2" and "avx2" not in _core._simd_paths():
        pytest.skip("no AVX2 path here")
    if HAS_DOT:
        _core._set_bf16_unit("dot")
    _core._set_simd("avx2" if what == "avx2" else _core._simd_best())
    rng = np.random.default_rng(4)
    q, k, v, g = _problem(rng, (2,), 70, 80, 32)
    out, lse = ac.dot_attention(q, k, values=v, return_weights=False)
    if what != "avx2":
        k[1, 5, 3] = np.nan if what == "nan" else np.inf
    got = []
    for precision in ("bf16", "ieee"):
        with ac.set_fp32_precision(precision):
            got.append(ac.dot_attention_backward(g, q, k, values=v, out=out,
                                                 lse=lse))
    assert_all_identical(got[0], got[1], what)


@pytest.mark.usefixtures("unit")
@pytest.mark.skipif(len(HALF_DTYPES) < 2, reason="ml_dtypes is missing")
def test_bfloat16_backward_is_the_bf16_float32_call():
    """A bfloat16 backward (every floating input bfloat16; the lse float32,
    as the forward returns it) is the float32 call under "bf16" on the
    widened inputs, rounded once to bfloat16."""
    bf = HALF_DTYPES[1]
    rng = np.random.default_rng(6)
    q, k, v, g = (x.astype(bf) for x in _problem(rng, (2,), 65, 65, 40))
    out, lse = ac.dot_attention(q, k, values=v, causal=True,
                                return_weights=False)
    assert out.dtype == bf and lse.dtype == np.float32
    got = ac.dot_attention_backward(g, q, k, values=v, out=out, lse=lse,
                                    causal=True)
    assert all(x.dtype == bf for x in got[:3])
    wide = [x.astype(np.float32) for x in (g, q, k, v, out)]
    with ac.set_fp32_precision("bf16"):
        want = ac.dot_attention_backward(*wide[:3], values=wide[3],
                                         out=wide[4], lse=lse, causal=True)
    assert_rounded(got, want, bf, "bfloat16 backward")
