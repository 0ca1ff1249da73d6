"""Today's variants (issue 25, "Measured"): sliding windows, packed
sequences, softcap, ALiBi slopes, sinks and a ``finfo.min`` bias.

``python -m attention_c.bench --variants`` (or ``python -m
attention_c.bench.variants``) runs it; ``--help`` lists the options,
``--quick`` runs tiny sizes in a few seconds.  PyTorch is required (it is
the baseline of the last comparisons).

Float32, d = 64, (B, heads) = (1, 8), at every thread count asked for
(default 1 and 2; ours through ``attention_c.set_num_threads``, PyTorch
through ``torch.set_num_threads``).  Every time is of a forward
(``dot_attention(..., return_weights=False)``) plus its backward
(``dot_attention_backward`` from ``out`` and ``lse``), and every figure is
a ratio of medians of ``harness.measure`` (interleaved rounds after
warm-up) whose two sides were timed together, in the same call:

* ``window``: window (256, 0) / the causal call, T = 8192 (theory
  256 / 4096 of the causal work);
* ``packed``: 8 causal sequences of 1024 through ``cu_seqlens_q/k`` / one
  causal sequence of 8192 (theory 1/8);
* ``softcap``, ``alibi_slopes``, ``sinks``: each / the same full call
  without it, T = 2048; ``alibi_slopes`` / the same ALiBi given as a
  (1, heads, T, T) bias array;
* ``finfo.min``: a bias whose last quarter of keys holds
  ``finfo(float32).min`` / the same bias with ``-inf`` there;
* against PyTorch's best form for each variant at T = 4096: SDPA with the
  equivalent dense mask or bias (window and packed as a bool mask, ALiBi
  as a float bias built before timing), and for softcap and sinks eager
  PyTorch as transformers writes it (Gemma 2, gpt-oss); time ratio, and
  the peak memory of one forward + backward, each side in a fresh process;
* bitwise identity of out, lse and every gradient at 1, 2 and 3 threads
  with every variant in one call (checked, not timed).

Accuracy, before timing: every function timed (ours and PyTorch's, in
float32) is run on the same case at a small size (T = 256, the window and
the packed sequences scaled with it) and compared with
``attention_c.reference`` in float64 (out and every gradient, normwise).
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np

import attention_c as ac
from attention_c import reference as ref
from attention_c.bench import harness
from attention_c.bench.docs_page import markdown_table, write_page
from attention_c.bench.report import format_load, peak_lines

_cell = harness.per_threads          # a value per thread count

HEADS = 8
SIZES = {"d": 64, "window_T": 8192, "window": 256, "packed": (8, 1024),
         "extras_T": 2048, "torch_T": 4096, "threads_T": 1024,
         "check_T": 256}
QUICK_SIZES = {"d": 16, "window_T": 512, "window": 32, "packed": (4, 128),
               "extras_T": 128, "torch_T": 256, "threads_T": 96,
               "check_T": 64}
SOFTCAP = 50.0           # Gemma 2's attention softcap
BITWISE_THREADS = (1, 2, 3)
TOLERANCE = 1e-4         # float32 against float64, normwise
MiB = 2.0 ** 20

# The ratios of ours: (name, numerator, denominator, group, target,
# theory or None).  A group's functions are timed together.
RATIOS = (
    ("window/causal", "window", "causal", "long", 0.1, "window"),
    ("packed/causal", "packed", "causal", "long", 0.18, "packed"),
    ("softcap/full", "softcap", "full", "extras", 1.15, None),
    ("alibi_slopes/full", "alibi_slopes", "full", "extras", 1.15, None),
    ("sinks/full", "sinks", "full", "extras", 1.15, None),
    ("alibi_slopes/alibi bias", "alibi_slopes", "alibi_bias", "extras", 0.8,
     None),
    ("finfo.min/-inf", "min_bias", "inf_bias", "extras", 1.1, None),
)
GROUPS = {"long": ("causal", "window", "packed"),
          "extras": ("full", "softcap", "alibi_slopes", "sinks",
                     "alibi_bias", "min_bias", "inf_bias")}
# The variants against PyTorch, with PyTorch's form.
TORCH_VARIANTS = {
    "window": "SDPA, bool (T, T) band mask",
    "packed": "SDPA, bool (T, T) block-diagonal causal mask",
    "alibi_slopes": "SDPA, float (1, heads, T, T) ALiBi bias",
    "softcap": "eager: scores, c tanh(s / c), softmax, matmul",
    "sinks": "eager: scores, sink column concatenated, softmax, dropped, "
             "matmul",
}
TORCH_TIME, TORCH_MEMORY = 0.5, 0.25


# --------------------------------------------------------------------------
# The problem and our calls

def alibi_slopes(heads):
    """ALiBi's geometric slopes 2^(-8 h / heads), h = 1..heads, (1,
    heads)."""
    return np.array([[2.0 ** (-8.0 * h / heads)
                      for h in range(1, heads + 1)]], dtype=np.float32)


def make_problem(T, d, seed=0):
    """q, k, v, g (1, HEADS, T, d), float32 standard normal, the slopes
    and the sinks (1, HEADS)."""
    rng = np.random.default_rng([seed, T, d])
    p = {name: rng.standard_normal((1, HEADS, T, d), dtype=np.float32)
         for name in ("q", "k", "v", "g")}
    p["slopes"] = alibi_slopes(HEADS)
    p["sinks"] = rng.standard_normal((1, HEADS), dtype=np.float32)
    p["bias"] = rng.standard_normal((1, 1, T, T), dtype=np.float32)
    return p


def cu_seqlens(n, T):
    """Offsets of n sequences of T / n, int32."""
    return np.arange(0, T + 1, T // n, dtype=np.int32)


def alibi_bias(slopes, T):
    """-slope |i - t| as a (1, heads, T, T) float32 array."""
    dist = np.abs(np.arange(T)[:, None] - np.arange(T)[None, :])
    return (-slopes[..., None, None] * dist).astype(np.float32)


def padded_bias(bias, fill):
    """``bias`` with its last quarter of keys set to ``fill`` (T5's
    padding mask added to a bias)."""
    out = bias.copy()
    out[..., 3 * out.shape[-1] // 4:] = fill
    return out


def case_kwargs(case, p, window, packed_n):
    """The keyword arguments of ours for ``case`` on problem ``p``."""
    T, d = p["q"].shape[-2:]
    kw = {"scale": 1 / math.sqrt(d)}
    if case in ("causal", "window", "packed"):
        kw["causal"] = True
    if case == "window":
        kw["window"] = (window, 0)
    if case == "packed":
        kw["cu_seqlens_q"] = kw["cu_seqlens_k"] = cu_seqlens(packed_n, T)
    if case == "softcap":
        kw["softcap"] = SOFTCAP
    if case == "alibi_slopes":
        kw["alibi_slopes"] = p["slopes"]
    if case == "sinks":
        kw["sinks"] = p["sinks"]
    if case == "alibi_bias":
        kw["bias"] = alibi_bias(p["slopes"], T)
    if case in ("min_bias", "inf_bias"):
        fill = np.finfo(np.float32).min if case == "min_bias" else -np.inf
        kw["bias"] = padded_bias(p["bias"], fill)
    if case == "all":
        kw.update(causal=True, window=(window, 0), softcap=SOFTCAP,
                  alibi_slopes=p["slopes"], sinks=p["sinks"],
                  cu_seqlens_q=cu_seqlens(packed_n, T),
                  cu_seqlens_k=cu_seqlens(packed_n, T))
    return kw


def ours_fwdbwd(module, p, kw):
    """Forward + backward of ``module`` (attention_c or its reference) on
    the problem (of its dtype): a function returning {out, lse, dq, ...}."""
    q, k, v, g = p["q"], p["k"], p["v"], p["g"]

    def run():
        o, lse = module.dot_attention(q, k, values=v, return_weights=False,
                                      **kw)
        grads = module.dot_attention_backward(g, q, k, out=o, lse=lse,
                                              values=v, **kw)
        found = {"out": o, "lse": lse}
        for name, x in zip(("dq", "dk", "dv", "dbias", "dslopes",
                            "dsinks"), grads):
            if x is not None:
                found[name] = x
        return found

    return run


def as64(p):
    return {n: x.astype(np.float64) for n, x in p.items()}


# --------------------------------------------------------------------------
# PyTorch's forms

def torch_tensors(torch, p, variant, window, packed_n, dtype=None):
    """q, k, v (requiring grad), g and the variant's mask, bias or sinks as
    tensors (sharing the problem's memory in float32)."""
    def tensor(x):
        t = torch.from_numpy(x)
        return t if dtype is None else t.to(dtype)

    t = {n: tensor(p[n]) for n in ("q", "k", "v", "g")}
    T = p["q"].shape[-2]
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    t["mask"] = None
    if variant == "window":
        t["mask"] = (j <= i) & (j >= i - window)
    elif variant == "packed":
        n = T // packed_n
        t["mask"] = (j <= i) & (i // n == j // n)
    elif variant == "alibi_slopes":
        t["mask"] = tensor(alibi_bias(p["slopes"], T))
    t["sinks"] = tensor(p["sinks"]) if variant == "sinks" else None
    for n in ("q", "k", "v", "sinks"):
        if t[n] is not None:
            t[n].requires_grad_(True)
    return t


def torch_forward(torch, t, variant):
    """PyTorch's output for the variant (a function of no argument)."""
    F = torch.nn.functional
    q, k, v = t["q"], t["k"], t["v"]
    scale = 1 / math.sqrt(q.shape[-1])
    if variant in ("window", "packed", "alibi_slopes"):
        return lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=t["mask"], scale=scale)
    if variant == "softcap":
        def softcap():
            # transformers' eager_attention_forward of Gemma 2
            s = torch.matmul(q, k.transpose(2, 3)) * scale
            s = torch.tanh(s / SOFTCAP) * SOFTCAP
            w = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(w, v)
        return softcap

    def sinks():
        # transformers' eager_attention_forward of gpt-oss
        s = torch.matmul(q, k.transpose(2, 3)) * scale
        b, h, tq, _ = s.shape
        sink = t["sinks"].reshape(1, -1, 1, 1).expand(b, h, tq, 1)
        combined = torch.cat([s, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
        return torch.matmul(probs[..., :-1], v)
    return sinks


def torch_fwdbwd(torch, t, variant):
    """Forward + backward (autograd.grad of the output given g for q, k,
    v and the sinks): a function returning {out, dq, dk, dv[, dsinks]}."""
    forward = torch_forward(torch, t, variant)
    names = [n for n in ("q", "k", "v", "sinks") if t[n] is not None]

    def run():
        out = forward()
        grads = torch.autograd.grad(out, [t[n] for n in names], t["g"])
        found = {"out": out}
        found.update({"d" + n: x for n, x in zip(names, grads)})
        return found

    return run


def numpy_result(found):
    """{name: float64 array} of a result of ours or of PyTorch."""
    return {n: np.asarray(x.detach().numpy() if hasattr(x, "detach")
                          else x, dtype=np.float64)
            for n, x in found.items()}


# --------------------------------------------------------------------------
# Accuracy

def check_sizes(sizes):
    """T, window and packed count of the accuracy checks."""
    T = sizes["check_T"]
    return T, T // 8, 4


def check_all(ctx):
    """{name: {array: error}} of every function timed, on the small
    problem, against the reference in float64; warns on stderr."""
    torch, sizes = ctx["torch"], ctx["sizes"]
    T, window, packed_n = check_sizes(sizes)
    p = make_problem(T, sizes["d"], ctx["seed"])
    p64 = as64(p)
    found = {}
    for case in GROUPS["long"] + GROUPS["extras"]:
        exact = ours_fwdbwd(ref, p64, case_kwargs(case, p64, window,
                                                  packed_n))()
        ours = ours_fwdbwd(ac, p, case_kwargs(case, p, window, packed_n))()
        found["ours " + case] = harness.errors(numpy_result(ours), exact)
    for variant in TORCH_VARIANTS:
        exact = ours_fwdbwd(ref, p64, case_kwargs(variant, p64, window,
                                                  packed_n))()
        t = torch_tensors(torch, p, variant, window, packed_n)
        theirs = numpy_result(torch_fwdbwd(torch, t, variant)())
        found["torch " + variant] = harness.errors(theirs, exact)
    for name, errs in found.items():
        bad = {k: e for k, e in errs.items() if not e <= TOLERANCE}
        if bad:
            print(f"WARNING: {name} is inaccurate: {bad}", file=sys.stderr)
    return found


def bitwise(ctx):
    """Every variant in one call at 1, 2 and 3 threads: are out, lse and
    every gradient bitwise identical?"""
    sizes = ctx["sizes"]
    T = sizes["threads_T"]
    p = make_problem(T, sizes["d"], ctx["seed"])
    kw = case_kwargs("all", p, sizes["window"] // 4, 4)
    results = {}
    for n in BITWISE_THREADS:
        with harness.thread_count(n, ctx["tpc"], None):
            results[n] = ours_fwdbwd(ac, p, kw)()
    first = results[BITWISE_THREADS[0]]
    same = {n: all(np.array_equal(first[a], r[a], equal_nan=True)
                   for a in first)
            for n, r in results.items()}
    found = {"T": T, "threads": list(BITWISE_THREADS),
             "arrays": sorted(first), "identical": all(same.values()),
             "kwargs": sorted(kw)}
    print(f"  bitwise {BITWISE_THREADS} thr: "
          f"{'identical' if found['identical'] else 'DIFFER'}",
          file=sys.stderr)
    return found


# --------------------------------------------------------------------------
# Timing

def group_T(group, sizes):
    return sizes["window_T"] if group == "long" else sizes["extras_T"]


def run_group(group, threads, ctx):
    """Time the group's functions of ours together at one thread count."""
    sizes = ctx["sizes"]
    T = group_T(group, sizes)
    p = make_problem(T, sizes["d"], ctx["seed"])
    funcs = {case: ours_fwdbwd(ac, p, case_kwargs(
        case, p, sizes["window"], sizes["packed"][0]))
        for case in GROUPS[group]}
    row = {"group": group, "T": T, "threads": threads,
           "lead": [1, HEADS], "d": sizes["d"]}
    before, start = harness.cpu_seconds(), time.perf_counter()
    with harness.thread_count(threads, ctx["tpc"], None):
        timed = harness.measure(funcs, ctx["target"], ctx["min_repeats"])
    row["others_load"] = harness.others_load(before,
                                             time.perf_counter() - start)
    row["times_ms"] = {k: s * 1e3 for k, (s, _) in timed.items()}
    row["repeats"] = {k: n for k, (_, n) in timed.items()}
    print(f"  {group:<7} T={T:<6} {threads} thr "
          f"{time.perf_counter() - start:6.1f} s", file=sys.stderr)
    return row


def theory(kind, sizes):
    """The share of the causal work the window or the packing leaves."""
    if kind == "window":
        return sizes["window"] / (sizes["window_T"] / 2)
    return 1 / sizes["packed"][0]


def ratios(rows, sizes):
    """One entry per ratio and thread count, from the group rows."""
    index = {(r["group"], r["threads"]): r for r in rows}
    found = []
    for name, num, den, group, limit, kind in RATIOS:
        for (g, threads), row in index.items():
            if g != group:
                continue
            t = row["times_ms"]
            found.append({
                "ratio": name, "threads": threads, "T": row["T"],
                "value": t[num] / t[den], "target": limit,
                "theory": theory(kind, sizes) if kind else None,
                "others_load": row["others_load"]})
    return found


def run_torch(variant, threads, ctx):
    """Ours and PyTorch's form of the variant, timed together."""
    torch, sizes = ctx["torch"], ctx["sizes"]
    T = sizes["torch_T"]
    p = make_problem(T, sizes["d"], ctx["seed"])
    window, packed_n = sizes["window"], sizes["packed"][0]
    funcs = {"ours": ours_fwdbwd(ac, p, case_kwargs(variant, p, window,
                                                    packed_n)),
             "torch": torch_fwdbwd(torch, torch_tensors(
                 torch, p, variant, window, packed_n), variant)}
    before, start = harness.cpu_seconds(), time.perf_counter()
    with harness.thread_count(threads, ctx["tpc"], torch):
        timed = harness.measure(funcs, ctx["target"], ctx["min_repeats"])
    row = {"variant": variant, "T": T, "threads": threads,
           "form": TORCH_VARIANTS[variant],
           "others_load": harness.others_load(
               before, time.perf_counter() - start),
           "times_ms": {k: s * 1e3 for k, (s, _) in timed.items()}}
    row["ratio"] = row["times_ms"]["ours"] / row["times_ms"]["torch"]
    print(f"  torch   {variant:<12} T={T:<6} {threads} thr "
          f"{time.perf_counter() - start:6.1f} s", file=sys.stderr)
    return row


# --------------------------------------------------------------------------
# Peak memory, each side in a fresh process

def memory_child(which, variant, sizes_name, threads, seed):
    """Print, as JSON, the growth of the peak RSS during one forward +
    backward of the variant by ``which`` ('ours' or 'torch'), after a
    warm-up call on a tiny problem."""
    sizes = QUICK_SIZES if sizes_name == "quick" else SIZES
    torch = harness.optional_import("torch") if which == "torch" else None
    tpc = harness.optional_import("threadpoolctl")
    window, packed_n = sizes["window"], sizes["packed"][0]
    with harness.thread_count(threads, tpc, torch):
        for T in (64, sizes["torch_T"]):
            p = make_problem(T, sizes["d"], seed)
            w = window if T > 64 else 8
            if which == "ours":
                fwdbwd = ours_fwdbwd(ac, p, case_kwargs(variant, p, w,
                                                        packed_n))
            else:
                fwdbwd = torch_fwdbwd(torch, torch_tensors(
                    torch, p, variant, w, packed_n), variant)
            if T == 64:
                fwdbwd()
                del p, fwdbwd
        import gc
        gc.collect()
        method, before = harness.peak_start()
        kept = fwdbwd()
        peak = harness.peak_now(method)
    del kept
    inputs = sum(p[n].nbytes for n in ("q", "k", "v", "g"))
    harness.print_memory(which, method, before, peak, inputs / MiB)
    return 0


def measure_memory(variant, threads, ctx):
    """{'ours_mib', 'torch_mib', 'ratio', ...} of the variant."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    found = {"variant": variant, "T": ctx["sizes"]["torch_T"],
             "threads": threads}
    found.update(harness.memory_children(
        "attention_c.bench.variants", ("ours", "torch"),
        ["--memory-variant", variant, "--memory-sizes",
         "quick" if ctx["quick"] else "full", "--threads", str(threads),
         "--seed", str(ctx["seed"])], env, 900))
    found["ratio"] = found["ours_mib"] / found["torch_mib"]
    print(f"  memory  {variant:<12} {threads} thr", file=sys.stderr)
    return found


# --------------------------------------------------------------------------
# Targets

def evaluate(found, torch_rows, memory):
    """PASS / MISS of every target of issue 25."""
    verdicts = []

    def add(target, case, threads, value, limit, load):
        verdicts.append({
            "target": target, "case": case, "threads": threads,
            "value": value, "limit": limit,
            "status": "PASS" if value <= limit else "MISS",
            "disturbed": load is not None and load > harness.DISTURBED})

    for r in found:
        add(r["ratio"], r["ratio"], r["threads"], r["value"], r["target"],
            r["others_load"])
    for r in torch_rows:
        add("time ours/torch", r["variant"], r["threads"], r["ratio"],
            TORCH_TIME, r["others_load"])
    for m in memory:
        add("memory ours/torch", m["variant"], m["threads"], m["ratio"],
            TORCH_MEMORY, None)
    return verdicts


# --------------------------------------------------------------------------
# Report and page

def _pairs(rows, key, value):
    """{key: {threads: value}} of rows."""
    out = {}
    for r in rows:
        out.setdefault(r[key], {})[r["threads"]] = r[value]
    return out


def ratio_table(found, targets):
    """Ours' ratios: a line per ratio, values at each thread count."""
    status = _pairs([dict(t, ratio=t["case"]) for t in targets
                     if t["case"] == t["target"]], "ratio", "status")
    body = []
    for name, _, _, _, limit, _ in RATIOS:
        rows = [r for r in found if r["ratio"] == name]
        if not rows:
            continue
        th = rows[0]["theory"]
        body.append([name, str(rows[0]["T"]), _cell(_pairs(rows, "ratio",
                                                           "value")[name]),
                     "" if th is None else f"{th:.3f}", f"≤ {limit}",
                     _cell(status.get(name, {}), "{}"),
                     _cell(_pairs(rows, "ratio", "others_load")[name],
                           "{:.0%}")])
    return markdown_table(("ratio (f+b)", "T", "value, 1 thr / N thr",
                           "theory", "target", "verdict",
                           "others' CPU share"), body)


def torch_table(torch_rows, memory):
    """Ours against PyTorch's form: time ratio per thread count, memory."""
    mem = {m["variant"]: m for m in memory}
    body = []
    by = {}
    for r in torch_rows:
        by.setdefault(r["variant"], []).append(r)
    for variant, rows in by.items():
        one = min(rows, key=lambda r: r["threads"])
        m = mem.get(variant)
        body.append([
            variant, TORCH_VARIANTS[variant], str(one["T"]),
            f"{one['times_ms']['ours']:.3g}",
            f"{one['times_ms']['torch']:.3g}",
            _cell({r["threads"]: r["ratio"] for r in rows}),
            "-" if m is None else
            f"{m['ours_mib']:.1f} / {m['torch_mib']:.1f} = {m['ratio']:.2f}",
            _cell({r["threads"]: r["others_load"] or 0.0 for r in rows},
                  "{:.0%}")])
    return markdown_table(
        ("variant", "PyTorch's form", "T", "ours ms, 1 thr",
         "torch ms, 1 thr", "ours / torch, 1 thr / N thr",
         "peak MiB ours / torch", "others' CPU share"), body)


def setup_text(meta):
    threads = " and ".join(map(str, meta["threads"]))
    cfg = meta["config"]
    text = (f"`python -m attention_c.bench --variants` on {meta['cpu']} "
            f"({meta['cpus']} CPUs available), {meta['date'][:10]}: "
            f"attention_c {cfg['version']} on its **{cfg['simd']}** path, "
            f"PyTorch {meta['torch']}, float32, d = {meta['sizes']['d']}, "
            f"(B, heads) = (1, {HEADS}), {threads} threads; one run of "
            f"{meta.get('wall_seconds', 0):.0f} s.  Medians of interleaved "
            f"rounds (at least {meta['min_repeats']} timed runs each, after "
            f"warm-up); the two sides of every ratio were timed together.  "
            f"Forward + backward everywhere.")
    if meta.get("quick"):
        text += "  A `--quick` run (tiny sizes): indicative only."
    return text


def bitwise_line(bits):
    return (f"- **Bitwise identical at {', '.join(map(str, bits['threads']))}"
            f" threads** with every variant in one call (T = {bits['T']}; "
            f"{', '.join(bits['kwargs'])}): "
            f"{'yes' if bits['identical'] else 'NO'} (out, lse and every "
            f"gradient).")


def sections(meta, found, torch_rows, memory, bits, targets):
    """{section name: text} of the page."""
    parts = [setup_text(meta), ratio_table(found, targets),
             "Against PyTorch's best form for each variant (SDPA with "
             "the equivalent dense mask or bias; eager PyTorch as "
             "transformers writes softcap and sinks); the peak memory is "
             "the growth of the peak RSS of one forward + backward, each "
             "side in a fresh process, at the largest thread count:",
             torch_table(torch_rows, memory),
             bitwise_line(bits) + "\n" + harness.targets_line(targets, 25)]
    return {"variants": "\n\n".join(parts)}


def report(meta, found, torch_rows, memory, bits, targets, checks):
    """The whole text report."""
    worst = max((max(e.values()) for e in checks.values() if e),
                default=0.0)
    lines = [
        f"CPU: {meta['cpu']} ({meta['cpus']} CPUs available)",
        *peak_lines(meta["peak"]),
        f"attention_c {meta['config']['version']}, SIMD path "
        f"{meta['config']['simd']}; NumPy {meta['numpy']}; PyTorch "
        f"{meta['torch']}; load average at start "
        f"{format_load(meta['load_start'])}",
        "Today's variants, float32, forward + backward, ratios of medians "
        "timed together.",
    ]
    if meta["quick"]:
        lines.append("--quick: tiny sizes, indicative only.")
    lines += [
        f"Checked against attention_c.reference (float64, T = "
        f"{meta['sizes']['check_T']}): worst normwise error {worst:.1e} "
        f"over {len(checks)} functions.", "",
        ratio_table(found, targets), "",
        torch_table(torch_rows, memory), "",
        bitwise_line(bits), harness.targets_line(targets, 25),
        harness.targets_count(targets),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Command line

def parse_args(argv):
    """The options of ``python -m attention_c.bench --variants``."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c.bench --variants",
        description="Benchmark today's variants (window, packed "
                    "sequences, softcap, ALiBi slopes, sinks, a finfo.min "
                    "bias), forward + backward, float32, against the same "
                    "calls without them and against PyTorch's best form, "
                    "with the targets of issue 25.")
    harness.add_run_options(parser, "variants")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory subprocesses")
    parser.add_argument("--memory-child", choices=("ours", "torch"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--memory-variant", help=argparse.SUPPRESS)
    parser.add_argument("--memory-sizes", help=argparse.SUPPRESS)
    return harness.finish_run_options(parser.parse_args(argv), parser)


def main(argv=None):
    """Entry point of ``python -m attention_c.bench --variants``."""
    options = parse_args(sys.argv[1:] if argv is None else list(argv))
    if options.memory_child:
        return memory_child(options.memory_child, options.memory_variant,
                            options.memory_sizes, max(options.threads),
                            options.seed)
    torch = harness.baseline_torch()
    if torch is None:
        return 1
    start = time.perf_counter()
    sizes = QUICK_SIZES if options.quick else SIZES
    options.shapes, options.dtypes = [], ["float32"]
    options.no_torch, options.compile = False, False
    ctx, meta = harness.setup(options)
    ctx.update(torch=torch, sizes=sizes, quick=options.quick)
    meta.update(quick=options.quick, torch=torch.__version__, sizes=sizes,
                heads=HEADS, softcap=SOFTCAP,
                peak=harness.peak_facts(meta["config"]["simd"], options.dtypes,
                                        options.threads, options.quick))
    print(f"CPU: {meta['cpu']}", file=sys.stderr)
    checks = check_all(ctx)
    rows = [run_group(group, n, ctx) for group in GROUPS
            for n in options.threads]
    found = ratios(rows, sizes)
    torch_rows = [run_torch(v, n, ctx) for v in TORCH_VARIANTS
                  for n in options.threads]
    memory = [] if options.no_memory else [
        measure_memory(v, max(options.threads), ctx) for v in TORCH_VARIANTS]
    bits = bitwise(ctx)
    targets = evaluate(found, torch_rows, memory)
    meta["wall_seconds"] = time.perf_counter() - start
    meta["load_end"] = harness.load_average()
    print(report(meta, found, torch_rows, memory, bits, targets, checks))
    print(f"\nTotal {meta['wall_seconds']:.0f} s")
    if options.json:
        with open(options.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "checks": checks, "groups": rows,
                       "ratios": found, "torch": torch_rows,
                       "memory": memory, "bitwise": bits,
                       "targets": targets}, f, indent=1)
            f.write("\n")
        print(f"wrote {options.json}")
    if options.write_docs:
        write_page(options.write_docs,
                   sections(meta, found, torch_rows, memory, bits, targets))
        print(f"wrote {options.write_docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
