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

The functional API (attention_c.torch.functional) checks the arguments
and calls :func:`_call`.  The ops' schemas take every argument by
position: they are internal, and what torch.export and torch.jit.trace
record, so they stay as they are.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Optional, TypeAlias

import numpy as np
import torch

import attention_c as _ac

from . import _pure
from .._functions import TABLE
from ._utils import _np, _np_opt, _tracing
from ._vmap import _loop_rule, _vmap_family, _vmap_native

# The C extension itself, for the backward's private stop_at_key_proj=True
# (it has no type stub: the public functions' are in __init__.pyi).
_core: Any = importlib.import_module("attention_c._core")

_NS = "attention_c"


def _empty(like: torch.Tensor) -> torch.Tensor:
    """The placeholder for a gradient that does not exist."""
    return like.new_empty(0)


def _t(x: np.ndarray | None, like: torch.Tensor) -> torch.Tensor:
    return _empty(like) if x is None else torch.from_numpy(x)


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
    return torch.from_numpy(out), torch.from_numpy(second)


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
    return torch.from_numpy(out), torch.from_numpy(second)


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
        _ARGS["context_attention"], _ARGS["context_attention_backward"],
        ("h", "W", "v", "b")),
    "additive": _Spec(
        "additive", _additive_op, _additive_bwd_op,
        _ARGS["additive_attention"], _ARGS["additive_attention_backward"],
        ("query", "keys", "W", "v", "b", "values", "key_proj")),
    "dot": _Spec(
        "dot", _dot_op, _dot_bwd_op,
        _ARGS["dot_attention"], _ARGS["dot_attention_backward"],
        ("query", "keys", "values", "bias", "alibi_slopes", "sinks")),
    "general": _Spec(
        "general", _general_op, _general_bwd_op,
        _ARGS["general_attention"], _ARGS["general_attention_backward"],
        ("query", "keys", "W", "bias", "values", "key_proj",
         "alibi_slopes", "sinks")),
}

# The non-differentiable arguments of the pure-PyTorch forwards.
_FIXED = ("mask", "attn_mask", "causal", "dropout", "seed", "scale",
          "weights", "window", "softcap", "cu_seqlens_q", "cu_seqlens_k")


def _pure_for(spec: _Spec, a: dict[str, Any]) -> Any:
    """The pure-PyTorch forward ``(**xs) -> (out, alpha)`` (or ``(out,
    lse)``) with the non-differentiable arguments of ``a`` fixed."""
    if spec.kind == "context":
        return lambda **x: _pure.context_attention(mask=a["mask"], **x)
    fixed = {n: a[n] for n in _FIXED if n in a}
    return lambda **x: _pure.family_attention(spec.kind, **fixed, **x)


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
        # (a direct call may leave out the trailing arguments that default)
        names = spec.inputs[:len(ctx.needs_input_grad)]
        if grad_out is None and grad_alpha is None:
            return (None,) * len(names)
        given = dict(a, grad_out=(torch.zeros_like(outs[0])
                                  if grad_out is None else grad_out),
                     grad_alpha=grad_alpha, alpha=outs[1], out=outs[0],
                     # A key_proj that requires grad: stop there, autograd
                     # carries the keys' projection through its graph.
                     stop=bool(need.get("key_proj")),
                     act=outs[2] if a.get("keep") else None)
        if grad_alpha is not None and (not a.get("weights", True)
                                       or a.get("sinks") is not None):
            # A gradient of lse: the C backward takes none (its delta has
            # no P_i * dlse_i term); nor one of alpha with sinks (it needs
            # out= and lse=, which take no grad_alpha): differentiate the
            # pure forward.
            xs = _xs(spec, given)
            res = _first_order(spec, given)(given["grad_out"], grad_alpha,
                                            *xs.values())
            g = dict(zip(xs, res))
        else:
            res = bwd(*[given.get(n) for n in spec.bwd_inputs])
            g = dict(zip(spec.grads, res))
        return tuple(g[n] if n in g and a[n] is not None and need[n]
                     else None for n in names)

    return backward


def _forward_jvp(spec: _Spec) -> Any:
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[Any, ...]:
        a, outs = _saved(ctx, spec.inputs)
        t = dict(zip(spec.inputs, tangents))
        # A key_proj without a tangent is a constant equal to the keys'
        # projection: recompute it so that the keys' tangent goes through.
        xs = {n: a[n] for n in spec.grads if a.get(n) is not None
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
        return tuple(d.get(n) for n in
                     spec.bwd_inputs[:len(ctx.needs_input_grad)])

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
    torch.library.register_vmap(
        _spec.op, _vmap_native(_spec.op, (0, 4)) if _spec.kind == "context"
        else _vmap_family(_spec.op, _spec.inputs))
del _spec, _bwd_fn


def _transforms() -> list[Any]:
    """The torch.func transforms (TransformType) around this call."""
    if not torch._C._are_functorch_transforms_active():
        return []
    from torch._functorch.pyfunctorch import (
        retrieve_all_functorch_interpreters)
    return [i.key() for i in retrieve_all_functorch_interpreters()]


def _plain(args: tuple[Any, ...]) -> bool:
    """Whether a call is plain eager inference on CPU tensors: no input
    that autograd tracks, no torch.func transform, no dispatch mode (fake
    or proxy tensors, FlopCounter, ...) and no tensor subclass."""
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (
                type(a) is not torch.Tensor or a.device.type != "cpu"
                or (grad and a.requires_grad)):
            return False
    return (not torch._C._are_functorch_transforms_active()
            and torch._C._len_torch_dispatch_stack() == 0)


def _call(kind: str, *args: Any) -> Any:
    """The op of ``kind`` through its autograd.Function (eager, torch.func)
    or directly: torch.compile traces the op with its registered autograd,
    torch.jit.trace records it as a node that scripts and saves (the
    Function would be an opaque Python node), and torch.func.functionalize
    has no rule for autograd.Functions."""
    if torch.compiler.is_compiling() or _tracing():
        return _SPECS[kind].op(*args)
    if _plain(args):
        # Nothing to record: the op's body, without the dispatcher and
        # autograd.Function around it (a one-token decoding step would pay
        # them ten times over).
        return _SPECS[kind].op._init_fn(*args)
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

