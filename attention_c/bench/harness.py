"""What both benchmarks share: the machine's facts (CPU, load, BLAS, the
CPU time other processes take, read from /proc where there is one),
thread counts, the timing loop, the peak-memory watch and the accuracy
check."""

import argparse
import contextlib
import datetime
import gc
import importlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

import attention_c as ac
from attention_c import _core  # type: ignore[attr-defined]
from attention_c.testing import rel_err

ROUNDS = 3              # interleaved rounds per measurement
MAX_BLOCK = 5000        # most timed calls in a row

# Rows timed while other processes used more than this share of all CPUs
# are marked as disturbed.
DISTURBED = 0.1

# The FMA peak is measured (measure_fma_peak): each SIMD path's
# register-only FMA loop (attention_c._core._fma_loop) calibrated to
# PEAK_SECONDS a call, the best of PEAK_REPEATS calls.
PEAK_SECONDS = 0.2
PEAK_REPEATS = 5
QUICK_PEAK_SECONDS = 0.05      # with --quick
# A row's share of the peak divides by the peak of its own rounds: the
# FMA loop, PROBE_SECONDS a call, timed among the row's calls under the
# key PROBE (measure_into's peak=).  The host's speed drifts by up to 20 %
# over a run (shared VMs), and a share against a peak taken minutes
# before measured the drift along with the kernel.
PROBE = "fma_peak"
PROBE_SECONDS = 0.02

# The /proc/cpuinfo flags the report names (x86 "flags", ARM "Features"):
# the instruction sets the kernels or the peers may use.
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni",
              "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
              "amx_int8", "asimd", "asimdhp", "asimddp", "sve", "sve2",
              "bf16", "i8mm", "sme")


# --------------------------------------------------------------------------
# Environment

def available_cpus():
    """Number of CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpuinfo(key):
    """The value of the first line of /proc/cpuinfo that starts with
    ``key``, or None (no such line, or no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model():
    """CPU model name from /proc/cpuinfo (else from platform)."""
    return (_cpuinfo("model name") or platform.processor()
            or platform.machine() or "unknown")


def load_average():
    """The 1-minute load average, or None where unknown."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_seconds():
    """(CPU seconds used by the whole machine, by this process) so far.

    The first is None where /proc/stat is missing (not Linux).
    """
    own = sum(os.times()[:2])
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None, own
    idle = ticks[3] + ticks[4]                 # idle, iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), own


def others_load(before, wall):
    """Share of all CPUs that other processes used since ``before`` (from
    cpu_seconds()) during ``wall`` seconds; None where unknown."""
    (machine0, own0), (machine1, own1) = before, cpu_seconds()
    if machine0 is None or machine1 is None or wall <= 0:
        return None
    others = (machine1 - machine0) - (own1 - own0)
    return max(0.0, others / (wall * (os.cpu_count() or 1)))


def cpu_flags():
    """The SIMD_FLAGS this CPU reports in /proc/cpuinfo, in that order
    (empty where there is no /proc/cpuinfo)."""
    line = _cpuinfo("flags") or _cpuinfo("Features") or ""
    have = set(line.split())
    return [f for f in SIMD_FLAGS if f in have]


def cpu_clock():
    """(MHz, what it is) of a core, for information only (the peak is
    measured): lscpu's "CPU max MHz" where it reports one, else the "cpu
    MHz" of /proc/cpuinfo (the clock now; on a virtual machine the
    nominal one), else (None, 'unknown')."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True,
                               env=dict(os.environ, LC_ALL="C"),
                               timeout=10, check=False).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        lines = []
    for line in lines:
        if line.startswith("CPU max MHz:"):
            return float(line.split(":", 1)[1]), "max MHz (lscpu)"
    mhz = _cpuinfo("cpu MHz")
    try:
        return (float(mhz), "cpu MHz of /proc/cpuinfo (nominal/current: "
                "no max MHz reported)")
    except (TypeError, ValueError):
        return None, "unknown"


# measure_fma_peak's results by (simd, dtype, threads, seconds, repeats)
_PEAKS: dict = {}


