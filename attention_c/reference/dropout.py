"""Dropout keep bits: Philox4x32-10 (Salmon, Moraes, Dror and Shaw,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011; Random123).

A counter-based generator: the bits for (seed, b, i, t) are a function of
those numbers alone, so the C kernel gets the same keep pattern for any
thread count and blocking, and the backward regenerates it instead of
storing it.  uint32 words are held in uint64 arrays so that the 32 x 32
-> 64-bit products are exact.
"""

import math

import numpy as np

_M32 = np.uint64(0xFFFFFFFF)
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_S32 = np.uint64(32)


def philox4x32(counter, key):
    """The 4 output words of Philox4x32-10 for counter (c0, c1, c2, c3)
    under key (k0, k1).

    Each word may be an int or an array of them (taken mod 2**32); arrays
    broadcast, and the words come back as uint32 arrays of the broadcast
    shape.  One round::

        p0 = M0 c0, p1 = M1 c2                      (64-bit products)
        (c0, c1, c2, c3) = (hi(p1) ^ c1 ^ k0, lo(p1), hi(p0) ^ c3 ^ k1,
                            lo(p0))

    then the key is bumped by the Weyl constants (k0 += W0, k1 += W1).
    """
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _M32
                      for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & _M32 for k in key)
    for _ in range(10):
        p0, p1 = _PHILOX_M[0] * c0, _PHILOX_M[1] * c2
        c0, c1, c2, c3 = ((p1 >> _S32) ^ c1 ^ k0, p1 & _M32,
                          (p0 >> _S32) ^ c3 ^ k1, p0 & _M32)
        k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
    shape = np.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape)
    return tuple(np.broadcast_to(c, shape).astype(np.uint32)
                 for c in (c0, c1, c2, c3))


def dropout_keep(seed, p, b, Tq, T):
    """keep (Tq, T) booleans of dropout rate p for flat batch index b.

    keep_it = (word t & 3 of philox(counter, key)) >= floor(p 2**32) with
    key = (seed mod 2**32, seed >> 32) and counter = (t >> 2, i, b mod
    2**32, b >> 32): one Philox call gives the bits of 4 keys.  ``b`` may
    also be an array of batch indices: the result is then b.shape + (Tq,
    T).  The fraction kept is 1 - p (within 2**-32).
    """
    seed, b = int(seed), np.asarray(b, dtype=np.uint64)[..., None, None]
    blocks = (T + 3) // 4
    i = np.arange(Tq, dtype=np.uint64)[:, None]        # (Tq, 1)
    t4 = np.arange(blocks, dtype=np.uint64)[None, :]   # (1, blocks) = t >> 2
    words = philox4x32((t4, i, b & _M32, b >> _S32),
                       (seed & 0xFFFFFFFF, seed >> 32))
    # word j of block t4 is key t = 4 t4 + j: interleave, cut to T
    u = np.stack(words, axis=-1).reshape(b.shape[:-2] + (Tq, 4 * blocks))
    threshold = np.uint32(math.floor(p * 2**32))
    return u[..., :T] >= threshold


def _check_dropout(dropout, seed, Tq, T):
    """Refuse a dropout rate outside [0, 1) and a missing or bad seed."""
    dropout = 0.0 if dropout is None else dropout   # None: the default
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), not {dropout}")
    if dropout > 0:
        if seed is None:
            raise ValueError("dropout > 0 needs seed= (an int, "
                             "0 <= seed < 2**64)")
        if (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                or not 0 <= int(seed) < 2**64):
            raise ValueError(f"seed must be an int, 0 <= seed < 2**64, "
                             f"not {seed!r}")
        if Tq >= 2**32 or T >= 2**34:
            raise ValueError(f"dropout needs Tq < 2**32 and T < 2**34, "
                             f"not Tq = {Tq}, T = {T}")


def _dropout_factor(dropout, seed, lead, Tq, T, dtype):
    """keep_it / (1 - p) as (lead, Tq, T) in dtype, or None when p = 0.
    The flat batch index b is the row-major index in ``lead``."""
    if not dropout:                     # 0 or None
        return None
    b = np.arange(int(np.prod(lead))).reshape(lead)
    keep = dropout_keep(seed, dropout, b, Tq, T)
    return np.where(keep, dtype.type(1 / (1 - dropout)), dtype.type(0))
