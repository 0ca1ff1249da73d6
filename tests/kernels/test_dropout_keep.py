"""Dropout's keep bits by every SIMD path: the same bits as the scalar one.

What these tests prove:

1. The keep_row of every path this CPU runs (``_core._simd_paths()``:
   scalar, then AVX2 and AVX-512 on x86-64 when the CPU has them, NEON on
   AArch64), in its float32 and its float64 table, gives bitwise the
   scalar generator's keep bytes (core/philox.h) for many (seed, p, b, i,
   t0, n): lengths 0, 1, 3, 17, 65 and past two vector runs, offsets that
   are no multiple of 4, 8 or 16, counters and batch indices past 2**32,
   and thresholds at 0, 1, 2**31 and near 2**32.
2. The scalar path's bytes are ``attention_c.reference.dropout_keep``'s
   (the contract's Philox4x32-10 in NumPy) over whole rows.
3. A forward with dropout picks the path by ``ATTENTION_C_SIMD`` in a
   fresh process: each path's keep pattern, read back from its output, is
   the reference's.

The hook is ``_core_tests._keep_row`` (the tests' extension).
"""

import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from attention_c import _core, _core_tests
from attention_c import reference as ref

PATHS = list(_core._simd_paths())              # the paths this CPU runs
SIMD_PATHS = PATHS[1:]

LENGTHS = [0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127,
           128, 129, 200, 257, 1000]
OFFSETS = [0, 1, 2, 3, 4, 5, 6, 7, 9, 13, 16, 17, 31, 33, 63, 64, 65, 100,
           (1 << 34) - 5, (1 << 34) + 3]
# (seed, p, b, i): seeds with either word 0 or all ones, b past 2**32 (its
# high counter word), i at 2**32 - 1, and thresholds 0 (p = 0), 1, 2**31
# (the sign bit: an unsigned comparison) and near 2**32
ROWS = [(0, 0.1, 0, 0), (1234, 0.1, 3, 7), (2 ** 64 - 1, 0.5, 1, 2),
        (2 ** 32, 0.25, 2 ** 32 + 5, 9),
        (0xDEADBEEFCAFEF00D, 0.9, 17, 2 ** 32 - 1),
        (42, 0.0, 5, 1), (7, 2.0 ** -32, 0, 3), (99, 1 - 2.0 ** -30, 4, 4),
        (2 ** 63 + 11, 0.3, 2 ** 40 + 1, 1 << 20)]


def keep_row(path, seed, p, b, i, t0, n, f64=False):
    k = _core_tests._keep_row(seed, p, b, i, t0, n, path, f64)
    assert k.dtype == np.uint8 and k.shape == (n,)
    return k


@pytest.mark.parametrize("path", SIMD_PATHS)
@pytest.mark.parametrize("f64", [False, True])
def test_simd_keep_rows_are_the_scalar_ones(path, f64):
    """Every (row, offset, length): the path's bytes equal the scalar ones."""
    for (seed, p, b, i), t0, n in itertools.product(ROWS, OFFSETS, LENGTHS):
        want = keep_row("scalar", seed, p, b, i, t0, n)
        got = keep_row(path, seed, p, b, i, t0, n, f64)
        assert np.array_equal(got, want), (
            f"{path} (f64={f64}): seed {seed}, p {p}, b {b}, i {i}, "
            f"t0 {t0}, n {n}: differs at "
            f"{np.flatnonzero(got != want)[:8].tolist()}")


@pytest.mark.parametrize("path", PATHS)
def test_keep_rows_are_the_references(path):
    """Whole rows from 0 and pieces at any offset: reference.dropout_keep's
    bits (bytes 0 or 1, the fraction kept about 1 - p)."""
    T = 523
    for seed, p, b, Tq in [(1234, 0.1, 0, 3), (2 ** 64 - 1, 0.5, 2 ** 32 + 1,
                                               2), (5, 0.0, 7, 1)]:
        want = ref.dropout_keep(seed, p, b, Tq, T)
        for i in range(Tq):
            row = keep_row(path, seed, p, b, i, 0, T)
            assert set(np.unique(row)) <= {0, 1}
            assert np.array_equal(row.astype(bool), want[i])
            for t0, n in [(1, 17), (3, 65), (13, 200), (250, 273)]:
                assert np.array_equal(keep_row(path, seed, p, b, i, t0, n),
                                      row[t0:t0 + n])
        if p > 0:
            assert abs(want.mean() - (1 - p)) < 0.05


def test_keep_row_rejects_bad_arguments():
    """A negative size or index, p outside [0, 1) or a path this CPU
    cannot run raise a ValueError."""
    for args in [(1, 0.1, -1, 0, 0, 4), (1, 0.1, 0, -1, 0, 4),
                 (1, 0.1, 0, 0, -1, 4), (1, 0.1, 0, 0, 0, -1),
                 (1, 1.0, 0, 0, 0, 4), (1, -0.1, 0, 0, 0, 4)]:
        with pytest.raises(ValueError):
            _core_tests._keep_row(*args, "scalar")
    for name in ["scalar", "avx2", "avx512", "neon"]:
        if name not in PATHS:
            with pytest.raises(ValueError, match="cannot run"):
                _core_tests._keep_row(1, 0.1, 0, 0, 0, 4, name)


CHILD = textwrap.dedent("""
    import numpy as np
    import attention_c as ac
    from attention_c import _core
    # values = identity rows: out_it = alpha_it keep_it / (1 - p), so the
    # keep pattern shows where out is 0 (alpha > 0 everywhere)
    rng = np.random.default_rng(0)
    T, d = 67, 8
    q = rng.standard_normal((2, 3, T, d))
    k = rng.standard_normal((2, 3, T, d))
    v = np.broadcast_to(np.eye(T), (2, 3, T, T))
    out, _ = ac.dot_attention(q, k, values=v, dropout=0.3, seed=2024)
    print(_core._get_simd())
    np.save(__import__("sys").stdout.buffer, out != 0)
""")


@pytest.mark.parametrize("path", PATHS)
def test_forward_keep_pattern_by_environment(path, tmp_path):
    """ATTENTION_C_SIMD=<path> in a fresh process: the forward's keep
    pattern is the reference's (T = 67: runs of vectors and tails)."""
    env = dict(os.environ, ATTENTION_C_SIMD=path)
    r = subprocess.run([sys.executable, "-c", CHILD], env=env,
                       capture_output=True, check=True)
    head, _, data = r.stdout.partition(b"\n")
    assert head.decode() == path
    out_path = tmp_path / "keep.npy"
    out_path.write_bytes(data)
    kept = np.load(out_path)
    want = ref.dropout_keep(2024, 0.3, np.arange(6).reshape(2, 3), 67, 67)
    assert np.array_equal(kept, want)
