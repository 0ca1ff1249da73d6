"""The attention family in plain NumPy: a query against keys, three
scores, values (docs/contract.md sections 4 and 5).

    query  (..., Hq) one per sequence, or (..., Tq, Hq) several
           (several when query.ndim == keys.ndim)
    keys   (..., T, H);  values (..., T, Hv), by default the keys

    additive  s_it = v . tanh(W_k k_t + W_q q_i + b)    W = [W_k | W_q]
    dot       s_it = scale q_i . k_t (+ bias_it)        scale = 1/sqrt(H)
    general   s_it = q_i . (W_a k_t) (+ bias_it)        W_a (Hq, H)

    alpha_i = softmax of s_i over the keys visible to query i
    out_i   = sum_t alpha_it keep_it / (1 - p) val_t    (p = dropout)

Which keys query i sees, and how padding is kept out of every sum, is in
:mod:`.masks`; the keep bits of the dropout in :mod:`.dropout`.

Leading axes (...) of every input broadcast by NumPy rules: the result
has the broadcast leading shape, and the gradient of a broadcast input is
summed back to its shape (_sum_to).  A query with no visible key has
out = 0, alpha = 0, lse = -inf and zero gradients.

Every function below works on several queries; one query per sequence is
the case Tq = 1 with that axis added on the way in and removed on the way
out.
"""

import numpy as np

from ._shapes import _rows, _sum_to
from .dropout import _check_dropout, _dropout_factor
from .masks import (_drop_padding, _exp, _layout, _softmax,
                    _visible_matmul)
from .variants import (_check_softcap, _relative_positions, alibi_term,
                       per_sequence, softcap_scores)


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


def _dot_scores(q, keys, scale, bias, softcap=None, alibi=None):
    """s (..., Tq, T) = softcap(scale q_i . k_t) + bias_it + alibi_it (bias
    in the scores' dtype, so a float64 bias does not promote float32
    scores).  Soft-capping comes first, as Gemma 2 has it."""
    s = softcap_scores(scale * (q @ keys.swapaxes(-1, -2)), softcap)
    with np.errstate(invalid="ignore"):                # -inf + inf: masked
        if bias is not None:
            s = s + bias.astype(s.dtype, copy=False)
        if alibi is not None:
            s = s + alibi.astype(s.dtype, copy=False)
    return s


def _variants(vis, softcap, alibi_slopes, sinks, cu_seqlens_q,
              cu_seqlens_k):
    """The checked softcap, the ALiBi term (lead, Tq, T) or None, and the
    sinks (lead) or None (.variants); ``vis`` gives the shapes."""
    lead, (Tq, T) = vis.shape[:-2], vis.shape[-2:]
    softcap = _check_softcap(softcap)
    slopes = per_sequence("alibi_slopes", alibi_slopes, lead)
    alibi = None
    if slopes is not None:
        _, rel = _relative_positions(Tq, T, cu_seqlens_q, cu_seqlens_k)
        alibi = alibi_term(slopes, rel)
    return softcap, alibi, per_sequence("sinks", sinks, lead)


def dot_attention(query, keys, *, mask=None, attn_mask=None, causal=False,
                  bias=None, dropout=0.0, seed=None, values=None, scale=None,
                  return_weights=True, window=None, softcap=None,
                  alibi_slopes=None, sinks=None, cu_seqlens_q=None,
                  cu_seqlens_k=None):
    """s_it = softcap(scale q_i . k_t) + bias_it - slope abs(i' - t), scale
    None = 1/sqrt(H).

    Returns (out, alpha), or (out, lse) with return_weights=False, lse_i =
    log(exp(sink) + sum_t exp(s_it)) over the visible keys (no sink: 0
    in place of exp(sink)).  alpha is before dropout.
    """
    keys = np.asarray(keys)
    vals = keys if values is None else np.asarray(values)
    scale = _default_scale(keys) if scale is None else scale
    q, single, vis, bias = _layout(query, keys, values, mask, attn_mask,
                                   causal, bias, window, cu_seqlens_q,
                                   cu_seqlens_k)
    Tq, T = vis.shape[-2:]
    _check_dropout(dropout, seed, Tq, T)
    softcap, alibi, sink = _variants(vis, softcap, alibi_slopes, sinks,
                                     cu_seqlens_q, cu_seqlens_k)
    q = _drop_padding(q, vis.any(axis=-1))             # queries seeing none
    keys, vals = (_drop_padding(x, vis.any(axis=-2)) for x in (keys, vals))
    s = _dot_scores(q, keys, scale, bias, softcap, alibi)
    alpha, lse = _softmax(s, vis, sink)
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
    dval_t = sum_i alpha_it keep_it/(1-p) g_i.  ``alpha`` is P of
    docs/contract.md 5.4 when recomputed from lse (then D_i = g_i . out_i
    is given).
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


