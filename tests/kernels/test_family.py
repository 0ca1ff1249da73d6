"""The attention family (docs/contract.md section 4): a query scored
against keys by the additive, dot or general score, the masked softmax,
and the weighted sum of the values; and project_keys, the keys' side of a
score computed once.

Every function, the C kernels *and* ``attention_c.reference``, is checked
against an independent float64 evaluation of the formulas of
docs/contract.md 4.3 and 4.4 written in this file as plain loops over the
query i and the key t (``loop_forward``, ``loop_backward``,
``loop_project_keys``; slow, so the sizes are small), and every gradient (C,
reference and the loops themselves) against central finite differences
(testing.numerical_grad) of ``L = sum(out G) [+ sum(alpha Ga)]`` in float64.

Tolerances (normwise relative error, ``testing.TOL``): 1e-12 for float64,
1e-5 for float32, against the float64 loops evaluated on the same (cast)
values; for a backward the bound is TOL or, when larger, ILL_FACTOR times
the error of the NumPy reference evaluated in the same dtype (near one-hot
weights make the gradients differences of nearly equal terms in any
evaluation; test_kernels.py does the same).  Finite differences: 1e-6.

Any warning raised during a test fails it (module-level
``filterwarnings``): queries with no valid key must never warn.
"""

import copy
import re

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import (DTYPES, FAMILY_FUNCTIONS, FD_RTOL,
                                 HALF_DTYPES, ILL_FACTOR, MASK_KINDS,
                                 Problem, SIGNATURES, TOL,
                                 assert_all_identical, assert_identical,
                                 assert_rounded, numerical_grad, rel_err)

pytestmark = pytest.mark.filterwarnings("error")

# Score variants: the additive score with and without bias, the dot score
# with its default scale (1/sqrt(H)) and a custom one, the general score.
SCORES = ["additive", "additive_nobias", "dot", "dot_scale", "general"]
KINDS = {"additive": "additive", "additive_nobias": "additive",
         "dot": "dot", "dot_scale": "dot", "general": "general"}
CUSTOM_SCALE = 0.7
# The score's parameters, in the order of the API.
PARAMS = {"additive": ["W", "v", "b"], "dot": ["scale"], "general": ["W"]}

SIMD_PATHS = list(_core._simd_paths())

score_param = pytest.mark.parametrize("score", SCORES)
dtype_param = pytest.mark.parametrize("dtype", DTYPES,
                                      ids=lambda d: np.dtype(d).name)
values_param = pytest.mark.parametrize("with_values", [True, False],
                                       ids=["values", "keys_as_values"])
ga_param = pytest.mark.parametrize("with_ga", [False, True],
                                   ids=["no_grad_alpha", "grad_alpha"])


# --------------------------------------------------------------------------
# The independent evaluation: docs/contract.md section 4, one (i, t) pair
# at a time.


def _score_fn(kind, H, W=None, v=None, b=None, scale=None):
    """s(q_i, k_t) of the score kind, from docs/contract.md 4.3."""
    if kind == "additive":
        W_k, W_q = W[:, :H], W[:, H:]
        bias = np.zeros(W.shape[0]) if b is None else b
        return lambda q, k: v @ np.tanh(W_k @ k + W_q @ q + bias)
    if kind == "dot":
        sc = 1 / np.sqrt(H) if scale is None else scale
        return lambda q, k: sc * (q @ k)
    return lambda q, k: q @ (W @ k)                    # general: q . (W_a k)


def _as_f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def _loop_setup(query, keys, mask, values):
    """(q (..., Tq, Hq), k, vals, m (..., Tq, T), single) in float64."""
    k = _as_f64(keys)
    q = _as_f64(query)
    single = q.ndim == k.ndim - 1
    if single:
        q = q[..., None, :]
    vals = k if values is None else _as_f64(values)
    shape = q.shape[:-1] + k.shape[-2:-1]              # (..., Tq, T)
    if mask is None:
        m = np.ones(shape, bool)
    else:
        m = np.asarray(mask, bool)
        if m.ndim == k.ndim - 1:                       # key mask (..., T)
            m = m[..., None, :]
        m = np.broadcast_to(m, shape)
    return q, k, vals, m, single


def loop_forward(kind, query, keys, W=None, v=None, b=None, mask=None,
                 values=None, scale=None):
    """(out, alpha) of docs/contract.md 4.3 by loops over (i, t), in
    float64."""
    q, k, vals, m, single = _loop_setup(query, keys, mask, values)
    W, v, b = _as_f64(W), _as_f64(v), _as_f64(b)
    Tq, T = m.shape[-2:]
    s_fn = _score_fn(kind, k.shape[-1], W, v, b, scale)
    out = np.zeros(q.shape[:-1] + vals.shape[-1:])
    alpha = np.zeros(m.shape)
    for seq in np.ndindex(k.shape[:-2]):
        Q, K, V, M = q[seq], k[seq], vals[seq], m[seq]
        for i in range(Tq):
            valid = [t for t in range(T) if M[i, t]]
            if not valid:
                continue                               # alpha = 0, out = 0
            s = {t: s_fn(Q[i], K[t]) for t in valid}
            top = max(s.values())
            e = {t: np.exp(s[t] - top) for t in valid}
            total = sum(e.values())
            for t in valid:
                alpha[seq + (i, t)] = e[t] / total
                out[seq + (i,)] += alpha[seq + (i, t)] * V[t]
    if single:
        return out[..., 0, :], alpha[..., 0, :]
    return out, alpha


def loop_backward(kind, grad_out, query, keys, alpha, W=None, v=None, b=None,
                  mask=None, values=None, scale=None, grad_alpha=None):
    """The gradients of docs/contract.md 4.4 by loops over (i, t), in
    float64: a dict query, keys, values (None without values), and the
    score's W, v, b (b None without bias)."""
    q, k, vals, m, single = _loop_setup(query, keys, mask, values)
    W, v, b = _as_f64(W), _as_f64(v), _as_f64(b)
    g, a, ga = _as_f64(grad_out), _as_f64(alpha), _as_f64(grad_alpha)
    if single:
        g, a = g[..., None, :], a[..., None, :]
        ga = None if ga is None else ga[..., None, :]
    Tq, T = m.shape[-2:]
    H = k.shape[-1]
    sc = 1 / np.sqrt(H) if scale is None else scale
    dq, dk, dvals = np.zeros(q.shape), np.zeros(k.shape), np.zeros(vals.shape)
    dW = None if W is None else np.zeros(W.shape)
    dv = None if v is None else np.zeros(v.shape)
    db = None if b is None else np.zeros(b.shape)
    for seq in np.ndindex(k.shape[:-2]):
        Q, K, V, M = q[seq], k[seq], vals[seq], m[seq]
        G, AL = g[seq], a[seq]
        for i in range(Tq):
            valid = [t for t in range(T) if M[i, t]]
            # gamma_it = g_i . val_t + ga_it
            gamma = {t: G[i] @ V[t] + (0 if ga is None else ga[seq][i, t])
                     for t in valid}
            mean = sum(AL[i, t] * gamma[t] for t in valid)
            for t in valid:
                delta = AL[i, t] * (gamma[t] - mean)   # dL/ds_it
                dvals[seq + (t,)] += AL[i, t] * G[i]
                if kind == "additive":
                    bias = 0 if b is None else b
                    u = np.tanh(W[:, :H] @ K[t] + W[:, H:] @ Q[i] + bias)
                    eps = delta * v * (1 - u * u)
                    dv += delta * u
                    if db is not None:
                        db += eps
                    dW[:, :H] += np.outer(eps, K[t])
                    dW[:, H:] += np.outer(eps, Q[i])
                    dk[seq + (t,)] += W[:, :H].T @ eps
                    dq[seq + (i,)] += W[:, H:].T @ eps
                elif kind == "dot":
                    dq[seq + (i,)] += sc * delta * K[t]
                    dk[seq + (t,)] += sc * delta * Q[i]
                else:                                  # general
                    dq[seq + (i,)] += delta * (W @ K[t])
                    dk[seq + (t,)] += delta * (W.T @ Q[i])
                    dW += delta * np.outer(Q[i], K[t])
    if single:
        dq = dq[..., 0, :]
    if values is None:
        dk, dvals = dk + dvals, None
    return dict(query=dq, keys=dk, values=dvals, W=dW, v=dv, b=db)


def loop_project_keys(keys, W):
    """P_t = W[:, :H] k_t for every key, by a loop over t."""
    k, W = _as_f64(keys), _as_f64(W)
    H = k.shape[-1]
    P = np.zeros(k.shape[:-1] + (W.shape[0],))
    for idx in np.ndindex(k.shape[:-1]):
        P[idx] = W[:, :H] @ k[idx]
    return P


def loop_project_keys_backward(grad_proj, keys, W):
    """(dkeys, dW): dk_t = W[:, :H]^T g_t, dW[:, :H] = sum_t g_t k_t^T."""
    g, k, W = _as_f64(grad_proj), _as_f64(keys), _as_f64(W)
    H = k.shape[-1]
    dk, dW = np.zeros(k.shape), np.zeros(W.shape)
    for idx in np.ndindex(k.shape[:-1]):
        dk[idx] = W[:, :H].T @ g[idx]
        dW[:, :H] += np.outer(g[idx], k[idx])
    return dk, dW


class Loops:
    """The family's API on the loops (float64; key_proj is not used)."""

    @staticmethod
    def additive_attention(query, keys, W, v, b=None, mask=None,
                           values=None, key_proj=None):
        return loop_forward("additive", query, keys, W=W, v=v, b=b,
                            mask=mask, values=values)

    @staticmethod
    def additive_attention_backward(grad_out, query, keys, W, v, alpha,
                                    b=None, mask=None, values=None,
                                    grad_alpha=None, key_proj=None):
        d = loop_backward("additive", grad_out, query, keys, alpha, W=W, v=v,
                          b=b, mask=mask, values=values,
                          grad_alpha=grad_alpha)
        return tuple(d[n] for n in ["query", "keys", "values", "W", "v",
                                    "b"])

    @staticmethod
    def dot_attention(query, keys, mask=None, values=None, scale=None):
        return loop_forward("dot", query, keys, mask=mask, values=values,
                            scale=scale)

    @staticmethod
    def dot_attention_backward(grad_out, query, keys, alpha, mask=None,
                               values=None, scale=None, grad_alpha=None):
        d = loop_backward("dot", grad_out, query, keys, alpha, mask=mask,
                          values=values, scale=scale, grad_alpha=grad_alpha)
        return tuple(d[n] for n in ["query", "keys", "values"])

    @staticmethod
    def general_attention(query, keys, W, mask=None, values=None,
                          key_proj=None):
        return loop_forward("general", query, keys, W=W, mask=mask,
                            values=values)

    @staticmethod
    def general_attention_backward(grad_out, query, keys, W, alpha,
                                   mask=None, values=None, grad_alpha=None,
                                   key_proj=None):
        d = loop_backward("general", grad_out, query, keys, alpha, W=W,
                          mask=mask, values=values, grad_alpha=grad_alpha)
        return tuple(d[n] for n in ["query", "keys", "values", "W"])

    project_keys = staticmethod(loop_project_keys)
    project_keys_backward = staticmethod(loop_project_keys_backward)


