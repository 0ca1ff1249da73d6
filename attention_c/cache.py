"""Attention against a key/value cache, as a serving engine decodes.

``cache_attention`` is FlashAttention-2's ``flash_attn_with_kvcache`` for
NumPy: new queries of B sequences against their caches of keys and values,
contiguous (B, S_max, Hkv, d) or paged (num_blocks, block_size, Hkv, d)
with a block table, each sequence of its own length, new keys and values
written into the cache in place first.  The cache is read where it is, in
float32, float64, float16 or bfloat16 (ml_dtypes), never copied or
converted whole.  The arguments are checked here, every one before
anything is written; the C kernel (``_core._cache_attention``) reads the
cache.
"""

import math
import operator

import numpy as np

from . import _core  # type: ignore[attr-defined]

__all__ = ["cache_attention", "quantize_kv", "dequantize_kv"]

_CACHE_DTYPES = ("float32, float64, float16, bfloat16 (ml_dtypes) or int8 "
                 "(with its scales)")
_I8 = np.dtype(np.int8)
_F32, _F64, _F16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(
    np.float16)


def _is_bf16(dt):
    # ml_dtypes' bfloat16, known by name: ml_dtypes is an optional extra
    return dt.kind == "V" and dt.itemsize == 2 and dt.name == "bfloat16"


def _low(dt):
    return dt == _F16 or _is_bf16(dt)


def _real_array(name, x):
    a = np.asarray(x)
    if not (a.dtype.kind in "fiu" or _is_bf16(a.dtype)) or a.ndim < 1:
        raise TypeError(f"{name} must be a real array with a last axis, "
                        f"got dtype {a.dtype} and shape {a.shape}")
    return a


def _group_of(d, ng, what):
    if ng < 1 or d % ng or d // ng < 8:
        raise ValueError(f"{what}: the groups must divide d = {d} into "
                         f"groups of 8 elements or more, got {ng} "
                         f"group{'s' if ng != 1 else ''}")
    return d // ng


def quantize_kv(x, group=32, scale_dtype=np.float32):
    """Keys or values in int8 with one scale per group of ``group``
    consecutive elements of a row, as an int8 cache holds them.

    Per group (in float32): ``scale = max|x| / 127`` (0 for an all-zero
    group) and ``q = rint(x / scale)`` in [-127, 127] (round half to
    even; 0 where the scale is 0), so ``|x - scale q| <= scale / 2``.
    llama.cpp's q8_0 is ``group=32``.  float16 scales are that scale
    rounded up to a float16 (so no q passes 127 and the bound holds for
    the scale stored), q computed with it.

    Parameters
    ----------
    x : array_like, (..., d)
        Finite real values (any float dtype; computed in float32).
    group : int
        Elements per scale: at least 8, dividing d.
    scale_dtype : float32 or float16
        float16 scales take half the bytes but hold groups of max|x| up
        to 127 x 65504 (larger is refused), and a group far below 1
        (max|x| < 127 x 2^-14, about 0.0078) keeps fewer bits.

    Returns
    -------
    q : ndarray of int8, (..., d)
    scales : ndarray of scale_dtype, (..., d // group)
    """
    x = _real_array("x", x)
    if isinstance(group, (bool, np.bool_)):
        raise TypeError(f"group must be an int, got {group!r}")
    try:
        group = operator.index(group)
    except TypeError:
        raise TypeError(f"group must be an int, got {group!r}") from None
    d = x.shape[-1]
    if group < 8 or d % group:
        raise ValueError(f"group = {group} must be >= 8 and divide the last "
                         f"axis d = {d}")
    sdt = np.dtype(scale_dtype)
    if sdt not in (_F32, _F16):
        raise TypeError(f"scale_dtype must be float32 or float16, got "
                        f"{sdt}")
    return _quantize(x, group, "x", sdt)


