"""The kernels as PyTorch custom operators (``torch.ops.attention_c.*``,
registered with ``torch.library.custom_op``), which torch.compile
(fullgraph), torch.export and torch.func see as opaque ops with a fake
(shape-only) implementation, an autograd formula and a vmap rule:

- the forward ops run one C call each; their backward is a backward op,
  one C call too, so first-order gradients stay on the fused kernels;
- a backward op's own backward (double backward, Hessians, jacrev of a
  grad) differentiates a pure-PyTorch transcription of the contract's
  forward (attention_c.torch._pure) twice with torch.func.vjp: exact, and
  differentiable again;
- optional tensor arguments are "Tensor?"; a gradient an op cannot have
  (db without b, ...) comes back as an empty placeholder tensor.

The autograd formulas, and :func:`_call`, are in
attention_c.torch._autograd; the location and cosine scores' ops in
attention_c.torch._scores_ops.  The functional API
(attention_c.torch.functional) checks the arguments and calls
:func:`_call`.  The ops' schemas take every argument by
position: they are internal, and what torch.export and torch.jit.trace
record, so they stay as they are.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional, TypeAlias

import numpy as np
import torch

import attention_c as _ac

from . import _pure
from .._functions import TABLE
from ._autograd import _call as _call  # what the functions call
from ._autograd import _eager as _eager
from ._autograd import _register, _Spec
from ._utils import _from_np, _np, _np_opt

# The C extension itself, for the backward's private stop_at_key_proj=True
# (it has no type stub: the public functions' are in __init__.pyi).
_core: Any = importlib.import_module("attention_c._core")

_NS = "attention_c"


def _empty(like: torch.Tensor) -> torch.Tensor:
    """The placeholder for a gradient that does not exist."""
    return like.new_empty(0)


def _t(x: np.ndarray | None, like: torch.Tensor) -> torch.Tensor:
    return _empty(like) if x is None else _from_np(x)


def _ga(grad_alpha: torch.Tensor | None) -> np.ndarray | None:
    return None if grad_alpha is None else _np(grad_alpha)


# ---- the schemas, from the binding's table (attention_c._functions): each
# op's arguments by name, in the op's order, typed by their kind there.

# The variants of the dot and general ops (docs/contract.md section 8),
# last: window ([left, right], -1 unbounded, or None), softcap,
# alibi_slopes and sinks (one value a sequence, differentiable),
# cu_seqlens_q and cu_seqlens_k (integer tensors); None by default.
_VARIANT_NAMES = ("window", "softcap", "alibi_slopes", "sinks",
                  "cu_seqlens_q", "cu_seqlens_k")

# The ops' arguments (what torch.export and torch.jit.trace record: they
# stay as they are; the variants were added at the end, with defaults).
# A family backward op takes both forward results: ``alpha`` (alpha or
# lse, as the forward gave) and ``out``.
_ARGS = {
    "context_attention": ("h", "W", "v", "b", "mask", "keep"),
    "context_attention_backward": (
        "grad_out", "grad_alpha", "h", "W", "v", "alpha", "b", "mask",
        "act"),
    "additive_attention": (
        "query", "keys", "W", "v", "b", "mask", "attn_mask", "causal",
        "values", "key_proj"),
    "additive_attention_backward": (
        "grad_out", "grad_alpha", "query", "keys", "W", "v", "alpha", "b",
        "mask", "attn_mask", "causal", "values", "key_proj", "stop"),
    "dot_attention": (
        "query", "keys", "mask", "attn_mask", "causal", "bias", "dropout",
        "seed", "values", "scale", "weights", *_VARIANT_NAMES),
    "dot_attention_backward": (
        "grad_out", "grad_alpha", "query", "keys", "alpha", "out", "mask",
        "attn_mask", "causal", "bias", "dropout", "seed", "values", "scale",
        "weights", *_VARIANT_NAMES),
    "general_attention": (
        "query", "keys", "W", "mask", "attn_mask", "causal", "bias",
        "dropout", "seed", "values", "key_proj", "weights", *_VARIANT_NAMES),
    "general_attention_backward": (
        "grad_out", "grad_alpha", "query", "keys", "W", "alpha", "out",
        "mask", "attn_mask", "causal", "bias", "dropout", "seed", "values",
        "key_proj", "stop", "weights", *_VARIANT_NAMES),
}
# The table's names of the ops' short ones.
_TABLE_NAMES = {"keep": "keep_activations", "act": "activations",
                "stop": "stop_at_key_proj", "weights": "return_weights"}
# An argument's kind (the same in every function) and its schema type;
# an array's is Tensor or Tensor?.  The seed is an int64 tensor holding
# its 64 bits, so that a module can draw it from torch's generator inside
# a compiled graph.
# A window is "int[]?": None, or [left, right] with -1 for an unbounded
# side (FlashAttention's convention; the NumPy API's None).  An argument
# the table does not have (yet) is an optional array.
_KINDS = {a.name: a.kind for f in TABLE.values() for a in f.args}
_TYPES = {"mask": "Tensor?", "flag": "bool", "number": "float",
          "scale": "float?", "seed": "Tensor?", "window": "int[]?"}


def _schema(function: str, nout: int) -> str:
    """The schema of the op of ``function``: its arguments (_ARGS) typed by
    the binding's table, an array a Tensor where ``function`` requires it
    or it is a forward's saved result (a backward op always takes alpha
    and out), else Tensor?; ``nout`` Tensors back."""
    required = {a.name for a in TABLE[function].args if a.required}
    if function.endswith("_backward"):
        required |= {"alpha", "out"}
    args = []
    for name in _ARGS[function]:
        kind = _KINDS.get(_TABLE_NAMES.get(name, name), "array")
        array = "Tensor" if name in required else "Tensor?"
        # The variants default to None: a call of the ops as they were
        # (recorded graphs, opcheck) still holds.
        default = "=None" if name in _VARIANT_NAMES else ""
        args.append(f"{_TYPES.get(kind, array)} {name}{default}")
    return f"({', '.join(args)}) -> ({', '.join(['Tensor'] * nout)})"


# ---- context_attention

@torch.library.custom_op(
    f"{_NS}::context_attention", mutates_args=(),
    schema=_schema("context_attention", 3))
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
    schema=_schema("context_attention_backward", 4))
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
    return (_new(h), _new(W), _new(v),
            _empty(h) if b is None else _new(b))


# ---- the family: additive, dot, general
#
# The §5 arguments: ``mask`` the key mask (..., T), ``attn_mask`` the
# per-query one, ``causal``, ``bias`` (dot and general), ``dropout`` with
# its ``seed`` (an int64 tensor holding the seed's 64 bits, so that a module
# can draw it from torch's generator inside a compiled graph), and
# ``weights``: whether the second result is alpha (True) or lse (False).
# A backward op takes both forward results: ``alpha`` (alpha or lse, as
# the forward gave) and ``out`` (read only from an lse forward).

def _lead(query: torch.Tensor, keys: torch.Tensor,
          values: torch.Tensor | None) -> tuple[bool, torch.Size]:
    """(single query?, the leading shape of the results)."""
    single = query.ndim < keys.ndim
    shapes = [query.shape[:-1] if single else query.shape[:-2],
              keys.shape[:-2]]
    if values is not None:
        shapes.append(values.shape[:-2])
    return single, _pure._broadcast_shapes(*shapes)


def _family_out_fake(query: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor | None, weights: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    single, lead = _lead(query, keys, values)
    rows = lead if single else (*lead, query.shape[-2])
    hv = (keys if values is None else values).shape[-1]
    second = (query.new_empty(*rows, keys.shape[-2]) if weights
              else query.new_empty(*rows))
    return query.new_empty(*rows, hv), second


def _new(x: torch.Tensor) -> torch.Tensor:
    """A fake result shaped as ``x``, contiguous as the kernels' results
    are (``empty_like`` would keep the strides of a transposed view)."""
    return x.new_empty(x.shape)


def _like(x: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    return _empty(ref) if x is None else _new(x)


def _seed(seed: torch.Tensor | None) -> int | None:
    """The seed, an int in [0, 2**64), from the int64 tensor of its bits."""
    return None if seed is None else int(seed.item()) % 2**64


def _sec5(mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
          causal: bool, bias: torch.Tensor | None = None,
          dropout: float = 0.0, seed: torch.Tensor | None = None
          ) -> dict[str, Any]:
    """The keyword arguments of section 5 for a C call."""
    kw: dict[str, Any] = dict(mask=_np_opt(mask),
                              attn_mask=_np_opt(attn_mask), causal=causal)
    if bias is not None:
        kw["bias"] = _np(bias)
    if dropout > 0:
        kw.update(dropout=dropout, seed=_seed(seed))
    return kw


def _variants_kw(window: list[int] | None, softcap: float | None,
                 alibi_slopes: torch.Tensor | None,
                 sinks: torch.Tensor | None,
                 cu_seqlens_q: torch.Tensor | None,
                 cu_seqlens_k: torch.Tensor | None) -> dict[str, Any]:
    """The keyword arguments of the variants (docs/contract.md section 8)
    for a C call: only those given, so that a call without them is the
    call of before.  The op's window ``[left, right]`` (-1: unbounded)
    becomes the binding's pair with None."""
    kw: dict[str, Any] = {}
    if window is not None:
        kw["window"] = tuple(None if w < 0 else int(w) for w in window)
    if softcap is not None:
        kw["softcap"] = softcap
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks),
                    ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seqlens_k", cu_seqlens_k)):
        if x is not None:
            kw[name] = _np(x)
    return kw


