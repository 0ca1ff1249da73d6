"""The context-pooled layer: :class:`ContextAttention`, a sequence pooled
with its own mean as the query (docs/contract.md sections 1 and 2)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .. import context_attention, context_attention_backward
from .._keywords import keyword_only
from ._common import Array, _Layer, _last_call, _positive, _uniform
from ._torch_weights import _cast_weights, _context_from_linear

__all__ = ["ContextAttention"]


class ContextAttention(_Layer):
    """Context-pooled additive attention as a trainable NumPy layer.

    ``out = sum_t alpha_t h_t`` with ``alpha = masked softmax of
    v . tanh(W_h h_t + W_c c + b)`` and ``c`` the mean of the valid
    ``h_t`` (docs/contract.md section 1).  Forward and backward are one C
    call each.

    Parameters
    ----------
    hidden_size : int
        H, the number of features of each item.
    attention_size : int
        A, the width of the score network.
    bias : bool, optional
        Whether the score network has the bias ``b`` (default True).
    dtype : dtype, optional
        float32 or float64 (default float64): the dtype of the parameters,
        of the computation and of every result.  Inputs are converted to it.
    seed : int or numpy.random.Generator, optional
        Seed of the initialisation.  Like ``torch.nn.Linear``: ``W`` and
        ``b`` are ``U(-1/sqrt(2H), 1/sqrt(2H))`` (a ``Linear(2H, A)``),
        ``v`` is ``U(-1/sqrt(A), 1/sqrt(A))`` (a ``Linear(A, 1)``).
    keep_activations : bool, optional
        Keep the (..., T, A) tanh activations between forward and backward
        (``context_attention(..., keep_activations=True)``), for a faster
        backward at the cost of that memory (default True).

    Attributes
    ----------
    W : ndarray (A, 2H)
        ``[W_h | W_c]``, the layout of ``torch.nn.Linear(2H, A).weight``.
    v : ndarray (A,)
    b : ndarray (A,) or None
    attention_weights : ndarray (..., T) or None
        The weights ``alpha`` of the last call (0 for masked items).

    Notes
    -----
    The layer keeps references to the inputs of the last call (not copies):
    do not modify ``h`` in place between a call and its backward.
    :meth:`backward` *overwrites* the stored gradients; it does not add to
    them.

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c import ContextAttention
    >>> layer = ContextAttention(4, 3, seed=0)
    >>> h = np.random.default_rng(1).standard_normal((2, 5, 4))
    >>> out = layer(h)
    >>> dh = layer.backward(np.ones_like(out))
    >>> out.shape, dh.shape, layer.grads()["W"].shape
    ((2, 4), (2, 5, 4), (3, 8))
    """

    _param_names = ("W", "v", "b")

    @keyword_only
    def __init__(self, hidden_size: int, attention_size: int, *,
                 bias: bool = True, dtype: npt.DTypeLike = np.float64,
                 seed: int | np.random.Generator | None = None,
                 keep_activations: bool = True) -> None:
        super().__init__(dtype)
        _positive(hidden_size=hidden_size, attention_size=attention_size)
        self.hidden_size = int(hidden_size)
        self.attention_size = int(attention_size)
        self.keep_activations = bool(keep_activations)
        rng = np.random.default_rng(seed)
        H, A = self.hidden_size, self.attention_size
        bound = 1.0 / np.sqrt(2 * H)
        self.W: Array = _uniform(rng, bound, (A, 2 * H), self.dtype)
        self.b: Array | None = (_uniform(rng, bound, (A,), self.dtype)
                                if bias else None)
        self.v: Array = _uniform(rng, 1.0 / np.sqrt(A), (A,), self.dtype)
        # h, mask, activations (or None), alpha of the last call
        self._cache: tuple[Array, Any, Array | None, Array] | None = None

    # ------------------------------------------------------------------
    @classmethod
    @keyword_only
    def from_torch(cls, score: Any, out: Any, *,
                   dtype: npt.DTypeLike | None = None,
                   keep_activations: bool = True) -> ContextAttention:
        """A layer with the weights of a PyTorch ``Linear(2H, A)`` and
        ``Linear(A, 1)`` pair computing ``out(tanh(score([h_t, c])))``.

        The weights are copied.  ``score.weight`` is ``W`` as it is (same
        layout), ``score.bias`` is ``b`` (None if the Linear has none) and
        ``out.weight[0]`` is ``v``.  ``out.bias`` is ignored: adding a
        constant to every score does not change the softmax.

        Parameters
        ----------
        score : torch.nn.Linear
            ``Linear(2H, A)`` whose input is the item followed by the
            context, ``[h_t, c]``.
        out : torch.nn.Linear
            ``Linear(A, 1)`` (or its weight, a tensor (A,) or (1, A)).
        dtype : dtype, optional
            Default: the dtype of ``score.weight`` (float32 or float64).
        keep_activations : bool, optional
            As in the constructor.
        """
        W, v, b = _context_from_linear(score, out)
        layer = cls(W.shape[1] // 2, W.shape[0], bias=b is not None,
                    dtype=W.dtype if dtype is None else dtype,
                    keep_activations=keep_activations)
        layer.W, layer.v, layer.b = _cast_weights(layer.dtype, W, v, b)
        return layer

    # ------------------------------------------------------------------
    @keyword_only
    def __call__(self, h: npt.ArrayLike, *,
                 mask: npt.ArrayLike | None = None) -> Array:
        """Forward pass; keeps what :meth:`backward` needs.

        Parameters
        ----------
        h : array_like (..., T, H)
            Converted to the layer's dtype.
        mask : array_like of bool (..., T), optional
            True marks a valid item.  A row with no valid item gives 0.

        Returns
        -------
        out : ndarray (..., H)
        """
        h = np.asarray(h, dtype=self.dtype)
        act: list[Array]          # [activations] or []
        out, alpha, *act = context_attention(
            h, self.W, self.v, b=self.b, mask=mask,
            keep_activations=self.keep_activations)
        self.attention_weights = alpha
        self._cache = (h, mask, act[0] if act else None, alpha)
        return out

    @keyword_only
    def backward(self, grad_out: npt.ArrayLike, *,
                 grad_alpha: npt.ArrayLike | None = None) -> Array:
        """Backward pass of the last call.

        Stores the gradients of ``W``, ``v`` and ``b`` (summed over the
        batch) for :meth:`grads`, replacing those of any earlier backward.

        Parameters
        ----------
        grad_out : array_like (..., H)
            Gradient of the loss with respect to the output.
        grad_alpha : array_like (..., T), optional
            Gradient of the loss with respect to :attr:`attention_weights`,
            if the loss uses them.

        Returns
        -------
        dh : ndarray (..., T, H)
            Gradient with respect to ``h``; 0 for masked items.
        """
        h, mask, act, alpha = _last_call(self._cache)
        g = context_attention_backward(grad_out, h, self.W, self.v, alpha,
                                       b=self.b, mask=mask,
                                       grad_alpha=grad_alpha,
                                       activations=act)
        self._store_grads(g)
        return g.h

    def _config(self) -> str:
        return (f"hidden_size={self.hidden_size}, "
                f"attention_size={self.attention_size}, "
                f"bias={self.b is not None}")
