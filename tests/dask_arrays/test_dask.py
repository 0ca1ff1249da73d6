"""attention_c.dask: the layers and the family on Dask arrays.

Every case is computed in memory (attention_c) and chunk by chunk (along
the batch, uneven chunks, more chunks than one node of the reduction
tree) and compared: outputs and input gradients bitwise, parameter
gradients within rounding of the in-memory sums and bitwise equal to the
documented fixed-order tree over the per-chunk in-memory gradients.  Then
the same on a real two-process dask.distributed cluster, including one
worker killed in the middle of a computation.
"""

import inspect
import os
import pickle
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import attention_c as ac
from attention_c.testing import TOL, rel_err

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
acd = pytest.importorskip("attention_c.dask")
HighLevelGraph = pytest.importorskip("dask.highlevelgraph").HighLevelGraph
try:
    import distributed
except ImportError:           # dask[array] without dask[distributed]
    distributed = None

ROOT = Path(ac.__file__).resolve().parent.parent
B = 11                  # the batch, split into chunks of 2: 6 chunks
CHUNK = 2


def ragged_mask(rng, lead, T):
    """(lead..., T) bool with random lengths, the first row empty."""
    lengths = rng.integers(1, T + 1, size=lead)
    mask = np.arange(T) < lengths[..., None]
    mask.reshape(-1, T)[0] = False
    return mask


def case(name, dtype, rng):
    """(function name, batched data, weights, literals, backward extras)
    of one problem; the batched data are split along their first axis."""
    f = lambda *s: rng.standard_normal(s).astype(dtype)   # noqa: E731
    T, Tq, H, Hq, A = 9, 4, 6, 5, 7
    if name == "context":
        return ("context_attention",
                {"h": f(B, T, H), "mask": ragged_mask(rng, (B,), T)},
                {"W": f(A, 2 * H) * 0.5, "v": f(A), "b": f(A)}, {}, {})
    if name == "context_activations":
        return ("context_attention",
                {"h": f(B, T, H), "mask": ragged_mask(rng, (B,), T)},
                {"W": f(A, 2 * H) * 0.5, "v": f(A), "b": None},
                {"keep_activations": True}, {})
    if name == "additive":       # one query, separate values, a key mask
        return ("additive_attention",
                {"query": f(B, Hq), "keys": f(B, T, H),
                 "values": f(B, T, 3), "mask": ragged_mask(rng, (B,), T)},
                {"W": f(A, H + Hq) * 0.5, "v": f(A), "b": f(A)}, {},
                {"grad_alpha": f(B, T)})
    if name == "additive_key_proj":   # several queries, per-query mask
        W = f(A, H + Hq) * 0.5
        keys = f(B, T, H)
        return ("additive_attention",
                {"query": f(B, Tq, Hq), "keys": keys,
                 "attn_mask": ragged_mask(rng, (B, Tq), T),
                 "key_proj": ac.project_keys(keys, W)},
                {"W": W, "v": f(A), "b": None}, {},
                {"stop_at_key_proj": True})
    if name == "dot_heads":      # (B, heads, T, d), causal mask broadcast
        x = f(B, 3, T, H)
        return ("dot_attention",
                {"query": x, "keys": x,
                 "attn_mask": np.tril(np.ones((1, 1, T, T), bool))},
                {}, {"scale": 0.3}, {})
    if name == "dot_heads_bias":     # a bias per head, shared by the batch
        x = f(B, 3, T, H)
        bias = f(3, T, T)
        bias[1, 2] = -np.inf            # a query that sees no key
        return ("dot_attention",
                {"query": x, "keys": x, "bias": bias,
                 "mask": ragged_mask(rng, (B, 1), T)},
                {}, {"causal": True}, {})
    if name == "dot_lse":        # return_weights=False: out= and lse=
        bias = f(B, Tq, T)
        bias[3, 1] = -np.inf
        return ("dot_attention",
                {"query": f(B, Tq, H), "keys": f(B, T, H),
                 "values": f(B, T, 2), "mask": ragged_mask(rng, (B,), T),
                 "attn_mask": rng.random((Tq, T)) < 0.7, "bias": bias},
                {}, {"causal": True, "return_weights": False}, {})
    if name == "dot_one_query":  # one query: a bias (..., T)
        return ("dot_attention",
                {"query": f(B, H), "keys": f(B, T, H), "bias": f(1, T)},
                {}, {"return_weights": False}, {})
    if name == "dot":
        return ("dot_attention",
                {"query": f(B, H), "keys": f(B, T, H), "values": f(B, T, 2)},
                {}, {}, {})
    if name == "general":
        W = f(Hq, H) * 0.5
        keys = f(B, T, H)
        return ("general_attention",
                {"query": f(B, Tq, Hq), "keys": keys, "values": f(B, T, 4),
                 "mask": ragged_mask(rng, (B,), T),
                 "key_proj": ac.project_keys(keys, W)},
                {"W": W}, {}, {"grad_alpha": f(B, Tq, T)})
    if name == "general_sec5":   # shared causal bias, out= and lse=
        W = f(Hq, H) * 0.5
        keys = f(B, T, H)
        return ("general_attention",
                {"query": f(B, Tq, Hq), "keys": keys,
                 "attn_mask": rng.random((B, 1, T)) < 0.8,
                 "bias": f(Tq, T), "key_proj": ac.project_keys(keys, W)},
                {"W": W}, {"causal": True, "return_weights": False},
                {"stop_at_key_proj": True})
    raise AssertionError(name)


