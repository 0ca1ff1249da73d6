"""Calls of the public API (docs/contract.md section 3) beyond their
inputs' layouts and dtypes: sizes whose product overflows memory, a bad
call that leaves no state behind, argument passing (positions, keywords,
the binding's METH_FASTCALL functions), ndarray subclasses, and the
family's arguments of docs/contract.md section 5.  The arguments and
checks of inputs_cases.py, as test_inputs.py.
"""

import re

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core, _core_tests, reference
from attention_c.testing import SIGNATURES, assert_close

from inputs_cases import (ALPHA_CHECKED, ArrayBomb, BombError, EXTRA_PARAMS,
                          FN_REQUIRED, FUNCS, REF, T_ONLY, as_tuple,
                          assert_identical, call, grow_last, make_args,
                          pair_id, params, ref_outputs)


# --------------------------------------------------------------------------
# 5. Sizes whose product overflows memory: MemoryError, then all is well.

HUGE = dict(lead=(4,), T=2 ** 57, H=2, A=3)   # h: 2**60 float32 = 4 EiB


def _huge_args(fn):
    """Zero-stride arrays of a size no machine can copy (4 EiB for h)."""
    lead, T, H, A = HUGE["lead"], HUGE["T"], HUGE["H"], HUGE["A"]
    shapes = {"h": lead + (T, H), "W": (A, 2 * H), "v": (A,), "b": (A,),
              "context": lead + (H,), "grad_c": lead + (H,),
              "grad_out": lead + (H,), "mask": lead + (T,)}
    for n in ("scores", "alpha", "grad_s", "grad_alpha"):
        shapes[n] = lead + (T,)
    out = {}
    for n in params(fn):
        seed = np.ones(1, bool) if n == "mask" else np.full(1, 0.5,
                                                            np.float32)
        out[n] = np.lib.stride_tricks.as_strided(
            seed, shape=shapes[n], strides=(0,) * len(shapes[n]))
    return out


def _assert_still_correct(fn, rng):
    args = make_args(fn, rng)
    got = as_tuple(call(fn, args))
    for i, (g, r) in enumerate(zip(got, ref_outputs(fn, args))):
        if r is not None:
            assert_close(g, r, np.float64, f"{fn} output {i} after overflow")


@pytest.mark.parametrize("fn", FUNCS)
def test_overflowing_sizes_raise_memory_error(fn, rng):
    """Exabyte-sized (zero-stride) inputs: MemoryError, next call correct."""
    args = _huge_args(fn)
    assert args[REF[fn]].nbytes >= 2 ** 61
    with pytest.raises((MemoryError, ValueError)):
        call(fn, args)
    _assert_still_correct(fn, rng)


def test_overflow_example_from_brief(rng):
    """h of shape (2**29, 2**30, 2) float32 with matching W, v: no crash."""
    h = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32),
                                        shape=(2 ** 29, 2 ** 30, 2),
                                        strides=(0, 0, 0))
    W, v = np.zeros((3, 4), np.float32), np.zeros(3, np.float32)
    for fn, args in [("context_attention", (h, W, v)),
                     ("mean_context", (h,))]:
        with pytest.raises((MemoryError, ValueError)):
            getattr(ac, fn)(*args)
        _assert_still_correct(fn, rng)


@pytest.mark.parametrize("fn", ["context_attention", "additive_score"])
def test_output_too_large_raises_memory_error(fn, rng):
    """Empty h (2**30, 2**30, 0): the (B, T) output cannot be allocated."""
    B = T = 2 ** 30
    args = {"h": np.zeros((B, T, 0), np.float32),
            "W": np.zeros((3, 0), np.float32), "v": np.zeros(3, np.float32)}
    if fn == "additive_score":
        args["context"] = np.zeros((B, 0), np.float32)
    with pytest.raises((MemoryError, ValueError)):
        call(fn, args)
    _assert_still_correct(fn, rng)


# --------------------------------------------------------------------------
# 6. A bad call leaves no state behind.

