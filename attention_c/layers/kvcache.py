"""The decoding cache of :class:`.multihead.MultiHeadAttention`:
:class:`KVCache` keeps the projected keys and values of a decoder between
calls, in a preallocated buffer that a one-token step appends to and
attends to without copying it (re-exported by attention_c.multihead);
in the layer's dtype, 16 bits, or int8 with a scale per group.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .._keywords import keyword_only
from ..cache import quantize_kv
from ._common import Array, _positive

__all__ = ["KVCache"]

_ACCEPTED = ("float16, bfloat16 (ml_dtypes), float32, float64, int8 or "
             "None (the layer's dtype)")
_I8 = np.dtype(np.int8)


def _storage_dtype(dtype: npt.DTypeLike | None) -> np.dtype[Any] | None:
    """The dtype ``KVCache(dtype=...)`` stores its keys and values in;
    None for the layer's own.  TypeError for anything else."""
    if dtype is None:               # np.dtype(None) would be float64
        return None
    if isinstance(dtype, str) and dtype == "bfloat16":
        # NumPy knows the name only once ml_dtypes is imported
        try:
            import ml_dtypes
        except ImportError as e:
            raise ImportError(
                "KVCache(dtype='bfloat16') needs ml_dtypes: pip install "
                "ml_dtypes (or pip install \"attention_c[bfloat16]\")"
            ) from e
        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        raise TypeError(f"dtype must be one of {_ACCEPTED}; got "
                        f"{dtype!r}") from None
    # bfloat16 told by its scalar type's name, as the C binding tells it
    # (csrc/python/parse.c): no import of ml_dtypes
    if dt in (np.float16, np.float32, np.float64, np.int8) or (
            dt.kind == "V" and dt.itemsize == 2
            and dt.type.__name__ == "bfloat16"):
        return dt
    raise TypeError(f"dtype must be one of {_ACCEPTED}; got {dt}")


