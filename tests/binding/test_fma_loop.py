"""The FMA peak loop of each SIMD path (``_core._fma_loop``), which the
bench times for the machine's measured peak: it performs the flops it
documents (threads x 2 x lanes x accumulators x iters) on every path
this CPU runs, for float32 and float64, on one or several threads, and it
rejects a bad dtype, path, iteration or thread count with a clear error.
"""

import threading
import time

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core

# Lanes of a register and independent accumulators of each path's loop
# (csrc/simd/avx2.c, avx512.c, neon.c and ref/ops.c).
LANES = {"scalar": {"float32": 1, "float64": 1},
         "avx2": {"float32": 8, "float64": 4},
         "avx512": {"float32": 16, "float64": 8},
         "neon": {"float32": 4, "float64": 2}}
ACCUMULATORS = {"scalar": 12, "avx2": 12, "avx512": 24, "neon": 24}
PATHS = _core._simd_paths()


@pytest.mark.parametrize("simd", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("iters", [1, 7, 5000])
def test_flops_are_the_documented_count(simd, dtype, threads, iters):
    flops = _core._fma_loop(dtype, simd, iters, threads)
    assert isinstance(flops, float)
    assert flops == (threads * 2 * LANES[simd][dtype] * ACCUMULATORS[simd]
                     * iters)


def test_dtype_may_be_a_numpy_dtype_or_type():
    simd = PATHS[-1]
    want = _core._fma_loop("float64", simd, 100, 1)
    assert _core._fma_loop(np.float64, simd, 100, 1) == want
    assert _core._fma_loop(np.dtype("float64"), simd, 100, 1) == want
    assert _core._fma_loop("f8", simd, 100, 1) == want
    assert _core._fma_loop("float32", simd, 100, 1) == want * (
        LANES[simd]["float32"] / LANES[simd]["float64"])


@pytest.mark.parametrize("dtype", ["int32", "float16", "complex128",
                                   "no such type", None, 3])
def test_bad_dtype(dtype):
    with pytest.raises(ValueError,
                       match="dtype must be float32 or float64, got"):
        _core._fma_loop(dtype, "scalar", 10, 1)


def test_bad_or_unsupported_path():
    with pytest.raises(ValueError, match="unknown SIMD path 'sse2'"):
        _core._fma_loop("float32", "sse2", 10, 1)
    with pytest.raises(TypeError):
        _core._fma_loop("float32", 1, 10, 1)
    missing = [p for p in ("avx2", "avx512", "neon") if p not in PATHS]
    for simd in missing:
        with pytest.raises(ValueError,
                           match=f"this CPU cannot run the {simd} path"):
            _core._fma_loop("float32", simd, 10, 1)


@pytest.mark.parametrize("iters", [0, -1, -2**40])
def test_bad_iters(iters):
    with pytest.raises(ValueError, match=f"iters must be at least 1, got "
                                         f"{iters}"):
        _core._fma_loop("float32", "scalar", iters, 1)


@pytest.mark.parametrize("threads", [0, -1, 257])
def test_bad_threads(threads):
    with pytest.raises(ValueError, match=r"the number of threads must be "
                                         rf"in \[1, 256\], got {threads}"):
        _core._fma_loop("float32", "scalar", 10, threads)


def test_bad_argument_types_and_counts():
    with pytest.raises(TypeError):
        _core._fma_loop("float32", "scalar", "10", 1)
    with pytest.raises(TypeError):
        _core._fma_loop("float32", "scalar", 10.0, 1)
    with pytest.raises(TypeError):
        _core._fma_loop("float32", "scalar", 10)
    with pytest.raises(OverflowError):
        _core._fma_loop("float32", "scalar", 10, 2**40)


def test_kernels_unchanged_around_a_wider_pool():
    """A loop on more threads than set_num_threads grows the pool; the
    kernels after it give the same bits at 1 and 2 threads."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 256, 32)).astype(np.float32)
               for _ in range(3))
    saved = ac.get_num_threads()
    try:
        ac.set_num_threads(1)
        one = ac.dot_attention(q, k, values=v)
        _core._fma_loop("float32", PATHS[-1], 1000, 4)
        ac.set_num_threads(2)
        two = ac.dot_attention(q, k, values=v)
        _core._fma_loop("float32", PATHS[-1], 1000, 3)
        again = ac.dot_attention(q, k, values=v)
    finally:
        ac.set_num_threads(saved)
    for a, b, c in zip(one, two, again):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_runs_without_the_gil():
    """Two Python threads run loops at once (each on one thread of its
    own): both finish with their counts."""
    found = []

    def run():
        found.append(_core._fma_loop("float64", PATHS[-1], 20000, 1))

    workers = [threading.Thread(target=run) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    simd = PATHS[-1]
    assert found == [2 * LANES[simd]["float64"] * ACCUMULATORS[simd]
                     * 20000] * 2


def test_threads_that_could_not_run_together_are_an_error():
    """While one caller holds the pool's workers, a second caller's loop
    on 2 threads runs its two loops one after the other: no peak, an
    error that says so (after the 1 s the first thread waits)."""
    simd = PATHS[-1]
    iters = 1000
    while True:             # a loop of about 1.5 s on 2 threads
        start = time.perf_counter()
        _core._fma_loop("float32", simd, iters, 2)
        took = time.perf_counter() - start
        if took > 0.05:
            break
        iters *= 4
    iters = int(iters * 1.5 / took)
    started, finished = threading.Event(), []

    def hold():
        started.set()
        _core._fma_loop("float32", simd, iters, 2)
        finished.append(time.perf_counter())

    holder = threading.Thread(target=hold)
    holder.start()
    started.wait()
    time.sleep(0.2)
    try:
        begin = time.perf_counter()
        _core._fma_loop("float32", simd, 1000, 2)
    except RuntimeError as exc:
        assert "only 1 of the 2 threads ran the FMA loop at once" in str(
            exc)
    else:
        holder.join()
        if finished[0] > begin:
            pytest.fail("two loops that could not run together passed")
        pytest.skip("the holder finished before the second call began")
    finally:
        holder.join()
