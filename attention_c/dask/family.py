"""The attention family on Dask arrays: the additive, dot and general
scores, and the keys' projection."""

from __future__ import annotations

from typing import Any, Literal, overload

import dask.array as da
import numpy as np

import attention_c as _ac
from attention_c._keywords import keyword_only

from ._graph import _apply
from ._types import (AdditiveAttentionGrads, DotAttentionGrads,
                     GeneralAttentionGrads, _Input)

__all__ = ["additive_attention", "additive_attention_backward",
           "dot_attention", "dot_attention_backward", "general_attention",
           "general_attention_backward", "project_keys",
           "project_keys_backward"]


def _family_cores(query: _Input, keys: _Input) -> dict[str, int]:
    """The non-batch axes of each family argument: one query per sequence
    when ``query`` has fewer axes than ``keys`` (as the C functions read
    it), else (..., Tq, .)."""
    single = _ndim(query) < _ndim(keys)
    q = 1 if single else 2
    return {"query": q, "keys": 2, "values": 2, "key_proj": 2, "mask": 1,
            "attn_mask": 2, "bias": q, "alpha": q, "grad_alpha": q,
            "out": q, "grad_out": q, "lse": q - 1,
            # the cosine score's sharpness: one value per query, like lse
            "sharpness": q - 1,
            # one value per sequence: every axis is a batch axis
            "alibi_slopes": 0, "sinks": 0}


# Where each field of a gradient tuple is laid out (see _graph._apply):
# like the input it is the gradient of (summed over the chunks along which
# that input is shared), or, for a parameter, summed over every chunk.
_FOLLOWS = {"query": "query", "keys": "keys", "values": "values",
            "bias": "bias", "alibi_slopes": "alibi_slopes",
            "sinks": "sinks", "key_proj": "key_proj",
            "sharpness": "sharpness"}


def _follows(fields: tuple[str, ...]) -> tuple[str | None, ...]:
    return tuple(_FOLLOWS.get(f) for f in fields)