def fma_peak_record(simd, dtype, threads, seconds=PEAK_SECONDS,
                    repeats=PEAK_REPEATS):
    """The measured FMA peak of ``threads`` threads on the SIMD path
    ``simd`` for ``dtype``, as a dict: ``gflops`` (the best of ``repeats``
    calls of the path's FMA loop, each calibrated to about ``seconds``),
    ``iters``, ``call_s`` (the best call's seconds), ``others`` (the
    share of all CPUs other processes used meanwhile, None where unknown),
    ``busy_gflops`` (flops per CPU second of this process x threads: the
    rate while the threads ran, what a machine without other processes
    would give; for information, as the peak is the wall-clock one) and
    the key.  Measured once per key, then cached."""
    dtype = np.dtype(dtype).name
    key = (simd, dtype, int(threads), float(seconds), int(repeats))
    if key not in _PEAKS:
        _PEAKS[key] = _measure_peak(simd, dtype, int(threads), seconds,
                                    repeats)
    return dict(_PEAKS[key])


def measure_fma_peak(simd, dtype, threads, seconds=PEAK_SECONDS,
                     repeats=PEAK_REPEATS):
    """GF/s of ``threads`` threads running the FMA loop of the SIMD path
    ``simd`` for ``dtype`` at once: the machine's measured peak (see
    :func:`fma_peak_record`)."""
    return fma_peak_record(simd, dtype, threads, seconds, repeats)["gflops"]


def _measure_peak(simd, dtype, threads, seconds, repeats):
    """One measurement of fma_peak_record."""
    clock = time.perf_counter

    def timed(iters):
        cpu, start = time.process_time(), clock()
        flops = _core._fma_loop(dtype, simd, iters, threads)
        return flops, clock() - start, time.process_time() - cpu

    iters = 1024
    while True:             # calibrate on at least a tenth of the target
        took = min(timed(iters)[1] for _ in range(3))
        if took >= seconds / 10:
            break
        iters *= 8 if took < seconds / 100 else 2
    iters = max(1, round(iters * seconds / took))
    best, call, busy = 0.0, None, 0.0
    before, begin = cpu_seconds(), clock()
    for _ in range(repeats):
        flops, took, cpu = timed(iters)
        if flops / took / 1e9 > best:
            best, call = flops / took / 1e9, took
        if cpu > 0:
            busy = max(busy, flops / cpu * threads / 1e9)
    return {"simd": simd, "dtype": dtype, "threads": threads,
            "gflops": best, "iters": iters, "seconds": seconds,
            "call_s": call, "repeats": repeats,
            "busy_gflops": busy or None,
            "others": others_load(before, clock() - begin)}


def peak_facts(simd, dtypes, threads, quick=False):
    """The machine's facts for the report and JSON: CPU model, SIMD flags,
    clock (information only) and the measured FMA peak of the path
    ``simd`` for each of ``dtypes`` and ``threads`` (list of
    fma_peak_record dicts, under "peaks"); ``quick``: calls of
    QUICK_PEAK_SECONDS."""
    seconds = QUICK_PEAK_SECONDS if quick else PEAK_SECONDS
    mhz, source = cpu_clock()
    peaks = [fma_peak_record(simd, d, n, seconds)
             for d in dict.fromkeys(np.dtype(d).name for d in dtypes)
             for n in sorted(set(threads))]
    return {"cpu": cpu_model(), "flags": cpu_flags(), "mhz": mhz,
            "clock": source, "simd": simd, "seconds": seconds,
            "peaks": peaks}


def fma_peak(facts, threads, dtype, simd=None):
    """The measured GF/s of ``threads`` threads on the path ``simd`` (the
    one of the ``facts``, by default) for ``dtype``: from the facts of
    :func:`peak_facts`, measured (and added to them) when missing."""
    simd = facts["simd"] if simd is None else simd
    dtype = np.dtype(dtype).name
    for p in facts["peaks"]:
        if (p["simd"], p["dtype"], p["threads"]) == (simd, dtype, threads):
            return p["gflops"]
    record = fma_peak_record(simd, dtype, threads, facts["seconds"])
    facts["peaks"].append(record)
    return record["gflops"]


def optional_import(name):
    """The module ``name``, or None when it cannot be imported."""
    try:
        return importlib.import_module(name)
    except Exception:   # noqa: BLE001 (a broken install must not stop us)
        return None


def blas_info(tpc):
    """The BLAS libraries NumPy uses, as reported by threadpoolctl."""
    if tpc is None:
        return "unknown (no threadpoolctl)"
    infos = [i for i in tpc.threadpool_info() if i["user_api"] == "blas"]
    return ", ".join(f"{i['internal_api']} {i['version']} "
                     f"({i.get('threading_layer', '?')}, "
                     f"{i.get('architecture', '?')})"
                     for i in infos) or "none found"


