"""Pure PyTorch for the tests of attention_c: the layer (contract section
1) and the three scores of the attention family (section 4) written with
plain torch operations, their gradients (of any order) from autograd, and
small random tensor problems for the PyTorch adapter.

torch is imported inside the functions, so that ``attention_c.testing``,
which re-exports everything here, imports without it.
"""

import math


# --------------------------------------------------------------------------
# The layer and the family (gradients from autograd, to any order)

def torch_context_attention(h, W, v, *, b=None, mask=None):
    """Contract section 1, context-pooled additive attention, in PyTorch.

    Same arguments as ``attention_c.torch.context_attention`` (the
    optional ones keyword-only); returns ``(out, alpha)``.  Masked items
    get exactly 0 weight and a fully masked row gives zeros and zero
    gradients.

    Examples
    --------
    >>> import torch
    >>> h, W, v, b, mask = torch_layer_problem(grad=False)
    >>> out, alpha = torch_context_attention(h, W, v, b=b, mask=mask)
    >>> out.shape, bool(alpha[1].eq(0).all())
    (torch.Size([3, 3]), True)
    """
    import torch

    Hs = h.shape[-1]
    if mask is None:
        mask = torch.ones(h.shape[:-1], dtype=torch.bool)
    m = mask.to(h.dtype)
    n = m.sum(-1, keepdim=True)
    c = (h * m[..., None]).sum(-2) / n.clamp(min=1)
    z = h @ W[:, :Hs].T + (c @ W[:, Hs:].T)[..., None, :]
    if b is not None:
        z = z + b
    s = torch.tanh(z) @ v
    any_valid = mask.any(-1, keepdim=True)
    M = torch.where(mask, s, -torch.inf).amax(-1, keepdim=True)
    M = torch.where(any_valid, M, torch.zeros_like(M)).detach()
    e = torch.where(mask, torch.exp(s - M), torch.zeros_like(s))
    alpha = e / torch.where(any_valid, e.sum(-1, keepdim=True),
                            torch.ones_like(M))
    return (alpha[..., None] * h).sum(-2), alpha


def torch_masked_softmax(s, m):
    """Softmax of s over its last axis and the valid keys of the bool mask
    m (None: all valid); masked keys, and queries with no valid key, get 0
    (contract section 4).

    Examples
    --------
    >>> import torch
    >>> torch_masked_softmax(torch.zeros(2, 2), torch.tensor([[1, 1],
    ...                                                       [0, 0]]) > 0)
    tensor([[0.5000, 0.5000],
            [0.0000, 0.0000]])
    """
    import torch

    if m is None:
        return torch.softmax(s, -1)
    any_valid = m.any(-1, keepdim=True)
    s = s.masked_fill(~m, -math.inf)
    M = torch.where(any_valid, s.amax(-1, keepdim=True), 0).detach()
    e = torch.exp(s - M)
    return e / torch.where(any_valid, e.sum(-1, keepdim=True), 1)


def torch_visible(s_shape, mask=None, attn_mask=None, causal=False,
                  bias=None, single=False):
    """The (..., Tq, T) booleans visible_it of contract section 5.1 for
    scores of shape ``s_shape``: the key mask (..., T), the per-query
    ``attn_mask``, ``causal`` (bottom-right aligned: t <= i + T - Tq) and
    the -inf entries of ``bias``; None when everything is visible.

    Examples
    --------
    >>> torch_visible((1, 2, 3), causal=True).int()
    tensor([[[1, 1, 0],
             [1, 1, 1]]], dtype=torch.int32)
    """
    import torch

    Tq, T = s_shape[-2:]
    vis = None

    def both(a, b):
        return b if a is None else a & b

    if mask is not None:
        vis = both(vis, mask.unsqueeze(-2))
    if attn_mask is not None:
        vis = both(vis, attn_mask)
    if causal:
        i, t = torch.arange(Tq)[:, None], torch.arange(T)[None, :]
        vis = both(vis, t <= i + (T - Tq))
    if bias is not None:
        vis = both(vis, ~torch.isneginf(bias.unsqueeze(-2) if single
                                        else bias))
    return None if vis is None else vis.expand(s_shape)