IMPLS = {"c": ac, "reference": ref, "loops": Loops}
GRAD_FIELDS = {"additive": ("query", "keys", "values", "W", "v", "b"),
               "dot": ("query", "keys", "values"),
               "general": ("query", "keys", "values", "W")}
GRAD_TYPES = {"additive": "AdditiveAttentionGrads",
              "dot": "DotAttentionGrads",
              "general": "GeneralAttentionGrads"}


# --------------------------------------------------------------------------
# Problems


def family_mask(rng, lead, Tq, T, kind):
    """A mask for Tq queries (Tq None: one query) of T keys, or None.

    none    no mask
    key     a key mask (..., T): random, one sequence with no valid key
    query   a per-query mask (..., Tq, T): random, one query with no valid
            key, and the last key masked for every query
    causal  np.tril: query i sees the keys up to T - Tq + i
    dead    a key mask with no valid key at all
    one     a key mask with one valid key per sequence
    """
    if kind == "none":
        return None
    if kind == "dead":
        return np.zeros(tuple(lead) + (T,), bool)
    if kind == "one":
        m = np.zeros(tuple(lead) + (T,), bool)
        idx = rng.integers(0, T, size=lead)
        np.put_along_axis(m, np.asarray(idx)[..., None], True, axis=-1)
        return m
    if kind == "key":
        m = rng.random(tuple(lead) + (T,)) < 0.7
        flat = m.reshape(-1, T)
        if flat.shape[0] > 0:
            flat[0, rng.integers(0, T)] = True
        if flat.shape[0] > 1:
            flat[1] = False
        return m
    if kind == "query":
        assert Tq is not None
        m = rng.random(tuple(lead) + (Tq, T)) < 0.7
        flat = m.reshape(-1, T)
        flat[:, 0] = True                          # most queries see a key
        flat[min(1, flat.shape[0] - 1)] = False     # but one sees none
        if T > 2:
            m[..., T - 1] = False                  # a key no query sees
        return m
    if kind == "causal":
        assert Tq is not None
        tri = np.tril(np.ones((Tq, T), bool), k=T - Tq)
        return np.broadcast_to(tri, tuple(lead) + (Tq, T)).copy()
    raise AssertionError(kind)


class FamilyProblem:
    """A random family problem in float64; .cast(dtype) gives its arrays
    in another dtype (the float64 loops then run on the cast values)."""

    def __init__(self, rng, score, lead=(2,), Tq=3, T=5, H=4, Hq=3, Hv=2,
                 A=5, single=False, mask="key", values=True, wscale=1.0):
        kind = KINDS[score]
        if kind == "dot":
            Hq = H
        self.score, self.kind, self.single = score, kind, single
        self.lead, self.Tq, self.T, self.H, self.Hq = tuple(lead), Tq, T, H, Hq
        self.A = A
        qlead = self.lead if single else self.lead + (Tq,)
        self.query = rng.standard_normal(qlead + (Hq,))
        self.keys = rng.standard_normal(self.lead + (T, H))
        self.values = (rng.standard_normal(self.lead + (T, Hv)) if values
                       else None)
        self.Hv = Hv if values else H
        self.W = self.v = self.b = None
        if kind == "additive":
            self.W = rng.standard_normal((A, H + Hq)) / np.sqrt(H + Hq)
            self.v = rng.standard_normal(A) * wscale
            if score == "additive":
                self.b = rng.standard_normal(A) * 0.5
        elif kind == "general":
            self.W = rng.standard_normal((Hq, H)) / np.sqrt(H) * wscale
        self.scale = CUSTOM_SCALE if score == "dot_scale" else None
        self.mask = family_mask(rng, self.lead, None if single else Tq, T,
                                mask)
        self.grad_out = rng.standard_normal(qlead + (self.Hv,))
        self.grad_alpha = rng.standard_normal(qlead + (T,))

    def cast(self, dtype):
        """The float arrays in dtype (None stays None), mask and scale."""
        out = {}
        for n in ["query", "keys", "values", "W", "v", "b", "grad_out",
                  "grad_alpha"]:
            x = getattr(self, n)
            out[n] = None if x is None else x.astype(dtype)
        out["mask"], out["scale"] = self.mask, self.scale
        return out

    def params(self, x):
        """The score's parameters (keywords) from the arrays x."""
        return {n: x[n] for n in PARAMS[self.kind]}

    def masks(self, mod, x):
        """The mask keywords for mod: a per-query mask (..., Tq, T) goes as
        attn_mask= (mask is the key mask only, docs/contract.md 5.1), except
        to the loops, which take either as mask=."""
        m = x["mask"]
        if (mod is not Loops and m is not None and not self.single
                and m.ndim == len(self.lead) + 2):
            return {"mask": None, "attn_mask": m}
        return {"mask": m}

    def forward(self, mod, x, **extra):
        """(out, alpha) of mod's forward of this score on x."""
        fn = getattr(mod, f"{self.kind}_attention")
        return fn(query=x["query"], keys=x["keys"], **self.masks(mod, x),
                  values=x["values"], **self.params(x), **extra)

    def backward(self, mod, x, alpha, with_ga, strip=True, **extra):
        """The gradient tuple of mod's backward of this score on x (with
        strip, a dot/general one without its bias entry, None here)."""
        fn = getattr(mod, f"{self.kind}_attention_backward")
        g = fn(grad_out=x["grad_out"], query=x["query"], keys=x["keys"],
               alpha=alpha, **self.masks(mod, x), values=x["values"],
               grad_alpha=x["grad_alpha"] if with_ga else None,
               **self.params(x), **extra)
        if strip and mod is not Loops and self.kind != "additive":
            # the dot/general tuples end with the gradients of bias,
            # alibi_slopes and sinks (docs/contract.md 5.4), None here: none
            # was given
            n = len(GRAD_FIELDS[self.kind])
            assert all(extra is None for extra in g[n:])
            g = g[:n]
        return g

    def full_mask(self):
        """The mask as (..., Tq, T) booleans (Tq = 1 for one query)."""
        shape = self.lead + (1 if self.single else self.Tq, self.T)
        if self.mask is None:
            return np.ones(shape, bool)
        m = self.mask if self.mask.ndim == len(shape) else \
            self.mask[..., None, :]
        return np.broadcast_to(m, shape)

    def dead_keys(self):
        """(..., T): keys no query may see."""
        return ~self.full_mask().any(axis=-2)

    def dead_queries(self):
        """(..., Tq) or (...,) for one query: queries with no valid key."""
        dead = ~self.full_mask().any(axis=-1)
        return dead[..., 0] if self.single else dead


def f64(x):
    """Every float array of the dict x as float64 (masks, scale, flags as
    they are)."""
    return {n: (a if a is None or n in NOT_FLOAT else
                np.asarray(a, dtype=np.float64)) for n, a in x.items()}


def grad_dict(g, kind):
    """A gradient tuple as a dict keyed by docs/contract.md's field
    names."""
    assert len(g) == len(GRAD_FIELDS[kind]), (len(g), kind)
    return dict(zip(GRAD_FIELDS[kind], g))


# --------------------------------------------------------------------------
# Checks


