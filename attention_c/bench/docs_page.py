"""The measured tables of ``docs/performance.md``, written by the
benchmarks' ``--write-docs PATH``.

The page mixes measurements with prose that explains them (why a target
is missed, what a profile showed), which no run can write.  So the page
marks what the benchmarks own: each generated section sits between

    <!-- bench:NAME -->
    ...
    <!-- /bench:NAME -->

and a run replaces the text between the markers of the sections it
produces, leaving everything else as it is.  ``python -m
attention_c.bench`` writes the ``layer-*`` sections, ``python -m
attention_c.bench.family`` the ``family-*`` ones, ``python -m
attention_c.bench --selfattn`` the ``selfattn`` one, ``--variants`` the
``variants`` one (attention_c.bench.variants), ``--transformers`` the
``transformers`` one (attention_c.bench.transformers).  A page that does not
exist yet is created with the sections alone.
"""

import re

from attention_c.bench.harness import DISTURBED

# Columns of the layer's tables: (header, ratio key, thread count), where
# the thread count is 1 or "N" (the largest count of the run).
LAYER_COLUMNS = (
    ("fwd / S1", "fwd/S1", 1),
    ("bwd / S1", "bwd/S1", 1),
    ("bwd saved / S1", "bwd_sv/S1", 1),
    ("fwd / torch", "fwd/pt", 1),
    ("f+b / torch", "f+b/pt", 1),
    ("f+b saved / torch", "f+b_sv/pt", 1),
    ("f+b saved / torch, {n} thr", "f+b_sv/pt", "N"),
    ("f+b {n} thr / 1 thr", "f+b N/1", "N"),
)
# The family's cases in the page's order, with what each times.
FAMILY_CASES = {
    "additive": "additive, several queries (d2l form: broadcast add, "
                "tanh, Linear)",
    "decoder_once": "decoder loop, {steps} steps, keys projected once each "
                    "way (`stop_at_key_proj`)",
    "decoder": "decoder loop, full gradients returned at every step",
    "dot": "dot, heads as a leading axis (matmul–softmax–matmul)",
    "general": "general (Linear on the keys, then as dot)",
}
FAMILY_HEAD = ("case", "shape", "mask", "ours ms (1 thr)", "torch ms",
               "ratio 1 thr", "ratio {n} thr", "target")
NOT_MEASURED = "*Not measured by the run this page was written from.*"


def markdown_table(head, body):
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _ratio(value):
    return "" if value is None else f"{value:.2f}"


def _most_threads(threads):
    """The largest thread count above 1 of a run, or None."""
    many = [n for n in threads if n > 1]
    return max(many) if many else None


def peak_sentence(peak):
    """The measured FMA peak of a run (harness.peak_facts), in a sentence
    for the page."""
    by = {}
    for p in peak["peaks"]:
        by.setdefault((p["simd"], p["dtype"]), []).append(
            f"{p['gflops']:.0f} GF/s on {p['threads']} "
            f"thread{'s' * (p['threads'] > 1)}")
    flags = ", ".join(peak["flags"]) or "unknown"
    return ("The FMA peak is measured on this CPU (flags: " + flags
            + "), each path's register-only FMA loop on every thread at "
            "once: " + "; ".join(f"{simd} {dtype} " + ", ".join(cells)
                                 for (simd, dtype), cells in by.items())
            + ".")


# --------------------------------------------------------------------------
# The layer's benchmark (python -m attention_c.bench)

def layer_setup(meta):
    """The paragraph that says where and how the tables were measured."""
    cfg = meta["config"]
    loads = [share for share in meta.get("others_loads", ())
             if share is not None]
    busy = (f"other processes used at most {max(loads):.0%} of the CPUs "
            f"while a row was timed" if loads else
            "the CPU use of other processes was not measured")
    text = (
        f"`python -m attention_c.bench` on {meta['cpu']} ({meta['cpus']} "
        f"CPUs available), {meta['date'][:10]}: attention_c "
        f"{cfg['version']} on its {cfg['simd']} path (the best of this "
        f"CPU: {cfg['simd_best']}), Python {meta['python']}, NumPy "
        f"{meta['numpy']} with {meta['blas']}, PyTorch "
        f"{meta['torch'] or 'not installed'}; one run of "
        f"{meta.get('wall_seconds', 0):.0f} s in which {busy}.  Medians "
        f"of interleaved rounds; ratios below 1 mean attention_c is "
        f"faster.")
    if "peak" in meta:
        text += "  " + peak_sentence(meta["peak"])
    if meta.get("quick"):
        text += ("  This was a `--quick` run (the large shapes with 8 times "
                 "fewer rows): indicative only.")
    return text


