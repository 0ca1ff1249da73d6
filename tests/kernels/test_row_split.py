"""The fused backward splits the rows of a long sequence over threads.

With fewer sequences than it has partial gradients, the SIMD backward
runs one sequence at a time and splits its valid rows into segments of
whole row blocks, one task each (csrc/simd/fused_backward.inc,
bwd_split_rows); each segment sums its dW_h, E and dv on its own, and the
segments are added in order.  These tests check, for single long
sequences and pairs of them, that the gradients are bitwise the same for
1, 2 and 3 threads and right against attention_c.reference: sizes around
and above the block sizes (120 rows on AVX2, 240 on AVX-512) and many
blocks, odd sizes, no mask, a random mask with a fully masked sequence, a
fully masked single sequence, ragged prefixes (a short sequence before a
long one, a long one before an empty one), float32 and float64, with and
without bias and grad_alpha, recomputing the activations and reading the
forward's.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import DTYPES, Problem, assert_close

SIMD_PATHS = list(_core._simd_paths())[1:]     # the scalar path is serial
THREAD_COUNTS = [1, 2, 3]

# (B, T, H, A, mask, bias, grad_alpha); mask is a MASK_KINDS name or the
# valid prefix length of each sequence.  Every size gives a call at least
# 3 * 2^22 multiply-adds, so that 3 threads really run (exec_threads).
SPECS = [
    (1, 121, 333, 319, "none", True, True),       # just past 120 rows
    (1, 241, 257, 203, "none", False, True),      # just past 240 rows
    (1, 121, 333, 319, "all_masked", True, True),
    (1, 1000, 129, 97, (977,), True, False),      # one ragged sequence
    (1, 4099, 65, 47, "random", True, True),      # many blocks, >= 8 segments
    (2, 2049, 65, 47, "random", False, True),     # the 2nd fully masked
    (2, 3001, 47, 65, (37, 3001), True, True),    # short, then long
    (2, 3001, 47, 65, (2999, 0), False, False),   # long, then empty
]


def _spec_id(spec):
    B, T, H, A, mask, bias, ga = spec
    kind = mask if isinstance(mask, str) else "len" + "-".join(map(str, mask))
    return (f"B{B}-T{T}-H{H}-A{A}-{kind}" + ("-bias" if bias else "")
            + ("-ga" if ga else ""))


# every test leaves the SIMD path and the thread count as it found them
pytestmark = pytest.mark.usefixtures("restore_settings")


def _problem(spec, dtype):
    B, T, H, A, mask, bias, ga = spec
    assert B * T * (H + 1) * (A + 1) >= 3 * 2 ** 22
    kind = mask if isinstance(mask, str) else "none"
    x = Problem(np.random.default_rng(B * T + H), (B,), T, H, A, bias=bias,
                mask=kind).cast(dtype)
    if not isinstance(mask, str):
        x["mask"] = np.arange(T) < np.asarray(mask)[:, None]
    if not ga:
        x["grad_alpha"] = None
    return x


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


@pytest.mark.skipif(not SIMD_PATHS, reason="threads need a SIMD path")
@pytest.mark.parametrize("path", SIMD_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("spec", SPECS, ids=[_spec_id(s) for s in SPECS])
def test_backward_bitwise_for_any_thread_count(spec, dtype, path):
    """dh, dW, dv, db bitwise the same for 1, 2, 3 threads, with the
    activations recomputed and read from the forward, and within TOL of
    the reference."""
    _core._set_simd(path)
    x = _problem(spec, dtype)
    if spec[4] == "random" and spec[0] == 2:
        assert not x["mask"][1].any()             # a fully masked sequence
    ac.set_num_threads(1)
    out, alpha, act = ac.context_attention(x["h"], x["W"], x["v"], b=x["b"],
                                           mask=x["mask"],
                                           keep_activations=True)
    results = {}
    for n in THREAD_COUNTS:
        ac.set_num_threads(n)
        for tag, saved in [("recomputed", None), ("saved", act)]:
            results[n, tag] = ac.context_attention_backward(
                x["grad_out"], x["h"], x["W"], x["v"], alpha, b=x["b"],
                mask=x["mask"], grad_alpha=x["grad_alpha"],
                activations=saved)
    names = ["dh", "dW", "dv", "db"]
    for (n, tag), grads in results.items():
        for name, got, base in zip(names, grads, results[1, tag]):
            if base is None:
                assert got is None, (name, n, tag)
                continue
            assert got.dtype == np.dtype(dtype), (name, got.dtype)
            assert np.array_equal(got, base), (
                f"{name} ({tag} activations) with {n} threads differs "
                f"from 1 thread")
    want = ref.context_attention_backward(
        _f64(x["grad_out"]), _f64(x["h"]), _f64(x["W"]), _f64(x["v"]),
        _f64(alpha), b=_f64(x["b"]), mask=x["mask"],
        grad_alpha=_f64(x["grad_alpha"]))
    for tag in ["recomputed", "saved"]:
        for name, got, w in zip(names, results[1, tag], want):
            if w is None:
                assert got is None, name
                continue
            assert_close(got, w, dtype, f"{name} ({tag} activations)")
