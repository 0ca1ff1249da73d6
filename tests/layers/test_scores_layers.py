"""The NumPy layers of the location and content (cosine) scores:
LocationAttention and CosineAttention (attention_c.layers.scores).

A layer must equal its functions forward and backward (exactly: the same
calls), its backward must equal finite differences of its own forward in
float64, its dicts must be the live arrays so that sgd_step / adam_step
train it (W and b; the learned sharpness), its dtype must hold through a
call, a backward and a step, bad input must be refused before anything
changes, and a layer loaded from a PyTorch Linear must compute what
PyTorch computes.
"""

import doctest
import inspect

import numpy as np
import pytest

import attention_c as ac
from attention_c.layers import scores
from attention_c.testing import DTYPES, TOL, make_mask, numerical_grad, rel_err

pytestmark = pytest.mark.filterwarnings("error")

B, TQ, T, T_MAX, H, HQ, HV = 3, 4, 5, 7, 3, 2, 2
FD_TOL = 1e-6
# (several queries, mask kind); "causal" is a per-query mask (..., Tq, T)
# with a fully masked query
CASES = [(True, "none"), (True, "random"), (True, "causal"),
         (True, "all_masked"), (False, "random"), (False, "single")]
CASE_IDS = [f"{'several' if s else 'single'}-{m}" for s, m in CASES]
# CosineAttention's sharpness: None, a number, learned
SHARPNESS = {"none": {}, "number": {"sharpness": 3.0},
             "learned": {"sharpness": 2.5, "learn_sharpness": True}}


def location(dtype=np.float64, seed=0, bias=True):
    return ac.LocationAttention(HQ, T_MAX, bias=bias, dtype=dtype, seed=seed)


def cosine(sharpness="learned", dtype=np.float64, **kw):
    return ac.CosineAttention(**SHARPNESS[sharpness], dtype=dtype, **kw)


def masks(rng, several, mask):
    if mask == "causal":
        m = np.tril(np.ones((TQ, T), bool), 1) & np.ones((B, 1, 1), bool)
        m[1, 0] = False
        return {"attn_mask": m}         # a per-query mask
    return {"mask": make_mask(rng, (B,), T, mask)}


def loc_inputs(seed=0, several=True, mask="random", dtype=np.float64):
    rng = np.random.default_rng(seed)
    lead = (B, TQ) if several else (B,)
    args = {"query": rng.standard_normal(lead + (HQ,)).astype(dtype),
            "values": rng.standard_normal((B, T, HV)).astype(dtype),
            **masks(rng, several, mask)}
    return args, rng


def cos_inputs(seed=0, several=True, mask="random", values=True,
               dtype=np.float64, zero_key=True):
    rng = np.random.default_rng(seed)
    lead = (B, TQ) if several else (B,)
    keys = rng.standard_normal((B, T, H))
    if zero_key:
        keys[0, 1] = 0.0                # scores 0 (its gradient is 1e12 x)
    args = {"query": rng.standard_normal(lead + (H,)).astype(dtype),
            "keys": keys.astype(dtype),
            "values": (rng.standard_normal((B, T, HV)).astype(dtype)
                       if values else None),
            **masks(rng, several, mask)}
    return args, rng


def loc_functions(layer, args, grad_out, grad_alpha):
    q, v = args["query"], args["values"]
    m = {n: args[n] for n in ("mask", "attn_mask") if n in args}
    out, alpha = ac.location_attention(q, v, layer.W, b=layer.b, **m)
    g = ac.location_attention_backward(grad_out, q, v, layer.W, alpha,
                                       b=layer.b, **m, grad_alpha=grad_alpha)
    return out, alpha, g


def cos_functions(layer, args, grad_out, grad_alpha=None, **extra):
    q, k = args["query"], args["keys"]
    kw = {n: x for n, x in args.items() if n not in ("query", "keys")}
    kw.update(extra, sharpness=layer.sharpness)
    out, saved = ac.cosine_attention(q, k, **kw)
    rw = kw.pop("return_weights", True)
    if rw and "sinks" not in kw:
        g = ac.cosine_attention_backward(grad_out, q, k, saved, **kw,
                                         grad_alpha=grad_alpha)
    else:       # with sinks, the layer's backward runs from out and lse
        out2, lse = ac.cosine_attention(q, k, **kw, return_weights=False)
        g = ac.cosine_attention_backward(grad_out, q, k, out=out2, lse=lse,
                                         **kw)
    return out, saved, g


