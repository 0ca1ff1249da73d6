"""Attention against a key-value cache in plain NumPy: the decoding step
of a language model, FlashAttention-2's ``flash_attn_with_kvcache``.

    query          (B, Tq, Hq, d)   Tq new queries per sequence
    k_cache        (B, S_max, Hkv, d)        contiguous: row t of seq b
                   (num_blocks, block_size, Hkv, d)  paged: position t of
                   sequence b is row t % block_size of block
                   block_table[b, t // block_size]
    v_cache        likewise with dv
    cache_seqlens  (B,)  keys already in the cache
    k, v           (B, Tn, Hkv, d|dv)  appended in place at positions
                   cache_seqlens[b] .. cache_seqlens[b] + Tn - 1

Sequence b attends N_b = cache_seqlens[b] + Tn keys.  Its query i sits
at position p = N_b - Tq + i (bottom-right aligned, as ``causal``), and
query head h reads kv head h // (Hq // Hkv) (grouped-query attention):

    visible   0 <= t < N_b, (not causal or t <= p), p - l <= t <= p + r
    s_t       = scale q . k_t           scale = 1/sqrt(d)
    softcap c s_t <- c tanh(s_t / c)
    ALiBi m   s_t <- s_t - m |p - t|
    sinks z   lse = log(exp(z) + sum_t exp(s_t))   (a logit with no value)
    out       = sum_t exp(s_t - lse) v_t     over the visible keys

A query that sees no key has out = 0 and lse = -inf (or z).  Each query
is written out on its own below, with the visible keys picked first, so
a NaN in a key that it does not see cannot reach it.

int8 caches: a cache may hold int8 numbers q with one float scale per
group of g consecutive elements of each row (k_scales, v_scales, the
cache's first three axes + (d // g,)).  It holds the values scale * q,
read here in float64.  quantize_kv gives q and the scales of new rows
(the appends), dequantize_kv the float32 values back:

    scale     = max |x| / 127 over the group (0 if the group is all 0),
                in float32; float16 scales round it up to a float16
    q         = round(x / scale) to the nearest integer, ties to even,
                clipped to -127 .. 127 (0 where scale = 0)
    x        ~= scale * q     within scale / 2
"""

import numpy as np