def _make_bad(kind, fn, args):
    bad = dict(args)
    ref = REF[fn]
    if kind == "wrong_shape":
        other = [a for a in params(fn) if a != ref][0]
        bad[other] = grow_last(args[other])
    elif kind == "wrong_dtype":
        bad[ref] = args[ref].astype(np.complex128)
    elif kind == "zero_items":
        x = args[ref]
        bad[ref] = x[..., :0] if ref in T_ONLY else x[..., :0, :]
    elif kind == "conversion_error":
        bad[ref] = ArrayBomb()
    elif kind == "huge":
        bad = _huge_args(fn)
    return bad


BAD_KINDS = ["wrong_shape", "wrong_dtype", "zero_items", "conversion_error",
             "huge"]


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("fn", FUNCS)
def test_bad_call_leaves_no_state(fn, kind, rng):
    """Good call, bad call, same good call: identical results."""
    args = make_args(fn, rng)
    args32 = make_args(fn, rng, dtype=np.float32)
    first, first32 = call(fn, args), call(fn, args32)
    with pytest.raises((ValueError, TypeError, MemoryError, BombError)):
        call(fn, _make_bad(kind, fn, args))
    assert_identical(call(fn, args), first, f"{fn} after {kind}")
    assert_identical(call(fn, args32), first32, f"{fn} float32 after {kind}")


# --------------------------------------------------------------------------
# 7. Argument passing.

@pytest.mark.parametrize("fn", FUNCS)
def test_keywords_match_positional(fn, rng):
    """docs/contract.md's keyword names work, in any order, like the call
    that gives the required arguments by position (the optional ones are
    keyword-only)."""
    args = make_args(fn, rng)
    req, opt = SIGNATURES[fn]
    positional = getattr(ac, fn)(*[args[n] for n in req],
                                 **{n: args[n] for n in opt})
    shuffled = dict(reversed(list(args.items())))
    assert_identical(call(fn, shuffled), positional, fn)
    core = getattr(ac._core, fn)(**shuffled)
    assert_identical(core, positional, f"_core.{fn}")


@pytest.mark.parametrize("fn", FUNCS)
def test_optional_arguments_default_to_none(fn, rng):
    """Leaving optional arguments out equals passing None for them."""
    args = make_args(fn, rng)
    req, opt = SIGNATURES[fn]
    short = {n: args[n] for n in req}
    if fn in ALPHA_CHECKED:                 # alpha of a forward with no mask
        short["alpha"] = reference.masked_softmax(args["alpha"] + 1)
    explicit = dict(short, **{n: None for n in opt})
    assert_identical(call(fn, short), call(fn, explicit), fn)


# The public functions are the binding's C functions (METH_FASTCALL, its
# own argument parser), published with their docstrings; _core has the
# same functions returning plain tuples, and _core_tests (the tests'
# extension) a third copy.  Each says what a Python function would.
TARGETS = [ac, _core, _core_tests]


@pytest.mark.parametrize("fn", FUNCS)
def test_unknown_keyword_raises_type_error(fn, rng):
    """An unknown keyword raises TypeError naming it, whatever else is
    given."""
    args = make_args(fn, rng)
    required = {n: args[n] for n in SIGNATURES[fn][0]}
    for target in TARGETS:
        for given in (required, args):
            with pytest.raises(TypeError, match=rf"^{fn}\(\) got an "
                               "unexpected keyword argument 'bogus'$"):
                getattr(target, fn)(**given, bogus=1)


@pytest.mark.parametrize("fn_arg", FN_REQUIRED, ids=pair_id)
def test_missing_required_argument_raises_type_error(fn_arg, rng):
    """Leaving out a required argument raises TypeError naming it."""
    fn, arg = fn_arg
    args = make_args(fn, rng)
    del args[arg]
    for target in TARGETS:
        with pytest.raises(TypeError, match=rf"^{fn}\(\) missing 1 "
                           f"required positional argument: '{arg}'$"):
            getattr(target, fn)(**args)


