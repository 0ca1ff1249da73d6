"""The modules of attention_c.torch, as ``torch.nn.modules``: the layers
as ``nn.Module`` holding their parameters, on the C kernels (through the
functions of attention_c.torch.functional).

Forwards take the data by position and every option by keyword:
``module(h, *, mask=None)`` (ContextAttention) and ``module(query, keys, *,
values=None, mask=None, attn_mask=None, causal=False, key_proj=None)`` (the
attention family; DotAttention has no key_proj; DotAttention and
GeneralAttention also take ``bias=``), each with ``return_weights=True`` to
also return the attention weights.  DotAttention and GeneralAttention take
``dropout=`` at construction, like ``nn.MultiheadAttention``: applied in
training mode only, with a seed drawn from torch's default generator, so
that ``torch.manual_seed`` reproduces a run.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from attention_c.layers import _torch_weights

from ._utils import _DTYPES_TEXT, _FLOATS, _LOW
from .functional import (additive_attention, context_attention,
                         dot_attention, general_attention, project_keys)

__all__ = ["ContextAttention", "AdditiveAttention", "DotAttention",
           "GeneralAttention"]


def _module_dtype(dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of a module's parameters: float32, float64, bfloat16 or
    float16."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in _FLOATS + _LOW:
        raise TypeError(f"dtype must be one of {_DTYPES_TEXT}, got {dtype}")
    return dtype


def _uniform_(p: torch.Tensor | None, fan_in: int) -> None:
    """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` in place, as ``nn.Linear``."""
    if p is not None:
        bound = 1.0 / math.sqrt(fan_in)
        with torch.no_grad():
            p.uniform_(-bound, bound)


def _load_(p: torch.Tensor | None, x: np.ndarray | None) -> None:
    """Copy the loaded values ``x`` into the parameter ``p`` (both or
    neither None)."""
    if p is not None and x is not None:
        with torch.no_grad():
            p.copy_(torch.from_numpy(x))


def _result(out: torch.Tensor, alpha: torch.Tensor, return_weights: bool
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A forward's result: ``out``, or ``(out, alpha)``."""
    return (out, alpha) if return_weights else out


def _check_p(dropout: float) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a float, got "
                        f"{type(dropout).__name__}")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), not {dropout}")
    return float(dropout)


def _dropout_args(module: torch.nn.Module) -> dict[str, Any]:
    """``dropout=`` and ``seed=`` of a forward: the module's rate in
    training mode, with a seed (a 0-dim int64 tensor, 63 random bits)
    drawn from torch's default generator; none in eval mode."""
    p = getattr(module, "dropout")
    if not (module.training and p > 0):
        return {}
    # A tensor, not .item(): the draw stays in a compiled graph.
    return dict(dropout=p, seed=torch.randint(0, 2**63 - 1, (),
                                              dtype=torch.int64))


class ContextAttention(torch.nn.Module):
    """Context-pooled additive attention pooling as an ``nn.Module``.

    Pools ``h`` (..., T, H) to (..., H) with the weights
    ``alpha = masked softmax of v . tanh(W_h h_t + W_c c + b)``, ``c`` the
    mean of the valid items.  Runs the C kernels on the CPU.

    Parameters
    ----------
    hidden_size : int
        H.
    attention_size : int
        A, the width of the score network.
    bias : bool, optional
        Whether the score network has a bias (default True).
    dtype : torch.dtype, optional
        torch.float32 (default: ``torch.get_default_dtype()``) or
        torch.float64.

    Attributes
    ----------
    W : Parameter (A, 2H)
        Initialised like ``nn.Linear(2H, A).weight``.
    v : Parameter (A,)
        Initialised like ``nn.Linear(A, 1).weight``.
    b : Parameter (A,) or None
        Initialised like ``nn.Linear(2H, A).bias``.
    """

    def __init__(self, hidden_size: int, attention_size: int, *,
                 bias: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = _module_dtype(dtype)
        self.hidden_size = hidden_size
        self.attention_size = attention_size
        A, H = attention_size, hidden_size
        self.W = torch.nn.Parameter(torch.empty(A, 2 * H, dtype=dtype))
        self.v = torch.nn.Parameter(torch.empty(A, dtype=dtype))
        self.b = (torch.nn.Parameter(torch.empty(A, dtype=dtype)) if bias
                  else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` as in ``nn.Linear``."""
        _uniform_(self.W, 2 * self.hidden_size)
        _uniform_(self.b, 2 * self.hidden_size)
        _uniform_(self.v, self.attention_size)

    @classmethod
    def from_linear(cls, score: torch.nn.Linear,
                    out: torch.nn.Linear | torch.Tensor
                    ) -> ContextAttention:
        """The module computing ``out(tanh(score([h_t, c])))`` scores with
        the weights (copied) of a ``Linear(2H, A)``, ``Linear(A, 1)`` pair.

        ``out.bias`` is dropped: a constant added to every score does not
        change the softmax.  ``out`` may also be ``v`` itself, a tensor (A,)
        or (1, A).
        """
        W, v, b = _torch_weights._context_from_linear(score, out)
        module = cls(W.shape[1] // 2, W.shape[0], bias=b is not None,
                     dtype=score.weight.dtype)
        for p, x in [(module.W, W), (module.v, v), (module.b, b)]:
            _load_(p, x)
        return module

    def forward(self, h: torch.Tensor, *, mask: torch.Tensor | None = None,
                return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pool ``h`` (..., T, H) to (..., H).

        Parameters
        ----------
        h : Tensor (..., T, H)
        mask : Tensor of torch.bool (..., T), optional
            True marks a valid item.  Keyword-only, as ``return_weights``.
        return_weights : bool, optional
            Also return the attention weights (..., T).

        Returns
        -------
        out : Tensor (..., H)
            ``(out, alpha)`` with ``return_weights``.
        """
        out, alpha = context_attention(h, self.W, self.v, b=self.b, mask=mask)
        return _result(out, alpha, return_weights)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, "
                f"attention_size={self.attention_size}, "
                f"bias={self.b is not None}")


