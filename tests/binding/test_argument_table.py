"""The binding's table (csrc/python/table.c, read through _core._table())
is the one description of every public function's arguments and outputs:
what else spells them out must agree with it.

Each test compares data written elsewhere by hand (the type stubs, the
Dask wrappers' signatures and named tuples, the PyTorch operators'
argument lists) or made by CPython from the table (inspect.signature of
the C functions) with the table, argument by argument: a name, a kind, a
default or an order changed on one side only fails here.
"""

import ast
import inspect
import pathlib

import pytest

import attention_c as ac
from attention_c import _core, _core_tests
from attention_c._functions import TABLE

ROOT = pathlib.Path(__file__).resolve().parents[2]
FUNCTIONS = list(TABLE)
P = inspect.Parameter

GRADS = {"context_attention_backward": "AttentionGrads",
         "additive_attention_backward": "AdditiveAttentionGrads",
         "dot_attention_backward": "DotAttentionGrads",
         "general_attention_backward": "GeneralAttentionGrads",
         "location_attention_backward": "LocationAttentionGrads",
         "cosine_attention_backward": "CosineAttentionGrads"}


def expected(fn):
    """[(name, kind, default)] of fn's parameters, from the table."""
    return [(a.name,
             P.POSITIONAL_OR_KEYWORD if a.positional else P.KEYWORD_ONLY,
             P.empty if a.required else a.default)
            for a in TABLE[fn].args]