def check(got, want, dtype, what, tol=None):
    """got is a new ndarray of dtype, want's shape, within tol (TOL)."""
    assert type(got) is np.ndarray, f"{what}: {type(got)}"
    assert got.dtype == np.dtype(dtype), (what, got.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol = TOL[np.dtype(dtype).type] if tol is None else tol
    err = rel_err(got, want)
    assert err <= tol, f"{what}: normwise relative error {err:.3g} > {tol:.3g}"


def check_grads(got, want, dtype, what, same=None):
    """Gradient dicts: None where want is None, else within TOL or
    ILL_FACTOR times the error of `same` (the reference in dtype)."""
    for n, w in want.items():
        if w is None:
            assert got[n] is None, f"{what}: d{n} should be None"
            continue
        tol = TOL[np.dtype(dtype).type]
        if same is not None:
            tol = max(tol, ILL_FACTOR * rel_err(same[n], w))
        check(got[n], w, dtype, f"{what} d{n}", tol)


def as_tuple(res):
    return tuple(res) if isinstance(res, tuple) else (res,)


def run_pair(p, x, with_ga, mod=ac):
    """(out, alpha, gradient dict) of mod on x (alpha from its forward)."""
    out, alpha = p.forward(mod, x)
    g = grad_dict(p.backward(mod, x, alpha, with_ga), p.kind)
    return out, alpha, g


# --------------------------------------------------------------------------
# 1. C and reference against the loops


LEADS = [(), (2,), (2, 3)]
# (one query?, mask kind): a per-query mask needs several queries
CASES = [(True, "none"), (True, "key"), (True, "dead"), (True, "one"),
         (False, "none"), (False, "key"), (False, "query"),
         (False, "causal"), (False, "dead")]


def _lead_id(lead):
    return "lead" + ("x".join(map(str, lead)) if lead else "none")


def _case_id(case):
    return ("q1-" if case[0] else "qN-") + case[1]


def _check_against_loops(p, dtype):
    """Forward and backward (with and without grad_alpha) of the C
    functions in dtype and of the reference in float64 against the loops;
    exact zeros for masked keys and queries with no valid key."""
    x = p.cast(dtype)
    x64 = f64(x)
    want_out, want_alpha = p.forward(Loops, x64)
    r_out, r_alpha = p.forward(ref, x64)
    check(r_out, want_out, np.float64, "reference out")
    check(r_alpha, want_alpha, np.float64, "reference alpha")
    out, alpha = p.forward(ac, x)
    check(out, want_out, dtype, "out")
    check(alpha, want_alpha, dtype, "alpha")

    full = p.full_mask()[..., 0, :] if p.single else p.full_mask()
    assert np.all(alpha[~full] == 0), "masked keys: weight not exactly 0"
    dead_q = p.dead_queries()
    assert np.all(out[dead_q] == 0) and np.all(alpha[dead_q] == 0), \
        "query with no valid key: out, alpha not exactly 0"
    live = alpha[~dead_q].astype(np.float64).sum(axis=-1)
    assert np.all(np.abs(live - 1) <= 8 * p.T * np.finfo(dtype).eps)

    for with_ga in (False, True):
        what = "grad_alpha" if with_ga else "no grad_alpha"
        want = grad_dict(p.backward(Loops, x64, f64({"a": alpha})["a"],
                                    with_ga), p.kind)
        r = grad_dict(p.backward(ref, x64, f64({"a": alpha})["a"],
                                 with_ga), p.kind)
        check_grads(r, want, np.float64, f"reference ({what})")
        same = grad_dict(p.backward(ref, x, alpha, with_ga), p.kind)
        g = grad_dict(p.backward(ac, x, alpha, with_ga), p.kind)
        check_grads(g, want, dtype, f"C ({what})", same)
        # masked keys: exactly zero gradient; dead queries: zero dquery
        dead_k = p.dead_keys()
        assert np.all(g["keys"][dead_k] == 0), "dkeys of a masked key"
        if g["values"] is not None:
            assert np.all(g["values"][dead_k] == 0), "dvalues of masked key"
        assert np.all(g["query"][dead_q] == 0), "dquery of a dead query"
        for n, arr in g.items():
            if arr is not None:
                assert np.all(np.isfinite(arr)), f"d{n} not finite"


@values_param
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("lead", LEADS, ids=_lead_id)
@dtype_param
@score_param
def test_family_matches_loops(score, dtype, lead, case, with_values, rng):
    """Each score, one or several queries, leading axes none/(2,)/(2, 3),
    key, per-query and causal masks (with queries that see no key), values
    given or not: C (in dtype) and reference (float64) == the loops."""
    single, mask = case
    p = FamilyProblem(rng, score, lead, Tq=3, T=5, H=4, Hq=3, Hv=2, A=5,
                      single=single, mask=mask, values=with_values)
    _check_against_loops(p, dtype)


# (lead, Tq, T, H, Hq, Hv, A): sizes from {1, 3, 17, 65}, each in each
# position at least once over the list (Hq = H for the dot score).
ODD_SIZES = [
    ((1,), 1, 1, 1, 1, 1, 1),
    ((3,), 3, 17, 1, 65, 3, 17),
    ((), 17, 3, 65, 1, 17, 3),
    ((1,), 65, 17, 3, 17, 1, 65),
    ((3,), 1, 65, 17, 3, 65, 1),
    ((), 17, 65, 3, 3, 17, 17),
]


def _odd_id(size):
    lead, Tq, T, H, Hq, Hv, A = size
    return (f"B{'x'.join(map(str, lead)) or '-'}-Tq{Tq}-T{T}-H{H}-Hq{Hq}"
            f"-Hv{Hv}-A{A}")


@pytest.mark.parametrize("size", ODD_SIZES, ids=_odd_id)
@dtype_param
@score_param
def test_family_odd_sizes(score, dtype, size):
    """Sizes 1, 3, 17, 65 in every position, per-query masks (one query
    with no valid key, one key no query sees): C and reference == loops."""
    lead, Tq, T, H, Hq, Hv, A = size
    rng = np.random.default_rng(sum(size[1:]) + len(lead))
    p = FamilyProblem(rng, score, lead, Tq, T, H, Hq, Hv, A, single=False,
                      mask="query" if Tq * int(np.prod(lead)) > 1 else "none",
                      values=Hv != 1)
    _check_against_loops(p, dtype)


# --------------------------------------------------------------------------
# 2. Gradients against finite differences (float64, tiny sizes)


def _fd_mask(single):
    """Key mask (3, 4): a full row, a dead row, one valid key; or a
    per-query mask (2, 3, 4): a full query, a dead one, a single key, and
    key 3 of sequence 1 seen by no query."""
    if single:
        return np.array([[1, 0, 1, 1], [0, 0, 0, 0], [0, 0, 1, 0]], bool)
    return np.array([[[1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]],
                     [[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 0, 0]]], bool)


@pytest.mark.parametrize("impl", list(IMPLS))
@ga_param
@values_param
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@score_param
def test_gradients_match_finite_differences(impl, score, single, masked,
                                            with_values, with_ga):
    """Every gradient (query, keys, values, W, v, b) of C, reference and the
    loops equals the central differences of L = sum(out G) [+ sum(alpha
    Ga)] in float64."""
    mod = IMPLS[impl]
    rng = np.random.default_rng(7)
    lead = (3,) if single else (2,)
    p = FamilyProblem(rng, score, lead, Tq=3, T=4, H=3, Hq=2, Hv=2, A=3,
                      single=single, mask="none", values=with_values)
    if masked:
        p.mask = _fd_mask(single)
    x = p.cast(np.float64)

    def loss():
        out, alpha = p.forward(mod, x)
        L = np.sum(out * x["grad_out"])
        if with_ga:
            L += np.sum(alpha * x["grad_alpha"])
        return L

    _, alpha = p.forward(mod, x)
    g = grad_dict(p.backward(mod, x, alpha, with_ga), p.kind)
    for n in GRAD_FIELDS[p.kind]:
        if x[n] is None:
            assert g[n] is None, f"d{n} should be None"
            continue
        num = numerical_grad(loss, x[n])
        assert g[n].shape == num.shape, n
        err = rel_err(g[n], num)
        assert err <= FD_RTOL, f"d{n}: relative error {err:.3g} > {FD_RTOL}"


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("Wkind", ["additive", "general"])
def test_project_keys_backward_matches_finite_differences(impl, Wkind):
    """project_keys_backward equals the FD gradient of sum(P G) for keys and
    W; dW is exactly 0 past the first H columns."""
    mod = IMPLS[impl]
    rng = np.random.default_rng(8)
    keys = rng.standard_normal((2, 3, 3))
    W = rng.standard_normal((4, 5) if Wkind == "additive" else (4, 3))
    G = rng.standard_normal((2, 3, 4))

    def loss():
        return np.sum(mod.project_keys(keys, W) * G)

    dk, dW = mod.project_keys_backward(G, keys, W)
    for name, got, x in [("dkeys", dk, keys), ("dW", dW, W)]:
        err = rel_err(got, numerical_grad(loss, x))
        assert err <= FD_RTOL, f"{name}: relative error {err:.3g}"
    assert np.all(dW[:, 3:] == 0)


# --------------------------------------------------------------------------
# 3. Masks: no valid key, masked keys, NaN/Inf in padding


@dtype_param
@score_param
def test_query_with_no_valid_key_gives_exact_zeros(score, dtype, rng):
    """A query with no valid key: alpha = 0, out = 0, zero gradients (also
    for the parameters when every query is dead), no NaN, no warning."""
    for single in (True, False):
        p = FamilyProblem(rng, score, (2,), 3, 4, 3, 2, 2, 3, single=single,
                          mask="dead")
        x = p.cast(dtype)
        out, alpha, g = run_pair(p, x, True)
        for name, arr in [("out", out), ("alpha", alpha)] + \
                [("d" + n, a) for n, a in g.items() if a is not None]:
            assert arr.dtype == np.dtype(dtype), name
            assert np.all(arr == 0), f"{name} not exactly 0 (single={single})"
        # a lone sequence with no leading axis
        p = FamilyProblem(rng, score, (), 3, 4, 3, 2, 2, 3, single=single,
                          mask="dead")
        out, alpha, g = run_pair(p, p.cast(dtype), True)
        assert np.all(out == 0) and np.all(alpha == 0)
        assert all(np.all(a == 0) for a in g.values() if a is not None)


@dtype_param
@score_param
def test_grad_alpha_on_masked_keys_changes_nothing(score, dtype, rng):
    """grad_alpha at masked positions (where alpha is exactly 0) changes no
    gradient at all."""
    p = FamilyProblem(rng, score, (2,), 3, 5, 4, 3, 2, 5, mask="query")
    x = p.cast(dtype)
    _, alpha = p.forward(ac, x)
    g1 = p.backward(ac, x, alpha, True)
    m = p.full_mask()
    x2 = dict(x, grad_alpha=np.where(m, x["grad_alpha"], 1e6).astype(dtype))
    g2 = p.backward(ac, x2, alpha, True)
    for n, a, b in zip(GRAD_FIELDS[p.kind], g1, g2):
        assert_identical(b, a, f"d{n}")


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf],
                         ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mask", ["key", "query", "one", "dead"])
@values_param
@dtype_param
@score_param
def test_nonfinite_padding_never_reaches_an_output(score, dtype, with_values,
                                                   mask, fill, rng):
    """NaN/Inf in keys and values (and key_proj rows) that no query may see:
    every output and gradient is bit-for-bit that of zero padding."""
    p = FamilyProblem(rng, score, (4,), 3, 5, 3, 2, 2, 4, mask=mask,
                      values=with_values)
    x = p.cast(dtype)
    dead = p.dead_keys()
    assert dead.any()

    def padded(value):
        y = dict(x)
        for n in ("keys", "values"):
            if y[n] is not None:
                y[n] = y[n].copy()
                y[n][dead] = value
        return y

    def run(y, kp_fill=None):
        out, alpha, g = run_pair(p, y, True)
        res = {"out": out, "alpha": alpha}
        res.update({"d" + n: a for n, a in g.items()})
        if p.kind != "dot":
            kp = ac.project_keys(x["keys"], x["W"])     # of the clean keys
            if kp_fill is not None:
                kp[dead] = kp_fill
            o2, a2 = p.forward(ac, y, key_proj=kp)
            g2 = grad_dict(p.backward(ac, y, a2, True, key_proj=kp), p.kind)
            res.update({"out(kp)": o2, "alpha(kp)": a2})
            res.update({"d" + n + "(kp)": a for n, a in g2.items()})
        return res

    clean, dirty = run(padded(0.0)), run(padded(fill), fill)
    for name in clean:
        if clean[name] is None:
            continue
        assert np.all(np.isfinite(clean[name])), name
        assert_identical(dirty[name], clean[name], name)


