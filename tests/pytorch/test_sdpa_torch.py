"""attention_c.torch.scaled_dot_product_attention against
torch.nn.functional.scaled_dot_product_attention (issue 20).

Outputs and the gradients of query, key, value and of a float attn_mask
that requires grad, on 2-D to 5-D inputs with broadcast leading axes;
boolean (True = take part) and float masks of every broadcastable shape,
-inf entries and fully masked rows (0 in both); top-left is_causal with
L == S and L != S; scale; enable_gqa; odd sizes; float32 against the float64
reference and float64 against float64; bfloat16/float16 in and out;
dropout (reproducible under torch.manual_seed, unbiased, the same bits in
the backward); gradcheck and gradgradcheck; torch.compile(fullgraph=True)
and torch.export; and SDPA's errors.
"""

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from attention_c.testing import noise_floor, rel_err  # noqa: E402
from attention_c.torch import scaled_dot_product_attention as sdpa  # noqa

# Normwise relative error allowed against PyTorch evaluated in float64 on
# the same (rounded) inputs, per computing dtype (issue 20).
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}

# bfloat16/float16 are computed in float32 and rounded once: twice the
# unit roundoff of the format (as tests/pytorch/test_torch_op.py).
LOW_TOL = {torch.bfloat16: 2 * 2.0 ** -8, torch.float16: 2 * 2.0 ** -11}

NEG_INF = float("-inf")


