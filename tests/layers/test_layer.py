"""The NumPy layer ContextAttention and the optimiser steps.

The layer must equal the functional API (and so the reference) forward and
backward, its backward must equal finite differences of its forward in
float64, its dicts must be the live arrays, loading a PyTorch Linear pair
must reproduce the PyTorch computation, and sgd_step / adam_step must do
exactly the update written in their docstrings.
"""

import inspect

import numpy as np
import pytest

import attention_c as ac
from attention_c import reference as ref
from attention_c.testing import (DTYPES, MASK_KINDS, TOL, assert_close,
                                 make_mask, numerical_grad, rel_err,
                                 torch_context_attention)

pytestmark = pytest.mark.filterwarnings("error")

B, T, H, A = 3, 5, 4, 6


def make_layer(dtype=np.float64, bias=True, seed=0, **kw):
    return ac.ContextAttention(H, A, bias=bias, dtype=dtype, seed=seed, **kw)


def inputs(seed, kind="random", dtype=np.float64):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((B, T, H)).astype(dtype)
    mask = make_mask(rng, (B,), T, kind)
    return h, mask, rng


# --------------------------------------------------------------------------
# Construction


@pytest.mark.parametrize("dtype", DTYPES)
def test_init_like_torch_linear(dtype):
    """Shapes, dtype, and U(-1/sqrt(fan_in), 1/sqrt(fan_in)) bounds."""
    layer = make_layer(dtype)
    assert layer.W.shape == (A, 2 * H) and layer.v.shape == (A,)
    assert layer.b.shape == (A,)
    for p in layer.parameters().values():
        assert p.dtype == dtype
    assert np.abs(layer.W).max() <= 1 / np.sqrt(2 * H)
    assert np.abs(layer.b).max() <= 1 / np.sqrt(2 * H)
    assert np.abs(layer.v).max() <= 1 / np.sqrt(A)
    assert np.abs(layer.W).max() > 0.5 / np.sqrt(2 * H)   # not all tiny


def test_init_is_seeded_and_dtype_independent():
    """The same seed gives the same weights; float32 is the float64 draw
    rounded, so changing the dtype does not change the model."""
    a, b = make_layer(seed=3), make_layer(seed=3)
    c = make_layer(np.float32, seed=3)
    for name in ["W", "v", "b"]:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        np.testing.assert_array_equal(getattr(a, name).astype(np.float32),
                                      getattr(c, name))
    assert not np.array_equal(a.W, make_layer(seed=4).W)
    gen = np.random.default_rng(3)
    np.testing.assert_array_equal(
        ac.ContextAttention(H, A, seed=gen).W, a.W)


def test_init_rejects_bad_arguments():
    with pytest.raises(TypeError, match="float32 or float64"):
        ac.ContextAttention(H, A, dtype=np.int32)
    with pytest.raises(ValueError, match="hidden_size"):
        ac.ContextAttention(0, A)


def test_parameters_and_grads_dicts():
    """parameters() gives the live arrays; grads() is empty until a
    backward, then has the same keys and shapes; no 'b' without a bias."""
    layer = make_layer()
    params = layer.parameters()
    assert list(params) == ["W", "v", "b"]
    assert params["W"] is layer.W and params["b"] is layer.b
    assert layer.grads() == {}
    h, mask, _ = inputs(0)
    out = layer(h, mask=mask)
    layer.backward(np.ones_like(out))
    grads = layer.grads()
    assert list(grads) == list(params)
    for name in params:
        assert grads[name].shape == params[name].shape

    nob = make_layer(bias=False)
    assert nob.b is None and list(nob.parameters()) == ["W", "v"]
    out = nob(h, mask=mask)
    nob.backward(out)
    assert list(nob.grads()) == ["W", "v"]
    assert "bias=False" in repr(nob)


def test_backward_before_call_raises():
    with pytest.raises(RuntimeError, match="before"):
        make_layer().backward(np.zeros((B, H)))


# --------------------------------------------------------------------------
# One argument order: what is always required by position, the rest by
# keyword


