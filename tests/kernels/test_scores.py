"""The location and cosine scores in the C kernels (issue 31) against
their NumPy reference (attention_c.reference.scores, itself checked
against PyTorch in test_reference_scores.py).

* forward and backward against the float64 reference on the same (cast)
  values: sizes 1, 3, 17, 65 for Tq, T and the widths, one query and
  several, leading axes and broadcast leading axes, a sequence and a query
  that see no key, float32 and float64, every SIMD path;
* location: T < T_max (rows t >= T of dW and db exactly 0) and T = T_max;
* cosine: every argument it shares with dot_attention (causal, bias,
  dropout and seed, window, softcap, alibi_slopes, sinks, cu_seqlens),
  from alpha and from out= and lse=; sharpness None, a number, arrays
  broadcast to the query positions (gradient summed back); zero and
  shorter-than-eps vectors (finite, never NaN);
* the C backward against central differences of the C forward;
* the same bits for 1, 2 and 3 threads, inputs left untouched, and bad
  input refused with an error naming the argument.

Tolerances (testing.TOL, normwise): 1e-5 for float32 and 1e-12 for float64
against the float64 reference; a gradient may also be within ILL_FACTOR
times the error of the reference evaluated in the same dtype (near one-hot
weights), and where a gradient can be 0 in exact arithmetic (one visible
key, the radial part of a normalised vector) its error is measured
against noise_floor(bound) with bound the size of its terms.  Finite
differences: FD_RTOL.  Any warning fails a test.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import (DTYPES, FD_RTOL, ILL_FACTOR, TOL,
                                 assert_all_identical, noise_floor,
                                 numerical_grad, rel_err)

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())
dtype_param = pytest.mark.parametrize("dtype", DTYPES,
                                      ids=lambda d: np.dtype(d).name)
simd_param = pytest.mark.parametrize("simd", SIMD_PATHS)
score_param = pytest.mark.parametrize("score", ["location", "cosine"])

# The arguments of each function that a problem (a dict) may hold, those
# with a gradient in the order of the gradient tuple (GRADS);
# return_weights and the backward's own arguments are added by the calls.
INPUTS = {"location": ["query", "values", "W", "b", "mask", "attn_mask"],
          "cosine": ["query", "keys", "values", "sharpness", "bias",
                     "alibi_slopes", "sinks", "mask", "attn_mask", "causal",
                     "dropout", "seed", "window", "softcap", "cu_seqlens_q",
                     "cu_seqlens_k"]}
GRADS = {"location": ("query", "values", "W", "b"),
         "cosine": ("query", "keys", "values", "sharpness", "bias",
                    "alibi_slopes", "sinks")}


def norm(*xs):
    """The product of the norms of the arrays xs (None counts 1)."""
    return float(np.prod([1.0 if x is None else np.linalg.norm(x)
                          for x in xs]))


def as64(x):
    """The inputs x with every float array in float64 (masks, seeds and
    numbers as they are): the reference's inputs."""
    return {n: (np.asarray(a, np.float64) if isinstance(a, np.ndarray)
                and a.dtype.kind == "f" else a) for n, a in x.items()}


# --------------------------------------------------------------------------
# Problems and calls


def key_mask(rng, lead, T):
    """(lead, T): random, key T-1 always valid, the second sequence sees
    nothing (when there is one)."""
    m = rng.random(lead + (T,)) < 0.7
    m[..., -1] = True
    if int(np.prod(lead)) > 1:
        m.reshape(-1, T)[1] = False
    return m


def query_mask(rng, lead, Tq, T):
    """(lead, Tq, T): random, query 1 sees no key (when Tq > 1), key 0 is
    seen by no query (when T > 1)."""
    am = rng.random(lead + (Tq, T)) < 0.7
    am[..., -1] = True
    if Tq > 1:
        am[..., 1, :] = False
    if T > 1:
        am[..., 0] = False
    return am


