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
  rechunked to the chunks of ``h`` (``keys`` in the family, ``values``
  for the location score).  Array-likes that are not Dask arrays are
  split like ``h`` (``keys``, ``values``).
- **Weights are one graph key each**, not one copy per chunk: every task
  of a call depends on the same key, so a distributed scheduler sends a
  weight to each worker once, and recomputes it (it is part of the graph)
  if the worker holding it dies.  The forward and the backward of the same
  weights share the key.
- **Masks** are data: chunked like the batch.  A family mask may have
  leading axes of size 1, which broadcast over the batch as in memory.
- **Parameter gradients** (``W``, ``v``, ``b``; the location score's
  ``W`` and ``b``) are summed over the chunks by a tree of fixed shape:
  groups of 4 consecutive chunks (in C order of the chunk grid), each
  summed left to right, then groups of those, up to one.  The result
  depends only on the chunks, never on the scheduler or the order in
  which tasks finish: the same chunks give the same bits on every run.
  It equals the in-memory call's within rounding (which sums the batch in
  another order); with a single chunk, exactly.
- Outputs and input gradients are computed per sequence by the same C
  code as in memory: bitwise equal to the in-memory call's.

Shapes and dtypes are checked when the graph is built, by the in-memory
function itself on empty stand-ins of the inputs (each batch axis of length
0), so bad input raises the in-memory function's ``ValueError`` or
``TypeError`` at once, not at compute time.  At least one leading batch
axis is needed; for a single sequence, call :mod:`attention_c` directly.
"""

# Dask first: without it, the one message that says how to install it.
try:
    import dask.array  # noqa: F401
except ImportError as _missing:     # tested in a subprocess
    raise ImportError(
        "attention_c.dask needs Dask: pip install \"attention_c[dask]\" "
        "(or pip install \"dask[array]>=2024.1\")") from _missing

# The modules: _graph the machinery (one task per chunk of the batch, the
# parameter gradients' reduction tree), context, family and scores the
# functions.
from ._graph import FAN_IN  # noqa: E402,F401
from ._types import (  # noqa: E402
    AdditiveAttentionGrads, AttentionGrads, CosineAttentionGrads,
    DotAttentionGrads, GeneralAttentionGrads, LocationAttentionGrads,
)
from .context import (  # noqa: E402
    context_attention, context_attention_backward,
)
from .family import (  # noqa: E402
    additive_attention, additive_attention_backward, dot_attention,
    dot_attention_backward, general_attention, general_attention_backward,
    project_keys, project_keys_backward,
)
from .scores import (  # noqa: E402
    cosine_attention, cosine_attention_backward, location_attention,
    location_attention_backward,
)

__all__ = ["context_attention", "context_attention_backward",
           "additive_attention", "additive_attention_backward",
           "dot_attention", "dot_attention_backward",
           "general_attention", "general_attention_backward",
           "project_keys", "project_keys_backward",
           "location_attention", "location_attention_backward",
           "cosine_attention", "cosine_attention_backward",
           "AttentionGrads", "AdditiveAttentionGrads", "DotAttentionGrads",
           "GeneralAttentionGrads", "LocationAttentionGrads",
           "CosineAttentionGrads"]
