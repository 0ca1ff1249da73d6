"""The NumPy layers of the attention family: AdditiveAttention,
DotAttention and GeneralAttention.

A layer must equal its functions forward and backward (exactly: the same
calls), its backward must equal finite differences of its own forward in
float64, its dicts must be the live arrays so that sgd_step / adam_step
train it, and loading PyTorch layers must give what the attention_c.torch
module loaded from them computes.
"""

import inspect

import numpy as np
import pytest

import attention_c as ac
from attention_c.testing import DTYPES, TOL, make_mask, numerical_grad, rel_err

pytestmark = pytest.mark.filterwarnings("error")

B, TQ, T, H, HQ, A, HV = 3, 4, 5, 3, 2, 7, 2
KINDS = ["additive", "dot", "general"]
# (several queries, mask kind); "causal" is a per-query mask (..., Tq, T)
# with a fully masked query
CASES = [(True, "none"), (True, "random"), (True, "causal"),
         (True, "all_masked"), (False, "random"), (False, "single")]
CASE_IDS = [f"{'several' if s else 'single'}-{m}" for s, m in CASES]


def make_layer(kind, dtype=np.float64, seed=0, bias=True):
    if kind == "additive":
        return ac.AdditiveAttention(H, HQ, A, bias=bias, dtype=dtype,
                                    seed=seed)
    if kind == "general":
        return ac.GeneralAttention(HQ, H, dtype=dtype, seed=seed)
    return ac.DotAttention(dtype=dtype)


def inputs(kind, seed=0, several=True, mask="random", values=True,
           dtype=np.float64):
    """Arguments of a layer call by name, and the generator."""
    rng = np.random.default_rng(seed)
    hq = H if kind == "dot" else HQ
    lead = (B, TQ) if several else (B,)
    args = {"query": rng.standard_normal(lead + (hq,)).astype(dtype),
            "keys": rng.standard_normal((B, T, H)).astype(dtype),
            "values": (rng.standard_normal((B, T, HV)).astype(dtype)
                       if values else None)}
    if mask == "causal":
        m = np.tril(np.ones((TQ, T), bool), 1) & np.ones((B, 1, 1), bool)
        m[1, 0] = False
        args["attn_mask"] = m           # a per-query mask (section 5)
    else:
        args["mask"] = make_mask(rng, (B,), T, mask)
    return args, rng


def functions(kind, layer, args, grad_out, grad_alpha):
    """(out, alpha, grads) of the functional API with the layer's
    parameters."""
    q, k, vals = args["query"], args["keys"], args["values"]
    m = {n: args[n] for n in ("mask", "attn_mask") if n in args}
    if kind == "additive":
        out, alpha = ac.additive_attention(q, k, layer.W, layer.v, b=layer.b,
                                           **m, values=vals)
        g = ac.additive_attention_backward(grad_out, q, k, layer.W, layer.v,
                                           alpha, b=layer.b, **m,
                                           values=vals,
                                           grad_alpha=grad_alpha)
    elif kind == "general":
        out, alpha = ac.general_attention(q, k, layer.W, **m, values=vals)
        g = ac.general_attention_backward(grad_out, q, k, layer.W, alpha,
                                          **m,
                                          values=vals, grad_alpha=grad_alpha)
    else:
        out, alpha = ac.dot_attention(q, k, **m, values=vals,
                                      scale=layer.scale)
        g = ac.dot_attention_backward(grad_out, q, k, alpha, **m,
                                      values=vals,
                                      scale=layer.scale, grad_alpha=grad_alpha)
    return out, alpha, g


# --------------------------------------------------------------------------
# Construction


