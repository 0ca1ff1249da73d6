"""Threads, fork() and PyTorch.

- Many Python threads call all ten functions at once, on different shapes,
  while the thread setting is changed under them: every result is
  bit-identical to the serial one.
- A child made by os.fork() after the parent used the kernels (with the
  thread pool running, also while another thread is inside a kernel)
  computes correctly and exits.
- Importing PyTorch before or after attention_c (and running PyTorch's
  own threads in between) changes no result and deadlocks nothing.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import attention_c as ac
from attention_c import reference
from attention_c.testing import Problem, record_figure

N_THREADS = 8
ITERS = 400
SANITIZED = bool(os.environ.get("ATTENTION_C_SANITIZED"))


def _calls(rng):
    """(fn, kwargs) of every function on a few shapes, small and large
    enough for the fused layer to use its threads."""
    calls = []
    for lead, T, H, A in [((3,), 5, 4, 6), ((2, 2), 33, 17, 9),
                          ((8,), 96, 32, 48), ((4,), 130, 70, 33)]:
        p = Problem(rng, lead, T, H, A)
        alpha = reference.masked_softmax(p.grad_s * 2, mask=p.mask)
        h32 = p.h.astype(np.float32)
        calls += [
            (ac.mean_context, dict(h=p.h, mask=p.mask)),
            (ac.mean_context_backward, dict(grad_c=p.grad_out, h=p.h,
                                            mask=p.mask)),
            (ac.additive_score, dict(h=p.h, context=p.context, W=p.W,
                                     v=p.v, b=p.b)),
            (ac.additive_score_backward, dict(grad_s=p.grad_s, h=p.h,
                                              context=p.context, W=p.W,
                                              v=p.v, b=p.b)),
            (ac.masked_softmax, dict(scores=p.grad_s, mask=p.mask)),
            (ac.masked_softmax_backward, dict(grad_alpha=p.grad_alpha,
                                              alpha=alpha)),
            (ac.weighted_sum, dict(alpha=alpha, h=p.h)),
            (ac.weighted_sum_backward, dict(grad_out=p.grad_out,
                                            alpha=alpha, h=p.h)),
            (ac.context_attention, dict(h=p.h, W=p.W, v=p.v, b=p.b,
                                        mask=p.mask)),
            (ac.context_attention, dict(h=h32, W=p.W.astype(np.float32),
                                        v=p.v.astype(np.float32))),
            (ac.context_attention_backward, dict(
                grad_out=p.grad_out, h=p.h, W=p.W, v=p.v, alpha=alpha,
                b=p.b, mask=p.mask, grad_alpha=p.grad_alpha)),
        ]
    return calls


def _outs(res):
    return tuple(res) if isinstance(res, tuple) else (res,)


def _same(got, want):
    return len(got) == len(want) and all(
        (g is None and w is None) or np.array_equal(g, w)
        for g, w in zip(got, want))


def test_many_threads_get_serial_results(rng, restore_settings):
    calls = _calls(rng)
    ac.set_num_threads(2)
    serial = [_outs(fn(**kw)) for fn, kw in calls]
    errors, done = [], [0] * N_THREADS
    barrier = threading.Barrier(N_THREADS)

    def work(i):
        r = np.random.default_rng(i)
        try:
            barrier.wait()
            for _ in range(ITERS):
                k = int(r.integers(len(calls)))
                if r.random() < 0.2:
                    ac.set_num_threads(int(r.integers(1, 5)))
                fn, kw = calls[k]
                if not _same(_outs(fn(**kw)), serial[k]):
                    errors.append((i, fn.__name__, k))
                done[i] += 1
        except BaseException as e:              # noqa: B036
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=work, args=(i,))
               for i in range(N_THREADS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    assert not errors, errors[:5]
    assert sum(done) == N_THREADS * ITERS
    record_figure("concurrency: Python threads x iterations",
                  f"{N_THREADS} x {ITERS} = {sum(done)} calls of 10 "
                  f"functions on 4 shapes, kernel threads 1-4, "
                  f"{time.perf_counter() - t0:.1f} s")


# --------------------------------------------------------------------------
# fork()

def _wait_child(pid, timeout=120):
    """Exit status of the child, killing it after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hangs")


def _fork_and_check(calls, serial):
    pid = os.fork()
    if pid == 0:                                 # the child
        code = 1
        try:
            ok = all(_same(_outs(fn(**kw)), want)
                     for (fn, kw), want in zip(calls, serial))
            ac.set_num_threads(2)                # and a fresh pool works
            ok = ok and all(_same(_outs(fn(**kw)), want)
                            for (fn, kw), want in zip(calls, serial))
            code = 0 if ok else 3
        finally:
            os._exit(code)
    return _wait_child(pid)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork()")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fork_after_threads(rng, restore_settings):
    calls = _calls(rng)
    ac.set_num_threads(2)
    serial = [_outs(fn(**kw)) for fn, kw in calls]   # pool is running
    assert _fork_and_check(calls, serial) == 0
    # the parent still computes right after its child
    assert all(_same(_outs(fn(**kw)), want)
               for (fn, kw), want in zip(calls, serial))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork()")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fork_while_another_thread_computes(rng, restore_settings):
    calls = _calls(rng)
    ac.set_num_threads(2)
    serial = [_outs(fn(**kw)) for fn, kw in calls]
    big = [(fn, kw) for fn, kw in calls if fn is ac.context_attention][-1]
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            big[0](**big[1])

    t = threading.Thread(target=busy)
    t.start()
    try:
        codes = []
        for _ in range(5):
            time.sleep(0.01)
            codes.append(_fork_and_check(calls, serial))
    finally:
        stop.set()
        t.join(timeout=60)
    assert codes == [0] * 5
    record_figure("fork: children checked", 6)


# --------------------------------------------------------------------------
# PyTorch import order (in fresh interpreters)

HAVE_TORCH = importlib.util.find_spec("torch") is not None

SCRIPT = textwrap.dedent("""
    import json, sys
    order = sys.argv[1]
    if order == "torch_first":
        import torch
    import numpy as np
    import attention_c as ac
    rng = np.random.default_rng(7)
    h = rng.standard_normal((8, 96, 32)); W = rng.standard_normal((48, 64))
    v = rng.standard_normal(48); mask = rng.random((8, 96)) < 0.8
    def run():
        out, alpha = ac.context_attention(h, W, v, mask=mask)
        g = ac.context_attention_backward(out, h, W, v, alpha, mask=mask)
        return [out.tobytes().hex()[:64], alpha.tobytes().hex()[:64],
                str(float(np.sum(g.h))), str(float(np.sum(g.W))),
                str(hash(out.tobytes() + g.W.tobytes()))]
    ac.set_num_threads(2)
    first = run()
    if order == "torch_after":
        import torch
    if order != "none":
        torch.set_num_threads(2)
        x = torch.randn(256, 256)
        for _ in range(3):
            x = torch.tanh(x @ x / 256)      # PyTorch's own threads
    second = run()
    print(json.dumps([first, second]))
""")


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
@pytest.mark.skipif(SANITIZED, reason="PyTorch under ASan preload is not "
                    "this test's business")
def test_torch_import_order_changes_nothing():
    env = dict(os.environ, PYTHONHASHSEED="0")
    results = {}
    for order in ("none", "torch_first", "torch_after"):
        proc = subprocess.run([sys.executable, "-c", SCRIPT, order],
                              capture_output=True, text=True, timeout=300,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[order] = json.loads(proc.stdout.strip().splitlines()[-1])
    for order, (first, second) in results.items():
        assert first == second, order
        assert first == results["none"][0], order
