"""The location and content (cosine) scores as layers:
:class:`LocationAttention` (Luong 2015, eq. 8) scores the source positions
from the query alone; :class:`CosineAttention` (Graves 2014) scores by the
cosine of query and key, times a sharpness (docs/contract.md section 9).
Both are the attention family's layers (``_Attention`` in .family: its
forward, backward and bookkeeping) on one C call each way
(:func:`attention_c.location_attention`, :func:`attention_c.cosine_attention`
and their backwards)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .. import (cosine_attention, cosine_attention_backward,
                location_attention, location_attention_backward)
from .._keywords import keyword_only
from ._common import (Array, _dropout_config, _dropout_p, _last_call,
                      _positive, _uniform)
from ._torch_weights import _torch_array
from .family import _FORWARD_DOCS, _Attention

__all__ = ["LocationAttention", "CosineAttention", "LocationInputGrads"]


class LocationInputGrads(NamedTuple):
    """Gradients of the loss with respect to the inputs of a
    :class:`LocationAttention` call, returned by its ``backward``.

    Attributes
    ----------
    query : ndarray, the shape of the query
    values : ndarray, the shape of the values
        Each summed over the leading axes along which it was broadcast
        against the other.

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c import LocationAttention
    >>> rng = np.random.default_rng(0)
    >>> layer = LocationAttention(query_size=4, max_length=8, seed=0)
    >>> out = layer(rng.standard_normal((2, 4)),
    ...             rng.standard_normal((2, 6, 3)))
    >>> g = layer.backward(np.ones_like(out))       # LocationInputGrads
    >>> g.query.shape, g.values.shape
    ((2, 4), (2, 6, 3))
    """

    query: Array
    values: Array


class LocationAttention(_Attention):
    """Location-based (Luong) attention as a trainable NumPy layer.

    ``s_it = W_t . q_i + b_t`` (one row of ``W`` per source position, from
    the query alone), ``alpha_i`` the masked softmax of ``s_i`` over the
    ``T <= max_length`` positions of the values, ``out_i = sum_t alpha_it
    val_t`` (:func:`attention_c.location_attention`).  It is
    ``torch.nn.Linear(query_size, max_length)(q)[..., :T]`` as the scores.

    Parameters
    ----------
    query_size : int
        Hq, the features of a query.
    max_length : int
        T_max, the longest sequence of values the layer scores: ``W`` has
        a row per position, and rows past a call's T get a zero gradient.
    bias : bool, optional
        Whether the scores have the bias ``b`` (default True).
    dtype : dtype, optional
        float32 or float64 (default float64): the dtype of the parameters,
        of the computation and of every result.  Inputs are converted to it.
    seed : int or numpy.random.Generator, optional
        Seed of the initialisation, like ``torch.nn.Linear(Hq, T_max)``:
        ``W`` and ``b`` are ``U(-1/sqrt(Hq), 1/sqrt(Hq))``.

    Attributes
    ----------
    W : ndarray (T_max, Hq)
        The layout of ``torch.nn.Linear(Hq, T_max).weight``.
    b : ndarray (T_max,) or None
    attention_weights : ndarray (..., T) or (..., Tq, T), or None
        The weights of the last call (0 for masked positions).

    Notes
    -----
    The layer keeps references to the inputs of the last call (not
    copies); :meth:`backward` overwrites the stored gradients.

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c import LocationAttention
    >>> layer = LocationAttention(query_size=3, max_length=10, seed=0)
    >>> rng = np.random.default_rng(1)
    >>> q, v = rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 6, 4))
    >>> out = layer(q, v)
    >>> g = layer.backward(np.ones_like(out))
    >>> out.shape, layer.attention_weights.shape, layer.grads()["W"].shape
    ((2, 5, 4), (2, 5, 6), (10, 3))
    """

    _param_names = ("W", "b")

    @keyword_only
    def __init__(self, query_size: int, max_length: int, *,
                 bias: bool = True, dtype: npt.DTypeLike = np.float64,
                 seed: int | np.random.Generator | None = None) -> None:
        super().__init__(dtype)
        _positive(query_size=query_size, max_length=max_length)
        self.query_size, self.max_length = int(query_size), int(max_length)
        rng = np.random.default_rng(seed)
        bound = 1.0 / np.sqrt(self.query_size)
        self.W: Array = _uniform(rng, bound,
                                 (self.max_length, self.query_size),
                                 self.dtype)
        self.b: Array | None = (_uniform(rng, bound, (self.max_length,),
                                         self.dtype) if bias else None)

    @classmethod
    @keyword_only
    def from_torch(cls, linear: Any, *,
                   dtype: npt.DTypeLike | None = None) -> LocationAttention:
        """A layer with the weights (copied) of a PyTorch ``Linear(Hq,
        T_max)`` applied to the query: ``s_i = linear(q_i)[:T]``.

        ``linear.weight`` is ``W`` as it is and ``linear.bias`` is ``b``
        (a bias per position: it changes the softmax, so it is kept).

        Parameters
        ----------
        linear : torch.nn.Linear
            ``Linear(Hq, T_max)``, with or without a bias.
        dtype : dtype, optional
            Default: the dtype of ``linear.weight`` (float32 or float64).
        """
        W = _torch_array(linear.weight, "linear.weight")
        if W.ndim != 2:
            raise ValueError(f"linear.weight has shape {W.shape}; expected "
                             f"(T_max, Hq) of a Linear(Hq, T_max)")
        b = (None if linear.bias is None
             else _torch_array(linear.bias, "linear.bias"))
        layer = cls(W.shape[1], W.shape[0], bias=b is not None,
                    dtype=W.dtype if dtype is None else dtype)
        layer.W = W.astype(layer.dtype, copy=False)
        layer.b = None if b is None else b.astype(layer.dtype, copy=False)
        return layer

    @keyword_only
    def __call__(self, query: npt.ArrayLike, values: npt.ArrayLike, *,
                 mask: npt.ArrayLike | None = None,
                 attn_mask: npt.ArrayLike | None = None) -> Array:
        """Forward pass; keeps what :meth:`backward` needs.

        Parameters
        ----------
        query : array_like (..., Hq) or (..., Tq, Hq)
            One query per sequence, or several when ``query.ndim ==
            values.ndim``.  Converted to the layer's dtype, like every
            array argument; its leading axes broadcast against the
            values'.
        values : array_like (..., T, Hv)
            ``T <= max_length`` positions.
        mask : array_like of bool (..., T), optional
            The position mask, the same for every query: True marks a
            valid position.  A query with no visible position gives 0.
        attn_mask : array_like of bool, optional
            Broadcastable to (..., Tq, T): True where query i may attend
            to position t (several queries only).

        Returns
        -------
        out : ndarray (..., Hv) or (..., Tq, Hv)
        """
        return self._forward(query, values, mask=mask, attn_mask=attn_mask)

    # The family's backward, with this layer's inputs (query and values,
    # no keys) as the result: a different named tuple.
    @keyword_only
    def backward(  # type: ignore[override]
            self, grad_out: npt.ArrayLike, *,
            grad_alpha: npt.ArrayLike | None = None) -> LocationInputGrads:
        """Backward pass of the last call.

        Stores the gradients of ``W`` and ``b`` (summed over the batch
        and the queries; 0 in the rows past the call's T) for
        :meth:`grads`, replacing those of any earlier backward.

        Parameters
        ----------
        grad_out : array_like, the shape of the output
            Gradient of the loss with respect to the output.
        grad_alpha : array_like, the shape of :attr:`attention_weights`, \
optional
            Gradient of the loss with respect to the weights, if the loss
            uses them.

        Returns
        -------
        LocationInputGrads
            Named tuple ``(query, values)``.  Masked positions get 0.
        """
        q, values, kw, saved = _last_call(self._cache)
        g = location_attention_backward(
            self._cast(grad_out), q, values, self.W, saved["alpha"],
            b=self.b, grad_alpha=self._cast_opt(grad_alpha), **kw)
        self._store_grads(g)
        return LocationInputGrads(g.query, g.values)

    # Typed Any, as _Attention declares them: mypy's view of the C
    # function is its annotated stub, which stubtest would compare with
    # the builtin's text signature (the layer's annotations check calls).
    _function: Any = staticmethod(location_attention)

    def _weights(self) -> tuple[Array, ...]:
        return (self.W,)

    def _options(self) -> dict[str, Any]:
        return {"b": self.b}

    def _config(self) -> str:
        return (f"query_size={self.query_size}, "
                f"max_length={self.max_length}, bias={self.b is not None}")


def _finite(sharpness: float) -> float:
    """A number sharpness, checked: finite."""
    value = float(sharpness)
    if not math.isfinite(value):
        raise ValueError(f"sharpness must be finite, got {value}")
    return value


class CosineAttention(_Attention):
    """Content-based (cosine) attention as a NumPy layer, optionally with a
    learned sharpness.

    ``s_it = beta n(q_i) . n(k_t)`` with ``n(x) = x / max(||x||, 1e-12)``
    (``torch.nn.functional.normalize``'s convention: a zero vector scores
    0), ``alpha_i`` the masked softmax of ``s_i`` over the keys, ``out_i =
    sum_t alpha_it val_t`` with the values, by default the raw keys
    (:func:`attention_c.cosine_attention`).  Everything after the score is
    :class:`DotAttention`'s: masks, causal, bias, dropout and today's
    variants.

    Parameters
    ----------
    sharpness : float, optional
        beta, a finite number (default 1); with ``learn_sharpness``, the
        learned sharpness's initial value.
    learn_sharpness : bool, optional
        Make beta a parameter, :attr:`sharpness` an array of shape ()
        with its gradient in :meth:`grads`, trained by :func:`sgd_step`
        and :func:`adam_step` (default False: no parameters).
    dropout : float, optional
        p in [0, 1): dropout on the weights while :attr:`training`
        (``out_i = sum_t alpha_it keep_it / (1 - p) val_t``).
    seed : int or numpy.random.Generator, optional
        Where the dropout's seeds come from: each call in training draws
        a new one, so the same seed gives the same sequence of keep
        patterns.
    dtype : dtype, optional
        float32 or float64 (default float64): the dtype of the learned
        sharpness, of the computation and of every result.  Inputs are
        converted to it.

    Attributes
    ----------
    sharpness : float, ndarray of shape () or None
        beta: None (1) or a number; the parameter (an array of the
        layer's dtype) with ``learn_sharpness``.
    attention_weights : ndarray (..., T) or (..., Tq, T), or None
        The weights of the last call (0 for masked keys; before dropout),
        None after a call with ``return_weights=False``.
    training : bool
        Dropout on (default True); :meth:`train` and :meth:`eval`.

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c import CosineAttention
    >>> rng = np.random.default_rng(1)
    >>> q, k = rng.standard_normal((2, 7, 4)), rng.standard_normal((2, 6, 4))
    >>> layer = CosineAttention(sharpness=5.0, learn_sharpness=True)
    >>> out = layer(q, k, causal=True)
    >>> g = layer.backward(np.ones_like(out))
    >>> out.shape, g.keys.shape, layer.grads()["sharpness"].shape
    ((2, 7, 4), (2, 6, 4), ())
    """

    @keyword_only
    def __init__(self, *, sharpness: float | None = None,
                 learn_sharpness: bool = False, dropout: float = 0.0,
                 seed: int | np.random.Generator | None = None,
                 dtype: npt.DTypeLike = np.float64) -> None:
        super().__init__(dtype)
        beta = None if sharpness is None else _finite(sharpness)
        self.learn_sharpness = bool(learn_sharpness)
        self.sharpness: float | Array | None = beta
        if self.learn_sharpness:
            self.sharpness = np.array(1.0 if beta is None else beta,
                                      dtype=self.dtype)
            self._param_names = ("sharpness",)
        self.dropout = _dropout_p(dropout)
        self._rng = np.random.default_rng(seed)

    @keyword_only
    def __call__(self, query: npt.ArrayLike, keys: npt.ArrayLike, *,
                 values: npt.ArrayLike | None = None,
                 mask: npt.ArrayLike | None = None,
                 attn_mask: npt.ArrayLike | None = None,
                 causal: bool = False, bias: npt.ArrayLike | None = None,
                 return_weights: bool = True,
                 window: tuple[int | None, int | None] | None = None,
                 softcap: float | None = None,
                 alibi_slopes: npt.ArrayLike | None = None,
                 sinks: npt.ArrayLike | None = None,
                 cu_seqlens_q: npt.ArrayLike | None = None,
                 cu_seqlens_k: npt.ArrayLike | None = None) -> Array:
        """Forward pass; keeps what :meth:`backward` needs.

        Parameters
        ----------
        query : array_like (..., H) or (..., Tq, H)
            One query per sequence, or several when ``query.ndim ==
            keys.ndim``.
        keys : array_like (..., T, H)
        values : array_like (..., T, Hv), optional
            Default: the keys (not normalised).
        %(masks)s
        %(bias)s
        %(return_weights)s
        %(variants)s

        Returns
        -------
        out : ndarray (..., Hv) or (..., Tq, Hv)
        """
        return self._forward(query, keys, return_weights, values=values,
                             mask=mask, attn_mask=attn_mask, causal=causal,
                             bias=bias, window=window, softcap=softcap,
                             alibi_slopes=alibi_slopes, sinks=sinks,
                             cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k)

    _function: Any = staticmethod(cosine_attention)
    _function_backward: Any = staticmethod(cosine_attention_backward)

    def _options(self) -> dict[str, Any]:
        return {"sharpness": self.sharpness}

    def _config(self) -> str:
        beta = (None if self.sharpness is None
                else float(self.sharpness))
        return (f"sharpness={beta}"
                + (", learn_sharpness=True" if self.learn_sharpness else "")
                + _dropout_config(self.dropout))


def _fill_forward_docs(call: Any) -> None:
    """The family's shared parameter texts into a forward's docstring."""
    call.__doc__ = (call.__doc__ or "") % _FORWARD_DOCS


_fill_forward_docs(CosineAttention.__call__)
