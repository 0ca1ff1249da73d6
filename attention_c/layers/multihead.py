"""Multi-head attention as a trainable NumPy layer, and its decoding cache
(re-exported by attention_c.multihead, whose docstring shows their use).

:class:`MultiHeadAttention` is ``torch.nn.MultiheadAttention`` in NumPy
(docs/contract.md section 5, the masks with True = valid): the inputs are
projected, the heads are read in place from the projections as strided
views (..., h, T, d), one call of :func:`attention_c.dot_attention` attends
every head of every sequence, and the heads are concatenated for the
output projection.  :class:`KVCache` keeps the projected keys and values
of a decoder between calls, in a preallocated buffer that a one-token
step appends to and attends to without copying it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .. import dot_attention, dot_attention_backward
from ..cache import cache_attention
from .._keywords import keyword_only
from ._common import (Array, _bool_mask, _broadcasts_into, _check_array,
                      _dropout_p, _float_dtype, _positive)
from ._torch_weights import _multihead_from_torch
from .kvcache import KVCache

__all__ = ["MultiHeadAttention", "KVCache", "MultiHeadInputGrads"]


class MultiHeadInputGrads(NamedTuple):
    """Gradients of the loss with respect to the inputs of a
    :class:`MultiHeadAttention` call, returned by its ``backward``.

    An argument that was not given (``key`` defaulting to the query,
    ``value`` to the key) has no field of its own: its gradient is added
    to the field of the input it defaulted to, and its own field is None.
    For self-attention, ``layer(x)``, ``query`` is the whole gradient of
    ``x``.  An argument given explicitly gets its own field even when it
    is the same array as another (``layer(x, x, x)``): the fields then add
    up to the gradient of ``x``.

    Attributes
    ----------
    query : ndarray, the shape of the query
    key : ndarray, the shape of the key, or None
        None when the call had no ``key``.
    value : ndarray, the shape of the value, or None
        None when the call had no ``value``.
    """

    query: Array
    key: Array | None
    value: Array | None


def _linear(x: Array, W: Array, b: Array | None) -> Array:
    """``x @ W.T + b`` over the last axis, as one matrix product."""
    y: Array = x.reshape(-1, x.shape[-1]) @ W.T
    if b is not None:
        y += b
    return y.reshape(x.shape[:-1] + (W.shape[0],))


def _split_heads(p: Array, h: int) -> Array:
    """(..., T, h*d) -> the view (..., h, T, d): no copy (the kernel reads
    strided views in place)."""
    return p.reshape(p.shape[:-1] + (h, p.shape[-1] // h)).swapaxes(-2, -3)


def _merge_heads(x: Array) -> Array:
    """(..., h, T, d) -> (..., T, h*d) (a copy: the heads interleave)."""
    t = x.swapaxes(-2, -3)
    return t.reshape(t.shape[:-2] + (t.shape[-2] * t.shape[-1],))


class MultiHeadAttention:
    """Multi-head scaled dot-product attention as a trainable NumPy layer,
    the NumPy twin of ``torch.nn.MultiheadAttention``.

    ``q = query W_q^T + b_q``, ``k = key W_k^T + b_k``, ``v = value W_v^T
    + b_v`` (..., T, E) are split into ``h`` heads of ``d = E / h``
    features, each head attends (scale ``1/sqrt(d)``), and the heads'
    outputs, concatenated, go through ``out = o W_o^T + b_o``.  The heads
    are strided views of the projections (no per-head copies) and all of
    them attend in one call of :func:`attention_c.dot_attention`.

    Parameters
    ----------
    embed_dim : int
        E, the features of the query and of the output.
    num_heads : int
        h; E must be a multiple of h.
    kdim, vdim : int, optional
        The features of the key and of the value (default E).  When
        either differs from E the input projections are separate
        matrices, as in PyTorch.
    bias : bool, optional
        Whether the projections have biases (default True).
    dropout : float, optional
        p in [0, 1): dropout on the attention weights while
        :attr:`training`.
    seed : int or numpy.random.Generator, optional
        Seed of the initialisation (PyTorch's: Xavier-uniform input
        projections, ``U(-1/sqrt(E), 1/sqrt(E))`` output projection, zero
        biases; drawn in float64, so every dtype gets the same model),
        then of the dropout: each call in training draws a new seed
        ``rng.integers(0, 2**63)`` and its backward regenerates the same
        keep pattern from it.  Default 0.
    dtype : dtype, optional
        float32 or float64 (default float64): the dtype of the parameters,
        of the computation and of every result.  Inputs are converted.
    sinks : bool, optional
        Give every head a learned sink (gpt-oss): one extra logit per
        head in each query's softmax, with no value, so a head can put
        weight nowhere.  The parameter :attr:`sinks` (h,), initialised to
        0, is then in :meth:`parameters` and :meth:`grads`.  Default
        False.
    alibi_slopes : array_like (h,), optional
        ALiBi: ``-m_head |i' - t|`` added to the scores of each head,
        fixed (not trained), e.g. Press et al.'s ``2.0 ** (-8 * np.arange(1,
        h + 1) / h)``.  Default None.

    Attributes
    ----------
    in_proj_weight : ndarray (3E, E) or None
        ``[W_q; W_k; W_v]`` when kdim = vdim = E (None otherwise).
    q_proj_weight, k_proj_weight, v_proj_weight : ndarray or None
        (E, E), (E, kdim), (E, vdim) when kdim or vdim differ from E.
    in_proj_bias : ndarray (3E,) or None
    out_proj_weight : ndarray (E, E)
    out_proj_bias : ndarray (E,) or None
        The names of PyTorch's ``state_dict`` with ``out_proj.weight`` and
        ``out_proj.bias`` spelt with an underscore.
    sinks : ndarray (h,) or None
        The heads' sink logits (``sinks=True``), a parameter.
    alibi_slopes : ndarray (h,) or None
        The heads' fixed ALiBi slopes.
    attention_weights : ndarray (..., h, Tq, S) or None
        The per-head weights of the last call (before dropout), None after
        a call with ``return_weights=False``.
    training : bool
        Dropout on (default True); :meth:`train` and :meth:`eval`.

    Notes
    -----
    Masks follow docs/contract.md section 5: True = valid, the opposite of
    ``nn.MultiheadAttention``'s boolean masks.  A query with no visible
    key gives 0 (PyTorch gives NaN).  The layer keeps references to the
    inputs of the last call (not copies) for :meth:`backward`, which
    *overwrites* the stored gradients.

    Examples
    --------
    >>> import numpy as np
    >>> from attention_c.multihead import MultiHeadAttention
    >>> mha = MultiHeadAttention(8, 2, seed=0)
    >>> x = np.random.default_rng(1).standard_normal((3, 5, 8))  # (B, T, E)
    >>> out = mha(x, causal=True)                                 # self
    >>> g = mha.backward(np.ones_like(out))
    >>> out.shape, g.query.shape, g.key, mha.grads()["in_proj_weight"].shape
    ((3, 5, 8), (3, 5, 8), None, (24, 8))
    >>> mem = np.random.default_rng(2).standard_normal((3, 7, 8))
    >>> out, w = mha(x, mem, return_weights=True)                 # cross
    >>> w.shape, bool(np.allclose(w.sum(-1), 1))
    ((3, 5, 7), True)
    """

    @keyword_only
    def __init__(self, embed_dim: int, num_heads: int, *,
                 kdim: int | None = None, vdim: int | None = None,
                 bias: bool = True, dropout: float = 0.0,
                 seed: int | np.random.Generator | None = 0,
                 dtype: npt.DTypeLike = np.float64, sinks: bool = False,
                 alibi_slopes: npt.ArrayLike | None = None) -> None:
        self.dtype: np.dtype[Any] = _float_dtype(dtype)
        E, h = int(embed_dim), int(num_heads)
        kdim = E if kdim is None else int(kdim)
        vdim = E if vdim is None else int(vdim)
        _positive(embed_dim=E, num_heads=h, kdim=kdim, vdim=vdim)
        if E % h:
            raise ValueError(f"embed_dim must be divisible by num_heads, got "
                             f"embed_dim={E} and num_heads={h}")
        self.embed_dim, self.num_heads = E, h
        self.head_dim = E // h
        self.kdim, self.vdim = kdim, vdim
        self.dropout = _dropout_p(dropout)
        self.training = True
        rng = np.random.default_rng(seed)
        self._rng = rng
        self._packed = kdim == E and vdim == E

        def xavier(shape: tuple[int, int]) -> Array:
            bound = np.sqrt(6.0 / (shape[0] + shape[1]))
            return rng.uniform(-bound, bound, size=shape).astype(self.dtype)

        self.in_proj_weight: Array | None = None
        self.q_proj_weight: Array | None = None
        self.k_proj_weight: Array | None = None
        self.v_proj_weight: Array | None = None
        if self._packed:
            self.in_proj_weight = xavier((3 * E, E))
            self._param_names: tuple[str, ...] = ("in_proj_weight",)
        else:
            self.q_proj_weight = xavier((E, E))
            self.k_proj_weight = xavier((E, kdim))
            self.v_proj_weight = xavier((E, vdim))
            self._param_names = ("q_proj_weight", "k_proj_weight",
                                 "v_proj_weight")
        bound = 1.0 / np.sqrt(E)
        self.out_proj_weight: Array = rng.uniform(
            -bound, bound, size=(E, E)).astype(self.dtype)
        self.in_proj_bias: Array | None = (
            np.zeros(3 * E, self.dtype) if bias else None)
        self.out_proj_bias: Array | None = (
            np.zeros(E, self.dtype) if bias else None)
        self._param_names += ("in_proj_bias", "out_proj_weight",
                              "out_proj_bias", "sinks")
        # Drawn after every other weight: a layer with sinks has the same
        # initial weights as one without.
        self.sinks: Array | None = (np.zeros(h, self.dtype) if sinks
                                    else None)
        self.alibi_slopes: Array | None = None
        if alibi_slopes is not None:
            slopes = _check_array(alibi_slopes, "alibi_slopes")
            if slopes.shape != (h,):
                raise ValueError(f"alibi_slopes has shape {slopes.shape}; "
                                 f"expected ({h},), one slope per head")
            self.alibi_slopes = slopes.astype(self.dtype)
        self.attention_weights: Array | None = None
        self._grads: dict[str, Array] = {}
        self._saved: dict[str, Any] | None = None

    # ------------------------------------------------------------------
    @classmethod
    @keyword_only
    def from_torch(cls, mha: Any, *, dtype: npt.DTypeLike | None = None
                   ) -> MultiHeadAttention:
        """A layer with the weights (copied) of a
        ``torch.nn.MultiheadAttention`` (or of
        ``attention_c.torch.MultiheadAttention``), its dropout rate and its
        training mode.

        ``batch_first`` does not matter (it changes the inputs, not the
        weights): the NumPy layer takes (..., T, E).

        Parameters
        ----------
        mha : torch.nn.MultiheadAttention
            Without ``add_bias_kv`` and ``add_zero_attn``, which this layer
            does not have (NotImplementedError).
        dtype : dtype, optional
            Default: the dtype of the weights (float32 for float16 and
            bfloat16).
        """
        weights, bias = _multihead_from_torch(mha)
        E, h = int(mha.embed_dim), int(mha.num_heads)
        first = next(iter(weights.values()))
        layer = cls(E, h, kdim=int(mha.kdim), vdim=int(mha.vdim), bias=bias,
                    dropout=float(mha.dropout),
                    dtype=first.dtype if dtype is None else dtype)
        for name, w in weights.items():
            have = getattr(layer, name)
            if w.shape != have.shape:
                raise ValueError(f"{name} has shape {w.shape}; expected "
                                 f"{have.shape}")
            setattr(layer, name, w.astype(layer.dtype, copy=False))
        layer.training = bool(mha.training)
        return layer

    # ------------------------------------------------------------------
    def parameters(self) -> dict[str, Array]:
        """The parameters by name (the live arrays, not copies, so that
        :func:`attention_c.sgd_step` and :func:`attention_c.adam_step`
        update the layer in place); biases absent when ``bias=False``."""
        return {name: p for name in self._param_names
                if (p := getattr(self, name)) is not None}

    def grads(self) -> dict[str, Array]:
        """The gradients of the last :meth:`backward`, keyed like
        :meth:`parameters` (empty before the first backward)."""
        return dict(self._grads)

    def train(self, mode: bool = True) -> MultiHeadAttention:
        """Set :attr:`training` (dropout on when True); returns the layer."""
        self.training = bool(mode)
        return self

    def eval(self) -> MultiHeadAttention:
        """``train(False)``: no dropout; returns the layer."""
        return self.train(False)

    def __repr__(self) -> str:
        extra = "" if self._packed else (f", kdim={self.kdim}, "
                                         f"vdim={self.vdim}")
        drop = f", dropout={self.dropout}" if self.dropout else ""
        if self.sinks is not None:
            drop += ", sinks=True"
        if self.alibi_slopes is not None:
            drop += f", alibi_slopes={self.alibi_slopes.tolist()}"
        return (f"MultiHeadAttention({self.embed_dim}, {self.num_heads}"
                f"{extra}, bias={self.in_proj_bias is not None}{drop}, "
                f"dtype={self.dtype.name})")

    # ------------------------------------------------------------------
    def _proj(self, role: int) -> tuple[Array, Array | None]:
        """(W, b) of the input projection of role 0 (query), 1 (key) or 2
        (value): views of the live parameters."""
        E = self.embed_dim
        W: Array | None
        if self.in_proj_weight is not None:
            W = self.in_proj_weight[role * E:(role + 1) * E]
        else:
            W = (self.q_proj_weight, self.k_proj_weight,
                 self.v_proj_weight)[role]
        assert W is not None
        b = (None if self.in_proj_bias is None
             else self.in_proj_bias[role * E:(role + 1) * E])
        return W, b

    def _groups(self, sources: dict[int, Array]) -> list[list[int]]:
        """The roles to project, grouped by input array when one matrix
        product serves them (the packed weight, consecutive rows)."""
        groups: list[list[int]] = []
        for r in sorted(sources):
            last = groups[-1] if groups else None
            if (last is not None and self._packed and last[-1] == r - 1
                    and sources[last[0]] is sources[r]):
                last.append(r)
            else:
                groups.append([r])
        return groups

    def _project(self, sources: dict[int, Array]
                 ) -> tuple[dict[int, Array], list[list[int]]]:
        """The heads (..., h, T, d) of each role, as views of one product
        per group."""
        E, h = self.embed_dim, self.num_heads
        heads: dict[int, Array] = {}
        groups = self._groups(sources)
        for g in groups:
            x = sources[g[0]]
            if self.in_proj_weight is not None:
                rows = slice(g[0] * E, (g[-1] + 1) * E)
                b = (None if self.in_proj_bias is None
                     else self.in_proj_bias[rows])
                p = _linear(x, self.in_proj_weight[rows], b)
            else:
                p = _linear(x, *self._proj(g[0]))
            for j, r in enumerate(g):
                heads[r] = _split_heads(p[..., j * E:(j + 1) * E], h)
        return heads, groups

    def _check(self, query: Array, key: Array | None, value: Array | None,
               mask: Any, attn_mask: Any, cache: KVCache | None
               ) -> tuple[tuple[int, ...], int, Any, Any]:
        """Every check of a call, before anything is computed or changes:
        (batch shape, S, key mask view, attn_mask view)."""
        E, h = self.embed_dim, self.num_heads
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be an attention_c KVCache, got "
                            f"{type(cache).__name__}")
        dims = {"query": E, "key": self.kdim, "value": self.vdim}
        given = {"query": query, "key": key, "value": value}
        for name, x in given.items():
            if x is None:
                continue
            if x.ndim < 2 or x.shape[-1] != dims[name]:
                what = "embed_dim" if name == "query" else name[0] + "dim"
                raise ValueError(f"{name} has shape {x.shape}; expected "
                                 f"(..., T, {dims[name]}) ({what} = "
                                 f"{dims[name]})")
        reuse = cache is not None and cache.static and len(cache) > 0
        if key is None and self.kdim != E and not reuse:
            raise ValueError(f"key is required: it defaults to the query, "
                             f"of {E} features, but kdim = {self.kdim}")
        if value is None and self.vdim != self.kdim and not reuse:
            raise ValueError(f"value is required: it defaults to the key, "
                             f"of kdim = {self.kdim} features, but vdim = "
                             f"{self.vdim}")
        if key is not None and value is not None and (
                key.shape[-2] != value.shape[-2]):
            raise ValueError(f"key {key.shape} and value {value.shape} "
                             f"must have the same number of positions")
        kv = key if key is not None else query
        try:
            lead = np.broadcast_shapes(
                *(x.shape[:-2] for x in (query, key, value) if x is not None))
        except ValueError:
            raise ValueError(
                "the leading (batch) axes of " + ", ".join(
                    f"{n} {x.shape}" for n, x in given.items()
                    if x is not None) + " do not broadcast") from None
        Tq, t = query.shape[-2], kv.shape[-2]
        if cache is None:
            S = t
        else:
            if cache.static and len(cache) > 0:
                assert cache._k is not None
                S = cache._k.shape[-2]
                if (cache._k.shape[:-3] != lead
                        or cache._k.shape[-3] != h
                        or cache._k.shape[-1] != self.head_dim
                        or cache._k.dtype != cache._storage(self.dtype)):
                    raise ValueError(
                        f"this static cache holds a memory of keys "
                        f"{cache._k.shape} (batch shape, heads, S, head "
                        f"size) of dtype {cache._k.dtype}; the call has "
                        f"batch shape {lead}, {h} heads of "
                        f"{self.head_dim}, dtype {self.dtype}")
            else:
                kl = kv.shape[:-2]
                if key is not None or value is not None:
                    kl = np.broadcast_shapes(
                        *(x.shape[:-2] for x in (key, value)
                          if x is not None))
                if kl != lead:
                    raise ValueError(
                        f"with a cache, the new keys and values must have "
                        f"the batch shape of the query: {kl} against "
                        f"{lead}")
                cache._check_new(lead, h, self.head_dim, self.head_dim,
                                 self.dtype, t)
                S = t if cache.static else len(cache) + t
        m = am = None
        if mask is not None:
            mk = _bool_mask(mask, "mask")
            if (mk.ndim < 1 or mk.shape[-1] != S
                    or not _broadcasts_into(mk.shape[:-1], lead)):
                raise ValueError(
                    f"mask has shape {mk.shape}; expected (..., S) "
                    f"broadcastable to {(*lead, S)} (batch shape, S keys), "
                    f"the key mask, the same for every query; for a mask "
                    f"per query use attn_mask=")
            m = mk[..., None, :] if mk.ndim > 1 else mk   # the head axis
        if attn_mask is not None:
            a = _bool_mask(attn_mask, "attn_mask")
            if a.ndim < 1 or not _broadcasts_into(a.shape, (*lead, Tq, S)):
                raise ValueError(
                    f"attn_mask has shape {a.shape}; expected a shape that "
                    f"broadcasts to {(*lead, Tq, S)} (batch shape, Tq "
                    f"queries, S keys) without adding axes")
            am = a[..., None, :, :] if a.ndim > 2 else a  # the head axis
        return lead, S, m, am

    def _check_int8(self, **given: Any) -> None:
        """An int8 cache's call: the cache kernel's arguments only."""
        if np.dtype(self.dtype) == np.float64:
            raise TypeError("an int8 KVCache serves float32 layers (its "
                            "step computes in float32); this layer is "
                            "float64: use a float cache")
        for name, x in given.items():
            if x is not None and x is not False:
                raise ValueError(f"{name} is not supported with an int8 "
                                 f"KVCache (attention_c.cache_attention "
                                 f"reads it: causal, window, softcap, ALiBi "
                                 f"and sinks only); use a float cache")
        if self.training and self.dropout > 0:
            raise ValueError("dropout is not supported with an int8 "
                             "KVCache: call layer.eval() to decode")

    def _int8_step(self, q: Array, cache: KVCache, lead: tuple[int, ...],
                   S: int, causal: bool, window: Any, softcap: Any
                   ) -> tuple[Array, Array]:
        """Attention of q (..., h, Tq, d) to the int8 cache's S positions,
        read in place by cache_attention; (out (*lead, h, Tq, d), lse)."""
        assert cache._k is not None and cache._v is not None
        assert cache._ks is not None and cache._vs is not None
        h, Tq, d = q.shape[-3:]
        B = int(np.prod(lead, dtype=np.int64))

        def serving(x: Array) -> Array:    # (B, capacity, h, width) view
            return x.reshape(B, *x.shape[-3:]).swapaxes(1, 2)

        qb = np.broadcast_to(q, (*lead, h, Tq, d)).reshape(B, h, Tq, d)
        out, lse = cache_attention(
            qb.swapaxes(1, 2), serving(cache._k), serving(cache._v),
            np.full(B, S, np.int64), k_scales=serving(cache._ks),
            v_scales=serving(cache._vs), causal=causal, window=window,
            softcap=softcap, alibi_slopes=self.alibi_slopes,
            sinks=self.sinks, return_lse=True)
        o = out.swapaxes(1, 2).reshape(*lead, h, Tq, out.shape[-1])
        return o, lse

    # ------------------------------------------------------------------
    @keyword_only
    def __call__(self, query: npt.ArrayLike,
                 key: npt.ArrayLike | None = None,
                 value: npt.ArrayLike | None = None, *,
                 mask: npt.ArrayLike | None = None,
                 attn_mask: npt.ArrayLike | None = None,
                 causal: bool = False, return_weights: bool = False,
                 average_weights: bool = True,
                 cache: KVCache | None = None,
                 window: tuple[int | None, int | None] | None = None,
                 softcap: float | None = None,
                 cu_seqlens_q: npt.ArrayLike | None = None,
                 cu_seqlens_k: npt.ArrayLike | None = None) -> Any:
        """Forward pass; keeps what :meth:`backward` needs.

        Parameters
        ----------
        query : array_like (..., Tq, E)
            Converted to the layer's dtype, like every array argument.
        key : array_like (..., S, kdim), optional
            Default: the query (self-attention).
        value : array_like (..., S, vdim), optional
            Default: the key.  The leading axes of query, key and value
            broadcast.
        mask : array_like of bool (..., S), optional
            The key mask, the same for every query and head: True marks a
            valid key.  A query with no visible key gives 0.
        attn_mask : array_like of bool, optional
            Broadcastable to (..., Tq, S), the same for every head: True
            where query i may attend to key t.  Never expanded per head.
        causal : bool, optional
            Key t visible to query i iff ``t <= i + (S - Tq)`` (bottom
            right, so new queries against a cache see the whole cache).
        return_weights : bool, optional
            False (default): never form the (..., h, Tq, S) weights (the
            streamed kernel).  True: return them too.
        average_weights : bool, optional
            With ``return_weights``: the mean over the heads (..., Tq, S)
            (default), or every head (..., h, Tq, S).
        cache : KVCache, optional
            Decoding: ``key``/``value`` (default the query) are the new
            positions only; they are projected and appended to the cache,
            and the query attends to every cached position.  A static
            cache keeps the first call's keys and values.  A
            ``KVCache(dtype=np.float16)`` (or bfloat16) stores them in 16
            bits, which a float32 decoding step reads in place; the
            results stay in the layer's dtype.  No :meth:`backward` after
            such a call.
        window : (left, right), optional
            Sliding window: key t visible to query i iff ``i' - left <= t
            <= i' + right`` (``i' = i + (S - Tq)``; None: that side
            unbounded; with ``causal``, right is 0), e.g. ``(4095, 0)``
            for Mistral's 4096 keys.
        softcap : float > 0, optional
            The scores s become ``softcap * tanh(s / softcap)`` (Gemma 2).
        cu_seqlens_q, cu_seqlens_k : array_like of int (n + 1,), optional
            Packed sequences along the Tq (resp. S) axis: a query sees
            only the keys of its own sequence, positions counted within
            it (docs/contract.md section 8).  Both or neither.

        Returns
        -------
        out : ndarray (..., Tq, E)
        weights : ndarray (..., Tq, S) or (..., h, Tq, S)
            Only with ``return_weights=True``; before dropout.
        """
        q_in = _check_array(query, "query")
        if isinstance(cache, KVCache) and cache.static and len(cache):
            key = value = None        # the memory is in the cache
        k_in = None if key is None else _check_array(key, "key")
        v_in = None if value is None else _check_array(value, "value")
        lead, S, m, am = self._check(q_in, k_in, v_in, mask, attn_mask,
                                     cache)
        if cache is not None and cache.int8:
            self._check_int8(mask=mask, attn_mask=attn_mask,
                             return_weights=return_weights,
                             cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k)
        causal = bool(causal)
        cast = {id(x): np.asarray(x, dtype=self.dtype)
                for x in (q_in, k_in, v_in) if x is not None}
        xq = cast[id(q_in)]
        xk = xq if k_in is None else cast[id(k_in)]
        xv = xk if v_in is None else cast[id(v_in)]
        reuse = cache is not None and cache.static and len(cache) > 0
        sources = {0: xq} if reuse else {0: xq, 1: xk, 2: xv}
        heads, groups = self._project(sources)
        q = heads[0]
        k: Array | None
        v: Array | None
        if cache is None:
            k, v = heads[1], heads[2]
        elif reuse:
            k, v = cache.keys, cache.values
        else:
            k, v = cache._stage(lead, heads[1], heads[2])
        assert k is not None and v is not None
        # One rank for all three (the kernel reads query.ndim < keys.ndim
        # as one query per sequence): leading size-1 axes, views.
        q, k, v = (x[(None,) * (len(lead) + 3 - x.ndim)] for x in (q, k, v))
        heads = {0: q, 1: k, 2: v}
        kw: dict[str, Any] = {"values": v, "causal": causal}
        variants = {"window": window, "softcap": softcap,
                    "cu_seqlens_q": cu_seqlens_q,
                    "cu_seqlens_k": cu_seqlens_k,
                    "alibi_slopes": self.alibi_slopes, "sinks": self.sinks}
        kw.update({n: x for n, x in variants.items() if x is not None})
        if m is not None:
            kw["mask"] = m
        if am is not None:
            kw["attn_mask"] = am
        if self.training and self.dropout > 0:
            # A fresh seed per call, kept for the backward, which
            # regenerates the same keep bits.
            kw["dropout"] = self.dropout
            kw["seed"] = int(self._rng.integers(0, 2**63))
        if cache is not None and cache.int8:
            o, lse = self._int8_step(q, cache, lead, S, causal, window,
                                     softcap)
            alpha = None
        elif return_weights:
            o, alpha = dot_attention(q, k, **kw)
            saved = {"alpha": alpha}
            if self.sinks is not None and cache is None:
                # The backward with sinks runs from out and lse (alpha
                # alone loses the sink's share): the streamed forward too.
                o_s, lse = dot_attention(q, k, **kw, return_weights=False)
                saved = {"out": o_s, "lse": lse}
        else:
            o, lse = dot_attention(q, k, **kw, return_weights=False)
            saved = {"out": o, "lse": lse}
            alpha = None
        if o.dtype != self.dtype:
            # a cache wider than the layer (float64 under float32) made
            # the call compute in float64: the results in the layer's
            o = o.astype(self.dtype)
            alpha = None if alpha is None else alpha.astype(self.dtype)
        if cache is not None:
            cache._commit(S)
        o2 = _merge_heads(o)                   # (..., Tq, E)
        out = _linear(o2, self.out_proj_weight, self.out_proj_bias)
        self.attention_weights = alpha
        if cache is not None:
            self._saved = {"cached": True}
        else:
            self._saved = {"sources": sources, "heads": heads,
                           "groups": groups, "kw": kw, "saved": saved,
                           "o2": o2, "given": (k_in is not None,
                                               v_in is not None)}
        if not return_weights:
            return out
        assert alpha is not None
        return out, (alpha.mean(axis=-3) if average_weights else alpha)

    # ------------------------------------------------------------------
    def backward(self, grad_out: npt.ArrayLike) -> MultiHeadInputGrads:
        """Backward pass of the last call.

        Stores the gradients of every parameter (summed over the batch)
        for :meth:`grads`, replacing those of any earlier backward.  With
        dropout, the same keep pattern as the forward's (regenerated from
        its seed).

        Parameters
        ----------
        grad_out : array_like (..., Tq, E)
            Gradient of the loss with respect to the output.

        Returns
        -------
        MultiHeadInputGrads
            ``(query, key, value)``; ``key`` and ``value`` are None when
            the call did not give them, their gradients being then in the
            field of the input they defaulted to (for ``layer(x)``,
            ``query`` is the whole gradient of ``x``).
        """
        st = self._saved
        if st is None:
            raise RuntimeError("backward() called before the layer was "
                               "called on an input")
        if "cached" in st:
            raise RuntimeError(
                "backward() is not available after a call with cache=: "
                "decoding runs forward only; call the layer without a "
                "cache (with causal=True) to train")
        E, h = self.embed_dim, self.num_heads
        o2: Array = st["o2"]
        g = _check_array(grad_out, "grad_out")
        if g.shape != o2.shape:
            raise ValueError(f"grad_out has shape {g.shape}; expected the "
                             f"output's {o2.shape}")
        g = np.asarray(g, dtype=self.dtype)
        g2 = g.reshape(-1, E)
        grads: dict[str, Array] = {
            "out_proj_weight": g2.T @ o2.reshape(-1, E)}
        if self.out_proj_bias is not None:
            grads["out_proj_bias"] = g2.sum(axis=0)
        do = _split_heads((g2 @ self.out_proj_weight).reshape(g.shape), h)
        heads, saved = st["heads"], st["saved"]
        dg = dot_attention_backward(do, heads[0], heads[1], saved.get("alpha"),
                                    **{n: x for n, x in saved.items()
                                       if n != "alpha"}, **st["kw"])
        assert dg.values is not None          # the call gave values
        dheads: dict[int, Array] = {0: dg.query, 1: dg.keys,
                                    2: dg.values}
        has_key, has_value = st["given"]
        # the field each role's gradient goes to: 0 query, 1 key, 2 value
        field = {0: 0, 1: 1 if has_key else 0}
        field[2] = 2 if has_value else field[1]
        dx: list[Array | None] = [None, None, None]
        dW: dict[int, Array] = {}
        db: dict[int, Array] = {}
        for grp in st["groups"]:
            x = st["sources"][grp[0]]
            n = len(grp)
            dp = np.empty(x.shape[:-1] + (n, h, E // h), self.dtype)
            for j, r in enumerate(grp):
                dr = dheads[r]            # without the rank's padding axes
                dr = dr.reshape(x.shape[:-2] + dr.shape[-3:])
                dp[..., j, :, :] = dr.swapaxes(-2, -3)
            dp2 = dp.reshape(-1, n * E)
            dWg = dp2.T @ x.reshape(-1, x.shape[-1])
            dbg = dp2.sum(axis=0)
            for j, r in enumerate(grp):
                dW[r], db[r] = dWg[j * E:(j + 1) * E], dbg[j * E:(j + 1) * E]
            # one product per field that the group's roles feed
            for f in sorted({field[r] for r in grp}):
                # fields only merge a role into an earlier one, so the
                # roles of a field are consecutive in the group
                js = [j for j, r in enumerate(grp) if field[r] == f]
                j0, j1 = js[0], js[-1] + 1
                Wf = (self.in_proj_weight[grp[j0] * E:(grp[j0] + j1 - j0)
                                          * E]
                      if self.in_proj_weight is not None
                      else self._proj(grp[j0])[0])
                part = (dp2[:, j0 * E:j1 * E] @ Wf).reshape(x.shape)
                dx[f] = part if dx[f] is None else dx[f] + part
        if self.in_proj_weight is not None:
            grads["in_proj_weight"] = np.concatenate([dW[0], dW[1], dW[2]])
        else:
            for r, name in enumerate(("q_proj_weight", "k_proj_weight",
                                      "v_proj_weight")):
                grads[name] = dW[r]
        if self.in_proj_bias is not None:
            grads["in_proj_bias"] = np.concatenate([db[0], db[1], db[2]])
        if self.sinks is not None:
            assert dg.sinks is not None          # sinks given: their grad
            grads["sinks"] = dg.sinks
        self._grads = grads
        dq = dx[0]
        assert dq is not None
        return MultiHeadInputGrads(dq, dx[1] if has_key else None,
                                   dx[2] if has_value else None)
