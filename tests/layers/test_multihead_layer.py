"""The NumPy multi-head attention layer and its decoding cache.

The layer must equal a plain NumPy reading of multi-head attention (one
head at a time, masks as boolean arrays) and torch.nn.MultiheadAttention
loaded through from_torch, forward and backward; its backward must equal
central differences in float64, dropout included; decoding with a KVCache
must equal the full causal forward step by step, appending to one buffer;
bad input must raise before anything changes.
"""

import doctest

import numpy as np
import pytest

from attention_c import adam_step, sgd_step
from attention_c.layers import kvcache, multihead
from attention_c import reference as ref
from attention_c.multihead import (KVCache, MultiHeadAttention,
                                   MultiHeadInputGrads)
from attention_c.testing import numerical_grad, rel_err

pytestmark = pytest.mark.filterwarnings("error")

# Normwise relative error against a float64 evaluation, per dtype.
TOL = {np.float64: 1e-12, np.float32: 2e-5}
TORCH_TOL = {np.float64: 1e-10, np.float32: 2e-5}
FD_TOL = 1e-7


# --------------------------------------------------------------------------
# The plain-NumPy reading of the layer

# The reading reference: one head at a time, in float64.
_reference_forward = ref.multi_head_attention


# --------------------------------------------------------------------------
# Problems

def randomize(layer, rng, scale=0.5):
    """Non-zero biases (the init's are 0) and weights of order 1, so that
    every parameter matters in the comparisons."""
    for p in layer.parameters().values():
        p[...] = rng.uniform(-scale, scale, p.shape)
    return layer


def make(E=12, h=2, dtype=np.float64, seed=0, **kw):
    layer = MultiHeadAttention(E, h, dtype=dtype, seed=seed, **kw)
    return randomize(layer, np.random.default_rng(seed + 100))


def inputs(rng, lead, Tq, S, E, kdim=None, vdim=None, dtype=np.float64):
    q = rng.standard_normal(lead + (Tq, E)).astype(dtype)
    k = rng.standard_normal(lead + (S, kdim or E)).astype(dtype)
    v = rng.standard_normal(lead + (S, vdim or E)).astype(dtype)
    return q, k, v


def fully_masked_key_mask(rng, lead, S):
    """Random key mask (lead..., S), with the first sequence fully masked
    when there is more than one."""
    m = rng.random(lead + (S,)) < 0.7
    m[..., 0] = True
    if lead:
        m.reshape(-1, S)[0] = False
    return m


# --------------------------------------------------------------------------
# Construction

def test_parameters_like_torch_state_dict():
    mha = MultiHeadAttention(12, 4)
    assert list(mha.parameters()) == ["in_proj_weight", "in_proj_bias",
                                      "out_proj_weight", "out_proj_bias"]
    shapes = {n: p.shape for n, p in mha.parameters().items()}
    assert shapes == {"in_proj_weight": (36, 12), "in_proj_bias": (36,),
                      "out_proj_weight": (12, 12), "out_proj_bias": (12,)}
    sep = MultiHeadAttention(12, 4, kdim=5, vdim=7, bias=False)
    shapes = {n: p.shape for n, p in sep.parameters().items()}
    assert shapes == {"q_proj_weight": (12, 12), "k_proj_weight": (12, 5),
                      "v_proj_weight": (12, 7), "out_proj_weight": (12, 12)}
    assert sep.in_proj_weight is None and sep.in_proj_bias is None
    # like torch: Xavier input projections, zero biases
    assert np.abs(mha.in_proj_weight).max() <= np.sqrt(6 / 48)
    assert np.abs(mha.in_proj_weight).max() > 0.5 * np.sqrt(6 / 48)
    assert np.abs(mha.out_proj_weight).max() <= 1 / np.sqrt(12)
    assert not mha.in_proj_bias.any() and not mha.out_proj_bias.any()


def test_init_seeded_and_dtype_independent():
    a, b = MultiHeadAttention(8, 2, seed=3), MultiHeadAttention(8, 2, seed=3)
    c = MultiHeadAttention(8, 2, seed=3, dtype=np.float32)
    d = MultiHeadAttention(8, 2, seed=4)
    for n, p in a.parameters().items():
        np.testing.assert_array_equal(p, b.parameters()[n])
        assert c.parameters()[n].dtype == np.float32
        np.testing.assert_array_equal(c.parameters()[n], p.astype(np.float32))
    assert not np.array_equal(a.in_proj_weight, d.in_proj_weight)