@pytest.mark.parametrize("fn", FUNCS)
def test_too_many_or_duplicate_arguments_raise_type_error(fn, rng):
    """An extra positional argument or one given twice raises TypeError;
    the message names the keyword-only arguments."""
    args = make_args(fn, rng)
    req, opt = SIGNATURES[fn]
    pos = [args[n] for n in req]
    kw_only = opt + EXTRA_PARAMS.get(fn, [])
    first = params(fn)[0]
    tail = "$"
    if kw_only:
        tail = (rf"; {', '.join(kw_only)} (is|are) keyword-only \(pass "
                rf"(it|them) by name, e\.g\. {kw_only[0]}=\.\.\.\)$")
    for target in TARGETS:
        with pytest.raises(TypeError, match=rf"^{fn}\(\) takes {len(req)} "
                           rf"positional arguments? but {len(req) + 1} "
                           "were given" + tail):
            getattr(target, fn)(*pos, None)
        with pytest.raises(TypeError, match=rf"^{fn}\(\) got multiple "
                           f"values for argument '{first}'$"):
            getattr(target, fn)(pos[0], **args)


@pytest.mark.parametrize("fn", [f for f in FUNCS
                                if "mask" in SIGNATURES[f][1]])
def test_positional_mask_asks_for_mask_keyword(fn, rng):
    """A boolean mask passed by position, where an optional float argument
    (b) used to be read from it, is refused with 'did you mean mask=...?';
    passed by name as b, its dtype error asks the same."""
    args = make_args(fn, rng)
    req, opt = SIGNATURES[fn]
    pos = [args[n] for n in req] + [args["mask"]]
    for target in TARGETS:
        with pytest.raises(TypeError, match=rf"keyword-only .*Argument "
                           rf"{len(pos)} is a boolean array: did you mean "
                           r"mask=\.\.\.\?$"):
            getattr(target, fn)(*pos)
    if "b" in opt:
        with pytest.raises(TypeError, match=r"^b has dtype bool.*did you "
                           r"mean mask=\.\.\.\?\)$"):
            getattr(ac, fn)(*pos[:-1], b=args["mask"])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_context_attention_backward_named_tuple(bias, rng):
    """The layer backward returns AttentionGrads (h, W, v, b); b None iff."""
    args = make_args("context_attention_backward", rng)
    if not bias:
        args["b"] = None
    g = ac.context_attention_backward(**args)
    assert isinstance(g, ac.AttentionGrads) and isinstance(g, tuple)
    assert g._fields == ("h", "W", "v", "b")
    assert g.h is g[0] and g.W is g[1] and g.v is g[2] and g.b is g[3]
    assert g.h.shape == args["h"].shape
    assert g.W.shape == args["W"].shape and g.v.shape == args["v"].shape
    if bias:
        assert g.b.shape == args["b"].shape
    else:
        assert g.b is None


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_additive_score_backward_five_items(bias, rng):
    """additive_score_backward: (dh, dcontext, dW, dv, db); db None iff."""
    args = make_args("additive_score_backward", rng)
    if not bias:
        args["b"] = None
    res = ac.additive_score_backward(**args)
    assert isinstance(res, tuple) and len(res) == 5
    dh, dctx, dW, dv, db = res
    assert dh.shape == args["h"].shape
    assert dctx.shape == args["context"].shape
    assert dW.shape == args["W"].shape and dv.shape == args["v"].shape
    assert (db is None) == (not bias)
    if bias:
        assert db.shape == args["b"].shape


@pytest.mark.parametrize("fn,n", [("context_attention", 2),
                                  ("weighted_sum_backward", 2)])
def test_pair_results(fn, n, rng):
    """Functions returning two arrays return a plain 2-tuple of arrays."""
    res = call(fn, make_args(fn, rng))
    assert type(res) is tuple and len(res) == n
    assert all(type(x) is np.ndarray for x in res)


# --------------------------------------------------------------------------
# 8. ndarray subclasses.

class MyArray(np.ndarray):
    """A trivial ndarray subclass."""


MATRIX_CASES = [(fn, lead) for fn in FUNCS for lead in ((), (3,))
                if not (lead == () and REF[fn] in T_ONLY)]


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
@pytest.mark.parametrize("fn,lead", MATRIX_CASES,
                         ids=[f"{f}-lead{len(lead)}" for f, lead in
                              MATRIX_CASES])