def torch_attend(s, mask, vals, single, *, attn_mask=None, causal=False,
                 bias=None):
    """Scores s (..., Tq, T) -> (out, alpha), a key mask (..., T) applying
    to every query and the per-query ``attn_mask``, ``causal`` and ``bias``
    (added to s, -inf masking) of contract section 5; with ``single``, the
    query axis (of length 1) is dropped from both.

    Examples
    --------
    >>> import torch
    >>> out, alpha = torch_attend(torch.zeros(1, 2, 3), None,
    ...                           torch.ones(1, 3, 4), False)
    >>> out.shape, alpha.shape
    (torch.Size([1, 2, 4]), torch.Size([1, 2, 3]))
    """
    import torch

    vis = torch_visible(s.shape, mask, attn_mask, causal, bias, single)
    if bias is not None:
        b = bias.unsqueeze(-2) if single else bias
        s = s + torch.where(torch.isneginf(b), 0, b)
    alpha = torch_masked_softmax(s, vis)
    out = alpha @ vals
    return (out[..., 0, :], alpha[..., 0, :]) if single else (out, alpha)


def torch_additive_attention(query, keys, W, v, *, b=None, mask=None,
                             attn_mask=None, causal=False, values=None):
    """d2l.ai's AdditiveAttention: W_q(q) and W_k(k) broadcast-added, tanh,
    then w_v; the arguments of ``attention_c.torch.additive_attention``.

    Examples
    --------
    >>> a = torch_family_problem("additive", grad=False)
    >>> torch_additive_attention(**a)[0].shape
    torch.Size([3, 3, 3])
    """
    import torch
    F = torch.nn.functional

    single = query.ndim < keys.ndim
    q = query.unsqueeze(-2) if single else query
    Hk = keys.shape[-1]
    features = (F.linear(q, W[:, Hk:], b).unsqueeze(-2)
                + F.linear(keys, W[:, :Hk]).unsqueeze(-3))
    scores = F.linear(torch.tanh(features), v[None])[..., 0]
    return torch_attend(scores, mask, keys if values is None else values,
                        single, attn_mask=attn_mask, causal=causal)


def torch_general_attention(query, keys, W, *, mask=None, attn_mask=None,
                            causal=False, bias=None, values=None):
    """q_i . (W_a k_t) + bias_it: matmul, softmax, matmul; the arguments
    of ``attention_c.torch.general_attention`` (no dropout).

    Examples
    --------
    >>> a = torch_family_problem("general", several=False, grad=False)
    >>> torch_general_attention(**a)[1].shape
    torch.Size([3, 5])
    """
    single = query.ndim < keys.ndim
    q = query.unsqueeze(-2) if single else query
    s = q @ (keys @ W.T).transpose(-1, -2)
    return torch_attend(s, mask, keys if values is None else values, single,
                        attn_mask=attn_mask, causal=causal, bias=bias)


def torch_dot_attention(query, keys, *, mask=None, attn_mask=None,
                        causal=False, bias=None, values=None, scale=None):
    """out from ``F.scaled_dot_product_attention`` (same scale and boolean
    mask conventions; ``bias`` is its float ``attn_mask``; our bottom-right
    ``causal`` as a boolean mask; a query with no visible key set to 0),
    alpha from matmul-softmax; the arguments of
    ``attention_c.torch.dot_attention`` (no dropout).

    Examples
    --------
    >>> a = torch_family_problem("dot", values=True, grad=False)
    >>> torch_dot_attention(**a)[0].shape
    torch.Size([3, 3, 2])
    """
    import torch
    F = torch.nn.functional

    single = query.ndim < keys.ndim
    q = query.unsqueeze(-2) if single else query
    vals = keys if values is None else values
    s_shape = (*q.shape[:-1], keys.shape[-2])
    vis = torch_visible(s_shape, mask, attn_mask, causal, bias, single)
    m = vis
    if bias is not None:
        b = bias.unsqueeze(-2) if single else bias
        m = torch.where(vis, b, -math.inf).to(q.dtype)
    out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=m,
                                         scale=scale)
    if vis is not None:
        out = torch.where(vis.any(-1, keepdim=True), out, 0)
    c = 1 / math.sqrt(keys.shape[-1]) if scale is None else scale
    _, alpha = torch_attend(c * q @ keys.transpose(-1, -2), mask, vals,
                            single, attn_mask=attn_mask, causal=causal,
                            bias=bias)
    return (out[..., 0, :], alpha) if single else (out, alpha)


TORCH_ATTENTION = {"context": torch_context_attention,
                   "additive": torch_additive_attention,
                   "dot": torch_dot_attention,
                   "general": torch_general_attention}


# --------------------------------------------------------------------------
# Small tensor problems for the PyTorch adapter

