"""Dask adapter: attention_c's layers on Dask arrays, chunk by chunk.

Imported only on demand (``import attention_c.dask``), so Dask stays an
optional dependency (``pip install "attention_c[dask]"``).  Every function
has the name and the arguments of its in-memory counterpart in
:mod:`attention_c`, takes Dask arrays (or array-likes) and returns Dask
arrays; nothing is computed until you call ``.compute()``::

    import dask.array as da
    import attention_c.dask as acd
    h = da.from_npy_stack("states/")          # (B, T, H), chunked along B
    out, alpha = acd.context_attention(h, W, v, b=b, mask=mask)
    out.compute()

The arguments are those of the in-memory functions, in the same order:
the data and the weights without a default by position, everything
optional by keyword only (a positional one raises a TypeError that says
so).

How the work is split:

- **Chunks along the leading (batch) axes only.**  Each sequence is
  computed whole, so every task runs the in-memory C function on one chunk
  of the batch.  An input chunked along any other axis (T, H, ...) is
  rechunked to one chunk along those axes, with a
  ``dask.array.PerformanceWarning`` that names it: chunk along the batch.
  Inputs of one call that are chunked differently along the batch are
  rechunked to the chunks of ``h`` (``keys`` in the family).  Array-likes
  that are not Dask arrays are split like ``h`` (``keys``).
- **Weights are one graph key each**, not one copy per chunk: every task
  of a call depends on the same key, so a distributed scheduler sends a
  weight to each worker once, and recomputes it (it is part of the graph)
  if the worker holding it dies.  The forward and the backward of the same
  weights share the key.
- **Masks** are data: chunked like the batch.  A family mask may have
  leading axes of size 1, which broadcast over the batch as in memory.
- **Parameter gradients** (``W``, ``v``, ``b``) are summed over the
  chunks by a tree of fixed shape: groups of 4 consecutive chunks (in C
  order of the chunk grid), each summed left to right, then groups of
  those, up to one.  The result depends only on the chunks, never on the
  scheduler or the order in which tasks finish: the same chunks give the
  same bits on every run.  It equals the in-memory call's within rounding
  (which sums the batch in another order); with a single chunk, exactly.
- Outputs and input gradients are computed per sequence by the same C
  code as in memory: bitwise equal to the in-memory call's.

Shapes and dtypes are checked when the graph is built, by the in-memory
function itself on empty stand-ins of the inputs (each batch axis of length
0), so bad input raises the in-memory function's ``ValueError`` or
``TypeError`` at once, not at compute time.  At least one leading batch
axis is needed; for a single sequence, call :mod:`attention_c` directly.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from operator import getitem
from types import FrameType
from typing import Any, Literal, NamedTuple, TypeAlias, overload

import numpy as np
import numpy.typing as npt

try:
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
except ImportError as _missing:     # tested in a subprocess
    raise ImportError(
        "attention_c.dask needs Dask: pip install \"attention_c[dask]\" "
        "(or pip install \"dask[array]>=2024.1\")") from _missing

import attention_c as _ac
from attention_c._keywords import keyword_only

__all__ = ["context_attention", "context_attention_backward",
           "additive_attention", "additive_attention_backward",
           "dot_attention", "dot_attention_backward",
           "general_attention", "general_attention_backward",
           "project_keys", "project_keys_backward",
           "AttentionGrads", "AdditiveAttentionGrads", "DotAttentionGrads",
           "GeneralAttentionGrads"]

# A Dask array or anything np.asarray accepts.
_Input: TypeAlias = da.Array | npt.ArrayLike

# Chunks summed per node of the parameter gradients' reduction tree.
FAN_IN = 4


class AttentionGrads(NamedTuple):
    """Gradients of :func:`context_attention_backward`, as Dask arrays:
    ``h`` (..., T, H) chunked like ``h``; ``W``, ``v``, ``b`` summed over
    the batch (one chunk each; ``b`` is None without a bias)."""

    h: da.Array
    W: da.Array
    v: da.Array
    b: da.Array | None


class AdditiveAttentionGrads(NamedTuple):
    """Gradients of :func:`additive_attention_backward`, as Dask arrays
    (``values`` None when no values were given, ``b`` without a bias)."""

    query: da.Array
    keys: da.Array
    values: da.Array | None
    W: da.Array
    v: da.Array
    b: da.Array | None


class DotAttentionGrads(NamedTuple):
    """Gradients of :func:`dot_attention_backward`, as Dask arrays
    (``values`` None when no values were given, ``bias`` without a
    bias)."""

    query: da.Array
    keys: da.Array
    values: da.Array | None
    bias: da.Array | None


class GeneralAttentionGrads(NamedTuple):
    """Gradients of :func:`general_attention_backward`, as Dask arrays
    (``bias`` None without a bias)."""

    query: da.Array
    keys: da.Array
    values: da.Array | None
    W: da.Array
    bias: da.Array | None


# --------------------------------------------------------------------------
# The machinery: one task per chunk of the batch, running the in-memory
# function on that chunk; its results split into one Dask array each.


def _flat(result: Any) -> tuple[Any, ...]:
    """The in-memory function's results as one flat tuple: a single
    array, ``(out, alpha[, act])``, a gradient tuple, or ``(grads,
    grad_key_proj)``."""
    if isinstance(result, np.ndarray):
        return (result,)
    flat: list[Any] = []
    for x in result:
        flat.extend(x if isinstance(x, tuple) else (x,))
    return tuple(flat)


def _chunk(fn: Callable[..., Any], names: tuple[str, ...],
           literals: dict[str, Any], *arrays: np.ndarray) -> tuple[Any, ...]:
    """One task: the in-memory function on one chunk of the batch."""
    return _flat(fn(**dict(zip(names, arrays)), **literals))


def _sum(*parts: np.ndarray) -> np.ndarray:
    """Left to right, so that the result depends on the order only."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _batch_error(name: str, shape: tuple[int, ...], ref: str,
                 ref_shape: tuple[int, ...],
                 lead: tuple[int, ...]) -> ValueError:
    return ValueError(
        f"{name} has shape {shape}; expected the leading (batch) axes "
        f"{lead} in front (those of {ref} with shape {ref_shape} and the "
        f"other arguments), or 1 or fewer axes where the in-memory "
        f"function broadcasts")