def test_matrix_inputs_give_plain_arrays(fn, lead, rng):
    """np.matrix for every 2-D argument: plain ndarrays, same values."""
    args = make_args(fn, rng, lead=lead)
    mats = {n: np.asmatrix(x) if x is not None and x.ndim == 2 else x
            for n, x in args.items()}
    assert any(isinstance(x, np.matrix) for x in mats.values())
    assert_identical(call(fn, mats), call(fn, args), f"{fn} np.matrix")


@pytest.mark.parametrize("fn", FUNCS)
def test_ndarray_subclass_gives_plain_arrays(fn, rng):
    """A trivial ndarray subclass for every argument: plain ndarrays."""
    args = make_args(fn, rng)
    subs = {n: None if x is None else x.view(MyArray)
            for n, x in args.items()}
    assert_identical(call(fn, subs), call(fn, args), f"{fn} subclass")


# --------------------------------------------------------------------------
# 9. The family's arguments of docs/contract.md section 5 (attn_mask,
# causal, bias, dropout and seed, return_weights, out and lse): wrong ones
# are refused with a message that says what to do; the C and the reference
# agree.
SEC5_FWD = ["dot_attention", "general_attention"]
SEC5_BWD = ["dot_attention_backward", "general_attention_backward"]
MASKED_FWD = SEC5_FWD + ["additive_attention"]
MASKED_ALL = MASKED_FWD + SEC5_BWD + ["additive_attention_backward"]


def family_args(fn, rng, single=False, lse=False):
    """Keyword arguments of a family function on 2 sequences of 3 queries
    (or one, single) and 5 keys; lse: a dot/general backward from out= and
    lse= instead of alpha."""
    kind = fn.split("_")[0]
    H = 4
    qshape = (2, H) if single else (2, 3, H)
    x = dict(query=rng.standard_normal(qshape),
             keys=rng.standard_normal((2, 5, H)))
    if kind == "additive":
        x.update(W=rng.standard_normal((6, 2 * H)), v=rng.standard_normal(6))
    elif kind == "general":
        x.update(W=rng.standard_normal((H, H)))
    forward = getattr(ac, f"{kind}_attention")
    if not fn.endswith("_backward"):
        return x
    out, alpha = forward(**x)
    x["grad_out"] = np.ones_like(out)
    if lse:
        x["out"], x["lse"] = forward(**x_forward(x), return_weights=False)
    else:
        x["alpha"] = alpha
    return x


def x_forward(x):
    return {n: a for n, a in x.items()
            if n not in ("grad_out", "alpha", "out", "lse", "grad_alpha")}


@pytest.mark.parametrize("fn", MASKED_ALL)
def test_per_query_mask_as_mask_names_attn_mask(fn, rng):
    """mask is the key mask (..., T): a (..., Tq, T) one is refused, the
    message pointing to attn_mask= and causal=True; as attn_mask it
    works."""
    args = family_args(fn, rng)
    m = np.ones((2, 3, 5), bool)
    with pytest.raises(ValueError, match=r"^mask has shape \(2, 3, 5\): mask "
                       r"is the key mask \(\.\.\., T\), the same for every "
                       r"query; for a mask per query \(\.\.\., Tq, T\) use "
                       r"attn_mask= \(and causal=True for causal "
                       r"attention\)$"):
        call(fn, dict(args, mask=m))
    assert_identical(call(fn, dict(args, attn_mask=m)), call(fn, args), fn)


@pytest.mark.parametrize("mdtype", [np.float64, np.float32, np.int64,
                                    np.uint8])
