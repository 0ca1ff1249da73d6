"""Decoding: the dot and general forward with few queries per sequence
(csrc/family/decode.inc decode_task, Tq <= DECODE_TQ = 8), one query against
its keys by matrix-vector passes instead of the blocked products.

* every section 5 argument (key mask, attn_mask, causal, bias with -inf,
  dropout, return_weights True and False) against ``attention_c.reference``
  on odd sizes, Tq 1..4 and 8 and T 1, 3, 17, 65, 1000, float32 and float64,
  with fully masked rows giving exact zeros (and lse -inf);
* the dropout keep bits read back from the outputs against
  ``reference.dropout_keep``;
* a NaN or an infinity reaching exactly the results that see it;
* key/value caches given as strided views of a larger buffer (sliced on
  the time axis, time-major and transposed, reversed, broadcast over
  heads or GQA groups; every section 5 argument, 1-3 threads, every SIMD
  path) giving the same bits as contiguous copies, and left unchanged;
  views the C reads in place (csrc/python/views.c read_rows) are never copied
  (no allocation of their size, by tracemalloc), those it cannot (a
  strided last axis, another dtype, the backward, Tq > 8) are;
* bitwise identical results for 1, 2 and 3 threads, on every SIMD path;
* the backward of such calls against the reference.

Tolerances: ``testing.TOL`` (normwise relative error; 1e-12 float64, 1e-5
float32) against the float64 reference on the same (cast) values.
"""

import tracemalloc

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import DTYPES, TOL, rel_err

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())
DECODE_TQ = 8                   # csrc/family/plan.inc
P_DROP = 0.3
SEED = 2**40 + 777              # both 32-bit halves of the Philox key used
KINDS = ["plain", "mask", "attn", "causal", "bias_ninf", "dropout", "all"]

dtype_param = pytest.mark.parametrize("dtype", DTYPES,
                                      ids=lambda d: np.dtype(d).name)


def make_case(rng, score, lead, Tq, T, kind, *, H=17, Hv=5):
    """(args, kwargs) of a dot or general call of kind `kind`: queries
    (*lead, Tq, Hq) against keys (*lead, T, H) and values (*lead, T, Hv);
    masks that leave some query with no visible key."""
    Hq = H if score == "dot" else 9
    q = rng.standard_normal(lead + (Tq, Hq))
    k = rng.standard_normal(lead + (T, H))
    kw = {"values": rng.standard_normal(lead + (T, Hv))}
    if kind in ("mask", "all"):
        mask = rng.random(lead + (T,)) < 0.7
        mask[(0,) * len(lead)] = False           # a sequence sees nothing
        kw["mask"] = mask
    if kind in ("attn", "all"):
        attn = rng.random((Tq, T)) < 0.6
        attn[0] = False                          # query 0 sees nothing
        kw["attn_mask"] = attn
    if kind in ("causal", "all"):
        kw["causal"] = True
    if kind in ("bias_ninf", "all"):
        bias = rng.standard_normal((1, Tq, T))
        bias[rng.random(bias.shape) < 0.3] = -np.inf
        kw["bias"] = bias
    if kind in ("dropout", "all"):
        kw.update(dropout=P_DROP, seed=SEED)
    if score == "dot":
        return (q, k), kw
    return (q, k, rng.standard_normal((Hq, H)) / np.sqrt(H)), kw


def cast(args, kw, dtype):
    """The float arrays of a case in dtype (masks left as they are)."""
    def c(x):
        x = np.asarray(x)
        return x.astype(dtype) if x.dtype.kind == "f" else x
    return (tuple(c(a) for a in args),
            {n: c(v) if isinstance(v, np.ndarray) else v
             for n, v in kw.items()})


def forward(mod, score, args, kw, rw):
    fn = mod.dot_attention if score == "dot" else mod.general_attention
    return fn(*args, **kw, return_weights=rw)


