"""Resources: no leaks (memory, references) and the GIL is released.

Every good and bad call of the ten public functions is repeated thousands
of times while tracemalloc's traced memory, the process RSS and the
reference counts of all argument objects must stay flat; several threads
calling the fused layer at once must get exactly the serial results; and a
pure-Python thread must run while the main thread is inside a C kernel.
"""

import gc
import os
import sys
import threading
import time
import tracemalloc
import weakref

import numpy as np
import pytest

import attention_c as ac
from attention_c import reference
from attention_c.testing import Problem, assert_close
from attention_c.testing.leaks import (WIDE_BATCH, bad_calls, good_calls,
                                       leak_problem, rss_bytes, run_calls)

# Loop lengths and slacks of the leak problems of attention_c.testing.leaks
# (its comment says why they catch a single leaked output per call).
RSS_ITERS = 10000
TRACE_ITERS = 5000
WARMUP_ITERS = 500
TRACED_SLACK = 100 * 1024          # bytes
RSS_SLACK = 2 * 1024 * 1024        # bytes


def test_calls_are_what_they_claim(rng):
    """The leak loops' calls behave as claimed: outputs >= 2 KiB, bad raise."""
    goods, bads = good_calls(rng), bad_calls(rng)
    biggest = {}
    for fn, kw in goods:
        res = fn(**kw)
        outs = res if isinstance(res, tuple) else (res,)
        for i, out in enumerate(outs):
            if out is not None:
                key = (fn.__name__, i)
                biggest[key] = max(biggest.get(key, 0), out.nbytes)
    assert len({name for name, _ in biggest}) == 10
    small = {k: n for k, n in biggest.items() if n < 2048}
    assert not small, small
    for fn, kw, exc in bads:
        with pytest.raises(exc):
            fn(**kw)


def test_no_leak_tracemalloc(rng):
    """Thousands of good and bad calls keep traced memory flat."""
    goods, bads = good_calls(rng), bad_calls(rng)
    run_calls(goods, bads, WARMUP_ITERS)
    tracemalloc.start()
    try:
        run_calls(goods, bads, WARMUP_ITERS // 3)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        run_calls(goods, bads, TRACE_ITERS)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < TRACED_SLACK, (
        f"traced memory grew by {(after - before) / 1024:.1f} KiB over "
        f"{TRACE_ITERS} iterations")


@pytest.mark.skipif(bool(os.environ.get("ATTENTION_C_SANITIZED")),
                    reason="under ASan freed memory sits in its quarantine, "
                           "so RSS grows; tracemalloc and refcounts still "
                           "checked")
def test_no_leak_rss(rng):
    """Thousands of good and bad calls keep the resident set flat."""
    goods, bads = good_calls(rng), bad_calls(rng)
    run_calls(goods, bads, WARMUP_ITERS)
    gc.collect()
    before = rss_bytes()
    run_calls(goods, bads, RSS_ITERS)
    gc.collect()
    after = rss_bytes()
    assert after - before < RSS_SLACK, (
        f"RSS grew by {(after - before) / 2 ** 20:.2f} MiB over "
        f"{RSS_ITERS} iterations")


def test_large_outputs_reuse_their_blocks(rng):
    """Outputs of 1 MiB or more take their memory from a handler that
    keeps a few freed blocks for the next call (csrc/python/state.c): a
    freed output's block, 64-byte aligned, is the next one's, and a block
    grown by resize keeps its data."""
    q = rng.standard_normal((4, 256, 256)).astype(np.float32)  # 1 MiB out
    out = ac.dot_attention(q, q, values=q, return_weights=False)[0]
    want, addr = out.copy(), out.ctypes.data
    assert addr % 64 == 0
    del out
    again = ac.dot_attention(q, q, values=q, return_weights=False)[0]
    assert again.ctypes.data == addr
    np.testing.assert_array_equal(again, want)
    again.resize((2 * again.size,), refcheck=False)
    np.testing.assert_array_equal(again[:want.size], want.ravel())