CASES = ["context", "context_activations", "additive", "additive_key_proj",
         "dot_heads", "dot_heads_bias", "dot_lse", "dot_one_query", "dot",
         "general", "general_sec5"]
FORWARD_OUT = ("out", "alpha", "activations")
FORWARD_ONLY = ("keep_activations", "return_weights")


def batched(x):
    """Whether x has the batch axis B in front (else it is shared: a
    broadcast 1, or no batch axis; no other axis of the cases is B)."""
    return x.ndim > 0 and x.shape[0] == B


def chunked(x, chunk):
    """x split along its first axis (unless it is shared by the batch)."""
    if not batched(x):
        return da.from_array(x, chunks=-1)
    return da.from_array(x, chunks=(chunk,) + (-1,) * (x.ndim - 1))


def run(name, dtype, chunk=CHUNK, scheduler="threads", client=None):
    """Forward and backward in memory and with Dask; returns both as
    (forward tuple, flat dict of gradients) and the per-chunk in-memory
    gradients."""
    fn, data, weights, lit, extra = case(name, dtype,
                                         np.random.default_rng(7))
    rng = np.random.default_rng(8)
    fwd = getattr(ac, fn)(**data, **weights, **lit)
    grad_out = rng.standard_normal(fwd[0].shape).astype(dtype)
    saved = ({"alpha": fwd[1]} if lit.get("return_weights", True) else
             {"out": fwd[0], "lse": fwd[1]})
    if lit.get("keep_activations"):
        saved["activations"] = fwd[2]
    # extra: arrays (grad_alpha) and flags (stop_at_key_proj) of the
    # backward only
    bwd_lit = {k: x for k, x in {**lit, **extra}.items()
               if not isinstance(x, np.ndarray) and k not in FORWARD_ONLY}
    bwd_data = {**data, **saved, "grad_out": grad_out,
                **{k: x for k, x in extra.items()
                   if isinstance(x, np.ndarray)}}

    def grads(result):
        flat = {}
        if isinstance(result, tuple) and isinstance(result[0], tuple):
            result, flat["grad_key_proj"] = result
        flat.update((k, x) for k, x in result._asdict().items()
                    if x is not None)
        return flat

    mem_bwd = grads(getattr(ac, fn + "_backward")(**bwd_data, **weights,
                                                  **bwd_lit))
    # Per chunk, in memory: what the fixed-order tree sums.
    per_chunk = []
    for start in range(0, B, chunk):
        part = {k: x[start:start + chunk] if batched(x) else x
                for k, x in bwd_data.items()}
        per_chunk.append(grads(getattr(ac, fn + "_backward")(
            **part, **weights, **bwd_lit)))

    dd = {k: chunked(x, chunk) for k, x in data.items()}
    dask_fwd = getattr(acd, fn)(**dd, **weights, **lit)
    dbwd_data = {k: chunked(x, chunk) for k, x in bwd_data.items()
                 if k not in saved}
    if "alpha" in saved:
        dbwd_data.update(zip(("alpha", "activations"), dask_fwd[1:]))
    else:
        dbwd_data.update(out=dask_fwd[0], lse=dask_fwd[1])
    dask_bwd = grads(getattr(acd, fn + "_backward")(**dbwd_data, **weights,
                                                    **bwd_lit))
    if client is not None:
        computed = on_cluster(client, [list(dask_fwd), dask_bwd])
    else:
        computed = dask.compute([list(dask_fwd), dask_bwd],
                                scheduler=scheduler)[0]
    # Gradients summed over the chunks: of the weights and of the data
    # shared by the batch (a bias without a batch axis).
    reduced = {*weights, *(k for k, x in data.items() if not batched(x))}
    return (fwd, mem_bwd), computed, per_chunk, reduced


