"""The benchmarks' reports: text tables, JSON and the plot (matplotlib,
imported when plotting)."""

import json

import numpy as np

from attention_c.bench.core import CALL_FUNCTIONS
from attention_c.bench.harness import DISTURBED, PROBE_SECONDS, ROUNDS
from attention_c.bench.run import (HEAVY_REPEATS, HEAVY_SHAPES, TOLERANCE,
                                   row_label, too_far)
from attention_c.bench.targets import (CAUSAL_FULL, DROPOUT_FULL, FB_PEAK,
                                       PEAK, RATIOS, SCALING,
                                       SELFATTN_SCALING, TARGETS)

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


def emit(options, meta, text, data, write_docs=None):
    """The end of a benchmark's run: print its report ``text`` and the
    run's length; write ``data`` as JSON to ``options.json`` and, with
    ``options.write_docs``, call ``write_docs(path)``, when asked."""
    print(text)
    print(f"\nTotal {meta['wall_seconds']:.0f} s; load average at end "
          f"{format_load(meta.get('load_end'))}")
    if options.json:
        with open(options.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, default=str)
            f.write("\n")
        print(f"wrote {options.json}")
    if write_docs is not None and options.write_docs:
        write_docs(options.write_docs)
        print(f"wrote {options.write_docs}")


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
    """Table with one line per row: shape, mask, dtype, threads, the
    columns and (if ``load``) the CPU share of other processes during the
    timing."""
    head = ["shape", "mask", "dtype", "thr"] + [h for _, h in columns]
    body = [[r["shape"], r["mask"], r["dtype"], str(r["threads"])]
            + [cell(r, k) for k, _ in columns] for r in rows]
    if load:
        head.append("others")
        for line, r in zip(body, rows):
            share = r["others_load"]
            line.append("?" if share is None else f"{share:.0%}")
    return format_table(head, body, left=3)


def targets_table(targets, shapes):
    """One line per (target, dtype, threads, mask), one cell per shape."""
    if not targets:
        return "(no target applies to these runs)"
    lines = {}
    for t in targets:
        key = (t["target"], t["dtype"], t["threads"], t["mask"])
        cell = "n/a" if t["ratio"] is None else (
            f"{t['ratio']:.2f} {t['status']}" + "*" * t["disturbed"])
        lines.setdefault(key, {})[t["shape"]] = cell
    text = {target[0]: target[-1] for target in TARGETS}
    head = ["target", "limit", "dtype", "thr", "mask"] + list(shapes)
    body = [[ratio, text[ratio], dtype, str(n), mask]
            + [cells.get(s, "") for s in shapes]
            for (ratio, dtype, n, mask), cells in lines.items()]
    return format_table(head, body, left=5)


def peak_lines(peak):
    """The machine's measured FMA peak (harness.peak_facts): the CPU's
    SIMD flags and one line per path, dtype and thread count."""
    seconds = {p["seconds"] for p in peak["peaks"]}
    repeats = {p["repeats"] for p in peak["peaks"]}
    clock = ("unknown" if not peak["mhz"] else
             f"{peak['mhz']:.0f} MHz ({peak['clock']})")
    return [
        f"CPU flags: {' '.join(peak['flags']) or 'unknown'}; clock "
        f"{clock}, for information only",
        f"FMA peak, measured: the path's register-only FMA loop on every "
        f"thread at once, best of {'/'.join(map(str, sorted(repeats)))} "
        f"calls of ~{'/'.join(f'{s:g}' for s in sorted(seconds))} s "
        f"(others: other processes' share of all CPUs meanwhile):",
    ] + [f"  {p['simd']} {p['dtype']} {p['threads']} thr: "
         f"{p['gflops']:.1f} GF/s (others "
         f"{'?' if p['others'] is None else format(p['others'], '.0%')}"
         + (f"; {p['busy_gflops']:.1f} GF/s per CPU time while running"
            if p.get("busy_gflops") and (p["others"] or 0) > DISTURBED
            else "") + ")"
         for p in peak["peaks"]] + [
        f"  (shares of the peak in the tables: of the same loop, "
        f"~{PROBE_SECONDS:g} s calls timed among each row's "
        f"calls, the median)"]