def _saved(alpha, out, lse, grad_alpha, sinks=None):
    """Check the backward's choice between alpha and (out=, lse=)."""
    if alpha is not None and (lse is not None or out is not None):
        raise ValueError("give either alpha or out= and lse= (from a "
                         "return_weights=False forward), not both")
    if alpha is not None and sinks is not None:
        raise ValueError("sinks needs out= and lse= (a return_weights="
                         "False forward): alpha alone loses the sink's "
                         "share")
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
                           scale=None, grad_alpha=None, window=None,
                           softcap=None, alibi_slopes=None, sinks=None,
                           cu_seqlens_q=None, cu_seqlens_k=None):
    """(dquery, dkeys, dvalues, dbias, dalibi_slopes, dsinks) of
    dot_attention (contract 5.4, 8).

    From alpha as in section 4, or from out= and lse=: P_it = exp(s_it -
    lse_i) on the visible keys and D_i = g_i . out_i.  dvalues is None when
    values is None (the keys take that gradient); dbias, dalibi_slopes and
    dsinks are None when their input is, else summed to its shape.
    """
    keys = np.asarray(keys)
    vals = keys if values is None else np.asarray(values)
    scale = _default_scale(keys) if scale is None else scale
    q, single, vis, b = _layout(query, keys, values, mask, attn_mask,
                                causal, bias, window, cu_seqlens_q,
                                cu_seqlens_k)
    Tq, T = vis.shape[-2:]
    _check_dropout(dropout, seed, Tq, T)
    _saved(alpha, out, lse, grad_alpha, sinks)
    softcap, alibi, sink = _variants(vis, softcap, alibi_slopes, sinks,
                                     cu_seqlens_q, cu_seqlens_k)
    g, a, ga = _add_query_axis(single, grad_out, alpha, grad_alpha)
    # rows nobody sees are zeroed: a query with no visible key gets no
    # gradient at all (its g may be NaN), and padding reaches nothing
    live_q, live_k = vis.any(axis=-1), vis.any(axis=-2)
    q, g = _drop_padding(q, live_q), _drop_padding(g, live_q)
    keys, vals = (_drop_padding(x, live_k) for x in (keys, vals))
    # the capped scores, before bias and ALiBi: softcap's derivative
    capped = softcap_scores(scale * (q @ keys.swapaxes(-1, -2)), softcap)
    D = ls = None
    if a is None:
        o, ls = np.asarray(out), np.asarray(lse)
        if single:
            o, ls = o[..., None, :], ls[..., None]
        ls = np.where(np.isfinite(ls), ls, 0)[..., None]  # -inf: no key seen
        s = _dot_scores(q, keys, scale, b, softcap, alibi)
        # exp only where visible: a hidden key's s - lse may overflow
        a = _exp(np.where(vis, s - ls, -np.inf))
        D = np.where(live_q, (g * o).sum(axis=-1), 0)
    drop = _dropout_factor(dropout, seed, vis.shape[:-2], Tq, T,
                           np.result_type(a, g))
    # (drop and D by keyword, only when there: the bare 5-argument call is
    # the one tests patch)
    extra = {n: x for n, x in (("drop", drop), ("D", D)) if x is not None}
    delta, dvals = _attend_backward(g, a, vis, vals, ga, **extra)
    dbias = dslopes = dsinks = None
    if bias is not None:
        dbias = _sum_to(delta[..., 0, :] if single else delta,
                        np.shape(bias))
    if alibi is not None:               # s += -m |rel|: dm = -sum |rel| d
        _, rel = _relative_positions(Tq, T, cu_seqlens_q, cu_seqlens_k)
        dslopes = _sum_to(-(delta * np.abs(rel)).sum(axis=(-2, -1)),
                          np.shape(alibi_slopes))
    if sink is not None:                # dsink = -sum_i P_i,sink D_i
        p_sink = _exp(sink[..., None] - ls[..., 0])
        dsinks = _sum_to(-(p_sink * D).sum(axis=-1), np.shape(sinks))
    if softcap is not None:             # d(c tanh(x/c))/dx = 1 - (./c)^2
        delta = delta * (1 - (capped / softcap) ** 2)
    dq = scale * _visible_matmul(delta, vis, keys)     # scale sum_t d_it k_t
    dk = scale * _visible_matmul(delta.swapaxes(-1, -2),
                                 vis.swapaxes(-1, -2), q)
    dq, dk = _sum_to(dq, q.shape), _sum_to(dk, keys.shape)
    dvals = _sum_to(dvals, vals.shape)
    return (_family_grads(single, dq, dk, dvals, values is None)
            + (dbias, dslopes, dsinks))


