"""attention_c.torch.flash_attn_func and flash_attn_varlen_func
(FlashAttention-2's API on the CPU, issue 25) against the NumPy reference
(attention_c.reference, docs/contract.md section 8).

Outputs, lse, weights and the gradients of q, k, v, alibi_slopes and
sinks, in float64 (1e-10) and float32 (against float64 on the rounded
inputs), over odd sizes with Tq == T, Tq < T and Tq > T; every variant
(causal, window, softcap, alibi_slopes, sinks) alone and together;
grouped-query and multi-query heads; packed sequences with empty and
unequal ones, with ALiBi slopes a head or a sequence and head; bfloat16
and float16; gradcheck and gradgradcheck; torch.compile(fullgraph=True)
and torch.export; the errors; and that q, k and v reach the kernel where
they are (no copy).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attention_c  # noqa: E402
from attention_c import reference as ref  # noqa: E402
from attention_c.testing import (flash_kw_as_numpy, noise_floor,  # noqa: E402
                                 rel_err)
from attention_c.torch import (flash_attn_func,  # noqa: E402
                               flash_attn_varlen_func)

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
LOW_TOL = {torch.bfloat16: 2 * 2.0 ** -8, torch.float16: 2 * 2.0 ** -11}

# name -> flash_attn keyword arguments (slopes and sinks filled per heads)
VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (3, 1)},
    "window_left": {"window_size": (2, -1), "causal": True},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi_slopes": True},
    "sinks": {"sinks": True},
    "all": {"causal": True, "window_size": (4, -1), "softcap": 2.0,
            "alibi_slopes": True, "sinks": True},
}
SIZES = [(1, 1), (3, 17), (17, 3), (17, 17), (65, 65)]


def randn(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def fill(kw, heads, seed=10, batch=None):
    """The variant's keywords with its slopes and sinks made, float64."""
    kw = dict(kw)
    shape = (heads,) if batch is None else (batch, heads)
    if kw.get("alibi_slopes") is True:
        kw["alibi_slopes"] = randn(*shape, seed=seed).abs() * 0.5
    if kw.get("sinks") is True:
        kw["sinks"] = randn(*shape, seed=seed + 1)
    return kw


def np_kw(kw, G, grouped_axis=-1):
    """flash_attn keywords as the reference's (over query heads)."""
    return flash_kw_as_numpy(kw, np.float64)


def reference(q, k, v, grad, kw):
    """(out, lse, probs, grads) of the NumPy reference in float64, in the
    flash layouts: q (B, Tq, H, d), k and v (B, T, Hk, d), K and V
    repeated over the groups and their gradients summed back."""
    H, Hk = q.shape[2], k.shape[2]
    G = H // Hk
    qn = q.detach().double().permute(0, 2, 1, 3).numpy()
    kn, vn = (np.repeat(x.detach().double().permute(0, 2, 1, 3).numpy(), G,
                        axis=1) for x in (k, v))
    nkw = np_kw(kw, G)
    out, lse = ref.dot_attention(qn, kn, values=vn, return_weights=False,
                                 **nkw)
    _, probs = ref.dot_attention(qn, kn, values=vn, **nkw)
    g = grad.detach().double().permute(0, 2, 1, 3).numpy()
    dq, dk, dv, _, dsl, dsk = ref.dot_attention_backward(
        g, qn, kn, out=out, lse=lse, values=vn, **nkw)
    B, _, T, d = dk.shape
    dk = dk.reshape(B, Hk, G, T, d).sum(2)
    dv = dv.reshape(B, Hk, G, T, -1).sum(2)
    grads = {"q": dq.transpose(0, 2, 1, 3), "k": dk.transpose(0, 2, 1, 3),
             "v": dv.transpose(0, 2, 1, 3), "alibi_slopes": dsl,
             "sinks": dsk}
    return out.transpose(0, 2, 1, 3), lse, probs, grads


