"""The attention of today's models, in plain NumPy (docs/contract.md
section 8): sliding windows, packed sequences, soft-capping, ALiBi slopes
and sinks, as keyword arguments of the dot and general scores.

Positions.  Query i of Tq and key t of T are aligned bottom-right, as
``causal`` is: query i sits at key position i' = i + (T - Tq), so the last
query sits at the last key.  With packed sequences (``cu_seqlens_q``,
``cu_seqlens_k``: the Tq and T axes hold n sequences back to back, the
s-th being queries cu_q[s]..cu_q[s+1] and keys cu_k[s]..cu_k[s+1]) this
holds inside each sequence, and a query sees only its own sequence's keys.
Everything below is written with ``rel_it = t - i'`` (within the
sequence): the key's offset from the query's own position.

    causal         visible iff rel_it <= 0
    window (l, r)  visible iff -l <= rel_it <= r     (None: unbounded)
    softcap c      s <- c tanh(s / c)                 on the scaled score
    alibi_slopes m s <- s - m abs(rel_it)             one slope a sequence
    sinks z        lse_i = log(exp(z) + sum_t exp(s_it))   no value

So causal, window and packing each give every query a contiguous range of
keys: the kernels never compute a block of (queries, keys) outside its
queries' ranges.  Here, for reading, every (query, key) pair is formed.
"""

import numbers

import numpy as np


def _check_window(window):
    """(left, right) with None for an unbounded side, or None."""
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right) of ints >= 0 "
                         f"or None, got {window!r}") from None
    for side, x in (("left", left), ("right", right)):
        if x is None:
            continue
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"window {side} side must be an int >= 0 or "
                            f"None, got {x!r}")
        if x < 0:
            raise ValueError(f"window {side} side must be >= 0 (None for "
                             f"unbounded), got {x}")
    return left, right


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, Tq, T):
    """The packed sequences' boundaries as int64 arrays, checked."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return None
    if cu_seqlens_q is None or cu_seqlens_k is None:
        given = "cu_seqlens_q" if cu_seqlens_k is None else "cu_seqlens_k"
        raise ValueError(f"{given} needs the other one: cu_seqlens_q and "
                         f"cu_seqlens_k go together")
    out = []
    for name, cu, n in (("cu_seqlens_q", cu_seqlens_q, Tq),
                        ("cu_seqlens_k", cu_seqlens_k, T)):
        cu = np.asarray(cu)
        if not np.issubdtype(cu.dtype, np.integer):
            raise TypeError(f"{name} must be an integer array, not "
                            f"{cu.dtype}")
        if cu.ndim != 1 or cu.size < 2:
            raise ValueError(f"{name} must be 1-D with n + 1 >= 2 entries, "
                             f"got shape {cu.shape}")
        if cu[0] != 0 or cu[-1] != n or np.any(np.diff(cu) < 0):
            raise ValueError(f"{name} must rise from 0 to {n} (the length "
                             f"of its axis) without decreasing, got "
                             f"{cu.tolist()}")
        out.append(cu.astype(np.int64))
    if out[0].size != out[1].size:
        raise ValueError(f"cu_seqlens_q ({out[0].size} entries) and "
                         f"cu_seqlens_k ({out[1].size}) must hold the same "
                         f"number of sequences")
    return out


def _relative_positions(Tq, T, cu_seqlens_q=None, cu_seqlens_k=None):
    """(same, rel), each (Tq, T): same_it, query i and key t are of the
    same packed sequence (all True without packing); rel_it = t - i' with
    both positions taken within that sequence."""
    i, t = np.arange(Tq), np.arange(T)
    cu = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, Tq, T)
    if cu is None:
        return np.ones((Tq, T), bool), t[None, :] - (i + (T - Tq))[:, None]
    cq, ck = cu
    # the sequence of each query and key (the last one starting at or
    # before it: empty sequences hold nobody)
    sq = np.searchsorted(cq, i, side="right") - 1
    sk = np.searchsorted(ck, t, side="right") - 1
    len_q, len_k = np.diff(cq)[sq], np.diff(ck)[sq]
    i_pos = (i - cq[sq]) + (len_k - len_q)           # i' in its sequence
    rel = (t - ck[sk])[None, :] - i_pos[:, None]
    return sq[:, None] == sk[None, :], rel


def key_ranges(Tq, T, causal=False, window=None, cu_seqlens_q=None,
               cu_seqlens_k=None):
    """(Tq, T) booleans: key t lies in query i's range, the keys that
    causal, window and packing leave it (before the masks)."""
    same, rel = _relative_positions(Tq, T, cu_seqlens_q, cu_seqlens_k)
    seen = same
    left, right = _check_window(window) or (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        seen = seen & (rel >= -left)
    if right is not None:
        seen = seen & (rel <= right)
    return seen


def _check_softcap(softcap):
    if softcap is None:
        return None
    if (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
            or not softcap > 0 or not np.isfinite(softcap)):
        raise ValueError(f"softcap must be a number > 0 (None: off), got "
                         f"{softcap!r}")
    return float(softcap)


def softcap_scores(s, softcap):
    """c tanh(s / c): scores squashed into (-c, c), nearly s where |s| << c
    (Gemma 2 caps its attention logits so)."""
    return s if softcap is None else softcap * np.tanh(s / softcap)


def per_sequence(name, x, lead):
    """alibi_slopes or sinks as an array of the leading shape ``lead`` of
    the result (one value a sequence and head), checked: it broadcasts to
    ``lead`` by NumPy's rules without adding axes (0-d: one value)."""
    if x is None:
        return None
    x = np.asarray(x)
    if x.dtype == bool or not np.issubdtype(x.dtype, np.number) or \
            np.iscomplexobj(x):
        raise TypeError(f"{name} must be a real float array, not {x.dtype}")
    try:
        ok = np.broadcast_shapes(x.shape, lead) == lead
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to "
                         f"{lead}, the leading axes of the result (one "
                         f"value a sequence and head)")
    return np.broadcast_to(x, lead)


def alibi_term(slopes, rel):
    """-m abs(rel_it), (lead, Tq, T): a penalty that grows with the distance
    between the query's position and the key's (Press et al. 2022, with
    FlashAttention's sign and symmetric distance)."""
    return -slopes[..., None, None] * np.abs(rel)
