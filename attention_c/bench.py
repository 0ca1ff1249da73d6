"""Benchmark of attention_c against one NumPy matmul, NumPy and PyTorch.

``python -m attention_c.bench --help`` lists the options.  In one process,
for each shape, dtype and thread count, it measures median times of:

* ours: ``context_attention`` (fwd), the same keeping the activations
  (fwd_kp), ``context_attention_backward`` recomputing them (bwd) or given
  them (bwd_sv), and forward + backward both ways (f+b, f+b_sv);
* S1: the bare NumPy product ``(B*T, H) @ (H, A)``, the largest product of
  the layer, as a yardstick of what the machine's BLAS can do;
* the NumPy reference (``attention_c.reference``), forward and backward;
* when PyTorch is importable: eager PyTorch in its best form (W split into
  W_h and W_c, the context product once per sequence), in the seed's form
  (context repeated T times and concatenated with h, one Linear over 2H),
  and ``torch.compile`` of the best form.  Forward runs under no_grad;
  forward + backward is autograd of ``(out * G).sum()`` for h, W, v and b.

Ours, NumPy's BLAS (through threadpoolctl) and PyTorch all get the same
thread count.  Before timing, the results of every implementation, ours
included, are checked against the NumPy reference computed in float64.
The implementations are timed in interleaved rounds (see ``measure``), and
the share of the CPUs that other processes used meanwhile is reported.
Ratios are ours / theirs (< 1: ours faster) and are compared with the
project's performance targets (PASS / MISS).

PyTorch, matplotlib and threadpoolctl are optional and imported lazily.
"""

import argparse
import contextlib
import datetime
import gc
import importlib
import io
import json
import math
import os
import platform
import statistics
import sys
import time

import numpy as np

import attention_c as ac
from attention_c import reference as ref

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
ROUNDS = 3              # interleaved rounds per measurement
MAX_BLOCK = 5000        # most timed calls in a row

# Rows timed while other processes used more than this share of all CPUs
# are marked as disturbed.
DISTURBED = 0.1

# Accuracy required of every implementation: max|x - r| / max|r| for each
# of out, alpha and the gradients, r from the float64 NumPy reference.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}
RESULTS = ("out", "alpha", "dh", "dW", "dv", "db")

# Times: (key, header); a key's prefix names the implementation.
OURS_COLUMNS = (
    ("ours_fwd", "fwd"), ("ours_fwd_keep", "fwd_kp"),
    ("ours_bwd", "bwd"), ("ours_bwd_saved", "bwd_sv"),
    ("ours_fwdbwd", "f+b"), ("ours_fwdbwd_saved", "f+b_sv"),
    ("s1", "S1"),
)
OTHER_COLUMNS = (
    ("ref_fwd", "np_fwd"), ("ref_bwd", "np_bwd"),
    ("torch_fwd", "pt_fwd"), ("torch_fwdbwd", "pt_f+b"),
    ("seed_fwd", "seed_fwd"), ("seed_fwdbwd", "seed_f+b"),
    ("compile_fwd", "cmp_fwd"), ("compile_fwdbwd", "cmp_f+b"),
)
# Ratios: (name, numerator, denominator).
RATIOS = (
    ("fwd/S1", "ours_fwd", "s1"),
    ("bwd/S1", "ours_bwd", "s1"),
    ("bwd_sv/S1", "ours_bwd_saved", "s1"),
    ("fwd/pt", "ours_fwd", "torch_fwd"),
    ("f+b/pt", "ours_fwdbwd", "torch_fwdbwd"),
    ("fwd/seed", "ours_fwd", "seed_fwd"),
    ("f+b/seed", "ours_fwdbwd", "seed_fwdbwd"),
    ("fwd/cmp", "ours_fwd", "compile_fwd"),
    ("f+b/cmp", "ours_fwdbwd", "compile_fwdbwd"),
    ("fwd/np", "ours_fwd", "ref_fwd"),
    ("f+b/np", "ours_fwdbwd", "ref_fwdbwd"),
)
# Ours at N threads / ours at 1 thread: (name, key).
SCALING = (
    ("fwd N/1", "ours_fwd"),
    ("bwd N/1", "ours_bwd"),
    ("bwd_sv N/1", "ours_bwd_saved"),
    ("f+b N/1", "ours_fwdbwd"),
)