def _apply(fn: Callable[..., Any], ref: str, data: dict[str, Any],
           weights: dict[str, Any], literals: dict[str, Any],
           fields: Sequence[str], follows: Sequence[str | None],
           cores: dict[str, int]) -> list[Any]:
    """Run ``fn`` chunk by chunk over the batch.

    ``data`` are the batched arguments (None: absent); ``cores[name]`` is
    the number of trailing axes of each that are not batch axes (2 for
    keys (..., T, H), 1 for a key mask (..., T), ...): the axes in front
    are its batch axes, right-aligned with the others' as NumPy
    broadcasts them, and it may have fewer (or size-1) ones, which it
    shares along the batch.  ``ref`` is the argument whose chunks set
    the batch's (``h`` or ``keys``).  ``weights`` are shared by the
    whole batch (one graph key each); ``literals`` go to every call as
    they are.  ``fields`` name the flat results of ``fn``; ``follows``
    says for each how it is laid out: ``""`` along the whole batch (an
    output), the name of a ``data`` argument whose shape it has (its
    gradient: summed over the chunks along which that argument is
    shared), or None (a parameter gradient, summed over every chunk).
    Returns one Dask array per result of ``fn`` (None where it gave None).
    """
    arrays: dict[str, Any] = {
        n: x if isinstance(x, da.Array) else np.asarray(x)
        for n, x in data.items() if x is not None}
    for n, x in arrays.items():
        if any(isinstance(s, float) and math.isnan(s) for s in x.shape):
            raise ValueError(f"{n} has unknown chunk sizes {x.chunks}; call "
                             f"{n}.compute_chunk_sizes() first")
    # Batch axes of each argument; one with fewer axes than its core
    # (bad input) is given whole to the in-memory check below.
    nb = {n: max(x.ndim - cores[n], 0) for n, x in arrays.items()}
    nlead = max(nb.values())
    ref_shape = tuple(arrays[ref].shape)
    if nlead < 1:
        raise ValueError(
            f"{ref} has shape {ref_shape}; attention_c.dask splits the "
            f"leading (batch) axes, so it needs (B, ..., T, H); for one "
            f"sequence call attention_c.{fn.__name__} directly")
    lead_list = [1] * nlead
    for n in (ref, *arrays):
        x = arrays[n]
        for j in range(nb[n]):
            i, s = nlead - nb[n] + j, x.shape[j]
            if lead_list[i] == 1:
                lead_list[i] = s
    lead = tuple(lead_list)
    shared: dict[str, Any] = {
        n: w if isinstance(w, da.Array) else np.asarray(w)
        for n, w in weights.items() if w is not None}
    weight_stand_ins = {n: np.zeros(w.shape, w.dtype) if isinstance(
        w, da.Array) else w for n, w in shared.items()}

    def check(stand_ins: dict[str, Any]) -> tuple[Any, ...]:
        """The in-memory function on stand-ins: its checks, and the
        results' shapes and dtypes."""
        try:
            return _flat(fn(**stand_ins, **weight_stand_ins, **literals))
        except ValueError as exc:
            given = ", ".join(f"{n} {tuple(x.shape)}"
                              for n, x in arrays.items())
            raise ValueError(
                f"{exc} [attention_c.dask checks shapes on empty stand-ins "
                f"whose batch axes have length 0; the shapes given: "
                f"{given}]") from exc

    for n, x in arrays.items():
        if any(s not in (1, lead[nlead - nb[n] + j])
               for j, s in enumerate(x.shape[:nb[n]])):
            # The in-memory function's message when it has one (a
            # per-query mask given as mask=, ...), else ours.
            check({m: np.empty(tuple(0 if s != 1 else 1
                                     for s in y.shape[:nb[m]])
                               + tuple(y.shape[nb[m]:]), y.dtype)
                   for m, y in arrays.items()})
            raise _batch_error(n, tuple(x.shape), ref, ref_shape, lead)

    def axis(n: str, j: int) -> int:
        """The batch axis of the call that axis j of argument n is."""
        return int(nlead - nb[n] + j)

    def shared_along(n: str, j: int) -> bool:
        return bool(arrays[n].shape[j] == 1 and lead[axis(n, j)] != 1)

    # Check shapes and dtypes now, and learn the results' shapes and dtypes,
    # with the in-memory function on empty stand-ins: each batch axis 0 (1
    # where an argument is shared along it).
    stand_ins = {n: np.empty(tuple(int(shared_along(n, j))
                                   for j in range(nb[n]))
                             + tuple(x.shape[nb[n]:]), x.dtype)
                 for n, x in arrays.items()}
    metas = check(stand_ins)

    # Chunks of the batch: those of ref along its batch axes (of the first
    # argument that spans an axis where ref is shared); whole with dropout.
    lead_chunks: list[tuple[int, ...]] = [(m,) for m in lead]
    for i in range(nlead):
        for n in (ref, *arrays):
            x, j = arrays[n], i - (nlead - nb[n])
            if j >= 0 and not shared_along(n, j) and isinstance(x, da.Array):
                lead_chunks[i] = x.chunks[j]
                break
    if literals.get("dropout") and any(len(c) > 1 for c in lead_chunks):
        warnings.warn(
            f"dropout > 0: the keep bits of sequence b are drawn from its "
            f"flat index b in the whole batch, and attention_c's functions "
            f"have no argument to start a chunk at its offset, so "
            f"attention_c.dask computes the batch {lead} in one chunk "
            f"(chunks {tuple(lead_chunks)} given) to give the bits of the "
            f"in-memory call.",
            da.PerformanceWarning, stacklevel=_caller_level())
        lead_chunks = [(m,) for m in lead]
    for n, x in arrays.items():
        target = tuple((1,) if shared_along(n, j) else lead_chunks[axis(n, j)]
                       for j in range(nb[n])) + tuple(
                           (s,) for s in x.shape[nb[n]:])
        if not isinstance(x, da.Array):
            arrays[n] = da.from_array(  # type: ignore[no-untyped-call]
                x, chunks=target)
            continue
        split = [i for i in range(nb[n], x.ndim) if len(x.chunks[i]) > 1]
        if split:
            warnings.warn(
                f"{n} is chunked along axes {split}, not only along the "
                f"leading (batch) axes (chunks {x.chunks}); attention_c."
                f"dask computes each sequence whole and rechunks it to "
                f"{target}. Chunk it along the batch only.",
                da.PerformanceWarning, stacklevel=_caller_level())
        if x.chunks != target:
            arrays[n] = x.rechunk(target)  # type: ignore[no-untyped-call]
    # One key per weight: a single chunk.
    for n, w in shared.items():
        if isinstance(w, da.Array):
            shared[n] = w.rechunk(w.shape)  # type: ignore[no-untyped-call]
        else:
            shared[n] = da.from_array(  # type: ignore[no-untyped-call]
                w, chunks=w.shape)

    def block(n: str, idx: tuple[int, ...]) -> tuple[int, ...]:
        """The block of argument n's batch axes that chunk idx reads."""
        return tuple(0 if shared_along(n, j) else idx[axis(n, j)]
                     for j in range(nb[n]))

    # One task per chunk of the batch, calling fn on it.
    names = (*arrays, *shared)
    inputs = [*arrays.values(), *shared.values()]
    token = tokenize(fn.__name__, names, literals,
                     *[x.name for x in inputs])
    prefix = f"attention-c-{fn.__name__.replace('_', '-')}-"
    tmp_name = prefix + token
    call = functools.partial(_chunk, fn, names, literals)
    blocks = list(np.ndindex(*map(len, lead_chunks)))
    tasks: dict[Any, Any] = {}
    for idx in blocks:
        keys = [(x.name, *block(n, idx), *[0] * (x.ndim - nb[n]))
                for n, x in arrays.items()]
        keys += [(w.name, *[0] * w.ndim) for w in shared.values()]
        tasks[(tmp_name, *idx)] = (call, *keys)
    graph = HighLevelGraph.from_collections(tmp_name, tasks,
                                            dependencies=inputs)
    tmp: Any = da.Array(  # type: ignore[no-untyped-call]
        graph, tmp_name, tuple(lead_chunks),
        meta=np.empty((0,) * nlead, object))

    results: list[Any] = []
    for j, (field, follow, meta) in enumerate(zip(fields, follows, metas)):
        if meta is None:
            results.append(None)
            continue
        name = f"{prefix}{field}-{token}"
        # Where each chunk's result goes: the block of the argument it
        # follows (parts landing on one block are summed by a tree).
        where: dict[tuple[int, ...], tuple[int, ...]]
        if follow is None:
            nres, where = 0, {idx: () for idx in blocks}
            res_chunks: list[tuple[int, ...]] = []
        elif follow == "":
            nres, where = nlead, {idx: idx for idx in blocks}
            res_chunks = list(lead_chunks)
        else:
            x = arrays[follow]
            nres = nb[follow]
            where = {idx: block(follow, idx) for idx in blocks}
            res_chunks = [x.chunks[k] for k in range(nres)]
        core = tuple(meta.shape[nres:])
        groups: dict[tuple[int, ...], list[Any]] = {}
        for idx in blocks:
            groups.setdefault(where[idx], []).append(
                (getitem, (tmp_name, *idx), j))
        layer: dict[Any, Any] = {}
        for out_idx, parts in groups.items():
            key = (name, *out_idx, *[0] * len(core))
            if len(parts) == 1:
                layer[key] = parts[0]
            else:
                layer.update(_tree_sum(name, key, parts))
        chunks = tuple(res_chunks) + tuple((s,) for s in core)
        graph = HighLevelGraph.from_collections(name, layer,
                                                dependencies=[tmp])
        empty = np.empty((0,) * len(chunks), meta.dtype)
        results.append(da.Array(  # type: ignore[no-untyped-call]
            graph, name, chunks, meta=empty))
    return results