def problem(rng, score, dtype, qlead, klead, Tq, T, H, Hv, single=False,
            masks=True, T_max=None, values=True, sharpness="per_query"):
    """Inputs (a dict, arrays in dtype) of a location or cosine problem:
    query (qlead, [Tq,] H) against keys or W, values (klead, T, Hv), a key
    mask with a dead sequence, and with several queries an attn_mask with
    a dead query; grad_out and grad_alpha of the result's shape."""
    lead = np.broadcast_shapes(qlead, klead)
    tail = () if single else (Tq,)

    def rnd(*shape):
        return rng.standard_normal(shape).astype(dtype)

    x = dict(lead=lead, single=single, query=rnd(*qlead, *tail, H))
    values = values or score == "location"      # (cosine: the keys)
    x["values"] = rnd(*klead, T, Hv) if values else None
    if score == "location":
        x["W"], x["b"] = rnd(T_max or T, H), rnd(T_max or T)
    else:
        x["keys"] = rnd(*klead, T, H)
        if isinstance(sharpness, str):  # "per_query": summed back
            shape = (lead + tail)[-1:]      # (Tq,), or (lead[-1],)
            x["sharpness"] = rng.uniform(0.5, 4, shape).astype(dtype)
        else:
            x["sharpness"] = sharpness
    x["mask"] = key_mask(rng, lead, T) if masks else None
    x["attn_mask"] = (query_mask(rng, lead, Tq, T) if masks and not single
                      else None)
    Ho = Hv if values else H
    x["grad_out"], x["grad_alpha"] = rnd(*lead, *tail, Ho), rnd(*lead,
                                                                *tail, T)
    return x


def forward(mod, score, x, **kw):
    """(out, alpha), or (out, lse) with return_weights=False."""
    args = {n: x[n] for n in INPUTS[score] if x.get(n) is not None}
    return getattr(mod, f"{score}_attention")(**args, **kw)


def backward(mod, score, x, saved, with_ga=True, **kw):
    """The gradient tuple, from alpha = saved[1], or from out= and lse=
    when kw has return_weights=False."""
    args = {n: x[n] for n in INPUTS[score] if x.get(n) is not None}
    if kw.pop("return_weights", True):
        args["alpha"] = saved[1]
        if with_ga:
            args["grad_alpha"] = x["grad_alpha"]
    else:
        args["out"], args["lse"] = saved
    return tuple(getattr(mod, f"{score}_attention_backward")(
        x["grad_out"], **args, **kw))


def bounds(score, x, T):
    """The size of the terms of each gradient (see noise_floor): gamma =
    g . val + ga over the visible pairs, times what each gradient
    multiplies it by."""
    vals = x["values"] if x["values"] is not None else x.get("keys")
    gamma = norm(x["grad_out"], vals) + norm(x["grad_alpha"])
    if score == "location":
        return dict(query=gamma * norm(x["W"]), values=norm(x["grad_out"]),
                    W=gamma * norm(x["query"]), b=gamma)

    def inv(v):                         # 1 / the shortest vector
        r = np.linalg.norm(v.astype(np.float64), axis=-1)
        return 1 / max(float(r.min()), 1e-12)

    beta = 1.0 if x["sharpness"] is None else float(
        np.max(np.abs(x["sharpness"])))
    keys_are_values = x["values"] is None
    return dict(query=gamma * beta * inv(x["query"]),
                keys=(gamma * beta * inv(x["keys"])
                      + keys_are_values * norm(x["grad_out"])),
                values=norm(x["grad_out"]), sharpness=gamma, bias=gamma,
                alibi_slopes=gamma * T, sinks=gamma)


