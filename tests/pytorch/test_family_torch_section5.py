"""attn_mask, causal, bias, dropout and return_weights (section 5) in the
attention family of the PyTorch adapter (attention_c.torch), for
DotAttention and GeneralAttention and their functions (and the arguments
AdditiveAttention takes): forward and gradients equal the C functions'
bit for bit and the float64 reference within rounding; gradcheck and
gradgradcheck; causal bottom-right aligned when Tq != T, a single query
with a bias; against F.scaled_dot_product_attention; dropout's keep bits
those of attention_c.reference, a module's dropout reproducible and off
in eval; the modules take the arguments of their functions; the errors;
grouped-query keys and values broadcast.  The rest of the family's tests
are in test_family_torch.py and test_family_torch_inputs.py, the shared
cases in family_torch_cases.py.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import attention_c  # noqa: E402
import attention_c.reference  # noqa: E402,F401
import attention_c.torch as act  # noqa: E402

from family_torch_cases import (A, B, H, HQ, HV, KINDS, T,  # noqa: E402
                                TQ, differentiable, ours)

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
