"""Inside the models people run (issue 27, "Measured"): attention_c as
the attention backend of Hugging Face transformers against sdpa or eager.

``python -m attention_c.bench --transformers`` (or ``python -m
attention_c.bench.transformers``) runs it; ``--help`` lists the options,
``--quick`` runs tiny configs in seconds.  PyTorch and transformers are
required.

Models are built from configs only (random weights, no hub), float32, at
every thread count asked for (default 1 and 2; ours through
``attention_c.set_num_threads``, PyTorch through
``torch.set_num_threads``).  Each figure is a ratio of medians of
``harness.measure`` (interleaved rounds after warm-up) whose two sides,
the same weights under ``attn_implementation="attention_c"`` and under
the baseline, were timed together in the same call:

* a Llama-like model (4 layers, hidden 512, 8 heads, 2 key/value heads,
  intermediate 1024, vocabulary 1000): a training step (forward and
  backward of the LM loss) at B = 1, T = 2048 / sdpa; 64 tokens greedily
  generated after a 1024-token prompt / sdpa;
* T5 (d_model 256, 4 layers, 4 heads): a training step at B = 4, T = 256
  (encoder and decoder) / sdpa;
* Gemma 2 (softcap on, hidden 256, 4 layers, 4 heads, window 256) and
  gpt-oss (sinks, a small config): a training step at T = 1024 / eager
  (sdpa cannot run softcap, and ignores the sinks);
* Mistral with a sliding window of 256: a training step at T = 4096 /
  sdpa (which gets a dense mask);
* the peak memory of one training step of the Llama-like model, Gemma 2
  and gpt-oss, ours and the baseline each in a fresh process
  (``harness.memory_children``).

Accuracy, before timing: on a short input every model's logits under
ours are compared with the baseline's (normwise, float32 tolerance); a
model that disagrees is not timed and the run fails, so a wrong fast
result is never reported.
"""

import argparse
import copy
import gc
import importlib
import json
import os
import sys
import time

from attention_c.bench import harness
from attention_c.bench.docs_page import markdown_table, write_page
from attention_c.bench.report import format_load

_cell = harness.per_threads          # a value per thread count

OURS = "attention_c"
TOLERANCE = 1e-4         # float32 logits, normwise against the baseline
MiB = 2.0 ** 20

# Sizes: the configs' dimensions and the lengths of each task.
SIZES = {
    "llama": {"hidden": 512, "layers": 4, "heads": 8, "kv_heads": 2,
              "intermediate": 1024, "vocab": 1000},
    "t5": {"d_model": 256, "layers": 4, "heads": 4, "vocab": 1000},
    "gemma2": {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2,
               "window": 256, "vocab": 1000},
    "gpt_oss": {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2,
                "window": 128, "experts": 4, "vocab": 1000},
    "mistral": {"hidden": 512, "layers": 4, "heads": 8, "kv_heads": 2,
                "intermediate": 1024, "window": 256, "vocab": 1000},
    "lengths": {"llama_train": (1, 2048), "llama_prompt": 1024,
                "llama_new": 64, "t5_train": (4, 256),
                "long_train": (1, 1024), "mistral_train": (1, 4096),
                "check": (2, 48)},
}
QUICK_SIZES = {
    "llama": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
              "intermediate": 96, "vocab": 101},
    "t5": {"d_model": 32, "layers": 2, "heads": 4, "vocab": 101},
    "gemma2": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
               "window": 16, "vocab": 101},
    "gpt_oss": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
                "window": 16, "experts": 4, "vocab": 101},
    "mistral": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
                "intermediate": 96, "window": 16, "vocab": 101},
    "lengths": {"llama_train": (1, 64), "llama_prompt": 32,
                "llama_new": 8, "t5_train": (2, 32),
                "long_train": (1, 64), "mistral_train": (1, 96),
                "check": (2, 24)},
}

