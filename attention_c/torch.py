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

The kernels are PyTorch custom operators (``torch.ops.attention_c.*``,
registered with ``torch.library.custom_op``), each with a fake (shape-only)
implementation, an autograd formula and a vmap rule, so the functions and
modules work under ``torch.compile(fullgraph=True)``, ``torch.export``,
``torch.func`` (grad, vjp, jvp, jacrev, jacfwd, hessian, vmap) and on 'meta'
tensors.  First-order gradients are the C backward; higher-order ones
(``create_graph=True``, Hessians, gradient penalties) differentiate a
PyTorch transcription of docs/contract.md and are exact.  bfloat16 and
float16 are computed in float32 and returned in their dtype; under
``torch.autocast('cpu')`` the layers compute in float32 and return float32.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, NamedTuple

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
# Computed in float32 and returned in their own dtype, as the NumPy API does
# for float16.
_LOW = (torch.bfloat16, torch.float16)
_DTYPES_TEXT = ("torch.float32, torch.float64 (computed natively), "
                "torch.bfloat16 and torch.float16 (computed in float32)")


def _np(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a checked CPU tensor: shared memory, any strides."""
    return t.detach().numpy()


def _np_opt(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else _np(t)


def _check_tensors(named: list[tuple[str, torch.Tensor | None]],
                   mask: torch.Tensor | None, item: str = "item"
                   ) -> torch.dtype | None:
    """Errors that the kernels cannot phrase in PyTorch's terms.

    ``named`` are the float tensors (None for an absent optional one), the
    first setting the dtype of all; ``mask`` the boolean mask of the valid
    items (``item``: what it masks, for the messages).

    Returns the dtype to compute in float32 and return in: bfloat16 or
    float16, float32 under ``torch.autocast`` (any mix of dtypes), or None
    when the tensors go to the kernels as they are (float32, float64).
    """
    present = [(n, t) for n, t in [*named, ("mask", mask)] if t is not None]
    for name, t in present:
        if isinstance(t, torch.fx.Proxy):
            # Only for a direct call: the modules' calls are leaves of
            # symbolic_trace (torch.fx.wrap below).
            raise TypeError(
                f"{name} is a torch.fx.Proxy: torch.fx.symbolic_trace "
                f"cannot trace into attention_c.torch; call its modules or "
                f"its functions as attributes of the module (e.g. "
                f"attention_c.torch.dot_attention), which symbolic_trace "
                f"keeps as leaves, or use torch.export.export or make_fx")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
        if t.layout != torch.strided or t.is_nested:
            kind = "nested" if t.is_nested else str(t.layout)
            raise TypeError(f"{name} is a {kind} tensor; attention_c.torch "
                            f"takes dense (strided) tensors: convert it "
                            f"with .to_dense() or .to_padded_tensor() and "
                            f"a mask")
    # All on 'meta': only shapes, which the operators' fake implementation
    # propagates.  Anything else off the CPU is refused.
    all_meta = all(t.device.type == "meta" for _, t in present)
    for name, t in present:
        if t.device.type != "cpu" and not all_meta:
            raise ValueError(
                f"attention_c.torch runs on the CPU only, but {name} is on "
                f"device '{t.device}'; move the module and its inputs with "
                f".cpu(), or use a pure-PyTorch attention on the GPU")
    first, ref = named[0]
    assert ref is not None
    autocast = torch.is_autocast_enabled("cpu")
    for name, x in named:
        if x is None:
            continue
        t = x
        if t.dtype not in _FLOATS + _LOW:
            raise TypeError(f"{name} has dtype {t.dtype}; attention_c.torch "
                            f"supports {_DTYPES_TEXT}")
        if t.dtype != ref.dtype and not autocast:
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
    if autocast and any(t is not None and t.dtype != torch.float64
                        for _, t in named):
        # In float32, like autocast's softmax.  Cast here, where autograd
        # records it, rather than inside the autograd.Function (whose saved
        # inputs would keep autocast's dtypes).
        return torch.float32
    return ref.dtype if ref.dtype in _LOW else None


def _back(out: torch.Tensor, alpha: torch.Tensor, low: torch.dtype | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, alpha)`` in the caller's low-precision dtype, if any."""
    if low is None:
        return out, alpha
    return out.to(low), alpha.to(low)


def _f32(t: torch.Tensor | None, low: torch.dtype | None
         ) -> torch.Tensor | None:
    """``t`` in float32 when computing a low-precision call (differentiable:
    the gradient comes back in ``t``'s dtype)."""
    return t if t is None or low is None else t.float()


def _check(h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
           b: torch.Tensor | None, mask: torch.Tensor | None
           ) -> torch.dtype | None:
    return _check_tensors([("h", h), ("W", W), ("v", v), ("b", b)], mask)


def _module_dtype(dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of a module's parameters: float32, float64, bfloat16 or
    float16."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in _FLOATS + _LOW:
        raise TypeError(f"dtype must be one of {_DTYPES_TEXT}, got {dtype}")
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


def _first_order_only(backward: Any) -> Any:
    """``once_differentiable``, and a clear error for ``create_graph=True``
    (which would otherwise give gradients without a graph: silent zeros
    in a Hessian)."""
    inner = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "the legacy *AttentionFunction classes of attention_c.torch "
                "are first-order only (create_graph=True, double backward, "
                "Hessians): use the functions context_attention, "
                "additive_attention, dot_attention, general_attention or "
                "the modules, whose higher-order gradients are exact")
        return inner(ctx, *grads)

    return wrapper


# Whether torch.jit.trace is recording: torch.jit.is_tracing itself, which
# torch.compile folds to False (not torch._C._is_tracing, a graph break).
# Not among the typed exports of torch.jit, hence getattr.
_tracing: Any = getattr(torch.jit, "is_tracing")


class _LegacyFunction(torch.autograd.Function):
    """The legacy *AttentionFunction classes: a clear error under the
    torch.func transforms, which they do not support (no setup_context)."""

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            raise RuntimeError(
                f"attention_c.torch.{cls.__name__} does not support the "
                f"torch.func transforms (grad, vmap, jvp, jacrev, "
                f"functionalize, ...): use the functions context_attention,"
                f" additive_attention, dot_attention, general_attention or "
                f"the modules, which do")
        apply: Any = super().apply
        return apply(*args, **kwargs)


class ContextAttentionFunction(_LegacyFunction):
    """``(out, alpha) = context_attention(h, W, v, b, mask)`` as an autograd
    function whose forward and backward are one C call each.

    Use :func:`context_attention` (which checks the arguments) rather than
    ``ContextAttentionFunction.apply`` directly.  Both outputs are
    differentiable; ``mask`` is not.  ``keep=True`` saves the tanh
    activations for the backward, which then skips recomputing them.

    Kept for existing code: the functions and modules now run the custom
    operators.  This class (like the family's ``*AttentionFunction``) is
    first-order only: ``create_graph=True`` raises a RuntimeError, and
    ``torch.func`` transforms do not apply to it.
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
                b: torch.Tensor | None, mask: torch.Tensor | None,
                keep: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        act: list[np.ndarray]               # [activations] or []
        out, alpha, *act = _ac.context_attention(
            _np(h), _np(W), _np(v), b=_np_opt(b), mask=_np_opt(mask),
            keep_activations=keep)
        out_t, alpha_t = torch.from_numpy(out), torch.from_numpy(alpha)
        # Saved as tensors so that autograd reports an input or alpha
        # modified in place before the backward.
        ctx.save_for_backward(h, W, v, b, mask, alpha_t)
        ctx.act = act[0] if act else None   # internal: nobody can modify it
        ctx.set_materialize_grads(False)    # an unused output gives None
        return out_t, alpha_t

    @staticmethod
    @_first_order_only
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
        g = _ac.context_attention_backward(go, h, W, v, alpha, b=b, mask=mask,
                                           grad_alpha=_np_opt(grad_alpha),
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
    (docs/contract.md section 1); the gradients are the C backward (exact
    higher-order gradients in PyTorch, see the module docstring).

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
        dtypes (outside ``torch.autocast``), a mask that is not boolean.
    """
    low = _check(h, W, v, b, mask)
    # Keep the tanh activations for the backward only if there will be one.
    # Not when tracing with torch.jit.trace: the flag would be a constant
    # of the trace, wrong for the other mode (grad or no_grad).
    keep = (torch.is_grad_enabled() and not _tracing()
            and any(t is not None and t.requires_grad for t in (h, W, v, b)))
    out, alpha, _ = _call("context", _f32(h, low), _f32(W, low),
                          _f32(v, low), _f32(b, low), mask, keep)
    return _back(out, alpha, low)


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
        out, alpha = context_attention(h, self.W, self.v, b=self.b, mask=mask)
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


class AdditiveAttentionFunction(_LegacyFunction):
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
            _np(query), _np(keys), _np(W), _np(v), b=_np_opt(b),
            mask=_np_opt(mask),
            values=_np_opt(values), key_proj=_np_opt(key_proj))
        return _save(ctx, out, alpha, query, keys, W, v, b, mask, values,
                     key_proj)

    @staticmethod
    @_first_order_only
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


