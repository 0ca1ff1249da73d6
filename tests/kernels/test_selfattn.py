"""Self-attention at scale (docs/contract.md section 5): the C functions'
dot and general attention with ``mask`` (key mask), ``attn_mask``,
``causal``, ``bias``, ``dropout`` + ``seed`` and ``return_weights``, forward
and backward (from ``alpha`` or from ``out=`` and ``lse=``), against
references:

* every argument combination against ``attention_c.reference`` (itself
  checked against loops in tests/kernels/test_reference_selfattn.py), on
  odd sizes and on sizes that cross the streamed kernel's blocks (64
  queries x 256 keys), with exact zeros where docs/contract.md 5.1
  says so;
* the gradients, dbias included and with dropout, against central finite
  differences;
* return_weights=False against the stored-weights path;
* T = 70 000 keys.

The cases and checks are in selfattn_cases.py; the dropout keep bits,
threads, SIMD paths, NaN and bad input in test_selfattn_robustness.py.

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
from attention_c import reference as ref
from attention_c.testing import (FD_RTOL, ILL_FACTOR, TOL,
                                 assert_all_identical, f64, numerical_grad,
                                 rel_err)

from selfattn_cases import (ATTN, BIASES, Case, MASKS, P_DROP, SKB, SQB,
                            SQB_CAUSAL, check, check_case, dtype_param,
                            score_param)

pytestmark = pytest.mark.filterwarnings("error")


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
    dropout; a (Tq, T) attn_mask + bias with -inf rows; an attn_mask of
    one run of keys a row (ranges) + dropout."""
    for n, kw in enumerate([
            dict(causal=True, mask="key", bias="T", dropout=P_DROP),
            dict(attn="TqT", bias="TqT_ninf"),
            dict(attn="runs", dropout=P_DROP)]):
        rng = np.random.default_rng([Tq, T, n])
        case = Case(rng, score, (2,), Tq, T, H=8, Hq=5, Hv=3, **kw)
        check_case(case, dtype)


@pytest.mark.parametrize("kw", [
    dict(), dict(causal=True, dropout=P_DROP), dict(mask="key", attn="TqT"),
    dict(mask="key", attn="runs", causal=True)],
    ids=["full", "causal_dropout", "masks", "runs"])
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


@pytest.mark.parametrize("Tq, T", [(300, 300), (130, 257), (65, 17)],
                         ids=["Tq300-T300", "Tq130-T257", "Tq65-T17"])
@dtype_param
@pytest.mark.parametrize("score", ["dot", "general"])
def test_attn_mask_of_runs_is_ranges(score, dtype, Tq, T):
    """An attn_mask whose every row is one run of keys is read as ranges
    (docs/contract.md 5.3): ``np.tril`` gives the bits of ``causal=True``,
    a band those of ``window=``, each with a padding key mask too, forward
    and backward."""
    rng = np.random.default_rng(Tq + T)
    case = Case(rng, score, (2, 3), Tq, T, H=16, Hq=8, Hv=8)
    x = case.cast(dtype)
    args = case.required(x)
    fn = ac.dot_attention if case.kind == "dot" else ac.general_attention
    bwd = (ac.dot_attention_backward if case.kind == "dot"
           else ac.general_attention_backward)
    i = np.arange(Tq)[:, None] + (T - Tq)
    t = np.arange(T)[None, :]
    pad = np.ones((2, 3, T), bool)
    pad[1, :, :T // 3] = False                 # left padding: one run
    g = rng.standard_normal((2, 3, Tq, 8)).astype(dtype)
    for mask in (None, pad):
        for runs, kw in ((t <= i, dict(causal=True)),
                         (np.abs(t - i) <= 5, dict(window=(5, 5)))):
            common = dict(mask=mask, values=x["values"],
                          return_weights=False)
            want = fn(*args, **kw, **common)
            got = fn(*args, attn_mask=runs, **common)
            assert_all_identical(got, want, f"attn_mask of runs vs {kw}")
            common.pop("return_weights")
            gw = bwd(g, *args, out=want[0], lse=want[1], **kw, **common)
            gg = bwd(g, *args, out=got[0], lse=got[1], attn_mask=runs,
                     **common)
            assert_all_identical(gg, gw, f"gradients against {kw}")


# --------------------------------------------------------------------------
# 4. Sizes: 70 000 keys


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
