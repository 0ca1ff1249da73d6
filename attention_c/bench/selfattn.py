"""Self-attention at scale (issue 19) against PyTorch's
``F.scaled_dot_product_attention`` (SDPA).

``python -m attention_c.bench --selfattn`` (or ``python -m
attention_c.bench.selfattn``) runs it; ``--help`` lists the options,
``--quick`` runs tiny sizes in a few seconds.  PyTorch is required (it is
the baseline).

Float32, in one process, at 1 thread and at every other count asked for
(default 1 and 2; ours through ``attention_c.set_num_threads``, PyTorch
through ``torch.set_num_threads``).  Every problem is 4-D, (B, heads, T, d)
with B * heads = the first number of each shape, and both sides do the
same work: ours is ``dot_attention(q, k, values=v, causal=...,
return_weights=False)`` then ``dot_attention_backward(g, q, k, out=o,
lse=lse, values=v, causal=...)``; SDPA is the forward (under no_grad) and
``torch.autograd.grad`` of its output for q, k, v (and the bias) given
the same g.  The scale is 1 / sqrt(d) on both sides.  Timings are medians
of ``harness.measure`` (interleaved rounds after warm-up).

* full and causal (SDPA's ``is_causal``, the same mask since Tq == T),
  (B * heads, T, d) in SHAPES; ratios ours / SDPA (forward, and forward +
  backward), causal / full (ours, forward + backward), N threads / 1
  thread (ours), and the forward's GFLOP/s (4 B Tq T d flops, halved for
  causal) as a share of the FMA peak of the SIMD path and the threads
  used, timed in the row's own rounds (``harness.measure_into``'s
  probe: the host's speed drifts over a run);
* dropout 0.1 (ours with a seed, SDPA with ``dropout_p=0.1``), a float
  bias (1, 1, T, T) (SDPA: the same tensor as ``attn_mask``, requiring
  grad, since ours returns its gradient) and causal as a boolean mask
  (``np.tril``, (1, 1, T, T), given to both as ``attn_mask``, what a
  user of SDPA builds) on DROPOUT_BIAS_SHAPES;
* the peak memory (growth of the peak RSS) of one forward + backward at
  MEMORY_SHAPE, ours and SDPA, each in a fresh subprocess;
* one causal forward + backward at LONG_SHAPE, ours and SDPA, timed once
  each at the largest thread count.

Accuracy, before timing: ours and SDPA in float32 against SDPA in float64
on the same data (out and every gradient; ||x - r|| / ||r||); with
dropout, whose generators differ, ours is checked on its first (batch,
head) against ``attention_c.reference`` in float64 with the same seed
(the keep bits are the same); the long call compares ours with SDPA.
"""

import argparse
import gc
import json
import math
import os
import sys
import time

import numpy as np

import attention_c as ac
from attention_c import reference as ref
from attention_c.bench import harness
from attention_c.bench.docs_page import selfattn_sections, write_page
from attention_c.bench.report import format_load, selfattn_report
from attention_c.bench.targets import (add_selfattn_ratios,
                                       evaluate_selfattn)

# (B * heads, T, d); --quick: the same roles on tiny sizes.  Shapes from
# the second on are "at scale" (T >= 1024 in the full run): the targets
# of causal / full, N / 1 and the share of the peak apply there.
SHAPES = ((32, 256, 64), (8, 1024, 64), (2, 4096, 64), (1, 16384, 64))
QUICK_SHAPES = ((4, 32, 16), (2, 64, 16), (2, 128, 16), (1, 256, 16))
DROPOUT_BIAS_SHAPES = (1, 2)        # indices into the shapes
MEMORY_SHAPE, QUICK_MEMORY_SHAPE = (8, 8192, 64), (2, 512, 16)
LONG_SHAPE, QUICK_LONG_SHAPE = (1, 65536, 64), (1, 1024, 16)
CASES = ("full", "causal", "dropout", "bias", "mask")
HEADS = 8                # B * heads is split as (B * heads / 8, 8)
DROPOUT = 0.1
SEED = 1234              # ours' dropout seed
TOLERANCE = 1e-4         # float32 against float64, normwise
HEAVY_T = 16384          # from this T: at most HEAVY_REPEATS samples
HEAVY_REPEATS = 3
MiB = 2.0 ** 20


