"""attention_c.dask with the last scores of the family: Luong's location
score and the content (cosine) score.

Chunk by chunk (one chunk, even and uneven chunks of the batch, more
chunks than one node of the reduction tree, chunks along the heads too)
against the in-memory call, float32 and float64: outputs and the
gradients of inputs split along every batch axis bitwise; the gradients
of what every chunk shares (the location score's W and b, a sharpness,
bias or query broadcast over some batch axes) within rounding of the
in-memory ones, bitwise with one chunk, and bitwise the documented
fixed-order tree over the per-chunk in-memory gradients.  A sharpness is
None, a number (a constant: no gradient) or an array (batched, or
broadcast over the batch or the query positions: its gradient summed back
to its shape).  Bad input is refused when the graph is built.
"""

import inspect
import warnings

import numpy as np
import pytest

import attention_c as ac
from attention_c.testing import TOL, rel_err

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
acd = pytest.importorskip("attention_c.dask")
HighLevelGraph = pytest.importorskip("dask.highlevelgraph").HighLevelGraph

B, NH, TQ, T, H, HQ, HV, TMAX = 7, 2, 5, 6, 4, 3, 5, 9

# (chunk along B, chunk along the heads): the batch axes are (B, NH).
CHUNKINGS = [
    pytest.param((B, NH), id="one-chunk"),
    pytest.param((2, NH), id="twos"),          # 4 chunks, the last short
    pytest.param((1, NH), id="ones"),          # 7: two levels of the tree
    pytest.param((3, 1), id="heads"),          # 3 x 2 chunks
]
FUNCTIONS = ["location_attention", "location_attention_backward",
             "cosine_attention", "cosine_attention_backward"]


def ragged_mask(rng, lead, n):
    """(lead..., n) bool with random lengths, the first row empty."""
    lengths = rng.integers(1, n + 1, size=lead)
    mask = np.arange(n) < lengths[..., None]
    mask.reshape(-1, n)[0] = False
    return mask


def full(x):
    """Whether x has both batch axes (B, NH) in front: split along every
    chunk of the batch (else it is shared along some of them)."""
    return isinstance(x, np.ndarray) and x.shape[:2] == (B, NH)


def split(x, chunking):
    """x as a Dask array chunked along the batch axes it has, when it has
    the batch axis B in front; otherwise as given (NumPy, a number), for
    attention_c.dask to give whole to every chunk."""
    if not isinstance(x, np.ndarray) or x.ndim == 0 or x.shape[0] != B:
        return x
    chunks = [chunking[0]] + [-1] * (x.ndim - 1)
    if x.ndim > 1 and x.shape[1] == NH:
        chunks[1] = chunking[1]
    return da.from_array(x, chunks=tuple(chunks))


def location_case(name, dtype, rng):
    """(data, weights, literals, backward extras) of a location call."""
    f = lambda *s: rng.standard_normal(s).astype(dtype)   # noqa: E731
    W, b = f(TMAX, HQ), f(TMAX)
    if name == "one-query":      # a key mask, b, grad_alpha
        return ({"query": f(B, NH, HQ), "values": f(B, NH, T, HV),
                 "mask": ragged_mask(rng, (B, NH), T)},
                {"W": W, "b": b}, {}, {"grad_alpha": f(B, NH, T)})
    if name == "queries":        # an attn_mask shared by the batch, no b
        return ({"query": f(B, NH, TQ, HQ), "values": f(B, NH, T, HV),
                 "attn_mask": rng.random((TQ, T)) < 0.7},
                {"W": W, "b": None}, {}, {})
    if name == "broadcast":      # a query shared by the heads
        return ({"query": f(B, 1, TQ, HQ), "values": f(B, NH, T, HV),
                 "mask": ragged_mask(rng, (B, 1), T)},
                {"W": W, "b": b}, {}, {"grad_alpha": f(B, NH, TQ, T)})
    raise AssertionError(name)


# A sharpness: a value, or the shape of an array (drawn in the dtype).
SHARPNESS = [
    pytest.param(None, id="none"),
    pytest.param(2.5, id="float"),
    pytest.param(3, id="int"),
    pytest.param((), id="array-0d"),
    pytest.param((TQ,), id="per-query"),            # shared by the batch
    pytest.param((B, NH, TQ), id="batched"),
    pytest.param((B, 1, 1), id="per-sequence"),     # shared by heads, Tq
]


