"""Plain NumPy reference for every attention_c kernel.

This module is meant to be *read*: each function is one step of the layer,
written the way the maths is written in ``docs/contract.md``, with the
shapes in the comments.  The C kernels must agree with it; the tests check
that they do.

Notation (one sequence; any leading axes ``...`` are a batch):

    h      (..., T, H)   the states h_t, one row per item
    mask   (..., T)      True = valid item (default: all valid)
    W      (A, 2H)       = [W_h | W_c], the layout of torch.nn.Linear(2H, A)
    v, b   (A,)          output weights and bias of the score network

    c       = (1/n) sum_t m_t h_t                   mean context, (..., H)
    z_t     = W_h h_t + W_c c + b                   pre-activation, (..., T, A)
    s_t     = v . tanh(z_t)                         score, (..., T)
    alpha_t = m_t exp(s_t - M) / sum_j m_j exp(s_j - M)
    out     = sum_t alpha_t h_t                     (..., H)

A masked item never influences anything: it is left out of every sum (not
multiplied by zero, which would let a NaN in padding through).  A row with no
valid item has c = 0, alpha = 0 and out = 0.
"""

import math

import numpy as np

__all__ = [
    "mean_context", "mean_context_backward",
    "additive_score", "additive_score_backward",
    "masked_softmax", "masked_softmax_backward",
    "weighted_sum", "weighted_sum_backward",
    "context_attention", "context_attention_backward",
    "additive_attention", "additive_attention_backward",
    "dot_attention", "dot_attention_backward",
    "general_attention", "general_attention_backward",
    "project_keys", "project_keys_backward",
    "philox4x32", "dropout_keep", "multi_head_attention",
]


def _valid(mask, shape):
    """The mask as a boolean array of ``shape`` (all True when None)."""
    if mask is None:
        return np.ones(shape, dtype=bool)
    return np.asarray(mask, dtype=bool)


def _rows(x):
    """Stack every leading axis: (..., n) -> (rows, n)."""
    return x.reshape(int(np.prod(x.shape[:-1])), x.shape[-1])


def _split(W, H):
    """W = [W_h | W_c]: W_h multiplies the item, W_c the context."""
    W = np.asarray(W)
    return W[:, :H], W[:, H:]


# --------------------------------------------------------------------------
# 1. Mean context: c = (1/n) sum_t m_t h_t

def mean_context(h, *, mask=None):
    """c (..., H) = mean of the valid rows of h (..., T, H); 0 when none."""
    h = np.asarray(h)
    m = _valid(mask, h.shape[:-1])                     # (..., T)
    h_valid = np.where(m[..., None], h, 0)             # padding -> exactly 0
    n = m.sum(axis=-1)[..., None]                      # (..., 1)
    # n = 0: the sum is 0, so dividing by 1 instead gives c = 0 (no 0/0).
    return h_valid.sum(axis=-2) / np.maximum(n, 1).astype(h.dtype)


def mean_context_backward(grad_c, h, *, mask=None):
    """dL/dh_t = (m_t / n) dL/dc: every valid item gets an equal share."""
    grad_c = np.asarray(grad_c)
    h = np.asarray(h)
    m = _valid(mask, h.shape[:-1])                     # (..., T)
    n = np.maximum(m.sum(axis=-1, keepdims=True), 1)   # (..., 1)
    share = (m / n).astype(grad_c.dtype)               # (..., T)
    return share[..., :, None] * grad_c[..., None, :]  # (..., T, H)


# --------------------------------------------------------------------------
# 2. Additive score: s_t = v . tanh(W_h h_t + W_c c + b)

def _preactivation(h, context, W, b):
    """z (..., T, A) = W_h h_t + W_c c + b; W_c c is computed once per row."""
    H = h.shape[-1]
    W_h, W_c = _split(W, H)
    z = h @ W_h.T + (context @ W_c.T)[..., None, :]    # (..., T, A)
    if b is not None:
        z = z + np.asarray(b)
    return z


def additive_score(h, context, W, v, *, b=None):
    """s (..., T): one score per item, given its row's context (..., H)."""
    h, context, v = np.asarray(h), np.asarray(context), np.asarray(v)
    u = np.tanh(_preactivation(h, context, W, b))      # (..., T, A)
    return u @ v                                       # (..., T)


