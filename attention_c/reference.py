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
#    mask   (..., T) for every query, or (..., Tq, T) per query
#
#    additive  s_it = v . tanh(W_k k_t + W_q q_i + b)    W = [W_k | W_q]
#    dot       s_it = scale q_i . k_t                    scale = 1/sqrt(H)
#    general   s_it = q_i . (W_a k_t)                    W_a (Hq, H)
#
#    alpha_i = masked softmax of s_i over t;  out_i = sum_t alpha_it val_t
#
# Every function below works on several queries; one query per sequence is
# the case Tq = 1 with that axis added on the way in and removed on the way
# out.

def _queries(query, keys):
    """(query as (..., Tq, Hq), whether it was a single query)."""
    query, keys = np.asarray(query), np.asarray(keys)
    single = query.ndim == keys.ndim - 1
    return (query[..., None, :] if single else query), single


def _family_mask(mask, query, keys):
    """The mask as (..., Tq, T) booleans: a key mask applies to every query."""
    shape = query.shape[:-1] + keys.shape[-2:-1]       # (..., Tq, T)
    m = _valid(mask, shape)
    if m.ndim == keys.ndim - 1:                        # a key mask (..., T)
        m = m[..., None, :]
    return np.broadcast_to(m, shape)


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


def _drop_padding(m, *rows):
    """Zero the padding: key rows (..., T, n) masked for every query, and
    query rows (..., Tq, n) with no valid key.  Then a NaN in padding cannot
    reach any result, and nothing else changes (padding has weight 0)."""
    live_k = m.any(axis=-2)[..., :, None]              # (..., T, 1)
    live_q = m.any(axis=-1)[..., :, None]              # (..., Tq, 1)
    return [None if x is None else
            np.where(live_k if kind == "k" else live_q, x, 0)
            for kind, x in rows]


def _attend(s, m, values):
    """alpha (..., Tq, T) = masked softmax of s; out = alpha @ values."""
    any_valid = m.any(axis=-1, keepdims=True)
    s = np.where(m, s, -np.inf)
    M = np.where(any_valid, s.max(axis=-1, keepdims=True), 0)
    e = np.exp(s - M)                                  # masked: exp(-inf) = 0
    alpha = e / np.where(any_valid, e.sum(axis=-1, keepdims=True), 1)
    return alpha @ values, alpha


def _attend_backward(g, alpha, m, values, grad_alpha):
    """(delta = dL/ds, dvalues) from the softmax and the weighted sum.

    gamma_it = g_i . val_t + ga_it;  delta_it = alpha_it (gamma_it -
    sum_j alpha_ij gamma_ij);  dval_t = sum_i alpha_it g_i.
    """
    gamma = g @ values.swapaxes(-1, -2)                # (..., Tq, T)
    if grad_alpha is not None:
        gamma = gamma + grad_alpha
    gamma = np.where(m, gamma, 0)                      # masked: alpha = 0
    delta = alpha * (gamma - (alpha * gamma).sum(axis=-1, keepdims=True))
    dvalues = alpha.swapaxes(-1, -2) @ g               # sum_i alpha_it g_i
    return delta, dvalues


def _additive_parts(query, keys, W, b, key_proj):
    """u (..., Tq, T, A) = tanh(W_k k_t + W_q q_i + b); W_k k_t once a key."""
    H = keys.shape[-1]
    kp = project_keys(keys, W) if key_proj is None else np.asarray(key_proj)
    qp = query @ W[:, H:].T                            # (..., Tq, A)
    if b is not None:
        qp = qp + b
    return np.tanh(kp[..., None, :, :] + qp[..., :, None, :])


def additive_attention(query, keys, W, v, *, b=None, mask=None, values=None,
                       key_proj=None):
    """(out, alpha) with s_it = v . tanh(W_k k_t + W_q q_i + b)."""
    q, single = _queries(query, keys)
    keys, W, v = np.asarray(keys), np.asarray(W), np.asarray(v)
    vals = keys if values is None else np.asarray(values)
    m = _family_mask(mask, q, keys)
    q, keys, vals, key_proj = _drop_padding(
        m, ("q", q), ("k", keys), ("k", vals), ("k", key_proj))
    s = _additive_parts(q, keys, W, b, key_proj) @ v   # (..., Tq, T)
    out, alpha = _attend(s, m, vals)
    return (out[..., 0, :], alpha[..., 0, :]) if single else (out, alpha)


