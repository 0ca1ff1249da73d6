"""Self-attention at scale (docs/contract.md section 5): the C functions'
dot and general attention with ``dropout`` + ``seed``, threads and SIMD
paths, NaN and bad input, forward and backward (from ``alpha`` or from
``out=`` and ``lse=``):

* the dropout keep bits against ``reference.dropout_keep``, read back
  from the C outputs;
* bitwise identical results for 1, 2 and 3 threads, every SIMD path;
* NaN in keys a query cannot see reaching nothing; inputs never written;
  every bad input refused with a message naming the argument, leaving no
  state.

The cases and checks are in selfattn_cases.py, with the tolerances of
test_selfattn.py's docstring.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import TOL, assert_all_identical, assert_identical

from selfattn_cases import (Case, P_DROP, SEED, SKB, SQB, check, check_case,
                            dtype_param)

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())


# --------------------------------------------------------------------------
# 1. Dropout: the keep bits


def _keep_from_forward(score, lead, Tq, T, p, seed, single=False,
                       return_weights=True):
    """The C forward's keep pattern: query 0 (so every weight is 1/T) and
    the values the identity, so out_it = keep_it / (T (1 - p))."""
    H = 4
    qshape = tuple(lead) + (() if single else (Tq,)) + (H,)
    query = np.zeros(qshape)
    keys = np.random.default_rng(0).standard_normal(tuple(lead) + (T, H))
    values = np.broadcast_to(np.eye(T), tuple(lead) + (T, T))
    if score == "dot":
        out, _ = ac.dot_attention(query, keys, values=values, dropout=p,
                                  seed=seed, return_weights=return_weights)
    else:
        out, _ = ac.general_attention(query, keys, np.ones((H, H)),
                                      values=values, dropout=p, seed=seed,
                                      return_weights=return_weights)
    if single:
        out = out[..., None, :]
    kept = out != 0
    assert np.all(out[kept] == out[kept].flat[0])       # 1 / (T (1-p))
    return kept


def _keep_from_backward(lead, Tq, T, p, seed, return_weights):
    """The C backward's keep pattern: grad_out the identity (Hv = Tq), so
    dvalues_ti = P_it keep_it / (1 - p) g_ii = keep_it / (T (1 - p))."""
    H = 4
    query = np.zeros(tuple(lead) + (Tq, H))
    rng = np.random.default_rng(1)
    keys = rng.standard_normal(tuple(lead) + (T, H))
    values = rng.standard_normal(tuple(lead) + (T, Tq))
    kw = dict(values=values, dropout=p, seed=seed)
    out, w = ac.dot_attention(query, keys, **kw,
                              return_weights=return_weights)
    g = np.broadcast_to(np.eye(Tq), tuple(lead) + (Tq, Tq))
    if return_weights:
        grads = ac.dot_attention_backward(g, query, keys, w, **kw)
    else:
        grads = ac.dot_attention_backward(g, query, keys, out=out, lse=w,
                                          **kw)
    dv = grads.values.swapaxes(-1, -2)                   # (lead, Tq, T)
    kept = dv != 0
    assert np.allclose(dv[kept], 1 / (T * (1 - p)), rtol=1e-12, atol=0)
    return kept


def _ref_keep(lead, Tq, T, p, seed):
    b = np.arange(int(np.prod(lead))).reshape(lead)
    return ref.dropout_keep(seed, p, b, Tq, T)


@pytest.mark.parametrize("p", [0.1, 0.5], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("sizes", [(1, 7), (5, 9), (SQB + 1, SKB + 3)],
                         ids=lambda s: f"Tq{s[0]}-T{s[1]}")
@pytest.mark.parametrize("return_weights", [True, False],
                         ids=["weights", "lse"])
@pytest.mark.parametrize("score", ["dot", "general"])
def test_dropout_keep_bits_match_reference(score, return_weights, sizes, p):
    """The keep pattern read back from the C forward (and backward) is bit
    for bit reference.dropout_keep at every flat batch index b of the
    leading shape (2, 3), for a seed with both 32-bit halves set."""
    Tq, T = sizes
    lead = (2, 3)
    want = _ref_keep(lead, Tq, T, p, SEED)
    got = _keep_from_forward(score, lead, Tq, T, p, SEED,
                             return_weights=return_weights)
    assert np.array_equal(got, want), \
        f"forward keep bits: {np.sum(got != want)} of {want.size} differ"
    if score == "dot":
        got = _keep_from_backward(lead, Tq, T, p, SEED, return_weights)
        assert np.array_equal(got, want), \
            f"backward keep bits: {np.sum(got != want)} differ"


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32, 2**64 - 1])
def test_dropout_keep_bits_seeds(seed):
    """The extreme seeds (the key's halves 0 and 2**32 - 1); one query per
    sequence uses i = 0."""
    lead, T, p = (3,), 13, 0.5
    want = _ref_keep(lead, 1, T, p, seed)
    assert np.array_equal(_keep_from_forward("dot", lead, 1, T, p, seed,
                                             single=True), want)
    assert np.array_equal(_keep_from_forward("dot", lead, 4, T, p, seed),
                          _ref_keep(lead, 4, T, p, seed))


@pytest.mark.parametrize("return_weights", [True, False],
                         ids=["weights", "lse"])
@pytest.mark.parametrize("score", ["dot", "general"])
def test_dropout_reproducible(score, return_weights):
    """The same seed gives the same bits (forward and backward); another
    seed other bits; dropout=0 (with or without a seed) is no dropout, bit
    for bit; the returned alpha is before dropout."""
    rng = np.random.default_rng(3)
    case = Case(rng, score, (2,), 70, 300, H=8, Hq=8, Hv=8, causal=True,
                bias="T", dropout=P_DROP)
    x = case.cast(np.float32)

    def run(**over):
        old = (case.dropout, case.seed)
        case.dropout, case.seed = over.get("dropout", case.dropout), \
            over.get("seed", case.seed)
        try:
            out, w = case.forward(ac, x, return_weights)
            saved = (w if return_weights else {"out": out, "lse": w})
            return (out, w) + tuple(case.backward(ac, x, saved))
        finally:
            case.dropout, case.seed = old

    first = run()
    assert_all_identical(run(), first, "same seed")
    other = run(seed=SEED + 1)
    assert not np.array_equal(other[0], first[0]), "seed ignored"
    if return_weights:
        assert_identical(other[1], first[1], "alpha is before dropout")
    plain = run(dropout=0.0, seed=None)
    assert_all_identical(run(dropout=0.0, seed=7), plain, "p = 0 with seed")
    assert not np.array_equal(plain[0], first[0])
    kw = case.kwargs(x)
    del kw["dropout"], kw["seed"]
    fn = getattr(ac, f"{case.kind}_attention")
    assert_all_identical(fn(*case.required(x), **kw,
                            return_weights=return_weights), plain[:2],
                         "p = 0 against no dropout argument")


# --------------------------------------------------------------------------
# 2. Threads and SIMD paths

# (lead, Tq, T, kw): big enough for several threads (2**22 multiply-adds
# each); the streamed backward's key segments (no bias, few sequences:
# 2 of one sequence each, then 3 of one), a shared bias summed in
# partials, many sequences, the stored path, an attn_mask of runs
THREAD_CASES = {
    "key_segments": ((2,), 600, 600, dict(causal=True, dropout=P_DROP)),
    "shared_bias": ((3,), 300, 520, dict(bias="TqT_ninf", attn="1TqT",
                                         mask="key", dropout=P_DROP)),
    "many_seqs": ((10,), 130, 257, dict(causal=True, bias="T",
                                        dropout=P_DROP)),
    "one_long": ((1,), 700, 700, dict(causal=True)),
    "mask_runs": ((2,), 600, 600, dict(attn="runs", dropout=P_DROP)),
}


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("name", list(THREAD_CASES))
@pytest.mark.parametrize("score", ["dot", "general"])
def test_threads_bitwise_identical(score, name):
    """1, 2 and 3 threads give the same bits: both forwards, the backward
    from alpha and from out= and lse=, dropout included."""
    lead, Tq, T, kw = THREAD_CASES[name]
    case = Case(np.random.default_rng(5), score, lead, Tq, T, H=32, Hq=32,
                Hv=32, **kw)
    x = case.cast(np.float32)

    def run():
        res = []
        for rw in (True, False):
            out, w = case.forward(ac, x, rw)
            saved = (w if rw else {"out": out, "lse": w})
            res += [out, w] + list(case.backward(ac, x, saved))
        return res

    ac.set_num_threads(1)
    one = run()
    for n in (2, 3):
        ac.set_num_threads(n)
        assert_all_identical(run(), one, f"{n} threads against 1")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@dtype_param
@pytest.mark.parametrize("score", ["dot", "general"])
def test_simd_paths_match_reference(score, dtype, simd):
    """Every SIMD path: the combinations over blocks against the reference
    within TOL, and the same dropout keep bits."""
    _core._set_simd(simd)
    for n, kw in enumerate([
            dict(causal=True, mask="key", bias="TqT_ninf",
                 dropout=P_DROP),
            dict(attn="full", bias="11TqT", dropout=P_DROP, values=False)]):
        case = Case(np.random.default_rng(n), score, (2,), SQB + 1,
                    SKB + 1, H=17, Hq=9, Hv=5, **kw)
        check_case(case, dtype)
    lead = (2,)
    assert np.array_equal(
        _keep_from_forward(score, lead, SQB + 1, SKB + 1, P_DROP, SEED,
                           return_weights=False),
        _ref_keep(lead, SQB + 1, SKB + 1, P_DROP, SEED))


# --------------------------------------------------------------------------
# 3. NaN where no query looks


def _nan_case(score, how):
    """A problem whose key 4 (keys and values) some queries cannot see:
    (case, the queries that cannot see it)."""
    rng = np.random.default_rng(9)
    Tq, T = 6, 6
    case = Case(rng, score, (2,), Tq, T, H=4, Hq=3, Hv=2)
    blind = np.ones(Tq, bool)
    if how == "causal":               # only queries 4 and 5 see key 4
        case.causal = True
        blind[4:] = False
    elif how == "attn_mask":
        case.attn_mask = np.ones((Tq, T), bool)
        case.attn_mask[:3, 4] = False
        blind[3:] = False
    elif how == "ninf_bias":
        case.bias = rng.standard_normal((Tq, T))
        case.bias[1::2, 4] = -np.inf
        blind[0::2] = False
    elif how == "key_mask":
        case.mask = np.ones((2, T), bool)
        case.mask[:, 4] = False
    elif how == "attn_mask_column":
        case.attn_mask = np.ones((1, Tq, T), bool)
        case.attn_mask[..., 4] = False
    elif how == "ninf_bias_column":
        case.bias = rng.standard_normal((2, 1, T))
        case.bias[..., 4] = -np.inf
    return case, blind


NAN_HOW = ["causal", "attn_mask", "ninf_bias", "key_mask",
           "attn_mask_column", "ninf_bias_column"]


@pytest.mark.parametrize("return_weights", [True, False],
                         ids=["weights", "lse"])
@pytest.mark.parametrize("how", NAN_HOW)
@pytest.mark.parametrize("score", ["dot", "general"])
def test_nan_in_invisible_keys_reaches_nothing(score, how, return_weights):
    """NaN in key 4 and its value, where a query cannot see it (causal,
    attn_mask, -inf bias): that query's out, alpha or lse and dquery are
    those of the same call with a finite key 4.  Where no query sees it
    (key mask, an all-False attn_mask column, a -inf bias column), every
    result is, and the NaN key gets zero gradients."""
    case, blind = _nan_case(score, how)
    runs = []
    for bad in (np.nan, 0.5):
        x = case.cast(np.float64)
        x["keys"][..., 4, :] = bad
        x["values"][..., 4, :] = bad
        out, w = case.forward(ac, x, return_weights)
        saved = (w if return_weights else {"out": out, "lse": w})
        runs.append((out, w, case.backward(ac, x, saved)))
    (out, w, g), (out0, w0, g0) = runs
    tol = TOL[np.float64]
    what = f"{how}, return_weights={return_weights}"
    for name, a, b in [("out", out, out0), ("weights", w, w0),
                       ("dquery", g.query, g0.query)]:
        check(a[:, blind], b[:, blind], np.float64,
              f"{what}: {name} of a query that cannot see the NaN", tol)
    if blind.all():                   # no query sees key 4
        for name, a, b in zip(g._fields, g, g0):
            if b is not None:
                check(a, b, np.float64, f"{what}: d{name}", tol)
        assert np.all(g.keys[:, 4] == 0) and np.all(g.values[:, 4] == 0)


@pytest.mark.parametrize("return_weights", [True, False],
                         ids=["weights", "lse"])
@pytest.mark.parametrize("score", ["dot", "general"])
def test_nan_where_nothing_looks(score, return_weights):
    """NaN in bias entries hidden by attn_mask, by causal and by the key
    mask, and in the query (and grad_out) of a query with no visible key,
    reach nothing: every result equals that of finite values there."""
    rng = np.random.default_rng(11)
    case = Case(rng, score, (2,), 6, 8, causal=True, attn="TqT",
                mask="key", bias="full_ninf")
    vis = case.visible()
    dead = ~vis.any(axis=-1)
    assert dead.any() and (~dead).any()
    runs = []
    for bad in (np.nan, 0.25):
        x = case.cast(np.float64)
        hidden = ~vis & ~np.isneginf(x["bias"])
        x["bias"][hidden] = bad
        x["query"][dead] = bad
        x["grad_out"][dead] = bad
        out, w = case.forward(ac, x, return_weights)
        saved = (w if return_weights else {"out": out, "lse": w})
        runs.append([out, w] + list(case.backward(ac, x, saved)))
    for n, (a, b) in enumerate(zip(*runs)):
        if b is not None:
            check(a, b, np.float64, f"result {n}", TOL[np.float64])


# --------------------------------------------------------------------------
# 4. Inputs are never written; bad input


@pytest.mark.parametrize("score", ["dot", "general"])
def test_inputs_never_modified(score):
    """Every input of both forwards and the three backwards, read-only
    (so a write would fail) and compared byte for byte afterwards;
    broadcast (stride 0) masks and bias are read in place."""
    rng = np.random.default_rng(13)
    case = Case(rng, score, (2, 3), 7, 9, mask="key", attn="TqT",
                causal=True, bias="11TqT", dropout=P_DROP)
    case.attn_mask = np.broadcast_to(case.attn_mask, (2, 3, 7, 9))
    case.bias = np.broadcast_to(case.bias, (2, 3, 7, 9))
    x = case.cast(np.float32)
    arrays = dict(x, mask=case.mask, attn_mask=case.attn_mask)
    out, alpha = case.forward(ac, x, True)
    out_s, lse = case.forward(ac, x, False)
    arrays.update(out=out_s, lse=lse, alpha=alpha)
    for a in arrays.values():
        if a is not None:
            a.flags.writeable = False
    before = {n: a.tobytes() for n, a in arrays.items() if a is not None}
    case.forward(ac, x, True)
    case.forward(ac, x, False)
    case.backward(ac, x, alpha)
    case.backward(ac, x, alpha, with_ga=True)
    case.backward(ac, x, {"out": out_s, "lse": lse})
    for n, b in before.items():
        assert arrays[n].tobytes() == b, f"{n} was written"


def _bad_calls():
    """(id, function name, changes to a good call's arguments, exception,
    words the message must contain)."""
    T, Tq = 7, 5
    per_query = np.ones((2, Tq, T), bool)
    return [
        ("per_query_mask", "fwd", dict(mask=per_query), ValueError,
         ["mask", "attn_mask"]),
        ("per_query_mask_bwd", "bwd", dict(mask=per_query), ValueError,
         ["mask", "attn_mask"]),
        ("attn_mask_shape", "fwd", dict(attn_mask=np.ones((3, T), bool)),
         ValueError, ["attn_mask", "(3, 7)"]),
        ("attn_mask_leading", "bwd",
         dict(attn_mask=np.ones((3, Tq, T), bool)), ValueError,
         ["attn_mask", "(3, 5, 7)"]),
        ("attn_mask_more_axes", "fwd",
         dict(attn_mask=np.ones((1, 2, Tq, T), bool)), ValueError,
         ["attn_mask"]),
        ("bias_shape", "fwd", dict(bias=np.ones((Tq, T + 1))), ValueError,
         ["bias", "(5, 8)"]),
        ("bias_shape_bwd", "bwd", dict(bias=np.ones((Tq + 1, 1))),
         ValueError, ["bias", "(6, 1)"]),
        ("attn_mask_float", "fwd", dict(attn_mask=np.ones((Tq, T))),
         TypeError, ["attn_mask", "bias=", "PyTorch", "opposite"]),
        ("attn_mask_int", "bwd", dict(attn_mask=np.ones((Tq, T), np.int8)),
         TypeError, ["attn_mask", "bias=", "PyTorch", "opposite"]),
        ("dropout_one", "fwd", dict(dropout=1.0, seed=1), ValueError,
         ["dropout", "[0, 1)"]),
        ("dropout_negative", "bwd", dict(dropout=-0.1, seed=1),
         ValueError, ["dropout", "[0, 1)"]),
        ("dropout_nan", "fwd", dict(dropout=float("nan"), seed=1),
         ValueError, ["dropout"]),
        ("dropout_without_seed", "fwd", dict(dropout=0.1, seed=None),
         ValueError, ["dropout", "seed"]),
        ("dropout_without_seed_bwd", "bwd", dict(dropout=0.1, seed=None),
         ValueError, ["dropout", "seed"]),
        ("seed_negative", "fwd", dict(dropout=0.1, seed=-1), ValueError,
         ["seed"]),
        ("seed_too_big", "fwd", dict(dropout=0.1, seed=2**64), ValueError,
         ["seed"]),
        ("lse_without_out", "bwd_lse", dict(out=None), ValueError,
         ["out", "lse"]),
        ("out_without_lse", "bwd_lse", dict(lse=None), ValueError,
         ["out", "lse"]),
        ("alpha_with_lse", "bwd", dict(lse="lse"), ValueError,
         ["alpha", "lse"]),
        ("alpha_with_out_and_lse", "bwd", dict(lse="lse", out="out"),
         ValueError, ["alpha", "lse"]),
        ("grad_alpha_with_lse", "bwd_lse", dict(grad_alpha="ga"),
         ValueError, ["grad_alpha"]),
        ("causal_single", "fwd_single", dict(causal=True), ValueError,
         ["causal"]),
        ("attn_mask_single", "fwd_single",
         dict(attn_mask=np.ones((2, T), bool)), ValueError, ["attn_mask"]),
        ("causal_single_bwd", "bwd_single", dict(causal=True), ValueError,
         ["causal"]),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("score", ["dot", "general"])
@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_bad_input(score, bad):
    """Each bad call raises with a message naming the argument, writes no
    input, and leaves no state: the next good call gives the same bits as
    the one before it."""
    _, which, changes, exc, words = bad
    single = which.endswith("single")
    rng = np.random.default_rng(17)
    case = Case(rng, score, (2,), 5, 7, single=single, causal=not single,
                bias="T", dropout=P_DROP)
    x = case.cast(np.float64)
    kind = case.kind
    out, lse = case.forward(ac, x, False)
    _, alpha = case.forward(ac, x, True)
    named = {"lse": lse, "out": out, "ga": x["grad_alpha"]}

    def call(chg=None):
        kw = case.kwargs(x)
        req = case.required(x)
        if chg:
            kw.update({k: named.get(v, v) if isinstance(v, str) else v
                       for k, v in chg.items()})
        if which.startswith("fwd"):
            return getattr(ac, f"{kind}_attention")(*req, **kw)
        fn = getattr(ac, f"{kind}_attention_backward")
        if which == "bwd_lse":
            kw = dict(dict(out=out, lse=lse), **kw)
            if chg:                  # out=None / lse=None: left out
                kw = {k: v for k, v in kw.items()
                      if not (k in ("out", "lse") and v is None)}
            return fn(x["grad_out"], *req, **kw)
        return fn(x["grad_out"], *req, alpha, **kw)

    good = call()
    copies = {n: a.copy() for n, a in x.items() if a is not None}
    with pytest.raises(exc) as info:
        call(changes)
    msg = str(info.value)
    for word in words:
        assert word in msg, f"{word!r} not in message: {msg}"
    for n, a in copies.items():
        assert np.array_equal(x[n], a), f"{n} written by a bad call"
    assert_all_identical(tuple(call()), tuple(good), "the next good call")