def cosine_case(sharpness, dtype, rng, return_weights=True):
    f = lambda *s: rng.standard_normal(s).astype(dtype)   # noqa: E731
    if isinstance(sharpness, tuple):
        sharpness = rng.uniform(0.5, 4.0, sharpness).astype(dtype)
    data = {"query": f(B, NH, TQ, H), "keys": f(B, NH, T, H),
            "values": f(B, NH, T, HV), "mask": ragged_mask(rng, (B, NH), T),
            "bias": f(TQ, T), "sharpness": sharpness}
    extra = {"grad_alpha": f(B, NH, TQ, T)} if return_weights else {}
    return (data, {}, {"causal": True, "return_weights": return_weights},
            extra)


def run(fn, case, chunking, dtype):
    """The forward and the backward of ``fn`` in memory and chunk by
    chunk (computed together): ((forward, grads), (forward, grads))."""
    data, weights, lit, extra = case
    rng = np.random.default_rng(1)
    fwd = getattr(ac, fn)(**data, **weights, **lit)
    grad_out = rng.standard_normal(fwd[0].shape).astype(dtype)
    weighted = lit.get("return_weights", True)
    saved = {"alpha": fwd[1]} if weighted else {"out": fwd[0],
                                                "lse": fwd[1]}
    bwd_lit = {k: x for k, x in lit.items() if k != "return_weights"}
    bwd = getattr(ac, fn + "_backward")(grad_out=grad_out, **data, **saved,
                                        **extra, **weights, **bwd_lit)

    dd = {k: split(x, chunking) for k, x in data.items()}
    dfwd = getattr(acd, fn)(**dd, **weights, **lit)
    dsaved = ({"alpha": dfwd[1]} if weighted else {"out": dfwd[0],
                                                   "lse": dfwd[1]})
    dbwd = getattr(acd, fn + "_backward")(
        grad_out=split(grad_out, chunking), **dd, **dsaved,
        **{k: split(x, chunking) for k, x in extra.items()}, **weights,
        **bwd_lit)
    assert dfwd[0].chunks[:2] == da.core.normalize_chunks(
        chunking, (B, NH))
    assert type(dbwd) is type(bwd)
    got_fwd, got_bwd = dask.compute(
        list(dfwd), [x for x in dbwd if x is not None])
    it = iter(got_bwd)
    got_bwd = [None if x is None else next(it) for x in dbwd]
    return (fwd, bwd), (got_fwd, got_bwd)


def check(mem, got, inputs, chunking, dtype):
    (fwd, bwd), (got_fwd, got_bwd) = mem, got
    for what, x, ref in zip(("out", "alpha or lse"), got_fwd, fwd):
        assert x.dtype == ref.dtype == dtype, what
        np.testing.assert_array_equal(x, ref, err_msg=what)
    one_chunk = chunking == (B, NH)
    for what, x, ref in zip(bwd._fields, got_bwd, bwd):
        if ref is None:
            assert x is None, what
            continue
        assert x.dtype == ref.dtype and x.shape == ref.shape, what
        if one_chunk or full(inputs[what]):
            np.testing.assert_array_equal(x, ref, err_msg=what)
        else:           # summed over the chunks that share it
            assert rel_err(x, ref) <= TOL[dtype], what


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("name", ["one-query", "queries", "broadcast"])
def test_location_equals_in_memory(name, chunking, dtype):
    case = location_case(name, dtype, np.random.default_rng(0))
    mem, got = run("location_attention", case, chunking, dtype)
    check(mem, got, {**case[0], **case[1]}, chunking, dtype)
    assert (mem[1].b is None) == (case[1]["b"] is None)
    # W's rows past T: exactly 0, in every chunk and in the sum.
    assert not got[1][2][T:].any()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("sharpness", SHARPNESS)
def test_cosine_equals_in_memory(sharpness, chunking, dtype):
    case = cosine_case(sharpness, dtype, np.random.default_rng(0))
    mem, got = run("cosine_attention", case, chunking, dtype)
    check(mem, got, case[0], chunking, dtype)
    # A number is a constant: no gradient, as in memory.
    assert (got[1][3] is None) == (not isinstance(sharpness, tuple))