def additive_score_backward(grad_s, h, context, W, v, *, b=None):
    """Gradients of additive_score: (dh, dcontext, dW, dv, db).

    Parameter gradients are summed over the batch.  db is None when b is.
    """
    grad_s, h = np.asarray(grad_s), np.asarray(h)
    context, v = np.asarray(context), np.asarray(v)
    H = h.shape[-1]
    W_h, W_c = _split(W, H)
    u = np.tanh(_preactivation(h, context, W, b))      # (..., T, A)
    # s_t = v . u_t  ->  dv = sum_t ds_t u_t
    dv = _rows(grad_s[..., None] * u).sum(axis=0)
    # u = tanh(z)  ->  eps_t = dL/dz_t = ds_t * v * (1 - u_t^2)
    eps = grad_s[..., None] * v * (1 - u * u)          # (..., T, A)
    # z_t = W_h h_t + W_c c + b
    E = eps.sum(axis=-2)                               # (..., A) sum over t
    dW_h = _rows(eps).T @ _rows(h)                     # sum_t eps_t h_t^T
    dW_c = _rows(E).T @ _rows(context)                 # (sum_t eps_t) c^T
    dh = eps @ W_h                                     # W_h^T eps_t
    dcontext = E @ W_c                                 # W_c^T sum_t eps_t
    db = None if b is None else _rows(E).sum(axis=0)
    return dh, dcontext, np.concatenate([dW_h, dW_c], axis=1), dv, db


# --------------------------------------------------------------------------
# 3. Masked softmax over T

def masked_softmax(scores, *, mask=None):
    """alpha (..., T): softmax over the valid items, exactly 0 elsewhere
    (and never exactly 0 on a valid item).

    Shifted by M = max of the valid scores, so exp never overflows.  A row
    with no valid item is all zeros (never NaN, never uniform over padding).
    """
    s = np.asarray(scores)
    m = _valid(mask, s.shape)
    any_valid = m.any(axis=-1, keepdims=True)          # (..., 1)
    M = np.max(np.where(m, s, -np.inf), axis=-1, keepdims=True)
    M = np.where(any_valid, M, 0)                      # no valid item: any M
    # exp(-inf) = 0: masked items get exactly zero weight.
    e = np.exp(np.where(m, s - M, -np.inf))            # (..., T)
    total = e.sum(axis=-1, keepdims=True)              # >= 1 when any valid
    alpha = e / np.where(any_valid, total, 1)
    # A valid item's weight is never exactly 0, even when exp underflows:
    # it is at least the smallest normal number.  So alpha is 0 exactly
    # where an item is masked, which the backwards check against the mask.
    return np.where(m, np.maximum(alpha, np.finfo(alpha.dtype).tiny), 0)


def masked_softmax_backward(grad_alpha, alpha):
    """ds_t = alpha_t (g_t - sum_j alpha_j g_j); masked items: alpha = 0."""
    g, alpha = np.asarray(grad_alpha), np.asarray(alpha)
    return alpha * (g - (alpha * g).sum(axis=-1, keepdims=True))


# --------------------------------------------------------------------------
# 4. Weighted sum: out = sum_t alpha_t h_t

def weighted_sum(alpha, h):
    """out (..., H) = sum_t alpha_t h_t."""
    return np.einsum("...t,...th->...h", np.asarray(alpha), np.asarray(h))


def weighted_sum_backward(grad_out, alpha, h):
    """(dalpha, dh): dalpha_t = g . h_t and dh_t = alpha_t g."""
    g, alpha, h = np.asarray(grad_out), np.asarray(alpha), np.asarray(h)
    dalpha = np.einsum("...h,...th->...t", g, h)
    dh = alpha[..., :, None] * g[..., None, :]
    return dalpha, dh


# --------------------------------------------------------------------------
# 5. The whole layer, written out once more from docs/contract.md sections
#    1 and 2 (independently of the building blocks above, so each checks the
#    other).

def context_attention(h, W, v, *, b=None, mask=None):
    """(out (..., H), alpha (..., T)) of context-pooled additive attention."""
    h, W, v = np.asarray(h), np.asarray(W), np.asarray(v)
    T, H = h.shape[-2:]
    m = _valid(mask, h.shape[:-1])                     # (..., T)
    h = np.where(m[..., None], h, 0)                   # padding never counts
    n = m.sum(axis=-1, keepdims=True)                  # (..., 1)
    c = h.sum(axis=-2) / np.maximum(n, 1).astype(h.dtype)        # (..., H)
    z = h @ W[:, :H].T + (c @ W[:, H:].T)[..., None, :]          # (..., T, A)
    if b is not None:
        z = z + b
    s = np.tanh(z) @ v                                           # (..., T)
    s = np.where(m, s, -np.inf)
    M = np.where(n > 0, s.max(axis=-1, keepdims=True), 0)
    e = np.exp(s - M)                                            # masked: 0
    alpha = e / np.where(n > 0, e.sum(axis=-1, keepdims=True), 1)
    out = np.einsum("...t,...th->...h", alpha, h)
    return out, alpha


