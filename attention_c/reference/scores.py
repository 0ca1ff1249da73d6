"""Two more scores of the attention family in plain NumPy: the location
score (Luong 2015, eq. 8) and the content score of the Neural Turing
Machine (cosine, Graves 2014).  Both are the dot score of .family in
disguise, so each is written here as what it feeds the reference
dot_attention, and each backward as the dot backward followed by the chain
rule back to its own inputs.

    query   (..., Hq) one per sequence, or (..., Tq, Hq) several
    keys    (..., T, H)   (cosine);  values (..., T, Hv)

    location  s_it = W_t . q_i + b_t          W (T_max, Hq), b (T_max,)
              = dot with keys W[:T] (the same for every sequence),
                scale 1, bias b[:T] (the same for every query)
    cosine    s_it = beta_i n(q_i) . n(k_t)   n(x) = x / max(||x||, eps)
              = dot with queries q'_i = beta_i n(q_i), keys n(k_t),
                scale 1; the values are by default the raw keys

The location score looks at no key: query i weighs position t by the row
W_t of a learned matrix, whatever sits there.  W has one row per position
up to T_max; a sequence of T <= T_max positions uses the first T rows, so
the others get a gradient of exactly 0.

The cosine score compares directions only, so the scores lie in [-beta_i,
beta_i]: the sharpness beta_i (key strength in the NTM) decides how peaked
the weights can be.  eps = 1e-12 and the clamp are F.normalize's: a vector
shorter than eps is divided by eps (a zero vector scores 0, never NaN),
and so is its gradient.

Everything else (masks, causal, window, packed sequences, bias, softcap,
ALiBi, sinks, dropout, return_weights) is that of dot_attention, applied
to the score above exactly as there.
"""

import numpy as np

from ._shapes import _sum_to
from .family import dot_attention, dot_attention_backward
from .masks import _drop_padding, _fits, _layout

EPS = 1e-12          # F.normalize's default: n(x) = x / max(||x||, EPS)


# --------------------------------------------------------------------------
# 1. Location: s_it = W_t . q_i + b_t

def _location_keys(values, W, b):
    """(keys, bias): W[:T] as keys with the values' number of leading axes
    (of size 1: the same rows for every sequence), and b[:T] or None."""
    values, W = np.asarray(values), np.asarray(W)
    T = values.shape[-2]
    if W.ndim != 2 or W.shape[0] < T:
        raise ValueError(f"W must be (T_max, Hq) with T_max >= T = {T} "
                         f"(one row per position), got shape {W.shape}")
    if b is not None:
        b = np.asarray(b)
        if b.shape != W.shape[:1]:
            raise ValueError(f"b must be (T_max,) = {W.shape[:1]} like W's "
                             f"rows, got shape {b.shape}")
        b = b[:T]
        W = W.astype(np.result_type(W, b), copy=False)  # b promotes as W
    keys = W[:T].reshape((1,) * (values.ndim - 2) + (T, W.shape[1]))
    return keys, b


def location_attention(query, values, W, *, b=None, mask=None,
                       attn_mask=None):
    """Location attention: each position t has its own learned row W_t.

    ::

        s_it     = W_t . q_i + b_t                  t < T <= T_max
        alpha_i  = masked softmax of s_i over t
        out_i    = sum_t alpha_it val_t

    that is ``dot_attention(query, W[:T], values=values, scale=1,
    bias=b[:T])``, and in PyTorch ``softmax(Linear(Hq, T_max)(q)[..., :T])
    @ values``.

    Parameters
    ----------
    query : array_like, (..., Hq) or (..., Tq, Hq)
        Several queries when ``query.ndim == values.ndim``.
    values : array_like, (..., T, Hv)
    W : array_like, (T_max, Hq)
        One row per position, shared by every sequence; rows t >= T unused.
    b : array_like, (T_max,), optional
    mask : array_like of bool, (..., T), optional
        The key mask.
    attn_mask : array_like of bool, (..., Tq, T), optional
        A mask per query (several queries only).

    Returns
    -------
    out : ndarray, (..., Hv) or (..., Tq, Hv)
    alpha : ndarray, (..., T) or (..., Tq, T)
        0 on masked positions; a query that sees no position has alpha = 0
        and out = 0.
    """
    keys, bias = _location_keys(values, W, b)
    return dot_attention(query, keys, mask=mask, attn_mask=attn_mask,
                         bias=bias, values=values, scale=1.0)