def check(got, want, dtype, bound, what, tol=None):
    tol = TOL[dtype] if tol is None else tol
    floor = noise_floor(bound, dtype, tol)
    err = rel_err(got.detach().double(), want, floor)
    assert err <= tol, (what, err)


def run_and_compare(q, k, v, kw, dtype, tol=None):
    """Ours in ``dtype`` against the float64 reference on the rounded
    inputs: out, lse, probs and every gradient."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    kw = {n: (x.detach().to(dtype).requires_grad_()
              if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    grad = randn(*out.shape, seed=99).to(out.dtype)
    want_out, want_lse, want_probs, want_g = reference(q, k, v, grad, kw)
    bound = float(v.detach().double().norm()) + 1
    check(out, want_out, dtype, bound, "out", tol)
    assert lse.dtype in (dtype, torch.float32, torch.float64)
    fin = np.isfinite(want_lse)
    assert (torch.isfinite(lse).numpy() == fin).all()
    check(lse[torch.from_numpy(fin)], want_lse[fin], dtype,
          float(np.abs(want_lse[fin]).sum()) + 1, "lse", tol)
    check(probs, want_probs, dtype, 1.0, "probs", tol)
    out.backward(grad)
    gbound = bound * float(grad.double().norm()) * (
        1 + float(q.detach().double().norm() * k.detach().double().norm()))
    for name, x in [("q", q), ("k", k), ("v", v)] + [
            (n, kw[n]) for n in ("alibi_slopes", "sinks") if n in kw]:
        check(x.grad, want_g[name], dtype, gbound, f"d{name}", tol)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32],
                         ids=["f64", "f32"])
def test_against_reference(size, variant, dtype):
    Tq, T = size
    B, H, d = 2, 3, 5
    q, k, v = (randn(B, Tq, H, d, seed=1), randn(B, T, H, d, seed=2),
               randn(B, T, H, 4, seed=3))
    run_and_compare(q, k, v, fill(VARIANTS[variant], H), dtype)


@pytest.mark.parametrize("heads_k", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("variant", ["plain", "all", "alibi"])
def test_grouped_queries(heads_k, variant):
    """heads = 6 query heads on 2 (or 1) key heads; slopes and sinks per
    query head, also (B, heads)."""
    B, Tq, T, H = 2, 7, 9, 6
    q, k, v = (randn(B, Tq, H, 4, seed=1), randn(B, T, heads_k, 4, seed=2),
               randn(B, T, heads_k, 3, seed=3))
    run_and_compare(q, k, v, fill(VARIANTS[variant], H), torch.float64)
    run_and_compare(q, k, v, fill(VARIANTS[variant], H, batch=B),
                    torch.float64)


def test_signatures_are_flash_attn_2s():
    """FlashAttention-2's arguments, order and defaults (flash_attn
    2.6's flash_attn_interface), and the keyword-only sinks."""
    import inspect
    common = [("dropout_p", 0.0), ("softmax_scale", None),
              ("causal", False), ("window_size", (-1, -1)),
              ("softcap", 0.0), ("alibi_slopes", None),
              ("deterministic", False), ("return_attn_probs", False)]
    for fn, required in (
            (flash_attn_func, ["q", "k", "v"]),
            (flash_attn_varlen_func, ["q", "k", "v", "cu_seqlens_q",
                                      "cu_seqlens_k", "max_seqlen_q",
                                      "max_seqlen_k"])):
        P = inspect.Parameter
        params = [(p.name, p.kind, p.default)
                  for p in inspect.signature(fn).parameters.values()]
        want = ([(n, P.POSITIONAL_OR_KEYWORD, P.empty) for n in required]
                + [(n, P.POSITIONAL_OR_KEYWORD, d) for n, d in common]
                + [("sinks", P.KEYWORD_ONLY, None)])
        assert params == want, fn.__name__