def context_attention_backward(grad_out, h, W, v, alpha, *, b=None,
                               mask=None, grad_alpha=None):
    """Gradients (dh, dW, dv, db) of the layer (docs/contract.md section 2).

    ``alpha`` is the forward's output; parameter gradients are summed over
    the batch; db is None when b is.
    """
    g, h, W = np.asarray(grad_out), np.asarray(h), np.asarray(W)
    v, alpha = np.asarray(v), np.asarray(alpha)
    T, H = h.shape[-2:]
    W_h, W_c = W[:, :H], W[:, H:]
    m = _valid(mask, h.shape[:-1])                     # (..., T)
    h = np.where(m[..., None], h, 0)
    n = m.sum(axis=-1, keepdims=True)                  # (..., 1)
    c = h.sum(axis=-2) / np.maximum(n, 1).astype(h.dtype)
    z = h @ W_h.T + (c @ W_c.T)[..., None, :]
    if b is not None:
        z = z + b
    u = np.tanh(z)                                     # u_t = tanh(z_t)

    # gamma_t = g . h_t + g_alpha_t
    gamma = np.einsum("...h,...th->...t", g, h)
    if grad_alpha is not None:
        gamma = gamma + np.where(m, grad_alpha, 0)
    # delta_t = alpha_t (gamma_t - sum_j alpha_j gamma_j)
    delta = alpha * (gamma - (alpha * gamma).sum(axis=-1, keepdims=True))
    delta = np.where(m, delta, 0)
    # dL/dv = sum_t delta_t u_t
    dv = _rows(delta[..., None] * u).sum(axis=0)
    # eps_t = delta_t v (1 - u_t^2)
    eps = delta[..., None] * v * (1 - u * u)           # (..., T, A)
    E = eps.sum(axis=-2)                               # (..., A)
    # dL/db = sum_t eps_t;  dW_h = sum_t eps_t h_t^T;  dW_c = (sum_t eps_t) c^T
    db = None if b is None else _rows(E).sum(axis=0)
    dW = np.concatenate([_rows(eps).T @ _rows(h), _rows(E).T @ _rows(c)],
                        axis=1)
    # dL/dc = W_c^T sum_t eps_t
    dc = E @ W_c                                       # (..., H)
    # dL/dh_t = alpha_t g + W_h^T eps_t + (m_t / n) dL/dc
    dh = (alpha[..., :, None] * g[..., None, :] + eps @ W_h
          + (m / np.maximum(n, 1)).astype(h.dtype)[..., :, None]
          * dc[..., None, :])
    dh = np.where(m[..., None], dh, 0)
    return dh, dW, dv, db


# --------------------------------------------------------------------------
# 6. The attention family: a query against keys, three scores, values
#
#    query  (..., Hq) one per sequence, or (..., Tq, Hq) several
#           (several when query.ndim == keys.ndim)
#    keys   (..., T, H);  values (..., T, Hv), by default the keys
#
#    additive  s_it = v . tanh(W_k k_t + W_q q_i + b)    W = [W_k | W_q]
#    dot       s_it = scale q_i . k_t (+ bias_it)        scale = 1/sqrt(H)
#    general   s_it = q_i . (W_a k_t) (+ bias_it)        W_a (Hq, H)
#
#    alpha_i = softmax of s_i over the keys visible to query i
#    out_i   = sum_t alpha_it keep_it / (1 - p) val_t    (p = dropout)
#
# Which keys query i sees (docs: SPEC section 5.1):
#
#    mask       (..., T)       key mask, the same for every query
#    attn_mask  -> (..., Tq, T) per query, broadcast by NumPy rules
#    causal     key t visible to query i iff t <= i + (T - Tq)
#    bias       -inf acts as a mask too
#
#    visible_it = mask_t AND attn_mask_it AND causal_it AND bias_it > -inf
#
# Leading axes (...) of every input broadcast by NumPy rules: the result
# has the broadcast leading shape, and the gradient of a broadcast input is
# summed back to its shape (_sum_to).  A query with no visible key has
# out = 0, alpha = 0, lse = -inf and zero gradients.
#
# Every function below works on several queries; one query per sequence is
# the case Tq = 1 with that axis added on the way in and removed on the way
# out.

def _queries(query, keys):
    """(query as (..., Tq, Hq), whether it was a single query)."""
    query, keys = np.asarray(query), np.asarray(keys)
    single = query.ndim == keys.ndim - 1
    return (query[..., None, :] if single else query), single


def _sum_to(x, shape):
    """Sum x back to ``shape``, the shape of an array NumPy broadcast to
    x.shape: the gradient of np.broadcast_to (sum over the added leading
    axes and over the axes of size 1 that were stretched)."""
    x = np.asarray(x)
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    stretched = tuple(a for a, n in enumerate(shape)
                      if n == 1 and x.shape[a] != 1)
    return x.sum(axis=stretched, keepdims=True).reshape(shape)


def _fits(name, shape, target):
    """Refuse an array of ``shape`` that does not broadcast to ``target``
    without changing it (masks and bias never add leading axes)."""
    try:
        ok = np.broadcast_shapes(tuple(shape), target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(shape)} does not "
                         f"broadcast to {target}")


