"""The variants (window, softcap, alibi_slopes, sinks, cu_seqlens_q/k;
docs/contract.md section 8, issue 25) in attention_c.torch's functions,
operators, scaled_dot_product_attention and modules, against the NumPy
reference.

dot_attention and general_attention with each variant and together,
several queries and one query per sequence, weights and lse, float64 and
float32; gradients (incl. alibi_slopes and sinks, summed over broadcast
axes; key_proj) from the C backward, gradcheck and gradgradcheck (double
backward through attention_c.torch._pure); the ops under opcheck (schema,
fake, autograd) and vmap; the SDPA drop-in's keyword-only extras (with
enable_gqa); DotAttention, GeneralAttention and MultiheadAttention
passing them through; the errors.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attention_c.torch as act  # noqa: E402
from attention_c import reference as ref  # noqa: E402
from attention_c.testing import noise_floor, rel_err  # noqa: E402
from attention_c.torch import _pure  # noqa: E402

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def randn(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# (torch keywords); slopes and sinks made per case
VARIANTS = {
    "window": {"window": (2, 1)},
    "window_open": {"window": (None, 0)},
    "causal_window": {"window": (3, None), "causal": True},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi_slopes": (3,)},
    "sinks": {"sinks": (2, 3)},
    "packed": {"cu_seqlens_q": [0, 4, 4, 9], "cu_seqlens_k": [0, 2, 7, 11],
               "causal": True},
    "all": {"window": (4, None), "causal": True, "softcap": 2.0,
            "alibi_slopes": (3,), "sinks": (3,), "bias": True},
}


def make_kw(name, seed=20, dtype=torch.float64):
    kw = dict(VARIANTS[name])
    for n in ("alibi_slopes", "sinks"):
        if n in kw:
            x = randn(*kw[n], seed=seed)
            kw[n] = (x.abs() * 0.4 if n == "alibi_slopes" else x).to(dtype)
            seed += 1
    for n in ("cu_seqlens_q", "cu_seqlens_k"):
        if n in kw:
            kw[n] = torch.tensor(kw[n])
    if kw.pop("bias", False):
        kw["bias"] = randn(9, 11, seed=seed).to(dtype)
    return kw


def as_np(kw):
    return {n: (x.detach().double().numpy() if isinstance(x, torch.Tensor)
                and x.dtype.is_floating_point else
                x.numpy() if isinstance(x, torch.Tensor) else x)
            for n, x in kw.items()}


def check(got, want, dtype, bound, what):
    tol = TOL[dtype]
    err = rel_err(got.detach().double(), want, noise_floor(bound, dtype, tol))
    assert err <= tol, (what, err)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", ["dot", "general"])
@pytest.mark.parametrize("weights", [True, False], ids=["alpha", "lse"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32],
                         ids=["f64", "f32"])
def test_functions_against_reference(variant, kind, weights, dtype):
    """out, alpha or lse, and the gradients of every input."""
    q = randn(2, 3, 9, 4, seed=1, dtype=dtype).requires_grad_()
    k = randn(2, 3, 11, 5 if kind == "general" else 4, seed=2,
              dtype=dtype).requires_grad_()
    v = randn(2, 3, 11, 3, seed=3, dtype=dtype).requires_grad_()
    W = randn(4, 5, seed=4, dtype=dtype).requires_grad_()
    kw = make_kw(variant, dtype=dtype)
    for n in ("alibi_slopes", "sinks", "bias"):
        if n in kw:
            kw[n].requires_grad_()
    nkw = as_np(kw)
    qn, kn, vn, Wn = (x.detach().double().numpy() for x in (q, k, v, W))
    if kind == "dot":
        out, second = act.dot_attention(q, k, values=v,
                                        return_weights=weights, **kw)
        want = ref.dot_attention(qn, kn, values=vn, return_weights=weights,
                                 **nkw)
        _, lse = ref.dot_attention(qn, kn, values=vn, return_weights=False,
                                   **nkw)
    else:
        out, second = act.general_attention(q, k, W, values=v,
                                            return_weights=weights, **kw)
        want = ref.general_attention(qn, kn, Wn, values=vn,
                                     return_weights=weights, **nkw)
        _, lse = ref.general_attention(qn, kn, Wn, values=vn,
                                       return_weights=False, **nkw)
    check(out, want[0], dtype, float(np.linalg.norm(vn)), "out")
    fin = np.isfinite(want[1])
    assert (torch.isfinite(second).numpy() == fin).all()
    check(second[torch.from_numpy(fin)], want[1][fin], dtype,
          float(np.abs(want[1][fin]).sum()) + 1, "second")
    g = randn(*out.shape, seed=9, dtype=dtype)
    out.backward(g)
    gn = g.double().numpy()
    if kind == "dot":
        dq, dk, dv, db, dsl, dsk = ref.dot_attention_backward(
            gn, qn, kn, out=want[0], lse=lse, values=vn, **nkw)
        grads = dict(zip(["q", "k", "v", "bias", "alibi_slopes", "sinks"],
                         [dq, dk, dv, db, dsl, dsk]))
    else:
        dq, dk, dv, dW, db, dsl, dsk = ref.general_attention_backward(
            gn, qn, kn, Wn, out=want[0], lse=lse, values=vn, **nkw)
        grads = dict(zip(["q", "k", "v", "W", "bias", "alibi_slopes",
                          "sinks"], [dq, dk, dv, dW, db, dsl, dsk]))
    tensors = {"q": q, "k": k, "v": v, "W": W, **kw}
    bound = (float(np.linalg.norm(gn)) * (1 + float(np.linalg.norm(vn)))
             * (1 + float(np.linalg.norm(qn) * np.linalg.norm(kn))))
    for name, want_g in grads.items():
        if want_g is None:
            continue
        check(tensors[name].grad, want_g, dtype, bound, f"d{name}")


@pytest.mark.parametrize("kind", ["dot", "general"])
def test_single_query(kind):
    """One query per sequence: softcap, alibi (i' = T - 1) and sinks
    apply; window and cu_seqlens are refused."""
    q = randn(2, 3, 4, seed=1)
    k = randn(2, 3, 7, 4, seed=2)
    W = randn(4, 4, seed=3)
    sl, sk = randn(3, seed=4).abs(), randn(3, seed=5)
    kw = dict(softcap=1.2, alibi_slopes=sl, sinks=sk)
    args = (q, k) if kind == "dot" else (q, k, W)
    fn = getattr(act, f"{kind}_attention")
    rfn = getattr(ref, f"{kind}_attention")
    out, lse = fn(*args, return_weights=False, **kw)
    want = rfn(*(x.numpy() for x in args), return_weights=False,
               **as_np(kw))
    assert rel_err(out, want[0]) <= 1e-12
    assert rel_err(lse, want[1]) <= 1e-12
    for bad in ({"window": (1, 1)},
                {"cu_seqlens_q": torch.tensor([0, 1]),
                 "cu_seqlens_k": torch.tensor([0, 7])}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            fn(*args, **bad)


@pytest.mark.parametrize("kind", ["dot", "general"])
@pytest.mark.parametrize("weights", [True, False], ids=["alpha", "lse"])
def test_gradcheck_gradgradcheck(kind, weights):
    """First order from the C backward, second through _pure (slopes and
    sinks broadcast: summed back to (3,) and (1, 3))."""
    q = randn(2, 3, 4, 3, seed=1).requires_grad_()
    k = randn(1, 3, 5, 3, seed=2).requires_grad_()
    W = randn(3, 3, seed=3).requires_grad_()
    sl = (randn(3, seed=4).abs() * 0.5).requires_grad_()
    sk = randn(1, 3, seed=5).requires_grad_()
    cu = dict(cu_seqlens_q=torch.tensor([0, 1, 4]),
              cu_seqlens_k=torch.tensor([0, 2, 5]))

    def f(q, k, W, sl, sk):
        kw = dict(window=(1, None), causal=True, softcap=1.5,
                  alibi_slopes=sl, sinks=sk, return_weights=weights, **cu)
        if kind == "dot":
            return act.dot_attention(q, k, **kw)
        return act.general_attention(q, k, W, **kw)

    inputs = (q, k, W, sl, sk)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def test_key_proj_with_variants():
    """general_attention with key_proj that requires grad (the gradient
    stops there): the same gradients as without key_proj."""
    q = randn(2, 5, 3, seed=1).requires_grad_()
    k = randn(2, 6, 4, seed=2).requires_grad_()
    W = randn(3, 4, seed=3).requires_grad_()
    sl, sk = (randn(2, seed=4).abs().requires_grad_(),
              randn(1, seed=5).requires_grad_())
    kw = dict(window=(2, 2), softcap=3.0, alibi_slopes=sl, sinks=sk,
              return_weights=False)
    out, _ = act.general_attention(q, k, W, **kw)
    g1 = torch.autograd.grad(out.sum(), (q, k, W, sl, sk))
    out2, _ = act.general_attention(q, k, W, key_proj=act.project_keys(k, W),
                                    **kw)
    g2 = torch.autograd.grad(out2.sum(), (q, k, W, sl, sk))
    for a, b in zip(g1, g2):
        assert rel_err(a, b) <= 1e-12


def test_pure_matches_reference():
    """The pure-PyTorch transcription (double backward) is the contract's
    forward with every variant."""
    q, k = randn(2, 9, 4, seed=1), randn(2, 11, 4, seed=2)
    kw = make_kw("all")
    kw["cu_seqlens_q"] = torch.tensor([0, 5, 9])
    kw["cu_seqlens_k"] = torch.tensor([0, 4, 11])
    kw["alibi_slopes"] = kw["alibi_slopes"][:2]
    kw["sinks"] = kw["sinks"][:2]
    for weights in (True, False):
        got = _pure.family_attention("dot", q, k, weights=weights, **kw)
        want = ref.dot_attention(q.numpy(), k.numpy(),
                                 return_weights=weights, **as_np(kw))
        assert rel_err(got[0], want[0]) <= 1e-12
        fin = np.isfinite(want[1])
        assert rel_err(got[1][torch.from_numpy(fin)], want[1][fin]) <= 1e-12


def test_sinks_with_weights_and_grad_alpha():
    """With sinks and return_weights=True the backward recomputes the lse
    (C), and a gradient of alpha goes through the pure path: both match
    the reference's gradient of the same loss."""
    q = randn(3, 5, 4, seed=1).requires_grad_()
    sk = randn(3, seed=2).requires_grad_()
    out, alpha = act.dot_attention(q, q, sinks=sk, causal=True)
    assert torch.all(alpha.sum(-1) < 1)
    (out.sum() + (alpha ** 2).sum()).backward()
    q2 = q.detach().clone().requires_grad_()
    sk2 = sk.detach().clone().requires_grad_()
    o2, a2 = _pure.family_attention("dot", q2, q2, sinks=sk2, causal=True)
    (o2.sum() + (a2 ** 2).sum()).backward()
    assert rel_err(q.grad, q2.grad) <= 1e-12
    assert rel_err(sk.grad, sk2.grad) <= 1e-12


def test_opcheck():
    """The ops' schemas, fakes and autograd registrations with the
    variants (torch.library.opcheck)."""
    q = randn(2, 5, 3, seed=1).requires_grad_()
    k = randn(2, 6, 3, seed=2).requires_grad_()
    sl = randn(2, seed=3).abs().requires_grad_()
    sk = randn(1, seed=4).requires_grad_()
    cq, ck = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 6])
    for weights in (True, False):
        torch.library.opcheck(
            torch.ops.attention_c.dot_attention.default,
            (q, k, None, None, True, None, 0.0, None, None, 0.7, weights,
             [1, -1], 2.0, sl, sk, cq, ck))
    W = randn(3, 3, seed=5).requires_grad_()
    torch.library.opcheck(
        torch.ops.attention_c.general_attention.default,
        (q, k, W, None, None, False, None, 0.0, None, None, None, False,
         [2, 0], None, sl, sk, None, None))


