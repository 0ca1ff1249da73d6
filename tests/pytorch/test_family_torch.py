"""The attention family in the PyTorch adapter (attention_c.torch).

AdditiveAttention, DotAttention and GeneralAttention and their functions:
gradients checked with torch.autograd.gradcheck in float64 (both outputs;
key masks, per-query causal masks and fully masked queries; one query or
several; values or not; the key_proj path of a decoder loop); float32
results and gradients against the plain PyTorch of
attention_c.torch._pure (through attention_c.testing's TORCH_ATTENTION),
against F.scaled_dot_product_attention and d2l.ai's additive attention;
the loaders from PyTorch layers; and that the modules train.  The errors,
memory and modes are in test_family_torch_inputs.py, attn_mask, causal,
bias, dropout and return_weights (section 5) in
test_family_torch_section5.py, the shared cases in family_torch_cases.py.
"""

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import attention_c.torch as act  # noqa: E402
from attention_c.testing import (  # noqa: E402
    TORCH_ATTENTION, TORCH_FAMILY_MASKS, rel_err, torch_masked_softmax)
from attention_c.testing import torch_family_problem as make  # noqa: E402

from family_torch_cases import (A, B, H, HQ, KINDS, T, TQ,  # noqa: E402
                                differentiable, ours)

CASES = [(several, mask) for several in (True, False)
         for mask in TORCH_FAMILY_MASKS if several or mask != "causal"]
CASE_IDS = [f"{'several' if s else 'single'}-{m}" for s, m in CASES]


def as_function(kind, args, key_proj=False):
    """(f, inputs) for gradcheck: f(*inputs) = (out, alpha), the inputs
    being the arguments that require grad; with key_proj, f projects the
    keys with project_keys and passes them on."""
    names = differentiable(args)

    def f(*xs):
        a = dict(args, **dict(zip(names, xs)))
        if key_proj:
            a["key_proj"] = act.project_keys(a["keys"], a["W"])
        return ours(kind, **a)

    return f, [args[n] for n in names]


# --------------------------------------------------------------------------
# Gradients in float64