def _layout(query, keys, values, mask, attn_mask, causal, bias):
    """Check the arguments and lay them out for several queries.

    Returns (q, single, vis, bias): q (..., Tq, Hq); vis (lead, Tq, T) the
    booleans visible_it of the leading shape ``lead`` of the result; bias
    (..., Tq, T) (a single query's (..., T) bias gets its Tq = 1 axis) or
    None.  ``values`` is only read for its shape.
    """
    q, single = _queries(query, keys)
    keys = np.asarray(keys)
    Tq, T = q.shape[-2], keys.shape[-2]
    vals_lead = () if values is None else np.shape(values)[:-2]
    try:
        lead = np.broadcast_shapes(q.shape[:-2], keys.shape[:-2], vals_lead)
    except ValueError:
        raise ValueError(
            f"the leading axes of query {np.shape(query)}, keys "
            f"{keys.shape} and values {np.shape(values)} do not broadcast"
        ) from None
    full = lead + (Tq, T)
    vis = np.ones(full, dtype=bool)

    if mask is not None:
        m = np.asarray(mask, dtype=bool)
        if not single and m.ndim - 1 > len(lead):
            # the (..., Tq, T) form belongs to attn_mask, so that a mask is
            # never read one way or the other depending on the sizes
            raise ValueError(
                f"mask of shape {m.shape} has a query axis: mask is the key "
                f"mask (..., T); for a mask per query use attn_mask=")
        _fits("mask", m.shape, lead + (T,))
        vis = vis & m[..., None, :]                    # same for every i

    if single and (attn_mask is not None or causal):
        raise ValueError("attn_mask and causal need several queries "
                         "(query (..., Tq, Hq)); with one query per "
                         "sequence, mask (..., T) says it all")
    if attn_mask is not None:
        am = np.asarray(attn_mask)
        if am.dtype != bool:
            raise TypeError(
                f"attn_mask must be boolean (True = may attend), not "
                f"{am.dtype}: for a float mask use bias=; note that "
                f"nn.MultiheadAttention's (PyTorch) boolean masks mean True "
                f"= masked, the opposite of ours, while "
                f"scaled_dot_product_attention's mean True = take part")
        _fits("attn_mask", am.shape, full)
        vis = vis & am
    if causal:
        # bottom-right aligned: the last query sees every key
        i = np.arange(Tq)[:, None]
        t = np.arange(T)[None, :]
        vis = vis & (t <= i + (T - Tq))

    if bias is not None:
        bias = np.asarray(bias)
        if bias.dtype == bool:
            raise TypeError("bias is a float array added to the scores; "
                            "for a boolean mask use attn_mask=")
        if single:
            _fits("bias", bias.shape, lead + (T,))
            bias = bias[..., None, :]
        else:
            _fits("bias", bias.shape, full)
        vis = vis & ~np.isneginf(bias)                 # -inf: a mask
    return q, single, vis, bias


def _check_dropout(dropout, seed, Tq, T):
    """Refuse a dropout rate outside [0, 1) and a missing or bad seed."""
    dropout = 0.0 if dropout is None else dropout   # None: the default
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), not {dropout}")
    if dropout > 0:
        if seed is None:
            raise ValueError("dropout > 0 needs seed= (an int, "
                             "0 <= seed < 2**64)")
        if (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                or not 0 <= int(seed) < 2**64):
            raise ValueError(f"seed must be an int, 0 <= seed < 2**64, "
                             f"not {seed!r}")
        if Tq >= 2**32 or T >= 2**34:
            raise ValueError(f"dropout needs Tq < 2**32 and T < 2**34, "
                             f"not Tq = {Tq}, T = {T}")


def _live(vis, shape):
    """(shape[:-1]) booleans: the rows of an input of ``shape`` that some
    (query, key) pair sees, over all the positions it is broadcast to.
    ``vis`` is reduced over its other axis first: (lead, n)."""
    return _sum_to(vis, shape[:-1]) > 0


def _drop_padding(x, live):
    """x with the rows no pair sees set to 0.  Then a NaN in padding cannot
    reach a sum over rows (0 * NaN is NaN), and nothing else changes:
    padding has weight 0."""
    if x is None:
        return None
    x = np.asarray(x)
    return np.where(_live(live, x.shape)[..., None], x, 0)


def _visible_matmul(a, vis, b):
    """a @ b, where a (..., m, k) is 0 wherever vis (..., m, k) is False,
    without letting a NaN or inf of row k of b reach row m unless (m, k)
    is visible.

    A plain a @ b would: 0 * NaN = NaN.  So the non-finite entries of b are
    taken out of the product and added back only where visible; the rare
    (..., m, k, n) tensor is formed only when b has such entries.
    """
    finite = np.isfinite(b)
    out = a @ np.where(finite, b, 0)
    if finite.all():
        return out
    bad = np.where(finite, 0, b)
    seen = vis[..., :, :, None] & ~finite[..., None, :, :]
    with np.errstate(invalid="ignore"):                # 0 * inf not kept
        terms = np.where(seen, a[..., :, :, None] * bad[..., None, :, :], 0)
    return out + terms.sum(axis=-2)