def _limits(default=None, **by_shape):
    """{shape: limit} from a default and per-shape exceptions."""
    return {s: by_shape.get(s, default) for s in SHAPES}


# Targets: (ratio, thread counts it applies to, {shape: limit or None},
# text).  "one": 1 thread; "every": all counts; "many": counts > 1.
_SCALING_LIMITS = _limits(tiny=1.05, small=1.05, large=0.6, long=0.6,
                          wide=0.6)
TARGETS = (
    ("fwd/S1", "one", _limits(1.15, tiny=1.3, small=1.3),
     "<= 1.15 (1.3 where H <= 64)"),
    ("bwd/S1", "one", _limits(3.3), "<= 3.3"),
    ("bwd_sv/S1", "one", _limits(2.3), "<= 2.3"),
    ("fwd/pt", "every", _limits(0.6, tiny=0.1), "<= 0.6 (0.1 on tiny)"),
    ("f+b/pt", "every", _limits(0.8, tiny=0.1), "<= 0.8 (0.1 on tiny)"),
    ("fwd/cmp", "every", _limits(1.0), "< 1"),
    ("f+b/cmp", "every", _limits(1.0), "< 1"),
    ("fwd N/1", "many", _SCALING_LIMITS, "<= 0.6 large+, 1.05 tiny/small"),
    ("bwd N/1", "many", _SCALING_LIMITS, "<= 0.6 large+, 1.05 tiny/small"),
    ("bwd_sv N/1", "many", _SCALING_LIMITS,
     "<= 0.6 large+, 1.05 tiny/small"),
)


# --------------------------------------------------------------------------
# Environment

def available_cpus():
    """Number of CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_model():
    """CPU model name from /proc/cpuinfo (else from platform)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


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

