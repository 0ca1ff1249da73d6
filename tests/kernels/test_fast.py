"""The fast layer: SIMD paths, saved activations, vector tanh, threads.

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
4. Results are bitwise identical for 1, 2, 3 and 8 threads, on problems
   big enough that the pool really runs them; the pool's workers exist
   while needed and go when the count drops; bad thread counts raise.
5. The layer works in a child after ``os.fork()`` (bitwise the parent's
   results, with its own threads), and importing torch before or after
   attention_c changes no result and deadlocks nothing.
6. The forward on (B, T, H, A) = (16, 8192, 256, 1024) float32 never
   holds the (B, T, A) activations: its peak RSS grows by at most its
   outputs + 64 MiB (the backward: its gradients + 64 MiB).

Each test restores the SIMD path and the thread count it found.
"""

import importlib.util
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core, _core_tests
from attention_c import reference as ref
from attention_c.testing import (DTYPES, ILL_FACTOR, MASK_KINDS, Problem, TOL,
                                 assert_identical, f64, rel_err)

ORDER = ["scalar", "avx2", "avx512", "neon"]
BEST = _core._simd_best()
PATHS = list(_core._simd_paths())              # the paths this CPU runs
SIMD_PATHS = PATHS[1:]
UNSUPPORTED = [name for name in ORDER if name not in PATHS]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(ac.__file__)))

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


def _dtype_id(dtype):
    return np.dtype(dtype).name


def _size_id(size):
    lead, T, H, A = size
    return "B{}-T{}-H{}-A{}".format("x".join(map(str, lead)) or "0", T, H, A)


dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
path_param = pytest.mark.parametrize("path", PATHS)
simd_param = pytest.mark.parametrize("path", SIMD_PATHS)


# every test leaves the SIMD path and the thread count as it found them
pytestmark = pytest.mark.usefixtures("restore_settings")


def assert_rel(got, want, tol, what):
    """Normwise relative error of got against want is <= tol."""
    err = rel_err(got, want)
    assert err <= tol, f"{what}: normwise relative error {err:.3g} > {tol:g}"


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


def count_threads():
    """OS threads of this process (Linux), or None."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def run_python(script, args=(), env=None, timeout=120):
    """Runs script in a fresh interpreter that imports this attention_c."""
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [REPO] + [p for p in [full_env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-c", script, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env=full_env)


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
cross_size_param = pytest.mark.parametrize("size", CROSS_SIZES, ids=_size_id)
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


@pytest.mark.parametrize("size", ACT_SIZES, ids=_size_id)
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


@pytest.mark.parametrize("size", ACT_SIZES, ids=_size_id)
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


# --------------------------------------------------------------------------
# SIMD selection and configuration


def test_simd_selection():
    """Every path up to _simd_best() can be chosen and is reported; an
    unknown name or a path the CPU cannot run is a ValueError that leaves
    the choice unchanged."""
    assert BEST in ORDER and PATHS[0] == "scalar" and PATHS[-1] == BEST
    for name in PATHS:
        _core._set_simd(name)
        assert _core._get_simd() == name
    for bad in ["sse", "AVX2", "", "avx", "avx512f"] + UNSUPPORTED:
        with pytest.raises(ValueError):
            _core._set_simd(bad)
        assert _core._get_simd() == PATHS[-1]
    with pytest.raises((ValueError, TypeError)):
        _core._set_simd(2)


def test_show_config():
    """show_config prints one line per fact and returns them as a dict
    that follows the current settings."""
    _core._set_simd("scalar")
    ac.set_num_threads(3)
    buf = io.StringIO()
    info = ac.show_config(file=buf)
    assert isinstance(info, dict)
    for key in ["version", "compiler", "simd", "simd_best", "num_threads"]:
        assert key in info, key
    assert info["version"] == ac.__version__
    assert info["simd"] == "scalar" and info["simd_best"] == BEST
    assert info["num_threads"] == 3
    assert isinstance(info["compiler"], str) and info["compiler"]
    lines = buf.getvalue().splitlines()
    assert len(lines) == len(info)
    for line, (key, value) in zip(lines, info.items()):
        assert line.split()[0] == key and line.rstrip().endswith(str(value))


_ENV_SCRIPT = textwrap.dedent("""
    import json, os, warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import attention_c as ac
    print(json.dumps({
        "simd": ac._core._get_simd(),
        "threads": ac.get_num_threads(),
        "cores": len(os.sched_getaffinity(0)),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }))
