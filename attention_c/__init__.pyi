# Type stubs of the public API of attention_c (the functions are thin
# wrappers of the C extension _core, which has no annotations of its own).
# tests/test_typing.py checks these against the runtime with mypy.stubtest.
from typing import IO, Any, Literal, NamedTuple, overload

import numpy as np
import numpy.typing as npt

from ._version import __version__ as __version__
from .layer import ContextAttention as ContextAttention
from .layer import adam_step as adam_step
from .layer import sgd_step as sgd_step

__all__ = [
    "mean_context", "mean_context_backward",
    "additive_score", "additive_score_backward",
    "masked_softmax", "masked_softmax_backward",
    "weighted_sum", "weighted_sum_backward",
    "context_attention", "context_attention_backward",
    "AttentionGrads", "set_num_threads", "get_num_threads", "show_config",
    "__version__",
    "ContextAttention", "sgd_step", "adam_step",
]

_Array = npt.NDArray[np.floating[Any]]
_Mask = npt.ArrayLike | None

class AttentionGrads(NamedTuple):
    h: _Array
    W: _Array
    v: _Array
    b: _Array | None

def mean_context(h: npt.ArrayLike, mask: _Mask = None) -> _Array: ...
def mean_context_backward(grad_c: npt.ArrayLike, h: npt.ArrayLike,
                          mask: _Mask = None) -> _Array: ...
def additive_score(h: npt.ArrayLike, context: npt.ArrayLike,
                   W: npt.ArrayLike, v: npt.ArrayLike,
                   b: npt.ArrayLike | None = None) -> _Array: ...
def additive_score_backward(
    grad_s: npt.ArrayLike, h: npt.ArrayLike, context: npt.ArrayLike,
    W: npt.ArrayLike, v: npt.ArrayLike, b: npt.ArrayLike | None = None,
) -> tuple[_Array, _Array, _Array, _Array, _Array | None]: ...
def masked_softmax(scores: npt.ArrayLike, mask: _Mask = None) -> _Array: ...
def masked_softmax_backward(grad_alpha: npt.ArrayLike,
                            alpha: npt.ArrayLike) -> _Array: ...
def weighted_sum(alpha: npt.ArrayLike, h: npt.ArrayLike) -> _Array: ...
def weighted_sum_backward(grad_out: npt.ArrayLike, alpha: npt.ArrayLike,
                          h: npt.ArrayLike) -> tuple[_Array, _Array]: ...
@overload
def context_attention(h: npt.ArrayLike, W: npt.ArrayLike, v: npt.ArrayLike,
                      b: npt.ArrayLike | None = None,
                      mask: _Mask = None,
                      keep_activations: Literal[False] = False,
                      ) -> tuple[_Array, _Array]: ...
@overload
def context_attention(h: npt.ArrayLike, W: npt.ArrayLike, v: npt.ArrayLike,
                      b: npt.ArrayLike | None = None,
                      mask: _Mask = None, *,
                      keep_activations: Literal[True],
                      ) -> tuple[_Array, _Array, _Array]: ...
@overload
def context_attention(h: npt.ArrayLike, W: npt.ArrayLike, v: npt.ArrayLike,
                      b: npt.ArrayLike | None = None,
                      mask: _Mask = None, keep_activations: bool = ...,
                      ) -> tuple[_Array, ...]: ...
def context_attention_backward(
    grad_out: npt.ArrayLike, h: npt.ArrayLike, W: npt.ArrayLike,
    v: npt.ArrayLike, alpha: npt.ArrayLike, b: npt.ArrayLike | None = None,
    mask: _Mask = None, grad_alpha: npt.ArrayLike | None = None,
    activations: npt.ArrayLike | None = None,
) -> AttentionGrads: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def show_config(file: IO[str] | None = None) -> dict[str, Any]: ...