@pytest.mark.parametrize("chunking", CHUNKINGS[1:])
@pytest.mark.parametrize("sharpness", [2.5, (TQ,), (B, NH, TQ)])
def test_cosine_out_and_lse(sharpness, chunking):
    """return_weights=False: (out, lse), and the backward on out= and
    lse=."""
    case = cosine_case(sharpness, np.float64, np.random.default_rng(2),
                       return_weights=False)
    mem, got = run("cosine_attention", case, chunking, np.float64)
    check(mem, got, case[0], chunking, np.float64)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cosine_one_query(dtype):
    """One query per sequence: the sharpness is (B, NH), or (NH,) shared
    by the batch; a key mask; the variants pass through."""
    rng = np.random.default_rng(3)
    f = lambda *s: rng.standard_normal(s).astype(dtype)   # noqa: E731
    for sharpness in (rng.uniform(1, 3, (B, NH)).astype(dtype),
                      rng.uniform(1, 3, (NH,)).astype(dtype)):
        data = {"query": f(B, NH, H), "keys": f(B, NH, T, H),
                "mask": ragged_mask(rng, (B, NH), T), "sharpness": sharpness,
                "alibi_slopes": rng.uniform(0.1, 0.5, (NH,)).astype(dtype)}
        case = (data, {}, {"softcap": 2.0}, {})
        mem, got = run("cosine_attention", case, (2, 1), dtype)
        check(mem, got, data, (2, 1), dtype)


def test_cosine_sharpness_nan_propagates_as_data():
    """An array's NaN is data (it reaches only its query's results); a
    number's is refused (test_bad_input_when_building)."""
    case = cosine_case((B, NH, TQ), np.float64, np.random.default_rng(4))
    case[0]["sharpness"][1, 0, 2] = np.nan
    case[0]["bias"] = None      # (its gradient sums the NaN over the batch)
    mem, got = run("cosine_attention", case, (2, NH), np.float64)
    assert np.isnan(mem[0][0][1, 0, 2]).all()
    check(mem, got, case[0], (2, NH), np.float64)


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


def test_shared_gradients_are_the_fixed_order_tree():
    """The location score's dW and db, and the gradient of a sharpness
    shared by the batch, are the fixed-order tree over the per-chunk
    in-memory gradients (7 chunks: two levels), whatever the scheduler."""
    rng = np.random.default_rng(5)
    data, weights, _, extra = location_case("one-query", np.float32, rng)
    out, alpha = ac.location_attention(**data, **weights)
    g_out = rng.standard_normal(out.shape).astype(np.float32)
    full_data = {**data, "alpha": alpha, "grad_out": g_out, **extra}
    parts = [ac.location_attention_backward(
        **{k: x[i:i + 1] for k, x in full_data.items()}, **weights)
        for i in range(B)]
    dd = {k: split(x, (1, NH)) for k, x in full_data.items()}
    g = acd.location_attention_backward(**dd, **weights)
    for scheduler in ("sync", "threads"):
        dW, db = dask.compute(g.W, g.b, scheduler=scheduler)
        np.testing.assert_array_equal(dW, tree_sum([p.W for p in parts]))
        np.testing.assert_array_equal(db, tree_sum([p.b for p in parts]))

    data, _, lit, extra = cosine_case((TQ,), np.float64, rng)
    out, alpha = ac.cosine_attention(**data, **lit)
    g_out = rng.standard_normal(out.shape)
    full_data = {**data, "alpha": alpha, "grad_out": g_out, **extra}
    del lit["return_weights"]
    parts = [ac.cosine_attention_backward(
        **{k: x[i:i + 1] if full(x) else x for k, x in full_data.items()},
        **lit) for i in range(B)]
    dd = {k: split(x, (1, NH)) for k, x in full_data.items()}
    g = acd.cosine_attention_backward(**dd, **lit)
    for name in ("sharpness", "bias"):
        np.testing.assert_array_equal(
            getattr(g, name).compute(),
            tree_sum([getattr(p, name) for p in parts]), err_msg=name)


