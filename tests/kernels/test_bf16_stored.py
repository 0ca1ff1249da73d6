"""A bfloat16 call's streamed forward reads its queries, keys and values
as stored and writes its output in bfloat16 (csrc/simd/flash.inc under
FLASH_DP, attention.h's att_family_takes16), and its streamed backward
reads them, out and grad_out as stored (csrc/simd/gemm_dp.inc's packing),
where the CPU has the bf16 dot products: no float32 copy of any of them.

* the results are the float32 call's under set_fp32_precision("bf16") on
  the widened arrays, its output rounded once, bit for bit: sizes 1, 3,
  17 and 65, odd widths, full, causal, window, grouped heads broadcast
  over the leading axes, packed segments, sinks, a padding mask (right,
  left, a sequence masked whole; a mask of two runs widens); 1 and 2
  threads (so on
  every host: where the path is not taken, both calls widen);
* non-finite inputs (which the fused kernel does not take) fall back to
  the widened call, with the same results;
* on a CPU with the dot products, a call allocates no float32 copies: its
  peak memory is below the float32 call's on the same sizes (a forward),
  or above it by less than half the copies would take (a backward, whose
  gradients sum in float32 and are rounded once);
* the backward: its gradients are the float32 call's under "bf16" on the
  widened arrays (out and grad_out too), rounded once, bit for bit, over
  the same sizes and kinds, one long sequence (split by keys across
  threads), and with a key mask (one sequence masked whole), a per-query
  mask, a bias, dropout, softcap or ALiBi, 1 and 2 threads; a NaN or an
  infinity in out or grad_out falls back to widening;
* the inputs are left as they were.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attention_c as ac

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)

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


def inputs(rng, B, G, Gk, Tq, T, d, dv):
    q = rng.standard_normal((B, G, Tq, d)).astype(BF16)
    k = rng.standard_normal((B, Gk, 1, T, d)).astype(BF16)
    v = rng.standard_normal((B, Gk, 1, T, dv)).astype(BF16)
    # grouped heads: query head g reads kv head g // (G // Gk)
    q = q.reshape(B, Gk, G // Gk, Tq, d)
    return q, k, v


def widened_call(q, k, v, **kw):
    """The float32 call on the widened arrays with bf16 products, its
    output rounded to bfloat16 once."""
    with ac.set_fp32_precision("bf16"):
        out, lse = ac.dot_attention(
            q.astype(np.float32), k.astype(np.float32),
            values=v.astype(np.float32), return_weights=False, **kw)
    return out.astype(BF16), lse


def assert_bits(got, want, what):
    assert got[0].dtype == BF16 and got[1].dtype == np.float32, what
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


@pytest.mark.usefixtures("restore_settings")
def test_sinks_and_segments_as_widened():
    """Sinks (one more logit per head; bfloat16 like the rest, so the call
    stays a bfloat16 one) and packed segments (cu_seqlens): ranges of keys
    the fused kernel takes as they are."""
    rng = np.random.default_rng(5)
    q, k, v = inputs(rng, 2, 4, 2, 40, 40, 32, 32)
    sinks = rng.standard_normal((2, 2, 2)).astype(BF16)
    got = ac.dot_attention(q, k, values=v, sinks=sinks, causal=True,
                           return_weights=False)
    with ac.set_fp32_precision("bf16"):
        want = ac.dot_attention(
            q.astype(np.float32), k.astype(np.float32),
            values=v.astype(np.float32), sinks=sinks.astype(np.float32),
            causal=True, return_weights=False)
    assert_bits(got, (want[0].astype(BF16), want[1]), "sinks")
    cu = np.array([0, 7, 30, 64], dtype=np.int64)
    qs, ks, vs = (rng.standard_normal((4, 64, 16)).astype(BF16)
                  for _ in range(3))
    seg = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
               return_weights=False)
    got = ac.dot_attention(qs, ks, values=vs, **seg)
    with ac.set_fp32_precision("bf16"):
        want = ac.dot_attention(qs.astype(np.float32), ks.astype(np.float32),
                                values=vs.astype(np.float32), **seg)
    assert_bits(got, (want[0].astype(BF16), want[1]), "segments")


@pytest.mark.usefixtures("restore_settings")
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


def widened_backward(g, q, k, v, out, lse, **kw):
    """The float32 backward on the widened arrays with bf16 products, its
    gradients rounded to bfloat16 once."""
    f = (lambda x: x.astype(np.float32))
    with ac.set_fp32_precision("bf16"):
        grads = ac.dot_attention_backward(f(g), f(q), f(k), values=f(v),
                                          out=f(out), lse=lse, **kw)
    return [x if x is None else x.astype(BF16) for x in grads]


def assert_grads(got, want, what):
    assert len(got) == len(want), what
    for x, y in zip(got, want):
        assert (x is None) == (y is None), what
        if x is not None:
            assert x.dtype == BF16 and x.shape == y.shape, what
            assert np.array_equal(x.view(np.uint16), y.view(np.uint16)), (
                what, np.max(np.abs(x.astype(np.float64)
                                    - y.astype(np.float64))))


def backward_inputs(rng, shape, **kw):
    q, k, v = inputs(rng, *shape)
    out, lse = ac.dot_attention(q, k, values=v, return_weights=False, **kw)
    g = rng.standard_normal(out.shape).astype(BF16)
    return g, q, k, v, out, lse


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("shape", SHAPES + [(1, 1, 1, 600, 600, 64, 64)],
                         ids=str)
@pytest.mark.parametrize("kw", KINDS, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_backward_as_widened(shape, kw, threads):
    ac.set_num_threads(threads)
    rng = np.random.default_rng(sum(shape) + threads)
    args = backward_inputs(rng, shape, **kw)
    before = [x.tobytes() for x in args]
    got = ac.dot_attention_backward(*args[:3], values=args[3], out=args[4],
                                    lse=args[5], **kw)
    assert_grads(got, widened_backward(*args, **kw), (shape, kw, threads))
    assert [x.tobytes() for x in args] == before


def options(rng, name):
    """A backward's options on (2, 2, 33, d) queries against 47 keys: a
    key mask with one sequence masked whole, a per-query mask, a bias
    (bfloat16, as the rest), dropout, softcap, ALiBi."""
    mask = rng.random((2, 1, 47)) > 0.2
    mask[1] = False
    return {"mask": {"mask": mask},
            "attn_mask": {"attn_mask": rng.random((33, 47)) > 0.3},
            "bias": {"bias": rng.standard_normal((2, 1, 33, 47)).astype(
                BF16)},
            "dropout": {"dropout": 0.2, "seed": 7, "causal": True},
            "softcap": {"softcap": 2.0, "causal": True},
            "alibi": {"alibi_slopes": np.array([0.5, 0.125], BF16)}}[name]


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("name", ["mask", "attn_mask", "bias", "dropout",
                                  "softcap", "alibi"])
@pytest.mark.parametrize("threads", [1, 2])
def test_backward_options_as_widened(name, threads):
    """The backward's options read none of its five inputs: it takes them
    as stored with any of them (and their gradients, dbias and dalibi,
    come from the same dS)."""
    ac.set_num_threads(threads)
    rng = np.random.default_rng(len(name) + threads)
    kw = options(rng, name)
    q = rng.standard_normal((2, 2, 33, 16)).astype(BF16)
    k = rng.standard_normal((2, 2, 47, 16)).astype(BF16)
    v = rng.standard_normal((2, 2, 47, 8)).astype(BF16)
    out, lse = ac.dot_attention(q, k, values=v, return_weights=False, **kw)
    g = rng.standard_normal(out.shape).astype(BF16)
    got = ac.dot_attention_backward(g, q, k, values=v, out=out, lse=lse,
                                    **kw)
    wide = {key: (x.astype(np.float32) if getattr(x, "dtype", None) == BF16
                  else x) for key, x in kw.items()}
    assert_grads(got, widened_backward(g, q, k, v, out, lse, **wide), name)


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("where", ["out", "grad_out", "keys"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_backward_nonfinite_falls_back(where, bad):
    rng = np.random.default_rng(11)
    g, q, k, v, out, lse = backward_inputs(rng, (2, 2, 1, 20, 30, 16, 8),
                                           causal=True)
    x = {"out": out, "grad_out": g, "keys": k}[where]
    x.reshape(-1)[41] = bad
    got = ac.dot_attention_backward(g, q, k, values=v, out=out, lse=lse,
                                    causal=True)
    assert_grads(got, widened_backward(g, q, k, v, out, lse, causal=True),
                 (where, bad))


PEAK = textwrap.dedent("""
    import sys, tracemalloc
    import numpy as np, ml_dtypes
    import attention_c as ac
    dtype, backward = np.dtype(sys.argv[1]), sys.argv[2] == "backward"
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 1024, 64)).astype(dtype)
               for _ in range(3))
    ac.set_fp32_precision("bf16")
    kw = dict(values=v, causal=True)
    if sys.argv[3] == "masked":         # (the backward's options)
        kw.update(mask=rng.random(1024) > 0.1, dropout=0.1, seed=3)
    if sys.argv[3] == "padded":         # a range to the fused forward
        kw.update(mask=np.arange(1024) < 900)
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


