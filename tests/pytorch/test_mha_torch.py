"""attention_c.torch.MultiheadAttention against torch.nn.MultiheadAttention
with the same state_dict, and decoding with attention_c.torch.KVCache
(issue 20).

Outputs, weights and the gradients of the inputs and of every parameter
over the constructor's and forward's arguments (batch_first, unbatched
inputs, self- and cross-attention, kdim/vdim, bias, add_bias_kv,
add_zero_attn, bool and float key_padding_mask and 2-D/3-D attn_mask, the
is_causal hint, need_weights and average_attn_weights): float64 within
1e-10 of PyTorch, float32 within 2e-5 of PyTorch in float64 on the same
rounded values (normwise).  A fully masked query gives 0 before the output
projection where PyTorch gives NaN with need_weights=True: those rows are
checked apart.  Then the subclass and its state_dict, gradcheck and
gradgradcheck, torch.compile and torch.export, dropout, decoding with the
cache, and bad input.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
nn = torch.nn

from attention_c.testing import rel_err  # noqa: E402
from attention_c.torch import (  # noqa: E402
    KVCache, MultiheadAttention, scaled_dot_product_attention)

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}

E, HEADS, N, L, S, KDIM, VDIM = 6, 3, 3, 5, 7, 4, 5
NEG_INF = float("-inf")


def randn(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def pair(dtype=torch.float64, seed=0, **kwargs):
    """(ours in dtype, PyTorch's in float64) with the same random
    parameters (biases non-zero), rounded to dtype."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, HEADS, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    ours = MultiheadAttention(E, HEADS, dtype=dtype, **kwargs)
    ours.load_state_dict({k: v.to(dtype)
                          for k, v in ref.state_dict().items()})
    ref.load_state_dict({k: v.double()
                         for k, v in ours.state_dict().items()})
    return ours, ref


def seq_shape(T, width, batch_first, batched):
    if not batched:
        return (T, width)
    return (N, T, width) if batch_first else (T, N, width)


def make_inputs(attention, batch_first, batched, seed=0):
    """float64 (query, key, value); the same tensor three times for
    self-attention, the same key and value for 'cross'."""
    T = L if attention == "self" else S
    q = randn(*seq_shape(L, E, batch_first, batched), seed=seed)
    if attention == "self":
        return q, q, q
    if attention == "cross":
        k = randn(*seq_shape(T, E, batch_first, batched), seed=seed + 1)
        return q, k, k
    return (q, randn(*seq_shape(T, KDIM, batch_first, batched), seed=seed + 1),
            randn(*seq_shape(T, VDIM, batch_first, batched), seed=seed + 2))


def module_kwargs(attention):
    return {"kdim": KDIM, "vdim": VDIM} if attention == "kvdim" else {}


def pytorch_mask(shape, kind, *, seed=3, full=None):
    """A mask in nn.MultiheadAttention's convention (bool True = not
    allowed, float added with -inf entries); column 0 always allowed
    unless ``full`` (an index into the leading axes) is masked entirely."""
    g = torch.Generator().manual_seed(seed)
    blocked = torch.rand(*shape, generator=g) < 0.4
    blocked[..., 0] = False
    if full is not None:
        blocked[full] = True
    if kind == "bool":
        return blocked
    bias = torch.randn(*shape, generator=g, dtype=torch.float64)
    return bias.masked_fill(blocked, NEG_INF)


def causal_mask(T, kind):
    upper = torch.ones(T, T, dtype=torch.bool).triu(1)
    if kind == "bool":
        return upper
    return torch.zeros(T, T, dtype=torch.float64).masked_fill(upper, NEG_INF)


MASK_CASES = ["none", "kpm-bool", "kpm-float", "2d-bool", "2d-float",
              "3d-bool", "3d-float", "causal-bool", "causal-float",
              "kpm-bool+2d-bool", "kpm-float+3d-float",
              "kpm-bool+causal-bool", "kpm-float+causal-float"]


def make_masks(case, T_q, T_k, batched=True, full=False):
    """forward's keyword arguments for a MASK_CASES entry; with full, the
    key_padding_mask masks sequence 1 entirely and attn_mask query 2."""
    kwargs = {}
    for part in case.split("+"):
        if part == "none":
            continue
        what, kind = part.split("-")
        if what == "kpm":
            shape = (N, T_k) if batched else (T_k,)
            at = (1 if batched else slice(None)) if full else None
            kwargs["key_padding_mask"] = pytorch_mask(shape, kind, full=at)
        elif what == "causal":
            kwargs["attn_mask"] = causal_mask(T_q, kind)
            kwargs["is_causal"] = True
        else:
            lead = () if what == "2d" else ((N if batched else 1) * HEADS,)
            kwargs["attn_mask"] = pytorch_mask(
                lead + (T_q, T_k), kind, seed=4,
                full=(..., 2, slice(None)) if full else None)
    return kwargs


NEED = {"no-weights": {"need_weights": False},
        "avg-weights": {"need_weights": True},
        "head-weights": {"need_weights": True,
                         "average_attn_weights": False}}


def leaves(inputs, dtype):
    """inputs rounded to dtype as fresh leaves requiring grad, keeping which
    of them are the same tensor (self-attention)."""
    made = {}
    out = []
    for x in inputs:
        if id(x) not in made:
            made[id(x)] = x.detach().to(dtype).clone().requires_grad_()
        out.append(made[id(x)])
    return out


def unique(xs):
    seen, out = set(), []
    for x in xs:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def cast_masks(kwargs, dtype):
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor)
                and v.is_floating_point() else v)
            for k, v in kwargs.items()}