def test_vmap_and_meta():
    q, k = randn(4, 2, 5, 3, seed=1), randn(2, 6, 3, seed=2)
    sl, sk = randn(2, seed=3).abs(), randn(2, seed=4)
    kw = dict(window=(2, None), softcap=2.0, alibi_slopes=sl, sinks=sk,
              return_weights=False)

    def f(q):
        return act.dot_attention(q, k, **kw)[0]

    got = torch.func.vmap(f)(q)
    want = act.dot_attention(q, k[None].expand(4, 2, 6, 3), **kw)[0]
    assert rel_err(got, want) <= 1e-14
    # per-example gradients of a batched query (the backward op's loop)
    gq = torch.func.vmap(torch.func.grad(lambda q: f(q).sum()))(q)
    qq = q.clone().requires_grad_()
    (gw,) = torch.autograd.grad(
        act.dot_attention(qq, k[None].expand(4, 2, 6, 3), **kw)[0].sum(), qq)
    assert rel_err(gq, gw) <= 1e-12
    m = act.dot_attention(q.to("meta"), k[None].to("meta"),
                          window=(2, None), softcap=2.0,
                          alibi_slopes=sl.to("meta"), sinks=sk.to("meta"),
                          cu_seqlens_q=torch.tensor([0, 5], device="meta"),
                          cu_seqlens_k=torch.tensor([0, 6], device="meta"),
                          return_weights=False)
    assert m[0].shape == (4, 2, 5, 3) and m[1].shape == (4, 2, 5)


