"""Self-attention at scale (docs/contract.md section 5): the C functions'
dot and general attention with ``mask`` (key mask), ``attn_mask``,
``causal``, ``bias``, ``dropout`` + ``seed`` and ``return_weights``, forward
and backward (from ``alpha`` or from ``out=`` and ``lse=``).

* every argument combination against ``attention_c.reference`` (itself
  checked against loops in tests/kernels/test_reference_selfattn.py), on
  odd sizes and on sizes that cross the streamed kernel's blocks (64
  queries x 256 keys), with exact zeros where docs/contract.md 5.1
  says so;
* the gradients, dbias included and with dropout, against central finite
  differences;
* return_weights=False against the stored-weights path; the dropout keep
  bits against ``reference.dropout_keep``, read back from the C outputs;
* bitwise identical results for 1, 2 and 3 threads, every SIMD path;
* NaN in keys a query cannot see reaching nothing; inputs never written;
  every bad input refused with a message naming the argument, leaving no
  state; T = 70 000 keys.

Tolerances (normwise relative error, ``testing.TOL``): 1e-12 for float64,
1e-5 for float32, against the float64 reference evaluated on the same
(cast) values; a backward's bound is TOL or, when larger, ILL_FACTOR times
the error of the reference evaluated in the same dtype (as in
tests/kernels/test_family.py).  Gradients are measured against max(||want||,
sqrt(queries)) (the inputs are O(1), and each query adds an O(1) term):
some are sums that cancel to 0 in exact arithmetic (dbias of a (Tq, 1)
bias without grad_alpha; every gradient but dvalues when T = 1), where a
relative error measures only rounding noise.  Finite
differences: FD_RTOL.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import (DTYPES, FD_RTOL, ILL_FACTOR, TOL,
                                 assert_all_identical, assert_identical,
                                 f64, numerical_grad, rel_err)

pytestmark = pytest.mark.filterwarnings("error")

SIMD_PATHS = list(_core._simd_paths())
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
# (1, Tq, T), one of the full leading shape
ATTN = ["none", "TqT", "1TqT", "full"]
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
                              "full": _attn_mask(rng, full)}[attn]
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


# --------------------------------------------------------------------------
# 1. Every argument combination against the reference

# (mask, dropout, values): each combination below meets each of these
VARIANTS = [("none", 0.0, True), ("key", P_DROP, True),
            ("key_bcast", 0.0, False), ("none", P_DROP, False)]
COMBOS = [(a, c, b) for a in ATTN for c in (False, True) for b in BIASES]


def _combo_id(combo):
    a, c, b = combo
    return f"attn-{a}-{'causal' if c else 'full'}-bias-{b}"


@pytest.mark.parametrize("shape", [(5, 7), (6, 3)],
                         ids=["Tq5-T7", "Tq6-T3"])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
@dtype_param
@score_param
def test_combinations_match_reference(score, dtype, combo, shape):
    """Every attn_mask x causal x bias kind (causal with Tq < T and
    Tq > T), each with no mask, a key mask (one sequence with no key), a
    broadcast key mask, dropout or not, values or the keys: C == the
    reference, forward (both return_weights) and backward (alpha, alpha
    and grad_alpha, out and lse)."""
    attn, causal, bias = combo
    Tq, T = shape
    for n, (mask, p, values) in enumerate(VARIANTS):
        rng = np.random.default_rng([Tq, T, n, COMBOS.index(combo)])
        case = Case(rng, score, (2, 3), Tq, T, mask=mask, attn=attn,
                    causal=causal, bias=bias, dropout=p, values=values)
        check_case(case, dtype)


@pytest.mark.parametrize("bias", ["none", "full_ninf", "T", "1T"])
@pytest.mark.parametrize("mask", MASKS)
@dtype_param
@score_param
def test_single_query_matches_reference(score, dtype, mask, bias):
    """One query per sequence (query (..., Hq)): bias (..., T), key mask,
    dropout (i = 0 in the keep bits), lse (...)."""
    for n, (p, values) in enumerate([(0.0, True), (P_DROP, False)]):
        rng = np.random.default_rng([n, MASKS.index(mask), len(bias)])
        case = Case(rng, score, (2, 3), T=9, single=True, mask=mask,
                    bias=bias, dropout=p, values=values)
        check_case(case, dtype)
        out, lse = case.forward(ac, case.cast(dtype), False)
        assert lse.shape == case.lead


# (lead, Tq, T, H, Hq, Hv): sizes from {1, 3, 17, 65} in every position
ODD_SIZES = [((1,), 1, 1, 1, 1, 1), ((3,), 3, 17, 1, 65, 3),
             ((), 17, 3, 65, 1, 17), ((1,), 65, 17, 3, 17, 1),
             ((3,), 1, 65, 17, 3, 65), ((), 17, 65, 3, 3, 17)]


def _odd_id(size):
    lead, Tq, T, H, Hq, Hv = size
    return (f"B{'x'.join(map(str, lead)) or '-'}-Tq{Tq}-T{T}-H{H}-Hq{Hq}"
            f"-Hv{Hv}")


@pytest.mark.parametrize("size", ODD_SIZES, ids=_odd_id)
@dtype_param
@score_param
def test_odd_sizes_match_reference(score, dtype, size):
    """Sizes 1, 3, 17, 65: causal and a (Tq, T) bias with -inf rows and
    dropout; a broadcast attn_mask with a key mask and a (T,) bias."""
    lead, Tq, T, H, Hq, Hv = size
    for n, kw in enumerate([
            dict(causal=True, bias="TqT_ninf", dropout=P_DROP),
            dict(attn="1TqT" if lead else "TqT", mask="key_bcast",
                 bias="T")]):
        rng = np.random.default_rng([Tq, T, H, n])
        case = Case(rng, score, lead, Tq, T, H, Hq, Hv, values=Hv != 1,
                    **kw)
        check_case(case, dtype)


# query and key counts on both sides of the streamed kernel's blocks
BLOCK_TQ = [1, SQB_CAUSAL - 1, SQB_CAUSAL, SQB_CAUSAL + 1, SQB - 1, SQB,
            SQB + 1]
BLOCK_T = [1, SKB - 1, SKB, SKB + 1, 600]


@pytest.mark.parametrize("T", BLOCK_T, ids=lambda n: f"T{n}")
@pytest.mark.parametrize("Tq", BLOCK_TQ, ids=lambda n: f"Tq{n}")
@dtype_param
@pytest.mark.parametrize("score", ["dot", "general"])
def test_block_sizes_match_reference(score, dtype, Tq, T):
    """Query and key counts that end a block early, fill it, and start the
    next one (causal with Tq < T, Tq == T and Tq > T, so whole blocks are
    skipped and diagonal blocks masked): causal + key mask + (T,) bias +
    dropout; a (Tq, T) attn_mask + bias with -inf rows."""
    for n, kw in enumerate([
            dict(causal=True, mask="key", bias="T", dropout=P_DROP),
            dict(attn="TqT", bias="TqT_ninf")]):
        rng = np.random.default_rng([Tq, T, n])
        case = Case(rng, score, (2,), Tq, T, H=8, Hq=5, Hv=3, **kw)
        check_case(case, dtype)


@pytest.mark.parametrize("kw", [
    dict(), dict(causal=True, dropout=P_DROP), dict(mask="key", attn="TqT")],
    ids=["full", "causal_dropout", "masks"])
@pytest.mark.parametrize("lead", [(1,), (3,)], ids=["B1", "B3"])
@dtype_param
@pytest.mark.parametrize("score", ["dot", "general"])
def test_key_segments_match_reference(score, dtype, lead, kw):
    """Fewer than 4 sequences and no bias: the streamed backward cuts
    each one's keys into segments (3 and 2 here, of blocks of 256 keys),
    one task each, and sums their dquery partials after."""
    rng = np.random.default_rng(len(lead) + len(kw))
    case = Case(rng, score, lead, 300, 2 * SKB + 100, H=8, Hq=5, Hv=3,
                **kw)
    check_case(case, dtype)


# --------------------------------------------------------------------------
# 2. Gradients against finite differences (float64, tiny sizes)

FD_VARIANTS = {
    "plain": dict(),
    "causal_bias": dict(causal=True, bias="full_ninf", mask="key"),
    "dropout": dict(dropout=0.4, attn="TqT", bias="T"),
    "all": dict(causal=True, attn="1TqT", bias="Tq1", dropout=0.4,
                mask="key_bcast"),
    "single": dict(single=True, bias="full_ninf", dropout=0.4, mask="key"),
}


@pytest.mark.parametrize("mode", ["alpha", "grad_alpha", "lse"])
@pytest.mark.parametrize("variant", list(FD_VARIANTS))
@pytest.mark.parametrize("score", ["dot_scale", "general"])
def test_gradients_match_finite_differences(score, variant, mode):
    """Every gradient (query, keys, values, W, bias) of the C backward ==
    central differences of L = sum(out G) [+ sum(alpha Ga)] through the C
    forward in float64; dropout's keep bits are fixed by the seed, so L is
    smooth.  Bias entries that are -inf or invisible get gradient 0."""
    rng = np.random.default_rng(list(FD_VARIANTS).index(variant))
    case = Case(rng, score, (2,), Tq=3, T=4, H=3, Hq=2, Hv=2,
                **FD_VARIANTS[variant])
    x = case.cast(np.float64)
    rw = mode != "lse"

    def loss():
        out, alpha = case.forward(ac, x, rw)
        total = np.sum(out * x["grad_out"])
        if mode == "grad_alpha":
            total += np.sum(alpha * x["grad_alpha"])
        return float(total)

    out, w = case.forward(ac, x, rw)
    saved = (w if rw else {"out": out, "lse": w})
    grads = case.backward(ac, x, saved, mode == "grad_alpha")
    names = dict(zip(case.fields(), grads))
    for name in case.fields():
        arr = x[name]
        if arr is None:
            assert names[name] is None, name
            continue
        want = numerical_grad(loss, arr)
        err = rel_err(names[name], want)
        assert err <= FD_RTOL, f"d{name}: {err:.3g} > {FD_RTOL:g}"


# --------------------------------------------------------------------------
# 3. return_weights=False against the stored weights


@pytest.mark.parametrize("kw", [
    dict(), dict(causal=True, bias="TqT_ninf", dropout=P_DROP),
    dict(attn="full", mask="key", bias="11TqT")],
    ids=["plain", "causal_bias_dropout", "masks"])
@dtype_param
@pytest.mark.parametrize("score", ["dot", "general"])
def test_streamed_equals_stored(score, dtype, kw):
    """Over several blocks of queries and keys: return_weights=False gives
    the out of the stored-weights path within rounding, and the lse of the
    reference; the backward from out= and lse= equals the backward from
    alpha."""
    rng = np.random.default_rng(len(kw))
    case = Case(rng, score, (2, 2), 2 * SQB + 7, SKB + 40, H=16, Hq=8,
                Hv=8, **kw)
    x = case.cast(dtype)
    tol = TOL[np.dtype(dtype).type]
    out_w, alpha = case.forward(ac, x, True)
    out_s, lse = case.forward(ac, x, False)
    check(out_s, f64(out_w), dtype, "out", tol)
    x64 = {n: f64(a) for n, a in x.items()}
    check(lse, case.forward(ref, x64, False)[1], dtype, "lse", tol)
    g_w = case.backward(ac, x, alpha)
    g_s = case.backward(ac, x, {"out": out_s, "lse": lse})
    # the gradients are differences of nearly equal sums in any
    # evaluation: the bound is that of the reference in dtype
    want = case.backward(ref, x64, f64(alpha))
    same = case.backward(ref, x, alpha)
    for name, a, b, w, s in zip(case.fields(), g_s, g_w, want, same):
        if b is None:
            assert a is None, name
            continue
        check(a, f64(b), dtype, f"d{name}",
              max(tol, ILL_FACTOR * rel_err(s, w)), floor=case.floor())


# --------------------------------------------------------------------------
# 4. Dropout: the keep bits


def _keep_from_forward(score, lead, Tq, T, p, seed, single=False,
                       return_weights=True):
    """The C forward's keep pattern: query 0 (so every weight is 1/T) and
    the values the identity, so out_it = keep_it / (T (1 - p))."""
    H = 4
    qshape = tuple(lead) + (() if single else (Tq,)) + (H,)
    query = np.zeros(qshape)
    keys = np.random.default_rng(0).standard_normal(tuple(lead) + (T, H))
    values = np.broadcast_to(np.eye(T), tuple(lead) + (T, T))
    if score == "dot":
        out, _ = ac.dot_attention(query, keys, values=values, dropout=p,
                                  seed=seed, return_weights=return_weights)
    else:
        out, _ = ac.general_attention(query, keys, np.ones((H, H)),
                                      values=values, dropout=p, seed=seed,
                                      return_weights=return_weights)
    if single:
        out = out[..., None, :]
    kept = out != 0
    assert np.all(out[kept] == out[kept].flat[0])       # 1 / (T (1-p))
    return kept


def _keep_from_backward(lead, Tq, T, p, seed, return_weights):
    """The C backward's keep pattern: grad_out the identity (Hv = Tq), so
    dvalues_ti = P_it keep_it / (1 - p) g_ii = keep_it / (T (1 - p))."""
    H = 4
    query = np.zeros(tuple(lead) + (Tq, H))
    rng = np.random.default_rng(1)
    keys = rng.standard_normal(tuple(lead) + (T, H))
    values = rng.standard_normal(tuple(lead) + (T, Tq))
    kw = dict(values=values, dropout=p, seed=seed)
    out, w = ac.dot_attention(query, keys, **kw,
                              return_weights=return_weights)
    g = np.broadcast_to(np.eye(Tq), tuple(lead) + (Tq, Tq))
    if return_weights:
        grads = ac.dot_attention_backward(g, query, keys, w, **kw)
    else:
        grads = ac.dot_attention_backward(g, query, keys, out=out, lse=w,
                                          **kw)
    dv = grads.values.swapaxes(-1, -2)                   # (lead, Tq, T)
    kept = dv != 0
    assert np.allclose(dv[kept], 1 / (T * (1 - p)), rtol=1e-12, atol=0)
    return kept


def _ref_keep(lead, Tq, T, p, seed):
    b = np.arange(int(np.prod(lead))).reshape(lead)
    return ref.dropout_keep(seed, p, b, Tq, T)


@pytest.mark.parametrize("p", [0.1, 0.5], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("sizes", [(1, 7), (5, 9), (SQB + 1, SKB + 3)],
                         ids=lambda s: f"Tq{s[0]}-T{s[1]}")
@pytest.mark.parametrize("return_weights", [True, False],
                         ids=["weights", "lse"])
@pytest.mark.parametrize("score", ["dot", "general"])
def test_dropout_keep_bits_match_reference(score, return_weights, sizes, p):
    """The keep pattern read back from the C forward (and backward) is bit
    for bit reference.dropout_keep at every flat batch index b of the
    leading shape (2, 3), for a seed with both 32-bit halves set."""
    Tq, T = sizes
    lead = (2, 3)
    want = _ref_keep(lead, Tq, T, p, SEED)
    got = _keep_from_forward(score, lead, Tq, T, p, SEED,
                             return_weights=return_weights)
    assert np.array_equal(got, want), \
        f"forward keep bits: {np.sum(got != want)} of {want.size} differ"
    if score == "dot":
        got = _keep_from_backward(lead, Tq, T, p, SEED, return_weights)
        assert np.array_equal(got, want), \
            f"backward keep bits: {np.sum(got != want)} differ"


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32, 2**64 - 1])
def test_dropout_keep_bits_seeds(seed):
    """The extreme seeds (the key's halves 0 and 2**32 - 1); one query per
    sequence uses i = 0."""
    lead, T, p = (3,), 13, 0.5
    want = _ref_keep(lead, 1, T, p, seed)
    assert np.array_equal(_keep_from_forward("dot", lead, 1, T, p, seed,
                                             single=True), want)
    assert np.array_equal(_keep_from_forward("dot", lead, 4, T, p, seed),
                          _ref_keep(lead, 4, T, p, seed))


@pytest.mark.parametrize("return_weights", [True, False],
                         ids=["weights", "lse"])
@pytest.mark.parametrize("score", ["dot", "general"])
def test_dropout_reproducible(score, return_weights):
    """The same seed gives the same bits (forward and backward); another
    seed other bits; dropout=0 (with or without a seed) is no dropout, bit
    for bit; the returned alpha is before dropout."""
    rng = np.random.default_rng(3)
    case = Case(rng, score, (2,), 70, 300, H=8, Hq=8, Hv=8, causal=True,
                bias="T", dropout=P_DROP)
    x = case.cast(np.float32)

    def run(**over):
        old = (case.dropout, case.seed)
        case.dropout, case.seed = over.get("dropout", case.dropout), \
            over.get("seed", case.seed)
        try:
            out, w = case.forward(ac, x, return_weights)
            saved = (w if return_weights else {"out": out, "lse": w})
            return (out, w) + tuple(case.backward(ac, x, saved))
        finally:
            case.dropout, case.seed = old

    first = run()
    assert_all_identical(run(), first, "same seed")
    other = run(seed=SEED + 1)
    assert not np.array_equal(other[0], first[0]), "seed ignored"
    if return_weights:
        assert_identical(other[1], first[1], "alpha is before dropout")
    plain = run(dropout=0.0, seed=None)
    assert_all_identical(run(dropout=0.0, seed=7), plain, "p = 0 with seed")
    assert not np.array_equal(plain[0], first[0])
    kw = case.kwargs(x)
    del kw["dropout"], kw["seed"]
    fn = getattr(ac, f"{case.kind}_attention")
    assert_all_identical(fn(*case.required(x), **kw,
                            return_weights=return_weights), plain[:2],
                         "p = 0 against no dropout argument")


# --------------------------------------------------------------------------
# 5. Threads and SIMD paths

# (lead, Tq, T, kw): big enough for several threads (2**22 multiply-adds
# each); the streamed backward's key segments (no bias, few sequences:
# 2 of one sequence each, then 3 of one), a shared bias summed in
# partials, many sequences, the stored path
THREAD_CASES = {
    "key_segments": ((2,), 600, 600, dict(causal=True, dropout=P_DROP)),
    "shared_bias": ((3,), 300, 520, dict(bias="TqT_ninf", attn="1TqT",
                                         mask="key", dropout=P_DROP)),
    "many_seqs": ((10,), 130, 257, dict(causal=True, bias="T",
                                        dropout=P_DROP)),
    "one_long": ((1,), 700, 700, dict(causal=True)),
}


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("name", list(THREAD_CASES))
@pytest.mark.parametrize("score", ["dot", "general"])
def test_threads_bitwise_identical(score, name):
    """1, 2 and 3 threads give the same bits: both forwards, the backward
    from alpha and from out= and lse=, dropout included."""
    lead, Tq, T, kw = THREAD_CASES[name]
    case = Case(np.random.default_rng(5), score, lead, Tq, T, H=32, Hq=32,
                Hv=32, **kw)
    x = case.cast(np.float32)

    def run():
        res = []
        for rw in (True, False):
            out, w = case.forward(ac, x, rw)
            saved = (w if rw else {"out": out, "lse": w})
            res += [out, w] + list(case.backward(ac, x, saved))
        return res

    ac.set_num_threads(1)
    one = run()
    for n in (2, 3):
        ac.set_num_threads(n)
        assert_all_identical(run(), one, f"{n} threads against 1")


@pytest.mark.usefixtures("restore_settings")
@pytest.mark.parametrize("simd", SIMD_PATHS)
@dtype_param
@pytest.mark.parametrize("score", ["dot", "general"])
def test_simd_paths_match_reference(score, dtype, simd):
    """Every SIMD path: the combinations over blocks against the reference
    within TOL, and the same dropout keep bits."""
    _core._set_simd(simd)
    for n, kw in enumerate([
            dict(causal=True, mask="key", bias="TqT_ninf",
                 dropout=P_DROP),
            dict(attn="full", bias="11TqT", dropout=P_DROP, values=False)]):
        case = Case(np.random.default_rng(n), score, (2,), SQB + 1,
                    SKB + 1, H=17, Hq=9, Hv=5, **kw)
        check_case(case, dtype)
    lead = (2,)
    assert np.array_equal(
        _keep_from_forward(score, lead, SQB + 1, SKB + 1, P_DROP, SEED,
                           return_weights=False),
        _ref_keep(lead, SQB + 1, SKB + 1, P_DROP, SEED))


# --------------------------------------------------------------------------
# 6. NaN where no query looks


def _nan_case(score, how):
    """A problem whose key 4 (keys and values) some queries cannot see:
    (case, the queries that cannot see it)."""
    rng = np.random.default_rng(9)
    Tq, T = 6, 6
    case = Case(rng, score, (2,), Tq, T, H=4, Hq=3, Hv=2)
    blind = np.ones(Tq, bool)
    if how == "causal":               # only queries 4 and 5 see key 4
        case.causal = True
        blind[4:] = False
    elif how == "attn_mask":
        case.attn_mask = np.ones((Tq, T), bool)
        case.attn_mask[:3, 4] = False
        blind[3:] = False
    elif how == "ninf_bias":
        case.bias = rng.standard_normal((Tq, T))
        case.bias[1::2, 4] = -np.inf
        blind[0::2] = False
    elif how == "key_mask":
        case.mask = np.ones((2, T), bool)
        case.mask[:, 4] = False
    elif how == "attn_mask_column":
        case.attn_mask = np.ones((1, Tq, T), bool)
        case.attn_mask[..., 4] = False
    elif how == "ninf_bias_column":
        case.bias = rng.standard_normal((2, 1, T))
        case.bias[..., 4] = -np.inf
    return case, blind


NAN_HOW = ["causal", "attn_mask", "ninf_bias", "key_mask",
           "attn_mask_column", "ninf_bias_column"]


@pytest.mark.parametrize("return_weights", [True, False],
                         ids=["weights", "lse"])
@pytest.mark.parametrize("how", NAN_HOW)
@pytest.mark.parametrize("score", ["dot", "general"])
def test_nan_in_invisible_keys_reaches_nothing(score, how, return_weights):
    """NaN in key 4 and its value, where a query cannot see it (causal,
    attn_mask, -inf bias): that query's out, alpha or lse and dquery are
    those of the same call with a finite key 4.  Where no query sees it
    (key mask, an all-False attn_mask column, a -inf bias column), every
    result is, and the NaN key gets zero gradients."""
    case, blind = _nan_case(score, how)
    runs = []
    for bad in (np.nan, 0.5):
        x = case.cast(np.float64)
        x["keys"][..., 4, :] = bad
        x["values"][..., 4, :] = bad
        out, w = case.forward(ac, x, return_weights)
        saved = (w if return_weights else {"out": out, "lse": w})
        runs.append((out, w, case.backward(ac, x, saved)))
    (out, w, g), (out0, w0, g0) = runs
    tol = TOL[np.float64]
    what = f"{how}, return_weights={return_weights}"
    for name, a, b in [("out", out, out0), ("weights", w, w0),
                       ("dquery", g.query, g0.query)]:
        check(a[:, blind], b[:, blind], np.float64,
              f"{what}: {name} of a query that cannot see the NaN", tol)
    if blind.all():                   # no query sees key 4
        for name, a, b in zip(g._fields, g, g0):
            if b is not None:
                check(a, b, np.float64, f"{what}: d{name}", tol)
        assert np.all(g.keys[:, 4] == 0) and np.all(g.values[:, 4] == 0)


@pytest.mark.parametrize("return_weights", [True, False],
                         ids=["weights", "lse"])
@pytest.mark.parametrize("score", ["dot", "general"])
def test_nan_where_nothing_looks(score, return_weights):
    """NaN in bias entries hidden by attn_mask, by causal and by the key
    mask, and in the query (and grad_out) of a query with no visible key,
    reach nothing: every result equals that of finite values there."""
    rng = np.random.default_rng(11)
    case = Case(rng, score, (2,), 6, 8, causal=True, attn="TqT",
                mask="key", bias="full_ninf")
    vis = case.visible()
    dead = ~vis.any(axis=-1)
    assert dead.any() and (~dead).any()
    runs = []
    for bad in (np.nan, 0.25):
        x = case.cast(np.float64)
        hidden = ~vis & ~np.isneginf(x["bias"])
        x["bias"][hidden] = bad
        x["query"][dead] = bad
        x["grad_out"][dead] = bad
        out, w = case.forward(ac, x, return_weights)
        saved = (w if return_weights else {"out": out, "lse": w})
        runs.append([out, w] + list(case.backward(ac, x, saved)))
    for n, (a, b) in enumerate(zip(*runs)):
        if b is not None:
            check(a, b, np.float64, f"result {n}", TOL[np.float64])


# --------------------------------------------------------------------------
# 7. Inputs are never written; bad input


@pytest.mark.parametrize("score", ["dot", "general"])
def test_inputs_never_modified(score):
    """Every input of both forwards and the three backwards, read-only
    (so a write would fail) and compared byte for byte afterwards;
    broadcast (stride 0) masks and bias are read in place."""
    rng = np.random.default_rng(13)
    case = Case(rng, score, (2, 3), 7, 9, mask="key", attn="TqT",
                causal=True, bias="11TqT", dropout=P_DROP)
    case.attn_mask = np.broadcast_to(case.attn_mask, (2, 3, 7, 9))
    case.bias = np.broadcast_to(case.bias, (2, 3, 7, 9))
    x = case.cast(np.float32)
    arrays = dict(x, mask=case.mask, attn_mask=case.attn_mask)
    out, alpha = case.forward(ac, x, True)
    out_s, lse = case.forward(ac, x, False)
    arrays.update(out=out_s, lse=lse, alpha=alpha)
    for a in arrays.values():
        if a is not None:
            a.flags.writeable = False
    before = {n: a.tobytes() for n, a in arrays.items() if a is not None}
    case.forward(ac, x, True)
    case.forward(ac, x, False)
    case.backward(ac, x, alpha)
    case.backward(ac, x, alpha, with_ga=True)
    case.backward(ac, x, {"out": out_s, "lse": lse})
    for n, b in before.items():
        assert arrays[n].tobytes() == b, f"{n} was written"


def _bad_calls():
    """(id, function name, changes to a good call's arguments, exception,
    words the message must contain)."""
    T, Tq = 7, 5
    per_query = np.ones((2, Tq, T), bool)
    return [
        ("per_query_mask", "fwd", dict(mask=per_query), ValueError,
         ["mask", "attn_mask"]),
        ("per_query_mask_bwd", "bwd", dict(mask=per_query), ValueError,
         ["mask", "attn_mask"]),
        ("attn_mask_shape", "fwd", dict(attn_mask=np.ones((3, T), bool)),
         ValueError, ["attn_mask", "(3, 7)"]),
        ("attn_mask_leading", "bwd",
         dict(attn_mask=np.ones((3, Tq, T), bool)), ValueError,
         ["attn_mask", "(3, 5, 7)"]),
        ("attn_mask_more_axes", "fwd",
         dict(attn_mask=np.ones((1, 2, Tq, T), bool)), ValueError,
         ["attn_mask"]),
        ("bias_shape", "fwd", dict(bias=np.ones((Tq, T + 1))), ValueError,
         ["bias", "(5, 8)"]),
        ("bias_shape_bwd", "bwd", dict(bias=np.ones((Tq + 1, 1))),
         ValueError, ["bias", "(6, 1)"]),
        ("attn_mask_float", "fwd", dict(attn_mask=np.ones((Tq, T))),
         TypeError, ["attn_mask", "bias=", "PyTorch", "opposite"]),
        ("attn_mask_int", "bwd", dict(attn_mask=np.ones((Tq, T), np.int8)),
         TypeError, ["attn_mask", "bias=", "PyTorch", "opposite"]),
        ("dropout_one", "fwd", dict(dropout=1.0, seed=1), ValueError,
         ["dropout", "[0, 1)"]),
        ("dropout_negative", "bwd", dict(dropout=-0.1, seed=1),
         ValueError, ["dropout", "[0, 1)"]),
        ("dropout_nan", "fwd", dict(dropout=float("nan"), seed=1),
         ValueError, ["dropout"]),
        ("dropout_without_seed", "fwd", dict(dropout=0.1, seed=None),
         ValueError, ["dropout", "seed"]),
        ("dropout_without_seed_bwd", "bwd", dict(dropout=0.1, seed=None),
         ValueError, ["dropout", "seed"]),
        ("seed_negative", "fwd", dict(dropout=0.1, seed=-1), ValueError,
         ["seed"]),
        ("seed_too_big", "fwd", dict(dropout=0.1, seed=2**64), ValueError,
         ["seed"]),
        ("lse_without_out", "bwd_lse", dict(out=None), ValueError,
         ["out", "lse"]),
        ("out_without_lse", "bwd_lse", dict(lse=None), ValueError,
         ["out", "lse"]),
        ("alpha_with_lse", "bwd", dict(lse="lse"), ValueError,
         ["alpha", "lse"]),
        ("alpha_with_out_and_lse", "bwd", dict(lse="lse", out="out"),
         ValueError, ["alpha", "lse"]),
        ("grad_alpha_with_lse", "bwd_lse", dict(grad_alpha="ga"),
         ValueError, ["grad_alpha"]),
        ("causal_single", "fwd_single", dict(causal=True), ValueError,
         ["causal"]),
        ("attn_mask_single", "fwd_single",
         dict(attn_mask=np.ones((2, T), bool)), ValueError, ["attn_mask"]),
        ("causal_single_bwd", "bwd_single", dict(causal=True), ValueError,
         ["causal"]),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("score", ["dot", "general"])
@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_bad_input(score, bad):
    """Each bad call raises with a message naming the argument, writes no
    input, and leaves no state: the next good call gives the same bits as
    the one before it."""
    _, which, changes, exc, words = bad
    single = which.endswith("single")
    rng = np.random.default_rng(17)
    case = Case(rng, score, (2,), 5, 7, single=single, causal=not single,
                bias="T", dropout=P_DROP)
    x = case.cast(np.float64)
    kind = case.kind
    out, lse = case.forward(ac, x, False)
    _, alpha = case.forward(ac, x, True)
    named = {"lse": lse, "out": out, "ga": x["grad_alpha"]}

    def call(chg=None):
        kw = case.kwargs(x)
        req = case.required(x)
        if chg:
            kw.update({k: named.get(v, v) if isinstance(v, str) else v
                       for k, v in chg.items()})
        if which.startswith("fwd"):
            return getattr(ac, f"{kind}_attention")(*req, **kw)
        fn = getattr(ac, f"{kind}_attention_backward")
        if which == "bwd_lse":
            kw = dict(dict(out=out, lse=lse), **kw)
            if chg:                  # out=None / lse=None: left out
                kw = {k: v for k, v in kw.items()
                      if not (k in ("out", "lse") and v is None)}
            return fn(x["grad_out"], *req, **kw)
        return fn(x["grad_out"], *req, alpha, **kw)

    good = call()
    copies = {n: a.copy() for n, a in x.items() if a is not None}
    with pytest.raises(exc) as info:
        call(changes)
    msg = str(info.value)
    for word in words:
        assert word in msg, f"{word!r} not in message: {msg}"
    for n, a in copies.items():
        assert np.array_equal(x[n], a), f"{n} written by a bad call"
    assert_all_identical(tuple(call()), tuple(good), "the next good call")


# --------------------------------------------------------------------------
# 8. Sizes: 70 000 keys


def _reference_in_chunks(case, x, chunk=16384):
    """out, lse and the gradients (from out and lse) of the 70 000-key
    problem in float64, one block of keys at a time: lse by a running
    log-sum-exp, then P_it = exp(s_it - lse_i) per chunk
    (docs/contract.md 5.3, 5.4)."""
    q, k, v = (f64(x[n]) for n in ("query", "keys", "values"))
    g, bias = f64(x["grad_out"]), f64(x["bias"])
    scale = 1 / np.sqrt(k.shape[-1])
    vis_all = case.visible()
    Tq, T = case.Tq, case.T
    b = np.arange(int(np.prod(case.lead))).reshape(case.lead)
    keep = ref.dropout_keep(case.seed, case.dropout, b, Tq, T)
    factor = keep / (1 - case.dropout)

    def chunks():
        for t0 in range(0, T, chunk):
            sl = slice(t0, t0 + chunk)
            s = scale * q @ k[..., sl, :].swapaxes(-1, -2) + bias[sl]
            vis = vis_all[..., sl]
            yield sl, np.where(vis, s, -np.inf), vis

    lse = np.full(case.lead + (Tq,), -np.inf)
    for _, s, _ in chunks():
        lse = np.logaddexp(lse, np.logaddexp.reduce(s, axis=-1))
    out = np.zeros(case.lead + (Tq, v.shape[-1]))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dbias = np.zeros(T)
    parts = []
    for sl, s, vis in chunks():
        with np.errstate(invalid="ignore"):      # -inf - -inf: not seen
            P = np.where(vis, np.exp(s - lse[..., None]), 0)
        parts.append((sl, P))
        out += (P * factor[..., sl]) @ v[..., sl, :]
    D = (g * out).sum(axis=-1)
    for sl, P in parts:
        gamma = (g @ v[..., sl, :].swapaxes(-1, -2)) * factor[..., sl]
        delta = P * (gamma - D[..., None])
        dv[..., sl, :] = (P * factor[..., sl]).swapaxes(-1, -2) @ g
        dq += scale * delta @ k[..., sl, :]
        dk[..., sl, :] = scale * delta.swapaxes(-1, -2) @ q
        dbias[sl] = delta.sum(axis=(0, 1))
    return out, lse, (dq, dk, dv, dbias)


@dtype_param
def test_70000_keys(dtype):
    """T = 70 000 keys, 4 queries, return_weights=False (causal with
    Tq < T, a key mask, a (T,) bias, dropout): out, lse and every gradient
    from out= and lse= against float64 computed chunk by chunk."""
    rng = np.random.default_rng(19)
    case = Case(rng, "dot", (2,), 4, 70_000, H=16, Hv=8, causal=True,
                mask="key", bias="T", dropout=0.1)
    case.mask[0, -3:] = False          # the last keys, seen by one query
    x = case.cast(dtype)
    out, lse = case.forward(ac, x, False)
    want_out, want_lse, want_g = _reference_in_chunks(case, x)
    check(out, want_out, dtype, "out")
    check(lse, want_lse, dtype, "lse")
    grads = case.backward(ac, x, {"out": out, "lse": lse})
    # the float32 bound: the C gradients from its own (rounded) out and lse
    tol = 10 * TOL[np.dtype(dtype).type]
    for name, got, want in zip(grads._fields, grads, want_g):
        check(got, want, dtype, f"d{name}", tol, floor=1.0)
