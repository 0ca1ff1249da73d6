"""The last scores of the family on Dask arrays: Luong's location score
and the content (cosine) score."""

from __future__ import annotations

from typing import Any

import dask.array as da

import attention_c as _ac
from attention_c._keywords import keyword_only

from ._graph import _apply
from ._types import CosineAttentionGrads, LocationAttentionGrads, _Input
from .family import _family_cores, _follows, _variants

__all__ = ["location_attention", "location_attention_backward",
           "cosine_attention", "cosine_attention_backward"]


def _sharpness(sharpness: _Input | float | None
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``sharpness`` as a batched argument (an array: split like the batch
    along the batch axes it has, its gradient summed back to its shape) or
    as a literal (a Python int or float, the binding's rule: a constant
    given to every chunk, without gradient), each only when given."""
    if sharpness is None:
        return {}, {}
    if isinstance(sharpness, (int, float)):
        return {}, {"sharpness": sharpness}
    return {"sharpness": sharpness}, {}


@keyword_only
def location_attention(query: _Input, values: _Input, W: _Input, *,
                       b: _Input | None = None, mask: _Input | None = None,
                       attn_mask: _Input | None = None
                       ) -> tuple[da.Array, da.Array]:
    """:func:`attention_c.location_attention` chunk by chunk of the batch.

    Parameters
    ----------
    query : dask.array.Array or array_like (B, ..., Hq) or (B, ..., Tq, Hq)
    values : dask.array.Array or array_like (B, ..., T, Hv)
        Chunked along the leading (batch) axes; the other batched
        arguments are rechunked to its chunks.
    W : array_like (T_max, Hq)
    b : array_like (T_max,), optional
        Weights: one graph key each, shared by every chunk.
    mask : dask.array.Array or array_like of bool (B, ..., T), optional
    attn_mask : dask.array.Array or array_like of bool, optional
        As in :func:`dot_attention`.

    Returns
    -------
    out : dask.array.Array (B, ..., Hv) or (B, ..., Tq, Hv)
    alpha : dask.array.Array (B, ..., T) or (B, ..., Tq, T)

    Examples
    --------
    >>> import numpy as np, dask.array as da
    >>> import attention_c as ac, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> enc = da.from_array(rng.standard_normal((10, 5, 4)),
    ...                     chunks=(4, -1, -1))     # T = 5 positions
    >>> state = rng.standard_normal((10, 6))       # split like enc
    >>> W, b = rng.standard_normal((9, 6)), np.zeros(9)   # T_max = 9
    >>> out, alpha = acd.location_attention(state, enc, W, b=b)
    >>> out.chunks, alpha.shape
    (((4, 4, 2), (4,)), (10, 5))
    >>> want = ac.location_attention(state, enc.compute(), W, b=b)[0]
    >>> bool((out.compute() == want).all())
    True
    """
    out, alpha = _apply(
        _ac.location_attention, "values",
        {"query": query, "values": values, "mask": mask,
         "attn_mask": attn_mask}, {"W": W, "b": b}, {}, ("out", "alpha"),
        ("", ""), _family_cores(query, values))
    return out, alpha


@keyword_only
def location_attention_backward(grad_out: _Input, query: _Input,
                                values: _Input, W: _Input, alpha: _Input, *,
                                b: _Input | None = None,
                                mask: _Input | None = None,
                                attn_mask: _Input | None = None,
                                grad_alpha: _Input | None = None
                                ) -> LocationAttentionGrads:
    """:func:`attention_c.location_attention_backward` chunk by chunk.

    Parameters
    ----------
    grad_out : dask.array.Array or array_like, the shape of ``out``
    query, values, W, b, mask, attn_mask
        As given to :func:`location_attention`.
    alpha : dask.array.Array or array_like, the forward's ``alpha``
    grad_alpha : dask.array.Array or array_like, optional

    Returns
    -------
    LocationAttentionGrads
        ``query``, ``values`` chunked like the batch (summed over the
        chunks along which they are shared); ``W`` and ``b`` (None
        without ``b``) summed over the chunks by a tree of fixed shape
        (rows t >= T of ``W`` and ``b``: 0).

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> enc = da.from_array(rng.standard_normal((10, 5, 4)),
    ...                     chunks=(4, -1, -1))
    >>> state = rng.standard_normal((10, 3, 6))    # Tq = 3 queries each
    >>> W, b = rng.standard_normal((9, 6)), np.zeros(9)
    >>> out, alpha = acd.location_attention(state, enc, W, b=b)
    >>> g = acd.location_attention_backward(da.ones_like(out), state, enc,
    ...                                     W, alpha, b=b)
    >>> g.query.chunks[0], g.W.shape, g.W.numblocks, g.b.shape
    ((4, 4, 2), (9, 6), (1, 1), (9,))
    >>> bool((g.W[5:].compute() == 0).all())        # rows past T
    True
    """
    fields = LocationAttentionGrads._fields
    return LocationAttentionGrads(*_apply(
        _ac.location_attention_backward, "values",
        {"grad_out": grad_out, "query": query, "values": values,
         "alpha": alpha, "mask": mask, "attn_mask": attn_mask,
         "grad_alpha": grad_alpha}, {"W": W, "b": b}, {}, fields,
        _follows(fields), _family_cores(query, values)))


@keyword_only
def cosine_attention(query: _Input, keys: _Input, *,
                     mask: _Input | None = None,
                     attn_mask: _Input | None = None, causal: bool = False,
                     bias: _Input | None = None, dropout: float = 0.0,
                     seed: int | None = None, values: _Input | None = None,
                     sharpness: _Input | float | None = None,
                     return_weights: bool = True,
                     window: tuple[int | None, int | None] | None = None,
                     softcap: float | None = None,
                     alibi_slopes: _Input | None = None,
                     sinks: _Input | None = None,
                     cu_seqlens_q: _Input | None = None,
                     cu_seqlens_k: _Input | None = None
                     ) -> tuple[da.Array, da.Array]:
    """:func:`attention_c.cosine_attention` chunk by chunk of the batch.

    Parameters
    ----------
    query : dask.array.Array or array_like (B, ..., H) or (B, ..., Tq, H)
    keys : dask.array.Array or array_like (B, ..., T, H)
        Chunked along the leading (batch) axes.
    mask, attn_mask, causal, bias, dropout, seed, return_weights
        As in :func:`dot_attention` (``dropout > 0``: one chunk).
    values : dask.array.Array or array_like (B, ..., T, Hv), optional
        Default: the keys (as given, not normalised).
    sharpness : float, or dask.array.Array or array_like, optional
        ``beta``: None (1), a finite number (a constant given to every
        chunk), or an array broadcastable to the query positions
        (B, ..., Tq) ((B, ...) for one query per sequence), split like
        the batch along the batch axes it has and given whole along
        those it broadcasts on (like ``bias``).
    window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k
        As in :func:`dot_attention`.

    Returns
    -------
    out : dask.array.Array (B, ..., Hv) or (B, ..., Tq, Hv)
    alpha : dask.array.Array (B, ..., T) or (B, ..., Tq, T)
        Or ``lse`` (B, ...) or (B, ..., Tq) with ``return_weights=False``.

    Examples
    --------
    >>> import numpy as np, dask.array as da
    >>> import attention_c as ac, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> q = da.from_array(rng.standard_normal((6, 3, 4)), chunks=(2, -1, -1))
    >>> k = da.from_array(rng.standard_normal((6, 7, 4)), chunks=(2, -1, -1))
    >>> out, alpha = acd.cosine_attention(q, k, sharpness=5.0)
    >>> out.numblocks, alpha.shape
    ((3, 1, 1), (6, 3, 7))
    >>> want = ac.cosine_attention(q.compute(), k.compute(), sharpness=5.0)
    >>> bool((out.compute() == want[0]).all())
    True
    """
    vdata, vshared, vlit = _variants(window, softcap, alibi_slopes, sinks,
                                     cu_seqlens_q, cu_seqlens_k)
    sdata, slit = _sharpness(sharpness)
    out, w = _apply(
        _ac.cosine_attention, "keys",
        {"query": query, "keys": keys, "mask": mask, "attn_mask": attn_mask,
         "bias": bias, "values": values, **sdata, **vdata}, vshared,
        {"causal": causal, "dropout": dropout, "seed": seed,
         "return_weights": return_weights, **slit, **vlit},
        ("out", "alpha" if return_weights else "lse"), ("", ""),
        _family_cores(query, keys))
    return out, w


@keyword_only
def cosine_attention_backward(grad_out: _Input, query: _Input, keys: _Input,
                              alpha: _Input | None = None, *,
                              out: _Input | None = None,
                              lse: _Input | None = None,
                              mask: _Input | None = None,
                              attn_mask: _Input | None = None,
                              causal: bool = False,
                              bias: _Input | None = None,
                              dropout: float = 0.0, seed: int | None = None,
                              values: _Input | None = None,
                              sharpness: _Input | float | None = None,
                              grad_alpha: _Input | None = None,
                              window: tuple[int | None, int | None] | None
                              = None,
                              softcap: float | None = None,
                              alibi_slopes: _Input | None = None,
                              sinks: _Input | None = None,
                              cu_seqlens_q: _Input | None = None,
                              cu_seqlens_k: _Input | None = None
                              ) -> CosineAttentionGrads:
    """:func:`attention_c.cosine_attention_backward` chunk by chunk.

    Parameters
    ----------
    grad_out : dask.array.Array or array_like, the shape of ``out``
    query, keys, mask, attn_mask, causal, bias, dropout, seed, values, \
sharpness
        As given to :func:`cosine_attention`.
    alpha : dask.array.Array or array_like, optional
        The forward's ``alpha``; or give ``out=`` and ``lse=``.
    out, lse : dask.array.Array or array_like, optional
        From a ``return_weights=False`` forward.
    grad_alpha : dask.array.Array or array_like, optional
        Only with ``alpha``.
    window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k
        As given to :func:`cosine_attention` (with ``sinks``: ``out=``
        and ``lse=``, not ``alpha``).

    Returns
    -------
    CosineAttentionGrads
        ``query``, ``keys``, ``values`` (None when not given), chunked
        like the batch; ``sharpness`` (None when it was None or a
        number), ``bias``, ``alibi_slopes`` and ``sinks`` (None when not
        given) of the shape given, summed over the chunks along which it
        is shared by a tree of fixed shape.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> q = da.from_array(rng.standard_normal((6, 3, 4)), chunks=(2, -1, -1))
    >>> k = da.from_array(rng.standard_normal((6, 7, 4)), chunks=(2, -1, -1))
    >>> beta = np.full((3,), 4.0)                  # per query, shared by B
    >>> out, lse = acd.cosine_attention(q, k, sharpness=beta, causal=True,
    ...                                 return_weights=False)
    >>> g = acd.cosine_attention_backward(da.ones_like(out), q, k, out=out,
    ...                                   lse=lse, sharpness=beta,
    ...                                   causal=True)
    >>> g.keys.chunks[0], g.values, g.sharpness.shape, g.sharpness.numblocks
    ((2, 2, 2), None, (3,), (1,))
    """
    vdata, vshared, vlit = _variants(window, softcap, alibi_slopes, sinks,
                                     cu_seqlens_q, cu_seqlens_k)
    sdata, slit = _sharpness(sharpness)
    fields = CosineAttentionGrads._fields
    return CosineAttentionGrads(*_apply(
        _ac.cosine_attention_backward, "keys",
        {"grad_out": grad_out, "query": query, "keys": keys, "alpha": alpha,
         "out": out, "lse": lse, "mask": mask, "attn_mask": attn_mask,
         "bias": bias, "values": values, "grad_alpha": grad_alpha,
         **sdata, **vdata}, vshared,
        {"causal": causal, "dropout": dropout, "seed": seed, **slit,
         **vlit},
        fields, _follows(fields), _family_cores(query, keys)))