def gemm_table(rows):
    """Our product core and NumPy's BLAS, one line per shape, dtype and
    thread count."""
    head = ["shape", "M x K x N", "dtype", "thr", "core ms", "BLAS ms",
            "core/BLAS", "core GF/s", "BLAS GF/s", "fwd GF/s",
            "peak GF/s", "core %pk", "BLAS %pk", "fwd %pk"]
    body = []
    for r in rows:
        t, peak = r["times_ms"], r["peak_gflops"]
        g = dict(r["gflops"], fwd=r.get("layer_fwd_gflops"))
        body.append([r["shape"], f"{r['M']} x {r['K']} x {r['N']}",
                     r["dtype"], str(r["threads"]), format_ms(t["core"]),
                     format_ms(t["blas"]), format_ratio(t["core"] / t["blas"])]
                    + ["-" if g[k] is None else f"{g[k]:.1f}"
                       for k in ("core", "blas", "fwd")]
                    + ["-" if peak is None else f"{peak:.1f}"]
                    + ["-" if peak is None or g[k] is None
                       else f"{g[k] / peak:.0%}"
                       for k in ("core", "blas", "fwd")])
    return format_table(head, body, left=3)


def call_lines(rows):
    """The fixed cost of a call, a line per dtype and thread count."""
    return [f"  {r['dtype']} {r['threads']} thr: " + ", ".join(
        f"{CALL_FUNCTIONS[k]} {us:.1f} us" for k, us in r["us"].items())
        for r in rows]


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
    ] + (peak_lines(meta["peak"]) if "peak" in meta else []) + [
        f"NOTE: {note}" for note in meta["notes"]]


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
        "||x - r|| / ||r||, r = the NumPy reference in float64 on the "
        "same data (ref: the reference in float32).",
        format_table(head, body),
        "Beyond the tolerance: " + ("; ".join(bad) if bad else "none"),
    ]


def shape_lines(meta):
    """The shapes run, with their sizes (reduced with --quick)."""
    sizes = ", ".join(f"{s} {tuple(meta['shape_sizes'][s])}"
                      for s in meta["shapes"])
    lines = [f"Shapes (B, T, H, A): {sizes}; masks: "
             f"{', '.join(meta['masks'])} (full: no mask; ragged: each "
             f"sequence keeps a random prefix of T/2 to T items)."]
    lines.append(f"On {', '.join(HEAVY_SHAPES)}: median of >= "
                 f"{min(meta['min_repeats'], HEAVY_REPEATS)} runs (a call "
                 f"takes 0.1-1 s there).")
    if meta["quick"]:
        lines.append("--quick: large, long, wide, wide2 and long1 have 8 "
                     "times fewer rows than in the full run, which the "
                     "targets are set for: indicative only.")
    return lines


def summary_line(targets):
    """The PASS / MISS count, in all and on full and ragged sequences."""
    def count(items):
        found = [t["status"] for t in items]
        return ", ".join(f"{found.count(s)} {s}"
                         for s in ("PASS", "MISS", "n/a"))

    by_mask = "; ".join(
        f"{mask}: {count([t for t in targets if t['mask'] == mask])}"
        for mask in dict.fromkeys(t["mask"] for t in targets))
    return f"Targets: {count(targets)} ({by_mask})."


def report(meta, rows, targets, gemm=(), calls=()):
    """The whole text report."""
    def time_cell(row, key):
        if key == "n_valid":
            return str(row["n_valid"])
        return format_ms(row["times_ms"].get(key))

    def ratio_cell(row, key):
        if key == "fwd GF/s":
            return f"{row['fwd_gflops']:.1f}"
        value = row["ratios"].get(key)
        if key == PEAK:
            return "-" if value is None else f"{value:.0%}"
        return format_ratio(value)

    ratios = ([(n, n) for n, _, _ in RATIOS] + [(n, n) for n, _ in SCALING]
              + [("fwd GF/s", "fwd GF/s"), (PEAK, PEAK)])
    compile_errors = sorted({f"{row_label(r)}: {r['compile_error']}"
                             for r in rows if "compile_error" in r})
    parts = header_lines(meta) + shape_lines(meta) + [
        "",
        "Ours, median ms.  fwd_kp: forward keeping the activations; bwd: "
        "recomputes them; bwd_sv: given them;",
        "f+b = fwd then bwd; f+b_sv = fwd_kp then bwd_sv.  rows: the "
        "items the layer computes (valid ones).",
        "S1: NumPy (rows, H) @ (H, A), the layer's main product over "
        "exactly those rows (gathered before timing).",
        "others: share of all CPUs used by other processes while this row "
        "was timed (more than a few % disturbs it).",
        row_table(rows, (("n_valid", "rows"),) + OURS_COLUMNS, time_cell,
                  load=True),
        "",
        "Others, median ms.  np: NumPy reference; pt: torch eager best "
        "form; seed: torch seed form (concatenation);",
        "cmp: torch.compile of the best form ('-': not run).  Torch "
        "forward runs under no_grad; torch gets the same mask (none on "
        "full).",
        row_table(rows, OTHER_COLUMNS, time_cell),
        "",
        "Ratios ours / other (< 1: ours faster); f+b/np uses np_fwd + "
        "np_bwd.  N/1: ours at N threads / 1 thread.",
        "fwd GF/s: 2 rows H A / fwd time (the main product only; the "
        "context product, tanh, scores, softmax and",
        "weighted sum are not counted); fwd %peak: that / the FMA peak "
        "of the path, dtype and threads timed in the row's rounds.",
        row_table(rows, ratios, ratio_cell),
    ]
    if gemm:
        parts += [
            "",
            "Product core alone: attention_c.project_keys(keys, W) (our "
            "blocked product) against NumPy keys @ W.T",
            "(its BLAS, same threads), keys (B*T, H), W (A, H): the "
            "layer's main product; GF/s = 2 M N K / time;",
            "fwd: the layer's forward on the same shape, full sequences, "
            "its main product's flops only.",
            gemm_table(gemm)]
    if calls:
        parts += [
            "",
            "Fixed cost of a call: shape (1, 1, 1, 1), no mask, median "
            "per call (Python wrapper, argument parsing,",
            "checks, output allocation, thread wake-up; no target).  S1: "
            "one (1, 1) @ (1, 1) NumPy product, for scale.",
        ] + call_lines(calls)
    parts += [
        "",
        "Targets, ratio and verdict per shape (every thread count; N/1 at "
        "N > 1; ratios: ours / baseline, %peak: share):",
        targets_table(targets, meta["shapes"]),
        f"*: other processes used more than {DISTURBED:.0%} of the CPUs "
        f"while timing.  " + summary_line(targets),
        "",
    ] + accuracy_lines(rows)
    if compile_errors:
        parts += ["torch.compile failed (n/a):"] + compile_errors
    return "\n".join(parts)


