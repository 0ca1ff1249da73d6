"""The good and bad calls of the leak loops, shared by
tests/binding/test_resources.py (thousands of rounds, tracemalloc, RSS and
refcounts) and tests/binding/test_soak.py (the long loop, with injected
allocation failures).
"""

import os

import numpy as np

import attention_c as ac
from attention_c import reference
from attention_c.testing import Problem

# Leak problems, float64 (float32 inputs below are cast to float64 because
# W is float64).  The cost of a call is dominated by B*T*A tanh, so two
# shapes share the work of making every output big:
#   WIDE_BATCH  B = 128, T = 2, H = 2, A = 1: out, c, dcontext, alpha, s,
#               dscores, dalpha are 128 x 2 = 2 KiB, dh 4 KiB;
#   WIDE_HIDDEN B = 1, T = 1, H = 1, A = 256: dv, db are 2 KiB, dW 4 KiB,
#               the kernels' scratch >= 4 KiB.
# Every function's every output is >= 2 KiB in at least one of them (and
# each converted copy of a float32 or strided h is 2-4 KiB), while a call
# costs microseconds.  So if any single one of them leaked once per call,
# test_resources.py's RSS_ITERS loops would leak >= 10000 * 2 KiB = 19.5
# MiB, ten times the RSS slack, and its TRACE_ITERS loops >= 5000 * 2 KiB,
# a hundred times the tracemalloc slack (which also catches a leaked bare
# array object).
WIDE_BATCH = dict(lead=(128,), T=2, H=2, A=1)
WIDE_HIDDEN = dict(lead=(1,), T=1, H=1, A=256)


class BombError(Exception):
    """Raised by ArrayBomb."""


class ArrayBomb:
    """An array-like whose __array__ raises."""

    def __array__(self, dtype=None, copy=None):
        raise BombError("boom")


def leak_problem(rng, lead, T, H, A):
    """A random Problem and a valid alpha for it."""
    p = Problem(rng, lead, T, H, A)
    alpha = reference.masked_softmax(p.grad_s * 2, mask=p.mask)
    return p, alpha


def _calls_for(p, alpha):
    h, W, v, b, m = p.h, p.W, p.v, p.b, p.mask
    c, go, gs, ga = p.context, p.grad_out, p.grad_s, p.grad_alpha
    h32s = np.asfortranarray(h.astype(np.float32))      # strided, cast
    # without a mask the backward's alpha has no zero (the binding checks)
    alpha_all = reference.masked_softmax(gs * 2)
    return [
        (ac.mean_context, dict(h=h, mask=m)),
        (ac.mean_context, dict(h=h32s, mask=m[:, ::-1])),
        (ac.mean_context_backward, dict(grad_c=go, h=h, mask=m)),
        (ac.additive_score, dict(h=h, context=c, W=W, v=v, b=b)),
        (ac.additive_score, dict(h=h32s, context=c, W=W, v=v.tolist())),
        (ac.additive_score_backward, dict(grad_s=gs, h=h, context=c, W=W,
                                          v=v, b=b)),
        (ac.additive_score_backward, dict(grad_s=gs, h=h32s, context=c,
                                          W=W, v=v)),
        (ac.masked_softmax, dict(scores=gs, mask=m)),
        (ac.masked_softmax_backward, dict(grad_alpha=ga, alpha=alpha)),
        (ac.weighted_sum, dict(alpha=alpha, h=h)),
        (ac.weighted_sum_backward, dict(grad_out=go, alpha=alpha, h=h)),
        (ac.context_attention, dict(h=h, W=W, v=v, b=b, mask=m)),
        (ac.context_attention, dict(h=h32s, W=W, v=v)),
        (ac.context_attention_backward, dict(grad_out=go, h=h, W=W, v=v,
                                             alpha=alpha, b=b, mask=m,
                                             grad_alpha=ga)),
        (ac.context_attention_backward, dict(grad_out=go, h=h32s, W=W,
                                             v=v, alpha=alpha_all)),
    ]


def good_calls(rng):
    """(function, kwargs) of successful calls of all ten functions, with
    contiguous float64, strided float32 and list inputs, in both shapes."""
    return (_calls_for(*leak_problem(rng, **WIDE_BATCH))
            + _calls_for(*leak_problem(rng, **WIDE_HIDDEN)))


def bad_calls(rng):
    """(function, kwargs, exception) of failing calls of several kinds."""
    p, alpha = leak_problem(rng, **WIDE_BATCH)
    h, W, v, b, m = p.h, p.W, p.v, p.b, p.mask
    go, ga = p.grad_out, p.grad_alpha
    h32s = np.asfortranarray(h.astype(np.float32))
    W32, v32 = W.astype(np.float32), v.astype(np.float32)
    huge = np.lib.stride_tricks.as_strided(
        np.zeros(1, np.float32), shape=(4, 2 ** 57, 2), strides=(0, 0, 0))
    empty = np.zeros((2 ** 30, 2 ** 30, 0), np.float32)
    return [
        # wrong shapes, after float32 -> float64 copies were made
        (ac.context_attention, dict(h=h32s, W=W, v=v[:-1], b=b, mask=m),
         ValueError),
        (ac.context_attention_backward, dict(grad_out=go, h=h32s, W=W, v=v,
                                             alpha=alpha[:, :-1], mask=m),
         ValueError),
        # alpha of a forward without the mask, after the copies
        (ac.context_attention_backward, dict(
            grad_out=go, h=h32s, W=W, v=v,
            alpha=reference.masked_softmax(p.grad_s), mask=m), ValueError),
        (ac.mean_context, dict(h=h, mask=m[:-1]), ValueError),
        (ac.weighted_sum, dict(alpha=alpha, h=h[..., :-1, :]), ValueError),
        (ac.additive_score, dict(h=h, context=p.context, W=W[:, 1:], v=v),
         ValueError),
        # wrong dtypes
        (ac.context_attention, dict(h=h, W=W.astype(complex), v=v),
         TypeError),
        (ac.masked_softmax, dict(scores=p.grad_s, mask=m.astype(np.int8)),
         TypeError),
        (ac.masked_softmax_backward, dict(grad_alpha=ga.astype(object),
                                          alpha=alpha), TypeError),
        # T = 0
        (ac.context_attention, dict(h=h[..., :0, :], W=W, v=v), ValueError),
        (ac.masked_softmax_backward, dict(grad_alpha=ga[:, :0],
                                          alpha=alpha[:, :0]), ValueError),
        # conversion errors: __array__ raising, ragged list
        (ac.context_attention, dict(h=h, W=W, v=v, b=b, mask=ArrayBomb()),
         BombError),
        (ac.additive_score_backward, dict(grad_s=p.grad_s, h=h,
                                          context=ArrayBomb(), W=W, v=v),
         BombError),
        (ac.mean_context, dict(h=[[1.0, 2.0], [3.0]]), ValueError),
        # sizes that cannot be allocated (input copy, then output)
        (ac.context_attention, dict(h=huge, W=W32[:, :4], v=v32), MemoryError),
        (ac.context_attention, dict(h=empty, W=np.zeros((3, 0), np.float32),
                                    v=np.zeros(3, np.float32)), MemoryError),
    ]


def run_calls(goods, bads, iters):
    """Runs every good and bad call iters times, dropping all results."""
    for _ in range(iters):
        for fn, kw in goods:
            fn(**kw)
        for fn, kw, exc in bads:
            try:
                fn(**kw)
            except exc:
                pass
            else:
                raise AssertionError(f"{fn.__name__} did not raise {exc}")


def rss_bytes():
    """Resident set size of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
