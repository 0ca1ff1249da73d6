"""The rows, targets and report of ``attention_c.bench.peers``: the
median times of the rounds, the ratios ours / peer, PASS / MISS of the
targets of issue 32, the Markdown table and text."""

import re
import statistics

from attention_c.bench import harness
from attention_c.bench.docs_page import markdown_table
from attention_c.bench.peers_cases import (FLOOR, KIND_TEXT, NAMES,
                                           TARGETS, THREAD_CONTROL)
from attention_c.bench.report import format_load, format_ms


# --------------------------------------------------------------------------
# Rows and targets

def median_times(children, passed):
    """{implementation|case key: median ms over the rounds} of one
    library's children, for the implementations that passed the check."""
    samples = {}
    for child in children:
        for key, ms in child.get("times_ms", {}).items():
            if passed.get(key.split("|")[0]):
                samples.setdefault(key, []).append(ms)
    return {k: statistics.median(v) for k, v in samples.items()}


def make_rows(cases, threads, medians, children):
    """One row per case: each library's time (ONNX Runtime: the faster of
    its operators, named), the ratios ours / peer and the others' CPU
    share (mean over every child of the thread count); a decode row also
    its read floor (``FLOOR`` in ``medians``: "read_ms", the faster
    reduction, and "floor", read_ms / the fastest peer's time)."""
    loads = [c["others_load"] for runs in children.values() for c in runs
             if c.get("others_load") is not None]
    rows = []
    for case in cases:
        row = {"case": case["key"], "kind": case["kind"],
               "variant": case["variant"], "shape": case["shape"],
               "threads": threads, "times_ms": {}, "impl": {},
               "others_load": statistics.mean(loads) if loads else None}
        for lib, times in medians.items():
            found = {k.split("|")[0]: ms for k, ms in times.items()
                     if k.split("|")[1] == case["key"]}
            if found and lib == FLOOR:
                row["read_ms"] = min(found.values())
            elif found:
                impl = min(found, key=found.get)
                row["times_ms"][lib], row["impl"][lib] = found[impl], impl
                if lib == "ort":
                    row["ort_ms"] = found
        ours = row["times_ms"].get("ours")
        row["ratios"] = {lib: ours / ms for lib, ms in row["times_ms"].items()
                         if lib != "ours" and ours is not None}
        peers = {lib: r for lib, r in row["ratios"].items()}
        if peers:
            best = max(peers, key=peers.get)     # the fastest peer
            row["best_peer"] = best
            row["ratios"]["best"] = peers[best]
            if "read_ms" in row:
                row["floor"] = row["read_ms"] / row["times_ms"][best]
        rows.append(row)
    return rows


def evaluate(rows):
    """PASS / MISS of every target of issue 32 that has its peer in a
    row; a target against the best peer also its row's read floor
    ("floor", None where not timed): above the limit, no implementation
    could meet it on this host."""
    targets = []
    for row in rows:
        for kind, peer, limit in TARGETS:
            ratio = row["ratios"].get(peer)
            if row["kind"] != kind or ratio is None:
                continue
            load = row["others_load"]
            targets.append({
                "target": f"{KIND_TEXT[kind]} ours/{peer}", "limit": limit,
                "case": row["case"], "threads": row["threads"],
                "peer": row.get("best_peer") if peer == "best" else peer,
                "ratio": ratio,
                "status": "PASS" if ratio <= limit else "MISS",
                "floor": row.get("floor") if peer == "best" else None,
                "disturbed": load is not None and load > harness.DISTURBED})
    return targets


# --------------------------------------------------------------------------
# Report

def _verdicts(targets, row):
    found = [t for t in targets if t["case"] == row["case"]
             and t["threads"] == row["threads"]]
    return "; ".join(
        ("best " if t["target"].endswith("/best") else "")
        + f"{t['peer']} ≤ {t['limit']} {t['status']}" + "*" * t["disturbed"]
        + (" (below the read floor)" if _below_floor(t) else "")
        for t in found) or ""


def _below_floor(target):
    """Whether a target asks for less time than reading K and V takes."""
    floor = target.get("floor")
    return floor is not None and floor > target["limit"]


