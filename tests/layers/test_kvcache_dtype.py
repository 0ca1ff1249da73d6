"""KVCache(dtype=...): the NumPy layer's decoding cache stored in float16
or bfloat16 (ml_dtypes, when installed), or in another float dtype than
the layer's.

* a float32 layer decoding into a 16-bit cache (a prefill of several
  tokens, then one token per call; batch shapes (), (3,), (2, 2); 1 and
  3 heads of 1, 3 and 17 features; max_len given, or None so that the
  buffer grows): the cache holds the float32 cache's keys and values
  rounded to its dtype, bit for bit; every call's output is, bit for bit,
  the layer's own computation on the widened cache (the kernel reads
  16-bit keys and values as the float32 call reads their widened copy),
  and within REL_TOL of the float32 cache's; the buffer has the dtype,
  half the float32 bytes, through growth and reset;
* a decoding step allocates nothing of the cache's size: the 16-bit
  buffer is read in place;
* masks, windows and weights through a 16-bit cache; the static cache
  (cross-attention) converts the memory once;
* a cache of another float dtype than the layer's: float64 layers with
  16-bit and float32 caches, a float32 layer with a float64 cache (its
  results still float32);
* dtype=None and the layer's own dtype: today's results, bit for bit;
* bad dtypes (TypeError naming dtype; ImportError naming ml_dtypes for
  "bfloat16" without it), and the layer-mismatch errors, which change
  nothing.
"""

import sys
import tracemalloc

import numpy as np
import pytest

import attention_c as ac
from attention_c.layers import multihead
from attention_c.multihead import KVCache, MultiHeadAttention
from attention_c.testing import HALF_DTYPES, rel_err

pytestmark = pytest.mark.filterwarnings("error")

half_param = pytest.mark.parametrize("dtype", HALF_DTYPES,
                                     ids=lambda d: np.dtype(d).name)

# Unit roundoff of each 16-bit dtype (8 and 11 significant bits).
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
# Normwise error of a 16-bit cache's outputs against a float32 cache's,
# in units u: keys and values are each rounded by at most u relative; the
# values add up to u to the attention's output, the keys move each score
# by at most u |q| |k| / sqrt(d) (about u with these weights of order 1),
# which the softmax passes on, and the output projection mixes the heads.
# Measured here: at most 0.89 u (decoding), 0.36 u (static).
REL_TOL = 3


def unit(dtype):
    return UNIT[np.dtype(dtype).name]


def make(E, h, dtype=np.float32, seed=0, **kw):
    """A layer with non-zero biases and weights of order 1, so that every
    parameter matters."""
    layer = MultiHeadAttention(E, h, dtype=dtype, seed=seed, **kw)
    rng = np.random.default_rng(seed + 100)
    for p in layer.parameters().values():
        p[...] = rng.uniform(-0.5, 0.5, p.shape)
    return layer


def computed_on(layer, x, keys, values, wide=None, causal=False,
                self_attention=True, **kw):
    """The output of ``layer(x, cache=...)`` computed as the layer does
    (its projection, one dot_attention call, the output projection), but
    with the attention on ``keys`` and ``values`` converted to ``wide``
    (default the layer's dtype), its result back in the layer's dtype.

    The query's projection is the layer's own: for self-attention one
    product with the key and value rows of the packed weight, whose query
    columns need not have the bits of a product with the query rows
    alone; else the query rows alone."""
    wide = layer.dtype if wide is None else wide
    xq = np.asarray(x, dtype=layer.dtype)
    heads, _ = layer._project({0: xq, 1: xq, 2: xq} if self_attention
                              else {0: xq})
    q = heads[0].astype(wide, copy=False)
    out = ac.dot_attention(q, keys.astype(wide), values=values.astype(wide),
                           causal=causal, **kw)
    o = out[0].astype(layer.dtype, copy=False)
    y = multihead._linear(multihead._merge_heads(o), layer.out_proj_weight,
                          layer.out_proj_bias)
    if kw.get("return_weights", True):
        return y, out[1].astype(layer.dtype, copy=False)
    return y


def pieces(T, prefill):
    """A prefill of ``prefill`` tokens, then one token per call."""
    return [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]


# --------------------------------------------------------------------------
# Decoding into a 16-bit cache

