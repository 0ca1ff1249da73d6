"""NaN and Inf in valid data: contained to their own sequence.

A NaN or Inf in one sequence may change only that sequence's outputs (and
the parameter gradients, which are summed over the batch); it never hangs,
and a fully valid neighbour sequence keeps exactly the result it has when
computed alone.  Checked for every function, both dtypes, every SIMD path
and 1 and 2 threads, with the bad value in every argument it can be in.
"""

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core, reference
from attention_c.testing import API_ARGS, Problem

SIMD_PATHS = list(_core._simd_paths())
BATCH_ARGS = {
    "mean_context": ["h"],
    "mean_context_backward": ["grad_c"],
    "additive_score": ["h", "context"],
    "additive_score_backward": ["grad_s", "h", "context"],
    "masked_softmax": ["scores"],
    "masked_softmax_backward": ["grad_alpha", "alpha"],
    "weighted_sum": ["alpha", "h"],
    "weighted_sum_backward": ["grad_out", "alpha", "h"],
    "context_attention": ["h"],
    "context_attention_backward": ["grad_out", "h", "alpha", "grad_alpha"],
    "additive_attention": ["query", "keys", "values"],
    "additive_attention_backward": ["grad_out", "query", "keys", "values",
                                    "alpha", "grad_alpha"],
    "dot_attention": ["query", "keys", "values", "bias"],
    "dot_attention_backward": ["grad_out", "query", "keys", "values",
                               "alpha", "grad_alpha", "bias"],
    "general_attention": ["query", "keys", "values", "bias"],
    "general_attention_backward": ["grad_out", "query", "keys", "values",
                                   "alpha", "grad_alpha", "bias"],
    "project_keys": ["keys"],
    "project_keys_backward": ["grad_proj", "keys"],
}
FAMILY = ["additive_attention", "additive_attention_backward",
          "dot_attention", "dot_attention_backward", "general_attention",
          "general_attention_backward", "project_keys",
          "project_keys_backward"]
# outputs that are summed over the batch (may change)
SHARED = {"additive_score_backward": {2, 3, 4},
          "context_attention_backward": {1, 2, 3},
          "additive_attention_backward": {3, 4, 5},
          "general_attention_backward": {3},
          "project_keys_backward": {1}}
# arguments shared by the batch (weights, flags), not split into sequences
PARAMS = {"W", "v", "b", "scale", "causal", "dropout", "seed",
          "return_weights"}
BAD = [np.nan, np.inf, -np.inf]


def _args(fn, p, alpha):
    every = dict(h=p.h, mask=p.mask, grad_c=p.grad_out, context=p.context,
                 W=p.W, v=p.v, b=p.b, grad_s=p.grad_s, scores=p.grad_s * 3,
                 grad_alpha=p.grad_alpha, alpha=alpha, grad_out=p.grad_out)
    return {n: every[n] for n in API_ARGS[fn]}


def _family_args(fn, rng, causal=False):
    """Arguments of a family function: 4 sequences of Tq = 5 queries and
    T = 37 keys, sequence 3 with keys 5.. masked, a per-query attn_mask
    hiding key 1 from query 0 in sequences 0 and 3 and key 0 from query 2
    in sequence 0 (sequence 1, where the bad values go, sees every key,
    so that alpha may be NaN everywhere there), causal as given; for
    dot/general a bias per sequence (no dropout: its keep bits depend on
    the sequence's index in the batch)."""
    lead, Tq, T, H, Hq, Hv, A = (4,), 5, 37, 19, 11, 13, 23
    kind = fn.split("_")[0]
    if kind == "dot":
        Hq = H
    mask = np.ones(lead + (T,), bool)
    mask[3, 5:] = False
    attn_mask = np.ones(lead + (Tq, T), bool)
    attn_mask[[0, 3], 0, 1] = False
    attn_mask[0, 2, 0] = False
    x = dict(query=rng.standard_normal(lead + (Tq, Hq)),
             keys=rng.standard_normal(lead + (T, H)),
             values=rng.standard_normal(lead + (T, Hv)), mask=mask,
             attn_mask=attn_mask, causal=causal,
             grad_out=rng.standard_normal(lead + (Tq, Hv)),
             grad_alpha=rng.standard_normal(lead + (Tq, T)))
    if kind in ("dot", "general"):
        x.update(bias=rng.standard_normal(lead + (Tq, T)))
    if kind == "additive":
        x.update(W=rng.standard_normal((A, H + Hq)) / 5,
                 v=rng.standard_normal(A), b=rng.standard_normal(A))
    elif kind == "general":
        x.update(W=rng.standard_normal((Hq, H)) / 5)
    elif kind == "dot":
        x.update(scale=0.4)
    else:
        x.update(W=rng.standard_normal((A, H + 2)),
                 grad_proj=rng.standard_normal(lead + (T, A)))
    if kind != "project":
        fwd = getattr(reference, f"{kind}_attention")
        x["alpha"] = fwd(**{n: x[n] for n in API_ARGS[f"{kind}_attention"]
                            if n in x})[1]
    return {n: x.get(n) for n in API_ARGS[fn]}


