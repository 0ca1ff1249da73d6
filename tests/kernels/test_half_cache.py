"""Decoding against keys and values stored in 16 bits (float16, and
ml_dtypes' bfloat16 when installed): a float32 call reads them where they
are, each element widened as it is loaded (csrc/simd/decode.inc,
core/half.h), with no float32 copy of the cache.

* every 16-bit pattern widened exactly, by the vector loads and by the
  scalar columns past them, on every SIMD path;
* the results are those of the float32 call on the widened arrays, bit
  for bit: sizes 1, 3, 17, 65 and 128 wide, one to four queries, grouped
  heads, every decoding argument (mask, causal, window, softcap, ALiBi,
  sinks, dropout, weights or lse), strided caches, keys that are the
  values, the general score's values, non-finite values where no query
  sees them; every SIMD path; 1, 2 and 3 threads with a cache long
  enough to be split;
* nothing of the cache's size is allocated;
* 16-bit queries too: the results come back in their dtype, the float32
  call's rounded once (the log-sum-exp stays float32).

Exact comparisons throughout: widening is exact, and the kernels sum the
widened elements as they sum float32 ones.
"""

import tracemalloc

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c.testing import HALF_DTYPES, assert_rounded

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())
half_param = pytest.mark.parametrize("dtype", HALF_DTYPES,
                                     ids=lambda d: np.dtype(d).name)
simd_param = pytest.mark.parametrize("simd", SIMD_PATHS)


def widened(x):
    return None if x is None else x.astype(np.float32)


def assert_same(got, want, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, (what, i)
        assert np.array_equal(g, w, equal_nan=True), (
            f"{what} output {i}: max |diff| "
            f"{np.nanmax(np.abs(g.astype(float) - w.astype(float)))}")


def every_pattern(dtype):
    """All 65536 bit patterns of a 16-bit dtype (NaNs included)."""
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype)


@pytest.mark.usefixtures("restore_settings")
@simd_param
@half_param
@pytest.mark.parametrize("width", [65536, 65535 - 14])
def test_every_pattern_widened_exactly(dtype, simd, width):
    """One key of weight 1: out = the value row, each element widened;
    a width that is no multiple of a vector leaves scalar columns."""
    _core._set_simd(simd)
    v = every_pattern(dtype)[:width].reshape(1, 1, width)
    q = np.ones((1, 1, 1), np.float32)
    k = np.ones((1, 1, 1), dtype)
    out, lse = ac.dot_attention(q, k, values=v, return_weights=False)
    want = v.astype(np.float32)
    assert lse[0, 0] == 1              # the one score, q . k
    assert np.array_equal(out, want, equal_nan=True)
    assert np.array_equal(np.isnan(out), np.isnan(want))


@pytest.mark.usefixtures("restore_settings")
@simd_param
@half_param
def test_key_patterns_widened_exactly(dtype, simd):
    """Every finite 16-bit key element against a query of one 1: the
    scores are the elements themselves (the weights show them)."""
    _core._set_simd(simd)
    p = every_pattern(dtype)
    p = p[np.isfinite(p.astype(np.float32))]
    k = p.reshape(-1, 1)[:, :, None].transpose(1, 0, 2)   # (1, n, 1)
    q = np.ones((1, 1, 1), np.float32)
    _, w = ac.dot_attention(q, k, values=np.zeros((1, k.shape[1], 1),
                                                  np.float32), scale=1.0,
                            return_weights=True)
    want = ac.dot_attention(q, k.astype(np.float32),
                            values=np.zeros((1, k.shape[1], 1), np.float32),
                            scale=1.0, return_weights=True)[1]
    assert np.array_equal(w, want)


KINDS = ["plain", "mask", "causal", "window", "softcap", "alibi", "sinks",
         "dropout", "all"]


def make_case(rng, dtype, B, G, Tq, T, d, dv, kind):
    """Queries (B, G, Tq, d) float32 against one cache head per sequence:
    keys (B, 1, T, d), values (B, 1, T, dv) in dtype, as slices of a
    longer cache; keyword arguments of kind."""
    q = rng.standard_normal((B, G, Tq, d)).astype(np.float32)
    k = rng.standard_normal((B, 1, T + 7, d)).astype(dtype)[:, :, :T]
    v = rng.standard_normal((B, 1, T + 7, dv)).astype(dtype)[:, :, :T]
    kw = {"values": v}
    if kind in ("mask", "all"):
        mask = rng.random((B, 1, T)) < 0.7
        mask[0] = False                       # a sequence sees nothing
        kw["mask"] = mask
    if kind in ("causal", "all"):
        kw["causal"] = True
    if kind == "window":
        kw["window"] = (3, 0)
    if kind in ("softcap", "all"):
        kw["softcap"] = 5.0
    if kind in ("alibi", "all"):
        kw["alibi_slopes"] = rng.random((B, G)).astype(np.float32)
        kw["causal"] = True
    if kind in ("sinks", "all"):
        kw["sinks"] = rng.standard_normal((B, G)).astype(np.float32)
    if kind in ("dropout", "all"):
        kw.update(dropout=0.25, seed=12345)
    return q, k, kw


