"""PyTorch adapter: the C kernels as differentiable functions and
nn.Modules.

Imported only on demand (``import attention_c.torch``), so torch stays an
optional dependency of attention_c.  CPU tensors of float32 or float64 are
handed to the kernels without copying (``tensor.numpy()`` shares memory) and
the results come back with ``torch.from_numpy`` (no copy either)::

    from attention_c.torch import ContextAttention
    pool = ContextAttention(hidden_size=64, attention_size=32)
    out = pool(h, mask=mask)     # h (B, T, 64), mask (B, T) bool, True = valid

The attention family (docs/contract.md section 4) attends from queries to keys:
:class:`AdditiveAttention`, :class:`DotAttention`, :class:`GeneralAttention`
(and the functions :func:`additive_attention`, :func:`dot_attention`,
:func:`general_attention`)::

    attn = AdditiveAttention(key_size=64, query_size=32, attention_size=48)
    out = attn(query, keys, mask=mask)     # query (B, 32), keys (B, T, 64)

and the location and content scores (:mod:`attention_c.torch.scores`):
:class:`LocationAttention` (Luong's ``softmax(W q + b)`` over the source
positions) and :class:`CosineAttention` (``beta cos(q, k)``, the Neural
Turing Machine's content addressing), and :func:`location_attention`,
:func:`cosine_attention`.

Self-attention at scale (contract section 5): ``mask`` is the key mask
(..., T) only, ``attn_mask`` the per-query boolean mask (True = may attend,
as in ``F.scaled_dot_product_attention``), ``causal=True`` (bottom-right
aligned), ``bias`` a differentiable float tensor added to the scores,
``dropout`` with ``seed`` (the modules draw the seed from torch's default
generator in training mode), and ``return_weights=False`` for ``(out,
lse)`` without ever forming the (..., Tq, T) weights::

    attn = DotAttention(dropout=0.1)
    out = attn(x, x, causal=True, bias=alibi)      # x (B, heads, T, d)

Required data (and a function's parameters) go by position, everything
optional by keyword: ``module(h, *, mask=None)``, ``module(query, keys, *,
values=None, mask=None, key_proj=None)``, and the functions have the
signatures of their NumPy counterparts in :mod:`attention_c`.

The kernels are PyTorch custom operators (``torch.ops.attention_c.*``,
registered with ``torch.library.custom_op``), each with a fake (shape-only)
implementation, an autograd formula and a vmap rule, so the functions and
modules work under ``torch.compile(fullgraph=True)``, ``torch.export``,
``torch.func`` (grad, vjp, jvp, jacrev, jacfwd, hessian, vmap) and on 'meta'
tensors.  First-order gradients are the C backward; higher-order ones
(``create_graph=True``, Hessians, gradient penalties) differentiate a
PyTorch transcription of docs/contract.md and are exact.  bfloat16 and
float16 are computed in float32 and returned in their dtype; under
``torch.autocast('cpu')`` the layers compute in float32 and return float32.

FlashAttention-2's ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache`` (:mod:`attention_c.torch.flash_attn_interface`)
run code written for flash_attn on the CPU by changing the import: (B, T,
heads, d) layouts, packed sequences, key-value caches (paged too) written
in place, sliding windows, soft-capping, ALiBi, grouped queries, and
attention sinks.

The package is laid out as PyTorch's own: :mod:`attention_c.torch.functional`
(as ``torch.nn.functional``) and :mod:`attention_c.torch.modules` (as
``torch.nn.modules``), and :mod:`attention_c.torch.scores` (the location
and cosine scores' functions and modules), all re-exported here; the
operators' registration is private (``_ops`` and ``_scores_ops``, their
autograd in ``_autograd``, the pure-PyTorch transcriptions in ``_pure``).
"""

import torch

from .flash_attn_interface import (flash_attn_func, flash_attn_varlen_func,
                                   flash_attn_with_kvcache)
from .functional import (additive_attention, context_attention,
                         dot_attention, general_attention, project_keys,
                         scaled_dot_product_attention)
from .modules import (AdditiveAttention, ContextAttention, DotAttention,
                      GeneralAttention)
from .multihead import KVCache, MultiheadAttention
from .scores import (CosineAttention, LocationAttention, cosine_attention,
                     location_attention)

__all__ = ["context_attention", "ContextAttention",
           "additive_attention", "AdditiveAttention",
           "dot_attention", "DotAttention",
           "general_attention", "GeneralAttention", "project_keys",
           "location_attention", "LocationAttention",
           "cosine_attention", "CosineAttention",
           "scaled_dot_product_attention", "MultiheadAttention", "KVCache",
           "flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache"]

# torch.fx.symbolic_trace records calls of the functions looked up here
# (attention_c.torch.dot_attention(...)) as leaves, run at call time: its
# proxies carry no data for the checks and the kernels.
for _name in ("context_attention", "additive_attention", "dot_attention",
              "general_attention", "project_keys", "location_attention",
              "cosine_attention",
              "scaled_dot_product_attention", "flash_attn_func",
              "flash_attn_varlen_func", "flash_attn_with_kvcache"):
    torch.fx.wrap(_name)
del _name
