"""The attention family's input handling (docs/contract.md section 4):
the dtypes a call computes and returns in, the errors that name a bad
argument, inputs never modified, keywords against positions, and the
results' types.  Every function of attention_c.testing.SIGNATURES, the C
kernels and ``attention_c.reference``; the cases and checks of
family_cases.py.

Any warning raised during a test fails it (module-level
``filterwarnings``).
"""

import re

import numpy as np
import pytest

import attention_c as ac
from attention_c import reference as ref
from attention_c.testing import (FAMILY_FUNCTIONS, HALF_DTYPES, ILL_FACTOR,
                                 SIGNATURES, TOL, assert_all_identical,
                                 assert_rounded, rel_err)

from family_cases import (FamilyProblem, NOT_FLOAT, as_tuple, check,
                          dtype_param, f64, family_mask, lead_id, run_pair,
                          score_param)

pytestmark = pytest.mark.filterwarnings("error")


# --------------------------------------------------------------------------
# Dtypes, errors, inputs never modified
#
# Arguments of every function: attention_c.testing.SIGNATURES.

FUNCS = FAMILY_FUNCTIONS
# Float arrays make_args leaves out (None): the backward gets alpha.
LEFT_NONE = {"key_proj", "out", "lse"}


def params_of(fn):
    req, opt = SIGNATURES[fn]
    return req + opt


def float_args(fn):
    """The float array arguments make_args fills (key_proj, out, lse left
    out)."""
    return [a for a in params_of(fn) if a not in NOT_FLOAT | LEFT_NONE]


def fn_kind(fn):
    return fn.split("_")[0]


def make_args(fn, rng, dtype=np.float64, lead=(3,), single=False, T=5,
              key_proj=False):
    """Keyword arguments of fn: every optional array given (key_proj only
    when asked): a key mask, for several queries a per-query attn_mask
    too, for dot/general a finite bias; the flags at their defaults (no
    out/lse: the backward gets alpha), in dtype."""
    kind = fn_kind(fn)
    if kind == "project":
        keys = rng.standard_normal(lead + (T, 4))
        W = rng.standard_normal((6, 7))
        args = {"keys": keys, "W": W}
        if fn == "project_keys_backward":
            args["grad_proj"] = rng.standard_normal(lead + (T, 6))
        return {n: args[n].astype(dtype) for n in params_of(fn)}
    score = {"additive": "additive", "dot": "dot_scale", "cosine": "dot_scale",
             "general": "general", "location": "general"}[kind]
    p = FamilyProblem(rng, score, lead, 2, T, 4, 3, 2, 6, single=single,
                      mask="key" if single else "query")
    x = f64(p.cast(np.float64))
    if single:
        x["attn_mask"] = None
    else:
        x["attn_mask"] = x["mask"]
        x["mask"] = family_mask(rng, lead, None, T, "key")
        x["mask"].reshape(-1, T)[:, 0] = True     # attn_mask's live key
    if kind not in ("additive", "location"):
        x["bias"] = rng.standard_normal(
            lead + (() if single else (2,)) + (T,))
    if kind == "cosine":                # a sharpness per query position
        x["sharpness"] = 1 + rng.random(lead + (() if single else (2,)))
    if kind == "location":              # two more positions than T
        x["W"] = rng.standard_normal((T + 2, x["query"].shape[-1]))
        x["b"] = rng.standard_normal(T + 2)
    x.update(causal=False, dropout=0.0, seed=None, return_weights=True,
             out=None, lse=None)
    fwd = {n: x.get(n) for n in params_of(f"{kind}_attention")}
    _, x["alpha"] = getattr(ref, f"{kind}_attention")(**fwd)
    if key_proj and kind in ("additive", "general"):
        x["key_proj"] = ref.project_keys(x["keys"], x["W"])
    out = {}
    for n in params_of(fn):
        if n == "key_proj" and not key_proj:
            continue
        a = x.get(n)
        out[n] = a if a is None or n in NOT_FLOAT else a.astype(dtype)
    return out


def call(fn, kwargs):
    return getattr(ac, fn)(**kwargs)


FN_FLOAT_ARGS = [(fn, a) for fn in FUNCS for a in float_args(fn)]


def _pair_id(pair):
    return "-".join(pair)