# --------------------------------------------------------------------------
# The problem and the implementations

def split(bh):
    """(B, heads) of B * heads: heads = 8 where it divides, else 1."""
    heads = HEADS if bh % HEADS == 0 else 1
    return bh // heads, heads


def make_problem(shape, case, seed=0):
    """q, k, v, g (B, heads, T, d) and, for 'bias', a (1, 1, T, T) float
    bias, float32, standard normal, for 'mask' a (1, 1, T, T) boolean
    lower triangle; with the kwargs of ours for the case."""
    bh, T, d = shape
    rng = np.random.default_rng([seed, bh, T, d, CASES.index(case)])
    lead = split(bh)
    p = {name: rng.standard_normal(lead + (T, d), dtype=np.float32)
         for name in ("q", "k", "v", "g")}
    p["bias"] = (rng.standard_normal((1, 1, T, T), dtype=np.float32)
                 if case == "bias" else None)
    p["mask"] = (np.tril(np.ones((T, T), bool))[None, None]
                 if case == "mask" else None)
    p["kwargs"] = {"causal": case == "causal", "scale": 1 / math.sqrt(d)}
    if case == "bias":
        p["kwargs"]["bias"] = p["bias"]
    if case == "mask":
        p["kwargs"]["attn_mask"] = p["mask"]
    if case == "dropout":
        p["kwargs"].update(dropout=DROPOUT, seed=SEED)
    return p


def ours_functions(p):
    """Our forward and forward + backward (return_weights=False)."""
    q, k, v, g, kw = p["q"], p["k"], p["v"], p["g"], p["kwargs"]

    def fwd():
        return ac.dot_attention(q, k, values=v, return_weights=False, **kw)

    def fwdbwd():
        o, lse = fwd()
        return o, ac.dot_attention_backward(g, q, k, out=o, lse=lse,
                                            values=v, **kw)

    return {"ours_fwd": fwd, "ours_fwdbwd": fwdbwd}


def sdpa_tensors(torch, p, dtype=None):
    """The problem as tensors (sharing its memory in float32); q, k, v and
    the bias require grad."""
    t = {"mask": None if p["mask"] is None else torch.from_numpy(p["mask"])}
    for name in ("q", "k", "v", "g", "bias"):
        x = None if p[name] is None else torch.from_numpy(p[name])
        if x is not None and dtype is not None:
            x = x.to(dtype)
        if x is not None and name != "g":
            x.requires_grad_(True)
        t[name] = x
    return t


