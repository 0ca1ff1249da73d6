# Type stubs of the public API of attention_c (the functions are the C
# functions of the extension _core, which has no annotations of its own).
# tests/test_typing.py checks these against the runtime with mypy.stubtest,
# tests/binding/test_argument_table.py against the binding's table.
from contextlib import AbstractContextManager
from typing import IO, Any, Literal, NamedTuple, overload

import numpy as np
import numpy.typing as npt

from ._version import __version__ as __version__
from .layers import AdditiveAttention as AdditiveAttention
from .layers import AttentionInputGrads as AttentionInputGrads
from .layers import ContextAttention as ContextAttention
from .layers import DotAttention as DotAttention
from .layers import GeneralAttention as GeneralAttention
from .optim import adam_step as adam_step
from .optim import sgd_step as sgd_step
from .layers import KVCache as KVCache
from .layers import MultiHeadAttention as MultiHeadAttention
from .layers import MultiHeadInputGrads as MultiHeadInputGrads
from .layers import CosineAttention as CosineAttention
from .layers import LocationAttention as LocationAttention
from .layers import LocationInputGrads as LocationInputGrads

__all__ = [
    "mean_context", "mean_context_backward",
    "additive_score", "additive_score_backward",
    "masked_softmax", "masked_softmax_backward",
    "weighted_sum", "weighted_sum_backward",
    "context_attention", "context_attention_backward",
    "AttentionGrads", "set_num_threads", "get_num_threads", "show_config",
    "set_fp32_precision", "get_fp32_precision",
    "__version__",
    "additive_attention", "additive_attention_backward",
    "dot_attention", "dot_attention_backward",
    "general_attention", "general_attention_backward",
    "location_attention", "location_attention_backward",
    "cosine_attention", "cosine_attention_backward",
    "LocationAttentionGrads", "CosineAttentionGrads",
    "project_keys", "project_keys_backward",
    "AdditiveAttentionGrads", "DotAttentionGrads", "GeneralAttentionGrads",
    "ContextAttention", "sgd_step", "adam_step",
    "AdditiveAttention", "DotAttention", "GeneralAttention",
    "AttentionInputGrads",
    "MultiHeadAttention", "MultiHeadInputGrads", "KVCache",
    "LocationAttention", "CosineAttention", "LocationInputGrads",
    "cache_attention", "quantize_kv", "dequantize_kv",
]

_Array = npt.NDArray[np.floating[Any]]
_Mask = npt.ArrayLike | None

class AttentionGrads(NamedTuple):
    h: _Array
    W: _Array
    v: _Array
    b: _Array | None

def mean_context(h: npt.ArrayLike, *, mask: _Mask = None) -> _Array: ...
def mean_context_backward(grad_c: npt.ArrayLike, h: npt.ArrayLike,
                          *, mask: _Mask = None) -> _Array: ...
def additive_score(h: npt.ArrayLike, context: npt.ArrayLike,
                   W: npt.ArrayLike, v: npt.ArrayLike,
                   *, b: npt.ArrayLike | None = None) -> _Array: ...
def additive_score_backward(
    grad_s: npt.ArrayLike, h: npt.ArrayLike, context: npt.ArrayLike,
    W: npt.ArrayLike, v: npt.ArrayLike, *, b: npt.ArrayLike | None = None,
) -> tuple[_Array, _Array, _Array, _Array, _Array | None]: ...
def masked_softmax(scores: npt.ArrayLike, *, mask: _Mask = None) -> _Array: ...
def masked_softmax_backward(grad_alpha: npt.ArrayLike,
                            alpha: npt.ArrayLike) -> _Array: ...
def weighted_sum(alpha: npt.ArrayLike, h: npt.ArrayLike) -> _Array: ...
def weighted_sum_backward(grad_out: npt.ArrayLike, alpha: npt.ArrayLike,
                          h: npt.ArrayLike) -> tuple[_Array, _Array]: ...
@overload
def context_attention(h: npt.ArrayLike, W: npt.ArrayLike, v: npt.ArrayLike,
                      *, b: npt.ArrayLike | None = None,
                      mask: _Mask = None,
                      keep_activations: Literal[False] = False,
                      ) -> tuple[_Array, _Array]: ...