def _caller_level() -> int:
    """The ``stacklevel`` that makes a warning of :func:`_apply` name the
    line that called attention_c.dask: the first frame outside this module
    and the argument check of attention_c._keywords that wraps its
    functions."""
    level = 2                               # 1 is _apply, 2 its caller
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in (
            __name__, "attention_c._keywords"):
        level, frame = level + 1, frame.f_back
    return level


def _tree_sum(name: str, key: tuple[Any, ...], parts: list[Any]
              ) -> dict[Any, Any]:
    """Tasks summing ``parts`` (tasks or keys, in chunk order) into
    ``key`` by a tree of fixed shape (FAN_IN per node); ``name`` names
    the partial sums."""
    layer: dict[Any, Any] = {}
    depth = 0
    while len(parts) > FAN_IN:
        groups = [parts[g:g + FAN_IN] for g in range(0, len(parts), FAN_IN)]
        parts = []
        for g, group in enumerate(groups):
            partial = (f"{name}-partial", *key[1:], depth, g)
            layer[partial] = (_sum, *group)
            parts.append(partial)
        depth += 1
    layer[key] = (_sum, *parts)
    return layer


# --------------------------------------------------------------------------
# Context-pooled attention


@overload
def context_attention(h: _Input, W: _Input, v: _Input, *,
                      b: _Input | None = None, mask: _Input | None = None,
                      keep_activations: Literal[False] = False
                      ) -> tuple[da.Array, da.Array]: ...


