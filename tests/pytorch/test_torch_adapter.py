"""The PyTorch adapter attention_c.torch (skipped when torch is absent).

Gradients are checked with torch.autograd.gradcheck in float64 (masks with
fully masked rows, with and without the bias, both outputs); float32 results
against the plain PyTorch of docs/contract.md section 1
(attention_c.torch._pure, through attention_c.testing) and its autograd
gradients; the errors for non-CPU tensors, a mask that requires grad, bad
dtypes and optional arguments given by position; strided inputs; that
nothing is copied on the way in; and that the nn.Module trains inside a
small model.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attention_c  # noqa: E402
import attention_c.torch as act  # noqa: E402
from attention_c.testing import (  # noqa: E402
    TORCH_LAYER_MASKS, TORCH_LAYER_SIZES, rel_err, torch_context_attention,
    torch_layer_problem)

B, T, H, A = TORCH_LAYER_SIZES


def context(h, W, v, b=None, mask=None):
    """act.context_attention with every argument by position, for
    gradcheck (which passes its inputs so)."""
    return act.context_attention(h, W, v, b=b, mask=mask)


# --------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("mask", list(TORCH_LAYER_MASKS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_gradcheck_float64(bias, mask):
    """gradcheck of both outputs (out and alpha) for h, W, v and b."""
    inputs = torch_layer_problem(torch.float64, bias, mask)
    assert torch.autograd.gradcheck(context, inputs)


def test_gradcheck_some_inputs_only():
    """Only h requires grad, or only the parameters: the others get None."""
    h, W, v, b, m = torch_layer_problem(mask="partial")
    hc = h.detach()
    assert torch.autograd.gradcheck(
        lambda W, v, b: act.context_attention(hc, W, v, b=b, mask=m), (W, v,
                                                                       b))
    Wc, vc, bc = W.detach(), v.detach(), b.detach()
    assert torch.autograd.gradcheck(
        lambda h: act.context_attention(h, Wc, vc, b=bc, mask=m)[0], (h,))


def test_gradcheck_leading_batch_axes():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 2, T, H, dtype=torch.float64, generator=g,
                    requires_grad=True)
    m = torch.rand(2, 2, T, generator=g) < 0.7
    m[0, 1] = False
    _, W, v, b, _ = torch_layer_problem()
    assert torch.autograd.gradcheck(context, (h, W, v, b, m))


@pytest.mark.parametrize("use", ["out", "alpha", "both"])
@pytest.mark.parametrize("mask", list(TORCH_LAYER_MASKS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_float32_equals_pure_pytorch(bias, mask, use):
    """float32 forward and gradients equal the pure-PyTorch float32
    implementation (within float32 rounding); a loss that uses only one
    output exercises the backward with the other gradient None."""
    ours = torch_layer_problem(torch.float32, bias, mask, seed=2)
    theirs = [None if t is None else t.detach().clone().requires_grad_(
        t.requires_grad) for t in ours]
    g = torch.Generator().manual_seed(3)
    Go, Ga = torch.randn(B, H, generator=g), torch.randn(B, T, generator=g)

    def loss(out, alpha):
        terms = {"out": (out * Go).sum(), "alpha": (alpha * Ga).sum()}
        return sum(terms.values()) if use == "both" else terms[use]

    out, alpha = context(*ours)
    h, W, v, b, m = theirs
    r_out, r_alpha = torch_context_attention(h, W, v, b=b, mask=m)
    assert out.dtype == torch.float32 and alpha.dtype == torch.float32
    assert rel_err(out.detach(), r_out.detach()) < 1e-6
    assert rel_err(alpha.detach(), r_alpha.detach()) < 1e-6
    loss(out, alpha).backward()
    loss(r_out, r_alpha).backward()
    for name, a, r in zip("hWvb", ours, theirs):
        if a is None:
            continue
        assert a.grad.dtype == torch.float32
        err = rel_err(a.grad, r.grad)
        assert err < 1e-5, f"d{name}: relative error {err:.3g}"


def test_fully_masked_row_gives_zeros_and_zero_gradients():
    h, W, v, b, m = torch_layer_problem(mask="edge")
    out, alpha = act.context_attention(h, W, v, b=b, mask=m)
    (out.sum() + alpha.sum()).backward()
    assert torch.all(out[1] == 0) and torch.all(alpha[1] == 0)
    assert torch.all(h.grad[1] == 0)
    assert all(torch.isfinite(t.grad).all() for t in (h, W, v, b))


# --------------------------------------------------------------------------
# Errors


def test_non_cpu_tensors_are_refused():
    """A tensor on another device (here 'meta', which every build has; a
    CUDA tensor takes the same path: device.type != 'cpu') raises a clear
    error before any data is touched, for every tensor argument."""
    for i, name in enumerate(["h", "W", "v", "b"]):
        args = list(torch_layer_problem(grad=False))
        args[i] = args[i].to("meta")
        with pytest.raises(ValueError,
                           match=f"CPU only, but {name} is on device 'meta'"):
            context(*args)
    module = act.ContextAttention(H, A).to("meta")
    with pytest.raises(ValueError, match="CPU only.*move the module"):
        module(torch.zeros(B, T, H))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_refused():
    args = list(torch_layer_problem(grad=False))
    args[0] = args[0].cuda()
    with pytest.raises(ValueError, match="CPU only, but h is on device "
                                         "'cuda:0'"):
        context(*args)


def test_mask_that_requires_grad_is_refused():
    h, W, v, b, _ = torch_layer_problem()
    m = torch.ones(B, T, requires_grad=True)
    with pytest.raises(ValueError, match="mask requires grad"):
        act.context_attention(h, W, v, b=b, mask=m)
    with pytest.raises(TypeError, match="mask has dtype torch.float32"):
        act.context_attention(h, W, v, b=b, mask=m.detach())


def test_bad_dtypes_are_refused():
    h, W, v, b, m = torch_layer_problem(grad=False)
    with pytest.raises(TypeError, match="W has dtype torch.float32 but h "
                                        "has torch.float64"):
        act.context_attention(h, W.float(), v, b=b, mask=m)
    # float16 and bfloat16 are accepted now (computed in float32, see
    # test_torch_op.py); an integer or complex dtype is named.
    with pytest.raises(TypeError, match="h has dtype torch.int32; "
                                        "attention_c.torch supports"):
        act.context_attention(h.int(), W.int(), v.int(), b=None, mask=m)
    with pytest.raises(TypeError, match="h has dtype torch.complex128"):
        act.context_attention(h.cdouble(), W.cdouble(), v.cdouble(), b=None,
                              mask=m)
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        act.context_attention(h, W, v.numpy(), b=b, mask=m)
    with pytest.raises(TypeError, match="dtype must be"):
        act.ContextAttention(H, A, dtype=torch.int32)


def test_optional_arguments_are_keyword_only():
    """b and mask of the function, mask and return_weights of the
    module's forward: by position they raise TypeError (a mask read as
    the bias is the silent misreading this prevents); by keyword they
    work."""
    h, W, v, b, m = torch_layer_problem(grad=False)
    with pytest.raises(TypeError, match="takes 3 positional arguments but "
                                        "4 were given"):
        act.context_attention(h, W, v, b)
    with pytest.raises(TypeError, match="takes 3 positional arguments but "
                                        "5 were given"):
        act.context_attention(h, W, v, None, m)
    module = act.ContextAttention(H, A, dtype=torch.float64)
    for extra in [(m,), (None, True)]:
        with pytest.raises(TypeError, match="takes 2 positional arguments"):
            module(h, *extra)
    out, alpha = module(h, mask=m, return_weights=True)
    ref = act.context_attention(h, module.W, module.v, b=module.b, mask=m)
    assert torch.equal(out, ref[0]) and torch.equal(alpha, ref[1])


def test_tensor_requiring_grad_given_to_numpy_points_to_the_adapter():
    """attention_c's NumPy functions refuse a tensor that requires grad
    with a message that names the argument and points to attention_c.torch
    (PyTorch's own says "use tensor.detach()", which silently cuts
    autograd); a tensor without grad is read as an array."""
    h, W, v, b, m = torch_layer_problem(grad=False)
    W = W.clone().requires_grad_()
    with pytest.raises(TypeError, match=r"^W is a torch\.Tensor .*requires "
                       r"grad.*attention_c\.context_attention takes NumPy "
                       r"arrays.*attention_c\.torch.*W\.detach\(\)"
                       r"\.numpy\(\)$"):
        attention_c.context_attention(h, W, v, b=b, mask=m)
    with pytest.raises(TypeError, match=r"^mask is a torch\.Tensor"):
        attention_c.context_attention(h.numpy(), W.detach().numpy(),
                                      v.numpy(), mask=m.float()
                                      .requires_grad_())
    out, _ = attention_c.context_attention(h, W.detach(), v, b=b, mask=m)
    ref, _ = act.context_attention(h, W.detach(), v, b=b, mask=m)
    np.testing.assert_array_equal(out, ref.numpy())


def test_shape_errors_come_from_the_kernels():
    h, W, v, b, m = torch_layer_problem(grad=False)
    with pytest.raises(ValueError, match="mask"):
        act.context_attention(h, W, v, b=b, mask=m[:, :2])


def test_alpha_modified_in_place_is_detected():
    """alpha is saved for the backward; autograd reports its modification."""
    h, W, v, b, m = torch_layer_problem()
    out, alpha = act.context_attention(h, W, v, b=b, mask=m)
    loss = (alpha * 2).sum() + out.sum()
    alpha.mul_(0)
    with pytest.raises(RuntimeError, match="modified by an inplace"):
        loss.backward()


# --------------------------------------------------------------------------
# Memory: strided inputs, no copies


def test_non_contiguous_inputs():
    """Transposed and sliced views give the values and gradients of their
    contiguous copies."""
    h, W, v, b, m = torch_layer_problem(mask="partial")
    h_big = torch.randn(B, H, 2 * T, dtype=torch.float64, requires_grad=True)
    h_view = h_big[:, :, ::2].transpose(1, 2)          # (B, T, H), strided
    W_big = torch.randn(2 * A, 2 * H, dtype=torch.float64,
                        requires_grad=True)
    W_view = W_big[::2]
    assert not h_view.is_contiguous() and not W_view.is_contiguous()
    out, alpha = act.context_attention(h_view, W_view, v, b=b, mask=m)
    h_c, W_c = (h_view.detach().contiguous().requires_grad_(),
                W_view.detach().contiguous().requires_grad_())
    out_c, alpha_c = act.context_attention(h_c, W_c, v, b=b, mask=m)
    assert rel_err(out, out_c) <= 1e-14
    (out.sum() + alpha[:, 0].sum()).backward()
    (out_c.sum() + alpha_c[:, 0].sum()).backward()
    assert rel_err(h_big.grad[:, :, ::2].transpose(1, 2), h_c.grad) <= 1e-14
    assert rel_err(W_big.grad[::2], W_c.grad) <= 1e-14
    assert torch.all(h_big.grad[:, :, 1::2] == 0)
    assert torch.autograd.gradcheck(context, (h_view, W_view, v, b, m))


def test_tensors_reach_the_kernels_without_a_copy(monkeypatch):
    """The arrays given to the C functions are the tensors' own memory,
    and the tensors returned are the C functions' own results."""
    seen = {}
    real_fwd = attention_c.context_attention
    real_bwd = attention_c.context_attention_backward

    def fwd(*args, **kwargs):
        # What the adapter passes by position, then b and mask by keyword.
        seen["fwd_in"] = [*args, kwargs["b"], kwargs["mask"]]
        seen["fwd_out"] = real_fwd(*args, **kwargs)
        return seen["fwd_out"]

    def bwd(*args, **kwargs):
        seen["bwd_in"] = args
        seen["bwd_out"] = real_bwd(*args, **kwargs)
        return seen["bwd_out"]

    monkeypatch.setattr(attention_c, "context_attention", fwd)
    monkeypatch.setattr(attention_c, "context_attention_backward", bwd)
    h, W, v, b, m = torch_layer_problem(mask="partial")
    h_view = h.detach().transpose(0, 1).requires_grad_()   # strided too
    out, alpha = act.context_attention(h_view.transpose(0, 1), W, v, b=b,
                                       mask=m)
    tensors = [h_view.transpose(0, 1), W, v, b, m]
    assert len(seen["fwd_in"]) == len(tensors)
    for t, arr in zip(tensors, seen["fwd_in"]):
        assert arr.__array_interface__["data"][0] == t.data_ptr()
        assert arr.strides == tuple(s * t.element_size() for s in t.stride())
    assert out.data_ptr() == seen["fwd_out"][0].ctypes.data
    assert alpha.data_ptr() == seen["fwd_out"][1].ctypes.data
    grad_out = torch.randn(B, H, dtype=torch.float64)
    out.backward(grad_out)
    assert seen["bwd_in"][0].ctypes.data == grad_out.data_ptr()
    assert W.grad.data_ptr() == seen["bwd_out"].W.ctypes.data


