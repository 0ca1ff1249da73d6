"""FlashAttention-2's functions on the CPU: ``flash_attn_func``,
``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` with the
signatures, layouts, defaults and returns of
``flash_attn.flash_attn_interface``, on attention_c's C kernels.  Code
written for flash_attn runs on the CPU by changing the import::

    # from flash_attn import flash_attn_func, flash_attn_varlen_func
    from attention_c.torch import flash_attn_func, flash_attn_varlen_func

Layouts: q (B, Tq, heads, d), k and v (B, T, heads_k, d); varlen: packed
q (total_q, heads, d), k and v (total_k, heads_k, d) with cu_seqlens.
heads_k may divide heads (grouped-query and multi-query attention: query
head h uses key head h // (heads / heads_k)).  The kernel reads q, k and v
where they are, as strided views ((B, Tq, heads, d) seen as (B, heads_k,
G, Tq, d)); nothing is transposed into a copy, and K, V are never
repeated.  float32 and float64 are computed natively, bfloat16 and
float16 in float32 (the lse comes back in float32, as FlashAttention's).

Semantics (docs/contract.md section 8), FlashAttention's: causal and the
window are aligned bottom-right (query i sits at key position i + T - Tq);
``window_size=(left, right)``, -1 an unbounded side; ``softcap=0.0`` off;
``alibi_slopes`` (heads,) or (B, heads) adds ``-slope |i + T - Tq - t|``
(varlen: B the number of sequences); a query that sees no key gives 0.
Beyond FlashAttention-2: ``sinks`` (heads,) or (B, heads) (varlen:
(heads,)), one logit a head in every softmax denominator (gpt-oss's
attention sinks).

Differences: ``deterministic`` is accepted and changes nothing (the
kernels are deterministic, bitwise, for any thread count); the dropout's
keep bits are attention_c's counter-based ones, seeded from torch's
default generator; ``max_seqlen_q`` and ``max_seqlen_k`` are accepted and
not read; with ``return_attn_probs=True`` the probabilities are the exact
weights (before dropout, not differentiable) and the lse is -inf (not
+inf) for a query that sees no key.

``flash_attn_with_kvcache`` (decoding, inference only) is
:func:`attention_c.cache_attention` on NumPy views of the tensors: the new
keys and values are written into the caller's ``k_cache`` and ``v_cache``
where they are (contiguous or paged with ``block_table``; never copied),
then the queries attend to the cache.  Beyond FlashAttention-2: int8
caches with their scales (keyword-only ``k_scales``, ``v_scales``), new
keys and values quantized into both in place.  ``cache_batch_idx`` is
supported;
the rotary embedding (``rotary_cos``, ``rotary_sin``) and
``cache_leftpad`` are not (NotImplementedError).
"""

from __future__ import annotations

from typing import Any

import torch

from ._utils import _LOW, _reads_as_stored
from .functional import dot_attention

__all__ = ["flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache"]


