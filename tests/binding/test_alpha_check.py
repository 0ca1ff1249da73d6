"""A backward's alpha must be its forward's for the same mask.

The forward's weights are exactly 0 where an item is masked.  The pooled
layer's (context_attention) are nonzero everywhere else (a valid weight
that underflows is raised to the least normal number); the attention
family's may be 0 on a valid item too: a weight below the least normal
number is flushed to 0 (docs/contract.md section 8, "no denormal, ever").
So the backwards that take both alpha and a mask check that alpha is
nonzero only where visible (and, for the pooled layer, that it is nonzero
there), and raise ValueError, naming the index, instead of returning the
silently wrong gradients a wrong mask used to give (off by up to 0.8,
nonzero on padding).  A family backward without masks accepts any alpha:
every key is visible, and a 0 may be a flushed weight.
"""

import re

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core, reference

PATHS = list(_core._simd_paths())
DTYPES = [np.float32, np.float64]
B, TQ, T, H, A = 3, 4, 17, 5, 6


@pytest.fixture
def simd_restored():
    simd = _core._get_simd()
    yield
    _core._set_simd(simd)


def _mask(rng, shape):
    """Random, with a fully masked row and a fully valid one."""
    m = rng.random(shape) < 0.6
    m.reshape(-1, shape[-1])[0] = False
    m.reshape(-1, shape[-1])[1] = True
    return m


def _cases(rng, dtype, scale=1.0):
    """(name, forward kwargs, mask kwargs, visible) for the layer and the
    three scores: a key mask (mask=), a per-query mask (attn_mask=),
    causal=True, or a -inf bias (which masks like attn_mask,
    docs/contract.md 5.1);
    visible is what they leave visible, in alpha's shape.  scale
    multiplies the scores (large: exp underflows)."""
    h = rng.standard_normal((B, T, H)).astype(dtype)
    q = rng.standard_normal((B, TQ, H)).astype(dtype)
    W2 = rng.standard_normal((A, 2 * H)).astype(dtype)
    v = (rng.standard_normal(A) * scale).astype(dtype)
    Wg = (rng.standard_normal((H, H)) * scale).astype(dtype)
    key_mask = _mask(rng, (B, T))
    query_mask = _mask(rng, (B, TQ, T))
    keys_seen = np.broadcast_to(key_mask[:, None, :], (B, TQ, T))
    causal = np.broadcast_to(np.tril(np.ones((TQ, T), bool), k=T - TQ),
                             (B, TQ, T))
    bias = np.where(query_mask, 0.0, -np.inf).astype(dtype)
    return [
        ("context_attention", dict(h=h, W=W2, v=v), dict(mask=key_mask),
         key_mask),
        ("additive_attention", dict(query=q, keys=h, W=W2, v=v),
         dict(mask=key_mask), keys_seen),
        ("additive_attention", dict(query=q, keys=h, W=W2, v=v),
         dict(attn_mask=query_mask), query_mask),
        ("dot_attention", dict(query=q, keys=h, scale=scale),
         dict(attn_mask=query_mask), query_mask),
        ("dot_attention", dict(query=q, keys=h, scale=scale),
         dict(causal=True), causal),
        ("general_attention", dict(query=q, keys=h, W=Wg),
         dict(mask=key_mask), keys_seen),
        ("general_attention", dict(query=q, keys=h, W=Wg),
         dict(bias=bias), query_mask),
        ("general_attention", dict(query=q[:, 0], keys=h, W=Wg),
         dict(mask=key_mask), key_mask),
    ]


