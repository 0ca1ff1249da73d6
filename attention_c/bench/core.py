"""Two measurements beside the layer's rows: our product core alone
against NumPy's BLAS, in GFLOP/s next to the machine's measured FMA peak,
and the fixed cost of a call.

The product core: ``attention_c.project_keys(keys, W)``, a plain
``(rows, H) x (A, H)^T`` product through the blocked product (packing and
micro-kernel) the layer runs, against NumPy's ``keys @ W.T`` (its BLAS,
OpenBLAS in NumPy's wheels, on the same thread count through
threadpoolctl), on the layer's main product: rows = B*T, the data of the
shape's full-sequence problem.  GFLOP/s = 2 * rows * H * A / seconds.

The fixed cost: shape (1, 1, 1, 1), no mask, where there is no arithmetic
to speak of: what remains is the Python wrapper, argument parsing, the
dtype and shape checks, the output allocation and the threads' wake-up.
"""

import sys
import time

import numpy as np

import attention_c as ac
from attention_c.bench import harness
from attention_c.bench.run import (TOLERANCE, make_problem,
                                   numpy_functions, ours_functions)
from attention_c.testing import rel_err

GEMM_SHAPES = ("medium", "large", "wide", "wide2")
CALL_SHAPE = (1, 1, 1, 1)
CALL_FUNCTIONS = {"ours_fwd": "fwd", "ours_bwd": "bwd",
                  "ours_fwdbwd": "f+b", "ours_fwdbwd_saved": "f+b_sv",
                  "s1": "S1"}


def gflops(m, n, k, seconds):
    """GFLOP/s of an (m, k) x (k, n) product taking ``seconds``: 2 m n k
    flops (a multiply and an add per term)."""
    return 2.0 * m * n * k / seconds / 1e9


def run_gemm(options, ctx, peak):
    """Our product core and NumPy's BLAS on the layer's main product of
    each shape of GEMM_SHAPES run; returns one row per shape, dtype and
    thread count."""
    rows = []
    for name in (s for s in options.shapes if s in GEMM_SHAPES):
        B, T, H, A = shape = ctx["shapes"][name]
        for dtype in options.dtypes:
            p = make_problem(shape, dtype, ctx["seed"], "full")
            keys = p["h"].reshape(B * T, H)
            W = np.ascontiguousarray(p["W"][:, :H])          # W_h (A, H)
            exact = keys.astype(np.float64) @ W.astype(np.float64).T
            funcs = {"core": lambda: ac.project_keys(keys, W),
                     "blas": lambda: keys @ W.T}
            for threads in options.threads:
                start = time.perf_counter()
                with harness.thread_count(threads, ctx["tpc"], None):
                    errors = {k: rel_err(f(), exact)
                              for k, f in funcs.items()}
                    timed, peak_gflops = harness.measure_peak(
                        funcs, ctx["target"], ctx["min_repeats"], peak,
                        threads, dtype)
                row = {"shape": name, "dtype": dtype, "threads": threads,
                       "M": B * T, "K": H, "N": A, "errors": errors,
                       "times_ms": {k: s * 1e3
                                    for k, (s, _) in timed.items()},
                       "gflops": {k: gflops(B * T, A, H, s)
                                  for k, (s, _) in timed.items()},
                       "peak_gflops": peak_gflops}
                rows.append(row)
                bad = {k: e for k, e in errors.items()
                       if not e <= TOLERANCE[dtype]}
                if bad:
                    print(f"WARNING: the product is inaccurate on {name} "
                          f"{dtype} {threads} thr: {bad}", file=sys.stderr)
                print(f"  product {name:<6} {dtype:<8} {threads} thr "
                      f"{time.perf_counter() - start:6.1f} s",
                      file=sys.stderr)
    return rows


def add_layer_forward(gemm, rows):
    """Give each product row the GFLOP/s of the layer's forward on the same
    shape, dtype and threads, full sequences (from targets.add_ratios), to
    read beside the product alone."""
    forward = {(r["shape"], r["dtype"], r["threads"]): r["fwd_gflops"]
               for r in rows if r["mask"] == "full"}
    for g in gemm:
        g["layer_fwd_gflops"] = forward.get(
            (g["shape"], g["dtype"], g["threads"]))


def run_call_cost(options, ctx):
    """Microseconds per call of ours (and of S1, one NumPy product, for
    scale) on shape (1, 1, 1, 1); one row per dtype and thread count."""
    rows = []
    for dtype in options.dtypes:
        p = make_problem(CALL_SHAPE, dtype, ctx["seed"], "full")
        funcs = dict(ours_functions(p), **numpy_functions(p, extras=False))
        funcs = {k: funcs[k] for k in CALL_FUNCTIONS}
        for threads in options.threads:
            with harness.thread_count(threads, ctx["tpc"], None):
                timed = harness.measure(funcs, ctx["target"],
                                        ctx["min_repeats"])
            rows.append({"shape": CALL_SHAPE, "dtype": dtype,
                         "threads": threads,
                         "us": {k: s * 1e6 for k, (s, _) in timed.items()}})
    return rows