@pytest.mark.parametrize("values", [False, True], ids=["keys", "values"])
@pytest.mark.parametrize("several,mask", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck(kind, several, mask, values):
    """gradcheck of both outputs for every differentiable argument."""
    f, inputs = as_function(kind, make(kind, several, values, mask))
    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("values", [False, True], ids=["keys", "values"])
@pytest.mark.parametrize("several,mask", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", ["additive", "general"])
def test_gradcheck_key_proj(kind, several, mask, values):
    """With key_proj = project_keys(keys, W): the gradients of the keys and
    of W come through the projection's graph, and are right."""
    f, inputs = as_function(kind, make(kind, several, values, mask),
                            key_proj=True)
    assert torch.autograd.gradcheck(f, inputs)


def test_gradcheck_additive_without_bias_and_scaled_dot():
    f, inputs = as_function("additive", make("additive", bias=False))
    assert torch.autograd.gradcheck(f, inputs)
    args = make("dot", mask="causal")
    assert torch.autograd.gradcheck(
        lambda q, k: act.dot_attention(q, k, attn_mask=args["attn_mask"],
                                       scale=0.3),
        (args["query"], args["keys"]))


def test_gradcheck_leading_batch_axes():
    """Two leading axes, a key mask with a fully masked sequence."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, HQ, dtype=torch.float64, generator=g,
                    requires_grad=True)
    k = torch.randn(2, 2, T, H, dtype=torch.float64, generator=g,
                    requires_grad=True)
    m = torch.rand(2, 2, T, generator=g) < 0.7
    m[0, 1] = False
    W = make("additive")["W"]
    v, b = make("additive")["v"], make("additive")["b"]
    assert torch.autograd.gradcheck(
        lambda q, k, W: act.additive_attention(q, k, W, v, b=b, mask=m), (q,
                                                                          k,
                                                                          W))


@pytest.mark.parametrize("values", [False, True], ids=["keys", "values"])
@pytest.mark.parametrize("kind", ["additive", "general"])
def test_decoder_loop_with_key_proj(kind, values):
    """A decoder loop attends to the same keys at every step: projecting
    them once gives the gradients of projecting them at every step."""
    args = make(kind, several=False, values=values, mask="key")
    g = torch.Generator().manual_seed(9)
    queries = torch.randn(4, *args["query"].shape, dtype=torch.float64,
                          generator=g)
    Ga = torch.randn(4, B, T, dtype=torch.float64, generator=g)

    def run(use_proj):
        leaves = {n: args[n].detach().clone().requires_grad_()
                  for n in differentiable(args)}
        a = dict(args, **leaves)
        if use_proj:
            a["key_proj"] = act.project_keys(a["keys"], a["W"])
        loss = 0
        state = a["query"]
        for step in range(4):
            a["query"] = torch.tanh(state + queries[step])
            out, alpha = ours(kind, **a)
            loss = loss + (out ** 2).sum() + (alpha * Ga[step]).sum()
            state = a["query"] + out.sum(-1, keepdim=True)
        loss.backward()
        return {n: x.grad for n, x in leaves.items()}

    plain, projected = run(False), run(True)
    for name in plain:
        err = rel_err(projected[name], plain[name])
        assert err < 1e-13, f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("kind", ["additive", "general"])
def test_constant_key_proj_gives_the_full_gradients(kind):
    """A key_proj that does not require grad (made under no_grad) stands
    for the projection of the keys: each call then gives the keys and W
    the gradients of a call without key_proj."""
    args = make(kind, values=False, mask="causal")
    f, inputs = as_function(kind, args)
    with torch.no_grad():
        kp = act.project_keys(args["keys"], args["W"])
    g = as_function(kind, dict(args, key_proj=kp))[0]
    out, alpha = f(*inputs)
    grads = torch.autograd.grad(out.sum() + alpha[..., 0].sum(), inputs)
    out, alpha = g(*inputs)
    grads_kp = torch.autograd.grad(out.sum() + alpha[..., 0].sum(), inputs)
    for a, b in zip(grads_kp, grads):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def test_fully_masked_queries_give_zeros_and_zero_gradients():
    """A query with no valid key: out = 0, alpha = 0, zero gradient; NaN in
    masked keys and values reaches nothing.  (With key_proj, NaN keys would
    reach dW through PyTorch's own backward of project_keys: only the
    values get one there.)"""
    for kind in KINDS:
        for use_proj in [False, True] if kind != "dot" else [False]:
            args = make(kind, several=True, values=True, mask="causal")
            args["attn_mask"][0, :, -1] = False
            with torch.no_grad():
                if not use_proj:                   # masked for every query
                    args["keys"][0, -1] = math.nan
                args["values"][0, -1] = math.nan
            f, inputs = as_function(kind, args, key_proj=use_proj)
            out, alpha = f(*inputs)
            (out.sum() + alpha.sum()).backward()
            assert torch.all(out[1, 0] == 0) and torch.all(alpha[1, 0] == 0)
            assert torch.all(args["query"].grad[1, 0] == 0)
            for x in inputs:
                assert torch.isfinite(x.grad).all(), (kind, use_proj)
            assert torch.isfinite(out).all() and torch.isfinite(alpha).all()


# --------------------------------------------------------------------------
# float32 against pure PyTorch


def detached_copy(args):
    return {n: x.detach().clone().requires_grad_(x.requires_grad)
            if isinstance(x, torch.Tensor) else x for n, x in args.items()}


@pytest.mark.parametrize("values", [False, True], ids=["keys", "values"])
@pytest.mark.parametrize("several,mask", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_float32_equals_pure_pytorch(kind, several, mask, values):
    """float32 outputs and gradients (of a loss using both outputs) equal
    the pure-PyTorch float32 implementation within float32 rounding."""
    mine = make(kind, several, values, mask, dtype=torch.float32, seed=2)
    theirs = detached_copy(mine)
    out, alpha = ours(kind, **mine)
    r_out, r_alpha = TORCH_ATTENTION[kind](**theirs)
    assert out.dtype == torch.float32 and alpha.dtype == torch.float32
    assert rel_err(out.detach(), r_out.detach()) < 1e-6
    assert rel_err(alpha.detach(), r_alpha.detach()) < 1e-6
    g = torch.Generator().manual_seed(3)
    Go = torch.randn(out.shape, generator=g)
    Ga = torch.randn(alpha.shape, generator=g)
    ((out * Go).sum() + (alpha * Ga).sum()).backward()
    ((r_out * Go).sum() + (r_alpha * Ga).sum()).backward()
    for name in differentiable(mine):
        assert mine[name].grad.dtype == torch.float32
        err = rel_err(mine[name].grad, theirs[name].grad)
        assert err < 1e-5, f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("use", ["out", "alpha"])
@pytest.mark.parametrize("kind", ["additive", "general"])
def test_float32_key_proj_one_output(kind, use):
    """key_proj with a loss on one output only (the other gradient None)."""
    mine = make(kind, values=True, mask="causal", dtype=torch.float32,
                seed=4)
    theirs = detached_copy(mine)
    out, alpha = ours(kind, **mine,
                      key_proj=act.project_keys(mine["keys"], mine["W"]))
    r_out, r_alpha = TORCH_ATTENTION[kind](**theirs)
    (out if use == "out" else alpha).pow(2).sum().backward()
    (r_out if use == "out" else r_alpha).pow(2).sum().backward()
    for name in differentiable(mine):
        grad, r_grad = mine[name].grad, theirs[name].grad
        if r_grad is None:                  # alpha does not see the values
            r_grad = torch.zeros_like(grad)
        err = rel_err(grad, r_grad)
        assert err < 1e-5, f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("scale", [None, 0.25])
def test_dot_equals_scaled_dot_product_attention(scale):
    """Against SDPA with a per-query causal mask and its scale argument."""
    mine = make("dot", values=True, mask="causal", dtype=torch.float32,
                seed=6)
    theirs = detached_copy(mine)
    out, _ = act.dot_attention(**mine, scale=scale)
    r_out = F.scaled_dot_product_attention(
        theirs["query"], theirs["keys"], theirs["values"],
        attn_mask=theirs["attn_mask"], scale=scale)
    assert rel_err(out.detach(), r_out.detach()) < 1e-6
    out.sum().backward()
    r_out.sum().backward()
    for name in ["query", "keys", "values"]:
        assert rel_err(mine[name].grad, theirs[name].grad) < 1e-5, name


# --------------------------------------------------------------------------
# Modules and loaders


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_module_parameters_and_init(dtype):
    torch.manual_seed(0)
    add = act.AdditiveAttention(H, HQ, A, dtype=dtype)
    assert list(dict(add.named_parameters())) == ["W", "v", "b"]
    assert add.W.shape == (A, H + HQ) and add.W.dtype == dtype
    assert add.W.abs().max() <= 1 / math.sqrt(H + HQ)
    assert add.b.abs().max() <= 1 / math.sqrt(H + HQ)
    assert add.v.abs().max() <= 1 / math.sqrt(A)
    assert "key_size=3, query_size=2, attention_size=5, bias=True" in repr(
        add)
    nob = act.AdditiveAttention(H, HQ, A, bias=False)
    assert list(dict(nob.named_parameters())) == ["W", "v"]
    gen = act.GeneralAttention(HQ, H, dtype=dtype)
    assert list(dict(gen.named_parameters())) == ["W"]
    assert gen.W.shape == (HQ, H) and gen.W.dtype == dtype
    assert gen.W.abs().max() <= 1 / math.sqrt(H)
    dot = act.DotAttention(scale=0.5)
    assert list(dot.parameters()) == [] and "scale=0.5" in repr(dot)


@pytest.mark.parametrize("kind", KINDS)
def test_modules_equal_their_functions(kind):
    args = make(kind, values=True, mask="causal", grad=False)
    if kind == "additive":
        module = act.AdditiveAttention(H, HQ, A, dtype=torch.float64)
    elif kind == "general":
        module = act.GeneralAttention(HQ, H, dtype=torch.float64)
    else:
        module = act.DotAttention()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(args[name])
    q, k = args["query"], args["keys"]
    opts = {"values": args["values"], "attn_mask": args["attn_mask"]}
    out, alpha = module(q, k, **opts, return_weights=True)
    f_out, f_alpha = ours(kind, **args)
    assert torch.equal(out, f_out) and torch.equal(alpha, f_alpha)
    # Without weights the module takes the return_weights=False path: the
    # same values within rounding, exactly the function's on that path.
    out_only = module(q, k, **opts)
    torch.testing.assert_close(out_only, f_out, rtol=1e-13, atol=1e-15)
    if kind != "additive":
        assert torch.equal(out_only,
                           ours(kind, **args, return_weights=False)[0])
    if kind != "dot":
        kp = module.project_keys(k)
        assert rel_err(module(q, k, **opts, key_proj=kp), f_out) <= 1e-13


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_additive_from_linear(bias):
    """from_linear(score, out, key_size) computes out(tanh(score([k; q])))
    scores, with out a Linear(A, 1) or its weight as a tensor."""
    torch.manual_seed(1)
    score = torch.nn.Linear(H + HQ, A, bias=bias, dtype=torch.float64)
    out_lin = torch.nn.Linear(A, 1, dtype=torch.float64)
    module = act.AdditiveAttention.from_linear(score, out_lin, key_size=H)
    assert module.W.dtype == torch.float64 and (module.b is None) != bias
    args = make("additive", mask="causal", grad=False)
    q, k, m = args["query"], args["keys"], args["attn_mask"]
    out, alpha = module(q, k, attn_mask=m, return_weights=True)
    kq = torch.cat([k[:, None].expand(B, TQ, T, H),
                    q[:, :, None].expand(B, TQ, T, HQ)], -1)
    r_alpha = torch_masked_softmax(out_lin(torch.tanh(score(kq)))[..., 0],
                                   m)
    r_out = r_alpha @ k
    torch.testing.assert_close(alpha, r_alpha, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(out, r_out, rtol=1e-12, atol=1e-15)
    for v in [out_lin.weight, out_lin.weight[0]]:
        other = act.AdditiveAttention.from_linear(score, v, key_size=H)
        assert torch.equal(other.v, module.v)
    with pytest.raises(ValueError, match=r"out.weight has shape \(2, 5\)"):
        act.AdditiveAttention.from_linear(score, torch.nn.Linear(A, 2), H)
    with pytest.raises(ValueError, match="key_size = 5"):
        act.AdditiveAttention.from_linear(score, out_lin, key_size=H + HQ)


class D2LAdditiveAttention(torch.nn.Module):
    """d2l.ai's additive attention (chapter 11.3), with nn.Linear for its
    nn.LazyLinear layers and valid_lens masking."""

    def __init__(self, key_size, query_size, num_hiddens):
        super().__init__()
        self.W_k = torch.nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = torch.nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = torch.nn.Linear(num_hiddens, 1, bias=False)

    def forward(self, queries, keys, values, valid_lens):
        queries, keys = self.W_q(queries), self.W_k(keys)
        features = torch.tanh(queries.unsqueeze(2) + keys.unsqueeze(1))
        scores = self.w_v(features).squeeze(-1)
        valid = torch.arange(scores.shape[-1]) < valid_lens[:, None, None]
        scores = scores.masked_fill(~valid, -1e6)
        self.attention_weights = torch.softmax(scores, dim=-1)
        return torch.bmm(self.attention_weights, values)


def test_additive_from_d2l():
    torch.manual_seed(2)
    d2l = D2LAdditiveAttention(H, HQ, A)
    module = act.AdditiveAttention.from_d2l(d2l.W_k, d2l.W_q, d2l.w_v)
    assert module.b is None and module.W.dtype == torch.float32
    args = make("additive", values=True, dtype=torch.float32, grad=False)
    valid_lens = torch.tensor([5, 1, 3])
    mask = torch.arange(T) < valid_lens[:, None]
    out, alpha = module(args["query"], args["keys"], values=args["values"],
                        mask=mask, return_weights=True)
    r_out = d2l(args["query"], args["keys"], args["values"], valid_lens)
    assert rel_err(out.detach(), r_out.detach()) < 1e-6
    assert rel_err(alpha.detach(), d2l.attention_weights.detach()) < 1e-6
    # biases of W_k and W_q, if any, add up to b
    W_k = torch.nn.Linear(H, A)
    W_q = torch.nn.Linear(HQ, A)
    biased = act.AdditiveAttention.from_d2l(W_k, W_q, d2l.w_v)
    torch.testing.assert_close(biased.b, W_k.bias + W_q.bias)
    with pytest.raises(ValueError, match="not initialised"):
        act.AdditiveAttention.from_d2l(torch.nn.LazyLinear(A), d2l.W_q,
                                       d2l.w_v)
    with pytest.raises(ValueError, match="W_k.weight has shape"):
        act.AdditiveAttention.from_d2l(torch.nn.Linear(H, A + 1), d2l.W_q,
                                       d2l.w_v)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_general_from_linear(bias):
    """q_i . linear(k_t): linear's bias shifts the scores of a query by a
    constant and drops out."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(H, HQ, bias=bias, dtype=torch.float64)
    module = act.GeneralAttention.from_linear(linear)
    assert torch.equal(module.W, linear.weight)
    assert module.W.data_ptr() != linear.weight.data_ptr()
    args = make("general", mask="causal", grad=False)
    q, k, m = args["query"], args["keys"], args["attn_mask"]
    out, alpha = module(q, k, attn_mask=m, return_weights=True)
    r_alpha = torch_masked_softmax(q @ linear(k).transpose(-1, -2), m)
    r_out = r_alpha @ k
    torch.testing.assert_close(alpha, r_alpha, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(out, r_out, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------------------
# Training


@pytest.mark.parametrize("kind", KINDS)
def test_module_trains(kind):
    """Retrieval: the query is a noisy copy of one key, the target that
    key's value.  A small model (a Linear on the query, then the
    attention module) trained with Adam brings the loss down."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n, length, hk, hv = 128, 6, 8, 4
    keys = torch.randn(n, length, hk, generator=g)
    values = torch.randn(n, length, hv, generator=g)
    pick = torch.randint(0, length, (n,), generator=g)
    lengths = torch.maximum(torch.randint(3, length + 1, (n,), generator=g),
                            pick + 1)
    mask = torch.arange(length) < lengths[:, None]
    query = keys[torch.arange(n), pick] + 0.1 * torch.randn(n, hk,
                                                            generator=g)
    target = values[torch.arange(n), pick]
    attention = {"additive": act.AdditiveAttention(hk, hk, 16),
                 "dot": act.DotAttention(),
                 "general": act.GeneralAttention(hk, hk)}[kind]
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(hk, hk),
                                 "attention": attention})
    opt = torch.optim.Adam(model.parameters(), lr=0.05)

    def loss_fn():
        out = model["attention"](model["proj"](query), keys, values=values,
                                 mask=mask)
        return F.mse_loss(out, target)

    first = loss_fn().item()
    for _ in range(60):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    last = loss_fn().item()
    assert last < 0.3 * first, (first, last)
