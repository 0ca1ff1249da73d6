"""bf16 products of float32 calls (``set_fp32_precision("bf16")``) and of
bfloat16 calls, against float32 products and PyTorch's
``scaled_dot_product_attention``.

``python -m attention_c.bench --bf16`` (or ``python -m
attention_c.bench.bf16``) runs it; ``--quick`` runs tiny sizes in seconds.
PyTorch is required (it is the baseline).

Float32 inputs, (B, heads, T, d) with B * heads the first number of each
shape, full and causal, at each thread count asked for (ours through
``attention_c.set_num_threads``, PyTorch through ``torch.set_num_threads``).
Timed in interleaved rounds (``harness.measure``), the forward alone and
the forward then the backward (``dot_attention_backward`` from the
forward's out and lse; PyTorch's autograd from leaf tensors, a gradient
of out drawn with the inputs):

* ours_fp32: ``dot_attention(q, k, values=v, return_weights=False)`` with
  ``set_fp32_precision("ieee")``;
* ours_bf16: the same with ``"bf16"`` (Q K^T and P V on bf16 units,
  float32 sums, where ``show_config()["bf16_products"]``: AMX tiles, or
  AVX512_BF16's dot products, on the unit ``show_config()["bf16_unit"]``
  names; ``ATTENTION_C_BF16_UNIT=dot`` chooses the dot products on a CPU
  that has both; float32 products elsewhere);
* ours_bf16_in: the ``"ieee"`` call on ml_dtypes bfloat16 copies of the
  inputs (made once, outside the timing), which returns bfloat16 and takes
  the bf16 products by itself;
* ours_f16_in: the same on float16 copies, which returns float16 and
  runs float32 products (its streamed forward reads the copies as
  stored);
* torch_fp32 / torch_bf16 / torch_f16: SDPA (under no_grad for the
  forward alone) on float32 tensors / on bfloat16 and float16 copies of
  them (made once, outside the timing).

The scale is 1 / sqrt(d) on both sides.  Before timing, each output is
compared with SDPA in float64 on the same data (||x - r|| / ||r||; the
gradients dq, dk, dv each), and so is floor_bf16: SDPA in float64 on the
inputs rounded to bfloat16, its results rounded once to bfloat16, the
error that rounding what a bfloat16 call reads and returns leaves however
exact the arithmetic between (an error target of ours / PyTorch's below
floor_bf16 / PyTorch's is met only by chance).  GF/s count 4 B T^2 d
flops for the forward, 3.5 times that with the backward (halved for
causal), as a share of the float32 FMA peak of our SIMD path timed among
the row's calls (bf16 products may go beyond it).
"""

import math
import sys

import numpy as np

import attention_c as ac
from attention_c import _core  # type: ignore[attr-defined]
from attention_c.bench import harness
from attention_c.bench.report import emit, format_load, format_table
from attention_c.bench.selfattn import (FWDBWD_FLOPS, HEADS,
                                        flops_forward, split)
from attention_c.testing import rel_err

SHAPES = ((8, 1024, 64), (2, 4096, 64))         # (B * heads, T, d)
QUICK_SHAPES = ((2, 128, 16), (1, 256, 16))
CASES = ("full", "causal")
PASSES = ("forward", "f+b")
IMPLS = ("ours_fp32", "ours_bf16", "ours_bf16_in", "ours_f16_in",
         "torch_fp32", "torch_bf16", "torch_f16")
FLOOR = "floor_bf16"    # not timed: what exact arithmetic leaves a bf16 call
TOLERANCE = {"ours_fp32": 1e-4, "torch_fp32": 1e-4, "ours_bf16": 2e-2,
             "ours_bf16_in": 2e-2, "torch_bf16": 2e-2, "ours_f16_in": 5e-3,
             "torch_f16": 5e-3, FLOOR: 2e-2}