def check_as_widened(q, k, kw, rw, what=""):
    """The call on the 16-bit cache (read in place) and on its widened
    copy: the same bits."""
    wide = dict(kw, values=widened(kw.get("values")))
    got = ac.dot_attention(q, k, **kw, return_weights=rw)
    want = ac.dot_attention(q, widened(k), **wide, return_weights=rw)
    assert got[0].dtype == np.float32
    assert_same(got, want, what)


@pytest.mark.usefixtures("restore_settings")
@simd_param
@half_param
@pytest.mark.parametrize("kind", KINDS)
def test_as_widened_every_argument(dtype, simd, kind):
    _core._set_simd(simd)
    rng = np.random.default_rng(31)
    for (B, G, Tq, T, d, dv) in [(1, 1, 1, 1, 1, 1), (2, 3, 1, 17, 3, 65),
                                 (3, 4, 3, 65, 17, 17),
                                 (1, 8, 4, 300, 128, 128),
                                 (2, 2, 2, 129, 65, 3)]:
        q, k, kw = make_case(rng, dtype, B, G, Tq, T, d, dv, kind)
        for rw in (False, True):
            check_as_widened(q, k, kw, rw, f"{kind} {B, G, Tq, T, d, dv}")


@pytest.mark.usefixtures("restore_settings")
@simd_param
@half_param
def test_layouts_keys_as_values_and_mixed(dtype, simd):
    """Transposed (B, T, h, d) caches, negative strides, keys that are
    the values, 16-bit keys with float32 values and the reverse, float16
    keys with bfloat16 values: each as widened."""
    _core._set_simd(simd)
    rng = np.random.default_rng(32)
    q = rng.standard_normal((2, 4, 1, 33)).astype(np.float32)
    buf = rng.standard_normal((2, 2, 70, 4, 33)).astype(dtype)
    k = buf[0, :, :61].transpose(0, 2, 1, 3)           # (2, 4, 61, 33)
    v = buf[1, :, ::-1][:, :61].transpose(0, 2, 1, 3)   # negative strides
    for kw in ({"values": v}, {}, {"values": widened(v)}):
        check_as_widened(q, k, kw, False, f"{sorted(kw)}")
    check_as_widened(q, widened(k), {"values": v}, False, "float32 keys")
    other = [t for t in HALF_DTYPES if t != dtype]
    if other:
        check_as_widened(q, k, {"values": v.astype(other[0])}, False,
                         "mixed 16-bit")


@pytest.mark.usefixtures("restore_settings")
@simd_param
@half_param
def test_general_score_values(dtype, simd):
    """The general score reads its values in place (its keys are
    projected, so cast): as widened."""
    _core._set_simd(simd)
    rng = np.random.default_rng(33)
    q = rng.standard_normal((3, 2, 9)).astype(np.float32)
    k = rng.standard_normal((3, 40, 5)).astype(dtype)
    v = rng.standard_normal((3, 50, 7)).astype(dtype)[:, :40]
    W = rng.standard_normal((9, 5)).astype(np.float32)
    got = ac.general_attention(q, k, W, values=v, return_weights=False)
    want = ac.general_attention(q, widened(k), W, values=widened(v),
                                return_weights=False)
    assert_same(got, want, "general")


@half_param
def test_nonfinite_only_where_seen(dtype):
    """Infinities and NaNs in cache rows a query does not see (masked,
    past a causal end) reach nothing; where seen, what float32 gives."""
    rng = np.random.default_rng(34)
    q, k, kw = make_case(rng, dtype, 2, 4, 2, 40, 16, 16, "plain")
    k, v = k.copy(), kw["values"].copy()
    k[0, 0, 5, 3] = np.inf
    v[0, 0, 6, 2] = np.nan
    v[1, 0, 39, 0] = -np.inf
    mask = np.ones((2, 1, 40), bool)
    mask[0, :, 5:7] = False
    for extra in ({"mask": mask}, {"mask": mask, "causal": True}, {}):
        check_as_widened(q, k, dict(kw, values=v, **extra), False,
                         f"{sorted(extra)}")
    out = ac.dot_attention(q, k, values=v, mask=mask, causal=True,
                           return_weights=False)[0]
    assert np.all(np.isfinite(out[0])) and not np.all(np.isfinite(out[1]))


@pytest.mark.usefixtures("restore_settings")
@half_param
def test_threads_bitwise_split_cache(dtype):
    """A cache long enough to be split across threads (and a batch of
    sequences): bitwise the same for 1, 2 and 3 threads, and as widened."""
    rng = np.random.default_rng(35)
    for (B, G) in ((1, 4), (5, 2)):
        q, k, kw = make_case(rng, dtype, B, G, 1, 5000, 64, 64, "mask")
        ac.set_num_threads(1)
        one = ac.dot_attention(q, k, **kw, return_weights=False)
        check_as_widened(q, k, kw, False, "1 thread")
        for n in (2, 3):
            ac.set_num_threads(n)
            assert_same(ac.dot_attention(q, k, **kw, return_weights=False),
                        one, f"{n} threads")


