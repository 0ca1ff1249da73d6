"""Weights of PyTorch layers as NumPy arrays: one place for the loaders
of the NumPy layers (``from_torch``, ``from_d2l``) and of attention_c.torch.

Nothing here imports torch at module level: only a caller that holds
PyTorch objects reaches it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._common import Array


def _torch_array(t: Any, name: str) -> Array:
    """A NumPy copy of the values of a PyTorch tensor or Parameter."""
    from torch.nn.parameter import is_lazy   # the caller has torch objects
    if is_lazy(t):
        raise ValueError(f"{name} is not initialised yet (a lazy layer such "
                         f"as nn.LazyLinear): run the model on an input "
                         f"once before loading its weights")
    t = t.detach().cpu()
    if not t.is_floating_point() or t.dtype.itemsize < 4:
        t = t.float()                # bfloat16 has no NumPy dtype
    arr: Array = np.array(t.numpy())                   # a copy
    return arr


def _v_from(out: Any, A: int, name: str = "out") -> Array:
    """v (A,) from a ``Linear(A, 1)``, or from a tensor (A,) or (1, A)."""
    weight = getattr(out, "weight", out)
    what = f"{name}.weight" if weight is not out else name
    v = _torch_array(weight, what)
    if v.shape not in ((A,), (1, A)):
        raise ValueError(f"{what} has shape {v.shape}; expected (1, {A}) of "
                         f"a Linear({A}, 1), or v of shape ({A},)")
    return v.reshape(A)


def _context_from_linear(score: Any, out: Any
                         ) -> tuple[Array, Array, Array | None]:
    """(W, v, b) of a ``Linear(2H, A)`` on ``[h_t; c]`` and a
    ``Linear(A, 1)``; ``out``'s bias is dropped (it shifts every score)."""
    W = _torch_array(score.weight, "score.weight")
    if W.ndim != 2 or W.shape[1] % 2:
        raise ValueError(f"score.weight has shape {W.shape}; expected "
                         f"(A, 2H) of a Linear(2H, A)")
    b = None if score.bias is None else _torch_array(score.bias,
                                                     "score.bias")
    return W, _v_from(out, W.shape[0]), b


def _additive_from_linear(score: Any, out: Any, key_size: int
                          ) -> tuple[Array, Array, Array | None]:
    """(W, v, b) of a ``Linear(H + Hq, A)`` on ``[k_t; q_i]`` and a
    ``Linear(A, 1)``; ``out``'s bias is dropped (it shifts every score)."""
    W = _torch_array(score.weight, "score.weight")
    if W.ndim != 2 or not 0 < key_size < W.shape[1]:
        raise ValueError(f"score.weight has shape {W.shape}; expected "
                         f"(A, H + Hq) of a Linear(H + Hq, A) with "
                         f"H = key_size = {key_size} and Hq >= 1")
    b = None if score.bias is None else _torch_array(score.bias,
                                                     "score.bias")
    return W, _v_from(out, W.shape[0]), b


def _additive_from_d2l(W_k: Any, W_q: Any, w_v: Any
                       ) -> tuple[Array, Array, Array | None, int]:
    """(W, v, b, H) of d2l's ``W_k = Linear(H, A)``, ``W_q = Linear(Hq,
    A)``, ``w_v = Linear(A, 1)``: ``W = [W_k | W_q]``, ``b`` the sum of the
    biases of W_k and W_q (None if neither has one)."""
    Wk = _torch_array(W_k.weight, "W_k.weight")
    Wq = _torch_array(W_q.weight, "W_q.weight")
    if Wk.ndim != 2 or Wq.ndim != 2 or Wk.shape[0] != Wq.shape[0]:
        raise ValueError(f"W_k.weight has shape {Wk.shape} and W_q.weight "
                         f"{Wq.shape}; expected (A, H) and (A, Hq) of a "
                         f"Linear(H, A) and a Linear(Hq, A)")
    biases = [_torch_array(lin.bias, f"{name}.bias")
              for name, lin in (("W_k", W_k), ("W_q", W_q))
              if lin.bias is not None]
    b = None if not biases else sum(biases[1:], biases[0])
    W = np.concatenate([Wk, Wq], axis=1)
    return W, _v_from(w_v, W.shape[0], "w_v"), b, Wk.shape[1]


def _cast_weights(dtype: np.dtype[Any], W: Array, v: Array,
                  b: Array | None) -> tuple[Array, Array, Array | None]:
    """Loaded (W, v, b) in a layer's dtype (they are copies already)."""
    return (W.astype(dtype, copy=False), v.astype(dtype, copy=False),
            None if b is None else b.astype(dtype, copy=False))


def _general_from_linear(linear: Any) -> Array:
    """W (Hq, H) of a ``Linear(H, Hq)`` applied to the keys; its bias is
    dropped (q_i . bias is the same for every key of a query)."""
    W = _torch_array(linear.weight, "linear.weight")
    if W.ndim != 2:
        raise ValueError(f"linear.weight has shape {W.shape}; expected "
                         f"(Hq, H) of a Linear(H, Hq)")
    return W


def _multihead_from_torch(mha: Any) -> tuple[dict[str, Array], bool]:
    """The weights of a ``torch.nn.MultiheadAttention`` by the NumPy
    layer's names, and whether it has biases; NotImplementedError for what
    the layer does not have (bias_k / bias_v, add_zero_attn, one bias
    without the other)."""
    if getattr(mha, "bias_k", None) is not None:
        raise NotImplementedError(
            "MultiHeadAttention.from_torch: add_bias_kv=True (the "
            "learned bias_k / bias_v rows) is not supported")
    if getattr(mha, "add_zero_attn", False):
        raise NotImplementedError(
            "MultiHeadAttention.from_torch: add_zero_attn=True is not "
            "supported")
    if mha._qkv_same_embed_dim:
        weights = {"in_proj_weight": _torch_array(mha.in_proj_weight,
                                                  "in_proj_weight")}
    else:
        weights = {n: _torch_array(getattr(mha, n), n)
                   for n in ("q_proj_weight", "k_proj_weight",
                             "v_proj_weight")}
    weights["out_proj_weight"] = _torch_array(mha.out_proj.weight,
                                              "out_proj.weight")
    bias = mha.in_proj_bias is not None
    if bias:
        weights["in_proj_bias"] = _torch_array(mha.in_proj_bias,
                                               "in_proj_bias")
    if mha.out_proj.bias is not None:
        if not bias:
            raise NotImplementedError(
                "MultiHeadAttention.from_torch: an out_proj bias "
                "without in_proj_bias is not supported")
        weights["out_proj_bias"] = _torch_array(mha.out_proj.bias,
                                                "out_proj.bias")
    elif bias:
        raise NotImplementedError(
            "MultiHeadAttention.from_torch: in_proj_bias without an "
            "out_proj bias is not supported")
    return weights, bias
