"""The location and content (cosine) scores in attention_c.torch: their
differentiable functions (as :mod:`attention_c.torch.functional`'s) and
their ``nn.Module`` layers (as :mod:`attention_c.torch.modules`').

- location (Luong 2015, eq. 8): ``s_it = W_t . q_i + b_t``, one row of
  ``W`` per source position, from the query alone:
  :func:`location_attention`, :class:`LocationAttention`;
- content (cosine; Graves 2014): ``s_it = beta_i n(q_i) . n(k_t)``, ``n``
  the L2 normalisation of ``F.normalize``, then every argument of
  :func:`attention_c.torch.dot_attention` but ``scale``:
  :func:`cosine_attention`, :class:`CosineAttention`.

Each function checks its arguments (in PyTorch's terms), casts bfloat16
and float16 to float32, and calls a custom operator
(attention_c.torch._scores_ops): one C call forward, one backward.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch

from attention_c.layers import _torch_weights

from . import _scores_ops  # noqa: F401  (registers the operators)
from ._autograd import _call
from ._utils import _back, _check_tensors, _f32
from .functional import (_FAMILY_RETURNS, _MASKS_DOC, _SEC5_DOC,
                         _VARIANTS_DOC, _check_bias, _check_masks,
                         _check_variants, _dropout_seed)
from .modules import (_check_p, _dropout_args, _load_, _module_dtype,
                      _no_script, _result, _uniform_)

__all__ = ["location_attention", "cosine_attention", "LocationAttention",
           "CosineAttention"]


def location_attention(query: torch.Tensor, values: torch.Tensor,
                       W: torch.Tensor, *, b: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None,
                       attn_mask: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Location attention (Luong 2015, eq. 8) on CPU tensors,
    differentiable: ``s_it = W_t . q_i + b_t``, the scores of
    ``F.linear(query, W[:T], b[:T])``, then the masked softmax over the T
    positions of ``values``.

    Same maths, arguments and shapes as
    :func:`attention_c.location_attention` (the dot score with keys
    ``W[:T]``, scale 1 and bias ``b[:T]``); the gradients are the C
    backward (W's rows t >= T get exactly 0).

    Parameters
    ----------
    query : Tensor (..., Hq) or (..., Tq, Hq)
        One query per sequence, or several when ``query.ndim ==
        values.ndim``.  float32 or float64 (bfloat16 and float16 computed
        in float32), on the CPU; every other float tensor of the same
        dtype.
    values : Tensor (..., T, Hv)
        Leading axes broadcast against the query's.
    W : Tensor (T_max, Hq)
        T_max >= T; the layout of ``torch.nn.Linear(Hq, T_max).weight``,
        shared by every sequence (no leading axes).
    b : Tensor (T_max,), optional
        Keyword-only, as every optional argument.
    mask : Tensor of torch.bool (..., T), optional
        The position mask, the same for every query: True marks a valid
        position (the opposite of ``key_padding_mask`` of
        ``nn.MultiheadAttention``).
    attn_mask : Tensor of torch.bool, optional
        Broadcastable to (..., Tq, T): True = query i may attend to
        position t.  Several queries only.

    Returns
    -------
    out : Tensor (..., Hv) or (..., Tq, Hv)
        0 for a query with no visible position.
    alpha : Tensor (..., T) or (..., Tq, T)
        The attention weights, 0 at masked positions.

    Raises
    ------
    ValueError
        A tensor not on the CPU, a mask that requires grad, a per-query
        mask given as ``mask``, ``attn_mask`` with one query per sequence,
        W with fewer rows than T or b of another length than W's rows.
    TypeError
        A dtype other than float32, float64, bfloat16 and float16, mixed
        dtypes (outside ``torch.autocast``), a mask that is not boolean.
    """
    low = _check_tensors([("query", query), ("values", values), ("W", W),
                          ("b", b)], mask, "position", attn_mask=attn_mask)
    _check_masks(query, values, mask, attn_mask, False, "values")
    out, alpha = _call("location", _f32(query, low), _f32(values, low),
                       _f32(W, low), _f32(b, low), mask, attn_mask)
    return _back(out, alpha, low)


