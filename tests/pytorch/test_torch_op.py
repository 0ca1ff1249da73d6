"""The kernels as PyTorch custom operators (issue 13): torch.library
registration, higher-order gradients, torch.compile, torch.export,
torch.func, meta tensors, bfloat16/float16 and autocast, and the loaders.

Everything is checked against pure PyTorch: the implementations of
attention_c.testing (context pooling and the three family scores),
differentiated by autograd.  Shapes are tiny and there are only two
compilations (one torch.compile, one torch.export), to keep the file fast.
"""

import copy
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import attention_c as ac  # noqa: E402
import attention_c.torch as act  # noqa: E402
from attention_c.testing import (  # noqa: E402
    TORCH_ATTENTION, TORCH_FAMILY_SIZES, rel_err, torch_family_problem,
    torch_key_mask, torch_layer_problem)

B, TQ, T, H, HQ, A, _ = TORCH_FAMILY_SIZES

KINDS = ["context", "additive", "dot", "general"]
OPS = ["context_attention", "additive_attention", "dot_attention",
       "general_attention"]

# Normwise relative error allowed against float32 on the same (rounded)
# inputs and weights: twice the unit roundoff of the format (the results
# are rounded once to it; bfloat16 keeps 8 significant bits, float16 11).
LOW_TOL = {torch.bfloat16: 2 * 2.0 ** -8, torch.float16: 2 * 2.0 ** -11}


def problem(kind, several=True, mask="key", values=False, grad=True,
            bias=True):
    """(ours, pure, args): our function, its pure-PyTorch twin and random
    float64 arguments by name (the float ones requiring grad)."""
    if kind == "context":
        mask = {"key": "edge", "causal": "partial"}.get(mask, mask)
        h, W, v, b, m = torch_layer_problem(mask=mask, grad=grad, bias=bias)
        return (act.context_attention, TORCH_ATTENTION[kind],
                {"h": h, "W": W, "v": v, "b": b, "mask": m})
    return (getattr(act, f"{kind}_attention"), TORCH_ATTENTION[kind],
            torch_family_problem(kind, several=several, mask=mask,
                                 values=values, grad=grad, bias=bias))


def split(args):
    """(names, tensors) of the arguments that require grad, and f building
    the call from them."""
    names = [n for n, x in args.items()
             if isinstance(x, torch.Tensor) and x.requires_grad]

    def bind(fn):
        return lambda *xs: fn(**dict(args, **dict(zip(names, xs))))

    return names, [args[n] for n in names], bind


def modules(dtype=torch.float64):
    torch.manual_seed(0)
    return {"context": act.ContextAttention(H, A, dtype=dtype),
            "additive": act.AdditiveAttention(H, HQ, A, dtype=dtype),
            "dot": act.DotAttention(),
            "general": act.GeneralAttention(HQ, H, dtype=dtype)}


def call(kind, module, query, keys, mask):
    """A module on (query, keys); the context module pools the keys."""
    if kind == "context":
        return module(keys, mask=mask)
    return module(query, keys, mask=mask)


# --------------------------------------------------------------------------
# Registration


OPCHECK_CASES = [("context", "plain"), ("additive", "plain"),
                 ("additive", "sec5"), ("dot", "plain"), ("dot", "sec5"),
                 ("dot", "lse"), ("general", "plain"), ("general", "sec5"),
                 ("general", "lse")]


