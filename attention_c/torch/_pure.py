"""Pure-PyTorch transcriptions of the forwards (docs/contract.md sections
1.2, 4.3 and 5), which attention_c.torch differentiates for the
derivatives of its backward operators (double backward, Hessians,
forward-mode), and for the gradient of ``lse``.

They zero the padding first so that NaN or Inf there reaches no second
derivative either (rule 1.3.2).  Dropout uses the kernels' keep bits:
:func:`dropout_keep` is Philox4x32-10 in int64 tensor arithmetic, bit for
bit ``attention_c.reference.dropout_keep``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

# (untyped in torch's stubs)
_broadcast_shapes: Any = torch.broadcast_shapes

_M32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of ``a * m``, a uint32 held in int64 and m <
    2**32: the product is built from 16-bit halves of ``a`` so that no
    partial product reaches 2**63."""
    x = (a & 0xFFFF) * m                        # < 2**48
    y = (a >> 16) * m                           # < 2**48
    mid = ((y & 0xFFFF) << 16) + x              # a m = (y >> 16) 2**32 + mid
    return (y >> 16) + (mid >> 32), mid & _M32


def philox4x32(counter: tuple[torch.Tensor, ...],
               key: tuple[torch.Tensor, torch.Tensor]
               ) -> tuple[torch.Tensor, ...]:
    """The 4 output words of Philox4x32-10 (int64 tensors holding uint32
    values) for the counter words ``counter`` under ``key``; the words
    broadcast.  The rounds of ``attention_c.reference.philox4x32``."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
    return c0, c1, c2, c3


def dropout_keep(seed: torch.Tensor | int, p: float,
                 lead: tuple[int, ...], Tq: int, T: int,
                 device: torch.device | None = None) -> torch.Tensor:
    """keep (lead + (Tq, T)) booleans of dropout rate ``p``, the flat batch
    index b running row-major over ``lead`` (section 5.1).

    ``seed`` is an int in [0, 2**64) or an int64 tensor holding its 64
    bits; keep_it = word ``t & 3`` of philox((t >> 2, i, b mod 2**32,
    b >> 32), (seed mod 2**32, seed >> 32)) >= floor(p 2**32).
    """
    if isinstance(seed, int):                   # its bits as an int64
        seed = seed - 2**64 if seed >= 2**63 else seed
    s = torch.as_tensor(seed, dtype=torch.int64, device=device)
    key = (s & _M32, (s >> 32) & _M32)          # arithmetic shift, masked
    n = math.prod(lead)
    blocks = (T + 3) // 4
    i64 = torch.int64
    b = torch.arange(n, dtype=i64, device=device)[:, None, None]
    i = torch.arange(Tq, dtype=i64, device=device)[None, :, None]
    t4 = torch.arange(blocks, dtype=i64, device=device)[None, None, :]
    words = philox4x32((t4, i, b & _M32, b >> 32), key)
    shape = (n, Tq, blocks)
    u = torch.stack([w.expand(shape) for w in words], -1)
    u = u.reshape(n, Tq, 4 * blocks)[..., :T]
    return (u >= math.floor(p * 2**32)).reshape(*lead, Tq, T)


def masked_softmax(s: torch.Tensor, m: torch.Tensor | None
                   ) -> torch.Tensor:
    """Masked softmax over the last axis; 0 where nothing is valid."""
    return _softmax_lse(s, m)[0]


def _softmax_lse(s: torch.Tensor, m: torch.Tensor | None,
                 sink: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha, lse) of ``s`` over the last axis and the valid entries of
    ``m``; a row with none gets alpha = 0 and lse = -inf, with zero
    derivatives of any order.  ``sink`` (lead), one logit a sequence,
    joins every denominator without a value (docs/contract.md section 8):
    lse_i = log(exp(sink) + sum_t exp(s_it)), = sink for a row with no
    valid entry."""
    if m is None and sink is None:
        return torch.softmax(s, -1), torch.logsumexp(s, -1)
    if m is None:
        m = torch.ones(s.shape, dtype=torch.bool, device=s.device)
    any_valid = m.any(-1, keepdim=True)
    M = torch.where(m, s, -torch.inf).amax(-1, keepdim=True)
    M = torch.where(any_valid, M, 0)
    if sink is not None:
        z = sink[..., None, None].expand(M.shape)
        M = torch.where(any_valid, torch.maximum(M, z), z)
    M = M.detach()
    # exp(0) on masked entries: no inf whose zero gradient would give NaN.
    e = torch.where(m, torch.exp(torch.where(m, s, M) - M), 0)
    total = e.sum(-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(z - M)
        return e / total, (M + torch.log(total))[..., 0]
    total = torch.where(any_valid, total, 1)
    lse = torch.where(any_valid, M + torch.log(total), -torch.inf)
    return e / total, lse[..., 0]


def _window_sides(window: Any) -> tuple[int | None, int | None]:
    """(left, right), None for an unbounded side: from the ops' [left,
    right] with -1, or the NumPy API's pair with None."""
    if window is None:
        return None, None
    left, right = (None if w is None or w < 0 else int(w) for w in window)
    return left, right


def relative_positions(Tq: int, T: int, cu_seqlens_q: torch.Tensor | None,
                       cu_seqlens_k: torch.Tensor | None,
                       device: torch.device | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(same, rel), each (Tq, T): whether query i and key t are of the same
    packed sequence, and rel_it = t - i' within it (i' the query's
    bottom-right aligned position), as
    ``attention_c.reference.variants._relative_positions``."""
    i = torch.arange(Tq, device=device)
    t = torch.arange(T, device=device)
    if cu_seqlens_q is None or cu_seqlens_k is None:
        same = torch.ones(Tq, T, dtype=torch.bool, device=device)
        return same, t[None, :] - (i + (T - Tq))[:, None]
    cq = cu_seqlens_q.to(torch.int64)
    ck = cu_seqlens_k.to(torch.int64)
    # the sequence of each query and key: the last starting at or before
    # it (an empty sequence holds nobody)
    sq = torch.searchsorted(cq, i, right=True) - 1
    sk = torch.searchsorted(ck, t, right=True) - 1
    len_q, len_k = (cq[1:] - cq[:-1])[sq], (ck[1:] - ck[:-1])[sq]
    i_pos = (i - cq[sq]) + (len_k - len_q)
    rel = (t - ck[sk])[None, :] - i_pos[:, None]
    return sq[:, None] == sk[None, :], rel


def key_ranges(Tq: int, T: int, causal: bool, window: Any,
               cu_seqlens_q: torch.Tensor | None,
               cu_seqlens_k: torch.Tensor | None,
               device: torch.device | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen, rel), each (Tq, T): key t lies in query i's range by causal,
    the window and the packed sequences; rel as :func:`relative_positions`.
    """
    seen, rel = relative_positions(Tq, T, cu_seqlens_q, cu_seqlens_k,
                                   device)
    left, right = _window_sides(window)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        seen = seen & (rel >= -left)
    if right is not None:
        seen = seen & (rel <= right)
    return seen, rel


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


def _any_to(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``x`` (bool) reduced with ``any`` to ``shape``, the shape of a
    tensor broadcast to ``x.shape``."""
    x = x.any(dim=tuple(range(x.ndim - len(shape)))) if (
        x.ndim > len(shape)) else x
    stretched = tuple(a for a, n in enumerate(shape)
                      if n == 1 and x.shape[a] != 1)
    return x.any(dim=stretched, keepdim=True) if stretched else x


def _live(x: torch.Tensor | None, seen: torch.Tensor) -> Any:
    """``x`` (..., n, d) with the rows no (query, key) pair sees set to 0
    (``seen`` (lead, n): whether the row is seen at that position)."""
    if x is None:
        return None
    return torch.where(_any_to(seen, x.shape[:-1])[..., None], x, 0)


def family_attention(kind: str, query: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor | None = None,
                     values: torch.Tensor | None = None,
                     W: torch.Tensor | None = None,
                     v: torch.Tensor | None = None,
                     b: torch.Tensor | None = None,
                     key_proj: torch.Tensor | None = None,
                     scale: float | None = None,
                     attn_mask: torch.Tensor | None = None,
                     causal: bool = False,
                     bias: torch.Tensor | None = None,
                     dropout: float = 0.0,
                     seed: torch.Tensor | int | None = None,
                     weights: bool = True,
                     window: Any = None,
                     softcap: float | None = None,
                     alibi_slopes: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None,
                     cu_seqlens_q: torch.Tensor | None = None,
                     cu_seqlens_k: torch.Tensor | None = None,
                     sharpness: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's ``kind`` ('additive', 'dot', 'general', 'cosine';
    sections 4.3, 5 and 8): ``(out, alpha)``, or ``(out, lse)`` when not
    ``weights``.  'cosine': ``s_it = sharpness_i n(q_i) . n(k_t)`` (n as
    ``F.normalize``), then as 'dot'; the values default to the raw keys.
    ``key_proj`` given: the scores use it (the gradient stops there).
    The variants (dot, general, cosine): ``window`` (left, right) (-1 or None
    unbounded), ``softcap`` c (s <- c tanh(s / c), before bias and ALiBi),
    ``alibi_slopes`` m (s <- s - m |t - i'|) and ``sinks`` (one logit a
    sequence in every denominator), each broadcast to the leading shape,
    and the packed sequences ``cu_seqlens_q``, ``cu_seqlens_k``."""
    single = query.ndim < keys.ndim
    q = query.unsqueeze(-2) if single else query
    Tq, T = q.shape[-2], keys.shape[-2]
    lead = _broadcast_shapes(
        q.shape[:-2], keys.shape[:-2],
        *([] if values is None else [values.shape[:-2]]))
    vis = torch.ones(*lead, Tq, T, dtype=torch.bool, device=q.device)
    if mask is not None:
        vis = vis & mask.unsqueeze(-2)
    if attn_mask is not None:
        vis = vis & attn_mask
    ranged = (causal or window is not None or cu_seqlens_q is not None
              or cu_seqlens_k is not None)
    rel = None
    if ranged or alibi_slopes is not None:
        seen, rel = key_ranges(Tq, T, causal, window, cu_seqlens_q,
                               cu_seqlens_k, q.device)
        if ranged:
            vis = vis & seen
    if bias is not None:
        bias = bias.unsqueeze(-2) if single else bias
        vis = vis & ~torch.isneginf(bias)
        bias = torch.where(torch.isneginf(bias), 0, bias)
    # Padding: keys no query sees, queries that see no key.
    seen_k, seen_q = vis.any(-2), vis.any(-1)
    keys, values, key_proj = (_live(x, seen_k)
                              for x in (keys, values, key_proj))
    q = _live(q, seen_q)
    H = keys.shape[-1]
    if kind == "dot":
        c = 1 / math.sqrt(H) if scale is None else scale
        s = c * q @ keys.transpose(-1, -2)
    elif kind == "cosine":
        s = F.normalize(q, dim=-1) @ F.normalize(keys, dim=-1).transpose(
            -1, -2)
        if sharpness is not None:       # (..., Tq) or (...): one a query
            beta = sharpness.unsqueeze(-1) if single else sharpness
            s = beta.unsqueeze(-1) * s
    elif kind == "general":
        assert W is not None
        kp = F.linear(keys, W) if key_proj is None else key_proj
        s = q @ kp.transpose(-1, -2)
    else:
        assert W is not None and v is not None
        kp = F.linear(keys, W[:, :H]) if key_proj is None else key_proj
        qp = F.linear(q, W[:, H:], b)
        s = torch.tanh(kp.unsqueeze(-3) + qp.unsqueeze(-2)) @ v
    if softcap is not None:             # before bias and ALiBi (Gemma 2)
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if alibi_slopes is not None:
        assert rel is not None
        s = s - alibi_slopes[..., None, None] * rel.abs().to(s.dtype)
    sink = None if sinks is None else sinks.expand(lead)
    alpha, lse = _softmax_lse(s, vis, sink)
    a = alpha
    if dropout > 0:
        assert seed is not None
        keep = dropout_keep(seed, dropout, tuple(lead), Tq, T, q.device)
        a = torch.where(keep, alpha / (1 - dropout), 0)
    out = a @ (keys if values is None else values)
    second = alpha if weights else lse
    if single:
        return out.squeeze(-2), (second.squeeze(-2) if weights
                                 else second.squeeze(-1))
    return out, second


def location_attention(query: torch.Tensor, values: torch.Tensor,
                       W: torch.Tensor, b: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None,
                       attn_mask: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The location score (Luong 2015), ``s_it = W_t . q_i + b_t``:
    ``(out, alpha)`` of the dot score with keys ``W[:T]`` (the same for
    every sequence), scale 1 and bias ``b[:T]``."""
    T = values.shape[-2]
    keys = W[:T].reshape(*(1,) * (values.ndim - 2), T, W.shape[-1])
    return family_attention("dot", query, keys, mask=mask, values=values,
                            scale=1.0, attn_mask=attn_mask,
                            bias=None if b is None else b[:T])
