"""Multi-head attention in plain NumPy, one head at a time
(docs/contract.md section 7)."""

import numpy as np

from .dropout import dropout_keep
from .masks import _softmax


def multi_head_attention(params, num_heads, query, key=None, value=None, *,
                         mask=None, attn_mask=None, causal=False,
                         dropout=0.0, seed=None):
    """Multi-head attention (docs/contract.md section 7), one head at a
    time: ``(out, weights)``, the weights (..., h, Tq, S) before dropout.

    ``params`` holds the parameters by PyTorch's names: ``in_proj_weight``
    (3E, E) (or ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``),
    ``in_proj_bias`` (3E,) (optional), ``out_proj_weight`` (E, E),
    ``out_proj_bias`` (E,) (optional).  key defaults to query, value to
    key; masks are True = valid (section 5), ``causal`` bottom-right
    aligned.  Dropout keeps the bits of :func:`dropout_keep`, with the
    flat index of (batch..., head) as the sequence index.

        q_j = query W_q^j + b_q^j,  k_j = key W_k^j + b_k^j,  v_j likewise
        o_j = softmax(q_j k_j^T / sqrt(d)) v_j     over the visible keys
        out = [o_1 ... o_h] W_o^T + b_o
    """
    p = {n: np.asarray(x, np.float64) for n, x in params.items()}
    q_in = np.asarray(query, np.float64)
    k_in = q_in if key is None else np.asarray(key, np.float64)
    v_in = k_in if value is None else np.asarray(value, np.float64)
    E = p["out_proj_weight"].shape[0]
    if "in_proj_weight" in p:
        Wq, Wk, Wv = np.split(p["in_proj_weight"], 3)
    else:
        Wq, Wk, Wv = (p["q_proj_weight"], p["k_proj_weight"],
                      p["v_proj_weight"])
    bq, bk, bv = (np.split(p["in_proj_bias"], 3) if "in_proj_bias" in p
                  else (0.0, 0.0, 0.0))
    q, k, v = q_in @ Wq.T + bq, k_in @ Wk.T + bk, v_in @ Wv.T + bv
    Tq, S, d = q.shape[-2], k.shape[-2], E // num_heads
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    vis = np.ones(lead + (Tq, S), bool)                # (..., Tq, S)
    if mask is not None:
        vis = vis & np.asarray(mask)[..., None, :]
    if attn_mask is not None:
        vis = vis & np.asarray(attn_mask)
    if causal:
        vis = vis & (np.arange(S)[None, :]
                     <= np.arange(Tq)[:, None] + (S - Tq))
    outs, weights = [], []
    for j in range(num_heads):                         # head j: d columns
        cols = slice(j * d, (j + 1) * d)
        s = q[..., cols] @ k[..., cols].swapaxes(-1, -2) / np.sqrt(d)
        alpha, _ = _softmax(s, vis)
        weights.append(alpha)
        P = alpha
        if dropout:
            b = np.arange(int(np.prod(lead, dtype=int)))
            b = b.reshape(lead) * num_heads + j
            P = alpha * dropout_keep(seed, dropout, b, Tq, S) / (1 - dropout)
        outs.append(P @ v[..., cols])
    o = np.concatenate(outs, axis=-1)                  # (..., Tq, E)
    out = o @ p["out_proj_weight"].T + p.get("out_proj_bias", 0.0)
    return out, np.stack(weights, axis=-3)