@overload
def context_attention(h: npt.ArrayLike, W: npt.ArrayLike, v: npt.ArrayLike,
                      *, b: npt.ArrayLike | None = None,
                      mask: _Mask = None,
                      keep_activations: Literal[True],
                      ) -> tuple[_Array, _Array, _Array]: ...
@overload
def context_attention(h: npt.ArrayLike, W: npt.ArrayLike, v: npt.ArrayLike,
                      *, b: npt.ArrayLike | None = None,
                      mask: _Mask = None, keep_activations: bool = ...,
                      ) -> tuple[_Array, ...]: ...
def context_attention_backward(
    grad_out: npt.ArrayLike, h: npt.ArrayLike, W: npt.ArrayLike,
    v: npt.ArrayLike, alpha: npt.ArrayLike, *, b: npt.ArrayLike | None = None,
    mask: _Mask = None, grad_alpha: npt.ArrayLike | None = None,
    activations: npt.ArrayLike | None = None,
) -> AttentionGrads: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def show_config(file: IO[str] | None = None) -> dict[str, Any]: ...

def set_fp32_precision(
    precision: Literal["ieee", "bf16"],
) -> AbstractContextManager[Any]: ...
def get_fp32_precision() -> Literal["ieee", "bf16"]: ...

# The attention family (docs/contract.md sections 4 and 5)

class AdditiveAttentionGrads(NamedTuple):
    query: _Array
    keys: _Array
    values: _Array | None
    W: _Array
    v: _Array
    b: _Array | None

class DotAttentionGrads(NamedTuple):
    query: _Array
    keys: _Array
    values: _Array | None
    bias: _Array | None
    alibi_slopes: _Array | None
    sinks: _Array | None

class GeneralAttentionGrads(NamedTuple):
    query: _Array
    keys: _Array
    values: _Array | None
    W: _Array
    bias: _Array | None
    alibi_slopes: _Array | None
    sinks: _Array | None

class LocationAttentionGrads(NamedTuple):
    query: _Array
    values: _Array
    W: _Array
    b: _Array | None

class CosineAttentionGrads(NamedTuple):
    query: _Array
    keys: _Array
    values: _Array | None
    sharpness: _Array | None
    bias: _Array | None
    alibi_slopes: _Array | None
    sinks: _Array | None

_Opt = npt.ArrayLike | None

def additive_attention(
    query: npt.ArrayLike, keys: npt.ArrayLike, W: npt.ArrayLike,
    v: npt.ArrayLike, *, b: _Opt = None, mask: _Mask = None,
    attn_mask: _Mask = None, causal: bool = False, values: _Opt = None,
    key_proj: _Opt = None,
) -> tuple[_Array, _Array]: ...
@overload
def additive_attention_backward(
    grad_out: npt.ArrayLike, query: npt.ArrayLike, keys: npt.ArrayLike,
    W: npt.ArrayLike, v: npt.ArrayLike, alpha: npt.ArrayLike,
    *, b: _Opt = None, mask: _Mask = None, attn_mask: _Mask = None,
    causal: bool = False, values: _Opt = None, grad_alpha: _Opt = None,
    key_proj: _Opt = None, stop_at_key_proj: Literal[False] = False,
) -> AdditiveAttentionGrads: ...
@overload
def additive_attention_backward(
    grad_out: npt.ArrayLike, query: npt.ArrayLike, keys: npt.ArrayLike,
    W: npt.ArrayLike, v: npt.ArrayLike, alpha: npt.ArrayLike,
    *, b: _Opt = None, mask: _Mask = None, attn_mask: _Mask = None,
    causal: bool = False, values: _Opt = None, grad_alpha: _Opt = None,
    key_proj: _Opt = None, stop_at_key_proj: Literal[True],
) -> tuple[AdditiveAttentionGrads, _Array]: ...
@overload
def additive_attention_backward(
    grad_out: npt.ArrayLike, query: npt.ArrayLike, keys: npt.ArrayLike,
    W: npt.ArrayLike, v: npt.ArrayLike, alpha: npt.ArrayLike,
    *, b: _Opt = None, mask: _Mask = None, attn_mask: _Mask = None,
    causal: bool = False, values: _Opt = None, grad_alpha: _Opt = None,
    key_proj: _Opt = None, stop_at_key_proj: bool = ...,
) -> AdditiveAttentionGrads | tuple[AdditiveAttentionGrads, _Array]: ...