def _saved_kw(alpha: torch.Tensor, out: torch.Tensor, weights: bool
              ) -> tuple[tuple[np.ndarray, ...], dict[str, Any]]:
    """A backward's saved forward results: alpha by position, or out= and
    lse= (``alpha`` then holds the lse)."""
    if weights:
        return (_np(alpha),), {}
    return (), dict(out=_np(out), lse=_np(alpha))


@torch.library.custom_op(
    f"{_NS}::additive_attention", mutates_args=(),
    schema=_schema("additive_attention", 2))
def _additive_op(query: torch.Tensor, keys: torch.Tensor, W: torch.Tensor,
                 v: torch.Tensor, b: torch.Tensor | None,
                 mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                 causal: bool, values: torch.Tensor | None,
                 key_proj: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    out, alpha = _ac.additive_attention(
        _np(query), _np(keys), _np(W), _np(v), b=_np_opt(b),
        values=_np_opt(values), key_proj=_np_opt(key_proj),
        **_sec5(mask, attn_mask, causal))
    return torch.from_numpy(out), torch.from_numpy(alpha)


@_additive_op.register_fake
def _additive_fake(query: torch.Tensor, keys: torch.Tensor, W: torch.Tensor,
                   v: torch.Tensor, b: torch.Tensor | None,
                   mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                   causal: bool, values: torch.Tensor | None,
                   key_proj: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return _family_out_fake(query, keys, values)


@torch.library.custom_op(
    f"{_NS}::additive_attention_backward", mutates_args=(),
    schema=_schema("additive_attention_backward", 7))
def _additive_bwd_op(grad_out: torch.Tensor, grad_alpha: torch.Tensor | None,
                     query: torch.Tensor, keys: torch.Tensor,
                     W: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor,
                     b: torch.Tensor | None, mask: torch.Tensor | None,
                     attn_mask: torch.Tensor | None, causal: bool,
                     values: torch.Tensor | None,
                     key_proj: torch.Tensor | None, stop: bool
                     ) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dW, dv, db, dvalues, dkey_proj)``; with ``stop`` the
    gradient stops at ``key_proj`` (contract section 4.6)."""
    args = (_np(grad_out), _np(query), _np(keys), _np(W), _np(v),
            _np(alpha))
    kw = dict(b=_np_opt(b), values=_np_opt(values),
              grad_alpha=_ga(grad_alpha), **_sec5(mask, attn_mask, causal))
    if stop:
        assert key_proj is not None
        dq, dk, dval, dW, dv, db, dkp = _core.additive_attention_backward(
            *args, key_proj=_np(key_proj), stop_at_key_proj=True, **kw)
    else:
        dq, dk, dval, dW, dv, db = _ac.additive_attention_backward(
            *args, key_proj=_np_opt(key_proj), **kw)
        dkp = None
    return tuple(_t(x, query) for x in (dq, dk, dW, dv, db, dval, dkp))


@_additive_bwd_op.register_fake
def _additive_bwd_fake(grad_out: torch.Tensor,
                       grad_alpha: torch.Tensor | None, query: torch.Tensor,
                       keys: torch.Tensor, W: torch.Tensor, v: torch.Tensor,
                       alpha: torch.Tensor, b: torch.Tensor | None,
                       mask: torch.Tensor | None,
                       attn_mask: torch.Tensor | None, causal: bool,
                       values: torch.Tensor | None,
                       key_proj: torch.Tensor | None, stop: bool
                       ) -> tuple[torch.Tensor, ...]:
    return (_new(query), _new(keys),
            _new(W), _new(v), _like(b, query),
            _like(values, query), _like(key_proj if stop else None, query))


# The types of the variants' arguments (_VARIANT_NAMES).
# (explicit aliases: where torch is not analysed, its Tensor is Any)
Win: TypeAlias = Optional[list[int]]
Opt: TypeAlias = Optional[torch.Tensor]


def _lse_for_sinks(call: Any, weights: bool, alpha: torch.Tensor,
                   out: torch.Tensor, sinks: Opt
                   ) -> tuple[tuple[np.ndarray, ...], dict[str, Any]]:
    """A backward's saved results; with sinks after a return_weights=True
    forward (whose alpha loses the sink's share, so the C backward refuses
    it), the lse of one more forward call ``call()`` -> (out, lse)."""
    if sinks is not None and weights:
        out2, lse = call()
        return (), dict(out=out2, lse=lse)
    return _saved_kw(alpha, out, weights)


@torch.library.custom_op(
    f"{_NS}::dot_attention", mutates_args=(),
    schema=_schema("dot_attention", 2))
def _dot_op(query: torch.Tensor, keys: torch.Tensor,
            mask: Opt, attn_mask: Opt, causal: bool, bias: Opt,
            dropout: float, seed: Opt, values: Opt, scale: float | None,
            weights: bool, window: Win = None,
            softcap: float | None = None, alibi_slopes: Opt = None,
            sinks: Opt = None, cu_seqlens_q: Opt = None,
            cu_seqlens_k: Opt = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, alpha)``, or ``(out, lse)`` when not ``weights``."""
    out, second = _ac.dot_attention(
        _np(query), _np(keys), values=_np_opt(values), scale=scale,
        return_weights=weights,
        **_sec5(mask, attn_mask, causal, bias, dropout, seed),
        **_variants_kw(window, softcap, alibi_slopes, sinks, cu_seqlens_q,
                       cu_seqlens_k))
    return _from_np(out), _from_np(second)


@_dot_op.register_fake
def _dot_fake(query: torch.Tensor, keys: torch.Tensor,
              mask: Opt, attn_mask: Opt, causal: bool, bias: Opt,
              dropout: float, seed: Opt, values: Opt, scale: float | None,
              weights: bool, window: Win = None,
              softcap: float | None = None, alibi_slopes: Opt = None,
              sinks: Opt = None, cu_seqlens_q: Opt = None,
              cu_seqlens_k: Opt = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _family_out_fake(query, keys, values, weights)


@torch.library.custom_op(
    f"{_NS}::dot_attention_backward", mutates_args=(),
    schema=_schema("dot_attention_backward", 6))
def _dot_bwd_op(grad_out: torch.Tensor, grad_alpha: Opt,
                query: torch.Tensor, keys: torch.Tensor, alpha: torch.Tensor,
                out: torch.Tensor, mask: Opt, attn_mask: Opt, causal: bool,
                bias: Opt, dropout: float, seed: Opt, values: Opt,
                scale: float | None, weights: bool, window: Win = None,
                softcap: float | None = None, alibi_slopes: Opt = None,
                sinks: Opt = None, cu_seqlens_q: Opt = None,
                cu_seqlens_k: Opt = None
                ) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dvalues, dbias, dalibi_slopes, dsinks)``, each empty
    without its input.  ``alpha`` is the lse when not ``weights``."""
    sec5 = _sec5(mask, attn_mask, causal, bias, dropout, seed)
    var = _variants_kw(window, softcap, alibi_slopes, sinks, cu_seqlens_q,
                       cu_seqlens_k)
    saved, skw = _lse_for_sinks(
        lambda: _ac.dot_attention(
            _np(query), _np(keys), values=_np_opt(values), scale=scale,
            return_weights=False, **sec5, **var),
        weights, alpha, out, sinks)
    backward: Any = _ac.dot_attention_backward  # alpha: by position or not
    g = backward(
        _np(grad_out), _np(query), _np(keys), *saved,
        values=_np_opt(values), scale=scale, grad_alpha=_ga(grad_alpha),
        **skw, **sec5, **var)
    extra = tuple(g[4:6]) if len(g) > 4 else (None, None)
    return tuple(_t(x, query) for x in (*g[:4], *extra))


@_dot_bwd_op.register_fake
def _dot_bwd_fake(grad_out: torch.Tensor, grad_alpha: Opt,
                  query: torch.Tensor, keys: torch.Tensor,
                  alpha: torch.Tensor, out: torch.Tensor,
                  mask: Opt, attn_mask: Opt, causal: bool, bias: Opt,
                  dropout: float, seed: Opt, values: Opt,
                  scale: float | None, weights: bool, window: Win = None,
                  softcap: float | None = None, alibi_slopes: Opt = None,
                  sinks: Opt = None, cu_seqlens_q: Opt = None,
                  cu_seqlens_k: Opt = None
                  ) -> tuple[torch.Tensor, ...]:
    return (_new(query), _new(keys), _like(values, query),
            _like(bias, query), _like(alibi_slopes, query),
            _like(sinks, query))


@torch.library.custom_op(
    f"{_NS}::general_attention", mutates_args=(),
    schema=_schema("general_attention", 2))
def _general_op(query: torch.Tensor, keys: torch.Tensor, W: torch.Tensor,
                mask: Opt, attn_mask: Opt, causal: bool, bias: Opt,
                dropout: float, seed: Opt, values: Opt, key_proj: Opt,
                weights: bool, window: Win = None,
                softcap: float | None = None, alibi_slopes: Opt = None,
                sinks: Opt = None, cu_seqlens_q: Opt = None,
                cu_seqlens_k: Opt = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, alpha)``, or ``(out, lse)`` when not ``weights``."""
    out, second = _ac.general_attention(
        _np(query), _np(keys), _np(W), values=_np_opt(values),
        key_proj=_np_opt(key_proj), return_weights=weights,
        **_sec5(mask, attn_mask, causal, bias, dropout, seed),
        **_variants_kw(window, softcap, alibi_slopes, sinks, cu_seqlens_q,
                       cu_seqlens_k))
    return _from_np(out), _from_np(second)


@_general_op.register_fake
def _general_fake(query: torch.Tensor, keys: torch.Tensor, W: torch.Tensor,
                  mask: Opt, attn_mask: Opt, causal: bool, bias: Opt,
                  dropout: float, seed: Opt, values: Opt, key_proj: Opt,
                  weights: bool, window: Win = None,
                  softcap: float | None = None, alibi_slopes: Opt = None,
                  sinks: Opt = None, cu_seqlens_q: Opt = None,
                  cu_seqlens_k: Opt = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return _family_out_fake(query, keys, values, weights)


@torch.library.custom_op(
    f"{_NS}::general_attention_backward", mutates_args=(),
    schema=_schema("general_attention_backward", 8))
def _general_bwd_op(grad_out: torch.Tensor, grad_alpha: Opt,
                    query: torch.Tensor, keys: torch.Tensor, W: torch.Tensor,
                    alpha: torch.Tensor, out: torch.Tensor,
                    mask: Opt, attn_mask: Opt, causal: bool, bias: Opt,
                    dropout: float, seed: Opt, values: Opt, key_proj: Opt,
                    stop: bool, weights: bool, window: Win = None,
                    softcap: float | None = None, alibi_slopes: Opt = None,
                    sinks: Opt = None, cu_seqlens_q: Opt = None,
                    cu_seqlens_k: Opt = None
                    ) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dW, dbias, dvalues, dkey_proj, dalibi_slopes, dsinks)``;
    with ``stop`` dW is 0 (W only acts through key_proj).  ``alpha`` is
    the lse when not ``weights``."""
    sec5 = _sec5(mask, attn_mask, causal, bias, dropout, seed)
    var = _variants_kw(window, softcap, alibi_slopes, sinks, cu_seqlens_q,
                       cu_seqlens_k)
    saved, skw = _lse_for_sinks(
        lambda: _ac.general_attention(
            _np(query), _np(keys), _np(W), values=_np_opt(values),
            key_proj=_np_opt(key_proj), return_weights=False, **sec5,
            **var),
        weights, alpha, out, sinks)
    args = (_np(grad_out), _np(query), _np(keys), _np(W), *saved)
    kw = dict(values=_np_opt(values), grad_alpha=_ga(grad_alpha), **skw,
              **sec5, **var)
    if stop:
        assert key_proj is not None
        g = _core.general_attention_backward(
            *args, key_proj=_np(key_proj), stop_at_key_proj=True, **kw)
        dq, dk, dval, _, dbias, *rest = g
        dkp = rest.pop()                    # the extra output, last
        dW = np.zeros(W.shape, _np(W).dtype)
    else:
        g = _ac.general_attention_backward(
            *args, key_proj=_np_opt(key_proj), **kw)
        dq, dk, dval, dW, dbias, *rest = g
        dkp = None
    dsl, dsk = rest if rest else (None, None)
    return tuple(_t(x, query)
                 for x in (dq, dk, dW, dbias, dval, dkp, dsl, dsk))


@_general_bwd_op.register_fake
def _general_bwd_fake(grad_out: torch.Tensor, grad_alpha: Opt,
                      query: torch.Tensor, keys: torch.Tensor,
                      W: torch.Tensor, alpha: torch.Tensor,
                      out: torch.Tensor, mask: Opt, attn_mask: Opt,
                      causal: bool, bias: Opt, dropout: float, seed: Opt,
                      values: Opt, key_proj: Opt, stop: bool, weights: bool,
                      window: Win = None,
                      softcap: float | None = None, alibi_slopes: Opt = None,
                      sinks: Opt = None, cu_seqlens_q: Opt = None,
                      cu_seqlens_k: Opt = None
                      ) -> tuple[torch.Tensor, ...]:
    return (_new(query), _new(keys),
            _new(W), _like(bias, query), _like(values, query),
            _like(key_proj if stop else None, query),
            _like(alibi_slopes, query), _like(sinks, query))


# ---- autograd, autocast and vmap (attention_c.torch._autograd)

for _spec in (
    _Spec(
        "context", _context_op, _context_bwd_op,
        _ARGS["context_attention"], _ARGS["context_attention_backward"],
        ("h", "W", "v", "b")),
    _Spec(
        "additive", _additive_op, _additive_bwd_op,
        _ARGS["additive_attention"], _ARGS["additive_attention_backward"],
        ("query", "keys", "W", "v", "b", "values", "key_proj")),
    _Spec(
        "dot", _dot_op, _dot_bwd_op,
        _ARGS["dot_attention"], _ARGS["dot_attention_backward"],
        ("query", "keys", "values", "bias", "alibi_slopes", "sinks")),
    _Spec(
        "general", _general_op, _general_bwd_op,
        _ARGS["general_attention"], _ARGS["general_attention_backward"],
        ("query", "keys", "W", "bias", "values", "key_proj",
         "alibi_slopes", "sinks")),
):
    _register(_spec)
del _spec