def _outs(res):
    return tuple(res) if isinstance(res, tuple) else (res,)


@pytest.fixture
def restore():
    simd, n = _core._get_simd(), ac.get_num_threads()
    yield
    _core._set_simd(simd)
    ac.set_num_threads(n)


@pytest.mark.parametrize("dtype", [np.float32, np.float64],
                         ids=["float32", "float64"])
@pytest.mark.parametrize("fn", list(BATCH_ARGS))
def test_nonfinite_stays_in_its_sequence(fn, dtype, rng, restore):
    # 4 sequences; the NaN/Inf goes into sequence 1, sequence 2 is fully
    # valid and is compared with the same call on it alone.
    if fn in FAMILY:
        args = _family_args(fn, rng)
    else:
        p = Problem(rng, (4,), 37, 19, 23, mask="none")
        p.mask = np.ones((4, 37), bool)
        p.mask[3, 5:] = False
        alpha = reference.masked_softmax(p.grad_s, mask=p.mask)
        args = _args(fn, p, alpha)
    base = {k: (v.astype(dtype) if isinstance(v, np.ndarray)
                and v.dtype != bool else v) for k, v in args.items()}
    func = getattr(ac, fn)
    cases = 0
    for path in SIMD_PATHS:
        _core._set_simd(path)
        for threads in (1, 2):
            ac.set_num_threads(threads)
            clean = _outs(func(**base))
            alone = _outs(func(**{k: (v[2:3] if k not in PARAMS
                                      and v is not None else v)
                                  for k, v in base.items()}))
            for arg in BATCH_ARGS[fn]:
                for bad in BAD:
                    if (arg == "bias" and bad == -np.inf
                            and "alpha" in base):
                        # -inf in bias is a mask: the forward's alpha
                        # no longer fits it (refused, test_alpha_check)
                        continue
                    for pos in ("first", "middle", "all"):
                        kw = dict(base)
                        x = base[arg].copy()
                        if pos == "first":
                            x[1].flat[0] = bad
                        elif pos == "middle":
                            x[1].flat[x[1].size // 2] = bad
                        else:
                            x[1] = bad
                        kw[arg] = x
                        got = _outs(func(**kw))
                        cases += 1
                        what = (f"{fn}({arg}[1] {pos} = {bad}) on {path}, "
                                f"{threads} threads")
                        for i, (g, c, a) in enumerate(zip(got, clean,
                                                          alone)):
                            if c is None:
                                continue
                            if i in SHARED.get(fn, ()):
                                continue            # summed over the batch
                            # sequences 0, 2, 3 exactly as without the
                            # bad value
                            for seq in (0, 2, 3):
                                assert np.array_equal(g[seq], c[seq]), (
                                    f"{what}: output {i} of sequence {seq} "
                                    f"changed")
                            # the fully valid neighbour: finite and equal to
                            # the call on it alone
                            assert np.all(np.isfinite(g[2])), what
                            assert np.array_equal(g[2:3], a), what
    assert cases > 0


def test_nonfinite_shared_gradients_do_not_hang(rng, restore):
    """NaN/Inf everywhere in the layer (weights too): every call returns
    promptly (the test has a process-level timeout in CI via the whole
    suite) and the next clean call is exact."""
    p = Problem(rng, (3,), 64, 33, 17)
    _, alpha = ac.context_attention(p.h, p.W, p.v, b=p.b, mask=p.mask)
    want = ac.context_attention_backward(p.grad_out, p.h, p.W, p.v, alpha,
                                         b=p.b, mask=p.mask)
    for bad in BAD:
        for name in ("h", "W", "v", "b"):
            kw = dict(h=p.h, W=p.W, v=p.v, b=p.b)
            kw[name] = np.full_like(kw[name], bad)
            ac.context_attention(**kw, mask=p.mask)
            ac.context_attention_backward(p.grad_out, kw["h"], kw["W"],
                                          kw["v"], alpha, b=kw["b"],
                                          mask=p.mask)
    got = ac.context_attention_backward(p.grad_out, p.h, p.W, p.v, alpha,
                                        b=p.b, mask=p.mask)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


@pytest.mark.parametrize("fn", [f for f in FAMILY
                                if f.endswith("attention_backward")])
def test_family_nonfinite_everywhere_does_not_hang(fn, rng, restore):
    """NaN/Inf filling any one argument of a family forward and backward
    (weights included): every call returns, and the next clean call gives
    the same bits as before (causal attention, a per-query mask)."""
    args = _family_args(fn, rng, causal=True)
    kind = fn.split("_")[0]
    fwd = getattr(ac, f"{kind}_attention")
    bwd = getattr(ac, fn)
    fwd_names = API_ARGS[f"{kind}_attention"]
    want = _outs(bwd(**args))
    for bad in BAD:
        for name, x in args.items():
            if not isinstance(x, np.ndarray) or x.dtype == bool:
                continue
            kw = dict(args, **{name: np.full_like(x, bad)})
            fwd(**{n: kw.get(n) for n in fwd_names})
            if name == "bias" and bad == -np.inf:
                # a -inf bias hides every key: the clean alpha is refused
                with pytest.raises(ValueError, match="alpha at"):
                    bwd(**kw)
                continue
            if name == "alpha":
                # refused where the masks hide; bad where they do not
                with pytest.raises(ValueError, match="alpha at"):
                    bwd(**kw)
                Tq, T = x.shape[-2:]
                valid = (args["mask"][:, None, :] & args["attn_mask"]
                         & np.tril(np.ones((Tq, T), bool), k=T - Tq))
                kw["alpha"] = np.where(valid, bad, 0)
            bwd(**kw)
    for g, w in zip(_outs(bwd(**args)), want):
        assert (g is None and w is None) or np.array_equal(g, w)


@pytest.mark.parametrize("arg", ["query", "keys", "values"])
def test_nonfinite_scan_split_across_threads(arg, rng, restore):
    """Inputs large enough that the scan for non-finite rows runs in
    chunks on the call's threads (1024 rows of 64 a chunk here): bad
    values at the chunks' edges give the same results, bit for bit, on 1
    and 2 threads, and only rows that see them (a bad query its own; a
    bad key or value the later queries of its sequence: causal) differ
    from the clean call beyond rounding."""
    B, h, T, d = 2, 4, 300, 64                   # 2400 rows of each input
    x = {n: rng.standard_normal((B, h, T, d)).astype(np.float32)
         for n in ("query", "keys", "values")}
    call = lambda **kw: ac.dot_attention(                   # noqa: E731
        kw["query"], kw["keys"], values=kw["values"], causal=True,
        return_weights=False)[0]
    ac.set_num_threads(1)
    clean = call(**x).reshape(-1, d)
    bad = dict(x)
    bad[arg] = x[arg].copy()
    rows = bad[arg].reshape(-1, d)
    sees = np.zeros(B * h * T, bool)
    for r, v in zip((0, 1023, 1024, 2047, 2048, B * h * T - 1),
                    (np.nan, np.inf, -np.inf, np.nan, np.inf, np.nan)):
        rows[r, r % d] = v
        if arg == "query":
            sees[r] = True
        else:                                  # queries t >= the key's
            sees[r:(r // T + 1) * T] = True
    got = {}
    for threads in (1, 2):
        ac.set_num_threads(threads)
        got[threads] = call(**bad).reshape(-1, d)
    np.testing.assert_array_equal(got[2], got[1])
    # (a call with a bad value anywhere runs the general path, not the
    # fused one: the clean rows agree to rounding, not bit for bit)
    scale = np.abs(clean).max()
    np.testing.assert_allclose(got[1][~sees], clean[~sees], rtol=0,
                               atol=1e-5 * scale)
    # (a key's -inf score only drops it: some rows that see it may not
    # change; NaN is never near)
    near = np.abs(got[1][sees] - clean[sees]).max(-1) <= 1e-3 * scale
    assert not near.all()