def _softmax(s, vis):
    """(alpha, lse) of s (..., Tq, T) over the visible keys.

    Shifted by the largest visible score M, so exp never overflows;
    lse_i = M_i + log sum_t exp(s_it - M_i).  A query with no visible key
    gets alpha = 0 and lse = -inf (no 0/0, no log 0).
    """
    seen = vis.any(axis=-1, keepdims=True)             # (..., Tq, 1)
    s = np.where(vis, s, -np.inf)
    M = np.where(seen, np.max(s, axis=-1, keepdims=True, initial=-np.inf), 0)
    e = np.exp(s - M)                                  # invisible: 0
    total = np.where(seen, e.sum(axis=-1, keepdims=True), 1)
    alpha = e / total
    lse = np.where(seen, M + np.log(total), -np.inf)[..., 0]
    return alpha, lse


def _dropout_factor(dropout, seed, lead, Tq, T, dtype):
    """keep_it / (1 - p) as (lead, Tq, T) in dtype, or None when p = 0.
    The flat batch index b is the row-major index in ``lead``."""
    if not dropout:                     # 0 or None
        return None
    b = np.arange(int(np.prod(lead))).reshape(lead)
    keep = dropout_keep(seed, dropout, b, Tq, T)
    return np.where(keep, dtype.type(1 / (1 - dropout)), dtype.type(0))


def project_keys(keys, W):
    """The keys' side of a score, once per key: k_t @ W[:, :H].T.

    For the additive score, W = [W_k | W_q] and this is W_k k_t (..., T, A);
    for the general score, W = W_a and this is W_a k_t (..., T, Hq).
    """
    keys, W = np.asarray(keys), np.asarray(W)
    return keys @ W[:, :keys.shape[-1]].T


def project_keys_backward(grad_proj, keys, W):
    """(dkeys, dW) of project_keys; dW is zero past the first H columns."""
    g, keys, W = np.asarray(grad_proj), np.asarray(keys), np.asarray(W)
    H = keys.shape[-1]
    dW = np.zeros(W.shape, np.result_type(g, keys))
    dW[:, :H] = _rows(g).T @ _rows(keys)               # sum_t g_t k_t^T
    return g @ W[:, :H], dW


def _additive_parts(query, keys, W, b, key_proj):
    """u (..., Tq, T, A) = tanh(W_k k_t + W_q q_i + b); W_k k_t once a key."""
    H = keys.shape[-1]
    kp = project_keys(keys, W) if key_proj is None else np.asarray(key_proj)
    qp = query @ W[:, H:].T                            # (..., Tq, A)
    if b is not None:
        qp = qp + b
    return np.tanh(kp[..., None, :, :] + qp[..., :, None, :])


def additive_attention(query, keys, W, v, *, b=None, mask=None,
                       attn_mask=None, causal=False, values=None,
                       key_proj=None):
    """(out, alpha) with s_it = v . tanh(W_k k_t + W_q q_i + b)."""
    keys, W, v = np.asarray(keys), np.asarray(W), np.asarray(v)
    vals = keys if values is None else np.asarray(values)
    q, single, vis, _ = _layout(query, keys, values, mask, attn_mask,
                                causal, None)
    q = _drop_padding(q, vis.any(axis=-1))             # queries seeing none
    keys, vals, key_proj = (_drop_padding(x, vis.any(axis=-2))
                            for x in (keys, vals, key_proj))
    s = _additive_parts(q, keys, W, b, key_proj) @ v   # (..., Tq, T)
    alpha, _ = _softmax(s, vis)
    out = _visible_matmul(alpha, vis, vals)
    return (out[..., 0, :], alpha[..., 0, :]) if single else (out, alpha)


