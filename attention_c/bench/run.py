"""What the layer's benchmark measures, one configuration (shape, dtype,
thread count) at a time: the problem, our functions, NumPy's (the bare
product S1 and the reference) and PyTorch's, each checked against the
float64 reference before all are timed together."""

import sys
import time

import numpy as np

import attention_c as ac
from attention_c import reference as ref
from attention_c.bench import harness
from attention_c.bench.torch_forms import (compile_best, torch_forms,
                                           torch_functions, torch_result,
                                           torch_tensors)
from attention_c.testing import ragged_batch

SHAPES = {              # name: (B, T, H, A)
    "tiny": (8, 16, 32, 32),
    "small": (32, 64, 64, 64),
    "medium": (32, 128, 128, 128),
    "large": (64, 256, 256, 256),
    "long": (4, 8192, 128, 128),
    "wide": (16, 256, 1024, 512),
}
QUICK_SHAPES = ("tiny", "small", "medium")
DTYPES = ("float32", "float64")

# Accuracy required of every implementation: the normwise relative error
# ||x - r|| / ||r|| (the tests' metric, attention_c.testing.rel_err) of
# each of out, alpha and the gradients, r from the float64 NumPy
# reference.  Looser than the tests' attention_c.testing.TOL (1e-5, 1e-12):
# these shapes are larger (up to 8192 items a sequence), and our float32
# db reaches 1e-5 on "long", the others' about half that.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}
RESULTS = ("out", "alpha", "dh", "dW", "dv", "db")


# --------------------------------------------------------------------------
# The problem and the implementations

