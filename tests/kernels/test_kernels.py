"""Every C kernel and the fused layer against ``attention_c.reference``.

The C result is computed from inputs cast to the tested dtype; the
reference is computed in float64 from those same cast values, so the
comparison (normwise relative error, ``testing.TOL``: 1e-12 for float64,
1e-5 for float32) measures only the kernel's own rounding.

Any warning raised during a test fails it (module-level ``filterwarnings``):
masked and fully masked rows must never produce a RuntimeWarning.
"""

import warnings

import numpy as np
import pytest

import attention_c as ac
from attention_c import reference as ref
from attention_c.testing import (DTYPES, ILL_FACTOR, MASK_KINDS, Problem, TOL,
                                 assert_close, assert_identical, f64,
                                 make_mask, rel_err)

pytestmark = pytest.mark.filterwarnings("error")

# (lead, T, H, A): small sizes drawn from {1, 2, 3, 17, 65}, chosen so each
# value appears in each position at least once, plus two larger problems.
SIZES = [
    ((1,), 1, 1, 1),
    ((2,), 2, 3, 1),
    ((3,), 3, 2, 17),
    ((2,), 17, 65, 3),
    ((17,), 65, 3, 2),
    ((65,), 3, 17, 65),
    ((3,), 65, 1, 17),
    ((1,), 2, 17, 65),
    ((4,), 130, 70, 33),
    ((9,), 100, 48, 65),
]

# Fused layer == composition of the building blocks, in float64.  On the
# scalar path both run the same per-sequence arithmetic and must agree to
# a few ulps; a SIMD path sums in another order, so it gets the float64
# tolerance against the reference.
FUSED_TOL = 1e-14 if ac._core._get_simd() == "scalar" else TOL[np.float64]


def rel_err_le(x, y, tol):
    """Normwise relative error of x against y is <= tol (shapes equal)."""
    return rel_err(x, y) <= tol


def _size_id(size):
    lead, T, H, A = size
    return "B{}-T{}-H{}-A{}".format("x".join(map(str, lead)), T, H, A)


def _dtype_id(dtype):
    return np.dtype(dtype).name


size_param = pytest.mark.parametrize("size", SIZES, ids=_size_id)
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
mask_param = pytest.mark.parametrize("mask_kind", MASK_KINDS)
bias_param = pytest.mark.parametrize("bias", [True, False],
                                     ids=["bias", "nobias"])


def check(got, want, dtype, what):
    """got has the computing dtype and agrees with the float64 reference."""
    assert isinstance(got, np.ndarray), what
    assert got.dtype == np.dtype(dtype), (what, got.dtype)
    assert_close(got, want, dtype, what)


def assert_masked_zero(x, mask, what):
    """Entries (or rows) of masked items are exactly 0."""
    if mask is None:
        return
    assert np.all(x[~mask] == 0), f"{what}: masked items are not exactly 0"


def check_tol(got, want, dtype, tol, what):
    """got has the computing dtype and rel_err(got, want) <= tol."""
    assert isinstance(got, np.ndarray), what
    assert got.dtype == np.dtype(dtype), (what, got.dtype)
    err = rel_err(got, want)
    assert err <= tol, f"{what}: normwise relative error {err:.3g} > {tol:.3g}"


def softmax_input(p, dtype):
    """(alpha, mask) with alpha a masked softmax in dtype (0 on padding)."""
    alpha = ref.masked_softmax(p.grad_s, mask=p.mask).astype(dtype)
    return alpha, p.mask


# --------------------------------------------------------------------------
# Building blocks against the reference


@size_param
@mask_param
@dtype_param
def test_mean_context(rng, dtype, mask_kind, size):
    """mean_context matches the reference; dtype is preserved."""
    p = Problem(rng, *size, mask=mask_kind)
    x = p.cast(dtype)
    got = ac.mean_context(x["h"], mask=x["mask"])
    check(got, ref.mean_context(f64(x["h"]), mask=x["mask"]), dtype, "c")
    assert got.shape == p.lead + (p.H,)


