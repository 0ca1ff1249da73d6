"""The shared cases of test_flash_attn_kvcache.py (float caches) and
test_flash_attn_kvcache_int8.py (int8 caches), the tests of
attention_c.torch.flash_attn_with_kvcache: the tolerances (``TOL``), the
flash_attn keywords of each variant (``VARIANTS``, made per heads by
``fill``, and as cache_attention's by ``np_kw``), seeded inputs
(``randn``), a contiguous or paged key-value cache (``Cache``), the
float64 PyTorch reference (``reference``: the softmax over the keys
gathered from the cache) and the checks against it (``check``,
``check_lse``).
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attention_c.testing import flash_kw_as_numpy, rel_err  # noqa: E402

TOL = {torch.float64: 1e-12, torch.float32: 2e-5}

# name -> flash_attn keywords (slopes and sinks made per heads by fill)
VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (3, 1)},
    "window_causal": {"window_size": (2, -1), "causal": True},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi_slopes": "heads"},
    "alibi_batch": {"alibi_slopes": "batch"},
    "sinks": {"sinks": True},
    "scale": {"softmax_scale": 0.3},
    "all": {"causal": True, "window_size": (4, 1), "softcap": 2.0,
            "alibi_slopes": "batch", "sinks": True},
}


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def fill(kw, B, H, seed=10):
    kw = dict(kw)
    if kw.get("alibi_slopes") is not None:
        shape = (H,) if kw["alibi_slopes"] == "heads" else (B, H)
        kw["alibi_slopes"] = randn(*shape, seed=seed).abs() * 0.5
    if kw.get("sinks") is True:
        kw["sinks"] = randn(H, seed=seed + 1)
    return kw


def np_kw(kw):
    """flash_attn keywords as cache_attention's."""
    return flash_kw_as_numpy(kw, np.float32)


class Cache:
    """A key-value cache of B sequences filled to ``seqlens``, contiguous
    (B, S_max, Hk, d) or paged (blocks of ``block`` rows, shuffled, with
    spare blocks), the unused slots filled with noise."""

    def __init__(self, B, S_max, Hk, d, dv, seqlens, block=None, seed=0,
                 dtype=torch.float32):
        self.B, self.S_max, self.block = B, S_max, block
        k = randn(B, S_max, Hk, d, seed=seed)
        v = randn(B, S_max, Hk, dv, seed=seed + 1)
        self.seqlens = torch.tensor(seqlens, dtype=torch.int32)
        if block is None:
            self.k, self.v, self.table = k.to(dtype), v.to(dtype), None
            return
        assert S_max % block == 0
        per = S_max // block
        n = B * per + 3                              # 3 spare blocks
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(
            seed + 2))[:B * per]
        self.table = perm.reshape(B, per).to(torch.int32)
        kp = randn(n, block, Hk, d, seed=seed + 3)
        vp = randn(n, block, Hk, dv, seed=seed + 4)
        kp[perm] = k.reshape(B * per, block, Hk, d)
        vp[perm] = v.reshape(B * per, block, Hk, dv)
        self.k, self.v = kp.to(dtype), vp.to(dtype)

    def kw(self):
        return {} if self.table is None else {"block_table": self.table}

    def gather(self, b, n, which="k"):
        """The first n positions of sequence b, float64 (n, Hk, d)."""
        c = self.k if which == "k" else self.v
        if self.table is None:
            return c[b, :n].double()
        rows = [c[self.table[b, t // self.block], t % self.block]
                for t in range(n)]
        return (torch.stack(rows) if rows
                else c.new_zeros((0,) + c.shape[2:])).double()

    def copy(self):
        new = object.__new__(Cache)
        new.__dict__.update(self.__dict__)
        new.k, new.v = self.k.clone(), self.v.clone()
        return new


def reference(q, keys, vals, kw):
    """(out (B, Tq, H, dv), lse (B, H, Tq)) in float64: for each sequence
    the softmax over its keys (n_b, Hk, d), FlashAttention's semantics."""
    B, Tq, H, d = q.shape
    scale = kw.get("softmax_scale") or 1 / math.sqrt(d)
    left, right = kw.get("window_size", (-1, -1))
    cap = kw.get("softcap", 0.0)
    slopes, sinks = kw.get("alibi_slopes"), kw.get("sinks")
    outs, lses = [], []
    for b in range(B):
        k, v = keys[b], vals[b]
        N, Hk = k.shape[0], k.shape[1]
        G = H // Hk
        k = k.repeat_interleave(G, dim=1)            # (N, H, d)
        v = v.repeat_interleave(G, dim=1)
        s = scale * torch.einsum("ihd,thd->hit", q[b].double(), k)
        if cap:
            s = cap * torch.tanh(s / cap)
        p = torch.arange(Tq, dtype=torch.float64)[:, None] + (N - Tq)
        t = torch.arange(N, dtype=torch.float64)[None, :]
        if slopes is not None:
            sl = (slopes if slopes.ndim == 1 else slopes[b]).double()
            s = s - sl[:, None, None] * (p - t).abs()
        see = torch.ones(Tq, N, dtype=torch.bool)
        if kw.get("causal"):
            see &= t <= p
        if left != -1:
            see &= t >= p - left
        if right != -1:
            see &= t <= p + right
        s = s.masked_fill(~see, -math.inf)
        if sinks is not None:
            sk = sinks.double()[:, None, None].expand(H, Tq, 1)
            full = torch.cat([s, sk], dim=-1)
        else:
            full = s
        lse = torch.logsumexp(full, dim=-1)          # (H, Tq)
        w = torch.exp(s - lse[..., None])
        w = torch.nan_to_num(w, nan=0.0)             # no key, no sink
        outs.append(torch.einsum("hit,thd->ihd", w, v))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def check(got, want, dtype, what):
    err = rel_err(got.double(), want)
    assert err <= TOL[dtype], (what, err)


def check_lse(got, want, dtype):
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert torch.equal(got[~fin], want[~fin])
    check(got[fin], want[fin], dtype, "lse")