def our_config():
    """The facts of ``attention_c.show_config()``, without printing them."""
    return ac.show_config(file=io.StringIO())


def thread_counts(text, parser):
    """The sorted thread counts of a comma-separated list ('all': the
    available CPUs); a bad item is an error of the argparse ``parser``."""
    threads = set()
    for item in text.split(","):
        item = item.strip().lower()
        if item == "all":
            threads.add(available_cpus())
        elif item.isdigit() and int(item) > 0:
            threads.add(int(item))
        else:
            parser.error(f"bad thread count {item!r}")
    return sorted(threads)


def memory_children(module, names, args, env, timeout):
    """Peak memory of one forward + backward of each of ``names`` (ours,
    the baseline), each in a fresh ``python -m module --memory-child NAME
    *args`` that prints :func:`print_memory`'s line last:
    ``{'<name>_mib', 'method', 'inputs_mib'}``."""
    found = {}
    for which in names:
        proc = subprocess.run(
            [sys.executable, "-m", module, "--memory-child", which, *args],
            capture_output=True, text=True, env=env, timeout=timeout,
            check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"memory subprocess ({which}) failed:\n"
                               + proc.stderr[-2000:])
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        found[f"{which}_mib"] = child["peak_mib"]
        found["method"], found["inputs_mib"] = (child["method"],
                                                child["inputs_mib"])
    return found


def print_memory(which, method, before, peak, inputs_mib):
    """A memory child's result line (KiB of RSS before and at the peak)."""
    print(json.dumps({"which": which, "method": method,
                      "rss_before_mib": before / 1024,
                      "peak_mib": (peak - before) / 1024,
                      "inputs_mib": inputs_mib}))


def baseline_torch():
    """torch, the baseline of the issue benchmarks; None (said on stderr)
    when it is not installed."""
    torch = optional_import("torch")
    if torch is None:
        print("PyTorch is required (it is the baseline)", file=sys.stderr)
    return torch


def torch_facts(torch):
    """The report's facts about the PyTorch baseline: its version and the
    CPU capability its kernels dispatch to."""
    capability = getattr(torch.backends, "cpu", None)
    return {"torch": torch.__version__,
            "torch_capability": capability.get_cpu_capability()
            if capability else "?"}


def run_baseline_bench(torch, run):
    """``run()`` -> (meta, results), timed as a whole: our float32
    precision and both libraries' thread counts restored after it, the
    run's wall seconds, the CPU share others used meanwhile and the load
    at its end in meta.  Returns (meta, results)."""
    saved = (ac.get_fp32_precision(), ac.get_num_threads(),
             torch.get_num_threads())
    try:
        before, start = cpu_seconds(), time.perf_counter()
        meta, results = run()
        meta["wall_seconds"] = time.perf_counter() - start
        meta["others_share"] = others_load(before, meta["wall_seconds"])
        meta["load_end"] = load_average()
    finally:
        ac.set_fp32_precision(saved[0])
        ac.set_num_threads(saved[1])
        torch.set_num_threads(saved[2])
    return meta, results