def call_ref(fn, args, single):
    """The reference's fn on args (the same arguments as the C call's), as
    a tuple."""
    return as_tuple(getattr(ref, fn)(**args))


@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@dtype_param
@pytest.mark.parametrize("fn", FUNCS)
def test_native_dtype_preserved(fn, dtype, single, rng):
    """float32 in -> float32 out, float64 -> float64, values right."""
    args = make_args(fn, rng, dtype, single=single)
    got = as_tuple(call(fn, args))
    want = call_ref(fn, f64(args), single)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"output {i}"
            continue
        same = call_ref(fn, args, single)[i]
        tol = max(TOL[np.dtype(dtype).type], ILL_FACTOR * rel_err(same, w))
        check(g, w, dtype, f"{fn} output {i}", tol)


@pytest.mark.parametrize("odd", ["float64_among_float32",
                                 "float32_among_float64"])
@pytest.mark.parametrize("fn_arg", FN_FLOAT_ARGS, ids=_pair_id)
def test_mixed_precision_promotes_to_float64(fn_arg, odd, rng):
    """One argument in the other float dtype: computes in float64, bit for
    bit the all-float64 call."""
    fn, arg = fn_arg
    base, other = ((np.float32, np.float64) if odd.startswith("float64")
                   else (np.float64, np.float32))
    args = make_args(fn, rng, base)
    args[arg] = args[arg].astype(other)
    want = call(fn, {n: a if n in NOT_FLOAT or a is None else
                     a.astype(np.float64) for n, a in args.items()})
    got = call(fn, args)
    assert all(g is None or g.dtype == np.float64 for g in as_tuple(got))
    assert_all_identical(got, want, f"{fn} with {arg} {odd}")


