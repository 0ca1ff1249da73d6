"""Small stateful NumPy layers around the kernels, and optimiser steps.

:class:`ContextAttention` pools a sequence with its own mean as the query;
:class:`AdditiveAttention`, :class:`DotAttention` and
:class:`GeneralAttention` attend from queries to keys, and
:class:`LocationAttention` and :class:`CosineAttention` score them by
position and by content (the attention family, docs/contract.md sections 4
and 9).  Each layer holds its parameters, remembers
what its backward needs from the last call, and stores the parameter
gradients of the last backward.  :func:`sgd_step` and :func:`adam_step`
update a dict of parameters in place from a dict of gradients, so a NumPy
training loop is::

    layer = ContextAttention(H, A, seed=0)
    out = layer(h, mask=mask)              # (..., H)
    dh = layer.backward(dL_dout)           # (..., T, H); layer.grads() filled
    adam_step(layer.parameters(), layer.grads(), state, lr=1e-3)

and the same for the family, whose backward returns the inputs' gradients::

    attn = AdditiveAttention(key_size=H, query_size=Hq, attention_size=A)
    out = attn(query, keys, mask=mask)     # (..., H)
    g = attn.backward(dL_dout)             # g.query, g.keys, g.values

What is always required goes by position (the data; a constructor's
sizes); everything optional is keyword-only, so that ``attn(query, keys,
mask)`` raises a TypeError that asks "did you mean mask=...?" instead of
reading the mask as the values.

The classes are defined in the package attention_c.layers (one module per
subject), the steps in attention_c.optim; this module re-exports them
as it always has (the name users and the docs import them by).
"""

from .layers import (AdditiveAttention, AttentionInputGrads,
                     ContextAttention, CosineAttention, DotAttention,
                     GeneralAttention, LocationAttention, LocationInputGrads)
from .optim import adam_step, sgd_step

__all__ = ["ContextAttention", "AdditiveAttention", "DotAttention",
           "GeneralAttention", "LocationAttention", "CosineAttention",
           "AttentionInputGrads", "LocationInputGrads", "sgd_step",
           "adam_step"]
