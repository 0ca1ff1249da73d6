"""Today's variants (docs/contract.md section 8) in the NumPy layers:
window, softcap, alibi_slopes, sinks and packed sequences (cu_seqlens_q/k)
in DotAttention, GeneralAttention and MultiHeadAttention.

Each layer against the NumPy reference (attention_c.reference.family),
forward and backward, in float64 (1e-10) and float32 (TOL); its backward
against central differences of its own forward, including the slopes',
the sinks' and the multi-head layer's learned sinks' gradients; bad input
refused before anything changes.
"""

import inspect

import numpy as np
import pytest

import attention_c as ac
from attention_c.reference import family as ref
from attention_c.testing import TOL, numerical_grad, rel_err

pytestmark = pytest.mark.filterwarnings("error")

# alibi_slopes and sinks come with the kernel's second half: until the
# binding takes them, the cases that use them are skipped.
HAS_ALIBI_SINKS = {"alibi_slopes", "sinks"} <= set(
    inspect.signature(ac.dot_attention).parameters)
needs_alibi_sinks = pytest.mark.skipif(
    not HAS_ALIBI_SINKS, reason="the binding has no alibi_slopes/sinks yet")

B, NH, TQ, T, H, HQ, HV = 2, 3, 7, 9, 4, 3, 5
CU_Q, CU_K = np.array([0, 3, 3, 7]), np.array([0, 4, 6, 9])
FD_TOL = 1e-6

