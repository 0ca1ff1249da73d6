"""A key mask that leaves each sequence one run of keys (padding at the
right or at the left; a sequence masked whole is an empty run) narrows
each query's range of keys in the streamed paths (csrc/family/
visibility.inc's find_spans): the fused forward and the backward's
ranged rows take it with no visibility bytes.

* right padding: the bits of the same call on each sequence's unpadded
  keys, forward (out, lse) and backward (dq; dk, dv of the kept keys,
  exactly 0 on the padding), float32 and float64, on every SIMD path;
* left and right padding, causal, a window, grouped heads, a sequence
  masked whole (out 0, lse -inf, gradients 0), and a mask of two runs
  (which keeps the visibility bytes): the float64 reference, forward and
  backward;
* a NaN or an infinity in the padding's keys and values reaches no
  result, and leaves the fused forward's bits as they were;
* 1 and 2 threads bitwise identical.

Tolerance: ``testing.TOL`` normwise (1e-5 float32, 1e-12 float64), with
a floor of 1 (the inputs' scale), against the float64 reference on the
same values.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import (DTYPES, TOL, assert_all_identical, f64,
                                 rel_err)

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())
dtype_param = pytest.mark.parametrize("dtype", DTYPES,
                                      ids=lambda d: np.dtype(d).name)
B, TQ, T, H, HV = 4, 65, 97, 16, 8
LENGTHS = [97, 50, 7, 64]           # kept keys a sequence: 64 a panel's


def _inputs(rng, dtype, lead=(B,)):
    q = rng.standard_normal(lead + (TQ, H)).astype(dtype)
    k = rng.standard_normal(lead + (T, H)).astype(dtype)
    v = rng.standard_normal(lead + (T, HV)).astype(dtype)
    g = rng.standard_normal(lead + (TQ, HV)).astype(dtype)
    return q, k, v, g


def _mask(kind):
    """(B, T): right or left padding by LENGTHS (one sequence masked
    whole with "empty"), or two runs of keys (not padding)."""
    t = np.arange(T)[None, :]
    n = np.array(LENGTHS)[:, None]
    mask = {"right": t < n, "left": t >= T - n, "empty": t < n,
            "two_runs": (t < n // 2) | (t >= n)}[kind].copy()
    if kind == "empty":
        mask[2] = False
    return mask


def _both(fn_fwd, fn_bwd, q, k, v, g, **kw):
    out, lse = fn_fwd(q, k, values=v, return_weights=False, **kw)
    grads = fn_bwd(g, q, k, values=v, out=out, lse=lse, **kw)[:3]
    return [out, lse, *grads]


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@dtype_param
def test_right_padding_is_the_unpadded_call(simd, dtype):
    _core._set_simd(simd)
    ac.set_num_threads(1)
    q, k, v, g = _inputs(np.random.default_rng(1), dtype)
    out, lse, dq, dk, dv = _both(ac.dot_attention, ac.dot_attention_backward,
                                 q, k, v, g, mask=_mask("right"))
    for b, n in enumerate(LENGTHS):
        want = _both(ac.dot_attention, ac.dot_attention_backward, q[b],
                     k[b, :n], v[b, :n], g[b])
        assert_all_identical([out[b], lse[b], dq[b], dk[b, :n], dv[b, :n]],
                             want, f"{simd} sequence {b}")
        assert not dk[b, n:].any() and not dv[b, n:].any()


KINDS = {
    "right": {}, "left": {}, "empty": {"causal": True},
    "two_runs": {"causal": True},
    "right causal": {"causal": True}, "left window": {"window": (20, 3)},
}


@pytest.mark.usefixtures("restore_settings")
@dtype_param
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_padding_matches_reference(kind, dtype, threads):
    ac.set_num_threads(threads)
    rng = np.random.default_rng(len(kind))
    # grouped heads: two query heads on each sequence's keys
    q, k, v, g = _inputs(rng, dtype, (B, 2))
    k, v = k[:, :1], v[:, :1]
    kw = dict(KINDS[kind], mask=_mask(kind.split()[0])[:, None])
    got = _both(ac.dot_attention, ac.dot_attention_backward, q, k, v, g,
                **kw)
    want = _both(ref.dot_attention, ref.dot_attention_backward, f64(q),
                 f64(k), f64(v), f64(g), **kw)
    names = ["out", "lse", "dq", "dk", "dv"]
    for name, x, w in zip(names, got, want):
        seen = np.isfinite(w)
        assert np.array_equal(np.isfinite(x), seen), f"{kind} {name}"
        assert rel_err(x[seen], w[seen], floor=1.0) < TOL[dtype], \
            f"{kind} {name}"
    if kind == "empty":
        assert not got[0][2].any() and np.isneginf(got[1][2]).all()
        assert not got[2][2].any()


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_padding_reaches_nothing(bad):
    q, k, v, g = _inputs(np.random.default_rng(3), np.float32)
    mask = _mask("left")
    kw = dict(mask=mask, causal=True)
    clean = _both(ac.dot_attention, ac.dot_attention_backward, q, k, v, g,
                  **kw)
    k2, v2 = k.copy(), v.copy()
    k2[1, 0, 3] = bad                   # sequence 1 keeps keys 47 on
    v2[1, 10, 0] = bad
    got = _both(ac.dot_attention, ac.dot_attention_backward, q, k2, v2, g,
                **kw)
    for name, x, w in zip(["out", "lse", "dq", "dk", "dv"], got, clean):
        assert not np.isnan(x[np.isfinite(w)]).any(), name
        seen = np.isfinite(w)
        assert rel_err(x[seen], w[seen], floor=1.0) < TOL[np.float32], name


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@dtype_param
@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_nonfinite_padding_keeps_the_fused_forward(simd, dtype, bad):
    """The fused forward checks the rows it reads for NaN and infinities
    as it reads them, not every row first: a bad value in the padding,
    which no query sees, leaves out and lse the bits of the clean call
    (a bad value it reads sends the call to the general path)."""
    _core._set_simd(simd)
    q, k, v, _ = _inputs(np.random.default_rng(5), dtype)
    mask = _mask("right")
    k2, v2 = k.copy(), v.copy()
    k2[2, 60, 3] = bad                  # sequence 2 keeps keys 0 to 6
    v2[2, 96, 0] = bad
    for causal in (False, True):
        want = ac.dot_attention(q, k, values=v, mask=mask, causal=causal,
                                return_weights=False)
        got = ac.dot_attention(q, k2, values=v2, mask=mask, causal=causal,
                               return_weights=False)
        assert_all_identical(list(got), list(want), f"{simd} {causal}")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("kind", ["right", "left"])
def test_threads_bitwise_identical(kind):
    """Enough work for 2 threads (2**22 multiply-adds each)."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((4, 600, 32)).astype(np.float32)
    k = rng.standard_normal((4, 600, 32)).astype(np.float32)
    v = rng.standard_normal((4, 600, 32)).astype(np.float32)
    g = rng.standard_normal((4, 600, 32)).astype(np.float32)
    t = np.arange(600)[None, :]
    n = np.array([600, 300, 31, 450])[:, None]
    mask = t < n if kind == "right" else t >= 600 - n
    ac.set_num_threads(1)
    one = _both(ac.dot_attention, ac.dot_attention_backward, q, k, v, g,
                mask=mask, causal=True)
    ac.set_num_threads(2)
    two = _both(ac.dot_attention, ac.dot_attention_backward, q, k, v, g,
                mask=mask, causal=True)
    assert_all_identical(two, one, kind)
