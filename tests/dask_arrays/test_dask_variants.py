"""attention_c.dask with today's variants (docs/contract.md section 8):
window, softcap, alibi_slopes, sinks and packed sequences.

Chunk by chunk against the in-memory call: outputs and input gradients
bitwise, the slopes' and sinks' gradients (summed over the chunks along
which they are shared) within rounding of the in-memory ones; against the
NumPy reference (float64 1e-10, float32 TOL); the packed sequences'
offsets go whole to every chunk and a T axis chunked through a sequence
is rechunked whole (a PerformanceWarning), never cut; bad input refused
when the graph is built.
"""

import inspect
import warnings

import numpy as np
import pytest

import attention_c as ac
from attention_c.reference import family as ref
from attention_c.testing import TOL, rel_err

da = pytest.importorskip("dask.array")
acd = pytest.importorskip("attention_c.dask")

HAS_ALIBI_SINKS = {"alibi_slopes", "sinks"} <= set(
    inspect.signature(ac.dot_attention).parameters)
needs_alibi_sinks = pytest.mark.skipif(
    not HAS_ALIBI_SINKS, reason="the binding has no alibi_slopes/sinks yet")

B, NH, TQ, T, H, HQ, HV = 7, 2, 6, 8, 4, 3, 5
CHUNK = 2                       # 4 chunks of the batch
CU_Q, CU_K = np.array([0, 2, 6]), np.array([0, 3, 8])

