"""PyTorch adapter: the C kernels as autograd functions and nn.Modules.

Imported only on demand (``import attention_c.torch``), so torch stays an
optional dependency of attention_c.  CPU tensors of float32 or float64 are
handed to the kernels without copying (``tensor.numpy()`` shares memory) and
the results come back with ``torch.from_numpy`` (no copy either)::

    from attention_c.torch import ContextAttention
    pool = ContextAttention(hidden_size=64, attention_size=32)
    out = pool(h, mask)          # h (B, T, 64), mask (B, T) bool, True = valid

The attention family (docs/contract.md section 4) attends from queries to keys:
:class:`AdditiveAttention`, :class:`DotAttention`, :class:`GeneralAttention`
(and the functions :func:`additive_attention`, :func:`dot_attention`,
:func:`general_attention`)::

    attn = AdditiveAttention(key_size=64, query_size=32, attention_size=48)
    out = attn(query, keys, mask=mask)     # query (B, 32), keys (B, T, 64)

Double backward (gradients of gradients) is not supported.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import attention_c as _ac
from attention_c import layer as _layer

# The C extension itself, for the backward's private stop_at_key_proj=True
# (it has no type stub: the public functions' are in __init__.pyi).
_core: Any = importlib.import_module("attention_c._core")

__all__ = ["ContextAttentionFunction", "context_attention",
           "ContextAttention",
           "AdditiveAttentionFunction", "additive_attention",
           "AdditiveAttention",
           "DotAttentionFunction", "dot_attention", "DotAttention",
           "GeneralAttentionFunction", "general_attention",
           "GeneralAttention", "project_keys"]

_FLOATS = (torch.float32, torch.float64)


def _np(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a checked CPU tensor: shared memory, any strides."""
    return t.detach().numpy()


def _np_opt(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else _np(t)


def _check_tensors(named: list[tuple[str, torch.Tensor | None]],
                   mask: torch.Tensor | None, item: str = "item") -> None:
    """Errors that the kernels cannot phrase in PyTorch's terms.

    ``named`` are the float tensors (None for an absent optional one), the
    first setting the dtype of all; ``mask`` the boolean mask of the valid
    items (``item``: what it masks, for the messages).
    """
    for name, t in [*named, ("mask", mask)]:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(
                f"attention_c.torch runs on the CPU only, but {name} is on "
                f"device '{t.device}'; move the module and its inputs with "
                f".cpu(), or use a pure-PyTorch attention on the GPU")
    first, ref = named[0]
    assert ref is not None
    for name, t in named:
        if t is None:
            continue
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} has dtype {t.dtype}; attention_c.torch "
                            f"supports torch.float32 and torch.float64")
        if t.dtype != ref.dtype:
            # NumPy would promote; autograd needs each gradient in the
            # dtype of its input, so mixed dtypes are refused instead.
            raise TypeError(f"{name} has dtype {t.dtype} but {first} has "
                            f"{ref.dtype}; convert them to one dtype")
    if mask is not None:
        if mask.requires_grad:
            raise ValueError(f"mask requires grad, but a mask is not "
                             f"differentiable: pass a torch.bool tensor "
                             f"(True = valid {item}), e.g. mask.detach() > 0")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask has dtype {mask.dtype}; expected "
                            f"torch.bool with True = valid {item}")


