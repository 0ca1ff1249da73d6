"""Input handling of the public API (docs/contract.md section 3).

Memory layouts, "never modify inputs", dtype rules, error messages for bad
input, overflowing sizes, argument passing and ndarray subclasses, for all
ten public functions.  Numerical accuracy of the kernels themselves is the
business of tests/kernels (test_kernels.py, test_gradients.py); here a
result is mostly compared with the result of the same call on plain
C-contiguous inputs, which must be bit-identical because the binding
copies every input to a C-contiguous aligned array of the computing dtype
before the kernel runs.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core, _core_tests, reference
from attention_c.testing import (DTYPES, HALF_DTYPES, LAYER_FUNCTIONS,
                                 SIGNATURES, Problem, assert_close,
                                 assert_rounded, misaligned)

# --------------------------------------------------------------------------
# The ten functions: their arguments (docs/contract.md's names, in order),
# which of them are required, and which argument the others' shapes are
# checked against.

FUNCS = LAYER_FUNCTIONS
# Optional parameters beyond docs/contract.md section 3 (saved
# activations), last.
EXTRA_PARAMS = {
    "context_attention": ["keep_activations"],
    "context_attention_backward": ["activations"],
}

# The argument that defines the layout (..., T, H) or (..., T).
REF = {fn: "h" for fn in FUNCS}
REF["masked_softmax"] = "scores"
REF["masked_softmax_backward"] = "alpha"

# Arguments whose trailing shape is (T,) rather than (T, H).
T_ONLY = {"scores", "alpha", "grad_s", "grad_alpha", "mask"}


def params(fn):
    """All argument names of fn, in docs/contract.md's order."""
    req, opt = SIGNATURES[fn]
    return req + opt


def float_params(fn):
    """The floating (non-mask) arguments of fn."""
    return [a for a in params(fn) if a != "mask"]


FN_FLOAT_ARGS = [(fn, a) for fn in FUNCS for a in float_params(fn)]
FN_ARGS = [(fn, a) for fn in FUNCS for a in params(fn)]
FN_REQUIRED = [(fn, a) for fn in FUNCS for a in SIGNATURES[fn][0]]
FNS_WITH_MASK = [fn for fn in FUNCS if "mask" in params(fn)]
# backwards whose alpha must be 0 exactly where their mask is False (the
# binding checks it): tests that change one must change the other
ALPHA_CHECKED = {fn for fn in FUNCS
                 if {"grad_out", "alpha", "mask"} <= set(params(fn))}


def pair_id(pair):
    return "-".join(pair)


def make_args(fn, rng, lead=(3,), T=5, H=4, A=6, dtype=np.float64):
    """Keyword arguments of fn for a random Problem (float args in dtype)."""
    if T > 0:
        p = Problem(rng, lead, T, H, A)
        alpha = reference.masked_softmax(p.grad_s * 2, mask=p.mask)
    else:
        # make_mask cannot build a random mask with no items
        p = Problem(rng, lead, T, H, A, mask="none")
        p.mask = np.ones(p.lead + (0,), dtype=bool)
        alpha = np.zeros(p.lead + (0,))
    x = p.cast(np.float64)
    values = {
        "h": x["h"], "W": x["W"], "v": x["v"], "b": x["b"],
        "mask": p.mask, "context": x["context"], "grad_c": x["grad_out"],
        "grad_out": x["grad_out"], "grad_s": x["grad_s"],
        "scores": x["grad_s"] * 3, "grad_alpha": x["grad_alpha"],
        "alpha": alpha,
    }
    out = {}
    for name in params(fn):
        val = values[name]
        out[name] = val if name == "mask" else val.astype(dtype)
    return out


def call(fn, kwargs):
    """Calls attention_c.<fn> with keyword arguments."""
    return getattr(ac, fn)(**kwargs)


def as_tuple(result):
    """The outputs of a call as a tuple (one element for a single array)."""
    return tuple(result) if isinstance(result, tuple) else (result,)


