"""A 16-bit call's streamed forward reads its queries, keys and values as
stored and writes its output in its dtype (attention.h's
att_family_takes16) on every SIMD path: bfloat16 on the bf16 products
where the CPU has them (csrc/simd/flash.inc under FLASH_DP, or AMX's
csrc/simd/flash_amx.inc), else, and float16 always, on the float32
products' fused kernel (FLASH_W16: each block of keys and values widened
once for every panel of queries); its streamed backward reads them, out
and grad_out as stored too (bfloat16 on the dot products:
csrc/simd/gemm_dp.inc's packing; else each block widened into the
scratch as it is read, on every path): no float32 copy of any of them.

* the forward's results are the float32 call's on the widened arrays
  (under set_fp32_precision("bf16") for bfloat16, whose products are
  bf16), its output rounded once, bit for bit: sizes 1, 3,
  17 and 65, odd widths, full, causal, window, grouped heads broadcast
  over the leading axes, packed segments, sinks, a padding mask (right,
  left, a sequence masked whole; a mask of two runs widens), an attn_mask
  of one run of keys a row (a row of two runs widens); 1 and 2 threads
  (so on
  every host: where the path is not taken, both calls widen);
* a float16 call under set_fp32_precision("bf16") is the widened one's
  too (bf16 products, which widen);
* non-finite inputs (which the fused kernel does not take) fall back to
  the widened call, with the same results;
* where the kernel takes them (bfloat16: a CPU with the dot products;
  float16: a SIMD path; its backward: any path), a call allocates no
  float32 copies: its peak memory is below the float32 call's on the
  same sizes (a forward), or above it by less than half the copies would
  take (a backward, whose gradients sum in float32 and are rounded
  once);
* the backward: its gradients are the float32 call's under "bf16" on the
  widened arrays (out and grad_out too), rounded once, bit for bit, over
  the same sizes and kinds, one long sequence (split by keys across
  threads), and with a key mask (one sequence masked whole), a per-query
  mask, a bias, dropout, softcap or ALiBi, 1 and 2 threads, in both
  dtypes (float16 on float32 products); a NaN or an infinity in out or
  grad_out falls back to widening;
* the inputs are left as they were.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attention_c as ac
from attention_c.testing import assert_rounded

from attention_c.testing import HALF_DTYPES

BF16 = next((np.dtype(d) for d in HALF_DTYPES
             if np.dtype(d).name == "bfloat16"), None)
F16 = np.dtype(np.float16)
# the forward's dtypes (bfloat16 where ml_dtypes is installed)
FORWARD16 = [d for d in (BF16, F16) if d is not None]
needs_bf16 = pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")

pytestmark = pytest.mark.filterwarnings("error")

SHAPES = [  # (B, G, Gk, Tq, T, d, dv): G query heads against Gk kv heads
    (1, 1, 1, 17, 17, 3, 5),
    (2, 1, 1, 9, 1, 1, 1),
    (1, 3, 1, 65, 65, 17, 1),
    (2, 4, 2, 33, 65, 64, 64),
    (1, 2, 2, 200, 300, 64, 17),
]
KINDS = [{}, {"causal": True}, {"window": (5, 3)},
         {"causal": True, "window": (20, 0)}]


def inputs(rng, B, G, Gk, Tq, T, d, dv, dtype=BF16):
    q = rng.standard_normal((B, G, Tq, d)).astype(dtype)
    k = rng.standard_normal((B, Gk, 1, T, d)).astype(dtype)
    v = rng.standard_normal((B, Gk, 1, T, dv)).astype(dtype)
    # grouped heads: query head g reads kv head g // (G // Gk)
    q = q.reshape(B, Gk, G // Gk, Tq, d)
    return q, k, v


def widened(x):
    """x widened to float32 where it is a 16-bit array (options too)."""
    return (x.astype(np.float32) if getattr(x, "dtype", None) in FORWARD16
            else x)


def widened_call(q, k, v, **kw):
    """The float32 call on the widened arrays (with bf16 products for
    bfloat16, whose products are bf16; the setting as it is for float16),
    its output rounded to q's dtype once."""
    kw = {key: widened(x) for key, x in kw.items()}
    precision = "bf16" if q.dtype == BF16 else ac.get_fp32_precision()
    with ac.set_fp32_precision(precision):
        out, lse = ac.dot_attention(widened(q), widened(k), values=widened(v),
                                    return_weights=False, **kw)
    return out.astype(q.dtype), lse


