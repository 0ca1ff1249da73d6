"""The attention family as layers: :class:`AdditiveAttention`,
:class:`DotAttention` and :class:`GeneralAttention` attend from queries to
keys (docs/contract.md sections 4 and 5); their backward returns
:class:`AttentionInputGrads`."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .. import (additive_attention, additive_attention_backward,
                dot_attention, dot_attention_backward, general_attention,
                general_attention_backward, project_keys)
from .._keywords import keyword_only
from ._common import (Array, _dropout_config, _dropout_p, _last_call, _Layer,
                      _positive, _uniform)
from ._torch_weights import (_additive_from_d2l, _additive_from_linear,
                             _cast_weights, _general_from_linear)

__all__ = ["AdditiveAttention", "DotAttention", "GeneralAttention",
           "AttentionInputGrads"]


class AttentionInputGrads(NamedTuple):
    """Gradients of the loss with respect to the inputs of an attention
    family layer, returned by its ``backward``.

    Attributes
    ----------
    query : ndarray, the shape of the query
    keys : ndarray (..., T, H)
        With the values' gradient included when no values were given.
    values : ndarray (..., T, Hv) or None
        None when no values were given (the keys were the values).
    bias : ndarray, the shape of the bias, or None
        None when the call had no ``bias`` (always for
        :class:`AdditiveAttention`); summed over the axes along which the
        bias was broadcast.
    alibi_slopes, sinks : ndarray or None
        The gradients of the call's ``alibi_slopes`` and ``sinks`` (of
        their shapes, summed over the axes along which they were
        broadcast), None when the call had none (docs/contract.md
        section 8).

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c import DotAttention
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 4)), rng.standard_normal((2, 6, 4))
    >>> layer = DotAttention()
    >>> out = layer(q, k, values=rng.standard_normal((2, 6, 3)))
    >>> g = layer.backward(np.ones_like(out))       # AttentionInputGrads
    >>> g.query.shape, g.keys.shape, g.values.shape, g.bias
    ((2, 4), (2, 6, 4), (2, 6, 3), None)
    """

    query: Array
    keys: Array
    values: Array | None
    bias: Array | None = None
    alibi_slopes: Array | None = None
    sinks: Array | None = None


# The arguments of the forward that are float arrays (cast to the layer's
# dtype); cu_seqlens_q/k stay integers.
_FLOAT_OPTIONS = ("values", "key_proj", "bias", "alibi_slopes", "sinks")


class _Attention(_Layer):
    """Forward and backward bookkeeping of the attention family layers;
    a subclass says which functions attend (:attr:`_function`,
    :attr:`_function_backward`), with which weights (:meth:`_weights`,
    :meth:`_options`), and has the public ``__call__``.

    ``training`` (True by default, as in PyTorch) switches the dropout of
    the layers that have one: :meth:`train` and :meth:`eval` set it.
    """

    _function: Any = None           # staticmethods of the subclasses
    _function_backward: Any = None

    def __init__(self, dtype: npt.DTypeLike) -> None:
        super().__init__(dtype)
        self.training = True
        self.dropout = 0.0
        self._rng: np.random.Generator | None = None
        # query, keys, the keyword arguments of both calls, and what the
        # backward needs of the forward's results (alpha, or out and lse)
        self._cache: tuple[Array, Array, dict[str, Any],
                           dict[str, Array]] | None = None

    def train(self, mode: bool = True) -> _Attention:
        """Set :attr:`training` (dropout on when True); returns the layer."""
        self.training = bool(mode)
        return self

    def eval(self) -> _Attention:
        """``train(False)``: no dropout; returns the layer."""
        return self.train(False)

    def _cast(self, x: npt.ArrayLike) -> Array:
        return np.asarray(x, dtype=self.dtype)

    def _cast_opt(self, x: npt.ArrayLike | None) -> Array | None:
        return None if x is None else self._cast(x)

    def _weights(self) -> tuple[Array, ...]:
        """The parameters the functions take by position."""
        return ()

    def _options(self) -> dict[str, Any]:
        """The layer's own keyword arguments of both functions."""
        return {}

    def _forward(self, query: npt.ArrayLike, keys: npt.ArrayLike,
                 return_weights: bool = True, **options: Any) -> Array:
        q, k = self._cast(query), self._cast(keys)
        kw: dict[str, Any] = {
            n: self._cast(x) if n in _FLOAT_OPTIONS else x
            for n, x in options.items()
            if x is not None and x is not False}
        if self.training and self.dropout > 0:
            # A fresh seed per call (like a fresh mask), kept for the
            # backward, which regenerates the same keep bits.
            assert self._rng is not None
            kw["dropout"] = self.dropout
            kw["seed"] = int(self._rng.integers(0, 2**63))
        if return_weights:
            out, alpha = type(self)._function(q, k, *self._weights(), **kw,
                                              **self._options())
            saved = {"alpha": alpha}
            if "sinks" in kw:
                # The backward with sinks runs from out and lse (alpha
                # alone loses the sink's share): the streamed forward too.
                out2, lse = type(self)._function(
                    q, k, *self._weights(), **kw, **self._options(),
                    return_weights=False)
                saved = {"out": out2, "lse": lse}
        else:
            out, lse = type(self)._function(q, k, *self._weights(), **kw,
                                            **self._options(),
                                            return_weights=False)
            saved = {"out": out, "lse": lse}
            alpha = None
        self.attention_weights = alpha
        self._cache = (q, k, kw, saved)
        result: Array = out        # the C function's array (typed Any)
        return result

    @keyword_only
    def backward(self, grad_out: npt.ArrayLike, *,
                 grad_alpha: npt.ArrayLike | None = None
                 ) -> AttentionInputGrads:
        """Backward pass of the last call.

        Stores the parameter gradients (summed over the batch and the
        queries) for :meth:`grads`, replacing those of any earlier
        backward.  With dropout, the same keep bits as the forward's
        (regenerated from its seed, never stored).

        Parameters
        ----------
        grad_out : array_like, the shape of the output
            Gradient of the loss with respect to the output.
        grad_alpha : array_like, the shape of :attr:`attention_weights`, \
optional
            Gradient of the loss with respect to the weights, if the loss
            uses them (only after a call with ``return_weights=True``).

        Returns
        -------
        AttentionInputGrads
            Named tuple ``(query, keys, values, bias, alibi_slopes,
            sinks)``; ``values`` is None when the call had no values
            (``keys`` then includes their gradient), ``bias``,
            ``alibi_slopes`` and ``sinks`` when it had none of them.
            Masked keys get 0.
        """
        q, k, kw, saved = _last_call(self._cache)
        if grad_alpha is not None and "sinks" in kw:
            raise ValueError(
                "grad_alpha is not accepted after a call with sinks: its "
                "backward runs from the output and the log-sum-exp, not "
                "from the weights")
        if grad_alpha is not None and "alpha" not in saved:
            raise ValueError(
                "grad_alpha needs the weights, which the last call did not "
                "keep (return_weights=False); call the layer with "
                "return_weights=True to use them in the loss")
        alpha = saved.get("alpha")
        opt = {n: x for n, x in saved.items() if n != "alpha"}
        if grad_alpha is not None:
            opt["grad_alpha"] = self._cast(grad_alpha)
        g = type(self)._function_backward(
            self._cast(grad_out), q, k, *self._weights(), alpha, **kw,
            **opt, **self._options())
        self._store_grads(g)
        return AttentionInputGrads(g.query, g.keys, g.values,
                                   getattr(g, "bias", None),
                                   getattr(g, "alibi_slopes", None),
                                   getattr(g, "sinks", None))


