"""The attention family (docs/contract.md section 4): a query scored
against keys by the additive, dot or general score, the masked softmax,
and the weighted sum of the values; and project_keys, the keys' side of a
score computed once.

Every function, the C kernels *and* ``attention_c.reference``, is checked
against an independent float64 evaluation of the formulas of
docs/contract.md 4.3 and 4.4 written as plain loops over the query i and
the key t (family_cases.py: ``loop_forward``, ``loop_backward``,
``loop_project_keys``; slow, so the sizes are small), and every gradient (C,
reference and the loops themselves) against central finite differences
(testing.numerical_grad) of ``L = sum(out G) [+ sum(alpha Ga)]`` in float64.
The input handling (dtypes, errors, inputs never modified) is in
test_family_inputs.py.

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

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c import reference as ref
from attention_c.testing import (FD_RTOL, ILL_FACTOR, MASK_KINDS, Problem, TOL,
                                 assert_identical, numerical_grad, rel_err)

from family_cases import (FamilyProblem, GRAD_FIELDS, GRAD_TYPES, IMPLS, Loops,
                          SIMD_PATHS, check, check_grads, dtype_param, f64,
                          ga_param, grad_dict, lead_id, loop_forward,
                          loop_project_keys, loop_project_keys_backward,
                          run_pair, score_fn, score_param, values_param)

pytestmark = pytest.mark.filterwarnings("error")


# --------------------------------------------------------------------------
# 1. C and reference against the loops


LEADS = [(), (2,), (2, 3)]
# (one query?, mask kind): a per-query mask needs several queries
CASES = [(True, "none"), (True, "key"), (True, "dead"), (True, "one"),
         (False, "none"), (False, "key"), (False, "query"),
         (False, "causal"), (False, "dead")]


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
@pytest.mark.parametrize("lead", LEADS, ids=lead_id)
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


@pytest.mark.parametrize("lead", LEADS, ids=lead_id)
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
@pytest.mark.parametrize("lead", LEADS, ids=lead_id)
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


@pytest.mark.parametrize("lead", LEADS, ids=lead_id)
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


# --------------------------------------------------------------------------
# 7. Threads and SIMD paths


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
    s_fn = score_fn(kind, p.H, x64["W"], x64["v"], x64["b"], p.scale)
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
# 8. The reference and the C agree at the edges


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