@pytest.mark.parametrize("fn", MASKED_ALL)
def test_non_boolean_attn_mask_points_to_bias(fn, mdtype, rng):
    """A float (or int) attn_mask: TypeError saying to use bias= for a
    float mask and that nn.MultiheadAttention's boolean masks are the
    opposite of ours (scaled_dot_product_attention's the same)."""
    args = family_args(fn, rng)
    am = np.ones((2, 3, 5), mdtype)
    with pytest.raises(TypeError, match=(
            r"^attn_mask must be a boolean array \(True = query i may attend "
            rf"to key t\); got dtype {np.dtype(mdtype).name}\.  For a float "
            r"mask added to the scores use bias=\.  Note that "
            r"nn\.MultiheadAttention's \(PyTorch\) boolean masks mean True "
            r"= masked, the opposite of ours \(pass ~mask\), while "
            r"scaled_dot_product_attention's mean True = take part, as "
            r"ours$")):
        call(fn, dict(args, attn_mask=am))
    with pytest.raises(TypeError, match=r"for a float mask use bias=; .*"
                       r"nn\.MultiheadAttention's .*opposite of ours"):
        getattr(reference, fn)(**dict(args, attn_mask=am))


@pytest.mark.parametrize("kw", ["attn_mask", "attn_mask_keys", "causal"])
@pytest.mark.parametrize("fn", MASKED_ALL)
def test_attn_mask_and_causal_need_several_queries(fn, kw, rng):
    """With a single query (..., Hq), attn_mask (of either shape) and
    causal are refused (ValueError), pointing to mask=; the reference
    refuses them too."""
    args = family_args(fn, rng, single=True)
    value = {"attn_mask": np.ones((2, 1, 5), bool),
             "attn_mask_keys": np.ones((2, 5), bool), "causal": True}[kw]
    name = kw.removesuffix("_keys")
    with pytest.raises(ValueError, match=(
            rf"^{fn}: {name} needs several queries \(query \(\.\.\., Tq, "
            r"Hq\) with query\.ndim == keys\.ndim\); one query per "
            r"sequence attends to its keys through mask=$")):
        call(fn, dict(args, **{name: value}))
    with pytest.raises(ValueError, match="needs? several queries"):
        getattr(reference, fn)(**dict(args, **{name: value}))


@pytest.mark.parametrize("p", [1.0, 1.5, -0.1, np.nan, np.inf])
@pytest.mark.parametrize("fn", SEC5_FWD + SEC5_BWD)
def test_dropout_outside_0_1_raises(fn, p, rng):
    """dropout p must be in [0, 1): ValueError showing p (NaN too)."""
    args = family_args(fn, rng)
    with pytest.raises(ValueError, match=rf"^dropout must be in \[0, 1\), "
                       rf"got {re.escape(f'{p:g}')}$"):
        call(fn, dict(args, dropout=p, seed=1))
    with pytest.raises(TypeError, match=r"^dropout must be a real number, "
                       "got str$"):
        call(fn, dict(args, dropout="0.1", seed=1))


@pytest.mark.parametrize("fn", SEC5_FWD + SEC5_BWD)
def test_dropout_needs_a_seed(fn, rng):
    """dropout > 0 without seed: ValueError saying seed= is needed (the
    backward regenerates the keep pattern from it); a seed outside
    [0, 2**64) or not an int is refused; seed alone (p = 0) is fine."""
    args = family_args(fn, rng)
    with pytest.raises(ValueError, match=r"^dropout > 0 needs seed= \(an int "
                       r">= 0\): the keep pattern is a function of \(seed, "
                       r"sequence, query, key\), regenerated by the "
                       r"backward$"):
        call(fn, dict(args, dropout=0.5))
    with pytest.raises(ValueError, match="needs seed="):
        getattr(reference, fn)(**dict(args, dropout=0.5))
    for seed in (-1, 2 ** 64):
        with pytest.raises(ValueError, match=rf"^seed must be in \[0, "
                           rf"2\*\*64\), got {seed}$"):
            call(fn, dict(args, dropout=0.5, seed=seed))
    for seed, tname in ((1.5, "float"), (True, "bool"), ("1", "str")):
        with pytest.raises(TypeError, match=rf"^seed must be an int in "
                           rf"\[0, 2\*\*64\), got {tname}$"):
            call(fn, dict(args, dropout=0.5, seed=seed))
    # the largest seed works; a seed without dropout changes nothing
    call(fn, dict(args, dropout=0.5, seed=2 ** 64 - 1))
    assert_identical(call(fn, dict(args, seed=7)), call(fn, args), fn)