def assert_identical(got, want, what=""):
    """Same number of outputs, each a plain ndarray bit-identical to want."""
    got, want = as_tuple(got), as_tuple(want)
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what}: output {i} should be None"
            continue
        assert type(g) is np.ndarray, f"{what}: output {i} is {type(g)}"
        assert g.dtype == w.dtype, f"{what}: output {i}: {g.dtype} {w.dtype}"
        assert g.shape == w.shape, f"{what}: output {i}: {g.shape} {w.shape}"
        assert np.array_equal(g, w, equal_nan=True), (
            f"{what}: output {i} differs, max |diff| = "
            f"{np.max(np.abs(g.astype(float) - w.astype(float))):.3g}")


def plain(x):
    """A fresh C-contiguous, aligned, writeable, native-endian copy."""
    a = np.asarray(x)
    return np.array(a, dtype=a.dtype.newbyteorder("="), order="C", copy=True)


def shape_re(shape):
    """Regex for a shape as the binding prints it, e.g. '\\(3, 5\\)'."""
    return re.escape(str(tuple(shape)))


# --------------------------------------------------------------------------
# 1. Memory layouts: same values, any strides -> bit-identical results.

def _noncontig(x):
    big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    big[..., ::2] = x
    return big[..., ::2]


def _every_other_row(x):
    big = np.zeros((2 * x.shape[0],) + x.shape[1:], x.dtype)
    big[::2] = x
    return big[::2]


def _fortran(x):
    return np.asfortranarray(x)


def _transposed(x):
    if x.ndim < 2:
        return x.copy()
    return np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2)


def _reversed(x):
    flip = (slice(None, None, -1),) * x.ndim
    return x[flip].copy()[flip]


def _readonly(x):
    y = x.copy()
    y.flags.writeable = False
    return y


def _bigendian(x):
    return x.astype(x.dtype.newbyteorder(">"))


def _broadcast(x):
    return np.broadcast_to(x[:1], x.shape)


def _list(x):
    return x.tolist()


def _check_layout(kind, x, y):
    """The transformed array y really has the layout it claims."""
    if kind == "list":
        assert isinstance(y, list)
        return
    assert isinstance(y, np.ndarray)
    big = x.ndim >= 1 and x.shape[-1] > 1 and x.size > 1
    if kind == "noncontig" and big:
        assert not y.flags.c_contiguous
    elif kind == "every_other_row" and x.shape[0] > 1:
        assert not y.flags.c_contiguous
    elif kind in ("fortran", "transposed") and x.ndim >= 2 and \
            min(x.shape[-2:]) > 1:
        assert not y.flags.c_contiguous
    elif kind == "reversed" and big:
        assert y.strides[-1] < 0
    elif kind == "misaligned" and x.dtype.itemsize > 1:
        assert not y.flags.aligned
        assert y.ctypes.data % x.dtype.itemsize != 0
    elif kind == "readonly":
        assert not y.flags.writeable
    elif kind == "bigendian" and x.dtype.itemsize > 1 and \
            sys.byteorder == "little":
        assert not y.dtype.isnative
    elif kind == "broadcast" and x.shape[0] > 1:
        assert y.strides[0] == 0