class AdditiveAttention(torch.nn.Module):
    """Additive (Bahdanau) attention as an ``nn.Module`` on the C kernels.

    ``s_it = v . tanh(W_k k_t + W_q q_i + b)``, ``alpha_i`` the masked
    softmax of ``s_i`` over the keys, ``out_i = sum_t alpha_it val_t``.

    Parameters
    ----------
    key_size : int
        H.
    query_size : int
        Hq.
    attention_size : int
        A, the width of the score network.
    bias : bool, optional
        Whether the score network has a bias (default True).
    dtype : torch.dtype, optional
        torch.float32 (default: ``torch.get_default_dtype()``) or
        torch.float64.

    Attributes
    ----------
    W : Parameter (A, H + Hq)
        ``[W_k | W_q]``, initialised like ``nn.Linear(H + Hq, A).weight``.
    v : Parameter (A,)
        Initialised like ``nn.Linear(A, 1).weight``.
    b : Parameter (A,) or None
        Initialised like ``nn.Linear(H + Hq, A).bias``.

    Examples
    --------
    A decoder that attends to the same keys at every step projects them
    once; autograd then carries their gradient once per sequence::

        attn = AdditiveAttention(key_size=64, query_size=32,
                                 attention_size=48)
        kp = attn.project_keys(keys)                   # (B, T, 48)
        for step in range(steps):
            context = attn(state, keys, mask=mask, key_proj=kp)
            state = cell(context, state)
    """

    def __init__(self, key_size: int, query_size: int, attention_size: int,
                 *, bias: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = _module_dtype(dtype)
        self.key_size, self.query_size = key_size, query_size
        self.attention_size = attention_size
        A, H, Hq = attention_size, key_size, query_size
        self.W = torch.nn.Parameter(torch.empty(A, H + Hq, dtype=dtype))
        self.v = torch.nn.Parameter(torch.empty(A, dtype=dtype))
        self.b = (torch.nn.Parameter(torch.empty(A, dtype=dtype)) if bias
                  else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` as in ``nn.Linear``."""
        _uniform_(self.W, self.key_size + self.query_size)
        _uniform_(self.b, self.key_size + self.query_size)
        _uniform_(self.v, self.attention_size)

    @classmethod
    def _from_weights(cls, W: np.ndarray, v: np.ndarray,
                      b: np.ndarray | None, key_size: int
                      ) -> AdditiveAttention:
        module = cls(key_size, W.shape[1] - key_size, W.shape[0],
                     bias=b is not None, dtype=torch.from_numpy(W).dtype)
        for p, x in [(module.W, W), (module.v, v), (module.b, b)]:
            _load_(p, x)
        return module

    @classmethod
    def from_linear(cls, score: torch.nn.Linear,
                    out: torch.nn.Linear | torch.Tensor,
                    key_size: int) -> AdditiveAttention:
        """The module computing ``out(tanh(score([k_t, q_i])))`` scores
        with the weights (copied) of a ``Linear(H + Hq, A)``,
        ``Linear(A, 1)`` pair.

        ``key_size`` is H: the first H inputs of ``score`` take the key,
        the others the query.  ``out`` may also be ``v`` itself, a tensor
        (A,) or (1, A); ``out.bias`` is dropped (a constant added to every
        score does not change the softmax).
        """
        W, v, b = _torch_weights._additive_from_linear(score, out, key_size)
        return cls._from_weights(W, v, b, key_size)

    @classmethod
    def from_d2l(cls, W_k: torch.nn.Linear, W_q: torch.nn.Linear,
                 w_v: torch.nn.Linear | torch.Tensor) -> AdditiveAttention:
        """The module computing d2l.ai's ``w_v(tanh(W_k(k_t) + W_q(q_i)))``
        scores with the weights (copied) of ``W_k = Linear(H, A)``, ``W_q =
        Linear(Hq, A)``, ``w_v = Linear(A, 1)`` (d2l's have no biases; any
        biases of ``W_k`` and ``W_q`` add up to ``b``, ``w_v``'s is
        dropped).

        d2l masks with ``valid_lens`` and gives a query with no valid key
        uniform weights; here it gets 0.
        """
        W, v, b, H = _torch_weights._additive_from_d2l(W_k, W_q, w_v)
        return cls._from_weights(W, v, b, H)

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """``W_k k_t`` (..., T, A) for ``forward(..., key_proj=)``."""
        return project_keys(keys, self.W)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, *,
                values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None,
                causal: bool = False,
                key_proj: torch.Tensor | None = None,
                return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` to ``keys``.

        Parameters
        ----------
        query : Tensor (..., Hq) or (..., Tq, Hq)
            Several queries when ``query.ndim == keys.ndim``.
        keys : Tensor (..., T, H)
        values : Tensor (..., T, Hv), optional
            Default: the keys.  Keyword-only, as every argument after
            ``keys``.
        mask : Tensor of torch.bool (..., T), optional
            The key mask: True marks a valid key, for every query.
        attn_mask : Tensor of torch.bool, optional
            Broadcastable to (..., Tq, T): True = query i may attend to
            key t (as ``F.scaled_dot_product_attention``'s boolean mask).
        causal : bool, optional
            Key t visible to query i iff ``t <= i + (T - Tq)``.
        key_proj : Tensor (..., T, A), optional
            :meth:`project_keys` of these keys, computed once per sequence.
        return_weights : bool, optional
            Also return the attention weights (..., T) or (..., Tq, T).

        Returns
        -------
        out : Tensor (..., Hv) or (..., Tq, Hv)
            ``(out, alpha)`` with ``return_weights``.
        """
        out, alpha = additive_attention(query, keys, self.W, self.v,
                                        b=self.b, mask=mask,
                                        attn_mask=attn_mask, causal=causal,
                                        values=values, key_proj=key_proj)
        return _result(out, alpha, return_weights)

    def extra_repr(self) -> str:
        return (f"key_size={self.key_size}, query_size={self.query_size}, "
                f"attention_size={self.attention_size}, "
                f"bias={self.b is not None}")


class DotAttention(torch.nn.Module):
    """Scaled dot-product attention as an ``nn.Module`` on the C kernels
    (no parameters): ``s_it = scale q_i . k_t + bias_it``.

    Parameters
    ----------
    scale : float, optional
        Default ``1/sqrt(H)``, H the features of a key and of a query.
    dropout : float, optional
        Dropout rate p in [0, 1) on the attention weights, in training
        mode only (``module.train()``, the default; none after
        ``module.eval()``), as ``nn.MultiheadAttention(dropout=)``.  Each
        training forward draws its seed from torch's default generator, so
        ``torch.manual_seed`` reproduces a run; the backward regenerates
        the same keep bits.
    """

    def __init__(self, *, scale: float | None = None,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.scale = None if scale is None else float(scale)
        self.dropout = _check_p(dropout)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, *,
                values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None,
                causal: bool = False,
                bias: torch.Tensor | None = None,
                return_weights: bool = False,
                window: tuple[int | None, int | None] | None = None,
                softcap: float | None = None,
                alibi_slopes: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None,
                cu_seqlens_q: torch.Tensor | None = None,
                cu_seqlens_k: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` (..., H) or (..., Tq, H) to ``keys``
        (..., T, H); arguments (keyword-only after ``keys``; no
        ``key_proj``: the scores use the keys as they are) and results as
        in :meth:`AdditiveAttention.forward`, and ``bias``, a float tensor
        broadcastable to (..., Tq, T) added to the scores (differentiable;
        -inf masks).

        Without ``return_weights`` the kernels never form the (..., Tq, T)
        weights (forward and backward work from ``out`` and the
        log-sum-exp); the weights returned with it are before dropout.

        ``window``, ``softcap``, ``alibi_slopes``, ``sinks``,
        ``cu_seqlens_q`` and ``cu_seqlens_k`` are the variants of
        :func:`attention_c.torch.dot_attention`, per call (a learned
        ``sinks`` or ``alibi_slopes`` is the caller's parameter).
        """
        out, second = dot_attention(
            query, keys, mask=mask, attn_mask=attn_mask, causal=causal,
            bias=bias, values=values, scale=self.scale,
            return_weights=return_weights, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            **_dropout_args(self))
        return _result(out, second, return_weights)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, dropout={self.dropout}"


class GeneralAttention(torch.nn.Module):
    """Multiplicative ("general", Luong) attention as an ``nn.Module`` on
    the C kernels: ``s_it = q_i . (W_a k_t)``.

    Parameters
    ----------
    query_size : int
        Hq.
    key_size : int
        H.
    dropout : float, optional
        As in :class:`DotAttention`: in training mode only, the seed of
        each forward drawn from torch's default generator.
    dtype : torch.dtype, optional
        torch.float32 (default: ``torch.get_default_dtype()``) or
        torch.float64.

    Attributes
    ----------
    W : Parameter (Hq, H)
        ``W_a``, initialised like ``nn.Linear(H, Hq, bias=False).weight``.
    """

    def __init__(self, query_size: int, key_size: int, *,
                 dropout: float = 0.0,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = _module_dtype(dtype)
        self.dropout = _check_p(dropout)
        self.query_size, self.key_size = query_size, key_size
        self.W = torch.nn.Parameter(torch.empty(query_size, key_size,
                                                dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(H), 1/sqrt(H))`` as in ``nn.Linear(H, Hq)``."""
        _uniform_(self.W, self.key_size)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> GeneralAttention:
        """The module computing ``q_i . linear(k_t)`` scores with the weight
        (copied) of a ``Linear(H, Hq)``.  A bias would add ``q_i . bias``
        to every score of query i, which leaves its softmax as it is: it is
        dropped."""
        W = _torch_weights._general_from_linear(linear)
        module = cls(W.shape[0], W.shape[1], dtype=torch.from_numpy(W).dtype)
        _load_(module.W, W)
        return module

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """``W_a k_t`` (..., T, Hq) for ``forward(..., key_proj=)``."""
        return project_keys(keys, self.W)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, *,
                values: torch.Tensor | None = None,
                mask: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None,
                causal: bool = False,
                bias: torch.Tensor | None = None,
                key_proj: torch.Tensor | None = None,
                return_weights: bool = False,
                window: tuple[int | None, int | None] | None = None,
                softcap: float | None = None,
                alibi_slopes: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None,
                cu_seqlens_q: torch.Tensor | None = None,
                cu_seqlens_k: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` (..., Hq) or (..., Tq, Hq) to ``keys``
        (..., T, H); arguments (keyword-only after ``keys``, the variants
        included) and results as in :meth:`DotAttention.forward` (and
        ``key_proj`` (..., T, Hq), as in
        :meth:`AdditiveAttention.forward`)."""
        out, second = general_attention(
            query, keys, self.W, mask=mask, attn_mask=attn_mask,
            causal=causal, bias=bias, values=values, key_proj=key_proj,
            return_weights=return_weights, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            **_dropout_args(self))
        return _result(out, second, return_weights)

    def extra_repr(self) -> str:
        return (f"query_size={self.query_size}, key_size={self.key_size}, "
                f"dropout={self.dropout}")


# torch.fx.symbolic_trace of a model records the forwards' calls of these
# functions as leaves (its proxies carry no data for the checks and
# kernels); they run at call time.  torch.fx.wrap patches the names in the
# namespace of the module that calls it: this one's, for the forwards.
for _name in ("context_attention", "additive_attention", "dot_attention",
              "general_attention", "project_keys"):
    torch.fx.wrap(_name)
del _name


def _no_script(self: torch.nn.Module) -> torch.nn.Module:
    """``torch.jit.script`` calls this first: refuse with a clear error
    (TorchScript cannot compile the Python around the operators, and is
    deprecated in PyTorch)."""
    raise RuntimeError(
        f"torch.jit.script is not supported for attention_c.torch."
        f"{type(self).__name__}: use torch.compile or torch.export, which "
        f"support its operators (torch.ops.attention_c.*)")


for _cls in (ContextAttention, AdditiveAttention, DotAttention,
             GeneralAttention):
    setattr(_cls, "__prepare_scriptable__", _no_script)
del _cls
