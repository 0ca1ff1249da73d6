"""attention_c.torch.MultiheadAttention at work (issue 20): torch.compile
and torch.export of a decoder block, dropout, and decoding with
attention_c.torch.KVCache.  The comparisons with torch.nn.MultiheadAttention
are in test_mha_torch.py; the helpers of both in mha_cases.py.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
nn = torch.nn

from attention_c.testing import rel_err  # noqa: E402
from attention_c.torch import (  # noqa: E402
    KVCache, MultiheadAttention, scaled_dot_product_attention)

from mha_cases import (  # noqa: E402
    E, HEADS, KDIM, L, N, NEED, S, TOL, VDIM, causal_mask, make_inputs,
    make_masks, pair, randn, seq_shape)


# --------------------------------------------------------------------------
# torch.compile and torch.export


class Decoder(nn.Module):
    """A decoder block holding our MultiheadAttention twice (causal
    self-attention with the hint, cross-attention with a key padding mask,
    per-head weights) and calling our SDPA."""

    def __init__(self):
        super().__init__()
        self.self_attn = MultiheadAttention(E, HEADS, batch_first=True)
        self.cross = MultiheadAttention(E, HEADS, batch_first=True,
                                        kdim=KDIM, vdim=KDIM)
        self.head = nn.Linear(E, E)

    def forward(self, x, memory, pad, causal):
        y, _ = self.self_attn(x, x, x, attn_mask=causal, is_causal=True,
                              need_weights=False)
        z, w = self.cross(y, memory, memory, key_padding_mask=pad,
                          average_attn_weights=False)
        h = self.head(z).view(N, L, HEADS, E // HEADS).transpose(1, 2)
        s = scaled_dot_product_attention(h, h, h, is_causal=True)
        return s.sum(1) + w.sum(1) @ memory[..., :1], w


def decoder_inputs():
    pad = torch.zeros(N, S, dtype=torch.bool)
    pad[0, 4:] = True
    return (randn(N, L, E, seed=31, dtype=torch.float32),
            randn(N, S, KDIM, seed=32, dtype=torch.float32), pad,
            causal_mask(L, "bool"))


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) of the decoder block: outputs and
    parameter gradients equal eager's."""
    torch.manual_seed(0)
    eager = Decoder()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True)
    inputs = decoder_inputs()
    results = []
    for m, fn in ((eager, eager), (model, compiled)):
        out, w = fn(*inputs)
        (out.square().sum() + w.sum()).backward()
        results.append((out.detach(), w.detach(),
                        [p.grad for p in m.parameters()]))
    (oe, we, ge), (oc, wc, gc) = results
    assert rel_err(oc, oe) <= TOL[torch.float32]
    assert rel_err(wc, we) <= TOL[torch.float32]
    for a, b in zip(ge, gc):
        assert rel_err(b, a) <= TOL[torch.float32]


def test_export():
    """torch.export.export of the decoder block: the program calls
    attention_c operators and gives eager's outputs."""
    torch.manual_seed(0)
    model = Decoder()
    inputs = decoder_inputs()
    exported = torch.export.export(model, inputs)
    assert "attention_c." in str(exported.graph)
    got, want = exported.module()(*inputs), model(*inputs)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= TOL[torch.float32]


# --------------------------------------------------------------------------
# Dropout


def dropout_pair(p=0.4):
    ours, _ = pair(dropout=p, batch_first=True)
    plain, _ = pair(batch_first=True)
    return ours, plain


def test_dropout_eval_is_no_dropout():
    ours, plain = dropout_pair()
    q, k, v = make_inputs("cross", True, True)
    ours.eval()
    a, wa = ours(q, k, v, key_padding_mask=make_masks("kpm-bool", L, S)[
        "key_padding_mask"])
    b, wb = plain(q, k, v, key_padding_mask=make_masks("kpm-bool", L, S)[
        "key_padding_mask"])
    assert torch.equal(a, b) and torch.equal(wa, wb)


@pytest.mark.parametrize("need", list(NEED))
def test_dropout_training_reproducible(need):
    """In training: the same torch.manual_seed gives the same output (and
    the same gradients), another seed another output; the output is not
    the eval one; the returned weights are those before dropout (a
    deliberate difference), so equal to eval's."""
    ours, plain = dropout_pair()
    q, k, v = make_inputs("cross", True, True, seed=4)
    runs = []
    for seed in (1, 1, 2):
        ours.zero_grad()
        torch.manual_seed(seed)
        out, w = ours(q, k, v, **NEED[need])
        out.square().sum().backward()
        runs.append((out.detach(), w, ours.in_proj_weight.grad.clone()))
    (a, wa, ga), (b, wb, gb), (c, _, _) = runs
    assert torch.equal(a, b) and torch.equal(ga, gb)
    assert not torch.allclose(a, c)
    ref, wref = plain(q, k, v, **NEED[need])
    assert not torch.allclose(a, ref)
    if NEED[need]["need_weights"]:
        assert rel_err(wa, wref) <= TOL[torch.float64]
        assert torch.equal(wa, wb)