def check_against_reference(score, args, kw, dtype, rw):
    """Our forward in dtype against the float64 reference on the same cast
    values: within TOL, exact zeros and -inf where they belong."""
    a, k = cast(args, kw, dtype)
    out, w = forward(ac, score, a, k, rw)
    a64, k64 = cast(a, k, np.float64)
    want_out, want_w = forward(ref, score, a64, k64, rw)
    assert out.dtype == dtype and out.shape == want_out.shape
    assert rel_err(out, want_out) <= TOL[dtype]
    assert np.array_equal(out == 0, want_out == 0) or np.all(
        out[want_out == 0] == 0)
    if rw:
        assert rel_err(w, want_w) <= TOL[dtype]
        assert np.array_equal(w == 0, want_w == 0)   # 0 iff not visible
    else:
        none = np.isneginf(want_w)
        assert np.array_equal(np.isneginf(w), none)
        assert np.all(out[none] == 0)
        assert rel_err(w[~none], want_w[~none]) <= TOL[dtype]


@dtype_param
@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("score", ["dot", "general"])
def test_matches_reference(score, kind, rw, dtype):
    rng = np.random.default_rng(KINDS.index(kind))
    for Tq in (1, 2, 3, DECODE_TQ):
        for T in (1, 3, 17, 65, 1000):
            args, kw = make_case(rng, score, (2, 3), Tq, T, kind)
            check_against_reference(score, args, kw, dtype, rw)


@dtype_param
@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
def test_one_query_per_sequence(rw, dtype):
    """query (..., H) with the key mask and a bias of (..., T)."""
    rng = np.random.default_rng(3)
    for T in (1, 3, 17, 65):
        q = rng.standard_normal((3, 5, 17))
        k = rng.standard_normal((3, 5, T, 17))
        mask = rng.random((3, 5, T)) < 0.6
        mask[1, 2] = False
        bias = rng.standard_normal((5, T))
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        kw = {"mask": mask, "bias": bias, "dropout": P_DROP, "seed": SEED}
        check_against_reference("dot", (q, k), kw, dtype, rw)


@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
@pytest.mark.parametrize("Tq", [1, 3])
def test_dropout_keep_bits(Tq, rw):
    """The keep bits of query i (its own index) and key t, read back from
    out with the identity as the values, are reference.dropout_keep's."""
    rng = np.random.default_rng(11)
    lead, T = (2, 3), 37
    q = rng.standard_normal(lead + (Tq, 8))
    k = rng.standard_normal(lead + (T, 8))
    vals = np.broadcast_to(np.eye(T), lead + (T, T))
    out, _ = ac.dot_attention(q, k, values=vals, dropout=P_DROP, seed=SEED,
                              return_weights=rw)
    want = ref.dropout_keep(SEED, P_DROP, np.arange(6).reshape(lead), Tq, T)
    assert np.array_equal(out != 0, want)


@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
@pytest.mark.parametrize("score", ["dot", "general"])
def test_nonfinite_reaches_only_what_sees_it(score, rw):
    """Causal, Tq = 3: the last key is seen only by the last query; a key
    masked for everyone is seen by none.  NaN and inf in those rows of the
    keys and values reach exactly the last query's results."""
    rng = np.random.default_rng(4)
    T = 9
    args, kw = make_case(rng, score, (2,), 3, T, "causal")
    mask = np.ones((2, T), bool)
    mask[:, 2] = False
    kw["mask"] = mask
    clean_out, clean_w = forward(ac, score, args, kw, rw)
    keys, vals = args[1].copy(), kw["values"].copy()
    keys[:, 2], vals[:, 2] = np.nan, np.inf          # seen by no query
    keys[1, T - 1, 0], vals[0, T - 1, 1] = np.inf, np.nan
    bad = (args[0], keys) + args[2:]
    out, w = forward(ac, score, bad, dict(kw, values=vals), rw)
    seen = np.zeros(out.shape[:-1], bool)
    seen[:, 2] = True                                # the last query
    assert np.array_equal(out[~seen], clean_out[~seen])
    assert np.array_equal(w[~seen], clean_w[~seen])
    assert np.isnan(out[0, 2, 1]) and np.all(np.isnan(out[1, 2]))
    assert np.all(np.isfinite(out[0, 2, [0, 2, 3, 4]]))