def _check(h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
           b: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    _check_tensors([("h", h), ("W", W), ("v", v), ("b", b)], mask)


def _module_dtype(dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of a module's parameters: float32 or float64."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in _FLOATS:
        raise TypeError(f"dtype must be torch.float32 or torch.float64, "
                        f"got {dtype}")
    return dtype


def _uniform_(p: torch.Tensor | None, fan_in: int) -> None:
    """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` in place, as ``nn.Linear``."""
    if p is not None:
        bound = 1.0 / math.sqrt(fan_in)
        with torch.no_grad():
            p.uniform_(-bound, bound)


def _load_(p: torch.Tensor | None, x: np.ndarray | None) -> None:
    """Copy the loaded values ``x`` into the parameter ``p`` (both or
    neither None)."""
    if p is not None and x is not None:
        with torch.no_grad():
            p.copy_(torch.from_numpy(x))


class ContextAttentionFunction(torch.autograd.Function):
    """``(out, alpha) = context_attention(h, W, v, b, mask)`` as an autograd
    function whose forward and backward are one C call each.

    Use :func:`context_attention` (which checks the arguments) rather than
    ``ContextAttentionFunction.apply`` directly.  Both outputs are
    differentiable; ``mask`` is not.  ``keep=True`` saves the tanh
    activations for the backward, which then skips recomputing them.
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
                b: torch.Tensor | None, mask: torch.Tensor | None,
                keep: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        act: list[np.ndarray]               # [activations] or []
        out, alpha, *act = _ac.context_attention(
            _np(h), _np(W), _np(v), _np_opt(b), _np_opt(mask),
            keep_activations=keep)
        out_t, alpha_t = torch.from_numpy(out), torch.from_numpy(alpha)
        # Saved as tensors so that autograd reports an input or alpha
        # modified in place before the backward.
        ctx.save_for_backward(h, W, v, b, mask, alpha_t)
        ctx.act = act[0] if act else None   # internal: nobody can modify it
        ctx.set_materialize_grads(False)    # an unused output gives None
        return out_t, alpha_t

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor | None,
                 grad_alpha: torch.Tensor | None) -> tuple[Any, ...]:
        h_t, W_t, v_t, b_t, mask_t, alpha_t = ctx.saved_tensors
        h, W, v, alpha = _np(h_t), _np(W_t), _np(v_t), _np(alpha_t)
        b, mask = _np_opt(b_t), _np_opt(mask_t)
        need = ctx.needs_input_grad
        if grad_out is None and grad_alpha is None or not any(need):
            return None, None, None, None, None, None
        if grad_out is None:
            go = np.zeros(h.shape[:-2] + h.shape[-1:], h.dtype)
        else:
            go = _np(grad_out)
        g = _ac.context_attention_backward(go, h, W, v, alpha, b, mask,
                                           _np_opt(grad_alpha),
                                           activations=ctx.act)

        def to_torch(x: np.ndarray | None, i: int) -> torch.Tensor | None:
            return torch.from_numpy(x) if need[i] and x is not None else None

        return (to_torch(g.h, 0), to_torch(g.W, 1), to_torch(g.v, 2),
                to_torch(g.b, 3), None, None)


def context_attention(h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
                      b: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-pooled additive attention on CPU tensors, differentiable.

    Same maths and shapes as :func:`attention_c.context_attention`
    (docs/contract.md section 1); the gradients are the C backward.

    Parameters
    ----------
    h : Tensor (..., T, H)
        float32 or float64, on the CPU; ``W``, ``v``, ``b`` of the same
        dtype.
    W : Tensor (A, 2H)
        Layout of ``torch.nn.Linear(2H, A).weight``.
    v : Tensor (A,)
    b : Tensor (A,), optional
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
        A dtype other than float32/float64, mixed dtypes, a mask that is
        not boolean.
    """
    _check(h, W, v, b, mask)
    # Keep the tanh activations for the backward only if there will be one.
    keep = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, W, v, b))
    # Function.apply is not annotated in torch: typed here by the signature.
    apply: Any = ContextAttentionFunction.apply
    out, alpha = apply(h, W, v, b, mask, keep)
    return out, alpha