def layer_table(rows, meta, dtype):
    """The table of one dtype: a line per shape and mask, the ratios at 1
    thread and the largest thread count of the run."""
    n = _most_threads(meta["threads"])
    index = {(r["shape"], r["mask"], r["threads"]): r for r in rows
             if r["dtype"] == dtype}
    head = ["shape (B, T, H, A)", "mask", "ours fwd ms"] + [
        h.format(n=n if n else "N") for h, _, _ in LAYER_COLUMNS]
    body = []
    for shape in meta["shapes"]:
        size = ", ".join(map(str, meta["shape_sizes"][shape]))
        for mask in meta["masks"]:
            one = index.get((shape, mask, 1))
            if one is None:
                continue
            many = index.get((shape, mask, n)) if n else None
            cells = []
            for _, key, threads in LAYER_COLUMNS:
                row = one if threads == 1 else many
                cells.append("-" if row is None else
                             _ratio(row["ratios"].get(key)) or "-")
            body.append([f"{shape} ({size})", mask,
                         f"{one['times_ms']['ours_fwd']:.3g}"] + cells)
    return markdown_table(head, body) if body else NOT_MEASURED


def layer_sections(meta, rows):
    """{section name: text} of the layer's benchmark."""
    meta = dict(meta, others_loads=[r.get("others_load") for r in rows])
    return {"layer-setup": layer_setup(meta),
            "layer-float32": layer_table(rows, meta, "float32"),
            "layer-float64": layer_table(rows, meta, "float64")}


# --------------------------------------------------------------------------
# The family's benchmark (python -m attention_c.bench.family)

def family_setup(meta):
    """Where and how the family's table was measured."""
    cfg = meta["config"]
    loads = [share for share in meta.get("others_loads", ())
             if share is not None]
    busy = (f", other processes using at most {max(loads):.0%} of the CPUs"
            if loads else "")
    text = (f"Float32, medians of interleaved rounds, on {meta['cpu']} "
            f"({meta['cpus']} CPUs available; attention_c on its "
            f"{cfg['simd']} path), PyTorch {meta['torch']}, "
            f"{meta['date'][:10]}{busy}.  Ratios are ours / PyTorch, "
            f"fwd+bwd (below 1: ours faster).")
    if meta.get("quick"):
        text += "  A `--quick` run (small shapes): indicative only."
    return text


def _shapes(sizes):
    """The shape cell of each case."""
    add, dec, dot = sizes["additive"], sizes["decoder"], sizes["dot"]
    lead = ", ".join(map(str, dot["lead"]))
    return {
        "additive": "(B, Tq, T, H, A) = ({B}, {Tq}, {T}, {H}, {A})".format(
            **add),
        "decoder_once": "(B, T, H, A) = ({B}, {T}, {H}, {A})".format(**dec),
        "dot": f"({lead}) × (Tq, T, H) = ({dot['Tq']}, {dot['T']}, "
               f"{dot['H']})",
    }


def _target(found):
    if found is None or found["limit"] is None:
        return "(none)"
    return f"≤ {found['limit']:g} {found['status'].lower()}"


def family_table(meta, found):
    """The family's table: a line per case and mask (forward + backward
    against PyTorch eager), the peak memory after the additive case, and
    dot against ``F.scaled_dot_product_attention``."""
    n = _most_threads(meta["threads"])
    index = {(c["case"], c["mask"], c["measure"], c["baseline"],
              c["threads"]): c for c in found}
    shapes = _shapes(meta["sizes"])
    shown = set()                     # a case's shape is given once
    body = []

    def shape_cell(case):
        key = "dot" if case == "general" else (
            "decoder_once" if case == "decoder" else case)
        if key in shown:
            return "same"
        shown.add(key)
        return shapes[key]

    def ratio(case, mask, threads, base="torch"):
        c = index.get((case, mask, "f+b ms", base, threads))
        return "" if c is None else _ratio(c["ratio"])

    for case, text in FAMILY_CASES.items():
        masks = [c["mask"] for c in found if c["case"] == case
                 and c["measure"] == "f+b ms" and c["baseline"] == "torch"
                 and c["threads"] == 1]
        for i, mask in enumerate(masks):
            one = index[case, mask, "f+b ms", "torch", 1]
            label = text.format(**meta["sizes"]["decoder"]) if i == 0 else ""
            body.append([label, shape_cell(case) if i == 0 else "", mask,
                         f"{one['ours']:.1f}", f"{one['theirs']:.1f}",
                         _ratio(one["ratio"]),
                         ratio(case, mask, n) if n else "", _target(one)])
        memory = index.get((case, "full", "peak MiB", "torch", 1))
        if memory is not None:
            body.append(["peak memory of one fwd+bwd (fresh processes)",
                         "same", "full", f"{memory['ours']:.1f} MiB",
                         f"{memory['theirs']:.1f} MiB",
                         _ratio(memory["ratio"]), "", _target(memory)])
        sdpa = [m for m in masks if (case, m, "f+b ms", "sdpa", 1) in index]
        if sdpa:
            body.append([
                "dot vs `F.scaled_dot_product_attention`", "same",
                " / ".join(sdpa), "", "",
                " / ".join(ratio(case, m, 1, "sdpa") for m in sdpa),
                " / ".join(ratio(case, m, n, "sdpa") for m in sdpa)
                if n else "", "(none)"])
    head = [h.format(n=n if n else "N") for h in FAMILY_HEAD]
    return markdown_table(head, body) if body else NOT_MEASURED


