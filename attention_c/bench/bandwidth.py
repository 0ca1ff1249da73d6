"""The host's read bandwidth, per thread count, for the decode benchmark
(``python -m attention_c.bench --cache``, attention_c.bench.cache): N
Python threads each reduce their own buffer with ``buf.max()`` (NumPy
releases the GIL), started together by a barrier, timed as
``harness.measure`` times.  See attention_c/bench/cache.py's docstring.
"""

import concurrent.futures
import os
import threading
import time

import numpy as np

from attention_c.bench import harness

BANDWIDTH_MIB = 256                     # at least, per thread
QUICK_BANDWIDTH_MIB = 16


def l3_bytes():
    """The size of the L3 cache in bytes (from sysfs), or None."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        names = os.listdir(base)
    except OSError:
        return None
    for name in names:
        try:
            with open(f"{base}/{name}/level", encoding="utf-8") as f:
                if f.read().strip() != "3":
                    continue
            with open(f"{base}/{name}/size", encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units and text[:-1].isdigit():
            return int(text[:-1]) * units[text[-1]]
        if text.isdigit():
            return int(text)
    return None


def bandwidth_bytes(quick, l3):
    """Bytes of each thread's buffer: QUICK_BANDWIDTH_MIB with --quick
    (it may fit in L3: not a DRAM figure), else BANDWIDTH_MIB MiB or 4
    times the L3 cache, the larger, so every pass misses the caches."""
    if quick:
        return QUICK_BANDWIDTH_MIB << 20
    size = max(BANDWIDTH_MIB << 20, 4 * (l3 or 0))
    return -(-size // (1 << 20)) << 20              # whole MiB


def _pass(pool, barrier, bufs):
    """One pass: each thread of ``pool`` reduces one of ``bufs``, started
    together by ``barrier``; (wall seconds, CPU seconds of the process)."""
    def reduce(buf):
        barrier.wait()
        return int(buf.max())

    futures = [pool.submit(reduce, b) for b in bufs]
    barrier.wait()
    cpu, start = time.process_time(), time.perf_counter()
    for fut in futures:
        fut.result()
    return time.perf_counter() - start, time.process_time() - cpu


def measure_bandwidth(counts, size, target, min_repeats):
    """The read bandwidth of each thread count n of ``counts``: n threads
    each reducing its own buffer of ``size`` bytes at once.  Timed as
    ``harness.measure`` times (and for the same reason): ROUNDS rounds
    over the counts, order reversed every other round, a pass untimed
    after each switch, then passes for about target / ROUNDS seconds and
    at least min_repeats in all.  A list of dicts, one per count: the
    median GB/s, the slowest and fastest pass, passes, CPU seconds per
    wall second, and the others' CPU share over the whole measurement."""
    # Written (arange), not np.zeros: untouched pages would all map the
    # one zero page, read from the caches.
    bufs = [np.arange(size // 4, dtype=np.int32) for _ in range(max(counts))]
    pools = {n: concurrent.futures.ThreadPoolExecutor(n) for n in counts}
    barriers = {n: threading.Barrier(n + 1) for n in counts}
    least = -(-min_repeats // harness.ROUNDS)
    samples = {n: [] for n in counts}
    before, begin = harness.cpu_seconds(), time.perf_counter()
    try:
        for r in range(harness.ROUNDS):
            for n in counts if r % 2 == 0 else counts[::-1]:
                args = pools[n], barriers[n], bufs[:n]
                _pass(*args)                        # untimed
                done, start = 0, time.perf_counter()
                while done < least or (time.perf_counter() - start
                                       < target / harness.ROUNDS):
                    samples[n].append(_pass(*args))
                    done += 1
    finally:
        for pool in pools.values():
            pool.shutdown()
    others = harness.others_load(before, time.perf_counter() - begin)
    found = []
    for n in counts:
        rates = [n * size / wall / 1e9 for wall, _ in samples[n]]
        found.append({
            "threads": n, "mib": size >> 20,
            "gbps": float(np.median(rates)), "min_gbps": min(rates),
            "max_gbps": max(rates), "passes": len(rates),
            "cpu_per_wall": (sum(c for _, c in samples[n])
                             / sum(w for w, _ in samples[n])),
            "others_load": others})
    return found
