"""The 16-bit conversions of the binding (attention.h's att_convert16):
16-bit inputs of a float32 call widened, its results rounded back, on
every SIMD path (vector loops, then core/half.h for the elements past the
last vector).

* every float16 and bfloat16 pattern widens exactly (NaN stays NaN);
* float32 values round as NumPy (float16) and ml_dtypes (bfloat16) round
  them: 2 million random patterns and the edges (the largest finite
  values, halfway cases, subnormal results, signed zeros, infinities),
  bit for bit; NaN gives a NaN of its sign (bfloat16: ml_dtypes' quiet
  NaN, bit for bit);
* lengths around the vectors (0, 1, 3, 17, 65) give the same bits as one
  long conversion;
* a call on 16-bit inputs laid out any way (C-contiguous ones take these
  loops, the others NumPy's cast) gives the same bits.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core, _core_tests
from attention_c.testing import HALF_DTYPES, assert_all_identical

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())
FMT = {"float16": "f16", "bfloat16": "bf16"}
half_param = pytest.mark.parametrize("dtype", HALF_DTYPES,
                                     ids=lambda d: np.dtype(d).name)

EDGES = np.array([
    0x00000000, 0x80000000, 0x7f800000, 0xff800000,       # zeros, infs
    0x7f7fffff, 0xff7fffff, 0x477fefff, 0x477ff000,       # near 65520
    0x477fe000, 0x3f808000, 0x3f818000, 0x3f800001,       # halfway, ties
    0x38800000, 0x387fc000, 0x33800000, 0x33000001,       # float16's
    0x33000000, 0x00000001, 0x80000001, 0x00800000,       # subnormals
    0x7fc00001, 0xffc12345, 0x7f800001, 0x7fa00000],      # NaNs
    dtype=np.uint32).view(np.float32)


def patterns(dtype):
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype)


@pytest.mark.parametrize("simd", SIMD_PATHS)
@half_param
def test_every_pattern_widens_exactly(dtype, simd):
    p = patterns(dtype)
    got = _core_tests._convert16(p.view(np.uint16), FMT[np.dtype(dtype).name],
                                 simd)
    want = p.astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32),
                          want[~nan].view(np.uint32))


@pytest.mark.parametrize("simd", SIMD_PATHS)
@half_param
def test_rounding_as_numpy(dtype, simd):
    rng = np.random.default_rng(41)
    x = np.concatenate([rng.integers(0, 2**32, 2_000_000, dtype=np.uint64)
                        .astype(np.uint32).view(np.float32), EDGES])
    got = _core_tests._convert16(x, FMT[np.dtype(dtype).name], simd)
    with np.errstate(all="ignore"):
        want = x.astype(dtype).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    back = got[nan].view(dtype).astype(np.float32)
    assert np.all(np.isnan(back))
    assert np.array_equal(np.signbit(back), np.signbit(x[nan]))
    if np.dtype(dtype).name == "bfloat16":      # ml_dtypes' quiet NaN
        assert np.array_equal(got[nan], want[nan])


@pytest.mark.parametrize("simd", SIMD_PATHS)
@half_param
def test_lengths_around_the_vectors(dtype, simd):
    rng = np.random.default_rng(42)
    x = rng.standard_normal(200).astype(np.float32) * 1e3
    fmt = FMT[np.dtype(dtype).name]
    whole = _core_tests._convert16(x, fmt, simd)
    for n in (0, 1, 3, 17, 65):
        assert np.array_equal(_core_tests._convert16(x[:n], fmt, simd),
                              whole[:n])
        assert np.array_equal(
            _core_tests._convert16(whole[:n], fmt, simd),
            whole[:n].view(dtype).astype(np.float32))


@half_param
def test_any_layout_same_bits(dtype):
    """16-bit inputs as transposed, sliced and reversed views (NumPy's cast)
    and as C-contiguous arrays (the conversion loops): the same results."""
    rng = np.random.default_rng(43)
    q, k, v = (rng.standard_normal((3, 40, 2, 24)).astype(dtype)
               for _ in range(3))
    views = [x.transpose(0, 2, 1, 3)[:, :, ::-1] for x in (q, k, v)]
    plain = [np.ascontiguousarray(x) for x in views]
    for rw in (True, False):
        got = ac.dot_attention(views[0], views[1], values=views[2],
                               causal=True, return_weights=rw)
        want = ac.dot_attention(plain[0], plain[1], values=plain[2],
                                causal=True, return_weights=rw)
        assert got[0].dtype == dtype
        assert_all_identical(got, want, f"return_weights={rw}")