class ContextAttention(torch.nn.Module):
    """Context-pooled additive attention pooling as an ``nn.Module``.

    Pools ``h`` (..., T, H) to (..., H) with the weights
    ``alpha = masked softmax of v . tanh(W_h h_t + W_c c + b)``, ``c`` the
    mean of the valid items.  Runs the C kernels on the CPU.

    Parameters
    ----------
    hidden_size : int
        H.
    attention_size : int
        A, the width of the score network.
    bias : bool, optional
        Whether the score network has a bias (default True).
    dtype : torch.dtype, optional
        torch.float32 (default: ``torch.get_default_dtype()``) or
        torch.float64.

    Attributes
    ----------
    W : Parameter (A, 2H)
        Initialised like ``nn.Linear(2H, A).weight``.
    v : Parameter (A,)
        Initialised like ``nn.Linear(A, 1).weight``.
    b : Parameter (A,) or None
        Initialised like ``nn.Linear(2H, A).bias``.
    """

    def __init__(self, hidden_size: int, attention_size: int,
                 bias: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = _module_dtype(dtype)
        self.hidden_size = hidden_size
        self.attention_size = attention_size
        A, H = attention_size, hidden_size
        self.W = torch.nn.Parameter(torch.empty(A, 2 * H, dtype=dtype))
        self.v = torch.nn.Parameter(torch.empty(A, dtype=dtype))
        self.b = (torch.nn.Parameter(torch.empty(A, dtype=dtype)) if bias
                  else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` as in ``nn.Linear``."""
        _uniform_(self.W, 2 * self.hidden_size)
        _uniform_(self.b, 2 * self.hidden_size)
        _uniform_(self.v, self.attention_size)

    @classmethod
    def from_linear(cls, score: torch.nn.Linear,
                    out: torch.nn.Linear | torch.Tensor
                    ) -> ContextAttention:
        """The module computing ``out(tanh(score([h_t, c])))`` scores with
        the weights (copied) of a ``Linear(2H, A)``, ``Linear(A, 1)`` pair.

        ``out.bias`` is dropped: a constant added to every score does not
        change the softmax.  ``out`` may also be ``v`` itself, a tensor (A,)
        or (1, A).
        """
        W, v, b = _layer._context_from_linear(score, out)
        module = cls(W.shape[1] // 2, W.shape[0], bias=b is not None,
                     dtype=score.weight.dtype)
        for p, x in [(module.W, W), (module.v, v), (module.b, b)]:
            _load_(p, x)
        return module

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None,
                return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pool ``h`` (..., T, H) to (..., H).

        Parameters
        ----------
        h : Tensor (..., T, H)
        mask : Tensor of torch.bool (..., T), optional
            True marks a valid item.
        return_weights : bool, optional
            Also return the attention weights (..., T).
        """
        out, alpha = context_attention(h, self.W, self.v, self.b, mask)
        return (out, alpha) if return_weights else out

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, "
                f"attention_size={self.attention_size}, "
                f"bias={self.b is not None}")


# --------------------------------------------------------------------------
# The attention family (docs/contract.md section 4): a query against keys.
#
# Each autograd function below takes the arguments of its NumPy function in
# the same order and returns (out, alpha); its backward is one C call.  Given
# a key_proj that requires grad, the backward stops at it (the private
# stop_at_key_proj=True of _core's backward): autograd takes its gradient
# through the graph of project_keys, once however many calls share it.


def _save(ctx: Any, out: np.ndarray, alpha: np.ndarray,
          *inputs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's bookkeeping: save the inputs and alpha for the
    backward, return (out, alpha) as tensors (sharing the arrays)."""
    out_t, alpha_t = torch.from_numpy(out), torch.from_numpy(alpha)
    # Saved as tensors so that autograd reports an input or alpha modified
    # in place before the backward.
    ctx.save_for_backward(*inputs, alpha_t)
    ctx.out_shape, ctx.out_dtype = out.shape, out.dtype
    ctx.set_materialize_grads(False)        # an unused output gives None
    return out_t, alpha_t


def _grad_out(ctx: Any, grad_out: torch.Tensor | None) -> np.ndarray:
    """dL/dout as an array, zeros when only alpha was used."""
    if grad_out is None:
        return np.zeros(ctx.out_shape, ctx.out_dtype)
    return _np(grad_out)


def _nothing_to_do(ctx: Any, grad_out: torch.Tensor | None,
                   grad_alpha: torch.Tensor | None) -> bool:
    return grad_out is None and grad_alpha is None or not any(
        ctx.needs_input_grad)


def _to_torch(ctx: Any, *grads: np.ndarray | None
              ) -> tuple[torch.Tensor | None, ...]:
    """The gradients as tensors (no copy), None where not needed."""
    return tuple(torch.from_numpy(g) if need and g is not None else None
                 for g, need in zip(grads, ctx.needs_input_grad))


class AdditiveAttentionFunction(torch.autograd.Function):
    """``(out, alpha) = additive_attention(query, keys, W, v, b, mask,
    values, key_proj)`` as an autograd function whose forward and backward
    are one C call each.

    Use :func:`additive_attention` (which checks the arguments) rather than
    ``AdditiveAttentionFunction.apply`` directly.  Both outputs are
    differentiable; ``mask`` is not.  Given a ``key_proj`` that requires
    grad, the backward returns dL/d key_proj and leaves the keys'
    projection to autograd (the graph of :func:`project_keys`, once per
    sequence).
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, keys: torch.Tensor,
                W: torch.Tensor, v: torch.Tensor, b: torch.Tensor | None,
                mask: torch.Tensor | None, values: torch.Tensor | None,
                key_proj: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        out, alpha = _ac.additive_attention(
            _np(query), _np(keys), _np(W), _np(v), _np_opt(b), _np_opt(mask),
            _np_opt(values), _np_opt(key_proj))
        return _save(ctx, out, alpha, query, keys, W, v, b, mask, values,
                     key_proj)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor | None,
                 grad_alpha: torch.Tensor | None) -> tuple[Any, ...]:
        if _nothing_to_do(ctx, grad_out, grad_alpha):
            return (None,) * 8
        q_t, k_t, W_t, v_t, b_t, m_t, val_t, kp_t, alpha_t = ctx.saved_tensors
        args = (_grad_out(ctx, grad_out), _np(q_t), _np(k_t), _np(W_t),
                _np(v_t), _np(alpha_t), _np_opt(b_t), _np_opt(m_t),
                _np_opt(val_t), _np_opt(grad_alpha))
        if not ctx.needs_input_grad[7]:     # no key_proj, or a constant one
            g = _ac.additive_attention_backward(*args, _np_opt(kp_t))
            return _to_torch(ctx, g.query, g.keys, g.W, g.v, g.b, None,
                             g.values, None)
        # The gradient stops at key_proj: dkeys is only the value path
        # (when the keys are the values), dW is 0 in the key columns.
        dq, dk, dval, dW, dv, db, dkp = _core.additive_attention_backward(
            *args, key_proj=_np(kp_t), stop_at_key_proj=True)
        return _to_torch(ctx, dq, dk if val_t is None else None, dW, dv, db,
                         None, dval, dkp)


class DotAttentionFunction(torch.autograd.Function):
    """``(out, alpha) = dot_attention(query, keys, mask, values, scale)`` as
    an autograd function whose forward and backward are one C call each.

    Use :func:`dot_attention` (which checks the arguments).
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, keys: torch.Tensor,
                mask: torch.Tensor | None, values: torch.Tensor | None,
                scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, alpha = _ac.dot_attention(_np(query), _np(keys), _np_opt(mask),
                                       _np_opt(values), scale)
        ctx.scale = scale
        return _save(ctx, out, alpha, query, keys, mask, values)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor | None,
                 grad_alpha: torch.Tensor | None) -> tuple[Any, ...]:
        if _nothing_to_do(ctx, grad_out, grad_alpha):
            return (None,) * 5
        q_t, k_t, m_t, val_t, alpha_t = ctx.saved_tensors
        g = _ac.dot_attention_backward(
            _grad_out(ctx, grad_out), _np(q_t), _np(k_t), _np(alpha_t),
            _np_opt(m_t), _np_opt(val_t), ctx.scale, _np_opt(grad_alpha))
        return _to_torch(ctx, g.query, g.keys, None, g.values, None)


class GeneralAttentionFunction(torch.autograd.Function):
    """``(out, alpha) = general_attention(query, keys, W, mask, values,
    key_proj)`` as an autograd function whose forward and backward are one
    C call each.

    Use :func:`general_attention` (which checks the arguments).  Given a
    ``key_proj`` that requires grad, the backward returns dL/d key_proj and
    no gradient for ``W`` or through the keys' projection: autograd takes
    those through the graph of :func:`project_keys`.
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, keys: torch.Tensor,
                W: torch.Tensor, mask: torch.Tensor | None,
                values: torch.Tensor | None, key_proj: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        out, alpha = _ac.general_attention(
            _np(query), _np(keys), _np(W), _np_opt(mask), _np_opt(values),
            _np_opt(key_proj))
        return _save(ctx, out, alpha, query, keys, W, mask, values, key_proj)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor | None,
                 grad_alpha: torch.Tensor | None) -> tuple[Any, ...]:
        if _nothing_to_do(ctx, grad_out, grad_alpha):
            return (None,) * 6
        q_t, k_t, W_t, m_t, val_t, kp_t, alpha_t = ctx.saved_tensors
        args = (_grad_out(ctx, grad_out), _np(q_t), _np(k_t), _np(W_t),
                _np(alpha_t), _np_opt(m_t), _np_opt(val_t),
                _np_opt(grad_alpha))
        if not ctx.needs_input_grad[5]:     # no key_proj, or a constant one
            g = _ac.general_attention_backward(*args, _np_opt(kp_t))
            return _to_torch(ctx, g.query, g.keys, g.W, None, g.values, None)
        # As for the additive score; W only acts through key_proj here.
        dq, dk, dval, _, dkp = _core.general_attention_backward(
            *args, key_proj=_np(kp_t), stop_at_key_proj=True)
        return _to_torch(ctx, dq, dk if val_t is None else None, None, None,
                         dval, dkp)


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
        A dtype other than float32/float64, mixed dtypes, a mask that is
        not boolean.
"""


def additive_attention(query: torch.Tensor, keys: torch.Tensor,
                       W: torch.Tensor, v: torch.Tensor,
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
        keys.ndim``.  float32 or float64, on the CPU; every other float
        tensor of the same dtype.
    keys : Tensor (..., T, H)
    W : Tensor (A, H + Hq)
        ``[W_k | W_q]``, the layout of ``torch.nn.Linear(H + Hq, A).weight``
        applied to ``[k_t; q_i]``.
    v : Tensor (A,)
    b : Tensor (A,), optional
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
    _check_tensors([("query", query), ("keys", keys), ("W", W), ("v", v),
                    ("b", b), ("values", values), ("key_proj", key_proj)],
                   mask, "key")
    apply: Any = AdditiveAttentionFunction.apply
    out, alpha = apply(query, keys, W, v, b, mask, values, key_proj)
    return out, alpha


def dot_attention(query: torch.Tensor, keys: torch.Tensor,
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
        keys.ndim``.  float32 or float64, on the CPU.
    keys : Tensor (..., T, H)
    mask : Tensor of torch.bool (..., T) or (..., Tq, T), optional
        True marks a valid key.  Must not require grad.
    values : Tensor (..., T, Hv), optional
        Default: the keys.
    scale : float, optional
        Default ``1/sqrt(H)``.
    """
    _check_tensors([("query", query), ("keys", keys), ("values", values)],
                   mask, "key")
    apply: Any = DotAttentionFunction.apply
    out, alpha = apply(query, keys, mask, values,
                       None if scale is None else float(scale))
    return out, alpha


def general_attention(query: torch.Tensor, keys: torch.Tensor,
                      W: torch.Tensor, mask: torch.Tensor | None = None,
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
        keys.ndim``.  float32 or float64, on the CPU.
    keys : Tensor (..., T, H)
    W : Tensor (Hq, H)
        ``W_a``, the layout of ``torch.nn.Linear(H, Hq).weight`` applied to
        the keys.
    mask : Tensor of torch.bool (..., T) or (..., Tq, T), optional
        True marks a valid key.  Must not require grad.
    values : Tensor (..., T, Hv), optional
        Default: the keys.
    key_proj : Tensor (..., T, Hq), optional
        ``project_keys(keys, W)``, computed once for several calls with the
        same keys; see :func:`additive_attention`.
    """
    _check_tensors([("query", query), ("keys", keys), ("W", W),
                    ("values", values), ("key_proj", key_proj)], mask, "key")
    apply: Any = GeneralAttentionFunction.apply
    out, alpha = apply(query, keys, W, mask, values, key_proj)
    return out, alpha


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


def _family_forward(out: torch.Tensor, alpha: torch.Tensor,
                    return_weights: bool
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return (out, alpha) if return_weights else out


class AdditiveAttention(torch.nn.Module):
    """Additive (Bahdanau) attention as an ``nn.Module`` on the C kernels.

    ``s_it = v . tanh(W_k k_t + W_q q_i + b)``, ``alpha_i`` the masked
    softmax of ``s_i`` over the keys, ``out_i = sum_t alpha_it val_t``.

    Parameters
    ----------
    key_size : int
        H.
    query_size : int
        Hq.
    attention_size : int
        A, the width of the score network.
    bias : bool, optional
        Whether the score network has a bias (default True).
    dtype : torch.dtype, optional
        torch.float32 (default: ``torch.get_default_dtype()``) or
        torch.float64.

    Attributes
    ----------
    W : Parameter (A, H + Hq)
        ``[W_k | W_q]``, initialised like ``nn.Linear(H + Hq, A).weight``.
    v : Parameter (A,)
        Initialised like ``nn.Linear(A, 1).weight``.
    b : Parameter (A,) or None
        Initialised like ``nn.Linear(H + Hq, A).bias``.

    Examples
    --------
    A decoder that attends to the same keys at every step projects them
    once; autograd then carries their gradient once per sequence::

        attn = AdditiveAttention(key_size=64, query_size=32,
                                 attention_size=48)
        kp = attn.project_keys(keys)                   # (B, T, 48)
        for step in range(steps):
            context = attn(state, keys, mask=mask, key_proj=kp)
            state = cell(context, state)
    """

    def __init__(self, key_size: int, query_size: int, attention_size: int,
                 bias: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = _module_dtype(dtype)
        self.key_size, self.query_size = key_size, query_size
        self.attention_size = attention_size
        A, H, Hq = attention_size, key_size, query_size
        self.W = torch.nn.Parameter(torch.empty(A, H + Hq, dtype=dtype))
        self.v = torch.nn.Parameter(torch.empty(A, dtype=dtype))
        self.b = (torch.nn.Parameter(torch.empty(A, dtype=dtype)) if bias
                  else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` as in ``nn.Linear``."""
        _uniform_(self.W, self.key_size + self.query_size)
        _uniform_(self.b, self.key_size + self.query_size)
        _uniform_(self.v, self.attention_size)

    @classmethod
    def _from_weights(cls, W: np.ndarray, v: np.ndarray,
                      b: np.ndarray | None, key_size: int
                      ) -> AdditiveAttention:
        module = cls(key_size, W.shape[1] - key_size, W.shape[0],
                     bias=b is not None, dtype=torch.from_numpy(W).dtype)
        for p, x in [(module.W, W), (module.v, v), (module.b, b)]:
            _load_(p, x)
        return module

    @classmethod
    def from_linear(cls, score: torch.nn.Linear,
                    out: torch.nn.Linear | torch.Tensor,
                    key_size: int) -> AdditiveAttention:
        """The module computing ``out(tanh(score([k_t, q_i])))`` scores
        with the weights (copied) of a ``Linear(H + Hq, A)``,
        ``Linear(A, 1)`` pair.

        ``key_size`` is H: the first H inputs of ``score`` take the key,
        the others the query.  ``out`` may also be ``v`` itself, a tensor
        (A,) or (1, A); ``out.bias`` is dropped (a constant added to every
        score does not change the softmax).
        """
        W, v, b = _layer._additive_from_linear(score, out, key_size)
        return cls._from_weights(W, v, b, key_size)

    @classmethod
    def from_d2l(cls, W_k: torch.nn.Linear, W_q: torch.nn.Linear,
                 w_v: torch.nn.Linear | torch.Tensor) -> AdditiveAttention:
        """The module computing d2l.ai's ``w_v(tanh(W_k(k_t) + W_q(q_i)))``
        scores with the weights (copied) of ``W_k = Linear(H, A)``, ``W_q =
        Linear(Hq, A)``, ``w_v = Linear(A, 1)`` (d2l's have no biases; any
        biases of ``W_k`` and ``W_q`` add up to ``b``, ``w_v``'s is
        dropped).

        d2l masks with ``valid_lens`` and gives a query with no valid key
        uniform weights; here it gets 0.
        """
        W, v, b, H = _layer._additive_from_d2l(W_k, W_q, w_v)
        return cls._from_weights(W, v, b, H)

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """``W_k k_t`` (..., T, A) for ``forward(..., key_proj=)``."""
        return project_keys(keys, self.W)

    def forward(self, query: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None,
                return_weights: bool = False,
                key_proj: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` to ``keys``.

        Parameters
        ----------
        query : Tensor (..., Hq) or (..., Tq, Hq)
            Several queries when ``query.ndim == keys.ndim``.
        keys : Tensor (..., T, H)
        values : Tensor (..., T, Hv), optional
            Default: the keys.
        mask : Tensor of torch.bool (..., T) or (..., Tq, T), optional
            True marks a valid key.
        return_weights : bool, optional
            Also return the attention weights (..., T) or (..., Tq, T).
        key_proj : Tensor (..., T, A), optional
            :meth:`project_keys` of these keys, computed once per sequence.

        Returns
        -------
        out : Tensor (..., Hv) or (..., Tq, Hv)
        """
        out, alpha = additive_attention(query, keys, self.W, self.v, self.b,
                                        mask, values, key_proj)
        return _family_forward(out, alpha, return_weights)

    def extra_repr(self) -> str:
        return (f"key_size={self.key_size}, query_size={self.query_size}, "
                f"attention_size={self.attention_size}, "
                f"bias={self.b is not None}")


class DotAttention(torch.nn.Module):
    """Scaled dot-product attention as an ``nn.Module`` on the C kernels
    (no parameters): ``s_it = scale q_i . k_t``.

    Parameters
    ----------
    scale : float, optional
        Default ``1/sqrt(H)``, H the features of a key and of a query.
    """

    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.scale = None if scale is None else float(scale)

    def forward(self, query: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None,
                return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` (..., H) or (..., Tq, H) to ``keys``
        (..., T, H); arguments and results as in
        :meth:`AdditiveAttention.forward`."""
        out, alpha = dot_attention(query, keys, mask, values, self.scale)
        return _family_forward(out, alpha, return_weights)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class GeneralAttention(torch.nn.Module):
    """Multiplicative ("general", Luong) attention as an ``nn.Module`` on
    the C kernels: ``s_it = q_i . (W_a k_t)``.

    Parameters
    ----------
    query_size : int
        Hq.
    key_size : int
        H.
    dtype : torch.dtype, optional
        torch.float32 (default: ``torch.get_default_dtype()``) or
        torch.float64.

    Attributes
    ----------
    W : Parameter (Hq, H)
        ``W_a``, initialised like ``nn.Linear(H, Hq, bias=False).weight``.
    """

    def __init__(self, query_size: int, key_size: int,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = _module_dtype(dtype)
        self.query_size, self.key_size = query_size, key_size
        self.W = torch.nn.Parameter(torch.empty(query_size, key_size,
                                                dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(H), 1/sqrt(H))`` as in ``nn.Linear(H, Hq)``."""
        _uniform_(self.W, self.key_size)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> GeneralAttention:
        """The module computing ``q_i . linear(k_t)`` scores with the weight
        (copied) of a ``Linear(H, Hq)``.  A bias would add ``q_i . bias``
        to every score of query i, which leaves its softmax as it is: it is
        dropped."""
        W = _layer._general_from_linear(linear)
        module = cls(W.shape[0], W.shape[1], dtype=torch.from_numpy(W).dtype)
        _load_(module.W, W)
        return module

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """``W_a k_t`` (..., T, Hq) for ``forward(..., key_proj=)``."""
        return project_keys(keys, self.W)

    def forward(self, query: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None,
                return_weights: bool = False,
                key_proj: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` (..., Hq) or (..., Tq, Hq) to ``keys``
        (..., T, H); arguments and results as in
        :meth:`AdditiveAttention.forward` (``key_proj`` (..., T, Hq))."""
        out, alpha = general_attention(query, keys, self.W, mask, values,
                                       key_proj)
        return _family_forward(out, alpha, return_weights)

    def extra_repr(self) -> str:
        return f"query_size={self.query_size}, key_size={self.key_size}"
