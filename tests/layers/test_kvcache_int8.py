"""KVCache(dtype="int8", group=g): the NumPy layer's decoding cache in int8
with one float32 scale per group of g elements (attention_c.quantize_kv),
read in place by attention_c.cache_attention.

* a float32 layer decoding into an int8 cache (a prefill of several
  tokens, then one token per call; batch shapes (), (3,), (2, 2); 1 and 3
  heads of 16 and 32 features; groups of 8, 16 and 32; max_len given, or
  None so that the buffer and its scales grow): the cache holds exactly
  quantize_kv of the float32 cache's keys and values; every output is the
  layer's own computation on the dequantized cache (in float64) within
  float32's TOL, and within 3e-2 of the float32 cache's (the
  quantization);
* window, softcap, ALiBi slopes and sinks through an int8 cache; the
  static cache (cross-attention) quantizes the memory once;
* refused, before the cache changes: masks, weights, packed sequences,
  training-time dropout, a float64 layer, a group that does not divide
  the head size; group with another dtype, bad groups.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c.layers import multihead
from attention_c.multihead import KVCache, MultiHeadAttention
from attention_c.testing import TOL, rel_err

pytestmark = pytest.mark.filterwarnings("error")

# Normwise error of an int8 cache's outputs against a float32 cache's:
# each element is off by at most half a step, max|x| / 254 of its group
# (about 1e-2 of its size for Gaussian groups of 32); measured at most
# 6e-3 here.
QUANT_TOL = 3e-2


def make(E, h, dtype=np.float32, seed=0, **kw):
    """A layer with non-zero biases and weights of order 1."""
    layer = MultiHeadAttention(E, h, dtype=dtype, seed=seed, **kw)
    rng = np.random.default_rng(seed + 100)
    for p in layer.parameters().values():
        p[...] = rng.uniform(-0.5, 0.5, p.shape)
    return layer


def on_dequantized(layer, x, cache, self_attention=True, **kw):
    """The layer's output on the values the int8 cache holds, computed in
    float64 (its projection, dot_attention, the output projection)."""
    xq = np.asarray(x, dtype=layer.dtype)
    heads, _ = layer._project({0: xq, 1: xq, 2: xq} if self_attention
                              else {0: xq})
    k = ac.dequantize_kv(cache.keys, cache.key_scales).astype(np.float64)
    v = ac.dequantize_kv(cache.values, cache.value_scales).astype(
        np.float64)
    kw = dict(kw, alibi_slopes=layer.alibi_slopes, sinks=layer.sinks)
    kw = {n: a for n, a in kw.items() if a is not None}
    out, _ = ac.dot_attention(heads[0].astype(np.float64), k, values=v,
                              return_weights=False, **kw)
    o = out.astype(layer.dtype)
    return multihead._linear(multihead._merge_heads(o),
                             layer.out_proj_weight, layer.out_proj_bias)


@pytest.mark.parametrize("lead", [(), (3,), (2, 2)], ids=str)
@pytest.mark.parametrize("h, d, group", [(1, 16, 8), (3, 16, 16),
                                         (3, 32, 32), (1, 32, 8)])
@pytest.mark.parametrize("max_len", [19, None])
def test_decoding_int8_cache(lead, h, d, group, max_len):
    rng = np.random.default_rng(7 * h + d + group)
    layer = make(h * d, h)
    x = rng.standard_normal(lead + (19, h * d)).astype(np.float32)
    q8, c32 = KVCache(max_len, dtype="int8", group=group), KVCache(max_len)
    got, want = [], []
    for a, b in [(0, 5)] + [(t, t + 1) for t in range(5, 19)]:
        xt = x[..., a:b, :]
        out = layer(xt, cache=q8, causal=True)
        out32 = layer(xt, cache=c32, causal=True)
        assert out.dtype == np.float32 and out.shape == xt.shape
        assert len(q8) == b and q8.keys.dtype == np.int8
        assert q8.keys.shape == lead + (h, b, d)
        assert q8.key_scales.shape == lead + (h, b, d // group)
        for c, s, w in ((q8.keys, q8.key_scales, c32.keys),
                        (q8.values, q8.value_scales, c32.values)):
            wq, ws = ac.quantize_kv(w, group)
            assert np.array_equal(c, wq) and np.array_equal(s, ws)
        want_out = on_dequantized(layer, xt, q8, causal=True)
        assert rel_err(out, want_out) <= TOL[np.float32], (a, b)
        got.append(out)
        want.append(out32)
    got, want = np.concatenate(got, -2), np.concatenate(want, -2)
    assert rel_err(got, want) <= QUANT_TOL
    # a quarter of the float32 bytes, grown (16 to 32 positions) without
    # max_len, and the scales with it
    assert 4 * q8._k.nbytes == c32._k.nbytes
    assert q8._k.shape[-2] == q8._ks.shape[-2] == (
        32 if max_len is None else 19)


def test_variants_through_an_int8_cache():
    """window, softcap, ALiBi slopes and sinks: the layer's computation
    on the dequantized cache."""
    rng = np.random.default_rng(3)
    layer = make(64, 4, alibi_slopes=[0.5, 0.25, 0.125, 0.0625], sinks=True)
    layer.sinks[...] = rng.standard_normal(4)
    x = rng.standard_normal((2, 11, 64)).astype(np.float32)
    kw = {"window": (4, 0), "softcap": 5.0, "causal": True}
    cache = KVCache(dtype="int8", group=16)
    for a, b in [(0, 6)] + [(t, t + 1) for t in range(6, 11)]:
        out = layer(x[:, a:b], cache=cache, **kw)
        want = on_dequantized(layer, x[:, a:b], cache, **kw)
        assert rel_err(out, want) <= TOL[np.float32], (a, b)


def test_static_int8_cache():
    """Cross-attention: the memory quantized once, then reused."""
    rng = np.random.default_rng(4)
    layer = make(32, 2)
    mem = rng.standard_normal((3, 9, 32)).astype(np.float32)
    cache = KVCache(static=True, dtype="int8", group=8)
    y0 = layer(rng.standard_normal((3, 1, 32)), mem, mem, cache=cache)
    keys = cache.keys.copy()
    assert keys.dtype == np.int8 and keys.shape == (3, 2, 9, 16)
    for t in range(3):
        xt = rng.standard_normal((3, 1, 32)).astype(np.float32)
        out = layer(xt, cache=cache)
        assert np.array_equal(cache.keys, keys)
        assert rel_err(out, on_dequantized(layer, xt, cache,
                                           self_attention=False)) <= TOL[
            np.float32]
    assert y0.shape == (3, 1, 32)


@pytest.mark.parametrize("kw, match", [
    ({"mask": np.ones(3, bool)}, "mask is not supported"),
    ({"attn_mask": np.ones((1, 3), bool)}, "attn_mask is not supported"),
    ({"return_weights": True}, "return_weights is not supported"),
    ({"cu_seqlens_q": [0, 1], "cu_seqlens_k": [0, 3]},
     "cu_seqlens_q is not supported"),
])
def test_refused_arguments_change_nothing(kw, match):
    layer = make(32, 2)
    x = np.random.default_rng(6).standard_normal((1, 3, 32))
    cache = KVCache(dtype="int8", group=16)
    layer(x[:, :2], cache=cache)
    keys = cache.keys.copy()
    with pytest.raises(ValueError, match=match):
        layer(x[:, 2:], cache=cache, **kw)
    assert len(cache) == 2 and np.array_equal(cache.keys, keys)


def test_refused_layers_and_groups():
    x = np.random.default_rng(8).standard_normal((1, 2, 48))
    with pytest.raises(TypeError, match="int8 KVCache serves float32 layers"):
        make(48, 2, dtype=np.float64)(x, cache=KVCache(dtype="int8",
                                                       group=8))
    drop = make(48, 2, dropout=0.5)
    drop.train()
    with pytest.raises(ValueError, match="dropout is not supported"):
        drop(x, cache=KVCache(dtype="int8", group=8))
    cache = KVCache(dtype="int8", group=16)     # 48 / 2 = 24 features
    with pytest.raises(ValueError, match=r"group=16 must divide the head "
                                         r"size \(24"):
        make(48, 2)(x, cache=cache)
    assert len(cache) == 0 and cache.keys is None
    with pytest.raises(ValueError, match="group goes with dtype='int8'"):
        KVCache(dtype=np.float16, group=32)
    for bad in (4, 7.5, True, "32"):
        with pytest.raises(ValueError, match="group must be an int >= 8"):
            KVCache(dtype="int8", group=bad)
    assert repr(KVCache(dtype=np.int8)) == (
        "KVCache(max_len=None, static=False, dtype=int8, group=32, len=0)")