def location_attention_backward(grad_out, query, values, W, alpha, *,
                                b=None, mask=None, attn_mask=None,
                                grad_alpha=None):
    """The gradients of location_attention: (dquery, dvalues, dW, db).

    With delta_it = dL/ds_it from the softmax (docs/contract.md 4.4)::

        dq_i  = sum_t delta_it W_t
        dW_t  = sum_i delta_it q_i    (t < T);   dW_t = 0  (t >= T)
        db_t  = sum_i delta_it        (t < T);   db_t = 0  (t >= T)
        dval_t = sum_i alpha_it g_i

    the dot score's gradients of its keys and bias, put back in the first
    T rows; the sums over i run over every query of every sequence.

    Parameters
    ----------
    grad_out : array_like, out's shape
    query, values, W, b, mask, attn_mask
        As for location_attention.
    alpha : array_like
        The forward's weights.
    grad_alpha : array_like, alpha's shape, optional
        dL/dalpha, when the loss also depends on the weights.

    Returns
    -------
    tuple of ndarray
        (dquery, dvalues, dW, db) in the shapes of query, values, W, b; db
        is None when b is.
    """
    keys, bias = _location_keys(values, W, b)
    dq, dkeys, dvals, dbias, _, _ = dot_attention_backward(
        grad_out, query, keys, alpha, mask=mask, attn_mask=attn_mask,
        bias=bias, values=values, scale=1.0, grad_alpha=grad_alpha)
    T = keys.shape[-2]
    dW = np.zeros(np.shape(W), dkeys.dtype)
    dW[:T] = dkeys.reshape(dW[:T].shape)             # the keys W[:T]
    db = None
    if b is not None:
        db = np.zeros(np.shape(b), dbias.dtype)
        db[:T] = dbias
    return dq, dvals, dW, db


# --------------------------------------------------------------------------
# 2. Cosine: s_it = beta_i n(q_i) . n(k_t)

def normalize(x):
    """(n(x), ||x||): n(x) = x / max(||x||, eps) along the last axis, as
    F.normalize(x, dim=-1) computes it; ||x|| keeps that axis (size 1)."""
    x = np.asarray(x)
    norm = np.sqrt((x * x).sum(axis=-1, keepdims=True))
    return x / np.maximum(norm, EPS), norm


def normalize_backward(grad, x):
    """dL/dx of n = normalize(x)[0], given grad = dL/dn::

        ||x|| >= eps:  dx = (grad - n (n . grad)) / ||x||
        ||x|| <  eps:  dx = grad / eps          (there n = x / eps)

    The part of grad along n is lost: scaling x does not move n.  grad may
    have more leading axes than x (x broadcast): the result has grad's.
    """
    n, norm = normalize(x)
    radial = np.where(norm >= EPS, (n * grad).sum(axis=-1, keepdims=True), 0)
    return (grad - n * radial) / np.maximum(norm, EPS)


def _is_number(sharpness):
    """A Python number (np.float64 is one: a float subclass), which has
    no gradient; an array (0-d too) has one."""
    return isinstance(sharpness, (int, float))


def _sharpness(sharpness, target, dtype):
    """beta as an array of the query positions' shape ``target`` = out's
    shape[:-1], in the computing dtype, checked: None is 1, a Python
    number must be finite, an array must broadcast to target."""
    if sharpness is None:
        sharpness = 1.0
    if isinstance(sharpness, bool):
        raise TypeError("sharpness must be a real number or a float array, "
                        "not a bool")
    if _is_number(sharpness):
        if not np.isfinite(sharpness):
            raise ValueError(f"sharpness must be finite, got {sharpness!r}")
    else:
        sharpness = np.asarray(sharpness)
        if not np.issubdtype(sharpness.dtype, np.number) or \
                np.iscomplexobj(sharpness):
            raise TypeError(f"sharpness must be a real float array, not "
                            f"{sharpness.dtype}")
        _fits("sharpness", sharpness.shape, target)
    return np.broadcast_to(np.asarray(sharpness, dtype), target)


def _cosine_parts(query, keys, values, sharpness, mask, attn_mask, causal,
                  bias, window, cu_seqlens_q, cu_seqlens_k):
    """What the cosine score hands the dot score, and the chain rule's
    inputs: (q' = beta n(q), n(k), the values, beta, query, keys).

    query and keys are returned with their padding (rows no pair sees) set
    to 0, so that a NaN there cannot reach n() and its gradient; beta is 0
    for a query that sees no key (its gradient must be 0 whatever beta).
    q' has the leading axes of the result and n(k) as many (of size 1
    where the keys have none), so that q' and n(k) tell one query from
    several as query and keys do.
    """
    keys = np.asarray(keys)
    _, single, vis, _ = _layout(query, keys, values, mask, attn_mask, causal,
                                bias, window, cu_seqlens_q, cu_seqlens_k)
    live_q = vis.any(axis=-1)                          # (lead, Tq)
    if single:
        live_q = live_q[..., 0]                        # (lead,)
    query = _drop_padding(query, live_q)
    keys = _drop_padding(keys, vis.any(axis=-2))
    nq, _ = normalize(query)
    nk, _ = normalize(keys)
    beta = _sharpness(sharpness, live_q.shape, nq.dtype)
    beta = np.where(live_q, beta, 0)
    nk = nk.reshape((1,) * (vis.ndim - keys.ndim) + nk.shape)
    vals = keys if values is None else values          # the raw keys
    return beta[..., None] * nq, nk, vals, beta, query, keys