def parameters(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_table_is_whole():
    """Every public function is a row, with its arguments in the order of
    the convention: required ones first, then positional ones, then
    keyword-only; an optional argument's default follows its kind."""
    assert set(TABLE) == {n for n in ac.__all__
                          if callable(getattr(ac, n))
                          and type(getattr(ac, n)).__name__
                          == "builtin_function_or_method"}
    defaults = {"flag": (False, True), "number": (0.0,), "seed": (None,),
                "scale": (None,), "mask": (None,), "array": (None,),
                "window": (None,), "number_or_array": (None,)}
    for fn, f in TABLE.items():
        required = [a.required for a in f.args]
        positional = [a.positional for a in f.args]
        assert required == sorted(required, reverse=True), fn
        assert positional == sorted(positional, reverse=True), fn
        for a in f.args:
            assert a.required <= a.positional, (fn, a.name)
            assert (a.shape is None) == (
                a.kind not in ("array", "mask", "number_or_array")), a
            if not a.required:
                assert a.default in defaults[a.kind], (fn, a)
                assert type(a.default) is type(defaults[a.kind][0]), a


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_runtime_signature(fn):
    """inspect.signature of the public function and of _core's and
    _core_tests' (the text signature CPython reads, made by the module
    from the table) lists the table's arguments."""
    for f in (getattr(ac, fn), getattr(_core, fn), getattr(_core_tests, fn)):
        assert parameters(inspect.signature(f)) == expected(fn)


@pytest.mark.parametrize("fn", list(GRADS))
def test_gradient_tuples(fn):
    """A backward's named tuple has a field per gradient output (dx -> x),
    each one an input of the function; the Dask adapter's tuple has the
    same fields."""
    fields = TABLE[fn].grad_fields()
    names = [a.name for a in TABLE[fn].args]
    assert set(fields) <= set(names)
    assert getattr(ac, GRADS[fn])._fields == fields
    # Skip on Dask itself: without it attention_c.dask raises an
    # ImportError, which pytest 9's importorskip reports as an error (it
    # skips on ModuleNotFoundError only); with Dask, the adapter must import.
    pytest.importorskip("dask.array")
    import attention_c.dask as acd
    assert getattr(acd, GRADS[fn])._fields == fields


# --------------------------------------------------------------------------
# The stubs (attention_c/__init__.pyi), read as source

# The annotations a stub may give an argument of each kind (optional
# arrays: _Opt or npt.ArrayLike | None; flags: bool, or Literal[...] in an
# overload).
ANNOTATIONS = {
    ("array", True): {"npt.ArrayLike"},
    ("array", False): {"_Opt", "npt.ArrayLike | None"},
    ("mask", False): {"_Mask"},
    ("flag", False): {"bool", "Literal[False]", "Literal[True]"},
    ("number", False): {"float"},
    ("seed", False): {"int | None"},
    ("scale", False): {"float | None"},
    ("window", False): {"tuple[int | None, int | None] | None"},
    ("number_or_array", False): {"float | npt.ArrayLike | None"},
}


def stub_functions():
    """{name: [ast.FunctionDef, ...]} of __init__.pyi (overloads: each)."""
    tree = ast.parse((ROOT / "attention_c" / "__init__.pyi").read_text())
    defs = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            defs.setdefault(node.name, []).append(node)
    return defs


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_stub(fn):
    """Every stub (each overload) of fn has the table's arguments, in
    order, positional or keyword-only as there, annotated for their kind,
    with the table's default (an overload may write ``...`` or, for the
    flag it is overloaded on, none)."""
    defs = stub_functions()[fn]
    for node in defs:
        a = node.args
        assert not a.posonlyargs and a.vararg is None and a.kwarg is None
        got = ([(x, True) for x in a.args]
               + [(x, False) for x in a.kwonlyargs])
        want = TABLE[fn].args
        assert [(x.arg, pos) for x, pos in got] == [
            (w.name, w.positional) for w in want], ast.unparse(node.args)
        defaults = ([None] * (len(a.args) - len(a.defaults))
                    + list(a.defaults) + list(a.kw_defaults))
        for (x, _), d, w in zip(got, defaults, want):
            note = ast.unparse(x.annotation)
            assert note in ANNOTATIONS[w.kind, w.required], (w, note)
            if w.required:
                assert d is None, w
            elif d is None:
                assert len(defs) > 1 and note.startswith("Literal["), w
            elif not (isinstance(d, ast.Constant) and d.value is ...):
                assert ast.literal_eval(d) == w.default, w
                assert type(ast.literal_eval(d)) is type(w.default), w


# --------------------------------------------------------------------------
# The PyTorch operators (torch.ops.attention_c.*)

# (every function but the building blocks and the keys' projection)
@pytest.mark.parametrize("fn", [f for f in FUNCTIONS if "_attention" in f])
def test_torch_schema(fn):
    """The op of fn, as registered: each argument one of fn's in the
    table (the ops' short names mapped; a backward's ``weights`` is its
    forward's return_weights), with the schema type of its kind; every
    argument of fn there but lse (a backward op's alpha holds it)."""
    pytest.importorskip("torch")
    import torch

    from attention_c.torch import _ops
    schema = getattr(torch.ops.attention_c, fn).default._schema
    table = {a.name: a for a in TABLE[fn].args}
    table.update({a.name: a for a in TABLE[fn.removesuffix("_backward")].args
                  if a.name not in table})
    seen = set()
    for arg in schema.arguments:
        name = _ops._TABLE_NAMES.get(arg.name, arg.name)
        a = table[name]
        seen.add(name)
        kind = {"mask": "Tensor?", "flag": "bool", "number": "float",
                "scale": "float?", "seed": "Tensor?",
                "window": "List[int]?",
                # a number is a 0-d tensor without gradient there
                "number_or_array": "Tensor?"}.get(a.kind)
        if kind is None:        # an array: Tensor when fn requires it
            saved = fn.endswith("_backward") and name in ("alpha", "out")
            kind = "Tensor" if a.required or saved else "Tensor?"
        if kind.endswith("?"):  # as torch writes it
            kind = f"Optional[{kind[:-1]}]"
        assert str(arg.type) == kind, (fn, arg.name, str(arg.type))
    assert {a.name for a in TABLE[fn].args} - seen <= {"lse"}


# --------------------------------------------------------------------------
# The Dask adapter (attention_c.dask)

@pytest.mark.parametrize("fn", FUNCTIONS)
def test_dask_signature(fn):
    """attention_c.dask.<fn>, where there is one, takes the table's
    arguments: names, kinds and defaults."""
    pytest.importorskip("dask.array")           # as in test_gradient_tuples
    import attention_c.dask as acd
    if not hasattr(acd, fn):
        pytest.skip(f"attention_c.dask has no {fn}")
    assert parameters(inspect.signature(getattr(acd, fn))) == expected(fn)
