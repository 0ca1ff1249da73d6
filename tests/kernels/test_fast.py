"""The fast layer's numerics: SIMD paths, saved activations, vector
tanh.

What these tests prove:

1. Every SIMD path this CPU runs (``_core._simd_best()`` and below) gives
   the scalar path's results for ``context_attention`` and its backward
   (normwise within CROSS_TOL, ~100-200 eps), on sizes that straddle the
   micro-tiles (AVX-512: MR = 12 rows x NR = 32 float32 / 16 float64
   columns; AVX2: 6 x 16 / 8; row blocks MC = 10 MR), with and without
   bias, every mask kind (fully masked rows included) and with or without
   ``grad_alpha``; and each path agrees with ``attention_c.reference``
   within ``testing.TOL`` (ill-conditioned gradients: see ILL_FACTOR).
2. ``keep_activations=True`` returns tanh(W_h h_t + W_c c + b), exactly 0
   for masked items, with the shape (..., T, A) and the computing dtype,
   and changes no other output; the backward given ``activations=`` equals
   the one that recomputes them, never reads the masked items' rows, and
   rejects a wrong shape with a ValueError naming ``activations``.
3. The vector tanh of each path (``_core_tests._tanh``: the tests'
   extension) is within 3 ulp of the correctly rounded float32 value over
   sweeps of the whole float32 range (with exhaustive windows where it is
   hardest), within 5 ulp in float64, and exact at +-0 (sign kept),
   +-inf (+-1), NaN and subnormals.

Each test restores the SIMD path and the thread count it found.  The
runtime (SIMD selection, configuration, threads, fork, torch, memory) is
in test_fast_runtime.py; the shared cases in fast_cases.py.
"""

import itertools

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core, _core_tests
from attention_c import reference as ref
from attention_c.testing import (ILL_FACTOR, MASK_KINDS, Problem, TOL,
                                 assert_identical, f64, rel_err)

from fast_cases import (UNSUPPORTED, assert_rel, dtype_param, path_param,
                        simd_param, size_id)

# Normwise relative difference allowed between a SIMD path and the scalar
# path (same inputs, same alpha for the backward).  Observed on the sizes
# below: at most 7.5e-15 (float64) and 3.1e-6 (float32, db: sums over
# T with cancellation), except dv of the ill-conditioned A = 1 case
# (2.8e-14 and 1.15e-5, see ILL_FACTOR).
CROSS_TOL = {np.float64: 5e-14, np.float32: 1e-5}

# Ill-conditioned gradients: the bounds of the backward are raised to
# ILL_FACTOR (attention_c.testing) times the error of NumPy evaluating the
# reference in the dtype.  (Worst seen: the scalar path, 1.9x NumPy's
# error on dv.)

# Backward with activations= against the backward that recomputes them.
ACT_TOL = {np.float64: 1e-12, np.float32: 1e-5}

# tanh accuracy in ulps.  Measured over every positive float32 (2.1e9
# values): scalar (libm) <= 2, avx2 <= 2, avx512 <= 3 (its quotient is
# rcp14's, corrected once by the residual).  float64, 4e7 random values:
# scalar <= 2, avx2 <= 3, avx512 <= 4 ulp (relative 5.7e-16).
TANH_ULP_F32 = 3
TANH_ULP_F64 = 5
TANH_REL_F64 = 8e-16


# every test leaves the SIMD path and the thread count as it found them
pytestmark = pytest.mark.usefixtures("restore_settings")


def assert_masked_zero(x, mask, what):
    """Rows (or entries) of masked items are exactly +0 or -0."""
    if mask is not None:
        assert np.all(x[~mask] == 0), f"{what}: masked items are not 0"


def forward(path, x, keep=False):
    """context_attention of the cast problem x on the given path."""
    _core._set_simd(path)
    return ac.context_attention(x["h"], x["W"], x["v"], b=x["b"],
                                mask=x["mask"],
                                keep_activations=keep)


def backward(path, x, alpha, ga=None, act=None):
    """context_attention_backward of the cast problem x on the path."""
    _core._set_simd(path)
    return ac.context_attention_backward(
        x["grad_out"], x["h"], x["W"], x["v"], alpha, b=x["b"],
        mask=x["mask"], grad_alpha=ga, activations=act)