def cosine_attention(query, keys, *, mask=None, attn_mask=None,
                     causal=False, bias=None, dropout=0.0, seed=None,
                     values=None, sharpness=None, return_weights=True,
                     window=None, softcap=None, alibi_slopes=None,
                     sinks=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Cosine (content) attention: the keys most aligned with the query win.

    ::

        n(x)     = x / max(||x||_2, eps)            eps = 1e-12
        s_it     = beta_i n(q_i) . n(k_t)           in [-beta_i, beta_i]
        alpha_i  = masked softmax of s_i over t
        out_i    = sum_t alpha_it val_t             val = keys by default

    that is ``dot_attention(q', n(keys), values=values or keys, scale=1,
    ...)`` with q'_i = beta_i n(q_i); in PyTorch ``softmax(beta *
    F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).mT + bias) @ v``.
    The other arguments act on s_it exactly as in dot_attention (softcap,
    then bias and ALiBi; masks, causal, window, packed sequences; sinks;
    dropout after the softmax).

    Parameters
    ----------
    query : array_like, (..., Hq) or (..., Tq, Hq)
        Several queries when ``query.ndim == keys.ndim``; Hq = H.
    keys : array_like, (..., T, H)
    sharpness : None, float or array_like, optional
        beta: None is 1; a Python number must be finite; an array
        broadcasts to out.shape[:-1], one beta per query position.
    mask, attn_mask, causal, bias, dropout, seed, values, return_weights, \
window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k
        As for dot_attention.

    Returns
    -------
    out : ndarray, (..., Hv) or (..., Tq, Hv)
    alpha or lse : ndarray
        alpha (..., [Tq,] T), or with return_weights=False lse (..., [Tq]).
    """
    ranges = dict(mask=mask, attn_mask=attn_mask, causal=causal, bias=bias,
                  window=window, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k)
    q1, nk, vals, _, _, _ = _cosine_parts(query, keys, values, sharpness,
                                          **ranges)
    return dot_attention(q1, nk, dropout=dropout, seed=seed, values=vals,
                         scale=1.0, return_weights=return_weights,
                         softcap=softcap, alibi_slopes=alibi_slopes,
                         sinks=sinks, **ranges)


def cosine_attention_backward(grad_out, query, keys, alpha=None, *,
                              out=None, lse=None, mask=None, attn_mask=None,
                              causal=False, bias=None, dropout=0.0,
                              seed=None, values=None, sharpness=None,
                              grad_alpha=None, window=None, softcap=None,
                              alibi_slopes=None, sinks=None,
                              cu_seqlens_q=None, cu_seqlens_k=None):
    """The gradients of cosine_attention: (dquery, dkeys, dvalues,
    dsharpness, dbias, dalibi_slopes, dsinks).

    The dot backward (from alpha, or from out= and lse=) gives dq'_i and
    dk'_t, the gradients of q'_i = beta_i n(q_i) and k'_t = n(k_t) (with
    delta_it = dL/ds_it: dq'_i = sum_t delta_it n(k_t), dk'_t = sum_i
    delta_it q'_i); then::

        dbeta_i = dq'_i . n(q_i)  = sum_t delta_it n(q_i) . n(k_t)
        dq_i    = n_backward(beta_i dq'_i, q_i)
        dk_t    = n_backward(dk'_t, k_t)   (+ dval_t when the values are
                                            the keys)

    with n_backward of normalize_backward.  Every gradient is summed back
    over the axes its input was broadcast along.

    Parameters
    ----------
    grad_out, query, keys, alpha, out, lse, grad_alpha, ...
        As for dot_attention_backward (no scale); sharpness as for
        cosine_attention.

    Returns
    -------
    tuple
        (dquery, dkeys, dvalues, dsharpness, dbias, dalibi_slopes, dsinks):
        dvalues is None when values is (dkeys holds that gradient too);
        dsharpness is None unless sharpness is an array, then it has its
        shape; the last three as in dot_attention_backward.
    """
    ranges = dict(mask=mask, attn_mask=attn_mask, causal=causal, bias=bias,
                  window=window, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k)
    q1, nk, vals, beta, query, keys = _cosine_parts(
        query, keys, values, sharpness, **ranges)
    dq1, dnk, dvals, *extras = dot_attention_backward(
        grad_out, q1, nk, alpha, out=out, lse=lse, dropout=dropout,
        seed=seed, values=vals, scale=1.0, grad_alpha=grad_alpha,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, **ranges)
    nq, _ = normalize(query)
    dbeta = None
    if sharpness is not None and not _is_number(sharpness):
        # (np.asarray: a 0-d sharpness gets a 0-d array, not a scalar)
        dbeta = np.asarray(_sum_to((dq1 * nq).sum(axis=-1),
                                   np.shape(sharpness)))
    dq = _sum_to(normalize_backward(beta[..., None] * dq1, query),
                 query.shape)
    dk = normalize_backward(_sum_to(dnk, keys.shape), keys)
    if values is None:                  # the raw keys were the values too
        dk, dvals = dk + dvals, None
    return (dq, dk, dvals, dbeta, *extras)
