"""int8 key/value caches (issue 34, step 2): ``quantize_kv`` and
``dequantize_kv``, between float rows and int8 numbers with one float32
or float16 scale per group of g consecutive elements of a row (the
scales: the rows' leading axes + (d // g,)).

Oracles: the contract's formulas transcribed in plain float32 NumPy
(``quantize_plain``, ``dequantize_plain``, in cache_int8_cases.py), a few
answers worked out by hand, and the float64 reference
``attention_c.reference``.  Proven here:

* quantize_kv is the formula, bit for bit: groups of 8, 32 and d, leading
  axes (none, several, an empty one), float32, float64, float16 and
  bfloat16 inputs (16-bit widened exactly, float64 rounded to float32),
  ties rounded to even, quotients rounded in float32 (near ties), all-zero
  groups (-0 too) and groups whose scale underflows to 0 give q 0, scale
  0; |x - dequantize_kv(q, scales)| <= scale / 2 per element (up to the
  float32 roundings of x / scale and scale * q);
* dequantize_kv is one float32 product per element, float32 and float16
  scales (the exact float64 product rounded once);
* the reference's quantize_kv and dequantize_kv are the same bits;
* bad input refused with an error naming the argument (non-finite x:
  saying it is not finite), x left as it was, and without a warning.

cache_attention on int8 caches, and the append into them:
test_cache_int8_attention.py.
"""

import re

import numpy as np
import pytest

import attention_c as ac
from attention_c import reference as ref
from attention_c.testing import assert_identical

from cache_int8_cases import (F16, INPUT_DTYPES, dequantize_plain, dtype_id,
                              quantize_plain, tricky_rows)

pytestmark = pytest.mark.filterwarnings("error")


def stored(x, dtype):
    """x (float32) as a 16-bit or float64 input holding the same kind of
    numbers."""
    return x.astype(dtype)


# --------------------------------------------------------------------------
# quantize_kv and dequantize_kv

# (d, groups, leading axes)
QUANT_SHAPES = [
    (8, [8], [(), (5,), (2, 3, 4)]),
    (64, [8, 32, 64], [(), (7,), (3, 2, 5), (2, 0, 3)]),
    (96, [8, 32, 96], [(11,), (1, 1, 4)]),
]


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=dtype_id)
def test_quantize_formula(dtype):
    """quantize_kv(x, group) is the formula's q and scales, bit for bit,
    and the reference's; the 16-bit inputs those of the widened array."""
    rng = np.random.default_rng(1)
    for d, groups, leads in QUANT_SHAPES:
        for g in groups:
            for lead in leads:
                x = tricky_rows(rng, lead + (d,), g)
                x[..., :1] *= np.float32(3.0)          # other magnitudes
                x = stored(x, dtype)
                what = f"{dtype_id(dtype)} d {d} g {g} lead {lead}"
                want = quantize_plain(x, g)
                q, scales = ac.quantize_kv(x, group=g)
                assert type(q) is np.ndarray and type(scales) is np.ndarray
                assert_identical(q, want[0], f"{what}: q")
                assert_identical(scales, want[1], f"{what}: scales")
                rq, rs = ref.quantize_kv(x, group=g)
                assert_identical(rq, want[0], f"{what}: reference q")
                assert_identical(rs, want[1], f"{what}: reference scales")
                if dtype != np.float64:                # widened exactly
                    w = ac.quantize_kv(x.astype(np.float32), group=g)
                    assert_identical(q, w[0], what)
                    assert_identical(scales, w[1], what)
    # the default group is 32
    x = rng.standard_normal((3, 64)).astype(dtype)
    q, scales = ac.quantize_kv(x)
    assert scales.shape == (3, 2)
    assert_identical(q, quantize_plain(x, 32)[0], "group=32 default")


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=dtype_id)
def test_quantize_known_answers(dtype):
    """Worked out by hand: a group whose largest magnitude is 127 s
    (s a power of two) has scale s exactly, and x / s = k + 1/2 rounds
    to the even neighbour; a group of zeros (or -0) has q 0 and scale 0,
    and so does a group whose scale underflows (float32 inputs)."""
    s = 0.125
    row = np.array([127, 2.5, -2.5, 3.5, -0.5, 0.5, 1.5, -126.5,
                    -127, 126.5, 125.5, -1.5, 4.5, -5.5, 0.25, 0.75,
                    0, 0, 0, 0, -0.0, 0, 0, -0.0,
                    64, 16, -8, 0, 1, -2, 0.5, 0.25]) * s
    # the last group: 127 v / 64 = 31.75, -15.875, 1.98, -3.97, 0.99, 0.5
    want_q = [127, 2, -2, 4, 0, 0, 2, -126,
              -127, 126, 126, -2, 4, -6, 0, 1,
              0, 0, 0, 0, 0, 0, 0, 0,
              127, 32, -16, 0, 2, -4, 1, 0]
    want_s = [s, s, 0, 64 * s / 127]
    x = row.astype(dtype)
    q, scales = ac.quantize_kv(x, group=8)
    assert q.dtype == np.int8 and scales.dtype == np.float32
    assert q.tolist() == want_q, q.tolist()
    assert scales[:3].tolist() == want_s[:3], scales
    assert scales[3] == np.float32(np.float32(64 * s) / np.float32(127))
    if dtype == np.float32:
        # max |x| = 2^-149 * 100: 100 / 127 of the smallest subnormal
        # rounds to 1 of it; 2^-149 / 127 rounds to 0
        tiny = np.float32(2.0**-149)
        x = np.array([tiny] + [0] * 7 + [100 * tiny, -50 * tiny] + [0] * 6,
                     np.float32)
        q, scales = ac.quantize_kv(x, group=8)
        assert scales[0] == 0 and not q[:8].any(), (q, scales)
        assert scales[1] == tiny, scales
        assert q[8:10].tolist() == [100, -50], q