@overload
def context_attention(h: _Input, W: _Input, v: _Input, *,
                      b: _Input | None = None, mask: _Input | None = None,
                      keep_activations: Literal[True]
                      ) -> tuple[da.Array, da.Array, da.Array]: ...


@overload
def context_attention(h: _Input, W: _Input, v: _Input, *,
                      b: _Input | None = None, mask: _Input | None = None,
                      keep_activations: bool = ...
                      ) -> tuple[da.Array, ...]: ...


@keyword_only
def context_attention(h: _Input, W: _Input, v: _Input, *,
                      b: _Input | None = None, mask: _Input | None = None,
                      keep_activations: bool = False
                      ) -> tuple[da.Array, ...]:
    """:func:`attention_c.context_attention` chunk by chunk of the batch.

    Parameters
    ----------
    h : dask.array.Array or array_like (B, ..., T, H)
        Chunked along the leading (batch) axes.
    W : array_like (A, 2H)
    v : array_like (A,)
    b : array_like (A,), optional
        Weights: one graph key each, shared by every chunk.
    mask : dask.array.Array or array_like of bool (B, ..., T), optional
        True marks a valid item; chunked like ``h`` (rechunked if not).
    keep_activations : bool, optional
        Also return the activations (B, ..., T, A).

    Returns
    -------
    out : dask.array.Array (B, ..., H)
    alpha : dask.array.Array (B, ..., T)
    activations : dask.array.Array (B, ..., T, A)
        Only with ``keep_activations=True``.

    Examples
    --------
    >>> import numpy as np, dask.array as da
    >>> import attention_c as ac, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> h = rng.standard_normal((10, 5, 4))            # B=10, T=5, H=4
    >>> W = rng.standard_normal((3, 8)); v = rng.standard_normal(3)
    >>> hd = da.from_array(h, chunks=(4, -1, -1))       # along the batch
    >>> out, alpha = acd.context_attention(hd, W, v)
    >>> out.chunks
    ((4, 4, 2), (4,))
    >>> bool((out.compute() == ac.context_attention(h, W, v)[0]).all())
    True
    """
    outs = _apply(
        _ac.context_attention, "h", {"h": h, "mask": mask},
        {"W": W, "v": v, "b": b}, {"keep_activations": keep_activations},
        ("out", "alpha", "activations"), ("", "", ""), _CONTEXT_CORES)
    return tuple(x for x in outs if x is not None)


@keyword_only
def context_attention_backward(grad_out: _Input, h: _Input, W: _Input,
                               v: _Input, alpha: _Input, *,
                               b: _Input | None = None,
                               mask: _Input | None = None,
                               grad_alpha: _Input | None = None,
                               activations: _Input | None = None
                               ) -> AttentionGrads:
    """:func:`attention_c.context_attention_backward` chunk by chunk.

    Parameters
    ----------
    grad_out : dask.array.Array or array_like (B, ..., H)
    h, W, v, b, mask
        As given to :func:`context_attention`.
    alpha : dask.array.Array or array_like (B, ..., T)
        The weights :func:`context_attention` returned.
    grad_alpha : dask.array.Array or array_like (B, ..., T), optional
    activations : dask.array.Array or array_like (B, ..., T, A), optional
        From ``context_attention(..., keep_activations=True)``.

    Returns
    -------
    AttentionGrads
        ``h`` chunked like ``h`` (bitwise the in-memory result); ``W``,
        ``v``, ``b`` summed over the chunks by a tree of fixed shape (equal
        to the in-memory sums within rounding; ``b`` None without a bias).

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> h = da.from_array(rng.standard_normal((10, 5, 4)),
    ...                   chunks=(4, -1, -1))
    >>> W = rng.standard_normal((3, 8)); v = rng.standard_normal(3)
    >>> out, alpha = acd.context_attention(h, W, v)
    >>> g = acd.context_attention_backward(da.ones_like(out), h, W, v, alpha)
    >>> g.h.chunks[0], g.W.shape, g.W.numblocks, g.b
    ((4, 4, 2), (3, 8), (1, 1), None)
    """
    return AttentionGrads(*_apply(
        _ac.context_attention_backward, "h",
        {"grad_out": grad_out, "h": h, "alpha": alpha, "mask": mask,
         "grad_alpha": grad_alpha, "activations": activations},
        {"W": W, "v": v, "b": b}, {}, AttentionGrads._fields,
        ("h", None, None, None), _CONTEXT_CORES))


