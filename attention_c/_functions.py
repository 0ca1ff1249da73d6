"""The public functions of attention_c, published from the binding's table.

Every public function is a row of the C binding's table
(csrc/python/table.c): its arguments in signature order with their kinds,
shapes and defaults, and its outputs.  The functions are the C functions
of ``attention_c._core`` themselves, so that a call (thousands per epoch
in a decoder) goes through no Python frame; here ``_core._publish`` makes
each one ``attention_c.<name>`` with its docstring (``_docstrings``,
``_family_docstrings``, ``_scores_docstrings``) and, for a backward, its
named tuple of gradients, whose fields are the table's: the gradient
``dx`` of input ``x`` is field ``x``.

:data:`TABLE` is the table as Python reads it; ``attention_c.testing``
derives its ``SIGNATURES`` from it, and tests/binding checks the stubs,
the PyTorch operators and the Dask wrappers against it.

``attention_c/__init__.py`` imports every public name defined here.
"""

import collections
from typing import Any, NamedTuple

from . import _core  # type: ignore[attr-defined]
from . import _docstrings, _family_docstrings, _scores_docstrings


class Arg(NamedTuple):
    """An argument of a public function, as the binding takes it."""

    name: str
    kind: str                 # array, mask, flag, number, seed, scale
    shape: str | None         # its pattern, e.g. "(..., T, H)"; None: a value
    required: bool
    positional: bool          # may be given by position (else keyword-only)
    default: Any              # of an optional one (None for required ones)


class Output(NamedTuple):
    """An output of a public function, in the order of its result."""

    name: str
    shape: str
    like: str | None          # has the shape of this argument
    when: str | None          # made only when this argument is given
    unless: str | None        # made only when this one is not
    extra: bool               # left out of the result when not made


class Function(NamedTuple):
    """A row of the table."""

    name: str
    args: tuple[Arg, ...]
    outputs: tuple[Output, ...]

    def grad_fields(self) -> tuple[str, ...]:
        """The fields of a backward's named tuple: the gradient ``dx`` of
        each input ``x``, in order, without the extra outputs."""
        fields = tuple(o.name[1:] for o in self.outputs if not o.extra)
        assert all(o.name.startswith("d") for o in self.outputs
                   if not o.extra), self.name
        return fields


TABLE = {name: Function(name, tuple(Arg(*a) for a in args),
                        tuple(Output(*o) for o in outs))
         for name, (args, outs) in _core._table().items()}

DOCS = {**_docstrings.DOCS, **_family_docstrings.DOCS,
        **_scores_docstrings.DOCS}
GRADS_DOCS = {**_docstrings.GRADS_DOCS, **_family_docstrings.GRADS_DOCS,
              **_scores_docstrings.GRADS_DOCS}


def _grads(name: str, function: str) -> Any:
    """The named tuple ``name`` of the gradients ``function`` returns."""
    # (through Any: a named tuple of fields read at run time is no type
    # mypy could check; the stubs declare each one)
    make: Any = collections.namedtuple
    grads = make(name, TABLE[function].grad_fields())
    grads.__doc__ = GRADS_DOCS[name]
    return grads


def _publish(name: str, grads: Any = None) -> Any:
    """attention_c.<name>: _core's function with its docstring and, for a
    backward, its gradients as the named tuple ``grads``."""
    return _core._publish(name, DOCS[name], grads)


AttentionGrads = _grads("AttentionGrads", "context_attention_backward")
AdditiveAttentionGrads = _grads("AdditiveAttentionGrads",
                                "additive_attention_backward")
DotAttentionGrads = _grads("DotAttentionGrads", "dot_attention_backward")
GeneralAttentionGrads = _grads("GeneralAttentionGrads",
                               "general_attention_backward")
LocationAttentionGrads = _grads("LocationAttentionGrads",
                                "location_attention_backward")
CosineAttentionGrads = _grads("CosineAttentionGrads",
                              "cosine_attention_backward")

# context-pooled attention: building blocks, each with its backward
mean_context = _publish("mean_context")
mean_context_backward = _publish("mean_context_backward")
additive_score = _publish("additive_score")
additive_score_backward = _publish("additive_score_backward")
masked_softmax = _publish("masked_softmax")
masked_softmax_backward = _publish("masked_softmax_backward")
weighted_sum = _publish("weighted_sum")
weighted_sum_backward = _publish("weighted_sum_backward")
# ... and the fused layer, one call each way
context_attention = _publish("context_attention")
context_attention_backward = _publish("context_attention_backward",
                                      AttentionGrads)
# the attention family: queries scored against keys, values averaged
additive_attention = _publish("additive_attention")
additive_attention_backward = _publish("additive_attention_backward",
                                       AdditiveAttentionGrads)
dot_attention = _publish("dot_attention")
dot_attention_backward = _publish("dot_attention_backward",
                                  DotAttentionGrads)
general_attention = _publish("general_attention")
general_attention_backward = _publish("general_attention_backward",
                                      GeneralAttentionGrads)
# the last scores of the seeds: Luong's location score, the content score
location_attention = _publish("location_attention")
location_attention_backward = _publish("location_attention_backward",
                                       LocationAttentionGrads)
cosine_attention = _publish("cosine_attention")
cosine_attention_backward = _publish("cosine_attention_backward",
                                     CosineAttentionGrads)
# the keys' side of a score, once per sequence (decoder loops)
project_keys = _publish("project_keys")
project_keys_backward = _publish("project_keys_backward")