@half_param
@pytest.mark.parametrize("lead", [(), (3,), (2, 2)], ids=str)
@pytest.mark.parametrize("h", [1, 3])
@pytest.mark.parametrize("d", [1, 3, 17])
@pytest.mark.parametrize("max_len", [19, None])
def test_decoding_half_cache(dtype, lead, h, d, max_len):
    rng = np.random.default_rng(7 * h + d)
    layer = make(h * d, h)
    x = rng.standard_normal(lead + (19, h * d)).astype(np.float32)
    half, c32 = KVCache(max_len, dtype=dtype), KVCache(max_len)
    got, want = [], []
    for a, b in pieces(19, 5):
        xt = x[..., a:b, :]
        out = layer(xt, cache=half, causal=True)
        out32 = layer(xt, cache=c32, causal=True)
        assert out.dtype == np.float32 and out.shape == xt.shape
        assert len(half) == b and half.keys.dtype == dtype
        assert half.values.dtype == dtype
        assert half.keys.shape == lead + (h, b, d)
        # the float32 cache's contents, rounded
        assert np.array_equal(half.keys, c32.keys.astype(dtype))
        assert np.array_equal(half.values, c32.values.astype(dtype))
        # the layer on the rounded keys and values, bit for bit
        assert np.array_equal(out, computed_on(
            layer, xt, half.keys, half.values, causal=True,
            return_weights=False))
        got.append(out)
        want.append(out32)
    got, want = np.concatenate(got, -2), np.concatenate(want, -2)
    assert rel_err(got, want) <= REL_TOL * unit(dtype)
    assert not np.array_equal(got, want)        # the cache did round
    # half the bytes of the float32 buffer; grown (from 16 to 32
    # positions) without max_len, in its dtype
    assert half._k.dtype == half._v.dtype == dtype
    assert 2 * half._k.nbytes == c32._k.nbytes
    assert 2 * half._v.nbytes == c32._v.nbytes
    assert half._k.shape[-2] == (32 if max_len is None else 19)


@half_param
def test_decoding_step_reads_the_cache_in_place(dtype):
    """A step against 2048 cached positions allocates nothing like the
    1 MiB a float32 copy of the keys would take (tracemalloc sees
    NumPy's allocations, copies included); the prefill, many queries
    per sequence, works on widened copies."""
    layer = MultiHeadAttention(64, 4, dtype=np.float32, seed=0)
    x = np.random.default_rng(1).standard_normal((2, 2049, 64))
    x = x.astype(np.float32)
    cache = KVCache(2049, dtype=dtype)
    layer(x[:, :2048], cache=cache, causal=True)
    layer(x[:, :1], cache=KVCache(dtype=dtype))      # scratch made
    copy = cache.keys.size * 4                       # float32 bytes
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = layer(x[:, 2048:], cache=cache)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < copy // 16, (peak, copy)
    assert np.array_equal(out, computed_on(
        layer, x[:, 2048:], cache.keys, cache.values,
        return_weights=False))


@half_param
def test_half_cache_with_mask_window_and_weights(dtype):
    rng = np.random.default_rng(3)
    layer = make(12, 3)
    x = rng.standard_normal((2, 9, 12)).astype(np.float32)
    m = rng.random((2, 9)) < 0.7
    m[:, 0] = True
    cache = KVCache(dtype=dtype)
    for a, b in pieces(9, 3):
        kw = {"mask": m[:, :b], "window": (3, 0), "causal": True}
        out, w = layer(x[:, a:b], cache=cache, return_weights=True,
                       average_weights=False, **kw)
        assert out.dtype == w.dtype == np.float32
        want, wwant = computed_on(layer, x[:, a:b], cache.keys,
                                  cache.values, mask=m[:, None, :b],
                                  window=(3, 0), causal=True)
        assert np.array_equal(out, want)
        assert np.array_equal(w, wwant)


