"""The command line of ``python -m attention_c.bench``: options, then the
run, the report and the files asked for."""

import argparse
import sys
import time

from attention_c.bench import harness
from attention_c.bench.core import (add_layer_forward, run_call_cost,
                                    run_gemm)
from attention_c.bench.docs_page import layer_sections, write_page
from attention_c.bench.report import (format_load, make_plot, report,
                                      write_json)
from attention_c.bench.run import (DTYPES, EXTRA_SHAPES, MASKS,
                                   QUICK_DTYPES, QUICK_EXTRA_SHAPES,
                                   QUICK_SHAPES, SHAPES, run_all)
from attention_c.bench.targets import add_ratios, evaluate_targets


def parse_args(argv):
    """The options, with shapes, dtypes, masks and threads expanded to
    lists."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c.bench",
        description="Benchmark attention_c against the NumPy product of the "
                    "rows it computes (S1), the NumPy reference and PyTorch, "
                    "on full and ragged sequences, against the targets of "
                    "issue 10; and its product core against NumPy's BLAS, "
                    "and the fixed cost of a call.")
    parser.add_argument("--quick", action="store_true",
                        help="every shape, the large ones with 8 times "
                             "fewer rows; float32; shorter measurements; "
                             "no torch.compile (about 1 min)")
    parser.add_argument("--shapes", help="comma-separated, from: " + ", ".join(
        f"{k} {v}" for k, v in SHAPES.items()))
    parser.add_argument("--dtypes", help="comma-separated, from: "
                        + ", ".join(DTYPES) + " (default: both; float32 "
                        "with --quick)")
    parser.add_argument("--masks", help="comma-separated, from: "
                        + ", ".join(MASKS) + " (default: both)")
    parser.add_argument("--threads", default="1,all",
                        help="comma-separated thread counts; 'all' = the "
                             "available CPUs (default: 1,all)")
    parser.add_argument("--target", type=float,
                        help="seconds per measurement (default 0.3, 0.02 "
                             "with --quick)")
    parser.add_argument("--min-repeats", type=int,
                        help="least timed runs per measurement (default 6, "
                             "2 with --quick; at most 3 on wide, wide2, "
                             "long1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torch", action="store_true",
                        help="leave PyTorch out even if it is installed")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="time torch.compile on float32 of medium and "
                             "large (default: yes, except with --quick)")
    parser.add_argument("--json", metavar="FILE", help="write all results")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG plot")
    parser.add_argument("--write-docs", metavar="PAGE",
                        help="rewrite the measured sections of this page "
                             "(docs/performance.md), keeping its prose")
    parser.add_argument("--family", action="store_true",
                        help="benchmark the attention family instead "
                             "(attention_c.bench.family; takes its options)")
    parser.add_argument("--selfattn", action="store_true",
                        help="benchmark self-attention at scale against "
                             "torch's scaled_dot_product_attention instead "
                             "(attention_c.bench.selfattn; takes its "
                             "options)")
    parser.add_argument("--bf16", action="store_true",
                        help="benchmark the forward's bf16 products on "
                             "float32 inputs (set_fp32_precision('bf16')) "
                             "against float32 products and torch's "
                             "scaled_dot_product_attention in float32 and "
                             "bfloat16 instead (attention_c.bench.bf16; "
                             "takes its options)")
    parser.add_argument("--cache", action="store_true",
                        help="benchmark a GQA decode step on key/value "
                             "caches in float32, bfloat16, float16 and "
                             "int8 against the host's read bandwidth and "
                             "torch's scaled_dot_product_attention instead "
                             "(attention_c.bench.cache; takes its options; "
                             "with --model: a Qwen3-shaped decoder's token "
                             "time with a bfloat16 and an int8 "
                             "CompactCache, attention_c.bench.cache_model)")
    parser.add_argument("--mha", action="store_true",
                        help="benchmark multi-head attention and decoding "
                             "against torch.nn.MultiheadAttention and "
                             "scaled_dot_product_attention instead "
                             "(attention_c.bench.mha; takes its options)")
    parser.add_argument("--variants", action="store_true",
                        help="benchmark today's variants (window, packed "
                             "sequences, softcap, ALiBi slopes, sinks) "
                             "instead (attention_c.bench.variants; takes its "
                             "options)")
    parser.add_argument("--transformers", action="store_true",
                        help="benchmark attention_c as the attention backend "
                             "of transformers models (training steps, "
                             "generation, peak memory) against sdpa or eager "
                             "instead (attention_c.bench.transformers; takes "
                             "its options)")
    parser.add_argument("--peers", action="store_true",
                        help="benchmark attention against PyTorch SDPA, "
                             "ONNX Runtime, OpenVINO and JAX, those "
                             "installed, each in its own process, instead "
                             "(attention_c.bench.peers; takes its options)")
    options = parser.parse_args(argv)

    def choose(text, allowed, default, what):
        items = [s.strip() for s in text.split(",")] if text else default
        wrong = [s for s in items if s not in allowed]
        if wrong or not items:
            parser.error(f"unknown {what} {wrong}; choose from "
                         f"{', '.join(allowed)}")
        return list(dict.fromkeys(items))

    options.shapes = choose(options.shapes, SHAPES, SHAPES, "shape")
    options.dtypes = choose(options.dtypes, DTYPES,
                            QUICK_DTYPES if options.quick else DTYPES,
                            "dtype")
    options.masks = choose(options.masks, MASKS, MASKS, "mask")
    options.threads = harness.thread_counts(options.threads, parser)
    if options.target is None:
        options.target = 0.02 if options.quick else 0.3
    if options.min_repeats is None:
        options.min_repeats = 2 if options.quick else 6
    if options.compile is None:
        options.compile = not options.quick
    if options.min_repeats < 1:
        parser.error("--min-repeats must be at least 1")
    return options


def main(argv=None):
    """Entry point of ``python -m attention_c.bench``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--family" in argv:
        from attention_c.bench import family
        return family.main([a for a in argv if a != "--family"])
    if "--selfattn" in argv:
        from attention_c.bench import selfattn
        return selfattn.main([a for a in argv if a != "--selfattn"])
    if "--bf16" in argv:
        from attention_c.bench import bf16
        return bf16.main([a for a in argv if a != "--bf16"])
    if "--cache" in argv:
        from attention_c.bench import cache
        return cache.main([a for a in argv if a != "--cache"])
    if "--mha" in argv:
        from attention_c.bench import mha
        return mha.main([a for a in argv if a != "--mha"])
    if "--variants" in argv:
        from attention_c.bench import variants
        return variants.main([a for a in argv if a != "--variants"])
    if "--transformers" in argv:
        from attention_c.bench import transformers
        return transformers.main([a for a in argv
                                  if a != "--transformers"])
    if "--peers" in argv:
        from attention_c.bench import peers
        return peers.main([a for a in argv if a != "--peers"])
    options = parse_args(argv)
    start = time.perf_counter()
    ctx, meta = harness.setup(options)
    sizes = QUICK_SHAPES if options.quick else SHAPES
    ctx.update(shapes=sizes, extra_shapes=QUICK_EXTRA_SHAPES
               if options.quick else EXTRA_SHAPES)
    meta.update(quick=options.quick, masks=options.masks,
                shape_sizes={s: sizes[s] for s in options.shapes},
                peak=harness.peak_facts(meta["config"]["simd"], options.dtypes,
                                        options.threads, options.quick))
    ctx["peak"] = meta["peak"]
    for note in meta["notes"]:
        print(f"NOTE: {note}", file=sys.stderr)
    rows = run_all(options, ctx)
    gemm = run_gemm(options, ctx, meta["peak"])
    calls = run_call_cost(options, ctx)
    add_ratios(rows, meta["peak"])
    add_layer_forward(gemm, rows)
    targets = evaluate_targets(rows)
    meta["wall_seconds"] = time.perf_counter() - start
    meta["load_end"] = harness.load_average()
    print(report(meta, rows, targets, gemm, calls))
    print(f"\nTotal {meta['wall_seconds']:.0f} s; load average at end "
          f"{format_load(meta['load_end'])}")
    if options.json:
        write_json(options.json, meta, rows, targets, gemm, calls)
        print(f"wrote {options.json}")
    if options.write_docs:
        write_page(options.write_docs, layer_sections(meta, rows))
        print(f"wrote {options.write_docs}")
    if options.plot:
        try:
            make_plot(options.plot, rows, meta)
        except ImportError as exc:
            print(f"cannot plot ({exc}); pip install matplotlib",
                  file=sys.stderr)
            return 1
        print(f"wrote {options.plot}")
    return 0
