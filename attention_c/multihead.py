"""Multi-head attention as a trainable NumPy layer, and its decoding cache.

:class:`MultiHeadAttention` is ``torch.nn.MultiheadAttention`` in NumPy
(docs/contract.md section 5, the masks with True = valid): the inputs are
projected, the heads are read in place from the projections as strided
views (..., h, T, d), one call of :func:`attention_c.dot_attention` attends
every head of every sequence, and the heads are concatenated for the
output projection.  :class:`KVCache` keeps the projected keys and values
of a decoder between calls, in a preallocated buffer that a one-token
step appends to and attends to without copying it.

    mha = MultiHeadAttention(E, h, seed=0)
    out = mha(x, causal=True)              # (..., T, E)
    g = mha.backward(dL_dout)              # g.query; mha.grads() filled
    adam_step(mha.parameters(), mha.grads(), state, lr=1e-3)

The classes are defined in attention_c.layers.multihead and
attention_c.layers.kvcache; this module re-exports them as it always has
(the name users and the docs import them by).
"""

from .layers import KVCache, MultiHeadAttention, MultiHeadInputGrads

__all__ = ["MultiHeadAttention", "KVCache", "MultiHeadInputGrads"]