def randn(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def problem(q_shape, k_shape, v_shape=None, *, seed=0):
    """Random float64 query, key and value (value like key if no shape)."""
    v_shape = k_shape if v_shape is None else v_shape
    return (randn(*q_shape, seed=seed), randn(*k_shape, seed=seed + 1),
            randn(*v_shape, seed=seed + 2))


def compare(query, key, value, dtype=torch.float64, attn_mask=None,
            mask_grad=False, **kwargs):
    """Run ours in dtype and F.scaled_dot_product_attention in float64 on
    the same rounded inputs; assert the output and the gradients (of
    query, key, value and of a float attn_mask if mask_grad) agree within
    TOL[dtype], and return our output (in float64) for further checks."""
    tensors = [query, key, value]
    if mask_grad:
        tensors.append(attn_mask)
    rounded = [x.detach().to(dtype) for x in tensors]
    ref_in = [x.double().clone().requires_grad_() for x in rounded]
    our_in = [x.clone().requires_grad_() for x in rounded]
    ref_mask = ref_in[3] if mask_grad else attn_mask
    our_mask = our_in[3] if mask_grad else attn_mask
    if attn_mask is not None and attn_mask.is_floating_point():
        if not mask_grad:
            our_mask = attn_mask.to(dtype)
            ref_mask = our_mask.double()

    want = F.scaled_dot_product_attention(*ref_in[:3], attn_mask=ref_mask,
                                          **kwargs)
    got = sdpa(*our_in[:3], attn_mask=our_mask, **kwargs)
    assert got.dtype == dtype and got.shape == want.shape
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"out: {err:.3g}"

    grad_out = randn(*want.shape, seed=99)
    (want * grad_out).sum().backward()
    (got * grad_out.to(dtype)).sum().backward()
    floors = grad_floors(*ref_in[:3], grad_out, want.detach(), dtype,
                         ref_mask, **kwargs)
    for name, ours, ref in zip(["query", "key", "value", "attn_mask"],
                               our_in, ref_in):
        assert torch.isfinite(ref.grad).all(), name
        assert ours.grad is not None, name
        assert ours.grad.dtype == dtype, name
        err = rel_err(ours.grad, ref.grad, floors[name])
        assert err <= TOL[dtype], f"grad of {name}: {err:.3g}"
    return got.detach().double()


def grad_floors(query, key, value, grad_out, want, dtype, attn_mask=None,
                **kwargs):
    """rel_err floors of the gradients, by name (testing.noise_floor).

    The scores' gradient ds_it = alpha_it (g_i . v_t - g_i . out_i) is 0
    in exact arithmetic for a query with one visible key (L = S = 1, the
    first row under is_causal): PyTorch returns rounding noise there
    (3.8e-18 on an AVX-512 host), ours 0.  So ds, dquery = c ds k and dkey
    = c ds^T q are measured against the size of their terms without
    cancellation, |ds|_it <= alpha_it (|g_i . v_t| + |g_i . out_i|); alpha
    is PyTorch's, as the output for the values eye(S).  dvalue = alpha^T g
    does not cancel."""
    with torch.no_grad():
        S, E = key.shape[-2], query.shape[-1]
        c = kwargs.get("scale") or 1 / math.sqrt(E)
        eye = torch.eye(S, dtype=value.dtype).expand(
            *value.shape[:-2], S, S)
        alpha = F.scaled_dot_product_attention(query, key, eye,
                                               attn_mask=attn_mask, **kwargs)
        if kwargs.get("enable_gqa"):
            groups = query.shape[-3] // value.shape[-3]
            value = value.repeat_interleave(groups, dim=-3)
        delta = (grad_out * want).sum(-1, keepdim=True)
        ds = alpha * ((grad_out @ value.transpose(-1, -2)).abs()
                      + delta.abs())
        rows = {name: float(x.norm(dim=-1).max())
                for name, x in [("query", query), ("key", key)]}
        bound = float(ds.norm())
    bounds = {"query": c * bound * rows["key"],
              "key": c * bound * rows["query"],
              "value": 0.0, "attn_mask": bound}
    return {name: noise_floor(b, dtype, TOL[dtype])
            for name, b in bounds.items()}


DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ["f64", "f32"]


# --------------------------------------------------------------------------
# Shapes, broadcasting, sizes


SHAPES = {
    "2d": ((5, 8), (7, 8), (7, 6)),
    "3d": ((3, 5, 8), (3, 7, 8), (3, 7, 6)),
    "4d": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6)),
    "5d": ((2, 3, 2, 5, 8), (2, 3, 2, 7, 8), (2, 3, 2, 7, 6)),
    "bcast-q": ((2, 1, 5, 8), (1, 3, 7, 8), (1, 3, 7, 6)),
    "bcast-kv": ((2, 3, 5, 8), (2, 1, 7, 8), (2, 1, 7, 6)),
    "bcast-rank": ((2, 3, 5, 8), (3, 7, 8), (3, 7, 6)),
    "bcast-5d": ((2, 1, 3, 5, 8), (1, 4, 1, 7, 8), (1, 4, 1, 7, 6)),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_and_broadcasting(shape, dtype, causal):
    """Any number of leading axes, broadcast between query and key/value
    like F.scaled_dot_product_attention; value's last size may differ."""
    compare(*problem(*SHAPES[shape]), dtype, is_causal=causal)


SIZES = [1, 3, 17, 65]


@pytest.mark.parametrize("E", [1, 3, 8])
@pytest.mark.parametrize("S", SIZES)
@pytest.mark.parametrize("L", SIZES)
def test_odd_sizes(L, S, E):
    """Every L and S of 1, 3, 17, 65 and head sizes 1, 3, 8, without a
    mask and with top-left is_causal (L != S included), in float64; and
    in float32 for the largest."""
    q, k, v = problem((2, 2, L, E), (2, 2, S, E), (2, 2, S, 3), seed=L + S)
    compare(q, k, v)
    compare(q, k, v, is_causal=True)
    if max(L, S) == 65:
        compare(q, k, v, torch.float32, is_causal=True)


@pytest.mark.parametrize("L,S", [(3, 5), (5, 3), (1, 4), (4, 1), (6, 6)])
def test_causal_is_top_left(L, S):
    """is_causal=True masks key j > i for query i whatever L and S (the
    top-left alignment of SDPA, not the bottom-right of a decoder cache):
    ours equals ours with the explicit tril(ones(L, S)) boolean mask."""
    q, k, v = problem((2, L, 4), (2, S, 4), (2, S, 3))
    tril = torch.ones(L, S, dtype=torch.bool).tril()
    causal = compare(q, k, v, is_causal=True)
    explicit = compare(q, k, v, attn_mask=tril)
    assert rel_err(causal, explicit) <= 1e-14