@size_param
@mask_param
@dtype_param
def test_mean_context_backward(rng, dtype, mask_kind, size):
    """mean_context_backward matches the reference; padding rows are 0."""
    p = Problem(rng, *size, mask=mask_kind)
    x = p.cast(dtype)
    got = ac.mean_context_backward(x["grad_out"], x["h"], mask=x["mask"])
    want = ref.mean_context_backward(f64(x["grad_out"]), f64(x["h"]),
                                     mask=x["mask"])
    check(got, want, dtype, "dh")
    assert_masked_zero(got, x["mask"], "dh")


@size_param
@bias_param
@dtype_param
def test_additive_score(rng, dtype, bias, size):
    """additive_score matches the reference, with and without bias."""
    p = Problem(rng, *size, bias=bias)
    x = p.cast(dtype)
    got = ac.additive_score(x["h"], x["context"], x["W"], x["v"], b=x["b"])
    want = ref.additive_score(f64(x["h"]), f64(x["context"]), f64(x["W"]),
                              f64(x["v"]), b=f64(x["b"]))
    check(got, want, dtype, "s")
    assert got.shape == p.lead + (p.T,)


@size_param
@bias_param
@dtype_param
def test_additive_score_backward(rng, dtype, bias, size):
    """additive_score_backward matches the reference; db is None iff b is."""
    p = Problem(rng, *size, bias=bias)
    x = p.cast(dtype)
    got = ac.additive_score_backward(x["grad_s"], x["h"], x["context"],
                                     x["W"], x["v"], b=x["b"])
    want = ref.additive_score_backward(
        f64(x["grad_s"]), f64(x["h"]), f64(x["context"]), f64(x["W"]),
        f64(x["v"]), b=f64(x["b"]))
    assert len(got) == 5
    for name, g, w in zip(["dh", "dcontext", "dW", "dv"], got, want):
        check(g, w, dtype, name)
    if bias:
        check(got[4], want[4], dtype, "db")
    else:
        assert got[4] is None


@size_param
@mask_param
@dtype_param
def test_masked_softmax(rng, dtype, mask_kind, size):
    """masked_softmax matches the reference; masked items get exactly 0."""
    p = Problem(rng, *size, mask=mask_kind)
    scores = (p.grad_s * 3).astype(dtype)
    got = ac.masked_softmax(scores, mask=p.mask)
    check(got, ref.masked_softmax(f64(scores), mask=p.mask), dtype, "alpha")
    assert_masked_zero(got, p.mask, "alpha")


@size_param
@mask_param
@dtype_param
def test_masked_softmax_backward(rng, dtype, mask_kind, size):
    """masked_softmax_backward matches the reference; 0 where alpha = 0."""
    p = Problem(rng, *size, mask=mask_kind)
    alpha, mask = softmax_input(p, dtype)
    g = p.cast(dtype)["grad_alpha"]
    got = ac.masked_softmax_backward(g, alpha)
    check(got, ref.masked_softmax_backward(f64(g), f64(alpha)), dtype, "ds")
    assert_masked_zero(got, mask, "ds")


@size_param
@mask_param
@dtype_param
def test_weighted_sum(rng, dtype, mask_kind, size):
    """weighted_sum matches the reference (alpha with zeros on padding)."""
    p = Problem(rng, *size, mask=mask_kind)
    alpha, _ = softmax_input(p, dtype)
    h = p.cast(dtype)["h"]
    got = ac.weighted_sum(alpha, h)
    check(got, ref.weighted_sum(f64(alpha), f64(h)), dtype, "out")