def test_dropout_is_unbiased():
    """The mean of the dropout outputs over many draws tends to the
    output without dropout (within 5 standard errors elementwise)."""
    ours, plain = dropout_pair(0.3)
    q, k, v = make_inputs("cross", True, True, seed=5)
    torch.manual_seed(0)
    with torch.no_grad():
        outs = torch.stack([ours(q, k, v, need_weights=False)[0]
                            for _ in range(100)])
        want = plain(q, k, v, need_weights=False)[0]
    se = outs.std(0) / outs.shape[0] ** 0.5
    z = (outs.mean(0) - want) / se
    assert z.abs().max() < 5.5


# --------------------------------------------------------------------------
# Decoding with the cache


def decode_setup(batch_first, **kwargs):
    ours, _ = pair(batch_first=batch_first, **kwargs)
    ours.eval()
    T = 9
    x = randn(*seq_shape(T, E, batch_first, True), seed=6)
    return ours, x, T


def step(x, t, n, batch_first):
    return x[:, t:t + n] if batch_first else x[t:t + n]


def cat(parts, batch_first):
    return torch.cat(parts, 1 if batch_first else 0)


@pytest.mark.parametrize("max_len", [None, 9], ids=["growing", "max_len"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["LNE", "NLE"])
def test_decode_step_by_step_equals_causal_forward(batch_first, max_len):
    """One query per step against the cache (under torch.no_grad) gives the
    full causal forward with the causal attn_mask (float64, 1e-12); the
    cache holds the projected keys and values as (N, heads, n, d) views;
    with max_len its buffer is never reallocated."""
    ours, x, T = decode_setup(batch_first)
    with torch.no_grad():
        full, _ = ours(x, x, x, attn_mask=causal_mask(T, "bool"),
                       is_causal=True, need_weights=False)
        cache = KVCache(max_len=max_len)
        outs, ptrs = [], set()
        for t in range(T):
            xt = step(x, t, 1, batch_first)
            out, w = ours(xt, xt, xt, cache=cache, need_weights=False)
            assert w is None and not out.requires_grad
            assert len(cache) == t + 1
            outs.append(out)
            ptrs.add((cache.keys.data_ptr(), cache.values.data_ptr()))
    assert rel_err(cat(outs, batch_first), full) <= 1e-12
    if max_len is not None:
        assert len(ptrs) == 1
    else:
        assert len(ptrs) <= 3      # grows by doubling, not every step
    d = E // HEADS
    xb = x if batch_first else x.transpose(0, 1)
    W, b = ours.in_proj_weight.detach(), ours.in_proj_bias.detach()
    k = F.linear(xb, W[E:2 * E], b[E:2 * E]).view(N, T, HEADS, d)
    v = F.linear(xb, W[2 * E:], b[2 * E:]).view(N, T, HEADS, d)
    assert cache.keys.shape == (N, HEADS, T, d)
    assert rel_err(cache.keys, k.transpose(1, 2)) <= 1e-14
    assert rel_err(cache.values, v.transpose(1, 2)) <= 1e-14


def test_cache_grows_by_doubling():
    """Without max_len the buffer is reallocated a logarithmic number of
    times over 33 steps, not at every step."""
    ours, _ = pair(batch_first=True)
    ours.eval()
    T = 33
    x = randn(N, T, E, seed=12)
    cache, outs, ptrs = KVCache(), [], set()
    with torch.no_grad():
        for t in range(T):
            xt = x[:, t:t + 1]
            outs.append(ours(xt, xt, xt, cache=cache, need_weights=False)[0])
            ptrs.add(cache.keys.data_ptr())
        full, _ = ours(x, x, x, attn_mask=causal_mask(T, "bool"),
                       is_causal=True, need_weights=False)
    assert len(ptrs) <= 6
    assert rel_err(torch.cat(outs, 1), full) <= 1e-12


@pytest.mark.parametrize("chunks", [[3, 1, 1, 4], [1, 5, 3], [9]])
def test_decode_chunks_are_bottom_right_causal(chunks):
    """Several new positions per call with is_causal=True (no attn_mask):
    causal among them, bottom-right against the cache, so the chunks
    give the full causal forward."""
    ours, x, T = decode_setup(True)
    with torch.no_grad():
        full, _ = ours(x, x, x, attn_mask=causal_mask(T, "bool"),
                       is_causal=True, need_weights=False)
        cache, outs, t = KVCache(), [], 0
        for n in chunks:
            xt = step(x, t, n, True)
            outs.append(ours(xt, xt, xt, cache=cache, is_causal=True,
                             need_weights=False)[0])
            t += n
    assert rel_err(cat(outs, True), full) <= 1e-12


def test_decode_reset_and_config():
    """reset() empties the cache (len 0) and decoding again gives the same
    outputs (a module without biases, a float causal mask)."""
    ours, x, T = decode_setup(False, bias=False)
    cache = KVCache(max_len=T)
    with torch.no_grad():
        runs = []
        for _ in range(2):
            outs = []
            for t in range(T):
                xt = step(x, t, 1, False)
                outs.append(ours(xt, xt, xt, cache=cache,
                                 need_weights=False)[0])
            runs.append(cat(outs, False))
            assert len(cache) == T
            cache.reset()
            assert len(cache) == 0
        full, _ = ours(x, x, x, attn_mask=causal_mask(T, "float"),
                       is_causal=True, need_weights=False)
    assert torch.equal(runs[0], runs[1])
    assert rel_err(runs[0], full) <= 1e-12


@pytest.mark.parametrize("again", ["none", "memory"])
@pytest.mark.parametrize("kvdim", [False, True], ids=["E", "kvdim"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["LNE", "NLE"])
def test_static_cache_cross_attention(batch_first, kvdim, again):
    """KVCache(static=True): the first call projects the memory, later
    calls reuse it (key/value None or the memory again); each step equals
    the full cross-attention call, weights included."""
    kwargs = {"kdim": KDIM, "vdim": VDIM} if kvdim else {}
    ours, _ = pair(batch_first=batch_first, **kwargs)
    ours.eval()
    y = randn(*seq_shape(L, E, batch_first, True), seed=8)
    mk = randn(*seq_shape(S, KDIM if kvdim else E, batch_first, True),
               seed=9)
    mv = randn(*seq_shape(S, VDIM if kvdim else E, batch_first, True),
               seed=10) if kvdim else mk
    with torch.no_grad():
        full, w_full = ours(y, mk, mv)
        cache = KVCache(static=True)
        outs, ws = [], []
        for t in range(L):
            yt = step(y, t, 1, batch_first)
            if t == 0 or again == "memory":
                out, w = ours(yt, mk, mv, cache=cache)
            else:
                out, w = ours(yt, None, None, cache=cache)
            assert len(cache) == S
            outs.append(out)
            ws.append(w)
    assert rel_err(cat(outs, batch_first), full) <= 1e-12
    assert rel_err(torch.cat(ws, 1), w_full) <= 1e-12


def test_cache_refuses_autograd_and_a_full_buffer():
    """With autograd recording, cache= is refused (inference only) and
    nothing is cached; a call beyond max_len raises and leaves the cache
    as it was."""
    ours, x, T = decode_setup(True)
    cache = KVCache(max_len=2)
    xt = step(x, 0, 1, True)
    with pytest.raises(RuntimeError, match="no_grad"):
        ours(xt, xt, xt, cache=cache, need_weights=False)
    assert len(cache) == 0
    with torch.no_grad():
        ours(xt, xt, xt, cache=cache, need_weights=False)
        keys = cache.keys.clone()
        x2 = step(x, 1, 2, True)
        with pytest.raises(ValueError, match="max_len"):
            ours(x2, x2, x2, cache=cache, is_causal=True, need_weights=False)
    assert len(cache) == 1 and torch.equal(cache.keys, keys)


def test_cache_bad_mask_leaves_the_cache_unchanged():
    """A key_padding_mask of the wrong shape in a cached step raises
    before anything is appended."""
    ours, x, T = decode_setup(True)
    cache = KVCache()
    with torch.no_grad():
        xt = step(x, 0, 1, True)
        ours(xt, xt, xt, cache=cache, need_weights=False)
        xt = step(x, 1, 1, True)
        bad = torch.zeros(N, 5, dtype=torch.bool)
        with pytest.raises((AssertionError, RuntimeError)):
            ours(xt, xt, xt, cache=cache, key_padding_mask=bad,
                 need_weights=False)
    assert len(cache) == 1
