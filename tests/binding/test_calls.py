"""The call interface of the public functions.

They are the binding's C functions themselves (METH_FASTCALL with the
binding's own argument parser, no Python frame on the call), published by
``_core._publish`` with the docstrings of attention_c/__init__.py.  These
tests check what users see of that: the signatures (inspect.signature,
from the binding's table), names, module, pickling, docstrings and their
examples, keyword handling the way a Python function does it, and the
named tuples of the backwards (made in C; ``_core``'s own functions
return plain tuples, which attention_c.torch unpacks).  The error messages
of wrong calls are in test_inputs_calls.py section 7.
"""

import doctest
import inspect
import pickle
import types

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core, _core_tests, reference
from attention_c.testing import (DEFAULTS, OPTIONAL_POSITIONAL, SIGNATURES,
                                 Problem)

ALL = list(SIGNATURES)
# Optional parameters past contract section 3, last in the signature.
EXTRA = {
    "context_attention": [("keep_activations", False)],
    "context_attention_backward": [("activations", None)],
    "additive_attention_backward": [("stop_at_key_proj", False)],
    "general_attention_backward": [("stop_at_key_proj", False)],
}
GRADS = {
    "context_attention_backward": ac.AttentionGrads,
    "additive_attention_backward": ac.AdditiveAttentionGrads,
    "dot_attention_backward": ac.DotAttentionGrads,
    "general_attention_backward": ac.GeneralAttentionGrads,
}


