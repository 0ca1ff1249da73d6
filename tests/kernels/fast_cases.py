"""The fast layer's shared test cases, used by test_fast.py and
test_fast_runtime.py: the SIMD paths this CPU runs (``PATHS``,
``SIMD_PATHS``) and those it does not (``UNSUPPORTED``, of ``ORDER``),
the parametrizations over them and over the dtypes, the ids of problem
sizes (``size_id``) and ``assert_rel``, the normwise check.
"""

import numpy as np
import pytest

from attention_c import _core
from attention_c.testing import DTYPES, rel_err

ORDER = ["scalar", "avx2", "avx512", "neon"]
PATHS = list(_core._simd_paths())              # the paths this CPU runs
SIMD_PATHS = PATHS[1:]
UNSUPPORTED = [name for name in ORDER if name not in PATHS]


def _dtype_id(dtype):
    return np.dtype(dtype).name


def size_id(size):
    lead, T, H, A = size
    return "B{}-T{}-H{}-A{}".format("x".join(map(str, lead)) or "0", T, H, A)


dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
path_param = pytest.mark.parametrize("path", PATHS)
simd_param = pytest.mark.parametrize("path", SIMD_PATHS)


def assert_rel(got, want, tol, what):
    """Normwise relative error of got against want is <= tol."""
    err = rel_err(got, want)
    assert err <= tol, f"{what}: normwise relative error {err:.3g} > {tol:g}"