# --------------------------------------------------------------------------
# 4. Forms that must agree


@pytest.mark.parametrize("H", [1, 3, 17, 64])
@dtype_param
def test_dot_scale_none_is_one_over_sqrt_h(dtype, H, rng):
    """scale=None gives 1/sqrt(H), forward and backward; a custom scale
    is used as given (loops with that scale)."""
    p = FamilyProblem(rng, "dot", (2,), 3, 5, H, H, 2, 1, mask="query")
    x = p.cast(dtype)
    x64 = f64(x)
    for scale in (None, 1 / np.sqrt(H), 2.5, -0.3):
        xs = dict(x, scale=scale)
        out, alpha, g = run_pair(p, xs, True)
        want_out, want_alpha = loop_forward(
            "dot", x64["query"], x64["keys"], mask=p.mask,
            values=x64["values"], scale=1 / np.sqrt(H) if scale is None
            else scale)
        check(out, want_out, dtype, f"out scale={scale}")
        check(alpha, want_alpha, dtype, f"alpha scale={scale}")
    out0, alpha0, g0 = run_pair(p, dict(x, scale=None), True)
    out1, alpha1, g1 = run_pair(p, dict(x, scale=1 / np.sqrt(H)), True)
    tol = TOL[np.dtype(dtype).type]
    assert rel_err(out0, out1) <= tol and rel_err(alpha0, alpha1) <= tol
    for n in g0:
        if g0[n] is not None:
            assert rel_err(g0[n], g1[n]) <= tol, n


@dtype_param
def test_dot_scale_zero_gives_uniform_weights(dtype, rng):
    """scale = 0: every valid key gets the same weight 1/n."""
    p = FamilyProblem(rng, "dot", (2,), 3, 5, 4, 4, 2, 1, mask="query")
    x = p.cast(dtype)
    _, alpha = ac.dot_attention(x["query"], x["keys"], attn_mask=p.mask,
                                values=x["values"],
                                scale=0.0)
    m = p.full_mask()
    n = m.sum(axis=-1, keepdims=True)
    want = np.where(m, 1 / np.maximum(n, 1), 0)
    check(alpha, want, dtype, "alpha")


@pytest.mark.parametrize("lead", LEADS, ids=_lead_id)
@values_param
@dtype_param
@score_param
def test_one_query_axis_equals_single_query(score, dtype, with_values, lead,
                                            rng):
    """query (..., 1, Hq) gives the single-query results with the query
    axis added, forward and backward (mask (..., T) and (..., 1, T))."""
    p = FamilyProblem(rng, score, lead, 1, 6, 4, 3, 2, 5, single=True,
                      mask="key", values=with_values)
    x = p.cast(dtype)
    out, alpha, g = run_pair(p, x, True)
    tol = TOL[np.dtype(dtype).type]
    p1 = copy.copy(p)
    p1.single = False
    for mask in (p.mask, p.mask[..., None, :]):
        x1 = dict(x, query=x["query"][..., None, :], mask=mask,
                  grad_out=x["grad_out"][..., None, :],
                  grad_alpha=x["grad_alpha"][..., None, :])
        out1, alpha1 = p1.forward(ac, x1)
        g1 = grad_dict(p1.backward(ac, x1, alpha1, True), p.kind)
        assert out1.shape == out[..., None, :].shape
        assert alpha1.shape == alpha[..., None, :].shape
        assert rel_err(out1[..., 0, :], out) <= tol
        assert rel_err(alpha1[..., 0, :], alpha) <= tol
        assert g1["query"].shape == x1["query"].shape
        assert rel_err(g1["query"][..., 0, :], g["query"]) <= tol
        for n in g:
            if n != "query":
                if g[n] is None:
                    assert g1[n] is None, n
                else:
                    assert rel_err(g1[n], g[n]) <= tol, n


# a mask's leading axes of size 1 stand for the whole batch axis
BROADCAST_MASKS = {"key (1, 1, T)": (1, 1, None),
                   "key (2, 1, T)": (2, 1, None),
                   "query (1, 1, Tq, T)": (1, 1, 4),
                   "query (1, 3, Tq, T)": (1, 3, 4),
                   "query (2, 1, Tq, T)": (2, 1, 4)}


@pytest.mark.parametrize("mask_id", list(BROADCAST_MASKS))
@dtype_param
@score_param
def test_mask_leading_axes_of_size_one_broadcast(score, dtype, mask_id,
                                                 rng):
    """A mask whose leading axes are 1 (e.g. one causal (1, 1, Tq, T) mask
    for a whole (2, 3) batch) gives the bits of its broadcast copy, forward
    and backward; the result matches the loops."""
    b0, b1, Tq = BROADCAST_MASKS[mask_id]
    p = FamilyProblem(rng, score, (2, 3), 4, 6, 3, 2, 2, 3, mask="none")
    x = p.cast(dtype)
    if Tq is None:
        small = rng.random((b0, b1, 6)) < 0.6
        small[..., 0] = False
        small[..., 1] = True
        full = np.broadcast_to(small, (2, 3, 6)).copy()
    else:
        small = np.broadcast_to(np.tril(np.ones((4, 6), bool), k=1),
                                (b0, b1, 4, 6)).copy()
        small[0, 0, 0] = False                  # a query with no key
        full = np.broadcast_to(small, (2, 3, 4, 6)).copy()
    out, alpha, g = run_pair(p, dict(x, mask=small), True)
    out_f, alpha_f, g_f = run_pair(p, dict(x, mask=full), True)
    assert_identical(out, out_f, "out")
    assert_identical(alpha, alpha_f, "alpha")
    for n in g:
        assert_identical(g[n], g_f[n], "d" + n)
    want_out, want_alpha = p.forward(Loops, dict(f64(x), mask=full))
    check(out, want_out, dtype, "out")
    check(alpha, want_alpha, dtype, "alpha")


@pytest.mark.parametrize("impl", ["c", "reference"])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead", LEADS, ids=_lead_id)
@dtype_param
def test_context_attention_is_additive_attention_on_the_mean(
        dtype, lead, bias, mask_kind, impl, rng):
    """additive_attention(mean_context(h), h, W, v, b, mask) equals
    context_attention(h, W, v, b, mask) (W = [W_h | W_c] is [W_k | W_q]
    with Hq = H); its gradients plus the path through the mean,
    dh = g.keys + mean_context_backward(g.query), equal the layer's."""
    if impl == "reference" and dtype != np.float64:
        pytest.skip("the reference is checked in float64")
    mod = IMPLS[impl]
    p = Problem(rng, lead, 7, 4, 5, bias=bias, mask=mask_kind)
    x = p.cast(dtype)
    h, W, v, b, mask = x["h"], x["W"], x["v"], x["b"], x["mask"]
    c = mod.mean_context(h, mask=mask)
    out, alpha = mod.additive_attention(c, h, W, v, b=b, mask=mask)
    out2, alpha2 = mod.context_attention(h, W, v, b=b, mask=mask)
    f64 = [None if a is None else a.astype(np.float64) for a in (h, W, v, b)]
    w64 = ref.context_attention(*f64[:3], b=f64[3], mask=mask)
    tol = TOL[np.dtype(dtype).type]
    for name, got, lay, want in [("out", out, out2, w64[0]),
                                 ("alpha", alpha, alpha2, w64[1])]:
        check(got, want, dtype, name)
        assert rel_err(got, lay) <= 2 * tol, name
    for ga in (None, x["grad_alpha"]):
        g = mod.additive_attention_backward(x["grad_out"], c, h, W, v, alpha,
                                            b=b, mask=mask, grad_alpha=ga)
        gl = mod.context_attention_backward(x["grad_out"], h, W, v, alpha, b=b,
                                            mask=mask, grad_alpha=ga)
        assert g[2] is None                          # no values given
        dh = g[1] + mod.mean_context_backward(g[0], h, mask=mask)
        want = ref.context_attention_backward(
            *[a.astype(np.float64) for a in (x["grad_out"], h, W, v, alpha)],
            b=f64[3], mask=mask,
            grad_alpha=None if ga is None else ga.astype(np.float64))
        same = ref.context_attention_backward(x["grad_out"], h, W, v, alpha,
                                              b=b, mask=mask, grad_alpha=ga)
        for name, got, lay, w, s in [("dh", dh, gl[0], want[0], same[0]),
                                     ("dW", g[3], gl[1], want[1], same[1]),
                                     ("dv", g[4], gl[2], want[2], same[2]),
                                     ("db", g[5], gl[3], want[3], same[3])]:
            if w is None:
                assert got is None and lay is None, name
                continue
            t = max(tol, ILL_FACTOR * rel_err(s, w))
            check(got, w, dtype, name, t)
            check(lay, w, dtype, name + " (layer)", t)
            if mask is not None:
                assert np.all(dh[~mask] == 0), "dh of masked items"


# --------------------------------------------------------------------------
# 5. project_keys and key_proj


@pytest.mark.parametrize("lead", LEADS, ids=_lead_id)
@pytest.mark.parametrize("Wkind", ["additive", "general"])
@dtype_param
def test_project_keys_matches_loops(dtype, Wkind, lead, rng):
    """project_keys = W[:, :H] k_t and its backward (dW zero past the
    first H columns), C in dtype and reference in float64, vs the loops."""
    T, H, P = 17, 3, 5
    keys = rng.standard_normal(lead + (T, H)).astype(dtype)
    W = rng.standard_normal((P, H + 2) if Wkind == "additive" else (P, H))
    W = W.astype(dtype)
    G = rng.standard_normal(lead + (T, P)).astype(dtype)
    want = loop_project_keys(keys, W)
    check(ref.project_keys(f64({"k": keys})["k"], W.astype(np.float64)),
          want, np.float64, "reference P")
    check(ac.project_keys(keys, W), want, dtype, "P")
    wk, wW = loop_project_keys_backward(G, keys, W)
    rk, rW = ref.project_keys_backward(*[a.astype(np.float64)
                                         for a in (G, keys, W)])
    check(rk, wk, np.float64, "reference dkeys")
    check(rW, wW, np.float64, "reference dW")
    dk, dW = ac.project_keys_backward(G, keys, W)
    check(dk, wk, dtype, "dkeys")
    check(dW, wW, dtype, "dW")
    assert np.all(dW[:, H:] == 0)