@pytest.mark.skipif(bool(os.environ.get("ATTENTION_C_SANITIZED")),
                    reason="under ASan freed memory sits in its quarantine")
def test_large_outputs_keep_bounded_memory(rng):
    """Hundreds of calls whose outputs (1 to 3 MiB) are kept a while and
    freed in another order keep the resident set within what the handler
    keeps (64 MiB) and a slack: a block lost a call would add 300 MiB."""
    qs = [rng.standard_normal((4, 256 * n, 256)).astype(np.float32)
          for n in (1, 2, 3)]
    alive = []
    for i in range(30):
        alive.append(ac.dot_attention(qs[i % 3], qs[i % 3], values=qs[i % 3],
                                      return_weights=False)[0])
        if len(alive) > 4:
            alive.pop(i % 3)
    gc.collect()
    before = rss_bytes()
    for i in range(300):
        q = qs[i % 3]
        alive.append(ac.dot_attention(q, q, values=q,
                                      return_weights=False)[0])
        if len(alive) > 4:
            alive.pop(i % 3)
    alive.clear()
    gc.collect()
    grown = rss_bytes() - before
    assert grown < (64 + 16) * 2 ** 20, f"RSS grew by {grown / 2 ** 20} MiB"


def test_argument_refcounts_unchanged(rng):
    """Good and failing calls leave every argument's refcount unchanged."""
    goods = [(fn, kw, None) for fn, kw in good_calls(rng)]
    cases = goods + bad_calls(rng)
    # None (the default of optional arguments) is passed explicitly too.
    p, _ = leak_problem(rng, **WIDE_BATCH)
    alpha = reference.masked_softmax(p.grad_s)       # no mask: no zero
    cases.append((ac.context_attention_backward,
                  dict(grad_out=p.grad_out, h=p.h, W=p.W, v=p.v, alpha=alpha,
                       b=None, mask=None, grad_alpha=None), None))
    for fn, kw, exc in cases:
        objs = list(kw.values()) + [None]

        def once():
            try:
                fn(**kw)
            except BaseException as e:          # noqa: B036
                if exc is None or not isinstance(e, exc):
                    raise

        once()                                  # warm any caches
        before = [sys.getrefcount(o) for o in objs]
        for _ in range(100):
            once()
        after = [sys.getrefcount(o) for o in objs]
        assert before == after, (fn.__name__, list(kw), before, after)


@pytest.mark.parametrize("name", [
    "mean_context", "mean_context_backward", "additive_score",
    "additive_score_backward", "masked_softmax", "masked_softmax_backward",
    "weighted_sum", "weighted_sum_backward", "context_attention",
    "context_attention_backward"])
def test_returned_arrays_hold_no_extra_references(name, rng):
    """Each returned array has the minimal refcount and owns its data."""
    calls = [kw for fn, kw in good_calls(rng) if fn is getattr(ac, name)]
    res = getattr(ac, name)(**calls[0])
    if not isinstance(res, tuple):
        # the name `res` and getrefcount's own argument
        assert sys.getrefcount(res) == 2, "extra reference to the result"
        outs = [res]
    else:
        outs = [x for x in res if x is not None]
        for x in outs:
            # the tuple, the list `outs`, the name `x`, getrefcount's arg
            assert sys.getrefcount(x) == 4, "extra reference to an output"
    for x in outs:
        assert x.base is None and x.flags.owndata
    refs = [weakref.ref(x) for x in outs]
    del res, outs, x
    gc.collect()
    assert all(r() is None for r in refs), "an output outlived its result"


# --------------------------------------------------------------------------
# The GIL.

def _layer_inputs(rng, lead, T_, H_):
    """h, mask, grad_out, grad_alpha of a random problem."""
    p = Problem(rng, lead, T_, H_, 1)
    return p.h, p.mask, p.grad_out, p.grad_alpha