# --------------------------------------------------------------------------
# The attention family


def _family_cores(query: _Input, keys: _Input) -> dict[str, int]:
    """The non-batch axes of each family argument: one query per sequence
    when ``query`` has one axis fewer than ``keys``, else (..., Tq, .)."""
    single = _ndim(query) == _ndim(keys) - 1
    q = 1 if single else 2
    return {"query": q, "keys": 2, "values": 2, "key_proj": 2, "mask": 1,
            "attn_mask": 2, "bias": q, "alpha": q, "grad_alpha": q,
            "out": q, "grad_out": q, "lse": q - 1}


def _ndim(x: _Input) -> int:
    """The axes of a Dask array or an array-like, computing nothing."""
    n = getattr(x, "ndim", None)
    return int(n) if n is not None else np.ndim(x)


_CONTEXT_CORES = {"h": 2, "mask": 1, "alpha": 1, "grad_alpha": 1,
                  "grad_out": 1, "activations": 2}

@keyword_only
def additive_attention(query: _Input, keys: _Input, W: _Input, v: _Input, *,
                       b: _Input | None = None, mask: _Input | None = None,
                       attn_mask: _Input | None = None, causal: bool = False,
                       values: _Input | None = None,
                       key_proj: _Input | None = None
                       ) -> tuple[da.Array, da.Array]:
    """:func:`attention_c.additive_attention` chunk by chunk of the batch.

    Parameters
    ----------
    query : dask.array.Array or array_like (B, ..., Hq) or (B, ..., Tq, Hq)
    keys : dask.array.Array or array_like (B, ..., T, H)
        Chunked along the leading (batch) axes; the other batched
        arguments are rechunked to its chunks.
    W : array_like (A, H + Hq)
    v : array_like (A,)
    b : array_like (A,), optional
    mask, attn_mask, causal
        As in memory (see :func:`dot_attention`).
    values : dask.array.Array or array_like (B, ..., T, Hv), optional
    key_proj : dask.array.Array or array_like (B, ..., T, A), optional
        ``project_keys(keys, W)``.

    Returns
    -------
    out : dask.array.Array (B, ..., Hv) or (B, ..., Tq, Hv)
    alpha : dask.array.Array (B, ..., T) or (B, ..., Tq, T)

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((10, 7, 4)),
    ...                      chunks=(5, -1, -1))
    >>> query = rng.standard_normal((10, 3))           # split like keys
    >>> W = rng.standard_normal((5, 4 + 3)); v = rng.standard_normal(5)
    >>> out, alpha = acd.additive_attention(query, keys, W, v)
    >>> out.chunks, alpha.compute().shape
    (((5, 5), (4,)), (10, 7))
    """
    out, alpha = _apply(
        _ac.additive_attention, "keys",
        {"query": query, "keys": keys, "mask": mask, "attn_mask": attn_mask,
         "values": values, "key_proj": key_proj}, {"W": W, "v": v, "b": b},
        {"causal": causal}, ("out", "alpha"), ("", ""),
        _family_cores(query, keys))
    return out, alpha


@overload
def additive_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input, v: _Input,
        alpha: _Input, *, b: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        values: _Input | None = None, grad_alpha: _Input | None = None,
        key_proj: _Input | None = None,
        stop_at_key_proj: Literal[False] = False
) -> AdditiveAttentionGrads: ...


@overload
def additive_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input, v: _Input,
        alpha: _Input, *, b: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        values: _Input | None = None, grad_alpha: _Input | None = None,
        key_proj: _Input | None = None,
        stop_at_key_proj: Literal[True]
) -> tuple[AdditiveAttentionGrads, da.Array]: ...


@overload
def additive_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input, v: _Input,
        alpha: _Input, *, b: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        values: _Input | None = None, grad_alpha: _Input | None = None,
        key_proj: _Input | None = None, stop_at_key_proj: bool = ...
) -> AdditiveAttentionGrads | tuple[AdditiveAttentionGrads, da.Array]: ...