# ratios: name -> (numerator, denominator)
RATIOS = {"bf16/fp32": ("ours_bf16", "ours_fp32"),
          "bf16/torch_bf16": ("ours_bf16", "torch_bf16"),
          "bf16/torch_fp32": ("ours_bf16", "torch_fp32"),
          "bf16_in/fp32": ("ours_bf16_in", "ours_fp32"),
          "bf16_in/torch_bf16": ("ours_bf16_in", "torch_bf16"),
          "f16_in/fp32": ("ours_f16_in", "ours_fp32"),
          "f16_in/torch_f16": ("ours_f16_in", "torch_f16")}
# issue 33's targets, ratio -> {pass: limit}: with bf16 products, 1.7x
# and 1.6x our float32 (forward, f+b), 0.55x and 0.7x PyTorch's bf16;
# without them, no more than 1.05x our float32 and 0.95x PyTorch's bf16
TARGETS = {"bf16/fp32": {"forward": 1 / 1.7, "f+b": 1 / 1.6},
           "bf16_in/fp32": {"forward": 1 / 1.7, "f+b": 1 / 1.6},
           "bf16/torch_bf16": {"forward": 0.55, "f+b": 0.7},
           "bf16_in/torch_bf16": {"forward": 0.55, "f+b": 0.7}}
TARGETS_WITHOUT = {"bf16_in/fp32": {"forward": 1.05, "f+b": 1.05},
                   "bf16_in/torch_bf16": {"forward": 0.95, "f+b": 0.95}}
# float16 inputs run float32 products on every CPU: as bfloat16 inputs
# without bf16 products, no more than 1.05x our float32
TARGETS_F16 = {"f16_in/fp32": {"forward": 1.05, "f+b": 1.05}}
# and the error of bfloat16 inputs against PyTorch's bf16: out 1.1x, each
# of dq, dk, dv 0.9x
ERROR_TARGETS = {"forward": 1.1, "f+b": 0.9}


def make_problem(shape, case, seed=0):
    """q, k, v and the gradient of out g (B, heads, T, d), float32
    standard normal, and the case."""
    bh, T, d = shape
    rng = np.random.default_rng([seed, bh, T, d, CASES.index(case)])
    lead = split(bh)
    p = {n: rng.standard_normal(lead + (T, d), dtype=np.float32)
         for n in ("q", "k", "v", "g")}
    p.update(causal=case == "causal", scale=1 / math.sqrt(d))
    return p


def ours_call(p, precision, backward, dtype=np.float32):
    """Our forward (then, ``backward``, its backward: the gradients) at
    ``precision`` on the inputs in ``dtype``; the setting is global, so
    each call sets it (only when it differs: a get costs far less than a
    set)."""
    q, k, v, g = (p[n].astype(dtype, copy=False) for n in "qkvg")
    kw = dict(causal=p["causal"], scale=p["scale"])

    def run():
        if ac.get_fp32_precision() != precision:
            ac.set_fp32_precision(precision)
        out, lse = ac.dot_attention(q, k, values=v, return_weights=False,
                                    **kw)
        if not backward:
            return [out]
        return list(ac.dot_attention_backward(g, q, k, values=v, out=out,
                                              lse=lse, **kw)[:3])
    return run


def torch_call(torch, p, dtype, backward):
    """SDPA's forward under no_grad (or, ``backward``, with autograd from
    leaf tensors: the gradients) on the problem converted to ``dtype``
    (float32 shares the arrays' memory)."""
    q, k, v, g = (torch.from_numpy(p[n]).to(dtype) for n in "qkvg")
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        if not backward:
            with torch.no_grad():
                return [sdpa(q, k, v, is_causal=p["causal"],
                             scale=p["scale"])]
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        sdpa(*x, is_causal=p["causal"], scale=p["scale"]).backward(g)
        return [t.grad for t in x]
    return run


