"""The location and content (cosine) scores in the PyTorch adapter
(attention_c.torch.location_attention, cosine_attention, LocationAttention,
CosineAttention; issue 31).

Forward and backward against plain PyTorch differentiated by autograd
(location: the masked softmax of ``F.linear(q, W[:T], b[:T])``; cosine:
of ``beta F.normalize(q) @ F.normalize(k).mT + bias``) in float32 and
float64: masks, causal, fully masked queries, one query or several,
leading axes that broadcast, sharpness None, a number or a tensor (with
its gradient, summed over broadcast axes), zero vectors; gradcheck and
gradgradcheck in float64; the operators under opcheck, meta tensors,
torch.func; one torch.compile(fullgraph=True) and one torch.export of a
model with both layers; bfloat16; the modules (parameters, loaders,
state_dict, dropout); the errors, each naming its argument.
"""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import attention_c.torch as act  # noqa: E402
from attention_c.testing import (  # noqa: E402
    TORCH_FAMILY_SIZES, rel_err, torch_causal_mask, torch_key_mask,
    torch_masked_softmax)

B, TQ, T, H, HQ, _, HV = TORCH_FAMILY_SIZES
TMAX = T + 2                    # W's rows past T are unused (gradient 0)
TOL = {torch.float64: 1e-12, torch.float32: 2e-6}
GRAD_TOL = {torch.float64: 1e-11, torch.float32: 2e-5}
# Twice the unit roundoff of the low-precision format (see test_torch_op).
LOW_TOL = {torch.bfloat16: 2 * 2.0 ** -8}


