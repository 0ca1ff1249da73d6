"""A transformers ``Cache`` whose keys and values stay compact (bfloat16,
float16 or int8 with float32 scales) and that attention_c's backend reads
in place.  Public as
:class:`attention_c.integrations.transformers.CompactCache` (see there and
docs/transformers.md); this module holds its machinery.

How the attention function reaches the cache
--------------------------------------------
transformers' decoders call ``past_key_values.update(k, v, layer_idx)``
and hand what it returns to the attention function as ``key`` and
``value``; the cache object itself is not passed on (``past_key_values``
is a named argument of the attention modules, not one of the ``**kwargs``
they forward).  So ``update`` returns *deferred* tensors: a
``torch.Tensor`` subclass of the full (B, Hkv, N, d) shape and the model's
dtype, storing nothing (a zero-stride view of one scalar), that holds its
cache layer and the new keys and values, which ``update`` has *not* yet
written.  attention_c's attention function recognises them and calls
:func:`attention_c.cache_attention` on the layer's buffers, whose ``k=``
and ``v=`` write the new rows (cast, or quantised) in place before the
attention: nothing is dequantised, widened or concatenated.

Any other use of a deferred tensor (another backend: sdpa's
``scaled_dot_product_attention``, eager's ``matmul``, indexing, printing)
goes through ``__torch_function__``, which first writes the pending rows
and then replaces the tensor by its dense value: the layer's N rows read
back (dequantised) in the model's dtype, a copy made once per tensor.  Only
the metadata (shape, dtype, device, ...) is answered without it.  So a
CompactCache is correct under every attn_implementation, and the backend
needs neither the cache (through kwargs), nor ``module.layer_idx``, nor a
guess at the model's attn_implementation.  ``update`` writes any rows
still pending from a previous call first, so no row is ever lost.
"""

from __future__ import annotations

import importlib
from abc import ABCMeta
import operator
from typing import Any

import numpy as np
import torch

import attention_c as ac
from attention_c.torch._utils import _from_np, _np