KP_CASES = [(True, "key"), (False, "query"), (False, "causal"),
            (False, "none")]


@pytest.mark.parametrize("case", KP_CASES, ids=_case_id)
@values_param
@dtype_param
@pytest.mark.parametrize("score", ["additive", "additive_nobias", "general"])
def test_key_proj_gives_the_same_results(score, dtype, with_values, case,
                                         rng):
    """key_proj=project_keys(keys, W): forward and every gradient (keys and
    W included) as without it, C and reference, against the loops."""
    single, mask = case
    p = FamilyProblem(rng, score, (2,), 3, 6, 4, 3, 2, 5, single=single,
                      mask=mask, values=with_values)
    x = p.cast(dtype)
    x64 = f64(x)
    out, alpha, g = run_pair(p, x, True)
    kp = ac.project_keys(x["keys"], x["W"])
    out_k, alpha_k = p.forward(ac, x, key_proj=kp)
    g_k = grad_dict(p.backward(ac, x, alpha, True, key_proj=kp), p.kind)
    want_out, want_alpha = p.forward(Loops, x64)
    check(out_k, want_out, dtype, "out with key_proj")
    check(alpha_k, want_alpha, dtype, "alpha with key_proj")
    want = grad_dict(p.backward(Loops, x64, alpha.astype(np.float64), True),
                     p.kind)
    same = grad_dict(p.backward(ref, x, alpha, True), p.kind)
    check_grads(g_k, want, dtype, "C with key_proj", same)
    tol = TOL[np.dtype(dtype).type]
    assert rel_err(out_k, out) <= tol and rel_err(alpha_k, alpha) <= tol
    for n in g:
        if g[n] is not None:
            assert rel_err(g_k[n], g[n]) <= ILL_FACTOR * tol, n
    # the reference, float64
    kp64 = ref.project_keys(x64["keys"], x64["W"])
    r_out, r_alpha = p.forward(ref, x64, key_proj=kp64)
    check(r_out, want_out, np.float64, "reference out with key_proj")
    r = grad_dict(p.backward(ref, x64, alpha.astype(np.float64), True,
                             key_proj=kp64), p.kind)
    check_grads(r, want, np.float64, "reference with key_proj")


# --------------------------------------------------------------------------
# 6. Gradient tuples


@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@values_param
@score_param
def test_gradient_named_tuples(score, with_values, single, rng):
    """The backward returns its named tuple: fields in docs/contract.md's
    order (a dot/general one ending with bias, then alibi_slopes and sinks,
    issue 25), shapes of the inputs,
    values None iff not given, b (bias) None iff no bias."""
    p = FamilyProblem(rng, score, (2,), 3, 5, 4, 3, 2, 5, single=single,
                      values=with_values)
    x = p.cast(np.float64)
    _, alpha = p.forward(ac, x)
    g = p.backward(ac, x, alpha, False, strip=False)
    cls = getattr(ac, GRAD_TYPES[p.kind])
    fields = GRAD_FIELDS[p.kind] + (() if p.kind == "additive"
                                    else ("bias", "alibi_slopes", "sinks"))
    assert isinstance(g, cls) and isinstance(g, tuple)
    assert type(g).__name__ == GRAD_TYPES[p.kind]
    assert g._fields == fields
    if p.kind != "additive":
        assert g.bias is None                      # no bias given
        bias = rng.standard_normal(x["grad_alpha"].shape[:-1][1:] + (5,))
        _, alpha_b = p.forward(ac, x, bias=bias)
        gb = p.backward(ac, x, alpha_b, False, strip=False, bias=bias)
        assert type(gb) is cls and type(gb.bias) is np.ndarray
        assert gb.bias.shape == bias.shape         # summed back
    for i, n in enumerate(g._fields):
        assert getattr(g, n) is g[i]
        want = x.get(n)
        if want is None:
            assert getattr(g, n) is None, f"{n} should be None"
        else:
            assert type(getattr(g, n)) is np.ndarray, n
            assert getattr(g, n).shape == np.shape(want), n
    assert (g.values is None) == (not with_values)
    if p.kind == "additive":
        assert (g.b is None) == (score == "additive_nobias")


@pytest.mark.parametrize("fn,n", [("additive_attention", 2),
                                  ("dot_attention", 2),
                                  ("general_attention", 2),
                                  ("project_keys_backward", 2)])
def test_pair_results(fn, n, rng):
    """The forwards and project_keys_backward return a plain 2-tuple."""
    res = getattr(ac, fn)(**make_args(fn, rng))
    assert type(res) is tuple and len(res) == n
    assert all(type(a) is np.ndarray for a in res)


# --------------------------------------------------------------------------
# 7. Input handling: dtypes, errors, inputs never modified
#
# Arguments of every function: attention_c.testing.SIGNATURES.

FUNCS = FAMILY_FUNCTIONS
# Arguments that are not float arrays (kept as they are by the casts).
NOT_FLOAT = {"mask", "attn_mask", "scale", "key_proj", "causal", "dropout",
             "seed", "return_weights", "window", "softcap", "cu_seqlens_q",
             "cu_seqlens_k",
             # float, but cast to the call's dtype (never choosing it), and
             # left out by make_args: tests/kernels/test_variants_kernel.py
             "alibi_slopes", "sinks", "sharpness"}
# Float arrays make_args leaves out (None): the backward gets alpha.
LEFT_NONE = {"key_proj", "out", "lse"}


def params_of(fn):
    req, opt = SIGNATURES[fn]
    return req + opt


def float_args(fn):
    """The float array arguments make_args fills (key_proj, out, lse left
    out)."""
    return [a for a in params_of(fn) if a not in NOT_FLOAT | LEFT_NONE]


def fn_kind(fn):
    return fn.split("_")[0]


def make_args(fn, rng, dtype=np.float64, lead=(3,), single=False, T=5,
              key_proj=False):
    """Keyword arguments of fn: every optional array given (key_proj only
    when asked): a key mask, for several queries a per-query attn_mask
    too, for dot/general a finite bias; the flags at their defaults (no
    out/lse: the backward gets alpha), in dtype."""
    kind = fn_kind(fn)
    if kind == "project":
        keys = rng.standard_normal(lead + (T, 4))
        W = rng.standard_normal((6, 7))
        args = {"keys": keys, "W": W}
        if fn == "project_keys_backward":
            args["grad_proj"] = rng.standard_normal(lead + (T, 6))
        return {n: args[n].astype(dtype) for n in params_of(fn)}
    score = {"additive": "additive", "dot": "dot_scale", "cosine": "dot_scale",
             "general": "general", "location": "general"}[kind]
    p = FamilyProblem(rng, score, lead, 2, T, 4, 3, 2, 6, single=single,
                      mask="key" if single else "query")
    x = f64(p.cast(np.float64))
    if single:
        x["attn_mask"] = None
    else:
        x["attn_mask"] = x["mask"]
        x["mask"] = family_mask(rng, lead, None, T, "key")
        x["mask"].reshape(-1, T)[:, 0] = True     # attn_mask's live key
    if kind not in ("additive", "location"):
        x["bias"] = rng.standard_normal(
            lead + (() if single else (2,)) + (T,))
    if kind == "cosine":                # a sharpness per query position
        x["sharpness"] = 1 + rng.random(lead + (() if single else (2,)))
    if kind == "location":              # two more positions than T
        x["W"] = rng.standard_normal((T + 2, x["query"].shape[-1]))
        x["b"] = rng.standard_normal(T + 2)
    x.update(causal=False, dropout=0.0, seed=None, return_weights=True,
             out=None, lse=None)
    fwd = {n: x.get(n) for n in params_of(f"{kind}_attention")}
    _, x["alpha"] = getattr(ref, f"{kind}_attention")(**fwd)
    if key_proj and kind in ("additive", "general"):
        x["key_proj"] = ref.project_keys(x["keys"], x["W"])
    out = {}
    for n in params_of(fn):
        if n == "key_proj" and not key_proj:
            continue
        a = x.get(n)
        out[n] = a if a is None or n in NOT_FLOAT else a.astype(dtype)
    return out


def call(fn, kwargs):
    return getattr(ac, fn)(**kwargs)


FN_FLOAT_ARGS = [(fn, a) for fn in FUNCS for a in float_args(fn)]


def _pair_id(pair):
    return "-".join(pair)


def call_ref(fn, args, single):
    """The reference's fn on args (the same arguments as the C call's), as
    a tuple."""
    return as_tuple(getattr(ref, fn)(**args))


@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@dtype_param
@pytest.mark.parametrize("fn", FUNCS)
def test_native_dtype_preserved(fn, dtype, single, rng):
    """float32 in -> float32 out, float64 -> float64, values right."""
    args = make_args(fn, rng, dtype, single=single)
    got = as_tuple(call(fn, args))
    want = call_ref(fn, f64(args), single)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"output {i}"
            continue
        same = call_ref(fn, args, single)[i]
        tol = max(TOL[np.dtype(dtype).type], ILL_FACTOR * rel_err(same, w))
        check(g, w, dtype, f"{fn} output {i}", tol)


@pytest.mark.parametrize("odd", ["float64_among_float32",
                                 "float32_among_float64"])
@pytest.mark.parametrize("fn_arg", FN_FLOAT_ARGS, ids=_pair_id)
def test_mixed_precision_promotes_to_float64(fn_arg, odd, rng):
    """One argument in the other float dtype: computes in float64, bit for
    bit the all-float64 call."""
    fn, arg = fn_arg
    base, other = ((np.float32, np.float64) if odd.startswith("float64")
                   else (np.float64, np.float32))
    args = make_args(fn, rng, base)
    args[arg] = args[arg].astype(other)
    want = call(fn, {n: a if n in NOT_FLOAT or a is None else
                     a.astype(np.float64) for n, a in args.items()})
    got = call(fn, args)
    assert all(g is None or g.dtype == np.float64 for g in as_tuple(got))
    assert_all_identical(got, want, f"{fn} with {arg} {odd}")


