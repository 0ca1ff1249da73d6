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
attention_c.bench.family`` the ``family-*`` ones.  A page that does not
exist yet is created with the sections alone.
"""

import re

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
