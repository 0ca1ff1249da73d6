"""Plain NumPy reference for every attention_c kernel.

This package is meant to be *read*: each function is one step of a layer,
written the way the maths is written in ``docs/contract.md``, with the
shapes in the comments.  The C kernels must agree with it; the tests check
that they do.  Every public function has the name and the arguments of
its C-backed counterpart in :mod:`attention_c`.  By subject:

- :mod:`.pooled`: the context-pooled layer (contract sections 1 and 2),
  its building blocks and the whole layer written out once more;
- :mod:`.family`: the attention family, a query against keys with the
  additive, dot or general score (sections 4 and 5);
- :mod:`.masks`: which keys a query sees (mask, attn_mask, causal, a
  -inf bias), the masked softmax and sums that padding cannot reach;
- :mod:`.dropout`: the dropout keep bits, Philox4x32-10;
- :mod:`.multihead`: multi-head attention, one head at a time (section 7);
- :mod:`.cache`: attention against a key-value cache, contiguous or
  paged, with the new keys and values appended in place (decoding);
  int8 caches with a scale per group (quantize_kv, dequantize_kv).
"""

from .cache import cache_attention, dequantize_kv, quantize_kv
from .dropout import dropout_keep, philox4x32
from .family import (additive_attention, additive_attention_backward,
                     dot_attention, dot_attention_backward,
                     general_attention, general_attention_backward,
                     project_keys, project_keys_backward)
from .multihead import multi_head_attention
# (_preactivation, the pooled layer's z_t, for tests/kernels/test_fast.py)
from .pooled import (_preactivation, additive_score, additive_score_backward,
                     context_attention, context_attention_backward,
                     masked_softmax, masked_softmax_backward, mean_context,
                     mean_context_backward, weighted_sum,
                     weighted_sum_backward)
from .scores import (cosine_attention, cosine_attention_backward,
                     location_attention, location_attention_backward)

__all__ = [
    "mean_context", "mean_context_backward",
    "additive_score", "additive_score_backward",
    "masked_softmax", "masked_softmax_backward",
    "weighted_sum", "weighted_sum_backward",
    "context_attention", "context_attention_backward",
    "additive_attention", "additive_attention_backward",
    "dot_attention", "dot_attention_backward",
    "general_attention", "general_attention_backward",
    "project_keys", "project_keys_backward",
    "location_attention", "location_attention_backward",
    "cosine_attention", "cosine_attention_backward",
    "philox4x32", "dropout_keep", "multi_head_attention",
    "cache_attention", "quantize_kv", "dequantize_kv",
]