def test_quantize_rounds_in_float32():
    """The quotient x / scale is a float32 division (not x * (1/scale),
    not float64): near ties decide differently otherwise.  Counts that
    this sample holds such cases, then checks the bits."""
    rng = np.random.default_rng(2)
    x = np.empty((4000, 32), np.float32)
    m = (rng.random((4000, 1)) * 10 + 0.1).astype(np.float32)
    scale = m / np.float32(127)
    k = rng.integers(-127, 127, (4000, 32)) + 0.5
    x[:] = (k * scale).astype(np.float32)
    x[:, 0] = m[:, 0]
    want = quantize_plain(x, 32)
    f64 = np.clip(np.rint(x.astype(np.float64) / scale.astype(np.float64)),
                  -127, 127)
    recip = np.clip(np.rint(x * (np.float32(1) / scale)), -127, 127)
    assert (f64 != want[0]).sum() > 100 and (recip != want[0]).sum() > 100
    q, scales = ac.quantize_kv(x, group=32)
    assert_identical(scales, want[1], "scales")
    assert_identical(q, want[0], "q")


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=dtype_id)
def test_round_trip_bound(dtype):
    """|x - dequantize_kv(q, scales)| <= scale / 2 per element, up to the
    two float32 roundings (x / scale: 127 2^-24 at most, and scale * q):
    scale (1/2 + 2^-16); q in [-127, 127]; the largest element of a
    group comes back within a rounding of its value."""
    rng = np.random.default_rng(3)
    for d, g in ((8, 8), (64, 8), (64, 32), (128, 128)):
        x = stored((rng.standard_normal((50, 3, d)) * np.exp(
            rng.standard_normal((50, 3, 1)) * 1.5)).astype(np.float32),
            dtype)
        q, scales = ac.quantize_kv(x, group=g)
        back = ac.dequantize_kv(q, scales)
        s = np.repeat(scales.astype(np.float64), g, axis=-1)
        err = np.abs(x.astype(np.float32).astype(np.float64) - back)
        assert np.all(err <= s * (0.5 + 2.0**-16)), (
            dtype_id(dtype), d, g, np.max(err / s))
        if dtype == np.float64:       # x itself, not x as float32
            err64 = np.abs(x - back)
            assert np.all(err64 <= s * (0.5 + 2.0**-15))
        assert q.min() >= -127
        top = np.abs(x.astype(np.float32)).reshape(50, 3, d // g, g).max(-1)
        assert np.allclose(np.abs(back).reshape(50, 3, d // g, g).max(-1),
                           top, rtol=2.0**-22, atol=0)


def test_quantize_float16_scales():
    """scale_dtype=float16: the least float16 at or above the float32
    scale, q from it (the formula's bits, the reference's), so that
    |x - scale q| <= scale / 2 holds for the scale as stored, down to
    groups whose scale is a float16 subnormal (a float32 scale that
    underflows to 0 stays 0, q 0, as with float32 scales); groups up to
    127 x 65504 (the largest float16 scale) and no larger."""
    rng = np.random.default_rng(4)
    for d, g in ((8, 8), (64, 32), (128, 128)):
        x = tricky_rows(rng, (40, 3, d), g)
        x *= 2.0 ** rng.integers(-30, 12, (40, 3, 1))  # (ties kept)
        x = x.astype(np.float32)
        x[0, 0, :g] = 1e-6                      # a subnormal scale
        want = quantize_plain(x, g, F16)
        q, scales = ac.quantize_kv(x, group=g, scale_dtype=np.float16)
        assert scales.dtype == F16
        assert_identical(q, want[0], f"d {d} g {g}: q")
        assert_identical(scales, want[1], f"d {d} g {g}: scales")
        rq, rs = ref.quantize_kv(x, group=g, scale_dtype=np.float16)
        assert_identical(rq, want[0], "reference q")
        assert_identical(rs, want[1], "reference scales")
        s = np.repeat(scales.astype(np.float64), g, axis=-1)
        err = np.abs(x.astype(np.float64) - ac.dequantize_kv(q, scales))
        under = np.repeat(quantize_plain(x, g)[1] == 0, g, axis=-1)
        assert not q[under].any()
        assert np.all(err[~under] <= s[~under] * (0.5 + 2.0**-16))
        assert (scales[0, 0, 0] > 0 and scales[0, 0, 0] < 2.0**-14
                and q[0, 0, 0] != 0)
        assert q.min() >= -127
    top = np.full(8, 127 * 65504, np.float32)
    q, scales = ac.quantize_kv(top, group=8, scale_dtype=np.float16)
    assert scales[0] == 65504 and (q == 127).all()
    with pytest.raises(ValueError, match=r"\bx\b.*float16"):
        ac.quantize_kv(top * np.float32(1.001), group=8,
                       scale_dtype=np.float16)


@pytest.mark.parametrize("bad,error", [
    ({"group": True}, TypeError), ({"group": 8.0}, TypeError),
    ({"scale_dtype": np.float64}, TypeError),
    ({"scale_dtype": np.int8}, TypeError)], ids=str)
def test_quantize_arguments_refused(bad, error):
    with pytest.raises(error, match="group|scale_dtype"):
        ac.quantize_kv(np.ones((2, 16), np.float32), **{"group": 8, **bad})


@pytest.mark.parametrize("sdtype", [np.float32, np.float16], ids=dtype_id)
def test_dequantize_formula(sdtype):
    """dequantize_kv(q, scales) = float32(scales[..., c // g]) * q[..., c],
    one float32 product (= the exact product rounded once), every q
    (-128 included), scales of any exponent; float32 out; the reference
    the same bits."""
    rng = np.random.default_rng(4)
    lo, hi = (-40, 40) if sdtype == np.float32 else (-14, 14)
    for d, ng, lead in ((8, 1, (5,)), (64, 8, (2, 3)), (64, 2, ()),
                        (96, 1, (4, 1, 2)), (96, 12, (3, 0))):
        q = rng.integers(-128, 128, lead + (d,)).astype(np.int8)
        scales = (rng.random(lead + (ng,)) * 2.0 ** rng.integers(
            lo, hi, lead + (ng,))).astype(sdtype)
        want = dequantize_plain(q, scales)
        got = ac.dequantize_kv(q, scales)
        assert_identical(got, want, f"d {d} ng {ng} lead {lead}")
        g = d // ng
        mult = (np.repeat(scales.astype(np.float32), g, axis=-1) *
                q.astype(np.float32))
        assert_identical(got, mult, "a float32 multiply")
        assert_identical(ref.dequantize_kv(q, scales), want, "reference")


QUANT_BAD = {
    "group_not_dividing": (lambda: (np.ones((2, 40), np.float32), 32),
                           ValueError, ["group", "40"]),
    "group_too_small": (lambda: (np.ones((2, 32), np.float32), 4),
                        ValueError, ["group", "32"]),
    "group_zero": (lambda: (np.ones((2, 32), np.float32), 0),
                   ValueError, ["group"]),
    "group_bigger_than_d": (lambda: (np.ones((2, 16), np.float32), 32),
                            ValueError, ["group", "16"]),
    "nan": (lambda: (np.where(np.arange(64) == 40, np.nan,
                              1.0).astype(np.float32), 32),
            ValueError, ["finite"]),
    "inf": (lambda: (np.where(np.arange(64) == 3, -np.inf,
                              1.0).astype(np.float16), 32),
            ValueError, ["finite"]),
    "float64_beyond_float32": (lambda: (np.full((3, 32), 1e39), 32),
                               ValueError, ["finite"]),
    "complex": (lambda: (np.ones((2, 32), np.complex64), 32),
                (TypeError, ValueError), [r"\bx\b"]),
    "scalar": (lambda: (np.float32(1.0), 8), (TypeError, ValueError),
               [r"\bx\b"]),
}


@pytest.mark.parametrize("name", list(QUANT_BAD))
def test_quantize_refused(name):
    make, error, words = QUANT_BAD[name]
    x, group = make()
    saved = np.array(x, copy=True)
    with pytest.raises(error) as info:
        ac.quantize_kv(x, group=group)
    for w in words:                     # each named in the message
        assert re.search(w, str(info.value)), (w, str(info.value))
    assert_identical(np.asarray(x), saved, "x")


def _dq_bad(name):
    rng = np.random.default_rng(5)
    q = rng.integers(-127, 128, (3, 32)).astype(np.int8)
    s = rng.random((3, 4)).astype(np.float32)
    if name == "q_float":
        return q.astype(np.float32), s, TypeError, r"\bq\b"
    if name == "q_int16":
        return q.astype(np.int16), s, TypeError, r"\bq\b"
    if name == "scales_float64":
        return q, s.astype(np.float64), TypeError, "scales"
    if name == "scales_int":
        return q, (s * 10).astype(np.int32), TypeError, "scales"
    if name == "lead_mismatch":
        return q, s[:2], ValueError, "scales"
    if name == "not_dividing":
        return q, rng.random((3, 3)).astype(np.float32), ValueError, "scales"
    if name == "group_too_small":
        return q, rng.random((3, 8)).astype(np.float32), ValueError, "scales"
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["q_float", "q_int16", "scales_float64",
                                  "scales_int", "lead_mismatch",
                                  "not_dividing", "group_too_small"])
def test_dequantize_refused(name):
    q, s, error, pattern = _dq_bad(name)
    with pytest.raises(error, match=pattern):
        ac.dequantize_kv(q, s)