def _layer(h, W, v, b, mask, g, ga):
    """All outputs of the layer forward and backward."""
    out, alpha = ac.context_attention(h, W, v, b=b, mask=mask)
    grads = ac.context_attention_backward(g, h, W, v, alpha, b=b, mask=mask,
                                          grad_alpha=ga)
    return (out, alpha) + tuple(grads)


def test_threads_get_serial_results(rng):
    """4 threads running the layer at once get exactly the serial results."""
    n_threads, repeats = 4, 3
    Hs, As = 32, 48
    W = rng.standard_normal((As, 2 * Hs)) / 8
    v, b = rng.standard_normal(As), rng.standard_normal(As) * 0.1
    inputs = [_layer_inputs(rng, (8,), 96 + 8 * i, Hs)
              for i in range(n_threads)]
    serial = [_layer(h, W, v, b, m, g, ga) for h, m, g, ga in inputs]
    results = [[] for _ in range(n_threads)]
    errors = []
    barrier = threading.Barrier(n_threads)

    def work(i):
        try:
            h, m, g, ga = inputs[i]
            barrier.wait()
            for _ in range(repeats):
                results[i].append(_layer(h, W, v, b, m, g, ga))
        except BaseException as e:              # noqa: B036
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,))
               for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    assert not errors, errors
    for i in range(n_threads):
        assert len(results[i]) == repeats
        for res in results[i]:
            for k, (got, want) in enumerate(zip(res, serial[i])):
                assert np.array_equal(got, want), f"thread {i} output {k}"
    # and the serial results are right
    h, m, g, ga = inputs[0]
    out, alpha = reference.context_attention(h, W, v, b=b, mask=m)
    assert_close(serial[0][0], out, np.float64, "out")
    assert_close(serial[0][1], alpha, np.float64, "alpha")


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_gil_released_during_kernel(direction, rng):
    """A Python thread runs while the main thread is inside the C kernel.

    The switch interval is raised to 60 s, so the interpreter never forces
    the main thread to hand over the GIL: the helper thread can only run
    when the main thread releases it.  Between t0 and t1 the main thread
    executes nothing but the kernel call, so any helper timestamp in
    (t0, t1) proves the call released the GIL.  A call takes a few ms on
    an AVX-512 host (1.3 ms at 48 sequences, too short for the helper to
    be scheduled while another process kept the second core busy: CI
    saw that), so the problem is larger and a loaded machine gets more
    tries; with the GIL held there would be no timestamp in any window,
    however long the call, so this is not a timing assertion.
    """
    p = Problem(rng, (192,), 256, 64, 64)
    out, alpha = ac.context_attention(p.h, p.W, p.v, b=p.b, mask=p.mask)
    if direction == "forward":
        def kernel():
            ac.context_attention(p.h, p.W, p.v, b=p.b, mask=p.mask)
    else:
        def kernel():
            ac.context_attention_backward(p.grad_out, p.h, p.W, p.v, alpha,
                                          b=p.b, mask=p.mask)

    ticks = []
    ready, go, stop = (threading.Event() for _ in range(3))

    def helper():
        ready.set()
        go.wait()
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)              # releases the GIL

    old = sys.getswitchinterval()
    thread = threading.Thread(target=helper)
    windows = []
    try:
        thread.start()
        assert ready.wait(10)
        sys.setswitchinterval(60.0)
        go.set()
        for _ in range(20):                 # a loaded machine gets retries
            t0 = time.perf_counter()
            kernel()
            t1 = time.perf_counter()
            windows.append((t0, t1))
            if any(t0 < t < t1 for t in ticks):
                break
    finally:
        stop.set()
        sys.setswitchinterval(old)
        thread.join(timeout=10)
    assert not thread.is_alive()
    inside = [sum(t0 < t < t1 for t in ticks) for t0, t1 in windows]
    assert max(inside) >= 1, (
        f"the helper thread never ran during {len(windows)} kernel calls of "
        f"{[round((b - a) * 1e3, 1) for a, b in windows]} ms: the GIL is "
        f"held")
