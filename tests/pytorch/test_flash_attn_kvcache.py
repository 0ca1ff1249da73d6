"""attention_c.torch.flash_attn_with_kvcache (FlashAttention-2's decoding
function on the CPU, issue 34) with float caches, against
attention_c.cache_attention (the same kernel: bitwise) and a float64
PyTorch reference (the softmax over the keys gathered from the cache).

Contiguous and paged caches, ragged cache_seqlens (an int or a tensor),
appends written in place into the caller's tensors (slot by slot, as a
decoding loop does, and by chunks), cache_batch_idx, grouped-query heads,
causal, window, softcap, ALiBi ((heads,) and (B, heads)) and sinks; the
lse's layout (B, heads, Tq); bfloat16 and float16 caches (the float32 call
on the same values, rounded once); strided caches; the refusal of
gradients; and the errors. The int8 caches are in
test_flash_attn_kvcache_int8.py, the shared cases in
flash_attn_kvcache_cases.py.
"""

import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attention_c  # noqa: E402
from attention_c.testing import rel_err  # noqa: E402
from attention_c.torch import (flash_attn_func,  # noqa: E402
                               flash_attn_with_kvcache)

from flash_attn_kvcache_cases import (Cache, VARIANTS, check,  # noqa: E402
                                      check_lse, fill, np_kw, randn,
                                      reference)

pytestmark = pytest.mark.skipif(
    not hasattr(attention_c, "cache_attention"),
    reason="attention_c.cache_attention is not built")


def run(cache, q, kw, knew=None, vnew=None, dtype=torch.float32):
    """Ours (out, lse), the caches written, against the reference over the
    keys gathered from our cache after the call; and the new keys landed
    at the right slots."""
    out, lse = flash_attn_with_kvcache(
        q, cache.k, cache.v, knew, vnew, cache_seqlens=cache.seqlens,
        return_softmax_lse=True, **cache.kw(), **kw)
    Tn = 0 if knew is None else knew.shape[1]
    keys, vals = [], []
    for b in range(cache.B):
        n = int(cache.seqlens[b]) + Tn
        keys.append(cache.gather(b, n, "k"))
        vals.append(cache.gather(b, n, "v"))
        if Tn:
            assert torch.equal(keys[b][-Tn:], knew[b].double())
            assert torch.equal(vals[b][-Tn:], vnew[b].double())
    want_out, want_lse = reference(q, keys, vals, kw)
    assert out.shape == q.shape[:3] + (cache.v.shape[-1],)
    assert out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert lse.is_contiguous()
    check(out, want_out, dtype, "out")
    check_lse(lse, want_lse, dtype)
    return out, lse


# --------------------------------------------------------------------------
# Against the reference

@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_against_reference(layout, variant):
    """Ragged cache_seqlens (an empty cache among them), GQA, two new keys
    appended, three queries."""
    B, S, H, Hk, d, dv = 3, 16, 6, 2, 5, 3
    cache = Cache(B, S, Hk, d, dv, [7, 0, 12],
                  block=4 if layout == "paged" else None)
    q = randn(B, 3, H, d, seed=5)
    kn, vn = randn(B, 2, Hk, d, seed=6), randn(B, 2, Hk, dv, seed=7)
    run(cache, q, fill(VARIANTS[variant], B, H), kn, vn)
    # and without appending: the cache as it is now
    run(cache, q, fill(VARIANTS[variant], B, H))


@pytest.mark.parametrize("heads_k", [1, 3, 6], ids=["mqa", "gqa", "mha"])
def test_grouped_queries(heads_k):
    B, S, H, d = 2, 8, 6, 4
    cache = Cache(B, S, heads_k, d, d, [5, 3], block=2)
    q = randn(B, 1, H, d, seed=5)
    kn, vn = randn(B, 1, heads_k, d, seed=6), randn(B, 1, heads_k, d, seed=7)
    run(cache, q, fill(VARIANTS["all"], B, H), kn, vn)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_float64(layout):
    B, S, H, Hk, d = 2, 12, 4, 2, 3
    cache = Cache(B, S, Hk, d, d, [4, 9], dtype=torch.float64,
                  block=3 if layout == "paged" else None)
    q = randn(B, 2, H, d, seed=5, dtype=torch.float64)
    kn = randn(B, 2, Hk, d, seed=6, dtype=torch.float64)
    vn = randn(B, 2, Hk, d, seed=7, dtype=torch.float64)
    out, lse = run(cache, q, fill(VARIANTS["all"], B, H), kn, vn,
                   dtype=torch.float64)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64


