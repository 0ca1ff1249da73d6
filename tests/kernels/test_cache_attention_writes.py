"""What ``cache_attention`` (issue 34) writes into the key-value caches,
contiguous and paged: the new keys and values appended in place, and
nothing when an argument is refused.  The cases, the reference and the
tolerances are test_cache_attention.py's (cache_attention_cases.py).
Proven here:

* the append: exactly the slots cache_seqlens[b] .. + Tn - 1 change, to
  the new rows rounded to the cache's dtype (to nearest even, ties
  included), across block boundaries; cache_seqlens is not changed; the
  other inputs neither;
* bad arguments refused with an error naming the argument, before
  anything is written.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c.testing import assert_identical, misaligned

from cache_attention_cases import (BF16, Case, F16, SHAPES, appended_slots,
                                   assert_matches, cache_dtypes_id,
                                   computing, half_pairs, variant_kwargs)

pytestmark = pytest.mark.filterwarnings("error")


# --------------------------------------------------------------------------
# the append in place

def is_half(dtype):
    return np.dtype(dtype) == F16 or (BF16 is not None
                                      and np.dtype(dtype) == BF16)


def ties(rng, shape, dtype):
    """float32 values, a third of them exactly halfway between two
    neighbours of the 16-bit dtype (rounding to nearest even decides)."""
    x = rng.standard_normal(shape).astype(np.float32)
    x = (np.sign(x) * (np.abs(x) + 0.01)).astype(np.float32)
    if is_half(dtype):
        low = np.uint32(0x1000 if dtype == F16 else 0x8000)
        base = x.astype(dtype).astype(np.float32).view(np.uint32)
        tie = (base | low).view(np.float32)
        x = np.where(rng.random(shape) < 1 / 3, tie, x)
    return x


@pytest.mark.parametrize("layout", ["contiguous", 1, 16],
                         ids=lambda x: x if isinstance(x, str)
                         else f"paged{x}")
@pytest.mark.parametrize("pair", [(np.float32, np.float32),
                                  (np.float64, np.float64)] + half_pairs(),
                         ids=cache_dtypes_id)
def test_append_in_place(layout, pair):
    """Slot by slot: the slots of positions cache_seqlens[b] .. + Tn - 1
    hold the new rows cast to the cache's dtype (16-bit: to nearest even,
    ties included), every other slot its old bits (NaN included); across
    a block boundary; cache_seqlens unchanged."""
    rng = np.random.default_rng(12)
    comp = computing(*pair)
    c = Case(rng, (3, 2, 4, 2, 9, 7, [15, 0, 30], 3), comp, *pair)
    c.k = ties(rng, c.k.shape, pair[0]).astype(c.k.dtype)
    c.v = ties(rng, c.v.shape, pair[1]).astype(c.v.dtype)
    if layout == "contiguous":
        kc, vc, table, bs = c.kc.copy(), c.vc.copy(), None, None
    else:
        bs = layout
        kc, vc, table = c.paged(rng, bs, "garbage")
    before = kc.copy(), vc.copy()
    lens, tab = c.seqlens.copy(), None if table is None else table.copy()
    got = c.call(kc, vc, table)
    assert_identical(c.seqlens, lens, "cache_seqlens")
    if table is not None:
        assert_identical(table, tab, "block_table")
    changed = appended_slots(c.seqlens, c.Tn, table, bs)
    assert len(changed) == c.B * c.Tn
    for cache, old, new in ((kc, before[0], c.k), (vc, before[1], c.v)):
        for slot in np.ndindex(cache.shape[:2]):
            if slot in changed:
                b, j = changed[slot]
                row = new[b, j].astype(cache.dtype)
                assert_identical(cache[slot], row, f"new slot {slot}")
                assert not np.array_equal(cache[slot], old[slot])
            else:
                assert cache[slot].tobytes() == old[slot].tobytes(), (
                    f"slot {slot} changed")
    assert_matches(c, got, c.want()[0], comp, "after the append")


def test_append_rounding_to_nearest_even():
    """The new rows' 16-bit bits from the float32 bits, written out:
    round to nearest, ties to even (no NumPy cast as oracle)."""
    rng = np.random.default_rng(13)
    for dtype in [t for t in (F16, BF16) if t is not None]:
        c = Case(rng, (1, 1, 2, 1, 64, 64, [0], 1), np.float32, dtype)
        x = ties(rng, c.k.shape, dtype)
        c.k = x
        kc, vc = c.kc.copy(), c.vc.copy()
        c.call(kc, vc)
        bits = kc[0, 0].view(np.uint16).astype(np.uint32).ravel()
        u = x.view(np.uint32).ravel()
        if dtype == BF16:
            want = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        else:                      # normal float16 range: |x| in [0.01, 6)
            sign = (u >> 31) << 15
            exp = ((u >> 23) & 0xFF).astype(np.int64) - 127 + 15
            man = u & 0x7FFFFF
            r = (man + 0xFFF + ((man >> 13) & 1)) >> 13    # may carry
            want = sign + ((exp.astype(np.uint32) << 10) + r)
        assert np.array_equal(bits, want.astype(np.uint32)), dtype


def test_inputs_unchanged():
    """query, k, v, block_table and cache_seqlens (int32 and int64) are
    left as they were; the caches change only by the append."""
    rng = np.random.default_rng(14)
    for lens_dtype in (np.int32, np.int64):
        c = Case(rng, SHAPES[4], np.float32)
        c.seqlens = c.seqlens.astype(lens_dtype)
        kp, vp, table = c.paged(rng, 16, "garbage")
        saved = [x.copy() for x in (c.q, c.k, c.v, table, c.seqlens)]
        kw = variant_kwargs("all", rng, c.B, c.Hq, np.float32)
        extra = [kw["alibi_slopes"].copy(), kw["sinks"].copy()]
        c.call(kp, vp, table, **kw)
        for x, y, name in zip((c.q, c.k, c.v, table, c.seqlens,
                               kw["alibi_slopes"], kw["sinks"]),
                              saved + extra,
                              ("query", "k", "v", "block_table",
                               "cache_seqlens", "alibi_slopes", "sinks")):
            assert_identical(x, y, name)


# --------------------------------------------------------------------------
# bad arguments: refused before anything is written

def bad_case(name):
    """(case, caches, block_table, keyword changes, error, pattern)."""
    rng = np.random.default_rng(18)
    c = Case(rng, (3, 2, 4, 2, 8, 6, [3, 16, 5], 2), np.float32)
    kp, vp, table = c.paged(rng, 16)
    contiguous = (c.kc.copy(), c.vc.copy())
    paged = (kp, vp)
    nb = kp.shape[0]
    kw = {}
    if name == "block_out_of_range":
        table[2, 0] = nb
        return c, paged, table, kw, ValueError, "block_table"
    if name == "block_negative_used":
        table[1, 0] = -1
        return c, paged, table, kw, ValueError, "block_table"
    if name == "block_used_by_append_only":
        # sequence 1 fills its first block; the append needs its second
        table[1, 1] = nb + 7
        return c, paged, table, kw, ValueError, "block_table"
    if name == "beyond_capacity":
        c.seqlens[2] = c.S - c.Tn + 1
        return c, contiguous, None, kw, ValueError, "cache_seqlens"
    if name == "beyond_capacity_paged":
        # one more key than the table's blocks hold, every entry valid
        c.seqlens[2] = table.shape[1] * 16 - c.Tn + 1
        kp, vp, table = c.paged(rng, 16)
        assert (table[2] >= 0).all()
        return c, (kp, vp), table, kw, ValueError, "cache_seqlens"
    if name == "negative_seqlens":
        c.seqlens[1] = -1
        return c, contiguous, None, kw, ValueError, "cache_seqlens"
    if name == "heads_not_multiple":
        c.q = rng.standard_normal((3, 2, 3, 8)).astype(np.float32)
        return c, contiguous, None, kw, ValueError, "query|k_cache"
    if name == "k_without_v":
        c.v = None
        return c, contiguous, None, kw, (TypeError, ValueError), r"\bv\b"
    if name == "v_without_k":
        c.k = None
        return c, contiguous, None, kw, (TypeError, ValueError), r"\bk\b"
    if name == "query_d_mismatch":
        c.q = rng.standard_normal((3, 2, 4, 9)).astype(np.float32)
        return c, contiguous, None, kw, ValueError, "query|k_cache"
    if name == "k_d_mismatch":
        c.k = rng.standard_normal((3, 2, 2, 9)).astype(np.float32)
        return c, contiguous, None, kw, ValueError, r"\bk\b"
    if name == "v_dv_mismatch":
        c.v = rng.standard_normal((3, 2, 2, 7)).astype(np.float32)
        return c, contiguous, None, kw, ValueError, r"\bv\b"
    if name == "int16_cache":
        kc = rng.integers(-9, 9, contiguous[0].shape).astype(np.int16)
        return c, (kc, contiguous[1]), None, kw, TypeError, "k_cache"
    if name == "float64_query_float32_cache":
        c.q = c.q.astype(np.float64)
        return c, contiguous, None, kw, TypeError, "query"
    if name == "float64_query_half_cache":
        c.q = c.q.astype(np.float64)
        return (c, tuple(x.astype(np.float16) for x in contiguous), None,
                kw, TypeError, "query")
    if name == "k_cache_last_axis_strided":
        kc = np.repeat(contiguous[0], 2, axis=-1)[..., ::2]
        return c, (kc, contiguous[1]), None, kw, ValueError, "k_cache"
    if name == "v_cache_last_axis_strided":
        vc = np.repeat(contiguous[1], 2, axis=-1)[..., ::2]
        return c, (contiguous[0], vc), None, kw, ValueError, "v_cache"
    if name == "v_cache_read_only":      # k_cache is checked first
        contiguous[1].flags.writeable = False
        return c, contiguous, None, kw, ValueError, "v_cache.*read-only"
    if name == "v_cache_unaligned":
        vc = misaligned(contiguous[1])
        assert not vc.flags.aligned
        return c, (contiguous[0], vc), None, kw, ValueError, "v_cache"
    raise AssertionError(name)


BAD = ["block_out_of_range", "block_negative_used",
       "block_used_by_append_only", "beyond_capacity",
       "beyond_capacity_paged", "negative_seqlens", "heads_not_multiple",
       "k_without_v", "v_without_k", "query_d_mismatch", "k_d_mismatch",
       "v_dv_mismatch", "int16_cache", "float64_query_float32_cache",
       "float64_query_half_cache", "k_cache_last_axis_strided",
       "v_cache_last_axis_strided", "v_cache_read_only",
       "v_cache_unaligned"]


@pytest.mark.parametrize("name", BAD)
def test_refused(name):
    """Each bad argument raises an error naming it, and the caches keep
    their bits: nothing is written before the checks (the other
    sequences' appends included)."""
    c, (kc, vc), table, kw, error, pattern = bad_case(name)
    before = kc.copy(), vc.copy()
    with pytest.raises(error, match=pattern) as info:
        c.call(kc, vc, table, **kw)
    if name == "int16_cache":            # the accepted dtypes named
        for accepted in ["float32", "float64", "float16", "int8"] + (
                ["bfloat16"] if BF16 is not None else []):
            assert accepted in str(info.value), (accepted, str(info.value))
    assert kc.tobytes() == before[0].tobytes(), "k_cache written"
    assert vc.tobytes() == before[1].tobytes(), "v_cache written"


def test_seqlens_beyond_int64_named():
    """A uint64 length past int64 is named as given, not wrapped."""
    c = Case(np.random.default_rng(19), SHAPES[0])
    lens = np.array([2 ** 64 - 1], np.uint64)
    with pytest.raises(ValueError, match=f"cache_seqlens.*{2 ** 64 - 1}"):
        ac.cache_attention(c.q, c.kc, c.vc, lens)


def test_table_shape_is_a_value_error():
    c = Case(np.random.default_rng(19), SHAPES[0])
    with pytest.raises(ValueError, match="block_table must have 2 axes"):
        ac.cache_attention(c.q, c.kc, c.vc, c.seqlens,
                           block_table=np.zeros(3, np.int64))
