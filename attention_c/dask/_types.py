"""The types of attention_c.dask's signatures: its inputs, and the
gradient tuples of its backward functions."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import dask.array as da
import numpy.typing as npt

# A Dask array or anything np.asarray accepts.
_Input: TypeAlias = da.Array | npt.ArrayLike

if TYPE_CHECKING:
    # What a type checker sees: attention_c's gradient tuples with Dask
    # arrays in their fields.  At run time they are attention_c's own
    # classes (below), the same fields in the same order.
    class AttentionGrads(NamedTuple):
        h: da.Array
        W: da.Array
        v: da.Array
        b: da.Array | None

    class AdditiveAttentionGrads(NamedTuple):
        query: da.Array
        keys: da.Array
        values: da.Array | None
        W: da.Array
        v: da.Array
        b: da.Array | None

    class DotAttentionGrads(NamedTuple):
        query: da.Array
        keys: da.Array
        values: da.Array | None
        bias: da.Array | None
        alibi_slopes: da.Array | None
        sinks: da.Array | None

    class GeneralAttentionGrads(NamedTuple):
        query: da.Array
        keys: da.Array
        values: da.Array | None
        W: da.Array
        bias: da.Array | None
        alibi_slopes: da.Array | None
        sinks: da.Array | None

    class LocationAttentionGrads(NamedTuple):
        query: da.Array
        values: da.Array
        W: da.Array
        b: da.Array | None

    class CosineAttentionGrads(NamedTuple):
        query: da.Array
        keys: da.Array
        values: da.Array | None
        sharpness: da.Array | None
        bias: da.Array | None
        alibi_slopes: da.Array | None
        sinks: da.Array | None
else:
    from attention_c import (AdditiveAttentionGrads, AttentionGrads,
                             CosineAttentionGrads, DotAttentionGrads,
                             GeneralAttentionGrads, LocationAttentionGrads)

__all__ = ["AttentionGrads", "AdditiveAttentionGrads", "DotAttentionGrads",
           "GeneralAttentionGrads", "LocationAttentionGrads",
           "CosineAttentionGrads"]