def positional(f):
    """The names f takes by position (after self or cls)."""
    return [p.name for p in inspect.signature(f).parameters.values()
            if p.kind is not p.KEYWORD_ONLY]


def test_optional_arguments_are_keyword_only():
    """The signatures: the input (the gradient for the backward), the
    sizes, the PyTorch layers and the dicts by position, nothing else."""
    layer = make_layer()
    assert positional(layer) == ["h"]
    assert positional(layer.backward) == ["grad_out"]
    assert positional(ac.ContextAttention) == ["hidden_size",
                                               "attention_size"]
    assert positional(ac.ContextAttention.from_torch) == ["score", "out"]
    assert positional(ac.sgd_step) == ["params", "grads"]
    assert positional(ac.adam_step) == ["params", "grads", "state"]
    kw = inspect.signature(layer).parameters["mask"]
    assert kw.kind is kw.KEYWORD_ONLY and kw.default is None


def test_a_positional_mask_asks_for_a_keyword():
    """layer(h, mask) used to be the documented call: now a TypeError that
    says to pass it by keyword and guesses mask=, and the layer is left as
    it was."""
    layer = make_layer()
    h, mask, _ = inputs(0)
    with pytest.raises(TypeError) as err:
        layer(h, mask)
    assert str(err.value) == (
        "ContextAttention.__call__() takes 1 positional argument but 2 were "
        "given; mask is keyword-only (pass it by name, e.g. mask=...). "
        "Argument 2 is a boolean array: did you mean mask=...?")
    assert layer.attention_weights is None
    # A list of booleans is a mask too.
    with pytest.raises(TypeError, match=r"did you mean mask=\.\.\.\?"):
        layer(h, mask.tolist())
    out = layer(h, mask=mask)
    np.testing.assert_array_equal(
        out, ac.context_attention(h, layer.W, layer.v, b=layer.b,
                                  mask=mask)[0])


def test_other_positional_optional_arguments_ask_for_a_keyword():
    """The backward, the constructor, the loader and the steps: a
    TypeError that names the keywords; no mask guess for a float array,
    nor where there is no mask."""
    layer = make_layer()
    h, mask, _ = inputs(1)
    out = layer(h, mask=mask)
    with pytest.raises(TypeError) as err:
        layer.backward(np.ones_like(out), np.ones((B, T)))
    assert str(err.value) == (
        "ContextAttention.backward() takes 1 positional argument but 2 were "
        "given; grad_alpha is keyword-only (pass it by name, e.g. "
        "grad_alpha=...)")
    assert layer.grads() == {}
    # ContextAttention(H, A, np.float32) used to mean bias=np.float32.
    with pytest.raises(TypeError, match=r"^ContextAttention\(\) takes 2 "
                       r"positional arguments but 3 were given; bias, dtype, "
                       r"seed, keep_activations are keyword-only \(pass them "
                       r"by name, e\.g\. bias=\.\.\.\)$"):
        ac.ContextAttention(H, A, np.float32)
    # Checked before the PyTorch layers are looked at.
    with pytest.raises(TypeError, match=r"^ContextAttention\.from_torch\(\)"
                       r" takes 2 .*; dtype, keep_activations are "
                       r"keyword-only"):
        ac.ContextAttention.from_torch(None, None, np.float32)
    params, grads = layer.parameters(), {"W": 1.0, "v": 1.0, "b": 1.0}
    W = layer.W.copy()
    with pytest.raises(TypeError, match=r"^sgd_step\(\) takes 2 .*; lr is "
                                        r"keyword-only .*lr=\.\.\.\)$"):
        ac.sgd_step(params, grads, 0.1)
    with pytest.raises(TypeError, match=r"^adam_step\(\) takes 3 positional "
                                        r"arguments but 6 were given; lr, "
                                        r"betas, eps are keyword-only"):
        ac.adam_step(params, grads, {}, 0.1, (0.9, 0.99), 1e-6)
    np.testing.assert_array_equal(layer.W, W)      # no step was taken