# The figures: (case, model, task, baseline, lengths key, target).
CASES = (
    ("llama train", "llama", "train", "sdpa", "llama_train", 0.85),
    ("llama generate", "llama", "generate", "sdpa", None, 0.9),
    ("t5 train", "t5", "train", "sdpa", "t5_train", 1.2),
    ("gemma2 train", "gemma2", "train", "eager", "long_train", 0.5),
    ("gpt_oss train", "gpt_oss", "train", "eager", "long_train", 0.5),
    ("mistral train", "mistral", "train", "sdpa", "mistral_train", 0.6),
)
# Peak memory of one training step: (model, lengths key, target).
MEMORY = (
    ("llama", "llama_train", 1.0),
    ("gemma2", "long_train", 0.5),
    ("gpt_oss", "long_train", 0.5),
)
BASELINE = {"llama": "sdpa", "t5": "sdpa", "gemma2": "eager",
            "gpt_oss": "eager", "mistral": "sdpa"}


# --------------------------------------------------------------------------
# Models

def make_config(transformers, model, sizes):
    """The transformers config of ``model`` at ``sizes`` (no dropout, so
    that both sides compute the same step)."""
    s = sizes[model]
    longest = 2 * max(max(v) if isinstance(v, tuple) else v
                      for v in sizes["lengths"].values()) + 128
    if model in ("llama", "mistral"):
        cls = (transformers.LlamaConfig if model == "llama"
               else transformers.MistralConfig)
        kw = {"sliding_window": s["window"]} if model == "mistral" else {}
        return cls(vocab_size=s["vocab"], hidden_size=s["hidden"],
                   intermediate_size=s["intermediate"],
                   num_hidden_layers=s["layers"],
                   num_attention_heads=s["heads"],
                   num_key_value_heads=s["kv_heads"],
                   max_position_embeddings=longest, attention_dropout=0.0,
                   **kw)
    if model == "t5":
        return transformers.T5Config(
            vocab_size=s["vocab"], d_model=s["d_model"],
            d_kv=s["d_model"] // s["heads"], num_heads=s["heads"],
            d_ff=4 * s["d_model"], num_layers=s["layers"], dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0)
    head_dim = s["hidden"] // s["heads"]
    if model == "gemma2":
        return transformers.Gemma2Config(
            vocab_size=s["vocab"], hidden_size=s["hidden"],
            intermediate_size=2 * s["hidden"], head_dim=head_dim,
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            max_position_embeddings=longest, sliding_window=s["window"],
            query_pre_attn_scalar=head_dim, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, attention_dropout=0.0)
    return transformers.GptOssConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"],
        intermediate_size=s["hidden"], head_dim=head_dim,
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], num_local_experts=s["experts"],
        num_experts_per_tok=2, sliding_window=s["window"],
        attention_dropout=0.0)     # its default positions cover them all


def model_class(transformers, model):
    return {"llama": transformers.LlamaForCausalLM,
            "t5": transformers.T5ForConditionalGeneration,
            "gemma2": transformers.Gemma2ForCausalLM,
            "gpt_oss": transformers.GptOssForCausalLM,
            "mistral": transformers.MistralForCausalLM}[model]


def build(torch, transformers, model, impls, sizes, seed):
    """{impl: the model under it}, float32, the same random weights."""
    cfg = make_config(transformers, model, sizes)
    cls = model_class(transformers, model)
    torch.manual_seed(seed)
    models = {}
    for impl in impls:
        m = cls._from_config(copy.deepcopy(cfg), attn_implementation=impl)
        if models:
            m.load_state_dict(next(iter(models.values())).state_dict())
        else:
            with torch.no_grad():
                for name, p in m.named_parameters():
                    if name.endswith("sinks"):   # gpt-oss starts them at 0
                        p.normal_()
        models[impl] = m.float()
    return models