@pytest.mark.parametrize("fn", SEC5_FWD)
def test_numpy_integer_seed_accepted_like_the_reference(fn, rng):
    """seed=np.int64(5) (e.g. from rng.integers) gives the bits of
    seed=5, as in the reference."""
    args = family_args(fn, rng)
    want = call(fn, dict(args, dropout=0.5, seed=5))
    for seed in (np.int64(5), np.uint64(5)):
        getattr(reference, fn)(**dict(args, dropout=0.5, seed=seed))
        assert_identical(call(fn, dict(args, dropout=0.5, seed=seed)), want,
                         fn)


@pytest.mark.parametrize("fn", SEC5_BWD)
def test_backward_alpha_or_out_and_lse(fn, rng):
    """A dot/general backward takes alpha, or out= and lse= together:
    lse without out (or out without lse), alpha with lse or out,
    grad_alpha without alpha, and neither are refused with messages that
    say which; the reference refuses the same calls."""
    with_lse = family_args(fn, rng, lse=True)
    with_alpha = dict(family_args(fn, rng), out=with_lse["out"],
                      lse=with_lse["lse"])
    together = (rf"^{fn}: out= and lse= go together \(the forward's with "
                r"return_weights=False\)$")
    both = (rf"^{fn}: give alpha, or out= and lse= of a forward with "
            r"return_weights=False, not both$")
    cases = [
        ({k: a for k, a in with_lse.items() if k != "out"}, ValueError,
         together),
        ({k: a for k, a in with_lse.items() if k != "lse"}, ValueError,
         together),
        ({k: a for k, a in with_alpha.items() if k != "out"}, ValueError,
         both),
        ({k: a for k, a in with_alpha.items() if k != "lse"}, ValueError,
         both),
        (with_alpha, ValueError, both),
        (dict(with_lse, grad_alpha=np.ones((2, 3, 5))), ValueError,
         rf"^{fn}: grad_alpha needs alpha: a forward with "
         r"return_weights=False returns no weights to differentiate$"),
        ({k: a for k, a in with_lse.items() if k not in ("out", "lse")},
         TypeError, rf"^{fn}: missing alpha \(the forward's weights\), or "
         r"out= and lse= \(a forward with return_weights=False\)$"),
    ]
    for args, err, pattern in cases:
        with pytest.raises(err, match=pattern):
            call(fn, args)
        with pytest.raises((ValueError, TypeError)):
            getattr(reference, fn)(**args)
    # and the right calls agree: from alpha and from (out, lse)
    a = as_tuple(call(fn, family_args(fn, np.random.default_rng(1))))
    b = as_tuple(call(fn, family_args(fn, np.random.default_rng(1),
                                      lse=True)))
    for g, w in zip(a, b):
        assert (g is None and w is None) or np.allclose(g, w, rtol=1e-12,
                                                        atol=1e-14)


@pytest.mark.parametrize("fn", SEC5_BWD)
def test_out_and_lse_shapes_checked(fn, rng):
    """out (..., Tq, Hv) and lse (..., Tq): ValueError naming them and the
    shapes they must match; a boolean lse is a dtype error."""
    args = family_args(fn, rng, lse=True)
    with pytest.raises(ValueError, match=r"^lse has shape \(2, 2\); expected "
                       r"\(\.\.\., Tq\) = \(2, 3\)"):
        call(fn, dict(args, lse=args["lse"][..., :2]))
    with pytest.raises(ValueError, match=r"^out has shape \(2, 3, 2\); "
                       r"expected \(\.\.\., Tq, Hv\) = \(2, 3, 4\)"):
        call(fn, dict(args, out=args["out"][..., :2]))
    with pytest.raises(TypeError, match=r"^lse has dtype bool"):
        call(fn, dict(args, lse=args["lse"] > 0))