class DotAttentionFunction(_LegacyFunction):
    """``(out, alpha) = dot_attention(query, keys, mask, values, scale)`` as
    an autograd function whose forward and backward are one C call each.

    Use :func:`dot_attention` (which checks the arguments).
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, keys: torch.Tensor,
                mask: torch.Tensor | None, values: torch.Tensor | None,
                scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, alpha = _ac.dot_attention(_np(query), _np(keys),
                                       mask=_np_opt(mask),
                                       values=_np_opt(values), scale=scale)
        ctx.scale = scale
        return _save(ctx, out, alpha, query, keys, mask, values)

    @staticmethod
    @_first_order_only
    def backward(ctx: Any, grad_out: torch.Tensor | None,
                 grad_alpha: torch.Tensor | None) -> tuple[Any, ...]:
        if _nothing_to_do(ctx, grad_out, grad_alpha):
            return (None,) * 5
        q_t, k_t, m_t, val_t, alpha_t = ctx.saved_tensors
        g = _ac.dot_attention_backward(
            _grad_out(ctx, grad_out), _np(q_t), _np(k_t), _np(alpha_t),
            mask=_np_opt(m_t), values=_np_opt(val_t), scale=ctx.scale,
            grad_alpha=_np_opt(grad_alpha))
        return _to_torch(ctx, g.query, g.keys, None, g.values, None)


class GeneralAttentionFunction(_LegacyFunction):
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
            _np(query), _np(keys), _np(W), mask=_np_opt(mask),
            values=_np_opt(values),
            key_proj=_np_opt(key_proj))
        return _save(ctx, out, alpha, query, keys, W, mask, values, key_proj)

    @staticmethod
    @_first_order_only
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


# --------------------------------------------------------------------------
# PyTorch custom operators (torch.library.custom_op)
#
# The public functions below call these operators, which torch.compile
# (fullgraph), torch.export and torch.func see as opaque ops with a fake
# (shape-only) implementation, an autograd formula and a vmap rule:
#
# - the forward ops run one C call each; their backward is a backward op,
#   one C call too, so first-order gradients stay on the fused kernels;
# - a backward op's own backward (double backward, Hessians, jacrev of a
#   grad) differentiates a pure-PyTorch transcription of the contract's
#   forward twice with torch.func.vjp: exact, and differentiable again;
# - optional tensor arguments are "Tensor?"; a gradient an op cannot have
#   (db without b, ...) comes back as an empty placeholder tensor.

_NS = "attention_c"


def _empty(like: torch.Tensor) -> torch.Tensor:
    """The placeholder for a gradient that does not exist."""
    return like.new_empty(0)


def _t(x: np.ndarray | None, like: torch.Tensor) -> torch.Tensor:
    return _empty(like) if x is None else torch.from_numpy(x)


def _ga(grad_alpha: torch.Tensor | None) -> np.ndarray | None:
    return None if grad_alpha is None else _np(grad_alpha)


# ---- pure-PyTorch forwards (contract sections 1.2 and 4.3), for the
# derivatives of the backward ops.  They zero the padding first so that
# NaN or Inf there reaches no second derivative either (rule 1.3.2).

def _pure_softmax(s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Masked softmax over the last axis; 0 where nothing is valid."""
    if m is None:
        return torch.softmax(s, -1)
    any_valid = m.any(-1, keepdim=True)
    M = torch.where(m, s, -torch.inf).amax(-1, keepdim=True)
    M = torch.where(any_valid, M, 0).detach()
    # exp(0) on masked entries: no inf whose zero gradient would give NaN.
    e = torch.where(m, torch.exp(torch.where(m, s, M) - M), 0)
    return e / torch.where(any_valid, e.sum(-1, keepdim=True), 1)