# return_weights=True returns (out, alpha), False (out, lse): both arrays.
def dot_attention(
    query: npt.ArrayLike, keys: npt.ArrayLike, *, mask: _Mask = None,
    attn_mask: _Mask = None, causal: bool = False, bias: _Opt = None,
    dropout: float = 0.0, seed: int | None = None, values: _Opt = None,
    scale: float | None = None, return_weights: bool = True,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: _Opt = None,
    sinks: _Opt = None, cu_seqlens_q: _Opt = None,
    cu_seqlens_k: _Opt = None,
) -> tuple[_Array, _Array]: ...
def dot_attention_backward(
    grad_out: npt.ArrayLike, query: npt.ArrayLike, keys: npt.ArrayLike,
    alpha: _Opt = None, *, out: _Opt = None, lse: _Opt = None,
    mask: _Mask = None, attn_mask: _Mask = None, causal: bool = False,
    bias: _Opt = None, dropout: float = 0.0, seed: int | None = None,
    values: _Opt = None, scale: float | None = None,
    grad_alpha: _Opt = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: _Opt = None,
    sinks: _Opt = None, cu_seqlens_q: _Opt = None,
    cu_seqlens_k: _Opt = None,
) -> DotAttentionGrads: ...
def general_attention(
    query: npt.ArrayLike, keys: npt.ArrayLike, W: npt.ArrayLike,
    *, mask: _Mask = None, attn_mask: _Mask = None, causal: bool = False,
    bias: _Opt = None, dropout: float = 0.0, seed: int | None = None,
    values: _Opt = None, key_proj: _Opt = None,
    return_weights: bool = True,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: _Opt = None,
    sinks: _Opt = None, cu_seqlens_q: _Opt = None,
    cu_seqlens_k: _Opt = None,
) -> tuple[_Array, _Array]: ...
@overload
def general_attention_backward(
    grad_out: npt.ArrayLike, query: npt.ArrayLike, keys: npt.ArrayLike,
    W: npt.ArrayLike, alpha: _Opt = None, *, out: _Opt = None,
    lse: _Opt = None, mask: _Mask = None, attn_mask: _Mask = None,
    causal: bool = False, bias: _Opt = None, dropout: float = 0.0,
    seed: int | None = None, values: _Opt = None, grad_alpha: _Opt = None,
    key_proj: _Opt = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: _Opt = None,
    sinks: _Opt = None, cu_seqlens_q: _Opt = None,
    cu_seqlens_k: _Opt = None,
    stop_at_key_proj: Literal[False] = False,
) -> GeneralAttentionGrads: ...
@overload
def general_attention_backward(
    grad_out: npt.ArrayLike, query: npt.ArrayLike, keys: npt.ArrayLike,
    W: npt.ArrayLike, alpha: _Opt = None, *, out: _Opt = None,
    lse: _Opt = None, mask: _Mask = None, attn_mask: _Mask = None,
    causal: bool = False, bias: _Opt = None, dropout: float = 0.0,
    seed: int | None = None, values: _Opt = None, grad_alpha: _Opt = None,
    key_proj: _Opt = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: _Opt = None,
    sinks: _Opt = None, cu_seqlens_q: _Opt = None,
    cu_seqlens_k: _Opt = None,
    stop_at_key_proj: Literal[True],
) -> tuple[GeneralAttentionGrads, _Array]: ...
@overload
def general_attention_backward(
    grad_out: npt.ArrayLike, query: npt.ArrayLike, keys: npt.ArrayLike,
    W: npt.ArrayLike, alpha: _Opt = None, *, out: _Opt = None,
    lse: _Opt = None, mask: _Mask = None, attn_mask: _Mask = None,
    causal: bool = False, bias: _Opt = None, dropout: float = 0.0,
    seed: int | None = None, values: _Opt = None, grad_alpha: _Opt = None,
    key_proj: _Opt = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: _Opt = None,
    sinks: _Opt = None, cu_seqlens_q: _Opt = None,
    cu_seqlens_k: _Opt = None,
    stop_at_key_proj: bool = ...,
) -> GeneralAttentionGrads | tuple[GeneralAttentionGrads, _Array]: ...
def location_attention(
    query: npt.ArrayLike, values: npt.ArrayLike, W: npt.ArrayLike,
    *, b: _Opt = None, mask: _Mask = None, attn_mask: _Mask = None,
) -> tuple[_Array, _Array]: ...
def location_attention_backward(
    grad_out: npt.ArrayLike, query: npt.ArrayLike, values: npt.ArrayLike,
    W: npt.ArrayLike, alpha: npt.ArrayLike, *, b: _Opt = None,
    mask: _Mask = None, attn_mask: _Mask = None, grad_alpha: _Opt = None,
) -> LocationAttentionGrads: ...
def cosine_attention(
    query: npt.ArrayLike, keys: npt.ArrayLike, *, mask: _Mask = None,
    attn_mask: _Mask = None, causal: bool = False, bias: _Opt = None,
    dropout: float = 0.0, seed: int | None = None, values: _Opt = None,
    sharpness: float | npt.ArrayLike | None = None,
    return_weights: bool = True,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: _Opt = None,
    sinks: _Opt = None, cu_seqlens_q: _Opt = None,
    cu_seqlens_k: _Opt = None,
) -> tuple[_Array, _Array]: ...
def cosine_attention_backward(
    grad_out: npt.ArrayLike, query: npt.ArrayLike, keys: npt.ArrayLike,
    alpha: _Opt = None, *, out: _Opt = None, lse: _Opt = None,
    mask: _Mask = None, attn_mask: _Mask = None, causal: bool = False,
    bias: _Opt = None, dropout: float = 0.0, seed: int | None = None,
    values: _Opt = None, sharpness: float | npt.ArrayLike | None = None,
    grad_alpha: _Opt = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: _Opt = None,
    sinks: _Opt = None, cu_seqlens_q: _Opt = None,
    cu_seqlens_k: _Opt = None,
) -> CosineAttentionGrads: ...
def project_keys(keys: npt.ArrayLike, W: npt.ArrayLike) -> _Array: ...
def project_keys_backward(grad_proj: npt.ArrayLike, keys: npt.ArrayLike,
                          W: npt.ArrayLike) -> tuple[_Array, _Array]: ...