class KVCache:
    """The projected keys and values of a decoder, between calls of a
    :class:`MultiHeadAttention` layer (``layer(x_t, cache=cache)``).

    Each call projects the keys and values of its new positions, appends
    them to a preallocated buffer laid out (..., h, capacity, d), and
    attends its queries to the view of the cached prefix: a step copies
    the new positions into the buffer and nothing else.

    Parameters
    ----------
    max_len : int, optional
        The most positions the cache will hold: the buffer is allocated
        once with exactly that room, and a call that would overflow it is
        a ValueError.  Default None: the buffer starts with room for 16
        positions (or the first call's) and doubles when full.
    static : bool, optional
        For cross-attention to a fixed memory (an encoder's output): the
        first call projects its ``key``/``value`` and keeps them; later
        calls reuse them and ignore ``key`` and ``value``.  Default False.
    dtype : dtype, optional
        The dtype the keys and values are stored in: float16, bfloat16
        (``ml_dtypes.bfloat16`` or ``"bfloat16"``, with ``pip install
        "attention_c[bfloat16]"``), float32 or float64.  Default None:
        the layer's dtype.  A float32 layer with a 16-bit cache keeps
        half the memory, and a decoding step reads half the bytes: the
        kernel reads the 16-bit buffer in place, widening each element as
        it loads it.  Each new position's keys and values are rounded to
        ``dtype`` as they are written (NumPy's cast: to nearest even,
        but a float64 layer's go to bfloat16 through float32); the
        results, in the layer's dtype, are then those of the layer on
        the rounded keys and values.  ``"int8"`` (``np.int8``) keeps a
        quarter of float32's bytes, and a scale a group: each new
        position's keys and values are quantized as
        :func:`attention_c.quantize_kv` does, and the step reads the int8
        buffer in place through :func:`attention_c.cache_attention`
        (results: the layer's on :func:`attention_c.dequantize_kv` of the
        stored values, computed in float32).
    group : int, optional
        With ``dtype="int8"`` only: the elements per scale, dividing the
        head size (default 32, llama.cpp's q8_0).

    Attributes
    ----------
    keys, values : ndarray (..., h, n, d) or None
        Views of the cached projected keys and values, in the storage
        dtype (None when empty).
    key_scales, value_scales : ndarray (..., h, n, d / group) or None
        An int8 cache's float32 scales (None for the other dtypes).
    dtype : numpy.dtype or None
        The storage dtype given (None: the layer's).
    group : int or None
        An int8 cache's elements per scale (None for the other dtypes).

    Notes
    -----
    A cache belongs to one layer and one batch shape, fixed by its first
    call; :meth:`reset` empties it for a new sequence (a non-static cache
    keeps its buffer, so a new sequence allocates nothing).  float16
    ends at 65504: a larger projected key or value is stored as inf
    (bfloat16 has float32's range).  An int8 cache serves float32
    layers, and calls without ``mask``, ``attn_mask``,
    ``cu_seqlens_q``/``_k``, weights or training-time dropout (the cache
    kernel's arguments); anything else is refused before the cache
    changes.

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c.multihead import MultiHeadAttention, KVCache
    >>> mha = MultiHeadAttention(8, 2, seed=0)
    >>> x = np.random.default_rng(1).standard_normal((3, 5, 8))
    >>> cache = KVCache(max_len=5)
    >>> steps = [mha(x[:, t:t + 1], cache=cache) for t in range(5)]
    >>> len(cache), cache.keys.shape
    (5, (3, 2, 5, 4))
    >>> full = mha(x, causal=True)
    >>> bool(np.allclose(np.concatenate(steps, axis=1), full))
    True

    A float32 layer with a float16 cache:

    >>> mha32 = MultiHeadAttention(8, 2, seed=0, dtype=np.float32)
    >>> half = KVCache(max_len=5, dtype=np.float16)
    >>> steps = [mha32(x[:, t:t + 1], cache=half) for t in range(5)]
    >>> half.keys.dtype, steps[-1].dtype
    (dtype('float16'), dtype('float32'))
    >>> bool(np.allclose(np.concatenate(steps, axis=1), full, atol=1e-3))
    True

    And an int8 one, a scale per 16 elements (heads of 16 here):

    >>> mha16 = MultiHeadAttention(32, 2, seed=0, dtype=np.float32)
    >>> y = np.random.default_rng(2).standard_normal((3, 5, 32))
    >>> q8 = KVCache(max_len=5, dtype="int8", group=16)
    >>> steps = [mha16(y[:, t:t + 1], cache=q8) for t in range(5)]
    >>> q8.keys.dtype, q8.key_scales.shape
    (dtype('int8'), (3, 2, 5, 1))
    >>> full16 = mha16(y, causal=True)
    >>> bool(np.allclose(np.concatenate(steps, axis=1), full16, atol=5e-2))
    True
    """

    @keyword_only
    def __init__(self, max_len: int | None = None, *,
                 static: bool = False,
                 dtype: npt.DTypeLike | None = None,
                 group: int | None = None) -> None:
        if max_len is not None:
            if isinstance(max_len, bool) or not isinstance(
                    max_len, (int, np.integer)):
                raise TypeError(f"max_len must be an int or None, got "
                                f"{type(max_len).__name__}")
            _positive(max_len=int(max_len))
            max_len = int(max_len)
        self.max_len = max_len
        self.static = bool(static)
        self.dtype: np.dtype[Any] | None = _storage_dtype(dtype)
        if group is not None and self.dtype != _I8:
            raise ValueError(f"group goes with dtype='int8' (the elements "
                             f"per scale); this cache's dtype is "
                             f"{self.dtype}")
        if self.dtype == _I8:
            if group is None:
                group = 32
            if isinstance(group, bool) or not isinstance(
                    group, (int, np.integer)) or group < 8:
                raise ValueError(f"group must be an int >= 8, got {group!r}")
        self.group = None if group is None else int(group)
        self._k: Array | None = None       # (..., h, capacity, d)
        self._v: Array | None = None
        self._ks: Array | None = None      # int8: (..., h, capacity, ng)
        self._vs: Array | None = None
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def keys(self) -> Array | None:
        return None if self._k is None else self._k[..., :self._n, :]

    @property
    def values(self) -> Array | None:
        return None if self._v is None else self._v[..., :self._n, :]

    @property
    def key_scales(self) -> Array | None:
        return None if self._ks is None else self._ks[..., :self._n, :]

    @property
    def value_scales(self) -> Array | None:
        return None if self._vs is None else self._vs[..., :self._n, :]

    @property
    def int8(self) -> bool:
        """Whether the keys and values are stored in int8."""
        return self.dtype == _I8

    def reset(self) -> None:
        """Empty the cache (a static cache forgets its memory)."""
        self._n = 0
        if self.static:
            self._k = self._v = self._ks = self._vs = None

    def __repr__(self) -> str:
        dt = "" if self.dtype is None else f"dtype={self.dtype.name}, "
        if self.group is not None:
            dt += f"group={self.group}, "
        return (f"KVCache(max_len={self.max_len}, static={self.static}, "
                f"{dt}len={self._n})")

    # ------------------------------------------------------------------
    # Used by MultiHeadAttention: check, write beyond the end, then commit
    # once the attention has succeeded (a failed call changes nothing
    # visible).

    def _storage(self, dtype: np.dtype[Any]) -> np.dtype[Any]:
        """The dtype of the buffer for a layer of ``dtype``."""
        return dtype if self.dtype is None else self.dtype

    def _check_new(self, lead: tuple[int, ...], h: int, dv: int, d: int,
                   dtype: np.dtype[Any], t: int) -> None:
        """ValueError unless keys (lead, h, t, d) and values (lead, h, t,
        dv) of a layer of ``dtype`` can join the cache."""
        dtype = self._storage(dtype)
        if self._k is not None and self._v is not None:
            have = self._k.shape[:-2], self._k.shape[-1], self._v.shape[-1]
            if (have != ((*lead, h), d, dv)
                    or self._k.dtype != dtype):
                raise ValueError(
                    f"this cache holds keys {self._k.shape[:-2]} x {d} "
                    f"... of dtype {self._k.dtype} (batch shape + heads, "
                    f"head size); the call gives batch shape + heads "
                    f"{(*lead, h)}, head sizes {d}/{dv}, dtype {dtype}: a "
                    f"cache serves one layer and one batch shape "
                    f"(reset() it for a new sequence of the same shape, "
                    f"or use a new KVCache)")
        if self.group is not None and (d % self.group or dv % self.group):
            raise ValueError(
                f"group={self.group} must divide the head size ({d} for "
                f"the keys, {dv} for the values)")
        if self.max_len is not None and self._n + t > self.max_len:
            raise ValueError(
                f"the cache is full: it holds {self._n} of max_len="
                f"{self.max_len} positions and the call adds {t}")

    def _stage(self, lead: tuple[int, ...], k: Array, v: Array
               ) -> tuple[Array, Array]:
        """Write k, v (..., h, t, d) after the cached positions, rounded
        to the storage dtype (int8: quantized, the scales beside); the
        views of every position, the new ones included.  :meth:`_commit`
        makes them part of the cache."""
        n, t = self._n, k.shape[-2]
        dtype = self._storage(k.dtype)
        if self.int8:
            g = self.group if self.group is not None else 32
            (k, ks), (v, vs) = (quantize_kv(x.astype(np.float32, copy=False),
                                            g) for x in (k, v))
        if self.static:                        # the memory itself
            # converted once, here; in the layer's dtype, not copied
            self._k = k.astype(dtype, copy=False)
            self._v = v.astype(dtype, copy=False)
            if self.int8:
                self._ks, self._vs = ks, vs
            return self._k, self._v
        cap = 0 if self._k is None else self._k.shape[-2]
        if n + t > cap:
            new = (self.max_len if self.max_len is not None
                   else max(16, n + t, 2 * cap))
            self._k, self._v = (self._grown(b, x, new, n, dtype) for b, x in
                                ((self._k, k), (self._v, v)))
            if self.int8:
                self._ks, self._vs = (
                    self._grown(b, x, new, n, np.dtype(np.float32))
                    for b, x in ((self._ks, ks), (self._vs, vs)))
        assert self._k is not None and self._v is not None
        self._k[..., n:n + t, :] = k
        self._v[..., n:n + t, :] = v
        if self.int8:
            assert self._ks is not None and self._vs is not None
            self._ks[..., n:n + t, :] = ks
            self._vs[..., n:n + t, :] = vs
        return self._k[..., :n + t, :], self._v[..., :n + t, :]

    @staticmethod
    def _grown(buf: Array | None, x: Array, cap: int, n: int,
               dtype: np.dtype[Any]) -> Array:
        """A buffer shaped as x but with cap positions, buf's first n
        positions copied in."""
        out = np.empty((*x.shape[:-2], cap, x.shape[-1]), dtype)
        if n:
            assert buf is not None
            out[..., :n, :] = buf[..., :n, :]
        return out

    def _commit(self, n: int) -> None:
        """The call succeeded: the cache holds ``n`` positions."""
        self._n = n