class AdditiveAttention(_Attention):
    """Additive (Bahdanau) attention as a trainable NumPy layer.

    ``s_it = v . tanh(W_k k_t + W_q q_i + b)``, ``alpha_i`` the masked
    softmax of ``s_i`` over the keys, ``out_i = sum_t alpha_it val_t``
    (docs/contract.md section 4; :func:`attention_c.additive_attention`).

    Parameters
    ----------
    key_size : int
        H, the features of a key.
    query_size : int
        Hq, the features of a query.
    attention_size : int
        A, the width of the score network.
    bias : bool, optional
        Whether the score network has the bias ``b`` (default True).
    dtype : dtype, optional
        float32 or float64 (default float64): the dtype of the parameters,
        of the computation and of every result.  Inputs are converted to it.
    seed : int or numpy.random.Generator, optional
        Seed of the initialisation, like ``torch.nn.Linear``: ``W`` and
        ``b`` are ``U(-1/sqrt(H + Hq), 1/sqrt(H + Hq))`` (a
        ``Linear(H + Hq, A)``), ``v`` is ``U(-1/sqrt(A), 1/sqrt(A))`` (a
        ``Linear(A, 1)``).

    Attributes
    ----------
    W : ndarray (A, H + Hq)
        ``[W_k | W_q]``, the layout of ``torch.nn.Linear(H + Hq, A).weight``
        applied to ``[k_t; q_i]``.
    v : ndarray (A,)
    b : ndarray (A,) or None
    attention_weights : ndarray (..., T) or (..., Tq, T), or None
        The weights of the last call (0 for masked keys).

    Notes
    -----
    The layer keeps references to the inputs of the last call (not
    copies); :meth:`backward` overwrites the stored gradients.

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c import AdditiveAttention
    >>> layer = AdditiveAttention(key_size=4, query_size=3,
    ...                           attention_size=5, seed=0)
    >>> rng = np.random.default_rng(1)
    >>> q, k = rng.standard_normal((2, 3)), rng.standard_normal((2, 6, 4))
    >>> out = layer(q, k)
    >>> g = layer.backward(np.ones_like(out))
    >>> out.shape, g.query.shape, g.keys.shape, layer.grads()["W"].shape
    ((2, 4), (2, 3), (2, 6, 4), (5, 7))
    """

    _param_names = ("W", "v", "b")

    @keyword_only
    def __init__(self, key_size: int, query_size: int, attention_size: int,
                 *, bias: bool = True, dtype: npt.DTypeLike = np.float64,
                 seed: int | np.random.Generator | None = None) -> None:
        super().__init__(dtype)
        _positive(key_size=key_size, query_size=query_size,
                  attention_size=attention_size)
        self.key_size, self.query_size = int(key_size), int(query_size)
        self.attention_size = int(attention_size)
        rng = np.random.default_rng(seed)
        H, Hq, A = self.key_size, self.query_size, self.attention_size
        bound = 1.0 / np.sqrt(H + Hq)
        self.W: Array = _uniform(rng, bound, (A, H + Hq), self.dtype)
        self.b: Array | None = (_uniform(rng, bound, (A,), self.dtype)
                                if bias else None)
        self.v: Array = _uniform(rng, 1.0 / np.sqrt(A), (A,), self.dtype)

    @classmethod
    def _from_weights(cls, W: Array, v: Array, b: Array | None,
                      key_size: int, dtype: npt.DTypeLike | None
                      ) -> AdditiveAttention:
        layer = cls(key_size, W.shape[1] - key_size, W.shape[0],
                    bias=b is not None,
                    dtype=W.dtype if dtype is None else dtype)
        layer.W, layer.v, layer.b = _cast_weights(layer.dtype, W, v, b)
        return layer

    @classmethod
    @keyword_only
    def from_torch(cls, score: Any, out: Any, key_size: int, *,
                   dtype: npt.DTypeLike | None = None) -> AdditiveAttention:
        """A layer with the weights (copied) of a PyTorch
        ``Linear(H + Hq, A)`` and ``Linear(A, 1)`` pair computing
        ``out(tanh(score([k_t, q_i])))``.

        ``score.weight`` is ``W`` as it is, ``score.bias`` is ``b``,
        ``out.weight[0]`` is ``v``; ``out.bias`` is ignored (a constant
        added to every score does not change the softmax).

        Parameters
        ----------
        score : torch.nn.Linear
            ``Linear(H + Hq, A)`` whose input is the key followed by the
            query.
        out : torch.nn.Linear
            ``Linear(A, 1)``, or ``v`` itself: a tensor (A,) or (1, A).
        key_size : int
            H (the query has the other ``Hq`` inputs of ``score``).
        dtype : dtype, optional
            Default: the dtype of ``score.weight`` (float32 or float64).
        """
        W, v, b = _additive_from_linear(score, out, key_size)
        return cls._from_weights(W, v, b, key_size, dtype)

    @classmethod
    @keyword_only
    def from_d2l(cls, W_k: Any, W_q: Any, w_v: Any, *,
                 dtype: npt.DTypeLike | None = None) -> AdditiveAttention:
        """A layer with the weights (copied) of d2l.ai's additive attention:
        ``w_v(tanh(W_k(k_t) + W_q(q_i)))``.

        Parameters
        ----------
        W_k : torch.nn.Linear
            ``Linear(H, A, bias=False)`` on the keys.
        W_q : torch.nn.Linear
            ``Linear(Hq, A, bias=False)`` on the queries.  Biases of
            ``W_k`` and ``W_q``, if any, add up to ``b``.
        w_v : torch.nn.Linear
            ``Linear(A, 1)`` (its bias is ignored), or a tensor (A,).
        dtype : dtype, optional
            Default: the dtype of the weights.

        Notes
        -----
        d2l masks with ``valid_lens`` and gives a query with no valid key
        uniform weights; here it gets 0 (docs/contract.md section 4).
        """
        W, v, b, H = _additive_from_d2l(W_k, W_q, w_v)
        return cls._from_weights(W, v, b, H, dtype)

    def project_keys(self, keys: npt.ArrayLike) -> Array:
        """``W_k k_t`` (..., T, A) for ``key_proj=``: the keys' side of the
        score, computed once for calls that attend to the same keys."""
        return project_keys(self._cast(keys), self.W)

    @keyword_only
    def __call__(self, query: npt.ArrayLike, keys: npt.ArrayLike, *,
                 values: npt.ArrayLike | None = None,
                 mask: npt.ArrayLike | None = None,
                 attn_mask: npt.ArrayLike | None = None,
                 causal: bool = False,
                 key_proj: npt.ArrayLike | None = None) -> Array:
        """Forward pass; keeps what :meth:`backward` needs.

        Parameters
        ----------
        query : array_like (..., Hq) or (..., Tq, Hq)
            One query per sequence, or several when ``query.ndim ==
            keys.ndim``.  Converted to the layer's dtype, like every
            array argument.
        keys : array_like (..., T, H)
        values : array_like (..., T, Hv), optional
            Default: the keys.
        %(masks)s
        key_proj : array_like (..., T, A), optional
            :meth:`project_keys` of these keys, to skip projecting them
            again (e.g. once per step of a decoder).  The results, and the
            gradients of :meth:`backward`, are the same.

        Returns
        -------
        out : ndarray (..., Hv) or (..., Tq, Hv)
        """
        return self._forward(query, keys, values=values, mask=mask,
                             attn_mask=attn_mask, causal=causal,
                             key_proj=key_proj)

    _function = staticmethod(additive_attention)
    _function_backward = staticmethod(additive_attention_backward)

    def _weights(self) -> tuple[Array, ...]:
        return (self.W, self.v)

    def _options(self) -> dict[str, Any]:
        return {"b": self.b}

    def _config(self) -> str:
        return (f"key_size={self.key_size}, query_size={self.query_size}, "
                f"attention_size={self.attention_size}, "
                f"bias={self.b is not None}")