def make_ids(torch, model, sizes, shape, seed):
    """Token ids of ``shape`` (B, T), never 0 (T5's pad)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, sizes[model]["vocab"], shape, generator=g)


def train_step(m, ids):
    """A function running forward + backward of the LM loss."""
    def run():
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()
    m.train()
    return run


def generate(m, prompt, new):
    """A function greedily generating exactly ``new`` tokens."""
    def run():
        return m.generate(prompt, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)
    m.eval()
    return run


# --------------------------------------------------------------------------
# Accuracy

def check_all(ctx):
    """{model: {'logits': error, 'baseline': name}}: our logits against the
    baseline's on a short input, in eval mode."""
    torch, tf, sizes = ctx["torch"], ctx["transformers"], ctx["sizes"]
    found = {}
    for model, base in BASELINE.items():
        models = build(torch, tf, model, (OURS, base), sizes, ctx["seed"])
        ids = make_ids(torch, model, sizes, sizes["lengths"]["check"],
                       ctx["seed"])
        logits = {}
        with torch.no_grad():
            for impl, m in models.items():
                m.eval()
                kw = {"labels": ids} if model == "t5" else {}
                logits[impl] = m(input_ids=ids, **kw).logits.double().numpy()
        err = harness.errors({"logits": logits[OURS]},
                             {"logits": logits[base]})["logits"]
        found[model] = {"logits": err, "baseline": base}
        print(f"  check   {model:<8} / {base}: {err:.1e}", file=sys.stderr)
    return found


# --------------------------------------------------------------------------
# Timing

def run_case(case, threads, ctx):
    """Ours and the baseline on one case, timed together."""
    torch, tf, sizes = ctx["torch"], ctx["transformers"], ctx["sizes"]
    name, model, task, base, key, target = case
    lengths = sizes["lengths"]
    models = build(torch, tf, model, (OURS, base), sizes, ctx["seed"])
    if task == "train":
        shape = lengths[key]
        ids = make_ids(torch, model, sizes, shape, ctx["seed"])
        funcs = {impl: train_step(m, ids)
                 for impl, m in models.items()}
    else:
        shape = (1, lengths["llama_prompt"])
        prompt = make_ids(torch, model, sizes, shape, ctx["seed"])
        funcs = {impl: generate(m, prompt, lengths["llama_new"])
                 for impl, m in models.items()}
    before, start = harness.cpu_seconds(), time.perf_counter()
    with harness.thread_count(threads, ctx["tpc"], torch):
        timed = harness.measure(funcs, ctx["target"], ctx["min_repeats"])
    times = {k: s * 1e3 for k, (s, _) in timed.items()}
    row = {"case": name, "model": model, "task": task, "baseline": base,
           "threads": threads, "shape": list(shape), "times_ms": times,
           "repeats": {k: n for k, (_, n) in timed.items()},
           "ratio": times[OURS] / times[base], "target": target,
           "others_load": harness.others_load(
               before, time.perf_counter() - start)}
    if task == "generate":
        row["new_tokens"] = lengths["llama_new"]
    print(f"  {name:<15} {threads} thr {time.perf_counter() - start:6.1f} s",
          file=sys.stderr)
    return row


# --------------------------------------------------------------------------
# Peak memory, each side in a fresh process

def memory_child(impl, model, sizes_name, threads, seed):
    """Print, as JSON, the growth of the peak RSS during one training step
    of ``model`` under ``impl``, after a warm-up step on a tiny input (the
    gradients then exist: what is measured is the step's own memory)."""
    # imported by name: the type checkers of attention_c (stubtest walks
    # this package) must neither need transformers nor analyse it
    torch = importlib.import_module("torch")
    tf = importlib.import_module("transformers")
    if impl == OURS:
        from attention_c.integrations.transformers import register
        register()
    sizes = QUICK_SIZES if sizes_name == "quick" else SIZES
    key = dict((m, k) for m, k, _ in MEMORY)[model]
    tpc = harness.optional_import("threadpoolctl")
    with harness.thread_count(threads, tpc, torch):
        m = build(torch, tf, model, (impl,), sizes, seed)[impl]
        m.train()
        ids = make_ids(torch, model, sizes, sizes["lengths"][key], seed)
        m(input_ids=ids[:, :16], labels=ids[:, :16]).loss.backward()
        gc.collect()
        method, before = harness.peak_start()
        m(input_ids=ids, labels=ids).loss.backward()
        peak = harness.peak_now(method)
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    harness.print_memory(impl, method, before, peak, params / MiB)
    return 0