def test_location_weights_are_one_key_shared_by_every_chunk():
    rng = np.random.default_rng(6)
    data, weights, _, _ = location_case("one-query", np.float64, rng)
    dd = {k: split(x, (2, NH)) for k, x in data.items()}
    out, alpha = acd.location_attention(**dd, **weights)
    grads = acd.location_attention_backward(da.ones_like(out), **dd,
                                            alpha=alpha, **weights)
    graph = HighLevelGraph.merge(*[x.__dask_graph__()
                                   for x in (out, alpha, *grads)])
    deps = graph.get_all_dependencies()
    for w in weights.values():
        key = (da.from_array(w, chunks=w.shape).name, *[0] * w.ndim)
        # One forward and one backward task per chunk use it, no one else.
        users = [k for k, d in deps.items() if key in d]
        assert len(users) == 2 * out.numblocks[0], users
    assert grads.W.numblocks == (1, 1) and grads.b.numblocks == (1,)
    # Weights given as Dask arrays (chunked: made one chunk).
    dW = da.from_array(weights["W"], chunks=(4, 2))
    out2, _ = acd.location_attention(**dd, W=dW, b=weights["b"])
    np.testing.assert_array_equal(out2.compute(), out.compute())


def test_values_chunks_set_the_batch_and_other_axes_are_rechunked():
    """Location: the values' chunks are the batch's (a query chunked
    otherwise is rechunked to them, silently); a T axis chunked is
    rechunked whole with a PerformanceWarning naming it."""
    data, weights, _, _ = location_case("queries", np.float64,
                                        np.random.default_rng(7))
    q = da.from_array(data["query"], chunks=(3, 1, -1, -1))
    v = da.from_array(data["values"], chunks=(2, 2, -1, -1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, alpha = acd.location_attention(q, v, **weights,
                                            attn_mask=data["attn_mask"])
    assert out.chunks[:2] == ((2, 2, 2, 1), (2,))
    want = ac.location_attention(**data, **weights)
    np.testing.assert_array_equal(out.compute(), want[0])
    with pytest.warns(da.PerformanceWarning,
                      match=r"values is chunked along axes \[2\]"):
        out, _ = acd.location_attention(
            data["query"], da.from_array(data["values"],
                                         chunks=(2, 2, 3, -1)),
            **weights, attn_mask=data["attn_mask"])
    assert out.chunks[2] == (TQ,)
    np.testing.assert_array_equal(out.compute(), want[0])


def test_cosine_dropout_is_the_in_memory_call_bit_for_bit():
    """dropout > 0: the batch in one chunk (a PerformanceWarning says so),
    the keep bits of the in-memory call."""
    data, _, lit, _ = cosine_case((TQ,), np.float64,
                                  np.random.default_rng(8))
    lit.update(dropout=0.3, seed=11)
    dd = {k: split(x, (2, NH)) for k, x in data.items()}
    with pytest.warns(da.PerformanceWarning, match="dropout"):
        out, alpha = acd.cosine_attention(**dd, **lit)
    want = ac.cosine_attention(**data, **lit)
    assert out.numblocks[0] == 1
    np.testing.assert_array_equal(out.compute(), want[0])
    del lit["return_weights"]
    with pytest.warns(da.PerformanceWarning, match="dropout"):
        g = acd.cosine_attention_backward(da.ones_like(out), **dd,
                                          alpha=alpha, **lit)
    want_g = ac.cosine_attention_backward(np.ones_like(want[0]), **data,
                                          alpha=want[1], **lit)
    for name, x, w in zip(want_g._fields, g, want_g):
        if w is not None:
            np.testing.assert_array_equal(x.compute(), w, err_msg=name)


# --------------------------------------------------------------------------
# The signatures and bad input


@pytest.mark.parametrize("name", FUNCTIONS)
def test_signature_is_the_in_memory_one(name):
    """The in-memory function's arguments, in its order, with its
    defaults; what has a default is keyword-only, the rest positional
    (but the cosine backward's alpha, which out= and lse= replace)."""
    mine = inspect.signature(getattr(acd, name)).parameters.values()
    theirs = inspect.signature(getattr(ac, name)).parameters.values()
    assert [(p.name, p.kind, p.default) for p in mine] == [
        (p.name, p.kind, p.default) for p in theirs]
    for p in mine:
        positional = p.default is p.empty or (
            p.name == "alpha" and name == "cosine_attention_backward")
        assert p.kind is (p.POSITIONAL_OR_KEYWORD if positional
                          else p.KEYWORD_ONLY), p
    assert name in acd.__all__


def test_gradient_tuples_are_attention_c_s():
    assert acd.LocationAttentionGrads is ac.LocationAttentionGrads
    assert acd.CosineAttentionGrads is ac.CosineAttentionGrads
    assert {"LocationAttentionGrads", "CosineAttentionGrads"} <= set(
        acd.__all__)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_positional_option_asks_for_a_keyword(name):
    """One argument too many: the in-memory function's TypeError word for
    word (with the mask=... hint for a boolean array, a Dask one too)."""
    params = inspect.signature(getattr(acd, name)).parameters.values()
    args = [np.zeros((2, 3, 4))] * sum(p.kind is p.POSITIONAL_OR_KEYWORD
                                       for p in params)
    for extra in [np.zeros((2, 3)), np.ones((2, 3), bool)]:
        with pytest.raises(TypeError) as want:
            getattr(ac, name)(*args, extra)
        with pytest.raises(TypeError) as err:
            getattr(acd, name)(*args, extra)
        assert str(err.value) == str(want.value)
    with pytest.raises(TypeError) as err:
        getattr(acd, name)(*args, da.ones((2, 3), dtype=bool, chunks=1))
    assert str(err.value) == str(want.value)
    assert str(err.value).endswith("did you mean mask=...?")


def location_inputs():
    data, weights, _, _ = location_case("queries", np.float64,
                                        np.random.default_rng(9))
    return (split(data["query"], (2, NH)), split(data["values"], (2, NH)),
            weights["W"])


@pytest.mark.parametrize("bad, error, match", [
    ({"W": np.zeros((T - 1, HQ))}, ValueError, r"W has shape \(5, 3\)"),
    ({"W": np.zeros((TMAX, HQ + 1))}, ValueError, r"W has shape \(9, 4\)"),
    ({"b": np.zeros(TMAX + 1)}, ValueError, r"b has shape \(10,\)"),
    ({"mask": np.ones((B, NH, T))}, TypeError, "mask must be a boolean"),
    ({"mask": np.ones((B + 1, NH, T), bool)}, ValueError,
     r"mask has shape \(8, 2, 6\)"),
    ({"query": np.zeros((B, NH, TQ, HQ), complex)}, TypeError, "query"),
    ({"values": np.zeros((T, HV)), "query": np.zeros((TQ, HQ))},
     ValueError, r"needs \(B, \.\.\., T, H\); for one sequence call "
                 r"attention_c\.location_attention directly"),
])
def test_location_bad_input_when_building(bad, error, match):
    q, v, W = location_inputs()
    args = {"query": q, "values": v, "W": W, **bad}
    with pytest.raises(error, match=match):
        acd.location_attention(**args)
    if "needs" in match:        # the backward's grad_out has the batch
        return
    with pytest.raises(error, match=match):
        acd.location_attention_backward(
            np.zeros((B, NH, TQ, HV)), alpha=np.zeros((B, NH, TQ, T)),
            **args)


def test_location_attn_mask_needs_several_queries():
    _, v, W = location_inputs()
    with pytest.raises(ValueError, match="attn_mask needs several queries"):
        acd.location_attention(np.zeros((B, NH, HQ)), v, W,
                               attn_mask=np.ones((TQ, T), bool))


@pytest.mark.parametrize("sharpness, error, match", [
    (float("nan"), ValueError, "sharpness must be finite, got nan"),
    (float("inf"), ValueError, "sharpness must be finite, got inf"),
    (np.float64(-np.inf), ValueError, "sharpness must be finite"),
    (True, TypeError, "sharpness has dtype bool"),
    (np.ones(TQ + 1), ValueError, r"sharpness has shape \(6,\)"),
    (np.ones((B, NH, T)), ValueError, "sharpness has shape"),
    (np.ones((B + 1, NH, TQ)), ValueError, r"sharpness has shape \(8, 2, 5\)"),
    (np.ones(TQ, complex), TypeError, "sharpness has dtype complex128"),
])
def test_cosine_bad_sharpness_when_building(sharpness, error, match):
    data, _, lit, _ = cosine_case(None, np.float64,
                                  np.random.default_rng(10))
    dd = {k: split(x, (2, NH)) for k, x in data.items()}
    dd["sharpness"] = split(sharpness, (2, NH))
    with pytest.raises(error, match=match):
        acd.cosine_attention(**dd, **lit)
    del lit["return_weights"]
    with pytest.raises(error, match=match):
        acd.cosine_attention_backward(
            np.zeros((B, NH, TQ, HV)), alpha=np.zeros((B, NH, TQ, T)),
            **dd, **lit)
