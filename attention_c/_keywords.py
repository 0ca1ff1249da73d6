"""The keyword-only rule of attention_c's Python functions, with the C
functions' message (docs/conventions.md).

Python's own error for an extra positional argument ("takes 2 positional
arguments but 3 were given") does not say which arguments are keyword-only
nor why the call was refused; :func:`keyword_only` gives the message the C
functions give (csrc/python/parse.c), word for word, so that the NumPy
layers, the Dask functions and the C functions say the same thing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np

_T = TypeVar("_T")
_P = ParamSpec("_P")


def _is_bool_array(x: Any) -> bool:
    """A NumPy, Dask or PyTorch array (or a nested list) of booleans,
    told without computing a lazy array."""
    if isinstance(x, (list, tuple)):
        try:
            return bool(np.asarray(x).dtype == np.bool_)
        except Exception:           # ragged, say: no hint, the error stands
            return False
    return str(getattr(x, "dtype", "")) in ("bool", "torch.bool")


def keyword_only(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """``fn`` with Python's bare "takes 2 positional arguments but 3 were
    given" replaced by the TypeError of the C functions: it names the
    keyword-only arguments, and asks "did you mean mask=...?" when an
    extra value is a boolean array (the misreading that keyword-only
    arguments prevent).  The signature (``inspect.signature``, the docs)
    is ``fn``'s own."""
    params = list(inspect.signature(fn).parameters.values())
    npos = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    positional = [p.name for p in params[:npos]]
    skip = 1 if positional[:1] in (["self"], ["cls"]) else 0
    keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(fn)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        if len(args) > npos:
            name = fn.__qualname__
            if skip:        # the class called, not the one defining fn
                owner: Any = (args[0] if positional[0] == "cls"
                              else type(args[0]))
                name = (owner.__name__ if fn.__name__ == "__init__" else
                        f"{owner.__name__}.{fn.__name__}")
            raise _too_many(name, positional[skip:], keywords, args[skip:])
        return fn(*args, **kwargs)
    return checked


def _too_many(name: str, positional: list[str], keywords: list[str],
              args: tuple[Any, ...]) -> TypeError:
    """The C functions' message (csrc/python/parse.c), word for word."""
    n, given = len(positional), len(args)
    several = len(keywords) > 1
    msg = (f"{name}() takes {n} positional argument{'s' * (n != 1)} but "
           f"{given} {'was' if given == 1 else 'were'} given; "
           f"{', '.join(keywords)} {'are' if several else 'is'} "
           f"keyword-only (pass {'them' if several else 'it'} by name, "
           f"e.g. {keywords[0]}=...)")
    masks = [i for i in range(n, given) if _is_bool_array(args[i])]
    if masks and "mask" in keywords:
        msg += (f". Argument {masks[0] + 1} is a boolean array: did you "
                f"mean mask=...?")
    return TypeError(msg)
