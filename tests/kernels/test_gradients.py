"""Gradients against central finite differences, in float64.

Every backward (the C kernels *and* ``attention_c.reference``, so that the
reference itself is checked against the maths) is compared with the central
difference (L(x + h) - L(x - h)) / 2h (testing.numerical_grad, step 1e-6)
of a scalar loss built from the matching forward with fixed random weights
G:

    fused layer:     L = sum(out * G) + sum(alpha * Ga)    (Ga optional)
    building block:  L = sum(output * G)

The agreement asked for is a normwise relative error <= FD_RTOL = 1e-6
(truncation error ~ step^2 = 1e-12, cancellation error ~ 1e-16 / step =
1e-10, both far below it).
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import reference as ref
from attention_c.testing import FD_RTOL, numerical_grad, rel_err

pytestmark = pytest.mark.filterwarnings("error")

IMPLS = {"c": ac, "reference": ref}
impl_param = pytest.mark.parametrize("impl", list(IMPLS))

# B = 3 sequences of T = 4 items.  "edge" has a fully valid row, a fully
# masked row and a row with a single valid item.
MASKS = {
    "none": None,
    "edge": np.array([[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 0]], bool),
    "partial": np.array([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 1]], bool),
}
mask_param = pytest.mark.parametrize("mask_name", list(MASKS))
bias_param = pytest.mark.parametrize("bias", [True, False],
                                     ids=["bias", "nobias"])
B, T, H, A = 3, 4, 3, 4


def assert_fd(analytic, numeric, what, rtol=FD_RTOL):
    """Analytic gradient equals the finite-difference one within rtol."""
    assert analytic.shape == numeric.shape, (what, analytic.shape)
    err = rel_err(analytic, numeric)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def layer_problem(seed, mask_name, bias=True):
    """Random inputs of the layer, float64, B=3, T=4, H=3, A=4."""
    rng = np.random.default_rng(seed)
    return {
        "h": rng.standard_normal((B, T, H)),
        "W": rng.standard_normal((A, 2 * H)),
        "v": rng.standard_normal(A),
        "b": rng.standard_normal(A) * 0.5 if bias else None,
        "mask": MASKS[mask_name],
        "G": rng.standard_normal((B, H)),
        "Ga": rng.standard_normal((B, T)),
    }


def layer_loss(mod, p, with_ga):
    """L = sum(out * G) [+ sum(alpha * Ga)] with mod's forward."""
    out, alpha = mod.context_attention(p["h"], p["W"], p["v"], b=p["b"],
                                       mask=p["mask"])
    loss = np.sum(out * p["G"])
    if with_ga:
        loss += np.sum(alpha * p["Ga"])
    return loss


def layer_grads(mod, p, with_ga):
    """(dh, dW, dv, db) from mod's context_attention_backward."""
    _, alpha = mod.context_attention(p["h"], p["W"], p["v"], b=p["b"],
                                     mask=p["mask"])
    return tuple(mod.context_attention_backward(
        p["G"], p["h"], p["W"], p["v"], alpha, b=p["b"], mask=p["mask"],
        grad_alpha=p["Ga"] if with_ga else None))


# --------------------------------------------------------------------------
# The fused layer


@impl_param
@pytest.mark.parametrize("with_ga", [False, True],
                         ids=["no_grad_alpha", "grad_alpha"])
@bias_param
@mask_param
def test_layer_gradients_match_finite_differences(impl, mask_name, bias,
                                                  with_ga):
    """context_attention_backward (C and reference) equals the central
    differences of L = sum(out G) [+ sum(alpha Ga)] for h, W, v and b."""
    mod = IMPLS[impl]
    p = layer_problem(1, mask_name, bias)
    dh, dW, dv, db = layer_grads(mod, p, with_ga)
    for name, got in [("h", dh), ("W", dW), ("v", dv), ("b", db)]:
        if p[name] is None:
            assert got is None, f"d{name} should be None without a bias"
            continue
        num = numerical_grad(lambda: layer_loss(mod, p, with_ga), p[name])
        assert_fd(got, num, f"d{name}")