def positional(f):
    """The names f takes by position (after self or cls)."""
    return [p.name for p in inspect.signature(f).parameters.values()
            if p.kind is not p.KEYWORD_ONLY]


# --------------------------------------------------------------------------
# Construction and the parameter dicts


@pytest.mark.parametrize("dtype", DTYPES)
def test_location_init_like_torch_linear(dtype):
    """W (T_max, Hq) and b (T_max,) are U(-1/sqrt(Hq), 1/sqrt(Hq)), drawn
    in float64 from the seed whatever the dtype."""
    layer = location(dtype, seed=3)
    assert layer.W.shape == (T_MAX, HQ) and layer.b.shape == (T_MAX,)
    assert layer.W.dtype == dtype and layer.b.dtype == dtype
    bound = 1 / np.sqrt(HQ)
    for p in (layer.W, layer.b):
        assert 0.5 * bound < np.abs(p).max() <= bound
    same, f64 = location(seed=3), location(np.float64, seed=3)
    np.testing.assert_array_equal(same.W.astype(dtype), layer.W)
    np.testing.assert_array_equal(f64.b.astype(dtype), layer.b)
    assert not np.array_equal(location(seed=4).W, same.W)
    assert location(bias=False).b is None


def test_parameters_and_grads_dicts():
    """parameters() gives the live arrays, grads() the last backward's,
    with the same keys and shapes; no 'b' without a bias; a cosine layer
    has parameters only with a learned sharpness, of shape ()."""
    layer = location()
    params = layer.parameters()
    assert list(params) == ["W", "b"]
    assert params["W"] is layer.W and params["b"] is layer.b
    assert layer.grads() == {}
    args, _ = loc_inputs()
    layer.backward(np.ones_like(layer(**args)))
    grads = layer.grads()
    assert list(grads) == ["W", "b"]
    assert all(grads[n].shape == params[n].shape for n in params)
    nob = location(bias=False)
    assert list(nob.parameters()) == ["W"]
    nob.backward(np.ones_like(nob(**args)))
    assert list(nob.grads()) == ["W"]

    cargs, _ = cos_inputs()
    for sharp in ("none", "number"):
        layer = cosine(sharp)
        assert layer.parameters() == {}
        layer.backward(np.ones_like(layer(**cargs)))
        assert layer.grads() == {}
    assert cosine("number").sharpness == 3.0
    learned = cosine("learned")
    params = learned.parameters()
    assert list(params) == ["sharpness"]
    assert params["sharpness"] is learned.sharpness
    assert params["sharpness"].shape == () and learned.sharpness == 2.5
    assert isinstance(params["sharpness"], np.ndarray)
    learned.backward(np.ones_like(learned(**cargs)))
    g = learned.grads()
    assert list(g) == ["sharpness"] and g["sharpness"].shape == ()
    assert ac.CosineAttention(learn_sharpness=True).sharpness == 1.0


def test_init_rejects_bad_arguments():
    with pytest.raises(TypeError, match="float32 or float64"):
        ac.LocationAttention(HQ, T_MAX, dtype=np.int32)
    with pytest.raises(TypeError, match="float32 or float64"):
        ac.CosineAttention(dtype=np.float16)
    with pytest.raises(ValueError, match="max_length"):
        ac.LocationAttention(HQ, 0)
    with pytest.raises(ValueError, match="query_size"):
        ac.LocationAttention(0, T_MAX)
    for bad in (np.inf, -np.inf, np.nan):
        for learn in (False, True):
            with pytest.raises(ValueError, match="sharpness must be finite"):
                ac.CosineAttention(sharpness=bad, learn_sharpness=learn)
    with pytest.raises(ValueError, match="dropout"):
        ac.CosineAttention(dropout=1.0)
    with pytest.raises(TypeError, match=r"^LocationAttention\(\) takes 2 "
                                        r".*; bias, dtype, seed are "
                                        r"keyword-only"):
        ac.LocationAttention(HQ, T_MAX, np.float32)
    with pytest.raises(TypeError, match=r"^CosineAttention\(\) takes 0 "
                                        r"positional arguments but 1 was "
                                        r"given; sharpness, learn_sharpness,"
                                        r" dropout, seed, dtype are "
                                        r"keyword-only"):
        ac.CosineAttention(2.0)


