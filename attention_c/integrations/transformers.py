"""attention_c as an attention backend of Hugging Face transformers.

>>> from attention_c.integrations.transformers import register
>>> register()                                   # doctest: +SKIP
>>> model = AutoModelForCausalLM.from_pretrained(
...     path, attn_implementation="attention_c")  # doctest: +SKIP

:func:`register` adds two functions under one name: the attention function
(``AttentionInterface``) and the mask function
(``AttentionMaskInterface``).  Both are needed: a backend known only to
``AttentionInterface`` receives no mask at all, and would silently ignore
padding.

The mask function keeps the mask structured (:class:`StructuredMask`):
causal, a sliding window, padding as a (B, S) key mask and packed
sequences as ``cu_seqlens`` are read by the kernel as such (blocks that no
query sees are skipped); a dense boolean mask is formed only for a pattern
it does not recognise.  The attention function honours every keyword that
the models of transformers pass (``scaling``, ``dropout``,
``sliding_window``, ``softcap``, ``s_aux``, ``position_bias``,
``cu_seq_lens_q/k``, ``output_attentions``), reads grouped-query heads in
place (no ``repeat_kv``), and raises, naming it, on anything else.

:class:`CompactCache` is a transformers ``Cache`` of bfloat16, float16 or
int8 keys and values, contiguous or paged, which the attention function
reads in place with :func:`attention_c.cache_attention` (its
``update`` returns placeholders that name the cache layer: see
:mod:`attention_c.integrations.compact_cache`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import numpy as np
import torch

import attention_c as ac
from attention_c.torch._utils import _from_np, _np, _reads_as_stored

from .compact_cache import (CompactCache, _Deferred, _import, deferred_layer,
                            dense)


_mu = _import("transformers.masking_utils")
_modeling = _import("transformers.modeling_utils")
# What output_attentions=True (in the call or the config) collects.
_capturing = _import("transformers.utils.output_capturing")

__all__ = ["register", "attention_forward", "mask_forward",
           "StructuredMask", "CompactCache", "NAME"]

NAME = "attention_c"

# Keywords that models pass and that need nothing from us: they describe
# what the mask or the cache already encode, or are for other backends.
_IGNORED = frozenset({
    "position_ids", "cache_position", "past_key_values", "past_key_value",
    "use_cache", "layer_idx", "max_length_q", "max_length_k",
    "output_hidden_states", "return_dict", "token_type_ids",
    "is_causal", "target_dtype", "implementation",
    "use_return_dict", "labels", "num_items_in_batch",
    "encoder_hidden_states", "encoder_attention_mask",
})


# ---------------------------------------------------------------------------
# The mask


@dataclass
class StructuredMask:
    """What the mask function returns and the attention function reads.

    Positions are in the kernel's terms, after the keys are cut to
    ``kv_length`` (the keys beyond it are invisible to every query, e.g.
    the unwritten slots of a static cache): ``causal`` and ``window``
    aligned at the bottom right (query i at ``i + kv_length - Tq``).

    Attributes
    ----------
    q_length, kv_length : int
    causal : bool
    window : (int or None, int or None) or None
        The kernel's ``window`` (left, right).
    key_mask : torch.Tensor of bool (B, kv_length) or None
        Padding: True = a real key.
    cu_seqlens : torch.Tensor of int64 (n + 1,) or None
        Packed sequences over the batch flattened into the time axis
        (row b's tokens at ``b * q_length`` on): self-attention only.
    dense : torch.Tensor of bool (B, 1, Tq, kv_length) or None
        Only for a pattern with no structured form.
    """

    q_length: int
    kv_length: int
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    key_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    dense: torch.Tensor | None = None

    # Models only pass the mask along; these keep the odd generic check
    # (``mask.shape``, ``mask.ndim``, ``mask.to(device)``) working.
    @property
    def shape(self) -> tuple[int, ...]:
        b = self.key_mask.shape[0] if self.key_mask is not None else 1
        return (b, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:
        return 4

    def to(self, *args: Any, **kwargs: Any) -> "StructuredMask":
        return self

    def contiguous(self) -> "StructuredMask":
        return self


class _Pattern:
    """A mask function of transformers, as a window per position."""

    def __init__(self) -> None:
        self.left: int | None = None     # kv >= q - left
        self.right: int | None = None    # kv <= q + right
        self.packed: torch.Tensor | None = None
        self.position_ids: torch.Tensor | None = None

    def narrow(self, left: int | None, right: int | None) -> None:
        if left is not None:
            self.left = left if self.left is None else min(self.left, left)
        if right is not None:
            self.right = (right if self.right is None
                          else min(self.right, right))


def _nonlocals(fn: Callable[..., Any]) -> dict[str, Any]:
    return dict(inspect.getclosurevars(fn).nonlocals)


def _parse(fn: Callable[..., Any], pat: _Pattern) -> bool:
    """Fill ``pat`` from the mask function ``fn``; False if unknown."""
    if fn is _mu.causal_mask_function:
        pat.narrow(None, 0)
        return True
    if fn is _mu.bidirectional_mask_function:
        return True
    name = getattr(fn, "__qualname__", "")
    try:
        free = _nonlocals(fn)
    except (TypeError, ValueError):
        return False
    if name == "and_masks.<locals>.and_mask":
        return all(_parse(f, pat) for f in free.get("mask_functions", ()))
    if name == "sliding_window_overlay.<locals>.inner_mask":
        # kv > q - w
        pat.narrow(int(free["sliding_window"]) - 1, None)
        return True
    if name == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
        w = int(free["sliding_window"])
        pat.narrow(w, w)
        return True
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        pat.packed = free["packed_sequence_mask"]
        return True
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        pat.position_ids = free["position_ids"]
        return _parse(free["mask_function"], pat)
    return False


def _segments(packed: torch.Tensor, position_ids: torch.Tensor | None
              ) -> torch.Tensor | None:
    """cu_seqlens of the rows of ``packed`` (B, T) laid end to end, or
    None when a segment's positions do not count up by one (then the
    remapped causal mask is not the segment's own causal mask)."""
    b, t = packed.shape
    starts = [0]
    for r in range(b):
        row = packed[r]
        cut = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
        starts += [r * t + c for c in cut] + [(r + 1) * t]
    cu = torch.tensor(sorted(set(starts)), dtype=torch.int64)
    if position_ids is not None:
        pos = position_ids.expand(b, t).reshape(-1)
        steps = pos[1:] - pos[:-1]
        inner = torch.ones(b * t - 1, dtype=torch.bool)
        inner[cu[1:-1] - 1] = False
        if not bool((steps[inner] == 1).all()):
            return None
    return cu


def mask_forward(batch_size: int, q_length: int, kv_length: int,
                 q_offset: Any = 0, kv_offset: int = 0,
                 mask_function: Callable[..., Any] = (
                     _mu.causal_mask_function),
                 attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> StructuredMask:
    """The mask function (``AttentionMaskInterface``): a
    :class:`StructuredMask` from what transformers' mask builders give
    (query positions ``q_offset + i``, key positions ``kv_offset + j``,
    the pattern ``mask_function`` and the 2-D padding mask)."""
    if isinstance(attention_mask, StructuredMask):
        # prepared already (generate builds the masks ahead for a static
        # cache), as transformers returns a 4-D tensor mask as it is
        return attention_mask
    q_offset = int(q_offset)
    kv_offset = int(kv_offset)
    pad = _mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if pad is not None:
        pad = pad[:, kv_offset:kv_offset + kv_length].to(torch.bool)

    def dense() -> StructuredMask:
        m = _mu.sdpa_mask(batch_size=batch_size, q_length=q_length,
                          kv_length=kv_length, q_offset=q_offset,
                          kv_offset=kv_offset, mask_function=mask_function,
                          attention_mask=attention_mask,
                          allow_is_causal_skip=False,
                          allow_is_bidirectional_skip=False,
                          use_vmap=kwargs.get("use_vmap", False),
                          device=kwargs.get("device", "cpu"))
        return StructuredMask(q_length, kv_length, dense=m)

    pat = _Pattern()
    if not _parse(mask_function, pat):
        return dense()
    # Key j is visible to query i iff
    #   q_offset + i - left <= kv_offset + j <= q_offset + i + right;
    # the kernel aligns query i at i + (T - Tq): T = d + Tq keys, with d
    # the offset between the two position counters.
    d = q_offset - kv_offset
    length = kv_length
    window = None
    causal = False
    if pat.left is not None or pat.right is not None:
        length = d + q_length
        if length <= 0:
            return dense()
        if length > kv_length:
            return dense()
        if length < kv_length and pat.right is None:
            return dense()
        # Keys past `length` are invisible to all when right == 0.
        if length < kv_length and pat.right != 0:
            return dense()
        causal = pat.right == 0
        if pat.left is not None or (pat.right not in (None, 0)):
            window = (pat.left, None if causal else pat.right)
    key_mask = None
    if pad is not None:
        pad = pad[:, :length]
        if not bool(pad.all()):
            key_mask = pad
    cu = None
    if pat.packed is not None:
        if d != 0 or q_length != kv_length or key_mask is not None:
            return dense()
        cu = _segments(pat.packed, pat.position_ids)
        if cu is None:
            return dense()
        if cu.numel() == 2:
            cu = None
    return StructuredMask(q_length, length, causal=causal, window=window,
                          key_mask=key_mask, cu_seqlens=cu)


# ---------------------------------------------------------------------------
# The kernel, as a torch.autograd.Function


def _npo(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else _np(t)


def _function() -> Any:
    """The autograd function of ``ac.dot_attention`` with every gradient
    (query, keys, values, the float bias and the sinks), and the weights
    when asked for.  Made with type(), so that stubtest (torch left
    unanalysed) meets no class whose metaclass it cannot know."""

    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, bias: torch.Tensor | None,
                sinks: torch.Tensor | None, kw: dict[str, Any],
                weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
        a = dict(kw, values=_np(v), bias=_npo(bias), sinks=_npo(sinks))
        if weights and sinks is None:
            out, alpha = ac.dot_attention(_np(q), _np(k), **a)
            ctx.save_for_backward(q, k, v, bias, sinks,
                                  _from_np(alpha))
            ctx.from_alpha = True
            w = _from_np(alpha)
        else:
            out, lse = ac.dot_attention(_np(q), _np(k),
                                        return_weights=False, **a)
            if weights:
                # The weights with sinks sum to less than 1: P = exp(s -
                # lse), from the weights path with the same sinks.
                _, alpha = ac.dot_attention(_np(q), _np(k), **a)
                w = _from_np(alpha)
                ctx.mark_non_differentiable(w)
            else:
                w = q.new_empty(0)
            ctx.save_for_backward(q, k, v, bias, sinks,
                                  _from_np(out),
                                  _from_np(lse))
            ctx.from_alpha = False
        ctx.kw = kw
        return _from_np(out), w

    def backward(ctx: Any, g: torch.Tensor, gw: torch.Tensor | None
                 ) -> tuple[Any, ...]:
        if ctx.from_alpha:
            q, k, v, bias, sinks, alpha = ctx.saved_tensors
            extra: dict[str, Any] = {"alpha": _np(alpha)}
            if gw is not None and gw.numel() and bool(gw.ne(0).any()):
                extra["grad_alpha"] = _np(gw.contiguous())
        else:
            q, k, v, bias, sinks, out, lse = ctx.saved_tensors
            extra = {"out": _np(out), "lse": _np(lse)}
        call: dict[str, Any] = dict(ctx.kw, values=_np(v), bias=_npo(bias),
                                    sinks=_npo(sinks), **extra)
        gr: Any = ac.dot_attention_backward(_np(g.contiguous()), _np(q),
                                            _np(k), **call)

        def t(x: np.ndarray | None, need: bool) -> torch.Tensor | None:
            return _from_np(np.ascontiguousarray(x)) if (
                need and x is not None) else None

        n = ctx.needs_input_grad
        return (t(gr.query, n[0]), t(gr.keys, n[1]), t(gr.values, n[2]),
                t(gr.bias, n[3]), t(gr.sinks, n[4]), None, None)

    return type("_DotAttention", (torch.autograd.Function,),
                {"forward": staticmethod(forward),
                 "backward": staticmethod(backward),
                 "__doc__": _function.__doc__})


_DotAttention: Any = _function()


# ---------------------------------------------------------------------------
# The attention function


def _weights_wanted(kwargs: dict[str, Any]) -> bool:
    if kwargs.get("output_attentions"):
        return True
    try:
        active = _capturing._active_collector.get()
    except (AttributeError, LookupError):
        return False
    return bool(active) and ("attentions" in active
                             or "cross_attentions" in active)


def _refuse(name: str, why: str) -> NoReturn:
    raise NotImplementedError(
        f"attention_c (transformers backend): {name} {why}; use "
        f"attn_implementation='eager' for this model")


def attention_forward(module: torch.nn.Module, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None,
                      is_causal: bool | None = None,
                      sliding_window: int | None = None,
                      softcap: float | None = None,
                      s_aux: torch.Tensor | None = None,
                      position_bias: torch.Tensor | None = None,
                      **kwargs: Any
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function (``AttentionInterface``).

    ``query`` (B, H, Tq, d), ``key`` and ``value`` (B, Hkv, T, d), H a
    multiple of Hkv; returns ``(out (B, Tq, H, dv), weights (B, H, Tq, T)
    or None)`` as transformers' other backends.
    """
    _check_call(query, kwargs)
    if s_aux is not None and not isinstance(s_aux, torch.Tensor):
        s_aux = torch.as_tensor(s_aux)
    if isinstance(key, _Deferred) or isinstance(value, _Deferred):
        # A CompactCache's layer: read in place, else densely (a copy).
        out = _from_cache(module, query, key, value, attention_mask,
                          dropout, scaling, is_causal, sliding_window,
                          softcap, s_aux, position_bias, kwargs)
        if out is not None:
            return out, None
        key, value = dense(key), dense(value)

    B, H, Tq, d = query.shape
    Hkv = key.shape[1]
    if H % Hkv:
        _refuse(f"{H} query heads over {Hkv} key/value heads",
                "(not a multiple)")
    G = H // Hkv
    kw: dict[str, Any] = {"scale": (float(scaling) if scaling is not None
                                    else d ** -0.5)}
    if softcap is not None:
        kw["softcap"] = float(softcap)
    key, value, bias, attn_mask, cu = _masks(
        module, attention_mask, query, key, value, position_bias, is_causal,
        sliding_window, kw)
    T = key.shape[2]
    cu = _packed_keywords(module, kwargs, attention_mask, is_causal, B, cu,
                          kw)
    if attn_mask is not None:
        kw["attn_mask"] = _np(attn_mask.to(torch.bool)[:, :, None])
    if dropout and module.training:
        kw["dropout"] = float(dropout)
        kw["seed"] = int(torch.randint(0, 2**62, (), dtype=torch.int64))

    low, q5, k5, v5, bias, sinks = _grouped(query, key, value, bias, s_aux,
                                            G)
    if cu is not None:
        # The batch into the time axis: (Hkv, G, B*T, d).
        q5 = q5.permute(1, 2, 0, 3, 4).reshape(Hkv, G, B * Tq, d)
        k5 = k5.permute(1, 2, 0, 3, 4).reshape(Hkv, 1, B * T, d)
        v5 = v5.permute(1, 2, 0, 3, 4).reshape(Hkv, 1, B * T, -1)
        if bias is not None:
            _refuse("a float bias with packed sequences", "is not supported")
        kw["cu_seqlens_q"] = kw["cu_seqlens_k"] = cu.numpy()

    want = _weights_wanted(kwargs)
    if want and (cu is not None or "cu_seqlens_q" in kw):
        _refuse("output_attentions with packed sequences", "is not supported")
    out, w = _DotAttention.apply(q5, k5, v5, bias, sinks, kw, want)
    if cu is not None:
        out = out.reshape(Hkv, G, B, Tq, -1).permute(2, 0, 1, 3, 4)
    out = out.reshape(B, H, Tq, -1).transpose(1, 2).contiguous()
    weights = w.reshape(B, H, Tq, T) if want else None
    if low is not None:
        out = out.to(low)
        weights = None if weights is None else weights.to(low)
    return out, weights


def _check_call(query: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """The keywords attention_forward takes (the others refused unless
    None), and a query on the CPU."""
    if kwargs.get("cache") is not None:
        _refuse("a paged cache", "is not supported")
    for name in kwargs:
        if name in _IGNORED or name.startswith("output_"):
            continue
        if name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            continue
        if kwargs[name] is None:
            continue
        _refuse(f"the keyword argument {name!r}", "is not supported")
    if query.device.type != "cpu":
        _refuse(f"a tensor on {query.device}", "is not supported (CPU only)")


def _masks(module: torch.nn.Module, attention_mask: Any,
           query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           bias: torch.Tensor | None, is_causal: bool | None,
           sliding_window: int | None, kw: dict[str, Any]) -> tuple[
               torch.Tensor, torch.Tensor, torch.Tensor | None,
               torch.Tensor | None, torch.Tensor | None]:
    """The mask as our keywords (into kw: causal, window, mask): returns
    (key, value, bias, attn_mask, cu_seqlens), the keys cut to the mask's
    length, a float mask added to the bias, a boolean one as attn_mask."""
    Tq, T = query.shape[2], key.shape[2]
    attn_mask = cu = None
    if isinstance(attention_mask, StructuredMask):
        m = attention_mask
        if m.q_length != Tq or m.kv_length > T:
            _refuse(f"a mask for {m.q_length} queries and {m.kv_length} "
                    f"keys with {Tq} queries and {T} keys", "does not fit")
        if m.kv_length < T:
            key, value = key[:, :, :m.kv_length], value[:, :, :m.kv_length]
            if bias is not None and bias.shape[-1] == T:
                bias = bias[..., :m.kv_length]
        kw["causal"] = m.causal
        if m.window is not None:
            kw["window"] = m.window
        if m.key_mask is not None:
            # (B, T) -> (B, 1, 1, T) against (B, Hkv, G, Tq, d)
            kw["mask"] = _np(m.key_mask[:, None, None, :])
        if m.dense is not None:
            attn_mask = m.dense
        cu = m.cu_seqlens
    elif isinstance(attention_mask, torch.Tensor):
        if attention_mask.ndim != 4:
            _refuse(f"an attention_mask of shape "
                    f"{tuple(attention_mask.shape)}", "(not 4-D)")
        am = attention_mask[..., :T]
        if am.dtype == torch.bool:
            attn_mask = am
        else:
            bias = am.to(query.dtype) if bias is None else bias + am
    elif attention_mask is not None:
        _refuse(f"an attention_mask of type "
                f"{type(attention_mask).__name__}", "is not supported")
    else:
        # No mask: the sdpa backend's rule (module.is_causal, top-left
        # alignment when there are more keys, the only case being an empty
        # static cache).
        causal = is_causal if is_causal is not None else getattr(
            module, "is_causal", True)
        if causal and Tq > 1:
            if T > Tq:
                key, value = key[:, :, :Tq], value[:, :, :Tq]
                if bias is not None and bias.shape[-1] == T:
                    bias = bias[..., :Tq]
            kw["causal"] = True
            if sliding_window is not None:
                kw["window"] = (int(sliding_window) - 1, 0)
    return key, value, bias, attn_mask, cu


def _packed_keywords(module: torch.nn.Module, kwargs: dict[str, Any],
                     attention_mask: Any, is_causal: bool | None, B: int,
                     cu: torch.Tensor | None,
                     kw: dict[str, Any]) -> torch.Tensor | None:
    """Packed sequences given as flash-attention keywords (cu_seq_lens_q,
    _k) into kw; returns the position_ids' cu_seqlens still to apply
    (None once the keywords took their place)."""
    cq, ck = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cq is None and ck is None:
        return cu
    if not (isinstance(cq, torch.Tensor) and isinstance(ck, torch.Tensor)):
        _refuse("cu_seq_lens_q without cu_seq_lens_k (or the reverse)", "")
    if B != 1:
        _refuse(f"cu_seq_lens_q/k with a batch of {B}",
                "(packed sequences come as one row)")
    cu_q = cq.to(torch.int64).cpu()
    cu_k = ck.to(torch.int64).cpu()
    if cu is not None and not torch.equal(cu, cu_q):
        _refuse("cu_seq_lens_q", "disagrees with the position_ids")
    kw["cu_seqlens_q"], kw["cu_seqlens_k"] = cu_q.numpy(), cu_k.numpy()
    if "causal" not in kw or attention_mask is None:
        kw["causal"] = bool(is_causal if is_causal is not None
                            else getattr(module, "is_causal", True))
    return None


def _grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             bias: torch.Tensor | None, s_aux: torch.Tensor | None,
             G: int) -> tuple[Any, ...]:
    """(the 16-bit dtype to return or None, query (B, Hkv, G, Tq, d), keys
    and values (B, Hkv, 1, T, .), bias and sinks by the same heads) in the
    dtype the call computes in."""
    B, H, Tq, d = query.shape
    Hkv = H // G
    low = None
    if query.dtype not in (torch.float32, torch.float64):
        low = query.dtype
    # A 16-bit model's queries, keys and values as they are, with
    # gradients or without: the call computes in float32 (on the bf16
    # products for bfloat16, where the CPU has them) and returns their
    # dtype; a decoding step reads the keys and values in place.  Widened
    # to float32 copies when NumPy cannot hold the dtype (no ml_dtypes).
    native = low is not None and all(
        _reads_as_stored(t) and t.dtype == low for t in (query, key, value))
    if low is not None and not native:
        query = query.float()
    dt = query.dtype
    if key.dtype != dt or value.dtype != dt:
        key, value = key.to(dt), value.to(dt)
    # Grouped heads in place: query (B, Hkv, G, Tq, d), keys (B, Hkv, 1, T,
    # d), a view each.
    q5 = query.reshape(B, Hkv, G, Tq, d)
    k5 = key[:, :, None]
    v5 = value[:, :, None]
    if bias is not None:
        bias = bias.to(dt)
        if bias.ndim == 4 and bias.shape[1] == H:
            bias = bias.reshape(bias.shape[0], Hkv, G, *bias.shape[2:])
        elif bias.ndim == 4:
            bias = bias[:, :, None]
    sinks = None
    if s_aux is not None:
        if s_aux.numel() != H:
            _refuse(f"s_aux of shape {tuple(s_aux.shape)}",
                    f"(one sink per head, {H}, expected)")
        sinks = s_aux.to(dt).reshape(Hkv, G)
    return low, q5, k5, v5, bias, sinks


def _from_cache(module: torch.nn.Module, query: torch.Tensor, key: Any,
                value: Any, mask: Any, dropout: float,
                scaling: float | None, is_causal: bool | None,
                sliding_window: int | None, softcap: float | None,
                s_aux: torch.Tensor | None, position_bias: Any,
                kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The attention on a CompactCache layer's buffers in place
    (attention_c.cache_attention writes the new keys and values first),
    or None when the call needs what that cannot give: padding or another
    mask than causal / a window, gradients, the weights, a position bias,
    dropout, packed sequences, a float64 query.  Bottom-right aligned:
    the Tq queries are the last Tq of the N positions."""
    layer = deferred_layer(key, value)
    if layer is None:
        return None
    B, H, Tq, d = query.shape
    N = key.shape[2]
    assert layer._pending is not None
    if (position_bias is not None or (dropout and module.training)
            or _weights_wanted(kwargs)
            or kwargs.get("cu_seq_lens_q") is not None
            or kwargs.get("cu_seq_lens_k") is not None
            or query.dtype not in (torch.float32, torch.bfloat16,
                                   torch.float16)
            or (torch.is_grad_enabled() and any(
                t.requires_grad for t in (query, *layer._pending)))):
        return None
    kw: dict[str, Any] = {"scale": (float(scaling) if scaling is not None
                                    else d ** -0.5)}
    if isinstance(mask, StructuredMask):
        if (mask.q_length != Tq or mask.kv_length != N
                or mask.key_mask is not None or mask.dense is not None
                or mask.cu_seqlens is not None):
            return None
        kw["causal"] = mask.causal
        kw["window"] = mask.window
    elif mask is None:
        # sdpa's rule without a mask aligns top-left: the same only when
        # the queries are one or all the positions.
        if Tq not in (1, N):
            return None
        causal = bool(is_causal if is_causal is not None
                      else getattr(module, "is_causal", True))
        kw["causal"] = causal
        if causal and sliding_window is not None:
            kw["window"] = (int(sliding_window) - 1, 0)
    else:
        return None
    if softcap is not None:
        kw["softcap"] = float(softcap)
    if s_aux is not None:
        if s_aux.numel() != H:
            return None             # the dense path names it
        kw["sinks"] = s_aux.detach().to(torch.float32).reshape(H).numpy()
    return layer.attend(query, **kw)


def register(name: str = NAME) -> str:
    """Register attention_c under ``name`` in transformers.

    Adds the attention function to ``AttentionInterface`` and the mask
    function to ``AttentionMaskInterface`` (both are needed: without the
    mask function, models pass no mask at all), after which
    ``attn_implementation=name`` works in ``from_config``,
    ``from_pretrained`` and ``set_attn_implementation``.  Idempotent.
    Returns ``name``.
    """
    _modeling.AttentionInterface.register(name, attention_forward)
    _mu.AttentionMaskInterface.register(name, mask_forward)
    return name