def test_module_doctests():
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    tests = [t for m in (multihead, kvcache) for t in finder.find(m)
             if t.examples]
    assert {t.name.split(".")[-1] for t in tests} >= {"MultiHeadAttention",
                                                      "KVCache"}
    for t in tests:
        runner.run(t)
    assert runner.summarize(verbose=False).failed == 0


# --------------------------------------------------------------------------
# Forward against the reference

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)])
@pytest.mark.parametrize("h", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_self_attention_against_reference(dtype, lead, h, T):
    rng = np.random.default_rng(T * 10 + h)
    layer = make(12, h, dtype)
    x = rng.standard_normal(lead + (T, 12)).astype(dtype)
    for causal in (False, True):
        want, alpha = _reference_forward(layer.parameters(), h, x,
                                         causal=causal)
        out = layer(x, causal=causal)
        assert out.shape == lead + (T, 12) and out.dtype == dtype
        assert rel_err(out, want) <= TOL[dtype]
        out2, w = layer(x, causal=causal, return_weights=True,
                        average_weights=False)
        assert rel_err(out2, want) <= TOL[dtype]
        assert w.shape == lead + (h, T, T)
        assert rel_err(w, alpha) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)])
def test_masks_against_reference(dtype, lead):
    rng = np.random.default_rng(7)
    Tq, S, E, h = 3, 17, 12, 4
    layer = make(E, h, dtype)
    q, k, v = inputs(rng, lead, Tq, S, E, dtype=dtype)
    m = fully_masked_key_mask(rng, lead, S)
    am2 = rng.random((Tq, S)) < 0.6
    am3 = rng.random(lead + (Tq, S)) < 0.6
    am1 = rng.random(S) < 0.5
    for kw in ({"mask": m}, {"attn_mask": am2}, {"attn_mask": am3},
               {"attn_mask": am1}, {"mask": m, "causal": True},
               {"mask": m[..., :1, :] if lead else m, "attn_mask": am3,
                "causal": True}):
        want, alpha = _reference_forward(layer.parameters(), h, q, k, v,
                                         **kw)
        out, wavg = layer(q, k, v, return_weights=True, **kw)
        assert rel_err(out, want) <= TOL[dtype], kw
        assert rel_err(wavg, alpha.mean(axis=-3)) <= TOL[dtype], kw
        assert rel_err(layer(q, k, v, **kw), want) <= TOL[dtype], kw
    # the fully masked sequence gives the output bias exactly, weights 0
    if lead:
        out, w = layer(q, k, v, mask=m, return_weights=True,
                       average_weights=False)
        first = (0,) * len(lead)
        np.testing.assert_array_equal(w[first], 0)
        np.testing.assert_allclose(
            out[first], np.broadcast_to(layer.out_proj_bias, (Tq, E)),
            rtol=0, atol=0)


def test_cross_attention_kdim_vdim_and_broadcast():
    rng = np.random.default_rng(3)
    layer = make(12, 3, kdim=5, vdim=7)
    q = rng.standard_normal((2, 3, 4, 12))
    k = rng.standard_normal((3, 17, 5))          # broadcast over axis 0
    v = rng.standard_normal((1, 3, 17, 7))
    want, alpha = _reference_forward(layer.parameters(), 3, q, k, v)
    out, w = layer(q, k, v, return_weights=True, average_weights=False)
    assert out.shape == (2, 3, 4, 12) and w.shape == (2, 3, 3, 4, 17)
    assert rel_err(out, want) <= 1e-12 and rel_err(w, alpha) <= 1e-12
    # value defaults to the key when vdim == kdim
    l2 = make(12, 3, kdim=5, vdim=5)
    want, _ = _reference_forward(l2.parameters(), 3, q, k)
    assert rel_err(l2(q, k), want) <= 1e-12


def test_no_bias():
    rng = np.random.default_rng(4)
    layer = make(8, 2, bias=False)
    x = rng.standard_normal((2, 5, 8))
    want, _ = _reference_forward(layer.parameters(), 2, x, causal=True)
    assert rel_err(layer(x, causal=True), want) <= 1e-12