@dtype_param
@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
def test_strided_cache_views(rw, dtype):
    """A (B, h, Tmax, d) cache sliced to n keys, and a (B, Tmax, h, d)
    cache sliced and transposed: the same bits as contiguous copies, the
    caches unchanged."""
    rng = np.random.default_rng(6)
    B, h, Tmax, d, n = 2, 3, 70, 16, 65
    q = rng.standard_normal((B, h, 1, d)).astype(dtype)
    head = rng.standard_normal((2, B, h, Tmax, d)).astype(dtype)
    time = rng.standard_normal((2, B, Tmax, h, d)).astype(dtype)
    before = head.copy(), time.copy()
    for kc, vc in ((head[0][:, :, :n], head[1][:, :, :n]),
                   (time[0][:, :n].transpose(0, 2, 1, 3),
                    time[1][:, :n].transpose(0, 2, 1, 3))):
        assert not kc.flags.c_contiguous
        for kw in ({}, {"causal": True, "bias": np.zeros((1, n))}):
            got = ac.dot_attention(q, kc, values=vc, return_weights=rw, **kw)
            want = ac.dot_attention(q, np.ascontiguousarray(kc),
                                    values=np.ascontiguousarray(vc),
                                    return_weights=rw, **kw)
            for g, w in zip(got, want):
                assert np.array_equal(g, w)
    assert np.array_equal(head, before[0]) and np.array_equal(time, before[1])


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
@pytest.mark.parametrize("score", ["dot", "general"])
def test_threads_bitwise_and_simd_paths(score, rw, simd):
    """Calls large enough for several threads: bitwise the same for 1, 2
    and 3 threads, and within TOL of the reference, on every SIMD path."""
    _core._set_simd(simd)
    rng = np.random.default_rng(8)
    for kind, Tq, T in (("plain", 1, 1000), ("all", 3, 1001)):
        for dtype in DTYPES:
            args, kw = make_case(rng, score, (2, 4), Tq, T, kind, H=64,
                                 Hv=64)
            a, k = cast(args, kw, dtype)
            ac.set_num_threads(1)
            one = forward(ac, score, a, k, rw)
            for n in (2, 3):
                ac.set_num_threads(n)
                for g, w in zip(forward(ac, score, a, k, rw), one):
                    assert np.array_equal(g, w, equal_nan=True)
            check_against_reference(score, args, kw, dtype, rw)


@dtype_param
@pytest.mark.parametrize("kind", ["plain", "all", "causal", "bias_ninf"])
@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
def test_backward_against_reference(rw, kind, dtype):
    """The backward of a decoding call (from alpha, or from out and lse)
    against the reference's, gradients measured against max(||want||,
    1)."""
    rng = np.random.default_rng(12)
    for Tq, T in ((1, 1), (1, 17), (3, 65), (4, 3)):
        args, kw = make_case(rng, "dot", (2, 3), Tq, T, kind)
        (q, k), kw = cast(args, kw, dtype)
        out, w = ac.dot_attention(q, k, **kw, return_weights=rw)
        g = rng.standard_normal(out.shape).astype(dtype)
        saved = {"alpha": w} if rw else {"out": out, "lse": w}
        got = ac.dot_attention_backward(g, q, k, **saved, **kw)
        (q64, k64, g64), kw64 = cast((q, k, g), kw, np.float64)
        ow, ww = ref.dot_attention(q64, k64, **kw64, return_weights=rw)
        saved = {"alpha": ww} if rw else {"out": ow, "lse": ww}
        want = ref.dot_attention_backward(g64, q64, k64, **saved, **kw64)
        for x, y in zip(got, want):
            if y is None:
                assert x is None
                continue
            err = np.linalg.norm((x - y).ravel()) / max(
                np.linalg.norm(y.ravel()), 1.0)
            assert err <= 10 * TOL[dtype]


@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
@pytest.mark.parametrize("Tq", [1, DECODE_TQ + 1])
def test_score_of_inf_gives_nan(Tq, rw):
    """A visible key whose score is +inf makes the row NaN (exp(inf - inf)),
    in decoding and in the blocked path (whose streamed sum was once taken
    for 0 and the row returned as 0), as in the reference."""
    rng = np.random.default_rng(13)
    T = 7
    q = np.abs(rng.standard_normal((2, Tq, 4)))
    k = rng.standard_normal((2, T, 4))
    k[1, 3, 0] = np.inf                     # sequence 1 only
    out, w = ac.dot_attention(q, k, return_weights=rw)
    with np.errstate(invalid="ignore"):
        want, want_w = ref.dot_attention(q, k, return_weights=rw)
    assert np.all(np.isnan(want[1])) and np.all(np.isnan(out[1]))
    assert np.all(np.isnan(w[1]))
    assert rel_err(out[0], want[0]) <= TOL[np.float64]
    assert rel_err(w[0], want_w[0]) <= TOL[np.float64]