def test_no_grad_mode():
    h, W, v, b, m = torch_layer_problem()
    with torch.no_grad():
        out, alpha = act.context_attention(h, W, v, b=b, mask=m)
    assert not out.requires_grad and not alpha.requires_grad
    out2, _ = act.context_attention(h, W, v, b=b, mask=m)
    assert rel_err(out, out2.detach()) <= 1e-13


# --------------------------------------------------------------------------
# The nn.Module


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_module_parameters_and_init(dtype):
    torch.manual_seed(0)
    module = act.ContextAttention(H, A, dtype=dtype)
    names = dict(module.named_parameters())
    assert list(names) == ["W", "v", "b"]
    assert module.W.shape == (A, 2 * H) and module.W.dtype == dtype
    assert module.W.abs().max() <= 1 / np.sqrt(2 * H)
    assert module.v.abs().max() <= 1 / np.sqrt(A)
    assert "bias=True" in repr(module)
    nob = act.ContextAttention(H, A, bias=False)
    assert list(dict(nob.named_parameters())) == ["W", "v"]
    assert nob.b is None


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_module_from_linear_equals_the_linear_pair(bias):
    """from_linear copies the weights of Linear(2H, A), Linear(A, 1) and
    computes what those layers compute (the scalar bias drops out)."""
    torch.manual_seed(1)
    score = torch.nn.Linear(2 * H, A, bias=bias, dtype=torch.float64)
    out_lin = torch.nn.Linear(A, 1, dtype=torch.float64)
    module = act.ContextAttention.from_linear(score, out_lin)
    h, _, _, _, m = torch_layer_problem(mask="partial", grad=False)
    out, alpha = module(h, mask=m, return_weights=True)
    n = m.sum(-1, keepdim=True).to(h.dtype)
    c = (h * m[..., None]).sum(-2) / n
    s = out_lin(torch.tanh(score(torch.cat(
        [h, c[:, None].expand_as(h)], -1))))[..., 0]
    r_alpha = torch.softmax(s.masked_fill(~m, -torch.inf), -1)
    torch.testing.assert_close(alpha, r_alpha, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(out, (r_alpha[..., None] * h).sum(-2),
                               rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="Linear"):
        act.ContextAttention.from_linear(score, torch.nn.Linear(A, 2))


def test_module_trains_inside_a_model():
    """Swapped into a small model (embedding -> attention pooling ->
    linear), the module trains with a stock optimiser: the loss of a task
    that needs the right item (is token 0 in the bag?) falls."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n, length, vocab = 256, 8, 10
    tokens = torch.randint(1, vocab, (n, length), generator=g)
    y = (torch.rand(n, generator=g) < 0.5)
    pos = torch.randint(0, length, (n,), generator=g)
    tokens[y, pos[y]] = 0
    lengths = torch.randint(3, length + 1, (n,), generator=g)
    lengths[y] = torch.maximum(lengths[y], pos[y] + 1)
    mask = torch.arange(length) < lengths[:, None]

    model = torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(vocab, 16),
        "pool": act.ContextAttention(16, 8),
        "head": torch.nn.Linear(16, 1),
    })
    opt = torch.optim.Adam(model.parameters(), lr=0.03)

    def loss_fn():
        pooled = model["pool"](torch.tanh(model["embed"](tokens)),
                               mask=mask)
        logits = model["head"](pooled)[:, 0]
        return torch.nn.functional.binary_cross_entropy_with_logits(
            logits, y.to(logits.dtype))

    first = loss_fn().item()
    for _ in range(60):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    assert model["pool"].W.grad is not None
    last = loss_fn().item()
    assert last < 0.3 * first, (first, last)