# --------------------------------------------------------------------------
# Masks


N, H, L_, S_, E_ = 2, 3, 5, 7, 4

MASK_SHAPES = {"LS": (L_, S_), "11LS": (1, 1, L_, S_), "N1LS": (N, 1, L_, S_),
               "NHLS": (N, H, L_, S_), "1HLS": (1, H, L_, S_),
               "N11S": (N, 1, 1, S_)}


def make_mask(shape, kind, *, seed=5, full_row=False):
    """A bool (True = take part) or float mask with -inf entries; every row
    keeps a visible key unless full_row, which masks query row 1 of every
    (broadcast) entry entirely."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(*shape, generator=g) < 0.6
    keep[..., 0] = True
    if full_row and shape[-2] > 1:
        keep[..., 1, :] = False
    if kind == "bool":
        return keep
    bias = torch.randn(*shape, generator=g, dtype=torch.float64)
    return bias.masked_fill(~keep, NEG_INF)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float", "float-grad"])
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
def test_masks(shape, kind, dtype):
    """Boolean and float masks broadcastable to (N, H, L, S); a float mask
    requiring grad gets SDPA's gradient (summed over broadcast axes)."""
    q, k, v = problem((N, H, L_, E_), (N, H, S_, E_), (N, H, S_, 3))
    mask = make_mask(MASK_SHAPES[shape], kind.split("-")[0])
    compare(q, k, v, dtype, attn_mask=mask, mask_grad=kind == "float-grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float", "float-grad"])
@pytest.mark.parametrize("shape", ["LS", "N1LS", "NHLS"])
def test_fully_masked_rows_are_zero(shape, kind, dtype):
    """A query with no visible key gives 0 (PyTorch 2.13's SDPA too: the
    whole output and the gradients are compared, and the row is exactly
    0 in ours)."""
    q, k, v = problem((N, H, L_, E_), (N, H, S_, E_), (N, H, S_, 3))
    mask = make_mask(MASK_SHAPES[shape], kind.split("-")[0], full_row=True)
    out = compare(q, k, v, dtype, attn_mask=mask,
                  mask_grad=kind == "float-grad")
    assert (out[..., 1, :] == 0).all()
    assert (out[..., 0, :] != 0).any()