""")


@pytest.mark.parametrize("simd_env, threads_env, warn", [
    (None, None, None),
    ("scalar", "3", None),
    (BEST, "1", None),
    ("bogus", None, "ATTENTION_C_SIMD"),
    (None, "0", "ATTENTION_C_NUM_THREADS"),
    (None, "many", "ATTENTION_C_NUM_THREADS"),
] + [(name, None, "ATTENTION_C_SIMD") for name in UNSUPPORTED])
def test_environment_variables(simd_env, threads_env, warn):
    """ATTENTION_C_SIMD and ATTENTION_C_NUM_THREADS set the path and the
    threads at import; a bad value gives a RuntimeWarning naming the
    variable and is ignored (best path, available cores)."""
    env = dict(os.environ)
    for key, value in [("ATTENTION_C_SIMD", simd_env),
                       ("ATTENTION_C_NUM_THREADS", threads_env)]:
        env.pop(key, None)
        if value is not None:
            env[key] = value
    proc = run_python(_ENV_SCRIPT, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    simd_ok = simd_env in PATHS
    assert got["simd"] == (simd_env if simd_ok else BEST)
    threads_ok = threads_env is not None and threads_env.isdigit() and \
        1 <= int(threads_env) <= 256
    assert got["threads"] == (int(threads_env) if threads_ok
                              else min(got["cores"], 256))
    if warn is None:
        assert got["warnings"] == []
    else:
        assert len(got["warnings"]) == 1, got["warnings"]
        assert got["warnings"][0].startswith("RuntimeWarning")
        assert warn in got["warnings"][0]


# --------------------------------------------------------------------------
# 4. Threads


@pytest.mark.parametrize("n, exc", [
    (0, ValueError), (-1, ValueError), (257, ValueError),
    ("2", TypeError), (2.5, TypeError), (None, TypeError),
    (2.0, TypeError)], ids=repr)
def test_set_num_threads_rejects(n, exc):
    """Counts outside 1 .. 256 or not integers raise and change nothing."""
    ac.set_num_threads(5)
    with pytest.raises(exc):
        ac.set_num_threads(n)
    assert ac.get_num_threads() == 5


def test_set_num_threads_accepts():
    """1 .. 256 and integer-likes (numpy integers) are accepted."""
    for n in [1, 256, np.int64(7), 2]:
        ac.set_num_threads(n)
        assert ac.get_num_threads() == int(n)
        assert type(ac.get_num_threads()) is int


# (lead, T, H, A, mask kind, bias): each has B T (H+1)(A+1) >= 2^24, so
# the kernel gives it at least two threads.  B = 9 runs one sequence per
# task up to 4 threads and splits sequences into row blocks at 8; B = 1
# and B = 3 split into row blocks.
THREAD_SIZES = [
    ((3,), 2000, 128, 128, "random", True),
    ((1,), 9000, 64, 64, "none", False),
    ((9,), 1400, 65, 33, "random", True),
]
THREAD_COUNTS = [1, 2, 3, 8]


def _thread_size_id(spec):
    return _size_id(spec[:4]) + "-" + spec[4]


def _thread_cases():
    """Every SIMD path on every size; the scalar path (which runs on one
    thread whatever the setting) on the smallest."""
    cases = [(path, spec) for path in SIMD_PATHS for spec in THREAD_SIZES]
    return cases + [("scalar", THREAD_SIZES[-1])]


def _layer_results(x, ga):
    """Forward (with activations) and backward (with and without them)."""
    out, alpha, act = ac.context_attention(x["h"], x["W"], x["v"], b=x["b"],
                                           mask=x["mask"],
                                           keep_activations=True)
    res = {"out": out, "alpha": alpha, "act": act}
    for tag, a in [("", None), ("_act", act)]:
        g = ac.context_attention_backward(
            x["grad_out"], x["h"], x["W"], x["v"], alpha, b=x["b"],
            mask=x["mask"], grad_alpha=ga, activations=a)
        for name, arr in zip("hWvb", g):
            res["d" + name + tag] = arr
    return res


def _thread_problem(spec, dtype, seed=11):
    lead, T, H, A, mask_kind, bias = spec
    p = Problem(np.random.default_rng(seed), lead, T, H, A, bias=bias,
                mask=mask_kind)
    return p.cast(dtype)


@pytest.mark.parametrize("path, spec", _thread_cases(),
                         ids=[f"{p}-{_thread_size_id(s)}"
                              for p, s in _thread_cases()])
@dtype_param
def test_bitwise_identical_for_any_thread_count(dtype, path, spec):
    """Forward (out, alpha, activations) and backward (dh, dW, dv, db,
    with and without activations) bitwise the same for 1, 2, 3, 8
    threads, with masks including fully masked rows."""
    lead, T, H, A = spec[:4]
    assert np.prod(lead) * T * (H + 1) * (A + 1) >= 2 ** 24
    _core._set_simd(path)
    x = _thread_problem(spec, dtype)
    if x["mask"] is not None:
        assert not x["mask"][1].any()           # a fully masked row
    results = {}
    for n in THREAD_COUNTS:
        ac.set_num_threads(n)
        results[n] = _layer_results(x, x["grad_alpha"])
    base = results[1]
    for n in THREAD_COUNTS[1:]:
        for key in base:
            assert_identical(results[n][key], base[key],
                             f"{key} with {n} threads")
    # and the result is right, long sequences included (sums over T are
    # done in double: float32 sums item by item were off by 1e-5 at
    # T = 9000)
    w_out, w_alpha = ref.context_attention(f64(x["h"]), f64(x["W"]),
                                           f64(x["v"]), b=f64(x["b"]),
                                           mask=x["mask"])
    tol = TOL[np.dtype(dtype).type]
    assert_rel(base["out"], w_out, tol, "out")
    assert_rel(base["alpha"], w_alpha, tol, "alpha")


@pytest.mark.skipif(not SIMD_PATHS, reason="threads need a SIMD path")
@pytest.mark.skipif(count_threads() is None, reason="needs /proc/self/task")
def test_pool_workers_come_and_go():
    """With n threads a big call runs on a pool of n - 1 workers, which
    are stopped when the count drops back to 1."""
    _core._set_simd(BEST)
    x = _thread_problem(THREAD_SIZES[0], np.float32)
    ac.set_num_threads(1)
    ac.context_attention(x["h"], x["W"], x["v"], b=x["b"], mask=x["mask"])
    before = count_threads()
    ac.set_num_threads(3)
    ac.context_attention(x["h"], x["W"], x["v"], b=x["b"], mask=x["mask"])
    assert count_threads() == before + 2
    ac.set_num_threads(1)
    assert count_threads() == before


# --------------------------------------------------------------------------
# 5. fork() and torch


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_computes_same_results():
    """A child forked after the parent used its thread pool gets bitwise
    the parent's results, on a pool of its own (the parent's workers do
    not exist in the child), also after changing the thread count."""
    _core._set_simd(BEST)
    ac.set_num_threads(2)
    x = _thread_problem(THREAD_SIZES[0], np.float32)
    parent = _layer_results(x, x["grad_alpha"])
    check_threads = BEST != "scalar" and count_threads() is not None
    pid = os.fork()
    if pid == 0:                                           # the child
        code = 70
        try:
            signal.alarm(60)        # a deadlock ends as SIGALRM
            for n in (2, 3):
                ac.set_num_threads(n)
                child = _layer_results(x, x["grad_alpha"])
                if any(child[k].tobytes() != parent[k].tobytes()
                       for k in parent if parent[k] is not None):
                    code = 10 + n
                    break
                if check_threads and count_threads() != n:
                    code = 20 + n
                    break
            else:
                code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 90
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hangs")
        time.sleep(0.05)
    assert not os.WIFSIGNALED(status), (
        f"child killed by {signal.Signals(os.WTERMSIG(status)).name}")
    code = os.WEXITSTATUS(status)
    messages = {0: "", 70: "child raised", 12: "2 threads: other results",
                13: "3 threads: other results",
                22: "2 threads: not 2 OS threads",
                23: "3 threads: not 3 OS threads"}
    assert code == 0, messages.get(code, f"exit code {code}")


_TORCH_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    order, path, folder = sys.argv[1:4]
    if order == "torch_first":
        import torch
        import attention_c as ac
    else:
        import attention_c as ac
        import torch
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    before = float((a @ a).sum())              # torch's threads run
    ac._core._set_simd(path)
    ac.set_num_threads(3)
    data = np.load(folder + "/inputs.npz")
    x = {k: data[k] for k in data.files}
    out, alpha, act = ac.context_attention(x["h"], x["W"], x["v"], b=x["b"],
                                           mask=x["mask"],
                                           keep_activations=True)
    g = ac.context_attention_backward(x["grad_out"], x["h"], x["W"],
                                      x["v"], alpha, b=x["b"],
                                      mask=x["mask"],
                                      grad_alpha=x["grad_alpha"])
    after = float((a @ a).sum())               # and still run
    assert before == after
    np.savez(folder + "/results.npz", out=out, alpha=alpha, act=act,
             dh=g.h, dW=g.W, dv=g.v, db=g.b)
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed")
@pytest.mark.parametrize("order", ["torch_first", "torch_last"])
def test_torch_import_order(order, tmp_path):
    """With torch imported before or after attention_c (and its own
    threads running), a threaded call gives bitwise this process's
    results, and nothing deadlocks (timeout)."""
    x = _thread_problem(THREAD_SIZES[0], np.float32)
    np.savez(tmp_path / "inputs.npz",
             **{k: v for k, v in x.items() if v is not None})
    try:
        proc = run_python(_TORCH_SCRIPT, [order, BEST, tmp_path],
                          timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{order}: the child did not finish (deadlock?)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(tmp_path / "results.npz")
    _core._set_simd(BEST)
    ac.set_num_threads(3)
    out, alpha, act = ac.context_attention(x["h"], x["W"], x["v"], b=x["b"],
                                           mask=x["mask"],
                                           keep_activations=True)
    g = ac.context_attention_backward(x["grad_out"], x["h"], x["W"], x["v"],
                                      alpha, b=x["b"], mask=x["mask"],
                                      grad_alpha=x["grad_alpha"])
    want = dict(out=out, alpha=alpha, act=act, dh=g.h, dW=g.W, dv=g.v,
                db=g.b)
    for key, value in want.items():
        assert_identical(got[key], value, f"{order}: {key}")


# --------------------------------------------------------------------------
# 6. Memory


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import attention_c as ac
    path, threads = sys.argv[1], int(sys.argv[2])
    ac._core._set_simd(path)
    ac.set_num_threads(threads)
    B, T, H, A = 16, 8192, 256, 1024
    rng = np.random.default_rng(0)
    # float32 straight from the generator: no float64 temporaries that
    # would raise the peak before the baseline
    h = rng.standard_normal((B, T, H), dtype=np.float32)
    W = rng.standard_normal((A, 2 * H), dtype=np.float32)
    W *= np.float32(1 / np.sqrt(2 * H))
    v = rng.standard_normal(A, dtype=np.float32)
    b = rng.standard_normal(A, dtype=np.float32)
    mask = rng.random((B, T)) < 0.9
    mask[1] = False
    g = rng.standard_normal((B, H), dtype=np.float32)
    # warm-up: first-call allocations, the thread pool
    o, a = ac.context_attention(h[:2, :40], W, v, b=b, mask=mask[:2, :40])
    ac.context_attention_backward(g[:2], h[:2, :40], W, v, a, b=b,
                                  mask=mask[:2, :40])

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    p0 = peak()
    out, alpha = ac.context_attention(h, W, v, b=b, mask=mask)
    p1 = peak()
    grads = ac.context_attention_backward(g, h, W, v, alpha, b=b, mask=mask)
    p2 = peak()
    live = mask.any(axis=-1)
    sums = alpha.astype(np.float64).sum(axis=-1)
    print(json.dumps({
        "forward_growth": p1 - p0, "backward_growth": p2 - p1,
        "outputs": out.nbytes + alpha.nbytes,
        "grads": sum(x.nbytes for x in grads),
        "sums_ok": bool(np.all(np.abs(sums[live] - 1) < 1e-4)
                        and np.all(sums[~live] == 0)),
        "finite": bool(all(np.isfinite(x).all() for x in (out,) + grads)),
    }))
""")
MEMORY_SLACK = 64 * 2 ** 20


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB")
@pytest.mark.skipif(not SIMD_PATHS, reason="the scalar path is too slow "
                    "for this size")