def reference_activations(x):
    """tanh(z) in float64 from the reference's own steps; 0 when masked."""
    h, mask = f64(x["h"]), x["mask"]
    c = ref.mean_context(h, mask=mask)
    u = np.tanh(ref._preactivation(h, c, f64(x["W"]), f64(x["b"])))
    return u if mask is None else np.where(mask[..., None], u, 0)


# --------------------------------------------------------------------------
# 1. Every SIMD path == the scalar path (and the reference)

# (lead, T, H, A): T straddles MR (6, 12) and MC (60, 120); H and A
# straddle NR (8, 16, 32) and its multiples; B runs through 1 .. 9.
CROSS_SIZES = [
    ((1,), 1, 1, 1),
    ((2,), 3, 17, 31),
    ((3,), 17, 33, 65),
    ((5,), 31, 65, 17),
    ((7,), 33, 3, 130),
    ((9,), 65, 121, 33),
    ((4,), 121, 31, 121),
    ((2,), 130, 130, 3),
    ((8,), 13, 1, 65),
    ((6,), 61, 130, 1),
    ((1,), 250, 20, 40),          # several row blocks in one sequence
    ((3,), 2, 65, 130),
]
cross_size_param = pytest.mark.parametrize("size", CROSS_SIZES, ids=size_id)
FWD_CASES = list(itertools.product([True, False], MASK_KINDS))
BWD_CASES = list(itertools.product([True, False], MASK_KINDS, [False, True]))


def _problem(size, dtype, bias, mask_kind, seed=0):
    """A Problem of one of the listed sizes cast to dtype, seeded by its
    parameters (so each case is reproducible on its own)."""
    sizes = CROSS_SIZES + ACT_SIZES
    seed = [seed, sizes.index(size), int(bias), MASK_KINDS.index(mask_kind)]
    p = Problem(np.random.default_rng(seed), *size, bias=bias,
                mask=mask_kind)
    return p.cast(dtype)


@cross_size_param
@dtype_param
@simd_param
def test_forward_simd_equals_scalar(path, dtype, size):
    """out and alpha of the SIMD path == the scalar path (CROSS_TOL) and
    the reference (TOL), with/without bias, every mask kind; masked items
    and fully masked rows give exactly 0 on both paths."""
    for bias, mask_kind in FWD_CASES:
        x = _problem(size, dtype, bias, mask_kind)
        what = f"{path} bias={bias} mask={mask_kind}"
        out_s, alpha_s = forward("scalar", x)
        out, alpha = forward(path, x)
        w_out, w_alpha = ref.context_attention(
            f64(x["h"]), f64(x["W"]), f64(x["v"]), b=f64(x["b"]),
            mask=x["mask"])
        tol = TOL[np.dtype(dtype).type]
        for name, got, scal, want in [("out", out, out_s, w_out),
                                      ("alpha", alpha, alpha_s, w_alpha)]:
            assert got.dtype == np.dtype(dtype), (what, name, got.dtype)
            assert_rel(got, scal, CROSS_TOL[np.dtype(dtype).type],
                       f"{what} {name} vs scalar")
            assert_rel(got, want, tol, f"{what} {name} vs reference")
            assert_rel(scal, want, tol, f"scalar {name} vs reference")
        for a in (alpha, alpha_s):
            assert_masked_zero(a, x["mask"], what + " alpha")
        if x["mask"] is not None:
            dead = ~x["mask"].any(axis=-1)
            assert np.all(out[dead] == 0) and np.all(alpha[dead] == 0), what