@pytest.mark.parametrize("qdtype", [torch.float32, torch.float16,
                                    torch.bfloat16])
def test_narrow_query_with_float64_caches(qdtype):
    """Computed in float64 with float64 caches; out in q's dtype (the
    float64 result rounded once), the lse float64."""
    B, S, H, d = 2, 6, 2, 3
    cache = Cache(B, S, H, d, d, [2, 5], dtype=torch.float64)
    q = randn(B, 1, H, d, seed=5, dtype=qdtype)
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v,
                                       cache_seqlens=cache.seqlens,
                                       return_softmax_lse=True)
    want, want_lse = flash_attn_with_kvcache(
        q.double(), cache.k, cache.v, cache_seqlens=cache.seqlens,
        return_softmax_lse=True)
    assert out.dtype == qdtype and lse.dtype == torch.float64
    assert torch.equal(out, want.to(qdtype))
    assert torch.equal(lse, want_lse)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_decoding_loop(layout):
    """Slot by slot, as a decoder: one key appended and one query a step,
    ragged lengths; the cache ends holding the whole history."""
    B, S, H, Hk, d = 2, 12, 4, 2, 4
    start = [2, 5]
    cache = Cache(B, S, Hk, d, d, start, block=4 if layout == "paged"
                  else None)
    hist_k = [cache.gather(b, start[b], "k") for b in range(B)]
    hist_v = [cache.gather(b, start[b], "v") for b in range(B)]
    kw = fill({"causal": True, "sinks": True}, B, H)
    for step in range(6):
        q = randn(B, 1, H, d, seed=100 + step)
        kn = randn(B, 1, Hk, d, seed=200 + step)
        vn = randn(B, 1, Hk, d, seed=300 + step)
        seqlens = cache.seqlens.clone()
        out, lse = run(cache, q, kw, kn, vn)
        assert torch.equal(cache.seqlens, seqlens)   # not modified
        for b in range(B):
            hist_k[b] = torch.cat([hist_k[b], kn[b].double()])
            hist_v[b] = torch.cat([hist_v[b], vn[b].double()])
            n = len(hist_k[b])
            assert torch.equal(cache.gather(b, n, "k"), hist_k[b])
            assert torch.equal(cache.gather(b, n, "v"), hist_v[b])
        want, _ = reference(q, hist_k, hist_v, kw)
        check(out, want, torch.float32, f"step {step}")
        cache.seqlens += 1                           # the caller's job


def test_int_seqlens_against_flash_attn_func():
    """A prefill chunk with cache_seqlens an int: the same as
    flash_attn_func over the whole keys (bottom-right causal)."""
    B, S, H, Hk, d, Tn = 2, 10, 4, 2, 4, 3
    cache = Cache(B, S, Hk, d, d, [4, 4])
    q = randn(B, Tn, H, d, seed=5)
    kn, vn = randn(B, Tn, Hk, d, seed=6), randn(B, Tn, Hk, d, seed=7)
    kw = {"causal": True, "window_size": (3, -1), "softcap": 3.0}
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, kn, vn,
                                       cache_seqlens=4,
                                       return_softmax_lse=True, **kw)
    n = 4 + Tn
    want, want_lse, _ = flash_attn_func(q, cache.k[:, :n], cache.v[:, :n],
                                        return_attn_probs=True, **kw)
    assert rel_err(out.double(), want.double()) <= 2e-6
    assert rel_err(lse.double(), want_lse.double()) <= 2e-6


def test_none_seqlens_means_full_and_empty_caches():
    B, S, H, d = 2, 5, 2, 3
    cache = Cache(B, S, H, d, d, [S, S])
    q = randn(B, 2, H, d, seed=5)
    got = flash_attn_with_kvcache(q, cache.k, cache.v, causal=True)
    for n in (S, np.int64(S), torch.tensor([S, S])):
        assert torch.equal(got, flash_attn_with_kvcache(
            q, cache.k, cache.v, cache_seqlens=n, causal=True))
    # empty caches: out 0, lse -inf, or the sink's logit with sinks
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=0,
                                       return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, -math.inf))
    sinks = randn(H, seed=8)
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=0,
                                       return_softmax_lse=True, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks[None, :, None].expand(B, H, 2))