@half_param
def test_cache_read_in_place(dtype):
    """A decoding call on a strided 16-bit cache allocates nothing of the
    cache's size (no widened copy)."""
    rng = np.random.default_rng(36)
    B, h, T, d = 1, 4, 4096, 32        # 1 MiB of 16-bit keys
    q = rng.standard_normal((B, h, 1, d)).astype(np.float32)
    k = rng.standard_normal((B, T + 3, h, d)).astype(dtype)[:, :T]
    v = rng.standard_normal((B, T + 3, h, d)).astype(dtype)[:, :T]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    call = lambda: ac.dot_attention(q, k, values=v,       # noqa: E731
                                    return_weights=False)
    call()                                           # scratch made
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        call()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < B * h * T * d * 2 // 8


@half_param
@pytest.mark.parametrize("rw", [False, True], ids=["lse", "weights"])
def test_half_queries_round_once(dtype, rw):
    """Queries, keys and values all 16-bit: the results in that dtype (the
    log-sum-exp float32), the float32 call's on the widened inputs
    rounded once; the inputs unchanged."""
    rng = np.random.default_rng(37)
    q, k, kw = make_case(rng, dtype, 2, 4, 2, 77, 40, 24, "causal")
    q = q.astype(dtype)
    before = [x.copy() for x in (q, k, kw["values"])]
    got = ac.dot_attention(q, k, **kw, return_weights=rw)
    want = ac.dot_attention(widened(q), widened(k),
                            **dict(kw, values=widened(kw["values"])),
                            return_weights=rw)
    assert_rounded(got, want, dtype, "16-bit call", lse=None if rw else 1)
    for x, y in zip(before, (q, k, kw["values"])):
        assert x.tobytes() == y.tobytes()


@half_param
@pytest.mark.parametrize("rw", [False, True], ids=["lse", "weights"])
def test_half_copies_kept_between_calls(dtype, rw):
    """A 16-bit call's float32 copies of its inputs and its outputs before
    rounding live in buffers kept between calls: a second call allocates
    its results alone (mapping those copies afresh faulted their pages in
    at every call: 1.5x the time of a forward at (8, 1024, 64)), and the
    results of one call are not touched by the next."""
    rng = np.random.default_rng(38)
    shape = (1, 4, 256, 32)
    q, k, v = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    call = lambda x: ac.dot_attention(x, k, values=v,       # noqa: E731
                                      causal=True, return_weights=rw)
    first = call(q)
    held = [np.array(x, copy=True) for x in first]
    results = sum(x.nbytes for x in first)
    q2 = np.ascontiguousarray(q[..., ::-1, :])
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        second = call(q2)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    widened_bytes = 2 * 3 * q.nbytes          # float32 copies of q, k, v
    assert peak < results + widened_bytes // 4, (peak, results)
    for x, y in zip(first, held):
        assert x.tobytes() == y.tobytes()
    assert first[0].tobytes() != second[0].tobytes()


@pytest.mark.usefixtures("restore_settings")
@half_param
def test_half_calls_from_threads(dtype):
    """Python threads calling with 16-bit inputs at once (one holds the
    kept buffers, the others allocate their own) get the serial results."""
    import threading
    rng = np.random.default_rng(39)
    probs = [tuple(rng.standard_normal((2, 3, 65, 17)).astype(dtype)
                   for _ in range(3)) for _ in range(4)]
    want = [ac.dot_attention(q, k, values=v, return_weights=False)[0]
            for q, k, v in probs]
    ac.set_num_threads(2)
    errors = []

    def work(i):
        q, k, v = probs[i]
        for _ in range(30):
            got = ac.dot_attention(q, k, values=v, return_weights=False)[0]
            if got.tobytes() != want[i].tobytes():
                errors.append(i)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.usefixtures("restore_settings")
@half_param
def test_half_conversions_on_threads(dtype):
    """Arrays of more than two chunks (2^16 elements) are widened and
    rounded on the call's threads: on 2 threads the results are the
    float32 call's on the widened inputs rounded once, bit for bit, as on
    one."""
    rng = np.random.default_rng(40)
    q, k, v = (rng.standard_normal((2, 4, 300, 64)).astype(dtype)
               for _ in range(3))
    assert q.size > 2 * 2 ** 16
    want = ac.dot_attention(widened(q), widened(k), values=widened(v),
                            causal=True)
    got = {}
    for n in (1, 2):
        ac.set_num_threads(n)
        got[n] = ac.dot_attention(q, k, values=v, causal=True)
        assert_rounded(got[n], want, dtype, f"{n} threads")
    for a, b in zip(got[1], got[2]):
        assert a.tobytes() == b.tobytes()
