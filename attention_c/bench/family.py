"""Benchmark of the attention family (issue 9) against PyTorch eager.

``python -m attention_c.bench.family`` runs it; ``python -m
attention_c.bench --family`` does the same and takes the same options
(``--help`` lists them; ``--quick``: small shapes, 1 thread, about 10 s;
``--json PATH``: write everything measured).  PyTorch is required (it is
the baseline).

In one process, in float32, at 1 thread and at every other count asked for
(default: 1 and all available CPUs, i.e. 2 on the CI machine), for each case
and mask it checks the results, then times ours and PyTorch eager with
``harness.measure`` (median of interleaved rounds, after warm-up).  Every
baseline does the work our call does: the same shapes, the same mask, the
same outputs and gradients.  Ratios are ours / theirs (< 1: ours faster).

* additive: several queries, (B, Tq, T, H, A) = (32, 32, 64, 128, 128),
  Hq = Hv = H, values given.  ``additive_attention`` (+ ``_backward``)
  against the d2l form: W_q(queries) and W_k(keys) as bias-free Linear
  layers, broadcast add to (B, Tq, T, A), tanh, Linear(A, 1), masked
  softmax, bmm with the values; forward + backward is autograd of the out
  for queries, keys, values and the three weights.  Target f+b <= 0.35.
  Also the peak memory of one forward + backward, ours and PyTorch's, each
  in a fresh subprocess (see ``memory_child``).  Target ours <= 1/4.
* decoder_once: 30 steps of one query per sequence, B = 64, T = 50,
  H = Hq = 256, A = 128, values = keys, as a training loop runs it: the
  keys are projected once per sequence and their projection is
  differentiated once.  Ours: ``project_keys``, then per step the forward
  with ``key_proj=`` and the backward with ``stop_at_key_proj=True``
  (gradients of the query, key_proj, W_q, v), the key_proj gradients
  summed, one ``project_keys_backward``.  PyTorch: W_k(keys) once, each
  step's backward into it (a leaf that accumulates), one backward through
  W_k.  Target f+b <= 0.4.
* decoder: the same loop with the full gradients (query, keys, W, v)
  returned at every step, each paying the keys' projection backward (two
  B T A H products) on both sides.  Reported, no target.
* dot and general: several queries, heads as a leading axis (4, 8),
  Tq = T = 256, H = 64, values given.  ``dot_attention`` and
  ``general_attention`` against eager matmul - masked softmax - matmul (and
  a bias-free Linear on the keys for general).  Target f+b <= 0.8.  Dot is
  also compared with ``F.scaled_dot_product_attention`` given the same
  mask (no target), and with ``is_causal=True`` on the causal rows.

Masks, reported as separate rows: full (no mask) and ragged (a key mask,
lengths uniform in [T/2, T]) for additive and decoder; full and causal for
dot and general.  On the causal rows ours is called with ``causal=True``,
as a user writes it (no mask array), and PyTorch's eager form and
``sdpa`` get the explicit (4, 8, Tq, T) bool mask (True = take part) that
they need, ``sdpa_causal`` ``is_causal=True``: the same keys are visible
to the same queries.  No row is fully masked, so the baselines need no
guard against NaN.

Accuracy, before timing: every result (out, alpha, gradients) of ours and
of each baseline against the same PyTorch form run in float64 on the same
data, and ours against PyTorch in float32; error = ||x - r|| / ||r|| per
array (the tests' normwise relative error), the worst array reported;
above 1e-4 is flagged.
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
from attention_c.bench import harness
from attention_c.bench.docs_page import family_sections, write_page
from attention_c.bench.report import (format_load, format_ms, format_ratio,
                                      format_table, header_lines)
from attention_c.bench.torch_forms import family_forms, stack_steps

SIZES = {
    "full": {
        "additive": {"B": 32, "Tq": 32, "T": 64, "H": 128, "A": 128},
        "decoder": {"steps": 30, "B": 64, "T": 50, "H": 256, "A": 128},
        "dot": {"lead": (4, 8), "Tq": 256, "T": 256, "H": 64},
    },
    "quick": {
        "additive": {"B": 8, "Tq": 8, "T": 16, "H": 32, "A": 32},
        "decoder": {"steps": 5, "B": 8, "T": 12, "H": 32, "A": 16},
        "dot": {"lead": (2, 4), "Tq": 32, "T": 32, "H": 16},
    },
}
# case: (size entry, mask kinds, limit of f+b ours / torch)
CASES = {
    "additive": ("additive", ("full", "ragged"), 0.35),
    "decoder": ("decoder", ("full", "ragged"), None),
    "decoder_once": ("decoder", ("full", "ragged"), 0.4),
    "dot": ("dot", ("full", "causal"), 0.8),
    "general": ("dot", ("full", "causal"), 0.8),
}
MEMORY_LIMIT = 0.25          # peak of ours / peak of torch, one f+b
TOLERANCE = 1e-4             # float32, ||x - r|| / ||r||
DTYPE: type[np.float32] = np.float32
METRICS = (("fwd", "fwd ms"), ("fwdbwd", "f+b ms"))
MiB = 2.0 ** 20


# --------------------------------------------------------------------------
# Problems

def make_problem(case, mask, size, seed=0):
    """The inputs of one case as float32 arrays, ``mask`` a bool array or
    None, ``G`` the gradient of the out.

    ``mask`` is what the PyTorch forms take: a key mask (..., T), or on
    the causal rows the explicit (..., Tq, T) mask; :func:`visibility`
    gives the arguments our functions take for it.

    Drawn in float64 from a seed that depends on the case and the size, then
    cast, so the float64 check sees the same numbers.
    """
    numbers = [n for x in size.values() for n in np.atleast_1d(x)]
    rng = np.random.default_rng([seed, list(CASES).index(case), *numbers])
    p = {}
    if case == "additive":
        B, Tq, T, H, A = (size[k] for k in ("B", "Tq", "T", "H", "A"))
        lead, shapes = (B,), {"query": (B, Tq, H), "keys": (B, T, H),
                              "values": (B, T, H), "G": (B, Tq, H)}
    elif case in ("decoder", "decoder_once"):
        S, B, T, H, A = (size[k] for k in ("steps", "B", "T", "H", "A"))
        lead, shapes = (B,), {"query": (S, B, H), "keys": (B, T, H),
                              "G": (S, B, H)}
    else:
        lead, Tq, T, H = size["lead"], size["Tq"], size["T"], size["H"]
        shapes = {"query": (*lead, Tq, H), "keys": (*lead, T, H),
                  "values": (*lead, T, H), "G": (*lead, Tq, H)}
    for name, shape in shapes.items():
        p[name] = rng.standard_normal(shape)
    if case in ("additive", "decoder", "decoder_once"):
        scale = 1.0 / math.sqrt(2 * H)     # torch.nn.Linear(H + Hq, A) init
        p["W"] = rng.uniform(-scale, scale, (A, 2 * H))
        p["v"] = rng.uniform(-1, 1, A) / math.sqrt(A)
    elif case == "general":
        p["W"] = rng.uniform(-1, 1, (H, H)) / math.sqrt(H)
    p = {k: np.ascontiguousarray(x, dtype=DTYPE) for k, x in p.items()}
    if mask == "ragged":
        lengths = rng.integers(T // 2, T + 1, size=lead)
        p["mask"] = np.arange(T) < lengths[..., None]
    elif mask == "causal":
        causal = np.arange(T) <= np.arange(Tq)[:, None]
        p["mask"] = np.ascontiguousarray(
            np.broadcast_to(causal, (*lead, Tq, T)))
    else:
        p["mask"] = None
    return p


def visibility(case, p):
    """Our keyword arguments for the problem's mask: ``causal=True`` on
    the causal rows of dot and general (whose ``mask`` has a query axis,
    for the PyTorch forms), else the key mask as ``mask=``."""
    mask = p.get("mask")
    if (case in ("dot", "general") and mask is not None
            and mask.ndim == p["query"].ndim):
        return {"causal": True}
    return {"mask": mask}


def input_bytes(p):
    """Bytes of a problem's arrays."""
    return sum(x.nbytes for x in p.values() if x is not None)