@half_param
def test_static_half_cache(dtype):
    """Cross-attention: the memory is projected and converted once, at the
    first call; later calls reuse the same 16-bit arrays."""
    rng = np.random.default_rng(15)
    layer = make(12, 3, kdim=5, vdim=7)
    q = rng.standard_normal((2, 4, 12)).astype(np.float32)
    k = rng.standard_normal((2, 17, 5)).astype(np.float32)
    v = rng.standard_normal((2, 17, 7)).astype(np.float32)
    half, c32 = KVCache(static=True, dtype=dtype), KVCache(static=True)
    got = [layer(q[:, :1], k, v, cache=half)]
    want = [layer(q[:, :1], k, v, cache=c32)]
    assert len(half) == 17 and half.keys.shape == (2, 3, 17, 4)
    assert half.keys.dtype == half.values.dtype == dtype
    assert np.array_equal(half.keys, c32.keys.astype(dtype))
    assert np.array_equal(half.values, c32.values.astype(dtype))
    keys, values = half._k, half._v
    for t in range(1, 4):
        got.append(layer(q[:, t:t + 1], cache=half))   # key/value ignored
        want.append(layer(q[:, t:t + 1], cache=c32))
        assert half._k is keys and half._v is values    # not converted
    for t, out in enumerate(got):
        assert out.dtype == np.float32
        assert np.array_equal(out, computed_on(
            layer, q[:, t:t + 1], keys, values, self_attention=False,
            return_weights=False))
    got, want = np.concatenate(got, 1), np.concatenate(want, 1)
    assert rel_err(got, want) <= REL_TOL * unit(dtype)
    half.reset()
    assert len(half) == 0 and half.keys is None and half.dtype == dtype
    layer(q[:, :1], k, v, cache=half)
    assert half.keys.dtype == dtype


# --------------------------------------------------------------------------
# Other dtypes than the layer's

@pytest.mark.parametrize("layer_dtype, cache_dtype", [
    (np.float64, d) for d in HALF_DTYPES] + [
    (np.float64, np.float32), (np.float32, np.float64)],
    ids=lambda d: np.dtype(d).name)
def test_cache_of_another_dtype(layer_dtype, cache_dtype):
    """The call computes in the wider of the two (float64 here), on the
    cache as stored, and returns the layer's dtype."""
    rng = np.random.default_rng(4)
    layer = make(12, 3, dtype=layer_dtype)
    x = rng.standard_normal((2, 9, 12))
    cache, ref = KVCache(dtype=cache_dtype), KVCache()
    for a, b in pieces(9, 4):
        out = layer(x[:, a:b], cache=cache, causal=True)
        layer(x[:, a:b], cache=ref, causal=True)
        assert out.dtype == layer_dtype
        assert cache.keys.dtype == cache_dtype
        assert np.array_equal(cache.keys, ref.keys.astype(cache_dtype))
        assert np.array_equal(out, computed_on(
            layer, x[:, a:b], cache.keys, cache.values, np.float64,
            causal=True, return_weights=False))


# --------------------------------------------------------------------------
# The default: the layer's dtype, as before

