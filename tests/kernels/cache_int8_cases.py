"""The shared cases of the int8 key/value cache tests (issue 34, step
2), used by test_cache_int8.py (``quantize_kv``, ``dequantize_kv``) and
test_cache_int8_attention.py (``cache_attention`` on int8 caches): the
contract's formulas transcribed in plain float32 NumPy
(``quantize_plain``, ``dequantize_plain``), rows whose groups hold ties,
near ties, zeros and underflowing scales (``tricky_rows``), the float
input dtypes (``INPUT_DTYPES``), the 16-bit dtypes (``F16``, ``BF16``,
None without a bfloat16) and the dtypes' test ids (``dtype_id``).
"""

import numpy as np

from attention_c.testing import HALF_DTYPES

F16 = np.dtype(np.float16)
BF16 = next((np.dtype(t) for t in HALF_DTYPES if np.dtype(t) != F16), None)
INPUT_DTYPES = [np.dtype(np.float32), np.dtype(np.float64), F16] + (
    [BF16] if BF16 is not None else [])


def dtype_id(dt):
    return np.dtype(dt).name


# --------------------------------------------------------------------------
# the contract's formulas, transcribed in plain float32 NumPy

def quantize_plain(x, g, sdtype=np.float32):
    """(q int8, scales of sdtype): per group of g elements, in float32,
    scale = max|x| / 127 (float16 scales: the least float16 >= it), q =
    clip(rint(x / scale), -127, 127) with the scale as stored, both 0 for
    a scale of 0."""
    x32 = np.asarray(x).astype(np.float32)
    lead, d = x32.shape[:-1], x32.shape[-1]
    xg = x32.reshape(lead + (d // g, g))
    scale = np.max(np.abs(xg), axis=-1) / np.float32(127)
    assert scale.dtype == np.float32
    if np.dtype(sdtype) == F16:
        near = scale.astype(np.float16)
        scale = np.where(near.astype(np.float64) >= scale, near,
                         np.nextafter(near, np.float16(np.inf)))
        assert scale.dtype == F16
    with np.errstate(divide="ignore", invalid="ignore"):
        quotient = xg / scale[..., None].astype(np.float32)
    assert quotient.dtype == np.float32
    q = np.clip(np.rint(quotient), -127, 127)
    q = np.where(scale[..., None] == 0, 0, q)
    return q.astype(np.int8).reshape(x32.shape), scale


def dequantize_plain(q, scales):
    """float32 (..., d): the exact float64 product scales * q, rounded
    once to float32 (what one float32 multiply gives)."""
    g = q.shape[-1] // scales.shape[-1]
    s = np.repeat(scales.astype(np.float64), g, axis=-1)
    return (s * q.astype(np.float64)).astype(np.float32)


def tricky_rows(rng, shape, g):
    """float32 rows (..., d) whose groups are Gaussian, or exact ties
    (max 127 s, the others (k + 1/2) s with s a power of two), or near
    ties (fl((k + 1/2) fl(m / 127)): the float32 quotient decides), or all
    zero (some -0), or subnormal (their scale underflows, or nearly)."""
    *lead, d = shape
    xg = rng.standard_normal(tuple(lead) + (d // g, g)).astype(np.float32)
    kind = rng.integers(0, 6, xg.shape[:-1])
    half = (rng.integers(-127, 127, xg.shape) + 0.5)
    s = np.float32(2.0) ** rng.integers(-6, 4, xg.shape[:-1] + (1,))
    ties = (half * s).astype(np.float32)
    ties[..., 0] = 127 * s[..., 0] * np.sign(rng.standard_normal(
        xg.shape[:-1]))
    m = (rng.random(xg.shape[:-1] + (1,)) * 10 + 0.1).astype(np.float32)
    near = (half.astype(np.float32) * (m / np.float32(127))).astype(
        np.float32)
    near[..., 0] = m[..., 0]
    zero = np.where(rng.random(xg.shape) < 0.5, np.float32(-0.0),
                    np.float32(0.0))
    tiny = (rng.integers(-200, 200, xg.shape) * np.float32(2.0**-149)
            ).astype(np.float32)
    xg = np.where((kind == 1)[..., None], ties, xg)
    xg = np.where((kind == 2)[..., None], near, xg)
    xg = np.where((kind == 3)[..., None], zero, xg)
    xg = np.where((kind == 4)[..., None], tiny, xg)
    return xg.reshape(shape)