def _quantize(x, group, name, sdt):
    """quantize_kv of the real array x into scales of dtype sdt, checked
    (its values named as `name`)."""
    d = x.shape[-1]
    with np.errstate(over="ignore"):    # beyond float32: refused below
        x32 = x.astype(_F32)
    if not np.isfinite(x32).all():
        raise ValueError(f"{name} has values that are not finite in "
                         f"float32: an int8 cache holds finite values only")
    xg = x32.reshape(x.shape[:-1] + (d // group, group))
    scales = np.max(np.abs(xg), axis=-1) / _F32.type(127)
    if sdt == _F16:
        with np.errstate(over="ignore"):        # refused just below
            s16 = scales.astype(_F16)
            s16 = np.where(s16.astype(_F32) < scales,
                           np.nextafter(s16, _F16.type(np.inf)), s16)
        if not np.isfinite(s16).all():
            raise ValueError(f"{name} has a group of max|x| = "
                             f"{float(np.abs(x32).max()):.6g}, beyond what "
                             f"float16 scales hold (127 x 65504 = 8.3e6)")
        scales = s16
    safe = np.where(scales > 0, scales, scales.dtype.type(1)).astype(_F32)
    q = np.clip(np.rint(xg / safe[..., None]), -127, 127)
    return q.astype(np.int8).reshape(x.shape), scales


def dequantize_kv(q, scales):
    """The float32 values an int8 cache holds: ``scales[..., c // g] *
    q[..., c]``, one float32 product each (g = d / scales.shape[-1]).

    Parameters
    ----------
    q : array_like of int8, (..., d)
    scales : array_like of float32 or float16, (..., d // g), g >= 8

    Returns
    -------
    ndarray of float32, (..., d)
    """
    q = np.asarray(q)
    scales = np.asarray(scales)
    if q.dtype != np.int8 or scales.dtype not in (_F32, _F16):
        raise TypeError(f"q must be int8 and scales float32 or float16, got "
                        f"{q.dtype} and {scales.dtype}")
    if q.ndim < 1 or scales.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"scales has shape {scales.shape}; expected q's "
                         f"leading axes {q.shape[:-1]} and a group axis")
    d, ng = q.shape[-1], scales.shape[-1]
    g = _group_of(d, ng, f"scales {scales.shape} for q {q.shape}")
    out = (scales.astype(_F32)[..., None] *
           q.astype(_F32).reshape(q.shape[:-1] + (ng, g)))
    return out.reshape(q.shape)


def _cache_dtype(name, x):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array (it is read where "
                        f"it is and written in place), got "
                        f"{type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have 4 axes, (B, S_max, Hkv, d) or "
                         f"paged (num_blocks, block_size, Hkv, d); got "
                         f"shape {x.shape}")
    dt = x.dtype
    if not (dt == _F32 or dt == _F64 or dt == _I8 or _low(dt)):
        raise TypeError(f"{name} has dtype {dt}; a cache is "
                        f"{_CACHE_DTYPES}")
    if x.size and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        raise ValueError(f"{name}'s last axis must be contiguous (stride "
                         f"{x.itemsize} bytes, got {x.strides[-1]}): the "
                         f"cache is read where it is, never copied")
    _aligned(name, x)
    return dt


def _aligned(name, x):
    """The kernel reads x's elements where they are: at an address and
    strides that are multiples of their size (NumPy's aligned flag says
    both; an array at an odd byte offset of a buffer is not)."""
    if x.size and not x.flags.aligned:
        raise ValueError(f"{name} is not aligned: its address and strides "
                         f"{x.strides} must be multiples of its "
                         f"{x.itemsize}-byte elements (it is read and "
                         f"written where it is, never copied)")


def _writable(name, x):
    if not x.flags.writeable:
        raise ValueError(f"{name} is read-only, but the new k and v are "
                         f"written into it in place")


def _scales(name, s, cache_name, cache):
    """An int8 cache's scales: (the cache's first three axes, ng) float32
    or float16, ng dividing its rows in groups of 8 or more; their group
    size.  None (and 0) with a float cache."""
    if cache.dtype != _I8:
        if s is not None:
            raise ValueError(f"{name} goes with an int8 {cache_name}; "
                             f"{cache_name} is {cache.dtype}")
        return 0
    if s is None:
        raise TypeError(f"{cache_name} is int8: it needs {name} (the "
                        f"float32 scales of quantize_kv)")
    if not isinstance(s, np.ndarray) or s.dtype not in (_F32, _F16):
        raise TypeError(f"{name} must be a float32 or float16 NumPy array "
                        f"(written in place with new keys and values), got "
                        f"{getattr(s, 'dtype', type(s).__name__)}")
    if s.ndim != 4 or s.shape[:3] != cache.shape[:3]:
        raise ValueError(f"{name} has shape {s.shape}; expected "
                         f"{cache.shape[:3]} + (groups,), as {cache_name} "
                         f"{cache.shape}")
    if s.size and s.shape[-1] > 1 and s.strides[-1] != s.itemsize:
        raise ValueError(f"{name}'s last axis must be contiguous")
    _aligned(name, s)
    return _group_of(cache.shape[-1], s.shape[-1], f"{name} {s.shape} for "
                     f"{cache_name} {cache.shape}")


def _ints(name, x, ndim):
    """x as a C-contiguous int64 array of ndim axes (a copy: the kernel
    reads these while the caller may change theirs)."""
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype "
                        f"{a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} "
                         f"ax{'is' if ndim == 1 else 'es'}, got shape "
                         f"{a.shape}")
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {a.max()}, beyond any cache")
    return np.array(a, dtype=np.int64, order="C")