def quantize_kv(x, group=32, scale_dtype=np.float32):
    """Keys or values x (..., d) as int8 numbers and a scale per group:
    (q int8 (..., d), scales (..., d // group) of scale_dtype).

    Every group of ``group`` consecutive elements of the last axis is
    scaled so that its largest magnitude becomes 127, then rounded to
    the nearest integer (ties to even).  All in float32: x is first
    converted to float32 (16-bit dtypes exactly, float64 rounded).
    float16 scales are rounded up (a float16 scale a little below the
    float32 one would push the largest magnitude past 127), and q is
    computed with the scale as stored.
    """
    x = np.asarray(x)
    d = x.shape[-1]
    if group < 8 or d % group:
        raise ValueError(f"group = {group} must be >= 8 and divide d = {d}")
    x32 = x.astype(np.float32)
    if not np.all(np.isfinite(x32)):
        raise ValueError("x must be finite: an int8 cache holds numbers")
    lead = x32.shape[:-1]
    xg = x32.reshape(lead + (d // group, group))       # (..., ng, group)

    # one scale per group: its largest magnitude / 127, in float32
    scales = np.max(np.abs(xg), axis=-1) / np.float32(127)    # (..., ng)
    if np.dtype(scale_dtype) == np.float16:
        with np.errstate(over="ignore"):   # (a scale past 65504 is inf)
            s16 = scales.astype(np.float16)            # to nearest ...
            up = s16.astype(np.float32) < scales       # ... then up
            scales = np.where(up, np.nextafter(s16, np.float16(np.inf)),
                              s16)

    # x / scale rounded to the nearest integer, ties to even (np.rint);
    # an all-zero group has scale 0 and q 0 (divide by 1 there instead)
    s = scales[..., None]                              # (..., ng, 1)
    ratio = xg / np.where(s == 0, 1, s).astype(np.float32)
    q = np.clip(np.rint(ratio), -127, 127)
    q = np.where(s == 0, 0, q)
    return q.astype(np.int8).reshape(x32.shape), scales


def dequantize_kv(q, scales):
    """The float32 values (..., d) that int8 numbers q (..., d) with
    scales (..., d // g) stand for: scales[..., c // g] * q[..., c],
    one float32 multiply."""
    q, scales = np.asarray(q), np.asarray(scales)
    d, ng = q.shape[-1], scales.shape[-1]
    g = d // ng                                        # the group size
    # element c of a row belongs to group c // g
    per_element = np.repeat(scales.astype(np.float32), g, axis=-1)
    return per_element * q.astype(np.float32)          # (..., d) float32


def _read(cache, scales, rows):
    """Rows of a cache as float64: (n, Hkv, d).  An int8 cache holds
    scale * q, one scale per group of d // ng elements."""
    x = cache[rows].astype(np.float64)                 # (n, Hkv, d)
    if scales is None:
        return x
    s = scales[rows].astype(np.float64)                # (n, Hkv, ng)
    g = x.shape[-1] // s.shape[-1]
    return np.repeat(s, g, axis=-1) * x                # exact in float64


def _write(cache, scales, slots, new):
    """New rows (Tn, Hkv, d) into the cache's slots: cast to its dtype,
    or for an int8 cache quantized with the scales' group size."""
    if scales is None:
        cache[slots] = new
        return
    g = cache.shape[-1] // scales.shape[-1]
    q, s = quantize_kv(new, group=g, scale_dtype=scales.dtype)
    cache[slots] = q
    scales[slots] = s                                  # (of its dtype)


def _slots(b, t, block_table, block_size):
    """Where positions t (n,) of sequence b are stored: an index into the
    cache's first two axes, so that k_cache[slots] is (n, Hkv, d)."""
    if block_table is None:
        return b, t                                    # row t of seq b
    return block_table[b, t // block_size], t % block_size


def cache_attention(query, k_cache, v_cache, cache_seqlens, *, k=None,
                    v=None, block_table=None, k_scales=None,
                    v_scales=None, scale=None, causal=True, window=None,
                    softcap=None, alibi_slopes=None, sinks=None,
                    return_lse=False):
    """out (B, Tq, Hq, dv), or (out, lse (B, Tq, Hq)) with return_lse=True,
    both float64.

    k and v, if given, are first written into the caches (in place, cast
    to the caches' dtypes as NumPy assignment casts; into an int8 cache
    quantized by quantize_kv, the scales written into k_scales or
    v_scales); cache_seqlens is not changed.  An int8 cache comes with
    its scales (the cache's first three axes + (ng,)) and is read as
    scales * q.  window = (left, right), a side None unbounded;
    alibi_slopes (Hq,) or (B, Hq); sinks (Hq,).
    """
    query = np.asarray(query)
    B, Tq, Hq, d = query.shape
    Hkv, dv = k_cache.shape[2], v_cache.shape[3]
    group = Hq // Hkv
    kv_head = np.arange(Hq) // group                   # (Hq,) query -> kv
    block_size = k_cache.shape[1]                      # (paged only)
    seqlens = np.asarray(cache_seqlens)

    # 1. append the new keys and values behind the cached ones
    Tn = 0
    if k is not None:
        Tn = k.shape[1]
        for b in range(B):
            new = _slots(b, seqlens[b] + np.arange(Tn), block_table,
                         block_size)
            _write(k_cache, k_scales, new, k[b])       # (Tn, Hkv, d)
            _write(v_cache, v_scales, new, v[b])       # (Tn, Hkv, dv)

    # 2. attend, one sequence and one query at a time
    scale = 1 / np.sqrt(d) if scale is None else scale
    left, right = (None, None) if window is None else window
    slopes = (None if alibi_slopes is None else
              np.broadcast_to(np.asarray(alibi_slopes, np.float64), (B, Hq)))
    sink = None if sinks is None else np.asarray(sinks, np.float64)  # (Hq,)
    q = query.astype(np.float64)                       # (B, Tq, Hq, d)
    out = np.zeros((B, Tq, Hq, dv))
    lse = np.full((B, Tq, Hq), -np.inf)
    for b in range(B):
        n = int(seqlens[b]) + Tn                       # N_b keys
        t = np.arange(n)
        rows = _slots(b, t, block_table, block_size)
        keys = _read(k_cache, k_scales, rows)          # (n, Hkv, d)
        vals = _read(v_cache, v_scales, rows)          # (n, Hkv, dv)
        for i in range(Tq):
            p = n - Tq + i                             # the query's position
            seen = np.ones(n, bool)
            if causal:
                seen &= t <= p
            if left is not None:
                seen &= t >= p - left
            if right is not None:
                seen &= t <= p + right
            ts = t[seen]                               # (m,) visible keys
            kh = keys[ts][:, kv_head]                  # (m, Hq, d)
            vh = vals[ts][:, kv_head]                  # (m, Hq, dv)

            s = scale * np.einsum("hd,thd->ht", q[b, i], kh)   # (Hq, m)
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            if slopes is not None:
                s = s - slopes[b][:, None] * np.abs(p - ts)[None, :]

            # softmax over the m visible keys and the sink, if any
            logits = s if sink is None else np.concatenate(
                [s, sink[:, None]], axis=1)            # (Hq, m [+ 1])
            if logits.shape[1] == 0:
                continue                               # out 0, lse -inf
            M = logits.max(axis=1, keepdims=True)      # (Hq, 1): no overflow
            e = np.exp(logits - M)
            total = e.sum(axis=1)                      # (Hq,)
            # (Hq, m): the weights of the keys (the sink has no value)
            alpha = e[:, :ts.size] / total[:, None]
            out[b, i] = np.einsum("ht,thd->hd", alpha, vh)     # (Hq, dv)
            lse[b, i] = M[:, 0] + np.log(total)
    return (out, lse) if return_lse else out