def on_cluster(client, collections):
    """Compute on the cluster, bounded in time."""
    futures = client.compute(collections)
    distributed.wait(futures, timeout=120)
    return client.gather(futures)


def tree_sum(parts):
    """The documented order: groups of 4 consecutive chunks, each summed
    left to right, until one is left."""
    def left_to_right(group):
        total = group[0]
        for p in group[1:]:
            total = total + p
        return total
    while len(parts) > 4:
        parts = [left_to_right(parts[i:i + 4])
                 for i in range(0, len(parts), 4)]
    return left_to_right(parts)


def check(name, mem, computed, per_chunk, reduced, dtype):
    (fwd, mem_bwd), (dask_fwd, dask_bwd) = mem, computed
    assert len(dask_fwd) == len(fwd)
    for what, x, ref in zip(FORWARD_OUT, dask_fwd, fwd):
        assert x.dtype == ref.dtype
        np.testing.assert_array_equal(x, ref, err_msg=f"{name} {what}")
    assert dask_bwd.keys() == mem_bwd.keys()
    for what, ref in mem_bwd.items():
        x = dask_bwd[what]
        assert x.dtype == ref.dtype and x.shape == ref.shape, what
        if what in reduced:     # summed over the chunks
            assert rel_err(x, ref) <= TOL[np.dtype(dtype).type], (name, what)
            np.testing.assert_array_equal(
                x, tree_sum([g[what] for g in per_chunk]),
                err_msg=f"{name} d{what}: not the fixed-order tree")
        else:
            np.testing.assert_array_equal(x, ref, err_msg=f"{name} d{what}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", CASES)
def test_equals_in_memory(name, dtype):
    """Forward and input gradients bitwise, parameter gradients within
    rounding of the in-memory call and bitwise in the documented order."""
    mem, computed, per_chunk, reduced = run(name, dtype)
    check(name, mem, computed, per_chunk, reduced, dtype)


@pytest.mark.parametrize("name", ["context", "additive"])
def test_one_chunk_is_the_in_memory_call(name):
    (fwd, mem_bwd), (_, dask_bwd), _, _ = run(name, np.float32, chunk=B)
    for what, ref in mem_bwd.items():
        np.testing.assert_array_equal(dask_bwd[what], ref, err_msg=what)


def test_scheduler_does_not_change_a_bit():
    """The fixed reduction order: the same bits from the synchronous and
    the threaded schedulers."""
    _, sync, _, _ = run("additive", np.float32, scheduler="sync")
    _, threads, _, _ = run("additive", np.float32, scheduler="threads")
    for what in sync[1]:
        np.testing.assert_array_equal(sync[1][what], threads[1][what])


def test_weights_are_one_key_shared_by_every_chunk():
    rng = np.random.default_rng(0)
    H, A = 32, 64             # W: 32 KiB, which no task may carry
    h = da.from_array(rng.standard_normal((12, 5, H)), chunks=(3, 5, H))
    W, v, b = (rng.standard_normal(s) for s in [(A, 2 * H), (A,), (A,)])
    out, alpha = acd.context_attention(h, W, v, b=b)
    grads = acd.context_attention_backward(da.ones_like(out), h, W, v,
                                           alpha, b=b)
    graph = HighLevelGraph.merge(*[x.__dask_graph__()
                                   for x in (out, alpha, *grads)])
    deps = graph.get_all_dependencies()
    for w in (W, v, b):
        key = (da.from_array(w, chunks=w.shape).name, *[0] * w.ndim)
        assert key in deps
        # One forward and one backward task per chunk use it, no one else.
        users = [k for k, d in deps.items() if key in d]
        assert len(users) == 2 * h.numblocks[0], users
    # The tasks of attention_c.dask refer to the weights, never copy them.
    ours = [k for k in deps if k[0].startswith("attention-c-")]
    assert len(ours) >= 4 * h.numblocks[0]
    assert max(len(pickle.dumps(graph[k])) for k in ours) < W.nbytes / 4