LAYOUTS = {
    "noncontig": _noncontig,
    "every_other_row": _every_other_row,
    "fortran": _fortran,
    "transposed": _transposed,
    "reversed": _reversed,
    "misaligned": misaligned,
    "readonly": _readonly,
    "bigendian": _bigendian,
    "broadcast": _broadcast,
    "list": _list,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fn", FUNCS)
def test_layout_gives_identical_results(fn, layout, dtype, rng):
    """Any layout of any argument gives the result of its contiguous copy."""
    args = make_args(fn, rng, dtype=dtype)
    names = [n for n in params(fn) if args[n] is not None]
    for targets in [[n] for n in names] + [names]:
        if fn in ALPHA_CHECKED and {"alpha", "mask"} & set(targets):
            targets = sorted(set(targets) | {"alpha", "mask"})
        moved, base = dict(args), dict(args)
        for n in targets:
            y = LAYOUTS[layout](args[n])
            _check_layout(layout, args[n], y)
            moved[n], base[n] = y, plain(y)
        assert_identical(call(fn, moved), call(fn, base),
                         f"{fn}, {layout} {targets}")


# --------------------------------------------------------------------------
# 2. Inputs are never modified, outputs never alias inputs.

INPUT_VARIANTS = ["float64", "float32", "mixed", "noncontig"]


def _variant(fn, kind, rng):
    if kind == "float32":
        return make_args(fn, rng, dtype=np.float32)
    args = make_args(fn, rng)
    if kind == "mixed":
        first = float_params(fn)[0]
        args[first] = args[first].astype(np.float32)
    elif kind == "noncontig":
        args = {n: None if x is None else _noncontig(x)
                for n, x in args.items()}
    return args


@pytest.mark.parametrize("kind", INPUT_VARIANTS)
@pytest.mark.parametrize("fn", FUNCS)
def test_inputs_never_modified(fn, kind, rng):
    """No argument (mask included) changes, and no output aliases one."""
    args = _variant(fn, kind, rng)
    # NaN in masked-out items: the kernel must not touch them either.
    if "h" in args and args.get("mask") is not None:
        args["h"][~args["mask"]] = np.nan
    before = {n: None if x is None else x.copy() for n, x in args.items()}
    flags = {n: None if x is None else (x.flags.writeable,
                                        x.flags.c_contiguous)
             for n, x in args.items()}
    result = as_tuple(call(fn, args))
    for n, x in args.items():
        if x is None:
            continue
        assert x.dtype == before[n].dtype, n
        assert np.array_equal(x, before[n], equal_nan=True), f"{n} changed"
        assert (x.flags.writeable, x.flags.c_contiguous) == flags[n], n
        for i, out in enumerate(result):
            if out is not None:
                assert not np.shares_memory(out, x), f"output {i} aliases {n}"


# --------------------------------------------------------------------------
# 3. Dtype rules.

def _ref_outputs(fn, args):
    """The float64 reference outputs for the same values."""
    args64 = {n: (x if x is None or n == "mask" else
                  np.asarray(x, dtype=np.float64))
              for n, x in args.items()}
    return as_tuple(getattr(reference, fn)(**args64))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", FUNCS)
def test_native_dtype_preserved(fn, dtype, rng):
    """float32 in -> float32 out, float64 -> float64, values correct."""
    args = make_args(fn, rng, dtype=dtype)
    got = as_tuple(call(fn, args))
    for i, (g, r) in enumerate(zip(got, _ref_outputs(fn, args))):
        if r is None:
            assert g is None
            continue
        assert g.dtype == dtype, f"output {i}: {g.dtype}"
        assert_close(g, r, dtype, f"{fn} output {i}")


MIXED_CASES = [(fn, a) for fn, a in FN_FLOAT_ARGS if len(float_params(fn)) > 1]


@pytest.mark.parametrize("odd", ["float64_among_float32",
                                 "float32_among_float64"])
@pytest.mark.parametrize("fn_arg", MIXED_CASES, ids=pair_id)
def test_mixed_precision_promotes_to_float64(fn_arg, odd, rng):
    """Mixed float32/float64 computes in np.result_type (float64)."""
    fn, arg = fn_arg
    base, other = ((np.float32, np.float64) if odd.startswith("float64")
                   else (np.float64, np.float32))
    args = make_args(fn, rng, dtype=base)
    args[arg] = args[arg].astype(other)
    floats = [args[n] for n in float_params(fn) if args[n] is not None]
    assert np.result_type(*floats) == np.float64
    want = call(fn, {n: x if n == "mask" or x is None else
                     x.astype(np.float64) for n, x in args.items()})
    assert_identical(call(fn, args), want, f"{fn} with {arg} {odd}")


INT_DTYPES = [np.int64, np.int32, np.uint8]


@pytest.mark.parametrize("itype", INT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", FUNCS)
def test_integer_inputs_compute_in_float64(fn, itype, rng):
    """Integer arrays compute in float64 and match float64 of same values."""
    args = make_args(fn, rng)
    ints = {}
    for n, x in args.items():
        if n == "mask" or x is None:
            ints[n] = x
        else:
            ints[n] = rng.integers(0, 3, size=x.shape).astype(itype)
    if fn in ALPHA_CHECKED:                 # 0 exactly where masked
        ints["alpha"] = (rng.integers(1, 3, size=args["alpha"].shape)
                         * args["mask"]).astype(itype)
    want = call(fn, {n: x if n == "mask" or x is None else
                     x.astype(np.float64) for n, x in ints.items()})
    got = call(fn, ints)
    assert all(g is None or g.dtype == np.float64 for g in as_tuple(got))
    assert_identical(got, want, f"{fn} with {np.dtype(itype).name}")


@pytest.mark.parametrize("fn", FUNCS)
def test_int64_with_float32_follows_result_type(fn, rng):
    """int64 states with float32 weights compute in float64 (result_type)."""
    args = make_args(fn, rng, dtype=np.float32)
    first = float_params(fn)[0]
    args[first] = np.round(args[first] * 3).astype(np.int64)
    assert np.result_type(np.int64, np.float32) == np.float64
    want = call(fn, {n: x if n == "mask" or x is None else
                     x.astype(np.float64) for n, x in args.items()})
    assert_identical(call(fn, args), want, fn)


@pytest.mark.parametrize("dtype", HALF_DTYPES,
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", FUNCS)
def test_half_computes_in_float32(fn, dtype, rng):
    """float16 and bfloat16 inputs compute in float32 and come back in
    their dtype: the float32 call's results rounded once."""
    args = make_args(fn, rng, dtype=dtype)
    want = call(fn, {n: x if n == "mask" or x is None else
                     x.astype(np.float32) for n, x in args.items()})
    assert_rounded(call(fn, args), want, dtype, f"{fn} {np.dtype(dtype)}")
    if "alpha" in args:
        # alpha rounded to 16 bits no longer sums to 1, which the backward
        # kernels assume; the float32 comparison above is the check here.
        return
    for i, (w, r) in enumerate(zip(as_tuple(want), _ref_outputs(fn, args))):
        if r is not None:
            assert_close(w, r, np.float32, f"{fn} {dtype} output {i}")


def _bad_dtype(kind, x):
    if kind == "complex":
        return x.astype(np.complex128)
    if kind == "object":
        return x.astype(object)
    if kind == "bool":
        return x > 0
    if kind == "str":
        return np.full(x.shape, "a")
    if kind == "longdouble":
        return x.astype(np.longdouble)
    if kind == "datetime":
        return np.zeros(x.shape, "datetime64[s]")
    raise AssertionError(kind)


BAD_DTYPES = ["complex", "object", "bool", "str", "longdouble", "datetime"]


@pytest.mark.parametrize("kind", BAD_DTYPES)
@pytest.mark.parametrize("fn_arg", FN_FLOAT_ARGS, ids=pair_id)
def test_unsupported_dtype_raises_type_error(fn_arg, kind, rng):
    """Complex/object/bool/str/long double data: TypeError naming the arg."""
    fn, arg = fn_arg
    if kind == "longdouble" and np.dtype(np.longdouble) == np.float64:
        pytest.skip("long double is float64 on this platform")
    args = make_args(fn, rng)
    args[arg] = _bad_dtype(kind, args[arg])
    with pytest.raises(TypeError, match=rf"^{arg} has dtype "
                       rf"{re.escape(str(args[arg].dtype))}"):
        call(fn, args)


@pytest.mark.parametrize("mdtype", [np.int64, np.int8, np.uint8, np.float64,
                                    np.float32],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", FNS_WITH_MASK)
def test_non_boolean_mask_raises_type_error(fn, mdtype, rng):
    """A mask of int or float dtype raises TypeError naming mask."""
    args = make_args(fn, rng)
    args["mask"] = args["mask"].astype(mdtype)
    with pytest.raises(TypeError, match=rf"^mask must be a boolean array.*"
                       rf"{np.dtype(mdtype).name}"):
        call(fn, args)


@pytest.mark.parametrize("fn", FNS_WITH_MASK)
def test_mask_as_list_of_ints_raises_type_error(fn, rng):
    """A mask given as a list of 0/1 ints is not silently accepted."""
    args = make_args(fn, rng)
    args["mask"] = args["mask"].astype(int).tolist()
    with pytest.raises(TypeError, match=r"^mask must be a boolean array"):
        call(fn, args)


# --------------------------------------------------------------------------
# 4. Bad shapes raise ValueError naming the argument and the shapes.

WRONG_NDIM = [(fn, nd) for fn in FUNCS
              for nd in ((0,) if REF[fn] in T_ONLY else (0, 1))]


@pytest.mark.parametrize("fn,ndim", WRONG_NDIM,
                         ids=[f"{f}-{n}d" for f, n in WRONG_NDIM])
def test_states_with_too_few_dims_raise(fn, ndim, rng):
    """h (or scores/alpha) with too few axes: ValueError with its shape."""
    args = make_args(fn, rng)
    ref = REF[fn]
    x = args[ref]
    args[ref] = x[(0,) * (x.ndim - ndim)]
    assert args[ref].ndim == ndim
    want = r"\(\.\.\., T\)" if ref in T_ONLY else r"\(\.\.\., T, H\)"
    with pytest.raises(ValueError, match=rf"^{ref} must have shape {want}.*"
                       rf"got shape {shape_re(args[ref].shape)}"):
        call(fn, args)


def _grow_last(x):
    pad = np.zeros(x.shape[:-1] + (1,), x.dtype)
    return np.concatenate([x, pad], axis=-1)


def _drop_lead(x):
    return x[0]


def _add_lead(x):
    return x[None]


WRONG_SHAPES = {"grow_last": _grow_last, "drop_lead": _drop_lead,
                "add_lead": _add_lead}
SHAPE_CASES = [(fn, a, k) for fn in FUNCS for a in params(fn)
               if a != REF[fn] for k in WRONG_SHAPES]


@pytest.mark.parametrize("fn,arg,kind", SHAPE_CASES,
                         ids=["-".join(c) for c in SHAPE_CASES])
def test_wrong_shape_raises_value_error(fn, arg, kind, rng):
    """Any argument of the wrong shape: ValueError naming it and shapes."""
    args = make_args(fn, rng)
    args[arg] = WRONG_SHAPES[kind](args[arg])
    ref = "W" if arg in ("v", "b") else REF[fn]
    pattern = (rf"^{arg} has shape {shape_re(args[arg].shape)}; expected "
               rf".* {ref} with shape {shape_re(args[ref].shape)}")
    with pytest.raises(ValueError, match=pattern):
        call(fn, args)


@pytest.mark.parametrize("fn", ["additive_score", "additive_score_backward",
                                "context_attention",
                                "context_attention_backward"])
def test_w_for_other_h_names_both_shapes(fn, rng):
    """W of (A, 2H') with H' != H: message gives W, 2*H and h's shape."""
    args = make_args(fn, rng, H=4, A=6)
    args["W"] = rng.standard_normal((6, 10))
    with pytest.raises(ValueError, match=r"^W has shape \(6, 10\); expected "
                       r"\(A, 2\*H\) = \(A, 8\) for h with shape \(3, 5, 4\)"):
        call(fn, args)


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)], ids=str)
@pytest.mark.parametrize("fn", FUNCS)
def test_zero_items_raise_value_error(fn, lead, rng):
    """T = 0 raises ValueError naming the argument and its shape."""
    args = make_args(fn, rng, lead=lead, T=0)
    ref = REF[fn]
    with pytest.raises(ValueError, match=rf"^{ref} has shape "
                       rf"{shape_re(args[ref].shape)}: T = 0"):
        call(fn, args)


class BombError(Exception):
    """Raised by the array-likes below."""


class ArrayBomb:
    """An array-like whose __array__ raises."""

    def __array__(self, dtype=None, copy=None):
        raise BombError("boom from __array__")


class InterfaceBomb:
    """An array-like whose __array_interface__ raises."""

    @property
    def __array_interface__(self):
        raise BombError("boom from __array_interface__")


@pytest.mark.parametrize("bomb", [ArrayBomb, InterfaceBomb],
                         ids=["__array__", "__array_interface__"])
@pytest.mark.parametrize("fn_arg", FN_ARGS, ids=pair_id)
def test_conversion_error_propagates(fn_arg, bomb, rng):
    """An exception raised while converting an argument propagates as is."""
    fn, arg = fn_arg
    args = make_args(fn, rng)
    good = call(fn, args)
    bad = dict(args, **{arg: bomb()})
    with pytest.raises(BombError, match="boom"):
        call(fn, bad)
    assert_identical(call(fn, args), good, f"{fn} after bomb in {arg}")


RAGGED = [(fn, a) for fn in FUNCS for a in (REF[fn], "mask")
          if a in params(fn)]


@pytest.mark.parametrize("fn_arg", RAGGED, ids=pair_id)
def test_ragged_list_raises_value_error(fn_arg, rng):
    """A ragged nested list raises ValueError (NumPy's), no crash."""
    fn, arg = fn_arg
    args = make_args(fn, rng)
    rows = args[arg].tolist()
    rows[-1] = rows[-1][:-1]
    args[arg] = rows
    with pytest.raises(ValueError, match="inhomogeneous"):
        call(fn, args)


# None passed for a required argument is run in child processes: a crash
# there must fail one test, not kill the whole session.

_NONE_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import attention_c as ac
    sys.path.insert(0, {tests!r})
    from test_inputs import make_args, call, FN_REQUIRED
    results = {{}}
    for fn, arg in FN_REQUIRED:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            signal.alarm(20)          # a hang is reported as SIGALRM
            args = make_args(fn, np.random.default_rng(0))
            args[arg] = None
            try:
                call(fn, args)
                msg = "returned"
            except Exception as e:
                msg = f"{{type(e).__name__}}: {{e}}"
            os.write(w, msg.encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            msg = f.read().decode()
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            sig = signal.Signals(os.WTERMSIG(status)).name
            msg = f"killed by {{sig}}"
        results[fn + "/" + arg] = msg
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def none_results():
    """fn/arg -> outcome of calling fn with that required argument None."""
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-c", _NONE_SCRIPT.format(tests=tests)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fn_arg", FN_REQUIRED, ids=pair_id)
def test_none_for_required_argument_raises(fn_arg, none_results):
    """None for a required array: TypeError naming it, never a crash."""
    fn, arg = fn_arg
    outcome = none_results[f"{fn}/{arg}"]
    assert not outcome.startswith("killed"), f"{fn}({arg}=None): {outcome}"
    assert outcome.startswith("TypeError: "), f"{fn}({arg}=None): {outcome}"
    assert re.search(rf"\b{arg}\b", outcome), f"{fn}({arg}=None): {outcome}"


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
    for i, (g, r) in enumerate(zip(got, _ref_outputs(fn, args))):
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
        bad[other] = _grow_last(args[other])
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