def sdpa_call(torch, p, t):
    """SDPA's output for the problem's case (a function of no argument)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kw = p["kwargs"]
    mask = t["bias"] if t["bias"] is not None else t["mask"]
    return lambda: sdpa(t["q"], t["k"], t["v"], attn_mask=mask,
                        dropout_p=kw.get("dropout", 0.0),
                        is_causal=kw["causal"], scale=kw["scale"])


def sdpa_functions(torch, p, t):
    """SDPA's forward (no_grad) and forward + backward (autograd.grad of
    the output given g, for q, k, v and the bias)."""
    call = sdpa_call(torch, p, t)
    leaves = [t[n] for n in ("q", "k", "v", "bias") if t[n] is not None]

    def fwd():
        with torch.no_grad():
            return call()

    def fwdbwd():
        out = call()
        return out, torch.autograd.grad(out, leaves, t["g"])

    return {"sdpa_fwd": fwd, "sdpa_fwdbwd": fwdbwd}


# --------------------------------------------------------------------------
# Accuracy

def _named(out, grads):
    names = ("out", "dq", "dk", "dv", "dbias")
    return {n: np.asarray(x, dtype=np.float64)
            for n, x in zip(names, (out,) + tuple(grads)) if x is not None}


def ours_result(p):
    """{out, dq, dk, dv[, dbias]} of ours."""
    out, grads = ours_functions(p)["ours_fwdbwd"]()
    return _named(out, grads)


def sdpa_result(torch, p, dtype):
    """{out, dq, dk, dv[, dbias]} of SDPA in ``dtype``."""
    t = sdpa_tensors(torch, p, dtype)
    out, grads = sdpa_functions(torch, p, t)["sdpa_fwdbwd"]()
    return _named(out.detach().numpy(), [x.numpy() for x in grads])


def reference_first_head(p):
    """{out, dq, dk, dv} of the float64 reference with dropout on the
    first (batch, head) of the problem (flat batch index 0, as in the full
    call, so the same keep bits)."""
    one = {n: p[n][:1, :1].astype(np.float64) for n in ("q", "k", "v", "g")}
    kw = p["kwargs"]
    o, lse = ref.dot_attention(one["q"], one["k"], values=one["v"],
                               return_weights=False, **kw)
    grads = ref.dot_attention_backward(one["g"], one["q"], one["k"], out=o,
                                       lse=lse, values=one["v"], **kw)
    return _named(o[0, 0], [x[0, 0] for x in grads[:3]])


def exact_result(torch, p, case):
    """What the case is checked against: SDPA in float64 on the same
    data; with dropout, whose generators differ, the reference on the
    first head (see reference_first_head)."""
    if case == "dropout":
        return reference_first_head(p)
    return sdpa_result(torch, p, torch.float64)


def check(torch, p, case, exact):
    """{implementation: {array: error}} of ours and SDPA (float32) against
    ``exact`` (exact_result); with dropout, ours' first head only."""
    if case == "dropout":
        out, grads = ours_functions(p)["ours_fwdbwd"]()
        ours = _named(out[0, 0], [x[0, 0] for x in grads[:3]])
        return {"ours": harness.errors(ours, exact)}
    return {"ours": harness.errors(ours_result(p), exact),
            "sdpa": harness.errors(sdpa_result(torch, p, torch.float32),
                                   exact)}


# --------------------------------------------------------------------------
# Running

def flops_forward(shape, causal):
    """4 B Tq T d (two products), halved for causal."""
    bh, T, d = shape
    return 4.0 * bh * T * T * d / (2 if causal else 1)


# forward + backward: 4 + 10 B T^2 d flops (the backward recomputes the
# scores: 5 products of the forward's 2), in forwards
FWDBWD_FLOPS = 3.5


def run_row(case, index, shape, threads, ctx, exact):
    """Check and time ours and SDPA on one case, shape and thread count."""
    torch = ctx["torch"]
    p = make_problem(shape, case, ctx["seed"])
    row = {"case": case, "shape": list(shape), "lead": list(split(shape[0])),
           "threads": threads, "at_scale": index >= 1}
    row["errors"] = check(torch, p, case, exact)
    for name, errs in row["errors"].items():
        bad = {k: e for k, e in errs.items() if not e <= TOLERANCE}
        if bad:
            print(f"WARNING: {name} is inaccurate on {case} {shape} "
                  f"{threads} thr: {bad}", file=sys.stderr)
    funcs = ours_functions(p)
    funcs.update(sdpa_functions(torch, p, sdpa_tensors(torch, p)))
    repeats = (min(ctx["min_repeats"], HEAVY_REPEATS)
               if shape[1] >= HEAVY_T else ctx["min_repeats"])
    harness.measure_into(row, funcs, ctx["target"], repeats,
                         peak=(ctx["peak"], "float32"))
    causal = case in ("causal", "mask")
    row["fwd_gflops"] = (flops_forward(shape, causal)
                         / (row["times_ms"]["ours_fwd"] / 1e3) / 1e9)
    row["fwdbwd_gflops"] = (FWDBWD_FLOPS * flops_forward(shape, causal)
                            / (row["times_ms"]["ours_fwdbwd"] / 1e3) / 1e9)
    return row


