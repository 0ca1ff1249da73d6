"""FlashAttention-2's ``flash_attn_with_kvcache`` on
:func:`attention_c.cache_attention`: the PyTorch half of decoding against
a key/value cache (docs/contract.md section 8.7), exported by
:mod:`attention_c.torch.flash_attn_interface`.  Its checks speak torch's
names; the tensors are handed to the NumPy function as views, so the
caller's cache (and scale) tensors are written in place.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch

from ..cache import cache_attention
from ._utils import _BF16, _from_np, _np
from .flash_attn_interface import _softcap, _window
from .functional import _check_scale

_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)
_CACHE_DTYPES_TEXT = ("torch.float32, torch.float16, torch.bfloat16 or "
                      "torch.int8 with its k_scales or v_scales (computed in "
                      "float32; k_cache and v_cache may differ among them), "
                      "or torch.float64 for both (computed in float64)")
_SCALE_DTYPES = (torch.float32, torch.float16)


def _int_tensor(name: str, x: Any, shape: tuple[int, ...] | None,
                ndim: int) -> torch.Tensor:
    """An integer CPU tensor of ``ndim`` axes (and ``shape`` if given)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got "
                        f"{type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or (
            x.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor (torch.int32 as "
                        f"flash_attn's), got dtype {x.dtype}")
    if x.ndim != ndim or (shape is not None and tuple(x.shape) != shape):
        raise ValueError(f"{name} must have shape "
                         f"{shape if shape is not None else f'{ndim}-D'}, "
                         f"got {tuple(x.shape)}")
    return x


