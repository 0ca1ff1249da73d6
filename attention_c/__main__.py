"""python -m attention_c: a short self-check and demo of the layer.

Computes context-pooled attention on a random masked batch, shows one
sequence's weights and output, checks the C kernels and their gradients
(the layer, the five scores of the attention family with masks and
causal attention, and the streamed self-attention path with bias and
dropout) against the plain NumPy reference in float32 and float64, and
times the fused C layer against the reference.  Exits with status 1 if a
check fails.
"""

import argparse
import sys
import time

import numpy as np

import attention_c as ac
from attention_c import reference as ref
from attention_c.testing import TOL, ragged_batch, rel_err


def median_time(fn, repeat=7):
    """Median wall time of fn() in seconds over `repeat` runs."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def check(rng, dtype):
    """Max normwise errors of the forward and the gradients vs reference."""
    h, W, v, b, mask = ragged_batch(rng, 6, 19, 17, 13, empty_row=True)
    h, W, v, b = (x.astype(dtype) for x in (h, W, v, b))
    g = rng.standard_normal((6, 17)).astype(dtype)
    ga = rng.standard_normal((6, 19)).astype(dtype)
    out, alpha = ac.context_attention(h, W, v, b=b, mask=mask)
    grads = ac.context_attention_backward(g, h, W, v, alpha, b=b, mask=mask,
                                          grad_alpha=ga)
    f64 = [x.astype(np.float64) for x in (h, W, v, b, g, ga)]
    r_out, r_alpha = ref.context_attention(*f64[:3], b=f64[3], mask=mask)
    r_grads = ref.context_attention_backward(
        f64[4], f64[0], f64[1], f64[2], r_alpha, b=f64[3], mask=mask,
        grad_alpha=f64[5])
    fwd = max(rel_err(out, r_out), rel_err(alpha, r_alpha))
    bwd = max(rel_err(x, r) for x, r in zip(grads, r_grads))
    ok = (fwd <= TOL[dtype] and bwd <= TOL[dtype]
          and out.dtype == dtype and np.all(out[-1] == 0)
          and np.all(alpha[-1] == 0) and np.all(grads.h[-1] == 0))
    return fwd, bwd, ok


def check_family(rng, dtype):
    """Max normwise errors of the three family scores (several queries,
    a key mask, a per-query mask with a fully masked query, causal,
    values) vs reference; each score's forward and every gradient."""
    B, Tq, T, H, Hq, Hv, A = 3, 5, 7, 6, 4, 3, 5
    q, k, vals = (rng.standard_normal(s) for s in
                  ((B, Tq, Hq), (B, T, H), (B, T, Hv)))
    qd = rng.standard_normal((B, Tq, H))
    Wadd, v, b = (rng.standard_normal((A, H + Hq)) / 3,
                  rng.standard_normal(A), rng.standard_normal(A))
    Wgen = rng.standard_normal((Hq, H)) / 3
    mask = np.arange(T) < np.array([[T], [T], [4]])   # padded keys
    attn_mask = rng.random((B, Tq, T)) < 0.8
    attn_mask[0, 2] = False                        # a query with no key
    go, ga = rng.standard_normal((B, Tq, Hv)), rng.standard_normal((B, Tq, T))
    calls = {
        "additive": ((q, k, Wadd, v), "additive_attention",
                     lambda a, x: (x[4], x[0], x[1], x[2], x[3], a)),
        "dot": ((qd, k), "dot_attention",
                lambda a, x: (x[2], x[0], x[1], a)),
        "general": ((q, k, Wgen), "general_attention",
                    lambda a, x: (x[3], x[0], x[1], x[2], a)),
    }
    visibility = dict(mask=mask, attn_mask=attn_mask, causal=True)
    errors = {}
    for score, (args, fn, bwd_args) in calls.items():
        cast = tuple(x.astype(dtype) for x in args)
        extra = dict(values=vals.astype(dtype))
        if score == "additive":
            extra["b"] = b.astype(dtype)
        out, alpha = getattr(ac, fn)(*cast, **extra, **visibility)
        grads = getattr(ac, fn + "_backward")(
            *bwd_args(alpha, cast + (go.astype(dtype),)),
            grad_alpha=ga.astype(dtype), **extra, **visibility)
        f64 = tuple(x.astype(np.float64) for x in cast)
        r_extra = {name: x.astype(np.float64) for name, x in extra.items()}
        r_out, r_alpha = getattr(ref, fn)(*f64, **r_extra, **visibility)
        r_grads = getattr(ref, fn + "_backward")(
            *bwd_args(r_alpha, f64 + (go.astype(dtype).astype(np.float64),)),
            grad_alpha=ga.astype(dtype).astype(np.float64), **r_extra,
            **visibility)
        fwd = max(rel_err(out, r_out), rel_err(alpha, r_alpha))
        bwd = max(rel_err(x, r) for x, r in zip(grads, r_grads)
                  if r is not None)
        ok = (fwd <= TOL[dtype] and bwd <= TOL[dtype] and out.dtype == dtype
              and np.all(alpha[0, 2] == 0) and np.all(grads.query[0, 2] == 0)
              and np.all(alpha[2, :, 4:] == 0))
        errors[score] = (fwd, bwd, ok)
    return errors