def measure(funcs, target, min_repeats):
    """Median seconds per call of each callable, and its number of samples.

    ROUNDS times, every callable runs in turn (order reversed every other
    round): one untimed call to warm up after the switch, then timed calls
    for about target / ROUNDS seconds, more if needed to reach
    ``min_repeats`` samples in all.  So changes in the machine's load hit
    every implementation alike.
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
                    start = clock()
                    fn()
                    times.append(clock() - start)
                    n += 1
    finally:
        gc.enable()
    return {key: (statistics.median(s), len(s)) for key, s in samples.items()}


# --------------------------------------------------------------------------
# The problem and the implementations

def make_problem(shape, dtype, seed=0):
    """Random inputs h, W, v, b, mask, G (gradient of out), X, Y (for S1).

    Drawn in float64 from a seed that depends on the shape, then cast, so
    both dtypes see the same numbers.  Each sequence has a random number
    of valid items between T/2 and T.
    """
    B, T, H, A = shape
    rng = np.random.default_rng([seed, B, T, H, A])
    scale = 1.0 / math.sqrt(2 * H)            # torch.nn.Linear(2H, A) init
    lengths = rng.integers(T // 2, T + 1, size=B)
    p = {
        "h": rng.standard_normal((B, T, H)),
        "W": rng.uniform(-scale, scale, (A, 2 * H)),
        "v": rng.uniform(-1, 1, A) / math.sqrt(A),
        "b": rng.uniform(-scale, scale, A),
        "G": rng.standard_normal((B, H)),
        "X": rng.standard_normal((B * T, H)),
        "Y": rng.standard_normal((H, A)),
    }
    p = {k: np.ascontiguousarray(x, dtype=dtype) for k, x in p.items()}
    p["mask"] = np.arange(T) < lengths[:, None]
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


def torch_forms(torch):
    """The eager PyTorch forms of the layer, ``(best, seed)``.

    Both map tensors (h, W, v, b, mask) to (out, alpha) with the SPEC's
    masking: masked items get exactly 0 weight, and a row with no valid
    item gives zeros (and zero gradients), not NaN.
    """
    linear = torch.nn.functional.linear

    def mean_context(h, mask):
        m = mask.to(h.dtype).unsqueeze(1)                  # (B, 1, T)
        n = m.sum(-1).clamp_min(1)                         # (B, 1)
        return torch.bmm(m, h).squeeze(1) / n              # (B, H)

    def softmax_and_sum(z, v, h, mask):
        s = (torch.tanh(z) @ v).masked_fill(~mask, -math.inf)
        # An all-masked row: softmax gives NaN, replaced by exact zeros.
        alpha = torch.softmax(s, -1).masked_fill(~mask, 0.0)
        return torch.bmm(alpha.unsqueeze(1), h).squeeze(1), alpha

    def best(h, W, v, b, mask):
        H = h.shape[-1]
        c = mean_context(h, mask)
        z = linear(h, W[:, :H], b) + linear(c, W[:, H:]).unsqueeze(1)
        return softmax_and_sum(z, v, h, mask)

    def seed(h, W, v, b, mask):
        c = mean_context(h, mask).unsqueeze(1).expand_as(h)
        return softmax_and_sum(linear(torch.cat([h, c], -1), W, b), v, h,
                               mask)

    return best, seed


def torch_tensors(torch, p):
    """The problem as tensors sharing its memory; h, W, v, b require grad."""
    t = {k: torch.from_numpy(p[k]) for k in ("h", "W", "v", "b", "G", "mask")}
    for k in ("h", "W", "v", "b"):
        t[k].requires_grad_(True)
    return t


def torch_functions(torch, layer, t, prefix):
    """Forward (no grad) and forward + backward (autograd) of ``layer``."""
    args = tuple(t[k] for k in ("h", "W", "v", "b", "mask"))
    params = args[:4]

    def forward():
        with torch.no_grad():
            return layer(*args)

    def forward_backward():
        out, _ = layer(*args)
        return torch.autograd.grad((out * t["G"]).sum(), params)

    return {f"{prefix}_fwd": forward, f"{prefix}_fwdbwd": forward_backward}


def compile_best(torch, best, t):
    """``torch.compile`` of the best form, compiled now so no compiling is
    timed.  Returns (compiled layer, its timing functions, seconds taken).

    Inductor specialises its C++ kernels on the thread count, so Dynamo's
    caches are reset first.
    """
    torch._dynamo.reset()
    start = time.perf_counter()
    layer = torch.compile(best, dynamic=False)
    funcs = torch_functions(torch, layer, t, "compile")
    for fn in funcs.values():
        fn()
    return layer, funcs, time.perf_counter() - start


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


def torch_result(torch, layer, t):
    """(out, alpha, dh, dW, dv, db) from a PyTorch form."""
    params = tuple(t[k] for k in ("h", "W", "v", "b"))
    out, alpha = layer(*params, t["mask"])
    grads = torch.autograd.grad((out * t["G"]).sum(), params)
    return tuple(x.detach().numpy() for x in (out, alpha, *grads))


def exact_result(p):
    """(out, alpha, dh, dW, dv, db) of the NumPy reference in float64 on
    the problem's data."""
    return ref_result({k: x.astype(np.float64) if x.dtype.kind == "f" else x
                       for k, x in p.items()})


def errors(result, exact):
    """{name: max|x - r| / max|r|} for each array of a result."""
    found = {}
    for name, x, r in zip(RESULTS, result, exact):
        scale = np.max(np.abs(r)) or 1.0
        found[name] = float(np.max(np.abs(np.asarray(x, np.float64) - r))
                            / scale)
    return found


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
    """Record the errors of ``result``; warn beyond the tolerance."""
    row["errors"][name] = errors(result, exact)
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
    before, start = cpu_seconds(), time.perf_counter()
    results = measure(funcs, ctx["target"], ctx["min_repeats"])
    row["others_load"] = others_load(before, time.perf_counter() - start)
    row["times_ms"] = {k: s * 1e3 for k, (s, _) in results.items()}
    row["repeats"] = {k: n for k, (_, n) in results.items()}
    row["times_ms"]["ref_fwdbwd"] = (row["times_ms"]["ref_fwd"]
                                     + row["times_ms"]["ref_bwd"])
    return row