def test_bool_mask_true_takes_part():
    """A bool mask keeping a single key per query selects that key's value
    (True = take part, the opposite of nn.MultiheadAttention)."""
    q, k, v = problem((2, 4, 3), (2, 6, 3), (2, 6, 5))
    pick = torch.tensor([2, 0, 5, 5])
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[torch.arange(4), pick] = True
    out = sdpa(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, v[:, pick], rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale", [0.3, 2.0, 1e-3])
def test_scale(scale, dtype):
    q, k, v = problem((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 3))
    compare(q, k, v, dtype, scale=scale)
    compare(q, k, v, dtype, scale=scale, is_causal=True)
    compare(q, k, v, dtype, scale=scale,
            attn_mask=make_mask((5, 7), "float"), mask_grad=True)


# --------------------------------------------------------------------------
# Grouped-query attention


GQA = {"6-2": ((2, 6, 5, 4), (2, 2, 7, 4)),
       "6-3": ((2, 6, 5, 4), (2, 3, 7, 4)),
       "4-1": ((2, 4, 5, 4), (2, 1, 7, 4)),
       "3d-4-2": ((4, 5, 4), (2, 7, 4)),
       "5d-6-2": ((2, 2, 6, 5, 4), (2, 2, 2, 7, 4)),
       "3-3": ((2, 3, 5, 4), (2, 3, 7, 4))}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", list(GQA))
def test_enable_gqa(heads, dtype, causal):
    """enable_gqa: each group of Hq / Hkv query heads shares a key/value
    head (repeat_interleave on axis -3)."""
    qs, ks = GQA[heads]
    vs = ks[:-1] + (3,)
    mask = None if causal else make_mask((5, 7), "bool")
    compare(*problem(qs, ks, vs), dtype, attn_mask=mask, is_causal=causal,
            enable_gqa=True)


# --------------------------------------------------------------------------
# Reduced precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_in_and_out(dtype):
    """bfloat16/float16 inputs give their dtype back, computed in float32:
    within twice the unit roundoff of SDPA on the same rounded inputs in
    float64; the gradients are in the dtype too."""
    q, k, v = (x.to(dtype).requires_grad_() for x in
               problem((2, 3, 5, 8), (2, 3, 17, 8), (2, 3, 17, 8)))
    mask = make_mask((5, 17), "float").to(dtype)
    out = sdpa(q, k, v, attn_mask=mask)
    assert out.dtype == dtype
    want = F.scaled_dot_product_attention(
        *(x.detach().double() for x in (q, k, v)), attn_mask=mask.double())
    assert rel_err(out, want) <= LOW_TOL[dtype]
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    causal = sdpa(q, k, v, is_causal=True)
    assert causal.dtype == dtype
    want = F.scaled_dot_product_attention(
        *(x.detach().double() for x in (q, k, v)), is_causal=True)
    assert rel_err(causal, want) <= LOW_TOL[dtype]


# --------------------------------------------------------------------------
# Dropout


def dropout_problem():
    return problem((2, 3, 5, 4), (2, 3, 9, 4), (2, 3, 9, 3), seed=11)


def test_dropout_reproducible_under_manual_seed():
    """The bits come from a seed drawn from torch's default generator: the
    same torch.manual_seed gives the same output, another seed or the
    next call (the generator moved on) another; dropout_p=0 is no
    dropout."""
    q, k, v = dropout_problem()
    torch.manual_seed(123)
    a = sdpa(q, k, v, dropout_p=0.4)
    b = sdpa(q, k, v, dropout_p=0.4)
    torch.manual_seed(123)
    a2 = sdpa(q, k, v, dropout_p=0.4)
    torch.manual_seed(321)
    c = sdpa(q, k, v, dropout_p=0.4)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)
    assert not torch.equal(a, c)
    plain = F.scaled_dot_product_attention(q, k, v)
    assert rel_err(sdpa(q, k, v, dropout_p=0.0), plain) <= TOL[torch.float64]
    assert not torch.allclose(a, plain)


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_dropout_drops_weights_with_probability_p(p):
    """Dropout applies to the normalised weights, as in SDPA: with the
    identity as values the output is the weights, each either 0 or scaled
    by 1 / (1 - p); about a fraction p are 0 (within 5 standard
    deviations), and the batch entries get different bits."""
    R, L, S = 200, 3, 17
    q, k, _ = problem((R, 1, L, 4), (1, 1, S, 4), (1, 1, S, S), seed=2)
    q = q[:1].expand(R, 1, L, 4).contiguous()
    eye = torch.eye(S, dtype=torch.float64).expand(1, 1, S, S)
    weights = F.scaled_dot_product_attention(q[:1], k, eye)
    torch.manual_seed(0)
    out = sdpa(q, k, eye, dropout_p=p)
    ratio = out / weights
    kept = (ratio - 1 / (1 - p)).abs() <= 1e-12 / (1 - p)
    dropped = ratio == 0
    assert (kept | dropped).all()
    n = dropped.numel()
    frac = dropped.sum().item() / n
    assert abs(frac - p) <= 5 * (p * (1 - p) / n) ** 0.5, frac
    flat = dropped.reshape(R, -1)
    assert len({tuple(row.tolist()) for row in flat}) > R // 2