def general_attention(query, keys, W, *, mask=None, attn_mask=None,
                      causal=False, bias=None, dropout=0.0, seed=None,
                      values=None, key_proj=None, return_weights=True,
                      window=None, softcap=None, alibi_slopes=None,
                      sinks=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """s_it = q_i . (W_a k_t) + bias_it, W_a = W (Hq, H): the dot score
    with scale 1 on the projected keys, with its variants (window,
    softcap, alibi_slopes, sinks, cu_seqlens_q/k).  Returns as
    dot_attention."""
    keys = np.asarray(keys)
    vals = keys if values is None else values
    if key_proj is None:                # padding dropped before W_a
        _, _, vis, _ = _layout(query, keys, values, mask, attn_mask, causal,
                               bias, window, cu_seqlens_q, cu_seqlens_k)
        keys = _drop_padding(keys, vis.any(axis=-2))
    kp = project_keys(keys, W) if key_proj is None else np.asarray(key_proj)
    return dot_attention(query, kp, mask=mask, attn_mask=attn_mask,
                         causal=causal, bias=bias, dropout=dropout,
                         seed=seed, values=vals, scale=1.0,
                         return_weights=return_weights, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes,
                         sinks=sinks, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k)


def general_attention_backward(grad_out, query, keys, W, alpha=None, *,
                               out=None, lse=None, mask=None, attn_mask=None,
                               causal=False, bias=None, dropout=0.0,
                               seed=None, values=None, grad_alpha=None,
                               key_proj=None, window=None, softcap=None,
                               alibi_slopes=None, sinks=None,
                               cu_seqlens_q=None, cu_seqlens_k=None):
    """(dquery, dkeys, dvalues, dW, dbias, dalibi_slopes, dsinks) of
    general_attention."""
    keys, W = np.asarray(keys), np.asarray(W)
    vals = keys if values is None else values
    _, _, vis, _ = _layout(query, keys, values, mask, attn_mask, causal,
                           bias, window, cu_seqlens_q, cu_seqlens_k)
    live_keys = _drop_padding(keys, vis.any(axis=-2))
    kp = (project_keys(live_keys, W) if key_proj is None
          else np.asarray(key_proj))
    dq, dkp, dvals, dbias, dslopes, dsinks = dot_attention_backward(
        grad_out, query, kp, alpha, out=out, lse=lse, mask=mask,
        attn_mask=attn_mask, causal=causal, bias=bias, dropout=dropout,
        seed=seed, values=vals, scale=1.0, grad_alpha=grad_alpha,
        window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    # k_t -> W_a k_t:  dk_t = W_a^T dkp_t,  dW_a = sum_t dkp_t k_t^T
    dk, dW = project_keys_backward(dkp, live_keys, W)
    if values is None:
        dk, dvals = dk + dvals, None
    return dq, dk, dvals, dW, dbias, dslopes, dsinks


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
