"""Which keys a query of the attention family sees, and sums that
padding cannot reach (docs/contract.md section 5.1).

    mask       (..., T)       key mask, the same for every query
    attn_mask  -> (..., Tq, T) per query, broadcast by NumPy rules
    causal     key t visible to query i iff t <= i + (T - Tq)
    window, cu_seqlens_q/k   a range of keys per query (.variants)
    bias       -inf acts as a mask too

    visible_it = mask_t AND attn_mask_it AND range_it AND bias_it > -inf

A masked item never influences anything: rows that no (query, key) pair
sees are set to 0 before any product, a product keeps a NaN or inf of a
row only where it is visible, and the softmax runs over the visible keys.
"""

import numpy as np

from ._shapes import _sum_to
from .variants import key_ranges


def _queries(query, keys):
    """(query as (..., Tq, Hq), whether it was a single query): several
    queries (..., Tq, Hq) have as many axes as the keys (..., T, H), one
    query per sequence (..., Hq) fewer (its leading axes broadcast);
    more is refused (which one was meant is unclear)."""
    query, keys = np.asarray(query), np.asarray(keys)
    if query.ndim < 1 or query.ndim > keys.ndim:
        raise ValueError(f"query has shape {query.shape} and keys "
                         f"{keys.shape}: several queries (..., Tq, Hq) have "
                         f"as many axes as the keys, one query per "
                         f"sequence (..., Hq) fewer")
    single = query.ndim < keys.ndim
    return (query[..., None, :] if single else query), single


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


def _layout(query, keys, values, mask, attn_mask, causal, bias,
            window=None, cu_seqlens_q=None, cu_seqlens_k=None):
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
        given = "" if values is None else f" and values {np.shape(values)}"
        raise ValueError(
            f"the leading axes of query {np.shape(query)}, keys "
            f"{keys.shape}{given} do not broadcast"
            + (" (query read as one query per sequence: query.ndim != "
               "keys.ndim)" if single else "")
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

    ranged = {"attn_mask": attn_mask is not None, "causal": causal,
              "window": window is not None,
              "cu_seqlens_q": cu_seqlens_q is not None,
              "cu_seqlens_k": cu_seqlens_k is not None}
    if single and any(ranged.values()):
        name = next(n for n, given in ranged.items() if given)
        raise ValueError(f"{name} needs several queries (query (..., Tq, "
                         f"Hq)); with one query per sequence, mask (..., T) "
                         f"says it all")
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
    # causal, window, packing: a range of keys per query, bottom-right
    # aligned (the last query of a sequence sits at its last key)
    vis = vis & key_ranges(Tq, T, causal, window, cu_seqlens_q,
                           cu_seqlens_k)

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


def _exp(x):
    """exp(x), exactly 0 where it would be below the dtype's smallest
    normal number: no weight is ever a denormal (a score of finfo.min, as
    transformers' masks write, weighs exactly 0, and costs nothing)."""
    with np.errstate(under="ignore"):
        e = np.exp(x)
    return np.where(x < np.log(np.finfo(e.dtype).tiny), 0, e)


def _softmax(s, vis, sink=None):
    """(alpha, lse) of s (..., Tq, T) over the visible keys.

    Shifted by the largest visible score M, so exp never overflows;
    lse_i = M_i + log sum_t exp(s_it - M_i).  A query with no visible key
    gets alpha = 0 and lse = -inf (no 0/0, no log 0).  ``sink`` (...,),
    one logit a sequence, joins every denominator without a value:
    lse_i = log(exp(sink) + sum_t exp(s_it)), and a query with no visible
    key then has lse = sink.
    """
    seen = vis.any(axis=-1, keepdims=True)             # (..., Tq, 1)
    s = np.where(vis, s, -np.inf)
    M = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    if sink is not None:
        z = sink[..., None, None]
        M = np.maximum(M, z)
    M = np.where(~seen & (M == -np.inf), 0, M)         # nothing to shift by
    e = _exp(s - M)                                    # invisible: 0
    total = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + _exp(z - M)
    empty = total == 0                                 # nothing at all
    alpha = e / np.where(empty, 1, total)
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, M + np.log(total))[..., 0]
    return alpha, lse
