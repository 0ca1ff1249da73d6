"""attention_c.torch.MultiheadAttention against torch.nn.MultiheadAttention
with the same state_dict (issue 20).

Outputs, weights and the gradients of the inputs and of every parameter
over the constructor's and forward's arguments (batch_first, unbatched
inputs, self- and cross-attention, kdim/vdim, bias, add_bias_kv,
add_zero_attn, bool and float key_padding_mask and 2-D/3-D attn_mask, the
is_causal hint, need_weights and average_attn_weights): float64 within
1e-10 of PyTorch, float32 within 2e-5 of PyTorch in float64 on the same
rounded values (normwise).  A fully masked query gives 0 before the output
projection where PyTorch gives NaN with need_weights=True: those rows are
checked apart.  Then the subclass and its state_dict, gradcheck and
gradgradcheck, and bad input.  torch.compile and torch.export, dropout
and decoding with the cache are in test_mha_torch_runtime.py; the helpers
of both in mha_cases.py.
"""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from attention_c.testing import rel_err  # noqa: E402
from attention_c.torch import MultiheadAttention  # noqa: E402

from mha_cases import (  # noqa: E402
    E, HEADS, KDIM, L, N, NEED, S, TOL, VDIM, causal_mask, make_inputs,
    make_masks, pair, pytorch_mask, randn)


def module_kwargs(attention):
    return {"kdim": KDIM, "vdim": VDIM} if attention == "kvdim" else {}


MASK_CASES = ["none", "kpm-bool", "kpm-float", "2d-bool", "2d-float",
              "3d-bool", "3d-float", "causal-bool", "causal-float",
              "kpm-bool+2d-bool", "kpm-float+3d-float",
              "kpm-bool+causal-bool", "kpm-float+causal-float"]


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
