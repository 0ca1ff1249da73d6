"""The attention family's test cases, shared by test_family.py and
test_family_inputs.py: an independent float64 evaluation of
docs/contract.md 4.3 and 4.4 as plain loops over the query i and the key
t (``loop_forward``, ``loop_backward``, ``loop_project_keys``; slow, so
the sizes are small), random problems with every kind of mask
(``FamilyProblem``), and the checks against them with the tolerances of
test_family.py's docstring.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import DTYPES, ILL_FACTOR, TOL, rel_err

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


def score_fn(kind, H, W=None, v=None, b=None, scale=None):
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
    s_fn = score_fn(kind, k.shape[-1], W, v, b, scale)
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


# Arguments that are not float arrays (kept as they are by the casts).
NOT_FLOAT = {"mask", "attn_mask", "scale", "key_proj", "causal", "dropout",
             "seed", "return_weights", "window", "softcap", "cu_seqlens_q",
             "cu_seqlens_k",
             # float, but cast to the call's dtype (never choosing it), and
             # left out by test_family_inputs.py's make_args: tested in
             # tests/kernels/test_variants_kernel.py
             "alibi_slopes", "sinks", "sharpness"}


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


def lead_id(lead):
    return "lead" + ("x".join(map(str, lead)) if lead else "none")