def functions(torch, p, backward):
    """The timed calls, by IMPLS name."""
    import ml_dtypes
    return {"ours_fp32": ours_call(p, "ieee", backward),
            "ours_bf16": ours_call(p, "bf16", backward),
            "ours_bf16_in": ours_call(p, "ieee", backward,
                                      ml_dtypes.bfloat16),
            "ours_f16_in": ours_call(p, "ieee", backward, np.float16),
            "torch_fp32": torch_call(torch, p, torch.float32, backward),
            "torch_bf16": torch_call(torch, p, torch.bfloat16, backward),
            "torch_f16": torch_call(torch, p, torch.float16, backward)}


def check(torch, p, funcs, backward):
    """{impl: [normwise error of each result]} against SDPA in float64:
    out, or dq, dk, dv; and FLOOR's, the error of the exact results of
    the inputs rounded to bfloat16, each rounded once to bfloat16 (what
    no bf16 call can improve on: the rounding of what it reads and of
    what it returns)."""
    exact = [x.numpy()
             for x in torch_call(torch, p, torch.float64, backward)()]
    rounded = {n: torch.from_numpy(p[n]).to(torch.bfloat16).float().numpy()
               for n in "qkvg"}
    best = [x.to(torch.bfloat16) for x in torch_call(
        torch, dict(p, **rounded), torch.float64, backward)()]
    errs = {}
    for name, fn in dict(funcs, **{FLOOR: lambda: best}).items():
        errs[name] = [
            rel_err((x.to(torch.float64).numpy() if torch.is_tensor(x)
                     else x).astype(np.float64), r)
            for x, r in zip(fn(), exact)]
    return errs


def run_row(case, shape, threads, ctx, funcs, errs, backward):
    """Time the calls on one case, shape and thread count."""
    row = {"case": case, "shape": list(shape), "lead": list(split(shape[0])),
           "threads": threads, "pass": PASSES[backward], "errors": errs}
    harness.measure_into(row, funcs, ctx["target"], ctx["min_repeats"],
                         peak=(ctx["peak"], "float32"))
    t = row["times_ms"]
    row["ratios"] = {r: t[a] / t[b] for r, (a, b) in RATIOS.items()}
    flops = flops_forward(shape, case == "causal") * (FWDBWD_FLOPS
                                                      if backward else 1)
    row["gflops"] = {k: flops / (ms / 1e3) / 1e9 for k, ms in t.items()}
    row["peak_share"] = {k: g / row["peak_gflops"]
                         for k, g in row["gflops"].items()}
    return row


def run_all(options, ctx):
    """Every shape, case and thread count; returns the rows."""
    torch, rows = ctx["torch"], []
    for backward in (0, 1):
        for shape in ctx["shapes"]:
            for case in CASES:
                p = make_problem(shape, case, ctx["seed"])
                funcs = functions(torch, p, backward)
                errs = check(torch, p, funcs, backward)  # once, before
                harness.warn_inaccurate({k: max(e) for k, e in errs.items()},
                                        TOLERANCE, f"{case} {shape}")
                rows += harness.rows_by_threads(
                    options.threads, ctx, torch,
                    f"{PASSES[backward]:<8} {case:<7} {str(shape):<16}",
                    lambda n: run_row(case, shape, n, ctx, funcs, errs,
                                      backward))
    return rows


# --------------------------------------------------------------------------
# Report

