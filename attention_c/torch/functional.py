"""The functional API of attention_c.torch, as ``torch.nn.functional``:
differentiable functions on CPU tensors with the signatures of their NumPy
counterparts in :mod:`attention_c` (required data and parameters by
position, every optional argument by keyword), returning ``(out, alpha)``.

Each checks its arguments (in PyTorch's terms), casts bfloat16 and float16
to float32, and calls a custom operator (attention_c.torch._ops).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import attention_c as _ac

from ._ops import _call, _eager
from ._utils import _back, _check_tensors, _f32, _kv, _tracing

__all__ = ["context_attention", "additive_attention", "dot_attention",
           "general_attention", "project_keys",
           "scaled_dot_product_attention"]


def context_attention(h: torch.Tensor, W: torch.Tensor, v: torch.Tensor, *,
                      b: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-pooled additive attention on CPU tensors, differentiable.

    Same maths and shapes as :func:`attention_c.context_attention`
    (docs/contract.md section 1); the gradients are the C backward (exact
    higher-order gradients in PyTorch, see :mod:`attention_c.torch`).

    Parameters
    ----------
    h : Tensor (..., T, H)
        float32 or float64, on the CPU; ``W``, ``v``, ``b`` of the same
        dtype.  bfloat16 or float16 are computed in float32 and the results
        returned in that dtype.
    W : Tensor (A, 2H)
        Layout of ``torch.nn.Linear(2H, A).weight``.
    v : Tensor (A,)
    b : Tensor (A,), optional
        Keyword-only, as every optional argument.
    mask : Tensor of torch.bool (..., T), optional
        True marks a valid item (note: the opposite of the
        ``key_padding_mask`` of ``nn.MultiheadAttention``).  Must not
        require grad.

    Returns
    -------
    out : Tensor (..., H)
        0 for a row with no valid item.
    alpha : Tensor (..., T)
        The attention weights, 0 for masked items.

    Raises
    ------
    ValueError
        A tensor not on the CPU (e.g. CUDA), a mask that requires grad, or
        shapes that do not fit.
    TypeError
        A dtype other than float32, float64, bfloat16 and float16, mixed
        dtypes (outside ``torch.autocast``), a mask that is not boolean;
        an optional argument passed by position.
    """
    low = _check_tensors([("h", h), ("W", W), ("v", v), ("b", b)], mask)
    # Keep the tanh activations for the backward only if there will be one.
    # Not when tracing with torch.jit.trace: the flag would be a constant
    # of the trace, wrong for the other mode (grad or no_grad).
    keep = (torch.is_grad_enabled() and not _tracing()
            and any(t is not None and t.requires_grad for t in (h, W, v, b)))
    out, alpha, _ = _call("context", _f32(h, low), _f32(W, low),
                          _f32(v, low), _f32(b, low), mask, keep)
    return _back(out, alpha, low)


_FAMILY_RETURNS = """
    Returns
    -------
    out : Tensor (..., Hv) or (..., Tq, Hv)
        0 for a query with no visible key.
    alpha : Tensor (..., T) or (..., Tq, T)
        The attention weights (before dropout), 0 for keys a query does
        not see (with ``sinks`` they sum to less than 1).  With
        ``return_weights=False`` (dot and general) this is ``lse`` (...)
        or (..., Tq) instead: ``log sum_t exp(s_it)`` over the visible
        keys (plus ``exp(sink)`` with ``sinks``), -inf for a query with
        none (the sink with ``sinks``); differentiable.

    Raises
    ------
    ValueError
        A tensor not on the CPU (e.g. CUDA), a mask that requires grad, a
        per-query mask given as ``mask``, ``attn_mask`` or ``causal`` with
        one query per sequence, a ``dropout`` outside [0, 1) or without
        ``seed``, or shapes that do not fit (masks and bias broadcast to
        the scores' shape, never adding leading axes); a negative window
        side, ``softcap`` <= 0, ``window`` or ``cu_seqlens_*`` with one
        query per sequence, cu_seqlens that do not rise from 0 to Tq
        (resp. T), or slopes or sinks that do not broadcast to the
        leading axes.
    TypeError
        A dtype other than float32, float64, bfloat16 and float16, mixed
        dtypes (outside ``torch.autocast``), a mask that is not boolean,
        cu_seqlens that are not integers; an optional argument passed by
        position.
"""