def test_signatures_and_repr():
    """Data by position, the rest by keyword, as the family's layers;
    the cosine forward takes DotAttention's keywords."""
    assert positional(location()) == ["query", "values"]
    assert list(inspect.signature(location()).parameters)[2:] == [
        "mask", "attn_mask"]
    assert positional(location().backward) == ["grad_out"]
    assert positional(ac.LocationAttention) == ["query_size", "max_length"]
    assert positional(ac.LocationAttention.from_torch) == ["linear"]
    dot, cos = ac.DotAttention(), cosine()
    assert (list(inspect.signature(cos).parameters)
            == list(inspect.signature(dot).parameters))
    assert positional(cos.backward) == ["grad_out"]
    assert positional(ac.CosineAttention) == []
    assert "%(" not in ac.CosineAttention.__call__.__doc__
    assert "softcap" in ac.CosineAttention.__call__.__doc__
    assert repr(location(np.float32)) == (
        "LocationAttention(query_size=2, max_length=7, bias=True, "
        "dtype=float32)")
    assert repr(ac.CosineAttention()) == (
        "CosineAttention(sharpness=None, dtype=float64)")
    assert repr(cosine("learned", dropout=0.1)) == (
        "CosineAttention(sharpness=2.5, learn_sharpness=True, dropout=0.1, "
        "dtype=float64)")


def test_a_positional_mask_asks_for_a_keyword():
    args, _ = loc_inputs()
    layer = location()
    with pytest.raises(TypeError, match=r"LocationAttention.__call__\(\) "
                                        r"takes 2 .*Argument 3 is a boolean "
                                        r"array: did you mean mask=\.\.\.\?"):
        layer(args["query"], args["values"], args["mask"])
    cargs, _ = cos_inputs()
    with pytest.raises(TypeError, match=r"CosineAttention.__call__\(\) "
                                        r"takes 2 .*did you mean mask="):
        cosine()(cargs["query"], cargs["keys"], cargs["mask"])
    out = layer(**args)
    with pytest.raises(TypeError, match="grad_alpha is keyword-only"):
        layer.backward(np.ones_like(out), layer.attention_weights)


def test_backward_before_call_raises():
    for layer in (location(), cosine()):
        with pytest.raises(RuntimeError, match="before"):
            layer.backward(np.zeros((B, HV)))


def test_module_doctests():
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    tests = [t for t in finder.find(scores) if t.examples]
    assert {t.name.split(".")[-1] for t in tests} >= {
        "LocationAttention", "CosineAttention", "LocationInputGrads"}
    for t in tests:
        runner.run(t, out=lambda s: None)
    assert runner.summarize(verbose=False).failed == 0


# --------------------------------------------------------------------------
# Against the functions


