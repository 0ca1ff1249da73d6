"""What the layer's benchmark measures, one configuration (shape, dtype,
thread count, mask) at a time: the problem, our functions, NumPy's (S1,
the layer's main product on exactly the rows the layer computes, and the
reference) and PyTorch's, each checked against the float64 reference
before all are timed together."""

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
    "wide2": (16, 256, 1024, 1024),
    "long1": (1, 65536, 128, 128),      # one long sequence
}
# --quick: the same names (so every target is checked), the large ones
# with 8 times fewer rows (B * T); H and A, what makes them wide, kept.
QUICK_SHAPES = dict(SHAPES, large=(8, 256, 256, 256),
                    long=(4, 1024, 128, 128), wide=(2, 256, 1024, 512),
                    wide2=(2, 256, 1024, 1024), long1=(1, 8192, 128, 128))
DTYPES = ("float32", "float64")
QUICK_DTYPES = ("float32",)
# full: every item valid, no mask passed (to ours, NumPy and PyTorch
# alike); ragged: each sequence has a random number of valid items (a
# prefix) between T/2 and T, the rest masked.
MASKS = ("full", "ragged")
# The NumPy reference and the seed's PyTorch form are not targets: timed
# on these shapes only (the first two with --quick).  torch.compile (15-30
# s to compile each configuration) is timed on float32 of COMPILE_SHAPES.
EXTRA_SHAPES = ("tiny", "small", "medium", "large")
QUICK_EXTRA_SHAPES = EXTRA_SHAPES[:2]
COMPILE_SHAPES = ("medium", "large")
# A call takes 0.1-1 s on these: at most HEAVY_REPEATS timed runs each
# (one a round), so that the full run fits in about 15 minutes.
HEAVY_SHAPES = ("wide", "wide2", "long1")
HEAVY_REPEATS = 3

# Accuracy required of every implementation: the normwise relative error
# ||x - r|| / ||r|| (the tests' metric, attention_c.testing.rel_err) of
# each of out, alpha and the gradients, r from the float64 NumPy
# reference.  Looser than the tests' attention_c.testing.TOL (1e-5, 1e-12):
# these shapes are larger (up to 65536 items a sequence), and our float32
# db reaches 1e-5 on "long", the others' about half that.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}
RESULTS = ("out", "alpha", "dh", "dW", "dv", "db")


# --------------------------------------------------------------------------
# The problem and the implementations

