"""Shared helpers of attention_c.torch: tensors to NumPy arrays and back
(no copies), and the checks that phrase errors in PyTorch's terms."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_FLOATS = (torch.float32, torch.float64)
# Computed in float32 and returned in their own dtype, as the NumPy API does
# for float16.
_LOW = (torch.bfloat16, torch.float16)
_DTYPES_TEXT = ("torch.float32, torch.float64 (computed natively), "
                "torch.bfloat16 and torch.float16 (computed in float32)")

# Whether torch.jit.trace is recording: torch.jit.is_tracing itself, which
# torch.compile folds to False (not torch._C._is_tracing, a graph break).
# Not among the typed exports of torch.jit, hence getattr.
_tracing: Any = getattr(torch.jit, "is_tracing")


try:
    import ml_dtypes
    _BF16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:         # the bfloat16 extra: without it, float32 copies
    _BF16 = None


def _np(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a checked CPU tensor: shared memory, any strides; a
    bfloat16 one as ml_dtypes' bfloat16 (see :func:`_reads_as_stored`)."""
    if t.requires_grad:     # (detach costs a new tensor: only if needed)
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    return t.numpy()


def _from_np(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (ml_dtypes' bfloat16 too)."""
    if a.dtype == _BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _reads_as_stored(t: torch.Tensor) -> bool:
    """Whether the kernels may take ``t`` (queries, keys or values of an
    eager call) in its own 16-bit dtype: they read it in place where they
    decode, and widen a copy elsewhere.  bfloat16 needs ml_dtypes."""
    return (t.dtype == torch.float16
            or (t.dtype == torch.bfloat16 and _BF16 is not None))


def _np_opt(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else _np(t)


def _check_tensors(named: list[tuple[str, torch.Tensor | None]],
                   mask: torch.Tensor | None, item: str = "item", *,
                   attn_mask: torch.Tensor | None = None
                   ) -> torch.dtype | None:
    """Errors that the kernels cannot phrase in PyTorch's terms.

    ``named`` are the float tensors (None for an absent optional one), the
    first setting the dtype of all; ``mask`` the boolean mask of the valid
    items (``item``: what it masks, for the messages); ``attn_mask`` the
    per-query mask (its dtype is checked by the caller).

    Returns the dtype to compute in float32 and return in: bfloat16 or
    float16, float32 under ``torch.autocast`` (any mix of dtypes), or None
    when the tensors go to the kernels as they are (float32, float64).
    """
    present = [(n, t) for n, t in [*named, ("mask", mask),
                                   ("attn_mask", attn_mask)]
               if t is not None]
    for name, t in present:
        if isinstance(t, torch.fx.Proxy):
            # Only for a direct call: the modules' calls are leaves of
            # symbolic_trace (torch.fx.wrap in modules.py and __init__.py).
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
        # NumPy would promote; autograd needs each gradient in the dtype
        # of its input, so mixed dtypes are refused instead.  But for a
        # bfloat16 or float16 call, computed in float32, a float32 bias
        # (a float attn_mask, ALiBi) costs nothing and loses nothing.
        lossless = (name == "bias" and ref.dtype in _LOW
                    and t.dtype == torch.float32)
        if t.dtype != ref.dtype and not autocast and not lossless:
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
        # records it, rather than inside the operators (whose saved inputs
        # would keep autocast's dtypes).
        return torch.float32
    return ref.dtype if ref.dtype in _LOW else None


def _back(out: torch.Tensor, alpha: torch.Tensor, low: torch.dtype | None,
          lse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, alpha)`` in the caller's low-precision dtype, if any; an
    ``lse`` in place of alpha stays float32, as the NumPy call and
    FlashAttention return it.  A valid item's float16 weight is at least
    float16's smallest subnormal, as the NumPy call rounds it."""
    if low is None:
        return out, alpha
    if lse:
        return out.to(low), alpha
    return out.to(low), _weights_to(alpha, low)


def _weights_to(alpha: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """Weights rounded to ``low``; in float16 a positive weight that
    rounds to 0 (float32's floor for a valid item, below 2^-25) becomes
    2^-24: the weights' zeros stay the masked items (docs/contract.md
    section 1, rule 2)."""
    w = alpha.to(low)
    if low != torch.float16:
        return w
    tiny = torch.full((), 2.0**-24, dtype=low)
    return torch.where((w == 0) & (alpha > 0), tiny, w)


def _kv(t: torch.Tensor | None, low: torch.dtype | None, eager: bool
        ) -> torch.Tensor | None:
    """Queries, keys or values for the kernels: in their 16-bit dtype in
    an eager call (``eager``, with autograd or without), where a decoding
    kernel reads keys and values in place, widening as it loads, and a
    call on bfloat16 alone takes the bf16 products, forward and backward;
    else :func:`_f32`."""
    if eager and t is not None and low in _LOW and _reads_as_stored(t):
        return t                 # (not autocast's float32: low is its own)
    return _f32(t, low)


def _f32(t: torch.Tensor | None, low: torch.dtype | None
         ) -> torch.Tensor | None:
    """``t`` in float32 when computing a low-precision call (differentiable:
    the gradient comes back in ``t``'s dtype)."""
    return t if t is None or low is None else t.float()