def test_weights_given_as_dask_arrays():
    rng = np.random.default_rng(1)
    h = rng.standard_normal((6, 5, 4))
    W, v = rng.standard_normal((3, 8)), rng.standard_normal(3)
    out, _ = acd.context_attention(
        da.from_array(h, chunks=(2, 5, 4)), da.from_array(W, chunks=(1, 4)),
        da.from_array(v, chunks=1))
    np.testing.assert_array_equal(out.compute(),
                                  ac.context_attention(h, W, v)[0])


def test_chunks_along_T_or_H_are_rechunked_with_a_warning():
    rng = np.random.default_rng(2)
    h = rng.standard_normal((6, 8, 4))
    mask = ragged_mask(rng, (6,), 8)
    W, v = rng.standard_normal((3, 8)), rng.standard_normal(3)
    with pytest.warns(da.PerformanceWarning,
                      match=r"h is chunked along axes \[1, 2\].*"
                            r"rechunks it to \(\(2, 2, 2\), \(8,\), \(4,\)\)"
                      ) as record:
        out, alpha = acd.context_attention(
            da.from_array(h, chunks=(2, 3, 2)), W, v,
            mask=da.from_array(mask, chunks=(3, 8)))
    # The warning names the caller's line, not attention_c's.
    assert {w.filename for w in record} == {__file__}
    with pytest.warns(da.PerformanceWarning) as record:
        acd.project_keys(da.from_array(h, chunks=(2, 3, 2)), W)
    assert [w.filename for w in record] == [__file__]
    assert out.chunks == ((2, 2, 2), (4,)) and alpha.chunks[1] == (8,)
    ref = ac.context_attention(h, W, v, mask=mask)
    np.testing.assert_array_equal(out.compute(), ref[0])
    np.testing.assert_array_equal(alpha.compute(), ref[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")         # chunked along B: silent
        acd.context_attention(da.from_array(h, chunks=(4, 8, 4)), W, v,
                              mask=mask)


def test_bad_input_raises_when_the_graph_is_built():
    rng = np.random.default_rng(3)
    h = da.from_array(rng.standard_normal((6, 5, 4)), chunks=(2, 5, 4))
    W, v = rng.standard_normal((3, 8)), rng.standard_normal(3)
    # The in-memory function's own checks and messages.
    with pytest.raises(ValueError, match=r"mask has shape \(1, 5\).*"
                                         r"the shapes given: h \(6, 5, 4\)"):
        acd.context_attention(h, W, v, mask=np.ones((1, 5), bool))
    with pytest.raises(ValueError, match=r"W"):
        acd.context_attention(h, rng.standard_normal((3, 7)), v)
    with pytest.raises(TypeError, match="mask"):
        acd.context_attention(h, W, v, mask=np.ones((6, 5)))
    # The batch axes.
    with pytest.raises(ValueError, match=r"mask has shape \(4, 5\); expected "
                                         r"the leading \(batch\) axes \(6,\)"):
        acd.context_attention(h, W, v, mask=np.ones((4, 5), bool))
    with pytest.raises(ValueError, match="needs .B, ..., T, H.; for one "
                                         "sequence call attention_c"):
        acd.context_attention(h[0], W, v)
    unknown = h[h[:, 0, 0] > 0]
    with pytest.raises(ValueError, match="compute_chunk_sizes"):
        acd.context_attention(unknown, W, v)


@pytest.mark.parametrize("fn", ["dot_attention", "general_attention"])
def test_dropout_is_the_in_memory_call_bit_for_bit(fn):
    """The keep bits depend on the flat batch index, which a chunk cannot
    offset: a batch split in chunks is computed in one, with a warning,
    and forward and backward are the in-memory call's bits."""
    rng = np.random.default_rng(11)
    q, k = rng.standard_normal((6, 2, 5, 4)), rng.standard_normal((6, 2, 7, 4))
    W = (rng.standard_normal((4, 4)),) if fn == "general_attention" else ()
    opts = {"dropout": 0.3, "seed": 2**40 + 5, "causal": True,
            "bias": rng.standard_normal((2, 5, 7))}
    out, alpha = getattr(ac, fn)(q, k, *W, **opts)
    g = rng.standard_normal(out.shape)
    ref = getattr(ac, fn + "_backward")(g, q, k, *W, alpha, **opts)
    qd, kd = (da.from_array(x, chunks=(2, 1, -1, -1)) for x in (q, k))
    with pytest.warns(da.PerformanceWarning, match=r"dropout > 0.*one chunk"):
        dout, dalpha = getattr(acd, fn)(qd, kd, *W, **opts)
    with pytest.warns(da.PerformanceWarning, match="dropout"):
        grads = getattr(acd, fn + "_backward")(g, qd, kd, *W, dalpha, **opts)
    assert dout.numblocks[:2] == (1, 1)
    got = dask.compute(dout, dalpha, *grads)
    np.testing.assert_array_equal(got[0], out)
    np.testing.assert_array_equal(got[1], alpha)
    for x, r in zip(got[2:], ref):
        if r is None:
            assert x is None
        else:
            np.testing.assert_array_equal(x, r)
    # The dropout acted: without it, another output; another seed, too.
    plain = getattr(ac, fn)(q, k, *W, **{**opts, "dropout": 0.0})[0]
    assert not np.array_equal(plain, got[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # one chunk already: silent
        again = getattr(acd, fn)(q, k, *W, **opts)[0].compute()
        other = getattr(acd, fn)(q, k, *W, **{**opts, "seed": 6})[0]
    np.testing.assert_array_equal(again, out)
    assert not np.array_equal(other.compute(), out)


def test_dropout_keep_bits_are_the_reference_ones():
    """One query row of the output rebuilt from reference.dropout_keep at
    the flat batch index b of the whole batch."""
    from attention_c import reference
    rng = np.random.default_rng(12)
    Bb, Tq, T, H, p, seed = 5, 3, 9, 4, 0.4, 123
    q, k = rng.standard_normal((Bb, Tq, H)), rng.standard_normal((Bb, T, H))
    with pytest.warns(da.PerformanceWarning):
        out, alpha = acd.dot_attention(da.from_array(q, chunks=(2, -1, -1)),
                                       k, dropout=p, seed=seed)
    out, alpha = dask.compute(out, alpha)
    for b in range(Bb):
        keep = reference.dropout_keep(seed, p, b, Tq, T)
        want = (alpha[b] * keep / (1 - p)) @ k[b]
        np.testing.assert_allclose(out[b], want, rtol=1e-12, atol=1e-12)


def test_bias_shared_along_one_axis_is_summed_over_those_chunks_only():
    """bias (B, 1, Tq, T) against (B, heads, ...) chunked along both: its
    gradient stays chunked along B and is summed over the head chunks."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((6, 4, 5, 3))
    bias = rng.standard_normal((6, 1, 5, 5))
    out, alpha = ac.dot_attention(x, x, bias=bias)
    g = rng.standard_normal(out.shape)
    ref = ac.dot_attention_backward(g, x, x, alpha, bias=bias)
    xd = da.from_array(x, chunks=(2, 1, -1, -1))
    bd = da.from_array(bias, chunks=(3, 1, -1, -1))     # rechunked to 2
    dout, dalpha = acd.dot_attention(xd, xd, bias=bd)
    grads = acd.dot_attention_backward(g, xd, xd, dalpha, bias=bd)
    assert grads.bias.chunks == ((2, 2, 2), (1,), (5,), (5,))
    np.testing.assert_array_equal(dout.compute(), out)
    np.testing.assert_array_equal(grads.keys.compute(), ref.keys)
    per_head = [ac.dot_attention_backward(
        g[:, h:h + 1], x[:, h:h + 1], x[:, h:h + 1], alpha[:, h:h + 1],
        bias=bias).bias for h in range(4)]
    np.testing.assert_array_equal(grads.bias.compute(), tree_sum(per_head))
    assert rel_err(grads.bias.compute(), ref.bias) <= TOL[np.float64]


def test_grouped_query_keys_are_shared_and_their_gradient_summed():
    """Keys (B, Hkv, 1, T, d) against queries (B, Hkv, G, Tq, d) chunked
    along G: every chunk reads the same keys block, and their gradient
    is the fixed tree over the G chunks."""
    rng = np.random.default_rng(17)
    q = rng.standard_normal((4, 2, 3, 5, 4))
    k = rng.standard_normal((4, 2, 1, 6, 4))
    out, lse = ac.dot_attention(q, k, causal=True, return_weights=False)
    g = rng.standard_normal(out.shape)
    ref = ac.dot_attention_backward(g, q, k, out=out, lse=lse, causal=True)
    qd = da.from_array(q, chunks=(2, 1, 1, -1, -1))
    kd = da.from_array(k, chunks=(2, 1, 1, -1, -1))
    dout, dlse = acd.dot_attention(qd, kd, causal=True, return_weights=False)
    grads = acd.dot_attention_backward(g, qd, kd, out=dout, lse=dlse,
                                       causal=True)
    assert grads.keys.chunks[:3] == ((2, 2), (1, 1), (1,))
    np.testing.assert_array_equal(dout.compute(), out)
    np.testing.assert_array_equal(grads.query.compute(), ref.query)
    per_group = [ac.dot_attention_backward(
        g[:, :, j:j + 1], q[:, :, j:j + 1], k, out=out[:, :, j:j + 1],
        lse=lse[:, :, j:j + 1], causal=True).keys for j in range(3)]
    np.testing.assert_array_equal(grads.keys.compute(), tree_sum(per_group))
    assert rel_err(grads.keys.compute(), ref.keys) <= TOL[np.float64]


def test_shared_masks_and_bias_are_one_key():
    """attn_mask and bias without batch axes are given whole to every
    task, as a weight is, never split or copied per chunk."""
    rng = np.random.default_rng(14)
    T, H = 6, 3
    x = da.from_array(rng.standard_normal((8, T, H)), chunks=(2, -1, -1))
    am = np.tril(np.ones((T, T), bool))
    bias = rng.standard_normal((T, T))
    out, lse = acd.dot_attention(x, x, attn_mask=am, bias=bias,
                                 return_weights=False)
    deps = out.__dask_graph__().get_all_dependencies()
    for a in (am, bias):
        key = (da.from_array(a, chunks=a.shape).name, 0, 0)
        assert len([k for k, d in deps.items() if key in d]) == 4
    xs = x.compute()
    ref = ac.dot_attention(xs, xs, attn_mask=am, bias=bias,
                           return_weights=False)
    np.testing.assert_array_equal(out.compute(), ref[0])
    np.testing.assert_array_equal(lse.compute(), ref[1])
    assert lse.chunks == ((2, 2, 2, 2), (T,))


def test_key_mask_without_batch_axes_is_not_read_as_the_batch():
    """A key mask (T,) with B == T: broadcast over the batch as in
    memory (never taken for a (B,) mask)."""
    rng = np.random.default_rng(15)
    T = 5
    q, k = rng.standard_normal((T, 3, 4)), rng.standard_normal((T, T, 4))
    mask = np.array([True, False, True, True, False])
    ref = ac.dot_attention(q, k, mask=mask)
    out, alpha = acd.dot_attention(da.from_array(q, chunks=(2, -1, -1)), k,
                                   mask=mask)
    np.testing.assert_array_equal(out.compute(), ref[0])
    np.testing.assert_array_equal(alpha.compute(), ref[1])
    assert not alpha.compute()[..., 1].any()


def test_section5_bad_input_raises_when_the_graph_is_built():
    rng = np.random.default_rng(16)
    x = da.from_array(rng.standard_normal((4, 5, 3)), chunks=(2, -1, -1))
    tril = np.tril(np.ones((4, 5, 5), bool))
    with pytest.raises(ValueError, match="attn_mask"):
        acd.dot_attention(x, x, mask=tril)
    with pytest.raises(ValueError, match="seed"):
        acd.dot_attention(x, x, dropout=0.1)
    with pytest.raises(ValueError, match="dropout"):
        acd.general_attention(x, x, np.eye(3), dropout=1.0, seed=0)
    with pytest.raises(TypeError, match="bias="):
        acd.dot_attention(x, x, attn_mask=np.ones((5, 5)))
    with pytest.raises(ValueError, match="causal"):
        acd.dot_attention(x[:, 0], x, causal=True)
    out, lse = acd.dot_attention(x, x, return_weights=False)
    with pytest.raises(ValueError, match="grad_alpha"):
        acd.dot_attention_backward(out, x, x, out=out, lse=lse,
                                   grad_alpha=np.ones((4, 5, 5)))
    with pytest.raises(ValueError, match="lse"):
        acd.dot_attention_backward(out, x, x, lse=lse)


FUNCTIONS = ["context_attention", "context_attention_backward",
             "additive_attention", "additive_attention_backward",
             "dot_attention", "dot_attention_backward", "general_attention",
             "general_attention_backward", "location_attention",
             "location_attention_backward", "cosine_attention",
             "cosine_attention_backward", "project_keys",
             "project_keys_backward"]


def test_every_function_is_here():
    assert sorted(n for n in acd.__all__ if n[0].islower()) == sorted(
        FUNCTIONS)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_signature_is_the_in_memory_one(name):
    """The in-memory function's arguments, in its order, with its
    defaults; what has a default is keyword-only, the rest positional
    (but the backward's alpha, which out= and lse= replace)."""
    mine = inspect.signature(getattr(acd, name)).parameters.values()
    theirs = inspect.signature(getattr(ac, name)).parameters.values()
    assert [(p.name, p.kind, p.default) for p in mine] == [
        (p.name, p.kind, p.default) for p in theirs]
    for p in mine:
        positional = p.default is p.empty or (
            p.name == "alpha" and name in ("dot_attention_backward",
                                           "general_attention_backward",
                                           "cosine_attention_backward"))
        assert p.kind is (p.POSITIONAL_OR_KEYWORD if positional
                          else p.KEYWORD_ONLY), p


def test_a_positional_mask_asks_for_a_keyword():
    """acd.additive_attention(q, k, W, v, mask) would have read the mask
    as the bias b: a TypeError that says to pass it by keyword, raised
    before any graph is built."""
    rng = np.random.default_rng(9)
    q, k = rng.standard_normal((4, 3)), rng.standard_normal((4, 5, 2))
    W, v = rng.standard_normal((6, 5)), rng.standard_normal(6)
    mask = da.from_array(ragged_mask(rng, (4,), 5), chunks=(2, -1))
    with pytest.raises(TypeError) as err:
        acd.additive_attention(q, k, W, v, mask)
    assert str(err.value) == (
        "additive_attention() takes 4 positional arguments but 5 were given; "
        "b, mask, attn_mask, causal, values, key_proj are keyword-only (pass "
        "them by name, e.g. "
        "b=...). Argument 5 is a boolean array: did you mean mask=...?")
    with pytest.raises(TypeError, match=r"takes 2 positional arguments but 3 "
                                        r"were given; .*did you mean "
                                        r"mask=\.\.\.\?$"):
        acd.dot_attention(k, k, mask.compute())
    out, _ = acd.additive_attention(q, k, W, v, mask=mask)
    np.testing.assert_array_equal(
        out.compute(), ac.additive_attention(q, k, W, v,
                                             mask=mask.compute())[0])


@pytest.mark.parametrize("name", [n for n in FUNCTIONS
                                  if "project_keys" not in n])
def test_every_positional_option_asks_for_a_keyword(name):
    """One argument too many, whatever it is: the in-memory function's
    TypeError word for word, which names the keyword-only arguments (and
    guesses mask= only for a boolean array, here a Dask one)."""
    params = inspect.signature(getattr(acd, name)).parameters.values()
    args = [np.zeros((2, 3, 4))] * sum(p.kind is p.POSITIONAL_OR_KEYWORD
                                       for p in params)
    messages = []
    for extra in [np.zeros((2, 3)), np.ones((2, 3), bool),
                  da.ones((2, 3), dtype=bool, chunks=1)]:
        for module in (ac, acd):
            if module is ac and isinstance(extra, da.Array):
                continue
            with pytest.raises(TypeError) as err:
                getattr(module, name)(*args, extra)
            messages.append(str(err.value))
    # in-memory then Dask: a float array, a boolean one, a Dask boolean one
    assert "keyword-only" in messages[0] and "did you" not in messages[0]
    assert messages[1] == messages[0]
    assert messages[2].startswith(messages[0] + ". Argument ")
    assert messages[2].endswith("boolean array: did you mean mask=...?")
    assert messages[3] == messages[4] == messages[2]


def test_import_attention_c_does_not_import_dask():
    code = ("import sys, attention_c, attention_c.layer\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('dask', 'distributed')]\n"
            "assert not bad, bad\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code], check=True, env=env,
                   timeout=120)
    # Without Dask, the adapter says what to install.
    code = ("import sys\nsys.modules['dask'] = None\n"
            "try:\n    import attention_c.dask\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, timeout=120,
                         capture_output=True, text=True, check=True).stdout
    assert 'pip install "attention_c[dask]"' in out, out


# --------------------------------------------------------------------------
# A real cluster: two worker processes on 127.0.0.1.


@pytest.fixture(scope="module")
def client():
    if distributed is None:
        pytest.skip("dask.distributed is not installed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1,
                                  processes=True, dashboard_address=None,
                                  host="127.0.0.1") as cluster, \
            distributed.Client(cluster, timeout=60) as c:
        c.wait_for_workers(2, timeout=60)
        # The workers compute with the package under test.
        assert set(c.run(lambda: __import__("attention_c").__file__)
                   .values()) == {ac.__file__}
        yield c


@pytest.mark.parametrize("name", ["context", "additive_key_proj",
                                  "dot_heads", "general"])
def test_distributed_equals_in_memory(client, name):
    mem, computed, per_chunk, reduced = run(name, np.float64, client=client)
    check(name, mem, computed, per_chunk, reduced, np.float64)


def test_distributed_sends_each_weight_once_per_worker(client):
    rng = np.random.default_rng(4)
    h = da.from_array(rng.standard_normal((40, 5, 4)), chunks=(2, 5, 4))
    W = rng.standard_normal((3, 8))
    key = (da.from_array(W, chunks=W.shape).name, 0, 0)
    client.run(lambda dask_worker: dask_worker.transfer_incoming_log.clear())
    out, _ = acd.context_attention(h, W, rng.standard_normal(3))
    on_cluster(client, out)
    logs = client.run(lambda dask_worker: [
        list(entry["keys"]) for entry in dask_worker.transfer_incoming_log])
    received = {w: sum(str(key) in map(str, keys) for keys in log)
                for w, log in logs.items()}
    assert all(n <= 1 for n in received.values()), received


def test_killed_worker_is_retried_and_the_result_is_right(client, tmp_path):
    """The first task to read a chunk of h kills its own worker process
    (once: a marker file); the scheduler reruns the lost tasks and the
    results are still bitwise those of the in-memory call."""
    rng = np.random.default_rng(5)
    h = rng.standard_normal((8, 6, 4))
    mask = ragged_mask(rng, (8,), 6)
    W, v, b = (rng.standard_normal(s) for s in [(3, 8), (3,), (3,)])
    marker = str(tmp_path / "killed")
    here = os.getpid()

    def die_once(block):
        if os.getpid() == here:     # never this process (not called, as
            return block            # meta is given; a guard all the same)
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return block
        os.kill(os.getpid(), signal.SIGKILL)

    hd = da.from_array(h, chunks=(2, 6, 4)).map_blocks(
        die_once, meta=np.empty((0, 0, 0), h.dtype))
    out, alpha = acd.context_attention(hd, W, v, b=b, mask=mask)
    grads = acd.context_attention_backward(da.ones_like(out), hd, W, v,
                                           alpha, b=b, mask=mask)
    before = set(client.scheduler_info()["workers"])
    got = on_cluster(client, [out, grads.h, grads.W])
    assert os.path.exists(marker)
    ref = ac.context_attention(h, W, v, b=b, mask=mask)
    ref_g = ac.context_attention_backward(np.ones_like(ref[0]), h, W, v,
                                          ref[1], b=b, mask=mask)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref_g.h)
    assert rel_err(got[2], ref_g.W) <= TOL[np.float64]
    client.wait_for_workers(2, timeout=60)       # the nanny restarted it
    assert set(client.scheduler_info()["workers"]) != before