def _window(window):
    if window is None:
        return -1, -1
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), a side "
                         f"None for unbounded, got {window!r}") from None
    sides = []
    for side, w in (("left", left), ("right", right)):
        if w is None:
            sides.append(-1)
            continue
        try:
            w = operator.index(w)
        except TypeError:
            raise TypeError(f"window's {side} side must be an int >= 0 or "
                            f"None, got {w!r}") from None
        if w < 0:
            raise ValueError(f"window's {side} side must be >= 0 or None, "
                             f"got {w}")
        sides.append(w)
    return tuple(sides)


def _number(name, x, positive):
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float, np.number)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or (positive and x <= 0):
        raise ValueError(f"{name} must be a finite number"
                         f"{' > 0' if positive else ''}, got {x}")
    return x


def _per_head(name, x, B, Hq, real, shapes):
    if x is None:
        return None
    a = np.asarray(x)
    if a.dtype.kind not in "fiu" or a.shape not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must be a real array of shape {want} "
                         f"(B = {B}, Hq = {Hq}), got dtype {a.dtype} and "
                         f"shape {a.shape}")
    return np.ascontiguousarray(a, dtype=real)


def _new_rows(name, x, like, B, Hkv, width):
    """k or v: (B, Tn, Hkv, width), real."""
    a = np.asarray(x)
    if a.dtype.kind not in "fiu" and not _is_bf16(a.dtype):
        raise TypeError(f"{name} has dtype {a.dtype}; new keys and values "
                        f"are real numbers")
    if a.ndim != 4 or a.shape[0] != B or a.shape[2] != Hkv or (
            a.shape[3] != width):
        raise ValueError(f"{name} must have shape (B, Tn, Hkv, {like}) = "
                         f"({B}, Tn, {Hkv}, {width}), got {a.shape}")
    return a