def test_heads_are_views_of_the_projection():
    """The kernel gets the heads as strided views, not copies."""
    p = np.arange(2 * 5 * 12, dtype=np.float64).reshape(2, 5, 12)
    heads = multihead._split_heads(p[..., 4:8], 2)
    assert heads.shape == (2, 2, 5, 2) and np.shares_memory(heads, p)
    np.testing.assert_array_equal(heads[1, 1, 3], p[1, 3, 6:8])


# --------------------------------------------------------------------------
# Backward against central differences (float64)

def _fd_check(layer, call, g_out, grads, names=None):
    """Every input and parameter gradient against central differences of
    sum(g_out * out)."""
    arrays = dict(call.args)
    for name, x in arrays.items():
        num = numerical_grad(lambda: float(np.sum(g_out * call())), x)
        got = getattr(grads, name)
        assert got is not None and got.shape == x.shape, name
        assert rel_err(got, num) <= FD_TOL, name
    params = layer.parameters()
    analytic = layer.grads()
    assert set(analytic) == set(params)
    for name in names or params:
        num = numerical_grad(lambda: float(np.sum(g_out * call())),
                             params[name])
        assert rel_err(analytic[name], num) <= FD_TOL, name


class _Call:
    """layer(*args, **kw) with the arrays perturbed in place by the FD."""

    def __init__(self, layer, args, kw):
        self.layer, self.args, self.kw = layer, args, kw

    def __call__(self):
        pos = [x for _, x in self.args]
        res = self.layer(*pos, **self.kw)
        return res[0] if self.kw.get("return_weights") else res


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("case", ["self", "self_masked", "cross",
                                  "kdim_vdim"])
def test_backward_finite_differences(case, weights):
    rng = np.random.default_rng(11)
    E, h, lead, Tq, S = 6, 2, (2,), 3, 4
    kw = {"return_weights": weights}
    if case.startswith("self"):
        layer = make(E, h)
        x = rng.standard_normal(lead + (Tq, E))
        args = [("query", x)]
        if case == "self_masked":
            kw.update(mask=np.array([[True, False, True], [False] * 3]),
                      attn_mask=rng.random((Tq, Tq)) < 0.7, causal=True)
    elif case == "cross":
        layer = make(E, h)
        q, k, v = inputs(rng, lead, Tq, S, E)
        args = [("query", q), ("key", k), ("value", v)]
        kw.update(mask=np.array([[True, True, False, True]] * 2),
                  causal=True)
    else:
        layer = make(E, h, kdim=3, vdim=5)
        q, k, v = inputs(rng, lead, Tq, S, E, 3, 5)
        args = [("query", q), ("key", k), ("value", v)]
    call = _Call(layer, args, kw)
    out = call()
    g_out = rng.standard_normal(out.shape)
    grads = layer.backward(g_out)
    assert isinstance(grads, MultiHeadInputGrads)
    if case.startswith("self"):
        assert grads.key is None and grads.value is None
    _fd_check(layer, call, g_out, grads)


def test_backward_explicit_same_array_fields_add_up():
    """layer(x, x, x): three fields that add up to the gradient of
    layer(x)'s x."""
    rng = np.random.default_rng(5)
    layer = make(8, 2)
    x = rng.standard_normal((2, 5, 8))
    g_out = rng.standard_normal((2, 5, 8))
    layer(x, causal=True)
    whole = layer.backward(g_out)
    pgrads = layer.grads()
    layer(x, x, x, causal=True)
    parts = layer.backward(g_out)
    assert parts.key is not None and parts.value is not None
    assert rel_err(parts.query + parts.key + parts.value,
                   whole.query) <= 1e-13
    for n, g in layer.grads().items():
        assert rel_err(g, pgrads[n]) <= 1e-13, n
    # key given, value defaulting to it: value's share is in key's field
    layer(x, x, causal=True)
    kv = layer.backward(g_out)
    assert kv.value is None
    assert rel_err(kv.key, parts.key + parts.value) <= 1e-13