def run_all(options, ctx):
    """Every case, shape and thread count; returns the rows."""
    rows = []
    for index, shape in enumerate(ctx["shapes"]):
        cases = CASES if index in DROPOUT_BIAS_SHAPES else CASES[:2]
        for case in cases:
            exact = exact_result(ctx["torch"],
                                 make_problem(shape, case, ctx["seed"]),
                                 case)
            for threads in options.threads:
                start = time.perf_counter()
                with harness.thread_count(threads, ctx["tpc"],
                                          ctx["torch"]):
                    rows.append(run_row(case, index, shape, threads, ctx,
                                        exact))
                print(f"  {case:<7} {str(shape):<16} {threads} thr "
                      f"{time.perf_counter() - start:6.1f} s",
                      file=sys.stderr)
            del exact
    return rows


def run_long(ctx, threads, with_sdpa=True):
    """One causal forward + backward at the long shape, ours and (with
    ``with_sdpa``) SDPA, each timed once; their outputs compared."""
    torch = ctx["torch"]
    shape = ctx["long_shape"]
    p = make_problem(shape, "causal", ctx["seed"])
    found = {"shape": list(shape), "lead": list(split(shape[0])),
             "threads": threads}
    before, begin = harness.cpu_seconds(), time.perf_counter()
    with harness.thread_count(threads, ctx["tpc"], torch):
        ours = ours_functions(p)["ours_fwdbwd"]
        start = time.perf_counter()
        out, grads = ours()
        found["ours_s"] = time.perf_counter() - start
        ours_out = _named(out, grads)
        del out, grads
        if with_sdpa:
            t = sdpa_tensors(torch, p)
            sdpa = sdpa_functions(torch, p, t)["sdpa_fwdbwd"]
            gc.collect()
            start = time.perf_counter()
            out, grads = sdpa()
            found["sdpa_s"] = time.perf_counter() - start
            theirs = _named(out.detach().numpy(), [x.numpy() for x in grads])
            found["ratio"] = found["ours_s"] / found["sdpa_s"]
            found["difference"] = harness.errors(ours_out, theirs)
    found["others_load"] = harness.others_load(before,
                                               time.perf_counter() - begin)
    print(f"  long    {str(shape):<16} {threads} thr", file=sys.stderr)
    return found


# --------------------------------------------------------------------------
# Peak memory, each implementation in a fresh process

def memory_child(which, shape, threads, seed):
    """Print, as JSON, the growth of the peak RSS during one forward +
    backward (full, return_weights=False for ours) by ``which`` ('ours'
    or 'sdpa') at ``shape``.

    A tiny forward + backward first initialises the libraries and thread
    pools; then the inputs are made, the peak is reset, one forward +
    backward runs (its outputs and gradients kept), and the rise of the
    peak over the RSS before the call is reported.
    """
    torch = harness.optional_import("torch") if which == "sdpa" else None
    tpc = harness.optional_import("threadpoolctl")
    with harness.thread_count(threads, tpc, torch):
        for size in ((1, 64, shape[2]), shape):
            p = make_problem(size, "full", seed)
            if which == "ours":
                fwdbwd = ours_functions(p)["ours_fwdbwd"]
            else:
                fwdbwd = sdpa_functions(torch, p, sdpa_tensors(torch, p))[
                    "sdpa_fwdbwd"]
            if size != shape:
                fwdbwd()
                del p, fwdbwd
        gc.collect()
        method, before = harness.peak_start()
        kept = fwdbwd()
        peak = harness.peak_now(method)
    del kept
    inputs = sum(p[n].nbytes for n in ("q", "k", "v", "g"))
    harness.print_memory(which, method, before, peak, inputs / MiB)
    return 0