def additive_attention_backward(grad_out, query, keys, W, v, alpha, *,
                                b=None, mask=None, attn_mask=None,
                                causal=False, values=None, grad_alpha=None,
                                key_proj=None):
    """(dquery, dkeys, dvalues, dW, dv, db) of additive_attention.

    dvalues is None when values is None (the keys then get that gradient
    too); db is None when b is.  Parameter gradients sum over everything.
    """
    keys, W, v = np.asarray(keys), np.asarray(W), np.asarray(v)
    H = keys.shape[-1]
    vals = keys if values is None else np.asarray(values)
    q, single, vis, _ = _layout(query, keys, values, mask, attn_mask,
                                causal, None)
    g, a, ga = _add_query_axis(single, grad_out, alpha, grad_alpha)
    live_q, live_k = vis.any(axis=-1), vis.any(axis=-2)
    q, g = _drop_padding(q, live_q), _drop_padding(g, live_q)
    keys, vals, key_proj = (_drop_padding(x, live_k)
                            for x in (keys, vals, key_proj))
    delta, dvals = _attend_backward(g, a, vis, vals, ga)
    u = _additive_parts(q, keys, W, b, key_proj)       # (..., Tq, T, A)
    # s_it = v . u_it  ->  dv = sum_it delta_it u_it (visible pairs only:
    # an invisible u_it may be NaN)
    dv = np.where(vis[..., None], delta[..., None] * u, 0)
    dv = dv.reshape(-1, u.shape[-1]).sum(axis=0)
    # eps_it = dL/dz_it = delta_it v (1 - u_it^2), z_it = W_k k_t + W_q q_i + b
    eps = np.where(vis[..., None], delta[..., None] * v * (1 - u * u), 0)
    # sum over the queries, then over the axes the keys were broadcast on
    Ek = _sum_to(eps.sum(axis=-3), keys.shape[:-1] + eps.shape[-1:])
    Eq = _sum_to(eps.sum(axis=-2), q.shape[:-1] + eps.shape[-1:])
    dW = np.concatenate([_rows(Ek).T @ _rows(keys), _rows(Eq).T @ _rows(q)],
                        axis=1)
    db = None if b is None else _rows(Eq).sum(axis=0)
    dq = Eq @ W[:, H:]                                 # W_q^T sum_t eps_it
    dk = Ek @ W[:, :H]                                 # W_k^T sum_i eps_it
    dvals = _sum_to(dvals, vals.shape)
    return _family_grads(single, dq, dk, dvals, values is None) + (dW, dv, db)


def _default_scale(keys):
    """1/sqrt(H) as a Python float (which does not promote float32 arrays);
    1 when H = 0."""
    return 1 / float(np.sqrt(max(keys.shape[-1], 1)))


def _dot_scores(q, keys, scale, bias):
    """s (..., Tq, T) = scale q_i . k_t + bias_it (bias in the scores'
    dtype, so a float64 bias does not promote float32 scores)."""
    s = scale * (q @ keys.swapaxes(-1, -2))
    if bias is not None:
        with np.errstate(invalid="ignore"):            # -inf + inf: masked
            s = s + bias.astype(s.dtype, copy=False)
    return s


def dot_attention(query, keys, *, mask=None, attn_mask=None, causal=False,
                  bias=None, dropout=0.0, seed=None, values=None, scale=None,
                  return_weights=True):
    """s_it = scale q_i . k_t + bias_it, scale None = 1/sqrt(H).

    Returns (out, alpha), or (out, lse) with return_weights=False, lse_i =
    log sum_t exp(s_it) over the visible keys.  alpha is before dropout.
    """
    keys = np.asarray(keys)
    vals = keys if values is None else np.asarray(values)
    scale = _default_scale(keys) if scale is None else scale
    q, single, vis, bias = _layout(query, keys, values, mask, attn_mask,
                                   causal, bias)
    Tq, T = vis.shape[-2:]
    _check_dropout(dropout, seed, Tq, T)
    q = _drop_padding(q, vis.any(axis=-1))             # queries seeing none
    keys, vals = (_drop_padding(x, vis.any(axis=-2)) for x in (keys, vals))
    s = _dot_scores(q, keys, scale, bias)
    alpha, lse = _softmax(s, vis)
    drop = _dropout_factor(dropout, seed, vis.shape[:-2], Tq, T,
                           alpha.dtype)
    weights = alpha if drop is None else alpha * drop
    out = _visible_matmul(weights, vis, vals)
    if single:                          # drop the Tq = 1 axis again
        out, alpha, lse = out[..., 0, :], alpha[..., 0, :], lse[..., 0]
    return (out, alpha) if return_weights else (out, lse)


def _attend_backward(g, alpha, vis, vals, ga, drop=None, D=None):
    """(delta = dL/ds, dvalues) from the softmax, dropout and weighted sum.

    gamma_it = (g_i . val_t) keep_it/(1-p) + ga_it;  with D_i None,
    D_i = sum_j alpha_ij gamma_ij; delta_it = alpha_it (gamma_it - D_i);
    dval_t = sum_i alpha_it keep_it/(1-p) g_i.  ``alpha`` is P of SPEC
    5.2 when recomputed from lse (then D_i = g_i . out_i is given).
    """
    gamma = g @ vals.swapaxes(-1, -2)                  # (..., Tq, T)
    if drop is not None:
        gamma = gamma * drop
    if ga is not None:
        gamma = gamma + ga
    gamma = np.where(vis, gamma, 0)                    # invisible: alpha = 0
    if D is None:
        D = (alpha * gamma).sum(axis=-1)
    delta = np.where(vis, alpha * (gamma - D[..., None]), 0)
    weights = alpha if drop is None else alpha * drop
    dvalues = _visible_matmul(weights.swapaxes(-1, -2),
                              vis.swapaxes(-1, -2), g)
    return delta, dvalues


