"""Optimiser steps over dicts of NumPy arrays, updating the parameters in
place: the NumPy layers' ``parameters()`` with their ``grads()``.

    adam_step(layer.parameters(), layer.grads(), state, lr=1e-3)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._keywords import keyword_only

__all__ = ["sgd_step", "adam_step"]

Array = npt.NDArray[np.floating[Any]]


def _check(params: dict[str, Array], grads: dict[str, Array],
           lr: float) -> None:
    """Every parameter a floating ndarray with a gradient of its shape,
    and lr a number >= 0: checked before any is updated, so that a step
    that raises leaves every parameter as it was."""
    missing = set(params) - set(grads)
    if missing:
        raise KeyError(f"no gradient for parameter(s) {sorted(missing)}; "
                       f"call backward() before the step")
    for name, p in params.items():
        if not isinstance(p, np.ndarray) or p.dtype.kind != "f":
            raise TypeError(f"parameter {name!r} must be a floating NumPy "
                            f"array (updated in place), got "
                            f"{getattr(p, 'dtype', type(p).__name__)}")
        if np.shape(grads[name]) != p.shape:
            raise ValueError(f"the gradient of {name!r} has shape "
                             f"{np.shape(grads[name])}; expected the "
                             f"parameter's {p.shape}")
    _number("lr", lr, 0.0, None)


def _number(name: str, x: Any, lo: float, hi: float | None) -> float:
    """x as a float in [lo, hi) (hi None: no upper bound)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(
            x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    x = float(x)
    if not (x >= lo and (hi is None or x < hi)):
        raise ValueError(f"{name} must be in [{lo}, "
                         f"{'inf' if hi is None else hi}), got {x}")
    return x


@keyword_only
def sgd_step(params: dict[str, Array], grads: dict[str, Array], *,
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

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c import ContextAttention, sgd_step
    >>> layer = ContextAttention(4, 3, seed=0)
    >>> h = np.random.default_rng(1).standard_normal((2, 5, 4))
    >>> out = layer(h)
    >>> _ = layer.backward(2 * out / out.size)      # dL/dout of mean(out**2)
    >>> before = layer.W.copy()
    >>> sgd_step(layer.parameters(), layer.grads(), lr=0.1)
    >>> np.allclose(layer.W, before - 0.1 * layer.grads()["W"])
    True
    """
    _check(params, grads, lr)
    for name, p in params.items():
        p -= lr * grads[name]


@keyword_only
def adam_step(params: dict[str, Array], grads: dict[str, Array],
              state: dict[str, Any], *, lr: float = 1e-3,
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

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c import ContextAttention, adam_step
    >>> layer = ContextAttention(4, 3, seed=0)
    >>> h = np.random.default_rng(1).standard_normal((8, 5, 4))
    >>> target = np.zeros((8, 4))
    >>> state = {}                                  # Adam's memory
    >>> losses = []
    >>> for step in range(50):
    ...     out = layer(h)
    ...     losses.append(float(((out - target) ** 2).mean()))
    ...     _ = layer.backward(2 * (out - target) / out.size)
    ...     adam_step(layer.parameters(), layer.grads(), state, lr=1e-2)
    >>> state["t"], losses[-1] < losses[0]
    (50, True)
    """
    _check(params, grads, lr)
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise TypeError(f"betas must be a pair (beta1, beta2), got "
                        f"{betas!r}") from None
    b1 = _number("betas[0]", b1, 0.0, 1.0)
    b2 = _number("betas[1]", b2, 0.0, 1.0)
    if _number("eps", eps, 0.0, None) == 0:
        raise ValueError("eps must be > 0")
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
