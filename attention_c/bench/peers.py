"""Attention against the peers (issues 26 and 32): PyTorch SDPA, ONNX Runtime,
OpenVINO and JAX, each in its own process, in the same run.

``python -m attention_c.bench --peers`` (or ``python -m
attention_c.bench.peers``) runs it; ``--help`` lists the options,
``--quick`` runs tiny sizes in a few seconds.  The peers are optional
(``pip install attention_c[peers]``); those not importable are left out
and said so.  PyTorch's SDPA is the reference of the accuracy check, so
PyTorch is required.

The implementations (float32 when timed):

* **ours**: ``attention_c.dot_attention(q, k, values=v,
  return_weights=False)`` on NumPy arrays (B, heads, T, d), and
  ``dot_attention_backward`` from its ``out`` and ``lse``; grouped-query
  heads as keys (B, Hkv, 1, T, d) against queries (B, Hkv, G, 1, d);
* **sdpa**: ``torch.nn.functional.scaled_dot_product_attention`` (forward
  under ``no_grad``; forward + backward ``torch.autograd.grad`` of its
  output given g; ``enable_gqa=True`` for grouped-query heads);
* **ort**: ONNX Runtime's CPU provider, a one-node model of the ONNX
  ``Attention`` operator at opset 23 (4-D (B, heads, T, d), grouped-query
  heads native) and of ``com.microsoft.MultiHeadAttention`` ((B, T,
  heads * d), ``unidirectional`` for causal; no grouped-query form): both
  are checked and timed, and a row reports the faster
  (``com.microsoft.GroupQueryAttention``, which needs a cache laid out
  its own way and the sequence lengths, is not timed);
* **openvino**: a one-node model of opset 13 ``ScaledDotProductAttention``
  compiled for the CPU, f32 inference precision (OpenVINO would pick bf16
  on CPUs that have it); grouped-query heads as ours (5-D, broadcast);
* **jax**: ``jax.nn.dot_product_attention`` (B, T, heads, d) under
  ``jax.jit``; forward + backward ``jax.vjp`` under the same jit.

ONNX Runtime and OpenVINO are inference engines: they have forward rows
only.  Every library gets its inputs in its own layout, made before
timing.

**One process per library.**  Each library runs in a child process
(``python -m attention_c.bench.peers --worker LIB``) that imports only
it, with its thread count set both in the environment (OMP_NUM_THREADS,
MKL_NUM_THREADS, OPENBLAS_NUM_THREADS, ATTENTION_C_NUM_THREADS) and
through its own control: ``attention_c.set_num_threads``,
``torch.set_num_threads``, ONNX Runtime's ``intra_op_num_threads`` (and
``inter_op_num_threads`` = 1), OpenVINO's ``INFERENCE_NUM_THREADS`` (one
stream, latency hint).  JAX (XLA) has no run-time thread count: its
child's CPU affinity is restricted to N CPUs before jax is imported (as
``taskset`` would), which sizes XLA's thread pool, and at 1 thread
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1`` as well (one CPU at a time, though
JAX keeps two threads busy: the Python one dispatches, one of XLA's
computes).  Every child reports, while it timed, the CPU time of all its
threads over that of its busiest one (read from /proc/self/task: about
the number of threads a library really shared its work among, whatever
the machine's load; threads that spin while they wait count too, as
ONNX Runtime's do between runs) and its CPU time / wall time.

**Checked before timed.**  At the smallest thread count, every library's
child computes each kind of case on a small shape (``CHECK_SHAPES``) and
its outputs (and gradients) are compared with SDPA in float64 on the same
data (``||x - r|| / ||r||``): in float64 where the library computes in
float64 (ours, SDPA), with tolerance ``TOLERANCE_64``, else in float32
with ``TOLERANCE_32`` (ONNX Runtime and OpenVINO have no float64
attention on the CPU; ``jax.nn.dot_product_attention`` computes its
softmax in float32 whatever its inputs; SDPA's float32 is checked
too).  An implementation that fails is reported as failed and never
timed.

**Interleaved rounds.**  For each thread count, ``--rounds`` rounds; in
each, every library's child runs once (order reversed every other round)
and times all its cases with ``harness.measure`` (medians of repeats
after warm-up).  A time is the median over the rounds; ratios are ours /
peer (< 1: ours faster).  Each child also reports the share of the CPUs
that other processes used while it timed (``harness.others_load``).

Targets of issue 32 (PASS / MISS): ours / SDPA <= 0.85 on every forward
and forward + backward row; ours / ONNX Runtime and ours / OpenVINO <=
0.93 on every forward row; decode (MHA and GQA) <= 0.8 x the best peer.

**The read floor of a decode row.**  A decode step reads each key and
value once and does two FMAs per element read for each query head that
shares it (2 to 8 here): it is bound by how fast the host reads them.  A
child of its own (``FLOOR``, with PyTorch's threads set like SDPA's)
times, in the same rounds, ``torch.amax`` and ``torch.sum`` of the case's
k and v, and the row reports the faster as
"read ms" and read / best peer: the least ratio to the fastest peer that
any implementation could reach.  Where it is above the target's limit the
target asks for more than the host's read rate, and the report says so.

The modules: this one holds the command line (the options, the rounds,
``run`` and ``main``) and re-exports the rest, ``peers_cases`` (the
libraries, shapes, tolerances, targets, the cases and their data),
``peers_torch``, ``peers_ort``, ``peers_openvino`` and ``peers_jax``
(each library's implementations), ``peers_child`` (a library's child
process), ``peers_check`` (the accuracy check) and ``peers_report``
(rows, targets and the report).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time

from attention_c.bench import harness
from attention_c.bench.docs_page import write_page
from attention_c.bench.peers_cases import (
    CHECK_SHAPES, DECODE, FLOAT64, FLOOR, FLOOR_IMPLS, HEADS, HEAVY_T,
    INFERENCE, KIND_TEXT, LIBS, MODULES, NAMES, ORT_IMPLS, QUICK_DECODE,
    QUICK_SHAPES, SHAPES, TARGETS, THREAD_CONTROL, TOLERANCE_32,
    TOLERANCE_64, WORKER_TIMEOUT, as_outputs, case_key, check_cases, dims,
    make_cases, make_problem)
from attention_c.bench.peers_check import (check_lib, compare, installed,
                                           load_outputs, sdpa_reference)
from attention_c.bench.peers_child import (check_dtypes, child_env,
                                           compute_outputs, effective_threads,
                                           impls, run_worker, set_threads,
                                           thread_ticks, time_cases, worker)
from attention_c.bench.peers_jax import jax_impls
from attention_c.bench.peers_openvino import openvino_impls
from attention_c.bench.peers_ort import ort_impls
from attention_c.bench.peers_report import (docs_section, evaluate,
                                            make_rows, median_times, report,
                                            report_lines, table)
from attention_c.bench.peers_torch import (ours_impls, read_impls,
                                           sdpa_impls)
from attention_c.bench.report import emit

__all__ = [
    # peers_cases
    "LIBS", "MODULES", "NAMES", "INFERENCE", "FLOAT64", "FLOOR",
    "FLOOR_IMPLS", "ORT_IMPLS",
    "SHAPES", "QUICK_SHAPES", "DECODE", "QUICK_DECODE", "HEADS",
    "CHECK_SHAPES", "TOLERANCE_64", "TOLERANCE_32", "HEAVY_T",
    "WORKER_TIMEOUT", "THREAD_CONTROL", "TARGETS", "KIND_TEXT",
    "case_key", "make_cases", "check_cases", "dims", "make_problem",
    "as_outputs",
    # the libraries
    "ours_impls", "sdpa_impls", "ort_impls", "openvino_impls", "jax_impls",
    "read_impls",
    # peers_child
    "impls", "child_env", "set_threads", "check_dtypes", "compute_outputs",
    "thread_ticks", "effective_threads", "time_cases", "worker",
    "run_worker",
    # peers_check
    "installed", "compare", "load_outputs", "check_lib", "sdpa_reference",
    # peers_report
    "median_times", "make_rows", "evaluate", "table", "report",
    "docs_section", "report_lines",
    # this module
    "run_rounds", "parse_args", "run", "main",
]


# --------------------------------------------------------------------------
# Rounds

def _times(lib, case):
    """Whether ``lib``'s child times ``case``: inference engines have no
    backward, the read floor is a decode row's alone."""
    if lib == FLOOR:
        return case["kind"] == "decode"
    return not (lib in INFERENCE and case["kind"] == "fwdbwd")


