"""What the NumPy layers share: argument checks, the initialisation's
draws, and the base class that holds a layer's parameters and gradients."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.floating[Any]]
_T = TypeVar("_T")


def _uniform(rng: np.random.Generator, bound: float, shape: tuple[int, ...],
             dtype: np.dtype[Any]) -> Array:
    """U(-bound, bound) drawn in float64 (the same numbers for every dtype),
    then cast."""
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


def _float_dtype(dtype: npt.DTypeLike) -> np.dtype[Any]:
    """float32 or float64 as a dtype; TypeError for anything else."""
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64, got {dt}")
    return dt


def _positive(**sizes: int) -> None:
    """ValueError unless every size is >= 1."""
    if min(sizes.values()) < 1:
        names = ", ".join(sizes)
        raise ValueError(f"{names} must be >= 1, got "
                         f"{', '.join(map(str, sizes.values()))}")


def _dropout_p(p: float) -> float:
    """The dropout probability, checked: 0 <= p < 1."""
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p}")
    return p


def _dropout_config(p: float) -> str:
    return f", dropout={p}" if p else ""


def _last_call(cache: _T | None) -> _T:
    """What the last call kept for the backward; an error before any call."""
    if cache is None:
        raise RuntimeError("backward() called before the layer was called "
                           "on an input")
    return cache


# --------------------------------------------------------------------------
# The base class of the context-pooled and family layers

class _Layer:
    """A float dtype, the parameters by name (the live arrays), the
    gradients of the last backward and the weights of the last call."""

    _param_names: tuple[str, ...] = ()

    def __init__(self, dtype: npt.DTypeLike) -> None:
        self.dtype: np.dtype[Any] = _float_dtype(dtype)
        self.attention_weights: Array | None = None
        self._grads: dict[str, Array] = {}

    def parameters(self) -> dict[str, Array]:
        """The parameters by name (those of the layer that are not None).

        The arrays themselves, not copies, so that :func:`sgd_step` and
        :func:`adam_step` update the layer in place.
        """
        return {name: p for name in self._param_names
                if (p := getattr(self, name)) is not None}

    def grads(self) -> dict[str, Array]:
        """The gradients of the last :meth:`backward`, keyed like
        :meth:`parameters` (empty before the first backward)."""
        return dict(self._grads)

    def _store_grads(self, grads: Any) -> None:
        """Keep the parameter fields of a gradient tuple (replacing any
        earlier ones)."""
        self._grads = {name: g for name in self._param_names
                       if (g := getattr(grads, name)) is not None}

    def _config(self) -> str:
        return ""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self._config()}, "
                f"dtype={self.dtype.name})")


# --------------------------------------------------------------------------
# Checks of the multi-head layer's inputs

def _check_array(x: npt.ArrayLike, name: str) -> np.ndarray[Any, Any]:
    """``x`` as an array of real numbers (ml_dtypes' bfloat16 among them,
    known by name: ml_dtypes is optional); TypeError naming it
    otherwise."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu" and arr.dtype.name != "bfloat16":
        raise TypeError(f"{name} must be an array of real numbers, got "
                        f"dtype {arr.dtype}")
    return arr


def _bool_mask(x: npt.ArrayLike, name: str) -> np.ndarray[Any, Any]:
    arr = np.asarray(x)
    if arr.dtype != np.bool_:
        extra = (" (for a float mask added to the scores, add it to the "
                 "scores yourself or use attention_c.dot_attention's bias=;"
                 " PyTorch's nn.MultiheadAttention masks mean True = "
                 "masked, ours True = valid: pass ~mask)"
                 if name == "attn_mask" else " (True = valid key)")
        raise TypeError(f"{name} must be a boolean array, got dtype "
                        f"{arr.dtype}{extra}")
    return arr


def _broadcasts_into(shape: tuple[int, ...], target: tuple[int, ...]
                     ) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without adding to it."""
    if len(shape) > len(target):
        return False
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False
