"""A small stateful NumPy layer around the fused kernels, and optimiser steps.

:class:`ContextAttention` holds the parameters ``W``, ``v``, ``b``, remembers
what its backward needs from the last call, and stores the parameter
gradients of the last backward.  :func:`sgd_step` and :func:`adam_step`
update a dict of parameters in place from a dict of gradients, so a NumPy
training loop is::

    layer = ContextAttention(H, A, seed=0)
    out = layer(h, mask)                   # (..., H)
    dh = layer.backward(dL_dout)           # (..., T, H); layer.grads() filled
    adam_step(layer.parameters(), layer.grads(), state, lr=1e-3)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import context_attention, context_attention_backward

__all__ = ["ContextAttention", "sgd_step", "adam_step"]

Array = npt.NDArray[np.floating[Any]]

def _uniform(rng: np.random.Generator, bound: float, shape: tuple[int, ...],
             dtype: np.dtype[Any]) -> Array:
    """U(-bound, bound) drawn in float64 (the same numbers for every dtype),
    then cast."""
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


class ContextAttention:
    """Context-pooled additive attention as a trainable NumPy layer.

    ``out = sum_t alpha_t h_t`` with ``alpha = masked softmax of
    v . tanh(W_h h_t + W_c c + b)`` and ``c`` the mean of the valid
    ``h_t`` (SPEC.md section 1).  Forward and backward are one C call each.

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
        when the kernels can return them, for a faster backward at the cost
        of that memory (default True; ignored by kernels without the option).

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

    def __init__(self, hidden_size: int, attention_size: int,
                 bias: bool = True, dtype: npt.DTypeLike = np.float64,
                 seed: int | np.random.Generator | None = None,
                 keep_activations: bool = True) -> None:
        self.dtype: np.dtype[Any] = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got "
                            f"{self.dtype}")
        if hidden_size < 1 or attention_size < 1:
            raise ValueError(f"hidden_size and attention_size must be >= 1, "
                             f"got {hidden_size} and {attention_size}")
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
        self.attention_weights: Array | None = None
        self._grads: dict[str, Array] = {}
        self._cache: tuple[Array, Any, Array | None] | None = None

    # ------------------------------------------------------------------
    @classmethod
    def from_torch(cls, score: Any, out: Any,
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
            ``Linear(A, 1)``.
        dtype : dtype, optional
            Default: the dtype of ``score.weight`` (float32 or float64).
        keep_activations : bool, optional
            As in the constructor.
        """
        W = score.weight.detach().cpu().numpy()
        v = out.weight.detach().cpu().numpy()
        if W.ndim != 2 or W.shape[1] % 2:
            raise ValueError(f"score.weight has shape {W.shape}; expected "
                             f"(A, 2H) of a Linear(2H, A)")
        A, H = W.shape[0], W.shape[1] // 2
        if v.shape != (1, A):
            raise ValueError(f"out.weight has shape {v.shape}; expected "
                             f"(1, {A}) of a Linear({A}, 1) to match "
                             f"score.weight with shape {W.shape}")
        layer = cls(H, A, bias=score.bias is not None,
                    dtype=W.dtype if dtype is None else dtype,
                    keep_activations=keep_activations)
        layer.W = W.astype(layer.dtype)             # astype copies
        layer.v = v[0].astype(layer.dtype)
        if score.bias is not None:
            layer.b = score.bias.detach().cpu().numpy().astype(layer.dtype)
        return layer

    # ------------------------------------------------------------------
    def __call__(self, h: npt.ArrayLike,
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
            h, self.W, self.v, self.b, mask,
            keep_activations=self.keep_activations)
        self.attention_weights = alpha
        self._cache = (h, mask, act[0] if act else None)
        return out

    def backward(self, grad_out: npt.ArrayLike,
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
        if self._cache is None or self.attention_weights is None:
            raise RuntimeError("backward() called before the layer was "
                               "called on an input")
        h, mask, act = self._cache
        g = context_attention_backward(
            grad_out, h, self.W, self.v, self.attention_weights, self.b,
            mask, grad_alpha, activations=act)
        self._grads = {"W": g.W, "v": g.v}
        if g.b is not None:
            self._grads["b"] = g.b
        return g.h

    # ------------------------------------------------------------------
    def parameters(self) -> dict[str, Array]:
        """The parameters by name: ``W``, ``v`` and (with a bias) ``b``.

        The arrays themselves, not copies, so that :func:`sgd_step` and
        :func:`adam_step` update the layer in place.
        """
        params = {"W": self.W, "v": self.v}
        if self.b is not None:
            params["b"] = self.b
        return params

    def grads(self) -> dict[str, Array]:
        """The gradients of the last :meth:`backward`, keyed like
        :meth:`parameters` (empty before the first backward)."""
        return dict(self._grads)

    def __repr__(self) -> str:
        return (f"ContextAttention(hidden_size={self.hidden_size}, "
                f"attention_size={self.attention_size}, "
                f"bias={self.b is not None}, dtype={self.dtype.name})")


# --------------------------------------------------------------------------
# Optimiser steps over dicts of arrays, updating the parameters in place.

def _check_keys(params: dict[str, Array], grads: dict[str, Array]) -> None:
    missing = set(params) - set(grads)
    if missing:
        raise KeyError(f"no gradient for parameter(s) {sorted(missing)}; "
                       f"call backward() before the step")


def sgd_step(params: dict[str, Array], grads: dict[str, Array],
             lr: float = 0.01) -> None:
    """One plain SGD step, in place: ``p -= lr * g`` for every parameter.

    Parameters
    ----------
    params : dict of ndarray
        E.g. ``layer.parameters()``; updated in place.
    grads : dict of ndarray
        Same keys, e.g. ``layer.grads()``.
    lr : float
        Learning rate.
    """
    _check_keys(params, grads)
    for name, p in params.items():
        p -= lr * grads[name]


def adam_step(params: dict[str, Array], grads: dict[str, Array],
              state: dict[str, Any], lr: float = 1e-3,
              betas: tuple[float, float] = (0.9, 0.999),
              eps: float = 1e-8) -> None:
    """One Adam step (Kingma & Ba, as ``torch.optim.Adam``), in place.

    ``m = b1 m + (1 - b1) g``, ``s = b2 s + (1 - b2) g^2``, then
    ``p -= lr * m_hat / (sqrt(s_hat) + eps)`` with the bias corrections
    ``m_hat = m / (1 - b1^t)`` and ``s_hat = s / (1 - b2^t)``.

    Parameters
    ----------
    params : dict of ndarray
        Updated in place.
    grads : dict of ndarray
        Same keys.
    state : dict
        The optimiser's memory: pass the same dict (empty at first) to every
        step.  It holds the step count ``t`` and the moments per parameter.
    lr, betas, eps : float
        As in ``torch.optim.Adam``.
    """
    _check_keys(params, grads)
    b1, b2 = betas
    t = state["t"] = state.get("t", 0) + 1
    for name, p in params.items():
        g = grads[name]
        m = state.setdefault("m", {}).setdefault(name, np.zeros_like(p))
        s = state.setdefault("s", {}).setdefault(name, np.zeros_like(p))
        m *= b1
        m += (1 - b1) * g
        s *= b2
        s += (1 - b2) * g * g
        denom = np.sqrt(s / (1 - b2 ** t)) + eps
        p -= (lr / (1 - b1 ** t)) * m / denom
