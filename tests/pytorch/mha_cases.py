"""The helpers shared by test_mha_torch.py and test_mha_torch_runtime.py
(attention_c.torch.MultiheadAttention, issue 20): the tolerances and the
sizes, random float64 tensors, a pair of modules (ours and
torch.nn.MultiheadAttention) with the same parameters, inputs in every
layout, masks in nn.MultiheadAttention's convention and the need_weights
forms.  torch is imported plainly: both modules importorskip it first.
"""

import torch

from attention_c.torch import MultiheadAttention

nn = torch.nn

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}

E, HEADS, N, L, S, KDIM, VDIM = 6, 3, 3, 5, 7, 4, 5
NEG_INF = float("-inf")


def randn(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def pair(dtype=torch.float64, seed=0, **kwargs):
    """(ours in dtype, PyTorch's in float64) with the same random
    parameters (biases non-zero), rounded to dtype."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, HEADS, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    ours = MultiheadAttention(E, HEADS, dtype=dtype, **kwargs)
    ours.load_state_dict({k: v.to(dtype)
                          for k, v in ref.state_dict().items()})
    ref.load_state_dict({k: v.double()
                         for k, v in ours.state_dict().items()})
    return ours, ref


def seq_shape(T, width, batch_first, batched):
    if not batched:
        return (T, width)
    return (N, T, width) if batch_first else (T, N, width)


def make_inputs(attention, batch_first, batched, seed=0):
    """float64 (query, key, value); the same tensor three times for
    self-attention, the same key and value for 'cross'."""
    T = L if attention == "self" else S
    q = randn(*seq_shape(L, E, batch_first, batched), seed=seed)
    if attention == "self":
        return q, q, q
    if attention == "cross":
        k = randn(*seq_shape(T, E, batch_first, batched), seed=seed + 1)
        return q, k, k
    return (q, randn(*seq_shape(T, KDIM, batch_first, batched), seed=seed + 1),
            randn(*seq_shape(T, VDIM, batch_first, batched), seed=seed + 2))


def pytorch_mask(shape, kind, *, seed=3, full=None):
    """A mask in nn.MultiheadAttention's convention (bool True = not
    allowed, float added with -inf entries); column 0 always allowed
    unless ``full`` (an index into the leading axes) is masked entirely."""
    g = torch.Generator().manual_seed(seed)
    blocked = torch.rand(*shape, generator=g) < 0.4
    blocked[..., 0] = False
    if full is not None:
        blocked[full] = True
    if kind == "bool":
        return blocked
    bias = torch.randn(*shape, generator=g, dtype=torch.float64)
    return bias.masked_fill(blocked, NEG_INF)


def causal_mask(T, kind):
    upper = torch.ones(T, T, dtype=torch.bool).triu(1)
    if kind == "bool":
        return upper
    return torch.zeros(T, T, dtype=torch.float64).masked_fill(upper, NEG_INF)


def make_masks(case, T_q, T_k, batched=True, full=False):
    """forward's keyword arguments for a MASK_CASES entry
    (test_mha_torch.py); with full, the key_padding_mask masks sequence 1
    entirely and attn_mask query 2."""
    kwargs = {}
    for part in case.split("+"):
        if part == "none":
            continue
        what, kind = part.split("-")
        if what == "kpm":
            shape = (N, T_k) if batched else (T_k,)
            at = (1 if batched else slice(None)) if full else None
            kwargs["key_padding_mask"] = pytorch_mask(shape, kind, full=at)
        elif what == "causal":
            kwargs["attn_mask"] = causal_mask(T_q, kind)
            kwargs["is_causal"] = True
        else:
            lead = () if what == "2d" else ((N if batched else 1) * HEADS,)
            kwargs["attn_mask"] = pytorch_mask(
                lead + (T_q, T_k), kind, seed=4,
                full=(..., 2, slice(None)) if full else None)
    return kwargs


NEED = {"no-weights": {"need_weights": False},
        "avg-weights": {"need_weights": True},
        "head-weights": {"need_weights": True,
                         "average_attn_weights": False}}
