"""The attention family in the PyTorch adapter (attention_c.torch).

AdditiveAttention, DotAttention and GeneralAttention and their functions:
gradients checked with torch.autograd.gradcheck in float64 (both outputs;
key masks, per-query causal masks and fully masked queries; one query or
several; values or not; the key_proj path of a decoder loop); float32
results and gradients against the plain PyTorch of
attention_c.torch._pure (through attention_c.testing's TORCH_ATTENTION),
against F.scaled_dot_product_attention and d2l.ai's additive attention;
the loaders from PyTorch layers; the errors; and that the modules train.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import attention_c  # noqa: E402
import attention_c.reference  # noqa: E402,F401
import attention_c.torch as act  # noqa: E402
from attention_c.testing import (  # noqa: E402
    TORCH_ATTENTION, TORCH_FAMILY_MASKS, TORCH_FAMILY_SIZES, rel_err,
    torch_causal_mask, torch_masked_softmax)
from attention_c.testing import torch_family_problem as make  # noqa: E402

B, TQ, T, H, HQ, A, HV = TORCH_FAMILY_SIZES
KINDS = ["additive", "dot", "general"]

CASES = [(several, mask) for several in (True, False)
         for mask in TORCH_FAMILY_MASKS if several or mask != "causal"]
CASE_IDS = [f"{'several' if s else 'single'}-{m}" for s, m in CASES]


def ours(kind, **args):
    return getattr(act, f"{kind}_attention")(**args)


def differentiable(args):
    """Names of the arguments that require grad."""
    return [n for n, x in args.items()
            if isinstance(x, torch.Tensor) and x.requires_grad]


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
# Errors


@pytest.mark.parametrize("kind", KINDS)
def test_non_cpu_tensors_are_refused(kind):
    """Every tensor argument on another device ('meta' here; CUDA takes the
    same path) raises before any data is touched, naming the argument."""
    base = make(kind, values=True, grad=False)
    for name, x in base.items():
        if not isinstance(x, torch.Tensor) or name == "mask":
            continue
        args = dict(base, **{name: x.to("meta")})
        with pytest.raises(ValueError,
                           match=f"CPU only, but {name} is on device 'meta'"):
            ours(kind, **args)
    args = dict(base, mask=base["mask"].to("meta"))
    with pytest.raises(ValueError, match="CPU only, but mask is on device"):
        ours(kind, **args)
    module = {"additive": act.AdditiveAttention(H, HQ, A),
              "dot": act.DotAttention(),
              "general": act.GeneralAttention(HQ, H)}[kind].to("meta")
    # dot has no parameters: its query goes to 'meta' instead (a query and
    # keys all on 'meta' only propagate shapes now, see test_torch_op.py).
    device = "meta" if kind == "dot" else "cpu"
    q = torch.zeros(B, H if kind == "dot" else HQ, device=device)
    with pytest.raises(ValueError, match="CPU only.*move the module"):
        module(q, torch.zeros(B, T, H))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_refused():
    args = make("dot", grad=False)
    args["keys"] = args["keys"].cuda()
    with pytest.raises(ValueError, match="CPU only, but keys is on device "
                                         "'cuda:0'"):
        act.dot_attention(**args)


def test_bad_dtypes_are_refused():
    args = make("additive", values=True, grad=False)
    with pytest.raises(TypeError, match="W has dtype torch.float32 but "
                                        "query has torch.float64"):
        act.additive_attention(**dict(args, W=args["W"].float()))
    with pytest.raises(TypeError, match="values has dtype torch.float32"):
        act.additive_attention(**dict(args, values=args["values"].float()))
    with pytest.raises(TypeError, match="key_proj has dtype torch.float32"):
        act.additive_attention(**args, key_proj=act.project_keys(
            args["keys"], args["W"]).float())
    # float16 and bfloat16 are accepted now (computed in float32, see
    # test_torch_op.py); an integer dtype is named.
    ints = {n: x.int() if isinstance(x, torch.Tensor) and n != "mask"
            else x for n, x in make("dot", grad=False).items()}
    with pytest.raises(TypeError, match="query has dtype torch.int32"):
        act.dot_attention(**ints)
    with pytest.raises(TypeError, match="keys must be a torch.Tensor"):
        act.general_attention(**dict(make("general"),
                                     keys=np.zeros((B, T, H))))
    for cls, sizes in [(act.AdditiveAttention, (H, HQ, A)),
                       (act.GeneralAttention, (HQ, H))]:
        with pytest.raises(TypeError, match="dtype must be"):
            cls(*sizes, dtype=torch.int32)


@pytest.mark.parametrize("kind", KINDS)
def test_mask_that_requires_grad_is_refused(kind):
    args = make(kind)
    m = torch.ones(B, T, requires_grad=True)
    with pytest.raises(ValueError, match="mask requires grad"):
        ours(kind, **dict(args, mask=m))
    with pytest.raises(TypeError, match="mask has dtype torch.float32; "
                                        "expected torch.bool with True = "
                                        "valid key"):
        ours(kind, **dict(args, mask=m.detach()))


REQUIRED = {"additive": ["query", "keys", "W", "v"],
            "dot": ["query", "keys"], "general": ["query", "keys", "W"]}


@pytest.mark.parametrize("kind", KINDS)
def test_optional_arguments_are_keyword_only(kind):
    """Every optional argument of a function (b, mask, values, key_proj,
    scale) and of a module's forward (values, mask, key_proj,
    return_weights), given by position after the required ones, raises
    TypeError; the same call by keyword works."""
    args = make(kind, values=True, grad=False)
    if kind == "dot":
        args["scale"] = 0.5
    else:
        args["key_proj"] = act.project_keys(args["keys"], args["W"])
    pos = [args[n] for n in REQUIRED[kind]]
    opts = {n: x for n, x in args.items() if n not in REQUIRED[kind]}
    f = getattr(act, f"{kind}_attention")
    for name, x in opts.items():
        with pytest.raises(TypeError, match=f"takes {len(pos)} positional "
                                            f"arguments but {len(pos) + 1}"):
            f(*pos, x)
    out, alpha = f(*pos, **opts)
    module = {"additive": act.AdditiveAttention(H, HQ, A),
              "dot": act.DotAttention(scale=0.5),
              "general": act.GeneralAttention(HQ, H)}[kind].double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(args[name])
    q, k = args["query"], args["keys"]
    for extra in [(args["values"],), (None, args["mask"]),
                  (None, None, True)]:
        with pytest.raises(TypeError, match="takes 3 positional arguments"):
            module(q, k, *extra)
    opts = {"values": args["values"], "mask": args["mask"]}
    if kind != "dot":
        opts["key_proj"] = args["key_proj"]
    m_out, m_alpha = module(q, k, **opts, return_weights=True)
    assert rel_err(m_out, out) <= 1e-13
    torch.testing.assert_close(m_alpha, alpha, rtol=1e-13, atol=0)


def test_signatures_follow_the_argument_convention():
    """Functions and forwards: whatever has a default is keyword-only, and
    what comes by position has none (docs/conventions.md)."""
    import inspect
    # The drop-ins keep PyTorch's signatures (test_drop_in_signatures).
    ours = [n for n in act.__all__ if n not in DROP_INS and n != "KVCache"
            and not n.startswith("flash_attn")]     # FlashAttention-2's
    callables = [getattr(act, n) for n in ours if n[0].islower()]
    callables += [getattr(act, n).forward for n in ours if n[0].isupper()]
    for fn in callables:
        params = list(inspect.signature(fn).parameters.values())
        for p in params:
            if p.name == "self":
                continue
            optional = p.default is not inspect.Parameter.empty
            assert optional == (p.kind == p.KEYWORD_ONLY), (
                fn.__qualname__, p.name)


DROP_INS = {"scaled_dot_product_attention": torch.nn.functional,
            "MultiheadAttention": torch.nn}


def test_drop_in_signatures():
    """The drop-ins take PyTorch's arguments, in its order, with its
    defaults; they add only keyword-only ones at the end, None by default:
    the variants (issue 25) and MultiheadAttention's ``cache``."""
    import inspect
    for name, where in DROP_INS.items():
        theirs, mine = getattr(where, name), getattr(act, name)
        if name[0].isupper():
            theirs, mine = theirs.forward, mine.forward
        params = [(p.name, p.kind, p.default)
                  for p in inspect.signature(mine).parameters.values()]
        try:
            sig = inspect.signature(theirs)
        except ValueError:
            # A builtin: its signature is the docstring's first line.
            text = theirs.__doc__.split("->")[0].strip()
            namespace: dict = {}
            exec(f"def {text}: pass", namespace)
            sig = inspect.signature(namespace[name])
        expect = [(p.name, p.kind, p.default)
                  for p in sig.parameters.values()]
        extra = ["window", "softcap", "alibi_slopes", "sinks"]
        if name == "MultiheadAttention":
            extra.insert(0, "cache")
        kw = inspect.Parameter.KEYWORD_ONLY
        assert params[-len(extra):] == [(n, kw, None) for n in extra], name
        assert params[:-len(extra)] == expect, name


