"""The NumPy reference of the location and cosine scores
(attention_c.reference.scores), checked on its own:

* against PyTorch autograd in float64 (skipped without torch), written
  from the definitions: location = softmax(F.linear(q, W[:T], b[:T])) @ v,
  cosine = softmax(beta F.normalize(q) @ F.normalize(k).mT + bias) @ v,
  with the masked softmax of attention_c.testing (0 for a query that sees
  no key); one query and several, broadcast leading axes, T < T_max and
  T = T_max, sharpness None / float / broadcast array, zero query and key
  vectors, masks with fully masked rows;
* its backwards against central finite differences of L = sum(out G)
  [+ sum(alpha Ga)] (pure NumPy: runs without torch), cosine with every
  argument of the dot score it passes on;
* exact zeros (rows t >= T of W, fully masked rows), NaN in padding, the
  computing dtype, and the errors.

Tolerances, normwise (testing.rel_err): TOL[float64] = 1e-12 between two
float64 evaluations of the same formula, measured against max(||ref||,
noise_floor(bound)) where bound is the size of the terms of the answer
(from the inputs' norms), since a softmax gradient can be 0 in exact
arithmetic; FD_RTOL = 1e-6 against finite differences (step 1e-6).
"""

import numpy as np
import pytest

from attention_c import reference as ref
from attention_c.testing import (FD_RTOL, TOL, noise_floor, numerical_grad,
                                 rel_err)

pytestmark = pytest.mark.filterwarnings("error")

TOL64 = TOL[np.float64]


def close(got, want, bound, what):
    """got (a float64 ndarray of want's shape) within TOL64 of want,
    normwise, with the noise floor of terms of size ``bound``."""
    got = got.detach().numpy() if hasattr(got, "detach") else got
    want = want.detach().numpy() if hasattr(want, "detach") else want
    assert isinstance(got, np.ndarray) and got.dtype == np.float64, what
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{what}: not finite"
    err = rel_err(got, want, noise_floor(bound, np.float64, TOL64))
    assert err <= TOL64, f"{what}: normwise relative error {err:.3g}"


def norm(*xs):
    """The product of the norms of the arrays xs (1 for None): the size of
    a sum of their products."""
    return float(np.prod([1.0 if x is None else np.linalg.norm(x)
                          for x in xs]))


# (query's leading axes, values' (keys') leading axes): the same; the
# query broadcast over more sequences; both broadcast against each other
LEADS = [((2,), (2,)), ((1,), (3,)), ((3, 1), (1, 2))]
MASKS = ["none", "key", "query"]      # query: attn_mask (several only)


def lead_id(case):
    return "q{}-k{}".format(*("x".join(map(str, c)) or "0" for c in case))


def masks(rng, lead, Tq, T, kind, single):
    """(mask, attn_mask): a key mask (lead, T) whose first sequence sees
    no key, or an attn_mask (lead, Tq, T) where query 1 sees no key and
    key 0 is seen by none; for one query the attn_mask becomes a key
    mask."""
    if kind == "none":
        return None, None
    if kind == "key" or single:
        m = rng.random(lead + (T,)) < 0.7
        m[..., -1] = True
        m.reshape(-1, T)[0] = False
        return m, None
    am = rng.random(lead + (Tq, T)) < 0.7
    am[..., 1:] = True
    am[..., 1, :] = False
    am[..., 0] = False
    return None, am


def visible(lead, Tq, T, mask, attn_mask, single):
    """The (lead, [Tq,] T) booleans of who sees what."""
    full = np.ones(lead + (1 if single else Tq, T), bool)
    if mask is not None:
        full = full & mask[..., None, :]
    if attn_mask is not None:
        full = full & attn_mask
    return full[..., 0, :] if single else full


# --------------------------------------------------------------------------
# 1. Against PyTorch autograd (float64)

def torch_location(q, v, W, b, m, single):
    """out, alpha of softmax(Linear(Hq, T_max)(q)[..., :T]) @ v."""
    import torch.nn.functional as F
    from attention_c.testing import torch_masked_softmax
    T = v.shape[-2]
    alpha = torch_masked_softmax(F.linear(q, W[:T], b[:T]), m)
    out = ((alpha[..., None, :] @ v)[..., 0, :] if single else alpha @ v)
    return out, alpha