def test_scale_and_defaults():
    q, k, v = (randn(1, 5, 2, 4, seed=s) for s in (1, 2, 3))
    run_and_compare(q, k, v, {"softmax_scale": 0.3}, torch.float64)
    # the defaults are flash_attn's: out only
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 5, 2, 4)
    assert out.is_contiguous()
    assert torch.equal(flash_attn_func(q, k, v, 0.0, None, False, (-1, -1),
                                       0.0, None, False, False), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    """Computed in float32 (sinks too): out, probs and gradients in the
    input dtype, the lse in float32."""
    B, T, H = 2, 9, 2
    q, k, v = (randn(B, T, H, 4, seed=s).to(dtype).requires_grad_()
               for s in (1, 2, 3))
    sinks = randn(H, seed=4).to(dtype).requires_grad_()
    out, lse, probs = flash_attn_func(q, k, v, causal=True, sinks=sinks,
                                      return_attn_probs=True)
    assert out.dtype == dtype and probs.dtype == dtype
    assert lse.dtype == torch.float32
    out.sum().backward()
    assert sinks.grad.dtype == dtype and q.grad.dtype == dtype
    want, _, _, g = reference(q, k, v, torch.ones(out.shape,
                                                  dtype=torch.float64),
                              {"causal": True, "sinks": sinks})
    tol = LOW_TOL[dtype] * 4
    assert rel_err(out.detach().double(), want) <= tol
    assert rel_err(sinks.grad.double(), g["sinks"]) <= tol


def test_bfloat16_is_the_numpy_bfloat16_call():
    """bfloat16 q, k, v reach the kernels as they are (no float32 copy):
    out and the float32 lse are the NumPy call's on the same bfloat16
    data, bit for bit, and so are the gradients of its backward."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v, go = (randn(2, 70, n, 16, seed=s).to(torch.bfloat16)
                   for n, s in ((4, 1), (2, 2), (2, 3), (4, 4)))
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flash_attn_func(*x, causal=True, return_attn_probs=True)
    out.backward(go)

    def arr(t):           # (B, T, heads, d) -> (B, heads_k, G, T, d)
        t = t.detach().transpose(1, 2)
        t = t.reshape(t.shape[0], 2, -1, *t.shape[2:]).contiguous()
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)

    o, ls = attention_c.dot_attention(arr(q), arr(k), values=arr(v),
                                      causal=True, return_weights=False)
    assert lse.dtype == torch.float32
    assert np.array_equal(arr(out), o)
    assert np.array_equal(lse.detach().reshape(ls.shape).numpy(), ls)
    grads = attention_c.dot_attention_backward(
        arr(go), arr(q), arr(k), values=arr(v), out=o, lse=ls, causal=True)
    for t, w in zip(x, grads):        # (keys shared by G = 2 heads)
        assert t.grad.dtype == torch.bfloat16
        assert np.array_equal(arr(t.grad), w)


# --------------------------------------------------------------------------
# Packed sequences

def packed(cu_q, cu_k, H=4, Hk=2, d=3, seed=0):
    cq = torch.tensor(cu_q, dtype=torch.int32)
    ck = torch.tensor(cu_k, dtype=torch.int32)
    q = randn(cu_q[-1], H, d, seed=seed)
    k = randn(cu_k[-1], Hk, d, seed=seed + 1)
    v = randn(cu_k[-1], Hk, d + 1, seed=seed + 2)
    return q, k, v, cq, ck


# sequences with empty queries, empty keys, both, and unequal lengths
CU = {"unequal": ([0, 3, 10, 27], [0, 5, 17, 20]),
      "empty": ([0, 3, 3, 10, 10, 17], [0, 0, 4, 9, 12, 17]),
      "one": ([0, 17], [0, 65])}


@pytest.mark.parametrize("cu", list(CU))
@pytest.mark.parametrize("variant", ["plain", "causal", "window", "all"])
def test_varlen_against_reference(cu, variant):
    """The packed call against the reference with cu_seqlens, and against
    flash_attn_func on each sequence on its own."""
    q, k, v, cq, ck = packed(*CU[cu])
    H, Hk = q.shape[1], k.shape[1]
    kw = fill(VARIANTS[variant], H)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    for x in kw.values():
        if isinstance(x, torch.Tensor):
            x.requires_grad_()
    out, lse, probs = flash_attn_varlen_func(
        q, k, v, cq, ck, 17, 17, return_attn_probs=True, **kw)
    assert out.shape == (q.shape[0], H, v.shape[-1])
    assert lse.shape == (H, q.shape[0])
    assert probs.shape == (H, q.shape[0], k.shape[0])
    G = H // Hk
    nkw = np_kw(kw, G)
    qn = q.detach().permute(1, 0, 2).numpy()
    kn, vn = (np.repeat(x.detach().permute(1, 0, 2).numpy(), G, axis=0)
              for x in (k, v))
    want, want_lse = ref.dot_attention(
        qn, kn, values=vn, return_weights=False, cu_seqlens_q=cq.numpy(),
        cu_seqlens_k=ck.numpy(), **nkw)
    assert rel_err(out.detach().permute(1, 0, 2), want) <= 1e-10
    fin = np.isfinite(want_lse)
    assert (torch.isfinite(lse).numpy() == fin).all()
    assert rel_err(lse.detach()[torch.from_numpy(fin)],
                   want_lse[fin]) <= 1e-10
    # sequence by sequence with flash_attn_func: the same numbers
    grad = randn(*out.shape, seed=7)
    out.backward(grad)
    for s in range(len(cq) - 1):
        a, b = int(cq[s]), int(cq[s + 1])
        c, e = int(ck[s]), int(ck[s + 1])
        if a == b:
            continue
        if c == e:                      # no key: out 0, lse the sink's
            assert not out[a:b].abs().any()
            assert not q.grad[a:b].any()
            continue
        qs, ks, vs = (x.detach()[i:j][None].requires_grad_()
                      for x, i, j in ((q, a, b), (k, c, e), (v, c, e)))
        o = flash_attn_func(qs, ks, vs, **kw)
        assert rel_err(o[0], out.detach()[a:b]) <= 1e-12
        o.backward(grad[a:b][None])
        assert rel_err(qs.grad[0], q.grad[a:b]) <= 1e-10
        p = probs[:, a:b]
        assert not p[..., :c].any() and not p[..., e:].any()


def test_varlen_gradcheck():
    q, k, v, cq, ck = packed([0, 2, 2, 5], [0, 3, 4, 6], H=2, Hk=1, d=2)
    sl = randn(2, seed=5).abs().requires_grad_()
    sk = randn(2, seed=6).requires_grad_()
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def f(q, k, v, sl, sk):
        return flash_attn_varlen_func(q, k, v, cq, ck, 3, 3, causal=True,
                                      window_size=(1, -1), softcap=1.5,
                                      alibi_slopes=sl, sinks=sk)

    assert torch.autograd.gradcheck(f, (q, k, v, sl, sk))
    assert torch.autograd.gradgradcheck(f, (q, k, v, sl, sk))


# --------------------------------------------------------------------------
# Autograd, compile, export

@pytest.mark.parametrize("variant", ["all", "alibi", "sinks", "window"])
def test_gradcheck(variant):
    B, Tq, T, H = 1, 3, 4, 2
    q, k, v = (randn(B, Tq, H, 3, seed=1).requires_grad_(),
               randn(B, T, 1, 3, seed=2).requires_grad_(),
               randn(B, T, 1, 2, seed=3).requires_grad_())
    kw = fill(VARIANTS[variant], H)
    names = [n for n in ("alibi_slopes", "sinks") if n in kw]
    extra = tuple(kw.pop(n).requires_grad_() for n in names)

    def f(q, k, v, *x):
        return flash_attn_func(q, k, v, **kw, **dict(zip(names, x)))

    assert torch.autograd.gradcheck(f, (q, k, v, *extra))
    assert torch.autograd.gradgradcheck(f, (q, k, v, *extra))

    def g(q, k, v, *x):            # the lse and probs: lse differentiable
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True,
                                      **kw, **dict(zip(names, x)))
        return out, lse.masked_fill(lse == float("-inf"), 0)

    assert torch.autograd.gradcheck(g, (q, k, v, *extra))


def test_compile_fullgraph_and_export():
    B, T, H = 2, 5, 4
    q, k, v = (randn(B, T, H, 3, seed=1), randn(B, T, 2, 3, seed=2),
               randn(B, T, 2, 3, seed=3))
    sl, sk = randn(H, seed=4).abs(), randn(H, seed=5)
    q.requires_grad_()

    def f(q, k, v, sl, sk):
        return flash_attn_func(q, k, v, causal=True, window_size=(2, -1),
                               softcap=3.0, alibi_slopes=sl, sinks=sk)

    want = f(q, k, v, sl, sk)
    (gq,) = torch.autograd.grad(want.sum(), q)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(
        q, k, v, sl, sk)
    assert rel_err(got.detach(), want.detach()) <= 1e-14
    (gq2,) = torch.autograd.grad(got.sum(), q)
    assert rel_err(gq2, gq) <= 1e-14

    class M(torch.nn.Module):
        def forward(self, q, k, v, sl, sk):
            return f(q, k, v, sl, sk)

    ep = torch.export.export(M(), (q.detach(), k, v, sl, sk))
    assert rel_err(ep.module()(q.detach(), k, v, sl, sk),
                   want.detach()) <= 1e-14

    cq, ck = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 5])
    qp, kp, vp = q.detach()[0], k[0], v[0]

    def g(q, k, v):
        return flash_attn_varlen_func(q, k, v, cq, ck, 3, 3, causal=True)

    torch._dynamo.reset()
    assert rel_err(torch.compile(g, fullgraph=True, backend="aot_eager")(
        qp, kp, vp), g(qp, kp, vp)) <= 1e-14


# --------------------------------------------------------------------------
# Memory

def test_no_copy_of_q_k_v(monkeypatch):
    """q, k and v reach the kernel as strided views of their memory (GQA
    and varlen too): no transposed or repeated copy."""
    seen = []
    real = attention_c.dot_attention

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_c, "dot_attention", spy)
    q, k, v = (randn(2, 5, 6, 4, seed=1), randn(2, 7, 2, 4, seed=2),
               randn(2, 7, 2, 3, seed=3))
    for call in (lambda: flash_attn_func(q, k, v, causal=True),
                 lambda: flash_attn_varlen_func(
                     q[0], k[0], v[0], torch.tensor([0, 2, 5]),
                     torch.tensor([0, 3, 7]), 3, 4, causal=True)):
        seen.clear()
        with torch.no_grad():
            call()
        (args, kwargs), = seen
        qa, ka, va = args[0], args[1], kwargs["values"]
        for arr, t in ((qa, q), (ka, k), (va, v)):
            assert arr.__array_interface__["data"][0] == t.data_ptr()
        assert qa.ndim == ka.ndim and ka.shape[-3] == 1     # (.., Hk, G, ..)


# --------------------------------------------------------------------------
# Errors

@pytest.mark.parametrize("kw,err,match", [
    ({"window_size": (-2, 0)}, ValueError, "window_size"),
    ({"window_size": (3,)}, ValueError, "window_size"),
    ({"window_size": (1.5, 0)}, TypeError, "window_size"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"alibi_slopes": torch.ones(3)}, ValueError, "alibi_slopes"),
    ({"alibi_slopes": torch.ones(2, 3, 4)}, ValueError, "alibi_slopes"),
    ({"sinks": torch.ones(5)}, ValueError, "sinks"),
    ({"causal": 1}, TypeError, "causal"),
])
def test_bad_input(kw, err, match):
    q, k, v = (randn(2, 5, 4, 3, seed=s) for s in (1, 2, 3))
    with pytest.raises(err, match=match):
        flash_attn_func(q, k, v, **kw)


def test_bad_shapes():
    q = randn(2, 5, 4, 3)
    with pytest.raises(ValueError, match="heads"):
        flash_attn_func(q, randn(2, 5, 3, 3), randn(2, 5, 3, 3))
    with pytest.raises(ValueError, match="q must be"):
        flash_attn_func(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="batch"):
        flash_attn_func(q, q[:1], q[:1])


@pytest.mark.parametrize("cq,ck,err,match", [
    ([0, 2, 1, 5], [0, 1, 2, 5], ValueError, "cu_seqlens_q"),
    ([1, 2, 5], [0, 2, 5], ValueError, "cu_seqlens_q"),
    ([0, 2, 4], [0, 2, 5], ValueError, "cu_seqlens_q"),
    ([0, 2, 5], [0, 5], ValueError, "cu_seqlens"),
    ([0.0, 2.0, 5.0], [0, 2, 5], TypeError, "cu_seqlens_q"),
])
def test_bad_cu_seqlens(cq, ck, err, match):
    q, k, v = (randn(5, 2, 3, seed=s) for s in (1, 2, 3))
    with pytest.raises(err, match=match):
        flash_attn_varlen_func(q, k, v, torch.tensor(cq), torch.tensor(ck),
                               5, 5)


def test_varlen_per_sequence_slopes_bad_shapes():
    """(n, heads) slopes need n = len(cu_seqlens) - 1 rows; per-sequence
    sinks stay refused; the cu_seqlens read here are checked as the
    kernel checks them."""
    q, k, v, cq, ck = packed([0, 2, 5], [0, 2, 5])
    for bad in (torch.ones(3, 4), torch.ones(1, 4), torch.ones(2, 3)):
        with pytest.raises(ValueError, match="alibi_slopes.*2 sequences"):
            flash_attn_varlen_func(q, k, v, cq, ck, 3, 3, alibi_slopes=bad)
    with pytest.raises(ValueError, match="sinks.*per-sequence"):
        flash_attn_varlen_func(q, k, v, cq, ck, 3, 3,
                               sinks=torch.ones(2, 4))
    sl = torch.ones(2, 4)
    for cq2, ck2, err, match in [
            ([0, 2, 1, 5], [0, 1, 2, 5], ValueError, "cu_seqlens_q must "
                                                     "never decrease"),
            ([1, 2, 5], [0, 2, 5], ValueError, "cu_seqlens_q must start"),
            ([0, 2, 5], [0, 2, 4], ValueError, "cu_seqlens_k must end"),
            ([0, 2, 5], [0, 2, 3, 5], ValueError, "same length"),
            ([0.0, 2.0, 5.0], [0, 2, 5], TypeError, "cu_seqlens_q")]:
        with pytest.raises(err, match=match):
            flash_attn_varlen_func(q, k, v, torch.tensor(cq2),
                                   torch.tensor(ck2), 3, 3, alibi_slopes=sl)


def varlen_reference(q, k, v, cq, ck, kw, grad):
    """(out, lse, probs, grads) of the float64 NumPy reference run on each
    packed sequence on its own with its own row of ``alibi_slopes`` (n,
    heads): out (total_q, H, dv), lse (H, total_q), probs (H, total_q,
    total_k), the gradients of q, k, v, alibi_slopes (and sinks)."""
    H, Hk = q.shape[1], k.shape[1]
    G = H // Hk
    sl = kw["alibi_slopes"].detach().double()
    sk = kw.get("sinks")
    qn, kn, vn = (x.detach().double().permute(1, 0, 2).numpy()
                  for x in (q, k, v))
    kn, vn = np.repeat(kn, G, axis=0), np.repeat(vn, G, axis=0)
    gn = grad.detach().double().permute(1, 0, 2).numpy()
    tq, tk = qn.shape[1], kn.shape[1]
    out = np.zeros((H, tq, vn.shape[-1]))
    lse = np.full((H, tq), -np.inf)
    if sk is not None:
        lse[:] = sk.detach().double().numpy()[:, None]
    probs = np.zeros((H, tq, tk))
    dq, dk, dv = np.zeros(qn.shape), np.zeros(kn.shape), np.zeros(vn.shape)
    dsl = np.zeros(tuple(sl.shape))
    dsk = np.zeros(H)
    for s in range(len(cq) - 1):
        a, b, c, e = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        if a == b or c == e:            # no query, or no key: out 0
            continue
        nkw = flash_kw_as_numpy({**kw, "alibi_slopes": sl[s]}, np.float64)
        qs, ks, vs = qn[:, a:b], kn[:, c:e], vn[:, c:e]
        o, ls = ref.dot_attention(qs, ks, values=vs, return_weights=False,
                                  **nkw)
        _, p = ref.dot_attention(qs, ks, values=vs, **nkw)
        out[:, a:b], lse[:, a:b], probs[:, a:b, c:e] = o, ls, p
        gq, gk, gv, _, gsl, gsk = ref.dot_attention_backward(
            gn[:, a:b], qs, ks, out=o, lse=ls, values=vs, **nkw)
        dq[:, a:b] += gq
        dk[:, c:e] += gk
        dv[:, c:e] += gv
        dsl[s] += gsl
        if gsk is not None:
            dsk += gsk
    T = tk
    grads = {"q": dq.transpose(1, 0, 2),
             "k": dk.reshape(Hk, G, T, -1).sum(1).transpose(1, 0, 2),
             "v": dv.reshape(Hk, G, T, -1).sum(1).transpose(1, 0, 2),
             "alibi_slopes": dsl, "sinks": dsk}
    return out.transpose(1, 0, 2), lse, probs, grads


@pytest.mark.parametrize("cu", list(CU))
@pytest.mark.parametrize("variant", ["alibi", "all"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32],
                         ids=["f64", "f32"])
@pytest.mark.parametrize("heads_k", [4, 2], ids=["mha", "gqa"])
def test_varlen_per_sequence_slopes(cu, variant, dtype, heads_k):
    """alibi_slopes (n, heads), one row a packed sequence (FlashAttention-2
    takes them; issue 34 item 5): out, lse, probs and the gradients of q,
    k, v, the slopes (each row its own) and sinks against the float64
    reference run sequence by sequence."""
    q, k, v, cq, ck = packed(*CU[cu], H=4, Hk=heads_k)
    n, H = len(cq) - 1, q.shape[1]
    kw = fill(VARIANTS[variant], H)
    kw["alibi_slopes"] = randn(n, H, seed=12).abs() * 0.5
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    kw = {name: (x.to(dtype).requires_grad_()
                 if isinstance(x, torch.Tensor) else x)
          for name, x in kw.items()}
    out, lse, probs = flash_attn_varlen_func(
        q, k, v, cq, ck, 17, 17, return_attn_probs=True, **kw)
    assert out.shape == (q.shape[0], H, v.shape[-1]) and out.dtype == dtype
    assert lse.shape == (H, q.shape[0])
    assert probs.shape == (H, q.shape[0], k.shape[0])
    grad = randn(*out.shape, seed=7).to(dtype)
    want, want_lse, want_probs, want_g = varlen_reference(q, k, v, cq, ck,
                                                          kw, grad)
    bound = float(v.detach().double().norm()) + 1
    check(out, want, dtype, bound, "out")
    fin = np.isfinite(want_lse)
    assert (torch.isfinite(lse).numpy() == fin).all()
    check(lse[torch.from_numpy(fin)], want_lse[fin], dtype,
          float(np.abs(want_lse[fin]).sum()) + 1, "lse")
    check(probs, want_probs, dtype, 1.0, "probs")
    out.backward(grad)
    gbound = bound * float(grad.double().norm()) * (
        1 + float(q.detach().double().norm() * k.detach().double().norm()))
    for name, x in [("q", q), ("k", k), ("v", v)] + [
            (nm, kw[nm]) for nm in ("alibi_slopes", "sinks") if nm in kw]:
        check(x.grad, want_g[name], dtype, gbound, f"d{name}")
    # a sequence with no query or no key: its row's gradient is 0
    for s in range(n):
        if cq[s] == cq[s + 1] or ck[s] == ck[s + 1]:
            assert not kw["alibi_slopes"].grad[s].any()


def test_varlen_per_sequence_slopes_gradcheck():
    """Finite differences (and second order) through (n, heads) slopes,
    with empty sequences and every variant."""
    q, k, v, cq, ck = packed([0, 2, 2, 5, 6], [0, 3, 4, 4, 6], H=2, Hk=1,
                             d=2)
    sl = randn(4, 2, seed=5).abs().requires_grad_()
    sk = randn(2, seed=6).requires_grad_()
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def f(q, k, v, sl, sk):
        return flash_attn_varlen_func(q, k, v, cq, ck, 3, 3, causal=True,
                                      window_size=(1, -1), softcap=1.5,
                                      alibi_slopes=sl, sinks=sk)

    assert torch.autograd.gradcheck(f, (q, k, v, sl, sk))
    assert torch.autograd.gradgradcheck(f, (q, k, v, sl, sk))


def test_varlen_per_sequence_slopes_calls(monkeypatch):
    """How the call is split: equal rows (no gradient wanted) share one
    call, bitwise the (heads,) call on that row; different rows, or a
    gradient wanted, one call per run of sequences, each on views of q,
    k and v (no copy)."""
    seen = []
    real = attention_c.dot_attention

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_c, "dot_attention", spy)
    q, k, v, cq, ck = packed([0, 3, 3, 10, 17], [0, 5, 9, 9, 12], H=4,
                             Hk=2)
    row = randn(4, seed=3).abs()
    kw = dict(causal=True, softcap=2.0, window_size=(5, -1))
    with torch.no_grad():
        want = flash_attn_varlen_func(q, k, v, cq, ck, 7, 7,
                                      alibi_slopes=row, **kw)
        seen.clear()
        got = flash_attn_varlen_func(q, k, v, cq, ck, 7, 7,
                                     alibi_slopes=row.expand(4, 4), **kw)
        assert len(seen) == 1 and torch.equal(got, want)
        # rows 1 and 2 (no query, no key) use no slope: still one call
        rows = row.repeat(4, 1)
        rows[1:3] = 7.0
        seen.clear()
        got = flash_attn_varlen_func(q, k, v, cq, ck, 7, 7,
                                     alibi_slopes=rows, **kw)
        assert len(seen) == 1 and torch.equal(got, want)
        rows[3] = 2 * row
        seen.clear()
        got = flash_attn_varlen_func(q, k, v, cq, ck, 7, 7,
                                     alibi_slopes=rows, **kw)
        assert len(seen) == 2 and rel_err(got[:10], want[:10]) <= 1e-12
        assert rel_err(got[10:], want[10:]) > 1e-6
        for args, kwargs in seen:
            qa, ka, va = args[0], args[1], kwargs["values"]
            for arr, t in ((qa, q), (ka, k), (va, v)):
                start = arr.__array_interface__["data"][0]
                assert t.data_ptr() <= start < t.data_ptr() + t.nbytes
    # a gradient wanted for the slopes: one call per sequence that uses
    # its row; their gradients sum to that of the (heads,) call
    rows = row.expand(4, 4).clone().requires_grad_()
    one = row.clone().requires_grad_()
    seen.clear()
    got = flash_attn_varlen_func(q, k, v, cq, ck, 7, 7, alibi_slopes=rows,
                                 **kw)
    assert len(seen) == 2
    flash_attn_varlen_func(q, k, v, cq, ck, 7, 7, alibi_slopes=one,
                           **kw).sum().backward()
    got.sum().backward()
    assert rel_err(got.detach(), want) <= 1e-12
    assert not rows.grad[1:3].any()
    assert rel_err(rows.grad.sum(0), one.grad) <= 1e-12