# --------------------------------------------------------------------------
# Ours: each form is (forward, forward + backward, results), where results
# maps what forward + backward returned to {name: array}.

# the fields of the backwards' named tuples (from the binding's table)
GRAD_FIELDS = {
    "additive": ac.AdditiveAttentionGrads._fields,
    "dot": ac.DotAttentionGrads._fields,
    "general": ac.GeneralAttentionGrads._fields,
}


def grad_dict(g, case):
    """A gradient tuple of the score of ``case`` (ours, or the
    reference's plain tuple, fields in GRAD_FIELDS' order) as
    {'dquery': ..., ...}, None fields left out."""
    fields = GRAD_FIELDS.get(case, GRAD_FIELDS["additive"])
    assert len(g) == len(fields), (case, len(g))
    return {"d" + k: x for k, x in zip(fields, g) if x is not None}


def ours_form(case, p):
    """Our forward and forward + backward for one case."""
    q, k, vals, W, v, mask, G = (p.get(n) for n in (
        "query", "keys", "values", "W", "v", "mask", "G"))
    if case == "additive":
        def fwd():
            return ac.additive_attention(q, k, W, v, mask=mask, values=vals)

        def bwd(alpha):
            return ac.additive_attention_backward(G, q, k, W, v, alpha,
                                                  mask=mask, values=vals)
    elif case == "decoder":
        def fwd():
            kp = ac.project_keys(k, W)
            return [ac.additive_attention(qs, k, W, v, mask=mask,
                                          key_proj=kp) for qs in q]

        def fwdbwd():
            kp = ac.project_keys(k, W)
            steps = []
            for qs, gs in zip(q, G):
                out, alpha = ac.additive_attention(qs, k, W, v, mask=mask,
                                                   key_proj=kp)
                steps.append((out, alpha, ac.additive_attention_backward(
                    gs, qs, k, W, v, alpha, mask=mask, key_proj=kp)))
            return steps

        def results(steps):
            return stack_steps([{"out": o, "alpha": a,
                                 **grad_dict(g, "additive")}
                                for o, a, g in steps])

        return fwd, fwdbwd, results
    elif case == "decoder_once":
        def fwd():
            kp = ac.project_keys(k, W)
            return [ac.additive_attention(qs, k, W, v, mask=mask,
                                          key_proj=kp) for qs in q]

        def fwdbwd():
            # the gradient stops at key_proj at each step; the keys'
            # projection is differentiated once, after the loop
            kp = ac.project_keys(k, W)
            dkp, total, steps = np.zeros_like(kp), None, []
            for qs, gs in zip(q, G):
                out, alpha = ac.additive_attention(qs, k, W, v, mask=mask,
                                                   key_proj=kp)
                g, g_kp = ac.additive_attention_backward(
                    gs, qs, k, W, v, alpha, mask=mask, key_proj=kp,
                    stop_at_key_proj=True)
                dkp += g_kp               # in place, as autograd does
                if total is None:
                    total = [g.keys, g.W, g.v]
                else:
                    for t, x in zip(total, (g.keys, g.W, g.v)):
                        t += x
                steps.append((out, alpha, g.query))
            dk, dW_k = ac.project_keys_backward(dkp, k, W)
            return steps, total[0] + dk, total[1] + dW_k, total[2]

        def results(r):
            steps, dkeys, dW, dv = r
            found = stack_steps([{"out": o, "alpha": a, "dquery": dq}
                                 for o, a, dq in steps])
            return dict(found, dkeys=dkeys, dW=dW, dv=dv)

        return fwd, fwdbwd, results
    elif case == "dot":
        vis = visibility(case, p)

        def fwd():
            return ac.dot_attention(q, k, values=vals, **vis)

        def bwd(alpha):
            return ac.dot_attention_backward(G, q, k, alpha, values=vals,
                                             **vis)
    else:
        vis = visibility(case, p)

        def fwd():
            return ac.general_attention(q, k, W, values=vals, **vis)

        def bwd(alpha):
            return ac.general_attention_backward(G, q, k, W, alpha,
                                                 values=vals, **vis)

    def fwdbwd():
        out, alpha = fwd()
        return out, alpha, bwd(alpha)

    def results(r):
        return {"out": r[0], "alpha": r[1], **grad_dict(r[2], case)}

    return fwd, fwdbwd, results