def additive_attention_backward(grad_out, query, keys, W, v, alpha, *,
                                b=None, mask=None, values=None, grad_alpha=None,
                                key_proj=None):
    """(dquery, dkeys, dvalues, dW, dv, db) of additive_attention.

    dvalues is None when values is None (the keys then get that gradient
    too); db is None when b is.  Parameter gradients sum over everything.
    """
    q, single = _queries(query, keys)
    keys, W, v = np.asarray(keys), np.asarray(W), np.asarray(v)
    H = keys.shape[-1]
    vals = keys if values is None else np.asarray(values)
    g, a, ga = _add_query_axis(single, grad_out, alpha, grad_alpha)
    m = _family_mask(mask, q, keys)
    q, keys, vals, key_proj, g = _drop_padding(
        m, ("q", q), ("k", keys), ("k", vals), ("k", key_proj), ("q", g))
    delta, dvals = _attend_backward(g, a, m, vals, ga)
    u = _additive_parts(q, keys, W, b, key_proj)       # (..., Tq, T, A)
    # s_it = v . u_it  ->  dv = sum_it delta_it u_it
    dv = (delta[..., None] * u).reshape(-1, u.shape[-1]).sum(axis=0)
    # eps_it = dL/dz_it = delta_it v (1 - u_it^2), z_it = W_k k_t + W_q q_i + b
    eps = delta[..., None] * v * (1 - u * u)
    Ek = eps.sum(axis=-3)                              # (..., T, A) over i
    Eq = eps.sum(axis=-2)                              # (..., Tq, A) over t
    dW = np.concatenate([_rows(Ek).T @ _rows(keys), _rows(Eq).T @ _rows(q)],
                        axis=1)
    db = None if b is None else _rows(Eq).sum(axis=0)
    dq = Eq @ W[:, H:]                                 # W_q^T sum_t eps_it
    dk = Ek @ W[:, :H]                                 # W_k^T sum_i eps_it
    return _family_grads(single, dq, dk, dvals, values is None) + (dW, dv, db)


def _default_scale(keys):
    """1/sqrt(H) as a Python float (which does not promote float32 arrays);
    1 when H = 0."""
    return 1 / float(np.sqrt(max(keys.shape[-1], 1)))


def dot_attention(query, keys, *, mask=None, values=None, scale=None):
    """(out, alpha) with s_it = scale q_i . k_t, scale None = 1/sqrt(H)."""
    q, single = _queries(query, keys)
    keys = np.asarray(keys)
    vals = keys if values is None else np.asarray(values)
    scale = _default_scale(keys) if scale is None else scale
    m = _family_mask(mask, q, keys)
    q, keys, vals = _drop_padding(m, ("q", q), ("k", keys), ("k", vals))
    s = scale * (q @ keys.swapaxes(-1, -2))            # (..., Tq, T)
    out, alpha = _attend(s, m, vals)
    return (out[..., 0, :], alpha[..., 0, :]) if single else (out, alpha)


def dot_attention_backward(grad_out, query, keys, alpha, *, mask=None,
                           values=None, scale=None, grad_alpha=None):
    """(dquery, dkeys, dvalues) of dot_attention; dvalues None as above."""
    q, single = _queries(query, keys)
    keys = np.asarray(keys)
    vals = keys if values is None else np.asarray(values)
    scale = _default_scale(keys) if scale is None else scale
    g, a, ga = _add_query_axis(single, grad_out, alpha, grad_alpha)
    m = _family_mask(mask, q, keys)
    q, keys, vals, g = _drop_padding(m, ("q", q), ("k", keys), ("k", vals),
                                     ("q", g))
    delta, dvals = _attend_backward(g, a, m, vals, ga)
    dq = scale * (delta @ keys)                        # scale sum_t d_it k_t
    dk = scale * (delta.swapaxes(-1, -2) @ q)          # scale sum_i d_it q_i
    return _family_grads(single, dq, dk, dvals, values is None)


def general_attention(query, keys, W, *, mask=None, values=None,
                      key_proj=None):
    """(out, alpha) with s_it = q_i . (W_a k_t), W_a = W (Hq, H)."""
    keys = np.asarray(keys)
    vals = keys if values is None else values
    if key_proj is None:                    # padding dropped before W_a
        q, _ = _queries(query, keys)
        (keys,) = _drop_padding(_family_mask(mask, q, keys), ("k", keys))
    kp = project_keys(keys, W) if key_proj is None else np.asarray(key_proj)
    # the general score is the dot score (scale 1) on the projected keys
    return dot_attention(query, kp, mask=mask, values=vals, scale=1.0)


def general_attention_backward(grad_out, query, keys, W, alpha, *,
                               mask=None, values=None, grad_alpha=None,
                               key_proj=None):
    """(dquery, dkeys, dvalues, dW) of general_attention."""
    keys, W = np.asarray(keys), np.asarray(W)
    vals = keys if values is None else values
    q, _ = _queries(query, keys)
    (live_keys,) = _drop_padding(_family_mask(mask, q, keys), ("k", keys))
    kp = (project_keys(live_keys, W) if key_proj is None
          else np.asarray(key_proj))
    dq, dkp, dvals = dot_attention_backward(grad_out, query, kp, alpha,
                                            mask=mask, values=vals,
                                            scale=1.0, grad_alpha=grad_alpha)
    # k_t -> W_a k_t:  dk_t = W_a^T dkp_t,  dW_a = sum_t dkp_t k_t^T
    dk, dW = project_keys_backward(dkp, live_keys, W)
    if values is None:
        dk, dvals = dk + dvals, None
    return dq, dk, dvals, dW


def _add_query_axis(single, grad_out, alpha, grad_alpha):
    """grad_out, alpha, grad_alpha with the query axis (Tq = 1) added."""
    g, a = np.asarray(grad_out), np.asarray(alpha)
    ga = None if grad_alpha is None else np.asarray(grad_alpha)
    if single:
        g, a = g[..., None, :], a[..., None, :]
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
