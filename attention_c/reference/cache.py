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
"""

import numpy as np


def _slots(b, t, block_table, block_size):
    """Where positions t (n,) of sequence b are stored: an index into the
    cache's first two axes, so that k_cache[slots] is (n, Hkv, d)."""
    if block_table is None:
        return b, t                                    # row t of seq b
    return block_table[b, t // block_size], t % block_size


def cache_attention(query, k_cache, v_cache, cache_seqlens, *, k=None,
                    v=None, block_table=None, scale=None, causal=True,
                    window=None, softcap=None, alibi_slopes=None,
                    sinks=None, return_lse=False):
    """out (B, Tq, Hq, dv), or (out, lse (B, Tq, Hq)) with return_lse=True,
    both float64.

    k and v, if given, are first written into the caches (in place, cast
    to the caches' dtypes as NumPy assignment casts); cache_seqlens is
    not changed.  window = (left, right), a side None unbounded;
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
            k_cache[new] = k[b]                        # (Tn, Hkv, d)
            v_cache[new] = v[b]                        # (Tn, Hkv, dv)

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
        keys = k_cache[rows].astype(np.float64)        # (n, Hkv, d)
        vals = v_cache[rows].astype(np.float64)        # (n, Hkv, dv)
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