VARIANTS = [
    pytest.param({"window": (2, 1)}, id="window"),
    pytest.param({"window": (None, 0), "softcap": 1.5}, id="softcap"),
    pytest.param({"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K,
                  "causal": True}, id="packed"),
    pytest.param({"alibi_slopes": (NH,)}, id="alibi-heads",
                 marks=needs_alibi_sinks),
    pytest.param({"alibi_slopes": (B, NH), "sinks": ()}, id="alibi-sinks",
                 marks=needs_alibi_sinks),
    pytest.param({"sinks": (B, 1), "window": (3, 0),
                  "cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K},
                 id="sinks-packed", marks=needs_alibi_sinks),
]


def problem(kind, variant, dtype=np.float64, seed=0):
    """(positional arrays, keywords) of the in-memory call."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(dtype)   # noqa: E731
    hq = H if kind == "dot" else HQ
    pos = [f(B, NH, TQ, hq), f(B, NH, T, H)]
    if kind == "general":
        pos.append(f(HQ, H))
    kw = {"values": f(B, NH, T, HV), **variant}
    for n in ("alibi_slopes", "sinks"):
        if n in kw:     # a shape: one value per sequence (and head)
            kw[n] = rng.uniform(0.1, 0.5, kw[n]).astype(dtype)
    return pos, kw


def chunked(pos, kw, kind):
    """The batched arrays as Dask arrays split along the batch; the slopes
    and sinks (NumPy, or Dask when they have the batch axis)."""
    def split(x):
        return da.from_array(x, chunks=(CHUNK,) + x.shape[1:])
    dpos = [split(pos[0]), split(pos[1])] + pos[2:]
    dkw = dict(kw)
    dkw["values"] = split(kw["values"])
    for n in ("alibi_slopes", "sinks"):
        if n in kw and kw[n].ndim == 2 and kw[n].shape[0] == B:
            dkw[n] = split(kw[n])
    return dpos, dkw


def fns(kind):
    return ((ac.dot_attention, ac.dot_attention_backward, acd.dot_attention,
             acd.dot_attention_backward) if kind == "dot" else
            (ac.general_attention, ac.general_attention_backward,
             acd.general_attention, acd.general_attention_backward))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["dot", "general"])
def test_chunked_equals_in_memory(kind, variant):
    fwd, bwd, dfwd, dbwd = fns(kind)
    pos, kw = problem(kind, variant)
    dpos, dkw = chunked(pos, kw, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # chunked along B: silent
        out, lse = dfwd(*dpos, **dkw, return_weights=False)
        g_out = np.random.default_rng(1).standard_normal(out.shape)
        grads = dbwd(da.from_array(g_out, chunks=(CHUNK, -1, -1, -1)),
                     *dpos, None, out=out, lse=lse, **dkw)
    want_out, want_lse = fwd(*pos, **kw, return_weights=False)
    assert out.chunks[0] == (2, 2, 2, 1)
    np.testing.assert_array_equal(out.compute(), want_out)
    np.testing.assert_array_equal(lse.compute(), want_lse)
    want = bwd(g_out, *pos, None, out=want_out, lse=want_lse, **kw)
    assert grads._fields == want._fields
    for name, got, w in zip(want._fields, grads, want):
        if w is None:
            assert got is None, name
        elif name in ("query", "keys", "values"):
            np.testing.assert_array_equal(got.compute(), w, err_msg=name)
        else:           # summed over chunks: within rounding
            assert got.shape == w.shape, name
            assert rel_err(got.compute(), w) <= 1e-13, name
    for name in ("alibi_slopes", "sinks"):
        if name in kw:
            assert getattr(grads, name).shape == np.shape(kw[name])
    if not any(n in kw for n in ("sinks",)):    # with weights too
        o2, alpha = dfwd(*dpos, **dkw)
        want_o2, want_alpha = fwd(*pos, **kw)
        np.testing.assert_array_equal(o2.compute(), want_o2)
        np.testing.assert_array_equal(alpha.compute(), want_alpha)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("variant", VARIANTS)
def test_against_reference(variant, dtype):
    pos, kw = problem("dot", variant, dtype)
    dpos, dkw = chunked(pos, kw, "dot")
    out, lse = acd.dot_attention(*dpos, **dkw, return_weights=False)

    def f64(x):
        if not isinstance(x, np.ndarray) or x.dtype.kind == "i":
            return x
        return x.astype(np.float64)

    want, _ = ref.dot_attention(*map(f64, pos), return_weights=False,
                                **{n: f64(x) for n, x in kw.items()})
    tol = 1e-10 if dtype == np.float64 else TOL[np.float32]
    assert rel_err(out.compute(), want) <= tol


def test_packed_sequences_never_cut():
    """A T axis chunked through a packed sequence is rechunked whole (with
    the PerformanceWarning of any chunked core axis): the result is the
    in-memory one."""
    pos, kw = problem("dot", {"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K})
    q = da.from_array(pos[0], chunks=(CHUNK, NH, 3, H))   # cuts [0, 2, 6]
    k = da.from_array(pos[1], chunks=(CHUNK, NH, 4, H))   # cuts [0, 3, 8]
    with pytest.warns(da.PerformanceWarning, match="chunked along axes"):
        out, alpha = acd.dot_attention(q, k, **kw)
    want, want_alpha = ac.dot_attention(*pos, **kw)
    np.testing.assert_array_equal(out.compute(), want)
    np.testing.assert_array_equal(alpha.compute(), want_alpha)
    assert out.chunks[2] == (TQ,)


def test_packed_offsets_as_dask_arrays():
    """The offsets given as Dask arrays: the result of NumPy ones (the
    check when building reads their values; a float argument shared by
    the chunks it does not), and bad ones still refused by name."""
    pos, kw = problem("dot", {"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K,
                              "causal": True})
    dpos, dkw = chunked(pos, kw, "dot")
    want = acd.dot_attention(*dpos, **dkw)
    dkw["cu_seqlens_q"] = da.from_array(CU_Q)
    dkw["cu_seqlens_k"] = da.from_array(CU_K)
    got = acd.dot_attention(*dpos, **dkw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.compute(), w.compute())
    dkw["cu_seqlens_q"] = da.from_array(np.array([0, 2, 5]))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        acd.dot_attention(*dpos, **dkw)


def test_shared_argument_of_unknown_chunk_sizes_refused():
    pos, kw = problem("general", {})
    dpos, dkw = chunked(pos, kw, "general")
    W = da.from_array(pos[2], chunks=2)
    dpos[2] = W[W[:, 0] > -np.inf]                 # shape (nan, H)
    with pytest.raises(ValueError, match=r"W has unknown chunk sizes.*"
                                         r"compute_chunk_sizes"):
        acd.general_attention(*dpos, **dkw)


@pytest.mark.parametrize("bad, error, match", [
    ({"window": (-1, 0)}, ValueError, "window"),
    ({"softcap": 0.0}, ValueError, "softcap"),
    ({"cu_seqlens_q": CU_Q}, ValueError, "cu_seqlens"),
    ({"cu_seqlens_q": [0, 2, 5], "cu_seqlens_k": CU_K}, ValueError,
     "cu_seqlens_q"),
    pytest.param({"alibi_slopes": np.ones(3)}, ValueError, "alibi_slopes",
                 marks=needs_alibi_sinks),
    pytest.param({"sinks": np.ones((B + 1, NH))}, ValueError, "sinks",
                 marks=needs_alibi_sinks),
])
def test_bad_input_when_building(bad, error, match):
    pos, kw = problem("dot", {})
    dpos, dkw = chunked(pos, kw, "dot")
    with pytest.raises(error, match=match):
        acd.dot_attention(*dpos, **dkw, **bad)