def assert_bits(got, want, what):
    assert got[1].dtype == np.float32, what
    assert_rounded(got, want, want[0].dtype, what, lse=1)


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("dtype", FORWARD16, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kw", KINDS, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_as_widened(dtype, shape, kw, threads):
    ac.set_num_threads(threads)
    rng = np.random.default_rng(sum(shape) + threads)
    q, k, v = inputs(rng, *shape, dtype=dtype)
    before = [x.tobytes() for x in (q, k, v)]
    got = ac.dot_attention(q, k, values=v, return_weights=False, **kw)
    assert_bits(got, widened_call(q, k, v, **kw), (shape, kw, threads))
    assert [x.tobytes() for x in (q, k, v)] == before


@pytest.mark.usefixtures("restore_settings")
def test_float16_bf16_products_as_widened():
    """Under set_fp32_precision("bf16") a float16 call runs the bf16
    products on its widened arrays, as the float32 call does."""
    rng = np.random.default_rng(2)
    q, k, v = inputs(rng, 2, 4, 2, 33, 65, 64, 64, dtype=F16)
    with ac.set_fp32_precision("bf16"):
        got = ac.dot_attention(q, k, values=v, causal=True,
                               return_weights=False)
        want = widened_call(q, k, v, causal=True)
    assert_bits(got, want, "bf16 products")


def test_float16_extremes_as_widened():
    """float16's largest finite values and its subnormals widen exactly:
    keys at -65504, values at 65504, subnormal queries."""
    rng = np.random.default_rng(8)
    q, k, v = inputs(rng, 1, 2, 1, 40, 50, 16, 16, dtype=F16)
    q.reshape(-1)[::7] = 6e-8
    k.reshape(-1)[::5] = -65504
    v.reshape(-1)[::3] = 65504
    got = ac.dot_attention(q, k, values=v, return_weights=False)
    assert_bits(got, widened_call(q, k, v), "extremes")
    assert np.isfinite(got[0].astype(np.float32)).all()


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("dtype", FORWARD16, ids=str)
@pytest.mark.parametrize("kind", ["right", "left", "two_runs"])
@pytest.mark.parametrize("threads", [1, 2])
def test_key_mask_as_widened(dtype, kind, threads):
    """A key mask of one run of keys a sequence (padding) is a range the
    fused kernel takes as stored; one of two runs widens: the widened
    call's bits either way."""
    ac.set_num_threads(threads)
    rng = np.random.default_rng(threads)
    q, k, v = inputs(rng, 3, 2, 2, 33, 70, 16, 8, dtype=dtype)
    t = np.arange(70)
    n = np.array([70, 31, 0])[:, None]
    mask = {"right": t < n, "left": t >= 70 - n,
            "two_runs": (t < n // 2) | (t >= n)}[kind][:, None, None, :]
    kw = dict(mask=mask, causal=True)
    got = ac.dot_attention(q, k, values=v, return_weights=False, **kw)
    assert_bits(got, widened_call(q, k, v, **kw), (kind, threads))


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("dtype", FORWARD16, ids=str)
@pytest.mark.parametrize("kind", ["tril", "band_padded", "two_runs"])
@pytest.mark.parametrize("threads", [1, 2])
def test_attn_mask_as_widened(dtype, kind, threads):
    """An attn_mask whose rows are each one run of keys is ranges the
    fused kernel takes as stored; one with a row of two runs widens: the
    widened call's bits either way."""
    ac.set_num_threads(threads)
    rng = np.random.default_rng(threads)
    q, k, v = inputs(rng, 3, 2, 2, 33, 70, 16, 8, dtype=dtype)
    i = np.arange(33)[:, None] + 70 - 33
    t = np.arange(70)
    m = {"tril": t <= i,
         "band_padded": (np.abs(t - i) <= 9) & (t >= np.array(
             [0, 12, 70])[:, None, None, None, None]),
         "two_runs": (t <= i) & (t != 20)}[kind]
    got = ac.dot_attention(q, k, values=v, return_weights=False,
                           attn_mask=m)
    assert_bits(got, widened_call(q, k, v, attn_mask=m), (kind, threads))


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("dtype", FORWARD16, ids=str)
def test_sinks_and_segments_as_widened(dtype):
    """Sinks (one more logit per head; 16-bit like the rest, so the call
    stays a 16-bit one) and packed segments (cu_seqlens): ranges of keys
    the fused kernel takes as they are."""
    rng = np.random.default_rng(5)
    q, k, v = inputs(rng, 2, 4, 2, 40, 40, 32, 32, dtype=dtype)
    sinks = rng.standard_normal((2, 2, 2)).astype(dtype)
    kw = dict(sinks=sinks, causal=True)
    got = ac.dot_attention(q, k, values=v, return_weights=False, **kw)
    assert_bits(got, widened_call(q, k, v, **kw), "sinks")
    cu = np.array([0, 7, 30, 64], dtype=np.int64)
    qs, ks, vs = (rng.standard_normal((4, 64, 16)).astype(dtype)
                  for _ in range(3))
    seg = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    got = ac.dot_attention(qs, ks, values=vs, return_weights=False, **seg)
    assert_bits(got, widened_call(qs, ks, vs, **seg), "segments")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("dtype", FORWARD16, ids=str)
@pytest.mark.parametrize("where", ["query", "keys", "values"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_falls_back(dtype, where, bad):
    """A NaN or an infinity anywhere: the call widens (the fused kernel
    takes finite inputs only) and gives the widened call's results."""
    rng = np.random.default_rng(9)
    q, k, v = inputs(rng, 2, 2, 1, 20, 30, 16, 8, dtype=dtype)
    x = {"query": q, "keys": k, "values": v}[where]
    x.reshape(-1)[37] = bad
    got = ac.dot_attention(q, k, values=v, causal=True, return_weights=False)
    assert_bits(got, widened_call(q, k, v, causal=True), (where, bad))


def widened_backward(g, q, k, v, out, lse, **kw):
    """The float32 backward on the widened arrays (options too; with bf16
    products for bfloat16), its gradients rounded to q's dtype once."""
    kw = {key: widened(x) for key, x in kw.items()}
    precision = "bf16" if q.dtype == BF16 else ac.get_fp32_precision()
    with ac.set_fp32_precision(precision):
        grads = ac.dot_attention_backward(*map(widened, (g, q, k)),
                                          values=widened(v),
                                          out=widened(out), lse=lse, **kw)
    return [x if x is None else x.astype(q.dtype) for x in grads]


def assert_grads(got, want, what):
    assert_rounded(got, want, want[0].dtype, what)


def backward_inputs(rng, shape, dtype=BF16, **kw):
    q, k, v = inputs(rng, *shape, dtype=dtype)
    out, lse = ac.dot_attention(q, k, values=v, return_weights=False, **kw)
    g = rng.standard_normal(out.shape).astype(dtype)
    return g, q, k, v, out, lse


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("dtype", FORWARD16, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(1, 1, 1, 600, 600, 64, 64)],
                         ids=str)
@pytest.mark.parametrize("kw", KINDS, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_backward_as_widened(dtype, shape, kw, threads):
    ac.set_num_threads(threads)
    rng = np.random.default_rng(sum(shape) + threads)
    args = backward_inputs(rng, shape, dtype, **kw)
    before = [x.tobytes() for x in args]
    got = ac.dot_attention_backward(*args[:3], values=args[3], out=args[4],
                                    lse=args[5], **kw)
    assert_grads(got, widened_backward(*args, **kw), (shape, kw, threads))
    assert [x.tobytes() for x in args] == before


def options(rng, name, dtype):
    """A backward's options on (2, 2, 33, d) queries against 47 keys: a
    key mask with one sequence masked whole, a per-query mask, a bias
    (in dtype, as the rest), dropout, softcap, ALiBi."""
    mask = rng.random((2, 1, 47)) > 0.2
    mask[1] = False
    return {"mask": {"mask": mask},
            "attn_mask": {"attn_mask": rng.random((33, 47)) > 0.3},
            "bias": {"bias": rng.standard_normal((2, 1, 33, 47)).astype(
                dtype)},
            "dropout": {"dropout": 0.2, "seed": 7, "causal": True},
            "softcap": {"softcap": 2.0, "causal": True},
            "alibi": {"alibi_slopes": np.array([0.5, 0.125], dtype)}}[name]


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("dtype", FORWARD16, ids=str)
@pytest.mark.parametrize("name", ["mask", "attn_mask", "bias", "dropout",
                                  "softcap", "alibi"])
@pytest.mark.parametrize("threads", [1, 2])
def test_backward_options_as_widened(dtype, name, threads):
    """The backward's options read none of its five inputs: it takes them
    as stored with any of them (and their gradients, dbias and dalibi,
    come from the same dS)."""
    ac.set_num_threads(threads)
    rng = np.random.default_rng(len(name) + threads)
    kw = options(rng, name, dtype)
    q = rng.standard_normal((2, 2, 33, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, 47, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, 47, 8)).astype(dtype)
    out, lse = ac.dot_attention(q, k, values=v, return_weights=False, **kw)
    g = rng.standard_normal(out.shape).astype(dtype)
    got = ac.dot_attention_backward(g, q, k, values=v, out=out, lse=lse,
                                    **kw)
    assert_grads(got, widened_backward(g, q, k, v, out, lse, **kw), name)


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("dtype", FORWARD16, ids=str)
@pytest.mark.parametrize("where", ["out", "grad_out", "keys"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_backward_nonfinite_falls_back(dtype, where, bad):
    rng = np.random.default_rng(11)
    g, q, k, v, out, lse = backward_inputs(rng, (2, 2, 1, 20, 30, 16, 8),
                                           dtype, causal=True)
    x = {"out": out, "grad_out": g, "keys": k}[where]
    x.reshape(-1)[41] = bad
    got = ac.dot_attention_backward(g, q, k, values=v, out=out, lse=lse,
                                    causal=True)
    assert_grads(got, widened_backward(g, q, k, v, out, lse, causal=True),
                 (where, bad))


PEAK = textwrap.dedent("""
    import sys, tracemalloc
    import numpy as np
    import attention_c as ac
    if sys.argv[1] == "bfloat16":
        import ml_dtypes
    dtype, backward = np.dtype(sys.argv[1]), sys.argv[2] == "backward"
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 1024, 64)).astype(dtype)
               for _ in range(3))
    ac.set_fp32_precision(sys.argv[4])
    kw = dict(values=v, causal=True)
    if sys.argv[3] == "masked":         # (the backward's options)
        kw.update(mask=rng.random(1024) > 0.1, dropout=0.1, seed=3)
    if sys.argv[3] == "padded":         # a range to the fused forward
        kw.update(mask=np.arange(1024) < 900)
    if sys.argv[3] == "tril":           # ranges as a dense attn_mask
        kw.update(attn_mask=np.tril(np.ones((1024, 1024), bool)))
    if backward:
        out, lse = ac.dot_attention(q, k, return_weights=False, **kw)
        g = rng.standard_normal(out.shape).astype(dtype)
    tracemalloc.start()
    if backward:
        ac.dot_attention_backward(g, q, k, out=out, lse=lse, **kw)
    else:
        ac.dot_attention(q, k, return_weights=False, **kw)
    print(tracemalloc.get_traced_memory()[1])
""")


def peak_bytes(dtype, direction="forward", kind="causal", precision="bf16"):
    """The peak memory traced in a fresh process (no buffers kept from
    earlier calls) over one causal forward (or backward) at (1, 4, 1024,
    64) in dtype, "masked" with a key mask and dropout too, "padded" with
    a padding mask, "tril" with np.tril as the attn_mask too; under
    set_fp32_precision(precision)."""
    run = subprocess.run([sys.executable, "-c", PEAK, dtype, direction,
                          kind, precision], capture_output=True, text=True,
                         check=True)
    return int(run.stdout)


@needs_bf16
@pytest.mark.parametrize("kind", ["causal", "padded", "tril"])
def test_no_float32_copies(kind):
    """On a SIMD path (whichever products its fused kernel runs: the dot
    products, AMX or float32), a bfloat16 forward takes less memory than
    a float32 one of the same sizes (its output is half as large, and it
    makes no float32 copies: they would be 3 MB, its whole output 0.5);
    with a padding mask too, and with causal given as a dense boolean
    attn_mask as well."""
    if ac.show_config()["simd"] == "scalar":
        pytest.skip("the scalar path has no fused kernel: it widens")
    bf16 = peak_bytes("bfloat16", "forward", kind)
    f32 = peak_bytes("float32", "forward", kind)
    assert bf16 < f32, (bf16, f32)


@needs_bf16
@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_backward_no_float32_copies(kind):
    """A bfloat16 backward holds its gradients in float32 (summed there,
    rounded once) and their bfloat16 roundings, 1.5 MB more than the
    float32 backward at these sizes; float32 copies of q, k, v, out and
    grad_out would add 5 MB more.  On any path: the dot products read
    bf16 as stored, the float products each block widened."""
    bf16 = peak_bytes("bfloat16", "backward", kind)
    f32 = peak_bytes("float32", "backward", kind)
    copies = 5 * 4 * 1024 * 64 * 4
    assert bf16 < f32 + copies / 2, (bf16, f32)


@pytest.mark.parametrize("kind", ["causal", "padded", "tril"])
def test_float16_no_float32_copies(kind):
    """On a SIMD path (the fused kernel's), a float16 forward takes less
    memory than a float32 one of the same sizes, both on float32
    products: no float32 copies (3 MB), an output half as large."""
    if ac.show_config()["simd"] == "scalar":
        pytest.skip("the scalar path has no fused kernel: it widens")
    f16 = peak_bytes("float16", "forward", kind, "ieee")
    f32 = peak_bytes("float32", "forward", kind, "ieee")
    assert f16 < f32, (f16, f32)


@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_float16_backward_no_float32_copies(kind):
    """A float16 backward widens each block as it reads it, into its
    scratch: its peak memory stays below the float32 backward's plus
    half the float32 copies of q, k, v, out and grad_out (5 MB) that it
    made before (its gradients sum in float32, rounded once, as a
    bfloat16 one's)."""
    f16 = peak_bytes("float16", "backward", kind, "ieee")
    f32 = peak_bytes("float32", "backward", kind, "ieee")
    copies = 5 * 4 * 1024 * 64 * 4
    assert f16 < f32 + copies / 2, (f16, f32)


SEQUENCE = textwrap.dedent("""
    import numpy as np, attention_c as ac
    from attention_c.testing import HALF_DTYPES
    dtypes = [np.float32, np.float64] + [np.dtype(d) for d in HALF_DTYPES]

    def step(shape, dt, seed):
        rng = np.random.default_rng(seed)
        q, k, v, g = (rng.standard_normal(shape).astype(dt)
                      for _ in range(4))
        o, lse = ac.dot_attention(q, k, values=v, return_weights=False)
        return (o, lse) + tuple(ac.dot_attention_backward(
            g, q, k, out=o, lse=lse, values=v))

    # float32 then float16 first, at sizes where the old fault crashed a
    # fresh process; then every pair, each larger than the last: the
    # scratch kept between calls is then the first call's size, no larger
    pairs = [(np.float32, np.float16)] + [
        (a, b) for a in dtypes for b in dtypes if a is not b]
    for i, (first, then) in enumerate(pairs):
        shape = (17, 17) if i == 0 else (2, 17 + 8 * i, 17 + 2 * i)
        step(shape, first, 0)
        got = step(shape, then, 1)
        step((3, 5, 4), np.float32, 9)              # other sizes
        want = step(shape, then, 1)
        for w, x in zip(want, got):
            assert w is None and x is None or (
                w.dtype == x.dtype and w.tobytes() == x.tobytes()), (
                shape, first, then)
    print("ok")
""")


def test_scratch_sized_for_each_call():
    """A call right after another of the same sizes in another dtype (a
    float16 streamed backward after a float32 one: its scratch holds the
    16-bit blocks widened) sizes its own scratch, and gives the bits it
    gives after a call of other sizes, every pair of dtypes.  The sizes
    of the last call's scratch are kept per function, keyed by what the
    sizing reads; a float16 backward once took a float32 one's, too
    small, and crashed (run in a child: a crash fails this test alone)."""
    run = subprocess.run([sys.executable, "-c", SEQUENCE],
                         capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (
        run.returncode, run.stderr[-2000:])
