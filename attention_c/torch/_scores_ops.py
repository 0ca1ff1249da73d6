"""The location and cosine (content) scores as PyTorch custom operators
(``torch.ops.attention_c.location_attention``, ``cosine_attention`` and
their backward ops), registered as the family's in attention_c.torch._ops:
schemas from the binding's table, fake implementations, autograd through
the backward op (one C call), higher orders through the pure-PyTorch
forwards of attention_c.torch._pure, autocast and vmap rules.

The cosine op's ``sharpness`` is a ``Tensor?`` (its table kind,
number_or_array, has no schema type of its own): the functional API
passes a Python number as a 0-dim tensor that does not require grad,
which the kernels read exactly as the number.
"""

from __future__ import annotations

from typing import Any

import torch

import attention_c as _ac

from . import _pure
from ._autograd import _register, _Spec
from ._ops import (_ARGS, _NS, _VARIANT_NAMES, Opt, Win, _family_out_fake,
                   _ga, _like, _lse_for_sinks, _new, _schema, _sec5, _t,
                   _variants_kw)
from ._utils import _np, _np_opt

# The ops' arguments (what torch.export records: they stay as they are).
# The location score has no keys (its W holds one row a position) and
# takes no section 5 argument but the masks; the cosine ops are the dot
# ops with ``sharpness`` in place of ``scale``.
_ARGS.update({
    "location_attention": ("query", "values", "W", "b", "mask",
                           "attn_mask"),
    "location_attention_backward": (
        "grad_out", "grad_alpha", "query", "values", "W", "alpha", "b",
        "mask", "attn_mask"),
    "cosine_attention": (
        "query", "keys", "mask", "attn_mask", "causal", "bias", "dropout",
        "seed", "values", "sharpness", "weights", *_VARIANT_NAMES),
    "cosine_attention_backward": (
        "grad_out", "grad_alpha", "query", "keys", "alpha", "out", "mask",
        "attn_mask", "causal", "bias", "dropout", "seed", "values",
        "sharpness", "weights", *_VARIANT_NAMES),
})


# ---- location_attention

@torch.library.custom_op(
    f"{_NS}::location_attention", mutates_args=(),
    schema=_schema("location_attention", 2))
def _location_op(query: torch.Tensor, values: torch.Tensor,
                 W: torch.Tensor, b: Opt, mask: Opt, attn_mask: Opt
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, alpha)``."""
    out, alpha = _ac.location_attention(
        _np(query), _np(values), _np(W), b=_np_opt(b), mask=_np_opt(mask),
        attn_mask=_np_opt(attn_mask))
    return torch.from_numpy(out), torch.from_numpy(alpha)


@_location_op.register_fake
def _location_fake(query: torch.Tensor, values: torch.Tensor,
                   W: torch.Tensor, b: Opt, mask: Opt, attn_mask: Opt
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    # the values stand for the keys: T positions, the rank of a sequence
    return _family_out_fake(query, values, None)


@torch.library.custom_op(
    f"{_NS}::location_attention_backward", mutates_args=(),
    schema=_schema("location_attention_backward", 4))
def _location_bwd_op(grad_out: torch.Tensor, grad_alpha: Opt,
                     query: torch.Tensor, values: torch.Tensor,
                     W: torch.Tensor, alpha: torch.Tensor, b: Opt,
                     mask: Opt, attn_mask: Opt
                     ) -> tuple[torch.Tensor, ...]:
    """``(dquery, dvalues, dW, db)``, db empty without b; dW's rows past
    T are 0."""
    g = _ac.location_attention_backward(
        _np(grad_out), _np(query), _np(values), _np(W), _np(alpha),
        b=_np_opt(b), mask=_np_opt(mask), attn_mask=_np_opt(attn_mask),
        grad_alpha=_ga(grad_alpha))
    return tuple(_t(x, query) for x in g)


@_location_bwd_op.register_fake
def _location_bwd_fake(grad_out: torch.Tensor, grad_alpha: Opt,
                       query: torch.Tensor, values: torch.Tensor,
                       W: torch.Tensor, alpha: torch.Tensor, b: Opt,
                       mask: Opt, attn_mask: Opt
                       ) -> tuple[torch.Tensor, ...]:
    return _new(query), _new(values), _new(W), _like(b, query)


# ---- cosine_attention

@torch.library.custom_op(
    f"{_NS}::cosine_attention", mutates_args=(),
    schema=_schema("cosine_attention", 2))
def _cosine_op(query: torch.Tensor, keys: torch.Tensor,
               mask: Opt, attn_mask: Opt, causal: bool, bias: Opt,
               dropout: float, seed: Opt, values: Opt, sharpness: Opt,
               weights: bool, window: Win = None,
               softcap: float | None = None, alibi_slopes: Opt = None,
               sinks: Opt = None, cu_seqlens_q: Opt = None,
               cu_seqlens_k: Opt = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, alpha)``, or ``(out, lse)`` when not ``weights``."""
    out, second = _ac.cosine_attention(
        _np(query), _np(keys), values=_np_opt(values),
        sharpness=_np_opt(sharpness), return_weights=weights,
        **_sec5(mask, attn_mask, causal, bias, dropout, seed),
        **_variants_kw(window, softcap, alibi_slopes, sinks, cu_seqlens_q,
                       cu_seqlens_k))
    return torch.from_numpy(out), torch.from_numpy(second)