def add_ratios(rows):
    """Add the ratios (ours / theirs, N threads / 1 thread) to every row."""
    single = {(r["shape"], r["dtype"]): r["times_ms"] for r in rows
              if r["threads"] == 1}
    for row in rows:
        times = row["times_ms"]
        row["ratios"] = {name: times[num] / times[den]
                         for name, num, den in RATIOS
                         if num in times and den in times}
        base = single.get((row["shape"], row["dtype"]))
        if row["threads"] > 1 and base:
            row["ratios"].update((name, times[key] / base[key])
                                 for name, key in SCALING)


def evaluate_targets(rows):
    """One entry per (target, row) it applies to, with PASS or MISS (n/a
    where torch.compile failed; left out where a comparison was not run).

    ``disturbed`` tells whether other processes were busy while the row
    (or, for N/1, its 1-thread row) was timed.
    """
    applies = {"one": lambda n: n == 1, "every": lambda n: True,
               "many": lambda n: n > 1}
    load = {(r["shape"], r["dtype"], r["threads"]): r["others_load"] or 0.0
            for r in rows}
    results = []
    for ratio, which, limits, _ in TARGETS:
        for row in rows:
            limit = limits[row["shape"]]
            value = row["ratios"].get(ratio)
            if limit is None or not applies[which](row["threads"]) or (
                    value is None and "compile_error" not in row):
                continue
            passed = None if value is None else value <= limit
            shape, dtype, n = row["shape"], row["dtype"], row["threads"]
            busy = max(load[shape, dtype, n], load.get((shape, dtype, 1), 0))
            results.append({"target": ratio, "shape": shape, "dtype": dtype,
                            "threads": n, "ratio": value, "limit": limit,
                            "status": {True: "PASS", False: "MISS",
                                       None: "n/a"}[passed],
                            "disturbed": busy > DISTURBED})
    return results


def run_all(options, ctx):
    """Every configuration, shapes outermost; returns the rows."""
    rows = []
    for name in options.shapes:
        for dtype in options.dtypes:
            for threads in options.threads:
                start = time.perf_counter()
                with thread_count(threads, ctx["tpc"], ctx["torch"]):
                    rows.append(run_config(name, dtype, threads, ctx))
                print(f"  {name:<7} {dtype:<8} {threads} thr "
                      f"{time.perf_counter() - start:6.1f} s",
                      file=sys.stderr)
    add_ratios(rows)
    return rows


# --------------------------------------------------------------------------
# Report

def format_ms(value):
    """A time in ms to about 3 significant digits, or '-'."""
    if value is None:
        return "-"
    if value < 0.1:
        return f"{value:.4f}"
    if value < 10:
        return f"{value:.3f}"
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def format_load(value):
    """A load average, or '?'."""
    return "?" if value is None else f"{value:.2f}"


def format_ratio(value):
    """A ratio to 2 decimals, or '-'."""
    return "-" if value is None else f"{value:.2f}"


def format_table(head, body, left=1):
    """Plain text table; the first ``left`` columns are left-aligned."""
    widths = [max(len(line[i]) for line in [head] + body)
              for i in range(len(head))]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [line(head), "-" * len(line(head))] + [line(b) for b in body]
    return "\n".join(s.rstrip() for s in lines)


def row_table(rows, columns, cell, load=False):
    """Table with one line per row: shape, dtype, threads, the columns and
    (if ``load``) the CPU share of other processes during the timing."""
    head = ["shape", "dtype", "thr"] + [h for _, h in columns]
    body = [[r["shape"], r["dtype"], str(r["threads"])]
            + [cell(r, k) for k, _ in columns] for r in rows]
    if load:
        head.append("others")
        for line, r in zip(body, rows):
            share = r["others_load"]
            line.append("?" if share is None else f"{share:.0%}")
    return format_table(head, body, left=2)


