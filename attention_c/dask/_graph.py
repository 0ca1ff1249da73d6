"""The machinery of attention_c.dask: one task per chunk of the batch,
running the in-memory function on that chunk; its results split into one
Dask array each, the parameter gradients summed over the chunks by a tree
of fixed shape.

:func:`_apply` is the whole of it, in steps: the batch of the call
(:class:`_Batch`), the in-memory function's checks on empty stand-ins
(:func:`_check_call`), the chunks of the batch (:func:`_lead_chunks`),
the arguments rechunked to them (:func:`_rechunk`), the tasks
(:func:`_chunk_tasks`) and one array per result (:func:`_result`).
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from operator import getitem
from types import FrameType
from typing import Any, NamedTuple

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

# Chunks summed per node of the parameter gradients' reduction tree.
FAN_IN = 4


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


def _as_arrays(data: dict[str, Any]) -> dict[str, Any]:
    """The batched arguments given (not None), as Dask or NumPy arrays;
    a Dask array of unknown chunk sizes is refused."""
    arrays: dict[str, Any] = {
        n: x if isinstance(x, da.Array) else np.asarray(x)
        for n, x in data.items() if x is not None}
    for n, x in arrays.items():
        if any(isinstance(s, float) and math.isnan(s) for s in x.shape):
            raise ValueError(f"{n} has unknown chunk sizes {x.chunks}; call "
                             f"{n}.compute_chunk_sizes() first")
    return arrays


class _Batch:
    """The batch of one call: the batch axes of each batched argument
    (those in front of its ``cores[name]`` trailing ones), right-aligned
    with the others' as NumPy broadcasts them, and the batch shape.

    ``arrays`` is the caller's dict, which :func:`_rechunk` updates in
    place (the shapes stay)."""

    def __init__(self, fn: Callable[..., Any], ref: str,
                 arrays: dict[str, Any], cores: dict[str, int]) -> None:
        self.arrays, self.ref = arrays, ref
        # Batch axes of each argument; one with fewer axes than its core
        # (bad input) is given whole to the in-memory check.
        self.nb = {n: max(x.ndim - cores[n], 0) for n, x in arrays.items()}
        self.nlead = nlead = max(self.nb.values())
        self.ref_shape = tuple(arrays[ref].shape)
        if nlead < 1:
            raise ValueError(
                f"{ref} has shape {self.ref_shape}; attention_c.dask splits "
                f"the leading (batch) axes, so it needs (B, ..., T, H); for "
                f"one sequence call attention_c.{fn.__name__} directly")
        lead_list = [1] * nlead
        for n in (ref, *arrays):
            x = arrays[n]
            for j in range(self.nb[n]):
                i, s = nlead - self.nb[n] + j, x.shape[j]
                if lead_list[i] == 1:
                    lead_list[i] = s
        self.lead = tuple(lead_list)

    def axis(self, n: str, j: int) -> int:
        """The batch axis of the call that axis j of argument n is."""
        return int(self.nlead - self.nb[n] + j)

    def shared_along(self, n: str, j: int) -> bool:
        return bool(self.arrays[n].shape[j] == 1
                    and self.lead[self.axis(n, j)] != 1)

    def block(self, n: str, idx: tuple[int, ...]) -> tuple[int, ...]:
        """The block of argument n's batch axes that chunk idx reads."""
        return tuple(0 if self.shared_along(n, j) else idx[self.axis(n, j)]
                     for j in range(self.nb[n]))


def _run_check(fn: Callable[..., Any], arrays: dict[str, Any],
               stand_ins: dict[str, Any], weights: dict[str, Any],
               literals: dict[str, Any]) -> tuple[Any, ...]:
    """The in-memory function on stand-ins: its checks, and the results'
    shapes and dtypes."""
    try:
        return _flat(fn(**stand_ins, **weights, **literals))
    except ValueError as exc:
        given = ", ".join(f"{n} {tuple(x.shape)}"
                          for n, x in arrays.items())
        raise ValueError(
            f"{exc} [attention_c.dask checks shapes on empty stand-ins "
            f"whose batch axes have length 0; the shapes given: "
            f"{given}]") from exc