@pytest.mark.parametrize("itype", [np.int64, np.int32, np.uint8],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", FUNCS)
def test_integer_inputs_compute_in_float64(fn, itype, rng):
    """Integer arrays compute in float64: the float64 call, bit for bit."""
    args = make_args(fn, rng)
    ints = {n: (a if n in NOT_FLOAT or a is None else
                rng.integers(0, 3, size=a.shape).astype(itype))
            for n, a in args.items()}
    if "alpha" in ints:
        ints["alpha"] = args["alpha"]         # weights must be a softmax
    want = call(fn, {n: a if n in NOT_FLOAT or a is None else
                     a.astype(np.float64) for n, a in ints.items()})
    got = call(fn, ints)
    assert all(g is None or g.dtype == np.float64 for g in as_tuple(got))
    assert_all_identical(got, want, f"{fn} with {np.dtype(itype).name}")


@pytest.mark.parametrize("dtype", HALF_DTYPES,
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", FUNCS)
def test_half_computes_in_float32(fn, dtype, rng):
    """float16 and bfloat16 inputs compute in float32 and come back in
    their dtype: the float32 call's results rounded once."""
    args = make_args(fn, rng, dtype)
    want = call(fn, {n: a if n in NOT_FLOAT or a is None else
                     a.astype(np.float32) for n, a in args.items()})
    assert_rounded(call(fn, args), want, dtype, f"{fn} {np.dtype(dtype)}")


@pytest.mark.parametrize("dtype", HALF_DTYPES,
                         ids=lambda d: np.dtype(d).name)
def test_half_weights_of_valid_items_never_zero(dtype):
    """A valid item's weight is positive in 16 bits too: float32's floor
    (its smallest normal) rounds to 0 in float16, so a float16 weight is
    at least float16's smallest subnormal; zeros stay the masked items,
    and the backwards given the weights take them."""
    x = np.array([[65504, -65504, 0, 65504]], dtype)
    alpha = ac.masked_softmax(x, mask=np.array([[1, 1, 1, 0]], bool))
    assert alpha.dtype == dtype
    assert (alpha[0, :3] > 0).all() and alpha[0, 3] == 0, alpha
    if np.dtype(dtype) == np.float16:
        assert alpha[0, 1] == np.float16(2.0**-24)
    h = np.array([[[4., 0.], [-4., 0.], [0., 0.], [1., 0.]]], dtype)
    W = np.array([[1., 0, 0, 0], [0, 0, 0, 0]], dtype)
    v = np.array([20., 0.], dtype)
    out, alpha = ac.context_attention(h, W, v)
    assert (alpha > 0).all(), alpha
    grads = ac.context_attention_backward(np.ones_like(out), h, W, v, alpha)
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads
               if g is not None)


@pytest.mark.parametrize("fn", ["dot_attention", "general_attention"])
def test_half_lse_stays_float32(fn, rng):
    """The log-sum-exp of a 16-bit call is float32, the out 16-bit."""
    args = make_args(fn, rng, np.float16)
    args["return_weights"] = False
    want = call(fn, {n: a if n in NOT_FLOAT or a is None else
                     a.astype(np.float32) for n, a in args.items()})
    got = call(fn, args)
    assert got[0].dtype == np.float16 and got[1].dtype == np.float32
    assert_rounded(got, want, np.float16, fn, lse=1)


def test_mixed_half_dtypes_compute_in_float32(rng):
    """float16 with bfloat16 (which NumPy cannot promote) computes and
    returns float32, as PyTorch promotes them; with float64, float64."""
    if len(HALF_DTYPES) < 2:
        pytest.skip("ml_dtypes is not installed")
    args = make_args("dot_attention", rng, np.float16)
    args["keys"] = args["keys"].astype(HALF_DTYPES[1])
    want = call("dot_attention", {
        n: a if n in NOT_FLOAT or a is None else a.astype(np.float32)
        for n, a in args.items()})
    assert_all_identical(call("dot_attention", args), want, "mixed")
    args["values"] = args["values"].astype(np.float64)
    assert all(g.dtype == np.float64
               for g in call("dot_attention", args))


@pytest.mark.parametrize("kind", ["complex", "bool", "object"])
@pytest.mark.parametrize("fn_arg", FN_FLOAT_ARGS, ids=_pair_id)
def test_unsupported_dtype_raises_type_error(fn_arg, kind, rng):
    """Complex, bool or object data: TypeError naming the argument."""
    fn, arg = fn_arg
    args = make_args(fn, rng)
    x = args[arg]
    args[arg] = {"complex": x.astype(np.complex128), "bool": x > 0,
                 "object": x.astype(object)}[kind]
    with pytest.raises(TypeError, match=rf"^{arg} has dtype "
                       rf"{re.escape(str(args[arg].dtype))}"):
        call(fn, args)


@pytest.mark.parametrize("name", ["float8_e5m2", "float8_e4m3fn", "int4",
                                  "longdouble"])
def test_other_small_or_wide_dtypes_refused_alike(name, rng):
    """ml_dtypes' 8-bit floats (float8_e5m2 says NumPy kind 'f', the
    others 'V'), its int4 and long double: refused alike, the accepted
    dtypes named."""
    if name == "longdouble":
        if np.dtype(np.longdouble).itemsize <= 8:
            pytest.skip("long double is double here")
        dtype = np.dtype(np.longdouble)
    else:
        dtype = np.dtype(getattr(pytest.importorskip("ml_dtypes"), name))
    x = rng.standard_normal((2, 3, 4)).astype(dtype)
    with pytest.raises(TypeError, match=rf"^query has dtype {dtype}.*"
                       rf"accepts float16, bfloat16 \(ml_dtypes\), "
                       rf"float32, float64 or integer input"):
        ac.dot_attention(x, x)


@pytest.mark.parametrize("mdtype", [np.int64, np.uint8, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@pytest.mark.parametrize("fn", [f for f in FUNCS if "mask" in params_of(f)])
def test_non_boolean_mask_raises_type_error(fn, single, mdtype, rng):
    """A mask of int or float dtype: TypeError naming mask."""
    args = make_args(fn, rng, single=single)
    args["mask"] = args["mask"].astype(mdtype)
    with pytest.raises(TypeError, match=rf"^mask must be a boolean array.*"
                       rf"{np.dtype(mdtype).name}"):
        call(fn, args)


def shape_error(names, own, others):
    """Regex: the message starts with one of names and shows the shape own
    and at least one of the shapes others."""
    names = names if isinstance(names, (list, tuple)) else [names]
    alts = "|".join(re.escape(str(tuple(s))) for s in others)
    return (rf"(?s)^(?:{'|'.join(names)})\b"
            rf"(?=.*{re.escape(str(tuple(own)))})(?=.*(?:{alts}))")


def _grow(x, axis=-1, by=1):
    pad = list(x.shape)
    pad[axis] = by
    return np.concatenate([x, np.zeros(pad, x.dtype)], axis=axis)


def bad_cases():
    """(id, fns, make(args) -> (bad args, regex)): each a shape error."""
    cases = []

    def add(cid, fns, make):
        cases.extend((f"{fn}-{cid}", fn, make) for fn in fns)

    fwd_bwd = {k: [f"{k}_attention", f"{k}_attention_backward"]
               for k in ("additive", "dot", "general")}
    every = sum(fwd_bwd.values(), [])
    wfns = fwd_bwd["additive"] + fwd_bwd["general"]

    def query_width(a):
        a["query"] = _grow(a["query"])
        return a, shape_error(["query", "W"], a["query"].shape,
                              [a["keys"].shape] + ([a["W"].shape]
                                                   if "W" in a else []))
    add("query_width", every, query_width)

    def w_width(a):
        a["W"] = _grow(a["W"])
        return a, shape_error("W", a["W"].shape,
                              [a["keys"].shape, a["query"].shape])
    add("W_columns", wfns, w_width)

    def w_rows_general(a):
        # W (Hq + 1, H): blamed on W or on the query it does not fit
        a["W"] = _grow(a["W"], axis=0)
        return a, shape_error(["W", "query"], a["W"].shape,
                              [a["query"].shape])
    add("W_rows", fwd_bwd["general"], w_rows_general)

    def w_rows_additive(a):
        # W (A + 1, H + Hq): blamed on W or on v, which has A items
        a["W"] = _grow(a["W"], axis=0)
        return a, shape_error(["W", "v"], a["W"].shape, [a["v"].shape])
    add("W_rows", fwd_bwd["additive"], w_rows_additive)

    def w_ndim(a):
        a["W"] = a["W"][0]
        return a, shape_error("W", a["W"].shape,
                              [a["keys"].shape, a["query"].shape])
    add("W_1d", wfns, w_ndim)

    def values_T(a):
        a["values"] = _grow(a["values"], axis=-2)
        return a, shape_error("values", a["values"].shape, [a["keys"].shape])
    add("values_T", every, values_T)

    def values_lead(a):
        a["values"] = a["values"][:-1]
        return a, shape_error("values", a["values"].shape, [a["keys"].shape])
    add("values_lead", every, values_lead)

    def target(a, per_query=True):
        """The (..., [Tq,] T) shape a mask or bias broadcasts to."""
        return a["query"].shape[:-1] + a["keys"].shape[-2:-1] \
            if per_query else a["keys"].shape[:-1]

    def mask_T(a):
        a["mask"] = _grow(a["mask"])
        return a, shape_error("mask", a["mask"].shape,
                              [a["keys"].shape, a["query"].shape,
                               target(a, False)])
    add("mask_T", every, mask_T)

    def mask_lead(a):
        a["mask"] = _grow(a["mask"], axis=-2)
        return a, shape_error("mask", a["mask"].shape,
                              [a["keys"].shape, a["query"].shape,
                               target(a, False)])
    add("mask_lead", every, mask_lead)

    def per_query_mask(a):
        # a per-query mask given as mask=: refused, pointing to attn_mask
        a["mask"], a["attn_mask"] = a["attn_mask"], None
        return a, (rf"^mask has shape {re.escape(str(a['mask'].shape))}: "
                   r"mask is the key mask \(\.\.\., T\).*use attn_mask=")
    add("per_query_mask", every, per_query_mask)

    def attn_mask_T(a):
        a["attn_mask"] = _grow(a["attn_mask"])
        return a, shape_error("attn_mask", a["attn_mask"].shape,
                              [target(a)])
    add("attn_mask_T", every, attn_mask_T)

    def attn_mask_Tq(a):
        a["attn_mask"] = _grow(a["attn_mask"], axis=-2)
        return a, shape_error("attn_mask", a["attn_mask"].shape,
                              [target(a)])
    add("attn_mask_Tq", every, attn_mask_Tq)

    def attn_mask_lead(a):
        # an axis more than query and keys have: never added
        a["attn_mask"] = a["attn_mask"][None]
        return a, shape_error("attn_mask", a["attn_mask"].shape,
                              [target(a)])
    add("attn_mask_lead", every, attn_mask_lead)

    def bias_T(a):
        a["bias"] = _grow(a["bias"])
        return a, shape_error("bias", a["bias"].shape, [target(a)])
    add("bias_T", fwd_bwd["dot"] + fwd_bwd["general"], bias_T)

    def bias_Tq(a):
        a["bias"] = _grow(a["bias"], axis=-2)
        return a, shape_error("bias", a["bias"].shape, [target(a)])
    add("bias_Tq", fwd_bwd["dot"] + fwd_bwd["general"], bias_Tq)

    def v_size(a):
        a["v"] = _grow(a["v"])
        return a, shape_error("v", a["v"].shape, [a["W"].shape])
    add("v_size", fwd_bwd["additive"], v_size)

    def b_size(a):
        a["b"] = _grow(a["b"])
        return a, shape_error("b", a["b"].shape, [a["W"].shape])
    add("b_size", fwd_bwd["additive"], b_size)

    def grad_out(a):
        a["grad_out"] = _grow(a["grad_out"])
        return a, shape_error("grad_out", a["grad_out"].shape,
                              [a["query"].shape, a["values"].shape,
                               a["keys"].shape])
    add("grad_out", [f for f in every if f.endswith("backward")], grad_out)

    def alpha(a):
        a["alpha"] = _grow(a["alpha"])
        return a, shape_error("alpha", a["alpha"].shape,
                              [a["keys"].shape, a["query"].shape])
    add("alpha", [f for f in every if f.endswith("backward")], alpha)

    def grad_alpha(a):
        a["grad_alpha"] = _grow(a["grad_alpha"])
        return a, shape_error("grad_alpha", a["grad_alpha"].shape,
                              [a["keys"].shape, a["query"].shape,
                               a["alpha"].shape])
    add("grad_alpha", [f for f in every if f.endswith("backward")],
        grad_alpha)

    def keys_1d(a):
        a["keys"] = a["keys"][0, 0]
        return a, shape_error(["keys", "query"], a["keys"].shape,
                              [a["keys"].shape])
    add("keys_1d", every, keys_1d)

    def query_ndim(a):
        a["query"] = a["query"][None, None]
        return a, shape_error("query", a["query"].shape, [a["keys"].shape])
    add("query_ndim", every, query_ndim)

    def key_proj(a):
        a["key_proj"] = _grow(a["key_proj"])
        return a, shape_error("key_proj", a["key_proj"].shape,
                              [a["keys"].shape, a["W"].shape])
    add("key_proj", wfns, key_proj)

    def pk_w(a):
        a["W"] = a["W"][:, :3]
        return a, shape_error("W", a["W"].shape, [a["keys"].shape])
    add("W_too_narrow", ["project_keys", "project_keys_backward"], pk_w)

    def pk_grad(a):
        a["grad_proj"] = _grow(a["grad_proj"])
        return a, shape_error("grad_proj", a["grad_proj"].shape,
                              [a["keys"].shape, a["W"].shape])
    add("grad_proj", ["project_keys_backward"], pk_grad)
    return cases


BAD_CASES = [pytest.param(*c, id=c[0]) for c in bad_cases()]


@pytest.mark.parametrize("cid,fn,make", BAD_CASES)
def test_bad_shape_raises_value_error(cid, fn, make, rng):
    """Each shape that does not fit: ValueError naming the argument and
    both shapes; the next good call gives the same bits as before."""
    kp = cid.endswith("-key_proj")            # else no key_proj to blame
    args = make_args(fn, rng, key_proj=kp)
    args32 = make_args(fn, rng, np.float32, key_proj=kp)
    first, first32 = call(fn, args), call(fn, args32)
    bad, pattern = make({n: a for n, a in args.items()})
    with pytest.raises(ValueError, match=pattern):
        call(fn, bad)
    assert_all_identical(call(fn, args), first, f"{fn} after the bad call")
    assert_all_identical(call(fn, args32), first32, f"{fn} float32 after")


@pytest.mark.parametrize("fn", [f for f in FUNCS if "mask" in params_of(f)])
def test_per_query_mask_with_one_query_raises(fn, rng):
    """A (..., Tq, T) mask given with a single query (..., Hq): ValueError
    naming mask with its shape and the keys' (..., T); attn_mask or
    causal with a single query: ValueError (they need several)."""
    args = make_args(fn, rng, single=True)
    good = call(fn, args)
    keys = args["keys" if "keys" in args else "values"]   # location: values
    bad = dict(args, mask=np.ones(keys.shape[:-2] + (2, 5), bool))
    with pytest.raises(ValueError, match=shape_error(
            "mask", bad["mask"].shape,
            [args["query"].shape, keys.shape, keys.shape[:-1]])):
        call(fn, bad)
    for kw in ({"attn_mask": np.ones(keys.shape[:-1], bool)},
               {"attn_mask": np.ones(keys.shape[:-2] + (2, 5), bool)},
               {"causal": True}):
        name = list(kw)[0]
        if name not in params_of(fn):
            continue
        with pytest.raises(ValueError, match=rf"^{fn}: {name} needs several "
                           r"queries .*through mask="):
            call(fn, dict(args, **kw))
    assert_all_identical(call(fn, args), good, fn)


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)], ids=lead_id)
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@pytest.mark.parametrize("fn", FUNCS)
def test_zero_keys_raise_value_error(fn, single, lead, rng):
    """T = 0: ValueError naming keys (or values, mask) and its shape."""
    if single and fn_kind(fn) == "project":
        pytest.skip("no query")
    args = make_args(fn, rng, lead=lead, single=single)
    good = call(fn, args)
    bad = {}
    for n, a in args.items():
        if n in ("keys", "values", "grad_proj"):
            a = a[..., :0, :]
        elif n in ("mask", "attn_mask", "bias", "alpha", "grad_alpha"):
            a = None if a is None else a[..., :0]
        bad[n] = a
    with pytest.raises(ValueError, match=r"(?s)^(?:keys|values|mask|"
                       r"attn_mask|bias|alpha|grad_proj)\b.*T = 0"):
        call(fn, bad)
    assert_all_identical(call(fn, args), good, fn)