_MASKS_DOC = """mask : Tensor of torch.bool (..., T), optional
        The key mask, the same for every query: True marks a valid key
        (the opposite of ``key_padding_mask`` of ``nn.MultiheadAttention``).
        Keyword-only, as every optional argument.  A per-query mask is
        ``attn_mask``: given as ``mask`` it is refused.
    attn_mask : Tensor of torch.bool, optional
        Broadcastable (missing or size-1 leading axes) to (..., Tq, T):
        True = query i may attend to key t, as the boolean ``attn_mask`` of
        ``F.scaled_dot_product_attention`` (``nn.MultiheadAttention``'s
        boolean masks mean the opposite).  Several queries only.
    causal : bool, optional
        Key t is visible to query i iff ``t <= i + (T - Tq)`` (bottom-right
        aligned: ``tril`` when Tq == T; SDPA's ``is_causal`` is top-left,
        the same when Tq == T).  Several queries only.  Visibility is the
        AND of ``mask``, ``attn_mask`` and ``causal``."""

_SEC5_DOC = """bias : Tensor, optional
        Float, of the queries' dtype, broadcastable to (..., Tq, T) ((...,
        T) with one query): added to the scores before the softmax (the
        float ``attn_mask`` of ``F.scaled_dot_product_attention``, ALiBi,
        relative positions); -inf masks.  Differentiable: its gradient
        comes from the C backward, summed to its shape.
    dropout : float, optional
        p in [0, 1): ``out_i = sum_t alpha_it keep_it / (1 - p) val_t``,
        the keep bits a counter-based function of (seed, flat batch index,
        i, t), regenerated by the backward.  Applied whenever p > 0 (a
        function has no training mode; the modules have).
    seed : int, optional
        0 <= seed < 2**64, required when ``dropout > 0``: the same seed
        gives the same keep bits, the keep bits of
        ``attention_c.reference.dropout_keep``.  Also a 0-dim torch.int64
        tensor holding its 64 bits (what a module draws from torch's
        generator, inside compiled graphs too).
    return_weights : bool, optional
        True (default): return ``(out, alpha)``; False: ``(out, lse)``,
        and neither the forward nor the backward forms the (..., Tq, T)
        weights.  ``lse`` is float32 for bfloat16 and float16 inputs."""


