"""attention_c: fast, exact attention and its gradients for NumPy, in C.

For a sequence of states ``h`` (T, H) with an optional validity mask, the
context-pooled layer is::

    c       = mean of the valid h_t                       (H,)
    s_t     = v . tanh(W_h h_t + W_c c + b)                (T,)
    alpha   = softmax of s over the valid items            (T,)
    out     = sum_t alpha_t h_t                            (H,)

with ``W = [W_h | W_c]`` of shape (A, 2H), the layout of
``torch.nn.Linear(2H, A).weight``.  The attention family scores queries
against keys (additive, dot or general score), takes the masked softmax and
averages values.  Every step is a C kernel with its backward; the fused
functions run a whole layer in one call each way.

All functions take array-likes with any number of leading batch axes,
never modify their inputs and return new arrays.  float32 and float64 are
computed natively; float16 and bfloat16 (``ml_dtypes``) in float32, and
returned in their dtype; other dtypes are promoted like ``np.result_type``
(integers compute in float64).  Masks are boolean,
True = valid.  A row with no valid item gives zeros, never NaN.

The required arguments come by position (data first, then parameters);
every optional one is keyword-only (``b=``, ``mask=``, ``values=``, ...).
``attention_c.reference`` holds a plain NumPy version of every function,
``attention_c.torch`` the PyTorch adapter, ``attention_c.dask`` the Dask one.
"""

import os as _os


def _not_built(exc):
    """ImportError for a missing C extension, saying why and what to do."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    if _os.path.exists(_os.path.join(root, "setup.py")):
        # NumPy says the same: the source folder shadows the installed
        # package (a plain `pip install .` builds the extension elsewhere).
        return ImportError(
            f"attention_c is imported from its source tree ({here}), where "
            "its C extension attention_c._core is not built.  The source "
            "folder shadows the installed package when Python runs from "
            f"{root}.  Either build it in place, with `pip install -e .` in "
            f"{root}, or run Python from another folder.")
    built = [f for f in _os.listdir(here) if f.startswith("_core.")]
    if built:                   # there, but it does not load: say why
        return ImportError(f"attention_c's C extension {built[0]} cannot "
                           f"be loaded: {exc}")
    return ImportError(
        f"attention_c's C extension attention_c._core is missing from "
        f"{here}: the package was not built.  Install it with `pip install "
        "attention_c` or, from a source tree, `pip install -e .`")


try:
    from . import _core
except ImportError as _exc:
    # from None: the message says it all; the chained ImportError would
    # add Python's "most likely due to a circular import" guess.
    raise _not_built(_exc) from None

from ._version import __version__  # noqa: E402

# Settings: SIMD path and threads (read from the environment at import),
# the products float32 calls may run on.
from ._config import (  # noqa: E402
    get_fp32_precision, get_num_threads, set_fp32_precision,
    set_num_threads, show_config,
)

# The C functions of the binding's table, with their docstrings and
# gradient tuples.
from ._functions import (  # noqa: E402
    # context-pooled attention: building blocks, each with its backward
    mean_context, mean_context_backward,
    additive_score, additive_score_backward,
    masked_softmax, masked_softmax_backward,
    weighted_sum, weighted_sum_backward,
    # ... and the fused layer, one call each way
    context_attention, context_attention_backward, AttentionGrads,
    # the attention family: queries scored against keys, values averaged
    additive_attention, additive_attention_backward, AdditiveAttentionGrads,
    dot_attention, dot_attention_backward, DotAttentionGrads,
    general_attention, general_attention_backward, GeneralAttentionGrads,
    # ... Luong's location score and the content (cosine) score
    location_attention, location_attention_backward, LocationAttentionGrads,
    cosine_attention, cosine_attention_backward, CosineAttentionGrads,
    # the keys' side of a score, once per sequence (decoder loops)
    project_keys, project_keys_backward,
)

# Trainable NumPy layers, built on the functions above (attention_c.layers;
# also importable from attention_c.layer and attention_c.multihead), and
# the optimiser steps.
from .layers import (  # noqa: E402
    AdditiveAttention, AttentionInputGrads, ContextAttention, DotAttention,
    GeneralAttention,
    # multi-head attention (heads read in place) and decoding with a cache
    KVCache, MultiHeadAttention, MultiHeadInputGrads,
    # the location and content (cosine) scores
    CosineAttention, LocationAttention, LocationInputGrads,
)
from .optim import adam_step, sgd_step  # noqa: E402
# decoding against a key/value cache, contiguous or paged, read in place
from .cache import cache_attention, dequantize_kv, quantize_kv  # noqa: E402

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