def measure_memory(entry, threads, ctx):
    """{'<ours>_mib', '<baseline>_mib', 'ratio', ...} of one model."""
    model, key, target = entry
    base = BASELINE[model]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    found = {"model": model, "baseline": base, "threads": threads,
             "shape": list(ctx["sizes"]["lengths"][key]), "target": target}
    child = harness.memory_children(
        "attention_c.bench.transformers", (OURS, base),
        ["--memory-model", model, "--memory-sizes",
         "quick" if ctx["quick"] else "full", "--threads", str(threads),
         "--seed", str(ctx["seed"])], env, 1800)
    found.update(ours_mib=child[f"{OURS}_mib"],
                 baseline_mib=child[f"{base}_mib"], method=child["method"],
                 params_mib=child["inputs_mib"])
    found["ratio"] = found["ours_mib"] / found["baseline_mib"]
    print(f"  memory  {model:<8} {threads} thr", file=sys.stderr)
    return found


# --------------------------------------------------------------------------
# Targets, report and page

def evaluate(rows, memory):
    """PASS / MISS of every target of issue 27."""
    verdicts = []

    def add(target, case, threads, value, limit, load):
        verdicts.append({
            "target": target, "case": case, "threads": threads,
            "value": value, "limit": limit,
            "status": "PASS" if value <= limit else "MISS",
            "disturbed": load is not None and load > harness.DISTURBED})

    for r in rows:
        add(f"time ours/{r['baseline']}", r["case"], r["threads"],
            r["ratio"], r["target"], r["others_load"])
    for m in memory:
        add(f"memory ours/{m['baseline']}", m["model"], m["threads"],
            m["ratio"], m["target"], None)
    return verdicts


def time_table(rows, targets):
    """A line per case: the times at the fewest threads, the ratio at each
    thread count, the target and the verdicts."""
    status = {(t["case"], t["threads"]): t["status"] for t in targets}
    body = []
    for name, *_ in CASES:
        found = [r for r in rows if r["case"] == name]
        if not found:
            continue
        one = min(found, key=lambda r: r["threads"])
        shape = "×".join(map(str, one["shape"]))
        if one["task"] == "generate":
            shape += f" + {one['new_tokens']} new"
        body.append([
            name, one["baseline"], shape,
            f"{one['times_ms'][OURS]:.4g}",
            f"{one['times_ms'][one['baseline']]:.4g}",
            _cell({r["threads"]: r["ratio"] for r in found}),
            f"≤ {one['target']}",
            _cell({r["threads"]: status[name, r["threads"]]
                   for r in found}, "{}"),
            _cell({r["threads"]: r["others_load"] or 0.0 for r in found},
                  "{:.0%}")])
    return markdown_table(("case", "baseline", "B×T", "ours ms, 1 thr",
                           "baseline ms, 1 thr",
                           "ours / baseline, 1 thr / N thr", "target",
                           "verdict", "others' CPU share"), body)


def memory_table(memory, targets):
    status = {t["case"]: t["status"] for t in targets
              if t["target"].startswith("memory")}
    body = [[m["model"], m["baseline"], "×".join(map(str, m["shape"])),
             f"{m['ours_mib']:.1f} / {m['baseline_mib']:.1f} = "
             f"{m['ratio']:.2f}", f"≤ {m['target']}", status[m["model"]]]
            for m in memory]
    return markdown_table(("model", "baseline", "B×T",
                           "peak MiB ours / baseline", "target", "verdict"),
                          body)


def setup_text(meta):
    threads = " and ".join(map(str, meta["threads"]))
    cfg = meta["config"]
    text = (f"`python -m attention_c.bench --transformers` on {meta['cpu']} "
            f"({meta['cpus']} CPUs available), {meta['date'][:10]}: "
            f"attention_c {cfg['version']} on its **{cfg['simd']}** path, "
            f"PyTorch {meta['torch']}, transformers {meta['transformers']}, "
            f"float32, {threads} threads; one run of "
            f"{meta.get('wall_seconds', 0):.0f} s.  Medians of interleaved "
            f"rounds (at least {meta['min_repeats']} timed runs each, after "
            f"warm-up); the two sides of every ratio were timed together.")
    if meta.get("quick"):
        text += "  A `--quick` run (tiny configs): indicative only."
    return text


def checks_line(checks):
    worst = max(c["logits"] for c in checks.values())
    return (f"- **Checked before timing:** the logits of every model under "
            f"attention_c against its baseline on a short input, worst "
            f"normwise error {worst:.1e} (tolerance {TOLERANCE:g}).")


