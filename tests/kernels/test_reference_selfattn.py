"""The NumPy reference of docs/contract.md section 5 (masks, causal,
bias, dropout, return_weights, broadcasting), checked on its own.

* Philox4x32-10 against the Random123 known answers, and the dropout keep
  pattern: its bit layout and the fraction kept;
* every formula of section 5.2 against an independent float64 computation
  written with explicit loops over (i, t) (``loops`` below), and against
  central finite differences;
* the mask combinations, broadcasting, lse and NaN rules of section 5.1.

Tolerances (float64): EXACT = 1e-12 normwise relative error for two
computations of the same formula; finite differences use a central step
FD_STEP = 1e-6 (truncation O(h^2) ~ 1e-12, rounding ~ 1e-16 / h = 1e-10),
so they must agree within FD_RTOL = 1e-6.
"""

import math

import numpy as np
import pytest

from attention_c import reference as ref

EXACT = 1e-12
FD_STEP = 1e-6
FD_RTOL = 1e-6


def close(got, want, rtol=EXACT, what=""):
    """Same shape, NaN and inf in the same places, and ||got - want|| <=
    rtol max(||want||, 1): relative, but absolute for results near 0 that
    are sums which cancel (sum_t delta_it = 0 without grad_alpha, so the
    dbias of a (Tq, 1) bias is rounding noise).  The inputs are O(1)."""
    got, want = np.asarray(got, float), np.asarray(want, float)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert (np.isnan(got) == np.isnan(want)).all(), what
    assert (np.isinf(got) == np.isinf(want)).all(), what
    assert (got[np.isinf(got)] == want[np.isinf(want)]).all(), what
    ok = np.isfinite(want)
    err = np.linalg.norm(got[ok] - want[ok])
    bound = rtol * max(np.linalg.norm(want[ok]), 1.0)
    assert err <= bound, f"{what}: {err:.3g}"


# --------------------------------------------------------------------------
# 1. Philox and the keep pattern