def make_problem(shape, dtype, seed=0, mask="ragged"):
    """Random inputs h, W, v, b, mask (None when ``mask`` is 'full'), G
    (gradient of out), and S1's operands: X, the rows of h the layer
    computes (the valid items, gathered: (n_valid, H)), and Y = W_h^T
    (H, A).  ``n_valid`` counts the rows.

    Drawn in float64 from a seed that depends on the shape and the mask,
    then cast, so both dtypes see the same numbers: a batch and a layer
    initialised like PyTorch's, from ``attention_c.testing.ragged_batch``.
    """
    B, T, H, A = shape
    rng = np.random.default_rng([seed, B, T, H, A, MASKS.index(mask)])
    h, W, v, b, valid = ragged_batch(
        rng, B, T, H, A, min_length=T if mask == "full" else T // 2)
    p = {"h": h, "W": W, "v": v, "b": b,
         "G": rng.standard_normal((B, H))}
    p = {k: np.ascontiguousarray(x, dtype=dtype) for k, x in p.items()}
    p["mask"] = None if mask == "full" else valid
    p["X"] = np.ascontiguousarray(p["h"][valid])
    p["Y"] = np.ascontiguousarray(p["W"][:, :H].T)
    p["n_valid"] = int(valid.sum())
    return p


def layer_args(p):
    """(h, W, v, b, mask) and G of a problem."""
    return tuple(p[k] for k in ("h", "W", "v", "b", "mask")), p["G"]


def ours_functions(p):
    """Our forward, backward and forward + backward, with and without
    saved activations."""
    (h, W, v, b, mask), G = layer_args(p)
    fwd, bwd = ac.context_attention, ac.context_attention_backward
    _, alpha, act = fwd(h, W, v, b=b, mask=mask, keep_activations=True)

    def fwd_keep():
        return fwd(h, W, v, b=b, mask=mask, keep_activations=True)

    def fwdbwd():
        _, a = fwd(h, W, v, b=b, mask=mask)
        return bwd(G, h, W, v, a, b=b, mask=mask)

    def fwdbwd_saved():
        _, a, u = fwd_keep()
        return bwd(G, h, W, v, a, b=b, mask=mask, activations=u)

    return {
        "ours_fwd": lambda: fwd(h, W, v, b=b, mask=mask),
        "ours_fwd_keep": fwd_keep,
        "ours_bwd": lambda: bwd(G, h, W, v, alpha, b=b, mask=mask),
        "ours_bwd_saved": lambda: bwd(G, h, W, v, alpha, b=b, mask=mask,
                                      activations=act),
        "ours_fwdbwd": fwdbwd,
        "ours_fwdbwd_saved": fwdbwd_saved,
    }


def numpy_functions(p, extras=True):
    """S1, the product (n_valid, H) @ (H, A) of the rows the layer
    computes, and (with ``extras``) the NumPy reference forward and
    backward."""
    X, Y = p["X"], p["Y"]
    funcs = {"s1": lambda: X @ Y}
    if extras:
        args, G = layer_args(p)
        h, W, v, b, mask = args
        _, alpha = ref.context_attention(h, W, v, b=b, mask=mask)
        funcs["ref_fwd"] = lambda: ref.context_attention(h, W, v, b=b,
                                                         mask=mask)
        funcs["ref_bwd"] = lambda: ref.context_attention_backward(
            G, h, W, v, alpha, b=b, mask=mask)
    return funcs


# --------------------------------------------------------------------------
# Accuracy

def ours_result(p, saved=False):
    """(out, alpha, dh, dW, dv, db) from ours."""
    (h, W, v, b, mask), G = layer_args(p)
    if saved:
        out, alpha, act = ac.context_attention(h, W, v, b=b, mask=mask,
                                               keep_activations=True)
    else:
        (out, alpha), act = ac.context_attention(h, W, v, b=b, mask=mask), None
    grads = ac.context_attention_backward(G, h, W, v, alpha, b=b, mask=mask,
                                          activations=act)
    return (out, alpha, *grads)


def ref_result(p):
    """(out, alpha, dh, dW, dv, db) from the NumPy reference."""
    args, G = layer_args(p)
    h, W, v, b, mask = args
    out, alpha = ref.context_attention(h, W, v, b=b, mask=mask)
    return (out, alpha,
            *ref.context_attention_backward(G, h, W, v, alpha, b=b, mask=mask))


def exact_result(p):
    """(out, alpha, dh, dW, dv, db) of the NumPy reference in float64 on
    the problem's data."""
    return ref_result({k: x.astype(np.float64)
                       if isinstance(x, np.ndarray) and x.dtype.kind == "f"
                       else x for k, x in p.items()})


# --------------------------------------------------------------------------
# Running

def row_label(row):
    """'shape mask dtype N thr' for messages."""
    return (f"{row['shape']} {row['mask']} {row['dtype']} "
            f"{row['threads']} thr")


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


def add_torch(row, funcs, torch, p, exact, extras, with_compile):
    """Check and add the torch functions: the best eager form, with
    ``extras`` the seed's, with ``with_compile`` torch.compile's."""
    best, seed = torch_forms(torch)
    t = torch_tensors(torch, p)
    for name, layer in (("torch", best), ("seed", seed))[:1 + extras]:
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


def new_row(name, shape, dtype, threads, mask):
    """The fields that name a configuration."""
    B, T, H, A = shape
    return {"shape": name, "mask": mask, "dtype": dtype, "threads": threads,
            "B": B, "T": T, "H": H, "A": A, "errors": {}}


def run_config(name, shape, dtype, threads, mask, ctx):
    """Check and time every implementation for one shape, dtype, thread
    count and mask; returns the result row."""
    p = make_problem(shape, dtype, ctx["seed"], mask)
    row = new_row(name, shape, dtype, threads, mask)
    row["n_valid"] = p["n_valid"]
    extras = name in ctx["extra_shapes"]
    exact = exact_result(p)
    check(row, "ours", ours_result(p), exact)
    check(row, "ours_saved", ours_result(p, saved=True), exact)
    if dtype != "float64" and extras:
        check(row, "ref", ref_result(p), exact)
    funcs = ours_functions(p)
    funcs.update(numpy_functions(p, extras))
    if ctx["torch"]:
        add_torch(row, funcs, ctx["torch"], p, exact, extras,
                  ctx["compile"] and dtype == "float32"
                  and name in COMPILE_SHAPES)
    del exact
    before, start = harness.cpu_seconds(), time.perf_counter()
    results, row["peak_gflops"] = harness.measure_peak(
        funcs, ctx["target"], min(ctx["min_repeats"], HEAVY_REPEATS)
        if name in HEAVY_SHAPES else ctx["min_repeats"], ctx["peak"],
        threads, dtype)
    row["others_load"] = harness.others_load(before,
                                             time.perf_counter() - start)
    row["times_ms"] = {k: s * 1e3 for k, (s, _) in results.items()}
    row["repeats"] = {k: n for k, (_, n) in results.items()}
    if "ref_fwd" in row["times_ms"]:
        row["times_ms"]["ref_fwdbwd"] = (row["times_ms"]["ref_fwd"]
                                         + row["times_ms"]["ref_bwd"])
    return row


def run_all(options, ctx):
    """Every configuration, shapes outermost; returns the rows."""
    rows = []
    for name in options.shapes:
        for dtype in options.dtypes:
            for threads in options.threads:
                for mask in options.masks:
                    start = time.perf_counter()
                    with harness.thread_count(threads, ctx["tpc"],
                                              ctx["torch"]):
                        rows.append(run_config(name, ctx["shapes"][name],
                                               dtype, threads, mask, ctx))
                    print(f"  {name:<7} {mask:<6} {dtype:<8} {threads} thr "
                          f"{time.perf_counter() - start:6.1f} s",
                          file=sys.stderr)
    return rows