def randn(*shape, seed=0, dtype=torch.float64, scale=1.0, grad=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    return x.to(dtype).requires_grad_(grad)


# --------------------------------------------------------------------------
# The scores in plain PyTorch


def visible(shape, single, mask=None, attn_mask=None, causal=False):
    """The (..., Tq, T) (or (..., T)) visibility of the scores' shape."""
    vis = torch.ones(shape, dtype=torch.bool)
    if mask is not None:
        vis = vis & (mask if single else mask.unsqueeze(-2))
    if attn_mask is not None:
        vis = vis & attn_mask
    if causal:
        tq, t = shape[-2], shape[-1]
        vis = vis & torch.ones(tq, t, dtype=torch.bool).tril(t - tq)
    return vis


def attend(alpha, values, single):
    if single:
        return (alpha.unsqueeze(-2) @ values).squeeze(-2)
    return alpha @ values


def ref_location(query, values, W, b=None, mask=None, attn_mask=None):
    single = query.ndim < values.ndim
    n = values.shape[-2]
    s = F.linear(query, W[:n], None if b is None else b[:n])
    alpha = torch_masked_softmax(s, visible(s.shape, single, mask,
                                            attn_mask))
    return attend(alpha, values, single), alpha


def ref_cosine(query, keys, values=None, sharpness=None, bias=None,
               mask=None, attn_mask=None, causal=False):
    """(out, alpha, lse)."""
    single = query.ndim < keys.ndim
    q = query.unsqueeze(-2) if single else query
    s = F.normalize(q, dim=-1) @ F.normalize(keys, dim=-1).mT
    if single:
        s = s.squeeze(-2)
    if sharpness is not None:
        s = torch.as_tensor(sharpness, dtype=s.dtype).unsqueeze(-1) * s
    if bias is not None:
        s = s + bias
    vis = visible(s.shape, single, mask, attn_mask, causal)
    alpha = torch_masked_softmax(s, vis)
    lse = torch.where(vis, s, -torch.inf).logsumexp(-1)
    return (attend(alpha, keys if values is None else values, single),
            alpha, lse)


# --------------------------------------------------------------------------
# Problems: (our call's arguments, the reference's)


def location_problem(case, dtype=torch.float64, seed=0):
    q_shape = {"single": (B, HQ), "broadcast": (2, 1, TQ, HQ)}.get(
        case, (B, TQ, HQ))
    v_shape = (1, 3, T, HV) if case == "broadcast" else (B, T, HV)
    args = {"query": randn(*q_shape, seed=seed, dtype=dtype),
            "values": randn(*v_shape, seed=seed + 1, dtype=dtype),
            "W": randn(TMAX, HQ, seed=seed + 2, dtype=dtype, scale=0.8),
            "b": randn(TMAX, seed=seed + 3, dtype=dtype, scale=0.5),
            "mask": None, "attn_mask": None}
    if case == "causal":
        args["attn_mask"] = torch_causal_mask()
    elif case == "broadcast":
        args["b"] = None
        args["mask"] = torch.rand(2, 3, T, generator=torch.Generator()
                                  .manual_seed(seed)) < 0.7
    else:
        args["mask"] = torch_key_mask()
    return args


LOCATION_CASES = ["causal", "key", "single", "broadcast"]

COSINE_CASES = {
    # case: (query shape, keys shape, values?, sharpness, extra)
    "causal-tensor": ((B, TQ, H), (B, T, H), True, (B, TQ),
                      {"causal": True, "bias": (TQ, T)}),
    "attn-number": ((B, TQ, H), (B, T, H), False, 3.0,
                    {"attn_mask": True}),
    "single-tensor": ((B, H), (B, T, H), True, (B,), {"mask": True}),
    "broadcast": ((2, 1, TQ, H), (1, 3, T, H), True, (TQ,),
                  {"mask": (2, 3, T)}),
    "zeros-none": ((B, TQ, H), (B, T, H), False, None, {"zeros": True}),
}


def cosine_problem(case, dtype=torch.float64, seed=0):
    qs, ks, values, beta, extra = COSINE_CASES[case]
    q, k = randn(*qs, seed=seed, dtype=dtype, grad=False), randn(
        *ks, seed=seed + 1, dtype=dtype, grad=False)
    if extra.get("zeros"):              # a zero query and a zero key
        q[0, 1] = 0
        k[2, 3] = 0
    args = {"query": q.requires_grad_(), "keys": k.requires_grad_(),
            "values": (randn(*ks[:-1], HV, seed=seed + 2, dtype=dtype)
                       if values else None),
            "sharpness": (randn(*beta, seed=seed + 3, dtype=dtype,
                                scale=2.0)
                          if isinstance(beta, tuple) else beta)}
    if extra.get("causal"):
        args["causal"] = True
    if "bias" in extra:
        args["bias"] = randn(*extra["bias"], seed=seed + 4, dtype=dtype)
    if extra.get("attn_mask"):
        args["attn_mask"] = torch_causal_mask()
    if extra.get("mask") is True:
        args["mask"] = torch_key_mask()
    elif "mask" in extra:
        args["mask"] = torch.rand(*extra["mask"], generator=torch.Generator()
                                  .manual_seed(seed)) < 0.7
    return args


def detached(args):
    return {n: x.detach().clone().requires_grad_(x.requires_grad)
            if isinstance(x, torch.Tensor) else x for n, x in args.items()}


def differentiable(args):
    return [n for n, x in args.items()
            if isinstance(x, torch.Tensor) and x.requires_grad]


def check_both(mine, theirs, results, ref_results, dtype):
    """Outputs equal, and the gradients of a loss on (out, alpha)."""
    g = torch.Generator().manual_seed(7)
    loss, ref_loss = 0, 0
    for x, r in zip(results, ref_results):
        assert x.dtype == dtype and x.shape == r.shape
        assert rel_err(x.detach(), r.detach()) <= TOL[dtype]
        G = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
        loss = loss + (x * G).sum()
        ref_loss = ref_loss + (r * G).sum()
    loss.backward()
    ref_loss.backward()
    for name in differentiable(mine):
        got, want = mine[name].grad, theirs[name].grad
        assert got.dtype == dtype and got.shape == mine[name].shape
        err = rel_err(got, want)
        assert err <= GRAD_TOL[dtype], f"d{name}: relative error {err:.3g}"


# --------------------------------------------------------------------------
# Against plain PyTorch


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", LOCATION_CASES)
def test_location_equals_pytorch(case, dtype):
    mine = location_problem(case, dtype)
    theirs = detached(mine)
    out, alpha = act.location_attention(
        mine["query"], mine["values"], mine["W"], b=mine["b"],
        mask=mine["mask"], attn_mask=mine["attn_mask"])
    check_both(mine, theirs, (out, alpha), ref_location(**theirs), dtype)
    assert torch.all(mine["W"].grad[T:] == 0)
    if mine["b"] is not None:
        assert torch.all(mine["b"].grad[T:] == 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(COSINE_CASES))
def test_cosine_equals_pytorch(case, dtype):
    mine = cosine_problem(case, dtype)
    theirs = detached(mine)
    out, alpha = act.cosine_attention(**mine)
    r_out, r_alpha, _ = ref_cosine(**theirs)
    check_both(mine, theirs, (out, alpha), (r_out, r_alpha), dtype)
    assert torch.isfinite(mine["query"].grad).all()


@pytest.mark.parametrize("case", ["causal-tensor", "single-tensor"])
def test_cosine_lse_and_its_gradient(case):
    """return_weights=False: (out, lse), both differentiable (the lse's
    gradient takes the pure-PyTorch path)."""
    mine = cosine_problem(case)
    theirs = detached(mine)
    out, lse = act.cosine_attention(**mine, return_weights=False)
    r_out, _, r_lse = ref_cosine(**theirs)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse))
    lse, r_lse = (torch.where(torch.isneginf(x), 0, x) for x in (lse, r_lse))
    check_both(mine, theirs, (out, lse), (r_out, r_lse), torch.float64)