def _cache_vector(name: str, x: Any, shapes: list[tuple[int, ...]],
                  heads: int, dtype: torch.dtype) -> np.ndarray | None:
    """alibi_slopes or sinks as a NumPy array in the compute dtype (a
    small copy; the per-head values are not differentiated here)."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got "
                        f"{type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got dtype "
                        f"{x.dtype}")
    if tuple(x.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {want} (heads = {heads}), "
                         f"got {tuple(x.shape)}")
    return x.detach().to(dtype).numpy()


def _refuse_placement(name: str, t: torch.Tensor) -> None:
    """The error for a tensor that is not a dense CPU one."""
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a "
                        f"{'nested' if t.is_nested else t.layout} one")
    raise ValueError(f"attention_c.torch runs on the CPU only, but {name} "
                     f"is on device '{t.device}'; move the tensors (the "
                     f"caches too) with .cpu()")


def _check_tensors(named: list[tuple[str, Any]],
                   scales: list[tuple[str, Any]],
                   unsupported: list[tuple[str, Any]],
                   others: list[tuple[str, Any]]) -> None:
    """The arguments that must be tensors are, dense and on the CPU, none
    requiring grad where grad is enabled; the unsupported ones None."""
    for name, t in named[:3]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
    for name, t in named[3:]:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got "
                            f"{type(t).__name__}")
    if (named[3][1] is None) != (named[4][1] is None):
        raise ValueError("k and v must be given together (the new keys "
                         "and values to append), or both be None")
    for name, x in unsupported:
        if x is not None:
            raise NotImplementedError(
                f"flash_attn_with_kvcache: {name} is not supported on the "
                f"CPU (attention_c); apply the rotary embedding to q and k "
                f"before the call, and keep each cache left-aligned")
    for name, t in scales:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got "
                            f"{type(t).__name__}")
    tensors = [(n, t) for n, t in named + others + scales
               if isinstance(t, torch.Tensor)]
    # One pass of the cheapest attributes: a decode step runs this once a
    # layer and token, its Python cold after the kernel swept the caches.
    grad = False
    for name, t in tensors:
        if not t.is_cpu or t.layout != torch.strided or t.is_nested:
            _refuse_placement(name, t)
        grad = grad or t.requires_grad
    if grad and torch.is_grad_enabled():
        needs = ", ".join(n for n, t in tensors if t.requires_grad)
        raise RuntimeError(
            f"flash_attn_with_kvcache is inference only (it has no "
            f"backward, as flash_attn's), but {needs} require(s) grad; call "
            f"it under torch.no_grad() or torch.inference_mode(), or use "
            f"flash_attn_func for a differentiable attention")


def _check_shapes(named: list[tuple[str, Any]]) -> tuple[int, int]:
    """q, the caches and k, v (named) of agreeing shapes: (B, heads)."""
    for name, t in named:
        if t is not None and t.ndim != 4:
            raise ValueError(f"{name} must be 4-D, got shape "
                             f"{tuple(t.shape)}")
    (_, q), (_, k_cache), (_, v_cache), (_, k), (_, v) = named
    B, Tq, heads, d = q.shape
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must have the same shape "
                         f"but for the last axis")
    heads_k = k_cache.shape[2]
    if heads_k == 0 or heads % heads_k:
        raise ValueError(f"the number of heads of k_cache and v_cache "
                         f"({heads_k}) must divide that of q ({heads})")
    if k_cache.shape[-1] != d:
        raise ValueError(f"q {tuple(q.shape)} and k_cache "
                         f"{tuple(k_cache.shape)} must have the same head "
                         f"size")
    if k is not None and v is not None:
        Tn = k.shape[1]
        for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
            want = (B, Tn, heads_k, cache.shape[-1])
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape (B, Tn, heads_k, "
                                 f"{'d' if name == 'k' else 'dv'}) = {want} "
                                 f"(q {tuple(q.shape)}, {name}_cache "
                                 f"{tuple(cache.shape)}), got "
                                 f"{tuple(t.shape)}")
    return B, heads


def _check_dtypes(named: list[tuple[str, Any]],
                  scales: list[tuple[str, Any]]) -> bool:
    """The dtypes, in torch's names (the NumPy call would name NumPy's),
    and the caches' (and scales') contiguous last axes; whether the call
    computes in float64."""
    for name, t in named:
        if t is None:
            continue
        cache = name.endswith("_cache")
        if t.dtype not in (_CACHE_DTYPES if cache else _CACHE_DTYPES[:3]
                           ) + (torch.float64,):
            if cache:
                raise TypeError(f"{name} has dtype {t.dtype}; "
                                f"flash_attn_with_kvcache takes caches of "
                                f"{_CACHE_DTYPES_TEXT}")
            raise TypeError(f"{name} has dtype {t.dtype}; expected a "
                            f"floating dtype")
        if t.dtype == torch.bfloat16 and _BF16 is None:
            raise TypeError(f"{name} is bfloat16, which needs the ml_dtypes "
                            f"package (pip install ml_dtypes)")
    q, k_cache, v_cache = (t for _, t in named[:3])
    for (name, t), cache_name, cache in zip(scales, ("k_cache", "v_cache"),
                                            (k_cache, v_cache)):
        if cache.dtype != torch.int8:
            if t is not None:
                raise ValueError(f"{name} goes with an int8 {cache_name}; "
                                 f"{cache_name} is {cache.dtype}")
        elif t is None:
            raise TypeError(f"{cache_name} is int8: it needs {name} (its "
                            f"float32 or float16 scales, as "
                            f"attention_c.quantize_kv makes them)")
        elif t.dtype not in _SCALE_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; the scales of an "
                            f"int8 cache are torch.float32 or torch.float16")
    wide = k_cache.dtype == torch.float64
    if wide != (v_cache.dtype == torch.float64):
        raise TypeError(f"k_cache has dtype {k_cache.dtype} and v_cache "
                        f"{v_cache.dtype}; caches are {_CACHE_DTYPES_TEXT}")
    if not wide and q.dtype == torch.float64:
        raise TypeError(f"q is float64 but the caches are {k_cache.dtype} "
                        f"and {v_cache.dtype} (computed in float32): convert "
                        f"q to torch.float32 (or a 16-bit cache's dtype), "
                        f"which loses nothing the computation would keep")
    for name, t in [("k_cache", k_cache), ("v_cache", v_cache)] + scales:
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last axis "
                             f"(stride 1), got strides {t.stride()}: the "
                             f"cache is read and written where it is, never "
                             f"copied")
    return wide


def _table(B: int, k_cache: torch.Tensor, cache_batch_idx: Any,
           block_table: Any) -> np.ndarray | None:
    """The block table cache_attention takes: block_table's entries, or
    cache_batch_idx's as a table of one block of S_max rows a sequence;
    None for a contiguous cache of B sequences."""
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError("cache_batch_idx cannot be used with "
                             "block_table (as flash_attn)")
        idx = _int_tensor("cache_batch_idx", cache_batch_idx, (B,), 1)
        # A contiguous cache (B_cache, S_max, ...) is a paged one of
        # B_cache blocks of S_max rows: sequence b is block idx[b].
        table = idx.reshape(B, 1).numpy()
        bad = (table < 0) | (table >= k_cache.shape[0])
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(f"cache_batch_idx[{b}] = {int(table[b, 0])} is "
                             f"out of range: k_cache has "
                             f"{k_cache.shape[0]} sequences")
        return table
    if block_table is not None:
        _int_tensor("block_table", block_table, None, 2)
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must have shape (B, max_blocks) "
                             f"with B = {B} (q's batch size), got "
                             f"{tuple(block_table.shape)}")
        return block_table.numpy()
    if k_cache.shape[0] != B:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} must have q's "
                         f"batch size {B} (or give cache_batch_idx or "
                         f"block_table)")
    return None


def _seqlens(B: int, k_cache: torch.Tensor, k: Any, cache_seqlens: Any,
             paged: bool) -> np.ndarray:
    """cache_seqlens as an integer array (B,): None for full caches."""
    if cache_seqlens is None:
        if paged:
            raise ValueError("cache_seqlens is required with block_table "
                             "(the number of positions filled in each "
                             "sequence's pages)")
        if k is not None:
            raise ValueError("cache_seqlens is None, which means every cache "
                             "is full (S_max positions): there is no room to "
                             "write k and v; give cache_seqlens")
        return np.full(B, k_cache.shape[1], dtype=np.int64)
    if isinstance(cache_seqlens, torch.Tensor):
        # (an integer tensor never requires grad: no detach)
        return _int_tensor("cache_seqlens", cache_seqlens, (B,), 1).numpy()
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(
            cache_seqlens, (bool, np.bool_)):
        n = int(cache_seqlens)
        if n < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {n}")
        return np.full(B, n, dtype=np.int64)
    raise TypeError(f"cache_seqlens must be an int or an integer "
                    f"torch.Tensor (B,), got "
                    f"{type(cache_seqlens).__name__}")


def _check_options(causal: Any, return_softmax_lse: Any, num_splits: Any,
                   softmax_scale: Any) -> float | None:
    """The flags' and num_splits' types; softmax_scale as a float."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got "
                        f"{type(causal).__name__}")
    if not isinstance(return_softmax_lse, bool):
        raise TypeError(f"return_softmax_lse must be a bool, got "
                        f"{type(return_softmax_lse).__name__}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int, got "
                        f"{type(num_splits).__name__}")
    _check_scale(softmax_scale, "softmax_scale")
    if softmax_scale is None:
        return None
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got "
                         f"{softmax_scale}")
    return softmax_scale


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor,
                            k: torch.Tensor | None = None,
                            v: torch.Tensor | None = None,
                            rotary_cos: torch.Tensor | None = None,
                            rotary_sin: torch.Tensor | None = None,
                            cache_seqlens: int | torch.Tensor | None = None,
                            cache_batch_idx: torch.Tensor | None = None,
                            cache_leftpad: torch.Tensor | None = None,
                            block_table: torch.Tensor | None = None,
                            softmax_scale: float | None = None,
                            causal: bool = False,
                            window_size: tuple[int, int] = (-1, -1),
                            softcap: float = 0.0,
                            rotary_interleaved: bool = True,
                            alibi_slopes: torch.Tensor | None = None,
                            num_splits: int = 0,
                            return_softmax_lse: bool = False, *,
                            sinks: torch.Tensor | None = None,
                            k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None) -> Any:
    """FlashAttention-2's ``flash_attn_with_kvcache`` on CPU tensors:
    decoding with a key-value cache, written in place (inference only).

    If ``k`` and ``v`` are given, they are written into ``k_cache`` and
    ``v_cache`` (the caller's tensors, in place) at positions
    ``cache_seqlens[b]`` to ``cache_seqlens[b] + Tn - 1`` of sequence b,
    then q attends to the ``cache_seqlens[b] + Tn`` first positions.
    ``cache_seqlens`` itself is not modified (as flash_attn).

    Parameters
    ----------
    q : Tensor (B, Tq, heads, d)
        Query i of sequence b sits at position ``N_b - Tq + i`` (N_b the
        keys attended): causal, the window and ALiBi are aligned
        bottom-right, as flash_attn's.
    k_cache, v_cache : Tensor (B_cache, S_max, heads_k, d) and (..., dv)
        or, paged (with ``block_table``), (num_blocks, block_size,
        heads_k, d) and (..., dv).  heads_k divides heads.  float32,
        float16, bfloat16 or int8 with its scales (computed in float32;
        keys and values may differ), or both float64; a contiguous last
        axis (any other strides).  Read, and written, where they are.
    k, v : Tensor (B, Tn, heads_k, d) and (B, Tn, heads_k, dv), optional
        New keys and values, given together; cast to the caches' dtypes
        (rounded to nearest even), or into an int8 cache quantized as
        :func:`attention_c.quantize_kv` does, the scales written into
        ``k_scales`` (``v_scales``) in place.
    rotary_cos, rotary_sin, cache_leftpad
        Not supported: must be None (NotImplementedError).  Apply the
        rotary embedding to q and k before the call.
    cache_seqlens : int or integer Tensor (B,), optional
        The positions already filled in each sequence's cache.  None: every
        cache is full (S_max keys; contiguous caches, no ``k``).
    cache_batch_idx : integer Tensor (B,), optional
        Sequence b uses ``k_cache[cache_batch_idx[b]]`` (contiguous caches
        only).
    block_table : integer Tensor (B, max_blocks), optional
        Paged cache: position t of sequence b is row ``t % block_size`` of
        block ``block_table[b, t // block_size]``.
    softmax_scale : float, optional
        Default ``1/sqrt(d)``.
    causal : bool
        Query i sees key t iff ``t <= N_b - Tq + i``.
    window_size : (int, int)
        (left, right) around the query's position; -1 an unbounded side.
    softcap : float
        c > 0: scores ``c tanh(s / c)``; 0.0 off.
    rotary_interleaved : bool
        Accepted (no rotary embedding here).
    alibi_slopes : Tensor (heads,) or (B, heads), optional
        Adds ``-slope |p - t|`` to the scores.
    num_splits : int
        Accepted, not read (the kernel splits the work itself and is
        deterministic for any thread count).
    return_softmax_lse : bool
        Also return the log-sum-exp.
    sinks : Tensor (heads,), optional
        Keyword-only: one logit a head in every softmax denominator, with
        no value (gpt-oss's attention sinks).
    k_scales, v_scales : Tensor, optional
        Keyword-only, with an int8 ``k_cache`` (``v_cache``) and only
        then: its scales, float32 or float16, shaped as the cache with
        ng groups in the last axis ((B_cache, S_max, heads_k, ng) or
        paged (num_blocks, block_size, heads_k, ng)), d / ng >= 8.  The
        cache holds :func:`attention_c.dequantize_kv` of the two (one
        float32 scale a group of d / ng elements), and the result is
        bitwise that of the call on that float32 cache.  Read, and
        written, where they are.

    Returns
    -------
    out : Tensor (B, Tq, heads, dv)
        In q's dtype; 0 for a query that sees no key.  With
        ``return_softmax_lse``: ``(out, softmax_lse)``, softmax_lse
        (B, heads, Tq) in float32 (float64 with float64 caches), -inf for
        a query that sees no key (the sink's logit with sinks).
    """
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
             ("k", k), ("v", v)]
    scales = [("k_scales", k_scales), ("v_scales", v_scales)]
    _check_tensors(named, scales, [
        ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
        ("cache_leftpad", cache_leftpad)], [
        ("cache_seqlens", cache_seqlens),
        ("cache_batch_idx", cache_batch_idx), ("block_table", block_table),
        ("alibi_slopes", alibi_slopes), ("sinks", sinks)])
    B, heads = _check_shapes(named)
    wide = _check_dtypes(named, scales)
    table = _table(B, k_cache, cache_batch_idx, block_table)
    seqlens = _seqlens(B, k_cache, k, cache_seqlens, block_table is not None)
    softmax_scale = _check_options(causal, return_softmax_lse, num_splits,
                                   softmax_scale)
    win, cap = _window(window_size), _softcap(softcap)
    compute = torch.float64 if wide else torch.float32
    slopes = _cache_vector("alibi_slopes", alibi_slopes,
                           [(heads,), (B, heads)], heads, compute)
    sink = _cache_vector("sinks", sinks, [(heads,)], heads, compute)

    out, lse = cache_attention(     # (the kernel computes lse anyway)
        _np(q), _np(k_cache), _np(v_cache), seqlens,
        k=None if k is None else _np(k), v=None if v is None else _np(v),
        block_table=table, scale=softmax_scale, causal=causal, window=win,
        softcap=cap, alibi_slopes=slopes, sinks=sink, return_lse=True,
        k_scales=None if k_scales is None else _np(k_scales),
        v_scales=None if v_scales is None else _np(v_scales))
    if k is not None:
        # Written behind autograd's back: a graph that saved a cache (some
        # earlier differentiable use) must see it modified, as with copy_.
        for t in (k_cache, v_cache, k_scales, v_scales):
            if t is not None:
                torch.autograd.graph.increment_version(t)
    # (out is a new contiguous array: cache_attention allocates it)
    if not return_softmax_lse:
        return _from_np(out)
    # NumPy's lse is (B, Tq, heads); flash_attn's (B, heads, Tq)
    return _from_np(out), _from_np(lse).transpose(1, 2).contiguous()