def targets_table(targets, shapes):
    """One line per (target, dtype, threads), one cell per shape."""
    if not targets:
        return "(no target applies to these runs)"
    lines = {}
    for t in targets:
        key = (t["target"], t["dtype"], t["threads"])
        cell = "n/a" if t["ratio"] is None else (
            f"{t['ratio']:.2f} {t['status']}" + "*" * t["disturbed"])
        lines.setdefault(key, {})[t["shape"]] = cell
    text = {ratio: text for ratio, _, _, text in TARGETS}
    head = ["target", "limit", "dtype", "thr"] + list(shapes)
    body = [[ratio, text[ratio], dtype, str(n)]
            + [cells.get(s, "") for s in shapes]
            for (ratio, dtype, n), cells in lines.items()]
    return format_table(head, body, left=3)


def header_lines(meta):
    """The report's header: machine, versions, method."""
    cfg = meta["config"]
    return [
        f"attention_c benchmark, {meta['date']}",
        f"CPU: {meta['cpu']}, {meta['cpus']} CPUs available, load average "
        f"{format_load(meta['load_start'])} at start",
        f"attention_c {cfg['version']} ({cfg['compiler']}), SIMD path "
        f"{cfg['simd']} (best on this CPU: {cfg['simd_best']}), default "
        f"threads {cfg['num_threads']}",
        f"Python {meta['python']}, numpy {meta['numpy']}, BLAS "
        f"{meta['blas']}, torch {meta['torch'] or 'not available'}",
        f"Timing: median of >= {meta['min_repeats']} runs (~"
        f"{meta['target_s']:g} s each) in {ROUNDS} interleaved rounds, "
        f"after warm-up; threads measured: "
        f"{', '.join(map(str, meta['threads']))}",
    ] + [f"NOTE: {note}" for note in meta["notes"]]


def accuracy_lines(rows):
    """Worst error of each implementation per dtype, and the failures."""
    names = list(dict.fromkeys(n for r in rows for n in r["errors"]))
    worst = {}
    for r in rows:
        for name, found in r["errors"].items():
            key = (r["dtype"], name)
            worst[key] = max(worst.get(key, 0.0), *found.values())
    head = ["dtype"] + names + ["tolerance"]
    body = [[dtype] + [f"{worst[dtype, n]:.1e}" if (dtype, n) in worst
                       else "-" for n in names] + [f"{TOLERANCE[dtype]:g}"]
            for dtype in dict.fromkeys(r["dtype"] for r in rows)]
    bad = [f"{name} on {row_label(r)}: " + ", ".join(
        f"{k} {e:.2g}" for k, e in too_far(r, name).items())
        for r in rows for name in r["errors"] if too_far(r, name)]
    return [
        "Accuracy before timing: worst over shapes, threads and out, alpha, "
        "dh, dW, dv, db of",
        "max|x - r| / max|r|, r = the NumPy reference in float64 on the "
        "same data (ref: the reference in float32).",
        format_table(head, body),
        "Beyond the tolerance: " + ("; ".join(bad) if bad else "none"),
    ]