def parse_mode_args(mode, description, argv):
    """The options of ``python -m attention_c.bench --<mode>``: the run
    options alone (no docs page to write)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m attention_c.bench --{mode}",
        description=description)
    add_run_options(parser, None)
    return finish_run_options(parser.parse_args(argv), parser)


def add_run_options(parser, section, repeats_help=""):
    """The options of the issue benchmarks (``--selfattn``, ``--mha``):
    --quick, --threads, --target, --min-repeats, --seed, --json and
    --write-docs (of the page's ``section``; none when it is None)."""
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, short measurements (seconds)")
    parser.add_argument("--threads", default="1,2",
                        help="comma-separated thread counts; 'all' = the "
                             "available CPUs (default: 1,2)")
    parser.add_argument("--target", type=float,
                        help="seconds per measurement (default 0.5, 0.01 "
                             "with --quick)")
    parser.add_argument("--min-repeats", type=int,
                        help="least timed runs per measurement (default 5"
                             + repeats_help + "; 1 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write all results")
    if section is None:
        return
    parser.add_argument("--write-docs", metavar="PAGE",
                        help=f"rewrite the '{section}' section of this page "
                             f"(docs/performance.md), keeping its prose; "
                             f"appended if the page has none")


def finish_run_options(options, parser):
    """The defaults and checks of :func:`add_run_options`' options, once
    parsed."""
    options.threads = thread_counts(options.threads, parser)
    if options.target is None:
        options.target = 0.01 if options.quick else 0.5
    if options.min_repeats is None:
        options.min_repeats = 1 if options.quick else 5
    if options.min_repeats < 1:
        parser.error("--min-repeats must be at least 1")
    return options


@contextlib.contextmanager
def thread_count(n, tpc, torch):
    """Run ours, NumPy's BLAS (if threadpoolctl) and torch on n threads."""
    saved_ours = ac.get_num_threads()
    saved_torch = torch.get_num_threads() if torch else None
    ac.set_num_threads(n)
    if torch:
        torch.set_num_threads(n)
    blas = (tpc.threadpool_limits(limits=n, user_api="blas") if tpc
            else contextlib.nullcontext())
    try:
        with blas:
            yield
    finally:
        ac.set_num_threads(saved_ours)
        if torch:
            torch.set_num_threads(saved_torch)


# --------------------------------------------------------------------------
# Timing

def warn_inaccurate(errs, tolerance, where):
    """A warning on stderr for each implementation whose error (``errs``,
    by name) passes its ``tolerance``."""
    for name, e in errs.items():
        if not e <= tolerance[name]:
            print(f"WARNING: {name} is inaccurate on {where}: {e:.2e} > "
                  f"{tolerance[name]:.0e}", file=sys.stderr)


def rows_by_threads(threads, ctx, torch, label, make_row):
    """``make_row(n)`` at each thread count n (ours and torch set to it),
    its seconds on stderr after ``label``; the rows."""
    rows = []
    for n in threads:
        start = time.perf_counter()
        with thread_count(n, ctx["tpc"], torch):
            rows.append(make_row(n))
        print(f"  {label} {n} thr {time.perf_counter() - start:6.1f} s",
              file=sys.stderr)
    return rows


def measure(funcs, target, min_repeats, before=None):
    """Median seconds per call of each callable, and its number of samples.

    ROUNDS times, every callable runs in turn (order reversed every other
    round): one untimed call to warm up after the switch, then timed calls
    for about target / ROUNDS seconds, more if needed to reach
    ``min_repeats`` samples in all.  So changes in the machine's load hit
    every implementation alike.  ``before``: called, untimed, before
    every timed call (its time counts against the budget).
    """
    clock = time.perf_counter
    budget = target / ROUNDS
    least = -(-min_repeats // ROUNDS)
    samples = {key: [] for key in funcs}
    order = list(funcs)
    gc.collect()
    gc.disable()
    try:
        for r in range(ROUNDS):
            for key in order if r % 2 == 0 else order[::-1]:
                fn, times = funcs[key], samples[key]
                fn()
                n, begin = 0, clock()
                while n < least or (clock() - begin < budget
                                    and n < MAX_BLOCK):
                    if before is not None:
                        before()
                    start = clock()
                    fn()
                    times.append(clock() - start)
                    n += 1
    finally:
        gc.enable()
    return {key: (statistics.median(s), len(s)) for key, s in samples.items()}


# --------------------------------------------------------------------------
# Accuracy

def peak_probe(facts, threads, dtype):
    """(probe, flops): a callable running the FMA loop of the ``facts``'
    path for ``dtype`` on ``threads`` threads at once for about
    PROBE_SECONDS (calibrated from the facts' peak record), and the flops
    one call does (it is run once here)."""
    simd, dtype = facts["simd"], np.dtype(dtype).name
    record = fma_peak_record(simd, dtype, threads, facts["seconds"])
    iters = max(1, round(record["iters"] * PROBE_SECONDS
                         / record["call_s"]))
    flops = _core._fma_loop(dtype, simd, iters, threads)
    return (lambda: _core._fma_loop(dtype, simd, iters, threads)), flops


def measure_peak(funcs, target, min_repeats, facts, threads, dtype,
                 before=None):
    """:func:`measure` the ``funcs`` with the :func:`peak_probe` among
    them: (their timings, the probe's GF/s from its median call)."""
    probe, flops = peak_probe(facts, threads, dtype)
    timed = measure({**funcs, PROBE: probe}, target, min_repeats, before)
    seconds = timed.pop(PROBE)[0]
    return timed, flops / seconds / 1e9


def measure_into(row, funcs, target, min_repeats, peak=None, before=None):
    """:func:`measure` the ``funcs`` and record in ``row``: ``times_ms``
    and ``repeats`` by name, and ``others_load``, the share of the CPUs
    other processes used meanwhile.  ``peak`` (facts, dtype): the probe
    timed among them too (:func:`measure_peak`, at ``row["threads"]``),
    its GF/s as ``row["peak_gflops"]``; ``before``: as :func:`measure`'s."""
    cpu, start = cpu_seconds(), time.perf_counter()
    if peak is None:
        timed = measure(funcs, target, min_repeats, before)
    else:
        timed, row["peak_gflops"] = measure_peak(
            funcs, target, min_repeats, peak[0], row["threads"], peak[1],
            before)
    row["others_load"] = others_load(cpu, time.perf_counter() - start)
    row["times_ms"] = {k: s * 1e3 for k, (s, _) in timed.items()}
    row["repeats"] = {k: n for k, (_, n) in timed.items()}
    return row


def errors(result, exact):
    """{name: normwise relative error} of each array of ``result`` (a dict
    of arrays) that ``exact`` has too: ||x - r|| / ||r|| in float64
    (attention_c.testing.rel_err, the metric of the tests)."""
    return {name: rel_err(result[name], r) for name, r in exact.items()
            if name in result}


def worst(errs):
    """(largest error, its array's name) of an errors dict."""
    name = max(errs, key=errs.get)
    return errs[name], name


# --------------------------------------------------------------------------
# Peak memory

def _status_kib(field):
    """A field of /proc/self/status in KiB."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _maxrss_kib():
    """ru_maxrss in KiB (it is in bytes on macOS)."""
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform == "darwin" else rss


def peak_start():
    """Start watching the peak RSS: (method, RSS or peak so far in KiB).

    On Linux the peak (VmHWM) is reset to the current RSS, so what follows
    is measured from here.  Elsewhere ru_maxrss is used, which only sees
    peaks above the highest one so far.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")
        return "VmHWM", _status_kib("VmRSS")
    except OSError:
        return "ru_maxrss", _maxrss_kib()


def peak_now(method):
    """The peak RSS in KiB since peak_start, by its method."""
    return _status_kib("VmHWM") if method == "VmHWM" else _maxrss_kib()


# --------------------------------------------------------------------------
# Settings and metadata

def setup(options):
    """Optional modules, the run's settings and the report's metadata."""
    tpc = optional_import("threadpoolctl")
    torch = None if options.no_torch else optional_import("torch")
    notes = []
    if tpc is None:
        notes.append("threadpoolctl is not installed: the BLAS threads of "
                     "NumPy (S1, NumPy reference) are not controlled")
    if torch is None and not options.no_torch:
        notes.append("torch is not importable: no PyTorch comparison")
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(
            timespec="seconds"),
        "cpu": cpu_model(), "cpus": available_cpus(),
        "load_start": load_average(), "config": our_config(),
        "python": platform.python_version(), "numpy": np.__version__,
        "blas": blas_info(tpc), "torch": getattr(torch, "__version__", None),
        "shapes": options.shapes, "dtypes": options.dtypes,
        "threads": options.threads, "target_s": options.target,
        "min_repeats": options.min_repeats, "seed": options.seed,
        "compile": bool(torch and options.compile), "notes": notes,
    }
    ctx = {"tpc": tpc, "torch": torch, "compile": meta["compile"],
           "seed": options.seed, "target": options.target,
           "min_repeats": options.min_repeats}
    return ctx, meta


# --------------------------------------------------------------------------
# Reports of targets (the issue benchmarks: variants, transformers)

def per_threads(by_threads, fmt="{:.2f}"):
    """A table cell with a value per thread count: "0.42 / 0.40"."""
    return " / ".join(fmt.format(by_threads[n]) for n in sorted(by_threads))


def targets_line(targets, issue, with_case=True):
    """The page's line of how many targets pass and which missed; each
    target a dict with "target", "limit", "case" and "status"."""
    missed = [t for t in targets if t["status"] == "MISS"]
    text = (f"- **Targets of issue {issue}:** {len(targets) - len(missed)} "
            f"of {len(targets)} checks pass")
    if missed:
        text += "; missed: " + "; ".join(dict.fromkeys(
            f"{t['target']} ≤ {t['limit']}"
            + ("" if not with_case or t["case"] == t["target"]
               else f" ({t['case']})")
            for t in missed))
    return text + "."


def targets_count(targets):
    """The report's last line: "Targets: N PASS, M MISS"."""
    passed = sum(t["status"] == "PASS" for t in targets)
    return f"Targets: {passed} PASS, {len(targets) - passed} MISS"
