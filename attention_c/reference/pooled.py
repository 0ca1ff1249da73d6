"""The context-pooled layer in plain NumPy: its building blocks, each with
its backward, and the whole layer (docs/contract.md sections 1 and 2).

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

from ._shapes import _rows


def _valid(mask, shape):
    """The mask as a boolean array of ``shape`` (all True when None)."""
    if mask is None:
        return np.ones(shape, dtype=bool)
    return np.asarray(mask, dtype=bool)


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