def _variants(window: tuple[int | None, int | None] | None,
              softcap: float | None, alibi_slopes: _Input | None,
              sinks: _Input | None, cu_seqlens_q: _Input | None,
              cu_seqlens_k: _Input | None
              ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The variants (docs/contract.md section 8) as the batched arguments
    (the slopes and sinks, one value per sequence, split like the batch),
    the shared ones (the packed sequences' offsets, whole in every chunk)
    and the literals, each only when given (so that a call without them
    is the call of before)."""
    data = {n: x for n, x in (("alibi_slopes", alibi_slopes),
                              ("sinks", sinks)) if x is not None}
    shared = {n: x for n, x in (("cu_seqlens_q", cu_seqlens_q),
                                ("cu_seqlens_k", cu_seqlens_k))
              if x is not None}
    literals = {n: x for n, x in (("window", window), ("softcap", softcap))
                if x is not None}
    return data, shared, literals


def _ndim(x: _Input) -> int:
    """The axes of a Dask array or an array-like, computing nothing."""
    n = getattr(x, "ndim", None)
    return int(n) if n is not None else np.ndim(x)


@keyword_only
def additive_attention(query: _Input, keys: _Input, W: _Input, v: _Input, *,
                       b: _Input | None = None, mask: _Input | None = None,
                       attn_mask: _Input | None = None, causal: bool = False,
                       values: _Input | None = None,
                       key_proj: _Input | None = None
                       ) -> tuple[da.Array, da.Array]:
    """:func:`attention_c.additive_attention` chunk by chunk of the batch.

    Parameters
    ----------
    query : dask.array.Array or array_like (B, ..., Hq) or (B, ..., Tq, Hq)
    keys : dask.array.Array or array_like (B, ..., T, H)
        Chunked along the leading (batch) axes; the other batched
        arguments are rechunked to its chunks.
    W : array_like (A, H + Hq)
    v : array_like (A,)
    b : array_like (A,), optional
    mask, attn_mask, causal
        As in memory (see :func:`dot_attention`).
    values : dask.array.Array or array_like (B, ..., T, Hv), optional
    key_proj : dask.array.Array or array_like (B, ..., T, A), optional
        ``project_keys(keys, W)``.

    Returns
    -------
    out : dask.array.Array (B, ..., Hv) or (B, ..., Tq, Hv)
    alpha : dask.array.Array (B, ..., T) or (B, ..., Tq, T)

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((10, 7, 4)),
    ...                      chunks=(5, -1, -1))
    >>> query = rng.standard_normal((10, 3))           # split like keys
    >>> W = rng.standard_normal((5, 4 + 3)); v = rng.standard_normal(5)
    >>> out, alpha = acd.additive_attention(query, keys, W, v)
    >>> out.chunks, alpha.compute().shape
    (((5, 5), (4,)), (10, 7))
    """
    out, alpha = _apply(
        _ac.additive_attention, "keys",
        {"query": query, "keys": keys, "mask": mask, "attn_mask": attn_mask,
         "values": values, "key_proj": key_proj}, {"W": W, "v": v, "b": b},
        {"causal": causal}, ("out", "alpha"), ("", ""),
        _family_cores(query, keys))
    return out, alpha


@overload
def additive_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input, v: _Input,
        alpha: _Input, *, b: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        values: _Input | None = None, grad_alpha: _Input | None = None,
        key_proj: _Input | None = None,
        stop_at_key_proj: Literal[False] = False
) -> AdditiveAttentionGrads: ...


@overload
def additive_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input, v: _Input,
        alpha: _Input, *, b: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        values: _Input | None = None, grad_alpha: _Input | None = None,
        key_proj: _Input | None = None,
        stop_at_key_proj: Literal[True]
) -> tuple[AdditiveAttentionGrads, da.Array]: ...


@overload
def additive_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input, v: _Input,
        alpha: _Input, *, b: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        values: _Input | None = None, grad_alpha: _Input | None = None,
        key_proj: _Input | None = None, stop_at_key_proj: bool = ...
) -> AdditiveAttentionGrads | tuple[AdditiveAttentionGrads, da.Array]: ...


@keyword_only
def additive_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input, v: _Input,
        alpha: _Input, *, b: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        values: _Input | None = None, grad_alpha: _Input | None = None,
        key_proj: _Input | None = None, stop_at_key_proj: bool = False
) -> AdditiveAttentionGrads | tuple[AdditiveAttentionGrads, da.Array]:
    """:func:`attention_c.additive_attention_backward` chunk by chunk.

    Parameters
    ----------
    grad_out : dask.array.Array or array_like, the shape of ``out``
    query, keys, W, v, b, mask, attn_mask, causal, values, key_proj
        As given to :func:`additive_attention`.
    alpha : dask.array.Array or array_like, the forward's ``alpha``
    grad_alpha : dask.array.Array or array_like, optional
    stop_at_key_proj : bool, optional
        With ``key_proj``: also return ``grad_key_proj``, as in memory.

    Returns
    -------
    AdditiveAttentionGrads
        ``query``, ``keys``, ``values`` chunked like the batch; ``W``,
        ``v``, ``b`` summed over the chunks by a tree of fixed shape.
    grad_key_proj : dask.array.Array (B, ..., T, A)
        Only with ``stop_at_key_proj=True``.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((10, 7, 4)),
    ...                      chunks=(5, -1, -1))
    >>> query = rng.standard_normal((10, 3))
    >>> W = rng.standard_normal((5, 7)); v = rng.standard_normal(5)
    >>> out, alpha = acd.additive_attention(query, keys, W, v)
    >>> g = acd.additive_attention_backward(da.ones_like(out), query, keys,
    ...                                     W, v, alpha)
    >>> g.query.chunks, g.W.shape, g.values
    (((5, 5), (3,)), (5, 7), None)
    """
    outs = _apply(_ac.additive_attention_backward, "keys",
                  {"grad_out": grad_out, "query": query, "keys": keys,
                   "alpha": alpha, "mask": mask, "attn_mask": attn_mask,
                   "values": values, "grad_alpha": grad_alpha,
                   "key_proj": key_proj},
                  {"W": W, "v": v, "b": b},
                  {"causal": causal, "stop_at_key_proj": stop_at_key_proj},
                  (*AdditiveAttentionGrads._fields, "grad_key_proj"),
                  ("query", "keys", "values", None, None, None, "key_proj"),
                  _family_cores(query, keys))
    grads = AdditiveAttentionGrads(*outs[:6])
    if len(outs) > 6:
        return grads, outs[6]
    return grads


@keyword_only
def dot_attention(query: _Input, keys: _Input, *,
                  mask: _Input | None = None,
                  attn_mask: _Input | None = None, causal: bool = False,
                  bias: _Input | None = None, dropout: float = 0.0,
                  seed: int | None = None, values: _Input | None = None,
                  scale: float | None = None, return_weights: bool = True,
                  window: tuple[int | None, int | None] | None = None,
                  softcap: float | None = None,
                  alibi_slopes: _Input | None = None,
                  sinks: _Input | None = None,
                  cu_seqlens_q: _Input | None = None,
                  cu_seqlens_k: _Input | None = None
                  ) -> tuple[da.Array, da.Array]:
    """:func:`attention_c.dot_attention` chunk by chunk of the batch.

    Parameters
    ----------
    query : dask.array.Array or array_like (B, ..., H) or (B, ..., Tq, H)
    keys : dask.array.Array or array_like (B, ..., T, H)
        Chunked along the leading (batch) axes.
    mask : dask.array.Array or array_like of bool (B, ..., T), optional
        The key mask, shared by every query; leading axes of size 1 (or
        missing) broadcast.
    attn_mask : dask.array.Array or array_like of bool, optional
        Broadcastable to (B, ..., Tq, T): chunked like the batch along the
        batch axes it has, given whole to every chunk when it has none
        (e.g. ``np.tril(np.ones((Tq, T), bool))``, one graph key).
    causal : bool, optional
        Key t visible to query i iff ``t <= i + (T - Tq)``.
    bias : dask.array.Array or array_like, optional
        Float, broadcastable to (B, ..., Tq, T) (to (B, ..., T) with one
        query); split like ``attn_mask``.
    dropout : float, optional
        p in [0, 1).  The keep bits of sequence b are drawn from its flat
        index b in the whole batch, and the in-memory functions take no
        offset at which a chunk would start: with ``dropout > 0`` the
        batch is computed in one chunk (a ``PerformanceWarning`` says so
        when it was split), which gives the bits of the in-memory call.
    seed : int, optional
        Required when ``dropout > 0``.
    values : dask.array.Array or array_like (B, ..., T, Hv), optional
    scale : float, optional
        Default ``1/sqrt(H)``.
    return_weights : bool, optional
        False: return ``(out, lse)`` instead of ``(out, alpha)``.
    window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k
        The variants of docs/contract.md section 8, as in memory.
        ``alibi_slopes`` and ``sinks`` (one value per sequence, dask or
        NumPy arrays) are split like the batch along the batch axes they
        have and given whole along those they broadcast on.  The packed
        sequences' offsets go whole to every chunk; the Tq and T axes are
        never split (a chunked one is rechunked whole, with a
        ``PerformanceWarning``), so no sequence is ever cut.

    Returns
    -------
    out : dask.array.Array (B, ..., Hv) or (B, ..., Tq, Hv)
    alpha : dask.array.Array (B, ..., T) or (B, ..., Tq, T)
        Or ``lse`` (B, ...) or (B, ..., Tq) with ``return_weights=False``.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> x = da.from_array(np.random.default_rng(0).standard_normal(
    ...     (8, 6, 4)), chunks=(2, 6, 4))
    >>> out, alpha = acd.dot_attention(x, x, causal=True)
    >>> out.numblocks, float(alpha[0, 0, 1].compute())
    ((4, 1, 1), 0.0)
    >>> out, lse = acd.dot_attention(x, x, causal=True, return_weights=False)
    >>> lse.shape
    (8, 6)
    """
    vdata, vshared, vlit = _variants(window, softcap, alibi_slopes, sinks,
                                     cu_seqlens_q, cu_seqlens_k)
    out, w = _apply(
        _ac.dot_attention, "keys",
        {"query": query, "keys": keys, "mask": mask, "attn_mask": attn_mask,
         "bias": bias, "values": values, **vdata}, vshared,
        {"causal": causal, "dropout": dropout, "seed": seed, "scale": scale,
         "return_weights": return_weights, **vlit},
        ("out", "alpha" if return_weights else "lse"), ("", ""),
        _family_cores(query, keys))
    return out, w


@keyword_only
def dot_attention_backward(grad_out: _Input, query: _Input, keys: _Input,
                           alpha: _Input | None = None, *,
                           out: _Input | None = None,
                           lse: _Input | None = None,
                           mask: _Input | None = None,
                           attn_mask: _Input | None = None,
                           causal: bool = False, bias: _Input | None = None,
                           dropout: float = 0.0, seed: int | None = None,
                           values: _Input | None = None,
                           scale: float | None = None,
                           grad_alpha: _Input | None = None,
                           window: tuple[int | None, int | None] | None
                           = None,
                           softcap: float | None = None,
                           alibi_slopes: _Input | None = None,
                           sinks: _Input | None = None,
                           cu_seqlens_q: _Input | None = None,
                           cu_seqlens_k: _Input | None = None
                           ) -> DotAttentionGrads:
    """:func:`attention_c.dot_attention_backward` chunk by chunk.

    Parameters
    ----------
    grad_out : dask.array.Array or array_like, the shape of ``out``
    query, keys, mask, attn_mask, causal, bias, dropout, seed, values, scale
        As given to :func:`dot_attention`.
    alpha : dask.array.Array or array_like, optional
        The forward's ``alpha``; or give ``out=`` and ``lse=``.
    out, lse : dask.array.Array or array_like, optional
        From a ``return_weights=False`` forward.
    grad_alpha : dask.array.Array or array_like, optional
        Only with ``alpha``.
    window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k
        As given to :func:`dot_attention` (with ``sinks``: ``out=`` and
        ``lse=``, not ``alpha``).

    Returns
    -------
    DotAttentionGrads
        ``query``, ``keys``, ``values`` (None when not given), chunked
        like the batch; ``bias``, ``alibi_slopes`` and ``sinks`` (None
        when not given) of the shape given, summed over the chunks along
        which it is shared by a tree of fixed shape.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> x = da.from_array(np.random.default_rng(0).standard_normal(
    ...     (8, 6, 4)), chunks=(2, 6, 4))
    >>> bias = np.zeros((6, 6))                         # shared: one key
    >>> out, lse = acd.dot_attention(x, x, bias=bias, return_weights=False)
    >>> g = acd.dot_attention_backward(da.ones_like(out), x, x, out=out,
    ...                                lse=lse, bias=bias)
    >>> g.keys.chunks[0], g.values, g.bias.shape, g.bias.numblocks
    ((2, 2, 2, 2), None, (6, 6), (1, 1))
    """
    vdata, vshared, vlit = _variants(window, softcap, alibi_slopes, sinks,
                                     cu_seqlens_q, cu_seqlens_k)
    return DotAttentionGrads(*_apply(
        _ac.dot_attention_backward, "keys",
        {"grad_out": grad_out, "query": query, "keys": keys, "alpha": alpha,
         "out": out, "lse": lse, "mask": mask, "attn_mask": attn_mask,
         "bias": bias, "values": values, "grad_alpha": grad_alpha,
         **vdata}, vshared,
        {"causal": causal, "dropout": dropout, "seed": seed, "scale": scale,
         **vlit},
        DotAttentionGrads._fields, _follows(DotAttentionGrads._fields),
        _family_cores(query, keys)))


@keyword_only
def general_attention(query: _Input, keys: _Input, W: _Input, *,
                      mask: _Input | None = None,
                      attn_mask: _Input | None = None, causal: bool = False,
                      bias: _Input | None = None, dropout: float = 0.0,
                      seed: int | None = None, values: _Input | None = None,
                      key_proj: _Input | None = None,
                      return_weights: bool = True,
                      window: tuple[int | None, int | None] | None = None,
                      softcap: float | None = None,
                      alibi_slopes: _Input | None = None,
                      sinks: _Input | None = None,
                      cu_seqlens_q: _Input | None = None,
                      cu_seqlens_k: _Input | None = None
                      ) -> tuple[da.Array, da.Array]:
    """:func:`attention_c.general_attention` chunk by chunk of the batch.

    Parameters
    ----------
    query : dask.array.Array or array_like (B, ..., Hq) or (B, ..., Tq, Hq)
    keys : dask.array.Array or array_like (B, ..., T, H)
        Chunked along the leading (batch) axes.
    W : array_like (Hq, H)
    mask, attn_mask, causal, bias, dropout, seed, return_weights
        As in :func:`dot_attention` (``dropout > 0``: one chunk).
    values : dask.array.Array or array_like (B, ..., T, Hv), optional
    key_proj : dask.array.Array or array_like (B, ..., T, Hq), optional
    window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k
        As in :func:`dot_attention`.

    Returns
    -------
    out : dask.array.Array (B, ..., Hv) or (B, ..., Tq, Hv)
    alpha : dask.array.Array (B, ..., T) or (B, ..., Tq, T)
        Or ``lse`` with ``return_weights=False``.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((6, 7, 4)),
    ...                      chunks=(3, -1, -1))
    >>> query = da.from_array(rng.standard_normal((6, 2, 3)),
    ...                       chunks=(3, -1, -1))
    >>> out, alpha = acd.general_attention(query, keys,
    ...                                    rng.standard_normal((3, 4)))
    >>> out.shape, alpha.numblocks
    ((6, 2, 4), (2, 1, 1))
    """
    vdata, vshared, vlit = _variants(window, softcap, alibi_slopes, sinks,
                                     cu_seqlens_q, cu_seqlens_k)
    out, w = _apply(
        _ac.general_attention, "keys",
        {"query": query, "keys": keys, "mask": mask, "attn_mask": attn_mask,
         "bias": bias, "values": values, "key_proj": key_proj, **vdata},
        {"W": W, **vshared},
        {"causal": causal, "dropout": dropout, "seed": seed,
         "return_weights": return_weights, **vlit},
        ("out", "alpha" if return_weights else "lse"), ("", ""),
        _family_cores(query, keys))
    return out, w


@overload
def general_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input,
        alpha: _Input | None = None, *, out: _Input | None = None,
        lse: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        bias: _Input | None = None, dropout: float = 0.0,
        seed: int | None = None, values: _Input | None = None,
        grad_alpha: _Input | None = None, key_proj: _Input | None = None,
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None, alibi_slopes: _Input | None = None,
        sinks: _Input | None = None, cu_seqlens_q: _Input | None = None,
        cu_seqlens_k: _Input | None = None,
        stop_at_key_proj: Literal[False] = False
) -> GeneralAttentionGrads: ...


@overload
def general_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input,
        alpha: _Input | None = None, *, out: _Input | None = None,
        lse: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        bias: _Input | None = None, dropout: float = 0.0,
        seed: int | None = None, values: _Input | None = None,
        grad_alpha: _Input | None = None, key_proj: _Input | None = None,
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None, alibi_slopes: _Input | None = None,
        sinks: _Input | None = None, cu_seqlens_q: _Input | None = None,
        cu_seqlens_k: _Input | None = None,
        stop_at_key_proj: Literal[True]
) -> tuple[GeneralAttentionGrads, da.Array]: ...


@overload
def general_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input,
        alpha: _Input | None = None, *, out: _Input | None = None,
        lse: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        bias: _Input | None = None, dropout: float = 0.0,
        seed: int | None = None, values: _Input | None = None,
        grad_alpha: _Input | None = None, key_proj: _Input | None = None,
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None, alibi_slopes: _Input | None = None,
        sinks: _Input | None = None, cu_seqlens_q: _Input | None = None,
        cu_seqlens_k: _Input | None = None,
        stop_at_key_proj: bool = ...
) -> GeneralAttentionGrads | tuple[GeneralAttentionGrads, da.Array]: ...


@keyword_only
def general_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input,
        alpha: _Input | None = None, *, out: _Input | None = None,
        lse: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        bias: _Input | None = None, dropout: float = 0.0,
        seed: int | None = None, values: _Input | None = None,
        grad_alpha: _Input | None = None, key_proj: _Input | None = None,
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None, alibi_slopes: _Input | None = None,
        sinks: _Input | None = None, cu_seqlens_q: _Input | None = None,
        cu_seqlens_k: _Input | None = None,
        stop_at_key_proj: bool = False
) -> GeneralAttentionGrads | tuple[GeneralAttentionGrads, da.Array]:
    """:func:`attention_c.general_attention_backward` chunk by chunk.

    Parameters
    ----------
    grad_out : dask.array.Array or array_like, the shape of ``out``
    query, keys, W, mask, attn_mask, causal, bias, dropout, seed, values, \