# --------------------------------------------------------------------------
# Against the functional API and the reference


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "recompute"])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_equals_functional_api_and_reference(dtype, bias, kind, keep):
    """Forward, attention_weights and backward (with grad_alpha) equal
    context_attention(_backward) exactly and the float64 reference within
    the dtype's tolerance."""
    layer = make_layer(dtype, bias, keep_activations=keep)
    h, mask, rng = inputs(1, kind, dtype)
    g = rng.standard_normal((B, H)).astype(dtype)
    ga = rng.standard_normal((B, T)).astype(dtype)

    out = layer(h, mask=mask)
    dh = layer.backward(g, grad_alpha=ga)
    grads = layer.grads()
    assert out.dtype == dtype and dh.dtype == dtype

    f_out, f_alpha = ac.context_attention(h, layer.W, layer.v, b=layer.b,
                                          mask=mask)
    f_g = ac.context_attention_backward(g, h, layer.W, layer.v, f_alpha,
                                        b=layer.b, mask=mask, grad_alpha=ga)
    # Saved activations may round differently from recomputed ones: out,
    # a sum that can cancel, normwise; alpha (no cancellation) elementwise.
    assert rel_err(out, f_out) <= TOL[dtype]
    np.testing.assert_allclose(layer.attention_weights, f_alpha,
                               rtol=TOL[dtype], atol=0)
    np.testing.assert_allclose(dh, f_g.h, rtol=10 * TOL[dtype],
                               atol=10 * TOL[dtype])

    f64 = [None if x is None else np.asarray(x, np.float64)
           for x in (h, layer.W, layer.v, layer.b, g, ga)]
    r_out, r_alpha = ref.context_attention(*f64[:3], b=f64[3], mask=mask)
    r_dh, r_dW, r_dv, r_db = ref.context_attention_backward(
        f64[4], f64[0], f64[1], f64[2], r_alpha, b=f64[3], mask=mask,
        grad_alpha=f64[5])
    assert_close(out, r_out, dtype, "out")
    assert_close(layer.attention_weights, r_alpha, dtype, "alpha")
    assert_close(dh, r_dh, dtype, "dh")
    assert_close(grads["W"], r_dW, dtype, "dW")
    assert_close(grads["v"], r_dv, dtype, "dv")
    if bias:
        assert_close(grads["b"], r_db, dtype, "db")


def test_fully_masked_rows_give_zeros():
    """A row with no valid item: out = 0, weights = 0, dh = 0, no NaN."""
    layer = make_layer()
    h, _, _ = inputs(2)
    mask = np.ones((B, T), bool)
    mask[1] = False
    out = layer(h, mask=mask)
    dh = layer.backward(np.ones_like(out), grad_alpha=np.ones((B, T)))
    assert np.all(out[1] == 0) and np.all(layer.attention_weights[1] == 0)
    assert np.all(dh[1] == 0)
    assert all(np.isfinite(g).all() for g in layer.grads().values())


def test_inputs_are_converted_to_the_layer_dtype():
    """A float32 layer computes in float32 whatever the input dtype."""
    layer = make_layer(np.float32)
    h, mask, _ = inputs(3)                      # float64
    out = layer(h, mask=mask)
    assert out.dtype == np.float32
    assert layer.backward(out).dtype == np.float32
    out_list = layer(h.tolist(), mask=mask)          # array-likes are accepted
    np.testing.assert_array_equal(out_list, out)


def test_leading_batch_axes():
    """Any number of leading axes, as in the functional API."""
    layer = make_layer()
    rng = np.random.default_rng(4)
    h = rng.standard_normal((2, 3, T, H))
    out = layer(h)
    assert out.shape == (2, 3, H)
    assert layer.attention_weights.shape == (2, 3, T)
    assert layer.backward(np.ones_like(out)).shape == h.shape


# --------------------------------------------------------------------------
# Finite differences of the layer itself