@pytest.mark.parametrize("kind,variant", OPCHECK_CASES)
def test_opcheck(kind, variant):
    """torch.library.opcheck: schema, fake implementation, autograd
    registration and AOT dispatch of each forward operator; 'sec5' with
    attn_mask, causal, bias and dropout, 'lse' with return_weights=False
    (the (out, lse) form) as well."""
    _, _, args = problem(kind, values=kind != "context",
                         mask="causal" if variant != "plain" else "key")
    op = getattr(torch.ops.attention_c, OPS[KINDS.index(kind)]).default
    sec5 = variant != "plain"
    am, causal = args.get("attn_mask"), sec5
    g = torch.Generator().manual_seed(4)
    bias = (torch.randn(TQ, T, dtype=torch.float64, generator=g,
                        requires_grad=True) if sec5 else None)
    p, seed = (0.25, torch.tensor(-5)) if sec5 else (0.0, None)
    weights = variant != "lse"
    if kind == "context":
        a = (args["h"], args["W"], args["v"], args["b"], args["mask"], True)
    elif kind == "dot":
        a = (args["query"], args["keys"], args["mask"], am, causal, bias, p,
             seed, args["values"], 0.7, weights)
    elif kind == "general":
        a = (args["query"], args["keys"], args["W"], args["mask"], am,
             causal, bias, p, seed, args["values"], None, weights)
    else:
        a = tuple(args[n] for n in ["query", "keys", "W", "v", "b", "mask",
                                    "attn_mask"]) + (
            causal, args["values"], None)
    torch.library.opcheck(op, a)


@pytest.mark.parametrize("several", [True, False], ids=["several", "single"])
def test_meta_tensors_propagate_shapes(several):
    """Modules and inputs all on 'meta': the fake implementation gives the
    output shapes (no data, no kernel call)."""
    q_shape = (B, TQ) if several else (B,)
    for kind, module in modules(torch.float32).items():
        module = module.to("meta")
        hq = H if kind in ("dot", "context") else HQ
        query = torch.empty(*q_shape, hq, device="meta")
        keys = torch.empty(B, T, H, device="meta")
        mask = torch.empty(B, T, dtype=torch.bool, device="meta")
        out = call(kind, module, query, keys, mask)
        assert out.device.type == "meta"
        want = (B, H) if kind == "context" else (*q_shape, H)
        assert tuple(out.shape) == want, kind


# --------------------------------------------------------------------------
# Higher-order gradients: exact, never silently zero

GG_CASES = [("context", True, "key", False), ("context", False, "none", False),
            ("additive", True, "causal", True), ("additive", False, "key",
                                                 False),
            ("dot", True, "causal", False), ("dot", False, "key", True),
            ("general", True, "key", True), ("general", False, "none",
                                             False)]


@pytest.mark.parametrize("kind,several,mask,values", GG_CASES)
def test_gradgradcheck(kind, several, mask, values):
    """Second derivatives of both outputs in float64 against finite
    differences of the (C) first derivatives; masks with fully masked
    rows or queries."""
    ours, _, args = problem(kind, several, mask, values,
                            bias=several or kind != "context")
    _, xs, bind = split(args)
    assert torch.autograd.gradgradcheck(bind(ours), xs)


@pytest.mark.parametrize("kind", ["additive", "general"])
def test_gradgradcheck_key_proj(kind):
    """The decoder path: the gradient stops at a key_proj made by
    project_keys, and the second derivatives still are exact."""
    ours, _, args = problem(kind, values=True)
    names, xs, _ = split(args)

    def f(*x):
        a = dict(args, **dict(zip(names, x)))
        return ours(**a, key_proj=act.project_keys(a["keys"], a["W"]))

    assert torch.autograd.gradgradcheck(f, xs)


def scalar_loss(fn):
    """A loss that uses both outputs nonlinearly."""
    def loss(**a):
        out, alpha = fn(**a)
        return (out ** 2).sum() + (alpha ** 3).sum()
    return loss