def make_problem(shape, dtype, seed=0):
    """Random inputs h, W, v, b, mask, G (gradient of out), X, Y (for S1).

    Drawn in float64 from a seed that depends on the shape, then cast, so
    both dtypes see the same numbers: a ragged batch (each sequence has a
    random number of valid items between T/2 and T, so that no row is
    empty) and a layer initialised like PyTorch's, from
    ``attention_c.testing.ragged_batch``.
    """
    B, T, H, A = shape
    rng = np.random.default_rng([seed, B, T, H, A])
    h, W, v, b, mask = ragged_batch(rng, B, T, H, A, min_length=T // 2)
    p = {"h": h, "W": W, "v": v, "b": b,
         "G": rng.standard_normal((B, H)),
         "X": rng.standard_normal((B * T, H)),
         "Y": rng.standard_normal((H, A))}
    p = {k: np.ascontiguousarray(x, dtype=dtype) for k, x in p.items()}
    p["mask"] = mask
    return p


def layer_args(p):
    """(h, W, v, b, mask) and G of a problem."""
    return tuple(p[k] for k in ("h", "W", "v", "b", "mask")), p["G"]


def ours_functions(p):
    """Our forward, backward and forward + backward, with and without
    saved activations."""
    (h, W, v, b, mask), G = layer_args(p)
    fwd, bwd = ac.context_attention, ac.context_attention_backward
    _, alpha, act = fwd(h, W, v, b, mask, keep_activations=True)

    def fwd_keep():
        return fwd(h, W, v, b, mask, keep_activations=True)

    def fwdbwd():
        _, a = fwd(h, W, v, b, mask)
        return bwd(G, h, W, v, a, b, mask)

    def fwdbwd_saved():
        _, a, u = fwd_keep()
        return bwd(G, h, W, v, a, b, mask, activations=u)

    return {
        "ours_fwd": lambda: fwd(h, W, v, b, mask),
        "ours_fwd_keep": fwd_keep,
        "ours_bwd": lambda: bwd(G, h, W, v, alpha, b, mask),
        "ours_bwd_saved": lambda: bwd(G, h, W, v, alpha, b, mask,
                                      activations=act),
        "ours_fwdbwd": fwdbwd,
        "ours_fwdbwd_saved": fwdbwd_saved,
    }


def numpy_functions(p):
    """S1 (the bare product) and the NumPy reference forward and backward."""
    X, Y = p["X"], p["Y"]
    args, G = layer_args(p)
    h, W, v, b, mask = args
    _, alpha = ref.context_attention(*args)
    return {
        "s1": lambda: X @ Y,
        "ref_fwd": lambda: ref.context_attention(*args),
        "ref_bwd": lambda: ref.context_attention_backward(
            G, h, W, v, alpha, b, mask),
    }


# --------------------------------------------------------------------------
# Accuracy

def ours_result(p, saved=False):
    """(out, alpha, dh, dW, dv, db) from ours."""
    (h, W, v, b, mask), G = layer_args(p)
    if saved:
        out, alpha, act = ac.context_attention(h, W, v, b, mask,
                                               keep_activations=True)
    else:
        (out, alpha), act = ac.context_attention(h, W, v, b, mask), None
    grads = ac.context_attention_backward(G, h, W, v, alpha, b, mask,
                                          activations=act)
    return (out, alpha, *grads)


def ref_result(p):
    """(out, alpha, dh, dW, dv, db) from the NumPy reference."""
    args, G = layer_args(p)
    h, W, v, b, mask = args
    out, alpha = ref.context_attention(*args)
    return (out, alpha,
            *ref.context_attention_backward(G, h, W, v, alpha, b, mask))


def exact_result(p):
    """(out, alpha, dh, dW, dv, db) of the NumPy reference in float64 on
    the problem's data."""
    return ref_result({k: x.astype(np.float64) if x.dtype.kind == "f" else x
                       for k, x in p.items()})


# --------------------------------------------------------------------------
# Running

def row_label(row):
    """'shape dtype N thr' for messages."""
    return f"{row['shape']} {row['dtype']} {row['threads']} thr"


def too_far(row, name):
    """The arrays of implementation ``name`` beyond the tolerance."""
    return {k: e for k, e in row["errors"][name].items()
            if not e <= TOLERANCE[row["dtype"]]}


def check(row, name, result, exact):
    """Record the errors of ``result`` (out, alpha, dh, dW, dv, db) against
    ``exact``; warn beyond the tolerance."""
    row["errors"][name] = harness.errors(dict(zip(RESULTS, result)),
                                         dict(zip(RESULTS, exact)))
    bad = too_far(row, name)
    if bad:
        print(f"WARNING: {name} is inaccurate on {row_label(row)}: "
              + ", ".join(f"{k} {e:.2g}" for k, e in bad.items()),
              file=sys.stderr)


def add_torch(row, funcs, torch, p, exact, with_compile):
    """Check and add the torch functions (eager forms, maybe compiled)."""
    best, seed = torch_forms(torch)
    t = torch_tensors(torch, p)
    for name, layer in (("torch", best), ("seed", seed)):
        check(row, name, torch_result(torch, layer, t), exact)
        funcs.update(torch_functions(torch, layer, t, name))
    if not with_compile:
        return
    try:
        layer, compiled, row["compile_seconds"] = compile_best(torch, best,
                                                               t)
        check(row, "compile", torch_result(torch, layer, t), exact)
    except Exception as exc:   # noqa: BLE001 (report n/a and go on)
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        row["compile_error"] = message
        print(f"torch.compile failed on {row_label(row)}: {message}",
              file=sys.stderr)
        return
    funcs.update(compiled)


def run_config(name, dtype, threads, ctx):
    """Check and time every implementation for one shape, dtype and
    thread count; returns the result row."""
    shape = SHAPES[name]
    p = make_problem(shape, dtype, ctx["seed"])
    row = {"shape": name, "dtype": dtype, "threads": threads,
           "B": shape[0], "T": shape[1], "H": shape[2], "A": shape[3],
           "errors": {}}
    exact = exact_result(p)
    check(row, "ours", ours_result(p), exact)
    check(row, "ours_saved", ours_result(p, saved=True), exact)
    if dtype != "float64":
        check(row, "ref", ref_result(p), exact)
    funcs = ours_functions(p)
    funcs.update(numpy_functions(p))
    if ctx["torch"]:
        add_torch(row, funcs, ctx["torch"], p, exact, ctx["compile"])
    before, start = harness.cpu_seconds(), time.perf_counter()
    results = harness.measure(funcs, ctx["target"], ctx["min_repeats"])
    row["others_load"] = harness.others_load(before,
                                             time.perf_counter() - start)
    row["times_ms"] = {k: s * 1e3 for k, (s, _) in results.items()}
    row["repeats"] = {k: n for k, (_, n) in results.items()}
    row["times_ms"]["ref_fwdbwd"] = (row["times_ms"]["ref_fwd"]
                                     + row["times_ms"]["ref_bwd"])
    return row


def run_all(options, ctx):
    """Every configuration, shapes outermost; returns the rows."""
    rows = []
    for name in options.shapes:
        for dtype in options.dtypes:
            for threads in options.threads:
                start = time.perf_counter()
                with harness.thread_count(threads, ctx["tpc"],
                                          ctx["torch"]):
                    rows.append(run_config(name, dtype, threads, ctx))
                print(f"  {name:<7} {dtype:<8} {threads} thr "
                      f"{time.perf_counter() - start:6.1f} s",
                      file=sys.stderr)
    return rows
