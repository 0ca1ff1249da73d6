"""The decoding cache of :class:`.multihead.MultiHeadAttention`:
:class:`KVCache` keeps the projected keys and values of a decoder between
calls, in a preallocated buffer that a one-token step appends to and
attends to without copying it (re-exported by attention_c.multihead).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._keywords import keyword_only
from ._common import Array, _positive

__all__ = ["KVCache"]


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

    Attributes
    ----------
    keys, values : ndarray (..., h, n, d) or None
        Views of the cached projected keys and values (None when empty).

    Notes
    -----
    A cache belongs to one layer and one batch shape, fixed by its first
    call; :meth:`reset` empties it for a new sequence (a non-static cache
    keeps its buffer, so a new sequence allocates nothing).

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
    """

    @keyword_only
    def __init__(self, max_len: int | None = None, *,
                 static: bool = False) -> None:
        if max_len is not None:
            if isinstance(max_len, bool) or not isinstance(
                    max_len, (int, np.integer)):
                raise TypeError(f"max_len must be an int or None, got "
                                f"{type(max_len).__name__}")
            _positive(max_len=int(max_len))
            max_len = int(max_len)
        self.max_len = max_len
        self.static = bool(static)
        self._k: Array | None = None       # (..., h, capacity, d)
        self._v: Array | None = None
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def keys(self) -> Array | None:
        return None if self._k is None else self._k[..., :self._n, :]

    @property
    def values(self) -> Array | None:
        return None if self._v is None else self._v[..., :self._n, :]

    def reset(self) -> None:
        """Empty the cache (a static cache forgets its memory)."""
        self._n = 0
        if self.static:
            self._k = self._v = None

    def __repr__(self) -> str:
        return (f"KVCache(max_len={self.max_len}, static={self.static}, "
                f"len={self._n})")

    # ------------------------------------------------------------------
    # Used by MultiHeadAttention: check, write beyond the end, then commit
    # once the attention has succeeded (a failed call changes nothing
    # visible).

    def _check_new(self, lead: tuple[int, ...], h: int, dv: int, d: int,
                   dtype: np.dtype[Any], t: int) -> None:
        """ValueError unless keys (lead, h, t, d) and values (lead, h, t,
        dv) can join the cache."""
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
        if self.max_len is not None and self._n + t > self.max_len:
            raise ValueError(
                f"the cache is full: it holds {self._n} of max_len="
                f"{self.max_len} positions and the call adds {t}")

    def _stage(self, lead: tuple[int, ...], k: Array, v: Array
               ) -> tuple[Array, Array]:
        """Write k, v (..., h, t, d) after the cached positions; the views
        of every position, the new ones included.  :meth:`_commit` makes
        them part of the cache."""
        n, t = self._n, k.shape[-2]
        if self.static:                        # the memory itself
            self._k, self._v = k, v
            return k, v
        cap = 0 if self._k is None else self._k.shape[-2]
        if n + t > cap:
            new = (self.max_len if self.max_len is not None
                   else max(16, n + t, 2 * cap))
            h = k.shape[-3]
            kb = np.empty((*lead, h, new, k.shape[-1]), k.dtype)
            vb = np.empty((*lead, h, new, v.shape[-1]), v.dtype)
            if n:
                assert self._k is not None and self._v is not None
                kb[..., :n, :] = self._k[..., :n, :]
                vb[..., :n, :] = self._v[..., :n, :]
            self._k, self._v = kb, vb
        assert self._k is not None and self._v is not None
        self._k[..., n:n + t, :] = k
        self._v[..., n:n + t, :] = v
        return self._k[..., :n + t, :], self._v[..., :n + t, :]

    def _commit(self, n: int) -> None:
        """The call succeeded: the cache holds ``n`` positions."""
        self._n = n
