"""Multi-head attention on the C kernels: a drop-in for
``torch.nn.MultiheadAttention`` (docs/contract.md section 6), and the
key/value cache of one-token decoding.

:class:`MultiheadAttention` *is* an ``nn.MultiheadAttention`` (a subclass:
the same constructor, parameters, initialisation and state_dict); only its
``forward`` differs in how it computes, not in what:

- the projections are PyTorch's ``F.linear``; the heads are read in place
  from them as strided (N, heads, L, d) views, with no transposed copies;
- the attention of all heads is one call of the streamed dot kernel
  (attention_c.torch.dot_attention), which forms the (L, S) weights only
  when ``need_weights=True`` asks for them;
- the masks are read where they are: ``key_padding_mask`` as an (N, 1, S)
  view, ``attn_mask`` as (L, S) or (N, heads, L, S), never merged into
  one (N, heads, L, S) mask as ``merge_masks`` does; ``is_causal`` runs the
  causal kernel, which skips the blocks no query sees.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .functional import _fast_dot, _plain_call, dot_attention

__all__ = ["MultiheadAttention", "KVCache"]


class KVCache:
    """The projected keys and values of past positions, for decoding one
    token at a time with :meth:`MultiheadAttention.forward` (``cache=``).

    Each call appends the new positions' keys and values to a buffer laid
    out (N, heads, capacity, d) and attends to its first ``len(cache)``
    positions through a view: no copy of the cache per step.  Without
    ``max_len`` the buffer doubles when full (an occasional copy, amortised
    over the steps); with it, it is allocated once.

    Parameters
    ----------
    max_len : int, optional
        The most positions the cache will hold.
    static : bool, optional
        For cross-attention to a fixed memory (an encoder's output): the
        first call projects its ``key`` and ``value`` and stores them;
        later calls reuse them and ignore ``key`` and ``value``.

    Examples
    --------
    >>> import torch
    >>> from attention_c.torch import KVCache, MultiheadAttention
    >>> _ = torch.manual_seed(0)
    >>> mha = MultiheadAttention(16, 4, batch_first=True).eval()
    >>> x = torch.randn(2, 5, 16)                     # (N, L, E)
    >>> causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    >>> full, _ = mha(x, x, x, attn_mask=causal, need_weights=False)
    >>> cache = KVCache(max_len=5)
    >>> with torch.no_grad():
    ...     steps = [mha(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1],
    ...                  need_weights=False, cache=cache)[0]
    ...              for t in range(5)]
    >>> len(cache), torch.allclose(torch.cat(steps, 1), full, atol=1e-6)
    (5, True)
    """

    def __init__(self, max_len: int | None = None, *,
                 static: bool = False) -> None:
        if max_len is not None and (isinstance(max_len, bool) or not
                                    isinstance(max_len, int) or max_len < 1):
            raise ValueError(f"max_len must be a positive int or None, got "
                             f"{max_len!r}")
        self.max_len = max_len
        self.static = bool(static)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        shape = None if self._k is None else tuple(self._k.shape)
        return (f"KVCache(len={self._n}, max_len={self.max_len}, "
                f"static={self.static}, buffer={shape})")

    @property
    def keys(self) -> torch.Tensor | None:
        """The cached keys, an (N, heads, len, d) view (None if empty)."""
        return None if self._k is None else self._k[:, :, :self._n]

    @property
    def values(self) -> torch.Tensor | None:
        """The cached values, an (N, heads, len, dv) view (None if
        empty)."""
        return None if self._v is None else self._v[:, :, :self._n]

    def reset(self) -> None:
        """Forget the cached positions (the buffer is kept for reuse)."""
        self._n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (N, heads, L, d) keys and values; returns the views of
        the whole cache."""
        n, L = self._n, k.shape[2]
        k_buf = self._k
        if k_buf is not None and (k_buf.shape[:2] != k.shape[:2]
                                  or k_buf.dtype != k.dtype):
            raise ValueError(
                f"the cache holds (N, heads) = {tuple(k_buf.shape[:2])} "
                f"of {k_buf.dtype}, the new keys are "
                f"{tuple(k.shape[:2])} of {k.dtype}: reset() it, or use "
                f"one cache per sequence batch")
        if k_buf is None or n + L > k_buf.shape[2]:
            if self.max_len is not None and n + L > self.max_len:
                raise ValueError(f"the cache is full: {n} positions + {L} "
                                 f"new > max_len={self.max_len}")
            cap = (self.max_len if self.max_len is not None
                   else max(16, 2 * (n + L)))
            self._k = self._grow(self._k, k, cap)
            self._v = self._grow(self._v, v, cap)
        assert self._k is not None and self._v is not None
        self._k[:, :, n:n + L] = k
        self._v[:, :, n:n + L] = v
        self._n = n + L
        return self._k[:, :, :self._n], self._v[:, :, :self._n]

    def _grow(self, old: torch.Tensor | None, new: torch.Tensor, cap: int
              ) -> torch.Tensor:
        buf = new.new_empty(new.shape[0], new.shape[1], cap, new.shape[3])
        if old is not None and self._n:
            buf[:, :, :self._n] = old[:, :, :self._n]
        return buf