def test_dropout_backward_uses_the_forward_bits():
    """gradcheck of the dropout output with the seed fixed inside the
    function: the backward drops the same weights as the forward."""
    q, k, v = (x.requires_grad_() for x in problem((2, 3, 4), (2, 5, 4),
                                                   (2, 5, 3), seed=3))

    def f(q, k, v):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            return sdpa(q, k, v, dropout_p=0.5)

    torch.manual_seed(7)
    assert not torch.allclose(f(q, k, v), F.scaled_dot_product_attention(
        q, k, v))
    assert torch.autograd.gradcheck(f, (q, k, v))


# --------------------------------------------------------------------------
# gradcheck, gradgradcheck


GRAD_CASES = ["plain", "bool", "float-grad", "causal", "causal-wide",
              "gqa", "scale"]


def grad_case(case):
    """(f, inputs) for gradcheck in float64, the inputs requiring grad."""
    q, k, v = problem((1, 2, 3, 3), (1, 2, 4, 3), (1, 2, 4, 2), seed=4)
    mask = None
    kwargs = {}
    if case == "bool":
        mask = make_mask((1, 2, 3, 4), "bool", full_row=True)
    elif case == "causal":
        kwargs["is_causal"] = True
    elif case == "causal-wide":
        # L > S: top-left, every query sees key 0.
        q, k, v = problem((1, 5, 3), (1, 3, 3), (1, 3, 2), seed=4)
        kwargs["is_causal"] = True
    elif case == "gqa":
        q = randn(1, 4, 3, 3, seed=8)
        kwargs["enable_gqa"] = True
    elif case == "scale":
        kwargs["scale"] = 0.7
    inputs = [q, k, v]
    if case == "float-grad":
        inputs.append(make_mask((3, 4), "float", full_row=True))
    inputs = [x.requires_grad_() for x in inputs]

    def f(q, k, v, m=mask):
        return sdpa(q, k, v, attn_mask=m, **kwargs)

    return f, inputs


@pytest.mark.parametrize("case", GRAD_CASES)
def test_gradcheck(case):
    f, inputs = grad_case(case)
    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("case", ["plain", "bool", "float-grad", "causal",
                                  "gqa"])
def test_gradgradcheck(case):
    f, inputs = grad_case(case)
    assert torch.autograd.gradgradcheck(f, inputs)


# --------------------------------------------------------------------------
# torch.compile and torch.export


class Block(torch.nn.Module):
    """Projections, then our SDPA twice: causal self-attention over heads,
    and attention with a float mask and enable_gqa."""

    def __init__(self, E=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(E, 3 * E)
        self.kv = torch.nn.Linear(E, E)
        self.out = torch.nn.Linear(E, E)

    def split(self, x):
        N, T, E = x.shape
        return x.view(N, T, -1, E // self.heads).transpose(1, 2)

    def forward(self, x, mask):
        q, k, v = (self.split(t) for t in self.qkv(x).chunk(3, dim=-1))
        y = sdpa(q, k, v, is_causal=True)
        kv = self.split(self.kv(x))[:, :1]
        y = y + sdpa(y, kv, kv, attn_mask=mask, enable_gqa=True, scale=0.5)
        N, _, T, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(N, T, -1))


def block_inputs():
    return (randn(3, 5, 8, seed=21, dtype=torch.float32),
            make_mask((5, 5), "float").float())


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) (a graph break would raise): the
    output and the parameter gradients equal eager's."""
    torch.manual_seed(0)
    eager = Block()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True)
    x, mask = block_inputs()
    results = []
    for m, fn in ((eager, eager), (model, compiled)):
        out = fn(x, mask)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad for p in m.parameters()]))
    (oe, ge), (oc, gc) = results
    assert rel_err(oc, oe) <= TOL[torch.float32]
    for a, b in zip(ge, gc):
        assert rel_err(b, a) <= TOL[torch.float32]