@pytest.mark.parametrize("kind", KINDS)
def test_hessian_equals_pure_pytorch(kind):
    """torch.autograd.functional.hessian (reverse over reverse) and
    torch.func.hessian (forward over reverse) equal pure PyTorch's, with a
    nonzero Hessian (it was all zeros before the operators)."""
    ours, pure, args = problem(kind, mask="causal" if kind != "context"
                               else "partial", values=kind == "dot")
    names, xs, bind = split(args)
    name = "h" if kind == "context" else "query"
    i = names.index(name)
    x0 = xs[i].detach()

    def only(fn):
        f = bind(scalar_loss(fn))
        return lambda x: f(*xs[:i], x, *xs[i + 1:])

    ref = torch.autograd.functional.hessian(only(pure), x0)
    assert ref.norm() > 0.1
    got = torch.autograd.functional.hessian(only(ours), x0)
    assert rel_err(got, ref) < 1e-12
    detached = [x.detach() for x in xs]
    f = bind(scalar_loss(ours))
    got = torch.func.hessian(
        lambda x: f(*detached[:i], x, *detached[i + 1:]))(x0)
    assert rel_err(got, ref) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_penalty_equals_pure_pytorch(kind):
    """A WGAN-GP style penalty: the norm of d loss / d input, taken with
    create_graph=True, then differentiated for every parameter and input;
    and a third derivative along the way."""
    ours, pure, args = problem(kind, values=True)
    names, xs, bind = split(args)
    results = []
    for fn in (ours, pure):
        leaves = [x.detach().requires_grad_() for x in xs]
        loss = bind(scalar_loss(fn))(*leaves)
        g = torch.autograd.grad(loss, leaves, create_graph=True)
        penalty = sum((gi ** 2).sum() for gi in g)
        second = torch.autograd.grad(penalty, leaves, create_graph=True)
        third = torch.autograd.grad(second[0].sum(), leaves[0])[0]
        results.append((penalty, second, third))
    (p, s, t), (rp, rs, rt) = results
    assert rel_err(p, rp) < 1e-12
    for a, b, n in zip(s, rs, names):
        assert rel_err(a, b) < 1e-11, n
    assert rt.norm() > 0 and rel_err(t, rt) < 1e-10


# --------------------------------------------------------------------------
# torch.func


@pytest.mark.parametrize("kind", KINDS)
def test_func_grad_jacrev_vmap(kind):
    """torch.func.grad, jacrev and vmap (of the forward and of per-example
    gradients) against autograd and loops over the batch."""
    module = modules()[kind]
    _, _, args = problem(kind, several=False, grad=False)
    keys = args["h"] if kind == "context" else args["keys"]
    # The context module has no query: it gets the keys and ignores them.
    query = keys if kind == "context" else args["query"]
    mask = args["mask"]
    live = dict(module.named_parameters())
    params = {n: p.detach() for n, p in live.items()}

    def loss(p, q, k, m):
        a = (k,) if kind == "context" else (q, k)
        out = torch.func.functional_call(module, p, a, {"mask": m})
        return (out ** 2).sum()

    # grad w.r.t. the parameters and the keys, against autograd
    k = keys.detach().requires_grad_()
    loss(live, query, k, mask).backward()
    g = torch.func.grad(loss, argnums=(0, 2))(params, query, keys, mask)
    assert rel_err(g[1], k.grad) < 1e-14
    for n, p in live.items():
        assert rel_err(g[0][n], p.grad) < 1e-14, n
    # jacrev of the output w.r.t. the keys, against a row from autograd
    J = torch.func.jacrev(lambda k: call(kind, module, query, k, mask))(keys)
    row, = torch.autograd.grad(call(kind, module, query, k, mask)[0, 1], k)
    assert rel_err(J[0, 1], row) < 1e-14
    # vmap of per-example gradients (parameters and keys) against a loop
    per = torch.func.vmap(torch.func.grad(loss, argnums=(0, 2)),
                          in_dims=(None, 0, 0, 0))(
        params, query[:, None], keys[:, None], mask[:, None])
    for b in range(keys.shape[0]):
        kb = keys[b:b + 1].detach().requires_grad_()
        refs = torch.autograd.grad(
            loss(live, query[b:b + 1], kb, mask[b:b + 1]), [*live.values(),
                                                            kb])
        for n, ref in zip([*live, "keys"], refs):
            got = per[1][b] if n == "keys" else per[0][n][b]
            assert rel_err(got, ref) < 1e-13, (n, b)
    # vmap of the forward over a new leading axis
    vm = torch.func.vmap(lambda k: call(kind, module, query, k, mask))(
        torch.stack([keys, keys.flip(1)]))
    assert rel_err(vm[1], call(kind, module, query, keys.flip(1),
                               mask)) < 1e-15