def _stand_weight(name: str, w: Any) -> Any:
    """What the check gives the in-memory function for the argument every
    chunk takes whole: zeros of a float Dask array's shape (no compute),
    an integer one's values (offsets, which the check reads: small), the
    others as they are.  Unknown chunk sizes are refused."""
    if not isinstance(w, da.Array):
        return w
    if any(isinstance(s, float) and math.isnan(s) for s in w.shape):
        raise ValueError(f"{name} has unknown chunk sizes {w.chunks}; call "
                         f"{name}.compute_chunk_sizes() first")
    if w.dtype.kind in "iu":
        return np.asarray(w.compute())  # type: ignore[no-untyped-call]
    return np.zeros(w.shape, w.dtype)


def _check_call(fn: Callable[..., Any], batch: _Batch,
                weights: dict[str, Any],
                literals: dict[str, Any]) -> tuple[Any, ...]:
    """Check shapes and dtypes now, and learn the results' shapes and
    dtypes, with the in-memory function on empty stand-ins: each batch
    axis 0 (1 where an argument is shared along it)."""
    arrays, nb, lead = batch.arrays, batch.nb, batch.lead
    stand_weights = {n: _stand_weight(n, w) for n, w in weights.items()}
    for n, x in arrays.items():
        if any(s not in (1, lead[batch.nlead - nb[n] + j])
               for j, s in enumerate(x.shape[:nb[n]])):
            # The in-memory function's message when it has one (a
            # per-query mask given as mask=, ...), else ours.
            _run_check(fn, arrays,
                       {m: np.empty(tuple(0 if s != 1 else 1
                                          for s in y.shape[:nb[m]])
                                    + tuple(y.shape[nb[m]:]), y.dtype)
                        for m, y in arrays.items()},
                       stand_weights, literals)
            raise _batch_error(n, tuple(x.shape), batch.ref,
                               batch.ref_shape, lead)
    stand_ins = {n: np.empty(tuple(int(batch.shared_along(n, j))
                                   for j in range(nb[n]))
                             + tuple(x.shape[nb[n]:]), x.dtype)
                 for n, x in arrays.items()}
    return _run_check(fn, arrays, stand_ins, stand_weights, literals)


def _lead_chunks(batch: _Batch,
                 literals: dict[str, Any]) -> list[tuple[int, ...]]:
    """Chunks of the batch: those of ref along its batch axes (of the
    first argument that spans an axis where ref is shared); whole with
    dropout."""
    arrays, nlead, lead = batch.arrays, batch.nlead, batch.lead
    lead_chunks: list[tuple[int, ...]] = [(m,) for m in lead]
    for i in range(nlead):
        for n in (batch.ref, *arrays):
            x, j = arrays[n], i - (nlead - batch.nb[n])
            if (j >= 0 and not batch.shared_along(n, j)
                    and isinstance(x, da.Array)):
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
    return lead_chunks


def _rechunk(batch: _Batch, lead_chunks: list[tuple[int, ...]],
             weights: dict[str, Any]) -> None:
    """Every batched argument chunked as the batch (whole along its other
    axes), in place in ``batch.arrays``; every weight one chunk (one
    graph key), in place in ``weights``."""
    arrays, nb = batch.arrays, batch.nb
    for n, x in arrays.items():
        target = tuple(
            (1,) if batch.shared_along(n, j)
            else lead_chunks[batch.axis(n, j)]
            for j in range(nb[n])) + tuple((s,) for s in x.shape[nb[n]:])
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
    for n, w in weights.items():
        if isinstance(w, da.Array):
            weights[n] = w.rechunk(w.shape)  # type: ignore[no-untyped-call]
        else:
            weights[n] = da.from_array(  # type: ignore[no-untyped-call]
                w, chunks=w.shape)


class _Tasks(NamedTuple):
    """The tasks of a call, one per chunk of the batch: the array of
    their (tuple) results, its name's prefix and token, and the chunks."""

    array: Any
    prefix: str
    token: str
    blocks: list[tuple[int, ...]]
    lead_chunks: list[tuple[int, ...]]


