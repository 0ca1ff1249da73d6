"""The NumPy layers, one module per subject.

- :mod:`._common`: the checks and draws every layer shares, and ``_Layer``,
  the base class holding a layer's parameters and gradients;
- :mod:`._torch_weights`: PyTorch layers' weights as NumPy arrays (the
  ``from_torch`` loaders here and in attention_c.torch);
- :mod:`.context`: :class:`ContextAttention`, the context-pooled layer;
- :mod:`.family`: :class:`AdditiveAttention`, :class:`DotAttention`,
  :class:`GeneralAttention` and :class:`AttentionInputGrads`;
- :mod:`.multihead`: :class:`MultiHeadAttention` and
  :class:`MultiHeadInputGrads`; :mod:`.kvcache`: :class:`KVCache`, its
  decoding cache;
- :mod:`.scores`: :class:`LocationAttention`, :class:`CosineAttention`
  (the family's base class with the location and cosine scores) and
  :class:`LocationInputGrads`.

The optimiser steps are in attention_c.optim.  Users import the layers
from :mod:`attention_c` (or, as documented, from ``attention_c.layer`` and
``attention_c.multihead``, which re-export them from here).
"""

from .context import ContextAttention
from .family import (AdditiveAttention, AttentionInputGrads, DotAttention,
                     GeneralAttention)
from .multihead import KVCache, MultiHeadAttention, MultiHeadInputGrads
from .scores import CosineAttention, LocationAttention, LocationInputGrads

__all__ = ["ContextAttention", "AdditiveAttention", "DotAttention",
           "GeneralAttention", "AttentionInputGrads", "MultiHeadAttention",
           "KVCache", "MultiHeadInputGrads", "LocationAttention",
           "CosineAttention", "LocationInputGrads"]