def test_compile_and_export():
    q = randn(2, 3, 5, 4, seed=1).requires_grad_()
    sl, sk = randn(3, seed=3).abs(), randn(3, seed=4)
    cq, ck = torch.tensor([0, 2, 5]), torch.tensor([0, 2, 5])

    def f(q, sl, sk):
        return act.dot_attention(q, q, window=(1, None), causal=True,
                                 softcap=2.0, alibi_slopes=sl, sinks=sk,
                                 cu_seqlens_q=cq, cu_seqlens_k=ck,
                                 return_weights=False)[0]

    want = f(q, sl, sk)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, sl, sk)
    assert rel_err(got.detach(), want.detach()) <= 1e-14
    assert rel_err(torch.autograd.grad(got.sum(), q)[0],
                   torch.autograd.grad(want.sum(), q)[0]) <= 1e-14

    class M(torch.nn.Module):
        def forward(self, q, sl, sk):
            return f(q, sl, sk)

    ep = torch.export.export(M(), (q.detach(), sl, sk))
    assert rel_err(ep.module()(q.detach(), sl, sk), want.detach()) <= 1e-14


# --------------------------------------------------------------------------
# Errors

@pytest.mark.parametrize("kw,err,match", [
    ({"window": (-1, 0)}, ValueError, "window"),
    ({"window": 3}, ValueError, "window"),
    ({"window": (1.0, 0)}, TypeError, "window"),
    ({"softcap": 0.0}, ValueError, "softcap"),
    ({"softcap": -2.0}, ValueError, "softcap"),
    ({"softcap": float("nan")}, ValueError, "softcap"),
    ({"alibi_slopes": torch.ones(4)}, ValueError, "alibi_slopes"),
    ({"sinks": torch.ones(3, 2)}, ValueError, "sinks"),
    ({"sinks": torch.ones(2, dtype=torch.int64)}, TypeError, "sinks"),
    ({"cu_seqlens_q": torch.tensor([0, 5])}, ValueError, "cu_seqlens"),
    ({"cu_seqlens_q": torch.tensor([0, 3, 2, 5]),
      "cu_seqlens_k": torch.tensor([0, 1, 2, 6])}, ValueError,
     "cu_seqlens_q"),
    ({"cu_seqlens_q": torch.tensor([0, 5]),
      "cu_seqlens_k": torch.tensor([0, 5])}, ValueError, "cu_seqlens_k"),
    ({"cu_seqlens_q": torch.tensor([0.0, 5.0]),
      "cu_seqlens_k": torch.tensor([0, 6])}, TypeError, "cu_seqlens_q"),
])
def test_bad_input(kw, err, match):
    q, k = randn(2, 5, 3, seed=1), randn(2, 6, 3, seed=2)
    with pytest.raises(err, match=match):
        act.dot_attention(q, k, **kw)