def test_backward_broadcast_inputs_summed_back():
    rng = np.random.default_rng(6)
    layer = make(6, 3)
    q = rng.standard_normal((2, 3, 6))
    k = rng.standard_normal((1, 4, 6))
    call = _Call(layer, [("query", q), ("key", k)], {})
    g_out = rng.standard_normal(call().shape)
    grads = layer.backward(g_out)
    assert grads.key.shape == (1, 4, 6) and grads.value is None
    _fd_check(layer, call, g_out, grads, names=["in_proj_weight"])


def test_backward_errors():
    layer = make(8, 2)
    with pytest.raises(RuntimeError, match="before"):
        layer.backward(np.ones((2, 3, 8)))
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    layer(x)
    with pytest.raises(ValueError, match=r"grad_out has shape \(2, 3, 7\)"):
        layer.backward(np.ones((2, 3, 7)))
    assert layer.grads() == {}


# --------------------------------------------------------------------------
# Dropout

def test_dropout_eval_equals_no_dropout():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 17, 8))
    plain, drop = make(8, 2), make(8, 2, dropout=0.4)
    assert drop.training and drop.eval() is drop and not drop.training
    np.testing.assert_array_equal(drop(x, causal=True), plain(x, causal=True))
    assert drop.train() is drop and drop.training
    assert not np.allclose(drop(x, causal=True), plain(x, causal=True))