def sections(meta, checks, rows, memory, targets):
    """{section name: text} of the page."""
    parts = [setup_text(meta), time_table(rows, targets)]
    if memory:
        parts += ["The peak memory is the growth of the peak RSS of one "
                  "training step (after a warm-up step), each side in a "
                  "fresh process, at the largest thread count:",
                  memory_table(memory, targets)]
    parts.append(checks_line(checks) + "\n"
                 + harness.targets_line(targets, 27))
    return {"transformers": "\n\n".join(parts)}


def report(meta, checks, rows, memory, targets):
    """The whole text report."""
    lines = [
        f"CPU: {meta['cpu']} ({meta['cpus']} CPUs available)",
        f"attention_c {meta['config']['version']}, SIMD path "
        f"{meta['config']['simd']}; PyTorch {meta['torch']}; transformers "
        f"{meta['transformers']}; load average at start "
        f"{format_load(meta['load_start'])}",
        "transformers models from configs (random weights), float32, "
        "attention_c against sdpa or eager, ratios of medians timed "
        "together.",
    ]
    if meta["quick"]:
        lines.append("--quick: tiny configs, indicative only.")
    lines += ["", time_table(rows, targets), ""]
    if memory:
        lines += [memory_table(memory, targets), ""]
    lines += [checks_line(checks), harness.targets_line(targets, 27),
              harness.targets_count(targets)]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Command line

def parse_args(argv):
    """The options of ``python -m attention_c.bench --transformers``."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c.bench --transformers",
        description="Benchmark attention_c as the attention backend of "
                    "transformers models (Llama-like, T5, Gemma 2, gpt-oss, "
                    "Mistral; random weights from configs), training steps "
                    "and generation, float32, against sdpa or eager, with "
                    "the targets of issue 27.")
    harness.add_run_options(parser, "transformers")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory subprocesses")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--memory-model", help=argparse.SUPPRESS)
    parser.add_argument("--memory-sizes", help=argparse.SUPPRESS)
    return harness.finish_run_options(parser.parse_args(argv), parser)


def main(argv=None):
    """Entry point of ``python -m attention_c.bench --transformers``."""
    options = parse_args(sys.argv[1:] if argv is None else list(argv))
    if options.memory_child:
        return memory_child(options.memory_child, options.memory_model,
                            options.memory_sizes, max(options.threads),
                            options.seed)
    torch = harness.baseline_torch()
    tf = harness.optional_import("transformers")
    if torch is None or tf is None:
        if tf is None:
            print("transformers is required (pip install "
                  "'attention_c[transformers]')", file=sys.stderr)
        return 1
    from attention_c.integrations.transformers import register
    register()
    start = time.perf_counter()
    sizes = QUICK_SIZES if options.quick else SIZES
    options.shapes, options.dtypes = [], ["float32"]
    options.no_torch, options.compile = False, False
    ctx, meta = harness.setup(options)
    ctx.update(torch=torch, transformers=tf, sizes=sizes,
               quick=options.quick)
    meta.update(quick=options.quick, torch=torch.__version__,
                transformers=tf.__version__, sizes=sizes)
    print(f"CPU: {meta['cpu']}", file=sys.stderr)
    checks = check_all(ctx)
    bad = {m: c for m, c in checks.items() if not c["logits"] <= TOLERANCE}
    if bad:
        print(f"ERROR: ours disagrees with the baseline, nothing timed: "
              f"{bad}", file=sys.stderr)
        return 1
    rows = [run_case(case, n, ctx) for case in CASES
            for n in options.threads]
    memory = [] if options.no_memory else [
        measure_memory(entry, max(options.threads), ctx)
        for entry in MEMORY]
    targets = evaluate(rows, memory)
    meta["wall_seconds"] = time.perf_counter() - start
    meta["load_end"] = harness.load_average()
    print(report(meta, checks, rows, memory, targets))
    print(f"\nTotal {meta['wall_seconds']:.0f} s")
    if options.json:
        with open(options.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "checks": checks, "rows": rows,
                       "memory": memory, "targets": targets}, f, indent=1)
            f.write("\n")
        print(f"wrote {options.json}")
    if options.write_docs:
        write_page(options.write_docs,
                   sections(meta, checks, rows, memory, targets))
        print(f"wrote {options.write_docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