def report(meta, rows, targets):
    """The whole text report."""
    def time_cell(row, key):
        return format_ms(row["times_ms"].get(key))

    def ratio_cell(row, key):
        return format_ratio(row["ratios"].get(key))

    ratios = [(n, n) for n, _, _ in RATIOS] + [(n, n) for n, _ in SCALING]
    counts = {s: sum(t["status"] == s for t in targets)
              for s in ("PASS", "MISS", "n/a")}
    compile_errors = sorted({f"{row_label(r)}: {r['compile_error']}"
                             for r in rows if "compile_error" in r})
    parts = header_lines(meta) + [
        "",
        "Ours, median ms.  fwd_kp: forward keeping the activations; bwd: "
        "recomputes them; bwd_sv: given them;",
        "f+b = fwd then bwd; f+b_sv = fwd_kp then bwd_sv.  S1: NumPy "
        "(B*T, H) @ (H, A).  others: share of all",
        "CPUs used by other processes while this row was timed (more than "
        "a few % disturbs its times).",
        row_table(rows, OURS_COLUMNS, time_cell, load=True),
        "",
        "Others, median ms.  np: NumPy reference; pt: torch eager best "
        "form; seed: torch seed form (concatenation);",
        "cmp: torch.compile of the best form ('-': not run).  Torch "
        "forward runs under no_grad.",
        row_table(rows, OTHER_COLUMNS, time_cell),
        "",
        "Ratios ours / other (< 1: ours faster); f+b/np uses np_fwd + "
        "np_bwd.  N/1: ours at N threads / 1 thread.",
        row_table(rows, ratios, ratio_cell),
        "",
        "Targets (S1 ratios at 1 thread; torch ratios at every thread "
        "count; N/1 where a limit is set):",
        targets_table(targets, meta["shapes"]),
        f"*: other processes used more than {DISTURBED:.0%} of the CPUs "
        f"while timing.  Targets: {counts['PASS']} PASS, {counts['MISS']} "
        f"MISS, {counts['n/a']} n/a.",
        "",
    ] + accuracy_lines(rows)
    if compile_errors:
        parts += ["torch.compile failed (n/a):"] + compile_errors
    return "\n".join(parts)


def write_json(path, meta, rows, targets):
    """Everything measured, as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "results": rows, "targets": targets}, f,
                  indent=1)
        f.write("\n")


PLOT_SERIES = (   # (label, time key pattern, colour)
    ("attention_c (ours)", "ours_{}", "#d62728"),
    ("S1: one NumPy matmul", "s1", "#bcbd22"),
    ("torch eager, best form", "torch_{}", "#1f77b4"),
    ("torch eager, seed form", "seed_{}", "#17becf"),
    ("torch.compile, best form", "compile_{}", "#2ca02c"),
    ("NumPy reference", "ref_{}", "#7f7f7f"),
)


def make_plot(path, rows, meta):
    """PNG: a panel per (metric, threads) and dtype; log-scale bars of the
    median times per shape, one bar per implementation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes, dtypes = meta["shapes"], meta["dtypes"]
    panels = [(m, n) for n in meta["threads"] for m in ("fwd", "fwdbwd")]
    index = {(r["shape"], r["dtype"], r["threads"]): r["times_ms"]
             for r in rows}
    fig, axes = plt.subplots(len(panels), len(dtypes), squeeze=False,
                             figsize=(1.6 * len(shapes) * len(dtypes) + 2,
                                      3.2 * len(panels) + 1))
    measured = {key for r in rows for key in r["times_ms"]}
    series = [s for s in PLOT_SERIES
              if s[1].format("fwd") in measured]
    width = 0.8 / len(series)
    x = np.arange(len(shapes))
    for (metric, n), ax_row in zip(panels, axes):
        for dtype, ax in zip(dtypes, ax_row):
            for k, (label, key, colour) in enumerate(series):
                key = key.format(metric)
                ys = [index.get((s, dtype, n), {}).get(key, np.nan)
                      for s in shapes]
                ax.bar(x + (k - (len(series) - 1) / 2) * width, ys, width,
                       label=label, color=colour)
            ax.set_yscale("log")
            ax.set_xticks(x, [f"{s}\n" + "x".join(map(str, SHAPES[s]))
                              for s in shapes], fontsize=8)
            what = "forward" if metric == "fwd" else "forward + backward"
            ax.set_title(f"{dtype}, {what}, {n} thread{'s' * (n > 1)}",
                         fontsize=10)
            ax.set_ylabel("median time (ms)", fontsize=8)
            ax.grid(axis="y", which="major", alpha=0.4)
            ax.set_axisbelow(True)
    height = fig.get_figheight()
    fig.suptitle(f"attention_c {meta['config']['version']} "
                 f"({meta['config']['simd']}) on {meta['cpu']}; shapes "
                 f"B x T x H x A; log scale, lower is better",
                 fontsize=10, y=1 - 0.1 / height, va="top")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=9,
               frameon=False, bbox_to_anchor=(0.5, 1 - 0.4 / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - 1.0 / height))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------