@pytest.mark.parametrize("fn", ALL)
def test_signature(fn):
    """inspect.signature: the contract's names in order, positional ones
    positional or keyword without a default (alpha of a dot/general
    backward: None), optional ones None (flags False, dropout 0.0,
    return_weights True) and keyword-only; _core's and _core_tests'
    functions the same."""
    req, opt = SIGNATURES[fn]
    optional_pos = OPTIONAL_POSITIONAL.get(fn, [])
    want = ([(n, None if n in optional_pos else inspect.Parameter.empty)
             for n in req]
            + [(n, DEFAULTS.get(n)) for n in opt] + EXTRA.get(fn, []))
    sig = inspect.signature(getattr(ac, fn))
    assert [(p.name, p.default) for p in sig.parameters.values()] == want
    kinds = [p.kind for p in sig.parameters.values()]
    assert kinds == ([inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(req)
                     + [inspect.Parameter.KEYWORD_ONLY]
                     * (len(want) - len(req)))
    assert sig.return_annotation is inspect.Signature.empty
    for core in (_core, _core_tests):
        assert inspect.signature(getattr(core, fn)) == sig


@pytest.mark.parametrize("fn", ALL)
def test_public_function_is_the_c_function(fn):
    """A builtin named fn in module attention_c, which pickles by name
    (as Dask's distributed scheduler sends it) and has its numpydoc
    docstring, without the signature line CPython keeps in front."""
    f = getattr(ac, fn)
    assert isinstance(f, types.BuiltinFunctionType)
    assert (f.__name__, f.__qualname__, f.__module__) == (fn, fn,
                                                          "attention_c")
    assert pickle.loads(pickle.dumps(f)) is f
    assert f.__doc__ and not f.__doc__.startswith(fn + "(")
    for section in ("Parameters", "Returns", "Examples"):
        assert f"\n    {section}\n    ---" in f.__doc__, section
    assert f.__text_signature__ == str(inspect.signature(f))
    # _core's own function: the signature only
    assert getattr(_core, fn).__doc__ is None


def test_doctest_finds_the_examples():
    """doctest (and so .ci/docs, pytest --doctest-modules) collects the
    examples of every public function, and they pass."""
    tests = {t.name: t for t in doctest.DocTestFinder().find(ac)}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for fn in ALL:
        test = tests[f"attention_c.{fn}"]
        assert test.examples, fn
        result = runner.run(test, out=lambda s: None)
        assert result.failed == 0, fn


def test_keyword_names_made_at_run_time(rng):
    """A keyword that is not the interned name (built at run time, or a
    str subclass) still matches its parameter."""

    class Name(str):
        pass

    p = Problem(rng, (2,), 5, 4, 3)
    want = ac.context_attention(p.h, p.W, p.v, b=p.b, mask=p.mask)
    kw = {"".join(["h"]): p.h, Name("W"): p.W, "v": p.v,
          "".join(["ma", "sk"]): p.mask, Name("b"): p.b}
    for f in (ac.context_attention, _core.context_attention):
        got = f(**kw)
        for g, w in zip(got, want):
            assert np.array_equal(g, w)


def test_several_missing_arguments_named(rng):
    with pytest.raises(TypeError, match=r"^context_attention\(\) missing 3 "
                       r"required positional arguments: 'h', 'W', and 'v'$"):
        ac.context_attention()
    with pytest.raises(TypeError, match=r"^context_attention\(\) missing 2 "
                       r"required positional arguments: 'W' and 'v'$"):
        ac.context_attention(np.zeros((2, 3)))
    with pytest.raises(TypeError, match=r"^masked_softmax_backward\(\) takes "
                       r"2 positional arguments but 3 were given$"):
        ac.masked_softmax_backward(1, 2, 3)
    # the argument's own check comes after: None for a required one
    with pytest.raises(TypeError, match="v is required and cannot be None"):
        ac.context_attention(np.zeros((2, 3)), np.zeros((4, 6)), v=None)


def _family_problem(rng):
    keys = rng.standard_normal((2, 7, 4))
    query = rng.standard_normal((2, 3, 3))
    W = rng.standard_normal((5, 7))
    v = rng.standard_normal(5)
    return keys, query, W, v


@pytest.mark.parametrize("fn", sorted(GRADS))
def test_backwards_named_tuples_public_plain_in_core(fn, rng):
    """The public backward returns its named tuple (made in C), _core's a
    plain tuple of the same arrays."""
    keys, query, W, v = _family_problem(rng)
    p = Problem(rng, (2,), 5, 4, 3)
    if fn == "context_attention_backward":
        out, alpha = ac.context_attention(p.h, p.W, p.v)
        args = (np.ones_like(out), p.h, p.W, p.v, alpha)
    else:
        forward = getattr(ac, fn.removesuffix("_backward"))
        inputs = {"additive_attention_backward": (query, keys, W, v),
                  "dot_attention_backward": (query[..., :1] * keys[:, :3],
                                             keys),
                  "general_attention_backward": (query, keys, W[:3, :4])}[fn]
        out, alpha = forward(*inputs)
        grad_out = np.ones_like(out)
        if fn == "dot_attention_backward":
            args = (grad_out, *inputs, alpha)
        else:
            args = (grad_out, *inputs[:3 if "general" in fn else 4], alpha)
    g = getattr(ac, fn)(*args)
    plain = getattr(_core, fn)(*args)
    assert type(g) is GRADS[fn] and type(plain) is tuple
    assert len(g) == len(plain) == len(GRADS[fn]._fields)
    for a, b in zip(g, plain):
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("fn", ["additive_attention_backward",
                                "general_attention_backward"])
def test_stop_at_key_proj_returns_grads_and_key_proj_gradient(fn, rng):
    """stop_at_key_proj=True: (named tuple, dkey_proj) from the public
    function, the flat tuple with dkey_proj last from _core's."""
    keys, query, W, v = _family_problem(rng)
    if fn.startswith("additive"):
        fwd = (query, keys, W, v)
        kp = reference.project_keys(keys, W)
    else:
        fwd = (query, keys, W[:3, :4])
        kp = reference.project_keys(keys, W[:3, :4])
    out, alpha = getattr(ac, fn.removesuffix("_backward"))(*fwd)
    kw = dict(key_proj=kp, stop_at_key_proj=True)
    grads, dkp = getattr(ac, fn)(np.ones_like(out), *fwd, alpha=alpha, **kw)
    plain = getattr(_core, fn)(np.ones_like(out), *fwd, alpha=alpha, **kw)
    assert type(grads) is GRADS[fn] and dkp.shape == kp.shape
    assert len(plain) == len(grads) + 1
    for a, b in zip((*grads, dkp), plain):
        assert (a is None and b is None) or np.array_equal(a, b)


def test_publish_checks_its_arguments():
    """_publish (on the tests' extension, leaving the package's functions
    alone): an unknown row, or grads that are not a named tuple with one
    field per gradient, are refused."""
    with pytest.raises(ValueError, match="no function nope"):
        _core_tests._publish("nope", "")
    # (GeneralAttentionGrads has 5 fields; DotAttentionGrads has 4 since
    # the bias gradient, like AttentionGrads)
    with pytest.raises(TypeError, match="named tuple of 4 fields"):
        _core_tests._publish("context_attention_backward", "",
                             ac.GeneralAttentionGrads)
    with pytest.raises(TypeError, match="named tuple"):
        _core_tests._publish("context_attention_backward", "", list)
    f = _core_tests._publish("context_attention_backward", "Doc.",
                             ac.AttentionGrads)
    assert f.__doc__ == "Doc." and f.__module__ == "attention_c._core_tests"
    assert inspect.signature(f) == inspect.signature(
        ac.context_attention_backward)


@pytest.mark.parametrize("fn", ["dot_attention_backward",
                                "general_attention_backward"])
def test_backward_from_out_and_lse_named_tuple(fn, rng):
    """A dot/general backward from out= and lse= (alpha left out,
    docs/contract.md 5.3) returns the same named tuple, with the bias
    gradient last in the bias's (broadcast) shape (5.4); _core's the plain
    tuple of the same arrays."""
    keys, query, W, _ = _family_problem(rng)
    fwd = ((query[..., :1] * keys[:, :3], keys)
           if fn.startswith("dot") else (query, keys, W[:3, :4]))
    bias = rng.standard_normal((1, 3, 7))
    forward = getattr(ac, fn.removesuffix("_backward"))
    out, lse = forward(*fwd, bias=bias, return_weights=False)
    kw = dict(out=out, lse=lse, bias=bias)
    g = getattr(ac, fn)(np.ones_like(out), *fwd, **kw)
    plain = getattr(_core, fn)(np.ones_like(out), *fwd, **kw)
    assert type(g) is GRADS[fn] and type(plain) is tuple
    # bias, then the variants' gradients (issue 25; None here)
    assert g._fields[-3:] == ("bias", "alibi_slopes", "sinks")
    assert g.bias.shape == bias.shape
    assert len(g) == len(plain)
    for a, b in zip(g, plain):
        assert (a is None and b is None) or np.array_equal(a, b)