@pytest.mark.parametrize("layer_dtype", [np.float32, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("static", [False, True])
def test_default_dtype_unchanged(layer_dtype, static):
    """dtype=None, and the layer's own dtype given, decode exactly as a
    cache made without the argument, which is the layer's computation on
    its own keys and values."""
    rng = np.random.default_rng(5)
    layer = make(12, 3, dtype=layer_dtype)
    x = rng.standard_normal((2, 9, 12))
    caches = [KVCache(static=static), KVCache(static=static, dtype=None),
              KVCache(static=static, dtype=layer_dtype)]
    assert caches[1].dtype is None and repr(caches[1]) == repr(caches[0])
    assert "dtype" not in repr(caches[0])
    for a, b in pieces(9, 4):
        outs = [layer(x[:, a:b], cache=c, causal=not static)
                for c in caches]
        for c, out in zip(caches, outs):
            assert out.dtype == layer_dtype
            assert c.keys.dtype == c._k.dtype == layer_dtype
            assert np.array_equal(out, outs[0])
        assert np.array_equal(outs[0], computed_on(
            layer, x[:, a:b], caches[0].keys, caches[0].values,
            causal=not static, return_weights=False))
    assert all(np.array_equal(c.keys, caches[0].keys) for c in caches)


# --------------------------------------------------------------------------
# Construction, repr, reset

@pytest.mark.parametrize("given, name", [
    (np.float16, "float16"), ("float16", "float16"), ("f2", "float16"),
    (np.dtype(np.float16), "float16"), (np.float32, "float32"),
    ("float32", "float32"), (np.float64, "float64"), (float, "float64"),
    ("float64", "float64")])
def test_accepted_dtypes(given, name):
    cache = KVCache(dtype=given)
    assert cache.dtype == np.dtype(name)
    assert repr(cache) == (f"KVCache(max_len=None, static=False, "
                           f"dtype={name}, len=0)")


def test_bfloat16_by_name_and_type():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for given in ("bfloat16", ml_dtypes.bfloat16,
                  np.dtype(ml_dtypes.bfloat16)):
        cache = KVCache(4, dtype=given, static=True)
        assert cache.dtype == np.dtype(ml_dtypes.bfloat16)
        assert repr(cache) == ("KVCache(max_len=4, static=True, "
                               "dtype=bfloat16, len=0)")


def test_bfloat16_without_ml_dtypes(monkeypatch):
    """The name needs ml_dtypes (NumPy does not know it): the error says
    what to install."""
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)   # import fails
    with pytest.raises(ImportError, match=r"ml_dtypes.*attention_c\["
                                          r"bfloat16\]"):
        KVCache(dtype="bfloat16")


@pytest.mark.parametrize("bad", [
    np.int32, "uint8", "float8", complex, np.complex64, bool, object, "U4",
    np.longdouble, ">f2" if sys.byteorder == "little" else "<f2",
    "not a dtype", 3.5],
    ids=repr)
def test_bad_dtypes(bad):
    if bad is np.longdouble and np.dtype(bad) == np.float64:
        pytest.skip("long double is float64 here")
    with pytest.raises(TypeError, match=r"dtype must be one of float16, "
                                        r"bfloat16 \(ml_dtypes\)"):
        KVCache(dtype=bad)


def test_other_ml_dtypes_refused():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for bad in (ml_dtypes.float8_e4m3fn, "float8_e5m2", ml_dtypes.int4):
        with pytest.raises(TypeError, match="dtype must be one of"):
            KVCache(dtype=bad)


@half_param
def test_reset_keeps_dtype_and_buffer(dtype):
    rng = np.random.default_rng(6)
    layer = make(8, 2)
    x = rng.standard_normal((3, 7, 8)).astype(np.float32)
    cache = KVCache(dtype=dtype)
    first = [layer(x[:, a:b], cache=cache, causal=True)
             for a, b in pieces(7, 2)]
    buffer = cache._k
    cache.reset()
    assert len(cache) == 0 and cache.dtype == dtype
    again = [layer(x[:, a:b], cache=cache, causal=True)
             for a, b in pieces(7, 2)]
    assert cache._k is buffer and cache.keys.dtype == dtype
    for p, q in zip(first, again):
        assert np.array_equal(p, q)


# --------------------------------------------------------------------------
# Mismatches: the errors of before, nothing changed

@half_param
def test_layer_mismatch_errors_change_nothing(dtype):
    rng = np.random.default_rng(16)
    layer = make(8, 2)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    cache = KVCache(4, dtype=dtype)
    layer(x, cache=cache)
    keys, values = cache.keys.copy(), cache.values.copy()
    with pytest.raises(ValueError, match="one layer"):
        make(8, 4)(x[:, :1], cache=cache)        # head size 2, not 4
    with pytest.raises(ValueError, match="batch shape"):
        layer(x[:1, :1], cache=cache)
    with pytest.raises(ValueError, match="full"):
        layer(x[:, :2], cache=cache)
    assert len(cache) == 3 and cache.keys.dtype == dtype
    assert np.array_equal(cache.keys, keys)
    assert np.array_equal(cache.values, values)
    # static: the memory's head size
    mem = KVCache(static=True, dtype=dtype)
    layer(x[:, :1], x, cache=mem)
    with pytest.raises(ValueError, match="static cache"):
        make(8, 4)(x[:, :1], cache=mem)
    assert len(mem) == 3 and mem.keys.dtype == dtype


def test_default_cache_keeps_the_layer_dtype_check():
    """dtype=None stores the first layer's dtype: a layer of another
    dtype is refused, as before."""
    x = np.random.default_rng(17).standard_normal((2, 3, 8))
    cache = KVCache()
    make(8, 2, dtype=np.float32)(x, cache=cache)
    with pytest.raises(ValueError, match="dtype float64"):
        make(8, 2, dtype=np.float64)(x[:, :1], cache=cache)
    assert len(cache) == 3 and cache.keys.dtype == np.float32