def write_json(path, meta, rows, targets, gemm=(), calls=()):
    """Everything measured, as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "results": rows, "targets": targets,
                   "product_core": list(gemm), "call_cost": list(calls)},
                  f, indent=1)
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
    panels = [(m, n, mask) for n in meta["threads"] for mask in meta["masks"]
              for m in ("fwd", "fwdbwd")]
    index = {(r["shape"], r["dtype"], r["threads"], r["mask"]): r["times_ms"]
             for r in rows}
    fig, axes = plt.subplots(len(panels), len(dtypes), squeeze=False,
                             figsize=(1.6 * len(shapes) * len(dtypes) + 2,
                                      3.2 * len(panels) + 1))
    measured = {key for r in rows for key in r["times_ms"]}
    series = [s for s in PLOT_SERIES
              if s[1].format("fwd") in measured]
    width = 0.8 / len(series)
    x = np.arange(len(shapes))
    for (metric, n, mask), ax_row in zip(panels, axes):
        for dtype, ax in zip(dtypes, ax_row):
            for k, (label, key, colour) in enumerate(series):
                key = key.format(metric)
                ys = [index.get((s, dtype, n, mask), {}).get(key, np.nan)
                      for s in shapes]
                ax.bar(x + (k - (len(series) - 1) / 2) * width, ys, width,
                       label=label, color=colour)
            ax.set_yscale("log")
            ax.set_xticks(x, [f"{s}\n" + "x".join(
                map(str, meta["shape_sizes"][s])) for s in shapes],
                fontsize=8)
            what = "forward" if metric == "fwd" else "forward + backward"
            ax.set_title(f"{dtype}, {what}, {n} thread{'s' * (n > 1)}, "
                         f"{mask}", fontsize=10)
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
# Self-attention at scale (python -m attention_c.bench --selfattn)

SELFATTN_TIMES = (("ours_fwd", "fwd"), ("ours_fwdbwd", "f+b"),
                  ("sdpa_fwd", "sdpa fwd"), ("sdpa_fwdbwd", "sdpa f+b"))
SELFATTN_COLUMNS = ("fwd/sdpa", "f+b/sdpa", CAUSAL_FULL, DROPOUT_FULL,
                    SELFATTN_SCALING)


def shape_text(shape, lead):
    """'(B*heads, T, d) = (B, heads, T, d)' of a row."""
    return (f"({', '.join(map(str, shape))}) = "
            f"({', '.join(map(str, list(lead) + list(shape[1:])))})")


def selfattn_table(rows):
    """One line per case, shape and thread count: times and ratios."""
    head = (["case", "(B*heads, T, d) = (B, heads, T, d)", "thr"]
            + [h + " ms" for _, h in SELFATTN_TIMES]
            + list(SELFATTN_COLUMNS)
            + ["fwd GF/s", "peak GF/s", "fwd %peak", "f+b %peak",
               "others"])
    body = []
    for r in rows:
        share = r["others_load"]
        peak = r.get("peak_gflops")
        body.append(
            [r["case"], shape_text(r["shape"], r["lead"]), str(r["threads"])]
            + [format_ms(r["times_ms"][k]) for k, _ in SELFATTN_TIMES]
            + [format_ratio(r["ratios"].get(k)) for k in SELFATTN_COLUMNS]
            + [f"{r['fwd_gflops']:.1f}",
               "-" if peak is None else f"{peak:.1f}",
               "-" if PEAK not in r["ratios"]
               else f"{r['ratios'][PEAK]:.0%}",
               "-" if FB_PEAK not in r["ratios"]
               else f"{r['ratios'][FB_PEAK]:.0%}",
               "?" if share is None else f"{share:.0%}"])
    return format_table(head, body, left=2)


def selfattn_targets_table(targets):
    """One line per target entry."""
    if not targets:
        return "(no target applies to these runs)"
    body = [[t["target"], t["text"], t["case"], str(tuple(t["shape"])),
             str(t["threads"]),
             (f"{t['ratio']:.0%}" if t["target"] in (PEAK, FB_PEAK)
              else f"{t['ratio']:.2f}"),
             t["status"] + "*" * t["disturbed"]] for t in targets]
    return format_table(["target", "limit", "case", "shape", "thr",
                         "measured", "verdict"], body, left=4)


def selfattn_memory_line(memory):
    """The peak memory, in a sentence."""
    return (f"Peak memory of one forward + backward (full, fresh "
            f"processes, {memory['threads']} thr, growth of the peak RSS "
            f"by {memory['method']}) at "
            f"{shape_text(memory['shape'], memory['lead'])}: ours "
            f"{memory['ours_mib']:.1f} MiB, SDPA {memory['sdpa_mib']:.1f} "
            f"MiB, ratio {memory['ratio']:.2f} (inputs q, k, v, g: "
            f"{memory['inputs_mib']:.0f} MiB).")


def selfattn_long_line(long):
    """The long causal call, in a sentence."""
    text = (f"One causal forward + backward at "
            f"{shape_text(long['shape'], long['lead'])}, "
            f"{long['threads']} thr: ours {long['ours_s']:.2f} s")
    if "sdpa_s" in long:
        worst = max(long["difference"].values())
        text += (f", SDPA {long['sdpa_s']:.2f} s, ratio "
                 f"{long['ratio']:.2f}; ours and SDPA differ by at most "
                 f"{worst:.1e} (normwise, out and gradients)")
    return text + "."


def selfattn_accuracy_line(rows):
    """The worst error of each implementation over the rows."""
    worst = {}
    for r in rows:
        for name, errs in r["errors"].items():
            worst[name] = max(worst.get(name, 0.0), *errs.values())
    return ("Accuracy before timing (worst ||x - r|| / ||r|| over out and "
            "the gradients; r: SDPA in float64, dropout: the NumPy "
            "reference on the first head): " + ", ".join(
                f"{n} {e:.1e}" for n, e in worst.items()) + ".")


def selfattn_report(meta, rows, targets, memory=None, long=None):
    """The whole text report of the self-attention benchmark."""
    counts = [t["status"] for t in targets]
    parts = header_lines(meta) + [
        "Self-attention, float32, 4-D (B, heads, T, d), ours "
        "(return_weights=False, then the backward from out and lse) "
        "against",
        "torch.nn.functional.scaled_dot_product_attention on the same "
        f"work; dropout p = {meta['dropout']}; bias (1, 1, T, T) "
        "given to SDPA as attn_mask; mask: causal as a boolean",
        "(1, 1, T, T) np.tril, the attn_mask of both (its GF/s counted "
        "as causal's).",
    ]
    if meta["quick"]:
        parts.append("--quick: tiny sizes, indicative only.")
    parts += [
        "",
        "Median ms; ratios ours / SDPA (< 1: ours faster); causal/full and "
        "f+b N/1: ours f+b;",
        "fwd GF/s: 4 B T T d / fwd time (halved for causal); peak GF/s: "
        "the FMA loop on the threads used, timed",
        "in the row's rounds among its calls (the header's: the best call "
        "at the start); fwd %peak, f+b %peak: the rates / that.",
        selfattn_table(rows),
        "",
    ]
    if memory:
        parts.append(selfattn_memory_line(memory))
    if long:
        parts.append(selfattn_long_line(long))
    parts += [
        "",
        "Targets of issues 32, 26 and 19:",
        selfattn_targets_table(targets),
        f"*: other processes used more than {DISTURBED:.0%} of the CPUs "
        f"while timing.  Targets: {counts.count('PASS')} PASS, "
        f"{counts.count('MISS')} MISS.",
        "",
        selfattn_accuracy_line(rows),
    ]
    return "\n".join(parts)