def test_cache_batch_idx():
    """Sequence b reads and writes k_cache[cache_batch_idx[b]]."""
    Bc, S, H, d = 4, 8, 2, 3
    cache = Cache(Bc, S, H, d, d, [1, 2, 3, 4])
    idx = torch.tensor([3, 0], dtype=torch.int32)
    q = randn(2, 1, H, d, seed=5)
    kn, vn = randn(2, 1, H, d, seed=6), randn(2, 1, H, d, seed=7)
    seqlens = torch.tensor([5, 2], dtype=torch.int32)
    k_sel, v_sel = cache.k[idx.long()].clone(), cache.v[idx.long()].clone()
    before = cache.k.clone()
    out = flash_attn_with_kvcache(q, cache.k, cache.v, kn, vn,
                                  cache_seqlens=seqlens,
                                  cache_batch_idx=idx, causal=True)
    want = flash_attn_with_kvcache(q, k_sel, v_sel, kn, vn,
                                   cache_seqlens=seqlens, causal=True)
    assert torch.equal(out, want)
    assert torch.equal(cache.k[3, 5], kn[0, 0])
    assert torch.equal(cache.k[0, 2], kn[1, 0])
    assert torch.equal(cache.k[3], k_sel[0]) and torch.equal(cache.k[0],
                                                             k_sel[1])
    assert torch.equal(cache.k[1:3], before[1:3])    # untouched


# --------------------------------------------------------------------------
# The same kernel as the NumPy function