def _saved(alpha, out, lse, grad_alpha):
    """Check the backward's choice between alpha and (out=, lse=)."""
    if alpha is not None and (lse is not None or out is not None):
        raise ValueError("give either alpha or out= and lse= (from a "
                         "return_weights=False forward), not both")
    if alpha is None:
        if lse is None or out is None:
            raise ValueError("the backward needs alpha, or out= and lse= "
                             "together")
        if grad_alpha is not None:
            raise ValueError("grad_alpha is accepted only with alpha (a "
                             "return_weights=False forward has no alpha)")


def dot_attention_backward(grad_out, query, keys, alpha=None, *, out=None,
                           lse=None, mask=None, attn_mask=None, causal=False,
                           bias=None, dropout=0.0, seed=None, values=None,
                           scale=None, grad_alpha=None):
    """(dquery, dkeys, dvalues, dbias) of dot_attention (SPEC 5.2).

    From alpha as in section 4, or from out= and lse=: P_it = exp(s_it -
    lse_i) on the visible keys and D_i = g_i . out_i.  dvalues is None when
    values is None (the keys take that gradient); dbias is None when bias
    is, else delta summed to the shape of bias.
    """
    keys = np.asarray(keys)
    vals = keys if values is None else np.asarray(values)
    scale = _default_scale(keys) if scale is None else scale
    q, single, vis, b = _layout(query, keys, values, mask, attn_mask,
                                causal, bias)
    Tq, T = vis.shape[-2:]
    _check_dropout(dropout, seed, Tq, T)
    _saved(alpha, out, lse, grad_alpha)
    g, a, ga = _add_query_axis(single, grad_out, alpha, grad_alpha)
    # rows nobody sees are zeroed: a query with no visible key gets no
    # gradient at all (its g may be NaN), and padding reaches nothing
    live_q, live_k = vis.any(axis=-1), vis.any(axis=-2)
    q, g = _drop_padding(q, live_q), _drop_padding(g, live_q)
    keys, vals = (_drop_padding(x, live_k) for x in (keys, vals))
    D = None
    if a is None:
        o, l = np.asarray(out), np.asarray(lse)
        if single:
            o, l = o[..., None, :], l[..., None]
        l = np.where(np.isfinite(l), l, 0)[..., None]  # -inf: no visible key
        s = _dot_scores(q, keys, scale, b)
        # exp only where visible: a hidden key's s - lse may overflow
        a = np.exp(np.where(vis, s - l, -np.inf))
        D = np.where(live_q, (g * o).sum(axis=-1), 0)
    drop = _dropout_factor(dropout, seed, vis.shape[:-2], Tq, T,
                           np.result_type(a, g))
    # (drop and D by keyword, only when there: the bare 5-argument call is
    # the one tests/test_properties.py patches)
    extra = {n: x for n, x in (("drop", drop), ("D", D)) if x is not None}
    delta, dvals = _attend_backward(g, a, vis, vals, ga, **extra)
    dq = scale * _visible_matmul(delta, vis, keys)     # scale sum_t d_it k_t
    dk = scale * _visible_matmul(delta.swapaxes(-1, -2),
                                 vis.swapaxes(-1, -2), q)
    dq, dk = _sum_to(dq, q.shape), _sum_to(dk, keys.shape)
    dvals = _sum_to(dvals, vals.shape)
    dbias = None
    if bias is not None:
        dbias = _sum_to(delta[..., 0, :] if single else delta,
                        np.shape(bias))
    return _family_grads(single, dq, dk, dvals, values is None) + (dbias,)


def general_attention(query, keys, W, *, mask=None, attn_mask=None,
                      causal=False, bias=None, dropout=0.0, seed=None,
                      values=None, key_proj=None, return_weights=True):
    """s_it = q_i . (W_a k_t) + bias_it, W_a = W (Hq, H): the dot score
    with scale 1 on the projected keys.  Returns as dot_attention."""
    keys = np.asarray(keys)
    vals = keys if values is None else values
    if key_proj is None:                # padding dropped before W_a
        _, _, vis, _ = _layout(query, keys, values, mask, attn_mask, causal,
                               bias)
        keys = _drop_padding(keys, vis.any(axis=-2))
    kp = project_keys(keys, W) if key_proj is None else np.asarray(key_proj)
    return dot_attention(query, kp, mask=mask, attn_mask=attn_mask,
                         causal=causal, bias=bias, dropout=dropout,
                         seed=seed, values=vals, scale=1.0,
                         return_weights=return_weights)


