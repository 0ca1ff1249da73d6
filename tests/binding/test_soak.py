"""Long leak loop (slow): hundreds of thousands of good and bad calls.

Runs only with ATTENTION_C_SLOW=1 (``.ci/run`` sets it).  The calls are
the leak loops' good and bad calls of test_resources.py plus injected
allocation failures; tracemalloc's traced memory, the RSS and every
argument's refcount must stay flat, and the figures are printed.
"""

import gc
import os
import sys
import tracemalloc

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core_tests as hooks
from attention_c.testing import record_figure
from attention_c.testing.leaks import (bad_calls, good_calls, rss_bytes,
                                       run_calls)

ROUNDS = int(os.environ.get("ATTENTION_C_SOAK_ROUNDS", "10000"))

pytestmark = pytest.mark.skipif(
    not os.environ.get("ATTENTION_C_SLOW"),
    reason="slow: set ATTENTION_C_SLOW=1")


def _injected(goods, k):
    """One good call, on the tests' extension (which has the hooks),
    with its k-th allocation point failing."""
    fn, kw = goods[k % len(goods)]
    hooks._fail_alloc_after(k % 5)
    try:
        getattr(hooks, fn.__name__)(**kw)
    except MemoryError:
        pass
    finally:
        hooks._fail_alloc_after(-1)


def test_soak_memory_and_refcounts_flat(rng):
    goods, bads = good_calls(rng), bad_calls(rng)
    objs = [o for _, kw in goods for o in kw.values()] + \
           [o for _, kw, _ in bads for o in kw.values()]
    run_calls(goods, bads, 300)
    for k in range(200):
        _injected(goods, k)
    refs = [sys.getrefcount(o) for o in objs]
    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    try:
        # one round under tracing first: NumPy traces even a failed data
        # allocation (of the exabyte bad calls) once, at address 0
        run_calls(goods, bads, 1)
        gc.collect()
        traced0 = tracemalloc.get_traced_memory()[0]
        calls = 0
        for r in range(ROUNDS):
            run_calls(goods, bads, 1)
            _injected(goods, r)
            calls += len(goods) + len(bads) + 1
        gc.collect()
        traced1 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    gc.collect()
    rss1 = rss_bytes()
    assert [sys.getrefcount(o) for o in objs] == refs
    record_figure("leak loop: calls (good, bad, injected failures)", calls)
    ghost = 2 ** 62 if traced0 >= 2 ** 62 else 0  # the failed 4 EiB copy
    record_figure("leak loop: tracemalloc before -> after (bytes)",
                  f"{traced0 - ghost} -> {traced1 - ghost} "
                  f"({traced1 - traced0:+d})")
    record_figure("leak loop: RSS before -> after (MiB)",
                  f"{rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} "
                  f"({(rss1 - rss0) / 2**20:+.2f})")
    assert traced1 - traced0 < 100 * 1024
    if not os.environ.get("ATTENTION_C_SANITIZED"):
        assert rss1 - rss0 < 4 * 2**20
