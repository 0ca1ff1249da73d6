"""A float16 call's streamed forward reads its queries, keys and values
as stored and writes its output in float16 (csrc/simd/flash.inc's
FLASH_F16, attention.h's att_family_takes16): the float32 products'
fused kernel widens each block of keys and values once for every panel
of queries, so no float32 copy of any input is made.

* the results are the float32 call's on the widened arrays, its output
  rounded once, bit for bit (the widening is exact): sizes 1, 3, 17 and
  65, odd widths, full, causal, window, grouped heads broadcast over the
  leading axes, packed segments, sinks, a padding mask (right, left, a
  sequence masked whole; a mask of two runs widens); 1 and 2 threads (so
  on every path: where the fused kernel is not taken, both calls widen);
* under set_fp32_precision("bf16") the call is the widened one's too;
* non-finite inputs (which the fused kernel does not take) fall back to
  the widened call, with the same results;
* on a SIMD path, a forward allocates no float32 copies: its peak memory
  is below the float32 call's on the same sizes;
* the inputs are left as they were.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attention_c as ac

pytestmark = pytest.mark.filterwarnings("error")

F16 = np.dtype(np.float16)
SHAPES = [  # (B, G, Gk, Tq, T, d, dv): G query heads against Gk kv heads
    (1, 1, 1, 17, 17, 3, 5),
    (2, 1, 1, 9, 1, 1, 1),
    (1, 3, 1, 65, 65, 17, 1),
    (2, 4, 2, 33, 65, 64, 64),
    (1, 2, 2, 200, 300, 64, 17),
]
KINDS = [{}, {"causal": True}, {"window": (5, 3)},
         {"causal": True, "window": (20, 0)}]


def inputs(rng, B, G, Gk, Tq, T, d, dv):
    q = rng.standard_normal((B, G, Tq, d)).astype(F16)
    k = rng.standard_normal((B, Gk, 1, T, d)).astype(F16)
    v = rng.standard_normal((B, Gk, 1, T, dv)).astype(F16)
    # grouped heads: query head g reads kv head g // (G // Gk)
    q = q.reshape(B, Gk, G // Gk, Tq, d)
    return q, k, v


def widened_call(q, k, v, **kw):
    """The float32 call on the widened arrays, its output rounded to
    float16 once."""
    f = (lambda x: x.astype(np.float32))
    if "sinks" in kw:
        kw = dict(kw, sinks=f(kw["sinks"]))
    out, lse = ac.dot_attention(f(q), f(k), values=f(v),
                                return_weights=False, **kw)
    return out.astype(F16), lse


def assert_bits(got, want, what):
    assert got[0].dtype == F16 and got[1].dtype == np.float32, what
    assert got[0].shape == want[0].shape, what
    assert np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16)), (
        what, np.nanmax(np.abs(got[0].astype(np.float64)
                               - want[0].astype(np.float64))))
    assert np.array_equal(got[1], want[1], equal_nan=True), what


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kw", KINDS, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_as_widened(shape, kw, threads):
    ac.set_num_threads(threads)
    rng = np.random.default_rng(sum(shape) + threads)
    q, k, v = inputs(rng, *shape)
    before = [x.tobytes() for x in (q, k, v)]
    got = ac.dot_attention(q, k, values=v, return_weights=False, **kw)
    assert_bits(got, widened_call(q, k, v, **kw), (shape, kw, threads))
    assert [x.tobytes() for x in (q, k, v)] == before


@pytest.mark.usefixtures("restore_settings")
def test_bf16_products_as_widened():
    """Under set_fp32_precision("bf16") a float16 call runs the bf16
    products on its widened arrays, as the float32 call does."""
    rng = np.random.default_rng(2)
    q, k, v = inputs(rng, 2, 4, 2, 33, 65, 64, 64)
    with ac.set_fp32_precision("bf16"):
        got = ac.dot_attention(q, k, values=v, causal=True,
                               return_weights=False)
        want = widened_call(q, k, v, causal=True)
    assert_bits(got, want, "bf16 products")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("kind", ["right", "left", "two_runs"])
@pytest.mark.parametrize("threads", [1, 2])
def test_key_mask_as_widened(kind, threads):
    """A key mask of one run of keys a sequence (padding) is a range the
    fused kernel takes as stored; one of two runs widens: the widened
    call's bits either way."""
    ac.set_num_threads(threads)
    rng = np.random.default_rng(threads)
    q, k, v = inputs(rng, 3, 2, 2, 33, 70, 16, 8)
    t = np.arange(70)
    n = np.array([70, 31, 0])[:, None]
    mask = {"right": t < n, "left": t >= 70 - n,
            "two_runs": (t < n // 2) | (t >= n)}[kind][:, None, None, :]
    kw = dict(mask=mask, causal=True)
    got = ac.dot_attention(q, k, values=v, return_weights=False, **kw)
    assert_bits(got, widened_call(q, k, v, **kw), (kind, threads))


def test_sinks_and_segments_as_widened():
    """Sinks (float16 like the rest, so the call stays a float16 one) and
    packed segments (cu_seqlens): ranges of keys the fused kernel takes
    as they are."""
    rng = np.random.default_rng(5)
    q, k, v = inputs(rng, 2, 4, 2, 40, 40, 32, 32)
    sinks = rng.standard_normal((2, 2, 2)).astype(F16)
    kw = dict(sinks=sinks, causal=True)
    got = ac.dot_attention(q, k, values=v, return_weights=False, **kw)
    assert_bits(got, widened_call(q, k, v, **kw), "sinks")
    cu = np.array([0, 7, 30, 64], dtype=np.int64)
    qs, ks, vs = (rng.standard_normal((4, 64, 16)).astype(F16)
                  for _ in range(3))
    seg = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    got = ac.dot_attention(qs, ks, values=vs, return_weights=False, **seg)
    assert_bits(got, widened_call(qs, ks, vs, **seg), "segments")


def test_extremes_as_widened():
    """float16's largest finite values and its subnormals widen exactly:
    scores near float16's range, values at 65504."""
    rng = np.random.default_rng(8)
    q, k, v = inputs(rng, 1, 2, 1, 40, 50, 16, 16)
    q.reshape(-1)[::7] = 6e-8                   # subnormal
    k.reshape(-1)[::5] = -65504
    v.reshape(-1)[::3] = 65504
    got = ac.dot_attention(q, k, values=v, return_weights=False)
    assert_bits(got, widened_call(q, k, v), "extremes")
    assert np.isfinite(got[0].astype(np.float32)).all()


@pytest.mark.parametrize("where", ["query", "keys", "values"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_falls_back(where, bad):
    """A NaN or an infinity anywhere: the call widens (the fused kernel
    takes finite inputs only) and gives the widened call's results."""
    rng = np.random.default_rng(9)
    q, k, v = inputs(rng, 2, 2, 1, 20, 30, 16, 8)
    x = {"query": q, "keys": k, "values": v}[where]
    x.reshape(-1)[37] = bad
    got = ac.dot_attention(q, k, values=v, causal=True, return_weights=False)
    assert_bits(got, widened_call(q, k, v, causal=True), (where, bad))


def test_backward_as_widened():
    """The backward widens its float16 inputs (float32 gemm packing reads
    floats): the float32 gradients rounded once."""
    rng = np.random.default_rng(4)
    q, k, v = inputs(rng, 2, 2, 1, 33, 40, 16, 8)
    out, lse = ac.dot_attention(q, k, values=v, causal=True,
                                return_weights=False)
    g = rng.standard_normal(out.shape).astype(F16)
    f = (lambda x: x.astype(np.float32))
    got = ac.dot_attention_backward(g, q, k, values=v, out=out, lse=lse,
                                    causal=True)
    want = ac.dot_attention_backward(f(g), f(q), f(k), values=f(v),
                                     out=f(out), lse=lse, causal=True)
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == F16 and x.shape == y.shape
            assert np.array_equal(x.view(np.uint16),
                                  y.astype(F16).view(np.uint16))


PEAK = textwrap.dedent("""
    import sys, tracemalloc
    import numpy as np
    import attention_c as ac
    dtype = np.dtype(sys.argv[1])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 1024, 64)).astype(dtype)
               for _ in range(3))
    kw = dict(values=v, causal=True)
    if sys.argv[2] == "padded":         # a range to the fused forward
        kw.update(mask=np.arange(1024) < 900)
    tracemalloc.start()
    ac.dot_attention(q, k, return_weights=False, **kw)
    print(tracemalloc.get_traced_memory()[1])
""")


def peak_bytes(dtype, kind):
    """The peak memory traced in a fresh process (no buffers kept from
    earlier calls) over one causal forward at (1, 4, 1024, 64) in
    dtype."""
    run = subprocess.run([sys.executable, "-c", PEAK, dtype, kind],
                         capture_output=True, text=True, check=True)
    return int(run.stdout)


@pytest.mark.parametrize("kind", ["causal", "padded"])
def test_no_float32_copies(kind):
    """On a SIMD path (the fused kernel's), a float16 forward takes less
    memory than a float32 one of the same sizes (its output is half as
    large, and it makes no float32 copies: they would be 3 MB, its whole
    output 0.5)."""
    if ac.show_config()["simd"] == "scalar":
        pytest.skip("the scalar path has no fused kernel: it widens")
    f16 = peak_bytes("float16", kind)
    f32 = peak_bytes("float32", kind)
    assert f16 < f32, (f16, f32)