LAYOUTS = ["sliced", "transposed", "reversed", "heads_bcast", "cols"]


def layout(rng, x, how, cap=5):
    """x (B, h, T, w) as a view of a larger buffer of the given layout,
    with the same values (``heads_bcast``: head 0's repeated over the
    heads, stride 0; ``cols``: a strided last axis, which must be
    copied)."""
    B, h, T, w = x.shape
    if how == "sliced":                   # (B, h, cap, w) cache, [:, :, :T]
        buf = rng.standard_normal((B, h, T + cap, w)).astype(x.dtype)
        buf[:, :, :T] = x
        return buf[:, :, :T]
    if how == "transposed":               # (B, cap, h, w) cache
        buf = rng.standard_normal((B, T + cap, h, w)).astype(x.dtype)
        buf[:, :T] = x.transpose(0, 2, 1, 3)
        return buf[:, :T].transpose(0, 2, 1, 3)
    if how == "reversed":                 # negative row and head strides
        return np.ascontiguousarray(x[:, ::-1, ::-1])[:, ::-1, ::-1]
    if how == "heads_bcast":
        return np.broadcast_to(x[:, :1], x.shape)
    buf = rng.standard_normal((B, h, T, 2 * w)).astype(x.dtype)
    buf[..., ::2] = x
    return buf[..., ::2]


def same_as_copies(fn, args, kw, rw):
    """fn on the views in args and kw (values) against fn on contiguous
    copies of them: the same bits."""
    got = fn(*args, **kw, return_weights=rw)
    c = {n: np.ascontiguousarray(v) if n == "values" else v
         for n, v in kw.items()}
    want = fn(*(np.ascontiguousarray(a) for a in args), **c,
              return_weights=rw)
    for g, w in zip(got, want):
        assert np.array_equal(g, w, equal_nan=True)
    return got


@dtype_param
@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
@pytest.mark.parametrize("how", LAYOUTS)
@pytest.mark.parametrize("score", ["dot", "general"])
def test_cache_layouts_every_argument(score, how, rw, dtype):
    """Keys and values as views of each layout, with every section 5
    argument, Tq 1, 3 and 8 (decoding) and 9 (the blocked path, which
    copies them): the same bits as contiguous copies, within TOL of the
    reference; the buffers unchanged."""
    rng = np.random.default_rng(20)
    fn = ac.dot_attention if score == "dot" else ac.general_attention
    for Tq, T, kind in ((1, 1, "plain"), (1, 65, "all"), (3, 17, "mask"),
                        (DECODE_TQ, 17, "causal"), (1, 3, "dropout"),
                        (DECODE_TQ + 1, 17, "all")):
        args, kw = make_case(rng, score, (2, 3), Tq, T, kind)
        (q, k, *w), kw = cast(args, kw, dtype)
        kv, vv = layout(rng, k, how), layout(rng, kw["values"], how)
        before = kv.copy(), vv.copy()
        got = same_as_copies(fn, (q, kv, *w), dict(kw, values=vv), rw)
        assert np.array_equal(kv, before[0]) and np.array_equal(vv, before[1])
        if how != "heads_bcast":
            want = fn(q, k, *w, **kw, return_weights=rw)
            for g, x in zip(got, want):
                assert np.array_equal(g, x, equal_nan=True)


@dtype_param
@pytest.mark.parametrize("how", LAYOUTS)
def test_keys_are_values_in_place(how, dtype):
    """values=None: the keys' view serves as both (dot reads it in place,
    general copies it for its projection)."""
    rng = np.random.default_rng(21)
    for score in ("dot", "general"):
        fn = ac.dot_attention if score == "dot" else ac.general_attention
        args, kw = make_case(rng, score, (2, 3), 2, 17, "all")
        del kw["values"]
        (q, k, *w), kw = cast(args, kw, dtype)
        for rw in (True, False):
            same_as_copies(fn, (q, layout(rng, k, how), *w), kw, rw)