key_proj
        As given to :func:`general_attention`.
    alpha : dask.array.Array or array_like, optional
        The forward's ``alpha``; or give ``out=`` and ``lse=``.
    out, lse : dask.array.Array or array_like, optional
        From a ``return_weights=False`` forward.
    grad_alpha : dask.array.Array or array_like, optional
        Only with ``alpha``.
    window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k
        As given to :func:`general_attention` (with ``sinks``: ``out=``
        and ``lse=``, not ``alpha``).
    stop_at_key_proj : bool, optional
        With ``key_proj``: also return ``grad_key_proj``, as in memory.

    Returns
    -------
    GeneralAttentionGrads
        ``query``, ``keys``, ``values`` chunked like the batch; ``W``
        summed over the chunks by a tree of fixed shape; ``bias``,
        ``alibi_slopes`` and ``sinks`` (None when not given) of the shape
        given, summed over the chunks along which it is shared by the
        same tree.
    grad_key_proj : dask.array.Array (B, ..., T, Hq)
        Only with ``stop_at_key_proj=True``.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((6, 7, 4)),
    ...                      chunks=(3, -1, -1))
    >>> query = rng.standard_normal((6, 3)); W = rng.standard_normal((3, 4))
    >>> out, alpha = acd.general_attention(query, keys, W)
    >>> g = acd.general_attention_backward(da.ones_like(out), query, keys,
    ...                                    W, alpha)
    >>> g.W.compute().shape, g.bias
    ((3, 4), None)
    """
    vdata, vshared, vlit = _variants(window, softcap, alibi_slopes, sinks,
                                     cu_seqlens_q, cu_seqlens_k)
    fields = GeneralAttentionGrads._fields
    outs = _apply(_ac.general_attention_backward, "keys",
                  {"grad_out": grad_out, "query": query, "keys": keys,
                   "alpha": alpha, "out": out, "lse": lse, "mask": mask,
                   "attn_mask": attn_mask, "bias": bias, "values": values,
                   "grad_alpha": grad_alpha, "key_proj": key_proj, **vdata},
                  {"W": W, **vshared},
                  {"causal": causal, "dropout": dropout, "seed": seed,
                   "stop_at_key_proj": stop_at_key_proj, **vlit},
                  (*fields, "grad_key_proj"),
                  (*_follows(fields), "key_proj"),
                  _family_cores(query, keys))
    n = len(fields)
    grads = GeneralAttentionGrads(*outs[:n])
    if len(outs) > n:
        return grads, outs[n]
    return grads


def project_keys(keys: _Input, W: _Input) -> da.Array:
    """:func:`attention_c.project_keys` chunk by chunk of the batch.

    Parameters
    ----------
    keys : dask.array.Array or array_like (B, ..., T, H)
    W : array_like (P, L), L >= H

    Returns
    -------
    key_proj : dask.array.Array (B, ..., T, P)

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((6, 7, 4)),
    ...                      chunks=(3, -1, -1))
    >>> acd.project_keys(keys, rng.standard_normal((5, 7))).chunks
    ((3, 3), (7,), (5,))
    """
    key_proj: da.Array = _apply(_ac.project_keys, "keys", {"keys": keys},
                                {"W": W}, {}, ("key_proj",), ("keys",),
                                {"keys": 2})[0]
    return key_proj


def project_keys_backward(grad_proj: _Input, keys: _Input, W: _Input
                          ) -> tuple[da.Array, da.Array]:
    """:func:`attention_c.project_keys_backward` chunk by chunk.

    Parameters
    ----------
    grad_proj : dask.array.Array or array_like (B, ..., T, P)
    keys : dask.array.Array or array_like (B, ..., T, H)
    W : array_like (P, L)

    Returns
    -------
    dkeys : dask.array.Array (B, ..., T, H)
    dW : dask.array.Array (P, L)
        Summed over the chunks by a tree of fixed shape.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((6, 7, 4)),
    ...                      chunks=(3, -1, -1))
    >>> W = rng.standard_normal((5, 7))
    >>> kp = acd.project_keys(keys, W)
    >>> dkeys, dW = acd.project_keys_backward(da.ones_like(kp), keys, W)
    >>> dkeys.chunks[0], dW.shape
    ((3, 3), (5, 7))
    """
    dkeys, dW = _apply(_ac.project_keys_backward, "keys",
                       {"grad_proj": grad_proj, "keys": keys}, {"W": W}, {},
                       ("keys", "W"), ("keys", None),
                       {"grad_proj": 2, "keys": 2})
    return dkeys, dW