KAT = [((0, 0, 0, 0), (0, 0),
        (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
       ((0xffffffff,) * 4, (0xffffffff,) * 2,
        (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
       ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344),
        (0xa4093822, 0x299f31d0),
        (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers(counter, key, want):
    got = ref.philox4x32(counter, key)
    assert all(w.dtype == np.uint32 for w in got)
    assert tuple(int(w) for w in got) == want


def test_philox_arrays_equal_scalar_calls():
    """A vector of counters gives each counter's scalar answer."""
    c0 = np.array([0, 1, 0xffffffff, 0x243f6a88], np.uint64)
    words = ref.philox4x32((c0, 5, 7, 9), (11, 13))
    for n, c in enumerate(c0):
        one = ref.philox4x32((int(c), 5, 7, 9), (11, 13))
        assert [int(w[n]) for w in words] == [int(w) for w in one]


@pytest.mark.parametrize("b", [0, 6, 2**32 + 3])
def test_keep_bit_layout(b):
    """keep_it = word t & 3 of philox((t >> 2, i, b lo, b hi), seed) >=
    floor(p 2**32), spelled out one (i, t) at a time."""
    seed, p, Tq, T = 2**40 + 12345, 0.37, 3, 9
    keep = ref.dropout_keep(seed, p, b, Tq, T)
    assert keep.shape == (Tq, T) and keep.dtype == bool
    key = (seed % 2**32, seed >> 32)
    for i in range(Tq):
        for t in range(T):
            u = int(ref.philox4x32((t // 4, i, b % 2**32, b >> 32),
                                   key)[t % 4])
            assert keep[i, t] == (u >= math.floor(p * 2**32)), (i, t)


def test_keep_batch_of_indices():
    """An array of batch indices stacks the one-index patterns; different
    seeds and batch indices give different patterns."""
    many = ref.dropout_keep(3, 0.5, np.array([[0, 1], [2, 3]]), 4, 10)
    assert many.shape == (2, 2, 4, 10)
    for b in range(4):
        assert (many.reshape(4, 4, 10)[b]
                == ref.dropout_keep(3, 0.5, b, 4, 10)).all()
    assert (many[0, 0] != many[0, 1]).any()
    assert (ref.dropout_keep(4, 0.5, 0, 4, 10) != many[0, 0]).any()
    assert ref.dropout_keep(3, 0.0, 0, 4, 10).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction(p):
    """The fraction kept is 1 - p within 6 binomial standard deviations."""
    n_b, Tq, T = 4, 64, 257
    keep = ref.dropout_keep(2024, p, np.arange(n_b), Tq, T)
    n = keep.size
    sd = math.sqrt(n * p * (1 - p))
    assert abs(keep.sum() - n * (1 - p)) <= 6 * sd


# --------------------------------------------------------------------------
# 2. The independent computation: explicit loops over (i, t), one sequence
#    at a time; broadcasting is done by index, not by NumPy


def _at(x, idx, core):
    """x's entry for the batch index idx of the broadcast leading shape
    (x has ``core`` trailing axes): missing axes dropped, size-1 axes 0."""
    lead = x.shape[:x.ndim - core]
    idx = idx[len(idx) - len(lead):]
    return tuple(0 if n == 1 else j for j, n in zip(idx, lead))


def loops(kind, q, k, vals, *, W=None, mask=None, attn_mask=None,
          causal=False, bias=None, dropout=0.0, seed=None, scale=None,
          g=None, ga=None):
    """Forward and gradients of docs/contract.md section 5 with loops.
    Several queries only.
    Returns a dict: out, alpha, lse (broadcast shape), dq, dk, dvals, dW,
    dbias (the shapes of the inputs)."""
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], vals.shape[:-2])
    Tq, T, Hv = q.shape[-2], k.shape[-2], vals.shape[-1]
    if scale is None:
        scale = 1 / math.sqrt(k.shape[-1]) if kind == "dot" else 1.0
    r = dict(out=np.zeros(lead + (Tq, Hv)), alpha=np.zeros(lead + (Tq, T)),
             lse=np.full(lead + (Tq,), -np.inf), dq=np.zeros(q.shape),
             dk=np.zeros(k.shape), dvals=np.zeros(vals.shape),
             dW=None if W is None else np.zeros(W.shape),
             dbias=None if bias is None else np.zeros(bias.shape))
    for b, idx in enumerate(np.ndindex(*lead)):
        qi, ki, vi = _at(q, idx, 2), _at(k, idx, 2), _at(vals, idx, 2)
        Q, K, V = q[qi], k[ki], vals[vi]
        KP = K @ W.T if kind == "general" else K       # W_a k_t per key
        keep = (ref.dropout_keep(seed, dropout, b, Tq, T) if dropout
                else np.ones((Tq, T), bool))
        drop = 1 / (1 - dropout)

        def visible(i, t):
            return ((mask is None or mask[_at(mask, idx, 1) + (t,)])
                    and (attn_mask is None or attn_mask[
                        _at(attn_mask, idx, 2) + (i % attn_mask.shape[-2],
                                                  t % attn_mask.shape[-1])])
                    and (not causal or t <= i + T - Tq)
                    and (bias is None or bias_at(i, t) != -np.inf))

        def bias_at(i, t):
            return bias[_at(bias, idx, 2) + (i % bias.shape[-2],
                                             t % bias.shape[-1])]

        P = np.zeros((Tq, T))
        for i in range(Tq):
            seen = [t for t in range(T) if visible(i, t)]
            if not seen:
                continue
            s = {t: scale * Q[i] @ KP[t]
                 + (0.0 if bias is None else bias_at(i, t)) for t in seen}
            M = max(s.values())
            lse = M + math.log(sum(math.exp(s[t] - M) for t in seen))
            r["lse"][idx + (i,)] = lse
            for t in seen:
                P[i, t] = math.exp(s[t] - lse)
                r["alpha"][idx + (i, t)] = P[i, t]
                r["out"][idx + (i,)] += P[i, t] * keep[i, t] * drop * V[t]
        if g is None:
            continue
        G = g[idx]
        dKP = np.zeros(KP.shape)
        for i in range(Tq):
            seen = [t for t in range(T) if visible(i, t)]
            gamma = {t: G[i] @ V[t] * keep[i, t] * drop
                     + (0.0 if ga is None else ga[idx + (i, t)])
                     for t in seen}
            D = sum(P[i, t] * gamma[t] for t in seen)
            for t in seen:
                delta = P[i, t] * (gamma[t] - D)
                r["dvals"][vi + (t,)] += P[i, t] * keep[i, t] * drop * G[i]
                r["dq"][qi + (i,)] += scale * delta * KP[t]
                dKP[t] += scale * delta * Q[i]
                if bias is not None:
                    r["dbias"][_at(bias, idx, 2)
                               + (i % bias.shape[-2],
                                  t % bias.shape[-1])] += delta
        if kind == "general":
            r["dk"][ki] += dKP @ W                     # W_a^T dkp_t
            r["dW"] += dKP.T @ K                       # sum_t dkp_t k_t^T
        else:
            r["dk"][ki] += dKP
    return r


def call(kind, q, k, vals, W=None, **kw):
    """(out, alpha, lse) of the reference (two forwards)."""
    fwd = getattr(ref, f"{kind}_attention")
    args = (q, k) if kind == "dot" else (q, k, W)
    out, alpha = fwd(*args, values=vals, **kw)
    out2, lse = fwd(*args, values=vals, return_weights=False, **kw)
    close(out2, out, what="out of return_weights=False")
    return out, alpha, lse


def grads(kind, g, q, k, vals, alpha, W=None, ga=None, **kw):
    """The reference's gradients as a dict (from alpha)."""
    bwd = getattr(ref, f"{kind}_attention_backward")
    args = (g, q, k) if kind == "dot" else (g, q, k, W)
    res = bwd(*args, alpha, values=vals, grad_alpha=ga, **kw)
    names = (["dq", "dk", "dvals", "dbias"] if kind == "dot"
             else ["dq", "dk", "dvals", "dW", "dbias"])
    names += ["dalibi_slopes", "dsinks"]
    assert len(res) == len(names)
    return dict(zip(names, res))


def problem(rng, kind, lead_q, lead_k, Tq, T, d=3, Hv=2):
    q = rng.standard_normal(lead_q + (Tq, d))
    k = rng.standard_normal(lead_k + (T, d))
    vals = rng.standard_normal(lead_k + (T, Hv))
    W = rng.standard_normal((d, d)) / 2 if kind == "general" else None
    return q, k, vals, W


def compare(kind, rng, q, k, vals, W, **kw):
    """Reference forward (both returns) and backward (both ways) ==
    loops, within EXACT."""
    out, alpha, lse = call(kind, q, k, vals, W, **kw)
    g = rng.standard_normal(out.shape)
    ga = rng.standard_normal(alpha.shape)
    want = loops(kind, q, k, vals, W=W, g=g, ga=ga, **kw)
    close(out, want["out"], what="out")
    close(alpha, want["alpha"], what="alpha")
    close(lse, want["lse"], what="lse")
    got = grads(kind, g, q, k, vals, alpha, W, ga, **kw)
    for n, x in got.items():
        if want.get(n) is None:
            assert x is None, n
        else:
            close(x, want[n], what=n)
    # the out=/lse= backward equals the alpha backward (no grad_alpha)
    want0 = grads(kind, g, q, k, vals, alpha, W, **kw)
    bwd = getattr(ref, f"{kind}_attention_backward")
    args = (g, q, k) if kind == "dot" else (g, q, k, W)
    got0 = bwd(*args, out=out, lse=lse, values=vals, **kw)
    for n, x in zip(want0, got0):
        if want0[n] is None:
            assert x is None
        else:
            close(x, want0[n], what=f"{n} from out and lse")
    return out, alpha, lse, got


# --------------------------------------------------------------------------
# 3. Every formula against the loops

SIZES = [(1, 1), (3, 3), (3, 17), (17, 3), (1, 17)]
KINDS = ["dot", "general"]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("Tq,T", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_against_loops_causal_bias_mask(kind, Tq, T, dropout):
    rng = np.random.default_rng(Tq * 100 + T)
    q, k, vals, W = problem(rng, kind, (2,), (2,), Tq, T)
    mask = rng.random((2, T)) < 0.8
    mask[1, 0] = True
    bias = rng.standard_normal((Tq, T))
    bias[0, -1] = -np.inf
    compare(kind, rng, q, k, vals, W, mask=mask, causal=True, bias=bias,
            dropout=dropout, seed=77 if dropout else None)


@pytest.mark.parametrize("Tq,T", [(3, 17), (17, 3), (3, 3)])
@pytest.mark.parametrize("kind", KINDS)
def test_causal_is_bottom_right(kind, Tq, T):
    """causal == attn_mask np.tril(k=T - Tq); with Tq > T the first
    Tq - T queries see nothing (out 0, alpha 0, lse -inf)."""
    rng = np.random.default_rng(1)
    q, k, vals, W = problem(rng, kind, (2,), (2,), Tq, T)
    out, alpha, lse, _ = compare(kind, rng, q, k, vals, W, causal=True)
    tri = np.tril(np.ones((Tq, T), bool), k=T - Tq)
    out2, alpha2, lse2 = call(kind, q, k, vals, W, attn_mask=tri)
    close(out, out2)
    close(alpha, alpha2)
    close(lse, lse2)
    dead = max(Tq - T, 0)
    assert (out[..., :dead, :] == 0).all()
    assert (alpha[..., :dead, :] == 0).all()
    assert (lse[..., :dead] == -np.inf).all()
    assert (alpha[..., ~tri] == 0).all()


@pytest.mark.parametrize("shape", [(7, 7), (1, 7, 7), (2, 1, 7, 7),
                                   (7, 1), (1, 7)])
@pytest.mark.parametrize("kind", KINDS)
def test_attn_mask_broadcasts(kind, shape):
    rng = np.random.default_rng(2)
    q, k, vals, W = problem(rng, kind, (2, 3), (2, 3), 7, 7)
    am = rng.random(shape) < 0.6
    compare(kind, rng, q, k, vals, W, attn_mask=am)


@pytest.mark.parametrize("shape", [(1, 1, 5, 9), (5, 1), (1, 9), (3, 1, 1),
                                   (2, 3, 5, 9)])
@pytest.mark.parametrize("kind", KINDS)
def test_bias_broadcasts_and_dbias_summed(kind, shape):
    """bias broadcast from shape; dbias has that shape (the loops add
    delta into the entry each (b, i, t) reads)."""
    rng = np.random.default_rng(3)
    q, k, vals, W = problem(rng, kind, (2, 3), (2, 3), 5, 9)
    bias = rng.standard_normal(shape)
    *_, got = compare(kind, rng, q, k, vals, W, bias=bias, dropout=0.2,
                      seed=5)
    assert got["dbias"].shape == shape


@pytest.mark.parametrize("kind", KINDS)
def test_fully_masked_queries_and_minus_inf_rows(kind):
    """A query with no visible key (attn_mask row False, or a bias row of
    -inf, or every visible key at -inf): out 0, alpha 0, lse -inf, zero
    gradients, dbias 0 there."""
    rng = np.random.default_rng(4)
    Tq, T = 4, 6
    q, k, vals, W = problem(rng, kind, (2,), (2,), Tq, T)
    am = np.ones((2, Tq, T), bool)
    am[0, 1] = False                                   # masked query
    am[1, 2, :3] = False
    bias = rng.standard_normal((2, Tq, T))
    bias[1, 0] = -np.inf                               # all -inf bias
    bias[1, 2, 3:] = -np.inf                           # visible ones -inf
    out, alpha, lse, got = compare(kind, rng, q, k, vals, W, attn_mask=am,
                                   bias=bias)
    for b, i in [(0, 1), (1, 0), (1, 2)]:
        assert (out[b, i] == 0).all() and (alpha[b, i] == 0).all()
        assert lse[b, i] == -np.inf
        assert (got["dq"][b, i] == 0).all()
        assert (got["dbias"][b, i] == 0).all()
    assert np.isfinite(out).all() and np.isfinite(got["dk"]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_query_broadcast(kind):
    """keys (B, Hkv, 1, T, d) against queries (B, Hkv, G, Tq, d): the same
    as repeating the keys G times, with dk and dvals summed over G."""
    rng = np.random.default_rng(5)
    B, Hkv, G, Tq, T = 2, 3, 2, 5, 7
    q, k, vals, W = problem(rng, kind, (B, Hkv, G), (B, Hkv, 1), Tq, T)
    kw = dict(causal=True, dropout=0.25, seed=9,
              bias=rng.standard_normal((Hkv, 1, Tq, T)))
    out, alpha, lse, got = compare(kind, rng, q, k, vals, W, **kw)
    assert got["dk"].shape == k.shape and got["dvals"].shape == vals.shape
    kr, vr = np.repeat(k, G, axis=2), np.repeat(vals, G, axis=2)
    out2, alpha2, _ = call(kind, q, kr, vr, W, **kw)
    close(out, out2)
    close(alpha, alpha2)
    g = rng.standard_normal(out.shape)
    a = grads(kind, g, q, k, vals, alpha, W, **kw)
    b = grads(kind, g, q, kr, vr, alpha, W, **kw)
    close(a["dq"], b["dq"])
    close(a["dk"], b["dk"].sum(axis=2, keepdims=True))
    close(a["dvals"], b["dvals"].sum(axis=2, keepdims=True))
    close(a["dbias"], b["dbias"])


@pytest.mark.parametrize("kind", KINDS)
def test_single_query(kind):
    """One query per sequence == Tq = 1, bias (..., T), mask (..., T)."""
    rng = np.random.default_rng(6)
    q, k, vals, W = problem(rng, kind, (3,), (3,), 1, 17)
    mask = rng.random((3, 17)) < 0.7
    mask[2] = False
    bias = rng.standard_normal((3, 17))
    kw = dict(mask=mask, dropout=0.4, seed=1)
    args = (k,) if kind == "dot" else (k, W)
    fwd = getattr(ref, f"{kind}_attention")
    bwd = getattr(ref, f"{kind}_attention_backward")
    out1, alpha1 = fwd(q[:, 0], *args, values=vals, bias=bias, **kw)
    _, lse1 = fwd(q[:, 0], *args, values=vals, bias=bias,
                  return_weights=False, **kw)
    out, alpha = fwd(q, *args, values=vals, bias=bias[:, None], **kw)
    _, lse = fwd(q, *args, values=vals, bias=bias[:, None],
                 return_weights=False, **kw)
    close(out1, out[:, 0])
    close(alpha1, alpha[:, 0])
    close(lse1, lse[:, 0])
    assert lse1[2] == -np.inf and (out1[2] == 0).all()
    g = rng.standard_normal(out1.shape)
    bargs = (g, q[:, 0], k) if kind == "dot" else (g, q[:, 0], k, W)
    g1 = bwd(*bargs, out=out1, lse=lse1, values=vals, bias=bias, **kw)
    bargs = ((g[:, None], q, k) if kind == "dot"
             else (g[:, None], q, k, W))
    gN = bwd(*bargs, alpha, values=vals, bias=bias[:, None], **kw)
    close(g1[0], gN[0][:, 0])
    # (..., dbias, dalibi_slopes, dsinks): the last two None here
    for x, y in zip(g1[1:-3], gN[1:-3]):
        close(x, y)
    close(g1[-3], gN[-3][:, 0])
    assert g1[-2:] == gN[-2:] == (None, None)


@pytest.mark.parametrize("kind", KINDS)
def test_values_default_to_keys(kind):
    """values=None: dvalues None, and the keys take its gradient."""
    rng = np.random.default_rng(7)
    q, k, _, W = problem(rng, kind, (2,), (2,), 3, 5)
    bias = rng.standard_normal((3, 5))
    args = (q, k) if kind == "dot" else (q, k, W)
    fwd = getattr(ref, f"{kind}_attention")
    bwd = getattr(ref, f"{kind}_attention_backward")
    out, alpha = fwd(*args, causal=True, bias=bias)
    g = rng.standard_normal(out.shape)
    a = bwd(g, *args, alpha, causal=True, bias=bias)
    b = bwd(g, *args, alpha, causal=True, bias=bias, values=k)
    assert a[2] is None
    close(a[1], b[1] + b[2])
    close(a[-1], b[-1])


# --------------------------------------------------------------------------
# 4. Finite differences (dropout with a fixed seed: keep is a constant)


def fd_check(kind, rng, dropout, **kw):
    Tq, T = 3, 4
    q, k, vals, W = problem(rng, kind, (2,), (2,), Tq, T)
    bias = rng.standard_normal((1, Tq, T))
    bias[0, 0, -1] = -np.inf
    kw.update(bias=bias, dropout=dropout, seed=31 if dropout else None)
    x = dict(q=q, k=k, vals=vals, W=W, bias=bias)
    fwd = getattr(ref, f"{kind}_attention")
    g_out = rng.standard_normal((2, Tq, vals.shape[-1]))

    def loss(x):
        a = (x["q"], x["k"]) if kind == "dot" else (x["q"], x["k"], x["W"])
        out, _ = fwd(*a, values=x["vals"], **dict(kw, bias=x["bias"]))
        return (g_out * out).sum()

    out, alpha = fwd(*((q, k) if kind == "dot" else (q, k, W)),
                     values=vals, **kw)
    got = grads(kind, g_out, q, k, vals, alpha, W, **kw)
    names = {"q": "dq", "k": "dk", "vals": "dvals", "W": "dW",
             "bias": "dbias"}
    for n, a in x.items():
        if a is None:
            continue
        num = np.zeros(a.shape)
        for j in np.ndindex(*a.shape):
            if not np.isfinite(a[j]):
                continue                               # -inf stays -inf
            hi, lo = dict(x), dict(x)
            hi[n], lo[n] = a.copy(), a.copy()
            hi[n][j] += FD_STEP
            lo[n][j] -= FD_STEP
            num[j] = (loss(hi) - loss(lo)) / (2 * FD_STEP)
        close(got[names[n]], num, FD_RTOL, f"d{n} vs finite differences")


@pytest.mark.parametrize("dropout", [0.0, 0.4])
@pytest.mark.parametrize("kind", KINDS)
def test_finite_differences(kind, dropout):
    rng = np.random.default_rng(8)
    fd_check(kind, rng, dropout, causal=True,
             mask=np.array([[True, True, False, True],
                            [True, True, True, True]]))


# --------------------------------------------------------------------------
# 5. Dropout, NaN, additive, errors


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_alpha_is_before_dropout(kind):
    rng = np.random.default_rng(9)
    q, k, vals, W = problem(rng, kind, (2,), (2,), 5, 6)
    out0, alpha0, lse0 = call(kind, q, k, vals, W)
    out, alpha, lse = call(kind, q, k, vals, W, dropout=0.5, seed=3)
    close(alpha, alpha0)
    close(lse, lse0)
    assert not np.allclose(out, out0)
    again, _, _ = call(kind, q, k, vals, W, dropout=0.5, seed=3)
    assert (again == out).all()


@pytest.mark.parametrize("kind", KINDS)
def test_nan_in_invisible_keys_reaches_nothing(kind):
    """A NaN in a key or value row reaches only the queries that see it:
    key T-1 is seen by the last query alone (causal, Tq = T), key 1 by no
    query (mask)."""
    rng = np.random.default_rng(10)
    Tq = T = 5
    q, k, vals, W = problem(rng, kind, (2,), (2,), Tq, T)
    mask = np.ones((2, T), bool)
    mask[:, 1] = False
    kw = dict(mask=mask, causal=True, bias=rng.standard_normal((Tq, T)))
    out0, alpha0, lse0 = call(kind, q, k, vals, W, **kw)
    g = rng.standard_normal(out0.shape)
    clean = grads(kind, g, q, k, vals, alpha0, W, **kw)
    k, vals = k.copy(), vals.copy()
    k[:, 1], vals[:, 1] = np.nan, np.inf               # nobody sees key 1
    k[0, T - 1], vals[1, T - 1] = np.nan, np.nan       # last query only
    out, alpha, lse = call(kind, q, k, vals, W, **kw)
    got = grads(kind, g, q, k, vals, alpha, W, **kw)
    close(out[:, :-1], out0[:, :-1], what="out")
    close(alpha[:, :-1], alpha0[:, :-1], what="alpha")
    close(lse[:, :-1], lse0[:, :-1], what="lse")
    close(got["dq"][:, :-1], clean["dq"][:, :-1], what="dq")
    assert np.isnan(out[:, -1]).all()
    # without the last query's gradient (grad_out 0 there, its weights
    # finite) the other queries' gradients stay finite; the last query's
    # dq, dW and dbias row may be NaN: key T-1 is visible to it (0 * NaN)
    g[:, -1] = 0
    alpha = alpha.copy()
    alpha[:, -1] = alpha0[:, -1]
    got = grads(kind, g, q, k, vals, alpha, W, **kw)
    assert np.isfinite(got["dq"][:, :-1]).all()
    assert np.isfinite(got["dvals"][:, :T - 1]).all()
    assert np.isfinite(got["dbias"][:-1]).all()       # bias (Tq, T)
    assert (got["dk"][:, 1] == 0).all() and (got["dvals"][:, 1] == 0).all()


def test_additive_causal_and_attn_mask():
    """additive: causal == attn_mask tril; a fully masked query gives 0;
    the weights are the softmax over the visible keys (loops)."""
    rng = np.random.default_rng(11)
    Tq, T, H, A = 4, 3, 3, 5
    q = rng.standard_normal((2, Tq, H))
    k = rng.standard_normal((2, T, H))
    W = rng.standard_normal((A, 2 * H))
    v = rng.standard_normal(A)
    mask = np.array([[True, False, True], [True, True, True]])
    out, alpha = ref.additive_attention(q, k, W, v, mask=mask, causal=True)
    tri = np.tril(np.ones((Tq, T), bool), k=T - Tq)
    out2, alpha2 = ref.additive_attention(q, k, W, v, mask=mask,
                                          attn_mask=tri)
    close(out, out2)
    close(alpha, alpha2)
    for b in range(2):
        for i in range(Tq):
            seen = [t for t in range(T) if mask[b, t] and t <= i + T - Tq]
            s = {t: v @ np.tanh(W[:, :H] @ k[b, t] + W[:, H:] @ q[b, i])
                 for t in seen}
            z = sum(math.exp(x) for x in s.values())
            for t in range(T):
                want = math.exp(s[t]) / z if t in s else 0.0
                assert abs(alpha[b, i, t] - want) <= EXACT, (b, i, t)
    assert (out[:, 0] == 0).all()                      # sees no key
    g = rng.standard_normal(out.shape)
    dq, dk, dvals, dW, dv, db = ref.additive_attention_backward(
        g, q, k, W, v, alpha, mask=mask, causal=True)
    assert (dq[:, 0] == 0).all() and dvals is None and db is None


def _args(kind):
    rng = np.random.default_rng(12)
    q, k, vals, W = problem(rng, kind, (2,), (2,), 3, 4)
    return q, k, W, rng


@pytest.mark.parametrize("kind", KINDS + ["additive"])
def test_per_query_mask_refused(kind):
    q, k, W, _ = _args(kind)
    extra = {"dot": (), "general": (W,),
             "additive": (np.ones((2, 6)), np.ones(2))}[kind]
    with pytest.raises(ValueError, match="attn_mask="):
        getattr(ref, f"{kind}_attention")(q, k, *extra,
                                          mask=np.ones((2, 3, 4), bool))


BAD = [
    (dict(attn_mask=np.ones((3, 4))), TypeError, "bias="),
    (dict(attn_mask=np.ones((3, 5), bool)), ValueError, "attn_mask"),
    (dict(bias=np.ones((2, 2, 3, 4))), ValueError, "bias"),
    (dict(bias=np.ones((3, 4), bool)), TypeError, "attn_mask"),
    (dict(dropout=1.0, seed=1), ValueError, "dropout"),
    (dict(dropout=-0.1, seed=1), ValueError, "dropout"),
    (dict(dropout=0.1), ValueError, "seed"),
    (dict(dropout=0.1, seed=-1), ValueError, "seed"),
    (dict(dropout=0.1, seed=2**64), ValueError, "seed"),
]


@pytest.mark.parametrize("kw,err,match", BAD)
def test_bad_arguments(kw, err, match):
    q, k, _, _ = _args("dot")
    with pytest.raises(err, match=match):
        ref.dot_attention(q, k, **kw)


def test_single_query_refuses_attn_mask_and_causal():
    q, k, _, _ = _args("dot")
    for kw in (dict(causal=True), dict(attn_mask=np.ones(4, bool))):
        with pytest.raises(ValueError, match="several queries"):
            ref.dot_attention(q[:, 0], k, **kw)


def test_backward_saved_arguments():
    """alpha, or out= and lse= together; grad_alpha only with alpha."""
    q, k, _, rng = _args("dot")
    out, alpha = ref.dot_attention(q, k)
    _, lse = ref.dot_attention(q, k, return_weights=False)
    g = rng.standard_normal(out.shape)
    for a, kw in [(alpha, dict(lse=lse)), (None, dict(lse=lse)),
                  (None, dict(out=out)), (None, {}),
                  (None, dict(out=out, lse=lse, grad_alpha=alpha))]:
        with pytest.raises(ValueError):
            ref.dot_attention_backward(g, q, k, a, **kw)