def check(got, want, dtype, what, same=None, bound=0.0):
    """got is a new ndarray of dtype and want's shape, within TOL[dtype]
    of the float64 want (floor noise_floor(bound)), or ILL_FACTOR times
    the error of same (the reference in dtype)."""
    assert type(got) is np.ndarray, f"{what}: {type(got)}"
    assert got.dtype == np.dtype(dtype), (what, got.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol = TOL[np.dtype(dtype).type]
    floor = noise_floor(bound, dtype, tol) if bound else 0.0
    if same is not None:
        tol = max(tol, ILL_FACTOR * rel_err(same, want, floor))
    err = rel_err(got, want, floor)
    assert err <= tol, f"{what}: normwise relative error {err:.3g} > {tol:.3g}"


def compare(score, x, dtype, with_ga=True, **kw):
    """The C forward and backward in dtype == the reference in float64 on
    the same values; returns C's (forward, gradient dict)."""
    x64 = as64(x)
    weights = kw.get("return_weights", True)
    fwd = forward(ac, score, x, **kw)
    want = forward(ref, score, x64, **kw)
    check(fwd[0], want[0], dtype, "out", bound=norm(x["values"]))
    if weights:
        check(fwd[1], want[1], dtype, "alpha", bound=1.0)
    else:
        lse_ok = np.isfinite(want[1])
        assert np.array_equal(np.isfinite(fwd[1]), lse_ok), "lse -inf"
        check(fwd[1][lse_ok], want[1][lse_ok], dtype, "lse",
              bound=float(np.abs(want[1][lse_ok]).sum()) + 1)
    got = backward(ac, score, x, fwd, with_ga, **kw)
    saved64 = as64({"o": fwd[0], "a": fwd[1]})
    want = backward(ref, score, x64, (saved64["o"], saved64["a"]), with_ga,
                    **kw)
    same = backward(ref, score, x, fwd, with_ga, **kw)
    size = bounds(score, x, x["grad_alpha"].shape[-1])
    assert len(got) == len(GRADS[score])
    for n, g, w, s in zip(GRADS[score], got, want, same):
        if w is None:
            assert g is None, f"d{n} should be None"
        else:
            check(g, w, dtype, f"d{n}", s, size[n])
    return fwd, dict(zip(GRADS[score], got))


def visible(x, T):
    """(lead, [Tq,] T): who sees what under mask and attn_mask."""
    Tq = 1 if x["single"] else x["query"].shape[-2]
    vis = np.ones(x["lead"] + (Tq, T), bool)
    if x["mask"] is not None:
        vis = vis & x["mask"][..., None, :]
    if x["attn_mask"] is not None:
        vis = vis & x["attn_mask"]
    return vis[..., 0, :] if x["single"] else vis


def check_zeros(score, x, fwd, g):
    """Exact zeros: masked weights, the output and query gradient of a
    query that sees no key, rows past T of dW and db; nothing non-finite."""
    out, alpha = fwd
    T = alpha.shape[-1]
    vis = visible(x, T)
    dead = ~vis.any(-1)
    assert np.all(alpha[~vis] == 0) and np.all(out[dead] == 0)
    q_dead = dead if g["query"].shape[:-1] == dead.shape else None
    if q_dead is not None:
        assert np.all(g["query"][q_dead] == 0), "dquery of a dead query"
    if score == "location":
        assert np.all(g["W"][T:] == 0) and np.all(g["b"][T:] == 0)
    for n, a in g.items():
        assert a is None or np.all(np.isfinite(a)), f"d{n} not finite"


# --------------------------------------------------------------------------
# 1. Against the reference: odd sizes, layouts, masks, dtypes, SIMD paths

# (lead, Tq, T, H, Hv): 1, 3, 17 and 65 in each position
SIZES = [((1,), 1, 1, 1, 1), ((3,), 3, 17, 65, 3), ((), 17, 3, 1, 17),
         ((1,), 65, 17, 3, 1), ((3,), 1, 65, 17, 65), ((2,), 17, 65, 3, 3)]


def size_id(s):
    lead, Tq, T, H, Hv = s
    return f"B{'x'.join(map(str, lead)) or '-'}-Tq{Tq}-T{T}-H{H}-Hv{Hv}"


@pytest.mark.parametrize("layout", ["q1", "qN", "broadcast"])
@pytest.mark.parametrize("size", SIZES, ids=size_id)
@dtype_param
@score_param
@simd_param
def test_matches_reference(simd, score, dtype, size, layout,
                           restore_settings):
    """One query or several, with masks (a dead sequence, a dead query, a
    key nobody sees), leading axes broadcast ((2, 1) x (1, 3) + lead); the
    location score with T < T_max or T = T_max, the cosine one with a
    sharpness per query position and the values given or the keys."""
    _core._set_simd(simd)
    lead, Tq, T, H, Hv = size
    rng = np.random.default_rng(sum(size[1:]) + len(lead))
    qlead, klead = lead, lead
    if layout == "broadcast":
        qlead, klead = (2, 1) + lead, (1, 3) + lead
    T_max = T if layout == "qN" else T + 3
    x = problem(rng, score, dtype, qlead, klead, Tq, T, H, Hv,
                single=layout == "q1", T_max=T_max, values=Hv != 1)
    fwd, g = compare(score, x, dtype)
    check_zeros(score, x, fwd, g)


@dtype_param
@score_param
def test_everything_masked_gives_zeros(score, dtype, rng):
    """No query sees any key: every output and gradient is exactly 0."""
    for single in (True, False):
        x = problem(rng, score, dtype, (2,), (2,), 3, 4, 3, 2, single=single,
                    T_max=6)
        x["mask"] = np.zeros((2, 4), bool)
        out, alpha = forward(ac, score, x)
        g = backward(ac, score, x, (out, alpha))
        for a in (out, alpha) + g:
            assert a is None or (a.dtype == dtype and np.all(a == 0))


# --------------------------------------------------------------------------
# 2. Cosine: the arguments of the dot score

CU_Q, CU_K = np.array([0, 5, 5, 17]), np.array([0, 30, 41, 65])
VARIANTS = {
    "causal": dict(causal=True),
    "bias": dict(bias="bias"),
    "dropout": dict(dropout=0.3, seed=2**40 + 7),
    "window": dict(window=(9, 2)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes="slopes"),
    "sinks": dict(sinks="sinks"),
    "packed": dict(cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K),
    "everything": dict(causal=True, bias="bias", dropout=0.2, seed=3,
                       window=(20, None), softcap=2.0,
                       alibi_slopes="slopes", cu_seqlens_q=CU_Q,
                       cu_seqlens_k=CU_K),
}


def variant(rng, dtype, name, lead, Tq, T):
    """The keywords of a variant, its arrays drawn in dtype."""
    fill = {"bias": rng.standard_normal((Tq, T)),
            "slopes": rng.uniform(0.01, 0.3, lead),
            "sinks": rng.standard_normal(lead)}
    return {n: fill[v].astype(dtype) if isinstance(v, str) else v
            for n, v in VARIANTS[name].items()}


@pytest.mark.parametrize("name,weights", [
    (n, w) for n in VARIANTS for w in (True, False)
    if not (n == "sinks" and w)])      # sinks: from out= and lse= only
@dtype_param
@simd_param
def test_cosine_variants(simd, dtype, name, weights, rng, restore_settings):
    """Each argument of the dot score, and all at once, with the weights
    stored (backward from alpha and grad_alpha) or not (return_weights=
    False, backward from out= and lse=): C == reference."""
    _core._set_simd(simd)
    lead, Tq, T = (2,), 17, 65
    x = problem(rng, "cosine", dtype, lead, lead, Tq, T, 3, 17)
    x["sharpness"] = rng.uniform(1, 6, lead + (Tq,)).astype(dtype)
    x.update(variant(rng, dtype, name, lead, Tq, T))
    compare("cosine", x, dtype, with_ga=weights, return_weights=weights)


SHARPNESS = {  # name: (a number, or the shape of a float64 array; for
    # lead (2, 3) and Tq = 4), one query?
    "none": (None, False), "float": (2.5, False), "int": (3, False),
    "zero_d": ((), False), "per_query": ((4,), False),
    "per_sequence": ((2, 1, 1), False), "full": ((2, 3, 4), False),
    "one_query_per_head": ((3,), True), "one_query_full": ((2, 3), True),
}


@pytest.mark.parametrize("name", list(SHARPNESS))
@dtype_param
def test_sharpness_forms(name, dtype, rng):
    """sharpness None, a number, arrays broadcast to out.shape[:-1] (their
    gradient summed back to their shape; None for None and numbers); a
    float64 array does not promote a float32 call."""
    beta, single = SHARPNESS[name]
    if isinstance(beta, tuple):
        beta = rng.uniform(0.5, 4, beta)                # float64 always
    x = problem(rng, "cosine", dtype, (2, 3), (2, 3), 4, 5, 3, 2,
                single=single, sharpness=beta)
    _, g = compare("cosine", x, dtype)
    if isinstance(beta, np.ndarray):
        assert g["sharpness"].shape == beta.shape
    else:
        assert g["sharpness"] is None
    if not isinstance(beta, np.ndarray) and beta is not None:
        same = forward(ac, "cosine", dict(x, sharpness=np.array(beta,
                                                                dtype)))
        check(forward(ac, "cosine", x)[0], same[0].astype(np.float64),
              dtype, "a number and its 0-d array")


def test_nan_sharpness_is_data(rng):
    """An array's NaN propagates to its query's output only (a Python
    float NaN is refused: test_bad_input)."""
    x = problem(rng, "cosine", np.float64, (2,), (2,), 3, 4, 3, 2,
                masks=False)
    beta = np.ones((2, 3))
    beta[1, 2] = np.nan
    out, _ = ac.cosine_attention(x["query"], x["keys"], values=x["values"],
                                 sharpness=beta)
    assert np.all(np.isnan(out[1, 2]))
    out[1, 2] = 0
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("fill", [np.nan, np.inf], ids=["nan", "inf"])
@dtype_param
@score_param
def test_nonfinite_padding_reaches_nothing(score, dtype, fill, rng):
    """NaN or Inf in padding (docs/contract.md 4.3): a key nobody sees
    (its keys, values, W and b rows), rows of W and b past T, a query that
    sees no key (and its sharpness): every output and gradient is bit for
    bit that of zeros there."""
    x = problem(rng, score, dtype, (2,), (2,), 3, 5, 4, 3, T_max=7)
    # sequence 1 sees no key, query 1 sees no key, key 0 is seen by none
    pad = {"query": np.s_[:, 1], "keys": np.s_[:, 0], "values": np.s_[:, 0],
           "W": np.s_[[0, 5, 6]], "b": np.s_[[0, 5, 6]],
           "sharpness": np.s_[1]}
    zero, bad = dict(x), dict(x)
    for n, where in pad.items():
        if x.get(n) is not None:
            zero[n], bad[n] = x[n].copy(), x[n].copy()
            zero[n][where], bad[n][where] = 0, fill
            if n in ("query", "keys", "values"):
                zero[n][1], bad[n][1] = 0, fill
    want = forward(ac, score, zero)
    want_g = backward(ac, score, zero, want)
    got = forward(ac, score, bad)
    assert_all_identical(list(got), list(want), "forward")
    assert_all_identical(list(backward(ac, score, bad, got)), list(want_g),
                         "gradients")


@pytest.mark.parametrize("values", [True, False],
                         ids=["values", "keys_as_values"])
@dtype_param
@simd_param
def test_cosine_zero_vectors(simd, dtype, values, rng, restore_settings):
    """Zero queries and keys (score 0) and vectors shorter than eps (n(x)
    = x / eps, gradient / eps): finite, == reference."""
    _core._set_simd(simd)
    x = problem(rng, "cosine", dtype, (2,), (2,), 17, 65, 3, 3,
                values=values)
    x["query"][0, 2] = 0                               # (sequence 1 and
    x["query"][0, 5] = 3e-13                           # query 1 see no
    x["keys"][0, 7] = 0                                # key: padding)
    x["keys"][0, 9] = -2e-13
    x["mask"][0, [7, 9]] = True
    fwd, g = compare("cosine", x, dtype)
    check_zeros("cosine", x, fwd, g)


# --------------------------------------------------------------------------
# 3. Gradients against finite differences of the C forward (float64)

@score_param
@simd_param
def test_gradients_match_finite_differences(simd, score, rng,
                                            restore_settings):
    """Every gradient of the C backward (from alpha with grad_alpha; for
    cosine also from out= and lse= with sinks, softcap and ALiBi) against
    central differences of the C forward, with a dead sequence, broadcast
    leading axes and, for location, rows of W past T."""
    _core._set_simd(simd)
    x = problem(rng, score, np.float64, (2, 1), (1, 3), 4, 5, 3, 2, T_max=7)
    cases = [({}, True)]
    if score == "cosine":
        x["sharpness"] = rng.uniform(0.5, 3, (3, 4))
        cases.append((dict(sinks=rng.standard_normal((2, 3)),
                           softcap=1.5, bias=rng.standard_normal((4, 5)),
                           alibi_slopes=rng.uniform(0.1, 0.5, (3,)),
                           window=(2, 1)), False))
    for extra, weights in cases:
        y = dict(x, **extra)
        kw = {} if weights else {"return_weights": False}

        def loss():
            out, alpha = forward(ac, score, y)
            L = np.sum(out * y["grad_out"])
            return L + (np.sum(alpha * y["grad_alpha"]) if weights else 0)

        g = backward(ac, score, y, forward(ac, score, y, **kw), **kw)
        for n, d in zip(GRADS[score], g):
            if not isinstance(y.get(n), np.ndarray):
                assert d is None, f"d{n} should be None"
                continue
            err = rel_err(d, numerical_grad(loss, y[n]))
            assert err <= FD_RTOL, f"d{n}: {err:.3g} against differences"


# --------------------------------------------------------------------------
# 4. Threads, inputs, errors

@pytest.mark.parametrize("score,weights", [
    ("location", True), ("cosine", True), ("cosine", False)])
def test_threads_bitwise(score, weights, rng, restore_settings):
    """The same bits with 1, 2 and 3 threads, forward and backward (for
    cosine with a causal window, dropout, ALiBi and, without weights, the
    sinks)."""
    lead, Tq, T = (4,), 150, 260
    x = problem(rng, score, np.float32, lead, lead, Tq, T, 32, 32,
                T_max=300)
    kw = {} if weights else {"return_weights": False}
    if score == "cosine":
        x["sharpness"] = rng.uniform(1, 8, lead + (Tq,)).astype(np.float32)
        x["alibi_slopes"] = rng.uniform(0, 0.1, lead).astype(np.float32)
        kw.update(causal=True, window=(100, 0), dropout=0.1, seed=9)
        if not weights:
            x["sinks"] = rng.standard_normal(lead).astype(np.float32)
    results = []
    for n in (1, 2, 3):
        ac.set_num_threads(n)
        fwd = forward(ac, score, x, **kw)
        grads = backward(ac, score, x, fwd, **kw)
        results.append(list(fwd) + [a for a in grads if a is not None])
    for other in results[1:]:
        assert_all_identical(other, results[0], "threads")


@score_param
def test_inputs_unchanged(score, rng):
    """No call writes into its inputs (every argument given)."""
    x = problem(rng, score, np.float32, (2,), (2,), 3, 5, 4, 3, T_max=6)
    kw = {}
    if score == "cosine":
        x.update(bias=rng.standard_normal((3, 5)).astype(np.float32),
                 alibi_slopes=np.full(2, 0.2, np.float32),
                 sinks=np.zeros(2, np.float32))
        kw = dict(causal=True, return_weights=False, dropout=0.5, seed=1,
                  softcap=3.0)
    before = {n: a.copy() for n, a in x.items()
              if isinstance(a, np.ndarray)}
    fwd = forward(ac, score, x, **kw)
    saved = tuple(a.copy() for a in fwd)
    backward(ac, score, x, fwd, **kw)
    for n, a in before.items():
        assert np.array_equal(a, x[n]), f"{n} was modified"
    assert_all_identical(list(fwd), list(saved), "forward's results")


def test_bad_input_names_the_argument(rng):
    """Refused before any work, the message naming the argument."""
    q, k = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4))
    v, W, b = rng.standard_normal((2, 5, 2)), np.ones((6, 4)), np.ones(6)
    g, a = np.ones((2, 3, 2)), np.full((2, 3, 5), 0.2)
    loc, loc_b = ac.location_attention, ac.location_attention_backward
    cos, cos_b = ac.cosine_attention, ac.cosine_attention_backward
    bad = [
        (ValueError, "W", lambda: loc(q, v, W[:4])),
        (ValueError, "W", lambda: loc_b(g, q, v, W[:4], a)),
        (ValueError, "W", lambda: loc(q, v, W[None])),
        (ValueError, "W", lambda: loc(q, v, np.ones((6, 3)))),
        (ValueError, "b", lambda: loc(q, v, W, b=b[:5])),
        (ValueError, "b", lambda: loc_b(g, q, v, W, a, b=np.ones(7))),
        (ValueError, "b", lambda: loc(q, v, W, b=np.ones((6, 1)))),
        (TypeError, "W", lambda: loc(q, v, W.astype(bool))),
        (TypeError, "b", lambda: loc(q, v, W, b=b.astype(complex))),
        (TypeError, "values", lambda: loc(q, v.astype(str), W)),
        (ValueError, "sharpness", lambda: cos(q, k, sharpness=np.ones(2))),
        (ValueError, "sharpness",
         lambda: cos(q, k, sharpness=np.ones((2, 2, 3)))),
        (ValueError, "sharpness",
         lambda: cos_b(g, q, k, a, values=v, sharpness=np.ones(5))),
        (ValueError, "sharpness", lambda: cos(q, k, sharpness=np.inf)),
        (ValueError, "sharpness", lambda: cos(q, k, sharpness=-np.inf)),
        (ValueError, "sharpness", lambda: cos(q, k, sharpness=np.nan)),
        (TypeError, "sharpness",
         lambda: cos(q, k, sharpness=np.ones(3, complex))),
        (TypeError, "sharpness", lambda: cos(q, k, sharpness="2")),
        (TypeError, "sharpness",
         lambda: cos(q, k, sharpness=np.ones(3, bool))),
        (TypeError, "query", lambda: cos(q.astype(complex), k)),
        (TypeError, "keys", lambda: cos(q, k.astype(object))),
        (ValueError, "keys", lambda: cos(q, k[..., :3])),
    ]
    for exc, name, call in bad:
        with pytest.raises(exc, match=name):
            call()
    with pytest.raises(TypeError, match="scale"):
        cos(q, k, scale=1.0)