def _chunk_tasks(fn: Callable[..., Any], batch: _Batch,
                 weights: dict[str, Any], literals: dict[str, Any],
                 lead_chunks: list[tuple[int, ...]]) -> _Tasks:
    """One task per chunk of the batch, calling fn on it."""
    arrays, nb = batch.arrays, batch.nb
    names = (*arrays, *weights)
    inputs = [*arrays.values(), *weights.values()]
    token = tokenize(fn.__name__, names, literals,
                     *[x.name for x in inputs])
    prefix = f"attention-c-{fn.__name__.replace('_', '-')}-"
    tmp_name = prefix + token
    call = functools.partial(_chunk, fn, names, literals)
    blocks = list(np.ndindex(*map(len, lead_chunks)))
    tasks: dict[Any, Any] = {}
    for idx in blocks:
        keys = [(x.name, *batch.block(n, idx), *[0] * (x.ndim - nb[n]))
                for n, x in arrays.items()]
        keys += [(w.name, *[0] * w.ndim) for w in weights.values()]
        tasks[(tmp_name, *idx)] = (call, *keys)
    graph = HighLevelGraph.from_collections(tmp_name, tasks,
                                            dependencies=inputs)
    tmp: Any = da.Array(  # type: ignore[no-untyped-call]
        graph, tmp_name, tuple(lead_chunks),
        meta=np.empty((0,) * batch.nlead, object))
    return _Tasks(tmp, prefix, token, blocks, lead_chunks)


def _result(batch: _Batch, tasks: _Tasks, j: int, field: str,
            follow: str | None, meta: Any) -> Any:
    """Result j of every task as one Dask array, laid out as ``follow``
    says (see :func:`_apply`)."""
    name = f"{tasks.prefix}{field}-{tasks.token}"
    blocks = tasks.blocks
    # Where each chunk's result goes: the block of the argument it
    # follows (parts landing on one block are summed by a tree).
    where: dict[tuple[int, ...], tuple[int, ...]]
    if follow is None:
        nres, where = 0, {idx: () for idx in blocks}
        res_chunks: list[tuple[int, ...]] = []
    elif follow == "":
        nres, where = batch.nlead, {idx: idx for idx in blocks}
        res_chunks = list(tasks.lead_chunks)
    else:
        x = batch.arrays[follow]
        nres = batch.nb[follow]
        where = {idx: batch.block(follow, idx) for idx in blocks}
        res_chunks = [x.chunks[k] for k in range(nres)]
    core = tuple(meta.shape[nres:])
    groups: dict[tuple[int, ...], list[Any]] = {}
    for idx in blocks:
        groups.setdefault(where[idx], []).append(
            (getitem, (tasks.array.name, *idx), j))
    layer: dict[Any, Any] = {}
    for out_idx, parts in groups.items():
        key = (name, *out_idx, *[0] * len(core))
        if len(parts) == 1:
            layer[key] = parts[0]
        else:
            layer.update(_tree_sum(name, key, parts))
    chunks = tuple(res_chunks) + tuple((s,) for s in core)
    graph = HighLevelGraph.from_collections(name, layer,
                                            dependencies=[tasks.array])
    empty = np.empty((0,) * len(chunks), meta.dtype)
    return da.Array(  # type: ignore[no-untyped-call]
        graph, name, chunks, meta=empty)


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
    batch = _Batch(fn, ref, _as_arrays(data), cores)
    shared: dict[str, Any] = {
        n: w if isinstance(w, da.Array) else np.asarray(w)
        for n, w in weights.items() if w is not None}
    metas = _check_call(fn, batch, shared, literals)
    lead_chunks = _lead_chunks(batch, literals)
    _rechunk(batch, lead_chunks, shared)
    tasks = _chunk_tasks(fn, batch, shared, literals, lead_chunks)
    return [None if meta is None
            else _result(batch, tasks, j, field, follow, meta)
            for j, (field, follow, meta)
            in enumerate(zip(fields, follows, metas))]


def _caller_level() -> int:
    """The ``stacklevel`` that makes a warning of :func:`_apply` name the
    line that called attention_c.dask: the first frame outside this
    package and the argument check of attention_c._keywords that wraps
    its functions."""
    level = 2                   # 1 is the function warning, 2 its caller
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and _ours(frame.f_globals.get("__name__")):
        level, frame = level + 1, frame.f_back
    return level


def _ours(module: str | None) -> bool:
    """Whether a frame of that module is attention_c.dask's own."""
    return module is not None and (
        module == "attention_c._keywords"
        or module.split(".")[:2] == ["attention_c", "dask"])


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