@keyword_only
def additive_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input, v: _Input,
        alpha: _Input, *, b: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        values: _Input | None = None, grad_alpha: _Input | None = None,
        key_proj: _Input | None = None, stop_at_key_proj: bool = False
) -> AdditiveAttentionGrads | tuple[AdditiveAttentionGrads, da.Array]:
    """:func:`attention_c.additive_attention_backward` chunk by chunk.

    Parameters
    ----------
    grad_out : dask.array.Array or array_like, the shape of ``out``
    query, keys, W, v, b, mask, attn_mask, causal, values, key_proj
        As given to :func:`additive_attention`.
    alpha : dask.array.Array or array_like, the forward's ``alpha``
    grad_alpha : dask.array.Array or array_like, optional
    stop_at_key_proj : bool, optional
        With ``key_proj``: also return ``grad_key_proj``, as in memory.

    Returns
    -------
    AdditiveAttentionGrads
        ``query``, ``keys``, ``values`` chunked like the batch; ``W``,
        ``v``, ``b`` summed over the chunks by a tree of fixed shape.
    grad_key_proj : dask.array.Array (B, ..., T, A)
        Only with ``stop_at_key_proj=True``.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((10, 7, 4)),
    ...                      chunks=(5, -1, -1))
    >>> query = rng.standard_normal((10, 3))
    >>> W = rng.standard_normal((5, 7)); v = rng.standard_normal(5)
    >>> out, alpha = acd.additive_attention(query, keys, W, v)
    >>> g = acd.additive_attention_backward(da.ones_like(out), query, keys,
    ...                                     W, v, alpha)
    >>> g.query.chunks, g.W.shape, g.values
    (((5, 5), (3,)), (5, 7), None)
    """
    outs = _apply(_ac.additive_attention_backward, "keys",
                  {"grad_out": grad_out, "query": query, "keys": keys,
                   "alpha": alpha, "mask": mask, "attn_mask": attn_mask,
                   "values": values, "grad_alpha": grad_alpha,
                   "key_proj": key_proj},
                  {"W": W, "v": v, "b": b},
                  {"causal": causal, "stop_at_key_proj": stop_at_key_proj},
                  (*AdditiveAttentionGrads._fields, "grad_key_proj"),
                  ("query", "keys", "values", None, None, None, "key_proj"),
                  _family_cores(query, keys))
    grads = AdditiveAttentionGrads(*outs[:6])
    if len(outs) > 6:
        return grads, outs[6]
    return grads


@keyword_only
def dot_attention(query: _Input, keys: _Input, *,
                  mask: _Input | None = None,
                  attn_mask: _Input | None = None, causal: bool = False,
                  bias: _Input | None = None, dropout: float = 0.0,
                  seed: int | None = None, values: _Input | None = None,
                  scale: float | None = None, return_weights: bool = True
                  ) -> tuple[da.Array, da.Array]:
    """:func:`attention_c.dot_attention` chunk by chunk of the batch.

    Parameters
    ----------
    query : dask.array.Array or array_like (B, ..., H) or (B, ..., Tq, H)
    keys : dask.array.Array or array_like (B, ..., T, H)
        Chunked along the leading (batch) axes.
    mask : dask.array.Array or array_like of bool (B, ..., T), optional
        The key mask, shared by every query; leading axes of size 1 (or
        missing) broadcast.
    attn_mask : dask.array.Array or array_like of bool, optional
        Broadcastable to (B, ..., Tq, T): chunked like the batch along the
        batch axes it has, given whole to every chunk when it has none
        (e.g. ``np.tril(np.ones((Tq, T), bool))``, one graph key).
    causal : bool, optional
        Key t visible to query i iff ``t <= i + (T - Tq)``.
    bias : dask.array.Array or array_like, optional
        Float, broadcastable to (B, ..., Tq, T) (to (B, ..., T) with one
        query); split like ``attn_mask``.
    dropout : float, optional
        p in [0, 1).  The keep bits of sequence b are drawn from its flat
        index b in the whole batch, and the in-memory functions take no
        offset at which a chunk would start: with ``dropout > 0`` the
        batch is computed in one chunk (a ``PerformanceWarning`` says so
        when it was split), which gives the bits of the in-memory call.
    seed : int, optional
        Required when ``dropout > 0``.
    values : dask.array.Array or array_like (B, ..., T, Hv), optional
    scale : float, optional
        Default ``1/sqrt(H)``.
    return_weights : bool, optional
        False: return ``(out, lse)`` instead of ``(out, alpha)``.

    Returns
    -------
    out : dask.array.Array (B, ..., Hv) or (B, ..., Tq, Hv)
    alpha : dask.array.Array (B, ..., T) or (B, ..., Tq, T)
        Or ``lse`` (B, ...) or (B, ..., Tq) with ``return_weights=False``.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> x = da.from_array(np.random.default_rng(0).standard_normal(
    ...     (8, 6, 4)), chunks=(2, 6, 4))
    >>> out, alpha = acd.dot_attention(x, x, causal=True)
    >>> out.numblocks, float(alpha[0, 0, 1].compute())
    ((4, 1, 1), 0.0)
    >>> out, lse = acd.dot_attention(x, x, causal=True, return_weights=False)
    >>> lse.shape
    (8, 6)
    """
    out, w = _apply(
        _ac.dot_attention, "keys",
        {"query": query, "keys": keys, "mask": mask, "attn_mask": attn_mask,
         "bias": bias, "values": values}, {},
        {"causal": causal, "dropout": dropout, "seed": seed, "scale": scale,
         "return_weights": return_weights},
        ("out", "alpha" if return_weights else "lse"), ("", ""),
        _family_cores(query, keys))
    return out, w