def check_scores(rng, dtype):
    """Max normwise errors of the location and content (cosine) scores
    vs reference: Luong's location score with T < T_max (W's and b's rows
    past T get 0) and a key mask; the cosine score with a sharpness per
    query position (its gradient summed over the batch), causal, a key
    and a query of zeros (score 0, finite gradients)."""
    B, Tq, T, Tm, H, Hv = 3, 5, 7, 9, 6, 4
    q, k, vals = (rng.standard_normal(s) for s in
                  ((B, Tq, H), (B, T, H), (B, T, Hv)))
    k[1, 3] = 0
    q[2, 1] = 0
    W, b = rng.standard_normal((Tm, H)) / 2, rng.standard_normal(Tm)
    beta = 1 + 4 * rng.random(Tq)
    mask = np.arange(T) < np.array([[T], [5], [1]])
    go = rng.standard_normal((B, Tq, Hv))
    calls = {
        "location": (("location_attention", (q, vals, W), dict(b=b),
                      dict(mask=mask)),
                     lambda a, x: (x[3], x[0], x[1], x[2], a)),
        "content": (("cosine_attention", (q, k),
                     dict(values=vals, sharpness=beta),
                     dict(mask=mask, causal=True)),
                    lambda a, x: (x[2], x[0], x[1], a)),
    }
    errors = {}
    for score, ((fn, args, params, vis), bwd_args) in calls.items():
        cast = tuple(x.astype(dtype) for x in args + (go,))
        kw = {name: x.astype(dtype) for name, x in params.items()}
        out, alpha = getattr(ac, fn)(*cast[:-1], **kw, **vis)
        grads = getattr(ac, fn + "_backward")(*bwd_args(alpha, cast), **kw,
                                              **vis)
        f64 = tuple(x.astype(np.float64) for x in cast)
        r_kw = {name: x.astype(np.float64) for name, x in kw.items()}
        r_out, r_alpha = getattr(ref, fn)(*f64[:-1], **r_kw, **vis)
        r_grads = getattr(ref, fn + "_backward")(*bwd_args(r_alpha, f64),
                                                 **r_kw, **vis)
        fwd = max(rel_err(out, r_out), rel_err(alpha, r_alpha))
        bwd = max(rel_err(x, r) for x, r in zip(grads, r_grads)
                  if r is not None)
        ok = (fwd <= TOL[dtype] and bwd <= TOL[dtype] and out.dtype == dtype
              and np.all(alpha[2, :, 1:] == 0)
              and all(np.isfinite(x).all() for x in grads if x is not None))
        if score == "location":
            ok &= bool(np.all(grads.W[T:] == 0) and np.all(grads.b[T:] == 0))
        else:
            ok &= grads.sharpness.shape == beta.shape
        errors[score] = (fwd, bwd, ok)
    return errors