def header(meta):
    """The lines saying what ran where."""
    flags = meta["peak"]["flags"]
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}"
                     for f in ("amx_bf16", "avx512_bf16"))
    share = meta["others_share"]
    peaks = ", ".join(f"{p['threads']} thr {p['gflops']:.0f} GF/s"
                      for p in meta["peak"]["peaks"])
    lines = [
        "bf16 products (set_fp32_precision('bf16')) against float32 "
        "products and torch SDPA: float32 inputs (bfloat16 for "
        "ours_bf16_in, float16 for ours_f16_in), the forward "
        "(return_weights=False) and the forward then the backward (f+b)",
        f"CPU {meta['cpu']} ({meta['cpus']} CPUs available); {have}",
        f"attention_c {meta['config']['version']}: SIMD path "
        f"{meta['config']['simd']}, bf16_products "
        f"{meta['bf16_products']} (unit {meta['bf16_unit']}; bf16 dot "
        f"products at {meta['bf16_dot_speedup']:.2f}x the FMA rate, 0: "
        f"none); "
        f"torch {meta['torch']} "
        f"(CPU capability {meta['torch_capability']})",
        f"Float32 FMA peak of the {meta['config']['simd']} path: {peaks}",
        "Other processes used "
        + ("?" if share is None else f"{share:.0%}")
        + " of the CPUs during the run; load average at start "
        + format_load(meta["load_start"])]
    if not meta["bf16_products"]:
        lines.append("NOTE: this CPU has no bf16 products for attention_c: "
                     "the 'bf16' setting runs float32 products, so "
                     "ours_bf16 times the same kernel as ours_fp32.")
    return lines


def shape_text(row):
    """The row's 4-D shape, "1x8x1024x64"."""
    return "x".join(map(str, row["lead"] + row["shape"][1:]))


def _worst(errors, torch_errors):
    """The largest ratio of an error to PyTorch's on the same result."""
    return max(a / b if b > 0 else math.inf
               for a, b in zip(errors, torch_errors))


def evaluate_targets(meta, rows):
    """Issue 33's targets on every row (TARGETS with bf16 products,
    TARGETS_WITHOUT else; TARGETS_F16 always), and the errors'
    (ERROR_TARGETS) once per pass, shape and case: dicts of target,
    limit, value, status, case."""
    ratios = dict(TARGETS if meta["bf16_products"] else TARGETS_WITHOUT,
                  **TARGETS_F16)
    out, seen = [], set()
    for r in rows:
        case = f"{r['pass']} {r['case']} {shape_text(r)}"
        for name, limits in ratios.items():
            limit = limits[r["pass"]]
            out.append({"target": f"{r['pass']} {name}", "limit": limit,
                        "value": r["ratios"][name],
                        "case": f"{case} {r['threads']} thr"})
        if case not in seen:
            seen.add(case)
            e, t = r["errors"]["ours_bf16_in"], r["errors"]["torch_bf16"]
            out.append({"target": f"{r['pass']} error bf16_in/torch_bf16",
                        "limit": ERROR_TARGETS[r["pass"]],
                        "value": _worst(e, t), "case": case,
                        "floor": _worst(r["errors"][FLOOR], t)})
    for t in out:
        t["status"] = "PASS" if t["value"] <= t["limit"] else "MISS"
    return out


def targets_lines(meta, rows):
    """How many rows pass each target of issue 33, and the worst."""
    targets = evaluate_targets(meta, rows)
    lines = ["Targets of issue 33 "
             + ("with" if meta["bf16_products"] else "without")
             + " bf16 products"
             + (" (--quick: tiny shapes, indicative only)"
                if meta["quick"] else "") + ":"]
    for name in dict.fromkeys(t["target"] for t in targets):
        these = [t for t in targets if t["target"] == name]
        worst = max(these, key=lambda t: t["value"])
        passed = sum(t["status"] == "PASS" for t in these)
        lines.append(f"  {name} <= {these[0]['limit']:.3g}: {passed} of "
                     f"{len(these)} pass; worst {worst['value']:.3f} "
                     f"({worst['case']})")
        if "floor" in these[0]:
            floors = [t["floor"] for t in these]
            above = sum(f > these[0]["limit"] for f in floors)
            lines.append(f"    {FLOOR} (exact arithmetic on the rounded "
                         f"inputs, its results rounded once): "
                         f"{min(floors):.3f}-{max(floors):.3f}, above the "
                         f"limit on {above} of {len(floors)}, where no "
                         f"bf16 call meets it but by chance")
    return lines + [harness.targets_count(targets)]