def peak_bytes(dtype, direction="forward", kind="causal"):
    """The peak memory traced in a fresh process (no buffers kept from
    earlier calls) over one causal forward (or backward) at (1, 4, 1024,
    64) in dtype, "masked" with a key mask and dropout too."""
    run = subprocess.run([sys.executable, "-c", PEAK, dtype, direction,
                          kind], capture_output=True, text=True, check=True)
    return int(run.stdout)


@pytest.mark.parametrize("kind", ["causal", "padded"])
def test_no_float32_copies(kind):
    """With the dot products, a bfloat16 forward takes less memory than a
    float32 one of the same sizes (its output is half as large, and it
    makes no float32 copies: they would be 3 MB, its whole output 0.5);
    with a padding mask too."""
    if ac.show_config()["bf16_unit"] != "dot":
        pytest.skip("the CPU or path has no bf16 dot products in use")
    bf16 = peak_bytes("bfloat16", "forward", kind)
    f32 = peak_bytes("float32", "forward", kind)
    assert bf16 < f32, (bf16, f32)


@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_backward_no_float32_copies(kind):
    """A bfloat16 backward holds its gradients in float32 (summed there,
    rounded once) and their bfloat16 roundings, 1.5 MB more than the
    float32 backward at these sizes; float32 copies of q, k, v, out and
    grad_out would add 5 MB more."""
    if ac.show_config()["bf16_unit"] != "dot":
        pytest.skip("the CPU or path has no bf16 dot products in use")
    bf16 = peak_bytes("bfloat16", "backward", kind)
    f32 = peak_bytes("float32", "backward", kind)
    copies = 5 * 4 * 1024 * 64 * 4
    assert bf16 < f32 + copies / 2, (bf16, f32)