def measure_memory(shape, threads, seed):
    """{'ours_mib', 'sdpa_mib', 'ratio', ...} from fresh subprocesses
    (glibc's mmap threshold fixed at its default 128 KiB, so that freed
    buffers go back to the system and the peak RSS follows the peak of
    live memory)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    found = {"shape": list(shape), "lead": list(split(shape[0])),
             "threads": threads}
    found.update(harness.memory_children(
        "attention_c.bench.selfattn", ("ours", "sdpa"),
        ["--memory-shape", ",".join(map(str, shape)), "--threads",
         str(threads), "--seed", str(seed)], env, 900))
    found["ratio"] = found["ours_mib"] / found["sdpa_mib"]
    print(f"  memory  {str(shape):<16} {threads} thr", file=sys.stderr)
    return found


# --------------------------------------------------------------------------
# Command line

def parse_args(argv):
    """The options of ``python -m attention_c.bench --selfattn``."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c.bench --selfattn",
        description="Benchmark dot_attention(return_weights=False) and its "
                    "backward, as self-attention on long sequences, against "
                    "torch.nn.functional.scaled_dot_product_attention, "
                    "float32, forward + backward: full, causal, dropout, "
                    "float bias, causal as a boolean attn_mask, peak "
                    "memory and one causal call at T = 65536, against the "
                    "targets of issues 19, 26 and 32.")
    harness.add_run_options(parser, "selfattn",
                            ", at most 3 at T >= 16384")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory subprocesses")
    parser.add_argument("--no-long", action="store_true",
                        help="skip the one causal call at T = 65536")
    parser.add_argument("--no-long-sdpa", action="store_true",
                        help="time only ours on the long call")
    parser.add_argument("--memory-child", choices=("ours", "sdpa"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--memory-shape", help=argparse.SUPPRESS)
    return harness.finish_run_options(parser.parse_args(argv), parser)


def setup(options, torch):
    """The run's settings and the report's metadata."""
    shapes = QUICK_SHAPES if options.quick else SHAPES
    options.shapes = [str(s) for s in shapes]
    options.dtypes = ["float32"]
    options.no_torch, options.compile = False, False
    ctx, meta = harness.setup(options)
    ctx.update(torch=torch, shapes=shapes,
               long_shape=QUICK_LONG_SHAPE if options.quick else LONG_SHAPE)
    meta.update(quick=options.quick, torch=torch.__version__,
                peak=harness.peak_facts(meta["config"]["simd"], options.dtypes,
                                        options.threads, options.quick),
                shape_sizes=[list(s) for s in shapes],
                heads=HEADS, dropout=DROPOUT)
    ctx["peak"] = meta["peak"]
    return ctx, meta


def main(argv=None):
    """Entry point of ``python -m attention_c.bench --selfattn``."""
    options = parse_args(sys.argv[1:] if argv is None else list(argv))
    if options.memory_child:
        shape = tuple(int(x) for x in options.memory_shape.split(","))
        return memory_child(options.memory_child, shape,
                            max(options.threads), options.seed)
    torch = harness.baseline_torch()
    if torch is None:
        return 1
    start = time.perf_counter()
    ctx, meta = setup(options, torch)
    threads = max(options.threads)
    rows = run_all(options, ctx)
    memory = None if options.no_memory else measure_memory(
        QUICK_MEMORY_SHAPE if options.quick else MEMORY_SHAPE, threads,
        options.seed)
    long = None if options.no_long else run_long(
        ctx, threads, with_sdpa=not options.no_long_sdpa)
    add_selfattn_ratios(rows, meta["peak"])
    targets = evaluate_selfattn(rows, memory)
    meta["wall_seconds"] = time.perf_counter() - start
    meta["load_end"] = harness.load_average()
    print(selfattn_report(meta, rows, targets, memory, long))
    print(f"\nTotal {meta['wall_seconds']:.0f} s; load average at end "
          f"{format_load(meta['load_end'])}")
    if options.json:
        with open(options.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "results": rows, "targets": targets,
                       "memory": memory, "long": long}, f, indent=1)
            f.write("\n")
        print(f"wrote {options.json}")
    if options.write_docs:
        write_page(options.write_docs,
                   selfattn_sections(meta, rows, targets, memory, long))
        print(f"wrote {options.write_docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