def report(meta, rows):
    """The plain-text report: header, times and ratios, GF/s, errors,
    the targets."""
    key = ["pass", "case", "B x h x T x d", "thr"]
    times = [[r["pass"], r["case"], shape_text(r), str(r["threads"])]
             + [f"{r['times_ms'][k]:.3f}" for k in IMPLS]
             + [f"{r['ratios'][k]:.2f}" for k in RATIOS]
             + ["?" if r["others_load"] is None
                else f"{r['others_load']:.0%}"] for r in rows]
    rates = [[r["pass"], r["case"], shape_text(r), str(r["threads"]),
              f"{r['peak_gflops']:.0f}"]
             + [f"{r['gflops'][k]:.1f} ({r['peak_share'][k]:.0%})"
                for k in IMPLS] for r in rows]
    seen = {}
    for r in rows:              # errors: once per pass, shape and case
        seen.setdefault((r["pass"], r["case"], shape_text(r)), r["errors"])
    errors = [[p, c, s] + [" ".join(f"{x:.1e}" for x in e[k])
                           for k in IMPLS + (FLOOR,)]
              for (p, c, s), e in seen.items()]
    return "\n".join(header(meta) + [
        "", "Median ms per call; ratios < 1: ours_bf16 faster",
        format_table(key + [f"{k} ms" for k in IMPLS] + list(RATIOS)
                     + ["others"], times, left=2),
        "", "GF/s (share of the float32 FMA peak of the threads used, "
        "timed in the row's rounds: the peak column)",
        format_table(key + ["peak"] + list(IMPLS), rates, left=2),
        "", "Error against SDPA in float64 (||x - r|| / ||r||) of out "
        "(forward), of dq dk dv (f+b); "
        f"{FLOOR}: the exact results of the inputs rounded to bfloat16, "
        "each rounded once to bfloat16",
        format_table(key[:3] + list(IMPLS) + [FLOOR], errors, left=2),
        ""] + targets_lines(meta, rows))


# --------------------------------------------------------------------------
# Command line

def parse_args(argv):
    """The options of ``python -m attention_c.bench --bf16``."""
    return harness.parse_mode_args(
        "bf16",
        "Benchmark the streamed forward of dot_attention, and "
        "the forward then the backward, on "
        "float32 inputs with bf16 products "
        "(set_fp32_precision('bf16')) against float32 products "
        "and torch.nn.functional.scaled_dot_product_attention "
        "in float32 and bfloat16, with each one's error "
        "against float64.",
        argv)


def setup(options, torch):
    """The run's settings and the report's metadata."""
    shapes = QUICK_SHAPES if options.quick else SHAPES
    options.shapes = [str(s) for s in shapes]
    options.dtypes = ["float32"]
    options.no_torch, options.compile = False, False
    ctx, meta = harness.setup(options)
    meta.update(harness.torch_facts(torch), quick=options.quick,
                bf16_products=bool(_core._bf16_products()),
                bf16_unit=_core._bf16_unit(),
                bf16_dot_speedup=_core._bf16_dot_speedup(),
                peak=harness.peak_facts(meta["config"]["simd"], ["float32"],
                                        options.threads, options.quick),
                shape_sizes=[list(s) for s in shapes], heads=HEADS)
    ctx.update(torch=torch, shapes=shapes, peak=meta["peak"])
    return ctx, meta


def main(argv=None):
    """Entry point of ``python -m attention_c.bench --bf16``."""
    options = parse_args(sys.argv[1:] if argv is None else list(argv))
    torch = harness.baseline_torch()
    if torch is None:
        return 2

    def run():
        ctx, meta = setup(options, torch)
        return meta, run_all(options, ctx)
    meta, rows = harness.run_baseline_bench(torch, run)
    emit(options, meta, report(meta, rows), {"meta": meta, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
