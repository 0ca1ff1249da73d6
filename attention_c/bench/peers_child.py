"""The child process of one library of ``attention_c.bench.peers``:
its implementations by name, its environment and thread control, its
outputs (the check) and times, and running it."""

import json
import os
import subprocess
import sys
import time

import numpy as np

from attention_c.bench import harness
from attention_c.bench.peers_cases import (FLOAT64, FLOOR, HEAVY_T, LIBS,
                                           WORKER_TIMEOUT, make_problem)
from attention_c.bench.peers_jax import jax_impls
from attention_c.bench.peers_openvino import openvino_impls
from attention_c.bench.peers_ort import ort_impls
from attention_c.bench.peers_torch import (ours_impls, read_impls,
                                           sdpa_impls)


# --------------------------------------------------------------------------
# The implementations: for each library, {implementation: (run, collect)}
# of a case, where run() is what is timed and collect(run()) the outputs
# as {out[, dq, dk, dv]} in the layout (B, heads, T, d), float64.

def impls(lib, case, p, threads):
    """{implementation: (run, collect)} of ``lib`` on a case (empty where
    the library has no such call)."""
    if lib == "ours":
        return ours_impls(case, p)
    if lib == "sdpa":
        return sdpa_impls(case, p)
    if lib == "ort":
        return ort_impls(case, p, threads)
    if lib == "openvino":
        return openvino_impls(case, p, threads)
    if lib == "jax":
        return jax_impls(case, p)
    if lib == FLOOR:
        return read_impls(case, p)
    raise ValueError(f"unknown library {lib!r}; choose from {LIBS}")


# --------------------------------------------------------------------------
# The child process of one library

def child_env(lib, threads, cache_dir=None):
    """The environment of ``lib``'s child at ``threads`` threads."""
    env = dict(os.environ)
    # the child imports the attention_c this process runs
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + [x for x in [env.get("PYTHONPATH")] if x])
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                 "OPENBLAS_NUM_THREADS", "ATTENTION_C_NUM_THREADS"):
        env[name] = str(threads)
    if lib == "jax":
        env["JAX_PLATFORMS"] = "cpu"
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        flags = [f"--xla_cpu_multi_thread_eigen={str(threads > 1).lower()}",
                 f"intra_op_parallelism_threads={threads}"]
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", "")] + flags
                                    ).strip()
        if cache_dir:
            env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    return env


def set_threads(lib, threads):
    """Set ``lib``'s own thread control in this (child) process; JAX's
    CPU affinity (its thread pool is sized from it) before jax is
    imported.  Returns the library's version."""
    if lib == "jax":
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[:threads])
        import jax
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            # the rounds compile the same functions: compile once
            jax.config.update("jax_compilation_cache_dir",
                              os.environ["JAX_COMPILATION_CACHE_DIR"])
            jax.config.update("jax_persistent_cache_min_compile_time_secs",
                              0)
        return jax.__version__
    if lib == "ours":
        import attention_c as ac
        ac.set_num_threads(threads)
        return ac.__version__
    if lib in ("sdpa", FLOOR):
        import torch
        torch.set_num_threads(threads)
        return torch.__version__
    if lib == "ort":
        import onnxruntime
        return onnxruntime.__version__
    if lib == "openvino":
        import openvino
        return openvino.__version__
    raise ValueError(f"unknown library {lib!r}")


def check_dtypes(lib):
    """The dtypes ``lib`` is checked in: float64 where it has it (SDPA
    both: its float64 is the reference)."""
    if lib == "sdpa":
        return ("float64", "float32")
    return ("float64",) if lib in FLOAT64 else ("float32",)


def compute_outputs(lib, cases, seed, threads, compute=None):
    """{(implementation, dtype, case key): outputs} of ``lib`` on the
    check cases, in this process.  ``compute`` (tests only) replaces the
    library: a function (lib, case, problem, threads) -> {implementation:
    (run, collect)}, to show that a wrong peer is caught."""
    compute = compute or (lambda lib, case, p, n: impls(lib, case, p, n))
    found = {}
    for dtype in check_dtypes(lib):
        for case in cases:
            p = make_problem(case, seed, np.dtype(dtype))
            for name, (run, collect) in compute(lib, case, p,
                                                threads).items():
                found[name, dtype, case["key"]] = collect(run())
    return found


def thread_ticks():
    """{thread id: CPU ticks (user + system)} of this process's threads,
    from /proc/self/task; empty where there is no /proc."""
    found = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        found[tid] = int(fields[11]) + int(fields[12])
    return found


def effective_threads(before, after):
    """The CPU time of all the process's threads between two
    ``thread_ticks()`` over that of its busiest thread: about N for a
    library that shares its work among N threads, whatever the machine's
    load and however many thread pools it holds (ONNX Runtime has one a
    session); None where unknown."""
    used = [ticks - before.get(t, 0) for t, ticks in after.items()]
    if not used or max(used) <= 0:
        return None
    return sum(used) / max(used)


def time_cases(lib, cases, seed, threads, target, min_repeats):
    """{implementation|case key: ms} of ``lib`` on ``cases`` (float32,
    ``harness.measure``), with the CPU use and others' share meanwhile."""
    funcs, heavy = {}, []
    for case in cases:
        p = make_problem(case, seed)
        for name, (run, _) in impls(lib, case, p, threads).items():
            funcs[f"{name}|{case['key']}"] = run
            if p["dims"][4] >= HEAVY_T and case["kind"] != "decode":
                heavy.append(f"{name}|{case['key']}")
    light = [k for k in funcs if k not in heavy]
    times = {}
    ticks = thread_ticks()
    before, start = harness.cpu_seconds(), time.perf_counter()
    for group, repeats in ((light, min_repeats),
                           (heavy, min(min_repeats, 3))):
        if group:
            timed = harness.measure({k: funcs[k] for k in group}, target,
                                    repeats)
            times.update({k: s * 1e3 for k, (s, _) in timed.items()})
    wall = time.perf_counter() - start
    own = harness.cpu_seconds()[1] - before[1]
    return {"times_ms": times, "cpu_per_wall": own / wall,
            "threads_used": effective_threads(ticks, thread_ticks()),
            "others_load": harness.others_load(before, wall)}


def worker(lib, spec):
    """The child's work: set the threads, import the library, then
    check (write the outputs to spec['out'], an .npz) or time; prints
    one JSON line."""
    threads = spec["threads"]
    version = set_threads(lib, threads)
    found = {"lib": lib, "version": version, "threads": threads,
             "mode": spec["mode"]}
    if spec["mode"] == "check":
        outputs = compute_outputs(lib, spec["cases"], spec["seed"], threads)
        np.savez(spec["out"], **{
            f"{name}|{dtype}|{key}|{array}": x
            for (name, dtype, key), arrays in outputs.items()
            for array, x in arrays.items()})
        found["impls"] = sorted({name for name, _, _ in outputs})
    else:
        found.update(time_cases(lib, spec["cases"], spec["seed"], threads,
                                spec["target"], spec["min_repeats"]))
    found["modules"] = sorted(m for m in ("torch", "jax", "onnxruntime",
                                          "openvino")
                              if m in sys.modules)
    print(json.dumps(found))
    return 0


def run_worker(lib, spec, cache_dir=None):
    """Run ``lib``'s child on ``spec``; its JSON line, or {'error': ...}
    when it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "attention_c.bench.peers", "--worker", lib,
         "--spec", json.dumps(spec)],
        capture_output=True, text=True, timeout=WORKER_TIMEOUT,
        env=child_env(lib, spec["threads"], cache_dir), check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-1500:] or
                f"exit status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])