@simd_param
def test_memory_of_a_large_layer(path):
    """(16, 8192, 256, 1024) float32 (h 128 MiB; the activations would be
    512 MiB): the forward's peak RSS grows by at most out + alpha +
    64 MiB, the backward's by at most its gradients + 64 MiB."""
    proc = run_python(_MEMORY_SCRIPT, [path, 4], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["sums_ok"] and got["finite"], got
    mib = 2 ** 20
    assert got["forward_growth"] <= got["outputs"] + MEMORY_SLACK, (
        f"forward: peak RSS grew {got['forward_growth'] / mib:.1f} MiB")
    assert got["backward_growth"] <= got["grads"] + MEMORY_SLACK, (
        f"backward: peak RSS grew {got['backward_growth'] / mib:.1f} MiB")


@path_param
def test_long_sequences_keep_float32_accuracy(path):
    """Sums over T = 16000 items (mean context, softmax total, weighted
    sum, dv and E) keep float32 within TOL on every path: they are done in
    blocks and in double.  Summed item by item in float32 every output and
    gradient here was off by 1.7e-5 to 2.2e-5."""
    _core._set_simd(path)
    p = Problem(np.random.default_rng(5), (1,), 16000, 64, 64, bias=False,
                mask="none")
    x = p.cast(np.float32)
    out, alpha = ac.context_attention(x["h"], x["W"], x["v"])
    got = ac.context_attention_backward(x["grad_out"], x["h"], x["W"],
                                        x["v"], alpha)
    r_out, r_alpha = ref.context_attention(f64(x["h"]), f64(x["W"]),
                                           f64(x["v"]))
    want = ref.context_attention_backward(f64(x["grad_out"]), f64(x["h"]),
                                          f64(x["W"]), f64(x["v"]), r_alpha)
    tol = TOL[np.float32]
    assert_rel(out, r_out, tol, "out")
    assert_rel(alpha, r_alpha, tol, "alpha")
    for name, g, w in zip("hWv", got[:3], want[:3]):
        assert_rel(g, w, tol, "d" + name)