def test_vmap_over_batched_weights_loops():
    """vmap over a stack of weights (not a native batch axis) runs one call
    per weight and matches them."""
    _, _, a = problem("general", grad=False)
    Ws = torch.stack([a["W"], 2 * a["W"]])
    out = torch.func.vmap(lambda W: act.general_attention(
        a["query"], a["keys"], W, mask=a["mask"])[0])(Ws)
    for i in range(2):
        ref, _ = act.general_attention(a["query"], a["keys"], Ws[i],
                                       mask=a["mask"])
        assert rel_err(out[i], ref) < 1e-15


# --------------------------------------------------------------------------
# torch.compile and torch.export


class AllFour(torch.nn.Module):
    """A model with each layer: a Linear, then the four attentions (with
    the section 5 arguments: key mask, attn_mask, causal, a learned bias),
    their outputs summed into a head, and the lse of a causal dot
    attention (whose gradient takes the pure-PyTorch path)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(H, H)
        self.att = torch.nn.ModuleDict(modules(torch.float32))
        self.rel = torch.nn.Parameter(0.1 * torch.randn(TQ, T))
        self.head = torch.nn.Linear(H, 1)

    def forward(self, query, keys, mask, attn_mask):
        k = torch.tanh(self.inp(keys))
        q_dot = k[:, :TQ]
        pooled = self.att["context"](k, mask=mask)
        out = (self.att["additive"](query, k, mask=mask,
                                    attn_mask=attn_mask).mean(-2)
               + self.att["dot"](q_dot, k, mask=mask, causal=True,
                                 bias=self.rel).mean(-2)
               + self.att["general"](query, k, attn_mask=attn_mask,
                                     bias=self.rel).mean(-2))
        _, lse = act.dot_attention(q_dot, k, causal=True, bias=self.rel,
                                   return_weights=False)
        return self.head(pooled + out)[..., 0] + 0.1 * lse.mean(-1)


def all_four_inputs():
    g = torch.Generator().manual_seed(3)
    attn_mask = torch.rand(1, TQ, T, generator=g) < 0.7
    attn_mask[..., 0] = True
    return (torch.randn(B, TQ, HQ, generator=g),
            torch.randn(B, T, H, generator=g), torch_key_mask(), attn_mask)


def test_compile_fullgraph_training_step():
    """torch.compile(fullgraph=True) of a model with all four layers (a
    graph break would raise): two training steps give eager's losses and
    gradients."""
    torch.manual_seed(0)
    eager = AllFour()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    inputs = all_four_inputs()
    y = torch.randn(B)
    losses = []
    for model, fn in ((eager, eager), (compiled_model, compiled)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = []
        for _ in range(2):
            opt.zero_grad()
            loss = F.mse_loss(fn(*inputs), y)
            loss.backward()
            opt.step()
            run.append(loss.detach())
        losses.append((run, [p.grad for p in model.parameters()]))
    (le, ge), (lc, gc) = losses
    for a, b in zip(le, lc):
        assert abs(a - b) <= 1e-6 * abs(a)
    for a, b in zip(ge, gc):
        assert rel_err(b, a) < 1e-5


def test_export():
    """torch.export.export of the model with all four layers: the exported
    program calls the attention_c operators and gives eager's output."""
    model = AllFour()
    inputs = all_four_inputs()
    exported = torch.export.export(model, inputs)
    text = str(exported.graph)
    for name in OPS:
        assert f"attention_c.{name}" in text, name
    torch.testing.assert_close(exported.module()(*inputs), model(*inputs),
                               rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------
# bfloat16, float16, autocast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_low_precision(kind, dtype):
    """Module and inputs in bfloat16 or float16: computed in float32,
    returned (with the gradients) in the input dtype, within twice the
    format's unit roundoff of float32 on the same rounded values."""
    low = modules(torch.float32)[kind].to(dtype)
    ref = copy.deepcopy(low).float()
    query, keys, mask, _ = all_four_inputs()
    if kind in ("dot", "context"):
        query = keys[:, :TQ]
    q, k = query.to(dtype), keys.to(dtype).requires_grad_()
    k32 = k.detach().float().requires_grad_()
    out = call(kind, low, q, k, mask)
    out32 = call(kind, ref, q.float(), k32, mask)
    assert out.dtype == dtype
    assert rel_err(out, out32) <= LOW_TOL[dtype]
    (out.float() ** 2).sum().backward()
    (out32 ** 2).sum().backward()
    assert k.grad.dtype == dtype
    assert rel_err(k.grad, k32.grad) <= LOW_TOL[dtype]
    for p, p32 in zip(low.parameters(), ref.parameters()):
        assert p.grad.dtype == dtype
        assert rel_err(p.grad, p32.grad) <= LOW_TOL[dtype]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inference_on_a_cache(dtype, mode, monkeypatch):
    """Inference against a 16-bit cache (the kernels read it in place
    where they decode): the float32 call's results on the widened
    tensors, rounded once (the lse kept in float32), for the dot and
    general scores, one and three queries per head, grouped heads on a
    strided cache view, and SDPA; the kernels are handed the cache in its
    own dtype."""
    seen = []
    real_np = act._ops._np

    def spy(t):
        seen.append(t.dtype)
        return real_np(t)

    monkeypatch.setattr(act._ops, "_np", spy)
    monkeypatch.setattr(act._ops, "_np_opt",
                        lambda t: None if t is None else spy(t))
    g = torch.Generator().manual_seed(7)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    cache = torch.randn(2, 2, 70, 3, 40, generator=g).to(dtype)
    W = torch.randn(24, 40, generator=g).to(dtype)
    for tq in (1, 3):
        q = torch.randn(2, 3, 2, tq, 40, generator=g).to(dtype)
        k = cache[0, :, :61].permute(0, 2, 1, 3)[:, :, None]  # (2, 3, 1, ..)
        v = cache[1, :, :61].permute(0, 2, 1, 3)[:, :, None]
        qg = torch.randn(2, 3, 2, tq, 24, generator=g).to(dtype)
        calls = {
            "dot": lambda q, k, v, W: act.dot_attention(
                q, k, values=v, causal=True, return_weights=False),
            "general": lambda q, k, v, W: act.general_attention(
                qg if q.dtype == dtype else qg.float(), k, W, values=v),
            "sdpa": lambda q, k, v, W: act.scaled_dot_product_attention(
                q, k.expand(-1, -1, 2, -1, -1), v.expand(-1, -1, 2, -1, -1)),
        }
        for name, f in calls.items():
            with ctx():
                got = f(q, k, v, W)
                want = f(q.float(), k.float(), v.float(), W.float())
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            for i, (x, y) in enumerate(zip(got, want)):
                lse = name == "dot" and i == 1      # float32, as NumPy's
                assert x.dtype == (torch.float32 if lse else dtype), name
                r = y if lse else y.to(dtype)
                if name == "general" and i == 1 and dtype == torch.float16:
                    # a valid item's weight: 2^-24 where it would be 0
                    r = torch.where((r == 0) & (y > 0),
                                    torch.full((), 2.0**-24, dtype=dtype), r)
                assert torch.equal(x, r), (name, tq)
    assert dtype in seen and torch.float32 in seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_eager_is_the_numpy_call(dtype):
    """An eager call on 16-bit tensors (a prefill: the streamed path) is
    the NumPy call on the same 16-bit data, bit for bit: for bfloat16
    the bf16 products where the CPU has them; with gradients recorded
    too, and its backward is the NumPy backward on the 16-bit data (bf16
    products there as well), gradients in the inputs' dtype."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np_dtype = {torch.bfloat16: ml_dtypes.bfloat16,
                torch.float16: np.float16}[dtype]
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, 70, 40, generator=g).to(dtype)
               for _ in range(3))

    def arr(t):
        return t.view(torch.int16).numpy().view(np_dtype)

    with torch.no_grad():
        out, lse = act.dot_attention(q, k, values=v, causal=True,
                                     return_weights=False)
    want, want_lse = ac.dot_attention(arr(q), arr(k), values=arr(v),
                                      causal=True, return_weights=False)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert np.array_equal(arr(out), want)
    assert torch.equal(lse, torch.from_numpy(want_lse))
    for t in (q, k, v):
        t.requires_grad_(True)
    out2, _ = act.dot_attention(q, k, values=v, causal=True,
                                return_weights=False)
    assert np.array_equal(arr(out2.detach()), want)
    go = torch.randn(out2.shape, generator=g).to(dtype)
    out2.backward(go)
    grads = ac.dot_attention_backward(arr(go), arr(q.detach()),
                                      arr(k.detach()), values=arr(v.detach()),
                                      out=want, lse=want_lse, causal=True)
    for t, w in zip((q, k, v), grads):
        assert t.grad.dtype == dtype and w.dtype == np_dtype
        assert np.array_equal(arr(t.grad), w)


def test_autocast_bfloat16():
    """Under torch.autocast('cpu', torch.bfloat16) the model runs forward
    and backward; the attention layers compute in float32 (their output
    is float32) from autocast's bfloat16 inputs."""
    model = AllFour()
    query, keys, mask, am = all_four_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        k = torch.tanh(model.inp(keys))
        assert k.dtype == torch.bfloat16
        pooled = model.att["context"](k, mask=mask)
        y = model(query, keys, mask, am)
    assert pooled.dtype == torch.float32
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for p in model.parameters())
    ref = model(query, keys, mask, am)
    # bfloat16 activations (the Linear layers) dominate the error here
    assert rel_err(y, ref) < 3e-2