@impl_param
@pytest.mark.parametrize("T_", [3, 5], ids=["T3", "T5"])
def test_layer_gradients_other_lengths(impl, T_):
    """Same FD check (with grad_alpha) for B=3, T in {3, 5}: a fully
    masked row, a single-valid-item row and a fully valid row."""
    rng = np.random.default_rng(7 + T_)
    mask = np.zeros((2, T_), bool)
    mask[1, T_ - 1] = True
    mask = np.concatenate([mask, np.ones((1, T_), bool)])
    p = {"h": rng.standard_normal((3, T_, H)),
         "W": rng.standard_normal((A, 2 * H)), "v": rng.standard_normal(A),
         "b": rng.standard_normal(A), "mask": mask,
         "G": rng.standard_normal((3, H)), "Ga": rng.standard_normal((3, T_))}
    mod = IMPLS[impl]
    grads = layer_grads(mod, p, True)
    for name, got in zip(["h", "W", "v", "b"], grads):
        num = numerical_grad(lambda: layer_loss(mod, p, True), p[name])
        assert_fd(got, num, f"d{name}")


# --------------------------------------------------------------------------
# Building blocks


@impl_param
@mask_param
def test_mean_context_backward_fd(impl, mask_name):
    """mean_context_backward equals the FD gradient of sum(c * Gc)."""
    mod = IMPLS[impl]
    rng = np.random.default_rng(2)
    h = rng.standard_normal((B, T, H))
    Gc = rng.standard_normal((B, H))
    mask = MASKS[mask_name]
    num = numerical_grad(lambda: np.sum(mod.mean_context(h, mask=mask) * Gc),
                         h)
    assert_fd(mod.mean_context_backward(Gc, h, mask=mask), num, "dh")


@impl_param
@bias_param
def test_additive_score_backward_fd(impl, bias):
    """additive_score_backward equals the FD gradient of sum(s * Gs) for h,
    context, W, v and b."""
    mod = IMPLS[impl]
    rng = np.random.default_rng(3)
    x = {"h": rng.standard_normal((B, T, H)),
         "context": rng.standard_normal((B, H)),
         "W": rng.standard_normal((A, 2 * H)),
         "v": rng.standard_normal(A),
         "b": rng.standard_normal(A) if bias else None}
    Gs = rng.standard_normal((B, T))

    def loss():
        return np.sum(mod.additive_score(x["h"], x["context"], x["W"],
                                         x["v"], b=x["b"]) * Gs)

    got = mod.additive_score_backward(Gs, x["h"], x["context"], x["W"],
                                      x["v"], b=x["b"])
    for name, g in zip(["h", "context", "W", "v", "b"], got):
        if x[name] is None:
            assert g is None, "db should be None without a bias"
            continue
        assert_fd(g, numerical_grad(loss, x[name]), f"d{name}")


@impl_param
@mask_param
def test_masked_softmax_backward_fd(impl, mask_name):
    """masked_softmax_backward equals the FD gradient of sum(alpha * Ga)
    with respect to the scores (masked scores: exactly 0)."""
    mod = IMPLS[impl]
    rng = np.random.default_rng(4)
    s = rng.standard_normal((B, T)) * 2
    Ga = rng.standard_normal((B, T))
    mask = MASKS[mask_name]
    num = numerical_grad(lambda: np.sum(mod.masked_softmax(s,
                                                           mask=mask) * Ga), s)
    got = mod.masked_softmax_backward(Ga, mod.masked_softmax(s, mask=mask))
    assert_fd(got, num, "dscores")
    if mask is not None:
        assert np.all(got[~mask] == 0)


@impl_param
def test_weighted_sum_backward_fd(impl):
    """weighted_sum_backward equals the FD gradient of sum(out * G) for
    alpha and h."""
    mod = IMPLS[impl]
    rng = np.random.default_rng(5)
    alpha = rng.random((B, T))
    h = rng.standard_normal((B, T, H))
    G = rng.standard_normal((B, H))

    def loss():
        return np.sum(mod.weighted_sum(alpha, h) * G)

    dalpha, dh = mod.weighted_sum_backward(G, alpha, h)
    assert_fd(dalpha, numerical_grad(loss, alpha), "dalpha")
    assert_fd(dh, numerical_grad(loss, h), "dh")


# --------------------------------------------------------------------------
# The mean-context path of dh: (m_t / n) W_c^T sum_t eps_t