# --------------------------------------------------------------------------
# Running

def run_row(case, mask, threads, ctx):
    """Check, then time, ours and the PyTorch forms of one case and mask at
    the current thread count; returns the result row."""
    torch, size = ctx["torch"], ctx["sizes"][CASES[case][0]]
    p = make_problem(case, mask, size, ctx["seed"])
    row = {"case": case, "mask": mask, "threads": threads,
           "size": {k: list(x) if isinstance(x, tuple) else x
                    for k, x in size.items()},
           "errors": {}}
    key = (case, mask)
    if key not in ctx["exact"]:
        fwd, fwdbwd, results = family_forms(torch, case, p,
                                            np.float64)["torch"]
        ctx["exact"][key] = results(fwdbwd())
    exact = ctx["exact"][key]
    forms = {"ours": ours_form(case, p),
             **family_forms(torch, case, p, DTYPE)}
    found = {name: results(fwdbwd())
             for name, (_, fwdbwd, results) in forms.items()}
    for name, result in found.items():
        row["errors"][name] = harness.errors(result, exact)
    row["errors"]["ours_vs_torch"] = harness.errors(found["ours"],
                                                    found["torch"])
    for name, errs in row["errors"].items():
        err, array = harness.worst(errs)
        if not err <= TOLERANCE:
            print(f"WARNING: {name} is inaccurate on {case} {mask} "
                  f"{threads} thr: {array} {err:.2g}", file=sys.stderr)
    funcs = {}
    for name, (fwd, fwdbwd, _) in forms.items():
        funcs[f"{name}_fwd"], funcs[f"{name}_fwdbwd"] = fwd, fwdbwd
    harness.measure_into(row, funcs, ctx["target"], ctx["min_repeats"])
    return row


