"""PyTorch adapter: the C kernels as an autograd function and an ``nn.Module``.

Imported only on demand (``import attention_c.torch``), so torch stays an
optional dependency of attention_c.  CPU tensors of float32 or float64 are
handed to the kernels without copying (``tensor.numpy()`` shares memory) and
the results come back with ``torch.from_numpy`` (no copy either)::

    from attention_c.torch import ContextAttention
    pool = ContextAttention(hidden_size=64, attention_size=32)
    out = pool(h, mask)          # h (B, T, 64), mask (B, T) bool, True = valid

Double backward (gradients of gradients) is not supported.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

import attention_c as _ac

__all__ = ["ContextAttentionFunction", "context_attention",
           "ContextAttention"]

_FLOATS = (torch.float32, torch.float64)



def _np(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a checked CPU tensor: shared memory, any strides."""
    return t.detach().numpy()


def _np_opt(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else _np(t)


def _check(h: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
           b: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    """Errors that the kernels cannot phrase in PyTorch's terms."""
    named = [("h", h), ("W", W), ("v", v), ("b", b), ("mask", mask)]
    for name, t in named:
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
    for name, t in named[:4]:
        if t is None:
            continue
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} has dtype {t.dtype}; attention_c.torch "
                            f"supports torch.float32 and torch.float64")
        if t.dtype != h.dtype:
            # NumPy would promote; autograd needs each gradient in the
            # dtype of its input, so mixed dtypes are refused instead.
            raise TypeError(f"{name} has dtype {t.dtype} but h has "
                            f"{h.dtype}; convert them to one dtype")
    if mask is not None:
        if mask.requires_grad:
            raise ValueError("mask requires grad, but a mask is not "
                             "differentiable: pass a torch.bool tensor "
                             "(True = valid item), e.g. mask.detach() > 0")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask has dtype {mask.dtype}; expected "
                            f"torch.bool with True = valid item")


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
    (SPEC.md section 1); the gradients are the C backward.

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
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in _FLOATS:
            raise TypeError(f"dtype must be torch.float32 or torch.float64, "
                            f"got {dtype}")
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
        with torch.no_grad():
            bound = 1.0 / math.sqrt(2 * self.hidden_size)
            self.W.uniform_(-bound, bound)
            if self.b is not None:
                self.b.uniform_(-bound, bound)
            bound = 1.0 / math.sqrt(self.attention_size)
            self.v.uniform_(-bound, bound)

    @classmethod
    def from_linear(cls, score: torch.nn.Linear,
                    out: torch.nn.Linear) -> ContextAttention:
        """The module computing ``out(tanh(score([h_t, c])))`` scores with
        the weights (copied) of a ``Linear(2H, A)``, ``Linear(A, 1)`` pair.

        ``out.bias`` is dropped: a constant added to every score does not
        change the softmax.
        """
        A, H2 = score.weight.shape
        if H2 % 2 or tuple(out.weight.shape) != (1, A):
            raise ValueError(f"expected Linear(2H, A) and Linear(A, 1), got "
                             f"weights of shapes {tuple(score.weight.shape)}"
                             f" and {tuple(out.weight.shape)}")
        module = cls(H2 // 2, A, bias=score.bias is not None,
                     dtype=score.weight.dtype)
        with torch.no_grad():
            module.W.copy_(score.weight)
            module.v.copy_(out.weight[0])
            if module.b is not None and score.bias is not None:
                module.b.copy_(score.bias)
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