def _heads(x: torch.Tensor, h: int, batch_first: bool) -> torch.Tensor:
    """The (N, h, L, d) view of projected (N, L, E) (batch_first) or
    (L, N, E) rows: strided, no copy."""
    if batch_first:
        N, L, E = x.shape
        return x.view(N, L, h, E // h).transpose(1, 2)
    L, N, E = x.shape
    return x.view(L, N, h, E // h).permute(1, 2, 0, 3)


def _weights(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
             mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
             bias: torch.Tensor | None, causal: bool, scale: float
             ) -> torch.Tensor:
    """The (N, h, L, S) weights ``exp(s - lse)`` on the visible keys, from
    the streamed forward's ``lse``, in differentiable PyTorch.

    Asked for, the weights are formed; but the output and its backward stay
    on the streamed kernel, and the weights' own backward runs only if the
    loss uses them (PyTorch users mostly log or plot them)."""
    # In place where autograd allows it (none of these backwards needs
    # its input): each pass over the (N, h, L, S) scores costs as much as
    # the product that made them.
    s = torch.matmul(q * scale, k.transpose(-2, -1))
    if bias is not None:
        s.add_(bias)
    L, S = s.shape[-2:]
    hidden = None if mask is None else ~mask.unsqueeze(-2)
    if attn_mask is not None:
        hidden = ~attn_mask if hidden is None else hidden | ~attn_mask
    if causal:
        above = torch.ones(L, S, dtype=torch.bool,
                           device=s.device).triu(S - L + 1)
        hidden = above if hidden is None else hidden | above
    if hidden is not None:
        s.masked_fill_(hidden, float("-inf"))
    # A query with no visible key has lse = -inf and weights 0: subtract
    # 0 there instead (exp(-inf) = 0, and no NaN in the gradient).
    return s.sub_(lse.masked_fill(lse == float("-inf"), 0)
                  .unsqueeze(-1)).exp_()


class MultiheadAttention(torch.nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` on attention_c's kernels: a drop-in
    (the same constructor, forward, parameters, state_dict and results).

    Swapping is one import::

        from attention_c.torch import MultiheadAttention
        mha = MultiheadAttention(512, 8, batch_first=True)
        out, weights = mha(x, x, x)

    and ``load_state_dict`` works both ways with ``nn.MultiheadAttention``
    (``isinstance(mha, nn.MultiheadAttention)`` is True).  What differs is
    the cost: the heads are read in place from the projections, the masks
    where they are (never merged to (N, heads, L, S)), ``need_weights=False``
    never forms the weights, and ``is_causal`` skips the hidden blocks.

    Parameters
    ----------
    embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim,
    vdim, batch_first, device, dtype
        As in ``torch.nn.MultiheadAttention``.  Parameters of float32 or
        float64 are computed natively; bfloat16 and float16 in float32.

    Notes
    -----
    Deliberate differences from ``nn.MultiheadAttention``:

    - a query that may attend to no key gets an output of 0 (before the
      output projection) and weights of 0, where PyTorch gives NaN;
    - dropout uses attention_c's counter-based keep bits, with a seed drawn
      from torch's generator: reproducible under ``torch.manual_seed``, not
      the same bits as PyTorch's; with ``need_weights=True`` in training
      the returned weights are those before dropout (PyTorch returns them
      after);
    - ``is_causal=True`` needs an ``attn_mask`` as in PyTorch, and is
      trusted as its hint: the causal kernel runs and the mask is not read
      (when L == S; otherwise the mask is used).

    Examples
    --------
    >>> import torch
    >>> import attention_c.torch as act
    >>> _ = torch.manual_seed(0)
    >>> ref = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    >>> mha = act.MultiheadAttention(16, 4, batch_first=True)
    >>> _ = mha.load_state_dict(ref.state_dict())
    >>> x = torch.randn(2, 5, 16)
    >>> pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    >>> out, w = mha(x, x, x, key_padding_mask=pad)
    >>> out_ref, w_ref = ref(x, x, x, key_padding_mask=pad)
    >>> torch.allclose(out, out_ref, atol=1e-6), w.shape
    (True, torch.Size([2, 5, 5]))
    """

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None,
                need_weights: bool = True,
                attn_mask: torch.Tensor | None = None,
                average_attn_weights: bool = True,
                is_causal: bool = False, *,
                cache: KVCache | None = None,
                window: tuple[int | None, int | None] | None = None,
                softcap: float | None = None,
                alibi_slopes: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``query`` to ``key``/``value``, as
        ``nn.MultiheadAttention.forward``.

        Parameters
        ----------
        query : Tensor (L, N, E), (N, L, E) with ``batch_first``, or (L, E)
        key : Tensor (S, N, kdim), (N, S, kdim) or (S, kdim)
        value : Tensor (S, N, vdim), (N, S, vdim) or (S, vdim)
        key_padding_mask : Tensor (N, S) or (S,), optional
            bool (True = this key is *not* attended to) or float (added).
        need_weights : bool, optional
            Also return the attention weights (default True, as PyTorch).
        attn_mask : Tensor (L, S) or (N * num_heads, L, S), optional
            bool (True = *not* allowed) or float (added to the scores).
        average_attn_weights : bool, optional
            Average the returned weights over the heads.
        is_causal : bool, optional
            A hint that ``attn_mask`` is the causal mask (required, as in
            PyTorch): the causal kernel runs instead.  With ``cache``:
            causal among the new positions, bottom-right aligned, and no
            ``attn_mask`` needed.
        cache : KVCache, optional
            Keyword-only (attention_c's own).  ``key`` and ``value`` are
            the new positions only: projected, appended to the cache, and
            the query attends to every cached position.  Inference only
            (under ``torch.no_grad()`` or ``torch.inference_mode()``).
        window, softcap, alibi_slopes, sinks : optional
            Keyword-only (attention_c's own): the variants of
            :func:`attention_c.torch.dot_attention` on each head's scores
            (docs/contract.md section 8): a sliding ``window`` (left,
            right) of key positions around query i's (bottom-right
            aligned: the last query at the last key, also with ``cache``),
            ``softcap`` c (scores ``c tanh(s / c)``), ``alibi_slopes`` and
            ``sinks`` of shape (num_heads,) or (N, num_heads) (e.g. a
            learned ``nn.Parameter`` of the caller: differentiable).

        Returns
        -------
        attn_output : Tensor shaped as ``query``
        attn_weights : Tensor (N, L, S) or (N, num_heads, L, S), or None
            None unless ``need_weights``.
        """
        batched = query.dim() == 3
        self._check_shapes(query, key, value, key_padding_mask, attn_mask,
                           batched, cache)
        if not batched:
            # (L, E) -> (L, 1, E) or (1, L, E): one sequence.
            dim = 0 if self.batch_first else 1
            query = query.unsqueeze(dim)
            key = key.unsqueeze(dim) if key is not None else key
            value = value.unsqueeze(dim) if value is not None else value
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        variants = {n: x for n, x in (("window", window),
                                      ("softcap", softcap),
                                      ("alibi_slopes", alibi_slopes),
                                      ("sinks", sinks)) if x is not None}
        out, weights = self._attend(query, key, value, key_padding_mask,
                                    need_weights, attn_mask, is_causal,
                                    cache, variants)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            out = out.squeeze(0 if self.batch_first else 1)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor,
                      key_padding_mask: torch.Tensor | None,
                      attn_mask: torch.Tensor | None, batched: bool,
                      cache: KVCache | None) -> None:
        """PyTorch's checks and messages (AssertionError for the inputs,
        as ``nn.MultiheadAttention``), before anything is computed."""
        if query.dim() not in (2, 3):
            raise AssertionError(
                f"query should be unbatched 2D or batched 3D tensor but "
                f"received {query.dim()}-D query tensor")
        static = cache is not None and cache.static and len(cache) > 0
        if query.shape[-1] != self.embed_dim:
            raise AssertionError(
                f"was expecting embedding dimension of {self.embed_dim}, "
                f"but got {query.shape[-1]}")
        if not static:
            for name, t, size in (("key", key, self.kdim),
                                  ("value", value, self.vdim)):
                if t is None or t.dim() != query.dim():
                    raise AssertionError(
                        f"For {'batched (3-D)' if batched else 'unbatched'}"
                        f" `query`, expected `{name}` to be a "
                        f"{query.dim()}-D tensor, got "
                        f"{None if t is None else f'{t.dim()}-D'}")
                if t.shape[-1] != size:
                    dim = "kdim" if name == "key" else "vdim"
                    raise AssertionError(
                        f"{name} has {t.shape[-1]} features in its last "
                        f"dimension, but this module was built with "
                        f"{dim}={size} (shape {tuple(t.shape)})")
            if key.shape[:-1] != value.shape[:-1]:
                raise AssertionError(
                    f"key's sequence and batch dims {tuple(key.shape[:-1])}"
                    f" do not match value's {tuple(value.shape[:-1])}")
            if batched:
                b = 0 if self.batch_first else 1
                if key.shape[b] != query.shape[b]:
                    raise AssertionError(
                        f"key has batch size {key.shape[b]} but query "
                        f"{query.shape[b]}")
        for name, m in (("key_padding_mask", key_padding_mask),
                        ("attn_mask", attn_mask)):
            if m is not None and m.dtype != torch.bool and (
                    not m.is_floating_point()):
                raise AssertionError(
                    f"only bool and floating types of {name} are supported")
        if key_padding_mask is not None and key_padding_mask.dim() != (
                2 if batched else 1):
            raise AssertionError(
                f"For {'batched (3-D)' if batched else 'unbatched'} "
                f"`query`, expected `key_padding_mask` to be "
                f"{'2-D' if batched else '`None` or 1-D'} but found "
                f"{key_padding_mask.dim()}-D tensor instead")
        if attn_mask is not None and attn_mask.dim() not in (2, 3):
            raise AssertionError(
                f"For {'batched (3-D)' if batched else 'unbatched (2-D)'} "
                f"`query`, expected `attn_mask` to be `None`, 2-D or 3-D "
                f"but found {attn_mask.dim()}-D tensor instead")

    def _project(self, query: torch.Tensor, key: torch.Tensor | None,
                 value: torch.Tensor | None, skip_kv: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None,
                            torch.Tensor | None]:
        """The projected rows, laid out as the inputs: one ``F.linear`` for
        self-attention (q, k, v are views of its (.., 3E) result), two when
        key is value."""
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.split(E)
        if not self._qkv_same_embed_dim:
            q = F.linear(query, self.q_proj_weight, bq)
            if skip_kv:
                return q, None, None
            return (q, F.linear(key, self.k_proj_weight, bk),
                    F.linear(value, self.v_proj_weight, bv))
        W = self.in_proj_weight
        if skip_kv:
            return F.linear(query, W[:E], bq), None, None
        if query is key and key is value:
            q, k, v = F.linear(query, W, b).split(E, dim=-1)
            return q, k, v
        q = F.linear(query, W[:E], bq)
        if key is value:
            k, v = F.linear(key, W[E:], None if b is None else b[E:]
                            ).split(E, dim=-1)
            return q, k, v
        return q, F.linear(key, W[E:2 * E], bk), F.linear(value, W[2 * E:],
                                                          bv)

    def _attend(self, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor,
                key_padding_mask: torch.Tensor | None, need_weights: bool,
                attn_mask: torch.Tensor | None, is_causal: bool,
                cache: KVCache | None,
                variants: dict[str, Any] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, bf = self.num_heads, self.batch_first
        variants = variants or {}
        L, N = (query.shape[1], query.shape[0]) if bf else query.shape[:2]
        if cache is not None and torch.is_grad_enabled() and any(
                p.requires_grad for p in self.parameters()):
            raise RuntimeError(
                "MultiheadAttention(..., cache=) is for inference: call it "
                "under torch.no_grad() or torch.inference_mode() (the cache "
                "holds no autograd history)")
        static = cache is not None and cache.static and len(cache) > 0
        q, k, v = self._project(query, key, value, static)
        qh = _heads(q, h, bf)
        if static:
            assert cache is not None
            kh, vh = cache.keys, cache.values
        else:
            assert k is not None and v is not None
            k, v, key_padding_mask, attn_mask = self._extend(
                k, v, key_padding_mask, attn_mask, N)
            kh, vh = _heads(k, h, bf), _heads(v, h, bf)
        assert kh is not None and vh is not None
        S = kh.shape[2] + (len(cache) if cache is not None and not static
                           else 0)
        if is_causal and cache is None and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may "
                "use the Transformer module method "
                "`generate_square_subsequent_mask` to create this mask.")
        # The hint stands for attn_mask (checked, then not read), as in
        # PyTorch's fast path; with L != S the mask itself is used.
        causal = bool(is_causal) and (cache is not None or L == S)
        mask, bool_attn, bias = self._masks(key_padding_mask, attn_mask,
                                            N, L, S, read_attn=not causal)
        if cache is not None and not static:
            # Only now that every argument is checked: a refused call
            # leaves the cache as it was.
            kh, vh = cache.append(kh, vh)
        p = self.dropout if self.training else 0.0
        seed = (torch.randint(0, 2**63 - 1, (), dtype=torch.int64)
                if p > 0 else None)
        o = weights = None
        per_head = [variants[n] for n in ("alibi_slopes", "sinks")
                    if n in variants]
        if not need_weights and p == 0 and _plain_call(qh, kh, vh, bias,
                                                       *per_head):
            o = _fast_dot(qh, kh, vh, mask, bool_attn, bias, causal,
                          1.0 / math.sqrt(self.head_dim), variants)
        if o is None:
            kw = dict(values=vh, mask=mask, attn_mask=bool_attn,
                      causal=causal, bias=bias,
                      scale=1.0 / math.sqrt(self.head_dim), **variants)
            o, lse = dot_attention(qh, kh, dropout=p, seed=seed,
                                   return_weights=False, **kw)
            if need_weights and variants:
                # The variants' weights from the kernel (a second call).
                _, weights = dot_attention(qh, kh, return_weights=True,
                                           **kw)
            elif need_weights:
                weights = _weights(qh, kh, lse, mask, bool_attn, bias,
                                   causal, 1.0 / math.sqrt(self.head_dim))
        # (N, h, L, d) -> the rows of the output projection: one copy.
        o = (o.transpose(1, 2) if bf else o.permute(2, 0, 1, 3)).reshape(
            *((N, L) if bf else (L, N)), self.embed_dim)
        out = F.linear(o, self.out_proj.weight, self.out_proj.bias)
        return out, (weights if need_weights else None)

    def _extend(self, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None,
                attn_mask: torch.Tensor | None, N: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                           torch.Tensor | None]:
        """``add_bias_kv`` and ``add_zero_attn``: one or two more keys
        (the only copies of K and V, as PyTorch makes them), the masks
        padded to match."""
        extra = []
        if self.bias_k is not None and self.bias_v is not None:
            extra.append((self.bias_k, self.bias_v))
        if self.add_zero_attn:
            extra.append((k.new_zeros(1, 1, k.shape[-1]),
                          v.new_zeros(1, 1, v.shape[-1])))
        if not extra:
            return k, v, key_padding_mask, attn_mask
        seq = 1 if self.batch_first else 0
        for bk, bv in extra:
            shape = (N, 1, -1) if self.batch_first else (1, N, -1)
            k = torch.cat([k, bk.reshape(1, 1, -1).expand(shape)], seq)
            v = torch.cat([v, bv.reshape(1, 1, -1).expand(shape)], seq)
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, 1))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        return k, v, key_padding_mask, attn_mask

    def _masks(self, key_padding_mask: torch.Tensor | None,
               attn_mask: torch.Tensor | None, N: int, L: int, S: int, *,
               read_attn: bool = True
               ) -> tuple[torch.Tensor | None, torch.Tensor | None,
                          torch.Tensor | None]:
        """PyTorch's masks (True = not allowed, or float added) as the
        kernel's: a key mask (N, 1, S), a per-query mask (L, S) or (N, h,
        L, S), and a float bias; each read in place or inverted at its own
        size, never broadcast against the others."""
        h = self.num_heads
        mask = bool_attn = bias = None
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (N, S):
                raise AssertionError(
                    f"expecting key_padding_mask shape of {(N, S)}, but got "
                    f"{tuple(key_padding_mask.shape)}")
            if key_padding_mask.dtype == torch.bool:
                mask = (~key_padding_mask).view(N, 1, S)
            else:
                bias = key_padding_mask.view(N, 1, 1, S)
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if tuple(attn_mask.shape) != (L, S):
                    raise RuntimeError(
                        f"The shape of the 2D attn_mask is "
                        f"{attn_mask.shape}, but should be {(L, S)}.")
                m = attn_mask
            else:
                if tuple(attn_mask.shape) != (N * h, L, S):
                    raise RuntimeError(
                        f"The shape of the 3D attn_mask is "
                        f"{attn_mask.shape}, but should be "
                        f"{(N * h, L, S)}.")
                m = attn_mask.view(N, h, L, S)
            if not read_attn:
                pass            # the causal hint stands for it
            elif m.dtype == torch.bool:
                bool_attn = ~m
            else:
                bias = m if bias is None else bias + m
        return mask, bool_attn, bias