def test_dropout_reproducible_and_the_kernels_keep_bits():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 17, 8))
    gen = np.random.default_rng(21)
    a = MultiHeadAttention(8, 4, dropout=0.3, seed=gen)
    # the seed of each call in training: rng.integers(0, 2**63)
    twin = np.random.default_rng(21)
    twin.bit_generator.state = gen.bit_generator.state
    b = MultiHeadAttention(8, 4, dropout=0.3, seed=21)
    first, second = a(x, causal=True), a(x, causal=True)
    assert not np.allclose(first, second)             # a new seed per call
    np.testing.assert_array_equal(b(x, causal=True), first)
    np.testing.assert_array_equal(b(x, causal=True), second)
    for got in (first, second):
        seed = int(twin.integers(0, 2**63))
        want, _ = _reference_forward(a.parameters(), 4, x, causal=True,
                                     dropout=0.3, seed=seed)
        assert rel_err(got, want) <= 1e-12
    # the weights are those before dropout
    a.eval()
    _, w_eval = a(x, causal=True, return_weights=True)
    a.train()
    _, w_train = a(x, causal=True, return_weights=True)
    np.testing.assert_allclose(w_train, w_eval, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("weights", [False, True])
def test_dropout_backward_finite_differences(weights):
    """Each evaluation gets a fresh layer of the same seed and parameters:
    the same dropout seed for the forward, the FD and the backward."""
    rng = np.random.default_rng(10)
    base = make(6, 2, dropout=0.35, seed=2)
    params = {n: p.copy() for n, p in base.parameters().items()}
    x = rng.standard_normal((2, 4, 6))
    g_out = rng.standard_normal((2, 4, 6))

    def fresh():
        layer = MultiHeadAttention(6, 2, dropout=0.35, seed=2)
        for n, p in layer.parameters().items():
            p[...] = params[n]
        return layer

    def loss():
        res = fresh()(x, causal=True, return_weights=weights)
        return float(np.sum(g_out * (res[0] if weights else res)))

    layer = fresh()
    layer(x, causal=True, return_weights=weights)
    grads = layer.backward(g_out)
    assert rel_err(grads.query, numerical_grad(loss, x)) <= FD_TOL
    for n, g in layer.grads().items():
        assert rel_err(g, numerical_grad(loss, params[n])) <= FD_TOL, n


# --------------------------------------------------------------------------
# Decoding with a cache

@pytest.mark.parametrize("max_len", [17, None])
@pytest.mark.parametrize("lead", [(), (2,)])
def test_cache_decoding_equals_full_causal(max_len, lead):
    rng = np.random.default_rng(12)
    layer = make(12, 4)
    x = rng.standard_normal(lead + (17, 12))
    full, wfull = layer(x, causal=True, return_weights=True,
                        average_weights=False)
    cache = KVCache(max_len)
    first_keys = None
    for t in range(17):
        out, w = layer(x[..., t:t + 1, :], cache=cache, return_weights=True,
                       average_weights=False)
        assert len(cache) == t + 1
        assert rel_err(out, full[..., t:t + 1, :]) <= 1e-12
        assert rel_err(w[..., 0, :], wfull[..., t, :t + 1]) <= 1e-12
        assert cache.keys.shape == lead + (4, t + 1, 3)
        if first_keys is None:
            first_keys = cache.keys
            buffer = cache.keys.base
        # one buffer for every step when max_len is set: no copy
        if max_len is not None:
            assert cache.keys.base is buffer
            assert np.shares_memory(cache.keys, first_keys)
    if max_len is None:                 # grew by doubling from 16
        assert cache.keys.base.shape[-2] == 32
    # the cache holds the projected keys and values, head-major
    Wk, Wv = np.split(layer.in_proj_weight, 3)[1:]
    bk, bv = np.split(layer.in_proj_bias, 3)[1:]
    keys = (x @ Wk.T + bk).reshape(lead + (17, 4, 3)).swapaxes(-2, -3)
    vals = (x @ Wv.T + bv).reshape(lead + (17, 4, 3)).swapaxes(-2, -3)
    assert rel_err(cache.keys, keys) <= 1e-13
    assert rel_err(cache.values, vals) <= 1e-13
    with pytest.raises(RuntimeError, match="cache"):
        layer.backward(np.ones_like(out))


def test_cache_several_new_queries_bottom_right():
    rng = np.random.default_rng(13)
    layer = make(8, 2)
    x = rng.standard_normal((3, 17, 8))
    full = layer(x, causal=True)
    cache = KVCache()
    pieces = [layer(x[:, a:b], cache=cache, causal=True)
              for a, b in ((0, 5), (5, 6), (6, 17))]
    assert rel_err(np.concatenate(pieces, axis=1), full) <= 1e-12
    cache.reset()
    assert len(cache) == 0
    out = layer(x[:, :3], cache=cache, causal=True)
    assert rel_err(out, full[:, :3]) <= 1e-12


def test_cache_with_key_mask():
    rng = np.random.default_rng(14)
    layer = make(8, 2)
    x = rng.standard_normal((2, 6, 8))
    m = np.array([[True, False, True, True, False, True]] * 2)
    full = layer(x, mask=m, causal=True)
    cache = KVCache(6)
    for t in range(6):
        out = layer(x[:, t:t + 1], cache=cache, mask=m[:, :t + 1])
        assert rel_err(out, full[:, t:t + 1]) <= 1e-12


def test_static_cache_cross_attention():
    rng = np.random.default_rng(15)
    layer = make(12, 3, kdim=5, vdim=7)
    q, k, v = inputs(rng, (2,), 4, 17, 12, 5, 7)
    full = layer(q, k, v)
    cache = KVCache(static=True)
    first = layer(q[:, :1], k, v, cache=cache)
    assert len(cache) == 17 and cache.keys.shape == (2, 3, 17, 4)
    keys = cache.keys
    rest = layer(q[:, 1:], cache=cache)             # key/value ignored
    assert cache.keys is not None and np.shares_memory(cache.keys, keys)
    assert rel_err(np.concatenate([first, rest], axis=1), full) <= 1e-12
    cache.reset()
    assert len(cache) == 0 and cache.keys is None


def test_cache_errors_change_nothing():
    rng = np.random.default_rng(16)
    layer = make(8, 2)
    x = rng.standard_normal((2, 3, 8))
    cache = KVCache(4)
    layer(x, cache=cache)
    keys = cache.keys.copy()
    with pytest.raises(ValueError, match="full"):
        layer(x, cache=cache)
    with pytest.raises(ValueError, match="batch shape"):
        layer(rng.standard_normal((3, 1, 8)), cache=cache)
    with pytest.raises(ValueError, match="mask has shape"):
        layer(x[:, :1], cache=cache, mask=np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="one layer"):
        make(8, 4)(x[:, :1], cache=cache)
    assert len(cache) == 3
    np.testing.assert_array_equal(cache.keys, keys)
    with pytest.raises(ValueError, match="max_len"):
        KVCache(0)
    with pytest.raises(TypeError, match="max_len"):
        KVCache(2.5)
    with pytest.raises(TypeError, match="KVCache"):
        layer(x, cache={})


# --------------------------------------------------------------------------
# Training

@pytest.mark.parametrize("step", ["sgd", "adam"])
def test_optimiser_steps_decrease_a_loss(step):
    rng = np.random.default_rng(17)
    layer = MultiHeadAttention(8, 2, seed=1)
    x = rng.standard_normal((4, 6, 8))
    target = rng.standard_normal((4, 6, 8))
    state = {}
    losses = []
    for _ in range(30):
        out = layer(x, causal=True)
        losses.append(float(np.mean((out - target) ** 2)))
        layer.backward(2 * (out - target) / out.size)
        if step == "sgd":
            sgd_step(layer.parameters(), layer.grads(), lr=0.5)
        else:
            adam_step(layer.parameters(), layer.grads(), state, lr=1e-2)
    assert losses[-1] < 0.9 * losses[0]


# --------------------------------------------------------------------------
# Bad input

def test_constructor_errors():
    with pytest.raises(ValueError, match="embed_dim=10 and num_heads=4"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match="num_heads"):
        MultiHeadAttention(8, 0)
    with pytest.raises(TypeError, match="float32 or float64"):
        MultiHeadAttention(8, 2, dtype=np.int32)
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadAttention(8, 2, dropout=1.0)
    with pytest.raises(TypeError, match="keyword-only"):
        MultiHeadAttention(8, 2, 4)


def test_call_errors_change_nothing():
    rng = np.random.default_rng(18)
    layer = make(8, 2, dropout=0.2, kdim=5, vdim=5)
    q, k, v = inputs(rng, (2,), 3, 4, 8, 5, 5)
    copies = [a.copy() for a in (q, k, v)]
    params = {n: p.copy() for n, p in layer.parameters().items()}
    m = np.ones((2, 4), bool)
    bad = [
        (ValueError, r"query has shape \(2, 3, 7\).*embed_dim = 8",
         (q[..., :7], k, v), {}),
        (ValueError, r"key has shape \(2, 4, 8\).*kdim = 5",
         (q, np.ones((2, 4, 8)), v), {}),
        (ValueError, r"value has shape .*vdim = 5",
         (q, k, np.ones((2, 4, 3))), {}),
        (ValueError, r"query has shape \(8,\)", (q[0, 0], k, v), {}),
        (ValueError, "key is required", (q,), {}),
        (ValueError, "same number of positions", (q, k, v[:, :3]), {}),
        (ValueError, "do not broadcast", (q, k[:1].repeat(3, 0), v), {}),
        (ValueError, r"mask has shape \(2, 5\)", (q, k, v),
         {"mask": np.ones((2, 5), bool)}),
        (ValueError, r"mask has shape \(2, 3, 4\).*attn_mask",
         (q, k, v), {"mask": np.ones((2, 3, 4), bool)}),
        (ValueError, r"mask has shape \(3, 2, 4\)", (q, k, v),
         {"mask": np.ones((3, 2, 4), bool)}),
        (ValueError, r"attn_mask has shape \(3, 5\)", (q, k, v),
         {"attn_mask": np.ones((3, 5), bool)}),
        (ValueError, r"attn_mask has shape \(2, 2, 3, 4\)", (q, k, v),
         {"attn_mask": np.ones((2, 2, 3, 4), bool)}),
        (TypeError, "mask must be a boolean", (q, k, v),
         {"mask": m.astype(float)}),
        (TypeError, "attn_mask must be a boolean.*True = masked",
         (q, k, v), {"attn_mask": np.ones((3, 4))}),
        (TypeError, "query must be an array of real numbers",
         (q.astype(complex), k, v), {}),
        (TypeError, "did you mean mask", (q, k, v, m), {}),
    ]
    for exc, msg, args, kw in bad:
        state = layer._rng.bit_generator.state
        with pytest.raises(exc, match=msg):
            layer(*args, **kw)
        assert layer._rng.bit_generator.state == state, msg
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)
    for n, p in layer.parameters().items():
        np.testing.assert_array_equal(p, params[n])
    with pytest.raises(RuntimeError, match="before"):
        layer.backward(np.ones((2, 3, 8)))