@size_param
@mask_param
@dtype_param
def test_weighted_sum_backward(rng, dtype, mask_kind, size):
    """weighted_sum_backward matches the reference for dalpha and dh."""
    p = Problem(rng, *size, mask=mask_kind)
    alpha, mask = softmax_input(p, dtype)
    x = p.cast(dtype)
    dalpha, dh = ac.weighted_sum_backward(x["grad_out"], alpha, x["h"])
    w_dalpha, w_dh = ref.weighted_sum_backward(f64(x["grad_out"]),
                                               f64(alpha), f64(x["h"]))
    check(dalpha, w_dalpha, dtype, "dalpha")
    check(dh, w_dh, dtype, "dh")
    assert_masked_zero(dh, mask, "dh")


# --------------------------------------------------------------------------
# The fused layer against the reference


@size_param
@bias_param
@mask_param
@dtype_param
def test_context_attention(rng, dtype, mask_kind, bias, size):
    """context_attention matches the reference; padding gets exactly 0."""
    p = Problem(rng, *size, bias=bias, mask=mask_kind)
    x = p.cast(dtype)
    out, alpha = ac.context_attention(x["h"], x["W"], x["v"], b=x["b"],
                                      mask=x["mask"])
    w_out, w_alpha = ref.context_attention(f64(x["h"]), f64(x["W"]),
                                           f64(x["v"]), b=f64(x["b"]),
                                           mask=x["mask"])
    check(out, w_out, dtype, "out")
    check(alpha, w_alpha, dtype, "alpha")
    assert_masked_zero(alpha, x["mask"], "alpha")


@size_param
@pytest.mark.parametrize("with_ga", [False, True],
                         ids=["no_grad_alpha", "grad_alpha"])
@bias_param
@mask_param
@dtype_param
def test_context_attention_backward(rng, dtype, mask_kind, bias, with_ga,
                                    size):
    """context_attention_backward matches the reference (with/without bias
    and grad_alpha) within TOL (see ILL_FACTOR); masked items get exactly
    zero dh.  The size ((1,), 2, 17, 65) has near one-hot alpha."""
    p = Problem(rng, *size, bias=bias, mask=mask_kind)
    x = p.cast(dtype)
    ga = x["grad_alpha"] if with_ga else None
    _, alpha = ac.context_attention(x["h"], x["W"], x["v"], b=x["b"],
                                    mask=x["mask"])
    got = ac.context_attention_backward(x["grad_out"], x["h"], x["W"],
                                        x["v"], alpha, b=x["b"],
                                        mask=x["mask"], grad_alpha=ga)
    want = ref.context_attention_backward(
        f64(x["grad_out"]), f64(x["h"]), f64(x["W"]), f64(x["v"]),
        f64(alpha), b=f64(x["b"]), mask=x["mask"], grad_alpha=f64(ga))
    assert isinstance(got, ac.AttentionGrads)
    # Ill-conditioned data (near one-hot alpha: the gradients are then
    # differences of nearly equal terms) loses digits in any evaluation in
    # this dtype, so the bound is TOL or, when larger, ILL_FACTOR times the
    # error of the NumPy reference evaluated in the same dtype.
    same = ref.context_attention_backward(
        x["grad_out"], x["h"], x["W"], x["v"], alpha, b=x["b"],
        mask=x["mask"], grad_alpha=ga)
    for name, g, w, r in zip("hWvb", got, want, same):
        if g is None:
            continue
        tol = max(TOL[np.dtype(dtype).type], ILL_FACTOR * rel_err(r, w))
        check_tol(g, w, dtype, tol, "d" + name)
    if not bias:
        assert got.b is None
    assert got.W.shape == (p.A, 2 * p.H)
    assert_masked_zero(got.h, x["mask"], "dh")


# --------------------------------------------------------------------------
# Fully masked rows, padding, large scores