@pytest.mark.parametrize("T", [4, 6], ids=["T<Tmax", "T=Tmax"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("leads", LEADS, ids=lead_id)
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
def test_location_matches_torch(single, leads, mask_kind, T, rng):
    """out, alpha and every gradient (with grad_alpha) == autograd of the
    PyTorch definition; dW and db exactly 0 past row T."""
    torch = pytest.importorskip("torch")
    qlead, vlead = leads
    T_max, Tq, Hq, Hv = 6, 3, 3, 2
    lead = np.broadcast_shapes(qlead, vlead)
    q = rng.standard_normal(qlead + (() if single else (Tq,)) + (Hq,))
    v = rng.standard_normal(vlead + (T, Hv))
    W = rng.standard_normal((T_max, Hq))
    b = rng.standard_normal(T_max)
    mask, am = masks(rng, lead, Tq, T, mask_kind, single)
    g = rng.standard_normal(lead + (() if single else (Tq,)) + (Hv,))
    ga = rng.standard_normal(lead + (() if single else (Tq,)) + (T,))

    out, alpha = ref.location_attention(q, v, W, b=b, mask=mask,
                                        attn_mask=am)
    grads = ref.location_attention_backward(g, q, v, W, alpha, b=b,
                                            mask=mask, attn_mask=am,
                                            grad_alpha=ga)
    tq, tv, tW, tb = (torch.tensor(x, requires_grad=True)
                      for x in (q, v, W, b))
    m = visible(lead, Tq, T, mask, am, single)
    t_out, t_alpha = torch_location(tq, tv, tW, tb, torch.tensor(m), single)
    loss = (t_out * torch.tensor(g)).sum() + (t_alpha * torch.tensor(ga)).sum()
    loss.backward()
    bound = norm(g, v) + norm(ga)
    close(out, t_out, norm(v), "out")
    close(alpha, t_alpha, 1.0, "alpha")
    for name, got, want, size in [("query", grads[0], tq, bound * norm(W)),
                                  ("values", grads[1], tv, norm(g)),
                                  ("W", grads[2], tW, bound * norm(q)),
                                  ("b", grads[3], tb, bound)]:
        close(got, want.grad, size, f"d{name}")
    assert np.all(grads[2][T:] == 0) and np.all(grads[3][T:] == 0)
    assert np.all(out[~m.any(-1)] == 0) and np.all(alpha[~m] == 0)


def torch_cosine(q, k, v, beta, m, single, bias=None, softcap=None):
    """out, alpha of softmax(softcap(beta n(q) . n(k)) + bias) @ v."""
    import torch
    import torch.nn.functional as F
    from attention_c.testing import torch_masked_softmax
    nq, nk = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if single:
        nq = nq[..., None, :]
    s = nq @ nk.mT
    s = (s[..., 0, :] if single else s) * beta[..., None]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    alpha = torch_masked_softmax(s, m)
    out = ((alpha[..., None, :] @ v)[..., 0, :] if single else alpha @ v)
    return out, alpha


# sharpness: None, a float, arrays broadcast to out.shape[:-1] = lead +
# ([Tq]) (lead = (2,) here), a NaN-free array the size of it
SHARPNESS = {"none": None, "float": 2.5, "scalar_array": np.array(3.0),
             "per_query": "per_query", "per_sequence": "per_sequence"}


@pytest.mark.parametrize("with_values", [True, False],
                         ids=["values", "keys_as_values"])
@pytest.mark.parametrize("zeros", [False, True], ids=["", "zero_vectors"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("sharp", list(SHARPNESS))
@pytest.mark.parametrize("layout", ["q1", "qN", "qN_causal_bias_softcap"])
def test_cosine_matches_torch(layout, sharp, mask_kind, zeros, with_values,
                              rng):
    """out, alpha and the gradients of query, keys, values, sharpness and
    bias == autograd of the PyTorch definition, zero vectors included (n
    of a zero vector is 0, its gradient dn / eps: finite, never NaN)."""
    torch = pytest.importorskip("torch")
    single, extras = layout == "q1", layout[3:] or "plain"
    lead, Tq, T, H, Hv = (2,), 3, 5, 4, 3
    ql = lead + (() if single else (Tq,))
    q = rng.standard_normal(ql + (H,))
    k = rng.standard_normal(lead + (T, H))
    v = rng.standard_normal(lead + (T, Hv)) if with_values else None
    if zeros:
        q.reshape(-1, H)[-1] = 0                       # a zero query
        k[..., 2, :] = 0                               # a zero key
        k[0, 3] = 1e-13                                # below eps
    sharpness = SHARPNESS[sharp]
    if sharp == "per_query":                           # (Tq,) or (2,)
        sharpness = rng.uniform(0.5, 4, ql[-1:])
    elif sharp == "per_sequence":                      # (2, 1) or (1,)
        sharpness = rng.uniform(0.5, 4, (2, 1) if not single else (1,))
    mask, am = masks(rng, lead, Tq, T, mask_kind, single)
    kw = {}
    if extras != "plain":
        kw = dict(causal=True, bias=rng.standard_normal((Tq, T)),
                  softcap=1.5)
    g = rng.standard_normal(ql + (Hv if with_values else H,))
    ga = rng.standard_normal(ql + (T,))

    out, alpha = ref.cosine_attention(q, k, mask=mask, attn_mask=am,
                                      values=v, sharpness=sharpness, **kw)
    grads = ref.cosine_attention_backward(
        g, q, k, alpha, mask=mask, attn_mask=am, values=v,
        sharpness=sharpness, grad_alpha=ga, **kw)
    assert len(grads) == 7 and all(x is None for x in grads[5:])

    beta = np.ones(ql) if sharpness is None else sharpness
    beta_is_array = isinstance(sharpness, np.ndarray)
    tq, tk, tbeta = (torch.tensor(np.asarray(x, float), requires_grad=True)
                     for x in (q, k, beta))
    tv = tk if v is None else torch.tensor(v, requires_grad=True)
    tbias = (None if "bias" not in kw else
             torch.tensor(kw["bias"], requires_grad=True))
    m = visible(lead, Tq, T, mask, am, single)
    if kw.get("causal"):
        m = m & np.tril(np.ones((Tq, T), bool), T - Tq)
    t_out, t_alpha = torch_cosine(tq, tk, tv, tbeta, torch.tensor(m),
                                  single, tbias, kw.get("softcap"))
    loss = (t_out * torch.tensor(g)).sum() + (t_alpha * torch.tensor(ga)).sum()
    loss.backward()

    # the terms: gamma = g . v + ga; dq and dk are divided by the norms
    vals = k if v is None else v
    gamma = norm(g, vals) + norm(ga)
    inv = 1 / np.maximum(np.linalg.norm(np.concatenate(
        [q.reshape(-1, H), k.reshape(-1, H)]), axis=-1), 1e-12).min()
    bound = gamma * norm(beta) * inv
    close(out, t_out, norm(vals), "out")
    close(alpha, t_alpha, 1.0, "alpha")
    close(grads[0], tq.grad, bound, "dquery")
    close(grads[1], tk.grad, bound + norm(g), "dkeys")
    if v is None:
        assert grads[2] is None
    else:
        close(grads[2], tv.grad, norm(g), "dvalues")
    if beta_is_array:
        close(grads[3], tbeta.grad, gamma, "dsharpness")
        assert grads[3].shape == np.shape(sharpness)
    else:
        assert grads[3] is None
    if tbias is not None:
        close(grads[4], tbias.grad, gamma, "dbias")
    dead = ~m.any(-1)
    assert np.all(out[dead] == 0) and np.all(alpha[~m] == 0)


# --------------------------------------------------------------------------
# 2. Finite differences (NumPy only)

def fd_check(loss, grads):
    """Each (name, analytic, input) against numerical_grad of loss."""
    for name, got, x in grads:
        num = numerical_grad(loss, x)
        assert got.shape == x.shape, name
        err = rel_err(got, num)
        assert err <= FD_RTOL, f"d{name}: {err:.3g} against differences"


@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
def test_location_backward_finite_differences(single, rng):
    """dquery, dvalues, dW (rows past T included) and db, with grad_alpha,
    a fully masked sequence and broadcast leading axes."""
    T_max, T, Tq, Hq, Hv = 5, 3, 2, 3, 2
    if single:                          # lead (3,)
        q, v = rng.standard_normal((3, Hq)), rng.standard_normal((3, T, Hv))
    else:                               # lead (3, 1) x (1, 2) -> (3, 2)
        q = rng.standard_normal((3, 1, Tq, Hq))
        v = rng.standard_normal((1, 2, T, Hv))
    W, b = rng.standard_normal((T_max, Hq)), rng.standard_normal(T_max)
    lead = (3,) if single else (3, 2)
    mask = np.ones(lead + (T,), bool)
    mask.reshape(-1, T)[1] = False                     # a dead sequence
    mask.reshape(-1, T)[2, 0] = False
    tail = () if single else (Tq,)
    g = rng.standard_normal(lead + tail + (Hv,))
    ga = rng.standard_normal(lead + tail + (T,))

    def loss():
        out, alpha = ref.location_attention(q, v, W, b=b, mask=mask)
        return np.sum(out * g) + np.sum(alpha * ga)

    _, alpha = ref.location_attention(q, v, W, b=b, mask=mask)
    dq, dv, dW, db = ref.location_attention_backward(
        g, q, v, W, alpha, b=b, mask=mask, grad_alpha=ga)
    fd_check(loss, [("query", dq, q), ("values", dv, v), ("W", dW, W),
                    ("b", db, b)])
    assert np.all(dW[T:] == 0) and np.all(db[T:] == 0)
    _, alpha = ref.location_attention(q, v, W, mask=mask)
    assert ref.location_attention_backward(g, q, v, W, alpha,
                                           mask=mask)[3] is None


COSINE_FD = {
    "causal_bias_sharpness": dict(causal=True, bias="bias",
                                  sharpness="per_query"),
    "softcap_window_alibi": dict(softcap=1.2, window=(1, 1),
                                 alibi_slopes="slopes", sharpness=1.7),
    "packed_sinks_lse": dict(cu_seqlens_q=np.array([0, 2, 4]),
                             cu_seqlens_k=np.array([0, 3, 5]),
                             sinks="sinks", sharpness="per_sequence"),
    "dropout_keys_as_values": dict(dropout=0.3, seed=11, values=None,
                                   sharpness="per_query"),
}


@pytest.mark.parametrize("case", list(COSINE_FD))
def test_cosine_backward_finite_differences(case, rng):
    """Every gradient of cosine_attention_backward (query, keys, values,
    sharpness, bias, alibi_slopes, sinks), from alpha, or from out= and
    lse= (sinks), against differences of sum(out G) + sum(alpha Ga)."""
    lead, Tq, T, H, Hv = (2,), 4, 5, 3, 2
    kw = dict(COSINE_FD[case])
    q = rng.standard_normal(lead + (Tq, H))
    k = rng.standard_normal(lead + (T, H))
    v = rng.standard_normal(lead + (T, Hv))
    fill = {"bias": rng.standard_normal((Tq, T)),
            "slopes": rng.uniform(0.1, 0.5, lead),
            "sinks": rng.standard_normal(lead),
            "per_query": rng.uniform(0.5, 3, (Tq,)),
            "per_sequence": rng.uniform(0.5, 3, lead + (1,))}
    kw = {n: fill[x] if isinstance(x, str) else x for n, x in kw.items()}
    if "values" not in kw:
        kw["values"] = v
    lse_path = "sinks" in kw
    g = rng.standard_normal(lead + (Tq, H if kw["values"] is None else Hv))
    ga = None if lse_path else rng.standard_normal(lead + (Tq, T))

    def loss():
        out, a = ref.cosine_attention(q, k, **kw)
        return np.sum(out * g) + (0 if lse_path else np.sum(a * ga))

    out, a = ref.cosine_attention(q, k, return_weights=not lse_path, **kw)
    saved = dict(out=out, lse=a) if lse_path else dict(grad_alpha=ga)
    grads = ref.cosine_attention_backward(
        g, q, k, None if lse_path else a, **saved, **kw)
    names = ["query", "keys", "values", "sharpness", "bias",
             "alibi_slopes", "sinks"]
    inputs = dict(query=q, keys=k, **kw)
    checks = [(n, d, inputs[n]) for n, d in zip(names, grads)
              if isinstance(inputs.get(n), np.ndarray)]
    assert len(checks) == sum(d is not None for d in grads)
    fd_check(loss, checks)


# --------------------------------------------------------------------------
# 3. Exact zeros, padding, dtypes, errors

def test_dead_queries_and_nan_padding_give_zeros(rng):
    """A query that sees no key: out = alpha = 0 and zero gradients even
    with a NaN sharpness; NaN in keys no query sees and in dead queries
    changes nothing."""
    Tq, T, H = 3, 4, 3
    q, k = rng.standard_normal((2, Tq, H)), rng.standard_normal((2, T, H))
    am = np.ones((2, Tq, T), bool)
    am[0, 1] = False                                   # a dead query
    am[:, :, 3] = False                                # a dead key
    beta = np.array([[1.0, 2.0, 3.0], [1.0, 1.5, 2.0]])
    g = rng.standard_normal((2, Tq, H))
    kw = dict(attn_mask=am, values=k.copy())
    out, alpha = ref.cosine_attention(q, k, sharpness=beta, **kw)
    want = ref.cosine_attention_backward(g, q, k, alpha, sharpness=beta,
                                         **kw)
    bad_q, bad_k, bad_beta = q.copy(), k.copy(), beta.copy()
    bad_q[0, 1], bad_k[:, 3], bad_beta[0, 1] = np.nan, np.nan, np.nan
    out2, alpha2 = ref.cosine_attention(bad_q, bad_k, sharpness=bad_beta,
                                        **kw)
    got = ref.cosine_attention_backward(g, bad_q, bad_k, alpha2,
                                        sharpness=bad_beta, **kw)
    assert np.array_equal(out, out2) and np.array_equal(alpha, alpha2)
    for w, x in zip(want[:4], got[:4]):
        assert np.array_equal(w, x)
    assert np.all(out[0, 1] == 0) and np.all(got[0][0, 1] == 0)
    assert got[3][0, 1] == 0 and np.all(got[1][:, 3] == 0)


@pytest.mark.parametrize("beta", [None, 2.0, np.float64(2.0), "array64"])
def test_float32_is_computed_in_float32(beta, rng):
    """float32 inputs give float32 results and gradients; a float64
    sharpness (like a float64 bias) does not promote them."""
    q = rng.standard_normal((2, 3, 4)).astype(np.float32)
    k = rng.standard_normal((2, 5, 4)).astype(np.float32)
    if beta == "array64":
        beta = np.full((2, 3), 2.0)
    out, alpha = ref.cosine_attention(q, k, sharpness=beta)
    grads = ref.cosine_attention_backward(out, q, k, alpha, sharpness=beta)
    for x in (out, alpha) + tuple(x for x in grads if x is not None):
        assert x.dtype == np.float32
    W, b = rng.standard_normal((6, 4)).astype(np.float32), np.zeros(
        6, np.float32)
    out, alpha = ref.location_attention(q, k, W, b=b)
    grads = ref.location_attention_backward(out, q, k, W, alpha, b=b)
    assert all(x.dtype == np.float32 for x in (out, alpha) + grads)


def test_bad_input_names_the_argument(rng):
    q, k = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4))
    with pytest.raises(ValueError, match="W"):
        ref.location_attention(q, k, np.zeros((4, 4)))
    with pytest.raises(ValueError, match="b"):
        ref.location_attention(q, k, np.zeros((6, 4)), b=np.zeros(5))
    with pytest.raises(ValueError, match="sharpness"):
        ref.cosine_attention(q, k, sharpness=np.ones(2))
    with pytest.raises(ValueError, match="sharpness"):
        ref.cosine_attention(q, k, sharpness=np.ones((2, 2, 3)))
    for bad in (np.inf, -np.inf, np.nan):
        with pytest.raises(ValueError, match="sharpness"):
            ref.cosine_attention(q, k, sharpness=bad)
    with pytest.raises(TypeError, match="sharpness"):
        ref.cosine_attention(q, k, sharpness=np.array(["a"]))