@pytest.mark.parametrize("fn", FUNCS)
def test_zero_queries_give_empty_results_and_zero_gradients(fn, rng):
    """Tq = 0 (several queries, none): no kernel runs; every output has
    its shape with the query axis empty, and the gradients of everything
    else are exactly 0 (nothing depends on them)."""
    if fn_kind(fn) == "project":
        pytest.skip("no query")
    args = make_args(fn, rng, lead=(2,), single=False)
    empty = {}
    for n, a in args.items():
        if n in ("query", "grad_out", "alpha", "grad_alpha", "out", "lse",
                 "attn_mask", "bias", "sharpness") and a is not None and (
                    np.ndim(a) >= 2 or n == "lse"):
            a = a[:, :0]
        empty[n] = a
    res = call(fn, empty)
    res = res if isinstance(res, tuple) else (res,)
    for x in res:
        if x is None:
            continue
        assert np.isfinite(x).all()
        if x.ndim >= 2 and x.shape[1] == 0:
            continue                        # the queries' results: empty
        assert not np.any(x), f"{fn}: a gradient is not 0"


def _strided(x):
    big = np.zeros(x.shape[:-1] + (2 * x.shape[-1] + 1,), x.dtype)
    big[..., 1::2] = x
    y = big[..., 1::2]
    assert x.shape[-1] == 1 or not y.flags.c_contiguous
    return y