def family_sections(meta, rows, found):
    """{section name: text} of the family's benchmark."""
    meta = dict(meta, others_loads=[r.get("others_load") for r in rows])
    return {"family-setup": family_setup(meta),
            "family-table": family_table(meta, found)}


# --------------------------------------------------------------------------
# Self-attention at scale (python -m attention_c.bench --selfattn)

SELFATTN_HEAD = ("case", "(B·heads, T, d)", "ours f+b ms (1 thr)",
                 "SDPA f+b ms", "ours / SDPA, 1 thr",
                 "ours / SDPA, {n} thr", "causal / full, 1 thr / {n} thr",
                 "{n} thr / 1 thr", "fwd % of FMA peak, 1 thr / {n} thr",
                 "f+b % of FMA peak, 1 thr / {n} thr",
                 "others' CPU share, 1 thr / {n} thr")


def _ms(value):
    """A time in ms to about 3 significant digits, without exponent."""
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _load(one, many):
    """'x% / y%' of the CPU share other processes used while the rows
    were timed ('?' where unknown)."""
    def cell(row):
        share = None if row is None else row.get("others_load")
        return "?" if share is None else f"{share:.0%}"

    return cell(one) if many is None else f"{cell(one)} / {cell(many)}"


def _pair(one, many, key, percent=False):
    """'x / y' of a ratio at 1 thread and at N threads ('-' if absent)."""
    def cell(row):
        value = None if row is None else row["ratios"].get(key)
        if value is None:
            return "-"
        return f"{value:.0%}" if percent else f"{value:.2f}"

    return cell(one) if many is None else f"{cell(one)} / {cell(many)}"


def selfattn_setup(meta):
    """Where, how and on which SIMD path and threads the section was
    measured."""
    cfg = meta["config"]
    loads = [share for share in meta.get("others_loads", ())
             if share is not None]
    busy = (f"other processes used at most {max(loads):.0%} of the CPUs "
            f"while a row was timed" if loads else
            "the CPU use of other processes was not measured")
    threads = " and ".join(map(str, meta["threads"]))
    threads += " threads" if meta["threads"] != [1] else " thread"
    heavy = "" if meta.get("quick") else ", at most 3 from T = 16384"
    text = (
        f"`python -m attention_c.bench --selfattn` on {meta['cpu']} "
        f"({meta['cpus']} CPUs available), {meta['date'][:10]}: attention_c "
        f"{cfg['version']} on its **{cfg['simd']}** path (the best of this "
        f"CPU: {cfg['simd_best']}), PyTorch {meta['torch']}, float32, "
        f"{threads} for both (`attention_c.set_num_threads`, "
        f"`torch.set_num_threads`); one run of "
        f"{meta.get('wall_seconds', 0):.0f} s in which {busy}.  Medians of "
        f"interleaved rounds (at least {meta['min_repeats']} timed runs "
        f"each{heavy}, after warm-up); ratios below 1 mean attention_c is "
        f"faster.  The last column gives the share of all CPUs that other "
        f"processes used while a row was timed: above "
        f"{DISTURBED:.0%} the row is disturbed (on 2 cores, another busy "
        f"process leaves a 2-thread row one core).")
    if "peak" in meta:
        text += "  " + peak_sentence(meta["peak"])
    if meta.get("quick"):
        text += "  A `--quick` run (tiny sizes): indicative only."
    return text