def mean_context_term(p, with_ga):
    """(m_t / n) W_c^T sum_t eps_t (B, T, H), from docs/contract.md
    section 2, written here from scratch (no attention_c function
    used)."""
    h, W, v, b = p["h"], p["W"], p["v"], p["b"]
    m = np.ones((B, T), bool) if p["mask"] is None else p["mask"]
    hv = np.where(m[..., None], h, 0.0)
    n = m.sum(axis=1)
    c = hv.sum(axis=1) / np.maximum(n, 1)[:, None]
    z = hv @ W[:, :H].T + (c @ W[:, H:].T)[:, None, :] + b
    u = np.tanh(z)
    s = np.where(m, u @ v, -np.inf)
    e = np.exp(s - np.where(n > 0, s.max(axis=1), 0)[:, None])
    alpha = e / np.where(n > 0, e.sum(axis=1), 1)[:, None]
    gamma = np.einsum("bh,bth->bt", p["G"], hv)
    if with_ga:
        gamma = gamma + np.where(m, p["Ga"], 0)
    delta = alpha * (gamma - (alpha * gamma).sum(axis=1, keepdims=True))
    eps = delta[..., None] * v * (1 - u ** 2)          # (B, T, A)
    dc = eps.sum(axis=1) @ W[:, H:]                     # W_c^T sum_t eps_t
    share = m / np.maximum(n, 1)[:, None]               # m_t / n
    return share[..., None] * dc[:, None, :]


def frozen_context_loss(p, c0, with_ga):
    """The layer's loss with the context frozen at c0 (no path through c),
    from the reference building blocks."""
    s = ref.additive_score(p["h"], c0, p["W"], p["v"], b=p["b"])
    alpha = ref.masked_softmax(s, mask=p["mask"])
    loss = np.sum(ref.weighted_sum(alpha, p["h"]) * p["G"])
    if with_ga:
        loss += np.sum(alpha * p["Ga"])
    return loss


@impl_param
@pytest.mark.parametrize("with_ga", [False, True],
                         ids=["no_grad_alpha", "grad_alpha"])
@pytest.mark.parametrize("mask_name", ["none", "partial", "edge"])
def test_mean_context_path_of_dh(impl, mask_name, with_ga):
    """The term (m_t/n) W_c^T sum_t eps_t of dh is present and right.

    FD of the full loss minus FD of the loss with the context frozen at its
    value isolates the path through c; it must equal the term computed from
    docs/contract.md section 2, and dh minus the term must equal the FD
    gradient of the frozen loss.  The term is far larger than the tolerance,
    so an implementation that forgot it fails the FD check."""
    mod = IMPLS[impl]
    p = layer_problem(11, mask_name)
    p["W"][:, H:] *= 3.0                     # make the context path strong
    dh = layer_grads(mod, p, with_ga)[0]
    c0 = ref.mean_context(p["h"], mask=p["mask"])
    fd_full = numerical_grad(lambda: layer_loss(mod, p, with_ga), p["h"])
    fd_frozen = numerical_grad(lambda: frozen_context_loss(p, c0, with_ga),
                               p["h"])
    term = mean_context_term(p, with_ga)

    assert_fd(term, fd_full - fd_frozen, "mean-context term (FD)")
    assert_fd(dh - term, fd_frozen, "dh without the mean-context term")
    assert_fd(dh, fd_full, "dh")
    # Forgetting the term must be detectable: it is >> FD_RTOL * ||dh||,
    # and dh without it fails the very check dh passes.
    assert np.linalg.norm(term) > 1e3 * FD_RTOL * np.linalg.norm(fd_full)
    assert rel_err(dh - term, fd_full) > 1e3 * FD_RTOL


# --------------------------------------------------------------------------
# Masked items


@impl_param
@pytest.mark.parametrize("mask_name", ["edge", "partial"])
def test_masked_items_have_exactly_zero_gradient(impl, mask_name):
    """dh of masked items is exactly 0, and grad_alpha given at masked
    positions (where alpha is identically 0) changes no gradient at all."""
    mod = IMPLS[impl]
    p = layer_problem(13, mask_name)
    mask = p["mask"]
    grads = layer_grads(mod, p, True)
    assert np.all(grads[0][~mask] == 0)
    assert np.any(grads[0][mask] != 0)
    mc = mod.mean_context_backward(p["G"], p["h"], mask=mask)
    assert np.all(mc[~mask] == 0)
    p2 = dict(p, Ga=np.where(mask, p["Ga"], 1e6))
    for name, g1, g2 in zip("hWvb", grads, layer_grads(mod, p2, True)):
        np.testing.assert_array_equal(g2, g1, err_msg=f"d{name}")