@pytest.mark.parametrize("itype", [np.int64, np.int32, np.uint8],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", FUNCS)
def test_integer_inputs_compute_in_float64(fn, itype, rng):
    """Integer arrays compute in float64: the float64 call, bit for bit."""
    args = make_args(fn, rng)
    ints = {n: (a if n in NOT_FLOAT or a is None else
                rng.integers(0, 3, size=a.shape).astype(itype))
            for n, a in args.items()}
    if "alpha" in ints:
        ints["alpha"] = args["alpha"]         # weights must be a softmax
    want = call(fn, {n: a if n in NOT_FLOAT or a is None else
                     a.astype(np.float64) for n, a in ints.items()})
    got = call(fn, ints)
    assert all(g is None or g.dtype == np.float64 for g in as_tuple(got))
    assert_all_identical(got, want, f"{fn} with {np.dtype(itype).name}")


@pytest.mark.parametrize("dtype", HALF_DTYPES,
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fn", FUNCS)
def test_half_computes_in_float32(fn, dtype, rng):
    """float16 and bfloat16 inputs compute in float32 and come back in
    their dtype: the float32 call's results rounded once."""
    args = make_args(fn, rng, dtype)
    want = call(fn, {n: a if n in NOT_FLOAT or a is None else
                     a.astype(np.float32) for n, a in args.items()})
    assert_rounded(call(fn, args), want, dtype, f"{fn} {np.dtype(dtype)}")


@pytest.mark.parametrize("dtype", HALF_DTYPES,
                         ids=lambda d: np.dtype(d).name)
def test_half_weights_of_valid_items_never_zero(dtype):
    """A valid item's weight is positive in 16 bits too: float32's floor
    (its smallest normal) rounds to 0 in float16, so a float16 weight is
    at least float16's smallest subnormal; zeros stay the masked items,
    and the backwards given the weights take them."""
    x = np.array([[65504, -65504, 0, 65504]], dtype)
    alpha = ac.masked_softmax(x, mask=np.array([[1, 1, 1, 0]], bool))
    assert alpha.dtype == dtype
    assert (alpha[0, :3] > 0).all() and alpha[0, 3] == 0, alpha
    if np.dtype(dtype) == np.float16:
        assert alpha[0, 1] == np.float16(2.0**-24)
    h = np.array([[[4., 0.], [-4., 0.], [0., 0.], [1., 0.]]], dtype)
    W = np.array([[1., 0, 0, 0], [0, 0, 0, 0]], dtype)
    v = np.array([20., 0.], dtype)
    out, alpha = ac.context_attention(h, W, v)
    assert (alpha > 0).all(), alpha
    grads = ac.context_attention_backward(np.ones_like(out), h, W, v, alpha)
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads
               if g is not None)


@pytest.mark.parametrize("fn", ["dot_attention", "general_attention"])
def test_half_lse_stays_float32(fn, rng):
    """The log-sum-exp of a 16-bit call is float32, the out 16-bit."""
    args = make_args(fn, rng, np.float16)
    args["return_weights"] = False
    want = call(fn, {n: a if n in NOT_FLOAT or a is None else
                     a.astype(np.float32) for n, a in args.items()})
    got = call(fn, args)
    assert got[0].dtype == np.float16 and got[1].dtype == np.float32
    assert_rounded(got, want, np.float16, fn, lse=1)


def test_mixed_half_dtypes_compute_in_float32(rng):
    """float16 with bfloat16 (which NumPy cannot promote) computes and
    returns float32, as PyTorch promotes them; with float64, float64."""
    if len(HALF_DTYPES) < 2:
        pytest.skip("ml_dtypes is not installed")
    args = make_args("dot_attention", rng, np.float16)
    args["keys"] = args["keys"].astype(HALF_DTYPES[1])
    want = call("dot_attention", {
        n: a if n in NOT_FLOAT or a is None else a.astype(np.float32)
        for n, a in args.items()})
    assert_all_identical(call("dot_attention", args), want, "mixed")
    args["values"] = args["values"].astype(np.float64)
    assert all(g.dtype == np.float64
               for g in call("dot_attention", args))


@pytest.mark.parametrize("kind", ["complex", "bool", "object"])
@pytest.mark.parametrize("fn_arg", FN_FLOAT_ARGS, ids=_pair_id)
def test_unsupported_dtype_raises_type_error(fn_arg, kind, rng):
    """Complex, bool or object data: TypeError naming the argument."""
    fn, arg = fn_arg
    args = make_args(fn, rng)
    x = args[arg]
    args[arg] = {"complex": x.astype(np.complex128), "bool": x > 0,
                 "object": x.astype(object)}[kind]
    with pytest.raises(TypeError, match=rf"^{arg} has dtype "
                       rf"{re.escape(str(args[arg].dtype))}"):
        call(fn, args)


@pytest.mark.parametrize("name", ["float8_e5m2", "float8_e4m3fn", "int4",
                                  "longdouble"])
def test_other_small_or_wide_dtypes_refused_alike(name, rng):
    """ml_dtypes' 8-bit floats (float8_e5m2 says NumPy kind 'f', the
    others 'V'), its int4 and long double: refused alike, the accepted
    dtypes named."""
    if name == "longdouble":
        if np.dtype(np.longdouble).itemsize <= 8:
            pytest.skip("long double is double here")
        dtype = np.dtype(np.longdouble)
    else:
        dtype = np.dtype(getattr(pytest.importorskip("ml_dtypes"), name))
    x = rng.standard_normal((2, 3, 4)).astype(dtype)
    with pytest.raises(TypeError, match=rf"^query has dtype {dtype}.*"
                       rf"accepts float16, bfloat16 \(ml_dtypes\), "
                       rf"float32, float64 or integer input"):
        ac.dot_attention(x, x)


@pytest.mark.parametrize("mdtype", [np.int64, np.uint8, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@pytest.mark.parametrize("fn", [f for f in FUNCS if "mask" in params_of(f)])
def test_non_boolean_mask_raises_type_error(fn, single, mdtype, rng):
    """A mask of int or float dtype: TypeError naming mask."""
    args = make_args(fn, rng, single=single)
    args["mask"] = args["mask"].astype(mdtype)
    with pytest.raises(TypeError, match=rf"^mask must be a boolean array.*"
                       rf"{np.dtype(mdtype).name}"):
        call(fn, args)


def shape_error(names, own, others):
    """Regex: the message starts with one of names and shows the shape own
    and at least one of the shapes others."""
    names = names if isinstance(names, (list, tuple)) else [names]
    alts = "|".join(re.escape(str(tuple(s))) for s in others)
    return (rf"(?s)^(?:{'|'.join(names)})\b"
            rf"(?=.*{re.escape(str(tuple(own)))})(?=.*(?:{alts}))")


def _grow(x, axis=-1, by=1):
    pad = list(x.shape)
    pad[axis] = by
    return np.concatenate([x, np.zeros(pad, x.dtype)], axis=axis)


def bad_cases():
    """(id, fns, make(args) -> (bad args, regex)): each a shape error."""
    cases = []

    def add(cid, fns, make):
        cases.extend((f"{fn}-{cid}", fn, make) for fn in fns)

    fwd_bwd = {k: [f"{k}_attention", f"{k}_attention_backward"]
               for k in ("additive", "dot", "general")}
    every = sum(fwd_bwd.values(), [])
    wfns = fwd_bwd["additive"] + fwd_bwd["general"]

    def query_width(a):
        a["query"] = _grow(a["query"])
        return a, shape_error(["query", "W"], a["query"].shape,
                              [a["keys"].shape] + ([a["W"].shape]
                                                   if "W" in a else []))
    add("query_width", every, query_width)

    def w_width(a):
        a["W"] = _grow(a["W"])
        return a, shape_error("W", a["W"].shape,
                              [a["keys"].shape, a["query"].shape])
    add("W_columns", wfns, w_width)

    def w_rows_general(a):
        # W (Hq + 1, H): blamed on W or on the query it does not fit
        a["W"] = _grow(a["W"], axis=0)
        return a, shape_error(["W", "query"], a["W"].shape,
                              [a["query"].shape])
    add("W_rows", fwd_bwd["general"], w_rows_general)

    def w_rows_additive(a):
        # W (A + 1, H + Hq): blamed on W or on v, which has A items
        a["W"] = _grow(a["W"], axis=0)
        return a, shape_error(["W", "v"], a["W"].shape, [a["v"].shape])
    add("W_rows", fwd_bwd["additive"], w_rows_additive)

    def w_ndim(a):
        a["W"] = a["W"][0]
        return a, shape_error("W", a["W"].shape,
                              [a["keys"].shape, a["query"].shape])
    add("W_1d", wfns, w_ndim)

    def values_T(a):
        a["values"] = _grow(a["values"], axis=-2)
        return a, shape_error("values", a["values"].shape, [a["keys"].shape])
    add("values_T", every, values_T)

    def values_lead(a):
        a["values"] = a["values"][:-1]
        return a, shape_error("values", a["values"].shape, [a["keys"].shape])
    add("values_lead", every, values_lead)

    def target(a, per_query=True):
        """The (..., [Tq,] T) shape a mask or bias broadcasts to."""
        return a["query"].shape[:-1] + a["keys"].shape[-2:-1] \
            if per_query else a["keys"].shape[:-1]

    def mask_T(a):
        a["mask"] = _grow(a["mask"])
        return a, shape_error("mask", a["mask"].shape,
                              [a["keys"].shape, a["query"].shape,
                               target(a, False)])
    add("mask_T", every, mask_T)

    def mask_lead(a):
        a["mask"] = _grow(a["mask"], axis=-2)
        return a, shape_error("mask", a["mask"].shape,
                              [a["keys"].shape, a["query"].shape,
                               target(a, False)])
    add("mask_lead", every, mask_lead)

    def per_query_mask(a):
        # a per-query mask given as mask=: refused, pointing to attn_mask
        a["mask"], a["attn_mask"] = a["attn_mask"], None
        return a, (rf"^mask has shape {re.escape(str(a['mask'].shape))}: "
                   r"mask is the key mask \(\.\.\., T\).*use attn_mask=")
    add("per_query_mask", every, per_query_mask)

    def attn_mask_T(a):
        a["attn_mask"] = _grow(a["attn_mask"])
        return a, shape_error("attn_mask", a["attn_mask"].shape,
                              [target(a)])
    add("attn_mask_T", every, attn_mask_T)

    def attn_mask_Tq(a):
        a["attn_mask"] = _grow(a["attn_mask"], axis=-2)
        return a, shape_error("attn_mask", a["attn_mask"].shape,
                              [target(a)])
    add("attn_mask_Tq", every, attn_mask_Tq)

    def attn_mask_lead(a):
        # an axis more than query and keys have: never added
        a["attn_mask"] = a["attn_mask"][None]
        return a, shape_error("attn_mask", a["attn_mask"].shape,
                              [target(a)])
    add("attn_mask_lead", every, attn_mask_lead)

    def bias_T(a):
        a["bias"] = _grow(a["bias"])
        return a, shape_error("bias", a["bias"].shape, [target(a)])
    add("bias_T", fwd_bwd["dot"] + fwd_bwd["general"], bias_T)

    def bias_Tq(a):
        a["bias"] = _grow(a["bias"], axis=-2)
        return a, shape_error("bias", a["bias"].shape, [target(a)])
    add("bias_Tq", fwd_bwd["dot"] + fwd_bwd["general"], bias_Tq)

    def v_size(a):
        a["v"] = _grow(a["v"])
        return a, shape_error("v", a["v"].shape, [a["W"].shape])
    add("v_size", fwd_bwd["additive"], v_size)

    def b_size(a):
        a["b"] = _grow(a["b"])
        return a, shape_error("b", a["b"].shape, [a["W"].shape])
    add("b_size", fwd_bwd["additive"], b_size)

    def grad_out(a):
        a["grad_out"] = _grow(a["grad_out"])
        return a, shape_error("grad_out", a["grad_out"].shape,
                              [a["query"].shape, a["values"].shape,
                               a["keys"].shape])
    add("grad_out", [f for f in every if f.endswith("backward")], grad_out)

    def alpha(a):
        a["alpha"] = _grow(a["alpha"])
        return a, shape_error("alpha", a["alpha"].shape,
                              [a["keys"].shape, a["query"].shape])
    add("alpha", [f for f in every if f.endswith("backward")], alpha)

    def grad_alpha(a):
        a["grad_alpha"] = _grow(a["grad_alpha"])
        return a, shape_error("grad_alpha", a["grad_alpha"].shape,
                              [a["keys"].shape, a["query"].shape,
                               a["alpha"].shape])
    add("grad_alpha", [f for f in every if f.endswith("backward")],
        grad_alpha)

    def keys_1d(a):
        a["keys"] = a["keys"][0, 0]
        return a, shape_error(["keys", "query"], a["keys"].shape,
                              [a["keys"].shape])
    add("keys_1d", every, keys_1d)

    def query_ndim(a):
        a["query"] = a["query"][None, None]
        return a, shape_error("query", a["query"].shape, [a["keys"].shape])
    add("query_ndim", every, query_ndim)

    def key_proj(a):
        a["key_proj"] = _grow(a["key_proj"])
        return a, shape_error("key_proj", a["key_proj"].shape,
                              [a["keys"].shape, a["W"].shape])
    add("key_proj", wfns, key_proj)

    def pk_w(a):
        a["W"] = a["W"][:, :3]
        return a, shape_error("W", a["W"].shape, [a["keys"].shape])
    add("W_too_narrow", ["project_keys", "project_keys_backward"], pk_w)

    def pk_grad(a):
        a["grad_proj"] = _grow(a["grad_proj"])
        return a, shape_error("grad_proj", a["grad_proj"].shape,
                              [a["keys"].shape, a["W"].shape])
    add("grad_proj", ["project_keys_backward"], pk_grad)
    return cases


BAD_CASES = [pytest.param(*c, id=c[0]) for c in bad_cases()]


@pytest.mark.parametrize("cid,fn,make", BAD_CASES)
def test_bad_shape_raises_value_error(cid, fn, make, rng):
    """Each shape that does not fit: ValueError naming the argument and
    both shapes; the next good call gives the same bits as before."""
    kp = cid.endswith("-key_proj")            # else no key_proj to blame
    args = make_args(fn, rng, key_proj=kp)
    args32 = make_args(fn, rng, np.float32, key_proj=kp)
    first, first32 = call(fn, args), call(fn, args32)
    bad, pattern = make({n: a for n, a in args.items()})
    with pytest.raises(ValueError, match=pattern):
        call(fn, bad)
    assert_all_identical(call(fn, args), first, f"{fn} after the bad call")
    assert_all_identical(call(fn, args32), first32, f"{fn} float32 after")


@pytest.mark.parametrize("fn", [f for f in FUNCS if "mask" in params_of(f)])
def test_per_query_mask_with_one_query_raises(fn, rng):
    """A (..., Tq, T) mask given with a single query (..., Hq): ValueError
    naming mask with its shape and the keys' (..., T); attn_mask or
    causal with a single query: ValueError (they need several)."""
    args = make_args(fn, rng, single=True)
    good = call(fn, args)
    keys = args["keys" if "keys" in args else "values"]   # location: values
    bad = dict(args, mask=np.ones(keys.shape[:-2] + (2, 5), bool))
    with pytest.raises(ValueError, match=shape_error(
            "mask", bad["mask"].shape,
            [args["query"].shape, keys.shape, keys.shape[:-1]])):
        call(fn, bad)
    for kw in ({"attn_mask": np.ones(keys.shape[:-1], bool)},
               {"attn_mask": np.ones(keys.shape[:-2] + (2, 5), bool)},
               {"causal": True}):
        name = list(kw)[0]
        if name not in params_of(fn):
            continue
        with pytest.raises(ValueError, match=rf"^{fn}: {name} needs several "
                           r"queries .*through mask="):
            call(fn, dict(args, **kw))
    assert_all_identical(call(fn, args), good, fn)


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)], ids=_lead_id)
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@pytest.mark.parametrize("fn", FUNCS)
def test_zero_keys_raise_value_error(fn, single, lead, rng):
    """T = 0: ValueError naming keys (or values, mask) and its shape."""
    if single and fn_kind(fn) == "project":
        pytest.skip("no query")
    args = make_args(fn, rng, lead=lead, single=single)
    good = call(fn, args)
    bad = {}
    for n, a in args.items():
        if n in ("keys", "values", "grad_proj"):
            a = a[..., :0, :]
        elif n in ("mask", "attn_mask", "bias", "alpha", "grad_alpha"):
            a = None if a is None else a[..., :0]
        bad[n] = a
    with pytest.raises(ValueError, match=r"(?s)^(?:keys|values|mask|"
                       r"attn_mask|bias|alpha|grad_proj)\b.*T = 0"):
        call(fn, bad)
    assert_all_identical(call(fn, args), good, fn)