@dtype_param
@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
def test_gqa_cache_broadcast(rw, dtype):
    """Grouped queries: keys and values (B, Hkv, 1, T, d) sliced from a
    (B, Hkv, cap, d) cache and from a time-major one, broadcast over the G
    queries of a group (B, Hkv, G, 1, d): the same bits as the copies."""
    rng = np.random.default_rng(22)
    B, Hkv, G, cap, d = 2, 3, 4, 40, 16
    q = rng.standard_normal((B, Hkv, G, 1, d)).astype(dtype)
    head = rng.standard_normal((2, B, Hkv, cap, d)).astype(dtype)
    time = rng.standard_normal((2, B, cap, Hkv, d)).astype(dtype)
    for n in (1, 17, 33):
        for kc, vc in ((head[0][:, :, None, :n], head[1][:, :, None, :n]),
                       (time[0][:, None, :n].transpose(0, 3, 1, 2, 4),
                        time[1][:, None, :n].transpose(0, 3, 1, 2, 4))):
            mask = rng.random((B, Hkv, 1, n)) < 0.8
            same_as_copies(ac.dot_attention, (q, kc), {"values": vc}, rw)
            same_as_copies(ac.dot_attention, (q, kc),
                           {"values": vc, "mask": mask, "dropout": 0.2,
                            "seed": 5}, rw)


@dtype_param
def test_other_dtype_and_backward_copy(dtype):
    """Views the C cannot read as they are: another dtype (cast), and the
    backward of a decoding call (its keys made C-contiguous): the same as
    on copies."""
    rng = np.random.default_rng(23)
    q = rng.standard_normal((2, 3, 1, 16)).astype(dtype)
    other = np.float64 if dtype == np.float32 else np.float32
    buf = rng.standard_normal((2, 2, 3, 30, 16)).astype(other)
    same_as_copies(ac.dot_attention, (q, buf[0][:, :, :17]),
                   {"values": buf[1][:, :, :17]}, False)
    k = layout(rng, rng.standard_normal((2, 3, 17, 16)).astype(dtype),
               "transposed")
    out, lse = ac.dot_attention(q, k, values=k, return_weights=False)
    g = rng.standard_normal(out.shape).astype(dtype)
    got = ac.dot_attention_backward(g, q, k, values=k, out=out, lse=lse)
    kc = np.ascontiguousarray(k)
    want = ac.dot_attention_backward(g, q, kc, values=kc, out=out, lse=lse)
    for x, y in zip(got, want):
        assert np.array_equal(x, y)


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@pytest.mark.parametrize("how", ["sliced", "transposed", "reversed"])
def test_cache_threads_bitwise(how, simd):
    """Strided caches large enough for several threads: bitwise the same
    for 1, 2 and 3 threads and as contiguous copies, on every SIMD path."""
    _core._set_simd(simd)
    rng = np.random.default_rng(24)
    for dtype in DTYPES:
        for kind, Tq in (("plain", 1), ("all", 3)):
            args, kw = make_case(rng, "dot", (2, 4), Tq, 1000, kind, H=64,
                                 Hv=64)
            (q, k), kw = cast(args, kw, dtype)
            kw["values"] = layout(rng, kw["values"], how)
            k = layout(rng, k, how)
            ac.set_num_threads(1)
            one = same_as_copies(ac.dot_attention, (q, k), kw, False)
            for n in (2, 3):
                ac.set_num_threads(n)
                for g, w in zip(ac.dot_attention(q, k, **kw,
                                                 return_weights=False), one):
                    assert np.array_equal(g, w, equal_nan=True)


