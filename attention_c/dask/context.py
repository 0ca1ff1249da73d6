"""Context-pooled attention on Dask arrays."""

from __future__ import annotations

from typing import Literal, overload

import dask.array as da

import attention_c as _ac
from attention_c._keywords import keyword_only

from ._graph import _apply
from ._types import AttentionGrads, _Input

__all__ = ["context_attention", "context_attention_backward"]

# The non-batch axes of each argument.
_CONTEXT_CORES = {"h": 2, "mask": 1, "alpha": 1, "grad_alpha": 1,
                  "grad_out": 1, "activations": 2}


@overload
def context_attention(h: _Input, W: _Input, v: _Input, *,
                      b: _Input | None = None, mask: _Input | None = None,
                      keep_activations: Literal[False] = False
                      ) -> tuple[da.Array, da.Array]: ...


@overload
def context_attention(h: _Input, W: _Input, v: _Input, *,
                      b: _Input | None = None, mask: _Input | None = None,
                      keep_activations: Literal[True]
                      ) -> tuple[da.Array, da.Array, da.Array]: ...


@overload
def context_attention(h: _Input, W: _Input, v: _Input, *,
                      b: _Input | None = None, mask: _Input | None = None,
                      keep_activations: bool = ...
                      ) -> tuple[da.Array, ...]: ...


@keyword_only
def context_attention(h: _Input, W: _Input, v: _Input, *,
                      b: _Input | None = None, mask: _Input | None = None,
                      keep_activations: bool = False
                      ) -> tuple[da.Array, ...]:
    """:func:`attention_c.context_attention` chunk by chunk of the batch.

    Parameters
    ----------
    h : dask.array.Array or array_like (B, ..., T, H)
        Chunked along the leading (batch) axes.
    W : array_like (A, 2H)
    v : array_like (A,)
    b : array_like (A,), optional
        Weights: one graph key each, shared by every chunk.
    mask : dask.array.Array or array_like of bool (B, ..., T), optional
        True marks a valid item; chunked like ``h`` (rechunked if not).
    keep_activations : bool, optional
        Also return the activations (B, ..., T, A).

    Returns
    -------
    out : dask.array.Array (B, ..., H)
    alpha : dask.array.Array (B, ..., T)
    activations : dask.array.Array (B, ..., T, A)
        Only with ``keep_activations=True``.

    Examples
    --------
    >>> import numpy as np, dask.array as da
    >>> import attention_c as ac, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> h = rng.standard_normal((10, 5, 4))            # B=10, T=5, H=4
    >>> W = rng.standard_normal((3, 8)); v = rng.standard_normal(3)
    >>> hd = da.from_array(h, chunks=(4, -1, -1))       # along the batch
    >>> out, alpha = acd.context_attention(hd, W, v)
    >>> out.chunks
    ((4, 4, 2), (4,))
    >>> bool((out.compute() == ac.context_attention(h, W, v)[0]).all())
    True
    """
    outs = _apply(
        _ac.context_attention, "h", {"h": h, "mask": mask},
        {"W": W, "v": v, "b": b}, {"keep_activations": keep_activations},
        ("out", "alpha", "activations"), ("", "", ""), _CONTEXT_CORES)
    return tuple(x for x in outs if x is not None)


@keyword_only
def context_attention_backward(grad_out: _Input, h: _Input, W: _Input,
                               v: _Input, alpha: _Input, *,
                               b: _Input | None = None,
                               mask: _Input | None = None,
                               grad_alpha: _Input | None = None,
                               activations: _Input | None = None
                               ) -> AttentionGrads:
    """:func:`attention_c.context_attention_backward` chunk by chunk.

    Parameters
    ----------
    grad_out : dask.array.Array or array_like (B, ..., H)
    h, W, v, b, mask
        As given to :func:`context_attention`.
    alpha : dask.array.Array or array_like (B, ..., T)
        The weights :func:`context_attention` returned.
    grad_alpha : dask.array.Array or array_like (B, ..., T), optional
    activations : dask.array.Array or array_like (B, ..., T, A), optional
        From ``context_attention(..., keep_activations=True)``.

    Returns
    -------
    AttentionGrads
        ``h`` chunked like ``h`` (bitwise the in-memory result); ``W``,
        ``v``, ``b`` summed over the chunks by a tree of fixed shape (equal
        to the in-memory sums within rounding; ``b`` None without a bias).

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> h = da.from_array(rng.standard_normal((10, 5, 4)),
    ...                   chunks=(4, -1, -1))
    >>> W = rng.standard_normal((3, 8)); v = rng.standard_normal(3)
    >>> out, alpha = acd.context_attention(h, W, v)
    >>> g = acd.context_attention_backward(da.ones_like(out), h, W, v, alpha)
    >>> g.h.chunks[0], g.W.shape, g.W.numblocks, g.b
    ((4, 4, 2), (3, 8), (1, 1), None)
    """
    return AttentionGrads(*_apply(
        _ac.context_attention_backward, "h",
        {"grad_out": grad_out, "h": h, "alpha": alpha, "mask": mask,
         "grad_alpha": grad_alpha, "activations": activations},
        {"W": W, "v": v, "b": b}, {}, AttentionGrads._fields,
        ("h", None, None, None), _CONTEXT_CORES))