@pytest.mark.parametrize("several,mask", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_location_equals_functions(dtype, several, mask):
    """Forward, attention_weights, the input gradients and the stored W,
    b gradients (with grad_alpha) are the functions' results; W's rows
    past T get 0."""
    layer = location(dtype, seed=1)
    args, rng = loc_inputs(2, several, mask, dtype)
    out = layer(**args)
    g = rng.standard_normal(out.shape).astype(dtype)
    ga = rng.standard_normal(layer.attention_weights.shape).astype(dtype)
    grads = layer.backward(g, grad_alpha=ga)
    f_out, f_alpha, f_g = loc_functions(layer, args, g, ga)
    assert out.dtype == dtype and grads.query.dtype == dtype
    np.testing.assert_array_equal(out, f_out)
    np.testing.assert_array_equal(layer.attention_weights, f_alpha)
    assert isinstance(grads, ac.LocationInputGrads)
    assert grads._fields == ("query", "values")
    np.testing.assert_array_equal(grads.query, f_g.query)
    np.testing.assert_array_equal(grads.values, f_g.values)
    pg = layer.grads()
    np.testing.assert_array_equal(pg["W"], f_g.W)
    np.testing.assert_array_equal(pg["b"], f_g.b)
    assert not pg["W"][T:].any() and not pg["b"][T:].any()


@pytest.mark.parametrize("values", [True, False], ids=["values", "keys"])
@pytest.mark.parametrize("several,mask", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("sharpness", SHARPNESS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cosine_equals_functions(dtype, sharpness, several, mask, values):
    layer = cosine(sharpness, dtype)
    args, rng = cos_inputs(3, several, mask, values, dtype)
    out = layer(**args)
    g = rng.standard_normal(out.shape).astype(dtype)
    ga = rng.standard_normal(layer.attention_weights.shape).astype(dtype)
    grads = layer.backward(g, grad_alpha=ga)
    f_out, f_alpha, f_g = cos_functions(layer, args, g, ga)
    assert out.dtype == dtype and grads.keys.dtype == dtype
    np.testing.assert_array_equal(out, f_out)
    np.testing.assert_array_equal(layer.attention_weights, f_alpha)
    assert isinstance(grads, ac.AttentionInputGrads)
    for name in ("query", "keys", "values"):
        mine, theirs = getattr(grads, name), getattr(f_g, name)
        if theirs is None:
            assert mine is None and not values
        else:
            np.testing.assert_array_equal(mine, theirs)
    if sharpness == "learned":
        np.testing.assert_array_equal(layer.grads()["sharpness"],
                                      f_g.sharpness)
        assert layer.grads()["sharpness"].dtype == dtype
    else:
        assert f_g.sharpness is None and layer.grads() == {}


# DotAttention's keywords, each as the functions take them
COSINE_OPTIONS = [
    pytest.param({"causal": True, "bias": "bias"}, id="causal-bias"),
    pytest.param({"window": (2, 1), "softcap": 0.8}, id="window-softcap"),
    pytest.param({"alibi_slopes": np.array([0.3, 0.5, 0.7]),
                  "sinks": np.array([0.1, -0.2, 0.4])}, id="alibi-sinks"),
    pytest.param({"cu_seqlens_q": np.array([0, 1, 4]),
                  "cu_seqlens_k": np.array([0, 2, 5]), "causal": True},
                 id="packed"),
]


@pytest.mark.parametrize("return_weights", [True, False])
@pytest.mark.parametrize("options", COSINE_OPTIONS)
def test_cosine_options_equal_functions(options, return_weights):
    """Masks, causal, bias, the variants and return_weights=False pass to
    the functions as DotAttention's do; the bias, slopes and sinks get
    their gradients."""
    layer = cosine("learned")
    args, rng = cos_inputs(4, True, "random")
    if "cu_seqlens_q" in options:
        del args["mask"]
    options = dict(options)
    if options.get("bias") == "bias":
        bias = rng.standard_normal((1, TQ, T))
        bias[0, 2] = -np.inf            # a query that sees no key
        options["bias"] = bias
    out = layer(**args, **options, return_weights=return_weights)
    assert (layer.attention_weights is None) == (not return_weights)
    g = rng.standard_normal(out.shape)
    grads = layer.backward(g)
    f_out, _, f_g = cos_functions(layer, args, g, **options,
                                  return_weights=return_weights)
    np.testing.assert_array_equal(out, f_out)
    for name in ("query", "keys", "values", "bias", "alibi_slopes",
                 "sinks"):
        mine, theirs = getattr(grads, name), getattr(f_g, name)
        if name in ("query", "keys", "values") or name in options:
            np.testing.assert_array_equal(mine, theirs)
        else:
            assert mine is None
    np.testing.assert_array_equal(layer.grads()["sharpness"], f_g.sharpness)


def test_cosine_dropout_is_reproducible_and_regenerated_in_backward():
    """A seed gives the same sequence of keep patterns; the backward uses
    the forward's; eval() turns dropout off."""
    args, rng = cos_inputs(5, True, "none")
    a = cosine("learned", dropout=0.3, seed=5)
    b = cosine("learned", dropout=0.3, seed=5)
    outs_a = [a(**args) for _ in range(2)]
    outs_b = [b(**args) for _ in range(2)]
    np.testing.assert_array_equal(outs_a[1], outs_b[1])
    assert not np.array_equal(outs_a[0], outs_a[1])
    draw = np.random.default_rng(5)
    seeds = [int(draw.integers(0, 2**63)) for _ in range(2)]
    g = rng.standard_normal(outs_a[1].shape)
    grads = a.backward(g)
    f_out, _, f_g = cos_functions(a, args, g, dropout=0.3, seed=seeds[1])
    np.testing.assert_array_equal(outs_a[1], f_out)
    np.testing.assert_array_equal(grads.query, f_g.query)
    np.testing.assert_array_equal(a.grads()["sharpness"], f_g.sharpness)
    plain, _, _ = cos_functions(a, args, g)
    np.testing.assert_array_equal(a.eval()(**args), plain)


def test_location_broadcasts_leading_axes():
    """The query's and the values' leading axes broadcast; the gradients
    are summed back to each input's shape."""
    rng = np.random.default_rng(6)
    layer = location(seed=2)
    q = rng.standard_normal((2, 1, TQ, HQ))
    v = rng.standard_normal((1, 3, T, HV))
    out = layer(q, v)
    assert out.shape == (2, 3, TQ, HV)
    g = layer.backward(np.ones_like(out))
    assert g.query.shape == q.shape and g.values.shape == v.shape
    want, _ = ac.location_attention(q, v, layer.W, b=layer.b)
    np.testing.assert_array_equal(out, want)


# --------------------------------------------------------------------------
# Finite differences of the layers themselves


@pytest.mark.parametrize("several,mask", [(True, "causal"),
                                          (False, "random")],
                         ids=["several-causal", "single-random"])
def test_location_backward_matches_finite_differences(several, mask):
    """L = sum(out G) + sum(alpha Ga): the input gradients and W's and b's
    equal central differences of the layer's own forward (float64)."""
    layer = location(seed=5)
    args, rng = loc_inputs(6, several, mask)
    out = layer(**args)
    G = rng.standard_normal(out.shape)
    Ga = rng.standard_normal(layer.attention_weights.shape)

    def loss():
        out = layer(**args)
        return float(np.sum(out * G) + np.sum(layer.attention_weights * Ga))

    loss()
    grads = layer.backward(G, grad_alpha=Ga)
    pgrads = layer.grads()
    for name in ("query", "values"):
        err = rel_err(getattr(grads, name), numerical_grad(loss, args[name]))
        assert err <= FD_TOL, f"d{name}: relative error {err:.3g}"
    for name, p in layer.parameters().items():
        err = rel_err(pgrads[name], numerical_grad(loss, p))
        assert err <= FD_TOL, f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("return_weights", [True, False])
@pytest.mark.parametrize("several,mask", [(True, "causal"),
                                          (False, "random")],
                         ids=["several-causal", "single-random"])
def test_cosine_backward_matches_finite_differences(several, mask,
                                                    return_weights):
    """The query's, keys', values', bias's and the learned sharpness's
    gradients against central differences."""
    layer = cosine("learned")
    args, rng = cos_inputs(7, several, mask, zero_key=False)
    lead = (B, TQ) if several else (B,)
    args["bias"] = rng.standard_normal(lead + (T,))

    def call():
        return layer(**args, return_weights=return_weights)

    G = rng.standard_normal(call().shape)

    def loss():
        return float(np.sum(call() * G))

    call()
    grads = layer.backward(G)
    sharp = layer.grads()["sharpness"]
    for name in ("query", "keys", "values", "bias"):
        err = rel_err(getattr(grads, name), numerical_grad(loss, args[name]))
        assert err <= FD_TOL, f"d{name}: relative error {err:.3g}"
    err = rel_err(sharp, numerical_grad(loss, layer.sharpness))
    assert err <= FD_TOL, f"dsharpness: relative error {err:.3g}"


# --------------------------------------------------------------------------
# Training with the optimiser steps


def test_location_adam_training_reduces_the_loss():
    """Fit the output to that of a sharper teacher layer: the loss falls by
    more than half in 100 Adam steps (W and b both move)."""
    rng = np.random.default_rng(7)
    args = {"query": rng.standard_normal((16, TQ, HQ)),
            "values": rng.standard_normal((16, T, HV))}
    teacher = location(seed=11)
    teacher.W *= 6
    target = teacher(**args)
    layer, state = location(seed=12), {}
    before = {n: p.copy() for n, p in layer.parameters().items()}

    def loss_and_step():
        diff = layer(**args) - target
        layer.backward(2 * diff / diff.size)
        ac.adam_step(layer.parameters(), layer.grads(), state, lr=0.05)
        return np.mean(diff ** 2)

    first = loss_and_step()
    for _ in range(100):
        last = loss_and_step()
    assert last < 0.5 * first, (first, last)
    for name, p in layer.parameters().items():
        assert not np.array_equal(p, before[name]), name
        # the rows past T: a zero gradient, no Adam step
        np.testing.assert_array_equal(p[T:], before[name][T:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cosine_adam_learns_the_sharpness(dtype):
    """A learned sharpness fitted to a sharper teacher's outputs by
    adam_step (in place, in the layer's dtype) approaches the teacher's
    and the loss falls."""
    rng = np.random.default_rng(8)
    args = {"query": rng.standard_normal((16, TQ, H)),
            "keys": rng.standard_normal((16, T, H)),
            "values": rng.standard_normal((16, T, HV))}
    target = ac.CosineAttention(sharpness=6.0)(**args)
    layer, state = ac.CosineAttention(learn_sharpness=True, dtype=dtype), {}
    param = layer.sharpness

    def loss_and_step():
        diff = layer(**args) - target
        layer.backward(2 * diff / diff.size)
        ac.adam_step(layer.parameters(), layer.grads(), state, lr=0.2)
        return np.mean(diff ** 2)

    first = loss_and_step()
    for _ in range(100):
        last = loss_and_step()
    assert last < 0.01 * first, (first, last)
    assert layer.sharpness is param and param.dtype == dtype
    assert param.shape == () and abs(float(param) - 6.0) < 0.2
    ac.sgd_step(layer.parameters(), layer.grads(), lr=0.1)
    assert layer.sharpness.dtype == dtype


# --------------------------------------------------------------------------
# dtype and bad input


def test_inputs_are_converted_to_the_layer_dtype():
    """A float32 layer computes in float32 whatever the inputs' dtype, and
    takes array-likes."""
    layer = location(np.float32)
    args, _ = loc_inputs(9)                     # float64
    out = layer(**args)
    assert out.dtype == np.float32
    g = layer.backward(out.astype(np.float64))
    assert g.query.dtype == np.float32 and g.values.dtype == np.float32
    assert all(p.dtype == np.float32 for p in layer.grads().values())
    listed = {n: x.tolist() if n != "mask" else x for n, x in args.items()}
    np.testing.assert_array_equal(layer(**listed), out)

    layer = cosine("learned", np.float32)
    args, _ = cos_inputs(9)
    out = layer(**args, bias=np.zeros((B, TQ, T)))
    assert out.dtype == np.float32
    g = layer.backward(out.astype(np.float64))
    assert {x.dtype for x in g if x is not None} == {np.dtype(np.float32)}
    assert layer.grads()["sharpness"].dtype == np.float32
    assert layer.sharpness.dtype == np.float32


def test_bad_input_changes_nothing():
    """Refused before any work, naming the argument; the layer keeps the
    last good call for its backward."""
    layer = location()
    args, _ = loc_inputs(10)
    out = layer(**args)
    weights = layer.attention_weights
    long_values = np.zeros((B, T_MAX + 1, HV))
    with pytest.raises(ValueError, match="W has shape"):
        layer(args["query"], long_values)
    with pytest.raises(ValueError):
        layer(np.zeros((B, TQ, HQ + 1)), args["values"])
    with pytest.raises(ValueError, match="attn_mask"):
        layer(args["query"][:, 0], args["values"],
              attn_mask=np.ones((B, TQ, T), bool))
    assert layer.attention_weights is weights
    g = layer.backward(np.ones_like(out))       # still the first call's
    assert g.query.shape == args["query"].shape

    layer = cosine("learned")
    cargs, _ = cos_inputs(10)
    out = layer(**cargs)
    weights = layer.attention_weights
    with pytest.raises(ValueError, match="softcap"):
        layer(**cargs, softcap=0.0)
    with pytest.raises(ValueError):
        layer(cargs["query"], np.zeros((B, T, H + 1)))
    assert layer.attention_weights is weights
    g = layer.backward(np.ones_like(out))
    assert g.keys.shape == cargs["keys"].shape
    layer.sharpness[...] = np.nan               # an array's NaN is data
    assert np.isnan(layer(**cargs)).any()


# --------------------------------------------------------------------------
# Against PyTorch


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_location_from_torch_equals_torch(dtype, bias):
    """from_torch(nn.Linear(Hq, T_max)) copies the weights in the Linear's
    dtype; the layer computes softmax(linear(q)[..., :T]) @ values."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    linear = torch.nn.Linear(HQ, T_MAX, bias=bias,
                             dtype=getattr(torch, dtype))
    layer = ac.LocationAttention.from_torch(linear)
    assert layer.dtype == np.dtype(dtype)
    assert (layer.max_length, layer.query_size) == (T_MAX, HQ)
    assert list(layer.parameters()) == (["W", "b"] if bias else ["W"])
    for name, p in layer.parameters().items():
        t = getattr(linear, {"W": "weight", "b": "bias"}[name])
        t = t.detach().numpy()
        np.testing.assert_array_equal(p, t)
        assert not np.shares_memory(p, t)
    args, _ = loc_inputs(11, dtype=dtype)
    out = layer(**args)
    q = torch.from_numpy(args["query"])
    with torch.no_grad():
        s = linear(q)[..., :T]
        s = s.masked_fill(~torch.from_numpy(args["mask"])[:, None], -torch.inf)
        alpha = torch.softmax(s, -1).nan_to_num(0.0)
        t_out = alpha @ torch.from_numpy(args["values"])
    tol = TOL[np.dtype(dtype).type]
    assert rel_err(out, t_out.numpy()) <= tol
    np.testing.assert_allclose(layer.attention_weights, alpha.numpy(),
                               rtol=tol, atol=tol)
    f64 = ac.LocationAttention.from_torch(linear, dtype=np.float64)
    assert f64.W.dtype == np.float64 and f64.dtype == np.float64


def test_location_from_torch_rejects_bad_layers():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="not initialised"):
        ac.LocationAttention.from_torch(torch.nn.LazyLinear(T_MAX))
    conv = torch.nn.Conv1d(HQ, T_MAX, 1)
    with pytest.raises(ValueError, match=r"linear.weight has shape"):
        ac.LocationAttention.from_torch(conv)
    with pytest.raises(TypeError, match="dtype is keyword-only"):
        ac.LocationAttention.from_torch(None, np.float32)


def test_cosine_equals_torch_autograd():
    """beta * normalize(q) @ normalize(k).mT scores, softmax, values: the
    layer's output and gradients are autograd's."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    layer = cosine("learned")
    args, rng = cos_inputs(12, True, "none", zero_key=False)
    out = layer(**args, causal=True)
    G = rng.standard_normal(out.shape)
    grads = layer.backward(G)
    t = {n: torch.tensor(args[n], requires_grad=True)
         for n in ("query", "keys", "values")}
    beta = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    s = beta * (F.normalize(t["query"], dim=-1)
                @ F.normalize(t["keys"], dim=-1).mT)
    causal = torch.ones(TQ, T, dtype=torch.bool).tril(T - TQ)
    alpha = torch.softmax(s.masked_fill(~causal, -torch.inf), -1)
    t_out = alpha @ t["values"]
    (t_out * torch.from_numpy(G)).sum().backward()
    assert rel_err(out, t_out.detach().numpy()) <= 1e-12
    for name in ("query", "keys", "values"):
        assert rel_err(getattr(grads, name), t[name].grad.numpy()) <= 1e-12
    assert rel_err(layer.grads()["sharpness"], beta.grad.numpy()) <= 1e-12