def _readonly(x):
    y = x.copy()
    y.flags.writeable = False
    return y


VARIANTS = ["float64", "float32", "mixed", "strided", "readonly",
            "fortran"]


@pytest.mark.parametrize("kind", VARIANTS)
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@pytest.mark.parametrize("fn", FUNCS)
def test_inputs_never_modified(fn, single, kind, rng):
    """No argument changes (NaN in padding too), none changes its flags,
    no output aliases an input; the results equal those of plain copies."""
    if single and fn_kind(fn) == "project":
        pytest.skip("no query")
    args = make_args(fn, rng, np.float32 if kind == "float32" else
                     np.float64, single=single, key_proj=True)
    if "mask" in args:                       # NaN where no query looks
        dead = ~args["mask"]
        if args.get("attn_mask") is not None:
            dead |= ~args["attn_mask"].any(axis=-2)
        for n in ("keys", "values", "key_proj"):
            if n in args and args[n] is not None:
                args[n][dead] = np.nan
    plain = {n: (a.copy() if isinstance(a, np.ndarray) else a)
             for n, a in args.items()}
    if kind == "mixed":
        first = float_args(fn)[0]
        args[first] = args[first].astype(np.float32)
        plain[first] = args[first].copy()
    elif kind in ("strided", "readonly", "fortran"):
        tf = {"strided": _strided, "readonly": _readonly,
              "fortran": np.asfortranarray}[kind]
        args = {n: tf(a) if isinstance(a, np.ndarray) else a
                for n, a in args.items()}
    before = {n: (a.copy() if isinstance(a, np.ndarray) else a)
              for n, a in args.items()}
    flags = {n: (a.flags.writeable, a.flags.c_contiguous, a.strides)
             for n, a in args.items() if isinstance(a, np.ndarray)}
    result = as_tuple(call(fn, args))
    for n, a in args.items():
        if not isinstance(a, np.ndarray):
            continue
        assert a.dtype == before[n].dtype, n
        assert np.array_equal(a, before[n], equal_nan=True), f"{n} changed"
        assert (a.flags.writeable, a.flags.c_contiguous,
                a.strides) == flags[n], n
        for i, out in enumerate(result):
            if out is not None:
                assert not np.shares_memory(out, a), f"output {i} aliases {n}"
    for i, out in enumerate(result):
        if out is not None:
            assert np.all(np.isfinite(out)), f"output {i}: NaN padding leaked"
    assert_all_identical(result, call(fn, plain), f"{fn} {kind}")