def peak_bytes(call):
    """The most memory traced (NumPy's arrays, the binding's PyMem and raw
    allocations) at once during call()."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        call()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("how", ["sliced", "transposed", "reversed",
                                 "heads_bcast", "cols"])
def test_cache_read_in_place(how):
    """A decoding call on a strided cache allocates nothing of the cache's
    size (no copy), but for a strided last axis, which it must copy."""
    rng = np.random.default_rng(25)
    B, h, T, d = 1, 4, 2048, 32        # 1 MiB of float32 keys
    q = rng.standard_normal((B, h, 1, d)).astype(np.float32)
    k = layout(rng, rng.standard_normal((B, h, T, d)).astype(np.float32),
               how)
    v = layout(rng, rng.standard_normal((B, h, T, d)).astype(np.float32),
               how)
    ac.dot_attention(q, k, values=v, return_weights=False)   # scratch made
    peak = peak_bytes(lambda: ac.dot_attention(q, k, values=v,
                                               return_weights=False))
    size = B * h * T * d * 4
    if how == "cols":
        assert peak >= 2 * size
    else:
        assert peak < size // 8


# ---------------------------------------------------------------------
# Grouped queries (several query heads, or the Tq queries of a sequence,
# on one key/value head: decode.inc reads each key and value once for
# them all) and the split of long caches (at most DECODE_SPLIT_SEQS
# sequences, lse: chunks of keys merged in order).

SPLIT_SEQS = 4                  # csrc/family/plan.inc DECODE_SPLIT_SEQS
GQA_KINDS = ["plain", "mask", "causal", "window", "sinks", "softcap",
             "alibi", "dropout", "bias_ninf", "all"]


def gqa_case(rng, lead, G, Tq, T, kind, *, d=19, dv=7, rw=False):
    """(q, k, kw): queries (*lead, G, Tq, d) against keys (*lead, 1, T, d)
    and values (*lead, 1, T, dv) shared by the G query heads of a group;
    a key mask per query head (the last head of the first group sees
    nothing, when there are others)."""
    q = rng.standard_normal(lead + (G, Tq, d))
    k = rng.standard_normal(lead + (1, T, d))
    kw = {"values": rng.standard_normal(lead + (1, T, dv))}
    if kind in ("mask", "all"):
        mask = rng.random(lead + (G, T)) < 0.7
        if G * np.prod(lead) > 1:
            mask[(0,) * len(lead) + (G - 1,)] = False
        kw["mask"] = mask
    if kind in ("causal", "all") and Tq > 1:
        kw["causal"] = True
    if kind in ("window", "all") and Tq > 1:
        kw["window"] = (max(T // 3, 1), 1)
    if kind in ("sinks", "all") and not rw:
        kw["sinks"] = rng.standard_normal(lead + (G,))
    if kind in ("softcap", "all"):
        kw["softcap"] = 3.0
    if kind in ("alibi", "all"):
        kw["alibi_slopes"] = rng.random(lead + (G,)) / 4
    if kind in ("dropout", "all"):
        kw.update(dropout=P_DROP, seed=SEED)
    if kind in ("bias_ninf", "all"):
        bias = rng.standard_normal((G, Tq, T))
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        kw["bias"] = bias
    return q, k, kw


def repeated(kw, G):
    """kw with the values repeated over the G heads (C-contiguous: no
    two heads share a row, so nothing is grouped)."""
    return dict(kw, values=np.ascontiguousarray(
        np.repeat(kw["values"], G, axis=-3)))


@dtype_param
@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
@pytest.mark.parametrize("kind", GQA_KINDS)
def test_gqa_matches_reference(kind, rw, dtype):
    """Grouped query heads (3 key/value heads of 3 query heads each, odd
    widths), Tq 1, 2, 3 and 8: within TOL of the reference, and the same
    bits as the keys and values repeated per head (grouped or not, a
    query's result is the same)."""
    rng = np.random.default_rng(30 + GQA_KINDS.index(kind))
    for Tq in (1, 2, 3, DECODE_TQ):
        for T in (1, 17, 300):
            q, k, kw = gqa_case(rng, (2, 3), 3, Tq, T, kind, rw=rw)
            check_against_reference("dot", (q, k), kw, dtype, rw)
            (q, k), kw = cast((q, k), kw, dtype)
            got = ac.dot_attention(q, k, **kw, return_weights=rw)
            kr = np.ascontiguousarray(np.repeat(k, 3, axis=-3))
            want = ac.dot_attention(q, kr, **repeated(kw, 3),
                                    return_weights=rw)
            for g, w in zip(got, want):
                assert np.array_equal(g, w, equal_nan=True)


@dtype_param
@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
def test_gqa_general_matches_reference(rw, dtype):
    """The general score on grouped heads (the projected keys of a group
    read once for its queries), and split (3 heads on 33000 keys):
    within TOL of the reference."""
    rng = np.random.default_rng(32)
    for lead, Tq, T, kind in (((1, 2), 1, 65, "all"), ((1, 2), 3, 17, "mask"),
                              ((1, 2), 1, 3000, "plain"),
                              ((1, 2), 2, 300, "causal"),
                              ((1, 1), 1, 33000, "mask")):
        q, k, kw = gqa_case(rng, lead, 3, Tq, T, kind, rw=rw)
        q = q[..., :9]
        W = rng.standard_normal((9, k.shape[-1])) / np.sqrt(k.shape[-1])
        check_against_reference("general", (q, k, W), kw, dtype, rw)


@pytest.mark.parametrize("rw", [True, False], ids=["weights", "lse"])
@pytest.mark.parametrize("T", [40, 3000])
def test_gqa_nonfinite_in_unseen_row(T, rw):
    """A key row masked for one query head of a group and seen by the
    others, NaN in its key and inf in its value: the heads that see it
    get NaN, the one that does not the same bits as without them (its
    row is read for the group, never used for it).  T = 3000 with one
    group of four queries (float64, d = 64: chunks of 1024 keys) also runs
    the split."""
    rng = np.random.default_rng(31)
    lead = (1,) if T > 1000 else (2,)
    q, k, kw = gqa_case(rng, lead, 4, 1, T, "plain", d=64, dv=64)
    kw["mask"] = np.ones(lead + (4, T), bool)
    kw["mask"][..., 0, T - 5] = False            # head 0 of every group
    clean = ac.dot_attention(q, k, **kw, return_weights=rw)
    k2, v2 = k.copy(), kw["values"].copy()
    k2[..., T - 5, 3], v2[..., T - 5, 1] = np.nan, np.inf
    got = ac.dot_attention(q, k2, **dict(kw, values=v2), return_weights=rw)
    for g, c in zip(got, clean):
        assert np.array_equal(g[..., 0, :, :] if g.ndim > 3 else g[..., 0, :],
                              c[..., 0, :, :] if c.ndim > 3 else c[..., 0, :])
    assert np.all(np.isnan(got[0][..., 1:, :, :]))


SPLIT_KINDS = ["plain", "mask", "causal", "window", "sinks", "softcap",
               "alibi", "dropout", "bias_ninf", "all", "gap"]


@dtype_param
@pytest.mark.parametrize("kind", SPLIT_KINDS)
def test_split_matches_reference(kind, dtype):
    """At most SPLIT_SEQS sequences and long caches (several chunks of
    keys, about 1 MiB of keys and values each, the last one partial):
    within TOL of the reference, with masks that hide whole chunks ("gap":
    every key of the first half hidden) and a query with no visible key
    (out 0, lse -inf or the sink)."""
    rng = np.random.default_rng(40 + SPLIT_KINDS.index(kind))
    for lead, G, Tq, T in (((1,), 1, 1, 9001), ((1,), 2, 2, 6001),
                           ((1,), 4, 1, 5500), ((1,), 1, DECODE_TQ, 6000)):
        assert np.prod(lead) * G <= SPLIT_SEQS
        q, k, kw = gqa_case(rng, lead, G, Tq, T,
                            "mask" if kind == "gap" else kind, d=64, dv=33)
        if kind == "gap":
            kw["mask"][..., : T // 2] = False
        check_against_reference("dot", (q, k), kw, dtype, False)


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
def test_grouped_and_split_threads_bitwise(simd):
    """Grouped heads (32 query heads on 8 key/value heads) and the split
    (one sequence, one to eight heads, long caches): bitwise the same for
    1, 2 and 3 threads on every SIMD path."""
    _core._set_simd(simd)
    rng = np.random.default_rng(50)
    for dtype in DTYPES:
        for lead, G, Tq, T, kind in (((8,), 4, 1, 3000, "plain"),
                                     ((8,), 4, 2, 1500, "all"),
                                     ((1,), 1, 1, 9000, "plain"),
                                     ((2,), 2, 1, 5000, "all"),
                                     ((1,), 1, DECODE_TQ, 6000, "causal")):
            q, k, kw = gqa_case(rng, lead, G, Tq, T, kind, d=64, dv=64)
            (q, k), kw = cast((q, k), kw, dtype)
            for rw in (True, False):
                ac.set_num_threads(1)
                one = ac.dot_attention(q, k, **kw, return_weights=rw)
                for n in (2, 3):
                    ac.set_num_threads(n)
                    got = ac.dot_attention(q, k, **kw, return_weights=rw)
                    for g, w in zip(got, one):
                        assert np.array_equal(g, w, equal_nan=True)