@dtype_param
def test_fully_masked_rows_are_exact_zeros(rng, dtype):
    """Rows with no valid item give exactly 0 for c, alpha, out, dh and
    dscores, never NaN, and raise no warning."""
    p = Problem(rng, (5,), 6, 4, 3, mask="random")
    mask = p.mask.copy()
    mask[0] = False
    mask[3] = False
    mask[4] = [False, True, False, False, False, False]
    dead = ~mask.any(axis=-1)
    x = p.cast(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = ac.mean_context(x["h"], mask=mask)
        dc = ac.mean_context_backward(x["grad_out"], x["h"], mask=mask)
        alpha_s = ac.masked_softmax(x["grad_s"], mask=mask)
        ds = ac.masked_softmax_backward(x["grad_alpha"], alpha_s)
        out, alpha = ac.context_attention(x["h"], x["W"], x["v"], b=x["b"],
                                          mask=mask)
        g = ac.context_attention_backward(x["grad_out"], x["h"], x["W"],
                                          x["v"], alpha, b=x["b"], mask=mask,
                                          grad_alpha=x["grad_alpha"])
    for name, arr in [("c", c), ("dh(mean)", dc), ("alpha(softmax)", alpha_s),
                      ("ds", ds), ("out", out), ("alpha", alpha),
                      ("dh", g.h)]:
        assert np.all(arr[dead] == 0), f"{name}: fully masked row not 0"
        assert np.all(np.isfinite(arr)), f"{name}: NaN or Inf"
    for name, arr in [("dW", g.W), ("dv", g.v), ("db", g.b)]:
        assert np.all(np.isfinite(arr)), name
    # the live rows are still right
    assert np.any(out[~dead] != 0)
    np.testing.assert_array_equal(alpha[~dead].sum(axis=-1) > 0.99, True)


@dtype_param
def test_all_masked_single_sequence(rng, dtype):
    """A lone (T, H) sequence with every item masked: all outputs and
    gradients exactly 0, no warning."""
    p = Problem(rng, (), 4, 3, 2)
    x = p.cast(dtype)
    mask = np.zeros(4, dtype=bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, alpha = ac.context_attention(x["h"], x["W"], x["v"], b=x["b"],
                                          mask=mask)
        g = ac.context_attention_backward(x["grad_out"], x["h"], x["W"],
                                          x["v"], alpha, b=x["b"], mask=mask,
                                          grad_alpha=x["grad_alpha"])
        c = ac.mean_context(x["h"], mask=mask)
    for name, arr in [("out", out), ("alpha", alpha), ("c", c),
                      ("dh", g.h), ("dW", g.W), ("dv", g.v), ("db", g.b)]:
        assert arr.dtype == np.dtype(dtype), name
        assert np.all(arr == 0), f"{name} is not exactly 0"


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf],
                         ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mask_kind", ["random", "single", "all_masked"])
@dtype_param
def test_nonfinite_padding_is_ignored(rng, dtype, mask_kind, fill):
    """NaN/Inf in masked rows of h (and masked scores) change no output of
    mean_context, masked_softmax, context_attention or its backward: the
    results are bit-for-bit those of zero padding."""
    p = Problem(rng, (4,), 5, 3, 4, mask=mask_kind)
    x = p.cast(dtype)
    mask = x["mask"]
    h0 = x["h"].copy()
    h0[~mask] = 0
    hbad = x["h"].copy()
    hbad[~mask] = fill
    s0 = x["grad_s"].copy()
    s0[~mask] = 0
    sbad = x["grad_s"].copy()
    sbad[~mask] = fill

    def run(h, s):
        out, alpha = ac.context_attention(h, x["W"], x["v"], b=x["b"],
                                          mask=mask)
        g = ac.context_attention_backward(x["grad_out"], h, x["W"], x["v"],
                                          alpha, b=x["b"], mask=mask,
                                          grad_alpha=x["grad_alpha"])
        return {"c": ac.mean_context(h, mask=mask),
                "softmax": ac.masked_softmax(s, mask=mask),
                "out": out, "alpha": alpha, "dh": g.h, "dW": g.W,
                "dv": g.v, "db": g.b}

    clean, dirty = run(h0, s0), run(hbad, sbad)
    for name in clean:
        assert np.all(np.isfinite(clean[name])), name
        assert_identical(dirty[name], clean[name], name)


@pytest.mark.parametrize("mask_kind", ["none", "random", "single"])
@dtype_param
def test_masked_softmax_large_scores(rng, dtype, mask_kind):
    """Scores around +-1e3 with spreads of thousands: finite, matches the
    reference, valid items sum to 1, padding exactly 0."""
    lead, T = (6,), 9
    base = rng.choice([-1e3, 1e3, 3e3], size=lead + (1,))
    scores = base + rng.standard_normal(lead + (T,)) * 5
    scores[:, ::3] -= 2500.0            # far below the max: exp -> 0
    scores[:, 1] += 0.25                # close competitors stay
    scores = scores.astype(dtype)
    mask = make_mask(rng, lead, T, mask_kind)
    alpha = ac.masked_softmax(scores, mask=mask)
    assert alpha.dtype == np.dtype(dtype)
    assert np.all(np.isfinite(alpha))
    check(alpha, ref.masked_softmax(f64(scores), mask=mask), dtype, "alpha")
    valid = np.ones(scores.shape, bool) if mask is None else mask
    live = valid.any(axis=-1)
    sums = alpha.astype(np.float64).sum(axis=-1)
    eps = np.finfo(dtype).eps
    assert np.all(np.abs(sums[live] - 1) <= 4 * T * eps), sums
    assert np.all(sums[~live] == 0)
    assert_masked_zero(alpha, mask, "alpha")


@dtype_param
def test_context_attention_large_scores_finite(rng, dtype):
    """The fused layer with |scores| in the thousands (v scaled by 1e3):
    alpha and every gradient stay finite and alpha sums to 1."""
    p = Problem(rng, (3,), 7, 5, 6, mask="none", scale=3.0)
    x = p.cast(dtype)
    v = (p.v * 1e3).astype(dtype)
    out, alpha = ac.context_attention(x["h"], x["W"], v, b=x["b"])
    s = ref.additive_score(p.h, ref.mean_context(p.h), p.W, p.v * 1e3, b=p.b)
    assert np.ptp(s, axis=-1).max() > 100    # the regime we meant to test
    g = ac.context_attention_backward(x["grad_out"], x["h"], x["W"], v,
                                      alpha, b=x["b"],
                                      grad_alpha=x["grad_alpha"])
    for name, arr in [("out", out), ("alpha", alpha), ("dh", g.h),
                      ("dW", g.W), ("dv", g.v), ("db", g.b)]:
        assert np.all(np.isfinite(arr)), name
    eps = np.finfo(dtype).eps
    assert np.all(np.abs(alpha.astype(np.float64).sum(-1) - 1) <= 30 * eps)


# --------------------------------------------------------------------------
# Fused layer == composition of the C building blocks (float64)


COMPOSE_SIZES = [((1,), 1, 1, 1), ((3,), 5, 4, 3), ((4,), 17, 3, 65),
                 ((2, 3), 65, 17, 2)]


@pytest.mark.parametrize("size", COMPOSE_SIZES, ids=_size_id)
@bias_param
@mask_param
def test_fused_forward_equals_composition(rng, mask_kind, bias, size):
    """context_attention == weighted_sum(masked_softmax(additive_score(h,
    mean_context(h))), h) of the C building blocks."""
    p = Problem(rng, *size, bias=bias, mask=mask_kind)
    out, alpha = ac.context_attention(p.h, p.W, p.v, b=p.b, mask=p.mask)
    c = ac.mean_context(p.h, mask=p.mask)
    s = ac.additive_score(p.h, c, p.W, p.v, b=p.b)
    a2 = ac.masked_softmax(s, mask=p.mask)
    o2 = ac.weighted_sum(a2, p.h)
    assert rel_err_le(alpha, a2, FUSED_TOL), "alpha"
    assert rel_err_le(out, o2, FUSED_TOL), "out"


@pytest.mark.parametrize("size", COMPOSE_SIZES, ids=_size_id)
@pytest.mark.parametrize("with_ga", [False, True],
                         ids=["no_grad_alpha", "grad_alpha"])
@bias_param
@mask_param
def test_fused_backward_equals_composition(rng, mask_kind, bias, with_ga,
                                           size):
    """context_attention_backward == the chained building-block backwards:
    weighted_sum -> masked_softmax -> additive_score -> mean_context."""
    p = Problem(rng, *size, bias=bias, mask=mask_kind)
    ga = p.grad_alpha if with_ga else None
    g = p.grad_out
    _, alpha = ac.context_attention(p.h, p.W, p.v, b=p.b, mask=p.mask)
    got = ac.context_attention_backward(g, p.h, p.W, p.v, alpha, b=p.b,
                                        mask=p.mask, grad_alpha=ga)
    c = ac.mean_context(p.h, mask=p.mask)
    dalpha, dh1 = ac.weighted_sum_backward(g, alpha, p.h)
    ds = ac.masked_softmax_backward(dalpha if ga is None else dalpha + ga,
                                    alpha)
    dh2, dc, dW, dv, db = ac.additive_score_backward(ds, p.h, c, p.W, p.v,
                                                     b=p.b)
    dh3 = ac.mean_context_backward(dc, p.h, mask=p.mask)
    assert rel_err_le(got.h, dh1 + dh2 + dh3, FUSED_TOL), "dh"
    assert rel_err_le(got.W, dW, FUSED_TOL), "dW"
    assert rel_err_le(got.v, dv, FUSED_TOL), "dv"
    if bias:
        assert rel_err_le(got.b, db, FUSED_TOL), "db"
    else:
        assert got.b is None and db is None


# --------------------------------------------------------------------------
# Leading batch axes


LEADS = [(), (1,), (5,), (2, 3), (2, 1, 3)]


def _lead_id(lead):
    return "lead" + ("x".join(map(str, lead)) if lead else "none")


@pytest.mark.parametrize("lead", LEADS, ids=_lead_id)
@pytest.mark.parametrize("mask_kind", ["none", "random"])
def test_leading_axes(rng, lead, mask_kind):
    """Any number of leading axes (none included): every function returns
    the reference's shapes and values (float64)."""
    p = Problem(rng, lead, 4, 3, 5, mask=mask_kind)
    h, W, v, b, m = p.h, p.W, p.v, p.b, p.mask
    T, H = 4, 3
    pairs = []
    pairs.append(("mean_context", ac.mean_context(h, mask=m),
                  ref.mean_context(h, mask=m)))
    pairs.append(("mean_context_backward",
                  ac.mean_context_backward(p.grad_out, h, mask=m),
                  ref.mean_context_backward(p.grad_out, h, mask=m)))
    pairs.append(("additive_score",
                  ac.additive_score(h, p.context, W, v, b=b),
                  ref.additive_score(h, p.context, W, v, b=b)))
    for i, (x, y) in enumerate(zip(
            ac.additive_score_backward(p.grad_s, h, p.context, W, v, b=b),
            ref.additive_score_backward(p.grad_s, h, p.context, W, v, b=b))):
        pairs.append((f"additive_score_backward[{i}]", x, y))
    alpha_s = ac.masked_softmax(p.grad_s, mask=m)
    pairs.append(("masked_softmax", alpha_s, ref.masked_softmax(p.grad_s,
                                                                mask=m)))
    pairs.append(("masked_softmax_backward",
                  ac.masked_softmax_backward(p.grad_alpha, alpha_s),
                  ref.masked_softmax_backward(p.grad_alpha, alpha_s)))
    pairs.append(("weighted_sum", ac.weighted_sum(alpha_s, h),
                  ref.weighted_sum(alpha_s, h)))
    for i, (x, y) in enumerate(zip(
            ac.weighted_sum_backward(p.grad_out, alpha_s, h),
            ref.weighted_sum_backward(p.grad_out, alpha_s, h))):
        pairs.append((f"weighted_sum_backward[{i}]", x, y))
    out, alpha = ac.context_attention(h, W, v, b=b, mask=m)
    w_out, w_alpha = ref.context_attention(h, W, v, b=b, mask=m)
    pairs += [("out", out, w_out), ("alpha", alpha, w_alpha)]
    got = ac.context_attention_backward(p.grad_out, h, W, v, alpha, b=b,
                                        mask=m, grad_alpha=p.grad_alpha)
    want = ref.context_attention_backward(p.grad_out, h, W, v, alpha, b=b,
                                          mask=m, grad_alpha=p.grad_alpha)
    for name, x, y in zip(["dh", "dW", "dv", "db"], got, want):
        pairs.append((name, x, y))
    for name, x, y in pairs:
        assert x.shape == y.shape, (name, x.shape, y.shape)
        check(x, y, np.float64, name)
    assert out.shape == lead + (H,) and alpha.shape == lead + (T,)
    assert got.h.shape == lead + (T, H)


@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)], ids=_lead_id)
@dtype_param
def test_empty_batch(dtype, lead):
    """An empty batch gives empty outputs of the right shapes and dtype;
    parameter gradients are zeros of shape (A, 2H), (A,)."""
    T, H, A = 4, 3, 5
    h = np.ones(lead + (T, H), dtype)
    W = np.ones((A, 2 * H), dtype)
    v = np.ones(A, dtype)
    b = np.ones(A, dtype)
    mask = np.ones(lead + (T,), bool)
    g_h = np.ones(lead + (H,), dtype)
    g_t = np.ones(lead + (T,), dtype)

    def expect(arr, shape, what):
        assert isinstance(arr, np.ndarray), what
        assert arr.shape == shape, (what, arr.shape, shape)
        assert arr.dtype == np.dtype(dtype), (what, arr.dtype)

    def expect_zero(arr, shape, what):
        expect(arr, shape, what)
        assert np.all(arr == 0), f"{what}: not zero"

    expect(ac.mean_context(h, mask=mask), lead + (H,), "c")
    expect(ac.mean_context_backward(g_h, h, mask=mask), lead + (T, H), "dh")
    expect(ac.additive_score(h, g_h, W, v, b=b), lead + (T,), "s")
    dh, dctx, dW, dv, db = ac.additive_score_backward(g_t, h, g_h, W, v, b=b)
    expect(dh, lead + (T, H), "dh")
    expect(dctx, lead + (H,), "dcontext")
    expect_zero(dW, (A, 2 * H), "dW")
    expect_zero(dv, (A,), "dv")
    expect_zero(db, (A,), "db")
    expect(ac.masked_softmax(g_t, mask=mask), lead + (T,), "alpha")
    expect(ac.masked_softmax_backward(g_t, g_t), lead + (T,), "ds")
    expect(ac.weighted_sum(g_t, h), lead + (H,), "out")
    dalpha, dh = ac.weighted_sum_backward(g_h, g_t, h)
    expect(dalpha, lead + (T,), "dalpha")
    expect(dh, lead + (T, H), "dh")
    out, alpha = ac.context_attention(h, W, v, b=b, mask=mask)
    expect(out, lead + (H,), "out")
    expect(alpha, lead + (T,), "alpha")
    g = ac.context_attention_backward(g_h, h, W, v, alpha, b=b, mask=mask,
                                      grad_alpha=g_t)
    expect(g.h, lead + (T, H), "dh")
    expect_zero(g.W, (A, 2 * H), "dW")
    expect_zero(g.v, (A,), "dv")
    expect_zero(g.b, (A,), "db")
    g = ac.context_attention_backward(g_h, h, W, v, alpha)
    expect_zero(g.W, (A, 2 * H), "dW (no bias)")
    assert g.b is None