class DotAttention(_Attention):
    """Scaled dot-product attention as a NumPy layer (no parameters).

    ``s_it = scale q_i . k_t``, ``alpha_i`` the masked softmax of ``s_i``
    over the keys, ``out_i = sum_t alpha_it val_t`` (docs/contract.md
    section 4; :func:`attention_c.dot_attention`).

    Parameters
    ----------
    scale : float, optional
        Default ``1/sqrt(H)`` (H = the features of a key and of a query).
    dropout : float, optional
        p in [0, 1): dropout on the weights while :attr:`training`
        (``out_i = sum_t alpha_it keep_it / (1 - p) val_t``).
    seed : int or numpy.random.Generator, optional
        Where the dropout's seeds come from: each call in training draws
        a new one, so the same seed gives the same sequence of keep
        patterns.
    dtype : dtype, optional
        float32 or float64 (default float64, as for the other layers): the
        dtype of the computation and of every result.  Inputs are converted
        to it.

    Attributes
    ----------
    attention_weights : ndarray (..., T) or (..., Tq, T), or None
        The weights of the last call (0 for masked keys; before dropout),
        None after a call with ``return_weights=False``.
    training : bool
        Dropout on (default True); :meth:`train` and :meth:`eval`.

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c import DotAttention
    >>> rng = np.random.default_rng(1)
    >>> q, k = rng.standard_normal((2, 7, 4)), rng.standard_normal((2, 6, 4))
    >>> layer = DotAttention()
    >>> out = layer(q, k)
    >>> g = layer.backward(np.ones_like(out))
    >>> out.shape, layer.attention_weights.shape, g.keys.shape
    ((2, 7, 4), (2, 7, 6), (2, 6, 4))
    """

    @keyword_only
    def __init__(self, *, scale: float | None = None, dropout: float = 0.0,
                 seed: int | np.random.Generator | None = None,
                 dtype: npt.DTypeLike = np.float64) -> None:
        super().__init__(dtype)
        self.scale = None if scale is None else float(scale)
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
            Default: the keys.
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

    _function = staticmethod(dot_attention)
    _function_backward = staticmethod(dot_attention_backward)

    def _options(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def _config(self) -> str:
        return f"scale={self.scale}" + _dropout_config(self.dropout)


class GeneralAttention(_Attention):
    """Multiplicative ("general", Luong) attention as a trainable NumPy
    layer.

    ``s_it = q_i . (W_a k_t)``, ``alpha_i`` the masked softmax of ``s_i``
    over the keys, ``out_i = sum_t alpha_it val_t`` (docs/contract.md
    section 4; :func:`attention_c.general_attention`).

    Parameters
    ----------
    query_size : int
        Hq, the features of a query.
    key_size : int
        H, the features of a key.
    dtype : dtype, optional
        float32 or float64 (default float64): the dtype of the parameters,
        of the computation and of every result.  Inputs are converted to it.
    dropout : float, optional
        p in [0, 1): dropout on the weights while :attr:`training`
        (``out_i = sum_t alpha_it keep_it / (1 - p) val_t``).
    seed : int or numpy.random.Generator, optional
        Seed of the initialisation, like ``torch.nn.Linear(H, Hq,
        bias=False)``: ``W`` is ``U(-1/sqrt(H), 1/sqrt(H))``; then of the
        dropout's seeds (a new one per call in training).

    Attributes
    ----------
    W : ndarray (Hq, H)
        ``W_a``, the layout of ``torch.nn.Linear(H, Hq).weight`` applied to
        the keys.
    attention_weights : ndarray (..., T) or (..., Tq, T), or None
        The weights of the last call (0 for masked keys; before dropout),
        None after a call with ``return_weights=False``.
    training : bool
        Dropout on (default True); :meth:`train` and :meth:`eval`.

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c import GeneralAttention
    >>> layer = GeneralAttention(query_size=3, key_size=4, seed=0)
    >>> rng = np.random.default_rng(1)
    >>> q, k = rng.standard_normal((2, 3)), rng.standard_normal((2, 6, 4))
    >>> out = layer(q, k)
    >>> g = layer.backward(np.ones_like(out))
    >>> out.shape, g.query.shape, layer.grads()["W"].shape
    ((2, 4), (2, 3), (3, 4))
    """

    _param_names = ("W",)

    @keyword_only
    def __init__(self, query_size: int, key_size: int, *,
                 dropout: float = 0.0, dtype: npt.DTypeLike = np.float64,
                 seed: int | np.random.Generator | None = None) -> None:
        super().__init__(dtype)
        _positive(query_size=query_size, key_size=key_size)
        self.query_size, self.key_size = int(query_size), int(key_size)
        self.dropout = _dropout_p(dropout)
        rng = np.random.default_rng(seed)
        self.W: Array = _uniform(rng, 1.0 / np.sqrt(self.key_size),
                                 (self.query_size, self.key_size),
                                 self.dtype)
        self._rng = rng

    @classmethod
    @keyword_only
    def from_torch(cls, linear: Any, *,
                   dtype: npt.DTypeLike | None = None) -> GeneralAttention:
        """A layer with the weight (copied) of a PyTorch ``Linear(H, Hq)``
        applied to the keys: ``s_it = q_i . linear(k_t)``.

        ``linear.weight`` is ``W`` as it is.  A bias would add ``q_i .
        bias`` to every score of query i, which does not change its
        softmax: it is ignored.

        Parameters
        ----------
        linear : torch.nn.Linear
            ``Linear(H, Hq, bias=False)``.
        dtype : dtype, optional
            Default: the dtype of ``linear.weight`` (float32 or float64).
        """
        W = _general_from_linear(linear)
        layer = cls(W.shape[0], W.shape[1],
                    dtype=W.dtype if dtype is None else dtype)
        layer.W = W.astype(layer.dtype, copy=False)
        return layer

    def project_keys(self, keys: npt.ArrayLike) -> Array:
        """``W_a k_t`` (..., T, Hq) for ``key_proj=``: the keys' side of
        the score, computed once for calls that attend to the same keys."""
        return project_keys(self._cast(keys), self.W)

    @keyword_only
    def __call__(self, query: npt.ArrayLike, keys: npt.ArrayLike, *,
                 values: npt.ArrayLike | None = None,
                 mask: npt.ArrayLike | None = None,
                 attn_mask: npt.ArrayLike | None = None,
                 causal: bool = False, bias: npt.ArrayLike | None = None,
                 key_proj: npt.ArrayLike | None = None,
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
        query : array_like (..., Hq) or (..., Tq, Hq)
            One query per sequence, or several when ``query.ndim ==
            keys.ndim``.  Converted to the layer's dtype, like every
            array argument.
        keys : array_like (..., T, H)
        values : array_like (..., T, Hv), optional
            Default: the keys.
        %(masks)s
        %(bias)s
        key_proj : array_like (..., T, Hq), optional
            :meth:`project_keys` of these keys, to skip projecting them
            again (e.g. once per step of a decoder).  The results, and the
            gradients of :meth:`backward`, are the same.
        %(return_weights)s
        %(variants)s

        Returns
        -------
        out : ndarray (..., Hv) or (..., Tq, Hv)
        """
        return self._forward(query, keys, return_weights, values=values,
                             mask=mask, attn_mask=attn_mask, causal=causal,
                             bias=bias, key_proj=key_proj, window=window,
                             softcap=softcap, alibi_slopes=alibi_slopes,
                             sinks=sinks, cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k)

    _function = staticmethod(general_attention)
    _function_backward = staticmethod(general_attention_backward)

    def _weights(self) -> tuple[Array, ...]:
        return (self.W,)

    def _config(self) -> str:
        return (f"query_size={self.query_size}, key_size={self.key_size}"
                + _dropout_config(self.dropout))


# The parameters the family's forwards share, written once.
_FORWARD_DOCS = dict(
    masks="""mask : array_like of bool (..., T), optional
            The key mask, the same for every query: True marks a valid
            key.  A query with no visible key gives 0.
        attn_mask : array_like of bool, optional
            Broadcastable to (..., Tq, T): True where query i may attend
            to key t (several queries only).
        causal : bool, optional
            Key t visible to query i iff ``t <= i + (T - Tq)``.""",
    bias="""bias : array_like, optional
            Float, broadcastable to (..., Tq, T) ((..., T) with one
            query), added to the scores; -inf masks.  :meth:`backward`
            returns its gradient.""",
    return_weights="""return_weights : bool, optional
            True (default): keep the weights in :attr:`attention_weights`
            for the backward.  False: never form them (the streaming
            kernel; :attr:`attention_weights` is None) and keep the output
            and the log-sum-exp of the scores instead.""",
    variants="""window : (left, right), optional
            Today's variants (docs/contract.md section 8), from here to
            ``cu_seqlens_k``.  Key t visible to query i iff ``i' - left <=
            t <= i' + right`` (``i' = i + (T - Tq)``; None: that side
            unbounded; with ``causal``, right is 0).  Several queries
            only.
        softcap : float > 0, optional
            The score s becomes ``softcap * tanh(s / softcap)`` (before
            bias and ALiBi), as Gemma 2.
        alibi_slopes : array_like, optional
            One slope m per sequence (and head), broadcastable to the
            output's leading axes: ``-m |i' - t|`` is added to the scores.
            :meth:`backward` returns its gradient.
        sinks : array_like, optional
            One extra logit per sequence (and head), same shape rules: it
            takes a share of every query's softmax and gives no value, so
            the weights over the keys sum to less than 1 (gpt-oss).
            :meth:`backward` returns its gradient.
        cu_seqlens_q, cu_seqlens_k : array_like of int (n + 1,), optional
            Packed sequences: the Tq (resp. T) axis holds n sequences
            back to back, starting at these offsets; a query sees only
            its own sequence's keys, positions counted within it.  Both
            or neither; several queries only.""")
for _cls in (AdditiveAttention, DotAttention, GeneralAttention):
    _cls.__call__.__doc__ = (_cls.__call__.__doc__ or "") % _FORWARD_DOCS
del _cls