def comparisons(rows, memory):
    """One entry per (row, metric, baseline) and one for the memory: ours,
    theirs, ratio, limit (None: no target) and status."""
    found = []
    for row in rows:
        times = row["times_ms"]
        for metric, unit in METRICS:
            for base in ("torch", "sdpa", "sdpa_causal"):
                theirs = times.get(f"{base}_{metric}")
                if theirs is None:
                    continue
                limit = (CASES[row["case"]][2]
                         if (metric, base) == ("fwdbwd", "torch") else None)
                found.append(verdict({
                    "case": row["case"], "mask": row["mask"],
                    "measure": unit, "threads": row["threads"],
                    "baseline": base, "ours": times[f"ours_{metric}"],
                    "theirs": theirs, "limit": limit,
                    "others_load": row["others_load"]}))
    if memory:
        found.append(verdict({
            "case": "additive", "mask": "full", "measure": "peak MiB",
            "threads": 1, "baseline": "torch", "ours": memory["ours_mib"],
            "theirs": memory["torch_mib"], "limit": MEMORY_LIMIT,
            "others_load": None}))
    return found


def verdict(entry):
    """Add the ratio, the status and whether the timing was disturbed."""
    ratio = entry["ours"] / entry["theirs"] if entry["theirs"] > 0 else None
    entry["ratio"] = ratio
    entry["status"] = ("-" if entry["limit"] is None
                       else "n/a" if ratio is None
                       else "PASS" if ratio <= entry["limit"] else "MISS")
    entry["disturbed"] = (entry["others_load"] or 0.0) > harness.DISTURBED
    return entry


def run_all(options, ctx):
    """Every case, mask and thread count; returns the rows."""
    rows = []
    for case in options.cases:
        for mask in CASES[case][1]:
            for threads in options.threads:
                start = time.perf_counter()
                with harness.thread_count(threads, ctx["tpc"], ctx["torch"]):
                    rows.append(run_row(case, mask, threads, ctx))
                print(f"  {case:<8} {mask:<6} {threads} thr "
                      f"{time.perf_counter() - start:6.1f} s",
                      file=sys.stderr)
    return rows


# --------------------------------------------------------------------------
# Peak memory, each implementation in a fresh process

