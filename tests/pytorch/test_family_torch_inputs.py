"""The input handling of the attention family in the PyTorch adapter
(attention_c.torch): the errors (tensors on another device, bad dtypes,
a mask that requires grad or is not boolean, optional arguments given by
position, the argument convention of the signatures and PyTorch's
signatures of the drop-ins, the kernels' shape errors, alpha modified in
place), and memory and modes (the tensors reach the kernels without a
copy, non-contiguous inputs, no_grad mode).  The gradients, float32
results, modules, loaders and training are in test_family_torch.py, the
shared cases in family_torch_cases.py.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attention_c  # noqa: E402
import attention_c.torch as act  # noqa: E402
from attention_c.testing import rel_err, torch_causal_mask  # noqa: E402
from attention_c.testing import torch_family_problem as make  # noqa: E402

from family_torch_cases import (A, B, H, HQ, KINDS, T,  # noqa: E402
                                ours)


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
