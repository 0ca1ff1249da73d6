"""The public functions' arguments, calls and checks shared by
test_inputs.py and test_inputs_calls.py (docs/contract.md section 3)."""

import re

import numpy as np

import attention_c as ac
from attention_c import reference
from attention_c.testing import LAYER_FUNCTIONS, SIGNATURES, Problem

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


def ref_outputs(fn, args):
    """The float64 reference outputs for the same values."""
    args64 = {n: (x if x is None or n == "mask" else
                  np.asarray(x, dtype=np.float64))
              for n, x in args.items()}
    return as_tuple(getattr(reference, fn)(**args64))


def grow_last(x):
    pad = np.zeros(x.shape[:-1] + (1,), x.dtype)
    return np.concatenate([x, pad], axis=-1)


class BombError(Exception):
    """Raised by the array-likes that fail their conversion (ArrayBomb
    here, InterfaceBomb in test_inputs.py)."""


class ArrayBomb:
    """An array-like whose __array__ raises."""

    def __array__(self, dtype=None, copy=None):
        raise BombError("boom from __array__")