@pytest.mark.parametrize("variant", ["plain", "all"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_bitwise_the_numpy_call(layout, variant):
    B, S, H, Hk, d, dv = 3, 16, 6, 2, 8, 4
    cache = Cache(B, S, Hk, d, dv, [7, 0, 12],
                  block=4 if layout == "paged" else None)
    twin = cache.copy()
    q = randn(B, 2, H, d, seed=5)
    kn, vn = randn(B, 2, Hk, d, seed=6), randn(B, 2, Hk, dv, seed=7)
    kw = fill(VARIANTS[variant], B, H)
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, kn, vn,
                                       cache_seqlens=cache.seqlens,
                                       return_softmax_lse=True,
                                       **cache.kw(), **kw)
    table = None if twin.table is None else twin.table.numpy()
    want, want_lse = attention_c.cache_attention(
        q.numpy(), twin.k.numpy(), twin.v.numpy(), twin.seqlens.numpy(),
        k=kn.numpy(), v=vn.numpy(), block_table=table, return_lse=True,
        **np_kw(kw))
    assert torch.equal(out, torch.from_numpy(want))
    assert torch.equal(lse, torch.from_numpy(want_lse).transpose(1, 2))
    assert torch.equal(cache.k, twin.k) and torch.equal(cache.v, twin.v)


def test_paged_equals_contiguous():
    """The same contents, paged or not: the same bits (the kernel's
    guarantee, through this function)."""
    B, S, H, Hk, d = 2, 12, 4, 2, 4
    cont = Cache(B, S, Hk, d, d, [5, 9])
    paged = Cache(B, S, Hk, d, d, [5, 9], block=3)
    q = randn(B, 2, H, d, seed=5)
    kn, vn = randn(B, 2, Hk, d, seed=6), randn(B, 2, Hk, d, seed=7)
    kw = fill(VARIANTS["all"], B, H)
    a = flash_attn_with_kvcache(q, cont.k, cont.v, kn, vn,
                                cache_seqlens=cont.seqlens,
                                return_softmax_lse=True, **kw)
    b = flash_attn_with_kvcache(q, paged.k, paged.v, kn, vn,
                                cache_seqlens=paged.seqlens,
                                block_table=paged.table,
                                return_softmax_lse=True, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_unused_slots_never_read(layout):
    """Slots past a sequence's length and blocks it does not own hold
    anything (a cache from torch.empty): NaN there changes no bit."""
    B, S, H, Hk, d = 2, 12, 4, 2, 4
    clean = Cache(B, S, Hk, d, d, [3, 7], block=4 if layout == "paged"
                  else None)
    dirty = clean.copy()
    Tn = 2
    keep = torch.zeros(dirty.k.shape[:2], dtype=torch.bool)
    for b in range(B):
        for t in range(int(clean.seqlens[b])):
            keep[(b, t) if clean.table is None
                 else (int(clean.table[b, t // 4]), t % 4)] = True
    dirty.k[~keep], dirty.v[~keep] = math.nan, math.nan
    q = randn(B, 2, H, d, seed=5)
    kn, vn = randn(B, Tn, Hk, d, seed=6), randn(B, Tn, Hk, d, seed=7)
    kw = fill(VARIANTS["all"], B, H)
    a, b = (flash_attn_with_kvcache(q, c.k, c.v, kn, vn,
                                    cache_seqlens=c.seqlens,
                                    return_softmax_lse=True, **c.kw(), **kw)
            for c in (clean, dirty))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bitwise_for_any_thread_count():
    B, S, H, Hk, d = 4, 1024, 16, 4, 64
    cache = Cache(B, S, Hk, d, d, [1000, 37, 1023, 517], block=16)
    q = randn(B, 4, H, d, seed=5)
    kw = fill(VARIANTS["all"], B, H)
    before = attention_c.get_num_threads()
    try:
        got = []
        for n in (1, 3, 8):
            attention_c.set_num_threads(n)
            got.append(flash_attn_with_kvcache(
                q, cache.k, cache.v, cache_seqlens=cache.seqlens,
                block_table=cache.table, return_softmax_lse=True, **kw))
    finally:
        attention_c.set_num_threads(before)
    for out, lse in got[1:]:
        assert torch.equal(out, got[0][0]) and torch.equal(lse, got[0][1])


# --------------------------------------------------------------------------
# In place, where the caller's tensors are

@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_write_lands_in_the_callers_tensors(layout):
    B, S, H, d = 2, 8, 2, 4
    cache = Cache(B, S, H, d, d, [3, 6], block=2 if layout == "paged"
                  else None)
    k_cache, v_cache = cache.k, cache.v
    ptrs = (k_cache.data_ptr(), v_cache.data_ptr())
    versions = (k_cache._version, v_cache._version)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    kn, vn = randn(B, 2, H, d, seed=6), randn(B, 2, H, d, seed=7)
    flash_attn_with_kvcache(randn(B, 1, H, d), k_cache, v_cache, kn, vn,
                            cache_seqlens=cache.seqlens, **cache.kw())
    assert (k_cache.data_ptr(), v_cache.data_ptr()) == ptrs
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    written_k, written_v = before_k.clone(), before_v.clone()
    for b in range(B):
        for j in range(2):
            t = int(cache.seqlens[b]) + j
            if cache.table is None:
                slot = (b, t)
            else:
                slot = (int(cache.table[b, t // 2]), t % 2)
            assert not torch.equal(before_k[slot], kn[b, j])    # changed
            written_k[slot], written_v[slot] = kn[b, j], vn[b, j]
    # exactly those slots changed, to exactly the new values
    assert torch.equal(k_cache, written_k)
    assert torch.equal(v_cache, written_v)


def test_strided_caches_are_read_where_they_are():
    """A cache that is a slice of a bigger buffer (heads and positions
    strided, the last axis contiguous): read and written in place."""
    B, S, H, d = 2, 8, 2, 4
    buf_k, buf_v = randn(B, 2 * S, 2 * H, d, seed=1), randn(B, 2 * S, 2 * H,
                                                            d, seed=2)
    k_cache, v_cache = buf_k[:, ::2, 1::2], buf_v[:, ::2, 1::2]
    assert not k_cache.is_contiguous()
    twin_k, twin_v = k_cache.clone(), v_cache.clone()
    q = randn(B, 3, 2 * H, d, seed=5)[:, :, ::2]    # a strided q too
    kn, vn = randn(B, 1, H, d, seed=6), randn(B, 1, H, d, seed=7)
    seqlens = torch.tensor([2, 5])
    out = flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn,
                                  cache_seqlens=seqlens, causal=True)
    want = flash_attn_with_kvcache(q.contiguous(), twin_k, twin_v, kn, vn,
                                   cache_seqlens=seqlens, causal=True)
    assert torch.equal(out, want)
    assert torch.equal(buf_k[:, ::2, 1::2], twin_k)  # landed in the buffer
    assert torch.equal(buf_v[:, ::2, 1::2], twin_v)


def test_autograd_sees_the_write():
    """A graph that saved a cache fails loudly after the cache is written
    (as after copy_), rather than differentiating stale values."""
    B, S, H, d = 1, 4, 1, 2
    cache = Cache(B, S, H, d, d, [1])
    w = torch.ones(B, S, H, d, requires_grad=True)
    loss = (w * cache.k).sum()                       # saves cache.k
    flash_attn_with_kvcache(randn(B, 1, H, d), cache.k, cache.v,
                            randn(B, 1, H, d), randn(B, 1, H, d),
                            cache_seqlens=1)
    with pytest.raises(RuntimeError, match="modified by an inplace"):
        loss.backward()


# --------------------------------------------------------------------------
# bfloat16 and float16

@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype, layout):
    """16-bit q, caches and new keys: out in the dtype, the float32 call
    on the same (rounded) values rounded once; the lse that call's,
    float32."""
    B, S, H, Hk, d = 2, 12, 4, 2, 8
    c16 = Cache(B, S, Hk, d, d, [5, 9], dtype=dtype,
                block=3 if layout == "paged" else None)
    c32 = c16.copy()
    c32.k, c32.v = c16.k.float(), c16.v.float()
    q = randn(B, 2, H, d, seed=5, dtype=dtype)
    kn = randn(B, 2, Hk, d, seed=6, dtype=dtype)
    vn = randn(B, 2, Hk, d, seed=7, dtype=dtype)
    kw = fill(VARIANTS["all"], B, H)
    out, lse = flash_attn_with_kvcache(q, c16.k, c16.v, kn, vn,
                                       cache_seqlens=c16.seqlens,
                                       return_softmax_lse=True,
                                       **c16.kw(), **kw)
    want, want_lse = flash_attn_with_kvcache(
        q.float(), c32.k, c32.v, kn.float(), vn.float(),
        cache_seqlens=c32.seqlens, return_softmax_lse=True, **c32.kw(),
        **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert c16.k.dtype == dtype                      # not converted
    assert torch.equal(out, want.to(dtype))
    assert torch.equal(lse, want_lse)
    assert torch.equal(c16.k.float(), c32.k)         # the same writes
    assert torch.equal(c16.v.float(), c32.v)
    # and near the float64 reference
    ref_out, _ = reference(q, [c16.gather(b, int(c16.seqlens[b]) + 2)
                               for b in range(B)],
                           [c16.gather(b, int(c16.seqlens[b]) + 2, "v")
                            for b in range(B)], kw)
    assert rel_err(out.double(), ref_out) <= 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_new_keys_rounded_into_the_cache(dtype):
    """float32 k and v written into a 16-bit cache: rounded to nearest
    even, as torch's .to()."""
    B, S, H, d = 1, 4, 2, 8
    cache = Cache(B, S, H, d, d, [1], dtype=dtype)
    kn, vn = randn(B, 2, H, d, seed=6), randn(B, 2, H, d, seed=7)
    flash_attn_with_kvcache(randn(B, 1, H, d, dtype=dtype), cache.k,
                            cache.v, kn, vn, cache_seqlens=1)
    assert torch.equal(cache.k[0, 1:3], kn[0].to(dtype))
    assert torch.equal(cache.v[0, 1:3], vn[0].to(dtype))


# --------------------------------------------------------------------------
# Inference only

def test_refuses_gradients():
    B, S, H, d = 1, 4, 2, 3
    cache = Cache(B, S, H, d, d, [2])
    q = randn(B, 1, H, d).requires_grad_()
    with pytest.raises(RuntimeError, match="inference only.*q"):
        flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=2)
    slopes = torch.ones(H, requires_grad=True)
    with pytest.raises(RuntimeError, match="alibi_slopes"):
        flash_attn_with_kvcache(q.detach(), cache.k, cache.v,
                                cache_seqlens=2, alibi_slopes=slopes)
    k_cache = torch.nn.Parameter(cache.k.clone())
    with pytest.raises(RuntimeError, match="no backward"):
        flash_attn_with_kvcache(q.detach(), k_cache, cache.v,
                                cache_seqlens=2)
    # refused before anything is written
    kn = randn(B, 1, H, d, seed=3)
    before = cache.k.clone()
    with pytest.raises(RuntimeError):
        flash_attn_with_kvcache(q, cache.k, cache.v, kn, kn, cache_seqlens=2)
    assert torch.equal(cache.k, before)
    # without gradients, fine (and the result carries none)
    with torch.no_grad():
        out = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=2)
    assert not out.requires_grad
    with torch.inference_mode():
        out2 = flash_attn_with_kvcache(q, k_cache, cache.v, kn, kn,
                                       cache_seqlens=2)
    assert torch.equal(k_cache[0, 2].detach(), kn[0, 0])
    assert out2.shape == out.shape


def test_inference_mode_tensors():
    B, S, H, d = 1, 4, 2, 3
    with torch.inference_mode():
        cache = Cache(B, S, H, d, d, [2])
        kn = randn(B, 1, H, d, seed=3)
        out = flash_attn_with_kvcache(randn(B, 1, H, d), cache.k, cache.v,
                                      kn, kn, cache_seqlens=2)
        assert torch.equal(cache.k[0, 2], kn[0, 0])
    assert out.shape == (B, 1, H, d)


# --------------------------------------------------------------------------
# Signature, exports and errors

def test_signature_is_flash_attn_2s():
    """flash_attn 2.6's flash_attn_with_kvcache: arguments, order and
    defaults (code calling it positionally runs unchanged), and the
    keyword-only sinks, k_scales and v_scales."""
    P = inspect.Parameter
    params = [(p.name, p.kind, p.default) for p in
              inspect.signature(flash_attn_with_kvcache).parameters.values()]
    want = ([(n, P.POSITIONAL_OR_KEYWORD, P.empty)
             for n in ("q", "k_cache", "v_cache")]
            + [(n, P.POSITIONAL_OR_KEYWORD, d) for n, d in [
                ("k", None), ("v", None), ("rotary_cos", None),
                ("rotary_sin", None), ("cache_seqlens", None),
                ("cache_batch_idx", None), ("cache_leftpad", None),
                ("block_table", None), ("softmax_scale", None),
                ("causal", False), ("window_size", (-1, -1)),
                ("softcap", 0.0), ("rotary_interleaved", True),
                ("alibi_slopes", None), ("num_splits", 0),
                ("return_softmax_lse", False)]]
            + [(n, P.KEYWORD_ONLY, None)
               for n in ("sinks", "k_scales", "v_scales")])
    assert params == want
    import attention_c.torch as act
    import attention_c.torch.flash_attn_interface as fai
    assert "flash_attn_with_kvcache" in act.__all__
    assert "flash_attn_with_kvcache" in fai.__all__


def test_defaults_return_out_only():
    B, S, H, d = 2, 6, 2, 3
    cache = Cache(B, S, H, d, d, [3, 4])
    q = randn(B, 1, H, d)
    out = flash_attn_with_kvcache(q, cache.k, cache.v,
                                  cache_seqlens=cache.seqlens)
    assert isinstance(out, torch.Tensor) and out.shape == (B, 1, H, d)
    # num_splits and rotary_interleaved are accepted, and change nothing
    assert torch.equal(out, flash_attn_with_kvcache(
        q, cache.k, cache.v, cache_seqlens=cache.seqlens, num_splits=4,
        rotary_interleaved=False))


def _call(**kw):
    B, S, H, d = 2, 6, 4, 3
    args = dict(q=randn(B, 1, H, d), k_cache=randn(B, S, 2, d, seed=1),
                v_cache=randn(B, S, 2, d, seed=2),
                cache_seqlens=torch.tensor([2, 3], dtype=torch.int32))
    args.update(kw)
    return flash_attn_with_kvcache(**args)


@pytest.mark.parametrize("kw,err,match", [
    ({"window_size": (-2, 0)}, ValueError, "window_size"),
    ({"window_size": (3,)}, ValueError, "window_size"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"causal": 1}, TypeError, "causal"),
    ({"alibi_slopes": torch.ones(3)}, ValueError, "alibi_slopes"),
    ({"alibi_slopes": torch.ones(2, 3, 4)}, ValueError, "alibi_slopes"),
    ({"sinks": torch.ones(2, 4)}, ValueError, "sinks"),
    ({"sinks": [0.0] * 4}, TypeError, "sinks"),
    ({"k": randn(2, 1, 2, 3)}, ValueError, "k and v"),
    ({"k": randn(2, 1, 4, 3), "v": randn(2, 1, 4, 3)}, ValueError,
     r"k must have shape"),
    ({"q": randn(2, 1, 3, 3)}, ValueError, "heads"),
    ({"q": randn(2, 1, 4, 5)}, ValueError, "head size"),
    ({"q": randn(3, 1, 4, 3)}, ValueError, "batch size"),
    ({"q": randn(1, 4, 3)}, ValueError, "q must be 4-D"),
    ({"v_cache": randn(2, 5, 2, 3)}, ValueError, "same shape"),
    ({"cache_seqlens": torch.tensor([2.0, 3.0])}, TypeError,
     "cache_seqlens"),
    ({"cache_seqlens": torch.tensor([2, 3, 4])}, ValueError,
     "cache_seqlens"),
    ({"cache_seqlens": 2.0}, TypeError, "cache_seqlens"),
    ({"cache_seqlens": -1}, ValueError, "cache_seqlens"),
    ({"cache_seqlens": torch.tensor([2, 7])}, ValueError, "cache_seqlens"),
    ({"cache_seqlens": None, "k": randn(2, 1, 2, 3),
      "v": randn(2, 1, 2, 3)}, ValueError, "cache_seqlens"),
    ({"cache_seqlens": None, "block_table": torch.zeros(2, 1,
                                                        dtype=torch.int32)},
     ValueError, "cache_seqlens"),
    ({"block_table": torch.zeros(3, 1, dtype=torch.int32)}, ValueError,
     "block_table"),
    ({"block_table": torch.zeros(2, 1)}, TypeError, "block_table"),
    ({"cache_batch_idx": torch.tensor([0, 1]),
      "block_table": torch.zeros(2, 1, dtype=torch.int32)}, ValueError,
     "cache_batch_idx"),
    ({"rotary_cos": torch.ones(6, 1), "rotary_sin": torch.ones(6, 1)},
     NotImplementedError, "rotary"),
    ({"cache_leftpad": torch.zeros(2, dtype=torch.int32)},
     NotImplementedError, "cache_leftpad"),
    ({"softmax_scale": "0.5"}, TypeError, "softmax_scale"),
    ({"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
    ({"cache_batch_idx": torch.tensor([0, 2])}, ValueError,
     r"cache_batch_idx\[1\] = 2"),
    ({"cache_batch_idx": torch.tensor([-1, 0])}, ValueError,
     r"cache_batch_idx\[0\] = -1"),
    ({"return_softmax_lse": 1}, TypeError, "return_softmax_lse"),
    ({"q": randn(2, 1, 4, 3, dtype=torch.float64)}, TypeError, "float64"),
    ({"k_cache": randn(2, 6, 2, 3).to(torch.int16)}, TypeError,
     "k_cache has dtype torch.int16"),
    ({"k_cache": randn(2, 6, 2, 3, dtype=torch.float64)}, TypeError,
     "v_cache"),
    ({"k_cache": randn(2, 6, 2, 6)[..., ::2]}, ValueError,
     "contiguous last axis"),
    ({"v_cache": randn(2, 6, 2, 3).to("meta")}, ValueError, "CPU"),
    ({"q": np.zeros((2, 1, 4, 3), np.float32)}, TypeError, "q must be"),
])
def test_bad_input(kw, err, match):
    with pytest.raises(err, match=match):
        _call(**kw)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_errors_write_nothing(layout):
    """Over capacity, or a block_table entry out of range: ValueError
    naming it, the caches untouched."""
    B, S, H, d = 2, 8, 2, 3
    cache = Cache(B, S, H, d, d, [6, 2], block=4 if layout == "paged"
                  else None)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    kn, vn = randn(B, 3, H, d, seed=6), randn(B, 3, H, d, seed=7)
    q = randn(B, 1, H, d)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, cache.k, cache.v, kn, vn,
                                cache_seqlens=cache.seqlens, **cache.kw())
    assert torch.equal(cache.k, before_k) and torch.equal(cache.v, before_v)
    if layout == "paged":
        table = cache.table.clone()
        table[1, 0] = cache.k.shape[0]               # one past the end
        with pytest.raises(ValueError, match="block_table"):
            flash_attn_with_kvcache(q, cache.k, cache.v, kn[:, :1],
                                    vn[:, :1], cache_seqlens=cache.seqlens,
                                    block_table=table)
        assert torch.equal(cache.k, before_k)
        assert torch.equal(cache.v, before_v)
        # a transposed table is a table (its entries copied)
        want = flash_attn_with_kvcache(q, cache.k.clone(), cache.v.clone(),
                                       kn[:, :1], vn[:, :1],
                                       cache_seqlens=cache.seqlens,
                                       block_table=cache.table)
        got = flash_attn_with_kvcache(q, cache.k, cache.v, kn[:, :1],
                                      vn[:, :1], cache_seqlens=cache.seqlens,
                                      block_table=cache.table.T.contiguous()
                                      .T)
        assert torch.equal(got, want)
