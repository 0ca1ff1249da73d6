"""bf16 products for float32 calls (attention_c.set_fp32_precision): the
streamed forward on AMX tiles (csrc/simd/flash_amx.inc) or on the dot
products (csrc/simd/flash.inc's FLASH_DP: AVX512_BF16's vdpbf16ps, Arm's
BFDOT) where the CPU has them, float32 products everywhere else.  (The
NEON path's BFDOT runs under qemu in tests/neon, whose driver models its
rounding in C.)

* the setting: default "ieee", a context manager that restores it, bad
  values refused, show_config reports it;
* what it does not change (bitwise): float64 calls, calls that return the
  weights, every call on a CPU or path without fast bf16 products;
* the unit: "auto" by default, "dot" or "amx" chosen where the CPU has
  it (on Intel, the dot products run only when chosen), refused where it
  has not, bad names refused;
* on each unit the CPU has (skipped elsewhere; both on a Sapphire Rapids):
  - the rounding, exactly: one key gives out = V rounded to bf16 (to
    nearest even, clamped to bf16's finite range) and lse = the score of
    Q and K rounded to bf16, products exact, summed in float32, scaled in
    float32; on the dot products bit for bit, the CPU's sums modelled
    (attention_c.testing.dot_bf16: x86's vdpbf16ps adds each pair's odd
    product before its even one, each sum to nearest; Arm's BFDOT adds
    the pair's sum, each sum to odd, which add_odd models and is checked
    against exact sums here);
  - sizes across the tiles (16 queries, 16 and 64 keys, 32 elements of d,
    16 of dv) and one more or less, causal, window, sinks, grouped heads,
    packed sequences with one that sees no key, the general score:
    within BF16_TOL of the float64 reference, and beyond float32's
    rounding (the tiles did run);
  - bitwise identical results for 1, 2 and 3 threads; inputs unchanged.

Tolerances: normwise against float64, BF16_TOL = 8e-3 (each operand and
weight rounded to bf16 costs up to 2^-9 relative; the measured error is
2.4e-3 to 3.5e-3); exact where the case is exact.
"""

import io
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import (add_odd, assert_all_identical,
                                 assert_rounded, dot_bf16, f64, rel_err)
from attention_c.testing import round_bf16 as bf16

pytestmark = pytest.mark.filterwarnings("error")

BF16_TOL = 8e-3
# What float32 products stay within here (testing.TOL's float32 is 1e-5):
# a bf16 result must be further off than this, or the tiles did not run
FLOAT32_ERR = 1e-5


@pytest.fixture(params=["dot", "amx"])
def unit(request, restore_settings):
    """Each unit of bf16 products this CPU has, chosen for the test."""
    if request.param not in _core._bf16_units():
        pytest.skip(f"this CPU has no {request.param} bf16 products")
    _core._set_bf16_unit(request.param)
    return request.param


def _inputs(rng, lead, Tq, T, H, Hv, kv_lead=None):
    q = rng.standard_normal(lead + (Tq, H)).astype(np.float32)
    kl = lead if kv_lead is None else kv_lead
    k = rng.standard_normal(kl + (T, H)).astype(np.float32)
    v = rng.standard_normal(kl + (T, Hv)).astype(np.float32)
    return q, k, v


def _forward(fn, q, k, v, precision, **kw):
    with ac.set_fp32_precision(precision):
        return fn(q, k, values=v, return_weights=False, **kw)


# -- the setting --------------------------------------------------------

@pytest.mark.usefixtures("restore_settings")
def test_setting_and_context_manager():
    assert ac.get_fp32_precision() == "ieee"
    with ac.set_fp32_precision("bf16") as ctx:
        assert ac.get_fp32_precision() == "bf16"
        assert "bf16" in repr(ctx)
        with ac.set_fp32_precision("ieee"):
            assert ac.get_fp32_precision() == "ieee"
        assert ac.get_fp32_precision() == "bf16"
    assert ac.get_fp32_precision() == "ieee"
    ac.set_fp32_precision("bf16")       # a plain call sets it for good
    assert ac.get_fp32_precision() == "bf16"
    ac.set_fp32_precision("ieee")
    info = ac.show_config(file=io.StringIO())
    assert info["fp32_precision"] == "ieee"
    assert info["bf16_products"] is _core._bf16_products()