def test_sharpness_number_is_a_constant():
    """A number is the 0-dim tensor of its value, bit for bit, without a
    gradient; None is 1."""
    a = cosine_problem("causal-tensor")
    q, k = a["query"], a["keys"]
    beta = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    out_n, alpha_n = act.cosine_attention(q, k, causal=True, sharpness=2.5)
    out_t, alpha_t = act.cosine_attention(q, k, causal=True, sharpness=beta)
    assert torch.equal(out_n, out_t) and torch.equal(alpha_n, alpha_t)
    out_n.sum().backward()
    assert beta.grad is None
    one = act.cosine_attention(q, k, sharpness=1)
    assert torch.equal(one[0], act.cosine_attention(q, k)[0])


def test_fully_masked_queries_give_zeros_and_zero_gradients():
    """A query with no visible key (position): out = 0, alpha = 0 and zero
    gradients; NaN in masked values reaches nothing."""
    loc = location_problem("causal")
    cos = cosine_problem("causal-tensor")
    cos.pop("causal")
    for a in (loc, cos):
        a["attn_mask"] = torch_causal_mask()
        a["attn_mask"][0, :, -1] = False
        with torch.no_grad():
            a["values"][0, -1] = float("nan")
    out_l, alpha_l = act.location_attention(
        loc["query"], loc["values"], loc["W"], b=loc["b"],
        attn_mask=loc["attn_mask"])
    out_c, alpha_c = act.cosine_attention(**cos)
    for out, alpha, a in ((out_l, alpha_l, loc), (out_c, alpha_c, cos)):
        (out.sum() + alpha.sum()).backward()
        assert torch.all(out[1, 0] == 0) and torch.all(alpha[1, 0] == 0)
        assert torch.all(a["query"].grad[1, 0] == 0)
        for n in differentiable(a):
            assert torch.isfinite(a[n].grad).all(), n
    assert torch.all(cos["sharpness"].grad[1, 0] == 0)


# --------------------------------------------------------------------------
# gradcheck, gradgradcheck, opcheck, meta, torch.func


def as_function(fn, args):
    names = differentiable(args)
    return (lambda *xs: fn(**dict(args, **dict(zip(names, xs)))),
            [args[n] for n in names])


