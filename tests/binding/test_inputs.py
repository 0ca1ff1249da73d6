"""Input handling of the public API (docs/contract.md section 3).

Memory layouts, "never modify inputs", dtype rules and error messages for
bad input, for all ten public functions (overflowing sizes, argument
passing and ndarray subclasses: test_inputs_calls.py; the arguments and
checks both use: inputs_cases.py).  Numerical accuracy of the kernels
themselves is the business of tests/kernels (test_kernels.py,
test_gradients.py); here a result is mostly compared with the result of
the same call on plain C-contiguous inputs, which must be bit-identical
because the binding copies every input to a C-contiguous aligned array of
the computing dtype before the kernel runs.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from attention_c.testing import (DTYPES, HALF_DTYPES, assert_close,
                                 assert_rounded, misaligned)

from inputs_cases import (ALPHA_CHECKED, ArrayBomb, BombError, FNS_WITH_MASK,
                          FN_ARGS, FN_FLOAT_ARGS, FN_REQUIRED, FUNCS, REF,
                          T_ONLY, as_tuple, assert_identical, call,
                          float_params, grow_last, make_args, pair_id, params,
                          plain, ref_outputs, shape_re)


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


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", FUNCS)
def test_native_dtype_preserved(fn, dtype, rng):
    """float32 in -> float32 out, float64 -> float64, values correct."""
    args = make_args(fn, rng, dtype=dtype)
    got = as_tuple(call(fn, args))
    for i, (g, r) in enumerate(zip(got, ref_outputs(fn, args))):
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
    for i, (w, r) in enumerate(zip(as_tuple(want), ref_outputs(fn, args))):
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


def _drop_lead(x):
    return x[0]


def _add_lead(x):
    return x[None]


WRONG_SHAPES = {"grow_last": grow_last, "drop_lead": _drop_lead,
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