def selfattn_table(meta, rows):
    """A line per case and shape: forward + backward against SDPA at 1
    and N threads, causal / full, N / 1, the forward's share of the
    peak."""
    n = _most_threads(meta["threads"])
    index = {(r["case"], tuple(r["shape"]), r["threads"]): r for r in rows}
    body = []
    for case, shape, threads in index:
        if threads != 1:
            continue
        one = index[case, shape, 1]
        many = index.get((case, shape, n)) if n else None
        t = one["times_ms"]
        body.append([
            case, "(" + ", ".join(map(str, shape)) + ")",
            _ms(t["ours_fwdbwd"]), _ms(t["sdpa_fwdbwd"]),
            _pair(one, None, "f+b/sdpa"),
            _pair(many, None, "f+b/sdpa") if n else "-",
            _pair(one, many, "causal/full") if case == "causal" else "",
            _pair(many, None, "f+b N/1") if n else "-",
            _pair(one, many, "fwd %peak", percent=True),
            _pair(one, many, "f+b %peak", percent=True),
            _load(one, many)])
    head = [h.format(n=n if n else "N") for h in SELFATTN_HEAD]
    return markdown_table(head, body) if body else NOT_MEASURED


def _shape(shape, lead):
    return (f"({', '.join(map(str, shape))}), as (B, heads, T, d) = "
            f"({', '.join(map(str, list(lead) + list(shape[1:])))})")


def selfattn_extras(memory, long, targets):
    """The memory, the long call and the count of targets, as a list."""
    lines = []
    if memory:
        lines.append(
            f"- **Peak memory** of one forward + backward (full, "
            f"`return_weights=False`) at "
            f"{_shape(memory['shape'], memory['lead'])}, "
            f"{memory['threads']} thr, each in a fresh process (growth of "
            f"the peak RSS, {memory['method']}): ours "
            f"{memory['ours_mib']:.1f} MiB, SDPA {memory['sdpa_mib']:.1f} "
            f"MiB; ratio **{memory['ratio']:.2f}** (q, k, v and g take "
            f"{memory['inputs_mib']:.1f} MiB).")
    if long:
        text = (f"- **One causal forward + backward** at "
                f"{_shape(long['shape'], long['lead'])}, {long['threads']} "
                f"thr, timed once: ours {long['ours_s']:.3g} s")
        if "sdpa_s" in long:
            worst = max(long["difference"].values())
            text += (f", SDPA {long['sdpa_s']:.3g} s (ratio "
                     f"**{long['ratio']:.2f}**); the two agree within "
                     f"{worst:.0e} (normwise, out and every gradient)")
        share = long.get("others_load")
        if share is not None:
            text += (f"; other processes used {share:.0%} of the CPUs "
                     f"meanwhile")
        lines.append(text + ".")
    if targets:
        missed = [t for t in targets if t["status"] == "MISS"]
        passed = len(targets) - len(missed)
        busy = sum(t["disturbed"] for t in targets)
        text = (f"- **Targets of issues 32, 26 and 19:** {passed} of "
                f"{len(targets)} "
                f"checks pass ({busy} of the checks on disturbed rows)")
        if missed:
            names = dict.fromkeys(
                f"{t['target']} {t['text']} ({t['case']})" for t in missed)
            text += "; missed: " + "; ".join(names)
        lines.append(text + ".")
    return "\n".join(lines)


def selfattn_sections(meta, rows, targets, memory=None, long=None):
    """{section name: text} of the self-attention benchmark."""
    meta = dict(meta, others_loads=[r.get("others_load") for r in rows])
    parts = [selfattn_setup(meta), selfattn_table(meta, rows),
             selfattn_extras(memory, long, targets)]
    return {"selfattn": "\n\n".join(p for p in parts if p)}


# --------------------------------------------------------------------------
# The page

def _pattern(name):
    return re.compile(
        rf"(<!-- bench:{re.escape(name)} -->\n)(.*?)(\n<!-- /bench:"
        rf"{re.escape(name)} -->)", re.DOTALL)


def replace_sections(text, sections):
    """``text`` with the body of each section of ``sections`` ({name:
    new body}) replaced; ValueError if a section's markers are missing."""
    for name, body in sections.items():
        pattern = _pattern(name)
        if len(pattern.findall(text)) != 1:
            raise ValueError(
                f"the page needs exactly one section '<!-- bench:{name} -->"
                f"' ... '<!-- /bench:{name} -->'")
        text = pattern.sub(lambda m: m[1] + body.strip("\n") + m[3], text)
    return text


def new_page(sections):
    """A page holding the sections alone."""
    parts = ["# Performance", ""]
    for name, body in sections.items():
        parts += [f"<!-- bench:{name} -->", body.strip("\n"),
                  f"<!-- /bench:{name} -->", ""]
    return "\n".join(parts)


def write_page(path, sections):
    """Replace the sections in the page at ``path`` (created if absent)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = replace_sections(f.read(), sections)
    except FileNotFoundError:
        text = new_page(sections)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