def call_location(query, values, W, b=None, mask=None, attn_mask=None):
    return act.location_attention(query, values, W, b=b, mask=mask,
                                  attn_mask=attn_mask)


@pytest.mark.parametrize("case", ["causal", "single", "broadcast"])
def test_location_gradcheck(case):
    f, xs = as_function(call_location, location_problem(case))
    assert torch.autograd.gradcheck(f, xs)


@pytest.mark.parametrize("case", ["causal-tensor", "single-tensor",
                                  "broadcast", "attn-number"])
def test_cosine_gradcheck(case):
    f, xs = as_function(act.cosine_attention, cosine_problem(case))
    assert torch.autograd.gradcheck(f, xs)


def test_gradgradcheck():
    """Second derivatives (the backward ops' own backward, through the
    pure-PyTorch forwards) against finite differences."""
    f, xs = as_function(call_location, location_problem("causal"))
    assert torch.autograd.gradgradcheck(f, xs)
    f, xs = as_function(act.cosine_attention, cosine_problem("causal-tensor"))
    assert torch.autograd.gradgradcheck(f, xs)


def test_opcheck():
    """Schema, fake implementation, autograd registration and AOT dispatch
    of both forward operators (cosine with dropout, bias and lse)."""
    a = location_problem("causal")
    torch.library.opcheck(torch.ops.attention_c.location_attention.default,
                          (a["query"], a["values"], a["W"], a["b"], None,
                           a["attn_mask"]))
    c = cosine_problem("causal-tensor")
    for weights, tests in ((True, None), (False, (
            "test_schema", "test_faketensor", "test_autograd_registration"))):
        torch.library.opcheck(
            torch.ops.attention_c.cosine_attention.default,
            (c["query"], c["keys"], None, None, True, c["bias"], 0.25,
             torch.tensor(-5), c["values"], c["sharpness"], weights),
            **({} if tests is None else {"test_utils": tests}))


@pytest.mark.parametrize("several", [True, False], ids=["several", "single"])
def test_meta_tensors_propagate_shapes(several):
    q_shape = (B, TQ) if several else (B,)
    loc = act.LocationAttention(HQ, TMAX).to("meta")
    cos = act.CosineAttention(learn_sharpness=True).to("meta")
    values = torch.empty(B, T, HV, device="meta")
    out, alpha = loc(torch.empty(*q_shape, HQ, device="meta"), values,
                     return_weights=True)
    assert out.shape == (*q_shape, HV) and alpha.shape == (*q_shape, T)
    out = cos(torch.empty(*q_shape, H, device="meta"),
              torch.empty(B, T, H, device="meta"), values=values)
    assert out.device.type == "meta" and out.shape == (*q_shape, HV)


def test_vmap_and_func_grad():
    """torch.func.vmap over a batch of queries (and of sharpness) equals a
    loop; torch.func.grad of the sharpness equals autograd's."""
    a = cosine_problem("single-tensor")
    loc = location_problem("single")
    qs = randn(4, B, H, seed=9, grad=False)
    betas = randn(4, B, seed=10, grad=False)

    def cos(q, beta):
        return act.cosine_attention(q, a["keys"], values=a["values"],
                                    mask=a["mask"], sharpness=beta)[0]

    def lo(q):
        return act.location_attention(q, loc["values"], loc["W"],
                                      mask=loc["mask"])[1]

    got = torch.func.vmap(cos)(qs, betas)
    want = torch.stack([cos(q, b) for q, b in zip(qs, betas)])
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    got = torch.func.vmap(lo)(qs[..., :HQ])
    want = torch.stack([lo(q) for q in qs[..., :HQ]])
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    g = torch.func.grad(lambda b: cos(qs[0], b).pow(2).sum())(betas[0])
    beta = betas[0].clone().requires_grad_()
    cos(qs[0], beta).pow(2).sum().backward()
    torch.testing.assert_close(g, beta.grad, rtol=1e-14, atol=1e-15)


# --------------------------------------------------------------------------
# torch.compile and torch.export