def _slots(lens, Tn, table, block):
    """(block index, row) of the Tn new positions of every sequence, each
    (B, Tn): where k and v are written."""
    pos = lens[:, None] + np.arange(Tn)[None, :]
    if table is None:
        return np.broadcast_to(np.arange(len(lens))[:, None], pos.shape), pos
    return np.take_along_axis(table, pos // block, axis=1), pos % block


def _check_table(table, B, lens, block, nblocks):
    """The entries of the blocks that hold keys, in range (the others
    are never read)."""
    if table.shape[0] != B:
        raise ValueError(f"block_table must have shape (B, max_blocks) "
                         f"with B = {B}, got {table.shape}")
    if table.size == 0 or table.view(np.uint64).max() < nblocks:
        return          # every entry in range (negative ones wrap high)
    used = np.arange(table.shape[1]) < (-(-lens // block))[:, None]
    bad = used & ((table < 0) | (table >= nblocks))
    if bad.any():
        b, k = np.argwhere(bad)[0]
        raise ValueError(f"block_table[{b}, {k}] = {int(table[b, k])} is "
                         f"out of range: the cache has {nblocks} blocks "
                         f"(sequence {b} holds {int(lens[b])} keys in "
                         f"blocks of {block})")


def _check_arrays(query, k_cache, v_cache, k_scales, v_scales):
    """The caches, their scales and the query, dtypes and shapes: (the
    query as an array, the computing dtype, the scales' groups)."""
    kd, vd = _cache_dtype("k_cache", k_cache), _cache_dtype("v_cache",
                                                            v_cache)
    if (kd == _F64) != (vd == _F64):
        raise TypeError(f"k_cache is {kd} and v_cache {vd}: float64 caches "
                        f"go together (a cache is never converted)")
    kg = _scales("k_scales", k_scales, "k_cache", k_cache)
    vg = _scales("v_scales", v_scales, "v_cache", v_cache)
    real = _F64 if kd == _F64 else _F32
    q = np.asarray(query)
    if q.ndim != 4:
        raise ValueError(f"query must have shape (B, Tq, Hq, d), got "
                         f"{q.shape}")
    qd = q.dtype
    if not (qd.kind == "f" or _is_bf16(qd)):
        raise TypeError(f"query has dtype {qd}; expected a floating "
                        f"dtype")
    if real == _F32 and not (qd == _F32 or _low(qd)):
        raise TypeError(f"query is {qd} but the caches are {kd} and {vd}: "
                        f"a float64 query needs float64 caches (the cache "
                        f"is read as it is stored, never converted)")
    B, Tq, Hq, d = q.shape
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache has shape {k_cache.shape}; its last axis "
                         f"must be query's d = {d}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache has shape {v_cache.shape}; its first "
                         f"three axes must be k_cache's {k_cache.shape[:3]}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"the caches have Hkv = {Hkv} heads, which must "
                         f"divide the query's Hq = {Hq}")
    if Tq < 1 or d < 1 or v_cache.shape[3] < 1:
        raise ValueError(f"query {q.shape} and v_cache {v_cache.shape} "
                         f"need Tq, d and dv >= 1")
    return q, real, kg, vg


def _capacity(block_table, k_cache, B, lens, Tn):
    """The table as int64 (or None), the lengths (with Tn new keys each)
    checked against the keys a sequence can hold."""
    nblocks, block = k_cache.shape[:2]
    table = None
    if block_table is not None:
        table = _ints("block_table", block_table, 2)
        capacity, where = table.shape[1] * block, (
            f"max_blocks x block_size = {table.shape[1]} x {block}")
    else:
        if nblocks < B:
            raise ValueError(f"k_cache has shape {k_cache.shape}: a "
                             f"contiguous cache needs a row for each of the "
                             f"B = {B} sequences (paged: give block_table)")
        capacity, where = block, f"S_max = {block}"
    # (the lengths as Python ints: a decode step runs this once a layer
    # and token, and NumPy's reductions cost more than the list, cold)
    have = lens.tolist()
    if have and (min(have) < 0 or max(have) + Tn > capacity):
        b = int(np.argmax((lens < 0) | (lens + Tn > capacity)))
        raise ValueError(f"cache_seqlens[{b}] = {int(lens[b])}"
                         f"{f' + {Tn} new' if Tn else ''} is out of range: "
                         f"a sequence holds 0 .. {capacity} keys ({where})")
    return table


def _append(pairs, slots):
    """k and v into their caches (and int8 caches' scales) at the slots
    (block index, row) of the new positions: every cache checked
    writeable and every int8 row quantized before anything is written."""
    writes = []
    for cache, scales, group, new, name in pairs:
        _writable(f"{name}_cache", cache)
        if group:
            _writable(f"{name}_scales", scales)
            new, s = _quantize(new, group, name, scales.dtype)
            writes.append((scales, s))
        writes.append((cache, new))
    blk, row = slots
    for dest, new in writes:
        dest[blk, row] = new


def cache_attention(query, k_cache, v_cache, cache_seqlens, *, k=None,
                    v=None, block_table=None, k_scales=None, v_scales=None,
                    scale=None, causal=True,
                    window=None, softcap=None, alibi_slopes=None,
                    sinks=None, return_lse=False):
    """Attention of new queries against a key/value cache, read in place.

    The NumPy form of FlashAttention-2's ``flash_attn_with_kvcache``:
    query (B, Tq, Hq, d) holds Tq >= 1 new queries of each of B sequences;
    sequence b has ``cache_seqlens[b]`` keys and values in the cache.

    Parameters
    ----------
    query : array_like, (B, Tq, Hq, d)
    k_cache, v_cache : ndarray
        Contiguous, (B, S_max, Hkv, d) and (B, S_max, Hkv, dv), or paged
        with ``block_table``, (num_blocks, block_size, Hkv, d) and (...,
        dv): position t of sequence b is row ``t % block_size`` of block
        ``block_table[b, t // block_size]``.  float32, float16, bfloat16
        (ml_dtypes; computed in float32, widened as loaded), int8 with
        scales (computed in float32, dequantized as loaded) or float64
        (both: computed in float64); keys and values may differ.  Any
        strides but a contiguous last axis: a cache is never copied.
        Query head h reads kv head ``h // (Hq // Hkv)`` (grouped query
        attention; Hkv must divide Hq).
    cache_seqlens : array_like of int, (B,)
        The keys each sequence has in the cache (before k and v).
    k, v : array_like, (B, Tn, Hkv, d) and (B, Tn, Hkv, dv), optional
        New keys and values, written into the caches in place at
        positions ``cache_seqlens[b] .. + Tn - 1`` (cast to the cache's
        dtype) before the attention; given together.  ``cache_seqlens``
        is not changed: the caller advances it.
    block_table : array_like of int, (B, max_blocks), optional
        The paged cache's blocks of each sequence; entries past a
        sequence's length are never read.
    k_scales, v_scales : ndarray, optional
        With an int8 cache, and only then: its scales, shaped as the
        cache with ng groups in the last axis (float32 or float16), as
        :func:`quantize_kv` makes them; the cache holds ``scale * q``
        (:func:`dequantize_kv`), and the result is bitwise the call on
        that float32 cache.  New keys and values are quantized in groups
        of d / ng into the cache and the scales, in place.
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(d)``.
    causal : bool
        Sequence b attends to N_b = cache_seqlens[b] (+ Tn) keys; query
        i is at position ``p = N_b - Tq + i`` (the queries are the last
        Tq positions) and, with causal (the default), sees the keys
        ``t <= p``.
    window : (int or None, int or None), optional
        ``(left, right)``: query i sees keys ``p - left <= t <= p +
        right``; a side of None is unbounded.
    softcap : float, optional
        c > 0: the score ``s`` becomes ``c tanh(s / c)``.
    alibi_slopes : array_like, (Hq,) or (B, Hq), optional
        ``-slope |p - t|`` added to the scores (after softcap).
    sinks : array_like, (Hq,), optional
        One more logit per head in the softmax's denominator, with no
        value (the weights then sum to less than 1).
    return_lse : bool
        Also return the log-sum-exp of each query's scores (the sink's
        included).

    Returns
    -------
    out : ndarray, (B, Tq, Hq, dv)
        In the query's dtype (16-bit: rounded once from float32).
    lse : ndarray, (B, Tq, Hq), float32 (float64 with float64 caches)
        Only with ``return_lse``.  A query that sees no key gets out 0
        and lse -inf (its sink's logit with sinks).

    Every argument is checked before anything is written.  Results are
    bitwise the same for any thread count, and a paged cache gives the
    bits of the contiguous one with the same contents.  Inference only:
    there is no backward.
    """
    q, real, kg, vg = _check_arrays(query, k_cache, v_cache, k_scales,
                                    v_scales)
    B, Tq, Hq, d = q.shape
    nblocks, block, Hkv = k_cache.shape[:3]
    dv = v_cache.shape[3]
    lens = np.asarray(cache_seqlens)
    if lens.ndim == 0:
        lens = np.full(B, lens)
    lens = _ints("cache_seqlens", lens, 1)
    if lens.shape != (B,):
        raise ValueError(f"cache_seqlens must have shape (B,) = ({B},), "
                         f"got {lens.shape}")
    if (k is None) != (v is None):
        raise ValueError("k and v go together: new keys need their values")
    Tn = 0
    if k is not None:
        k = _new_rows("k", k, "d", B, Hkv, d)
        v = _new_rows("v", v, "dv", B, Hkv, dv)
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k has {k.shape[1]} new positions and v "
                             f"{v.shape[1]}: they must agree")
        Tn = k.shape[1]
    table = _capacity(block_table, k_cache, B, lens, Tn)
    total = lens + Tn if Tn else lens
    if table is not None:
        _check_table(table, B, total, block, nblocks)
    wl, wr = _window(window)
    if scale is None:
        scale = 1 / math.sqrt(d)
    scale = _number("scale", scale, False)
    cap = _number("softcap", softcap, True)
    slopes = _per_head("alibi_slopes", alibi_slopes, B, Hq, real,
                       [(Hq,), (B, Hq)])
    if slopes is not None:
        slopes = slopes.reshape(-1, Hq)
    sink = _per_head("sinks", sinks, B, Hq, real, [(Hq,)])
    qc = q if (q.dtype == real and q.strides[-1] == q.itemsize
               and q.flags.aligned) else np.array(q, dtype=real, order="C")
    if Tn:
        _append(((k_cache, k_scales, kg, k, "k"),
                 (v_cache, v_scales, vg, v, "v")),
                _slots(lens, Tn, table, block))
    out = np.empty((B, Tq, Hq, dv), real)
    lse = np.empty((B, Tq, Hq), real)
    _core._cache_attention(qc, k_cache, v_cache, total, table,
                           k_scales, v_scales, scale,
                           bool(causal), wl, wr, cap or 0.0, slopes, sink,
                           out, lse)
    qd = q.dtype
    if qd != real:                      # rounded once, to the query's
        out = out.astype(qd)
    return (out, lse) if return_lse else out