@pytest.mark.parametrize("fn", FUNCS)
def test_zero_queries_give_empty_results_and_zero_gradients(fn, rng):
    """Tq = 0 (several queries, none): no kernel runs; every output has
    its shape with the query axis empty, and the gradients of everything
    else are exactly 0 (nothing depends on them)."""
    if fn_kind(fn) == "project":
        pytest.skip("no query")
    args = make_args(fn, rng, lead=(2,), single=False)
    empty = {}
    for n, a in args.items():
        if n in ("query", "grad_out", "alpha", "grad_alpha", "out", "lse",
                 "attn_mask", "bias", "sharpness") and a is not None and (
                    np.ndim(a) >= 2 or n == "lse"):
            a = a[:, :0]
        empty[n] = a
    res = call(fn, empty)
    res = res if isinstance(res, tuple) else (res,)
    for x in res:
        if x is None:
            continue
        assert np.isfinite(x).all()
        if x.ndim >= 2 and x.shape[1] == 0:
            continue                        # the queries' results: empty
        assert not np.any(x), f"{fn}: a gradient is not 0"


def _strided(x):
    big = np.zeros(x.shape[:-1] + (2 * x.shape[-1] + 1,), x.dtype)
    big[..., 1::2] = x
    y = big[..., 1::2]
    assert x.shape[-1] == 1 or not y.flags.c_contiguous
    return y


def _readonly(x):
    y = x.copy()
    y.flags.writeable = False
    return y


VARIANTS = ["float64", "float32", "mixed", "strided", "readonly",
            "fortran"]


@pytest.mark.parametrize("kind", VARIANTS)
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@pytest.mark.parametrize("fn", FUNCS)
def test_inputs_never_modified(fn, single, kind, rng):
    """No argument changes (NaN in padding too), none changes its flags,
    no output aliases an input; the results equal those of plain copies."""
    if single and fn_kind(fn) == "project":
        pytest.skip("no query")
    args = make_args(fn, rng, np.float32 if kind == "float32" else
                     np.float64, single=single, key_proj=True)
    if "mask" in args:                       # NaN where no query looks
        dead = ~args["mask"]
        if args.get("attn_mask") is not None:
            dead |= ~args["attn_mask"].any(axis=-2)
        for n in ("keys", "values", "key_proj"):
            if n in args and args[n] is not None:
                args[n][dead] = np.nan
    plain = {n: (a.copy() if isinstance(a, np.ndarray) else a)
             for n, a in args.items()}
    if kind == "mixed":
        first = float_args(fn)[0]
        args[first] = args[first].astype(np.float32)
        plain[first] = args[first].copy()
    elif kind in ("strided", "readonly", "fortran"):
        tf = {"strided": _strided, "readonly": _readonly,
              "fortran": np.asfortranarray}[kind]
        args = {n: tf(a) if isinstance(a, np.ndarray) else a
                for n, a in args.items()}
    before = {n: (a.copy() if isinstance(a, np.ndarray) else a)
              for n, a in args.items()}
    flags = {n: (a.flags.writeable, a.flags.c_contiguous, a.strides)
             for n, a in args.items() if isinstance(a, np.ndarray)}
    result = as_tuple(call(fn, args))
    for n, a in args.items():
        if not isinstance(a, np.ndarray):
            continue
        assert a.dtype == before[n].dtype, n
        assert np.array_equal(a, before[n], equal_nan=True), f"{n} changed"
        assert (a.flags.writeable, a.flags.c_contiguous,
                a.strides) == flags[n], n
        for i, out in enumerate(result):
            if out is not None:
                assert not np.shares_memory(out, a), f"output {i} aliases {n}"
    for i, out in enumerate(result):
        if out is not None:
            assert np.all(np.isfinite(out)), f"output {i}: NaN padding leaked"
    assert_all_identical(result, call(fn, plain), f"{fn} {kind}")