def test_shape_errors_come_from_the_kernels():
    """ValueErrors of the NumPy functions, naming the argument."""
    args = make("additive", values=True, grad=False)
    with pytest.raises(ValueError, match="values"):
        act.additive_attention(**dict(args, values=args["values"][:, :2]))
    args = make("dot", several=False, grad=False)
    with pytest.raises(ValueError, match="mask"):
        act.dot_attention(**dict(args, mask=torch_causal_mask()))
    args = make("general", grad=False)
    with pytest.raises(ValueError, match="W"):
        act.general_attention(**dict(args, W=args["W"].T))
    with pytest.raises(ValueError, match=r"W has shape \(2, 3\); expected "
                                         r"\(P, >= H\) = \(P, >= 4\)"):
        act.project_keys(torch.zeros(B, T, 4, dtype=torch.float64),
                         args["W"])


def test_alpha_modified_in_place_is_detected():
    args = make("general")
    out, alpha = act.general_attention(**args)
    loss = (alpha * 2).sum() + out.sum()
    alpha.mul_(0)
    with pytest.raises(RuntimeError, match="modified by an inplace"):
        loss.backward()


# --------------------------------------------------------------------------
# Memory and modes


def test_tensors_reach_the_kernels_without_a_copy(monkeypatch):
    """The arrays given to the NumPy function are the tensors' memory (a
    strided view too), and out is the function's own result."""
    seen = {}
    real = attention_c.additive_attention

    def spy(*args, **kwargs):
        # What the adapter passes by position, then b and mask by keyword.
        seen["in"] = [*args, kwargs["b"], kwargs["mask"]]
        seen["out"] = real(*args, **kwargs)
        return seen["out"]

    monkeypatch.setattr(attention_c, "additive_attention", spy)
    args = make("additive", mask="key")
    keys_t = args["keys"].detach().transpose(0, 1).requires_grad_()
    args["keys"] = keys_t.transpose(0, 1)
    out, alpha = act.additive_attention(**args)
    names = ["query", "keys", "W", "v", "b", "mask"]
    assert len(seen["in"]) == len(names)
    for name, arr in zip(names, seen["in"]):
        t = args[name]
        assert arr.__array_interface__["data"][0] == t.data_ptr(), name
        assert arr.strides == tuple(s * t.element_size()
                                    for s in t.stride()), name
    assert out.data_ptr() == seen["out"][0].ctypes.data
    assert alpha.data_ptr() == seen["out"][1].ctypes.data