@pytest.mark.parametrize("dtype", DTYPES)
def test_init_like_torch_linear(dtype):
    """Shapes, dtype, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) bounds."""
    add = make_layer("additive", dtype)
    assert add.W.shape == (A, H + HQ) and add.v.shape == (A,)
    assert add.b.shape == (A,)
    assert np.abs(add.W).max() <= 1 / np.sqrt(H + HQ)
    assert np.abs(add.b).max() <= 1 / np.sqrt(H + HQ)
    assert np.abs(add.v).max() <= 1 / np.sqrt(A)
    assert np.abs(add.W).max() > 0.5 / np.sqrt(H + HQ)
    gen = make_layer("general", dtype)
    assert gen.W.shape == (HQ, H)
    assert 0.5 / np.sqrt(H) < np.abs(gen.W).max() <= 1 / np.sqrt(H)
    for layer in (add, gen):
        assert all(p.dtype == dtype for p in layer.parameters().values())


@pytest.mark.parametrize("kind", ["additive", "general"])
def test_init_is_seeded_and_dtype_independent(kind):
    a, b = make_layer(kind, seed=3), make_layer(kind, seed=3)
    c = make_layer(kind, np.float32, seed=3)
    for name, p in a.parameters().items():
        np.testing.assert_array_equal(p, b.parameters()[name])
        np.testing.assert_array_equal(p.astype(np.float32),
                                      c.parameters()[name])
    assert not np.array_equal(a.W, make_layer(kind, seed=4).W)


def test_init_rejects_bad_arguments():
    with pytest.raises(TypeError, match="float32 or float64"):
        ac.AdditiveAttention(H, HQ, A, dtype=np.int32)
    with pytest.raises(TypeError, match="float32 or float64"):
        ac.GeneralAttention(HQ, H, dtype=np.float16)
    with pytest.raises(TypeError, match="float32 or float64"):
        ac.DotAttention(dtype=complex)
    with pytest.raises(ValueError, match="query_size"):
        ac.AdditiveAttention(H, 0, A)
    with pytest.raises(ValueError, match="key_size"):
        ac.GeneralAttention(HQ, 0)


def test_parameters_and_grads_dicts():
    """parameters() gives the live arrays; grads() is empty until a
    backward, then has the same keys and shapes; no 'b' without a bias;
    DotAttention has none."""
    add = make_layer("additive")
    params = add.parameters()
    assert list(params) == ["W", "v", "b"]
    assert params["W"] is add.W and params["b"] is add.b
    assert add.grads() == {}
    args, _ = inputs("additive")
    out = add(**args)
    add.backward(np.ones_like(out))
    grads = add.grads()
    assert list(grads) == ["W", "v", "b"]
    assert all(grads[n].shape == params[n].shape for n in params)
    grads["W"] = None                              # a copy of the dict
    assert add.grads()["W"] is not None
    nob = make_layer("additive", bias=False)
    assert list(nob.parameters()) == ["W", "v"]
    nob(**args)
    nob.backward(np.ones_like(out))
    assert list(nob.grads()) == ["W", "v"]
    gen = make_layer("general")
    assert list(gen.parameters()) == ["W"]
    dot = make_layer("dot")
    assert dot.parameters() == {}
    dot(**inputs("dot")[0])
    dot.backward(np.ones((B, TQ, HV)))
    assert dot.grads() == {}


@pytest.mark.parametrize("kind", KINDS)
def test_backward_before_call_raises(kind):
    with pytest.raises(RuntimeError, match="before"):
        make_layer(kind).backward(np.zeros((B, HV)))


# --------------------------------------------------------------------------
# One argument order: query and keys by position, the rest by keyword


def positional(f):
    """The names f takes by position (after self or cls)."""
    return [p.name for p in inspect.signature(f).parameters.values()
            if p.kind is not p.KEYWORD_ONLY]


# today's variants (docs/contract.md section 8), last
VARIANT_KEYWORDS = ["window", "softcap", "alibi_slopes", "sinks",
                    "cu_seqlens_q", "cu_seqlens_k"]
KEYWORDS = {
    "additive": ["values", "mask", "attn_mask", "causal", "key_proj"],
    "dot": ["values", "mask", "attn_mask", "causal", "bias",
            "return_weights", *VARIANT_KEYWORDS],
    "general": ["values", "mask", "attn_mask", "causal", "bias", "key_proj",
                "return_weights", *VARIANT_KEYWORDS]}