def test_export():
    """torch.export.export: the program calls an attention_c operator (not
    a decomposition into matmul and softmax) and gives eager's output."""
    torch.manual_seed(0)
    model = Block()
    inputs = block_inputs()
    exported = torch.export.export(model, inputs)
    assert "attention_c." in str(exported.graph)
    want = model(*inputs)
    assert rel_err(exported.module()(*inputs), want) <= TOL[torch.float32]


# --------------------------------------------------------------------------
# Errors


def bad_calls():
    """Calls SDPA refuses: (args, kwargs, the exception types accepted from
    ours).  PyTorch raises RuntimeError throughout; attention_c's adapter
    raises ValueError for shapes and TypeError for dtypes (its
    convention), accepted here as well."""
    q, k, v = problem((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 3))
    causal = torch.ones(5, 7, dtype=torch.bool).tril()
    shape, dtype = (RuntimeError, ValueError), (RuntimeError, TypeError)
    return {
        "key-E": ((q, k[..., :3], v), {}, shape),
        "value-S": ((q, k, v[..., :6, :]), {}, shape),
        "heads": ((q, k[:, :2], v[:, :2]), {}, shape),
        "mask-shape": ((q, k, v), {"attn_mask": causal[:, :6]}, shape),
        "mask-shape-4d": ((q, k, v),
                          {"attn_mask": torch.ones(2, 2, 5, 7,
                                                   dtype=torch.bool)}, shape),
        "gqa-not-multiple": ((randn(2, 6, 5, 4), randn(2, 4, 7, 4),
                              randn(2, 4, 7, 3)), {"enable_gqa": True},
                             shape),
        "dtype": ((q, k.float(), v), {}, dtype),
        "mask-dtype": ((q.float(), k.float(), v.float()),
                       {"attn_mask": torch.zeros(5, 7,
                                                 dtype=torch.float64)},
                       dtype),
    }


@pytest.mark.parametrize("grad", [False, True])
def test_numpy_scalar_scale(grad):
    """A NumPy scalar scale is a number, with gradients recorded or not
    (with them it was refused as not a real number); a bool is not."""
    q, k, v = problem((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 3))
    q.requires_grad_(grad)
    want = sdpa(q, k, v, scale=0.5)
    assert torch.equal(sdpa(q, k, v, scale=np.float32(0.5)), want)
    with pytest.raises(TypeError, match="scale must be a real number"):
        sdpa(q, k, v, scale=True)


@pytest.mark.parametrize("case", list(bad_calls()))
def test_errors_like_sdpa(case):
    """What F.scaled_dot_product_attention refuses, ours refuses (with
    PyTorch's exception type or the adapter's ValueError/TypeError, and a
    message), leaving the inputs as they were."""
    args, kwargs, accepted = bad_calls()[case]
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(*args, **kwargs)
    before = [x.clone() for x in args]
    with pytest.raises(accepted) as ours:
        sdpa(*args, **kwargs)
    assert str(ours.value)
    for a, b in zip(args, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("L,S", [(5, 5), (3, 5), (5, 3)])
def test_causal_with_attn_mask_applies_both(L, S, kind):
    """is_causal=True with an attn_mask: ours applies both (top-left), as
    documented.  PyTorch 2.13 is not consistent here: its CPU flash kernel
    (4-D, some head sizes) applies both, its other paths raise
    RuntimeError, so the reference is the explicit combined mask."""
    q, k, v = problem((2, 3, L, 4), (2, 3, S, 4), (2, 3, S, 3))
    mask = make_mask((L, S), kind)
    tril = torch.ones(L, S, dtype=torch.bool).tril()
    both = (mask & tril if kind == "bool"
            else mask.masked_fill(~tril, NEG_INF))
    for lead in (slice(None), 0):
        got = sdpa(q[lead], k[lead], v[lead], attn_mask=mask, is_causal=True)
        want = F.scaled_dot_product_attention(q[lead], k[lead], v[lead],
                                              attn_mask=both)
        assert rel_err(got, want) <= TOL[torch.float64]
