"""A PyTorch user's script, type-checked by tests/binding/test_typing.py."""

import torch
from typing_extensions import assert_type

from attention_c.torch import (AdditiveAttention, ContextAttention,
                               DotAttention, GeneralAttention,
                               additive_attention, context_attention,
                               dot_attention, general_attention,
                               project_keys)

pool = ContextAttention(4, 3)
h = torch.randn(2, 5, 4)
mask = torch.ones(2, 5, dtype=torch.bool)
out, alpha = context_attention(h, pool.W, pool.v, b=pool.b, mask=mask)
assert_type(out, torch.Tensor)
assert_type(alpha, torch.Tensor)
pooled = pool(h, mask=mask)
assert_type(pool.forward(h, mask=mask, return_weights=True),
            torch.Tensor | tuple[torch.Tensor, torch.Tensor])

# The attention family
query = torch.randn(2, 3)
keys = torch.randn(2, 5, 4)
attn = AdditiveAttention(4, 3, 6)
kp = attn.project_keys(keys)
assert_type(kp, torch.Tensor)
assert_type(attn.forward(query, keys, mask=mask, key_proj=kp),
            torch.Tensor | tuple[torch.Tensor, torch.Tensor])
out, alpha = additive_attention(query, keys, attn.W, attn.v, b=attn.b,
                                key_proj=project_keys(keys, attn.W))
assert_type(alpha, torch.Tensor)
loaded = AdditiveAttention.from_linear(torch.nn.Linear(7, 6),
                                       torch.nn.Linear(6, 1), key_size=4)
assert_type(loaded, AdditiveAttention)
assert_type(AdditiveAttention.from_d2l(torch.nn.Linear(4, 6),
                                       torch.nn.Linear(3, 6),
                                       torch.nn.Linear(6, 1)),
            AdditiveAttention)
out, alpha = dot_attention(keys, keys, values=torch.randn(2, 5, 2),
                           scale=0.5)
assert_type(DotAttention().forward(keys, keys), torch.Tensor | tuple[
    torch.Tensor, torch.Tensor])
# Section 5: attn_mask, causal, bias, dropout + seed, return_weights
x = torch.randn(2, 5, 4)
causal_mask = torch.ones(5, 5, dtype=torch.bool).tril()
out, lse = dot_attention(x, x, attn_mask=causal_mask, bias=torch.zeros(5, 5),
                         dropout=0.1, seed=0, return_weights=False)
assert_type(lse, torch.Tensor)
out, alpha = dot_attention(x, x, causal=True, dropout=0.1,
                           seed=torch.tensor(3))
self_attn = DotAttention(dropout=0.1)
assert_type(self_attn.forward(x, x, causal=True, bias=torch.zeros(5, 5)),
            torch.Tensor | tuple[torch.Tensor, torch.Tensor])
general = GeneralAttention.from_linear(torch.nn.Linear(4, 3, bias=False))
assert_type(GeneralAttention(3, 4, dropout=0.1).forward(
    torch.randn(2, 5, 3), x, mask=mask, causal=True),
    torch.Tensor | tuple[torch.Tensor, torch.Tensor])
out, alpha = general_attention(query, keys, general.W,
                               key_proj=general.project_keys(keys))
assert_type(out, torch.Tensor)

# Optional arguments are keyword-only: mypy refuses them by position (and
# --strict, warning of unused ignores, fails if it stops refusing them).
additive_attention(query, keys, attn.W, attn.v,
                   attn.b)  # type: ignore[call-arg]
pool.forward(h, mask)  # type: ignore[call-arg]
