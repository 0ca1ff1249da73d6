"""The functional API of attention_c.torch, as ``torch.nn.functional``:
differentiable functions on CPU tensors with the signatures of their NumPy
counterparts in :mod:`attention_c` (required data and parameters by
position, every optional argument by keyword), returning ``(out, alpha)``.

Each checks its arguments (in PyTorch's terms), casts bfloat16 and float16
to float32, and calls a custom operator (attention_c.torch._ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._ops import _call
from ._utils import _back, _check_tensors, _f32, _tracing

__all__ = ["context_attention", "additive_attention", "dot_attention",
           "general_attention", "project_keys"]


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
        0 for a query with no valid key.
    alpha : Tensor (..., T) or (..., Tq, T)
        The attention weights, 0 for masked keys.

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


def additive_attention(query: torch.Tensor, keys: torch.Tensor,
                       W: torch.Tensor, v: torch.Tensor, *,
                       b: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None,
                       values: torch.Tensor | None = None,
                       key_proj: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive attention on CPU tensors, differentiable:
    ``s_it = v . tanh(W_k k_t + W_q q_i + b)``.

    Same maths, arguments and shapes as
    :func:`attention_c.additive_attention` (docs/contract.md section 4); the
    gradients are the C backward.

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
    mask : Tensor of torch.bool (..., T) or (..., Tq, T), optional
        True marks a valid key (the opposite of ``key_padding_mask`` of
        ``nn.MultiheadAttention``); per query only with several queries.
        Must not require grad.
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
                          ("key_proj", key_proj)], mask, "key")
    out, alpha = _call("additive", _f32(query, low), _f32(keys, low),
                       _f32(W, low), _f32(v, low), _f32(b, low), mask,
                       _f32(values, low), _f32(key_proj, low))
    return _back(out, alpha, low)


def dot_attention(query: torch.Tensor, keys: torch.Tensor, *,
                  mask: torch.Tensor | None = None,
                  values: torch.Tensor | None = None,
                  scale: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention on CPU tensors, differentiable:
    ``s_it = scale q_i . k_t``.

    Same maths, arguments and shapes as :func:`attention_c.dot_attention`
    (docs/contract.md section 4); the gradients are the C backward.  With
    several queries this is ``F.scaled_dot_product_attention(query, keys,
    values, attn_mask=mask, scale=scale)`` (the same scale and mask
    conventions); a query with no valid key gets 0 (older PyTorch versions
    gave NaN there).

    Parameters
    ----------
    query : Tensor (..., H) or (..., Tq, H)
        One query per sequence, or several when ``query.ndim ==
        keys.ndim``.  float32 or float64 (bfloat16 and float16 computed
        in float32), on the CPU.
    keys : Tensor (..., T, H)
    mask : Tensor of torch.bool (..., T) or (..., Tq, T), optional
        True marks a valid key.  Must not require grad.  Keyword-only, as
        every optional argument.
    values : Tensor (..., T, Hv), optional
        Default: the keys.
    scale : float, optional
        Default ``1/sqrt(H)``.
    """
    low = _check_tensors([("query", query), ("keys", keys),
                          ("values", values)], mask, "key")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a real number or None, got "
                        f"{type(scale).__name__}")
    out, alpha = _call("dot", _f32(query, low), _f32(keys, low), mask,
                       _f32(values, low),
                       None if scale is None else float(scale))
    return _back(out, alpha, low)


def general_attention(query: torch.Tensor, keys: torch.Tensor,
                      W: torch.Tensor, *, mask: torch.Tensor | None = None,
                      values: torch.Tensor | None = None,
                      key_proj: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Multiplicative ("general") attention on CPU tensors, differentiable:
    ``s_it = q_i . (W_a k_t)``.

    Same maths, arguments and shapes as
    :func:`attention_c.general_attention` (docs/contract.md section 4); the
    gradients are the C backward.

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
    mask : Tensor of torch.bool (..., T) or (..., Tq, T), optional
        True marks a valid key.  Must not require grad.  Keyword-only, as
        every optional argument.
    values : Tensor (..., T, Hv), optional
        Default: the keys.
    key_proj : Tensor (..., T, Hq), optional
        ``project_keys(keys, W)``, computed once for several calls with the
        same keys; see :func:`additive_attention`.
    """
    low = _check_tensors([("query", query), ("keys", keys), ("W", W),
                          ("values", values), ("key_proj", key_proj)], mask,
                         "key")
    out, alpha = _call("general", _f32(query, low), _f32(keys, low),
                       _f32(W, low), mask, _f32(values, low),
                       _f32(key_proj, low))
    return _back(out, alpha, low)


for _f in (additive_attention, dot_attention, general_attention):
    _f.__doc__ = (_f.__doc__ or "") + _FAMILY_RETURNS
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