@cross_size_param
@dtype_param
@simd_param
def test_backward_simd_equals_scalar(path, dtype, size):
    """dh, dW, dv, db of the SIMD path == the scalar path (same alpha;
    CROSS_TOL) and the reference (TOL), with/without bias and grad_alpha,
    every mask kind; masked items get exactly zero dh on both paths."""
    for bias, mask_kind, with_ga in BWD_CASES:
        x = _problem(size, dtype, bias, mask_kind, seed=1)
        ga = x["grad_alpha"] if with_ga else None
        what = f"{path} bias={bias} mask={mask_kind} grad_alpha={with_ga}"
        _, alpha = forward("scalar", x)
        g_s = backward("scalar", x, alpha, ga)
        g = backward(path, x, alpha, ga)
        want = ref.context_attention_backward(
            f64(x["grad_out"]), f64(x["h"]), f64(x["W"]), f64(x["v"]),
            f64(alpha), b=f64(x["b"]), mask=x["mask"], grad_alpha=f64(ga))
        same = None
        for i, (name, got, scal, w) in enumerate(zip("hWvb", g, g_s, want)):
            if w is None:
                assert got is None and scal is None, (what, "db")
                continue
            assert got.dtype == np.dtype(dtype), (what, name, got.dtype)
            assert got.shape == w.shape, (what, name, got.shape)
            cross, tol = CROSS_TOL[dtype], TOL[dtype]
            if (rel_err(got, scal) > cross or rel_err(got, w) > tol
                    or rel_err(scal, w) > tol):
                # ill-conditioned?  Compare with NumPy in this dtype.
                if same is None:
                    same = ref.context_attention_backward(
                        x["grad_out"], x["h"], x["W"], x["v"], alpha,
                        b=x["b"], mask=x["mask"], grad_alpha=ga)
                ill = ILL_FACTOR * rel_err(same[i], w)
                cross, tol = max(cross, ill), max(tol, ill)
            assert_rel(got, scal, cross, f"{what} d{name} vs scalar")
            assert_rel(got, w, tol, f"{what} d{name} vs reference")
            assert_rel(scal, w, tol, f"scalar d{name} vs reference")
        assert_masked_zero(g.h, x["mask"], what + " dh")
        assert_masked_zero(g_s.h, x["mask"], "scalar dh")


# --------------------------------------------------------------------------
# 2. Saved activations


# (lead, T, H, A): no leading axis, two axes, and a batch whose T spans
# two row blocks and whose A spans several column panels.
ACT_SIZES = [((), 7, 5, 3), ((2, 3), 13, 17, 33), ((5,), 130, 33, 65)]


@pytest.mark.parametrize("size", ACT_SIZES, ids=size_id)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@dtype_param
@path_param
def test_keep_activations_forward(path, dtype, mask_kind, size):
    """act = tanh(W_h h_t + W_c c + b) of the reference (TOL), shape
    (..., T, A) and the computing dtype, exactly 0 on masked items;
    out and alpha bitwise those of keep_activations=False."""
    lead, T, H, A = size
    x = _problem(size, dtype, True, mask_kind, seed=2)
    out0, alpha0 = forward(path, x)
    res = forward(path, x, keep=True)
    assert isinstance(res, tuple) and len(res) == 3
    out, alpha, act = res
    assert isinstance(act, np.ndarray)
    assert act.shape == lead + (T, A) and act.dtype == np.dtype(dtype)
    assert_identical(out, out0, "out")
    assert_identical(alpha, alpha0, "alpha")
    want = reference_activations(x)
    assert_rel(act, want, TOL[np.dtype(dtype).type], "act vs reference")
    assert np.all(np.abs(act) <= 1)
    assert_masked_zero(act, x["mask"], "act")


@pytest.mark.parametrize("size", ACT_SIZES, ids=size_id)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@dtype_param
@path_param
def test_backward_with_activations(path, dtype, bias, mask_kind, size):
    """The backward given the saved activations == the one recomputing
    them (ACT_TOL); NaN in the masked items' rows of activations changes
    no bit (they are never read)."""
    x = _problem(size, dtype, bias, mask_kind, seed=3)
    ga = x["grad_alpha"]
    _, alpha, act = forward(path, x, keep=True)
    plain = backward(path, x, alpha, ga)
    saved = backward(path, x, alpha, ga, act=act)
    for name, a, b in zip("hWvb", saved, plain):
        if b is None:
            assert a is None
            continue
        assert a.dtype == np.dtype(dtype) and a.shape == b.shape, name
        assert_rel(a, b, ACT_TOL[np.dtype(dtype).type], f"d{name}")
    assert_masked_zero(saved.h, x["mask"], "dh")
    if x["mask"] is not None and not x["mask"].all():
        poisoned = act.copy()
        poisoned[~x["mask"]] = np.nan
        again = backward(path, x, alpha, ga, act=poisoned)
        for name, a, b in zip("hWvb", again, saved):
            assert_identical(a, b, f"d{name} with NaN in masked act rows")