def test_inputs_unmodified_by_forward_and_backward():
    rng = np.random.default_rng(19)
    layer = make(8, 2)
    q, k, v = inputs(rng, (2,), 3, 5, 8)
    copies = [a.copy() for a in (q, k, v)]
    g = rng.standard_normal((2, 3, 8))
    g0 = g.copy()
    layer(q, k, v, causal=True, return_weights=True)
    layer.backward(g)
    for a, c in zip((q, k, v, g), copies + [g0]):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "int32"])
def test_inputs_of_other_dtypes_converted(name):
    """Inputs (and alibi_slopes, and a decoding step's query) of another
    real dtype are converted to the layer's: the results of the converted
    arrays, bit for bit; bfloat16 is ml_dtypes'."""
    dtype = (pytest.importorskip("ml_dtypes").bfloat16
             if name == "bfloat16" else np.dtype(name))
    rng = np.random.default_rng(23)
    slopes = np.array([0.5, 0.25], dtype)
    layer = MultiHeadAttention(8, 2, dtype=np.float32, alibi_slopes=slopes)
    q, k, v = ((x * 4).astype(dtype) for x in inputs(rng, (2,), 3, 5, 8))
    wide = [x.astype(np.float32) for x in (q, k, v)]
    np.testing.assert_array_equal(layer(q, k, v), layer(*wide))
    first, second = KVCache(), KVCache()
    np.testing.assert_array_equal(layer(q, cache=first),
                                  layer(wide[0], cache=second))


