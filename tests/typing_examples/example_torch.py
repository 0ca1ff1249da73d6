"""A PyTorch user's script, type-checked by tests/test_typing.py."""

import torch
from typing_extensions import assert_type

from attention_c.torch import ContextAttention, context_attention

pool = ContextAttention(4, 3)
h = torch.randn(2, 5, 4)
mask = torch.ones(2, 5, dtype=torch.bool)
out, alpha = context_attention(h, pool.W, pool.v, pool.b, mask)
assert_type(out, torch.Tensor)
assert_type(alpha, torch.Tensor)
pooled = pool(h, mask)
assert_type(pool.forward(h, mask, return_weights=True),
            torch.Tensor | tuple[torch.Tensor, torch.Tensor])
