"""Self-attention at scale's test cases, shared by test_selfattn.py and
test_selfattn_robustness.py: random docs/contract.md section 5 problems
in float64 with every kind of key mask, attn_mask, causal, bias and
dropout (``Case``, the kinds ``MASKS``, ``ATTN``, ``BIASES``), the
streamed kernel's block sizes, and the checks of both forwards and the
three backwards of C against ``attention_c.reference``, with the exact
zeros of docs/contract.md 5.1 (``check``, ``check_grads``,
``check_zeros``, ``check_case``) and the tolerances of test_selfattn.py's
docstring.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import reference as ref
from attention_c.testing import DTYPES, ILL_FACTOR, TOL, f64, rel_err

# The streamed kernel's blocks (csrc/family/plan.inc QBLK, SQB, SKB):
# queries with causal and without, keys.
SQB_CAUSAL, SQB, SKB = 64, 256, 256

# Score variants: the dot score with its default scale (1/sqrt(H)) and a
# custom one, the general score.
SCORES = ["dot", "dot_scale", "general"]
CUSTOM_SCALE = 0.7
P_DROP = 0.3
SEED = 2**40 + 12345          # both 32-bit halves of the Philox key used

dtype_param = pytest.mark.parametrize("dtype", DTYPES,
                                      ids=lambda d: np.dtype(d).name)
score_param = pytest.mark.parametrize("score", SCORES)


# --------------------------------------------------------------------------
# Problems


def _key_mask(rng, shape):
    """Random key mask of ``shape`` (..., T): the first row sees no key,
    every other row at least one."""
    m = rng.random(shape) < 0.7
    flat = m.reshape(-1, shape[-1])
    flat[:, rng.integers(0, shape[-1])] = True
    if flat.shape[0] > 1:
        flat[0] = False
    return m


def _attn_mask(rng, shape):
    """Random per-query mask of ``shape`` (..., Tq, T): query 1 (or 0)
    sees no key, key 0 is seen by most queries, the last key by none."""
    Tq, T = shape[-2:]
    m = rng.random(shape) < 0.7
    m[..., 0] = True
    if T > 2:
        m[..., T - 1] = False
    m[..., min(1, Tq - 1), :] = False
    return m


def _runs_mask(rng, shape):
    """Per-query mask of ``shape`` (..., Tq, T) whose every row is one run
    of keys, at random places (not growing with the query, so no causal
    staircase): the kernels take such a mask as ranges.  Query 1 (or 0)
    sees no key."""
    Tq, T = shape[-2:]
    m = np.zeros(shape, bool)
    flat = m.reshape(-1, Tq, T)
    for s in flat:
        for i in range(Tq):
            a = rng.integers(0, T)
            s[i, a:a + 1 + rng.integers(0, max(1, T // 2))] = True
        s[min(1, Tq - 1)] = False
    return m


def _bias(rng, shape, ninf):
    """Normal bias of ``shape``; with ninf, query 0 gets an all -inf row
    and some entries are -inf (they act as a mask)."""
    b = rng.standard_normal(shape)
    if ninf:
        b[rng.random(shape) < 0.2] = -np.inf
        if len(shape) >= 2 and shape[-2] > 1:
            b[..., 0, :] = -np.inf
    return b


# mask kinds: the key mask of the leading shape, or broadcast (T,)
MASKS = ["none", "key", "key_bcast"]
# attn_mask kinds: a (Tq, T) mask for every sequence (the np.tril use),
# (1, Tq, T), one of the full leading shape, and one of the full shape
# whose rows are each one run of keys (taken as ranges)
ATTN = ["none", "TqT", "1TqT", "full", "runs"]
# bias kinds: the full shape with -inf entries and an all -inf row,
# (1, 1, Tq, T), (Tq, 1), (T,), and (Tq, T) with -inf rows
BIASES = ["none", "full_ninf", "11TqT", "Tq1", "T", "TqT_ninf"]


class Case:
    """A random section 5 problem in float64; ``cast(dtype)`` gives its
    float arrays in dtype (the float64 reference then runs on the cast
    values).

    lead: the leading shape of query, keys, values; single: one query per
    sequence (query (..., Hq)); mask, attn, bias: kinds of MASKS, ATTN,
    BIASES; dropout: the rate (seed SEED); values: given or the keys.
    """

    def __init__(self, rng, score, lead=(2, 3), Tq=5, T=7, H=4, Hq=3, Hv=2,
                 single=False, mask="none", attn="none", causal=False,
                 bias="none", dropout=0.0, values=True, seed=SEED):
        self.score = score
        self.kind = "general" if score == "general" else "dot"
        if self.kind == "dot":
            Hq = H
        self.lead, self.Tq, self.T = tuple(lead), (1 if single else Tq), T
        self.single, self.causal, self.dropout = single, causal, dropout
        self.seed = seed if dropout else None
        qshape = self.lead + (() if single else (Tq,)) + (Hq,)
        self.query = rng.standard_normal(qshape)
        self.keys = rng.standard_normal(self.lead + (T, H))
        self.values = (rng.standard_normal(self.lead + (T, Hv)) if values
                       else None)
        self.Hv = Hv if values else H
        self.W = (rng.standard_normal((Hq, H)) / np.sqrt(H)
                  if self.kind == "general" else None)
        self.scale = CUSTOM_SCALE if score == "dot_scale" else None
        nl = len(self.lead)
        self.mask = {"none": None,
                     "key": _key_mask(rng, self.lead + (T,)),
                     "key_bcast": _key_mask(rng, (T,))}[mask]
        if single:
            assert attn == "none" and not causal
            self.attn_mask = None
            self.bias = {"none": None,
                         "full_ninf": _bias(rng, self.lead + (T,), True),
                         "T": _bias(rng, (T,), False),
                         "1T": _bias(rng, (1,) * nl + (T,), False)}[bias]
        else:
            full = self.lead + (Tq, T)
            self.attn_mask = {"none": None,
                              "TqT": _attn_mask(rng, (Tq, T)),
                              "1TqT": _attn_mask(rng, (1, Tq, T)),
                              "full": _attn_mask(rng, full),
                              "runs": _runs_mask(rng, full)}[attn]
            self.bias = {"none": None,
                         "full_ninf": _bias(rng, full, True),
                         "11TqT": _bias(rng, (1,) * nl + (Tq, T), False),
                         "Tq1": _bias(rng, (Tq, 1), False),
                         "T": _bias(rng, (T,), False),
                         "TqT_ninf": _bias(rng, (Tq, T), True)}[bias]
        oshape = self.lead + (() if single else (Tq,))
        self.grad_out = rng.standard_normal(oshape + (self.Hv,))
        self.grad_alpha = rng.standard_normal(oshape + (T,))

    FLOATS = ["query", "keys", "values", "W", "bias", "grad_out",
              "grad_alpha"]

    def cast(self, dtype):
        """The float arrays in dtype (None stays None), by name."""
        return {n: None if getattr(self, n) is None
                else getattr(self, n).astype(dtype) for n in self.FLOATS}

    def kwargs(self, x):
        """The optional arguments of both functions, by keyword."""
        kw = dict(mask=self.mask, attn_mask=self.attn_mask,
                  causal=self.causal, bias=x["bias"], dropout=self.dropout,
                  seed=self.seed, values=x["values"])
        if self.kind == "dot":
            kw["scale"] = self.scale
        return kw

    def required(self, x):
        return ((x["query"], x["keys"]) if self.kind == "dot"
                else (x["query"], x["keys"], x["W"]))

    def forward(self, mod, x, return_weights=True):
        fn = getattr(mod, f"{self.kind}_attention")
        return fn(*self.required(x), **self.kwargs(x),
                  return_weights=return_weights)

    def backward(self, mod, x, saved, with_ga=False):
        """The gradient tuple; saved is (alpha,) or {out:, lse:}."""
        fn = getattr(mod, f"{self.kind}_attention_backward")
        ga = x["grad_alpha"] if with_ga else None
        if isinstance(saved, dict):
            return fn(x["grad_out"], *self.required(x), **saved,
                      **self.kwargs(x), grad_alpha=ga)
        return fn(x["grad_out"], *self.required(x), saved,
                  **self.kwargs(x), grad_alpha=ga)

    def fields(self):
        if self.kind == "dot":
            return ("query", "keys", "values", "bias")
        return ("query", "keys", "values", "W", "bias")

    def floor(self):
        """The gradients' norm floor: sqrt of the number of queries (each
        adds an O(1) term to a sum that may cancel)."""
        return float(np.sqrt(np.prod(self.lead, dtype=float) * self.Tq))

    def visible(self):
        """(lead, Tq, T) booleans: docs/contract.md 5.1's visibility, formed
        here from its definition."""
        Tq, T = self.Tq, self.T
        vis = np.ones(self.lead + (Tq, T), bool)
        if self.mask is not None:
            vis &= self.mask[..., None, :]
        if self.attn_mask is not None:
            vis &= self.attn_mask
        if self.causal:
            vis &= np.tril(np.ones((Tq, T), bool), k=T - Tq)
        if self.bias is not None:
            b = self.bias[..., None, :] if self.single else self.bias
            vis &= ~np.isneginf(b)
        return vis


# --------------------------------------------------------------------------
# Checks


def check(got, want, dtype, what, tol=None, floor=0.0):
    """got is an ndarray of dtype and want's shape within tol (TOL) of
    want: normwise relative error, or relative to floor when ||want|| is
    smaller.  -inf (lse) must be at the same places."""
    assert type(got) is np.ndarray, f"{what}: {type(got)}"
    assert got.dtype == np.dtype(dtype), (what, got.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    ninf = np.isneginf(want)
    assert np.array_equal(np.isneginf(got), ninf), f"{what}: -inf places"
    got, want = got[~ninf], want[~ninf]
    assert np.all(np.isfinite(got)), f"{what}: not finite"
    tol = TOL[np.dtype(dtype).type] if tol is None else tol
    err = rel_err(got, want, floor)
    assert err <= tol, f"{what}: normwise relative error {err:.3g} > " \
                       f"{tol:.3g}"


def check_grads(case, got, want, same, dtype, what):
    """Gradient tuples: the named tuple's fields in order, None where the
    reference has None, else within TOL or ILL_FACTOR times the error of
    the reference in dtype (same)."""
    assert type(got).__name__ == ("DotAttentionGrads" if case.kind == "dot"
                                  else "GeneralAttentionGrads"), type(got)
    # (the variants' gradients end the tuple, issue 25; None here)
    assert got._fields == case.fields() + ("alibi_slopes", "sinks"), \
        got._fields
    assert len(want) == len(got)
    for name, g, w, s in zip(case.fields(), got, want, same):
        if w is None:
            assert g is None, f"{what}: d{name} should be None"
            continue
        tol = max(TOL[np.dtype(dtype).type], ILL_FACTOR * rel_err(s, w))
        check(g, w, dtype, f"{what} d{name}", tol, floor=case.floor())


def check_zeros(case, out, weights, grads, return_weights):
    """docs/contract.md 5.1 exact values: weight 0 on invisible pairs; a
    query with no visible key has out = 0, alpha = 0, lse = -inf,
    dquery = 0, dbias = 0 (its row of a bias of the full shape)."""
    vis = case.visible()
    dead = ~vis.any(axis=-1)                            # (lead, Tq)
    o = out[..., None, :] if case.single else out
    assert np.all(o[dead] == 0), "query with no visible key: out != 0"
    if return_weights:
        a = weights[..., None, :] if case.single else weights
        assert np.all(a[~vis] == 0), "weight of an invisible key != 0"
        live = f64(a).sum(axis=-1)[~dead]
        assert np.all(np.abs(live - 1) < 1e-4), "weights do not sum to 1"
    else:
        lse = weights[..., None] if case.single else weights
        assert np.all(np.isneginf(lse[dead])), "lse of a dead query"
        assert np.all(np.isfinite(lse[~dead])), "lse of a live query"
    if grads is not None:
        dq = grads.query[..., None, :] if case.single else grads.query
        assert np.all(dq[dead] == 0), "dquery of a query with no key"
        b = case.bias
        if b is not None and b.shape == vis.shape[:-2] + vis.shape[
                -1 - (not case.single):]:           # bias of the full shape
            db = grads.bias[..., None, :] if case.single else grads.bias
            assert np.all(db[~vis] == 0), "dbias of an invisible pair"
        for name, g in zip(grads._fields, grads):
            if g is not None:
                assert np.all(np.isfinite(g)), f"d{name} not finite"


def check_case(case, dtype):
    """Both forwards and the three backwards (alpha, alpha + grad_alpha,
    out= and lse=) of C in dtype against the reference in float64 on the
    same values, and the exact zeros."""
    x = case.cast(dtype)
    x64 = {n: f64(a) for n, a in x.items()}
    for rw in (True, False):
        what = f"return_weights={rw}"
        out, w = case.forward(ac, x, rw)
        r_out, r_w = case.forward(ref, x64, rw)
        check(out, r_out, dtype, f"{what} out")
        check(w, r_w, dtype, f"{what} {'alpha' if rw else 'lse'}")
        runs = ([(w, False), (w, True)] if rw
                else [({"out": out, "lse": w}, False)])
        for saved, with_ga in runs:
            sw = f"{what} grad_alpha={with_ga}"
            s64 = ({k: f64(a) for k, a in saved.items()}
                   if isinstance(saved, dict) else f64(saved))
            want = case.backward(ref, x64, s64, with_ga)
            same = case.backward(ref, x, saved, with_ga)
            got = case.backward(ac, x, saved, with_ga)
            check_grads(case, got, want, same, dtype, sw)
            check_zeros(case, out, w, got, rw)