# --------------------------------------------------------------------------
# Against torch.nn.MultiheadAttention through from_torch

def _torch_mha(E, h, dtype, seed=0, **kw):
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    mha = torch.nn.MultiheadAttention(E, h, batch_first=True, dtype=tdt,
                                      **kw)
    with torch.no_grad():                  # non-zero biases
        for p in mha.parameters():
            p.copy_(torch.rand_like(p) - 0.5)
    return mha


def _torch_run(mha, q, k, v, *, mask=None, attn_mask=None, h,
               need_weights=False, average=True):
    """mha on NumPy inputs of any batch shape (flattened to one axis),
    our masks translated (True = masked in torch)."""
    torch = pytest.importorskip("torch")
    lead = q.shape[:-2]
    flat = [torch.tensor(a.reshape((-1,) + a.shape[-2:]), requires_grad=True)
            for a in (q, k, v)]
    kpm = None if mask is None else torch.tensor(
        ~np.broadcast_to(mask, lead + mask.shape[-1:]).reshape(
            -1, mask.shape[-1]))
    am = None
    if attn_mask is not None:
        a = ~np.asarray(attn_mask)
        if a.ndim > 2:              # (N * heads, L, S)
            a = np.repeat(a.reshape((-1,) + a.shape[-2:]), h, axis=0)
        am = torch.tensor(a)
    out, w = mha(*flat, key_padding_mask=kpm, attn_mask=am,
                 need_weights=need_weights, average_attn_weights=average)
    return out, w, flat


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)])
@pytest.mark.parametrize("kind", ["self", "causal", "masks", "kdim"])
def test_against_torch(dtype, lead, kind):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(20)
    E, h, Tq, S = 12, 4, 3, 17
    kw = {"kdim": 5, "vdim": 7} if kind == "kdim" else {}
    mha = _torch_mha(E, h, dtype, **kw)
    layer = MultiHeadAttention.from_torch(mha)
    assert layer.dtype == dtype and layer.training
    for n, p in layer.parameters().items():
        want = dict(mha.named_parameters())[n.replace("out_proj_",
                                                      "out_proj.")]
        np.testing.assert_array_equal(p, want.detach().numpy())
    if kind in ("self", "causal"):
        x = rng.standard_normal(lead + (S, E)).astype(dtype)
        q = k = v = x
        args = (x,)
    else:
        q, k, v = inputs(rng, lead, Tq, S, E, kw.get("kdim"),
                         kw.get("vdim"), dtype)
        args = (q, k, v)
    ours_kw, torch_kw = {}, {}
    if kind == "causal":
        tril = np.tril(np.ones((S, S), bool))
        ours_kw["causal"] = True
        torch_kw["attn_mask"] = tril
    elif kind in ("masks", "kdim"):
        m = rng.random(lead + (S,)) < 0.7
        m[..., 0] = True
        am = rng.random(lead + (Tq, S)) < 0.8
        am[..., 1] = True
        ours_kw.update(mask=m, attn_mask=am)
        torch_kw.update(mask=m, attn_mask=am)
    tq = q[None] if not lead else q        # torch: a batch axis
    tk, tv = (k[None], v[None]) if not lead else (k, v)
    for average in (True, False):
        tout, tw, flat = _torch_run(mha, tq, tk, tv, h=h, need_weights=True,
                                    average=average, **torch_kw)
        out, w = layer(*args, return_weights=True, average_weights=average,
                       **ours_kw)
        tol = TORCH_TOL[dtype]
        assert rel_err(out, tout.detach().numpy().reshape(out.shape)) <= tol
        assert rel_err(w, tw.detach().numpy().reshape(w.shape)) <= tol
    # gradients, through the streamed path
    out = layer(*args, **ours_kw)
    g_out = rng.standard_normal(out.shape).astype(dtype)
    grads = layer.backward(g_out)
    tout, _, flat = _torch_run(mha, tq, tk, tv, h=h, **torch_kw)
    mha.zero_grad()
    tout.backward(torch.tensor(g_out.reshape(tout.shape)))
    tol = TORCH_TOL[dtype]
    if len(args) == 1:
        want = sum(f.grad for f in flat).numpy()
        assert rel_err(grads.query, want.reshape(x.shape)) <= tol
    else:
        for got, f in zip(grads, flat):
            assert rel_err(got, f.grad.numpy().reshape(got.shape)) <= tol
    tgrads = {n.replace(".", "_"): p.grad.numpy()
              for n, p in mha.named_parameters()}
    assert set(tgrads) == set(layer.grads())
    for n, g in layer.grads().items():
        assert rel_err(g, tgrads[n]) <= tol, n


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_against_torch_fully_masked_rows(dtype):
    """torch gives NaN for a query with no visible key, we give 0 (the
    output bias after the projection): compare the other rows."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(22)
    E, h, Tq, S = 8, 2, 3, 5
    mha = _torch_mha(E, h, dtype)
    layer = MultiHeadAttention.from_torch(mha)
    q, k, v = inputs(rng, (3,), Tq, S, E, dtype=dtype)
    m = np.ones((3, S), bool)
    m[1] = False                           # sequence 1: no key at all
    am = np.ones((Tq, S), bool)
    am[0] = False                          # query 0: no key anywhere
    tout, tw, _ = _torch_run(mha, q, k, v, mask=m, attn_mask=am, h=h,
                             need_weights=True)
    out, w = layer(q, k, v, mask=m, attn_mask=am, return_weights=True)
    dead = np.zeros((3, Tq), bool)
    dead[1], dead[:, 0] = True, True
    tout = tout.detach().numpy()
    assert np.isnan(tout[dead]).all()
    assert rel_err(out[~dead], tout[~dead]) <= TORCH_TOL[dtype]
    assert rel_err(w[~dead], tw.detach().numpy()[~dead]) <= TORCH_TOL[dtype]
    np.testing.assert_array_equal(w[dead], 0)
    np.testing.assert_array_equal(
        out[dead], np.broadcast_to(layer.out_proj_bias, out[dead].shape))


def test_from_torch_options():
    torch = pytest.importorskip("torch")
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.25, bias=False)
    mha.eval()
    layer = MultiHeadAttention.from_torch(mha, dtype=np.float64)
    assert layer.dtype == np.float64 and layer.dropout == 0.25
    assert not layer.training and layer.in_proj_bias is None
    assert set(layer.parameters()) == {"in_proj_weight", "out_proj_weight"}
    half = torch.nn.MultiheadAttention(8, 2, dtype=torch.bfloat16)
    assert MultiHeadAttention.from_torch(half).dtype == np.float32
    for kw, name in (({"add_bias_kv": True}, "add_bias_kv"),
                     ({"add_zero_attn": True}, "add_zero_attn")):
        with pytest.raises(NotImplementedError, match=name):
            MultiHeadAttention.from_torch(
                torch.nn.MultiheadAttention(8, 2, **kw))