TORCH_LAYER_SIZES = (3, 4, 3, 5)          # B, T, H, A
TORCH_LAYER_MASKS = {
    "none": None,
    # a fully valid row, a fully masked row, a row with one valid item
    "edge": [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 0]],
    "partial": [[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 1]],
}


def torch_layer_problem(dtype=None, bias=True, mask="edge", seed=0,
                        grad=True):
    """Random (h, W, v, b, mask) tensors of TORCH_LAYER_SIZES.

    Parameters
    ----------
    dtype : torch.dtype, optional
        float64 by default.
    bias : bool
        b is None without.
    mask : str
        A key of TORCH_LAYER_MASKS.
    seed : int
        Of the torch.Generator drawing h, W, v and b (standard normal).
    grad : bool
        Whether the float tensors require grad.

    Examples
    --------
    >>> h, W, v, b, mask = torch_layer_problem(bias=False)
    >>> tuple(h.shape), b is None, h.requires_grad
    ((3, 4, 3), True, True)
    """
    import torch

    dtype = torch.float64 if dtype is None else dtype
    B, T, H, A = TORCH_LAYER_SIZES
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype,
                           requires_grad=grad)

    m = TORCH_LAYER_MASKS[mask]
    m = None if m is None else torch.tensor(m, dtype=torch.bool)
    return rnd(B, T, H), rnd(A, 2 * H), rnd(A), rnd(A) if bias else None, m


TORCH_FAMILY_SIZES = (3, 3, 5, 3, 2, 5, 2)    # B, TQ, T, H, HQ, A, HV


def torch_key_mask():
    """(B, T) of TORCH_FAMILY_SIZES: all valid, fully masked, one valid
    key.

    Examples
    --------
    >>> torch_key_mask().sum(-1)
    tensor([5, 0, 1])
    """
    import torch

    return torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 0, 1, 0, 0]],
                        dtype=torch.bool)


def torch_causal_mask():
    """(B, TQ, T) of TORCH_FAMILY_SIZES: query i sees keys t <= i + 2; one
    fully masked query and one query with a single valid key.

    Examples
    --------
    >>> torch_causal_mask().sum(-1)
    tensor([[3, 4, 5],
            [0, 4, 5],
            [3, 1, 5]])
    """
    import torch

    B, TQ, T = TORCH_FAMILY_SIZES[:3]
    m = torch.ones(TQ, T, dtype=torch.bool).tril(2).repeat(B, 1, 1)
    m[1, 0] = False
    m[2, 1] = torch.tensor([0, 0, 0, 1, 0], dtype=torch.bool)
    return m


TORCH_FAMILY_MASKS = {"none": lambda: None, "key": torch_key_mask,
                      "causal": torch_causal_mask}


def torch_family_problem(kind, several=True, values=False, mask="key",
                         dtype=None, bias=True, seed=0, grad=True):
    """Random arguments of a family function, by name, of
    TORCH_FAMILY_SIZES.

    Parameters
    ----------
    kind : {'additive', 'dot', 'general'}
    several : bool
        Queries (B, TQ, Hq), else one query per sequence (B, Hq).
    values : bool
        Give values (B, T, HV), else None (the keys are the values).
    mask : str
        A key of TORCH_FAMILY_MASKS: 'key' gives ``mask`` (B, T), 'causal'
        the per-query ``attn_mask`` (B, TQ, T) (several queries only).
    dtype : torch.dtype, optional
        float64 by default.
    bias : bool
        Additive only: b, or None without.
    seed : int
    grad : bool
        Whether the float tensors require grad.

    Examples
    --------
    >>> sorted(torch_family_problem("general"))
    ['W', 'attn_mask', 'keys', 'mask', 'query', 'values']
    """
    import torch

    dtype = torch.float64 if dtype is None else dtype
    B, TQ, T, H, HQ, A, HV = TORCH_FAMILY_SIZES
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        x = torch.randn(*shape, generator=g, dtype=dtype) * scale
        return x.requires_grad_(grad)

    hq = H if kind == "dot" else HQ
    args = {"query": rnd(B, TQ, hq) if several else rnd(B, hq),
            "keys": rnd(B, T, H),
            "values": rnd(B, T, HV) if values else None,
            "mask": None, "attn_mask": None}
    args["attn_mask" if mask == "causal" else "mask"] = (
        TORCH_FAMILY_MASKS[mask]())
    if kind == "additive":
        args.update(W=rnd(A, H + HQ, scale=0.7), v=rnd(A),
                    b=rnd(A, scale=0.3) if bias else None)
    elif kind == "general":
        args["W"] = rnd(HQ, H, scale=0.7)
    return args