@pytest.mark.parametrize("shape", [
    (2, 5, 4), (2, 6, 3), (2, 5), (3, 5, 3), (2, 3, 5), (5, 3), (1, 5, 3),
    (2, 1, 5, 3), (3,)], ids=str)
def test_activations_wrong_shape_raises(rng, shape):
    """activations of any shape but (..., T, A) = (2, 5, 3): ValueError
    naming 'activations' (leading axes are not broadcast)."""
    p = Problem(rng, (2,), 5, 4, 3)
    out, alpha = ac.context_attention(p.h, p.W, p.v, b=p.b, mask=p.mask)
    with pytest.raises(ValueError, match="activations"):
        ac.context_attention_backward(out, p.h, p.W, p.v, alpha, b=p.b,
                                      mask=p.mask,
                                      activations=np.zeros(shape))


# --------------------------------------------------------------------------
# 3. The vector tanh


def _ordered(y):
    """Bit patterns mapped to integers in the order of the values (+0 and
    -0 both to 0), so |a - b| counts the ulps between a and b."""
    ibits = {4: np.int32, 8: np.int64}[y.dtype.itemsize]
    i = y.view(ibits).astype(np.int64)
    return np.where(i < 0, -(i & np.iinfo(ibits).max), i)


def _window(center, half):
    """Every float32 within `half` bit patterns of center (> 0)."""
    c = int(np.float32(center).view(np.uint32))
    return np.arange(c - half, c + half + 1, dtype=np.uint32)


@pytest.fixture(scope="module")
def f32_sweep():
    """(x, ordered correctly rounded tanh(x)) for a float32 sweep: every
    finite magnitude with a stride (subnormals to FLT_MAX), [1e-3, 10]
    densely, and exhaustive windows at the saturation point (~9.01), the
    argument-reduction steps (odd multiples of ln(2)/4) and the worst cases
    found by an exhaustive search; both signs.  tanh in float64 rounded to
    float32 is the correctly rounded value except within 2^-29 ulp of a
    midpoint."""
    lo = int(np.float32(1e-3).view(np.uint32))
    hi = int(np.float32(10).view(np.uint32))
    bits = [np.arange(0, 0x7F800000, 1021, dtype=np.uint32),
            np.arange(lo, hi, 53, dtype=np.uint32),
            np.arange(0, 1 << 16, dtype=np.uint32),       # subnormals
            np.arange(np.float32(8.75).view(np.uint32),
                      np.float32(9.25).view(np.uint32), dtype=np.uint32)]
    for k in (1, 3, 5, 7):        # where round(2|x| / ln 2) steps
        bits.append(_window(np.log(2) / 4 * k, 1 << 13))
    for worst in (0.21059934794902802, 0.2123373, 2.0916173, 3.1769156,
                  0.015354436, 0.015393897):
        bits.append(_window(worst, 1 << 12))
    x = np.concatenate(bits).view(np.float32)
    x = np.concatenate([x, -x])
    want = _ordered(np.tanh(x.astype(np.float64)).astype(np.float32))
    return x, want


@pytest.fixture(scope="module")
def f64_sweep():
    """(x, tanh(x) in long double or float64, its float64 rounding) for
    log-uniform magnitudes from subnormal to 40, a dense linear grid on
    [0, 20] and the argument-reduction steps; both signs."""
    rng = np.random.default_rng(7)
    x = np.concatenate([
        np.exp(rng.uniform(np.log(5e-324), np.log(40.0), 1_000_000)),
        np.linspace(0, 20, 1_000_001),
        np.concatenate([np.log(2) / 4 * k * (1 + np.linspace(-1e-6, 1e-6,
                                                             2001))
                        for k in (1, 3, 5, 7)])])
    x = np.concatenate([x, -x])
    if np.finfo(np.longdouble).nmant >= 63:
        exact = np.tanh(x.astype(np.longdouble))
    else:                                     # no extended precision
        exact = np.tanh(x)
    return x, exact, exact.astype(np.float64)