# --------------------------------------------------------------------------
# scaled_dot_product_attention's extras, the modules

@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("grad", [False, True], ids=["infer", "grad"])
def test_sdpa_extras(gqa, grad):
    """window, softcap, alibi_slopes (Hq,) and sinks (Hq,) on (B, Hq, L,
    E) against the reference with K and V repeated; the fast path
    (inference) and the operator path (grad) alike."""
    Hk = 2 if gqa else 4
    q = randn(2, 4, 7, 5, seed=1).requires_grad_(grad)
    k, v = randn(2, Hk, 9, 5, seed=2), randn(2, Hk, 9, 3, seed=3)
    sl, sk = randn(4, seed=4).abs(), randn(4, seed=5)
    kw = dict(window=(3, 0), softcap=2.0, alibi_slopes=sl, sinks=sk)
    out = act.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kw)
    G = 4 // Hk
    want, _ = ref.dot_attention(
        q.detach().numpy(), np.repeat(k.numpy(), G, 1),
        values=np.repeat(v.numpy(), G, 1), **as_np(kw))
    assert rel_err(out.detach(), want) <= 1e-12


def test_dot_module_passes_variants():
    m = act.DotAttention(scale=0.5)
    q = randn(2, 3, 6, 4, seed=1)
    kw = make_kw("all")
    kw["bias"] = kw["bias"][:6, :6]
    out = m(q, q, **kw)
    want, _ = act.dot_attention(q, q, scale=0.5, return_weights=False, **kw)
    assert torch.equal(out, want)
    g = act.GeneralAttention(4, 4, dtype=torch.float64)
    out = g(q, q, window=(1, 1), softcap=3.0)
    want, _ = act.general_attention(q, q, g.W, window=(1, 1), softcap=3.0,
                                    return_weights=False)
    assert torch.equal(out, want)


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_variants(batch_first):
    """MultiheadAttention(window=, alibi_slopes=) against
    nn.MultiheadAttention with the equivalent float attn_mask (N * h, L,
    S); sinks and softcap against the functional call on the same
    heads; the weights asked for are the kernel's."""
    torch.manual_seed(0)
    E, h, N, L = 8, 2, 3, 6
    theirs = torch.nn.MultiheadAttention(E, h, batch_first=batch_first,
                                         dtype=torch.float64)
    ours = act.MultiheadAttention(E, h, batch_first=batch_first,
                                  dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    x = randn(N, L, E, seed=1) if batch_first else randn(L, N, E, seed=1)
    sl = randn(h, seed=2).abs()
    i = torch.arange(L)
    rel = (i[None, :] - i[:, None]).double()
    bias = -sl[:, None, None] * rel.abs()
    bias = bias.masked_fill((rel < -2) | (rel > 1), float("-inf"))
    mask = bias.repeat(N, 1, 1)                      # (N * h, L, S)
    want, want_w = theirs(x, x, x, attn_mask=mask, average_attn_weights=False)
    got, got_w = ours(x, x, x, window=(2, 1), alibi_slopes=sl,
                      average_attn_weights=False)
    assert rel_err(got.detach(), want.detach()) <= 1e-12
    assert rel_err(got_w.detach(), want_w.detach()) <= 1e-12
    # sinks: the weights sum to less than 1, differentiable
    sinks = randn(h, seed=3).requires_grad_()
    out, w = ours(x, x, x, sinks=sinks, softcap=2.0)
    assert torch.all(w.sum(-1) < 1)
    out.sum().backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()
    with torch.no_grad():
        fast, _ = ours(x, x, x, sinks=sinks, softcap=2.0, need_weights=False)
    assert rel_err(fast, out.detach()) <= 1e-12


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16],
                         ids=["bf16", "f16"])