def memory_child(which, seed):
    """Print, as JSON, the peak memory of one forward + backward of the
    full-size additive case (full mask) by ``which`` ('ours' or 'torch').

    After the imports, a forward + backward of the quick-size problem warms
    up the libraries (lazy initialisation, thread pools) without leaving
    large buffers behind; then the inputs are made, the peak RSS is reset,
    one forward + backward runs (its outputs kept), and the rise of the
    peak over the RSS before the call is reported.
    """
    torch = harness.optional_import("torch") if which == "torch" else None
    tpc = harness.optional_import("threadpoolctl")
    with harness.thread_count(1, tpc, torch):
        for sizes in (SIZES["quick"], SIZES["full"]):
            p = make_problem("additive", "full", sizes["additive"], seed)
            form = (ours_form("additive", p) if which == "ours" else
                    family_forms(torch, "additive", p, DTYPE)["torch"])
            fwdbwd = form[1]
            if sizes is SIZES["quick"]:
                fwdbwd()
                del p, form, fwdbwd
        gc.collect()
        method, before = harness.peak_start()
        kept = fwdbwd()
        peak = harness.peak_now(method)
    del kept
    harness.print_memory(which, method, before, peak, input_bytes(p) / MiB)
    return 0


def measure_memory(seed):
    """{'ours_mib', 'torch_mib', ...}: peak memory of one forward + backward
    of each, from a fresh subprocess (glibc's mmap threshold fixed at its
    default 128 KiB, so freed buffers go back to the system and the peak
    RSS follows the peak of live memory)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072",
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    found = harness.memory_children(
        "attention_c.bench.family", ("ours", "torch"), ["--seed", str(seed)],
        env, 600)
    found["shape"] = SIZES["full"]["additive"]
    return found


# --------------------------------------------------------------------------
# Report

def comparison_table(found):
    """One line per comparison."""
    head = ["case", "mask", "measure", "thr", "ours", "other", "other is",
            "ratio", "target", "verdict", "others"]
    body = []
    for c in found:
        value = (format_ms if c["measure"] != "peak MiB"
                 else "{:.1f}".format)
        share = c["others_load"]
        body.append([
            c["case"], c["mask"], c["measure"], str(c["threads"]),
            value(c["ours"]), value(c["theirs"]), c["baseline"],
            format_ratio(c["ratio"]),
            "-" if c["limit"] is None else f"<= {c['limit']:g}",
            c["status"] + "*" * c["disturbed"],
            "-" if share is None else f"{share:.0%}"])
    return format_table(head, body, left=3)


def accuracy_table(rows):
    """Worst error (and its array) of each implementation per row."""
    names = list(dict.fromkeys(n for r in rows for n in r["errors"]))
    head = ["case", "mask", "thr"] + [n.replace("_vs_", "~")
                                      for n in names] + ["flag"]
    body = []
    for r in rows:
        cells, bad = [], False
        for n in names:
            if n not in r["errors"]:
                cells.append("-")
                continue
            err, array = harness.worst(r["errors"][n])
            bad |= not err <= TOLERANCE
            cells.append(f"{err:.1e} {array}")
        body.append([r["case"], r["mask"], str(r["threads"])] + cells
                    + ["> 1e-4" if bad else "ok"])
    return format_table(head, body, left=3)


def report(meta, rows, found, memory):
    """The whole text report."""
    lines = header_lines(meta)
    lines[0] = f"attention_c attention-family benchmark, {meta['date']}"
    sizes = meta["sizes"]
    counts = {s: sum(c["status"] == s for c in found)
              for s in ("PASS", "MISS", "n/a")}
    flagged = sum(not harness.worst(e)[0] <= TOLERANCE
                  for r in rows for e in r["errors"].values())
    lines += [
        "",
        "float32.  Shapes: additive (B, Tq, T, H, A) = {}; decoder {} steps,"
        " (B, T, H, A) = {}; dot/general {} x (Tq, T, H) = {}.".format(
            tuple(sizes["additive"].values()), sizes["decoder"]["steps"],
            tuple(list(sizes["decoder"].values())[1:]),
            tuple(sizes["dot"]["lead"]),
            tuple(list(sizes["dot"].values())[1:])),
        "Median ms of ours and of the baseline (torch: PyTorch eager in the "
        "same form; sdpa: F.scaled_dot_product_attention",
        "with the same mask; sdpa_causal: with is_causal=True).  Ratio = "
        "ours / other (< 1: ours faster).  others: share",
        "of all CPUs used by other processes while the row was timed (*: "
        f"more than {harness.DISTURBED:.0%}).",
        comparison_table(found),
        f"Targets: {counts['PASS']} PASS, {counts['MISS']} MISS, "
        f"{counts['n/a']} n/a.",
    ]
    if memory:
        lines.append(
            "peak MiB: rise of the peak RSS ({}) during one forward + "
            "backward of additive {} (full mask), 1 thread, each in a fresh "
            "process; the inputs are {:.1f} MiB.".format(
                memory["method"], tuple(memory["shape"].values()),
                memory["inputs_mib"]))
    lines += [
        "",
        "Accuracy before timing: worst over out, alpha and the gradients of "
        "||x - r|| / ||r||, r = the PyTorch form",
        "in float64 on the same data (ours~torch: r = PyTorch in float32).  "
        f"Flagged above {TOLERANCE:g}: {flagged}.",
        accuracy_table(rows),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Command line

def parse_args(argv):
    """The options, cases and threads expanded to lists."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c.bench.family",
        description="Benchmark the attention family (additive, decoder "
                    "loop, dot, general) against PyTorch eager, float32.")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes, 1 thread, short measurements "
                             "(about 10 s)")
    parser.add_argument("--cases", help="comma-separated, from: "
                        + ", ".join(CASES))
    parser.add_argument("--threads",
                        help="comma-separated thread counts; 'all' = the "
                             "available CPUs (default: 1,all; 1 with "
                             "--quick)")
    parser.add_argument("--target", type=float,
                        help="seconds per measurement (default 0.3, 0.02 "
                             "with --quick)")
    parser.add_argument("--min-repeats", type=int,
                        help="least timed runs per measurement (default 6, "
                             "3 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory subprocesses")
    parser.add_argument("--json", metavar="PATH", help="write all results")
    parser.add_argument("--write-docs", metavar="PAGE",
                        help="rewrite the family's measured sections of "
                             "this page (docs/performance.md), keeping its "
                             "prose")
    parser.add_argument("--memory-child", choices=("ours", "torch"),
                        help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    items = ([s.strip() for s in options.cases.split(",")]
             if options.cases else list(CASES))
    wrong = [s for s in items if s not in CASES]
    if wrong or not items:
        parser.error(f"unknown case {wrong}; choose from {', '.join(CASES)}")
    options.cases = list(dict.fromkeys(items))
    options.threads = harness.thread_counts(
        options.threads or ("1" if options.quick else "1,all"), parser)
    if options.target is None:
        options.target = 0.02 if options.quick else 0.3
    if options.min_repeats is None:
        options.min_repeats = 3 if options.quick else 6
    if options.min_repeats < 1:
        parser.error("--min-repeats must be at least 1")
    return options


def main(argv=None):
    """Entry point of ``python -m attention_c.bench.family``."""
    options = parse_args(argv)
    if options.memory_child:
        return memory_child(options.memory_child, options.seed)
    start = time.perf_counter()
    # harness.setup's optional imports, notes and metadata, for float32.
    ctx, meta = harness.setup(argparse.Namespace(
        no_torch=False, compile=False, shapes=options.cases,
        dtypes=["float32"], threads=options.threads, target=options.target,
        min_repeats=options.min_repeats, seed=options.seed))
    if ctx["torch"] is None:
        print("PyTorch is not importable: it is this benchmark's baseline",
              file=sys.stderr)
        return 1
    meta["cases"] = meta.pop("shapes")
    del meta["compile"]
    meta["sizes"] = SIZES["quick" if options.quick else "full"]
    ctx.update(sizes=meta["sizes"], exact={})
    for note in meta["notes"]:
        print(f"NOTE: {note}", file=sys.stderr)
    rows = run_all(options, ctx)
    memory = None if options.no_memory else measure_memory(options.seed)
    found = comparisons(rows, memory)
    meta["wall_seconds"] = time.perf_counter() - start
    meta["load_end"] = harness.load_average()
    print(report(meta, rows, found, memory))
    print(f"\nTotal {meta['wall_seconds']:.0f} s; load average at end "
          f"{format_load(meta['load_end'])}")
    if options.json:
        with open(options.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "results": rows,
                       "comparisons": found, "memory": memory}, f, indent=1)
            f.write("\n")
        print(f"wrote {options.json}")
    if options.write_docs:
        write_page(options.write_docs, family_sections(
            dict(meta, quick=options.quick), rows, found))
        print(f"wrote {options.write_docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