def test_non_contiguous_inputs():
    """Transposed and sliced views give the results and gradients of their
    contiguous copies."""
    args = make("dot", values=True, mask="causal")
    big = torch.randn(B, H, 2 * T, dtype=torch.float64, requires_grad=True)
    view = big[:, :, ::2].transpose(1, 2)              # (B, T, H), strided
    assert not view.is_contiguous()
    out, alpha = act.dot_attention(**dict(args, keys=view))
    flat = view.detach().contiguous().requires_grad_()
    out_c, alpha_c = act.dot_attention(**dict(args, keys=flat))
    assert rel_err(out, out_c) <= 1e-14
    (out.sum() + alpha[..., 0].sum()).backward()
    (out_c.sum() + alpha_c[..., 0].sum()).backward()
    assert rel_err(big.grad[:, :, ::2].transpose(1, 2), flat.grad) <= 1e-14
    assert torch.all(big.grad[:, :, 1::2] == 0)


def test_no_grad_mode():
    args = make("general", values=True)
    with torch.no_grad():
        out, alpha = act.general_attention(**args)
    assert not out.requires_grad and not alpha.requires_grad


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


# --------------------------------------------------------------------------
# Section 5: attn_mask, causal, bias, dropout, return_weights


def sec5_problem(kind, seed=0, Tq=TQ, Tk=T):
    """float64 query, keys, values (and W) requiring grad, a broadcast
    attn_mask (1, Tq, T), a key mask with a fully masked sequence, and a
    bias (Tq, T) with a row of -inf."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=g
                           ).requires_grad_()

    hq = H if kind == "dot" else HQ
    args = {"query": rnd(B, Tq, hq), "keys": rnd(B, Tk, H),
            "values": rnd(B, Tk, HV)}
    if kind == "general":
        args["W"] = rnd(HQ, H)
    am = torch.rand(1, Tq, Tk, generator=g) < 0.8
    am[0, 0] = True
    mask = torch.ones(B, Tk, dtype=torch.bool)
    mask[1] = False
    bias = torch.randn(Tq, Tk, dtype=torch.float64, generator=g)
    bias[-1] = -math.inf
    return args, {"attn_mask": am, "mask": mask,
                  "bias": bias.requires_grad_()}


SEC5_OPTS = {
    "causal": dict(causal=True),
    "attn_mask": dict(attn_mask=True),
    "bias": dict(bias=True),
    "all": dict(mask=True, attn_mask=True, causal=True, bias=True),
    "dropout": dict(causal=True, bias=True, dropout=0.3),
}


def sec5_args(kind, opts, seed=0, **shape):
    """(args, names of the differentiable ones) of one SEC5_OPTS case."""
    args, extra = sec5_problem(kind, seed, **shape)
    for name, x in extra.items():
        if opts.get(name):
            args[name] = x
    if opts.get("causal"):
        args["causal"] = True
    if opts.get("dropout"):
        args.update(dropout=opts["dropout"], seed=12345)
    return args, differentiable(args)


def numpy_call(fn, args, **kw):
    """fn (attention_c or attention_c.reference) on the tensors as
    arrays."""
    a = {n: x.detach().numpy() if isinstance(x, torch.Tensor) else x
         for n, x in dict(args, **kw).items()}
    pos = [a.pop("query"), a.pop("keys")] + (
        [a.pop("W")] if "W" in a else [])
    return fn(*pos, **a)


@pytest.mark.parametrize("weights", [True, False], ids=["alpha", "lse"])
@pytest.mark.parametrize("opts", list(SEC5_OPTS))
@pytest.mark.parametrize("kind", ["dot", "general"])
def test_sec5_equals_the_numpy_functions(kind, opts, weights):
    """Forward and gradients (bias included, summed to its shape) equal
    the C functions' on the same arrays, bit for bit, and the float64
    reference of section 5 within rounding."""
    args, names = sec5_args(kind, SEC5_OPTS[opts])
    out, second = ours(kind, **args, return_weights=weights)
    n_out, n_second = numpy_call(getattr(attention_c, f"{kind}_attention"),
                                 args, return_weights=weights)
    np.testing.assert_array_equal(out.detach().numpy(), n_out)
    np.testing.assert_array_equal(second.detach().numpy(), n_second)
    r_out, r_second = numpy_call(getattr(attention_c.reference,
                                         f"{kind}_attention"),
                                 args, return_weights=weights)
    np.testing.assert_allclose(out.detach().numpy(), r_out, rtol=1e-12,
                               atol=1e-14)
    np.testing.assert_allclose(second.detach().numpy(), r_second,
                               rtol=1e-12, atol=1e-14)
    g = torch.randn(out.shape, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, [args[n] for n in names], g)
    backward = getattr(attention_c, f"{kind}_attention_backward")
    a = {n: x.detach().numpy() if isinstance(x, torch.Tensor) else x
         for n, x in args.items()}
    pos = [g.numpy(), a.pop("query"), a.pop("keys")] + (
        [a.pop("W")] if "W" in a else [])
    if weights:
        want = backward(*pos, second.detach().numpy(), **a)
    else:
        want = backward(*pos, out=out.detach().numpy(),
                        lse=second.detach().numpy(), **a)
    for name, x in zip(names, grads):
        np.testing.assert_array_equal(x.numpy(), getattr(want, name),
                                      err_msg=name)
        assert x.shape == args[name].shape


@pytest.mark.parametrize("weights", [True, False], ids=["alpha", "lse"])
@pytest.mark.parametrize("opts", list(SEC5_OPTS))
@pytest.mark.parametrize("kind", ["dot", "general"])
def test_sec5_gradcheck_and_gradgradcheck(kind, opts, weights):
    """gradcheck (float64, both outputs: alpha, or lse, whose gradient
    takes the pure-PyTorch path) and gradgradcheck with bias, masks,
    causal and dropout at a fixed seed."""
    args, names = sec5_args(kind, SEC5_OPTS[opts])

    def f(*xs):
        out, second = ours(kind, **dict(args, **dict(zip(names, xs))),
                           return_weights=weights)
        # lse = -inf (no visible key) would make finite differences NaN.
        return out, torch.where(second.isfinite(), second, 0)

    inputs = [args[n] for n in names]
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("Tq,Tk", [(2, 5), (5, 3)], ids=["Tq<T", "Tq>T"])
def test_sec5_causal_bottom_right_and_single_query_bias(Tq, Tk):
    """causal with Tq != T is bottom-right aligned (t <= i + T - Tq); a
    single query takes a (..., T) bias and the key mask; gradcheck."""
    args, names = sec5_args("dot", dict(causal=True), Tq=Tq, Tk=Tk)
    out, alpha = ours("dot", **args)
    i, t = torch.arange(Tq)[:, None], torch.arange(Tk)[None, :]
    assert torch.equal(alpha.detach() != 0, (t <= i + Tk - Tq).expand(
        B, Tq, Tk)) or Tq > Tk
    assert torch.all(alpha[:, t[0] > i[:, 0, None] + Tk - Tq] == 0)
    assert torch.autograd.gradcheck(
        lambda q, k: ours("dot", **dict(args, query=q, keys=k)),
        (args["query"], args["keys"]))
    g = torch.Generator().manual_seed(3)
    q1 = torch.randn(B, H, dtype=torch.float64, generator=g,
                     requires_grad=True)
    bias = torch.randn(B, Tk, dtype=torch.float64, generator=g,
                       requires_grad=True)
    mask = torch.tensor([[1] * Tk, [0] * Tk, [1] + [0] * (Tk - 1)]) > 0
    for weights in [True, False]:
        assert torch.autograd.gradcheck(
            lambda q, k, b: act.dot_attention(q, k, bias=b, mask=mask,
                                              return_weights=weights)[0],
            (q1, args["keys"], bias))
    out, lse = act.dot_attention(q1, args["keys"], bias=bias, mask=mask,
                                 return_weights=False)
    assert lse.shape == (B,) and lse[1] == -math.inf


@pytest.mark.parametrize("case", ["mask", "bias", "causal", "all"])
def test_dot_equals_sdpa_with_section5_arguments(case):
    """Against F.scaled_dot_product_attention (float64, Tq == T): its
    boolean attn_mask (True = take part) is our attn_mask, its float one
    our bias, its is_causal our causal; outputs and gradients of query,
    keys, values and bias."""
    g = torch.Generator().manual_seed(8)
    n = 6

    def rnd(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=g,
                           requires_grad=True)

    q, k, v = rnd(2, 3, n, 4), rnd(2, 3, n, 4), rnd(2, 3, n, 5)
    bias = rnd(3, n, n)
    am = torch.rand(2, 1, n, n, generator=g) < 0.7
    am[..., 0] = True                   # every query sees a key
    mine = {"mask": dict(attn_mask=am), "bias": dict(bias=bias),
            "causal": dict(causal=True),
            "all": dict(attn_mask=am, bias=bias, causal=True)}[case]
    out, _ = act.dot_attention(q, k, values=v, **mine)
    theirs = dict(is_causal=mine.get("causal", False))
    if "bias" in mine and "attn_mask" in mine:
        theirs["attn_mask"] = bias.masked_fill(~am, -math.inf)
    elif "bias" in mine or "attn_mask" in mine:
        theirs["attn_mask"] = mine.get("bias", mine.get("attn_mask"))
    if theirs["is_causal"] and "attn_mask" in theirs:
        # SDPA takes is_causal without attn_mask: fold it in.
        tril = torch.ones(n, n, dtype=torch.bool).tril()
        m = theirs.pop("attn_mask")
        theirs["attn_mask"] = (m.masked_fill(~tril, -math.inf)
                               if m.dtype != torch.bool else m & tril)
        theirs["is_causal"] = False
    r_out = F.scaled_dot_product_attention(q, k, v, **theirs)
    torch.testing.assert_close(out, r_out, rtol=1e-12, atol=1e-13)
    go = torch.randn(out.shape, dtype=torch.float64, generator=g)
    xs = [q, k, v] + ([bias] if "bias" in mine else [])
    mine_g = torch.autograd.grad(out, xs, go)
    their_g = torch.autograd.grad(r_out, xs, go)
    for a, b in zip(mine_g, their_g):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_dropout_keep_bits_are_those_of_the_reference():
    """Dropout in the adapter uses the keep bits of
    attention_c.reference.dropout_keep (flat batch index over the leading
    axes): out equals (alpha * keep / (1 - p)) @ values; the pure-PyTorch
    Philox gives the same bits."""
    from attention_c.torch import _pure
    p, seed = 0.4, 2**64 - 7
    args, _ = sec5_args("dot", {})
    lead = (B,)
    keep = attention_c.reference.dropout_keep(seed, p, np.arange(B), TQ, T)
    assert np.array_equal(_pure.dropout_keep(seed, p, lead, TQ, T).numpy(),
                          keep)
    out, alpha = act.dot_attention(args["query"], args["keys"],
                                   values=args["values"], dropout=p,
                                   seed=seed)
    want = (alpha * torch.from_numpy(keep) / (1 - p)) @ args["values"]
    torch.testing.assert_close(out, want, rtol=1e-13, atol=1e-14)
    assert not torch.allclose(out, act.dot_attention(
        args["query"], args["keys"], values=args["values"])[0])
    # The same seed as an int64 tensor of its bits gives the same result.
    again, _ = act.dot_attention(args["query"], args["keys"],
                                 values=args["values"], dropout=p,
                                 seed=torch.tensor(seed - 2**64))
    assert torch.equal(again, out)


@pytest.mark.parametrize("kind", ["dot", "general"])
def test_module_dropout_is_reproducible_and_off_in_eval(kind):
    """A module draws its dropout seed from torch's default generator in
    training mode: torch.manual_seed reproduces the output and the
    gradients, another seed changes them; eval() means no dropout."""
    args, _ = sec5_args(kind, {})
    q, k, vals = args["query"], args["keys"], args["values"]
    if kind == "dot":
        module, plain = act.DotAttention(dropout=0.5), act.DotAttention()
    else:
        module = act.GeneralAttention(HQ, H, dropout=0.5,
                                      dtype=torch.float64)
        plain = act.GeneralAttention(HQ, H, dtype=torch.float64)
        with torch.no_grad():
            module.W.copy_(args["W"])
            plain.W.copy_(args["W"])
    assert "dropout=0.5" in repr(module)

    def run(seed):
        torch.manual_seed(seed)
        out = module(q, k, values=vals, causal=True)
        return out, torch.autograd.grad(out.sum(), q)[0]

    (o1, g1), (o2, g2), (o3, _) = run(0), run(0), run(1)
    assert torch.equal(o1, o2) and torch.equal(g1, g2)
    assert not torch.equal(o1, o3)
    # The seed drawn is the next int64 of the default generator.
    torch.manual_seed(0)
    seed = torch.randint(0, 2**63 - 1, (), dtype=torch.int64)
    fn = getattr(act, f"{kind}_attention")
    w = () if kind == "dot" else (module.W,)
    want, _ = fn(q, k, *w, values=vals, causal=True, dropout=0.5, seed=seed)
    torch.testing.assert_close(o1, want, rtol=1e-13, atol=1e-14)
    plain_out = plain(q, k, values=vals, causal=True)
    assert not torch.allclose(o1, plain_out)
    module.eval()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    assert torch.equal(module(q, k, values=vals, causal=True), plain_out)
    assert torch.equal(torch.get_rng_state(), state)   # nothing drawn
    module.train()
    out, alpha = module(q, k, values=vals, causal=True, return_weights=True)
    # The weights returned are before dropout.
    torch.testing.assert_close(
        alpha, plain(q, k, values=vals, causal=True, return_weights=True)[1])


def test_sec5_modules_take_the_arguments():
    """DotAttention and GeneralAttention take mask, attn_mask, causal and
    bias, AdditiveAttention mask, attn_mask and causal, as their
    functions."""
    for kind in KINDS:
        opts = dict(SEC5_OPTS["all"], bias=kind != "additive")
        args, _ = sec5_args(kind if kind != "additive" else "general", opts)
        if kind == "additive":
            module = act.AdditiveAttention(H, HQ, A, dtype=torch.float64)
            args["W"], args["v"] = module.W, module.v
            args["b"] = module.b
        elif kind == "general":
            module = act.GeneralAttention(HQ, H, dtype=torch.float64)
            args["W"] = module.W
        else:
            module = act.DotAttention()
        q, k = args["query"], args["keys"]
        kw = {n: x for n, x in args.items()
              if n not in ("query", "keys", "W", "v", "b")}
        out, alpha = module(q, k, **kw, return_weights=True)
        f_out, f_alpha = ours(kind, **args)
        assert torch.equal(out, f_out) and torch.equal(alpha, f_alpha)


def test_sec5_errors():
    args, _ = sec5_args("dot", {})
    q, k = args["query"], args["keys"]
    per_query = torch.ones(B, TQ, T, dtype=torch.bool)
    with pytest.raises(ValueError, match="attn_mask="):
        act.dot_attention(q, k, mask=per_query)
    with pytest.raises(ValueError, match="attn_mask="):
        act.DotAttention()(q, k, mask=per_query)
    with pytest.raises(TypeError, match="bias="):
        act.dot_attention(q, k, attn_mask=per_query.double())
    with pytest.raises(TypeError, match="attn_mask="):
        act.dot_attention(q, k, bias=per_query)
    with pytest.raises(ValueError, match="several queries"):
        act.dot_attention(q[:, 0], k, causal=True)
    with pytest.raises(ValueError, match="several queries"):
        act.general_attention(q[:, 0, :HQ], k, args["values"][0, :HQ, :H],
                              attn_mask=per_query[:, 0])
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        act.dot_attention(q, k, dropout=1.0, seed=0)
    with pytest.raises(ValueError, match="needs seed"):
        act.dot_attention(q, k, dropout=0.1)
    with pytest.raises(ValueError, match="seed must be an int"):
        act.dot_attention(q, k, dropout=0.1, seed=2**64)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        act.DotAttention(dropout=-0.1)
    with pytest.raises(ValueError, match="bias"):     # does not broadcast
        act.dot_attention(q, k, bias=torch.zeros(TQ + 1, T,
                                                 dtype=torch.float64))
    with pytest.raises(TypeError, match="positional"):
        act.dot_attention(q, k, None, per_query)


@pytest.mark.parametrize("weights", [True, False], ids=["alpha", "lse"])
def test_grouped_query_attention_broadcasts_keys(weights):
    """Keys and values (B, Hkv, 1, T, d) against queries (B, Hkv, G, Tq,
    d): the leading axes broadcast without copies; the result and the
    gradients (the keys' and values' summed over the G query groups) equal
    those of the keys expanded; gradcheck."""
    g = torch.Generator().manual_seed(11)

    def rnd(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=g,
                           requires_grad=True)

    q, k, v = rnd(2, 2, 3, 4, H), rnd(2, 2, 1, 5, H), rnd(2, 2, 1, 5, HV)
    bias = rnd(4, 5)
    kw = dict(causal=True, return_weights=weights)
    out, second = act.dot_attention(q, k, values=v, bias=bias, **kw)
    ke, ve = (x.expand(2, 2, 3, *x.shape[-2:]) for x in (k, v))
    r_out, r_second = act.dot_attention(q, ke, values=ve, bias=bias, **kw)
    torch.testing.assert_close(out, r_out, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(second, r_second, rtol=1e-13, atol=1e-14)
    go = torch.randn(out.shape, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad(out, (q, k, v, bias), go)
    r_grads = torch.autograd.grad(r_out, (q, k, v, bias), go)
    for a, b in zip(grads, r_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    assert grads[1].shape == k.shape
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: act.dot_attention(q, k, values=v, bias=b,
                                             **kw)[0], (q, k, v, bias))