def _pure_context(h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
                  b: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    H = h.shape[-1]
    if mask is None:
        c = h.mean(-2)
    else:
        h = torch.where(mask[..., None], h, 0)
        n = mask.sum(-1, keepdim=True).clamp(min=1).to(h.dtype)
        c = h.sum(-2) / n
    z = F.linear(h, W[:, :H], b) + F.linear(c, W[:, H:]).unsqueeze(-2)
    alpha = _pure_softmax(torch.tanh(z) @ v, mask)
    return (alpha.unsqueeze(-2) @ h).squeeze(-2), alpha


def _pure_family(kind: str, query: torch.Tensor, keys: torch.Tensor,
                 mask: torch.Tensor | None = None,
                 values: torch.Tensor | None = None,
                 W: torch.Tensor | None = None,
                 v: torch.Tensor | None = None,
                 b: torch.Tensor | None = None,
                 key_proj: torch.Tensor | None = None,
                 scale: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``key_proj`` given: the scores use it (the gradient stops there)."""
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
    alpha = _pure_softmax(s, m)
    out = alpha @ (keys if values is None else values)
    return (out.squeeze(-2), alpha.squeeze(-2)) if single else (out, alpha)


# ---- vmap: leading batch axes are native, so a vmapped data argument just
# moves its batched dimension to the front (unbatched data is expanded).
# Batched weights, and every backward op (whose parameter gradients are
# summed over the batch axes, but must stay per-example under vmap), loop.

def _vmap_loop(op: Any, info: Any, in_dims: tuple[Any, ...],
               *args: Any) -> tuple[Any, Any]:
    outs = []
    for i in range(info.batch_size):
        outs.append(op(*[a.select(d, i) if d is not None else a
                         for a, d in zip(args, in_dims)]))
    stacked = tuple(torch.stack(o) for o in zip(*outs))
    return stacked, (0,) * len(stacked)


def _vmap_native(op: Any, data: tuple[int, ...]) -> Any:
    """A vmap rule for a forward op whose arguments at positions ``data``
    take leading batch axes (the others are weights or flags)."""

    def rule(info: Any, in_dims: tuple[Any, ...], *args: Any
             ) -> tuple[Any, Any]:
        if any(d is not None for i, d in enumerate(in_dims)
               if i not in data):
            return _vmap_loop(op, info, in_dims, *args)
        new = list(args)
        for i in data:
            a, d = args[i], in_dims[i]
            if a is None:
                continue
            new[i] = (a.movedim(d, 0) if d is not None
                      else a.expand(info.batch_size, *a.shape))
        outs = op(*new)
        # An empty placeholder (no activations kept) is not batched.
        return outs, tuple(0 if o.numel() or o.ndim > 1 else None
                           for o in outs)

    return rule


def _loop_rule(op: Any) -> Any:
    def rule(info: Any, in_dims: tuple[Any, ...], *args: Any
             ) -> tuple[Any, Any]:
        return _vmap_loop(op, info, in_dims, *args)
    return rule


# ---- context_attention

@torch.library.custom_op(
    f"{_NS}::context_attention", mutates_args=(),
    schema="(Tensor h, Tensor W, Tensor v, Tensor? b, Tensor? mask, "
           "bool keep) -> (Tensor, Tensor, Tensor)")
def _context_op(h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
                b: torch.Tensor | None, mask: torch.Tensor | None,
                keep: bool) -> tuple[torch.Tensor, torch.Tensor,
                                     torch.Tensor]:
    """``(out, alpha, act)``; ``act`` the tanh activations (..., T, A) with
    ``keep``, else an empty placeholder."""
    out, alpha, *act = _ac.context_attention(
        _np(h), _np(W), _np(v), b=_np_opt(b), mask=_np_opt(mask),
        keep_activations=keep)
    return (torch.from_numpy(out), torch.from_numpy(alpha),
            _t(act[0] if act else None, h))


@_context_op.register_fake
def _context_fake(h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
                  b: torch.Tensor | None, mask: torch.Tensor | None,
                  keep: bool) -> tuple[torch.Tensor, torch.Tensor,
                                       torch.Tensor]:
    lead = h.shape[:-2]
    act = (h.new_empty(*h.shape[:-1], W.shape[0]) if keep
           else _empty(h))
    return (h.new_empty(*lead, h.shape[-1]), h.new_empty(*h.shape[:-1]),
            act)


@torch.library.custom_op(
    f"{_NS}::context_attention_backward", mutates_args=(),
    schema="(Tensor grad_out, Tensor? grad_alpha, Tensor h, Tensor W, "
           "Tensor v, Tensor alpha, Tensor? b, Tensor? mask, Tensor? act) "
           "-> (Tensor, Tensor, Tensor, Tensor)")
def _context_bwd_op(grad_out: torch.Tensor, grad_alpha: torch.Tensor | None,
                    h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
                    alpha: torch.Tensor, b: torch.Tensor | None,
                    mask: torch.Tensor | None, act: torch.Tensor | None
                    ) -> tuple[torch.Tensor, ...]:
    """``(dh, dW, dv, db)``, db empty without b.  ``alpha`` must be the
    forward's for these inputs (its own derivative is taken as 0: the
    double backward differentiates through the recomputed forward)."""
    g = _ac.context_attention_backward(
        _np(grad_out), _np(h), _np(W), _np(v), _np(alpha), b=_np_opt(b),
        mask=_np_opt(mask), grad_alpha=_ga(grad_alpha),
        activations=_np_opt(act))
    return (torch.from_numpy(g.h), torch.from_numpy(g.W),
            torch.from_numpy(g.v), _t(g.b, h))


@_context_bwd_op.register_fake
def _context_bwd_fake(grad_out: torch.Tensor,
                      grad_alpha: torch.Tensor | None, h: torch.Tensor,
                      W: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor,
                      b: torch.Tensor | None, mask: torch.Tensor | None,
                      act: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    return (torch.empty_like(h), torch.empty_like(W), torch.empty_like(v),
            _empty(h) if b is None else torch.empty_like(b))


# ---- the family: additive, dot, general

def _family_out_fake(query: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    lead = query.shape[:-1]
    hv = (keys if values is None else values).shape[-1]
    return query.new_empty(*lead, hv), query.new_empty(*lead, keys.shape[-2])


def _like(x: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    return _empty(ref) if x is None else torch.empty_like(x)


@torch.library.custom_op(
    f"{_NS}::additive_attention", mutates_args=(),
    schema="(Tensor query, Tensor keys, Tensor W, Tensor v, Tensor? b, "
           "Tensor? mask, Tensor? values, Tensor? key_proj) "
           "-> (Tensor, Tensor)")
def _additive_op(query: torch.Tensor, keys: torch.Tensor, W: torch.Tensor,
                 v: torch.Tensor, b: torch.Tensor | None,
                 mask: torch.Tensor | None, values: torch.Tensor | None,
                 key_proj: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    out, alpha = _ac.additive_attention(
        _np(query), _np(keys), _np(W), _np(v), b=_np_opt(b),
        mask=_np_opt(mask),
        values=_np_opt(values), key_proj=_np_opt(key_proj))
    return torch.from_numpy(out), torch.from_numpy(alpha)


@_additive_op.register_fake
def _additive_fake(query: torch.Tensor, keys: torch.Tensor, W: torch.Tensor,
                   v: torch.Tensor, b: torch.Tensor | None,
                   mask: torch.Tensor | None, values: torch.Tensor | None,
                   key_proj: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return _family_out_fake(query, keys, values)


@torch.library.custom_op(
    f"{_NS}::additive_attention_backward", mutates_args=(),
    schema="(Tensor grad_out, Tensor? grad_alpha, Tensor query, "
           "Tensor keys, Tensor W, Tensor v, Tensor alpha, Tensor? b, "
           "Tensor? mask, Tensor? values, Tensor? key_proj, bool stop) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def _additive_bwd_op(grad_out: torch.Tensor, grad_alpha: torch.Tensor | None,
                     query: torch.Tensor, keys: torch.Tensor,
                     W: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor,
                     b: torch.Tensor | None, mask: torch.Tensor | None,
                     values: torch.Tensor | None,
                     key_proj: torch.Tensor | None, stop: bool
                     ) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dW, dv, db, dvalues, dkey_proj)``; with ``stop`` the
    gradient stops at ``key_proj`` (contract section 4.6)."""
    args = (_np(grad_out), _np(query), _np(keys), _np(W), _np(v),
            _np(alpha), _np_opt(b), _np_opt(mask), _np_opt(values),
            _ga(grad_alpha))
    if stop:
        assert key_proj is not None
        dq, dk, dval, dW, dv, db, dkp = _core.additive_attention_backward(
            *args, key_proj=_np(key_proj), stop_at_key_proj=True)
    else:
        dq, dk, dval, dW, dv, db = _ac.additive_attention_backward(
            *args, _np_opt(key_proj))
        dkp = None
    return tuple(_t(x, query) for x in (dq, dk, dW, dv, db, dval, dkp))


@_additive_bwd_op.register_fake
def _additive_bwd_fake(grad_out: torch.Tensor,
                       grad_alpha: torch.Tensor | None, query: torch.Tensor,
                       keys: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
                       alpha: torch.Tensor, b: torch.Tensor | None,
                       mask: torch.Tensor | None, values: torch.Tensor | None,
                       key_proj: torch.Tensor | None, stop: bool
                       ) -> tuple[torch.Tensor, ...]:
    return (torch.empty_like(query), torch.empty_like(keys),
            torch.empty_like(W), torch.empty_like(v), _like(b, query),
            _like(values, query), _like(key_proj if stop else None, query))


@torch.library.custom_op(
    f"{_NS}::dot_attention", mutates_args=(),
    schema="(Tensor query, Tensor keys, Tensor? mask, Tensor? values, "
           "float? scale) -> (Tensor, Tensor)")
def _dot_op(query: torch.Tensor, keys: torch.Tensor,
            mask: torch.Tensor | None, values: torch.Tensor | None,
            scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    out, alpha = _ac.dot_attention(_np(query), _np(keys), mask=_np_opt(mask),
                                   values=_np_opt(values), scale=scale)
    return torch.from_numpy(out), torch.from_numpy(alpha)


@_dot_op.register_fake
def _dot_fake(query: torch.Tensor, keys: torch.Tensor,
              mask: torch.Tensor | None, values: torch.Tensor | None,
              scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _family_out_fake(query, keys, values)


@torch.library.custom_op(
    f"{_NS}::dot_attention_backward", mutates_args=(),
    schema="(Tensor grad_out, Tensor? grad_alpha, Tensor query, "
           "Tensor keys, Tensor alpha, Tensor? mask, Tensor? values, "
           "float? scale) -> (Tensor, Tensor, Tensor)")
def _dot_bwd_op(grad_out: torch.Tensor, grad_alpha: torch.Tensor | None,
                query: torch.Tensor, keys: torch.Tensor, alpha: torch.Tensor,
                mask: torch.Tensor | None, values: torch.Tensor | None,
                scale: float | None) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dvalues)``."""
    g = _ac.dot_attention_backward(
        _np(grad_out), _np(query), _np(keys), _np(alpha), mask=_np_opt(mask),
        values=_np_opt(values), scale=scale, grad_alpha=_ga(grad_alpha))
    return (torch.from_numpy(g.query), torch.from_numpy(g.keys),
            _t(g.values, query))


@_dot_bwd_op.register_fake
def _dot_bwd_fake(grad_out: torch.Tensor, grad_alpha: torch.Tensor | None,
                  query: torch.Tensor, keys: torch.Tensor,
                  alpha: torch.Tensor, mask: torch.Tensor | None,
                  values: torch.Tensor | None, scale: float | None
                  ) -> tuple[torch.Tensor, ...]:
    return (torch.empty_like(query), torch.empty_like(keys),
            _like(values, query))


@torch.library.custom_op(
    f"{_NS}::general_attention", mutates_args=(),
    schema="(Tensor query, Tensor keys, Tensor W, Tensor? mask, "
           "Tensor? values, Tensor? key_proj) -> (Tensor, Tensor)")
def _general_op(query: torch.Tensor, keys: torch.Tensor, W: torch.Tensor,
                mask: torch.Tensor | None, values: torch.Tensor | None,
                key_proj: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    out, alpha = _ac.general_attention(
        _np(query), _np(keys), _np(W), mask=_np_opt(mask),
        values=_np_opt(values),
        key_proj=_np_opt(key_proj))
    return torch.from_numpy(out), torch.from_numpy(alpha)


@_general_op.register_fake
def _general_fake(query: torch.Tensor, keys: torch.Tensor, W: torch.Tensor,
                  mask: torch.Tensor | None, values: torch.Tensor | None,
                  key_proj: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return _family_out_fake(query, keys, values)


@torch.library.custom_op(
    f"{_NS}::general_attention_backward", mutates_args=(),
    schema="(Tensor grad_out, Tensor? grad_alpha, Tensor query, "
           "Tensor keys, Tensor W, Tensor alpha, Tensor? mask, "
           "Tensor? values, Tensor? key_proj, bool stop) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _general_bwd_op(grad_out: torch.Tensor, grad_alpha: torch.Tensor | None,
                    query: torch.Tensor, keys: torch.Tensor, W: torch.Tensor,
                    alpha: torch.Tensor, mask: torch.Tensor | None,
                    values: torch.Tensor | None,
                    key_proj: torch.Tensor | None, stop: bool
                    ) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dW, dvalues, dkey_proj)``; with ``stop`` dW is 0 (W
    only acts through key_proj)."""
    args = (_np(grad_out), _np(query), _np(keys), _np(W), _np(alpha),
            _np_opt(mask), _np_opt(values), _ga(grad_alpha))
    if stop:
        assert key_proj is not None
        dq, dk, dval, _, dkp = _core.general_attention_backward(
            *args, key_proj=_np(key_proj), stop_at_key_proj=True)
        dW = np.zeros(W.shape, _np(W).dtype)
    else:
        dq, dk, dval, dW = _ac.general_attention_backward(
            *args, _np_opt(key_proj))
        dkp = None
    return tuple(_t(x, query) for x in (dq, dk, dW, dval, dkp))


@_general_bwd_op.register_fake
def _general_bwd_fake(grad_out: torch.Tensor,
                      grad_alpha: torch.Tensor | None, query: torch.Tensor,
                      keys: torch.Tensor, W: torch.Tensor,
                      alpha: torch.Tensor, mask: torch.Tensor | None,
                      values: torch.Tensor | None,
                      key_proj: torch.Tensor | None, stop: bool
                      ) -> tuple[torch.Tensor, ...]:
    return (torch.empty_like(query), torch.empty_like(keys),
            torch.empty_like(W), _like(values, query),
            _like(key_proj if stop else None, query))


# ---- autograd: first order on the backward ops, higher orders in PyTorch
#
# Each op gets its formulas twice: registered on the op itself
# (register_autograd, for direct calls and torch.compile), and as an
# autograd.Function with setup_context, jvp and generate_vmap_rule, which
# the public functions use in eager mode: the Function generated by
# register_autograd has no setup_context, so torch.func.grad, jacrev and
# vmap of a grad refuse it (pytorch/pytorch#168393, #179652).

# torch.func.vjp and jvp, typed loosely (their stubs do not fit
# tuple-valued functions).
_func_vjp: Any = torch.func.vjp


def _func_jvp(f: Any, primals: tuple[Any, ...],
              tangents: tuple[Any, ...]) -> Any:
    """The tangents of ``f``'s outputs."""
    return torch.func.jvp(f, primals, tangents)[1]


class _Spec(NamedTuple):
    """How an op and its backward op take their arguments (by name)."""

    kind: str
    op: Any
    bwd_op: Any
    inputs: tuple[str, ...]         # the forward op's arguments
    bwd_inputs: tuple[str, ...]     # the backward op's arguments
    grads: tuple[str, ...]          # the backward op's results, by input


_SPECS = {
    "context": _Spec(
        "context", _context_op, _context_bwd_op,
        ("h", "W", "v", "b", "mask", "keep"),
        ("grad_out", "grad_alpha", "h", "W", "v", "alpha", "b", "mask",
         "act"),
        ("h", "W", "v", "b")),
    "additive": _Spec(
        "additive", _additive_op, _additive_bwd_op,
        ("query", "keys", "W", "v", "b", "mask", "values", "key_proj"),
        ("grad_out", "grad_alpha", "query", "keys", "W", "v", "alpha", "b",
         "mask", "values", "key_proj", "stop"),
        ("query", "keys", "W", "v", "b", "values", "key_proj")),
    "dot": _Spec(
        "dot", _dot_op, _dot_bwd_op,
        ("query", "keys", "mask", "values", "scale"),
        ("grad_out", "grad_alpha", "query", "keys", "alpha", "mask",
         "values", "scale"),
        ("query", "keys", "values")),
    "general": _Spec(
        "general", _general_op, _general_bwd_op,
        ("query", "keys", "W", "mask", "values", "key_proj"),
        ("grad_out", "grad_alpha", "query", "keys", "W", "alpha", "mask",
         "values", "key_proj", "stop"),
        ("query", "keys", "W", "values", "key_proj")),
}


def _pure_for(spec: _Spec, a: dict[str, Any]) -> Any:
    """The pure-PyTorch forward ``(**xs) -> (out, alpha)`` with the
    non-differentiable arguments of ``a`` fixed."""
    if spec.kind == "context":
        return lambda **x: _pure_context(mask=a["mask"], **x)
    return lambda **x: _pure_family(spec.kind, mask=a["mask"],
                                    scale=a.get("scale"), **x)


def _xs(spec: _Spec, a: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The differentiable inputs of a backward op's arguments ``a``: a
    key_proj only where the gradient stops there (otherwise the keys'
    projection is recomputed from the keys and W, as the C backward
    does)."""
    return {n: a[n] for n in spec.grads
            if a.get(n) is not None and (n != "key_proj" or a.get("stop"))}


def _saved(ctx: Any, names: tuple[str, ...]
           ) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
    t = ctx.saved_tensors
    a = dict(zip(names, t))
    a.update(ctx.consts)
    return a, t[len(names):]


def _setup(names: tuple[str, ...]) -> Any:
    def setup_context(ctx: Any, inputs: tuple[Any, ...],
                      output: Any) -> None:
        ctx.consts = {n: x for n, x in zip(names, inputs)
                      if not isinstance(x, torch.Tensor)}
        outs = tuple(output) if isinstance(output, tuple) else (output,)
        tensors = [x if isinstance(x, torch.Tensor) else None
                   for x in inputs] + list(outs)
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)
        ctx.set_materialize_grads(False)    # an unused output gives None
    return setup_context


def _first_backward(spec: _Spec, bwd: Any) -> Any:
    """The forward op's backward, calling ``bwd`` (the backward op or its
    autograd.Function)."""

    def backward(ctx: Any, grad_out: torch.Tensor | None,
                 grad_alpha: torch.Tensor | None, *_: Any
                 ) -> tuple[Any, ...]:
        a, outs = _saved(ctx, spec.inputs)
        need = dict(zip(spec.inputs, ctx.needs_input_grad))
        if grad_out is None and grad_alpha is None:
            return (None,) * len(spec.inputs)
        given = dict(a, grad_out=(torch.zeros_like(outs[0])
                                  if grad_out is None else grad_out),
                     grad_alpha=grad_alpha, alpha=outs[1],
                     # A key_proj that requires grad: stop there, autograd
                     # carries the keys' projection through its graph.
                     stop=bool(need.get("key_proj")),
                     act=outs[2] if a.get("keep") else None)
        res = bwd(*[given[n] for n in spec.bwd_inputs])
        g = dict(zip(spec.grads, res))
        return tuple(g[n] if n in g and a[n] is not None and need[n]
                     else None for n in spec.inputs)

    return backward


def _forward_jvp(spec: _Spec) -> Any:
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[Any, ...]:
        a, outs = _saved(ctx, spec.inputs)
        t = dict(zip(spec.inputs, tangents))
        # A key_proj without a tangent is a constant equal to the keys'
        # projection: recompute it so that the keys' tangent goes through.
        xs = {n: a[n] for n in spec.grads if a[n] is not None
              and (n != "key_proj" or t[n] is not None)}
        t_out, t_alpha = _func_jvp(
            lambda *y: _pure_for(spec, a)(**dict(zip(xs, y))),
            tuple(xs.values()),
            tuple(torch.zeros_like(x) if t[n] is None else t[n]
                  for n, x in xs.items()))
        return (t_out, t_alpha, *[torch.zeros_like(o) for o in outs[2:]])

    return jvp


def _first_order(spec: _Spec, a: dict[str, Any]) -> Any:
    """``(grad_out, grad_alpha, *xs) -> grads of xs``, the backward op in
    pure PyTorch."""
    pure, names = _pure_for(spec, a), list(_xs(spec, a))

    def first(go: torch.Tensor, ga: torch.Tensor,
              *x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vjp = _func_vjp(lambda *y: pure(**dict(zip(names, y))), *x)[1]
        grads: tuple[torch.Tensor, ...] = vjp((go, ga))
        return grads

    return first


def _second_backward(spec: _Spec) -> Any:
    """The backward op's backward: the VJP of the pure-PyTorch first order
    (differentiable again, for third and higher orders).  ``alpha`` (and
    ``act``) get no gradient: they are the forward's results for these
    inputs, and the pure first order recomputes them, so the derivative
    through them is in the inputs' share already."""

    def backward(ctx: Any, *gg: torch.Tensor | None) -> tuple[Any, ...]:
        a, _ = _saved(ctx, spec.bwd_inputs)
        xs = _xs(spec, a)
        go, ga = a["grad_out"], a["grad_alpha"]
        ga0 = torch.zeros_like(a["alpha"]) if ga is None else ga
        grads, vjp = _func_vjp(_first_order(spec, a), go, ga0,
                               *xs.values())
        cot = dict(zip(spec.grads, gg))
        d_go, d_ga, *d_xs = vjp(tuple(
            torch.zeros_like(g) if cot[n] is None else cot[n]
            for n, g in zip(xs, grads)))
        d = dict(zip(xs, d_xs), grad_out=d_go,
                 grad_alpha=None if ga is None else d_ga)
        return tuple(d.get(n) for n in spec.bwd_inputs)

    return backward


def _second_jvp(spec: _Spec) -> Any:
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[Any, ...]:
        a, _ = _saved(ctx, spec.bwd_inputs)
        t = dict(zip(spec.bwd_inputs, tangents))
        xs = _xs(spec, a)
        ga = (torch.zeros_like(a["alpha"]) if a["grad_alpha"] is None
              else a["grad_alpha"])
        primals = (a["grad_out"], ga, *xs.values())
        t_grads = _func_jvp(_first_order(spec, a), primals, tuple(
            torch.zeros_like(p) if t.get(n) is None else t[n]
            for n, p in zip(["grad_out", "grad_alpha", *xs], primals)))
        tg = dict(zip(xs, t_grads))
        ref = primals[0]
        return tuple(tg[n] if n in tg else ref.new_zeros(0)
                     for n in spec.grads)

    return jvp


def _function(name: str, op: Any, names: tuple[str, ...], backward: Any,
              jvp: Any) -> Any:
    return type(name, (torch.autograd.Function,), {
        "__doc__": f"Autograd of ``{op}`` (internal).",
        "generate_vmap_rule": True,         # the op's own vmap rule
        "forward": staticmethod(lambda *args: op(*args)),
        "setup_context": staticmethod(_setup(names)),
        "backward": staticmethod(backward),
        "jvp": staticmethod(jvp)})


def _differentiable(bwd_op: Any, function: Any) -> Any:
    """The backward op as eager's first backward calls it: through its
    autograd.Function when the backward itself is differentiated
    (create_graph=True, torch.func), else directly (no Function to set up:
    the common, first-order case)."""

    def call(*args: Any) -> Any:
        if (torch.is_grad_enabled()
                or torch._C._are_functorch_transforms_active()):
            return function.apply(*args)
        return bwd_op(*args)

    return call


# kind -> the autograd.Function of its forward op (what eager calls).
_FUNCTIONS: dict[str, Any] = {}
for _spec in _SPECS.values():
    _bwd_fn = _function(f"_{_spec.kind}_backward", _spec.bwd_op,
                        _spec.bwd_inputs, _second_backward(_spec),
                        _second_jvp(_spec))
    _FUNCTIONS[_spec.kind] = _function(
        f"_{_spec.kind}", _spec.op, _spec.inputs,
        _first_backward(_spec, _differentiable(_spec.bwd_op, _bwd_fn)),
        _forward_jvp(_spec))
    _spec.op.register_autograd(_first_backward(_spec, _spec.bwd_op),
                               setup_context=_setup(_spec.inputs))
    _spec.bwd_op.register_autograd(_second_backward(_spec),
                                   setup_context=_setup(_spec.bwd_inputs))
    # Under torch.autocast the kernels run in float32 (like softmax) and
    # return float32, whatever mix of dtypes autocast gave the inputs.
    torch.library.register_autocast(_spec.op, "cpu", torch.float32)
    torch.library.register_vmap(_spec.bwd_op, _loop_rule(_spec.bwd_op))
for _kind, _data in [("context", (0, 4)), ("additive", (0, 1, 5, 6, 7)),
                     ("dot", (0, 1, 2, 3)), ("general", (0, 1, 3, 4, 5))]:
    _op = _SPECS[_kind].op
    torch.library.register_vmap(_op, _vmap_native(_op, _data))
del _spec, _bwd_fn, _kind, _data, _op


def _transforms() -> list[Any]:
    """The torch.func transforms (TransformType) around this call."""
    if not torch._C._are_functorch_transforms_active():
        return []
    from torch._functorch.pyfunctorch import (
        retrieve_all_functorch_interpreters)
    return [i.key() for i in retrieve_all_functorch_interpreters()]


def _call(kind: str, *args: Any) -> Any:
    """The op of ``kind`` through its autograd.Function (eager, torch.func)
    or directly: torch.compile traces the op with its registered autograd,
    torch.jit.trace records it as a node that scripts and saves (the
    Function would be an opaque Python node), and torch.func.functionalize
    has no rule for autograd.Functions."""
    if torch.compiler.is_compiling() or _tracing():
        return _SPECS[kind].op(*args)
    transforms = _transforms()
    T = torch._C._functorch.TransformType
    if T.Functionalize in transforms:
        if T.Grad in transforms or T.Jvp in transforms:
            raise RuntimeError(
                f"torch.func.functionalize together with a gradient "
                f"transform (grad, vjp, jvp, jacrev, jacfwd, hessian) is "
                f"not supported by attention_c.torch ({kind}_attention); "
                f"its operators mutate nothing, so functionalize is not "
                f"needed: drop it, or use torch.compile or torch.export")
        return _SPECS[kind].op(*args)
    return _FUNCTIONS[kind].apply(*args)


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
        dtypes (outside ``torch.autocast``), a mask that is not boolean.
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
        keys.ndim``.  float32 or float64 (bfloat16 and float16 computed
        in float32), on the CPU; every other float tensor of the same
        dtype.
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
    low = _check_tensors([("query", query), ("keys", keys), ("W", W),
                          ("v", v), ("b", b), ("values", values),
                          ("key_proj", key_proj)], mask, "key")
    out, alpha = _call("additive", _f32(query, low), _f32(keys, low),
                       _f32(W, low), _f32(v, low), _f32(b, low), mask,
                       _f32(values, low), _f32(key_proj, low))
    return _back(out, alpha, low)


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
        keys.ndim``.  float32 or float64 (bfloat16 and float16 computed
        in float32), on the CPU.
    keys : Tensor (..., T, H)
    mask : Tensor of torch.bool (..., T) or (..., Tq, T), optional
        True marks a valid key.  Must not require grad.
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
        keys.ndim``.  float32 or float64 (bfloat16 and float16 computed
        in float32), on the CPU.
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
        out, alpha = additive_attention(query, keys, self.W, self.v, b=self.b,
                                        mask=mask, values=values,
                                        key_proj=key_proj)
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
        out, alpha = dot_attention(query, keys, mask=mask, values=values,
                                   scale=self.scale)
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
        out, alpha = general_attention(query, keys, self.W, mask=mask,
                                       values=values,
                                       key_proj=key_proj)
        return _family_forward(out, alpha, return_weights)

    def extra_repr(self) -> str:
        return f"query_size={self.query_size}, key_size={self.key_size}"


# torch.fx.symbolic_trace of a model records these calls as leaves (its
# proxies carry no data for the checks and kernels); they run at call time.
for _name in ("context_attention", "additive_attention", "dot_attention",
              "general_attention", "project_keys"):
    torch.fx.wrap(_name)
del _name


def _no_script(self: torch.nn.Module) -> torch.nn.Module:
    """``torch.jit.script`` calls this first: refuse with a clear error
    (TorchScript cannot compile the Python around the operators, and is
    deprecated in PyTorch)."""
    raise RuntimeError(
        f"torch.jit.script is not supported for attention_c.torch."
        f"{type(self).__name__}: use torch.compile or torch.export, which "
        f"support its operators (torch.ops.attention_c.*)")


for _cls in (ContextAttention, AdditiveAttention, DotAttention,
             GeneralAttention):
    setattr(_cls, "__prepare_scriptable__", _no_script)
del _cls