@keyword_only
def dot_attention_backward(grad_out: _Input, query: _Input, keys: _Input,
                           alpha: _Input | None = None, *,
                           out: _Input | None = None,
                           lse: _Input | None = None,
                           mask: _Input | None = None,
                           attn_mask: _Input | None = None,
                           causal: bool = False, bias: _Input | None = None,
                           dropout: float = 0.0, seed: int | None = None,
                           values: _Input | None = None,
                           scale: float | None = None,
                           grad_alpha: _Input | None = None
                           ) -> DotAttentionGrads:
    """:func:`attention_c.dot_attention_backward` chunk by chunk.

    Parameters
    ----------
    grad_out : dask.array.Array or array_like, the shape of ``out``
    query, keys, mask, attn_mask, causal, bias, dropout, seed, values, scale
        As given to :func:`dot_attention`.
    alpha : dask.array.Array or array_like, optional
        The forward's ``alpha``; or give ``out=`` and ``lse=``.
    out, lse : dask.array.Array or array_like, optional
        From a ``return_weights=False`` forward.
    grad_alpha : dask.array.Array or array_like, optional
        Only with ``alpha``.

    Returns
    -------
    DotAttentionGrads
        ``query``, ``keys``, ``values`` (None when not given), chunked
        like the batch; ``bias`` (None without a bias) of the bias's
        shape, summed over the chunks along which it is shared by a tree
        of fixed shape.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> x = da.from_array(np.random.default_rng(0).standard_normal(
    ...     (8, 6, 4)), chunks=(2, 6, 4))
    >>> bias = np.zeros((6, 6))                         # shared: one key
    >>> out, lse = acd.dot_attention(x, x, bias=bias, return_weights=False)
    >>> g = acd.dot_attention_backward(da.ones_like(out), x, x, out=out,
    ...                                lse=lse, bias=bias)
    >>> g.keys.chunks[0], g.values, g.bias.shape, g.bias.numblocks
    ((2, 2, 2, 2), None, (6, 6), (1, 1))
    """
    return DotAttentionGrads(*_apply(
        _ac.dot_attention_backward, "keys",
        {"grad_out": grad_out, "query": query, "keys": keys, "alpha": alpha,
         "out": out, "lse": lse, "mask": mask, "attn_mask": attn_mask,
         "bias": bias, "values": values, "grad_alpha": grad_alpha}, {},
        {"causal": causal, "dropout": dropout, "seed": seed, "scale": scale},
        DotAttentionGrads._fields, ("query", "keys", "values", "bias"),
        _family_cores(query, keys)))


@keyword_only
def general_attention(query: _Input, keys: _Input, W: _Input, *,
                      mask: _Input | None = None,
                      attn_mask: _Input | None = None, causal: bool = False,
                      bias: _Input | None = None, dropout: float = 0.0,
                      seed: int | None = None, values: _Input | None = None,
                      key_proj: _Input | None = None,
                      return_weights: bool = True
                      ) -> tuple[da.Array, da.Array]:
    """:func:`attention_c.general_attention` chunk by chunk of the batch.

    Parameters
    ----------
    query : dask.array.Array or array_like (B, ..., Hq) or (B, ..., Tq, Hq)
    keys : dask.array.Array or array_like (B, ..., T, H)
        Chunked along the leading (batch) axes.
    W : array_like (Hq, H)
    mask, attn_mask, causal, bias, dropout, seed, return_weights
        As in :func:`dot_attention` (``dropout > 0``: one chunk).
    values : dask.array.Array or array_like (B, ..., T, Hv), optional
    key_proj : dask.array.Array or array_like (B, ..., T, Hq), optional

    Returns
    -------
    out : dask.array.Array (B, ..., Hv) or (B, ..., Tq, Hv)
    alpha : dask.array.Array (B, ..., T) or (B, ..., Tq, T)
        Or ``lse`` with ``return_weights=False``.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((6, 7, 4)),
    ...                      chunks=(3, -1, -1))
    >>> query = da.from_array(rng.standard_normal((6, 2, 3)),
    ...                       chunks=(3, -1, -1))
    >>> out, alpha = acd.general_attention(query, keys,
    ...                                    rng.standard_normal((3, 4)))
    >>> out.shape, alpha.numblocks
    ((6, 2, 4), (2, 1, 1))
    """
    out, w = _apply(
        _ac.general_attention, "keys",
        {"query": query, "keys": keys, "mask": mask, "attn_mask": attn_mask,
         "bias": bias, "values": values, "key_proj": key_proj}, {"W": W},
        {"causal": causal, "dropout": dropout, "seed": seed,
         "return_weights": return_weights},
        ("out", "alpha" if return_weights else "lse"), ("", ""),
        _family_cores(query, keys))
    return out, w


@overload
def general_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input,
        alpha: _Input | None = None, *, out: _Input | None = None,
        lse: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        bias: _Input | None = None, dropout: float = 0.0,
        seed: int | None = None, values: _Input | None = None,
        grad_alpha: _Input | None = None, key_proj: _Input | None = None,
        stop_at_key_proj: Literal[False] = False
) -> GeneralAttentionGrads: ...


@overload
def general_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input,
        alpha: _Input | None = None, *, out: _Input | None = None,
        lse: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        bias: _Input | None = None, dropout: float = 0.0,
        seed: int | None = None, values: _Input | None = None,
        grad_alpha: _Input | None = None, key_proj: _Input | None = None,
        stop_at_key_proj: Literal[True]
) -> tuple[GeneralAttentionGrads, da.Array]: ...


@overload
def general_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input,
        alpha: _Input | None = None, *, out: _Input | None = None,
        lse: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        bias: _Input | None = None, dropout: float = 0.0,
        seed: int | None = None, values: _Input | None = None,
        grad_alpha: _Input | None = None, key_proj: _Input | None = None,
        stop_at_key_proj: bool = ...
) -> GeneralAttentionGrads | tuple[GeneralAttentionGrads, da.Array]: ...


