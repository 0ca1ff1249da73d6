"""attention_c.torch.flash_attn_with_kvcache (issue 34, step 2) with int8
caches, float32 or float16 scales: bitwise the NumPy call
(attention_c.cache_attention), and the float32 call on the dequantized
cache (attention_c.dequantize_kv), near the float64 PyTorch reference;
appends quantized into the caller's cache and scales (slot by slot, as a
decoding loop does), strided scales and caches, cache_batch_idx, int8 keys
with bfloat16 values; the refusal of gradients; and the errors, which
write nothing. The shared cases are in flash_attn_kvcache_cases.py.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attention_c  # noqa: E402
from attention_c.torch import flash_attn_with_kvcache  # noqa: E402

from flash_attn_kvcache_cases import (Cache, VARIANTS, check,  # noqa: E402
                                      check_lse, fill, np_kw, randn,
                                      reference)

pytestmark = pytest.mark.skipif(
    not hasattr(attention_c, "cache_attention"),
    reason="attention_c.cache_attention is not built")


# --------------------------------------------------------------------------
# int8 caches (issue 34, step 2)

needs_int8 = pytest.mark.skipif(
    not hasattr(attention_c, "quantize_kv"),
    reason="attention_c.quantize_kv is not built")


def quantized(c, which, sdtype=torch.float32, groups=(2, 1)):
    """Cache ``c`` with its keys (``which`` "k"), values ("v") or both
    ("kv") as int8 and scales of ``sdtype``, ``groups`` groups a row
    (keys, values), quantized by attention_c.quantize_kv; the scales in
    c.ks and c.vs (None for a float cache)."""
    c = c.copy()
    c.ks = c.vs = None
    for name, ng in zip("kv", groups):
        if name not in which:
            continue
        x = getattr(c, name)
        q, sc = attention_c.quantize_kv(x.float().numpy(),
                                        group=x.shape[-1] // ng)
        setattr(c, name, torch.from_numpy(q))
        setattr(c, name + "s", torch.from_numpy(sc).to(sdtype))
    return c


def twin_of(c):
    """An independent copy (caches and scales)."""
    t = c.copy()
    t.ks, t.vs = (None if x is None else x.clone() for x in (c.ks, c.vs))
    return t


def dequantized(c):
    """The float32 cache an int8 one holds (attention_c.dequantize_kv); a
    float cache as it is."""
    f = c.copy()
    for name in "kv":
        sc = getattr(c, name + "s")
        if sc is not None:
            setattr(f, name, torch.from_numpy(attention_c.dequantize_kv(
                getattr(c, name).numpy(), sc.numpy())))
    f.ks = f.vs = None
    return f


def int8_call(c, q, kn=None, vn=None, **kw):
    return flash_attn_with_kvcache(
        q, c.k, c.v, kn, vn, cache_seqlens=c.seqlens,
        return_softmax_lse=True, k_scales=c.ks, v_scales=c.vs,
        **c.kw(), **kw)


def numpy_call(c, q, kn=None, vn=None, **kw):
    """attention_c.cache_attention on NumPy views of c's tensors, lse in
    flash_attn's layout."""
    def arr(t):
        if t is None:
            return None
        if t.dtype == torch.bfloat16:
            import ml_dtypes
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    table = None if c.table is None else c.table.numpy()
    out, lse = attention_c.cache_attention(
        arr(q), arr(c.k), arr(c.v), c.seqlens.numpy(), k=arr(kn),
        v=arr(vn), block_table=table, k_scales=arr(c.ks),
        v_scales=arr(c.vs), return_lse=True, **np_kw(kw))
    return torch.from_numpy(out), torch.from_numpy(lse).transpose(1, 2)


