"""The vmap rules of the PyTorch operators (attention_c.torch._ops):
leading batch axes are native to the kernels, so a vmapped data argument
just moves its batched dimension to the front (unbatched data is
expanded).  Batched weights, and every backward op (whose parameter
gradients are summed over the batch axes, but must stay per-example under
vmap), loop.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _pure


def _tensor_dims(in_dims: tuple[Any, ...], args: tuple[Any, ...]
                 ) -> tuple[Any, ...]:
    """``in_dims`` with None for every argument that is not a tensor (a
    window [left, right] comes with a list of dims, [None, None])."""
    return tuple(d if isinstance(a, torch.Tensor) else None
                 for a, d in zip(args, in_dims))


def _vmap_loop(op: Any, info: Any, in_dims: tuple[Any, ...],
               *args: Any) -> tuple[Any, Any]:
    in_dims = _tensor_dims(in_dims, args)
    outs = []
    for i in range(info.batch_size):
        outs.append(op(*[a.select(d, i) if d is not None else a
                         for a, d in zip(args, in_dims)]))
    stacked = tuple(torch.stack(o) for o in zip(*outs))
    return stacked, (0,) * len(stacked)


def _vmap_native(op: Any, data: tuple[int, ...]) -> Any:
    """A vmap rule for a forward op whose arguments at positions ``data``
    take leading batch axes (the others are weights or flags)."""

    def rule(info: Any, in_dims: tuple[Any, ...], *args: Any
             ) -> tuple[Any, Any]:
        if any(d is not None for i, d in enumerate(in_dims)
               if i not in data):
            return _vmap_loop(op, info, in_dims, *args)
        new = list(args)
        for i in data:
            a, d = args[i], in_dims[i]
            if a is None:
                continue
            new[i] = (a.movedim(d, 0) if d is not None
                      else a.expand(info.batch_size, *a.shape))
        outs = op(*new)
        # An empty placeholder (no activations kept) is not batched.
        return outs, tuple(0 if o.numel() or o.ndim > 1 else None
                           for o in outs)

    return rule


# A family op's data arguments and their trailing (non-batch) axes; None:
# a query's, 1 or 2.  bias takes the query's: (..., T) with one query.
_CORE = {"query": None, "keys": 2, "values": 2, "key_proj": 2, "mask": 1,
         "attn_mask": 2, "bias": None}
# Inputs and outputs broadcast to the results' leading shape (the kernels
# want one leading shape for these); masks and bias broadcast as they are.
_FULL = ("query", "keys", "values", "key_proj")


def _vmap_family(op: Any, names: tuple[str, ...]) -> Any:
    """The vmap rule of a family forward op (argument ``names``): the
    vmapped axis becomes the first leading axis of the call, each batched
    input getting size-1 axes where it has fewer leading axes than the
    results.  Batched weights, and dropout (whose keep bits depend on the
    flat batch index, which the extra axis would change), loop."""

    def rule(info: Any, in_dims: tuple[Any, ...], *args: Any
             ) -> tuple[Any, Any]:
        a = dict(zip(names, args))
        d = dict(zip(names, _tensor_dims(in_dims, args)))
        # (a call may leave out the trailing arguments that default)
        if (any(d[n] is not None for n in d if n not in _CORE)
                or a.get("dropout", 0.0) > 0):
            return _vmap_loop(op, info, in_dims, *args)
        logical = {n: (x.shape if d[n] is None
                       else x.shape[:d[n]] + x.shape[d[n] + 1:])
                   for n, x in a.items() if n in _CORE and x is not None}
        # (the location score has no keys: its values set the rank)
        ref = logical["keys"] if "keys" in logical else logical["values"]
        single = len(logical["query"]) < len(ref)
        core = {n: (1 if single else 2) if c is None else c
                for n, c in _CORE.items()}
        lead = _pure._broadcast_shapes(*[logical[n][:-core[n]]
                                         for n in _FULL if n in logical])
        N = info.batch_size
        new = dict(a)
        for n, shape in logical.items():
            x, pad = a[n], len(lead) - (len(shape) - core[n])
            if d[n] is None and n not in _FULL:
                continue                        # broadcasts as it is
            x = x.movedim(d[n], 0) if d[n] is not None else x[None]
            x = x.reshape(x.shape[0], *(1,) * pad, *shape)
            if n in _FULL:
                x = x.expand(N, *lead, *shape[len(shape) - core[n]:])
            new[n] = x
        outs = op(*[new[n] for n in names[:len(args)]])
        return outs, (0,) * len(outs)

    return rule


def _loop_rule(op: Any) -> Any:
    def rule(info: Any, in_dims: tuple[Any, ...], *args: Any
             ) -> tuple[Any, Any]:
        return _vmap_loop(op, info, in_dims, *args)
    return rule