def check_streamed(rng, dtype):
    """Max normwise errors of the streamed path of the dot and general
    scores (return_weights=False: out and lse; the backward from out= and
    lse=) vs reference, on causal self-attention with a key mask, a float
    bias whose -inf leaves query 0 no visible key, and dropout; and its
    out against the stored-weights path's."""
    B, T, H, Hv = 3, 9, 6, 4
    x, vals = rng.standard_normal((B, T, H)), rng.standard_normal((B, T, Hv))
    Wgen = rng.standard_normal((H, H)) / 3
    bias = rng.standard_normal((T, T))       # one (T, T) bias for the batch
    bias[0, 0] = -np.inf                     # query 0 (causal) sees key 0 only
    go = rng.standard_normal((B, T, Hv)).astype(dtype)
    common = dict(mask=np.arange(T) < np.array([[T], [T], [6]]),
                  causal=True, dropout=0.25, seed=2024)
    calls = {"dot": ((x, x), "dot_attention"),
             "general": ((x, x, Wgen), "general_attention")}
    errors = {}
    for score, (args, fn) in calls.items():
        cast = tuple(a.astype(dtype) for a in args)
        extra = dict(common, bias=bias.astype(dtype),
                     values=vals.astype(dtype))
        out, lse = getattr(ac, fn)(*cast, return_weights=False, **extra)
        out_w, _ = getattr(ac, fn)(*cast, **extra)       # stored weights
        grads = getattr(ac, fn + "_backward")(go, *cast, out=out, lse=lse,
                                              **extra)
        f64 = tuple(a.astype(np.float64) for a in cast)
        r_extra = dict(common, bias=bias.astype(dtype).astype(np.float64),
                       values=vals.astype(dtype).astype(np.float64))
        r_out, r_lse = getattr(ref, fn)(*f64, return_weights=False,
                                        **r_extra)
        r_grads = getattr(ref, fn + "_backward")(
            go.astype(np.float64), *f64, out=r_out, lse=r_lse, **r_extra)
        seen = np.isfinite(r_lse)
        fwd = max(rel_err(out, r_out), rel_err(lse[seen], r_lse[seen]),
                  rel_err(out_w, out))
        bwd = max(rel_err(g, r) for g, r in zip(grads, r_grads)
                  if r is not None)
        ok = (fwd <= TOL[dtype] and bwd <= TOL[dtype] and out.dtype == dtype
              and lse.shape == (B, T) and grads.bias.shape == (T, T)
              and np.array_equal(np.isfinite(lse), seen)
              and not seen[:, 0].any()
              and np.all(out[:, 0] == 0) and np.all(grads.query[:, 0] == 0))
        errors[score] = (fwd, bwd, ok)
    return errors


def check_multihead(rng, dtype):
    """Normwise errors of ac.MultiHeadAttention (heads read in place, one
    kernel call) vs reference.multi_head_attention, forward and input
    gradients (by central differences of the reference, float64 only: the
    float32 backward against the float64 layer's), on causal
    self-attention with a key mask that leaves sequence 2 one key; and
    decoding one token at a time with a KVCache vs the full causal call."""
    B, T, E, heads = 3, 7, 12, 3
    mha = ac.MultiHeadAttention(E, heads, seed=0, dtype=dtype)
    x = rng.standard_normal((B, T, E)).astype(dtype)
    mask = np.arange(T) < np.array([[T], [5], [1]])
    out = mha(x, mask=mask, causal=True)
    r_out, _ = ref.multi_head_attention(mha.parameters(), heads, x,
                                        mask=mask, causal=True)
    g = rng.standard_normal(out.shape).astype(dtype)
    dx = mha.backward(g).query
    full = mha.parameters()
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    if dtype == np.float32:            # against the float64 layer's
        exact = ac.MultiHeadAttention(E, heads, dtype=np.float64)
        for name, p in exact.parameters().items():
            p[...] = full[name]
        exact(x64, mask=mask, causal=True)
        r_dx = exact.backward(g64).query
    else:                              # central differences of the ref
        eps, r_dx = 1e-6, np.zeros_like(x64)
        for idx in np.ndindex(x64.shape):
            for sign in (1, -1):
                xp = x64.copy()
                xp[idx] += sign * eps
                o, _ = ref.multi_head_attention(full, heads, xp, mask=mask,
                                                causal=True)
                r_dx[idx] += sign * (o * g64).sum() / (2 * eps)
    cache = ac.KVCache(max_len=T)
    steps = np.concatenate([mha(x[:, t:t + 1], cache=cache)
                            for t in range(T)], axis=1)
    fwd = max(rel_err(out, r_out), rel_err(steps, mha(x, causal=True)))
    bwd = rel_err(dx, r_dx)
    tol = TOL[dtype] if dtype == np.float32 else 1e-7   # differences
    return fwd, bwd, fwd <= TOL[dtype] and bwd <= tol


# The self-check: (title, check(rng, dtype) -> (fwd, bwd, ok) or
# {score: (fwd, bwd, ok)}).
CHECKS = [
    ("check against attention_c.reference (normwise relative error):",
     check),
    ("the attention family (several queries, key mask, attn_mask, causal, "
     "values):", check_family),
    ("the location and content scores (location: T < T_max, key mask; "
     "content: a\n  sharpness per query, causal, zero vectors):",
     check_scores),
    ("self-attention, streamed (return_weights=False, backward from out "
     "and lse;\n  causal, key mask, bias with -inf, dropout):",
     check_streamed),
    ("multi-head attention (ac.MultiHeadAttention: causal, key mask; "
     "decoding with\n  a KVCache against the full call):", check_multihead),
]