@pytest.mark.parametrize("extra", ["alibi_slopes", "sinks", "bias"])
@pytest.mark.parametrize("extra_dtype", ["same", "float32"])
def test_low_precision_with_variants(low, extra, extra_dtype):
    """A bfloat16 or float16 call with ALiBi slopes, sinks or a bias, in
    its own dtype or in float32 (lossless: the call computes in float32),
    is the float32 call on the same values, rounded to its dtype; each
    gradient comes back in its input's dtype.  (Slopes and sinks of a
    16-bit call once reached the kernels in 16 bits: "unsupported
    ScalarType"; a float32 bias was refused.)"""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g).to(low)
               for _ in range(3))
    x = {"alibi_slopes": torch.rand(4, generator=g),
         "sinks": torch.randn(4, generator=g),
         "bias": torch.randn(9, 9, generator=g)}[extra]
    x = x.to(low) if extra_dtype == "same" else x
    leaves = [t.clone().requires_grad_() for t in (q, k, v, x)]
    out, alpha = act.dot_attention(leaves[0], leaves[1], values=leaves[2],
                                   causal=True, **{extra: leaves[3]})
    want, want_alpha = act.dot_attention(q.float(), k.float(),
                                         values=v.float(),
                                         causal=True, **{extra: x.float()})
    assert out.dtype == low and torch.equal(out, want.to(low))
    assert torch.equal(alpha, want_alpha.to(low))
    out.float().sum().backward()
    for t in leaves:
        assert t.grad is not None and t.grad.dtype == t.dtype
        assert torch.isfinite(t.grad.float()).all()