@pytest.mark.parametrize("kind", KINDS)
def test_optional_arguments_are_keyword_only(kind):
    layer = make_layer(kind)
    assert positional(layer) == ["query", "keys"]
    assert list(inspect.signature(layer).parameters)[2:] == KEYWORDS[kind]
    assert positional(layer.backward) == ["grad_out"]
    assert positional(type(layer)) == {
        "additive": ["key_size", "query_size", "attention_size"],
        "general": ["query_size", "key_size"], "dot": []}[kind]


def test_loaders_take_the_torch_layers_by_position_only():
    assert positional(ac.AdditiveAttention.from_torch) == [
        "score", "out", "key_size"]
    assert positional(ac.AdditiveAttention.from_d2l) == ["W_k", "W_q", "w_v"]
    assert positional(ac.GeneralAttention.from_torch) == ["linear"]


@pytest.mark.parametrize("several", [True, False], ids=["several", "single"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_positional_mask_asks_for_a_keyword(kind, several):
    """layer(query, keys, mask) used to read the mask as the values (and
    layer(query, keys, values, mask) was the documented call): now a
    TypeError that says to pass them by keyword and guesses mask=."""
    layer = make_layer(kind)
    args, _ = inputs(kind, several=several)
    q, k, vals, m = (args[n] for n in ["query", "keys", "values", "mask"])
    name = type(layer).__name__
    keywords = ", ".join(KEYWORDS[kind])
    no_guess = (f"{name}.__call__() takes 2 positional arguments but 3 were "
                f"given; {keywords} are keyword-only (pass them by name, "
                f"e.g. values=...)")
    with pytest.raises(TypeError) as err:
        layer(q, k, m)
    assert str(err.value) == (no_guess + ". Argument 3 is a boolean array: "
                              "did you mean mask=...?")
    with pytest.raises(TypeError, match=r"4 were given.*Argument 4 is a "
                                        r"boolean array: did you mean "
                                        r"mask=\.\.\.\?$"):
        layer(q, k, vals, m)
    with pytest.raises(TypeError) as err:         # float values: no guess
        layer(q, k, vals)
    assert str(err.value) == no_guess
    assert layer.attention_weights is None        # nothing ran
    out = layer(q, k, values=vals, mask=m)
    assert out.shape == q.shape[:-1] + (HV,)


@pytest.mark.parametrize("kind", KINDS)
def test_a_positional_grad_alpha_asks_for_a_keyword(kind):
    layer = make_layer(kind)
    args, _ = inputs(kind)
    out = layer(**args)
    with pytest.raises(TypeError) as err:
        layer.backward(np.ones_like(out), np.ones(
            layer.attention_weights.shape))
    assert str(err.value) == (
        f"{type(layer).__name__}.backward() takes 1 positional argument but "
        f"2 were given; grad_alpha is keyword-only (pass it by name, e.g. "
        f"grad_alpha=...)")
    assert layer.grads() == {}


def test_constructors_and_loaders_ask_for_keywords():
    """Where a positional option was silently misread, or could be: e.g.
    GeneralAttention(Hq, H, np.float32) and AdditiveAttention(H, Hq, A,
    np.float32) (a truthy bias)."""
    cases = [
        (lambda: ac.AdditiveAttention(H, HQ, A, np.float32),
         r"^AdditiveAttention\(\) takes 3 positional arguments but 4 were "
         r"given; bias, dtype, seed are keyword-only \(pass them by name, "
         r"e\.g\. bias=\.\.\.\)$"),
        (lambda: ac.GeneralAttention(HQ, H, np.float32),
         r"^GeneralAttention\(\) takes 2 .*; dropout, dtype, seed are "
         r"keyword-only"),
        (lambda: ac.DotAttention(0.5),
         r"^DotAttention\(\) takes 0 positional arguments but 1 was given; "
         r"scale, dropout, seed, dtype are keyword-only"),
        # checked before the PyTorch layers are looked at
        (lambda: ac.AdditiveAttention.from_torch(None, None, H, np.float32),
         r"^AdditiveAttention\.from_torch\(\) takes 3 .*; dtype is "
         r"keyword-only \(pass it by name, e\.g\. dtype=\.\.\.\)$"),
        (lambda: ac.AdditiveAttention.from_d2l(None, None, None, np.float32),
         r"^AdditiveAttention\.from_d2l\(\) takes 3 .*; dtype is "
         r"keyword-only"),
        (lambda: ac.GeneralAttention.from_torch(None, np.float32),
         r"^GeneralAttention\.from_torch\(\) takes 1 positional argument "
         r"but 2 were given; dtype is keyword-only"),
    ]
    for call, message in cases:
        with pytest.raises(TypeError, match=message):
            call()


def test_repr():
    assert repr(make_layer("additive", np.float32)) == (
        "AdditiveAttention(key_size=3, query_size=2, attention_size=7, "
        "bias=True, dtype=float32)")
    assert repr(ac.DotAttention(scale=0.5)) == (
        "DotAttention(scale=0.5, dtype=float64)")
    assert repr(make_layer("general")) == (
        "GeneralAttention(query_size=2, key_size=3, dtype=float64)")


# --------------------------------------------------------------------------
# Against the functions


@pytest.mark.parametrize("values", [True, False], ids=["values", "keys"])
@pytest.mark.parametrize("several,mask", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_layer_equals_functions(kind, dtype, several, mask, values):
    """Forward, attention_weights, the input gradients and the stored
    parameter gradients (with grad_alpha) are the functions' results."""
    layer = make_layer(kind, dtype, seed=1)
    args, rng = inputs(kind, 2, several, mask, values, dtype)
    out = layer(**args)
    g = rng.standard_normal(out.shape).astype(dtype)
    ga = rng.standard_normal(layer.attention_weights.shape).astype(dtype)
    grads = layer.backward(g, grad_alpha=ga)
    f_out, f_alpha, f_g = functions(kind, layer, args, g, ga)
    assert out.dtype == dtype and grads.query.dtype == dtype
    np.testing.assert_array_equal(out, f_out)
    np.testing.assert_array_equal(layer.attention_weights, f_alpha)
    assert isinstance(grads, ac.AttentionInputGrads)
    for name in ["query", "keys", "values"]:
        mine, theirs = getattr(grads, name), getattr(f_g, name)
        if theirs is None:
            assert mine is None and not values
        else:
            np.testing.assert_array_equal(mine, theirs)
    for name, dp in layer.grads().items():
        np.testing.assert_array_equal(dp, getattr(f_g, name))


@pytest.mark.parametrize("kind", ["additive", "general"])
def test_key_proj_gives_the_same_results(kind):
    """layer(..., key_proj=layer.project_keys(keys)) and its backward equal
    the call without it."""
    layer = make_layer(kind, seed=2)
    args, rng = inputs(kind, 3, mask="causal", values=False)
    out = layer(**args)
    g = rng.standard_normal(out.shape)
    grads, pgrads = layer.backward(g), layer.grads()
    kp = layer.project_keys(args["keys"])
    np.testing.assert_allclose(kp, ac.project_keys(args["keys"], layer.W),
                               rtol=1e-15)
    out_kp = layer(**args, key_proj=kp)
    grads_kp = layer.backward(g)
    tight = dict(rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(out_kp, out, **tight)
    for a, b in zip(grads_kp, grads):
        if b is not None:
            np.testing.assert_allclose(a, b, **tight)
    for name, dp in layer.grads().items():
        np.testing.assert_allclose(dp, pgrads[name], **tight)


def test_inputs_are_converted_to_the_layer_dtype():
    """A float32 layer computes in float32 whatever the inputs' dtype, and
    takes array-likes."""
    for kind in KINDS:
        layer = make_layer(kind, np.float32)
        args, _ = inputs(kind, 4)                  # float64
        out = layer(**args)
        assert out.dtype == np.float32
        g = layer.backward(out.astype(np.float64))
        assert g.query.dtype == np.float32 and g.keys.dtype == np.float32
        assert all(p.dtype == np.float32 for p in layer.grads().values())
        listed = {n: x.tolist() if n != "mask" else x
                  for n, x in args.items()}
        np.testing.assert_array_equal(layer(**listed), out)


def test_leading_batch_axes():
    layer = make_layer("additive")
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 3, HQ))
    k = rng.standard_normal((2, 3, T, H))
    out = layer(q, k)
    assert out.shape == (2, 3, H)
    assert layer.attention_weights.shape == (2, 3, T)
    g = layer.backward(np.ones_like(out))
    assert g.query.shape == q.shape and g.keys.shape == k.shape
    assert g.values is None


# --------------------------------------------------------------------------
# Finite differences of the layers themselves


@pytest.mark.parametrize("several,mask", [(True, "causal"),
                                          (False, "random")],
                         ids=["several-causal", "single-random"])
@pytest.mark.parametrize("kind", KINDS)
def test_backward_matches_finite_differences(kind, several, mask):
    """L = sum(out G) + sum(alpha Ga): the layer's input gradients and its
    stored parameter gradients equal central differences of its own
    forward (float64)."""
    layer = make_layer(kind, seed=5)
    args, rng = inputs(kind, 6, several, mask)
    out = layer(**args)
    G = rng.standard_normal(out.shape)
    Ga = rng.standard_normal(layer.attention_weights.shape)

    def loss():
        out = layer(**args)
        return np.sum(out * G) + np.sum(layer.attention_weights * Ga)

    loss()
    grads = layer.backward(G, grad_alpha=Ga)
    pgrads = layer.grads()
    for name in ["query", "keys", "values"]:
        err = rel_err(getattr(grads, name), numerical_grad(loss, args[name]))
        assert err <= 1e-6, f"d{name}: relative error {err:.3g}"
    for name, p in layer.parameters().items():
        err = rel_err(pgrads[name], numerical_grad(loss, p))
        assert err <= 1e-6, f"d{name}: relative error {err:.3g}"


# --------------------------------------------------------------------------
# Training with the optimiser steps


@pytest.mark.parametrize("kind", ["additive", "general"])
def test_adam_training_reduces_the_loss(kind):
    """Fit the output of a layer to that of a sharper teacher layer: the
    loss falls by more than half in 100 Adam steps."""
    rng = np.random.default_rng(7)
    args, _ = inputs(kind, 8, mask="causal")
    args["query"] = rng.standard_normal((16, TQ, HQ))
    args["keys"] = rng.standard_normal((16, T, H))
    args["values"] = rng.standard_normal((16, T, HV))
    args["attn_mask"] = args["attn_mask"][0]      # broadcast

    teacher = make_layer(kind, seed=11)
    teacher.W *= 6
    target = teacher(**args)
    layer, state = make_layer(kind, seed=12), {}

    def loss_and_step():
        diff = layer(**args) - target
        layer.backward(2 * diff / diff.size)
        ac.adam_step(layer.parameters(), layer.grads(), state, lr=0.05)
        return np.mean(diff ** 2)

    first = loss_and_step()
    for _ in range(100):
        last = loss_and_step()
    assert last < 0.5 * first, (first, last)


def test_adam_on_the_query_of_dot_attention():
    """DotAttention has no parameters; its query gradient trains a query
    (with adam_step on a dict of inputs) to pick out one key's value."""
    rng = np.random.default_rng(9)
    keys = rng.standard_normal((8, T, H))
    values = rng.standard_normal((8, T, HV))
    target = values[:, 2]
    params = {"query": rng.standard_normal((8, H)) * 0.1}
    layer, state = ac.DotAttention(scale=2.0), {}

    def loss_and_step():
        diff = layer(params["query"], keys, values=values) - target
        g = layer.backward(2 * diff / diff.size)
        ac.adam_step(params, {"query": g.query}, state, lr=0.1)
        return np.mean(diff ** 2)

    first = loss_and_step()
    for _ in range(100):
        last = loss_and_step()
    assert last < 0.2 * first, (first, last)


# --------------------------------------------------------------------------
# Loading from PyTorch


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_from_torch_equals_the_torch_modules(dtype, bias):
    """AdditiveAttention.from_torch / from_d2l and
    GeneralAttention.from_torch compute what the attention_c.torch modules
    loaded from the same PyTorch layers compute, in the Linear's dtype."""
    torch = pytest.importorskip("torch")
    import attention_c.torch as act
    torch.manual_seed(0)
    tdtype = getattr(torch, dtype)
    score = torch.nn.Linear(H + HQ, A, bias=bias, dtype=tdtype)
    out_lin = torch.nn.Linear(A, 1, dtype=tdtype)
    W_k = torch.nn.Linear(H, A, bias=bias, dtype=tdtype)
    W_q = torch.nn.Linear(HQ, A, bias=False, dtype=tdtype)
    linear = torch.nn.Linear(H, HQ, bias=bias, dtype=tdtype)
    pairs = [
        (ac.AdditiveAttention.from_torch(score, out_lin, key_size=H),
         act.AdditiveAttention.from_linear(score, out_lin, key_size=H)),
        (ac.AdditiveAttention.from_d2l(W_k, W_q, out_lin),
         act.AdditiveAttention.from_d2l(W_k, W_q, out_lin)),
        (ac.GeneralAttention.from_torch(linear),
         act.GeneralAttention.from_linear(linear)),
    ]
    args, _ = inputs("additive", 10, mask="causal", dtype=dtype)
    for layer, module in pairs:
        assert layer.dtype == np.dtype(dtype)
        for name, p in layer.parameters().items():
            t = getattr(module, name).detach().numpy()
            np.testing.assert_array_equal(p, t)
            assert not np.shares_memory(p, t)
        assert ("b" in layer.parameters()) == (
            getattr(module, "b", None) is not None)
        out = layer(**args)
        t_args = {n: torch.from_numpy(x) for n, x in args.items()}
        with torch.no_grad():
            t_out, t_alpha = module(
                t_args.pop("query"), t_args.pop("keys"), **t_args,
                return_weights=True)
        # out, a sum that can cancel, normwise; alpha elementwise.
        tol = TOL[np.dtype(dtype).type]
        assert rel_err(out, t_out.numpy()) <= tol
        np.testing.assert_allclose(layer.attention_weights, t_alpha.numpy(),
                                   rtol=tol, atol=0)


def test_from_torch_dtype_and_bare_v():
    torch = pytest.importorskip("torch")
    score = torch.nn.Linear(H + HQ, A)
    out_lin = torch.nn.Linear(A, 1)
    layer = ac.AdditiveAttention.from_torch(score, out_lin.weight[0], H,
                                            dtype=np.float64)
    assert layer.dtype == np.float64 and layer.v.shape == (A,)
    np.testing.assert_array_equal(layer.v, out_lin.weight[0].detach())
    # the loaders share one helper: ContextAttention takes a bare v too
    ctx = ac.ContextAttention.from_torch(torch.nn.Linear(2 * H, A),
                                         out_lin.weight)
    np.testing.assert_array_equal(ctx.v, out_lin.weight[0].detach())


def test_from_torch_rejects_wrong_shapes():
    torch = pytest.importorskip("torch")
    score = torch.nn.Linear(H + HQ, A)
    with pytest.raises(ValueError, match=r"out.weight has shape \(2, 7\)"):
        ac.AdditiveAttention.from_torch(score, torch.nn.Linear(A, 2), H)
    with pytest.raises(ValueError, match=r"score.weight has shape \(7, 5\)"
                                         r".*key_size = 5"):
        ac.AdditiveAttention.from_torch(score, torch.nn.Linear(A, 1), H + HQ)
    with pytest.raises(ValueError, match="W_k.weight has shape"):
        ac.AdditiveAttention.from_d2l(torch.nn.Linear(H, A),
                                      torch.nn.Linear(HQ, A + 1),
                                      torch.nn.Linear(A, 1))
    with pytest.raises(ValueError, match="not initialised"):
        ac.AdditiveAttention.from_d2l(torch.nn.LazyLinear(A),
                                      torch.nn.Linear(HQ, A),
                                      torch.nn.Linear(A, 1))
    with pytest.raises(ValueError, match=r"w_v.weight has shape \(1, 3\)"):
        ac.AdditiveAttention.from_d2l(torch.nn.Linear(H, A),
                                      torch.nn.Linear(HQ, A),
                                      torch.nn.Linear(3, 1))


# --------------------------------------------------------------------------
# Section 5: key mask, attn_mask, causal, bias, dropout, return_weights


def sec5_args(kind, rng, dtype=np.float64):
    """A call with every section 5 argument the layer takes: a key mask, a
    shared per-query mask, causal, and (dot, general) a bias broadcast over
    the batch with a row of -inf (a query that sees no key)."""
    args, _ = inputs(kind, 21, several=True, dtype=dtype)
    args["attn_mask"] = rng.random((TQ, T)) < 0.8
    args["causal"] = True
    if kind != "additive":
        bias = rng.standard_normal((1, TQ, T)).astype(dtype)
        bias[0, 2] = -np.inf
        args["bias"] = bias
    return args


def function_call(kind, layer, args, **extra):
    fn = getattr(ac, f"{kind}_attention")
    weights = ((layer.W, layer.v) if kind == "additive" else
               (layer.W,) if kind == "general" else ())
    opts = ({"b": layer.b} if kind == "additive" else
            {"scale": layer.scale} if kind == "dot" else {})
    q, k = args["query"], args["keys"]
    kw = {n: x for n, x in args.items() if n not in ("query", "keys")}
    return fn(q, k, *weights, **kw, **opts, **extra), (
        lambda g, *saved, **more: getattr(ac, f"{kind}_attention_backward")(
            g, q, k, *weights, *saved, **kw, **opts, **more))


@pytest.mark.parametrize("kind", KINDS)
def test_section5_arguments_equal_the_functions(kind):
    rng = np.random.default_rng(20)
    layer = make_layer(kind)
    args = sec5_args(kind, rng)
    out = layer(**args)
    (ref_out, alpha), backward = function_call(kind, layer, args)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(layer.attention_weights, alpha)
    g = rng.standard_normal(out.shape)
    ga = rng.standard_normal(alpha.shape)
    grads = layer.backward(g, grad_alpha=ga)
    ref = backward(g, alpha, grad_alpha=ga)
    for name in ("query", "keys", "values"):
        np.testing.assert_array_equal(getattr(grads, name),
                                      getattr(ref, name))
    if kind == "additive":
        assert grads.bias is None
    else:
        assert grads.bias.shape == (1, TQ, T)
        np.testing.assert_array_equal(grads.bias, ref.bias)
        assert not grads.bias[0, 2].any()       # the query that sees none
        assert not out[:, 2].any()


@pytest.mark.parametrize("kind", ["dot", "general"])
def test_return_weights_false_keeps_out_and_lse(kind):
    rng = np.random.default_rng(22)
    layer = make_layer(kind)
    args = sec5_args(kind, rng)
    out = layer(**args, return_weights=False)
    assert layer.attention_weights is None
    (ref_out, lse), backward = function_call(kind, layer, args,
                                             return_weights=False)
    np.testing.assert_array_equal(out, ref_out)
    g = rng.standard_normal(out.shape)
    grads = layer.backward(g)
    ref = backward(g, out=ref_out, lse=lse)
    for name in ("query", "keys", "values", "bias"):
        np.testing.assert_array_equal(getattr(grads, name),
                                      getattr(ref, name))
    # Within rounding of the stored-weights path.
    with_weights = make_layer(kind)
    np.testing.assert_allclose(with_weights(**args), out, rtol=1e-12,
                               atol=1e-12)
    g2 = with_weights.backward(g)
    for name in ("query", "keys", "values", "bias"):
        np.testing.assert_allclose(getattr(g2, name), getattr(grads, name),
                                   rtol=1e-10, atol=1e-12)
    if kind == "general":
        np.testing.assert_allclose(with_weights.grads()["W"],
                                   layer.grads()["W"], rtol=1e-10,
                                   atol=1e-12)
    with pytest.raises(ValueError, match="return_weights=True"):
        layer.backward(g, grad_alpha=np.ones((B, TQ, T)))


def test_a_per_query_mask_as_mask_names_attn_mask():
    layer = make_layer("dot")
    args, _ = inputs("dot", 23, several=True)
    args["mask"] = np.tril(np.ones((B, TQ, T), bool))
    with pytest.raises(ValueError, match="attn_mask"):
        layer(**args)


@pytest.mark.parametrize("kind", ["dot", "general"])
def test_dropout_is_reproducible_and_regenerated_in_backward(kind):
    """A seed gives the same sequence of keep patterns (a new one per
    call); the backward uses the forward's; eval() turns dropout off."""
    rng = np.random.default_rng(24)
    args = sec5_args(kind, rng)
    del args["bias"]
    make = {"dot": lambda: ac.DotAttention(dropout=0.3, seed=5),
            "general": lambda: ac.GeneralAttention(HQ, H, dropout=0.3,
                                                   seed=5)}[kind]
    a, b = make(), make()
    outs_a = [a(**args) for _ in range(2)]
    outs_b = [b(**args) for _ in range(2)]
    np.testing.assert_array_equal(outs_a[0], outs_b[0])
    np.testing.assert_array_equal(outs_a[1], outs_b[1])
    assert not np.array_equal(outs_a[0], outs_a[1])   # a new pattern
    # The seed of the second call, as the layer draws it.
    draw = np.random.default_rng(5)
    if kind == "general":
        draw.uniform(size=(HQ, H))                     # W first
    seeds = [int(draw.integers(0, 2**63)) for _ in range(2)]
    (ref_out, alpha), backward = function_call(kind, a, args, dropout=0.3,
                                               seed=seeds[1])
    np.testing.assert_array_equal(outs_a[1], ref_out)
    np.testing.assert_array_equal(a.attention_weights, alpha)   # pre-drop
    g = rng.standard_normal(ref_out.shape)
    grads = a.backward(g)
    ref = backward(g, alpha, dropout=0.3, seed=seeds[1])
    np.testing.assert_array_equal(grads.query, ref.query)
    np.testing.assert_array_equal(grads.keys, ref.keys)
    np.testing.assert_array_equal(grads.values, ref.values)
    # eval: no dropout, the plain function
    assert a.eval() is a and not a.training
    (plain, _), _ = function_call(kind, a, args)
    np.testing.assert_array_equal(a(**args), plain)
    assert a.train().training
    assert not np.array_equal(a(**args), plain)


def test_dropout_out_of_range_is_refused():
    with pytest.raises(ValueError, match="dropout"):
        ac.DotAttention(dropout=1.0)
    with pytest.raises(ValueError, match="dropout"):
        ac.GeneralAttention(HQ, H, dropout=-0.1)
    assert "dropout=0.1" in repr(ac.DotAttention(dropout=0.1))


def test_bias_gradient_matches_finite_differences():
    rng = np.random.default_rng(25)
    args, _ = inputs("dot", 26, several=True)
    bias = rng.standard_normal((TQ, T))
    layer = make_layer("dot")
    G = rng.standard_normal((B, TQ, HV))

    def loss():
        return float((layer(**args, bias=bias, causal=True) * G).sum())

    loss()
    grads = layer.backward(G)
    num = numerical_grad(loss, bias)
    assert rel_err(grads.bias, num) <= 1e-6