@path_param
def test_tanh_float32_within_3_ulp(path, f32_sweep):
    """float32 tanh of the path within TANH_ULP_F32 ulp of the correctly
    rounded value over the whole sweep (never NaN for a finite x)."""
    x, want = f32_sweep
    y = _core_tests._tanh(x, path)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert not np.any(np.isnan(y)), "NaN for a finite argument"
    ulps = np.abs(_ordered(y) - want)
    k = int(ulps.argmax())
    assert ulps[k] <= TANH_ULP_F32, (
        f"{path}: {ulps[k]} ulp at x = {x[k]!r}: got {y[k]!r}, "
        f"want {np.tanh(np.float64(x[k])).astype(np.float32)!r}")


@path_param
def test_tanh_float64_accuracy(path, f64_sweep):
    """float64 tanh of the path within TANH_ULP_F64 ulp and a relative
    error of TANH_REL_F64 of tanh in long double."""
    x, exact, want = f64_sweep
    y = _core_tests._tanh(x, path)
    assert y.dtype == np.float64 and y.shape == x.shape
    ulps = np.abs(_ordered(y) - _ordered(want))
    k = int(ulps.argmax())
    # one more ulp when the reference is itself only float64 tanh
    slack = 0 if exact.dtype == np.longdouble else 1
    assert ulps[k] <= TANH_ULP_F64 + slack, (
        f"{path}: {ulps[k]} ulp at x = {x[k]!r}: got {y[k]!r}, "
        f"want {want[k]!r}")
    normal = np.abs(want) >= np.finfo(np.float64).tiny
    rel = np.abs((y[normal] - exact[normal]) / exact[normal])
    assert rel.max() <= TANH_REL_F64 + slack * 2.3e-16, (
        f"{path}: relative error {float(rel.max()):.3g}")


@dtype_param
@path_param
def test_tanh_special_values(path, dtype):
    """tanh(+-0) = +-0 with the sign kept, tanh(+-inf) = +-1, NaN -> NaN,
    tanh(x) = x exactly for subnormal and tiny x, +-1 exactly past the
    saturation point; vector tails (any length) give the same bits."""
    fi = np.finfo(dtype)
    zeros = np.array([0.0, -0.0], dtype)
    y = _core_tests._tanh(zeros, path)
    assert np.all(y == 0) and list(np.signbit(y)) == [False, True]
    y = _core_tests._tanh(np.array([np.inf, -np.inf, fi.max, -fi.max],
                                   dtype), path)
    assert list(y) == [1, -1, 1, -1]
    nans = np.array([np.nan, -np.nan, np.inf - np.inf], dtype)
    assert np.all(np.isnan(_core_tests._tanh(nans, path)))
    # past the saturation point (float32 ~9.01, float64 ~19.06) +-1 exactly
    big = np.array([10, 20, 40, 41, 100, 1e10], dtype)
    big = big[big >= (10 if dtype == np.float32 else 20)]
    assert np.all(_core_tests._tanh(big, path) == 1)
    assert np.all(_core_tests._tanh(-big, path) == -1)
    # tiny x: tanh(x) rounds to x
    tiny = np.array([fi.smallest_subnormal, 3 * fi.smallest_subnormal,
                     fi.smallest_normal, 1e-30, 2.0 ** -30], dtype)
    tiny = np.concatenate([tiny, -tiny])
    assert_identical(_core_tests._tanh(tiny, path), tiny, "tanh(tiny)")
    # tails: each length gives the bits of the full-length call
    x = np.random.default_rng(3).standard_normal(67).astype(dtype) * 3
    full = _core_tests._tanh(x, path)
    for n in range(0, 67):
        assert_identical(_core_tests._tanh(x[:n], path), full[:n],
                         f"length {n}")


def test_tanh_bad_arguments():
    """_tanh: unknown path ValueError, non-float array TypeError."""
    with pytest.raises(ValueError):
        _core_tests._tanh(np.zeros(3), "sse")
    with pytest.raises(TypeError):
        _core_tests._tanh(np.zeros(3, np.int64), "scalar")
    for name in UNSUPPORTED:
        with pytest.raises(ValueError):
            _core_tests._tanh(np.zeros(3), name)