def _sharpness(sharpness: Any) -> tuple[Any, float | None]:
    """(the tensor, None) or (None, the number) of ``sharpness``; a number
    must be finite, anything else is checked as a tensor."""
    if isinstance(sharpness, numbers.Real) and not isinstance(
            sharpness, (bool, np.bool_)):       # NumPy's scalars too
        if not math.isfinite(sharpness):
            raise ValueError(f"sharpness must be finite, got {sharpness!r} "
                             f"(a tensor's NaN propagates as data; a "
                             f"number's is an error)")
        return None, float(sharpness)
    if sharpness is not None and not isinstance(
            sharpness, (torch.Tensor, torch.fx.Proxy)):
        raise TypeError(f"sharpness must be None, a number or a "
                        f"torch.Tensor, got {type(sharpness).__name__}")
    return sharpness, None


def cosine_attention(query: torch.Tensor, keys: torch.Tensor, *,
                     mask: torch.Tensor | None = None,
                     attn_mask: torch.Tensor | None = None,
                     causal: bool = False,
                     bias: torch.Tensor | None = None,
                     dropout: float = 0.0,
                     seed: int | torch.Tensor | None = None,
                     values: torch.Tensor | None = None,
                     sharpness: float | torch.Tensor | None = None,
                     return_weights: bool = True,
                     window: tuple[int | None, int | None] | None = None,
                     softcap: float | None = None,
                     alibi_slopes: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None,
                     cu_seqlens_q: torch.Tensor | None = None,
                     cu_seqlens_k: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Content (cosine) attention on CPU tensors, differentiable:
    ``s_it = softcap(beta_i n(q_i) . n(k_t)) + bias_it - slope |i' - t|``,
    ``n(x) = x / max(||x||, 1e-12)`` (``F.normalize``: a zero vector
    scores 0).

    Same maths, arguments and shapes as
    :func:`attention_c.cosine_attention`: the dot score of the normalised
    query and keys, scaled by ``sharpness`` instead of ``scale``; every
    other argument as in :func:`attention_c.torch.dot_attention`.  The
    gradients are the C backward.

    Parameters
    ----------
    query : Tensor (..., H) or (..., Tq, H)
        One query per sequence, or several when ``query.ndim ==
        keys.ndim``.  float32 or float64 (bfloat16 and float16 computed
        in float32), on the CPU.
    keys : Tensor (..., T, H)
    %(masks)s
    %(sec5)s
    values : Tensor (..., T, Hv), optional
        Default: the keys (as given, not normalised).
    sharpness : float or Tensor, optional
        beta: None (1), a finite Python number (a constant), or a float
        tensor of the queries' dtype broadcastable to the query positions
        (..., Tq) ((...) with one query), differentiable: its gradient is
        summed to its shape.  A tensor's NaN propagates as data.
    %(variants)s
    """
    _check_bias(bias)
    beta, number = _sharpness(sharpness)
    low = _check_tensors([("query", query), ("keys", keys),
                          ("values", values), ("bias", bias),
                          ("sharpness", beta)], mask, "key",
                         attn_mask=attn_mask)
    _check_masks(query, keys, mask, attn_mask, causal)
    p, seed_t = _dropout_seed(dropout, seed)
    var = _check_variants(query, keys, window, softcap, alibi_slopes, sinks,
                          cu_seqlens_q, cu_seqlens_k, low)
    if number is not None:
        # a constant: a 0-dim tensor without grad (the op's Tensor?)
        beta = torch.full((), number, dtype=low or query.dtype,
                          device=query.device)
    out, second = _call("cosine", _f32(query, low), _f32(keys, low), mask,
                        attn_mask, causal, _f32(bias, low), p, seed_t,
                        _f32(values, low), _f32(beta, low),
                        bool(return_weights), *var, cu_seqlens_q,
                        cu_seqlens_k)
    return _back(out, second, low, lse=not return_weights)


cosine_attention.__doc__ = (cosine_attention.__doc__ or "") % dict(
    masks=_MASKS_DOC, sec5=_SEC5_DOC, variants=_VARIANTS_DOC
) + _FAMILY_RETURNS


class LocationAttention(torch.nn.Module):
    """Location attention (Luong 2015, eq. 8) as an ``nn.Module`` on the C
    kernels: ``alpha_i = masked softmax of Linear(Hq, max_length)(q_i)[:T]``
    over the T positions of the values, ``out_i = sum_t alpha_it v_t``.

    Parameters
    ----------
    query_size : int
        Hq.
    max_length : int
        T_max, the longest source (values) sequence the layer attends to.
    bias : bool, optional
        Whether the scores have a bias per position (default True).
    dtype : torch.dtype, optional
        torch.float32 (default: ``torch.get_default_dtype()``) or
        torch.float64.

    Attributes
    ----------
    W : Parameter (max_length, Hq)
        Initialised like ``nn.Linear(Hq, max_length).weight``.
    b : Parameter (max_length,) or None
        Initialised like ``nn.Linear(Hq, max_length).bias``.
    """

    def __init__(self, query_size: int, max_length: int, *,
                 bias: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = _module_dtype(dtype)
        self.query_size, self.max_length = query_size, max_length
        self.W = torch.nn.Parameter(torch.empty(max_length, query_size,
                                                dtype=dtype))
        self.b = (torch.nn.Parameter(torch.empty(max_length, dtype=dtype))
                  if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(Hq), 1/sqrt(Hq))`` as in ``nn.Linear(Hq, T_max)``."""
        _uniform_(self.W, self.query_size)
        _uniform_(self.b, self.query_size)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> LocationAttention:
        """The module whose scores are ``linear(q_i)[:T]``, with the weight
        and bias (copied) of a ``Linear(Hq, T_max)``."""
        W = _torch_weights._torch_array(linear.weight, "linear.weight")
        if W.ndim != 2:
            raise ValueError(f"linear.weight has shape {W.shape}; expected "
                             f"(T_max, Hq) of a Linear(Hq, T_max)")
        b = (None if linear.bias is None
             else _torch_weights._torch_array(linear.bias, "linear.bias"))
        module = cls(W.shape[1], W.shape[0], bias=b is not None,
                     dtype=linear.weight.dtype)
        _load_(module.W, W)
        _load_(module.b, b)
        return module

    def forward(self, query: torch.Tensor, values: torch.Tensor, *,
                mask: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None,
                return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` (..., Hq) or (..., Tq, Hq) to the T <=
        max_length positions of ``values`` (..., T, Hv).

        Parameters
        ----------
        query : Tensor (..., Hq) or (..., Tq, Hq)
            Several queries when ``query.ndim == values.ndim``.
        values : Tensor (..., T, Hv)
        mask : Tensor of torch.bool (..., T), optional
            True marks a valid position, for every query.  Keyword-only,
            as every argument after ``values``.
        attn_mask : Tensor of torch.bool, optional
            Broadcastable to (..., Tq, T): True = query i may attend to
            position t.
        return_weights : bool, optional
            Also return the attention weights (..., T) or (..., Tq, T).

        Returns
        -------
        out : Tensor (..., Hv) or (..., Tq, Hv)
            ``(out, alpha)`` with ``return_weights``.
        """
        out, alpha = location_attention(query, values, self.W, b=self.b,
                                        mask=mask, attn_mask=attn_mask)
        return _result(out, alpha, return_weights)

    def extra_repr(self) -> str:
        return (f"query_size={self.query_size}, "
                f"max_length={self.max_length}, bias={self.b is not None}")


class CosineAttention(torch.nn.Module):
    """Content (cosine) attention as an ``nn.Module`` on the C kernels:
    ``s_it = beta n(q_i) . n(k_t)`` (the Neural Turing Machine's content
    addressing), ``n`` the L2 normalisation of ``F.normalize``.

    Parameters
    ----------
    sharpness : float, optional
        beta, a finite number (default None: 1); with ``learn_sharpness``
        the initial value of the learned one (None: 1).
    learn_sharpness : bool, optional
        Learn beta: a 0-dim Parameter ``sharpness``, trained with the
        model (default False: a constant).
    dropout : float, optional
        As in :class:`attention_c.torch.DotAttention`: in training mode
        only, the seed of each forward drawn from torch's default
        generator.
    dtype : torch.dtype, optional
        The learned sharpness's: torch.float32 (default:
        ``torch.get_default_dtype()``) or torch.float64.

    Attributes
    ----------
    sharpness : Parameter () or float or None
        A Parameter with ``learn_sharpness``.
    """

    sharpness: torch.Tensor | float | None

    def __init__(self, *, sharpness: float | None = None,
                 learn_sharpness: bool = False, dropout: float = 0.0,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = _module_dtype(dtype)
        self.dropout = _check_p(dropout)
        self.learn_sharpness = bool(learn_sharpness)
        _, number = _sharpness(sharpness)
        if sharpness is not None and number is None:
            raise TypeError(f"sharpness must be a number or None, got "
                            f"{type(sharpness).__name__} (a sharpness per "
                            f"query goes to forward(sharpness=))")
        self._initial = 1.0 if number is None else number
        if self.learn_sharpness:
            self.sharpness = torch.nn.Parameter(torch.empty((), dtype=dtype))
            self.reset_parameters()
        else:
            self.sharpness = number

    def reset_parameters(self) -> None:
        """The learned sharpness back to its initial value."""
        if isinstance(self.sharpness, torch.Tensor):
            with torch.no_grad():
                self.sharpness.fill_(self._initial)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, *,
                values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None,
                causal: bool = False,
                bias: torch.Tensor | None = None,
                sharpness: float | torch.Tensor | None = None,
                return_weights: bool = False,
                window: tuple[int | None, int | None] | None = None,
                softcap: float | None = None,
                alibi_slopes: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None,
                cu_seqlens_q: torch.Tensor | None = None,
                cu_seqlens_k: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` (..., H) or (..., Tq, H) to ``keys``
        (..., T, H); arguments (keyword-only after ``keys``) and results
        as in :meth:`attention_c.torch.DotAttention.forward`, and
        ``sharpness``, a number or a tensor broadcastable to the query
        positions (..., Tq) (e.g. the key strength an NTM controller
        emits), multiplying the module's (differentiable when a tensor).

        Without ``return_weights`` the kernels never form the (..., Tq, T)
        weights; the weights returned with it are before dropout.
        """
        beta = self.sharpness
        if sharpness is not None:
            beta = sharpness if beta is None else beta * sharpness
        out, second = cosine_attention(
            query, keys, mask=mask, attn_mask=attn_mask, causal=causal,
            bias=bias, values=values, sharpness=beta,
            return_weights=return_weights, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            **_dropout_args(self))
        return _result(out, second, return_weights)

    def extra_repr(self) -> str:
        beta = ("learn_sharpness=True" if self.learn_sharpness
                else f"sharpness={self.sharpness}")
        return f"{beta}, dropout={self.dropout}"


# torch.fx.symbolic_trace records calls of these functions (direct ones,
# and the forwards', which look them up in this namespace) as leaves.
for _name in ("location_attention", "cosine_attention"):
    torch.fx.wrap(_name)
del _name

for _cls in (LocationAttention, CosineAttention):
    setattr(_cls, "__prepare_scriptable__", _no_script)
del _cls