def general_attention_backward(grad_out, query, keys, W, alpha=None, *,
                               out=None, lse=None, mask=None, attn_mask=None,
                               causal=False, bias=None, dropout=0.0,
                               seed=None, values=None, grad_alpha=None,
                               key_proj=None):
    """(dquery, dkeys, dvalues, dW, dbias) of general_attention."""
    keys, W = np.asarray(keys), np.asarray(W)
    vals = keys if values is None else values
    _, _, vis, _ = _layout(query, keys, values, mask, attn_mask, causal,
                           bias)
    live_keys = _drop_padding(keys, vis.any(axis=-2))
    kp = (project_keys(live_keys, W) if key_proj is None
          else np.asarray(key_proj))
    dq, dkp, dvals, dbias = dot_attention_backward(
        grad_out, query, kp, alpha, out=out, lse=lse, mask=mask,
        attn_mask=attn_mask, causal=causal, bias=bias, dropout=dropout,
        seed=seed, values=vals, scale=1.0, grad_alpha=grad_alpha)
    # k_t -> W_a k_t:  dk_t = W_a^T dkp_t,  dW_a = sum_t dkp_t k_t^T
    dk, dW = project_keys_backward(dkp, live_keys, W)
    if values is None:
        dk, dvals = dk + dvals, None
    return dq, dk, dvals, dW, dbias


def _add_query_axis(single, grad_out, alpha, grad_alpha):
    """grad_out, alpha, grad_alpha with the query axis (Tq = 1) added
    (alpha may be None: a backward from out= and lse=)."""
    g = np.asarray(grad_out)
    a = None if alpha is None else np.asarray(alpha)
    ga = None if grad_alpha is None else np.asarray(grad_alpha)
    if single:
        g = g[..., None, :]
        a = None if a is None else a[..., None, :]
        ga = None if ga is None else ga[..., None, :]
    return g, a, ga


def _family_grads(single, dq, dk, dvals, values_are_keys):
    """(dquery, dkeys, dvalues) in the caller's shapes; the keys take the
    values' gradient when they are the values."""
    if single:
        dq = dq[..., 0, :]
    if values_are_keys:
        return dq, dk + dvals, None
    return dq, dk, dvals


# --------------------------------------------------------------------------
# 7. Dropout keep bits: Philox4x32-10 (Salmon, Moraes, Dror and Shaw,
#    "Parallel random numbers: as easy as 1, 2, 3", SC 2011; Random123)
#
# A counter-based generator: the bits for (seed, b, i, t) are a function of
# those numbers alone, so the C kernel gets the same keep pattern for any
# thread count and blocking, and the backward regenerates it instead of
# storing it.  uint32 words are held in uint64 arrays so that the 32 x 32
# -> 64-bit products are exact.

_M32 = np.uint64(0xFFFFFFFF)
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_S32 = np.uint64(32)


def philox4x32(counter, key):
    """The 4 output words of Philox4x32-10 for counter (c0, c1, c2, c3)
    under key (k0, k1).

    Each word may be an int or an array of them (taken mod 2**32); arrays
    broadcast, and the words come back as uint32 arrays of the broadcast
    shape.  One round::

        p0 = M0 c0, p1 = M1 c2                      (64-bit products)
        (c0, c1, c2, c3) = (hi(p1) ^ c1 ^ k0, lo(p1), hi(p0) ^ c3 ^ k1,
                            lo(p0))

    then the key is bumped by the Weyl constants (k0 += W0, k1 += W1).
    """
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _M32
                      for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & _M32 for k in key)
    for _ in range(10):
        p0, p1 = _PHILOX_M[0] * c0, _PHILOX_M[1] * c2
        c0, c1, c2, c3 = ((p1 >> _S32) ^ c1 ^ k0, p1 & _M32,
                          (p0 >> _S32) ^ c3 ^ k1, p0 & _M32)
        k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
    shape = np.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape)
    return tuple(np.broadcast_to(c, shape).astype(np.uint32)
                 for c in (c0, c1, c2, c3))


def dropout_keep(seed, p, b, Tq, T):
    """keep (Tq, T) booleans of dropout rate p for flat batch index b.

    keep_it = (word t & 3 of philox(counter, key)) >= floor(p 2**32) with
    key = (seed mod 2**32, seed >> 32) and counter = (t >> 2, i, b mod
    2**32, b >> 32): one Philox call gives the bits of 4 keys.  ``b`` may
    also be an array of batch indices: the result is then b.shape + (Tq,
    T).  The fraction kept is 1 - p (within 2**-32).
    """
    seed, b = int(seed), np.asarray(b, dtype=np.uint64)[..., None, None]
    blocks = (T + 3) // 4
    i = np.arange(Tq, dtype=np.uint64)[:, None]        # (Tq, 1)
    t4 = np.arange(blocks, dtype=np.uint64)[None, :]   # (1, blocks) = t >> 2
    words = philox4x32((t4, i, b & _M32, b >> _S32),
                       (seed & 0xFFFFFFFF, seed >> 32))
    # word j of block t4 is key t = 4 t4 + j: interleave, cut to T
    u = np.stack(words, axis=-1).reshape(b.shape[:-2] + (Tq, 4 * blocks))
    threshold = np.uint32(math.floor(p * 2**32))
    return u[..., :T] >= threshold


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