class Both(torch.nn.Module):
    """A Linear, then both layers (a learned sharpness times a learned
    one per query, causal) and the lse of a cosine attention with a
    number as sharpness, summed."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(H, H)
        self.loc = act.LocationAttention(H, TMAX)
        self.cos = act.CosineAttention(sharpness=2.0, learn_sharpness=True)
        self.beta = torch.nn.Parameter(torch.rand(TQ) + 0.5)

    def forward(self, x, mask, attn_mask):
        k = torch.tanh(self.inp(x))
        q = k[:, :TQ]
        h = (self.loc(q, k, mask=mask, attn_mask=attn_mask)
             + self.cos(q, k, causal=True, sharpness=self.beta))
        _, lse = act.cosine_attention(q, k, mask=mask, sharpness=3.0,
                                      return_weights=False)
        return h.sum((-2, -1)) + 0.1 * lse.clamp(min=-5).sum(-1)


def both_inputs():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(B, T, H, generator=g), torch_key_mask(),
            torch_causal_mask())


def test_compile_fullgraph_training_step():
    """torch.compile(fullgraph=True) of a model with both layers (a graph
    break would raise): the loss and every parameter's gradient equal
    eager's.  The aot_eager backend traces the operators and their fake
    and backward rules as Inductor does, without its minute of code
    generation (tests/pytorch/test_torch_op.py compiles with Inductor)."""
    torch.manual_seed(0)
    eager = Both()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True,
                             backend="aot_eager")
    inputs = both_inputs()
    y = torch.randn(B)
    results = []
    for model, fn in ((eager, eager), (compiled_model, compiled)):
        loss = F.mse_loss(fn(*inputs), y)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (le, ge), (lc, gc) = results
    assert abs(le - lc) <= 1e-6 * abs(le)
    for a, b in zip(ge, gc):
        assert b is not None and rel_err(b, a) < 1e-5


def test_export():
    """torch.export.export of the model: the program calls both operators
    and gives eager's output."""
    torch.manual_seed(1)
    model = Both()
    inputs = both_inputs()
    exported = torch.export.export(model, inputs)
    text = str(exported.graph)
    for name in ("location_attention", "cosine_attention"):
        assert f"attention_c.{name}" in text, name
    torch.testing.assert_close(exported.module()(*inputs), model(*inputs),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
def test_fx_and_jit_trace():
    """torch.fx.symbolic_trace keeps each call as a leaf (run at call
    time); torch.jit.trace records the operators."""
    torch.manual_seed(2)
    model = Both()
    inputs = both_inputs()
    gm = torch.fx.symbolic_trace(model)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    for name in ("location_attention", "cosine_attention"):
        assert getattr(act, name) in targets, name
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)
    text = str(torch.jit.trace(model, inputs).inlined_graph)
    for name in ("location_attention", "cosine_attention"):
        assert f"attention_c::{name}" in text, name


# --------------------------------------------------------------------------
# bfloat16


def test_bfloat16_computed_in_float32():
    """bfloat16 inputs: computed in float32, results and gradients in
    bfloat16, within twice its unit roundoff of float32 on the same rounded
    values."""
    low = torch.bfloat16
    loc = {n: x.detach().to(low).requires_grad_()
           for n, x in location_problem("causal").items()
           if n in ("query", "values", "W", "b")}
    cos = {n: x.detach().to(low).requires_grad_()
           for n, x in cosine_problem("causal-tensor").items()
           if isinstance(x, torch.Tensor)}
    for fn, a, kw in ((call_location, loc,
                       {"attn_mask": torch_causal_mask()}),
                      (act.cosine_attention, cos, {"causal": True})):
        a32 = {n: x.detach().float().requires_grad_() for n, x in a.items()}
        out, alpha = fn(**a, **kw)
        out32, alpha32 = fn(**a32, **kw)
        assert out.dtype == low and alpha.dtype == low
        assert rel_err(out, out32) <= LOW_TOL[low]
        (out.float() ** 2).sum().backward()
        (out32 ** 2).sum().backward()
        for n in a:
            assert a[n].grad.dtype == low
            assert rel_err(a[n].grad, a32[n].grad) <= LOW_TOL[low], n