def run_pair(ours, ref, inputs, kwargs, dtype, weights_in_loss=True,
             ref_kwargs=None):
    """Call both on the same rounded inputs, backpropagate a random linear
    function of the output (and of the weights if returned and
    weights_in_loss), and return ((out, weights, grads) of ours, the same
    of PyTorch's), the grads by name: input i and each parameter."""
    results = []
    ref_kwargs = kwargs if ref_kwargs is None else ref_kwargs
    for module, dt, kw in ((ours, dtype, kwargs),
                           (ref, torch.float64, ref_kwargs)):
        xs = leaves(inputs, dtype)
        if dt != dtype:
            made = {}
            xs = [made.setdefault(id(x), x.detach().double()
                                  .requires_grad_()) for x in xs]
        module.zero_grad()
        kw = cast_masks(kw, dtype)
        if dt != dtype:
            kw = cast_masks(kw, torch.float64)
        out, w = module(*xs, **kw)
        loss = (out * randn(*out.shape, seed=7, dtype=out.dtype)).sum()
        if w is not None and weights_in_loss:
            loss = loss + (w * randn(*w.shape, seed=8, dtype=w.dtype)).sum()
        loss.backward()
        grads = {f"input{i}": x.grad for i, x in enumerate(unique(xs))}
        grads.update({n: p.grad for n, p in module.named_parameters()})
        results.append((out.detach(), None if w is None else w.detach(),
                        grads))
    return results


def assert_pair(results, dtype, weights=True):
    (out, w, grads), (out_r, w_r, grads_r) = results
    assert out.dtype == dtype and out.shape == out_r.shape
    err = rel_err(out, out_r)
    assert err <= TOL[dtype], f"out: {err:.3g}"
    if weights:
        assert (w is None) == (w_r is None)
        if w is not None:
            assert w.shape == w_r.shape
            err = rel_err(w, w_r)
            assert err <= TOL[dtype], f"weights: {err:.3g}"
    assert grads.keys() == grads_r.keys()
    for name in grads:
        assert torch.isfinite(grads_r[name]).all(), name
        assert grads[name] is not None, name
        err = rel_err(grads[name], grads_r[name])
        assert err <= TOL[dtype], f"grad of {name}: {err:.3g}"


# --------------------------------------------------------------------------
# Against nn.MultiheadAttention


@pytest.mark.parametrize("need", list(NEED))
@pytest.mark.parametrize("batch_first", [False, True], ids=["LNE", "NLE"])
@pytest.mark.parametrize("masks", MASK_CASES)
def test_masks_against_pytorch(masks, batch_first, need):
    """Every mask combination with every need_weights form, in float64:
    cross-attention (L != S), self-attention for the causal hint."""
    attention = "self" if "causal" in masks else "cross"
    ours, ref = pair(batch_first=batch_first)
    inputs = make_inputs(attention, batch_first, True)
    T_k = L if attention == "self" else S
    kwargs = dict(make_masks(masks, L, T_k), **NEED[need])
    assert_pair(run_pair(ours, ref, inputs, kwargs, torch.float64),
                torch.float64)