@pytest.mark.parametrize("fn", SEC5_FWD + SEC5_BWD)
def test_bias_dtype_and_shape_checked(fn, rng):
    """bias is float (..., Tq, T) or, for a single query, (..., T): a
    boolean bias is a dtype error that points to a mask, complex too; a
    shape that does not broadcast names both shapes."""
    args = family_args(fn, rng)
    with pytest.raises(TypeError, match=r"^bias has dtype bool.*a boolean "
                       r"array is a mask"):
        call(fn, dict(args, bias=np.ones((2, 3, 5), bool)))
    with pytest.raises(TypeError, match=r"^bias has dtype complex128"):
        call(fn, dict(args, bias=np.ones((2, 3, 5), complex)))
    with pytest.raises(ValueError, match=r"^bias has shape \(2, 3, 6\); "
                       r"expected a shape that broadcasts to \(\.\.\., Tq\?, "
                       r"T\) = \(2, 3, 5\)"):
        call(fn, dict(args, bias=np.ones((2, 3, 6))))
    single = family_args(fn, rng, single=True)
    with pytest.raises(ValueError, match=r"^bias has shape \(2, 3, 5\); "
                       r"expected a shape that broadcasts to \(\.\.\., Tq\?, "
                       r"T\) = \(2, 5\)"):
        call(fn, dict(single, bias=np.ones((2, 3, 5))))
    # a list is converted like an array
    bias = rng.standard_normal((3, 5))
    assert_identical(call(fn, dict(args, bias=bias.tolist())),
                     call(fn, dict(args, bias=bias)), fn)


@pytest.mark.parametrize("kw", [{"bias": np.zeros((2, 3, 5))},
                                {"dropout": 0.1, "seed": 1},
                                {"return_weights": False}],
                         ids=["bias", "dropout", "return_weights"])
@pytest.mark.parametrize("fn", ["additive_attention",
                                "additive_attention_backward"])
def test_additive_has_no_bias_dropout_or_lse(fn, kw, rng):
    """The additive score takes masks only (docs/contract.md 5.2): bias,
    dropout and return_weights are unknown keywords there."""
    args = family_args(fn, rng)
    name = list(kw)[0]
    with pytest.raises(TypeError, match=rf"^{fn}\(\) got an unexpected "
                       rf"keyword argument '{name}'$"):
        call(fn, dict(args, **kw))


@pytest.mark.parametrize("fn", MASKED_FWD + SEC5_BWD
                         + ["additive_attention_backward"])
def test_positional_attn_mask_asks_for_a_keyword(fn, rng):
    """A boolean per-query mask passed by position is refused: every
    optional argument, the section 5 ones included, is keyword-only, and
    the message names them in the signature's order."""
    args = family_args(fn, rng)
    req, opt = SIGNATURES[fn]
    pos = [args[n] for n in req if n in args]
    if len(pos) < len(req):
        pytest.skip("alpha may be left out")
    extra = {"additive_attention_backward": ["stop_at_key_proj"],
             "general_attention_backward": ["stop_at_key_proj"]}
    kw_only = ", ".join(opt + extra.get(fn, []))
    with pytest.raises(TypeError, match=(
            rf"^{fn}\(\) takes {len(req)} positional arguments but "
            rf"{len(req) + 1} were given; {re.escape(kw_only)} are "
            rf"keyword-only .*Argument {len(req) + 1} is a boolean array: "
            r"did you mean mask=\.\.\.\?$")):
        call_pos = getattr(ac, fn)
        call_pos(*pos, np.ones((2, 3, 5), bool))


@pytest.mark.parametrize("kw,error", [
    ({"scale": True}, "scale must be a real number or None, got bool"),
    ({"softcap": np.bool_(True)}, "softcap must be a real number or None"),
    ({"dropout": False}, "dropout must be a real number, got bool"),
    ({"causal": "no"}, "causal must be a bool, got str"),
    ({"return_weights": 1.0}, "return_weights must be a bool, got float"),
])
def test_bools_are_flags_and_flags_are_bools(kw, error):
    """A bool is no number (scale, softcap, dropout; as attention_c.torch
    refuses it), and a flag is a bool (NumPy's, or an int): "no" was
    true."""
    x = np.random.default_rng(0).standard_normal((1, 3, 2))
    with pytest.raises(TypeError, match=f"^{re.escape(error)}"):
        ac.dot_attention(x, x, **kw)
    for flag in (True, np.bool_(True), 1, np.int64(0)):
        ac.dot_attention(x, x, causal=flag)