@pytest.mark.usefixtures("restore_settings")
def test_unit_setting():
    """"auto" by default: AMX where the OS grants it, else the dot
    products where they beat the FMAs (measured: the rate is a number,
    never asserted against the threshold); a unit the CPU and path lack
    is refused, naming them; a bad name is refused; the path's units
    follow the path."""
    assert _core._get_bf16_unit() == "auto"
    units = _core._bf16_units()
    assert set(units) <= {"dot", "amx"}
    assert "amx" not in units or "dot" in units     # AMX implies AVX512_BF16
    auto = _core._bf16_unit()
    speedup = _core._bf16_dot_speedup()
    if "dot" in units:
        assert 0.05 < speedup < 20, speedup          # a measured ratio
    else:
        assert speedup == 0
    if "amx" in units:
        assert auto == "amx"
    else:
        assert auto in (("dot", None) if units else (None,))
    assert _core._bf16_products() == (auto is not None)
    for name in ("dot", "amx"):
        if name in units:
            _core._set_bf16_unit(name)
            assert _core._get_bf16_unit() == name
            assert _core._bf16_unit() == name
            info = ac.show_config(file=io.StringIO())
            assert info["bf16_unit"] == name and info["bf16_products"]
        else:
            with pytest.raises(ValueError, match="path have no "):
                _core._set_bf16_unit(name)
    for bad in ("AMX", "tiles", None):
        with pytest.raises(ValueError, match="'auto', 'dot' or 'amx'"):
            _core._set_bf16_unit(bad)
    _core._set_bf16_unit("auto")
    assert _core._bf16_unit() == auto
    if "avx2" in _core._simd_paths():
        _core._set_simd("avx2")
        assert _core._bf16_units() == () and _core._bf16_unit() is None


@pytest.mark.skipif("dot" not in _core._bf16_units(),
                    reason="this CPU has no bf16 dot products")
def test_unit_from_environment():
    """ATTENTION_C_BF16_UNIT=dot in a fresh process chooses the dot
    products; a unit the CPU lacks warns and is ignored."""
    code = ("import attention_c, attention_c._core as c; "
            "print(c._get_bf16_unit(), c._bf16_unit())")
    for value, want in (("dot", "dot dot"), ("tiles", "auto ")):
        env = dict(os.environ, ATTENTION_C_BF16_UNIT=value)
        r = subprocess.run([sys.executable, "-W", "always", "-c", code],
                           env=env, capture_output=True, text=True,
                           check=True)
        assert r.stdout.startswith(want), r.stdout
        assert ("ignored" in r.stderr) == (value == "tiles"), r.stderr


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("bad, err", [("tf32", ValueError),
                                      ("BF16", ValueError),
                                      (None, TypeError), (16, TypeError)])
def test_bad_precision_refused(bad, err):
    with pytest.raises(err, match="ieee.*bf16|bf16.*ieee"):
        ac.set_fp32_precision(bad)
    assert ac.get_fp32_precision() == "ieee"