def run_rounds(libs, cases, threads, options, cache_dir):
    """``options.rounds`` interleaved rounds at ``threads`` threads: every
    library's child once a round, order reversed every other round.
    Returns {lib: [child results]}."""
    found = {lib: [] for lib in libs}
    spec = {"mode": "time", "threads": threads, "seed": options.seed,
            "target": options.target, "min_repeats": options.min_repeats}
    for r in range(options.rounds):
        for lib in libs if r % 2 == 0 else libs[::-1]:
            start = time.perf_counter()
            lib_cases = [c for c in cases if _times(lib, c)]
            child = run_worker(lib, dict(spec, cases=lib_cases), cache_dir)
            found[lib].append(child)
            print(f"  round {r + 1}/{options.rounds} {threads} thr {lib:<9}"
                  f"{time.perf_counter() - start:6.1f} s"
                  + (" FAILED" if "error" in child else ""),
                  file=sys.stderr)
    return found


# --------------------------------------------------------------------------
# Command line

def parse_args(argv):
    """The options of ``python -m attention_c.bench --peers``."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c.bench --peers",
        description="Benchmark attention_c against PyTorch SDPA, ONNX "
                    "Runtime, OpenVINO and JAX (those installed), each in "
                    "its own process, checked against SDPA in float64 "
                    "before timing, in interleaved rounds: forward full "
                    "and causal, forward + backward, decode MHA and GQA, "
                    "with the targets of issue 32.")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, short measurements, 2 rounds")
    parser.add_argument("--threads", default="1,2",
                        help="comma-separated thread counts; 'all' = the "
                             "available CPUs (default: 1,2)")
    parser.add_argument("--libs", default=",".join(LIBS),
                        help="comma-separated, from: " + ", ".join(LIBS)
                             + " (default: all; ours and sdpa always run)")
    parser.add_argument("--rounds", type=int,
                        help="interleaved rounds (default 3, 2 with --quick)")
    parser.add_argument("--target", type=float,
                        help="seconds per case in a child (default 0.3, "
                             "0.01 with --quick)")
    parser.add_argument("--min-repeats", type=int,
                        help="least timed runs per case in a child (default"
                             " 3, 1 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write all results")
    parser.add_argument("--write-docs", metavar="PAGE",
                        help="rewrite the 'peers' section of this page "
                             "(docs/performance.md), keeping its prose")
    parser.add_argument("--worker", choices=LIBS + (FLOOR,),
                        help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        return options
    options.threads = harness.thread_counts(options.threads, parser)
    libs = [s.strip() for s in options.libs.split(",") if s.strip()]
    wrong = [s for s in libs if s not in LIBS]
    if wrong:
        parser.error(f"unknown libraries {wrong}; choose from "
                     f"{', '.join(LIBS)}")
    options.libs = [lib for lib in LIBS
                    if lib in libs or lib in ("ours", "sdpa")]
    if options.rounds is None:
        options.rounds = 2 if options.quick else 3
    if options.target is None:
        options.target = 0.01 if options.quick else 0.3
    if options.min_repeats is None:
        options.min_repeats = 1 if options.quick else 3
    if options.rounds < 1 or options.min_repeats < 1:
        parser.error("--rounds and --min-repeats must be at least 1")
    return options


def run(options, folder):
    """The check, the rounds at each thread count, the rows and targets:
    (meta, rows, targets)."""
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": harness.cpu_model(), "cpus": harness.available_cpus(),
        "load_start": harness.load_average(), "config": harness.our_config(),
        "quick": options.quick, "threads": options.threads,
        "rounds": options.rounds, "target_s": options.target,
        "min_repeats": options.min_repeats, "seed": options.seed,
        "libs": {}, "checks": {}, "cpu_use": {}, "threads_used": {},
        "others_load": {}}
    check_threads = min(options.threads)
    reference, version, error = sdpa_reference(options.seed, check_threads,
                                               folder)
    if error:
        raise RuntimeError(f"SDPA's check child failed:\n{error}")
    passed = {}
    for lib in options.libs:
        status = {"version": None, "status": "not installed"}
        meta["libs"][lib] = status
        if not installed(lib):
            continue
        status["version"], passed[lib], verdicts, error = check_lib(
            lib, reference, options.seed, check_threads, folder)
        meta["checks"][lib] = verdicts
        failed = [i for i, ok in passed[lib].items() if not ok]
        if error:
            status["status"] = "failed to run: " + error.splitlines()[-1]
        elif failed or not passed[lib]:
            status["status"] = "FAILED the check: " + ", ".join(failed)
        else:
            status["status"] = "checked"
        print(f"  check {lib:<9} {status['status']}", file=sys.stderr)
    timed = [lib for lib in options.libs if passed.get(lib)
             and any(passed[lib].values())]
    meta["timed"] = timed
    if "ours" not in timed:
        raise RuntimeError("attention_c failed its own check: "
                           + json.dumps(meta["checks"].get("ours"),
                                        default=str))
    cases = make_cases(options.quick)
    # the read floor beside the libraries (PyTorch is there: SDPA is)
    passed[FLOOR] = dict.fromkeys(FLOOR_IMPLS, True)
    rows = []
    for threads in options.threads:
        children = run_rounds(timed + [FLOOR], cases, threads, options,
                              folder)
        for lib, runs in children.items():
            errors = [c["error"] for c in runs if "error" in c]
            if errors:
                meta["libs"][lib]["status"] += (
                    f"; {len(errors)} timing run(s) failed at {threads} "
                    f"thr: " + errors[-1].splitlines()[-1])
        medians = {lib: median_times(runs, passed[lib])
                   for lib, runs in children.items()}
        rows += make_rows(cases, threads, medians, children)
        meta["threads_used"][threads] = {
            lib: statistics.median(c["threads_used"] for c in runs
                                   if c.get("threads_used") is not None)
            for lib, runs in children.items()
            if any(c.get("threads_used") is not None for c in runs)}
        meta["cpu_use"][threads] = {
            lib: statistics.median(c["cpu_per_wall"] for c in runs
                                   if "cpu_per_wall" in c)
            for lib, runs in children.items()
            if any("cpu_per_wall" in c for c in runs)}
        loads = [c["others_load"] for runs in children.values()
                 for c in runs if c.get("others_load") is not None]
        meta["others_load"][threads] = (statistics.mean(loads) if loads
                                        else None)
    return meta, rows, evaluate(rows)


def main(argv=None):
    """Entry point of ``python -m attention_c.bench --peers``."""
    options = parse_args(sys.argv[1:] if argv is None else list(argv))
    if options.worker:
        return worker(options.worker, json.loads(options.spec))
    if not installed("sdpa"):
        print("PyTorch is required (SDPA is the reference and a peer)",
              file=sys.stderr)
        return 1
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attention_c_peers_") as folder:
        meta, rows, targets = run(options, folder)
    meta["wall_seconds"] = time.perf_counter() - start
    meta["load_end"] = harness.load_average()
    emit(options, meta, report(meta, rows, targets),
         {"meta": meta, "rows": rows, "targets": targets},
         lambda path: write_page(path, docs_section(meta, rows, targets)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