@overload
def cache_attention(
    query: npt.ArrayLike, k_cache: np.ndarray[Any, Any],
    v_cache: np.ndarray[Any, Any], cache_seqlens: npt.ArrayLike, *,
    k: npt.ArrayLike | None = None, v: npt.ArrayLike | None = None,
    block_table: npt.ArrayLike | None = None,
    k_scales: np.ndarray[Any, Any] | None = None,
    v_scales: np.ndarray[Any, Any] | None = None, scale: float | None = None,
    causal: bool = True, window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: npt.ArrayLike | None = None,
    sinks: npt.ArrayLike | None = None,
    return_lse: Literal[False] = False) -> _Array: ...
@overload
def cache_attention(
    query: npt.ArrayLike, k_cache: np.ndarray[Any, Any],
    v_cache: np.ndarray[Any, Any], cache_seqlens: npt.ArrayLike, *,
    k: npt.ArrayLike | None = None, v: npt.ArrayLike | None = None,
    block_table: npt.ArrayLike | None = None,
    k_scales: np.ndarray[Any, Any] | None = None,
    v_scales: np.ndarray[Any, Any] | None = None, scale: float | None = None,
    causal: bool = True, window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: npt.ArrayLike | None = None,
    sinks: npt.ArrayLike | None = None,
    return_lse: Literal[True]) -> tuple[_Array, _Array]: ...
@overload
def cache_attention(
    query: npt.ArrayLike, k_cache: np.ndarray[Any, Any],
    v_cache: np.ndarray[Any, Any], cache_seqlens: npt.ArrayLike, *,
    k: npt.ArrayLike | None = None, v: npt.ArrayLike | None = None,
    block_table: npt.ArrayLike | None = None,
    k_scales: np.ndarray[Any, Any] | None = None,
    v_scales: np.ndarray[Any, Any] | None = None, scale: float | None = None,
    causal: bool = True, window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None, alibi_slopes: npt.ArrayLike | None = None,
    sinks: npt.ArrayLike | None = None,
    return_lse: bool = False) -> _Array | tuple[_Array, _Array]: ...
def quantize_kv(x: npt.ArrayLike, group: int = 32,
                scale_dtype: npt.DTypeLike = np.float32
                ) -> tuple[npt.NDArray[np.int8],
                           npt.NDArray[np.floating[Any]]]: ...
def dequantize_kv(q: npt.ArrayLike, scales: npt.ArrayLike
                  ) -> npt.NDArray[np.float32]: ...