@_cosine_op.register_fake
def _cosine_fake(query: torch.Tensor, keys: torch.Tensor,
                 mask: Opt, attn_mask: Opt, causal: bool, bias: Opt,
                 dropout: float, seed: Opt, values: Opt, sharpness: Opt,
                 weights: bool, window: Win = None,
                 softcap: float | None = None, alibi_slopes: Opt = None,
                 sinks: Opt = None, cu_seqlens_q: Opt = None,
                 cu_seqlens_k: Opt = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _family_out_fake(query, keys, values, weights)


@torch.library.custom_op(
    f"{_NS}::cosine_attention_backward", mutates_args=(),
    schema=_schema("cosine_attention_backward", 7))
def _cosine_bwd_op(grad_out: torch.Tensor, grad_alpha: Opt,
                   query: torch.Tensor, keys: torch.Tensor,
                   alpha: torch.Tensor, out: torch.Tensor, mask: Opt,
                   attn_mask: Opt, causal: bool, bias: Opt, dropout: float,
                   seed: Opt, values: Opt, sharpness: Opt, weights: bool,
                   window: Win = None, softcap: float | None = None,
                   alibi_slopes: Opt = None, sinks: Opt = None,
                   cu_seqlens_q: Opt = None, cu_seqlens_k: Opt = None
                   ) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dvalues, dsharpness, dbias, dalibi_slopes, dsinks)``,
    each empty without its input.  ``alpha`` is the lse when not
    ``weights``."""
    sec5 = _sec5(mask, attn_mask, causal, bias, dropout, seed)
    var = _variants_kw(window, softcap, alibi_slopes, sinks, cu_seqlens_q,
                       cu_seqlens_k)
    kw: dict[str, Any] = dict(values=_np_opt(values),
                              sharpness=_np_opt(sharpness))
    saved, skw = _lse_for_sinks(
        lambda: _ac.cosine_attention(_np(query), _np(keys),
                                     return_weights=False, **kw, **sec5,
                                     **var),
        weights, alpha, out, sinks)
    backward: Any = _ac.cosine_attention_backward  # alpha: by position or not
    g = backward(_np(grad_out), _np(query), _np(keys), *saved,
                 grad_alpha=_ga(grad_alpha), **kw, **skw, **sec5, **var)
    return tuple(_t(x, query) for x in g)


@_cosine_bwd_op.register_fake
def _cosine_bwd_fake(grad_out: torch.Tensor, grad_alpha: Opt,
                     query: torch.Tensor, keys: torch.Tensor,
                     alpha: torch.Tensor, out: torch.Tensor, mask: Opt,
                     attn_mask: Opt, causal: bool, bias: Opt, dropout: float,
                     seed: Opt, values: Opt, sharpness: Opt, weights: bool,
                     window: Win = None, softcap: float | None = None,
                     alibi_slopes: Opt = None, sinks: Opt = None,
                     cu_seqlens_q: Opt = None, cu_seqlens_k: Opt = None
                     ) -> tuple[torch.Tensor, ...]:
    return (_new(query), _new(keys), _like(values, query),
            _like(sharpness, query), _like(bias, query),
            _like(alibi_slopes, query), _like(sinks, query))


# ---- autograd, autocast and vmap (attention_c.torch._autograd)

_register(_Spec(
    "location", _location_op, _location_bwd_op,
    _ARGS["location_attention"], _ARGS["location_attention_backward"],
    ("query", "values", "W", "b"), pure=_pure.location_attention))
_register(_Spec(
    "cosine", _cosine_op, _cosine_bwd_op,
    _ARGS["cosine_attention"], _ARGS["cosine_attention_backward"],
    ("query", "keys", "values", "sharpness", "bias", "alibi_slopes",
     "sinks")))