# --------------------------------------------------------------------------
# Loaders and bad input


@pytest.mark.parametrize("form", ["linear", "linear_nobias", "parameter",
                                  "tensor_1A"])
def test_loaders_accept_every_form_of_v(form):
    """from_linear and from_d2l take v as Linear(A, 1) (its bias dropped),
    Linear(A, 1, bias=False), a bare (A,) Parameter or a (1, A) tensor."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(A, 1, bias=form != "linear_nobias")
    out = {"linear": lin, "linear_nobias": lin,
           "parameter": torch.nn.Parameter(lin.weight.detach()[0].clone()),
           "tensor_1A": lin.weight.detach().clone()}[form]
    score = torch.nn.Linear(2 * H, A)
    c = act.ContextAttention.from_linear(score, out)
    assert torch.equal(c.v, lin.weight[0]) and torch.equal(c.W, score.weight)
    score = torch.nn.Linear(H + HQ, A)
    a = act.AdditiveAttention.from_linear(score, out, key_size=H)
    assert torch.equal(a.v, lin.weight[0])
    d = act.AdditiveAttention.from_d2l(torch.nn.Linear(H, A, bias=False),
                                       torch.nn.Linear(HQ, A, bias=False),
                                       out)
    assert torch.equal(d.v, lin.weight[0])
    with pytest.raises(ValueError, match=r"expected \(1, 5\)"):
        act.ContextAttention.from_linear(torch.nn.Linear(2 * H, A),
                                         torch.zeros(A + 1))


def test_bad_dtypes_and_devices_name_the_argument():
    _, _, a = problem("dot", grad=False)
    with pytest.raises(TypeError, match="keys has dtype torch.int64; "
                                        "attention_c.torch supports"):
        act.dot_attention(a["query"], a["keys"].long())
    with pytest.raises(TypeError, match="keys has dtype torch.float64 but "
                                        "query has torch.bfloat16"):
        act.dot_attention(a["query"].bfloat16(), a["keys"])
    with pytest.raises(TypeError, match="dtype must be one of"):
        act.GeneralAttention(2, 3, dtype=torch.complex64)
    with pytest.raises(ValueError, match="CPU only, but keys is on device "
                                         "'meta'"):
        act.dot_attention(a["query"], a["keys"].to("meta"))


def test_jit_script_is_refused_clearly():
    """TorchScript cannot compile the adapter: a clear error naming the
    module and the supported alternatives (also from inside a model)."""
    model = torch.nn.Sequential(torch.nn.Linear(H, H),
                                act.ContextAttention(H, A))
    with pytest.raises(RuntimeError, match="torch.jit.script is not "
                                           "supported.*ContextAttention.*"
                                           "torch.compile or torch.export"):
        torch.jit.script(model)


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
def test_jit_trace_records_the_operators():
    """torch.jit.trace of a model with all four layers passes its own
    check (trace with grad, check without: the same graph), records the
    operators (not Python nodes), and survives save/load with eager's
    outputs and gradients."""
    model = AllFour()
    query, keys, mask, am = all_four_inputs()
    traced = torch.jit.trace(model, (query, keys, mask, am))
    text = str(traced.inlined_graph)
    for name in OPS:
        assert f"attention_c::{name}" in text, name
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    k1, k2 = keys.clone().requires_grad_(), keys.clone().requires_grad_()
    out, ref = loaded(query, k1, mask, am), model(query, k2, mask, am)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    g, = torch.autograd.grad(out.sum(), k1)
    g_ref, = torch.autograd.grad(ref.sum(), k2)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


def test_fx_symbolic_trace_keeps_the_calls_as_leaves():
    """torch.fx.symbolic_trace of a model: each attention call is one node
    of the graph (run at call time), and the GraphModule equals the model;
    a proxy handed to a function directly gets a clear error."""
    model = AllFour()
    gm = torch.fx.symbolic_trace(model)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    for name in OPS:
        assert getattr(act, name) in targets, name
    inputs = all_four_inputs()
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)

    dot = act.dot_attention         # a name of its own: not patched

    class Direct(torch.nn.Module):
        def forward(self, query, keys):
            return dot(query.float(), keys)[0]

    with pytest.raises(TypeError, match="query is a torch.fx.Proxy: "
                                        "torch.fx.symbolic_trace cannot"):
        torch.fx.symbolic_trace(Direct())


def test_functionalize():
    """torch.func.functionalize runs the operators (an autograd.Function has
    no functionalize rule); with a gradient transform inside it, a clear
    error names both."""
    model = AllFour()
    inputs = all_four_inputs()
    out = torch.func.functionalize(model)(*inputs)
    torch.testing.assert_close(out, model(*inputs), rtol=0, atol=0)
    _, _, a = problem("dot", grad=False)

    def loss(q):
        return act.dot_attention(q, a["keys"], mask=a["mask"])[0].sum()

    with pytest.raises(RuntimeError, match="functionalize together with a "
                                           "gradient transform.*dot_attent"):
        torch.func.functionalize(torch.func.grad(loss))(a["query"])


def test_sparse_and_nested_tensors_are_refused_clearly():
    _, _, a = problem("dot", grad=False)
    with pytest.raises(TypeError, match="keys is a torch.sparse_coo tensor;"
                                        " attention_c.torch takes dense"):
        act.dot_attention(a["query"], a["keys"].to_sparse())
    nested = torch.nested.nested_tensor([a["keys"][0], a["keys"][1, :2]],
                                        layout=torch.jagged)
    with pytest.raises(TypeError, match="keys is a nested tensor"):
        act.dot_attention(a["query"][:2], nested)


# --------------------------------------------------------------------------
# The compiled-step benchmark


def test_compile_step_benchmark_prints_its_tables(capsys):
    """python -m attention_c.bench.compile_step at tiny sizes (one step,
    one round): both tables, every variant; no time is asserted."""
    from attention_c.bench import compile_step
    with pytest.raises(SystemExit) as exit_info:
        compile_step.parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out
    threads = torch.get_num_threads(), ac.get_num_threads()
    try:
        code = compile_step.main(["--models", "context", "--sizes", "tiny",
                                  "--acts", "Tanh", "--pools",
                                  "attention_c,mean", "--repeats", "1",
                                  "--steps", "1"])
    finally:
        torch.set_num_threads(threads[0])
        ac.set_num_threads(threads[1])
    assert code == 0
    out = capsys.readouterr().out
    assert "ratio = compiled / eager" in out
    rows = [line.split() for line in out.splitlines()
            if line.startswith("context")]
    assert [r[3] for r in rows] == ["attention_c", "mean", "attention_c"]
    assert all(float(x) > 0 for x in rows[0][4:7])
    with pytest.raises(SystemExit):
        compile_step.parse_args(["--acts", "Softmax"])


# --------------------------------------------------------------------------
# Section 5 arguments under torch.func, meta tensors and torch.compile


def sec5_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, TQ, H, dtype=torch.float64, generator=g)
    k = torch.randn(B, T, H, dtype=torch.float64, generator=g)
    bias = torch.randn(TQ, T, dtype=torch.float64, generator=g)
    am = torch.rand(TQ, T, generator=g) < 0.7
    return q, k, bias, am


def test_vmap_with_section5_arguments():
    """vmap over batched bias and attn_mask (fewer leading axes than the
    query: aligned to the results' leading axes), over queries with a
    shared bias, and with dropout (one call per example: the keep bits
    depend on the flat batch index), against loops; per-example bias
    gradients with vmap(grad)."""
    q, k, bias, am = sec5_inputs()
    biases = torch.stack([bias, -bias, 2 * bias])
    ams = torch.stack([am, ~am, am])
    vm = torch.func.vmap(lambda b, m: act.dot_attention(
        q, k, bias=b, attn_mask=m, causal=True, return_weights=False))(
        biases, ams)
    for i in range(3):
        out, lse = act.dot_attention(q, k, bias=biases[i], attn_mask=ams[i],
                                     causal=True, return_weights=False)
        assert torch.equal(vm[0][i], out) and torch.equal(vm[1][i], lse)
    qs = torch.stack([q, q.flip(0)])
    vm = torch.func.vmap(lambda x: act.dot_attention(
        x, k, bias=bias, dropout=0.5, seed=7)[0])(qs)
    for i in range(2):
        out, _ = act.dot_attention(qs[i], k, bias=bias, dropout=0.5, seed=7)
        assert torch.equal(vm[i], out)

    def loss(b, x):
        out, alpha = act.dot_attention(x, k, bias=b, causal=True)
        return (out ** 2).sum() + alpha[..., 0].sum()

    per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(bias,
                                                                    qs)
    for i in range(2):
        b = bias.detach().requires_grad_()
        ref, = torch.autograd.grad(loss(b, qs[i]), b)
        assert rel_err(per[i], ref) < 1e-13


@pytest.mark.parametrize("several", [True, False], ids=["several", "single"])
def test_meta_tensors_give_lse_and_bias_gradient_shapes(several):
    """The fake implementations: (out, lse) shapes with
    return_weights=False, and a broadcast bias's gradient in its shape."""
    q_shape = (B, TQ, H) if several else (B, H)
    q = torch.empty(*q_shape, device="meta", requires_grad=True)
    k = torch.empty(B, T, H, device="meta")
    bias = torch.empty(*((TQ, T) if several else (T,)), device="meta",
                       requires_grad=True)
    out, lse = act.dot_attention(q, k, bias=bias, return_weights=False,
                                 dropout=0.1, seed=3)
    assert out.shape == q_shape and lse.shape == q_shape[:-1]
    W = torch.empty(HQ, H, device="meta")
    out, lse = act.general_attention(
        torch.empty(*q_shape[:-1], HQ, device="meta"), k, W, bias=bias,
        return_weights=False)
    assert out.shape == (*q_shape[:-1], H) and lse.shape == q_shape[:-1]
    g, = torch.autograd.grad(act.dot_attention(q, k, bias=bias)[0].sum(),
                             bias)
    assert g.shape == bias.shape and g.device.type == "meta"


def test_compile_module_dropout_is_reproducible():
    """torch.compile(fullgraph=True) of a DotAttention with dropout: the
    seed is drawn inside the graph, so torch.manual_seed reproduces the
    output and gradients; in eval mode the compiled module has no dropout
    and equals eager."""
    module = act.DotAttention(dropout=0.3)
    compiled = torch.compile(module, fullgraph=True)
    q, k, bias, _ = sec5_inputs(1)
    q = q.float().requires_grad_()
    k, bias = k.float(), bias.float()

    def run(seed):
        torch.manual_seed(seed)
        out = compiled(q, k, causal=True, bias=bias)
        return out, torch.autograd.grad(out.sum(), q)[0]

    (o1, g1), (o2, g2), (o3, _) = run(0), run(0), run(1)
    assert torch.equal(o1, o2) and torch.equal(g1, g2)
    assert not torch.equal(o1, o3)
    module.eval()
    plain = act.DotAttention()(q, k, causal=True, bias=bias)
    torch.testing.assert_close(compiled(q, k, causal=True, bias=bias), plain,
                               rtol=1e-6, atol=1e-7)