@pytest.mark.parametrize("fn", FUNCS)
def test_keywords_match_positional(fn, rng):
    """docs/contract.md's keyword names, in any order, give the positional
    call's bits; leaving the optional arguments out equals passing None
    (values kept: grad_out has the values' width; a backward's mask kept:
    its alpha is the forward's for that mask, which the backward checks)."""
    args = make_args(fn, rng, key_proj=True)
    req, opt = SIGNATURES[fn]
    positional = getattr(ac, fn)(*[args[n] for n in req],
                                 **{n: args.get(n) for n in opt})
    shuffled = dict(reversed(list(args.items())))
    assert_all_identical(call(fn, shuffled), positional, fn)
    keep = ({"values", "mask", "attn_mask", "bias"} if "alpha" in args
            else {"values"})
    short = {n: a for n, a in args.items() if n in req or n in keep}
    # (return_weights=None is falsy: it returns (out, lse), not the
    # default (out, alpha); so True there)
    left_out = {n: True if n == "return_weights" else None
                for n in opt if n not in keep}
    assert_all_identical(call(fn, short), call(fn, dict(short, **left_out)),
                         fn)


@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=_lead_id)
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@dtype_param
@score_param
def test_empty_batch(score, dtype, single, lead, rng):
    """An empty batch: empty outputs of the right shapes and dtype,
    parameter gradients exactly zero."""
    p = FamilyProblem(rng, score, lead, 3, 4, 3, 2, 2, 5, single=single,
                      mask="key")
    x = p.cast(dtype)
    out, alpha, g = run_pair(p, x, True)
    assert out.shape == x["grad_out"].shape and out.dtype == dtype
    assert alpha.shape == x["grad_alpha"].shape and alpha.dtype == dtype
    for n, a in g.items():
        if x[n] is None:
            assert a is None, n
            continue
        assert a.shape == x[n].shape and a.dtype == dtype, n
        if n in ("W", "v", "b"):
            assert np.all(a == 0), n


# --------------------------------------------------------------------------
# 8. Threads and SIMD paths


@pytest.fixture
def restore_config():
    simd, n = _core._get_simd(), ac.get_num_threads()
    yield
    _core._set_simd(simd)
    ac.set_num_threads(n)


# Large enough that two threads take part (the batch or the rows split).
BIG = [((8,), 33, 65, 32, 24, 17, 40), ((2,), 130, 300, 16, 16, 8, 33)]


def _run_all(p, x):
    """Every output of forward, backward (with grad_alpha), project_keys."""
    out, alpha, g = run_pair(p, x, True)
    res = [out, alpha] + [g[n] for n in GRAD_FIELDS[p.kind]]
    if p.kind != "dot":
        kp = ac.project_keys(x["keys"], x["W"])
        res.append(kp)
        res += list(ac.project_keys_backward(
            np.ones_like(kp), x["keys"], x["W"]))
        o2, a2 = p.forward(ac, x, key_proj=kp)
        res += [o2, a2]
        res += list(p.backward(ac, x, a2, True, key_proj=kp))
    return res


@pytest.mark.parametrize("size", BIG, ids=_odd_id)
@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@dtype_param
@score_param
def test_one_and_two_threads_identical(score, dtype, single, size, rng,
                                       restore_config):
    """Every output (gradients summed over the batch included) is bit for
    bit the same with 1 and 2 threads."""
    lead, Tq, T, H, Hq, Hv, A = size
    p = FamilyProblem(rng, score, lead, Tq, T, H, Hq, Hv, A, single=single,
                      mask="key" if single else "query", wscale=0.3)
    x = p.cast(dtype)
    ac.set_num_threads(1)
    one = _run_all(p, x)
    ac.set_num_threads(2)
    two = _run_all(p, x)
    for i, (a, b) in enumerate(zip(one, two)):
        assert_identical(b, a, f"output {i}")


@pytest.mark.parametrize("single", [True, False], ids=["q1", "qN"])
@dtype_param
@score_param
def test_every_simd_path_agrees(score, dtype, single, rng, restore_config):
    """On each SIMD path this CPU has: within TOL of the float64 reference
    (ILL_FACTOR for the backward) and of the scalar path."""
    lead, Tq, T, H, Hq, Hv, A = BIG[0]
    p = FamilyProblem(rng, score, lead, Tq, T, H, Hq, Hv, A, single=single,
                      mask="key" if single else "query", wscale=0.3)
    x = p.cast(dtype)
    x64 = f64(x)
    tol = TOL[np.dtype(dtype).type]
    results = {}
    for path in SIMD_PATHS:
        _core._set_simd(path)
        assert _core._get_simd() == path
        out, alpha, g = run_pair(p, x, True)
        results[path] = (out, alpha, g)
    # reference: float64, on the scalar path's alpha
    out_s, alpha_s, g_s = results["scalar"]
    w_out, w_alpha = p.forward(ref, x64)
    want = grad_dict(p.backward(ref, x64, alpha_s.astype(np.float64), True),
                     p.kind)
    same = grad_dict(p.backward(ref, x, alpha_s, True), p.kind)
    for path, (out, alpha, g) in results.items():
        check(out, w_out, dtype, f"out on {path}")
        check(alpha, w_alpha, dtype, f"alpha on {path}")
        assert rel_err(out, out_s) <= 2 * tol, path
        assert rel_err(alpha, alpha_s) <= 2 * tol, path
        if path != "scalar":
            # the backward on this path with the scalar path's alpha
            _core._set_simd(path)
            g = grad_dict(p.backward(ac, x, alpha_s, True), p.kind)
        check_grads(g, want, dtype, f"on {path}", same)
        for n in g:
            if g[n] is not None:
                t = max(2 * tol, 2 * ILL_FACTOR * rel_err(same[n], want[n]))
                assert rel_err(g[n], g_s[n]) <= t, (path, n)


@dtype_param
@score_param
def test_large_scores_stay_finite(score, dtype, rng):
    """Scores in the thousands: finite weights summing to 1, finite
    gradients; out and alpha match the float64 reference within the
    softmax's condition (|s| eps)."""
    p = FamilyProblem(rng, score, (3,), 4, 9, 5, 5, 3, 6, mask="query")
    kind = p.kind
    if kind == "additive":
        p.v *= 1e3
    else:
        p.keys *= 30.0
        p.query *= 30.0
    x = p.cast(dtype)
    x64 = f64(x)
    s_fn = _score_fn(kind, p.H, x64["W"], x64["v"], x64["b"], p.scale)
    s = [s_fn(x64["query"][0, 0], k) for k in x64["keys"][0]]
    assert np.ptp(s) > 100                         # the regime meant
    out, alpha, g = run_pair(p, x, True)
    w_out, w_alpha = p.forward(ref, x64)
    tol = max(TOL[np.dtype(dtype).type],
              50 * np.max(np.abs(s)) * np.finfo(dtype).eps)
    check(out, w_out, dtype, "out", tol)
    check(alpha, w_alpha, dtype, "alpha", tol)
    dead = p.dead_queries()
    sums = alpha.astype(np.float64).sum(-1)
    assert np.all(np.abs(sums[~dead] - 1) <= 30 * np.finfo(dtype).eps)
    for n, a in [("out", out), ("alpha", alpha)] + list(g.items()):
        if a is not None:
            assert np.all(np.isfinite(a)), n


# --------------------------------------------------------------------------
# 9. The reference and the C agree at the edges


def test_reference_lse_backward_masked_key_does_not_warn():
    """A masked key and a query whose lse is very negative: the
    reference's backward from out= and lse= must not warn (the C does
    not)."""
    q, k = np.array([[1.0]]), np.array([[1.0], [-1.0]])
    m = np.array([False, True])
    out, lse = ref.dot_attention(q, k, mask=m, scale=1000.0,
                                 return_weights=False)
    assert lse[0] < -709
    want = ac.dot_attention_backward(np.ones_like(out), q, k, out=out,
                                     lse=lse, mask=m, scale=1000.0)
    got = ref.dot_attention_backward(np.ones_like(out), q, k, out=out,
                                     lse=lse, mask=m, scale=1000.0)
    for g, w in zip(got, want):
        assert (g is None and w is None) or np.allclose(g, w)


def test_dropout_none_same_in_c_and_reference(rng):
    """dropout=None is treated alike by the C and the reference."""
    q = rng.standard_normal((2, 3, 4))
    k = rng.standard_normal((2, 5, 4))
    got = ac.dot_attention(q, k, dropout=None)
    want = ref.dot_attention(q, k, dropout=None)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= TOL[np.float64]


def test_keys_1d_named_without_values(rng):
    """The C's message for 1-D keys names keys."""
    with pytest.raises(ValueError, match=r"^keys (has|must have) shape"):
        ac.dot_attention(np.ones((3, 2, 4)), np.ones(4))


@pytest.mark.parametrize("impl", ["c", "reference"])
def test_query_ndim_decides_one_or_several(impl, rng):
    """Several queries (..., Tq, H) have as many axes as the keys, one
    query per sequence (..., H) fewer, in the C functions and the
    reference alike: a 1-D query against batched keys is one query for
    every sequence; a query with more axes than the keys is refused (it
    was read as one query per sequence, or failed with another message
    in the reference)."""
    mod = ac if impl == "c" else ref
    keys = rng.standard_normal((2, 5, 4))
    q1 = rng.standard_normal(4)
    out, alpha = mod.dot_attention(q1, keys)
    want = ac.dot_attention(np.broadcast_to(q1, (2, 4)), keys)
    assert out.shape == (2, 4) and alpha.shape == (2, 5)
    np.testing.assert_allclose(out, want[0], rtol=1e-12)
    q4 = rng.standard_normal((2, 3, 4, 4))
    for k in (rng.standard_normal((3, 5, 4)), rng.standard_normal((5, 4))):
        with pytest.raises(ValueError, match="as many axes as the keys"):
            mod.cosine_attention(q4, k)
    with pytest.raises(ValueError, match="one query per sequence"):
        mod.dot_attention(rng.standard_normal((2, 3, 4)),
                          rng.standard_normal((2, 2, 5, 4)))
    with pytest.raises(ValueError, match="several queries"):
        mod.cosine_attention(rng.standard_normal((2, 4, 4)),
                             rng.standard_normal((5, 4)), causal=True)