@needs_int8
@pytest.mark.parametrize("which", ["k", "v", "kv", "k_bf16v"])
@pytest.mark.parametrize("sdtype", [torch.float32, torch.float16],
                         ids=["f32scales", "f16scales"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("variant", ["plain", "all"])
def test_int8_bitwise(which, sdtype, layout, variant):
    """int8 keys, values or both (or int8 keys with bfloat16 values), two
    new positions appended: bitwise the NumPy call (the same writes into
    caches and scales), and bitwise the call on the float32 cache
    attention_c.dequantize_kv gives of what ours holds afterwards."""
    B, S, H, Hk, d, dv = 3, 16, 6, 2, 16, 8
    base = Cache(B, S, Hk, d, dv, [7, 0, 12],
                 block=4 if layout == "paged" else None)
    if which == "k_bf16v":
        base.v = base.v.to(torch.bfloat16)
    c = quantized(base, "k" if which == "k_bf16v" else which, sdtype)
    twin = twin_of(c)
    q = randn(B, 2, H, d, seed=5)
    kn, vn = randn(B, 2, Hk, d, seed=6), randn(B, 2, Hk, dv, seed=7)
    kw = fill(VARIANTS[variant], B, H)
    out, lse = int8_call(c, q, kn, vn, **kw)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    want, want_lse = numpy_call(twin, q, kn, vn, **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    for name in ("k", "v", "ks", "vs"):
        a, b = getattr(c, name), getattr(twin, name)
        assert a is None and b is None or torch.equal(a, b), name
    # the float32 cache it holds, now with the new positions
    f = dequantized(c)
    f.seqlens = c.seqlens + 2
    out32, lse32 = int8_call(f, q, **kw)
    assert torch.equal(out, out32) and torch.equal(lse, lse32)
    # near the float64 reference on those values
    keys = [f.gather(b, int(f.seqlens[b]), "k") for b in range(B)]
    vals = [f.gather(b, int(f.seqlens[b]), "v") for b in range(B)]
    want_out, want_lse = reference(q, keys, vals, kw)
    check(out, want_out, torch.float32, "out")
    check_lse(lse, want_lse, torch.float32)


@needs_int8
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("sdtype", [torch.float32, torch.float16],
                         ids=["f32scales", "f16scales"])
def test_int8_decoding_loop(layout, sdtype):
    """Slot by slot: each new key and value lands in the caller's int8
    cache as attention_c.quantize_kv(row) (with scales of the caller's
    scale tensors' dtype) and its scales in them, every other slot
    untouched; each step bitwise the dequantized float32 call."""
    B, S, H, Hk, d = 2, 12, 4, 2, 16
    c = quantized(Cache(B, S, Hk, d, d, [2, 5],
                        block=4 if layout == "paged" else None), "kv",
                  sdtype, groups=(2, 2))
    tensors = (c.k, c.v, c.ks, c.vs)
    ptrs = [t.data_ptr() for t in tensors]
    kw = fill({"causal": True, "sinks": True}, B, H)
    for step in range(5):
        q = randn(B, 1, H, d, seed=100 + step)
        kn = randn(B, 1, Hk, d, seed=200 + step)
        vn = randn(B, 1, Hk, d, seed=300 + step)
        before = [t.clone() for t in tensors]
        versions = [t._version for t in tensors]
        out, lse = int8_call(c, q, kn, vn, **kw)
        assert [t.data_ptr() for t in tensors] == ptrs
        assert all(t._version > n for t, n in zip(tensors, versions))
        written = [t.clone() for t in before]
        for b in range(B):
            t = int(c.seqlens[b])
            slot = ((b, t) if c.table is None
                    else (int(c.table[b, t // 4]), t % 4))
            for i, new in ((0, kn), (1, vn)):
                qn, sn = attention_c.quantize_kv(
                    new[b, 0].numpy(), group=8,
                    scale_dtype=np.float16 if sdtype == torch.float16
                    else np.float32)
                written[i][slot] = torch.from_numpy(qn)
                written[i + 2][slot] = torch.from_numpy(sn)
        for t, w in zip(tensors, written):
            assert torch.equal(t, w)
        f = dequantized(c)
        f.seqlens = c.seqlens + 1
        want, want_lse = int8_call(f, q, **kw)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        c.seqlens += 1


@needs_int8
def test_int8_strided_scales_written_where_they_are():
    """Scales that are a slice of a bigger buffer (and a strided cache):
    read and written in place."""
    B, S, H, d = 2, 8, 2, 16
    c = quantized(Cache(B, S, H, d, d, [3, 6]), "kv")
    buf = torch.zeros(B, 2 * S, H, 4)
    buf[:, ::2, :, 1:3] = c.ks
    kbuf = torch.zeros(B, S, 2 * H, d, dtype=torch.int8)
    kbuf[:, :, ::2] = c.k
    twin = twin_of(c)
    c.ks, c.k = buf[:, ::2, :, 1:3], kbuf[:, :, ::2]
    q = randn(B, 1, H, d, seed=5)
    kn, vn = randn(B, 1, H, d, seed=6), randn(B, 1, H, d, seed=7)
    out, lse = int8_call(c, q, kn, vn, causal=True)
    want, want_lse = int8_call(twin, q, kn, vn, causal=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(buf[:, ::2, :, 1:3], twin.ks)
    assert torch.equal(kbuf[:, :, ::2], twin.k)
    assert not buf[:, 1::2].any() and not buf[..., 0].any()
    assert not kbuf[:, :, 1::2].any()


@needs_int8
def test_int8_cache_batch_idx():
    """Sequence b reads and writes row cache_batch_idx[b] of the int8
    caches and of their scales."""
    Bc, S, H, d = 4, 8, 2, 16
    c = quantized(Cache(Bc, S, H, d, d, [1, 2, 3, 4]), "kv")
    idx = torch.tensor([3, 0], dtype=torch.int32)
    sel = twin_of(c)
    sel.k, sel.v, sel.ks, sel.vs = (x[idx.long()].clone()
                                    for x in (c.k, c.v, c.ks, c.vs))
    q = randn(2, 1, H, d, seed=5)
    kn, vn = randn(2, 1, H, d, seed=6), randn(2, 1, H, d, seed=7)
    seqlens = torch.tensor([5, 2], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, c.k, c.v, kn, vn, cache_seqlens=seqlens,
                                  cache_batch_idx=idx, causal=True,
                                  k_scales=c.ks, v_scales=c.vs)
    want = flash_attn_with_kvcache(q, sel.k, sel.v, kn, vn,
                                   cache_seqlens=seqlens, causal=True,
                                   k_scales=sel.ks, v_scales=sel.vs)
    assert torch.equal(out, want)
    for name in ("k", "v", "ks", "vs"):
        assert torch.equal(getattr(c, name)[idx.long()],
                           getattr(sel, name)), name
    qk, sk = attention_c.quantize_kv(kn[0, 0].numpy(), group=8)
    assert torch.equal(c.k[3, 5], torch.from_numpy(qk))
    assert torch.equal(c.ks[3, 5], torch.from_numpy(sk))


@needs_int8
def test_int8_refuses_gradients():
    B, S, H, d = 1, 4, 2, 16
    c = quantized(Cache(B, S, H, d, d, [2]), "kv")
    q = randn(B, 1, H, d)
    ks = c.ks.clone().requires_grad_()
    kn = randn(B, 1, H, d, seed=3)
    before = (c.k.clone(), c.ks.clone())
    with pytest.raises(RuntimeError, match="inference only.*k_scales"):
        flash_attn_with_kvcache(q, c.k, c.v, kn, kn, cache_seqlens=2,
                                k_scales=ks, v_scales=c.vs)
    assert torch.equal(c.k, before[0]) and torch.equal(ks, before[1])
    with torch.no_grad():
        out = flash_attn_with_kvcache(q, c.k, c.v, cache_seqlens=2,
                                      k_scales=ks, v_scales=c.vs)
    assert not out.requires_grad


def _int8_call(**kw):
    B, S, d = 2, 6, 16
    k8 = torch.zeros(B, S, 2, d, dtype=torch.int8)
    args = dict(q=randn(B, 1, 4, d), k_cache=k8, v_cache=k8.clone(),
                cache_seqlens=torch.tensor([2, 3], dtype=torch.int32),
                k_scales=torch.ones(B, S, 2, 2),
                v_scales=torch.ones(B, S, 2, 1))
    args.update(kw)
    return flash_attn_with_kvcache(**args)


@needs_int8
@pytest.mark.parametrize("kw,err,match", [
    ({"k_scales": None}, TypeError, "k_cache is int8.*k_scales"),
    ({"v_scales": None}, TypeError, "v_cache is int8.*v_scales"),
    ({"k_cache": randn(2, 6, 2, 16)}, ValueError,
     "k_scales goes with an int8 k_cache; k_cache is torch.float32"),
    ({"v_cache": randn(2, 6, 2, 16, dtype=torch.bfloat16)}, ValueError,
     "v_scales goes with an int8 v_cache; v_cache is torch.bfloat16"),
    ({"k_scales": torch.ones(2, 6, 2, 2, dtype=torch.float64)}, TypeError,
     "k_scales has dtype torch.float64"),
    ({"v_scales": torch.ones(2, 6, 2, 1, dtype=torch.bfloat16)}, TypeError,
     "v_scales has dtype torch.bfloat16"),
    ({"k_scales": torch.ones(2, 6, 2, 2, dtype=torch.int8)}, TypeError,
     "k_scales has dtype torch.int8"),
    ({"k_scales": np.ones((2, 6, 2, 2), np.float32)}, TypeError,
     "k_scales must be a torch.Tensor"),
    ({"k_scales": torch.ones(2, 6, 1, 2)}, ValueError, "k_scales"),
    ({"k_scales": torch.ones(2, 6, 2, 4)}, ValueError, "k_scales"),
    ({"k_scales": torch.ones(2, 6, 2, 6)[..., ::3]}, ValueError,
     "k_scales.*contiguous"),
    ({"k_scales": torch.ones(2, 6, 2, 2, device="meta")}, ValueError,
     "CPU"),
    ({"q": randn(2, 1, 4, 16, dtype=torch.float64)}, TypeError, "float64"),
    ({"k": torch.zeros(2, 1, 2, 16, dtype=torch.int8),
      "v": torch.zeros(2, 1, 2, 16, dtype=torch.int8)}, TypeError,
     "k has dtype torch.int8"),
    ({"k_cache": torch.zeros(2, 6, 2, 16, dtype=torch.int8),
      "v_cache": randn(2, 6, 2, 16, dtype=torch.float64),
      "v_scales": None}, TypeError, "v_cache"),
])
def test_int8_bad_input(kw, err, match):
    with pytest.raises(err, match=match):
        _int8_call(**kw)


@needs_int8
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_int8_errors_write_nothing(layout):
    """Over capacity, or a non-finite new key (int8 holds finite values):
    refused, caches and scales untouched."""
    B, S, H, d = 2, 8, 2, 16
    c = quantized(Cache(B, S, H, d, d, [6, 2],
                        block=4 if layout == "paged" else None), "kv")
    tensors = (c.k, c.v, c.ks, c.vs)
    before = [t.clone() for t in tensors]
    q = randn(B, 1, H, d)
    kn, vn = randn(B, 3, H, d, seed=6), randn(B, 3, H, d, seed=7)
    with pytest.raises(ValueError, match="cache_seqlens"):
        int8_call(c, q, kn, vn)
    kn[1, 0, 0, 3] = math.nan
    with pytest.raises(ValueError, match="finite"):
        int8_call(c, q, kn[:, :1], vn[:, :1])
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