def _check_masks(query: torch.Tensor, keys: torch.Tensor,
                 mask: torch.Tensor | None,
                 attn_mask: torch.Tensor | None, causal: bool,
                 keys_name: str = "keys") -> None:
    """Refuse what would be misread (on any device, before the kernels):
    a per-query mask as ``mask``, a non-boolean ``attn_mask``.  ``keys``
    is the tensor setting the rank of a sequence, ``keys_name`` its
    name."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got "
                        f"{type(causal).__name__}")
    several = query.ndim == keys.ndim
    if (mask is not None and several
            and mask.ndim > max(query.ndim, keys.ndim) - 1):
        raise ValueError(
            f"mask has shape {tuple(mask.shape)}: mask is the key mask "
            f"(..., T), the same for every query; for a mask per query "
            f"(..., Tq, T) use attn_mask= (and causal=True for causal "
            f"attention)")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor of "
                            f"torch.bool, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool:
            raise TypeError(
                f"attn_mask has dtype {attn_mask.dtype}; expected torch.bool "
                f"(True = query i may attend to key t, as the boolean "
                f"attn_mask of F.scaled_dot_product_attention; "
                f"nn.MultiheadAttention's boolean masks mean True = masked, "
                f"the opposite). For a float mask added to the scores use "
                f"bias=")
    if not several and (attn_mask is not None or causal):
        raise ValueError(
            f"attn_mask and causal need several queries (query (..., Tq, "
            f"Hq) with query.ndim == {keys_name}.ndim); query has shape "
            f"{tuple(query.shape)} and {keys_name} {tuple(keys.shape)}: "
            f"one query per sequence, where mask (..., T) says it all")


def _check_bias(bias: torch.Tensor | None) -> None:
    if bias is not None and isinstance(bias, torch.Tensor) and (
            bias.dtype == torch.bool):
        raise TypeError("bias is a float tensor added to the scores; for a "
                        "boolean mask use attn_mask= (True = may attend)")


def _dropout_seed(dropout: float, seed: int | torch.Tensor | None
                  ) -> tuple[float, torch.Tensor | None]:
    """(p, the seed as an int64 tensor of its bits, None without
    dropout)."""
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a float, got "
                        f"{type(dropout).__name__}")
    p = float(dropout)
    if not 0 <= p < 1:
        raise ValueError(f"dropout must be in [0, 1), not {dropout}")
    if p == 0:
        return 0.0, None
    if seed is None:
        raise ValueError("dropout > 0 needs seed= (an int, 0 <= seed < "
                         "2**64; the modules draw one from torch's "
                         "generator)")
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.ndim != 0:
            raise TypeError(f"a seed tensor must be a 0-dim torch.int64 "
                            f"tensor, got {seed.dtype} of shape "
                            f"{tuple(seed.shape)}")
        return p, seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not (
            0 <= seed < 2**64):
        raise ValueError(f"seed must be an int, 0 <= seed < 2**64, not "
                         f"{seed!r}")
    # Its 64 bits as an int64 (torch has no uint64 arithmetic to speak of).
    return p, torch.tensor(seed - 2**64 if seed >= 2**63 else seed,
                           dtype=torch.int64)


_VARIANTS_DOC = """window : tuple (left, right), optional
        A sliding window: key t is visible to query i iff ``i' - left <= t
        <= i' + right`` (i' = i + T - Tq, bottom-right aligned as
        ``causal``), each side an int >= 0 or None (unbounded); with
        ``causal`` the right side is 0.  Several queries only.  The
        kernels compute only the blocks inside the window.
    softcap : float, optional
        c > 0: the score (scaled, before bias and ALiBi) becomes ``c
        tanh(s / c)`` (Gemma 2).  None: off.
    alibi_slopes : Tensor, optional
        One slope a sequence and head, broadcastable (never adding axes)
        to the leading shape of ``out`` (e.g. (heads,) for (B, heads, T,
        d)): adds ``-slope |i' - t|`` to the scores (FlashAttention's
        ALiBi).  Cast to the computation's dtype; differentiable.
    sinks : Tensor, optional
        One logit a sequence and head (same shapes as ``alibi_slopes``)
        in every softmax denominator, without a value: ``lse_i = log(exp
        (sink) + sum_t exp(s_it))``, so the weights sum to less than 1 (an
        attention sink, gpt-oss).  Differentiable (in float32 for bfloat16
        and float16 calls).  With ``return_weights=True`` the backward runs
        one more forward (it needs the lse).
    cu_seqlens_q, cu_seqlens_k : Tensor of an integer dtype (n + 1,), optional
        Packed sequences (FlashAttention's varlen layout): the Tq axis holds
        n query sequences back to back, sequence s being the queries
        ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, and the T axis n key
        sequences; a query sees only its own sequence's keys, and causal,
        window and ALiBi positions are taken within it.  Both or neither;
        non-decreasing from 0 to Tq (resp. T).  Several queries only."""


def _check_variants(query: torch.Tensor, keys: torch.Tensor,
                    window: tuple[int | None, int | None] | None,
                    softcap: float | None,
                    alibi_slopes: torch.Tensor | None,
                    sinks: torch.Tensor | None,
                    cu_seqlens_q: torch.Tensor | None,
                    cu_seqlens_k: torch.Tensor | None,
                    low: torch.dtype | None
                    ) -> tuple[list[int] | None, float | None,
                               torch.Tensor | None, torch.Tensor | None]:
    """The variants checked (docs/contract.md section 8) and laid out for
    the ops: window as [left, right] with -1 for an unbounded side,
    softcap a float, alibi_slopes and sinks in the computation's dtype
    (a differentiable cast).  The kernels check the rest (the values of
    cu_seqlens, the shapes of slopes and sinks) before any work."""
    win = None
    if window is not None:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(f"window must be a pair (left, right), each an "
                             f"int >= 0 or None (unbounded), got "
                             f"{window!r}") from None
        win = []
        for side, w in (("left", left), ("right", right)):
            if w is None:
                win.append(-1)
                continue
            if isinstance(w, bool) or not isinstance(w, int):
                raise TypeError(f"window {side} side must be an int >= 0 or "
                                f"None, got {w!r}")
            if w < 0:
                raise ValueError(f"window {side} side must be >= 0 (None "
                                 f"for unbounded), got {w}")
            win.append(int(w))
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap,
                                                       (int, float)):
            raise TypeError(f"softcap must be a number > 0 or None, got "
                            f"{type(softcap).__name__}")
        if not 0 < softcap < float("inf"):
            raise ValueError(f"softcap must be a number > 0 (None: off), "
                             f"got {softcap!r}")
        softcap = float(softcap)
    several = query.ndim == keys.ndim
    if not several:
        for name, x in (("window", window), ("cu_seqlens_q", cu_seqlens_q),
                        ("cu_seqlens_k", cu_seqlens_k)):
            if x is not None:
                raise ValueError(
                    f"{name} needs several queries (query (..., Tq, Hq) "
                    f"with query.ndim == keys.ndim); query has shape "
                    f"{tuple(query.shape)} and keys {tuple(keys.shape)}")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together: give "
                         "both or neither")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q),
                     ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            continue
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be an integer torch.Tensor, got "
                            f"{type(cu).__name__}")
        if cu.dtype.is_floating_point or cu.dtype.is_complex or (
                cu.dtype == torch.bool):
            raise TypeError(f"{name} must be an integer tensor (torch.int32 "
                            f"or torch.int64), not {cu.dtype}")
        if cu.device.type not in ("cpu", "meta") or cu.ndim != 1:
            raise ValueError(f"{name} must be a 1-D CPU tensor (n + 1,), "
                             f"got shape {tuple(cu.shape)} on {cu.device}")
    # the computation's dtype: float32 for a bfloat16 or float16 call
    dtype = query.dtype if low is None else torch.float32
    per_seq = []
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            if not isinstance(x, torch.Tensor):
                x = torch.as_tensor(x, dtype=dtype)
            if not (x.dtype.is_floating_point):
                raise TypeError(f"{name} must be a float tensor, not "
                                f"{x.dtype}")
            if x.device.type != query.device.type:
                raise ValueError(f"{name} is on '{x.device}' but query on "
                                 f"'{query.device}'")
            x = x.to(dtype)
        per_seq.append(x)
    return win, softcap, per_seq[0], per_seq[1]


def additive_attention(query: torch.Tensor, keys: torch.Tensor,
                       W: torch.Tensor, v: torch.Tensor, *,
                       b: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None,
                       attn_mask: torch.Tensor | None = None,
                       causal: bool = False,
                       values: torch.Tensor | None = None,
                       key_proj: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive attention on CPU tensors, differentiable:
    ``s_it = v . tanh(W_k k_t + W_q q_i + b)``.

    Same maths, arguments and shapes as
    :func:`attention_c.additive_attention` (docs/contract.md sections 4
    and 5); the gradients are the C backward.  The additive score takes no
    ``bias``, ``dropout`` or ``return_weights``.

    Parameters
    ----------
    query : Tensor (..., Hq) or (..., Tq, Hq)
        One query per sequence, or several when ``query.ndim ==
        keys.ndim``.  float32 or float64 (bfloat16 and float16 computed
        in float32), on the CPU; every other float tensor of the same
        dtype.
    keys : Tensor (..., T, H)
    W : Tensor (A, H + Hq)
        ``[W_k | W_q]``, the layout of ``torch.nn.Linear(H + Hq, A).weight``
        applied to ``[k_t; q_i]``.
    v : Tensor (A,)
    b : Tensor (A,), optional
        Keyword-only, as every optional argument.
    %(masks)s
    values : Tensor (..., T, Hv), optional
        Default: the keys.
    key_proj : Tensor (..., T, A), optional
        ``project_keys(keys, W)``, computed once for several calls with the
        same keys (a decoder loop).  When it requires grad, the backward
        stops at it and autograd takes the keys' and ``W_k``'s share
        through the graph that made it, once however many calls use it;
        when it does not (e.g. made under ``torch.no_grad()``), each call's
        backward gives the keys and ``W`` their full gradients, as without
        ``key_proj``.  Either way it must equal ``project_keys(keys, W)``.
    """
    low = _check_tensors([("query", query), ("keys", keys), ("W", W),
                          ("v", v), ("b", b), ("values", values),
                          ("key_proj", key_proj)], mask, "key",
                         attn_mask=attn_mask)
    _check_masks(query, keys, mask, attn_mask, causal)
    out, alpha = _call("additive", _f32(query, low), _f32(keys, low),
                       _f32(W, low), _f32(v, low), _f32(b, low), mask,
                       attn_mask, causal, _f32(values, low),
                       _f32(key_proj, low))
    return _back(out, alpha, low)


def _check_scale(scale: Any, name: str = "scale") -> None:
    """A scale is None or a real number (NumPy's scalars too), not a
    bool; TypeError naming it (as ``name``) otherwise."""
    if scale is None or type(scale) is float:   # (the common case, fast)
        return
    if (not isinstance(scale, numbers.Real)
            or isinstance(scale, (bool, np.bool_))):
        raise TypeError(f"{name} must be a real number or None, got "
                        f"{type(scale).__name__}")


def dot_attention(query: torch.Tensor, keys: torch.Tensor, *,
                  mask: torch.Tensor | None = None,
                  attn_mask: torch.Tensor | None = None,
                  causal: bool = False,
                  bias: torch.Tensor | None = None,
                  dropout: float = 0.0,
                  seed: int | torch.Tensor | None = None,
                  values: torch.Tensor | None = None,
                  scale: float | None = None,
                  return_weights: bool = True,
                  window: tuple[int | None, int | None] | None = None,
                  softcap: float | None = None,
                  alibi_slopes: torch.Tensor | None = None,
                  sinks: torch.Tensor | None = None,
                  cu_seqlens_q: torch.Tensor | None = None,
                  cu_seqlens_k: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention on CPU tensors, differentiable:
    ``s_it = softcap(scale q_i . k_t) + bias_it - slope |i' - t|``.

    Same maths, arguments and shapes as :func:`attention_c.dot_attention`
    (docs/contract.md sections 4 and 5); the gradients are the C backward.
    With several queries and no dropout this is
    ``F.scaled_dot_product_attention(query, keys, values, attn_mask=...,
    scale=scale)`` with its boolean ``attn_mask`` (True = take part) as
    ``attn_mask`` and its float one as ``bias``; a query with no visible
    key gets 0 (older PyTorch versions gave NaN there).

    Parameters
    ----------
    query : Tensor (..., H) or (..., Tq, H)
        One query per sequence, or several when ``query.ndim ==
        keys.ndim``.  float32 or float64 (bfloat16 and float16 computed
        in float32), on the CPU.
    keys : Tensor (..., T, H)
    %(masks)s
    %(sec5)s
    values : Tensor (..., T, Hv), optional
        Default: the keys.
    scale : float, optional
        Default ``1/sqrt(H)``.
    %(variants)s
    """
    _check_bias(bias)
    low = _check_tensors([("query", query), ("keys", keys),
                          ("values", values), ("bias", bias)], mask, "key",
                         attn_mask=attn_mask)
    _check_masks(query, keys, mask, attn_mask, causal)
    p, seed_t = _dropout_seed(dropout, seed)
    _check_scale(scale)
    var = _check_variants(query, keys, window, softcap, alibi_slopes, sinks,
                          cu_seqlens_q, cu_seqlens_k, low)
    eager = _eager(query, keys, values, bias, mask, attn_mask, *var[2:4])
    out, second = _call("dot", _kv(query, low, eager),
                        _kv(keys, low, eager), mask, attn_mask, causal,
                        _f32(bias, low), p, seed_t, _kv(values, low, eager),
                        None if scale is None else float(scale),
                        bool(return_weights), *var, cu_seqlens_q,
                        cu_seqlens_k)
    return _back(out, second, low, lse=not return_weights)


def general_attention(query: torch.Tensor, keys: torch.Tensor,
                      W: torch.Tensor, *, mask: torch.Tensor | None = None,
                      attn_mask: torch.Tensor | None = None,
                      causal: bool = False,
                      bias: torch.Tensor | None = None,
                      dropout: float = 0.0,
                      seed: int | torch.Tensor | None = None,
                      values: torch.Tensor | None = None,
                      key_proj: torch.Tensor | None = None,
                      return_weights: bool = True,
                      window: tuple[int | None, int | None] | None = None,
                      softcap: float | None = None,
                      alibi_slopes: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None,
                      cu_seqlens_q: torch.Tensor | None = None,
                      cu_seqlens_k: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Multiplicative ("general") attention on CPU tensors, differentiable:
    ``s_it = softcap(q_i . (W_a k_t)) + bias_it - slope |i' - t|``.

    Same maths, arguments and shapes as
    :func:`attention_c.general_attention` (docs/contract.md sections 4 and
    5); the gradients are the C backward.

    Parameters
    ----------
    query : Tensor (..., Hq) or (..., Tq, Hq)
        One query per sequence, or several when ``query.ndim ==
        keys.ndim``.  float32 or float64 (bfloat16 and float16 computed
        in float32), on the CPU.
    keys : Tensor (..., T, H)
    W : Tensor (Hq, H)
        ``W_a``, the layout of ``torch.nn.Linear(H, Hq).weight`` applied to
        the keys.
    %(masks)s
    %(sec5)s
    values : Tensor (..., T, Hv), optional
        Default: the keys.
    key_proj : Tensor (..., T, Hq), optional
        ``project_keys(keys, W)``, computed once for several calls with the
        same keys; see :func:`additive_attention`.
    %(variants)s
    """
    _check_bias(bias)
    low = _check_tensors([("query", query), ("keys", keys), ("W", W),
                          ("values", values), ("key_proj", key_proj),
                          ("bias", bias)], mask, "key",
                         attn_mask=attn_mask)
    _check_masks(query, keys, mask, attn_mask, causal)
    p, seed_t = _dropout_seed(dropout, seed)
    var = _check_variants(query, keys, window, softcap, alibi_slopes, sinks,
                          cu_seqlens_q, cu_seqlens_k, low)
    eager = _eager(query, keys, W, values, bias, mask, attn_mask,
                   *var[2:4])
    out, second = _call("general", _kv(query, low, eager),
                        _kv(keys, low, eager), _kv(W, low, eager), mask,
                        attn_mask, causal,
                        _f32(bias, low), p, seed_t, _kv(values, low, eager),
                        _f32(key_proj, low), bool(return_weights), *var,
                        cu_seqlens_q, cu_seqlens_k)
    return _back(out, second, low, lse=not return_weights)


for _f in (additive_attention, dot_attention, general_attention):
    _f.__doc__ = (_f.__doc__ or "") % dict(
        masks=_MASKS_DOC, sec5=_SEC5_DOC,
        variants=_VARIANTS_DOC) + _FAMILY_RETURNS
del _f


def project_keys(keys: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """The keys' side of a score, ``keys @ W[:, :H].T`` (..., T, P), for
    ``key_proj=``; differentiable by autograd (``F.linear``), so that a
    decoder loop carries the gradient of the projection once per sequence.

    Parameters
    ----------
    keys : Tensor (..., T, H)
    W : Tensor (P, >= H)
        Additive ``W`` (A, H + Hq): gives ``W_k k_t``; general ``W`` (Hq,
        H): gives ``W_a k_t``.
    """
    _check_tensors([("keys", keys), ("W", W)], None)
    H = keys.shape[-1]
    if W.ndim != 2 or W.shape[1] < H:
        raise ValueError(f"W has shape {tuple(W.shape)}; expected (P, >= H) "
                         f"= (P, >= {H}) to match keys with shape "
                         f"{tuple(keys.shape)}")
    return F.linear(keys, W[:, :H])


# torch.fx.symbolic_trace records the calls of these functions found in
# this module's namespace (attention_c.torch.functional.dot_attention(...))
# as leaves, run at call time: its proxies carry no data for the checks and
# the kernels.  __init__.py and modules.py do the same for theirs.
for _name in __all__:
    torch.fx.wrap(_name)
del _name


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None,
                                 dropout_p: float = 0.0,
                                 is_causal: bool = False,
                                 scale: float | None = None,
                                 enable_gqa: bool = False, *,
                                 window: tuple[int | None, int | None]
                                 | None = None,
                                 softcap: float | None = None,
                                 alibi_slopes: torch.Tensor | None = None,
                                 sinks: torch.Tensor | None = None
                                 ) -> torch.Tensor:
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention``
    on the streamed C kernel: the same signature and semantics, and the
    (..., L, S) weights are never formed, forward or backward.

    Parameters
    ----------
    query : Tensor (..., L, E)
    key : Tensor (..., S, E)
    value : Tensor (..., S, Ev)
        Leading axes broadcast (NumPy rules; a missing axis counts as 1).
        float32 or float64 (bfloat16 and float16 computed in float32).
    attn_mask : Tensor, optional
        Broadcastable to (..., L, S): bool, True = the query may attend
        to the key (as SDPA; ``nn.MultiheadAttention``'s boolean masks
        mean the opposite), or float, added to the scores (-inf masks;
        differentiable).  Read in place, never expanded.
    dropout_p : float, optional
        Dropout on the weights, applied whenever > 0 (as SDPA: pass 0.0
        in evaluation).  Its keep bits come from attention_c's
        counter-based generator with a seed drawn from torch's default
        generator: reproducible under ``torch.manual_seed``, not the same
        bits as PyTorch's dropout.
    is_causal : bool, optional
        Query i sees keys t <= i (top-left aligned, as SDPA).  With L == S
        the causal kernel runs and skips the blocks no query sees.  Given
        with ``attn_mask``, both apply (PyTorch's CPU kernel does so for
        some shapes and refuses the pair for others).
    scale : float, optional
        Default ``1/sqrt(E)``.
    enable_gqa : bool, optional
        Grouped-query attention: query (..., Hq, L, E) against key and
        value (..., Hkv, S, E), Hq a multiple of Hkv; query head j uses key
        head j // (Hq / Hkv).  Read in place, without repeating K and V.
    window, softcap, alibi_slopes, sinks : optional
        Keyword-only, beyond PyTorch's signature: the variants of
        :func:`dot_attention` (docs/contract.md section 8).  Their
        positions are bottom-right aligned (query i at key position i + S
        - L, as FlashAttention's), the same as top-left when L == S
        (``is_causal`` stays top-left).  ``alibi_slopes`` and ``sinks``
        broadcast to the leading axes (..., Hq) of the result, e.g. (Hq,)
        for (B, Hq, L, E).

    Returns
    -------
    Tensor (..., L, Ev)
        0 for a query that may attend to no key (as PyTorch 2.13's CPU
        kernels; earlier versions gave NaN).

    Examples
    --------
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from attention_c.torch import scaled_dot_product_attention
    >>> _ = torch.manual_seed(0)
    >>> q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    >>> out = scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(out, ref, atol=1e-6)
    True
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if isinstance(t, torch.Tensor) and t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dimensions "
                             f"(..., L, E), got shape {tuple(t.shape)}")
    _check_scale(scale)
    nd = max(query.dim(), key.dim(), value.dim())
    if not query.dim() == key.dim() == value.dim():
        # The same rank for all (SDPA broadcasts a missing leading axis;
        # the kernel would read a lower-rank query as one query per
        # sequence).
        query, key, value = (t.reshape((1,) * (nd - t.dim()) + t.shape)
                             for t in (query, key, value))
    L, S = query.shape[-2], key.shape[-2]
    bool_mask = bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bool_mask = attn_mask
        else:
            bias = attn_mask
    causal = bool(is_causal) and L == S
    if is_causal and L != S:
        # Top-left with L != S is not the kernel's bottom-right rule: an
        # (L, S) mask, shared by every sequence.
        tril = torch.ones(L, S, dtype=torch.bool,
                          device=query.device).tril()
        if bias is not None:
            bias = bias.masked_fill(~tril, float("-inf"))
        else:
            bool_mask = tril if bool_mask is None else bool_mask & tril
    groups = 0
    if enable_gqa and nd >= 3 and query.shape[-3] != key.shape[-3]:
        hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
        if hk != hv or hq % hk:
            raise RuntimeError(
                f"Number of heads in key and value must divide the number "
                f"of heads in query: query has {hq}, key {hk}, value {hv} "
                f"(enable_gqa=True)")
        groups = hq // hk
        # query (..., Hkv, G, L, E) against key (..., Hkv, 1, S, E): views.
        query = query.unflatten(-3, (hk, groups))
        key, value = key.unsqueeze(-3), value.unsqueeze(-3)
        bool_mask, bias = (_gqa_mask(m, hk, groups)
                           for m in (bool_mask, bias))
        alibi_slopes, sinks = (_gqa_per_head(x, hk, groups)
                               for x in (alibi_slopes, sinks))
    # (spelled out: a decoding step without the variants pays nothing)
    variants: dict[str, Any] = {}
    per_head: tuple[torch.Tensor, ...] = ()
    if not (window is None and softcap is None and alibi_slopes is None
            and sinks is None):
        variants = {n: x for n, x in (
            ("window", window), ("softcap", softcap),
            ("alibi_slopes", alibi_slopes), ("sinks", sinks))
            if x is not None}
        per_head = tuple(x for x in (alibi_slopes, sinks) if x is not None)
    if dropout_p == 0 and _plain_call(query, key, value, bias, *per_head):
        out = _fast_dot(query, key, value, None, bool_mask, bias, causal,
                        scale, variants)
        if out is not None:
            return out.flatten(-4, -3) if groups else out
    p, seed = _dropout_seed(dropout_p, None if dropout_p == 0 else
                            torch.randint(0, 2**63 - 1, (),
                                          dtype=torch.int64))
    out, _ = dot_attention(query, key, values=value, attn_mask=bool_mask,
                           causal=causal, bias=bias, dropout=p, seed=seed,
                           scale=scale, return_weights=False, **variants)
    return out.flatten(-4, -3) if groups else out


def _gqa_mask(m: torch.Tensor | None, hk: int, groups: int
              ) -> torch.Tensor | None:
    """A mask or bias over query heads (..., Hq, L, S) as (..., Hkv, G, L,
    S), or with a size-1 head axis as (..., 1, 1, L, S): views."""
    if m is None or m.dim() < 3:
        return m
    if m.shape[-3] == 1:
        return m.unsqueeze(-3)
    return m.unflatten(-3, (hk, groups))


def _gqa_per_head(x: torch.Tensor | None, hk: int, groups: int
                  ) -> torch.Tensor | None:
    """alibi_slopes or sinks over query heads (..., Hq) as (..., Hkv, G),
    or with a size-1 head axis as (..., 1, 1): views."""
    if x is None or not isinstance(x, torch.Tensor) or x.dim() < 1:
        return x
    if x.shape[-1] == 1:
        return x.unsqueeze(-1)
    return x.unflatten(-1, (hk, groups))


def _plain_call(query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, bias: torch.Tensor | None,
                *per_head: torch.Tensor) -> bool:
    """Plain eager inference (a decoding step): float32 or float64 CPU
    tensors, nothing for autograd to record, no compile, trace, transform
    or dispatch mode.  ``_ops._plain`` asks the same of an operator's
    call; spelled out here because a step pays for it (through _plain,
    1.5 of SDPA's 6 us)."""
    dt = query.dtype
    return (type(query) is torch.Tensor and type(key) is torch.Tensor
            and type(value) is torch.Tensor
            and (dt is torch.float32 or dt is torch.float64)
            and key.dtype is dt and value.dtype is dt
            and query.is_cpu and key.is_cpu and value.is_cpu
            and (bias is None or (type(bias) is torch.Tensor
                                  and bias.dtype is dt and bias.is_cpu
                                  and not bias.requires_grad))
            and not (torch.is_grad_enabled()
                     and (query.requires_grad or key.requires_grad
                          or value.requires_grad))
            and (not per_head
                 or all(type(x) is torch.Tensor and x.dtype is dt
                        and x.is_cpu and not x.requires_grad
                        for x in per_head))
            and not torch.compiler.is_compiling() and not _tracing()
            and not torch._C._are_functorch_transforms_active()
            and torch._C._len_torch_dispatch_stack() == 0)


def _fast_dot(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
              bias: torch.Tensor | None, causal: bool, scale: float | None,
              variants: dict[str, Any] | None = None
              ) -> torch.Tensor | None:
    """The kernel called directly on NumPy views, as the custom operator's
    body would be: the per-call cost of one-token decoding is this, not
    the dispatcher's.  None when the kernel refuses the arguments: the
    regular path then raises the error in PyTorch's terms."""
    extra: dict[str, Any] = {} if not variants else {
        n: x.numpy() if isinstance(x, torch.Tensor) else x
        for n, x in variants.items()}
    try:
        out, _ = _ac.dot_attention(
            query.numpy(), key.numpy(), values=value.numpy(),
            mask=None if mask is None else mask.numpy(),
            attn_mask=None if attn_mask is None else attn_mask.numpy(),
            causal=causal, bias=None if bias is None else bias.numpy(),
            scale=scale, return_weights=False, **extra)
    except (TypeError, ValueError, RuntimeError):
        return None
    return torch.from_numpy(out)