# (id, keywords, needs alibi/sinks)
VARIANTS = [
    ("window", {"window": (2, 1)}, False),
    ("window-causal", {"window": (3, None), "causal": True}, False),
    ("softcap", {"softcap": 1.5}, False),
    ("packed", {"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K}, False),
    ("packed-causal-window", {"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K,
                              "causal": True, "window": (1, None)}, False),
    ("alibi", {"alibi_slopes": "heads"}, True),
    ("sinks", {"sinks": "heads"}, True),
    ("all", {"window": (4, 2), "softcap": 2.0, "alibi_slopes": "batch",
             "sinks": "heads", "causal": True}, True),
]
PARAMS = [pytest.param(kw, id=name,
                       marks=[needs_alibi_sinks] if needs else [])
          for name, kw, needs in VARIANTS]


def per_sequence(rng, kind, dtype):
    """Slopes or sinks: one per head (NH,), shared by the batch, or one
    per sequence and head (B, NH)."""
    shape = (NH,) if kind == "heads" else (B, NH)
    return (0.3 * rng.uniform(0.2, 1.0, shape)).astype(dtype)


def problem(kind, variant, dtype=np.float64, seed=0):
    """(layer, call arguments, variant keywords)."""
    rng = np.random.default_rng(seed)
    hq = H if kind == "dot" else HQ
    args = {"query": rng.standard_normal((B, NH, TQ, hq)).astype(dtype),
            "keys": rng.standard_normal((B, NH, T, H)).astype(dtype),
            "values": rng.standard_normal((B, NH, T, HV)).astype(dtype)}
    kw = dict(variant)
    for n in ("alibi_slopes", "sinks"):
        if n in kw:
            kw[n] = per_sequence(rng, kw[n], dtype)
    if kind == "dot":
        layer = ac.DotAttention(dtype=dtype)
    else:
        layer = ac.GeneralAttention(HQ, H, dtype=dtype, seed=seed)
    return layer, args, kw


def reference(kind, layer, args, kw, grad_out, return_weights):
    """(out, grads) of the reference in float64 with the layer's W."""
    a = {n: np.asarray(x, np.float64) for n, x in args.items()}
    k = {n: (np.asarray(x, np.float64) if n in ("alibi_slopes", "sinks")
             else x) for n, x in kw.items()}
    W = () if kind == "dot" else (np.asarray(layer.W, np.float64),)
    fwd = ref.dot_attention if kind == "dot" else ref.general_attention
    bwd = (ref.dot_attention_backward if kind == "dot"
           else ref.general_attention_backward)
    q, keys, vals = a["query"], a["keys"], a["values"]
    out, lse = fwd(q, keys, *W, values=vals, return_weights=False, **k)
    g = bwd(np.asarray(grad_out, np.float64), q, keys, *W, None, out=out,
            lse=lse, values=vals, **k)
    return out, g


@pytest.mark.parametrize("return_weights", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("variant", PARAMS)
@pytest.mark.parametrize("kind", ["dot", "general"])
def test_against_reference(kind, variant, dtype, return_weights):
    layer, args, kw = problem(kind, variant, dtype)
    out = layer(**args, return_weights=return_weights, **kw)
    assert out.dtype == dtype
    g_out = np.random.default_rng(1).standard_normal(out.shape)
    g = layer.backward(g_out.astype(dtype))
    out_ref, g_ref = reference(kind, layer, args, kw, g_out, return_weights)
    tol = 1e-10 if dtype == np.float64 else TOL[np.float32]
    assert rel_err(out, out_ref) <= tol
    assert rel_err(g.query, g_ref[0]) <= tol
    assert rel_err(g.keys, g_ref[1]) <= tol
    assert rel_err(g.values, g_ref[2]) <= tol
    if kind == "general":
        assert rel_err(layer.grads()["W"], g_ref[3]) <= tol
    for name, want in zip(("alibi_slopes", "sinks"), g_ref[-2:]):
        got = getattr(g, name)
        if name in kw:
            assert got.shape == kw[name].shape and got.dtype == dtype
            assert rel_err(got, want) <= tol, name
        else:
            assert got is None and want is None
    if return_weights:
        # the weights over the keys (with sinks, summing to less than 1)
        assert layer.attention_weights.shape == (B, NH, TQ, T)
        total = layer.attention_weights.sum(-1)
        if "sinks" in kw:
            assert np.all(total < 1)


@pytest.mark.parametrize("variant", PARAMS)
@pytest.mark.parametrize("kind", ["dot", "general"])
def test_backward_finite_differences(kind, variant):
    """Every input's gradient, the slopes' and the sinks' included,
    against central differences of the layer's own forward."""
    layer, args, kw = problem(kind, variant, seed=3)
    arrays = {**args, **{n: np.array(kw[n]) for n in ("alibi_slopes",
                                                      "sinks") if n in kw}}
    rest = {n: x for n, x in kw.items() if n not in arrays}

    def call():
        return layer(**arrays, **rest, return_weights=False)

    g_out = np.random.default_rng(4).standard_normal(call().shape)
    call()
    g = layer.backward(g_out)
    fields = {"query": g.query, "keys": g.keys, "values": g.values,
              "alibi_slopes": g.alibi_slopes, "sinks": g.sinks}
    for name, x in arrays.items():
        num = numerical_grad(lambda: float(np.sum(g_out * call())), x)
        assert rel_err(fields[name], num) <= FD_TOL, name
    if kind == "general":
        num = numerical_grad(lambda: float(np.sum(g_out * call())), layer.W)
        assert rel_err(layer.grads()["W"], num) <= FD_TOL


@needs_alibi_sinks
def test_sinks_take_a_share_and_weights_equal_streamed():
    """With sinks and return_weights=True the layer keeps the streamed
    (out, lse) for its backward: its gradients equal those after a
    return_weights=False call; grad_alpha is refused with sinks."""
    layer, args, kw = problem("dot", {"sinks": "batch"})
    out_w = layer(**args, **kw)
    weights = layer.attention_weights
    g1 = layer.backward(np.ones_like(out_w))
    out_s = layer(**args, **kw, return_weights=False)
    g2 = layer.backward(np.ones_like(out_s))
    assert rel_err(out_w, out_s) <= 1e-14
    for a, b in zip(g1, g2):
        assert (a is None and b is None) or rel_err(a, b) <= 1e-14
    # the sink absorbs 1 - sum_t P_it of every query
    lse = ref.dot_attention(args["query"], args["keys"],
                            values=args["values"], return_weights=False,
                            **kw)[1]
    p_sink = np.exp(kw["sinks"][..., None] - lse)
    assert np.allclose(weights.sum(-1) + p_sink, 1)
    layer(**args, **kw)
    with pytest.raises(ValueError, match="grad_alpha"):
        layer.backward(np.ones_like(out_w), grad_alpha=np.ones_like(weights))


def test_one_query_per_sequence():
    """softcap (and alibi/sinks) apply with one query per sequence;
    window and packed sequences are refused, naming the argument."""
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((B, H)), rng.standard_normal((B, T, H))
    layer = ac.DotAttention()
    out = layer(q, k, softcap=0.7)
    want, _ = ref.dot_attention(q, k, softcap=0.7)
    assert rel_err(out, want) <= 1e-10
    with pytest.raises(ValueError, match="window"):
        layer(q, k, window=(1, 1))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(q, k, cu_seqlens_q=[0, 1], cu_seqlens_k=[0, T])


@pytest.mark.parametrize("bad, error, match", [
    ({"window": (-1, 2)}, ValueError, "window"),
    ({"window": 3}, (ValueError, TypeError), "window"),
    ({"softcap": 0.0}, ValueError, "softcap"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"cu_seqlens_q": CU_Q}, ValueError, "cu_seqlens"),
    ({"cu_seqlens_q": [0, 4, 3, 7], "cu_seqlens_k": CU_K}, ValueError,
     "cu_seqlens_q"),
    ({"cu_seqlens_q": CU_Q, "cu_seqlens_k": [0, 9]}, ValueError,
     "cu_seqlens"),
    ({"cu_seqlens_q": CU_Q.astype(float), "cu_seqlens_k": CU_K}, TypeError,
     "cu_seqlens_q"),
    pytest.param({"alibi_slopes": np.ones(4)}, ValueError, "alibi_slopes",
                 marks=needs_alibi_sinks),
    pytest.param({"sinks": np.ones((5, 1))}, ValueError, "sinks",
                 marks=needs_alibi_sinks),
])
@pytest.mark.parametrize("kind", ["dot", "general"])
def test_bad_input_changes_nothing(kind, bad, error, match):
    layer, args, _ = problem(kind, {})
    out = layer(**args)
    weights = layer.attention_weights
    with pytest.raises(error, match=match):
        layer(**args, **bad)
    assert layer.attention_weights is weights
    g = layer.backward(np.ones_like(out))       # still the first call's
    assert g.query.shape == args["query"].shape


# --------------------------------------------------------------------------
# MultiHeadAttention

E, HEADS = 6, 3


def mha_reference(layer, x, kw, sinks=None, slopes=None):
    """The layer's forward written with the reference: projections, the
    heads, reference.dot_attention, the output projection."""
    d = E // HEADS
    W, b = layer.in_proj_weight, layer.in_proj_bias
    q, k, v = (x @ W[r * E:(r + 1) * E].T + b[r * E:(r + 1) * E]
               for r in range(3))

    def split(p):
        return p.reshape(p.shape[:-1] + (HEADS, d)).swapaxes(-2, -3)

    o, _ = ref.dot_attention(split(q), split(k), values=split(v),
                             sinks=sinks, alibi_slopes=slopes, **kw)
    o = o.swapaxes(-2, -3).reshape(x.shape)
    return o @ layer.out_proj_weight.T + layer.out_proj_bias


MHA_VARIANTS = [
    pytest.param({"window": (2, 0)}, {}, id="window"),
    pytest.param({"softcap": 1.0, "causal": True}, {}, id="softcap"),
    pytest.param({"cu_seqlens_q": [0, 2, 5], "cu_seqlens_k": [0, 2, 5],
                  "causal": True}, {}, id="packed"),
    pytest.param({"window": (1, 1)}, {"sinks": True}, id="sinks",
                 marks=needs_alibi_sinks),
    pytest.param({"causal": True},
                 {"alibi_slopes": 2.0 ** (-8 * np.arange(1, 4) / 3)},
                 id="alibi", marks=needs_alibi_sinks),
]


def make_mha(options, seed=0):
    layer = ac.MultiHeadAttention(E, HEADS, seed=seed, **options)
    rng = np.random.default_rng(seed + 1)
    for p in layer.parameters().values():       # non-zero biases and sinks
        p += 0.3 * rng.standard_normal(p.shape)
    return layer


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("call_kw, options", MHA_VARIANTS)
def test_multihead_against_reference(call_kw, options, return_weights):
    layer = make_mha(options)
    x = np.random.default_rng(2).standard_normal((1, 5, E))
    res = layer(x, return_weights=return_weights, **call_kw)
    out = res[0] if return_weights else res
    want = mha_reference(layer, x, call_kw, layer.sinks, layer.alibi_slopes)
    assert rel_err(out, want) <= 1e-10
    assert ("sinks" in layer.parameters()) == ("sinks" in options)


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("call_kw, options", MHA_VARIANTS)
def test_multihead_finite_differences(call_kw, options, return_weights):
    """The input's and every parameter's gradient (the learned sinks
    included) against central differences."""
    layer = make_mha(options, seed=7)
    x = np.random.default_rng(8).standard_normal((1, 5, E))

    def call():
        res = layer(x, return_weights=return_weights, **call_kw)
        return res[0] if return_weights else res

    g_out = np.random.default_rng(9).standard_normal(call().shape)
    call()
    g = layer.backward(g_out)
    num = numerical_grad(lambda: float(np.sum(g_out * call())), x)
    assert rel_err(g.query, num) <= FD_TOL
    params, grads = layer.parameters(), layer.grads()
    assert set(grads) == set(params)
    for name, p in params.items():
        num = numerical_grad(lambda: float(np.sum(g_out * call())), p)
        assert rel_err(grads[name], num) <= FD_TOL, name


@needs_alibi_sinks
def test_multihead_sinks_train():
    """sgd_step moves the sinks with the other parameters."""
    layer = make_mha({"sinks": True})
    x = np.random.default_rng(3).standard_normal((2, 4, E))
    before = layer.sinks.copy()
    out = layer(x, causal=True)
    layer.backward(out)                 # the gradient of sum(out^2) / 2
    ac.sgd_step(layer.parameters(), layer.grads(), lr=0.1)
    assert not np.array_equal(before, layer.sinks)
    assert "sinks=True" in repr(layer)


def test_multihead_options():
    layer = ac.MultiHeadAttention(E, HEADS)
    assert layer.sinks is None and layer.alibi_slopes is None
    assert "sinks" not in layer.parameters()
    with_sinks = ac.MultiHeadAttention(E, HEADS, sinks=True)
    assert with_sinks.sinks.shape == (HEADS,)
    assert not with_sinks.sinks.any()
    # the same initial weights as without sinks
    for n, p in layer.parameters().items():
        assert np.array_equal(p, with_sinks.parameters()[n])
    with pytest.raises(ValueError, match="alibi_slopes"):
        ac.MultiHeadAttention(E, HEADS, alibi_slopes=np.ones(2))
    with pytest.raises(ValueError, match="window"):
        layer(np.zeros((1, 4, E)), window=(-1, 0))


@pytest.mark.parametrize("options", [
    {}, pytest.param({"sinks": True}, marks=needs_alibi_sinks),
    pytest.param({"alibi_slopes": [0.5, 0.25, 0.125]},
                 marks=needs_alibi_sinks)])
def test_multihead_cache_decoding_with_a_window(options):
    """Decoding one token at a time with a KVCache, a window and the
    layer's sinks or slopes (positions bottom-right: the new query is the
    last position) gives the full causal call's outputs."""
    layer = make_mha(options, seed=4)
    x = np.random.default_rng(5).standard_normal((2, 7, E))
    kw = {"window": (2, 0), "softcap": 3.0}
    full = layer(x, causal=True, **kw)
    cache = ac.KVCache(max_len=7)
    steps = [layer(x[:, t:t + 1], cache=cache, **kw) for t in range(7)]
    assert rel_err(np.concatenate(steps, axis=1), full) <= 1e-12