def parse_args(argv=None):
    """The command line of ``python -m attention_c``."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog="More: python -m attention_c.bench (speed against PyTorch), "
               "pytest (the tests), notebooks/ (Jupyter).  Environment: "
               "ATTENTION_C_SIMD=scalar|avx2|avx512|neon forces a SIMD "
               "path, ATTENTION_C_BF16_UNIT=dot|amx the unit of bf16 "
               "products, ATTENTION_C_NUM_THREADS the threads.")
    parser.add_argument("--version", action="version",
                        version=f"attention_c {ac.__version__}")
    parser.add_argument("--config", action="store_true",
                        help="print the build and run-time configuration "
                             "(version, compiler, SIMD path, threads) and "
                             "exit")
    parser.add_argument("--no-timing", action="store_true",
                        help="run the demo and the self-check only, "
                             "without timing the layer")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random problems (default 0)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.config:
        ac.show_config()
        return 0
    rng = np.random.default_rng(args.seed)
    print(f"attention_c {ac.__version__}: context-pooled additive attention "
          f"and the attention family")
    print("  c = mean(h_t),  s_t = v . tanh(W [h_t; c] + b),  "
          "alpha = softmax(s),  out = sum_t alpha_t h_t\n")

    # 1. The demo: one batch, one sequence shown.
    h, W, v, b, mask = ragged_batch(rng, 4, 8, 6, 5, empty_row=True)
    out, alpha = ac.context_attention(h, W, v, b=b, mask=mask)
    np.set_printoptions(precision=3, suppress=True)
    print(f"batch h {h.shape}, W {W.shape}; sequence 0 has "
          f"{mask[0].sum()} of 8 items valid")
    print(f"  alpha[0] = {alpha[0]}   (sum {alpha[0].sum():.6f})")
    print(f"  out[0]   = {out[0]}")
    print(f"  row 3 is fully masked: out[3] = {out[3]}, "
          f"alpha[3].max() = {alpha[3].max()}\n")

    # 2. The self-check against the NumPy reference.
    all_ok = True
    for title, check_one in CHECKS:
        print(title)
        for dtype in (np.float32, np.float64):
            results = check_one(rng, dtype)
            if isinstance(results, tuple):          # one row, no score
                results = {None: results}
            for score, (fwd, bwd, ok) in results.items():
                all_ok &= ok
                name = "" if score is None else f"{score:8s} "
                tol = (f"(tolerance {TOL[dtype]:.0e})  "
                       if check_one is check else "")
                print(f"  {name}{np.dtype(dtype).name:8s} forward "
                      f"{fwd:.1e}  gradients {bwd:.1e}  {tol}"
                      f"{'ok' if ok else 'FAILED'}")

    if args.no_timing:
        print("\nall checks passed" if all_ok else "\nSELF-CHECK FAILED")
        return 0 if all_ok else 1

    # 3. Call times, median of repeated runs in this process.
    B, T, H, A = 32, 128, 128, 128
    h, W, v, b, mask = ragged_batch(rng, B, T, H, A, empty_row=True)
    h32, W32, v32, b32 = (x.astype(np.float32) for x in (h, W, v, b))
    g = rng.standard_normal((B, H)).astype(np.float32)
    out, alpha = ac.context_attention(h32, W32, v32, b=b32, mask=mask)
    t_c = median_time(lambda: ac.context_attention(h32, W32, v32, b=b32,
                                                   mask=mask))
    t_r = median_time(lambda: ref.context_attention(h32, W32, v32, b=b32,
                                                    mask=mask))
    tb_c = median_time(lambda: ac.context_attention_backward(
        g, h32, W32, v32, alpha, b=b32, mask=mask))
    tb_r = median_time(lambda: ref.context_attention_backward(
        g, h32, W32, v32, alpha, b=b32, mask=mask))
    print(f"\ntimes, float32, B={B} T={T} H={H} A={A} (median of 7; "
          f"SIMD path {ac._core._get_simd()}, {ac.get_num_threads()} "
          f"thread(s); python -m attention_c.bench measures more):")
    print(f"  forward   C {t_c * 1e3:7.2f} ms   NumPy reference "
          f"{t_r * 1e3:7.2f} ms   ratio {t_c / t_r:.2f}")
    print(f"  backward  C {tb_c * 1e3:7.2f} ms   NumPy reference "
          f"{tb_r * 1e3:7.2f} ms   ratio {tb_c / tb_r:.2f}")
    print("\nall checks passed" if all_ok else "\nSELF-CHECK FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