@keyword_only
def general_attention_backward(
        grad_out: _Input, query: _Input, keys: _Input, W: _Input,
        alpha: _Input | None = None, *, out: _Input | None = None,
        lse: _Input | None = None, mask: _Input | None = None,
        attn_mask: _Input | None = None, causal: bool = False,
        bias: _Input | None = None, dropout: float = 0.0,
        seed: int | None = None, values: _Input | None = None,
        grad_alpha: _Input | None = None, key_proj: _Input | None = None,
        stop_at_key_proj: bool = False
) -> GeneralAttentionGrads | tuple[GeneralAttentionGrads, da.Array]:
    """:func:`attention_c.general_attention_backward` chunk by chunk.

    Parameters
    ----------
    grad_out : dask.array.Array or array_like, the shape of ``out``
    query, keys, W, mask, attn_mask, causal, bias, dropout, seed, values, \
key_proj
        As given to :func:`general_attention`.
    alpha : dask.array.Array or array_like, optional
        The forward's ``alpha``; or give ``out=`` and ``lse=``.
    out, lse : dask.array.Array or array_like, optional
        From a ``return_weights=False`` forward.
    grad_alpha : dask.array.Array or array_like, optional
        Only with ``alpha``.
    stop_at_key_proj : bool, optional
        With ``key_proj``: also return ``grad_key_proj``, as in memory.

    Returns
    -------
    GeneralAttentionGrads
        ``query``, ``keys``, ``values`` chunked like the batch; ``W``
        summed over the chunks by a tree of fixed shape; ``bias`` (None
        without a bias) of the bias's shape, summed over the chunks along
        which it is shared by the same tree.
    grad_key_proj : dask.array.Array (B, ..., T, Hq)
        Only with ``stop_at_key_proj=True``.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((6, 7, 4)),
    ...                      chunks=(3, -1, -1))
    >>> query = rng.standard_normal((6, 3)); W = rng.standard_normal((3, 4))
    >>> out, alpha = acd.general_attention(query, keys, W)
    >>> g = acd.general_attention_backward(da.ones_like(out), query, keys,
    ...                                    W, alpha)
    >>> g.W.compute().shape, g.bias
    ((3, 4), None)
    """
    outs = _apply(_ac.general_attention_backward, "keys",
                  {"grad_out": grad_out, "query": query, "keys": keys,
                   "alpha": alpha, "out": out, "lse": lse, "mask": mask,
                   "attn_mask": attn_mask, "bias": bias, "values": values,
                   "grad_alpha": grad_alpha, "key_proj": key_proj},
                  {"W": W},
                  {"causal": causal, "dropout": dropout, "seed": seed,
                   "stop_at_key_proj": stop_at_key_proj},
                  (*GeneralAttentionGrads._fields, "grad_key_proj"),
                  ("query", "keys", "values", None, "bias", "key_proj"),
                  _family_cores(query, keys))
    grads = GeneralAttentionGrads(*outs[:5])
    if len(outs) > 5:
        return grads, outs[5]
    return grads


def project_keys(keys: _Input, W: _Input) -> da.Array:
    """:func:`attention_c.project_keys` chunk by chunk of the batch.

    Parameters
    ----------
    keys : dask.array.Array or array_like (B, ..., T, H)
    W : array_like (P, L), L >= H

    Returns
    -------
    key_proj : dask.array.Array (B, ..., T, P)

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((6, 7, 4)),
    ...                      chunks=(3, -1, -1))
    >>> acd.project_keys(keys, rng.standard_normal((5, 7))).chunks
    ((3, 3), (7,), (5,))
    """
    key_proj: da.Array = _apply(_ac.project_keys, "keys", {"keys": keys},
                                {"W": W}, {}, ("key_proj",), ("keys",),
                                {"keys": 2})[0]
    return key_proj


def project_keys_backward(grad_proj: _Input, keys: _Input, W: _Input
                          ) -> tuple[da.Array, da.Array]:
    """:func:`attention_c.project_keys_backward` chunk by chunk.

    Parameters
    ----------
    grad_proj : dask.array.Array or array_like (B, ..., T, P)
    keys : dask.array.Array or array_like (B, ..., T, H)
    W : array_like (P, L)

    Returns
    -------
    dkeys : dask.array.Array (B, ..., T, H)
    dW : dask.array.Array (P, L)
        Summed over the chunks by a tree of fixed shape.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attention_c.dask as acd
    >>> rng = np.random.default_rng(0)
    >>> keys = da.from_array(rng.standard_normal((6, 7, 4)),
    ...                      chunks=(3, -1, -1))
    >>> W = rng.standard_normal((5, 7))
    >>> kp = acd.project_keys(keys, W)
    >>> dkeys, dW = acd.project_keys_backward(da.ones_like(kp), keys, W)
    >>> dkeys.chunks[0], dW.shape
    ((3, 3), (5, 7))
    """
    dkeys, dW = _apply(_ac.project_keys_backward, "keys",
                       {"grad_proj": grad_proj, "keys": keys}, {"W": W}, {},
                       ("keys", "W"), ("keys", None),
                       {"grad_proj": 2, "keys": 2})
    return dkeys, dW