# Command line

def parse_args(argv):
    """The options, with shapes, dtypes and threads expanded to lists."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c.bench",
        description="Benchmark attention_c against one NumPy matmul (S1), "
                    "the NumPy reference and PyTorch.")
    parser.add_argument("--quick", action="store_true",
                        help="shapes tiny, small, medium; shorter "
                             "measurements; no torch.compile (< 1 min)")
    parser.add_argument("--shapes", help="comma-separated, from: " + ", ".join(
        f"{k} {v}" for k, v in SHAPES.items()))
    parser.add_argument("--dtypes", help="comma-separated, from: "
                        + ", ".join(DTYPES))
    parser.add_argument("--threads", default="1,all",
                        help="comma-separated thread counts; 'all' = the "
                             "available CPUs (default: 1,all)")
    parser.add_argument("--target", type=float,
                        help="seconds per measurement (default 0.3, 0.05 "
                             "with --quick)")
    parser.add_argument("--min-repeats", type=int,
                        help="least timed runs per measurement (default 6, "
                             "3 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torch", action="store_true",
                        help="leave PyTorch out even if it is installed")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="time torch.compile (default: yes, except "
                             "with --quick)")
    parser.add_argument("--json", metavar="FILE", help="write all results")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG plot")
    parser.add_argument("--family", action="store_true",
                        help="benchmark the attention family instead "
                             "(attention_c.bench_family; takes its options)")
    options = parser.parse_args(argv)

    def choose(text, allowed, default, what):
        items = [s.strip() for s in text.split(",")] if text else default
        wrong = [s for s in items if s not in allowed]
        if wrong or not items:
            parser.error(f"unknown {what} {wrong}; choose from "
                         f"{', '.join(allowed)}")
        return list(dict.fromkeys(items))

    options.shapes = choose(options.shapes, SHAPES,
                            QUICK_SHAPES if options.quick else SHAPES,
                            "shape")
    options.dtypes = choose(options.dtypes, DTYPES, DTYPES, "dtype")
    threads = set()
    for item in options.threads.split(","):
        item = item.strip().lower()
        if item == "all":
            threads.add(available_cpus())
        elif item.isdigit() and int(item) > 0:
            threads.add(int(item))
        else:
            parser.error(f"bad thread count {item!r}")
    options.threads = sorted(threads)
    if options.target is None:
        options.target = 0.05 if options.quick else 0.3
    if options.min_repeats is None:
        options.min_repeats = 3 if options.quick else 6
    if options.compile is None:
        options.compile = not options.quick
    if options.min_repeats < 1:
        parser.error("--min-repeats must be at least 1")
    return options


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


def main(argv=None):
    """Entry point of ``python -m attention_c.bench``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--family" in argv:
        from attention_c import bench_family
        return bench_family.main([a for a in argv if a != "--family"])
    options = parse_args(argv)
    start = time.perf_counter()
    ctx, meta = setup(options)
    for note in meta["notes"]:
        print(f"NOTE: {note}", file=sys.stderr)
    rows = run_all(options, ctx)
    targets = evaluate_targets(rows)
    meta["wall_seconds"] = time.perf_counter() - start
    meta["load_end"] = load_average()
    print(report(meta, rows, targets))
    print(f"\nTotal {meta['wall_seconds']:.0f} s; load average at end "
          f"{format_load(meta['load_end'])}")
    if options.json:
        write_json(options.json, meta, rows, targets)
        print(f"wrote {options.json}")
    if options.plot:
        try:
            make_plot(options.plot, rows, meta)
        except ImportError as exc:
            print(f"cannot plot ({exc}); pip install matplotlib",
                  file=sys.stderr)
            return 1
        print(f"wrote {options.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