def _window(window_size: Any) -> tuple[int | None, int | None] | None:
    """FlashAttention's (left, right), -1 unbounded, as the functions'
    window (None unbounded), or None for (-1, -1)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of "
                         f"ints, -1 for an unbounded side, got "
                         f"{window_size!r}") from None
    sides = []
    for name, w in (("left", left), ("right", right)):
        if isinstance(w, torch.Tensor) and w.ndim == 0 and (
                not w.dtype.is_floating_point):
            w = int(w)
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"window_size {name} side must be an int (-1: "
                            f"unbounded), got {w!r}")
        if w < -1:
            raise ValueError(f"window_size {name} side must be >= 0, or -1 "
                             f"for unbounded, got {w}")
        sides.append(None if w == -1 else w)
    if sides == [None, None]:
        return None
    return sides[0], sides[1]


def _softcap(softcap: Any) -> float | None:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0: off), got "
                        f"{type(softcap).__name__}")
    if not softcap >= 0 or softcap == float("inf"):
        raise ValueError(f"softcap must be >= 0 (0.0: off), got {softcap!r}")
    return float(softcap) if softcap > 0 else None


def _per_head(name: str, x: torch.Tensor | None, B: int | None,
              heads: int, heads_k: int, what: str = ""
              ) -> torch.Tensor | None:
    """alibi_slopes or sinks, (heads,) or (B, heads), laid out for the
    leading axes of the call: (heads_k, G) or (B, heads_k, G) views with
    grouped queries, as they are without.  ``B`` None: only (heads,) is
    accepted (varlen's sinks; the kernel's leading axes are the heads).
    ``what``: B's meaning, for the message."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got "
                        f"{type(x).__name__}")
    shapes = [(heads,)] if B is None else [(heads,), (B, heads)]
    if tuple(x.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {want} (heads = "
                         f"{heads}{what}), got {tuple(x.shape)}"
                         + (" (varlen: one value a head; per-sequence "
                            "values are not supported)" if B is None
                            and x.ndim == 2 else ""))
    G = heads // heads_k
    return x.unflatten(-1, (heads_k, G)) if G > 1 else x


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           head_axis: int) -> tuple[int, int]:
    """(heads, heads_k), checked: k and v alike, heads a multiple."""
    hq, hk, hv = (t.shape[head_axis] for t in (q, k, v))
    if hk != hv or hk == 0 or hq % hk:
        raise ValueError(f"the number of heads of k and v must be equal and "
                         f"divide that of q: q has {hq}, k {hk}, v {hv}")
    return hq, hk


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ndim: int,
           layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
        if t.ndim != ndim:
            raise ValueError(f"{name} must be {layout}, got shape "
                             f"{tuple(t.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must "
                         f"have the same shape but for the last axis")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must "
                         f"have the same head size")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            dropout_p: float, softmax_scale: float | None, causal: bool,
            window_size: Any, softcap: Any, alibi_slopes: Any, sinks: Any,
            return_attn_probs: bool, cu: tuple[Any, Any]
            ) -> tuple[torch.Tensor, torch.Tensor,
                       torch.Tensor | None]:
    """The call on q (..., heads_k, G, Tq, d), k and v (..., heads_k, 1,
    T, d) views (G = 1: (..., heads, Tq, d) and (..., heads, T, d)):
    (out, lse, probs) in the same leading axes, lse in float32 at least,
    probs None unless asked for."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got "
                        f"{type(causal).__name__}")
    win, cap = _window(window_size), _softcap(softcap)
    low = q.dtype if q.dtype in _LOW else None
    if low is not None:
        # 16-bit q, k, v as they are (dot_attention computes in float32,
        # on the bf16 products for bfloat16, and returns the lse in
        # float32), unless NumPy cannot hold them (no ml_dtypes)
        if not all(_reads_as_stored(t) for t in (q, k, v)):
            q, k, v = q.float(), k.float(), v.float()
        alibi_slopes, sinks = (None if x is None else x.float()
                               for x in (alibi_slopes, sinks))
    if isinstance(dropout_p, bool) or not isinstance(dropout_p,
                                                     (int, float)):
        raise TypeError(f"dropout_p must be a float, got "
                        f"{type(dropout_p).__name__}")
    seed = (torch.randint(0, 2**63 - 1, (), dtype=torch.int64)
            if dropout_p > 0 else None)
    kw: dict[str, Any] = dict(
        values=v, causal=causal, scale=softmax_scale, window=win,
        softcap=cap, alibi_slopes=alibi_slopes, sinks=sinks,
        cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    out, lse = dot_attention(q, k, dropout=float(dropout_p), seed=seed,
                             return_weights=False, **kw)
    probs = None
    if return_attn_probs:           # a second call, for testing only
        with torch.no_grad():
            _, probs = dot_attention(q, k, return_weights=True, **kw)
    return out, lse, probs


def _merge(x: torch.Tensor | None, axis: int, grouped: bool
           ) -> torch.Tensor | None:
    """(..., heads_k, G, ...) as (..., heads, ...) at ``axis`` (the
    heads_k axis) when ``grouped``."""
    if x is None or not grouped:
        return x
    return x.flatten(axis, axis + 1)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    dropout_p: float = 0.0,
                    softmax_scale: float | None = None,
                    causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None,
                    deterministic: bool = False,
                    return_attn_probs: bool = False, *,
                    sinks: torch.Tensor | None = None) -> Any:
    """FlashAttention-2's ``flash_attn_func`` on CPU tensors,
    differentiable (q, k, v, alibi_slopes and sinks).

    Parameters
    ----------
    q : Tensor (B, Tq, heads, d)
    k, v : Tensor (B, T, heads_k, d) and (B, T, heads_k, dv)
        heads_k divides heads (grouped-query attention).  float32 or
        float64 (bfloat16, float16: computed in float32), on the CPU.
    dropout_p : float
        Dropout on the weights, applied whenever > 0 (pass 0.0 in
        evaluation, as with flash_attn).
    softmax_scale : float, optional
        Default ``1/sqrt(d)``.
    causal : bool
        Key t visible to query i iff ``t <= i + T - Tq`` (bottom-right).
    window_size : (int, int)
        (left, right): query i sees keys ``i + T - Tq - left`` to ``i + T
        - Tq + right``; -1 an unbounded side, (-1, -1) no window.
    softcap : float
        c > 0: scores ``c tanh(s / c)``; 0.0 off.
    alibi_slopes : Tensor (heads,) or (B, heads), optional
        Adds ``-slope |i + T - Tq - t|`` to the scores.
    deterministic : bool
        Accepted; the kernels are always deterministic.
    return_attn_probs : bool
        Also return the lse and the weights.
    sinks : Tensor (heads,) or (B, heads), optional
        Keyword-only: one logit a head in every softmax denominator, with
        no value (the weights then sum to less than 1).

    Returns
    -------
    out : Tensor (B, Tq, heads, dv)
        0 for a query that sees no key.  With ``return_attn_probs``:
        ``(out, softmax_lse, probs)``, softmax_lse (B, heads, Tq) (float32
        for bfloat16 and float16; the sink included; -inf for a query that
        sees no key) and probs (B, heads, Tq, T), the weights over the keys
        (before dropout, not differentiable).
    """
    _check(q, k, v, 4, "(batch, seqlen, heads, headdim)")
    B = q.shape[0]
    if k.shape[0] != B:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must "
                         f"have the same batch size")
    heads, heads_k = _heads(q, k, v, 2)
    G = heads // heads_k
    # (B, T, heads, d) seen as (B, heads_k, G, T, d), k and v as (B,
    # heads_k, 1, T, d): views, no copy.
    if G > 1:
        qv = q.unflatten(2, (heads_k, G)).permute(0, 2, 3, 1, 4)
        kv, vv = (x.permute(0, 2, 1, 3).unsqueeze(2) for x in (k, v))
    else:
        qv, kv, vv = (x.permute(0, 2, 1, 3) for x in (q, k, v))
    slopes = _per_head("alibi_slopes", alibi_slopes, B, heads, heads_k)
    sink = _per_head("sinks", sinks, B, heads, heads_k)
    out, lse, probs = _attend(qv, kv, vv, dropout_p, softmax_scale, causal,
                              window_size, softcap, slopes, sink,
                              return_attn_probs, (None, None))
    grouped = G > 1
    merged = _merge(out, 1, grouped)
    assert merged is not None
    out = merged.permute(0, 2, 1, 3).contiguous()   # (B, Tq, heads, dv)
    if q.dtype in _LOW:
        out = out.to(q.dtype)
    if not return_attn_probs:
        return out
    probs = _merge(probs, 1, grouped)
    if probs is not None and q.dtype in _LOW:
        probs = probs.to(q.dtype)
    return out, _merge(lse, 1, grouped), probs


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                           max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None,
                           causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None,
                           deterministic: bool = False,
                           return_attn_probs: bool = False, *,
                           sinks: torch.Tensor | None = None) -> Any:
    """FlashAttention-2's ``flash_attn_varlen_func`` on CPU tensors,
    differentiable: packed sequences of different lengths.

    Parameters
    ----------
    q : Tensor (total_q, heads, d)
        The queries of n sequences back to back, sequence s being rows
        ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``.
    k, v : Tensor (total_k, heads_k, d) and (total_k, heads_k, dv)
    cu_seqlens_q, cu_seqlens_k : Tensor (n + 1,) of torch.int32 or int64
        Non-decreasing from 0 to total_q (resp. total_k); a sequence may be
        empty.  Causal, window and ALiBi positions are taken within each
        sequence (bottom-right aligned there).
    max_seqlen_q, max_seqlen_k : int
        Accepted, not read (the kernel takes the lengths from cu_seqlens).
    alibi_slopes : Tensor (heads,) or (n, heads), optional
        One slope a head, or a sequence and head (n = ``len(cu_seqlens_q)
        - 1``, as flash_attn's (batch, heads)); differentiable in both
        forms.  The kernel takes one slope a head per call, so (n, heads)
        splits the call into runs of consecutive sequences that share
        their row (one call when all rows are equal); when the slopes
        require grad, each sequence has its own call (views of q, k and v,
        no copy), which is slower for many short sequences.  A sequence
        with no query or no key uses no slope (its gradient is 0).
    sinks : Tensor (heads,), optional
        One logit a head (the (B, heads) form of flash_attn_func is refused
        here).
    Others as :func:`flash_attn_func`.

    Returns
    -------
    out : Tensor (total_q, heads, dv)
        With ``return_attn_probs``: ``(out, softmax_lse, probs)``,
        softmax_lse (heads, total_q), probs (heads, total_q, total_k), the
        weights, block-diagonal: zero between different sequences.
    """
    _check(q, k, v, 3, "(total, heads, headdim)")
    for name, m in (("max_seqlen_q", max_seqlen_q),
                    ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt,
                                                     torch.Tensor)):
            raise TypeError(f"{name} must be an int, got "
                            f"{type(m).__name__}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q),
                     ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be an integer torch.Tensor, got "
                            f"{type(cu).__name__}")
    heads, heads_k = _heads(q, k, v, 1)
    G = heads // heads_k
    if G > 1:
        qv = q.unflatten(1, (heads_k, G)).permute(1, 2, 0, 3)
        kv, vv = (x.permute(1, 0, 2).unsqueeze(1) for x in (k, v))
    else:
        qv, kv, vv = (x.permute(1, 0, 2) for x in (q, k, v))
    sink = _per_head("sinks", sinks, None, heads, heads_k)
    if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.ndim == 2:
        # One slope a sequence and head: the kernel takes one slope per
        # leading index (a head), so the call is split into runs of
        # sequences that share their slopes (below).
        cq, ck = _segments(cu_seqlens_q, cu_seqlens_k, q.shape[0],
                           k.shape[0])
        n = len(cq) - 1
        _per_head("alibi_slopes", alibi_slopes, n, heads, heads_k,
                  f", {n} sequences (len(cu_seqlens_q) - 1)")
        out, lse, probs = _attend_runs(
            qv, kv, vv, cq, ck, (cu_seqlens_q, cu_seqlens_k), alibi_slopes,
            heads, heads_k, dropout_p, softmax_scale, causal, window_size,
            softcap, sink, return_attn_probs)
    else:
        slopes = _per_head("alibi_slopes", alibi_slopes, None, heads,
                           heads_k)
        out, lse, probs = _attend(qv, kv, vv, dropout_p, softmax_scale,
                                  causal, window_size, softcap, slopes,
                                  sink, return_attn_probs,
                                  (cu_seqlens_q, cu_seqlens_k))
    grouped = G > 1
    merged = _merge(out, 0, grouped)
    assert merged is not None
    out = merged.permute(1, 0, 2).contiguous()      # (total_q, heads, dv)
    if q.dtype in _LOW:
        out = out.to(q.dtype)
    if not return_attn_probs:
        return out
    probs = _merge(probs, 0, grouped)
    if probs is not None and q.dtype in _LOW:
        probs = probs.to(q.dtype)
    return out, _merge(lse, 0, grouped), probs


def _segments(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
              total_q: int, total_k: int) -> tuple[list[int], list[int]]:
    """cu_seqlens_q and cu_seqlens_k as lists, checked as the kernel
    checks them (for a call split by sequences, which reads them here)."""
    got = []
    for name, cu, end in (("cu_seqlens_q", cu_seqlens_q, total_q),
                          ("cu_seqlens_k", cu_seqlens_k, total_k)):
        if cu.dtype.is_floating_point or cu.dtype.is_complex or (
                cu.dtype == torch.bool):
            raise TypeError(f"{name} must be an integer tensor (torch.int32 "
                            f"or torch.int64), not {cu.dtype}")
        if cu.device.type != "cpu" or cu.ndim != 1:
            raise ValueError(f"{name} must be a 1-D CPU tensor (n + 1,), "
                             f"got shape {tuple(cu.shape)} on {cu.device}")
        x = [int(c) for c in cu.tolist()]
        why = ("needs two entries or more" if len(x) < 2
               else "must start at 0" if x[0] != 0
               else "must end at the length of its axis" if x[-1] != end
               else "must never decrease" if any(
                   b < a for a, b in zip(x, x[1:])) else None)
        if why is not None:
            raise ValueError(
                f"{name} {why} (the starts of the packed segments, then "
                f"the total {end}); got [{x[0] if x else 0}, ..., "
                f"{x[-1] if x else 0}] of {len(x)}")
        got.append(x)
    if len(got[0]) != len(got[1]):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same "
                         f"length (n + 1 for n sequences), got "
                         f"{len(got[0])} and {len(got[1])}")
    return got[0], got[1]


def _attend_runs(qv: torch.Tensor, kv: torch.Tensor, vv: torch.Tensor,
                 cq: list[int], ck: list[int], cu: tuple[Any, Any],
                 slopes: torch.Tensor, heads: int, heads_k: int,
                 dropout_p: float, softmax_scale: float | None,
                 causal: bool, window_size: Any, softcap: Any,
                 sink: torch.Tensor | None, return_attn_probs: bool
                 ) -> tuple[torch.Tensor, torch.Tensor,
                            torch.Tensor | None]:
    """:func:`_attend` of a packed call with ``slopes`` (n, heads), one
    row a sequence: one call per run of consecutive sequences that share
    a slope row, on views of q, k and v (no copy), the outputs joined.

    A sequence with no query or no key uses no slope (its row's gradient
    is 0) and joins the run before it.  Without a gradient wanted for
    ``slopes``, sequences whose rows are equal share a run (one call in
    all when every row is equal: the (heads,) call on that row); with
    one, each sequence that uses its row has its own call, which gives
    that row its gradient (the kernel sums a slope's gradient over all
    the queries of its call)."""
    n = len(cq) - 1
    used = [s for s in range(n) if cq[s + 1] > cq[s] and ck[s + 1] > ck[s]]
    if torch.is_grad_enabled() and slopes.requires_grad:
        new = [True] * (len(used) - 1)
    elif len(used) > 1:
        rows = slopes.detach()[torch.tensor(used)]
        new = (rows[1:] != rows[:-1]).any(1).tolist()
    else:
        new = []
    # runs (first sequence, row of its slopes): the first run starts at 0
    firsts = used[:1] + [s for s, b in zip(used[1:], new) if b]
    starts = [0] + firsts[1:]
    runs = [(a, b, r) for a, b, r in zip(starts, starts[1:] + [n],
                                         firsts or [0])]
    outs, lses, parts = [], [], []
    for a, b, row in runs:
        q0, q1, k0, k1 = cq[a], cq[b], ck[a], ck[b]
        whole = (a, b) == (0, n)
        run_cu = cu if whole else tuple(
            torch.tensor(c[a:b + 1], dtype=torch.int64) - c[a]
            for c in (cq, ck))
        out, lse, probs = _attend(
            qv[..., q0:q1, :], kv[..., k0:k1, :], vv[..., k0:k1, :],
            dropout_p, softmax_scale, causal, window_size, softcap,
            _per_head("alibi_slopes", slopes[row], None, heads, heads_k),
            sink, return_attn_probs, run_cu)
        if whole:
            return out, lse, probs
        outs.append(out)
        lses.append(lse)
        parts.append((q0, q1, k0, k1, probs))
    probs = None
    if return_attn_probs:
        first = parts[0][4]
        assert first is not None
        probs = first.new_zeros((*first.shape[:-2], cq[-1], ck[-1]))
        for q0, q1, k0, k1, p in parts:
            probs[..., q0:q1, k0:k1] = p
    return torch.cat(outs, -2), torch.cat(lses, -1), probs


# flash_attn_with_kvcache lives in _kvcache.py, which takes _window and
# _softcap from above: imported once they exist.
from ._kvcache import flash_attn_with_kvcache  # noqa: E402

for _name in __all__:
    torch.fx.wrap(_name)
del _name