# --------------------------------------------------------------------------
# Modules


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_location_module(dtype):
    """Parameters W (T_max, Hq) and b, initialised like nn.Linear(Hq,
    T_max), with gradients; the function's results; state_dict."""
    torch.manual_seed(0)
    m = act.LocationAttention(HQ, TMAX, dtype=dtype)
    assert list(dict(m.named_parameters())) == ["W", "b"]
    assert m.W.shape == (TMAX, HQ) and m.W.dtype == dtype
    assert m.W.abs().max() <= HQ ** -0.5 and m.b.abs().max() <= HQ ** -0.5
    assert "query_size=2, max_length=7, bias=True" in repr(m)
    assert list(dict(act.LocationAttention(HQ, TMAX, bias=False)
                     .named_parameters())) == ["W"]
    a = location_problem("causal", dtype, seed=4)
    q, v, am = a["query"], a["values"], a["attn_mask"]
    out, alpha = m(q, v, attn_mask=am, return_weights=True)
    f_out, f_alpha = act.location_attention(q, v, m.W, b=m.b, attn_mask=am)
    assert torch.equal(out, f_out) and torch.equal(alpha, f_alpha)
    assert torch.equal(m(q, v, attn_mask=am), out)
    out.sum().backward()
    assert m.W.grad is not None and m.b.grad is not None
    other = act.LocationAttention(HQ, TMAX, dtype=dtype)
    other.load_state_dict(m.state_dict())
    assert torch.equal(other(q, v, attn_mask=am), out)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_location_from_linear(bias):
    """from_linear(Linear(Hq, T_max)): scores linear(q)[..., :T], the
    weights copied."""
    torch.manual_seed(2)
    linear = torch.nn.Linear(HQ, TMAX, bias=bias, dtype=torch.float64)
    m = act.LocationAttention.from_linear(linear)
    assert torch.equal(m.W, linear.weight) and (m.b is None) != bias
    assert m.W.data_ptr() != linear.weight.data_ptr()
    a = location_problem("key", seed=5)
    q, v, mask = a["query"].detach(), a["values"].detach(), a["mask"]
    out, alpha = m(q, v, mask=mask, return_weights=True)
    r_alpha = torch_masked_softmax(linear(q)[..., :T], mask.unsqueeze(-2))
    torch.testing.assert_close(alpha, r_alpha, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(out, r_alpha @ v, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="not initialised"):
        act.LocationAttention.from_linear(torch.nn.LazyLinear(TMAX))


def test_cosine_module():
    """A number, a learned sharpness (a Parameter with a gradient, in the
    state_dict) and a per-call sharpness (multiplying the module's);
    dropout in training mode only, reproducible under manual_seed."""
    a = cosine_problem("causal-tensor", seed=6)
    q, k, v, beta = a["query"], a["keys"], a["values"], a["sharpness"]
    fixed = act.CosineAttention(sharpness=2.0)
    assert list(fixed.parameters()) == [] and "sharpness=2.0" in repr(fixed)
    out, alpha = fixed(q, k, values=v, causal=True, return_weights=True)
    f = act.cosine_attention(q, k, values=v, causal=True, sharpness=2.0)
    assert torch.equal(out, f[0]) and torch.equal(alpha, f[1])
    torch.testing.assert_close(fixed(q, k, values=v, causal=True), f[0],
                               rtol=1e-13, atol=1e-15)
    learned = act.CosineAttention(sharpness=2.0, learn_sharpness=True,
                                  dtype=torch.float64)
    assert [n for n, _ in learned.named_parameters()] == ["sharpness"]
    assert "learn_sharpness=True, dropout=0.0" in repr(learned)
    assert learned.sharpness.shape == () and learned.sharpness.item() == 2.0
    out = learned(q, k, values=v, causal=True, sharpness=beta)
    want = act.cosine_attention(q, k, values=v, causal=True,
                                sharpness=2.0 * beta)[0]
    torch.testing.assert_close(out, want, rtol=1e-13, atol=1e-15)
    out.sum().backward()
    assert learned.sharpness.grad is not None and beta.grad is not None
    other = act.CosineAttention(learn_sharpness=True, dtype=torch.float64)
    assert other.sharpness.item() == 1.0
    other.load_state_dict(learned.state_dict())
    assert other.sharpness.item() == 2.0
    drop = act.CosineAttention(dropout=0.5)
    with torch.no_grad():
        x = []
        for _ in range(2):
            torch.manual_seed(3)
            x.append(drop(q, k, causal=True))
        assert torch.equal(x[0], x[1])
        assert not torch.allclose(x[0], act.cosine_attention(
            q, k, causal=True)[0])
        assert torch.equal(drop.eval()(q, k, causal=True),
                           act.cosine_attention(q, k, causal=True,
                                                return_weights=False)[0])


# --------------------------------------------------------------------------
# Errors


def test_bad_input_names_the_argument():
    a = location_problem("causal", seed=8)
    q, v, W, b = (a[n].detach() for n in ("query", "values", "W", "b"))
    with pytest.raises(ValueError, match=r"W has shape \(4, 2\); expected "
                                         r"\(T_max, Hq\) with at least"):
        act.location_attention(q, v, W[:4])
    with pytest.raises(ValueError, match=r"b has shape \(6,\)"):
        act.location_attention(q, v, W, b=b[:6])
    with pytest.raises(ValueError, match="attn_mask and causal need several "
                                         "queries.*query.ndim == values"):
        act.location_attention(q[:, 0], v, W, attn_mask=a["attn_mask"])
    with pytest.raises(TypeError, match="W has dtype torch.float32 but query"
                                        " has torch.float64"):
        act.location_attention(q, v, W.float())
    with pytest.raises(TypeError, match="mask has dtype torch.int64"):
        act.location_attention(q, v, W, mask=torch_key_mask().long())
    c = cosine_problem("causal-tensor", seed=9)
    q, k = c["query"].detach(), c["keys"].detach()
    with pytest.raises(ValueError, match="sharpness must be finite, got nan"):
        act.cosine_attention(q, k, sharpness=float("nan"))
    with pytest.raises(TypeError, match="sharpness must be None, a number "
                                        "or a torch.Tensor, got str"):
        act.cosine_attention(q, k, sharpness="2")
    with pytest.raises(ValueError, match=r"sharpness has shape \(4,\)"):
        act.cosine_attention(q, k, sharpness=torch.ones(4,
                                                        dtype=torch.float64))
    with pytest.raises(TypeError, match="sharpness has dtype torch.float32 "
                                        "but query has torch.float64"):
        act.cosine_attention(q, k, sharpness=torch.ones(TQ))
    with pytest.raises(TypeError, match="sharpness has dtype torch.int64"):
        act.cosine_attention(q, k, sharpness=torch.ones(TQ, dtype=int))
    with pytest.raises(ValueError, match="mask has shape"):
        act.cosine_attention(q, k, mask=torch_causal_mask())
    with pytest.raises(ValueError, match="sharpness must be finite"):
        act.CosineAttention(sharpness=float("inf"))
    with pytest.raises(TypeError, match="sharpness must be None"):
        act.cosine_attention(q, k, sharpness=np.bool_(True))
    # a NumPy scalar is a number, of any precision
    assert torch.equal(act.cosine_attention(q, k, sharpness=np.float32(2))[0],
                       act.cosine_attention(q, k, sharpness=2.0)[0])
    with pytest.raises(TypeError, match="sharpness must be a number or None"):
        act.CosineAttention(sharpness=torch.ones(()))
    with pytest.raises(ValueError, match="dropout must be in"):
        act.CosineAttention(dropout=1.0)