@pytest.mark.usefixtures("restore_settings")
def test_unchanged_where_bf16_does_not_run():
    """float64, the weights' path, and (on a CPU or path without fast bf16
    products) every float32 call: bitwise as with "ieee"."""
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, (2,), 70, 90, 17, 9)
    q64, k64, v64 = f64(q), f64(k), f64(v)
    assert_all_identical(_forward(ac.dot_attention, q64, k64, v64, "bf16"),
                         _forward(ac.dot_attention, q64, k64, v64, "ieee"),
                         "float64")
    for precision in ("bf16", "ieee"):
        with ac.set_fp32_precision(precision):
            got = ac.dot_attention(q, k, values=v, causal=True)
        if precision == "bf16":
            weights = got
        else:
            assert_all_identical(weights, got, "return_weights=True")
    paths = [p for p in _core._simd_paths()]
    for simd in paths:
        _core._set_simd(simd)
        if _core._bf16_products():
            continue
        assert_all_identical(_forward(ac.dot_attention, q, k, v, "bf16"),
                             _forward(ac.dot_attention, q, k, v, "ieee"),
                             f"{simd} without bf16 products")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_inputs_take_bf16_products(causal):
    """A call on bfloat16 inputs (ml_dtypes) takes the bf16 products by
    itself, whatever the setting: the float32 call with "bf16" on the
    widened inputs, rounded once (lse float32); float32 products where
    the CPU has no fast bf16 ones."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(5)
    q, k, v = (x.astype(ml_dtypes.bfloat16)
               for x in _inputs(rng, (2, 3), 70, 150, 40, 24))
    wide = [x.astype(np.float32) for x in (q, k, v)]
    want = _forward(ac.dot_attention, *wide, "bf16", causal=causal)
    for setting in ("ieee", "bf16"):
        got = _forward(ac.dot_attention, q, k, v, setting, causal=causal)
        assert_rounded(got, want, ml_dtypes.bfloat16, setting, lse=1)
    if _core._bf16_products():
        ieee = _forward(ac.dot_attention, *wide, "ieee", causal=causal)
        assert not np.array_equal(want[0], ieee[0])


# -- where the tiles run ------------------------------------------------

@pytest.mark.parametrize("H", [1, 17, 64, 65])
def test_one_key_rounds_exactly(unit, H):
    """One key: its weight is 1, so out is V rounded to bf16, and lse is
    the score: Q and K rounded to bf16, exact products summed in float32,
    times scale log2 e in float32, times ln 2.  Values beyond bf16's range
    clamp."""
    rng = np.random.default_rng(H)
    Tq = 40          # several queries: the streamed path, not decoding
    q = rng.standard_normal((1, Tq, H)).astype(np.float32)
    k = rng.standard_normal((1, 1, H)).astype(np.float32)
    v = (rng.standard_normal((1, 1, H)) *
         np.logspace(-30, 30, H)).astype(np.float32)
    v[0, 0, 0] = np.finfo(np.float32).max       # past bf16's range
    out, lse = _forward(ac.dot_attention, q, k, v, "bf16")
    np.testing.assert_array_equal(out, np.broadcast_to(bf16(v), out.shape))
    scale = np.float32(1 / np.sqrt(H))
    c = np.float32(scale * np.float32(1.4426950408889634))
    s = (f64(bf16(q)) * f64(bf16(k))).sum(-1)     # exact, then one
    want = s * f64(c) * np.log(2)                 # rounding in all
    np.testing.assert_allclose(lse, want, rtol=2e-6, atol=2e-6 * H)
    if unit == "dot":
        m = np.float32(dot_bf16(bf16(q), bf16(k))[..., 0] * c)
        np.testing.assert_array_equal(lse, m * np.float32(np.log(2)))


def test_dot_product_model_is_exact():
    """dot_bf16 (attention_c.testing) is exact where it claims: float32
    products of bf16 values lose nothing (16 significant bits), so only
    the sums round."""
    rng = np.random.default_rng(1)
    a = bf16(rng.standard_normal((5, 9)).astype(np.float32))
    b = bf16(rng.standard_normal((4, 9)).astype(np.float32))
    prods = f64(a)[:, None, :] * f64(b)[None, :, :]
    np.testing.assert_array_equal(prods.astype(np.float32), prods)
    for sums in ("nearest", "odd"):
        assert rel_err(dot_bf16(a, b, sums), f64(a) @ f64(b).T) < 1e-6
    with pytest.raises(ValueError, match="'nearest' or 'odd'"):
        dot_bf16(a, b, "up")


def _odd_exact(x, y):
    """x + y rounded to odd from the exact sum (fractions), flushed below
    the least normal float: what add_odd must give."""
    exact = Fraction(float(x)) + Fraction(float(y))
    t = np.float32(float(exact))
    if abs(Fraction(float(t))) > abs(exact):
        t = np.nextafter(t, np.float32(0))
    if Fraction(float(t)) != exact:
        t = (np.array([t]).view(np.uint32) | 1).view(np.float32)[0]
    return np.float32(0) if abs(t) < np.finfo(np.float32).tiny else t


def test_round_to_odd_model():
    """add_odd (attention_c.testing), Arm BFDOT's sums: known results (an
    inexact sum truncated with its lowest bit set, exact ones exact,
    subnormal results flushed), then random sums over 60 binades against
    the exact sum rounded to odd."""
    f = np.float32
    ulp = 2.0 ** -23
    known = [(1, 2 ** -31, 1 + ulp), (1, -2 ** -31, 1 - ulp / 2),
             (2, 1 + ulp, 3 + 2 * ulp), (1, 1, 2), (1.5, -1.5, 0),
             (2 ** -126, -2 ** -127, 0), (-1, -2 ** -40, -(1 + ulp))]
    for x, y, want in known:
        assert add_odd(f(x), f(y)) == f(want), (x, y)
    rng = np.random.default_rng(7)
    x, y = ((rng.standard_normal(3000) *
             np.exp2(rng.integers(-30, 30, 3000))).astype(f)
            for _ in range(2))
    got = add_odd(x, y)
    want = np.array([_odd_exact(a, b) for a, b in zip(x, y)], f)
    np.testing.assert_array_equal(got, want)


CASES = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window": (20, 3)},
    "sinks": {"causal": True, "sinks": True},
}
SIZES = [(17, 1), (16, 15), (33, 65), (64, 64), (65, 129), (257, 300)]


def _check_bf16(fn, q, k, v, what, **kw):
    if kw.pop("sinks", False):
        kw["sinks"] = np.linspace(-1, 2, q.shape[-3]).astype(np.float32)
    before = [x.copy() for x in (q, k, v)]
    out, lse = _forward(fn, q, k, v, "bf16", **kw)
    for x, b in zip((q, k, v), before):
        np.testing.assert_array_equal(x, b)         # inputs unchanged
    rfn = getattr(ref, fn.__name__)
    want_out, want_lse = rfn(f64(q), f64(k), values=f64(v),
                             return_weights=False, **kw)
    err = rel_err(out, want_out, floor=1.0)
    assert err < BF16_TOL, f"{what}: out {err:.2e}"
    seen = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), seen), f"{what}: lse -inf"
    assert np.all(out[~seen] == 0), f"{what}: out of a query seeing nothing"
    assert rel_err(lse[seen], want_lse[seen], floor=1.0) < BF16_TOL, \
        f"{what}: lse"
    return err


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sizes_match_reference(unit, size, case):
    """Grouped heads (3 query heads on one key head), d = 33, dv = 17:
    within BF16_TOL, and further off than float32 products would be."""
    Tq, T = size
    rng = np.random.default_rng(Tq * 1000 + T)
    q, k, v = _inputs(rng, (2, 3), Tq, T, 33, 17, kv_lead=(2, 1))
    err = _check_bf16(ac.dot_attention, q, k, v, f"{case} {size}",
                      **CASES[case])
    if T > 1:
        assert err > FLOAT32_ERR, f"{case} {size}: bf16 products did not run"


@pytest.mark.parametrize("causal", [False, True])
def test_climbing_scores_raise_the_max(unit, causal):
    """Scores that climb along the keys (by 1.5 per key, then by 40, past
    exp's range within a tile) pass the running max by more than 2^8
    inside a block of keys: the weights of the block's tiles before, out
    already in bf16, are scaled down (and those that fall below the least
    normal number become 0).  Q and K in bf16 already, so that scores
    this large (up to 10^4) carry float32's rounding alone: within
    BF16_TOL; and falling, where the first tile's max holds."""
    rng = np.random.default_rng(11)
    Tq, T, H = 37, 250, 32
    for step in (1.5, 40.0):
        q = bf16(1 + 0.01 * rng.standard_normal((1, Tq, H)))
        k = bf16(np.arange(T)[:, None] * step / np.sqrt(H)
                 + 0.01 * rng.standard_normal((1, T, H)))
        v = rng.standard_normal((1, T, 24)).astype(np.float32)
        _check_bf16(ac.dot_attention, q, k, v, f"step {step}",
                    causal=causal)
        _check_bf16(ac.dot_attention, q, k[:, ::-1].copy(), v,
                    f"step -{step}", causal=causal)


def test_packed_sequences_and_general_score(unit):
    """Packed sequences, the last with no keys (out 0, lse -inf); and the
    general score (q W against the keys)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 90, 40)).astype(np.float32)
    k = rng.standard_normal((2, 70, 40)).astype(np.float32)
    v = rng.standard_normal((2, 70, 24)).astype(np.float32)
    cu_q = np.array([0, 30, 75, 90], dtype=np.int32)
    cu_k = np.array([0, 50, 70, 70], dtype=np.int32)
    _check_bf16(ac.dot_attention, q, k, v, "segments", causal=True,
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    W = (rng.standard_normal((40, 40)) / 6).astype(np.float32)
    with ac.set_fp32_precision("bf16"):
        out, lse = ac.general_attention(q, k, W, values=v,
                                        return_weights=False)
    want, _ = ref.general_attention(f64(q), f64(k), f64(W), values=f64(v),
                                    return_weights=False)
    assert FLOAT32_ERR < rel_err(out, want, floor=1.0) < BF16_TOL


@pytest.mark.parametrize("case", ["full", "causal"])
def test_threads_bitwise_identical(unit, case):
    """Enough work for 3 threads (2**22 multiply-adds each)."""
    q, k, v = _inputs(np.random.default_rng(9), (2, 4), 600, 600, 32, 32)
    ac.set_num_threads(1)
    one = _forward(ac.dot_attention, q, k, v, "bf16", **CASES[case])
    for n in (2, 3):
        ac.set_num_threads(n)
        assert_all_identical(_forward(ac.dot_attention, q, k, v, "bf16",
                                      **CASES[case]), one, f"{n} threads")