def _backward(name, fwd, alpha, out, masks):
    """The backward with the mask keywords masks (a dict; {}: none)."""
    grad = np.ones_like(out)
    bwd = getattr(ac, name + "_backward")
    if name == "context_attention":
        return bwd(grad, fwd["h"], fwd["W"], fwd["v"], alpha, **masks)
    return bwd(grad, alpha=alpha, **masks, **fwd)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_forward_alpha_is_zero_exactly_where_masked(dtype, rng,
                                                    simd_restored):
    """On every SIMD path, with scores large enough that exp underflows:
    alpha is 0 on every masked item; on a valid one it is at least the
    least normal number (the pooled layer), or that or exactly 0 (the
    family: never a denormal); the backward accepts it."""
    tiny = np.finfo(dtype).tiny
    scale = 100.0 if dtype == np.float32 else 3000.0   # exp underflows
    for path in PATHS:
        _core._set_simd(path)
        smallest, flushed = np.inf, 0
        for name, fwd, masks, valid in _cases(rng, dtype, scale):
            out, alpha = getattr(ac, name)(**fwd, **masks)[:2]
            assert valid.shape == alpha.shape
            what = f"{name} {path} {list(masks)}"
            assert np.all(alpha[~valid] == 0), what
            if name == "context_attention":
                assert np.all(alpha[valid] >= tiny), what
                smallest = min(smallest, alpha[valid].min())
            else:
                assert np.all((alpha[valid] == 0)
                              | (alpha[valid] >= tiny)), what
                flushed += np.count_nonzero(alpha[valid] == 0)
            _backward(name, fwd, alpha, out, masks)
        # some weights were in exp's underflow range (where they used to
        # become 0): floored by the pooled layer, flushed by the family
        assert smallest < 16 * tiny, path
        assert flushed > 0, path


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_backward_without_the_forwards_mask_raises(dtype, rng):
    """The pooled layer's forward had a mask, the backward none:
    ValueError naming the first masked item (the old silently wrong
    gradients).  The family's backward cannot tell a masked 0 from a
    flushed one (no denormal, ever), so it accepts the call."""
    for name, fwd, masks, _ in _cases(rng, dtype):
        out, alpha = getattr(ac, name)(**fwd, **masks)[:2]
        if name != "context_attention":
            _backward(name, fwd, alpha, out, {})
            continue
        first = tuple(int(i) for i in np.argwhere(alpha == 0)[0])
        at = "(" + ", ".join(map(str, first)) + ")"
        with pytest.raises(ValueError) as err:
            _backward(name, fwd, alpha, out, {})
        msg = str(err.value)
        assert msg.startswith(f"{name}_backward: alpha at {at} is 0 but no "
                              "mask was given"), msg
        assert "pass the masks the forward used" in msg


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_backward_with_a_mask_the_forward_lacked_raises(dtype, rng):
    """The forward had no mask, the backward one: ValueError naming the
    first masked item, whose weight is nonzero."""
    for name, fwd, masks, valid in _cases(rng, dtype):
        out, alpha = getattr(ac, name)(**fwd)[:2]
        first = tuple(int(i) for i in np.argwhere(~valid)[0])
        at = re.escape("(" + ", ".join(map(str, first)) + ")")
        with pytest.raises(ValueError, match=rf"^{name}_backward: alpha at "
                           rf"{at} is nonzero but the masks hide that key"):
            _backward(name, fwd, alpha, out, masks)


def test_backward_with_another_mask_raises(rng):
    """Two different masks: refused.  Changing only a fully masked row
    into another fully masked row is not a change."""
    (name, fwd, masks, _), = _cases(rng, np.float64)[:1]
    mask = masks["mask"]
    out, alpha = ac.context_attention(**fwd, mask=mask)
    other = mask.copy()
    t = np.argmax(mask[1])
    other[1, t] = False
    with pytest.raises(ValueError, match=rf"alpha at \(1, {t}\) is nonzero"):
        _backward(name, fwd, alpha, out, dict(mask=other))
    # the same mask as a copy, and as a list of lists, is accepted
    want = _backward(name, fwd, alpha, out, masks)
    for same in (mask.copy(), mask.tolist()):
        got = _backward(name, fwd, alpha, out, dict(mask=same))
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_a_wrong_pair_leaves_no_state(rng):
    """After the refused call (masks the forward lacked), the right call
    gives the same bits as before it."""
    for name, fwd, masks, _ in _cases(rng, np.float32):
        out, alpha = getattr(ac, name)(**fwd)[:2]
        want = _backward(name, fwd, alpha, out, {})
        with pytest.raises(ValueError):
            _backward(name, fwd, alpha, out, masks)
        got = _backward(name, fwd, alpha, out, {})
        for g, w in zip(got, want):
            assert (g is None and w is None) or np.array_equal(g, w), name


def test_nonfinite_alpha_where_valid_is_not_refused(rng):
    """A NaN weight on a valid item is nonzero: no refusal (NaN flows
    through as the NaN tests describe); the check is about the mask."""
    name, fwd, masks, _ = _cases(rng, np.float64)[0]
    mask = masks["mask"]
    out, alpha = ac.context_attention(**fwd, mask=mask)
    alpha[mask] = np.nan
    grads = _backward(name, fwd, alpha, out, masks)
    assert np.isnan(grads.h[mask]).any()


def test_reference_softmax_floors_valid_weights():
    """reference.masked_softmax mirrors the rule in its dtype."""
    s = np.array([[0.0, -1e4, 5.0, -1e4]])
    m = np.array([[True, True, False, False]])
    for dtype in DTYPES:
        a = reference.masked_softmax(s.astype(dtype), mask=m)
        assert a.dtype == dtype
        assert a[0, 1] == np.finfo(dtype).tiny
        assert a[0, 0] == 1 and a[0, 2] == a[0, 3] == 0


def test_layers_pass_their_masks(rng):
    """The NumPy layers hand their forward's mask to the backward."""
    from attention_c.layer import ContextAttention, DotAttention
    h = rng.standard_normal((B, T, H))
    mask = _mask(rng, (B, T))
    layer = ContextAttention(H, A, seed=0)
    out = layer(h, mask=mask)
    assert np.all(np.isfinite(layer.backward(np.ones_like(out))))
    dot = DotAttention()
    q = rng.standard_normal((B, TQ, H))
    out = dot(q, h, mask=mask)
    grads = dot.backward(np.ones_like(out))
    assert np.all(grads.keys[~mask] == 0)
