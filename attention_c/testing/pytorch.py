"""The PyTorch side of the tests of attention_c: the layer (contract
section 1.2) and the three scores of the attention family (section 4.3)
in plain torch operations, whose gradients (of any order) come from
autograd, and small random tensor problems for the PyTorch adapter.

The mathematics is written once for PyTorch, in
``attention_c.torch._pure`` (the transcription attention_c.torch
differentiates for its higher derivatives); the functions here only give
it the adapter's call signatures.  torch is imported inside the
functions, so that ``attention_c.testing``, which re-exports everything
here, imports without it.
"""


def _pure():
    from attention_c.torch import _pure
    return _pure


# --------------------------------------------------------------------------
# The layer and the family (gradients from autograd, to any order)

def torch_context_attention(h, W, v, *, b=None, mask=None):
    """Contract section 1.2, context-pooled additive attention, in PyTorch.

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
    return _pure().context_attention(h, W, v, b, mask)


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
    return _pure().masked_softmax(s, m)


def torch_additive_attention(query, keys, W, v, *, b=None, mask=None,
                             attn_mask=None, causal=False, values=None):
    """The additive score (d2l.ai's AdditiveAttention); the arguments of
    ``attention_c.torch.additive_attention``; returns ``(out, alpha)``.

    Examples
    --------
    >>> a = torch_family_problem("additive", grad=False)
    >>> torch_additive_attention(**a)[0].shape
    torch.Size([3, 3, 3])
    """
    return _pure().family_attention(
        "additive", query, keys, mask=mask, values=values, W=W, v=v, b=b,
        attn_mask=attn_mask, causal=causal)


def torch_general_attention(query, keys, W, *, mask=None, attn_mask=None,
                            causal=False, bias=None, values=None):
    """q_i . (W_a k_t) + bias_it; the arguments of
    ``attention_c.torch.general_attention`` (no dropout).

    Examples
    --------
    >>> a = torch_family_problem("general", several=False, grad=False)
    >>> torch_general_attention(**a)[1].shape
    torch.Size([3, 5])
    """
    return _pure().family_attention(
        "general", query, keys, mask=mask, values=values, W=W,
        attn_mask=attn_mask, causal=causal, bias=bias)


def torch_dot_attention(query, keys, *, mask=None, attn_mask=None,
                        causal=False, bias=None, values=None, scale=None):
    """c q_i . k_t + bias_it; the arguments of
    ``attention_c.torch.dot_attention`` (no dropout).

    Examples
    --------
    >>> a = torch_family_problem("dot", values=True, grad=False)
    >>> torch_dot_attention(**a)[0].shape
    torch.Size([3, 3, 2])
    """
    return _pure().family_attention(
        "dot", query, keys, mask=mask, values=values, scale=scale,
        attn_mask=attn_mask, causal=causal, bias=bias)


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


def flash_kw_as_numpy(kw, dtype):
    """FlashAttention's keywords (causal, softmax_scale, window_size with
    -1 unbounded, softcap 0.0 off, alibi_slopes, sinks) as the NumPy
    functions' (scale, window with None, softcap None; tensors as NumPy
    arrays of ``dtype``)."""
    out = {"causal": kw.get("causal", False),
           "scale": kw.get("softmax_scale")}
    left, right = kw.get("window_size", (-1, -1))
    if (left, right) != (-1, -1):
        out["window"] = (None if left == -1 else left,
                         None if right == -1 else right)
    if kw.get("softcap", 0.0):
        out["softcap"] = kw["softcap"]
    for name in ("alibi_slopes", "sinks"):
        if kw.get(name) is not None:
            out[name] = kw[name].detach().double().numpy().astype(dtype)
    return out
