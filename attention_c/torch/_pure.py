"""Pure-PyTorch transcriptions of the forwards (docs/contract.md sections
1.2 and 4.3), which attention_c.torch differentiates for the derivatives
of its backward operators (double backward, Hessians, forward-mode).

They zero the padding first so that NaN or Inf there reaches no second
derivative either (rule 1.3.2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def masked_softmax(s: torch.Tensor, m: torch.Tensor | None
                   ) -> torch.Tensor:
    """Masked softmax over the last axis; 0 where nothing is valid."""
    if m is None:
        return torch.softmax(s, -1)
    any_valid = m.any(-1, keepdim=True)
    M = torch.where(m, s, -torch.inf).amax(-1, keepdim=True)
    M = torch.where(any_valid, M, 0).detach()
    # exp(0) on masked entries: no inf whose zero gradient would give NaN.
    e = torch.where(m, torch.exp(torch.where(m, s, M) - M), 0)
    return e / torch.where(any_valid, e.sum(-1, keepdim=True), 1)


def context_attention(h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
                      b: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Context pooling (section 1.2): ``(out, alpha)``."""
    H = h.shape[-1]
    if mask is None:
        c = h.mean(-2)
    else:
        h = torch.where(mask[..., None], h, 0)
        n = mask.sum(-1, keepdim=True).clamp(min=1).to(h.dtype)
        c = h.sum(-2) / n
    z = F.linear(h, W[:, :H], b) + F.linear(c, W[:, H:]).unsqueeze(-2)
    alpha = masked_softmax(torch.tanh(z) @ v, mask)
    return (alpha.unsqueeze(-2) @ h).squeeze(-2), alpha


def family_attention(kind: str, query: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor | None = None,
                     values: torch.Tensor | None = None,
                     W: torch.Tensor | None = None,
                     v: torch.Tensor | None = None,
                     b: torch.Tensor | None = None,
                     key_proj: torch.Tensor | None = None,
                     scale: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's ``kind`` ('additive', 'dot', 'general'; section 4.3):
    ``(out, alpha)``.  ``key_proj`` given: the scores use it (the gradient
    stops there)."""
    single = query.ndim < keys.ndim
    q = query.unsqueeze(-2) if single else query
    m = None
    if mask is not None:
        m = mask if mask.ndim == keys.ndim else mask.unsqueeze(-2)
        # Padding: keys masked for every query, queries with no valid key.
        key_ok, query_ok = m.any(-2)[..., None], m.any(-1)[..., None]
        keys = torch.where(key_ok, keys, 0)
        values = None if values is None else torch.where(key_ok, values, 0)
        key_proj = (None if key_proj is None
                    else torch.where(key_ok, key_proj, 0))
        q = torch.where(query_ok, q, 0)
    H = keys.shape[-1]
    if kind == "dot":
        c = 1 / math.sqrt(H) if scale is None else scale
        s = c * q @ keys.transpose(-1, -2)
    elif kind == "general":
        assert W is not None
        kp = F.linear(keys, W) if key_proj is None else key_proj
        s = q @ kp.transpose(-1, -2)
    else:
        assert W is not None and v is not None
        kp = F.linear(keys, W[:, :H]) if key_proj is None else key_proj
        qp = F.linear(q, W[:, H:], b)
        s = torch.tanh(kp.unsqueeze(-3) + qp.unsqueeze(-2)) @ v
    alpha = masked_softmax(s, m)
    out = alpha @ (keys if values is None else values)
    return (out.squeeze(-2), alpha.squeeze(-2)) if single else (out, alpha)