CONFIGS = [(a, bias, bkv, zero) for a in ("self", "cross", "kvdim")
           for bias in (True, False) for bkv in (False, True)
           for zero in (False, True)]
CONFIG_IDS = [f"{a}-{'b' if b else 'nob'}{'-bkv' if k else ''}"
              f"{'-zero' if z else ''}" for a, b, k, z in CONFIGS]


@pytest.mark.parametrize("masks", ["kpm-bool+3d-bool", "kpm-float+2d-float"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched",
                                                        "unbatched"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["LNE", "NLE"])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_configs_against_pytorch(config, batch_first, batched, masks):
    """Every constructor combination (self/cross/kdim-vdim, bias,
    add_bias_kv, add_zero_attn) on batched and unbatched inputs, float64,
    per-head weights."""
    attention, bias, bkv, zero = config
    ours, ref = pair(batch_first=batch_first, bias=bias, add_bias_kv=bkv,
                     add_zero_attn=zero, **module_kwargs(attention))
    inputs = make_inputs(attention, batch_first, batched, seed=1)
    T_k = L if attention == "self" else S
    kwargs = dict(make_masks(masks, L, T_k, batched=batched),
                  need_weights=True, average_attn_weights=False)
    assert_pair(run_pair(ours, ref, inputs, kwargs, torch.float64),
                torch.float64)


@pytest.mark.parametrize("need", list(NEED))
@pytest.mark.parametrize("case", [
    ("cross", "kpm-bool+2d-bool", True), ("self", "causal-float", True),
    ("kvdim", "kpm-float+3d-float", True), ("self", "3d-bool", False),
    ("kvdim", "kpm-bool+causal-bool", True)],
    ids=lambda c: "-".join(map(str, c)))
def test_float32_against_pytorch_float64(case, need):
    """float32 parameters and inputs: within 2e-5 of PyTorch in float64 on
    the same rounded values (outputs, weights, every gradient)."""
    attention, masks, batch_first = case
    T_k = L if attention == "self" else S
    if "causal" in masks:
        attention, T_k = "self", L
    ours, ref = pair(torch.float32, batch_first=batch_first,
                     add_bias_kv=attention == "kvdim",
                     **module_kwargs(attention))
    inputs = make_inputs(attention, batch_first, True, seed=2)
    kwargs = dict(make_masks(masks, L, T_k), **NEED[need])
    assert_pair(run_pair(ours, ref, inputs, kwargs, torch.float32),
                torch.float32)


FULL_CASES = ["kpm-bool", "kpm-float", "2d-bool", "2d-float", "3d-bool",
              "3d-float", "kpm-bool+2d-bool"]


@pytest.mark.parametrize("need", list(NEED))
@pytest.mark.parametrize("batched", [True, False], ids=["batched",
                                                        "unbatched"])
@pytest.mark.parametrize("masks", FULL_CASES)
def test_fully_masked_queries(masks, batched, need):
    """A query that may attend to no key: ours gives 0 before the output
    projection (the output is out_proj.bias) and weights of 0, PyTorch
    NaN with need_weights=True.  The output and every gradient are
    compared with PyTorch's need_weights=False path (SDPA, which gives 0
    too), the weights of the other queries with need_weights=True."""
    ours, ref = pair(batch_first=True)
    inputs = make_inputs("cross", True, batched, seed=3)
    kwargs = make_masks(masks, L, S, batched=batched, full=True)
    results = run_pair(ours, ref, inputs, dict(kwargs, **NEED[need]),
                       torch.float64, weights_in_loss=False,
                       ref_kwargs=dict(kwargs, need_weights=False))
    assert_pair(results, torch.float64, weights=False)
    out, w, _ = results[0]
    dead = torch.zeros(out.shape[:-1], dtype=torch.bool)
    if "kpm" in masks:
        dead[1 if batched else slice(None)] = True
    if "2d" in masks or "3d" in masks:
        dead[..., 2] = True
    bias = ours.out_proj.bias.detach()
    assert torch.equal(out[dead], bias.expand_as(out[dead]))
    if (~dead).any():
        assert not torch.equal(out[~dead], bias.expand_as(out[~dead]))
    if w is None:
        return
    _, w_ref = ref(*(x.double() for x in inputs), **kwargs, **NEED[need])
    rows = torch.isnan(w_ref).any(-1)
    assert rows.any()
    assert (w[rows] == 0).all()
    assert rel_err(w[~rows], w_ref[~rows]) <= TOL[torch.float64]


# --------------------------------------------------------------------------
# The subclass, its state_dict and its initialisation


STATE_CONFIGS = [{}, {"bias": False}, {"add_bias_kv": True},
                 {"kdim": KDIM, "vdim": VDIM}, {"kdim": KDIM},
                 {"add_zero_attn": True, "batch_first": True}]
STATE_IDS = ["default", "nobias", "bias_kv", "kvdim", "kdim", "zero-bf"]


@pytest.mark.parametrize("kwargs", STATE_CONFIGS, ids=STATE_IDS)
def test_subclass_and_state_dict_round_trip(kwargs):
    """isinstance of nn.MultiheadAttention; the state_dict keys, shapes and
    the parameter names are PyTorch's; loading either into the other
    (strict) gives the same outputs."""
    theirs = nn.MultiheadAttention(E, HEADS, dtype=torch.float64, **kwargs)
    ours = MultiheadAttention(E, HEADS, dtype=torch.float64, **kwargs)
    assert isinstance(ours, nn.MultiheadAttention)
    a, b = theirs.state_dict(), ours.state_dict()
    assert list(a) == list(b)
    assert all(a[k].shape == b[k].shape for k in a)
    assert ([n for n, _ in theirs.named_parameters()]
            == [n for n, _ in ours.named_parameters()])
    for attr in ("embed_dim", "num_heads", "head_dim", "kdim", "vdim",
                 "batch_first", "dropout", "add_zero_attn",
                 "_qkv_same_embed_dim"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    attention = "kvdim" if "kdim" in kwargs else "cross"
    inputs = make_inputs(attention, kwargs.get("batch_first", False), True)
    if "vdim" not in kwargs and "kdim" in kwargs:
        inputs = (inputs[0], inputs[1], randn(*inputs[1].shape[:-1], E))
    ours.load_state_dict(theirs.state_dict())
    want = theirs(*inputs)[0]
    assert rel_err(ours(*inputs)[0], want) <= TOL[torch.float64]
    back = nn.MultiheadAttention(E, HEADS, dtype=torch.float64, **kwargs)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back(*inputs)[0], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kwargs", STATE_CONFIGS, ids=STATE_IDS)
def test_same_initialisation_under_manual_seed(kwargs, dtype):
    torch.manual_seed(17)
    theirs = nn.MultiheadAttention(E, HEADS, dtype=dtype, **kwargs)
    torch.manual_seed(17)
    ours = MultiheadAttention(E, HEADS, dtype=dtype, **kwargs)
    a, b = theirs.state_dict(), ours.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == dtype, k
        assert torch.equal(a[k], b[k]), k
    # The generator is left where PyTorch's constructor leaves it.
    after_ours = torch.rand(3)
    torch.manual_seed(17)
    nn.MultiheadAttention(E, HEADS, dtype=dtype, **kwargs)
    assert torch.equal(after_ours, torch.rand(3))


# --------------------------------------------------------------------------
# gradcheck and gradgradcheck


def small_module(**kwargs):
    torch.manual_seed(5)
    m = MultiheadAttention(4, 2, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    return m


GRAD_CASES = {
    "self-causal": ({"batch_first": True}, "self", "causal-float",
                    {"need_weights": False}),
    "cross-kpm-weights": ({}, "cross", "kpm-bool",
                          {"need_weights": True,
                           "average_attn_weights": False}),
    "kvdim-bias_kv-zero": ({"kdim": 3, "vdim": 5, "add_bias_kv": True,
                            "add_zero_attn": True}, "kvdim", "2d-float",
                           {"need_weights": True}),
}


def grad_function(case):
    """(f, inputs): f(query, key, value, *parameters) -> the outputs, for
    gradcheck in float64 on a small module."""
    kwargs, attention, masks, need = GRAD_CASES[case]
    m = small_module(**kwargs)
    bf = kwargs.get("batch_first", False)
    Lq, Sk = 3, (3 if attention == "self" else 4)
    shape = (2, Lq, 4) if bf else (Lq, 2, 4)
    kshape = (2, Sk) if bf else (Sk, 2)
    q = randn(*shape, seed=1)
    k = randn(*kshape, kwargs.get("kdim", 4), seed=2)
    v = randn(*kshape, kwargs.get("vdim", 4), seed=3)
    masks = {"self-causal": {"attn_mask": causal_mask(3, "float"),
                             "is_causal": True},
             "cross-kpm-weights": {"key_padding_mask": torch.tensor(
                 [[False, True, False, True], [False] * 4])},
             "kvdim-bias_kv-zero": {"attn_mask": pytorch_mask((3, 4),
                                                              "float")}}[case]
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_()
              for _, p in m.named_parameters()]
    if attention == "self":
        data = [q.requires_grad_()]
    else:
        data = [x.requires_grad_() for x in (q, k, v)]

    def f(*xs):
        qkv = xs[:len(data)] * (3 if attention == "self" else 1)
        ps = dict(zip(names, xs[len(data):]))
        out, w = torch.func.functional_call(m, ps, tuple(qkv),
                                            dict(masks, **need))
        return (out,) if w is None else (out, w)

    return f, data + params


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradcheck(case):
    f, inputs = grad_function(case)
    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("case", ["self-causal", "cross-kpm-weights"])
def test_gradgradcheck(case):
    f, inputs = grad_function(case)
    assert torch.autograd.gradgradcheck(f, inputs)


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


# --------------------------------------------------------------------------
# Bad input


def test_embed_dim_not_divisible_by_num_heads():
    """AssertionError at construction, as PyTorch."""
    with pytest.raises(AssertionError):
        nn.MultiheadAttention(10, 3)
    with pytest.raises(AssertionError, match="divisible"):
        MultiheadAttention(10, 3)


def bad_calls():
    q, k, _ = make_inputs("cross", False, True)
    qk, kk, vk = make_inputs("kvdim", False, True)
    causal = causal_mask(L, "bool")
    return {
        "key-width": ({}, (q, k[..., :4], k[..., :4]), {}),
        "kdim": ({"kdim": KDIM, "vdim": VDIM},
                 (qk, randn(S, N, KDIM + 1), vk), {}),
        "vdim": ({"kdim": KDIM, "vdim": VDIM},
                 (qk, kk, randn(S, N, VDIM - 1)), {}),
        "query-width": ({}, (q[..., :4], k, k), {}),
        "query-4d": ({}, (q[None], k[None], k[None]), {}),
        "value-length": ({}, (q, k, k[:-1]), {}),
        "kpm-shape": ({}, (q, k, k),
                      {"key_padding_mask": torch.zeros(N, S - 1,
                                                       dtype=torch.bool)}),
        "kpm-unbatched-2d": ({}, (q[:, 0], k[:, 0], k[:, 0]),
                             {"key_padding_mask": torch.zeros(
                                 1, S, dtype=torch.bool)}),
        "attn-2d-shape": ({}, (q, k, k),
                          {"attn_mask": torch.zeros(L, S - 1,
                                                    dtype=torch.bool)}),
        "attn-3d-shape": ({}, (q, k, k),
                          {"attn_mask": torch.zeros(N, L, S,
                                                    dtype=torch.bool)}),
        "attn-4d": ({}, (q, k, k),
                    {"attn_mask": torch.zeros(N, HEADS, L, S,
                                              dtype=torch.bool)}),
        "attn-int": ({}, (q, k, k),
                     {"attn_mask": torch.zeros(L, S, dtype=torch.int64)}),
        "causal-without-mask": ({}, (q, q, q), {"is_causal": True}),
        "causal-wrong-shape": ({}, (q, q, q),
                               {"attn_mask": causal[:, :-1],
                                "is_causal": True}),
    }


@pytest.mark.parametrize("case", list(bad_calls()))
def test_bad_input_like_pytorch(case):
    """What nn.MultiheadAttention refuses, ours refuses with the same
    exception type and a message, before changing anything: parameters,
    their gradients and the inputs stay as they were."""
    kwargs, args, call = bad_calls()[case]
    ours, ref = pair(**kwargs)
    with pytest.raises((AssertionError, RuntimeError)) as theirs:
        ref(*args, **call)
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    before = [x.clone() for x in args]
    # A key narrower than kdim fails inside PyTorch's projection
    # (RuntimeError); ours checks it first (AssertionError, as for kdim).
    accepted = ((type(theirs.value), AssertionError) if case == "key-width"
                else type(theirs.value))
    with pytest.raises(accepted) as err:
        ours(*args, **call)
    assert str(err.value)
    if case == "causal-without-mask":
        assert "Need attn_mask" in str(err.value)
    after = ours.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert all(p.grad is None for p in ours.parameters())
    for a, b in zip(args, before):
        assert torch.equal(a, b)