def _import(name: str) -> Any:
    """transformers' module ``name``, imported by name, so that the type
    checkers of attention_c (the stubs' test among them) neither need
    transformers nor analyse it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:  # pragma: no cover - the message is the point
        raise ImportError(
            "attention_c.integrations.transformers needs transformers "
            "(pip install 'attention_c[transformers]')") from e


_cu = _import("transformers.cache_utils")
# The bases, as names of type Any: transformers is not analysed by the
# package's type checkers (stubtest among them); CompactLayer names its
# base's metaclass, which stubtest compares.
_LayerBase: Any = _cu.CacheLayerMixin
_CacheBase: Any = _cu.Cache

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": torch.int8}
_ACCEPTED = ('"bfloat16", "float16", "int8" (or torch.bfloat16, '
             'torch.float16, torch.int8)')
# Layer types whose attention reads the keys of the past: full attention,
# and sliding windows (a CompactCache keeps every position; the window is
# the mask's).
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _storage_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be {_ACCEPTED}, got {dtype!r}")


def _count(name: str, x: Any, low: int, none: bool = True) -> int | None:
    if x is None and none:
        return None
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got {x!r}")
    try:
        n = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an int{' or None' if none else ''}"
                        f", got {type(x).__name__}") from None
    if n < low:
        raise ValueError(f"{name} must be >= {low}, got {n}")
    return n


def _has_int8() -> bool:
    return hasattr(ac, "quantize_kv") and hasattr(ac, "dequantize_kv")


# ---------------------------------------------------------------------------
# Deferred keys and values


# Answered from the placeholder itself; everything else sees the dense
# value.
_META = frozenset(
    [getattr(torch.Tensor, p).__get__ for p in
     ("shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_meta",
      "is_sparse", "is_quantized", "is_nested")]
    + [getattr(torch.Tensor, m) for m in
       ("size", "dim", "numel", "nelement", "element_size", "__len__",
        "is_floating_point", "is_complex", "get_device")])


def _dense(t: Any) -> Any:
    return t._ac_dense() if isinstance(t, _Deferred) else t


def _deferred_class() -> Any:
    """The placeholders' class, made with type() as _function() in
    transformers.py: stubtest (torch left unanalysed) cannot know
    torch.Tensor's metaclass."""

    def __torch_function__(cls: Any, func: Any, types: Any,
                           args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        tree = torch.utils._pytree
        args, kwargs = tree.tree_map(_dense, (args, kwargs))
        return func(*args, **kwargs)

    def ac_dense(self: Any) -> torch.Tensor:
        if self._ac_value is None:
            self._ac_value = self._ac_layer._dense(self)
        return self._ac_value   # type: ignore[no-any-return]

    return type("_Deferred", (torch.Tensor,), {
        "__torch_function__": classmethod(__torch_function__),
        "_ac_dense": ac_dense,
        "__doc__": "Keys or values of a CompactCache layer, not read yet "
                   "(see attention_c.integrations.compact_cache)."})


_Deferred: Any = _deferred_class()


def _deferred(layer: "CompactLayer", values: bool, n: int,
              new: torch.Tensor) -> Any:
    shape = (layer.batch_size, layer.num_heads, n,
             layer.v_head_dim if values else layer.k_head_dim)
    base = torch.zeros((), dtype=new.dtype).expand(*shape)
    t = torch.Tensor._make_subclass(_Deferred, base, False)
    t._ac_layer = layer
    t._ac_values = values
    t._ac_n = n                       # the positions it stands for
    t._ac_new = new                   # the rows of update(), (B, Hkv, Tn, d)
    t._ac_start = n - new.shape[2]
    t._ac_value = None
    return t


def deferred_layer(key: Any, value: Any) -> "CompactLayer | None":
    """The layer whose pending rows ``key`` and ``value`` are, when they
    are the fresh placeholders of one update (else None)."""
    if not (isinstance(key, _Deferred) and isinstance(value, _Deferred)):
        return None
    layer = key._ac_layer
    if (value._ac_layer is not layer or key._ac_values or
            not value._ac_values or key._ac_n != value._ac_n
            or key._ac_n != layer.seq_len or layer._pending is None
            or layer._pending[0] is not key._ac_new
            or layer._pending[1] is not value._ac_new):
        return None
    return layer   # type: ignore[no-any-return]


def dense(t: Any) -> Any:
    """``t`` itself, or a placeholder's dense value."""
    return _dense(t)


# ---------------------------------------------------------------------------
# A layer


class CompactLayer(_LayerBase, metaclass=ABCMeta):
    """One layer of a :class:`CompactCache` (see there).

    Storage: ``k``, ``v`` (B, capacity, Hkv, d) contiguous, or pools
    (num_blocks, block_size, Hkv, d) paged with ``block_table`` (B,
    max_blocks) int64; with int8, ``k_scales`` and ``v_scales`` (..., Hkv,
    d // group) float32.  ``keys`` and ``values`` name the same buffers.
    Positions ``0 .. written - 1`` are stored; ``seq_len - written`` rows
    are pending (given to ``update``, written by the attention or on the
    first dense read).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, dtype: torch.dtype, group: int,
                 block_size: int | None, max_cache_len: int | None) -> None:
        super().__init__()
        self.storage_dtype = dtype
        self.group = group
        self.block_size = block_size
        self.max_cache_len = max_cache_len
        self.seq_len = 0
        self.written = 0
        # Dense reads (a backend other than attention_c's cache path):
        # each is a widened copy of the layer's keys or values.
        self.dense_reads = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- storage ------------------------------------------------------------

    @property
    def int8(self) -> bool:
        return self.storage_dtype == torch.int8

    @property
    def paged(self) -> bool:
        return self.block_size is not None

    def lazy_initialization(self, key_states: torch.Tensor,
                            value_states: torch.Tensor) -> None:
        if key_states.device.type != "cpu":
            raise ValueError(f"CompactCache runs on the CPU only, got keys "
                             f"on {key_states.device}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads = key_states.shape[1]
        self.k_head_dim = key_states.shape[-1]
        self.v_head_dim = value_states.shape[-1]
        if self.int8:
            if not _has_int8():
                raise NotImplementedError(
                    "CompactCache(dtype='int8') needs attention_c's int8 "
                    "caches (attention_c.quantize_kv), which this build of "
                    "attention_c lacks; use dtype='bfloat16' or 'float16'")
            for name, d in (("key", self.k_head_dim),
                            ("value", self.v_head_dim)):
                if d % self.group:
                    raise ValueError(
                        f"group = {self.group} must divide the {name} head "
                        f"dimension d = {d} (int8 keeps one scale per "
                        f"group of d's elements)")
        self._allocate(key_states.shape[0])
        self.is_initialized = True

    def _allocate(self, batch: int) -> None:
        """Empty buffers for ``batch`` sequences (full size with
        max_cache_len, else grown on demand)."""
        self.batch_size = batch
        self.seq_len = self.written = 0
        self._pending = None
        if self.paged:
            bs = self.block_size
            assert bs is not None
            cols = (-(-self.max_cache_len // bs) if self.max_cache_len
                    else 0)
            self.block_table = torch.zeros((batch, cols), dtype=torch.int64)
            self._blocks = 0            # columns of the table in use
            self._alloc_rows(batch * cols, bs)
            self._free = list(range(batch * cols))
        else:
            self.block_table = None
            self._alloc_rows(batch, self.max_cache_len or 0)

    def _alloc_rows(self, n0: int, n1: int) -> None:
        """k, v (and scales) of shape (n0, n1, Hkv, .), zeros."""
        h = self.num_heads

        def buf(d: int, dt: torch.dtype) -> torch.Tensor:
            return torch.zeros((n0, n1, h, d), dtype=dt)
        self.k = buf(self.k_head_dim, self.storage_dtype)
        self.v = buf(self.v_head_dim, self.storage_dtype)
        if self.int8:
            self.k_scales: torch.Tensor | None = buf(
                self.k_head_dim // self.group, torch.float32)
            self.v_scales: torch.Tensor | None = buf(
                self.v_head_dim // self.group, torch.float32)
        else:
            self.k_scales = self.v_scales = None
        self.keys, self.values = self.k, self.v

    def _buffers(self) -> list[torch.Tensor]:
        return [b for b in (self.k, self.v, self.k_scales, self.v_scales)
                if b is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the keys, values and scales held (the block table and
        free list excluded)."""
        if not self.is_initialized:
            return 0
        return sum(b.numel() * b.element_size() for b in self._buffers())

    def _full(self, need: int) -> None:
        raise ValueError(
            f"CompactCache: {need} positions do not fit in max_cache_len = "
            f"{self.max_cache_len}; make it larger (or None to grow)")

    def _reserve(self, need: int) -> None:
        """Room for ``need`` positions of every sequence."""
        if self.max_cache_len is not None and need > self.max_cache_len:
            self._full(need)
        if not self.paged:
            cap = self.k.shape[1]
            if need <= cap:
                return
            new = max(cap, 16)
            while new < need:
                new *= 2
            old = self._buffers()
            self._alloc_rows(self.batch_size, new)
            for o, b in zip(old, self._buffers()):
                b[:, :self.written] = o[:, :self.written]
            return
        bs = self.block_size
        assert bs is not None
        want = -(-need // bs)
        if want <= self._blocks:
            return
        B = self.batch_size
        table = self.block_table
        assert table is not None
        if want > table.shape[1]:
            cols = max(table.shape[1], 1)
            while cols < want:
                cols *= 2
            grown = torch.zeros((B, cols), dtype=torch.int64)
            grown[:, :table.shape[1]] = table
            self.block_table = table = grown
        short = B * (want - self._blocks) - len(self._free)
        if short > 0:                   # a bigger pool, the blocks kept
            n = self.k.shape[0]
            total = max(2 * n, n + short)
            old = self._buffers()
            self._alloc_rows(total, bs)
            for o, b in zip(old, self._buffers()):
                b[:n] = o
            self._free += range(n, total)
        # column by column, so the sequences' blocks interleave in the pool
        for c in range(self._blocks, want):
            for b in range(B):
                table[b, c] = self._free.pop(0)
        self._blocks = want

    def _slots(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(buffer index, row) of positions start .. start + n - 1 of
        every sequence, each (B, n)."""
        pos = np.broadcast_to(np.arange(start, start + n),
                              (self.batch_size, n))
        if not self.paged:
            return np.broadcast_to(
                np.arange(self.batch_size)[:, None], pos.shape), pos
        bs = self.block_size
        assert bs is not None and self.block_table is not None
        table = self.block_table.numpy()
        return np.take_along_axis(table, pos // bs, axis=1), pos % bs

    def _put(self, k: np.ndarray, v: np.ndarray, start: int) -> None:
        """Rows (B, n, Hkv, d) in the storage at ``start``, as
        cache_attention writes its k= and v=."""
        blk, row = self._slots(start, k.shape[1])
        for x, buf, scales in ((k, self.k, self.k_scales),
                               (v, self.v, self.v_scales)):
            if scales is None:
                _np(buf)[blk, row] = x
            else:
                q, s = ac.quantize_kv(x, group=self.group)
                _np(buf)[blk, row] = q
                _np(scales)[blk, row] = s

    def _rows(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """Positions 0 .. n - 1 of every sequence, (B, n, Hkv, .): a view
        (contiguous) or a gathered copy (paged)."""
        if not self.paged:
            return buf[:, :n]
        bs = self.block_size
        assert bs is not None and self.block_table is not None
        nb = -(-n // bs)
        got = buf[self.block_table[:, :nb]]
        return got.reshape(self.batch_size, nb * bs, *buf.shape[2:])[:, :n]

    # -- pending rows -------------------------------------------------------

    def _commit(self) -> None:
        """Write the pending rows (the attention did not)."""
        if self._pending is None:
            return
        k, v = self._pending
        self._put(_np(k.transpose(1, 2)), _np(v.transpose(1, 2)),
                  self.written)
        self.written = self.seq_len
        self._pending = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Reserve room for the new keys and values (B, Hkv, Tn, d) and
        return placeholders for all N = seq_len + Tn positions; the rows
        are written by attention_c's attention (``cache_attention(k=,
        v=)``) or on the first dense read of a placeholder."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._commit()
        B, H, Tn = key_states.shape[:3]
        if (B, H) != (self.batch_size, self.num_heads) or tuple(
                value_states.shape[:3]) != (B, H, Tn):
            raise ValueError(
                f"CompactCache: keys {tuple(key_states.shape)} and values "
                f"{tuple(value_states.shape)} do not fit a layer of batch "
                f"{self.batch_size} and {self.num_heads} heads")
        n = self.seq_len + Tn
        self._reserve(n)
        self._pending = (key_states, value_states)
        self.seq_len = n
        return (_deferred(self, False, n, key_states),
                _deferred(self, True, n, value_states))

    def _dense(self, t: Any) -> torch.Tensor:
        """A placeholder's value: its n positions read back, (B, Hkv, n,
        d) in the model's dtype."""
        self._commit()
        n = t._ac_n
        if n > self.seq_len:
            raise RuntimeError(
                "a key/value tensor of a CompactCache was read after the "
                "cache was reset or cropped below its length")
        self.dense_reads += 1
        if t._ac_values:
            buf, scales = self.v, self.v_scales
        else:
            buf, scales = self.k, self.k_scales
        rows = self._rows(buf, n)
        if scales is not None:
            x = _from_np(ac.dequantize_kv(
                _np(rows), _np(self._rows(scales, n)))).to(t.dtype)
        else:
            x = rows.to(t.dtype)
        x = x.transpose(1, 2)
        new = t._ac_new
        if torch.is_grad_enabled() and new.requires_grad:
            # the stored value, with the gradient of the new rows
            s, e = t._ac_start, t._ac_start + new.shape[2]
            x = torch.cat([x[:, :, :s], new + (x[:, :, s:e] - new).detach(),
                           x[:, :, e:]], dim=2)
        return x

    def attend(self, query: torch.Tensor, **kw: Any) -> torch.Tensor:
        """attention_c.cache_attention of ``query`` (B, Hq, Tq, d) on this
        layer, its pending rows written in place first; (B, Tq, Hq, dv) in
        the query's dtype.  ``kw``: scale, causal, window, softcap,
        sinks."""
        assert self._pending is not None
        k, v = self._pending
        if self.paged:
            assert self.block_table is not None
            kw["block_table"] = self.block_table.numpy()
        if self.int8:
            assert self.k_scales is not None and self.v_scales is not None
            kw["k_scales"] = _np(self.k_scales)
            kw["v_scales"] = _np(self.v_scales)
        out = ac.cache_attention(
            _np(query.transpose(1, 2)), _np(self.k), _np(self.v),
            np.full(self.batch_size, self.written, dtype=np.int64),
            k=_np(k.transpose(1, 2)), v=_np(v.transpose(1, 2)), **kw)
        self.written = self.seq_len
        self._pending = None
        return _from_np(out)

    # -- transformers' Cache protocol --------------------------------------

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return self.max_cache_len if self.max_cache_len is not None else -1

    def offload(self) -> None:
        """CPU only: nothing to move."""

    def prefetch(self) -> None:
        """CPU only: nothing to move."""

    def reset(self) -> None:
        """Empty, the buffers kept."""
        self._pending = None
        self.seq_len = self.written = 0
        if self.is_initialized and self.paged:
            self._free = list(range(self.k.shape[0]))
            self._blocks = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (a negative count,
        as DynamicLayer)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative count of tokens to remove, got "
                f"{tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._commit()
        n = max(0, self.seq_len + tokens_to_remove)
        self.seq_len = self.written = n
        if self.paged:
            bs = self.block_size
            assert bs is not None and self.block_table is not None
            keep = -(-n // bs)
            for c in range(keep, self._blocks):
                self._free += self.block_table[:, c].tolist()
            self._blocks = keep

    def _select_rows(self, index: torch.Tensor) -> None:
        """Sequence b becomes sequence index[b] (beam search and batch
        edits): the stored rows copied, each into its own slots."""
        if not self.is_initialized:
            return
        self._commit()
        n = self.written
        index = index.to(torch.int64).cpu()
        old = [self._rows(b, n).index_select(0, index).contiguous()
               for b in self._buffers()]
        if len(index) != self.batch_size:
            self._allocate(len(index))
        self._reserve(n)
        self.seq_len = self.written = n
        blk, row = self._slots(0, n)
        for o, b in zip(old, self._buffers()):
            _np(b)[blk, row] = _np(o)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(
                self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch_size)[indices])


# ---------------------------------------------------------------------------
# The cache


class CompactCache(_CacheBase):
    """A transformers ``Cache`` of compact keys and values, read in place
    by attention_c's attention.

    Parameters
    ----------
    config : PretrainedConfig
        The model's config (its decoder's layers are the cache's).
    dtype : str or torch.dtype
        How keys and values are stored: "bfloat16", "float16" or "int8"
        (or torch.bfloat16, torch.float16, torch.int8).  int8: in groups
        of ``group`` consecutive elements of a head's vector, each with a
        float32 scale (:func:`attention_c.quantize_kv`: scale = max|x| /
        127, values rounded to nearest even).
    group : int
        int8's group, >= 8, dividing the head dimension.
    block_size : int, optional
        None: each layer holds one contiguous (B, capacity, Hkv, d)
        buffer for keys and one for values.  An int: paged, a pool of
        blocks of ``block_size`` positions and a block table per layer,
        blocks taken from the pool as the sequences grow.
    max_cache_len : int, optional
        Positions per sequence, allocated at the first update and never
        exceeded (ValueError).  None: the buffers (the pool) double when
        full, the stored rows copied once.

    With ``attn_implementation="attention_c"``
    (:func:`attention_c.integrations.transformers.register`), every
    attention call of a decoder's forward (prefill and each decoding
    step) is :func:`attention_c.cache_attention` on the layer's buffers:
    the new keys and values are written in place (cast or quantised) and
    the cache is read where it is, with no dequantised or concatenated
    copy.  This holds for the plain causal decoder (no padding: all the
    sequences of the batch as long), sliding windows, softcap and sinks.
    A mask with padding (``attention_mask`` with zeros, left-padded
    batches) or any other pattern, gradients, the attention weights, a
    position bias: the backend reads the cache densely instead (correct,
    a copy per call; counted in each layer's ``dense_reads``).

    With any other attn_implementation (sdpa, eager, ...), ``update``'s
    keys and values are read densely: a widened (dequantised) copy of
    the layer's keys and values, per call, in the model's dtype.  The
    results are those of a transformers cache holding the values this
    one stores (rounded to bfloat16/float16, or int8 dequantised).

    CPU only.  Every layer keeps all its positions (a sliding-window
    layer too).  Beam search and batch edits (``reorder_cache``,
    ``batch_select_indices``, ``batch_repeat_interleave``) copy the
    stored rows.
    """

    def __init__(self, config: Any, dtype: Any = "bfloat16",
                 group: int = 32, block_size: int | None = None,
                 max_cache_len: int | None = None) -> None:
        storage = _storage_dtype(dtype)
        g = _count("group", group, 8, none=False)
        assert g is not None
        block = _count("block_size", block_size, 1)
        cap = _count("max_cache_len", max_cache_len, 1)
        if storage == torch.int8 and not _has_int8():
            raise NotImplementedError(
                "CompactCache(dtype='int8') needs attention_c's int8 caches "
                "(attention_c.quantize_kv), which this build of attention_c "
                "lacks; use dtype='bfloat16' or 'float16'")
        text = config.get_text_config(decoder=True)
        types, _ = _cu.get_layer_types_and_kwargs(text)
        for i, t in enumerate(types):
            if t not in _LAYER_TYPES:
                raise NotImplementedError(
                    f"CompactCache: layer {i} is of type {t!r}; it holds "
                    f"the layers of types {', '.join(_LAYER_TYPES)} only")
        d = getattr(text, "head_dim", None) or (
            text.hidden_size // text.num_attention_heads)
        if storage == torch.int8 and d % g:
            raise ValueError(f"group = {g} must divide the head dimension "
                             f"d = {d} (int8 keeps one scale per group)")
        self.storage_dtype = storage
        self.group = g
        self.block_size = block
        self.max_cache_len = cap
        super().__init__(layers=[CompactLayer(storage, g, block, cap)
                                 for _ in types])

    @property
    def nbytes(self) -> int:
        """Bytes of the keys, values and scales of all the layers."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def dense_reads(self) -> int:
        """How many dense copies of a layer's keys or values were made
        (0 when attention_c's attention read every layer in place)."""
        return sum(layer.dense_reads for layer in self.layers)

    def __repr__(self) -> str:
        how = (f"paged, block_size={self.block_size}" if self.block_size
               else "contiguous")
        return (f"CompactCache({str(self.storage_dtype)[6:]}, {how}, "
                f"{len(self.layers)} layers, seq_len "
                f"{self.get_seq_length()})")