@pytest.mark.parametrize("kind", ["none", "random", "single"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_backward_matches_finite_differences(bias, kind):
    """L = sum(out G) + sum(alpha Ga): the layer's dh and stored parameter
    gradients equal central differences of its own forward (float64)."""
    layer = make_layer(np.float64, bias, seed=5)
    h, mask, rng = inputs(5, kind)
    G = rng.standard_normal((B, H))
    Ga = rng.standard_normal((B, T))

    def loss():
        out = layer(h, mask=mask)
        return np.sum(out * G) + np.sum(layer.attention_weights * Ga)

    loss()
    dh = layer.backward(G, grad_alpha=Ga)
    grads = layer.grads()
    assert rel_err(dh, numerical_grad(loss, h)) <= 1e-6
    for name, p in layer.parameters().items():
        err = rel_err(grads[name], numerical_grad(loss, p))
        assert err <= 1e-6, f"d{name}: relative error {err:.3g}"


# --------------------------------------------------------------------------
# Optimiser steps


def test_sgd_step_by_hand():
    params = {"w": np.array([1.0, 2.0]), "b": np.array([0.5])}
    grads = {"w": np.array([0.5, -1.0]), "b": np.array([2.0])}
    w = params["w"]
    ac.sgd_step(params, grads, lr=0.1)
    np.testing.assert_allclose(params["w"], [0.95, 2.1], rtol=1e-15)
    np.testing.assert_allclose(params["b"], [0.3], rtol=1e-15)
    assert params["w"] is w                     # in place


def test_adam_step_by_hand():
    """Two Adam steps on one number, written out with the bias corrections:
    step 1 moves by lr * g / (|g| + eps'), step 2 by the corrected means."""
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    params = {"x": np.array([1.0])}
    state = {}
    g1, g2 = 0.5, -2.0
    ac.adam_step(params, {"x": np.array([g1])}, state, lr=lr,
                 betas=(b1, b2), eps=eps)
    x1 = 1.0 - lr * g1 / (abs(g1) + eps)
    np.testing.assert_allclose(params["x"], [x1], rtol=1e-15)
    ac.adam_step(params, {"x": np.array([g2])}, state, lr=lr,
                 betas=(b1, b2), eps=eps)
    m = b1 * (1 - b1) * g1 + (1 - b1) * g2
    s = b2 * (1 - b2) * g1 ** 2 + (1 - b2) * g2 ** 2
    m_hat, s_hat = m / (1 - b1 ** 2), s / (1 - b2 ** 2)
    x2 = x1 - lr * m_hat / (np.sqrt(s_hat) + eps)
    np.testing.assert_allclose(params["x"], [x2], rtol=1e-14)
    assert state["t"] == 2


def test_step_without_gradient_raises():
    with pytest.raises(KeyError, match="backward"):
        ac.sgd_step({"W": np.zeros(2)}, {})
    with pytest.raises(KeyError, match="backward"):
        ac.adam_step(make_layer().parameters(), {}, {})


BOTH = ["grad_shape", "grad_broadcast", "int_param", "float_param", "lr"]


@pytest.mark.parametrize("step,bad", [("sgd", b) for b in BOTH]
                         + [("adam", b) for b in BOTH
                            + ["betas", "beta1", "eps"]])
def test_bad_step_refused_before_any_update(step, bad):
    """A gradient of another shape (even one that broadcasts), a parameter
    that cannot be updated in place, or a bad lr, betas or eps: an error
    naming it, raised before any parameter (or Adam's state) changes."""
    params = {"a": np.ones(3), "b": np.ones((2, 3))}
    grads = {"a": np.ones(3), "b": np.ones((2, 3))}
    kw = {"lr": 0.1}
    if bad == "grad_shape":
        grads["b"], err, word = np.ones(4), ValueError, "'b'"
    if bad == "grad_broadcast":
        grads["b"], err, word = np.ones(3), ValueError, "'b'"
    if bad == "int_param":
        params["b"], err, word = np.ones((2, 3), int), TypeError, "'b'"
    if bad == "float_param":
        params["b"], err, word = 1.0, TypeError, "'b'"
        grads["b"] = 1.0
    if bad == "lr":
        kw["lr"], err, word = -1.0, ValueError, "lr"
    if bad == "betas":
        kw["betas"], err, word = 0.9, TypeError, "betas"
    if bad == "beta1":
        kw["betas"], err, word = (1.0, 0.999), ValueError, "betas"
    if bad == "eps":
        kw["eps"], err, word = 0.0, ValueError, "eps"
    before = {n: np.array(p, copy=True) for n, p in params.items()}
    state = {}
    with pytest.raises(err, match=word):
        if step == "sgd":
            ac.sgd_step(params, grads, **kw)
        else:
            ac.adam_step(params, grads, state, **kw)
    for n, p in params.items():
        assert np.array_equal(p, before[n]), n
    assert state == {}


def test_adam_equals_torch_adam():
    """Ten steps of adam_step equal torch.optim.Adam on the same gradients."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    x0 = rng.standard_normal(4)
    grads = rng.standard_normal((10, 4))
    params, state = {"x": x0.copy()}, {}
    xt = torch.tensor(x0, requires_grad=True)
    opt = torch.optim.Adam([xt], lr=0.05, betas=(0.8, 0.99), eps=1e-6)
    for g in grads:
        ac.adam_step(params, {"x": g}, state, lr=0.05, betas=(0.8, 0.99),
                     eps=1e-6)
        xt.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(params["x"], xt.detach().numpy(), rtol=1e-12)


@pytest.mark.parametrize("step", ["sgd", "adam"])
def test_training_reduces_the_loss(step):
    """Fit the layer's output to a target made by another layer: the loss
    falls by more than half in 100 steps."""
    rng = np.random.default_rng(7)
    h = rng.standard_normal((16, T, H))
    mask = rng.random((16, T)) < 0.8
    teacher = ac.ContextAttention(H, A, seed=11)
    teacher.W *= 6
    target = teacher(h, mask=mask)
    layer, state = make_layer(seed=12), {}

    def loss_and_step():
        diff = layer(h, mask=mask) - target
        layer.backward(2 * diff / diff.size)
        if step == "sgd":
            ac.sgd_step(layer.parameters(), layer.grads(), lr=2.0)
        else:
            ac.adam_step(layer.parameters(), layer.grads(), state, lr=0.05)
        return np.mean(diff ** 2)

    first = loss_and_step()
    for _ in range(100):
        last = loss_and_step()
    assert last < 0.5 * first, (first, last)


# --------------------------------------------------------------------------
# Loading from PyTorch


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_from_torch_reproduces_the_pytorch_model(dtype, bias):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tdtype = getattr(torch, dtype)
    score = torch.nn.Linear(2 * H, A, bias=bias, dtype=tdtype)
    out_lin = torch.nn.Linear(A, 1, dtype=tdtype)   # its bias is ignored
    layer = ac.ContextAttention.from_torch(score, out_lin)
    assert layer.dtype == np.dtype(dtype) and (layer.b is None) != bias
    np.testing.assert_array_equal(layer.W, score.weight.detach().numpy())
    assert not np.shares_memory(layer.W, score.weight.detach().numpy())

    h, mask, _ = inputs(8, "random", dtype)
    out = layer(h, mask=mask)
    with torch.no_grad():
        t_out, t_alpha = torch_context_attention(
            torch.from_numpy(h), score.weight, out_lin.weight[0],
            b=score.bias, mask=torch.from_numpy(mask))
    assert_close(out, t_out.numpy(), dtype, "out")
    assert_close(layer.attention_weights, t_alpha.numpy(), dtype, "alpha")


def test_from_torch_rejects_wrong_shapes():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"out.weight has shape \(2, 6\)"):
        ac.ContextAttention.from_torch(torch.nn.Linear(2 * H, A),
                                       torch.nn.Linear(A, 2))
    with pytest.raises(ValueError, match="score.weight"):
        ac.ContextAttention.from_torch(torch.nn.Linear(7, A),
                                       torch.nn.Linear(A, 1))


def test_importing_attention_c_does_not_import_torch():
    """torch is optional: only ``import attention_c.torch`` loads it."""
    import subprocess
    import sys
    code = ("import sys, attention_c; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