def _ratio(value):
    """A ratio to 2 decimals (3 significant digits below 0.1), or '-'."""
    if value is None:
        return "-"
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def table(rows, targets, libs):
    """The Markdown table: a line per case and thread count."""
    peers = [lib for lib in libs if lib != "ours"]
    floor = any("read_ms" in row for row in rows)
    head = (["case", "thr", "ours ms"] + [f"{lib} ms" for lib in peers]
            + [f"ours/{lib}" for lib in peers]
            + ["read ms", "read/best"] * floor
            + ["targets", "others' CPU"])
    body = []
    for row in rows:
        t = row["times_ms"]
        cells = [row["case"], str(row["threads"]), format_ms(t.get("ours"))]
        for lib in peers:
            cell = format_ms(t.get(lib))
            if lib == "ort" and lib in t:
                cell += f" ({row['impl'][lib].split(':')[1]})"
            cells.append(cell)
        cells += [_ratio(row["ratios"].get(lib)) for lib in peers]
        if floor:
            cells += ["" if "read_ms" not in row
                      else format_ms(row["read_ms"]),
                      _ratio(row["floor"]) if "floor" in row else ""]
        load = row["others_load"]
        cells += [_verdicts(targets, row),
                  "?" if load is None else f"{load:.0%}"]
        body.append(cells)
    return markdown_table(head, body)


def _used(meta, threads, lib):
    used = meta["threads_used"].get(threads, {}).get(lib)
    return "?" if used is None else f"{used:.1f}"


def report(meta, rows, targets):
    """The whole text report (Markdown)."""
    return "\n".join(report_lines(meta, rows, targets))


def docs_section(meta, rows, targets):
    """{"peers": the report as docs/performance.md's section}: the command
    and date first, each sentence its own paragraph."""
    lines = report_lines(meta, rows, targets)
    lines[0] = (f"`python -m attention_c.bench --peers` on {meta['cpu']}, "
                f"{meta['date'][:10]}.")
    text = "\n".join(lines)
    return {"peers": re.sub(r"\n(?!\|)", "\n\n",
                            text).replace("\n\n\n\n", "\n\n")}


def report_lines(meta, rows, targets):
    """The report, a line per sentence (the table one block)."""
    lines = [
        f"attention_c against its peers, {meta['date']}",
        f"CPU: {meta['cpu']} ({meta['cpus']} CPUs available); load "
        f"average {format_load(meta['load_start'])} at start; others' CPU "
        f"share while timing: " + ", ".join(
            f"{n} thr {'?' if s is None else f'{s:.0%}'}"
            for n, s in meta["others_load"].items()),
        f"attention_c {meta['config']['version']}, SIMD path "
        f"{meta['config']['simd']}; float32, each library in its own "
        f"process; medians of {meta['rounds']} interleaved rounds (each a "
        f"median of >= {meta['min_repeats']} runs, ~{meta['target_s']:g} s "
        f"a case).",
        "Libraries: " + "; ".join(
            f"{NAMES[lib]} {s['version'] or '-'}: {s['status']}"
            for lib, s in meta["libs"].items()) + ".",
        "Threads set by: " + "; ".join(
            f"{lib} {THREAD_CONTROL[lib]}"
            for lib in meta["timed"] + [FLOOR])
        + "; OMP/MKL/OPENBLAS_NUM_THREADS in every child's environment.",
        "Threads each child used while timing (CPU time of its threads / "
        "of its busiest one; in parentheses its CPU time / wall time, "
        "medians over the rounds): " + "; ".join(
            f"{n} thr " + ", ".join(
                f"{lib} {_used(meta, n, lib)} ({u:.2f})"
                for lib, u in use.items())
            for n, use in meta["cpu_use"].items()) + ".",
    ]
    if meta["quick"]:
        lines.append("--quick: tiny sizes, indicative only.")
    lines += [
        "Checked before timing against SDPA in float64 (worst ||x - r|| / "
        "||r|| over out and the gradients): " + ", ".join(
            f"{v['impl']} {v['dtype']} {max(v['errors'].values()):.1e}"
            + ("" if v["ok"] else " FAILED")
            for lib in meta["checks"].values() for v in lib.values()) + ".",
        "",
        table(rows, targets, meta["timed"]),
        "",
        "Times in ms, ratios ours / peer (< 1: ours faster); ort: the "
        "faster of Attention-23 and MultiHeadAttention (named); decode "
        "targets against the fastest peer; *: others used more than "
        f"{harness.DISTURBED:.0%} of the CPUs.  read: the decode step's "
        "k and v reduced once (the faster of torch.amax and torch.sum, "
        "PyTorch's threads set as SDPA's), in the same rounds; read/best: "
        "the least ratio to the fastest peer an implementation that reads "
        "them at that rate could reach.",
        harness.targets_line(targets, 32),
    ]
    below = [t for t in targets if t["status"] == "MISS"
             and _below_floor(t)]
    if below:
        lines.append(
            f"- **Below the read floor:** {len(below)} of the misses ask "
            "for less time than reading the step's k and v takes here: "
            + "; ".join(f"{t['case']}, {t['threads']} thr: read/best "
                        f"{t['floor']:.2f}" for t in below) + ".")
    lines.append(harness.targets_count(targets))
    return lines