@pytest.mark.parametrize("fn", FUNCS)
def test_keywords_match_positional(fn, rng):
    """docs/contract.md's keyword names, in any order, give the positional
    call's bits; leaving the optional arguments out equals passing None
    (values kept: grad_out has the values' width; a backward's mask kept:
    its alpha is the forward's for that mask, which the backward checks)."""
    args = make_args(fn, rng, key_proj=True)
    req, opt = SIGNATURES[fn]
    positional = getattr(ac, fn)(*[args[n] for n in req],
                                 **{n: args.get(n) for n in opt})
    shuffled = dict(reversed(list(args.items())))
    assert_all_identical(call(fn, shuffled), positional, fn)
    keep = ({"values", "mask", "attn_mask", "bias"} if "alpha" in args
            else {"values"})
    short = {n: a for n, a in args.items() if n in req or n in keep}
    # (return_weights=None is falsy: it returns (out, lse), not the
    # default (out, alpha); so True there)
    left_out = {n: True if n == "return_weights" else None
                for n in opt if n not in keep}
    assert_all_identical(call(fn, short), call(fn, dict(short, **left_out)),
                         fn)


@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=lead_id)
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@dtype_param
@score_param
def test_empty_batch(score, dtype, single, lead, rng):
    """An empty batch: empty outputs of the right shapes and dtype,
    parameter gradients exactly zero."""
    p = FamilyProblem(rng, score, lead, 3, 4, 3, 2, 2, 5, single=single,
                      mask="key")
    x = p.cast(dtype)
    out, alpha, g = run_pair(p, x, True)
    assert out.shape == x["grad_out"].shape and out.dtype == dtype
    assert alpha.shape == x["grad_alpha"].shape and alpha.dtype == dtype
    for n, a in g.items():
        if x[n] is None:
            assert a is None, n
            continue
        assert a.shape == x[n].shape and a.dtype == dtype, n
        if n in ("W", "v", "b"):
            assert np.all(a == 0), n


@pytest.mark.parametrize("fn,n", [("additive_attention", 2),
                                  ("dot_attention", 2),
                                  ("general_attention", 2),
                                  ("project_keys_backward", 2)])
def test_pair_results(fn, n, rng):
    """The forwards and project_keys_backward return a plain 2-tuple."""
    res = getattr(ac, fn)(**make_args(fn, rng))
    assert type(res) is tuple and len(res) == n
    assert all(type(a) is np.ndarray for a in res)
