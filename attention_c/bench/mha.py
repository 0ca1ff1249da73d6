"""Multi-head attention (issue 20) against PyTorch: the module, a decode
step on a key/value cache, and the module's decode step with a KVCache.

``python -m attention_c.bench.mha`` runs it; ``--help`` lists the options,
``--quick`` runs tiny sizes in seconds.  PyTorch is required (it is the
baseline).  Float32, in one process, at 1 thread and at every other count
asked for (default 1 and 2; ours through ``attention_c.set_num_threads``,
PyTorch through ``torch.set_num_threads``, both the same).  Every time is
a median of ``harness.measure`` (interleaved rounds after warm-up) or,
for the module's decode step, of ``measure_steps`` (the same rounds).

1. **The module**, forward + backward, self-attention, (B, T, E, heads)
   = MODULE_SHAPE, ``batch_first=True``:
   ``attention_c.torch.MultiheadAttention`` against
   ``torch.nn.MultiheadAttention`` holding the same weights
   (``load_state_dict``), both in training mode (dropout 0).  The loss
   is ``out.sum()``: with ``need_weights=True`` the weights are computed
   (averaged over the heads, the default) but left out of the loss, as
   PyTorch users backpropagate through the output; the gradients are
   those of x and every parameter (``torch.autograd.grad``, nothing
   accumulated).  Cases: ``need_weights=False`` (target <= 0.6),
   ``need_weights=True`` (target <= 0.4), and causal (a bool (T, T)
   ``attn_mask`` with ``is_causal=True``, ``need_weights=False``; no
   target).
2. **A decode step**, under ``torch.no_grad``: one query (1, 8, 1, 64)
   against the first n positions of a cache of 2n, so k and v are strided
   views (1, 8, n, 64).  ``attention_c.torch.scaled_dot_product_attention``
   and the NumPy call ``ac.dot_attention(q, k, values=v,
   return_weights=False)`` on the same memory against
   ``torch.nn.functional.scaled_dot_product_attention`` (SDPA), per call.
   Target <= 0.5 at n = 1024 (both ours); n = 16 gives the fixed cost of
   a tiny call, 128 and 4096 are extra rows.
3. **The module's decode step**, one token, E = 512, 8 heads, a cache of
   about 1024 positions, under ``torch.no_grad``, eval mode: ours with
   ``attention_c.torch.KVCache`` (``mha(x_t, x_t, x_t, cache=cache,
   need_weights=False)``) against ``nn.MultiheadAttention`` given the
   whole prefix as key and value (how PyTorch users decode without a
   cache: every step projects every key again) and against a hand-written
   PyTorch cache (one in-projection of the token, its key and value
   written into preallocated buffers, SDPA on views of them, the
   out-projection: the best form of the baseline).  No target.

Accuracy, before timing: ours and PyTorch in float32 against PyTorch in
float64 on the same data and weights (||x - r|| / ||r||; the module:
out, the weights when asked for, the gradients of x and every parameter;
the decode steps: out).
"""

import argparse
import gc
import statistics
import sys
import time

import numpy as np

import attention_c as ac
from attention_c.bench import harness
from attention_c.bench.docs_page import (NOT_MEASURED, markdown_table,
                                         write_page)
from attention_c.bench.report import emit, format_table, header_lines

# (B, T, E, heads) of the module; --quick: tiny sizes with the same roles.
MODULE_SHAPE, QUICK_MODULE_SHAPE = (8, 512, 512, 8), (2, 32, 64, 4)
MODULE_CASES = ("no_weights", "weights", "causal")
# The decode step: (heads, d), and the cache lengths; the third is the
# one the target is set for, the first the tiny call (fixed cost).
DECODE_HEADS = (8, 64)
DECODE_CACHES, QUICK_DECODE_CACHES = (16, 128, 1024, 4096), (16, 32, 128,
                                                             256)
DECODE_TARGET_INDEX = 2
# The module's decode step: (E, heads, cache, window); each fill of the
# cache is followed by ``window`` steps around the cache length.
STEP_SHAPE, QUICK_STEP_SHAPE = (512, 8, 1024, 32), (64, 4, 64, 8)
# Targets: (part, case or None for the decode's target cache, ratio,
# limit, text).
TARGETS = (
    ("module", "no_weights", "ours/torch", 0.9, "<= 0.9 (issue 26)"),
    ("module", "no_weights", "ours/torch", 0.6, "<= 0.6"),
    ("module", "weights", "ours/torch", 0.4, "<= 0.4"),
    ("decode", None, "ours/sdpa", 0.5, "<= 0.5"),
    ("decode", None, "numpy/sdpa", 0.5, "<= 0.5"),
)
TOLERANCE = 1e-4         # float32 against float64, normwise
MODULE_TEXT = {
    "no_weights": "need_weights=False",
    "weights": "need_weights=True (averaged)",
    "causal": "causal, need_weights=False",
}


def ours_api():
    """(MultiheadAttention, scaled_dot_product_attention, KVCache) of
    attention_c.torch."""
    import attention_c.torch as act
    return (act.MultiheadAttention, act.scaled_dot_product_attention,
            act.KVCache)


def _named_grads(names, grads):
    return {"d" + n: g.detach().double().numpy()
            for n, g in zip(names, grads)}


# --------------------------------------------------------------------------
# 1. The module, forward + backward

def module_problem(torch, shape, seed):
    """x (B, T, E), the causal mask (T, T) (True = not allowed) and the
    state_dict of a fresh nn.MultiheadAttention."""
    B, T, E, heads = shape
    rng = np.random.default_rng([seed, B, T, E, heads])
    x = torch.from_numpy(rng.standard_normal((B, T, E), dtype=np.float32))
    torch.manual_seed(seed)
    state = torch.nn.MultiheadAttention(E, heads, batch_first=True
                                        ).state_dict()
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    return {"x": x, "state": state, "causal": causal, "shape": shape,
            "embed": (E, heads)}


def make_module(cls, p, dtype):
    """A module of class ``cls`` (batch_first) with the weights of the
    problem ``p`` in ``dtype``."""
    mha = cls(*p["embed"], batch_first=True, dtype=dtype)
    mha.load_state_dict({k: v.to(dtype) for k, v in p["state"].items()})
    return mha


def module_call(torch, mha, p, case, dtype):
    """A function of no argument: one forward + backward of ``mha`` on the
    case, returning (out, weights, gradients of x and the parameters)."""
    x = p["x"].to(dtype).requires_grad_(True)
    leaves = [x] + list(mha.parameters())
    kwargs = {"need_weights": case == "weights"}
    if case == "causal":
        kwargs.update(attn_mask=p["causal"], is_causal=True)

    def fwdbwd():
        out, weights = mha(x, x, x, **kwargs)
        return out, weights, torch.autograd.grad(out.sum(), leaves)

    return fwdbwd


def module_result(torch, mha, p, case, dtype):
    """{out, weights, dx, d<parameter>...} as float64 arrays."""
    out, weights, grads = module_call(torch, mha, p, case, dtype)()
    names = ["x"] + [n for n, _ in mha.named_parameters()]
    found = {"out": out.detach().double().numpy()}
    if weights is not None:
        found["weights"] = weights.detach().double().numpy()
    found.update(_named_grads(names, grads))
    return found


def run_module(torch, ctx, threads, p, case, exact):
    """Check and time ours and nn.MultiheadAttention on one case."""
    ours_cls = ours_api()[0]
    row = {"part": "module", "case": case, "size": list(p["shape"]),
           "threads": threads}
    ours = make_module(ours_cls, p, torch.float32)
    theirs = make_module(torch.nn.MultiheadAttention, p, torch.float32)
    row["errors"] = {
        name: harness.errors(module_result(torch, m, p, case,
                                           torch.float32), exact)
        for name, m in (("ours", ours), ("torch", theirs))}
    funcs = {"ours": module_call(torch, ours, p, case, torch.float32),
             "torch": module_call(torch, theirs, p, case, torch.float32)}
    _time(row, funcs, ctx, scale=1e3, unit="ms")
    row["ratios"] = {"ours/torch": row["times_ms"]["ours"]
                     / row["times_ms"]["torch"]}
    return row


def _time(row, funcs, ctx, scale, unit, measure=None):
    """Time ``funcs`` into ``row`` (times in ``unit``, the other
    processes' CPU share meanwhile)."""
    before, start = harness.cpu_seconds(), time.perf_counter()
    timed = (measure or harness.measure)(funcs, ctx["target"],
                                         ctx["min_repeats"])
    row["others_load"] = harness.others_load(before,
                                             time.perf_counter() - start)
    row[f"times_{unit}"] = {k: s * scale for k, (s, _) in timed.items()}
    row["repeats"] = {k: n for k, (_, n) in timed.items()}


# --------------------------------------------------------------------------
# 2. A decode step on a cache

def decode_problem(n, seed):
    """q (1, heads, 1, d) and the views k, v (1, heads, n, d) of caches
    of 2n positions, float32 NumPy arrays."""
    heads, d = DECODE_HEADS
    rng = np.random.default_rng([seed, n])
    q = rng.standard_normal((1, heads, 1, d), dtype=np.float32)
    kbuf, vbuf = (rng.standard_normal((1, heads, 2 * n, d),
                                      dtype=np.float32) for _ in range(2))
    return {"q": q, "k": kbuf[:, :, :n], "v": vbuf[:, :, :n], "n": n}


def decode_functions(torch, p):
    """Ours (torch and NumPy) and SDPA on the problem, run under
    no_grad by the caller; each returns out."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ours_sdpa = ours_api()[1]
    q, k, v = (torch.from_numpy(p[n]) for n in ("q", "k", "v"))
    nq, nk, nv = p["q"], p["k"], p["v"]
    return {"ours": lambda: ours_sdpa(q, k, v),
            "numpy": lambda: ac.dot_attention(nq, nk, values=nv,
                                              return_weights=False)[0],
            "sdpa": lambda: sdpa(q, k, v)}


def run_decode(torch, ctx, threads, n):
    """Check and time one decode call at cache length n."""
    p = decode_problem(n, ctx["seed"])
    row = {"part": "decode", "case": f"cache {n}", "size": [n],
           "threads": threads}
    with torch.no_grad():
        funcs = decode_functions(torch, p)
        exact = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(p[x]).double() for x in ("q", "k", "v")))
        exact = {"out": exact.numpy()}
        row["errors"] = {
            name: harness.errors({"out": np.asarray(f(), np.float64)},
                                 exact)
            for name, f in funcs.items()}
        _time(row, funcs, ctx, scale=1e6, unit="us")
    t = row["times_us"]
    row["ratios"] = {"ours/sdpa": t["ours"] / t["sdpa"],
                     "numpy/sdpa": t["numpy"] / t["sdpa"]}
    return row


# --------------------------------------------------------------------------
# 3. The module's decode step with a cache

def measure_steps(impls, target, min_repeats):
    """Median seconds of one decode step of each implementation, and its
    number of samples.

    ``impls`` maps a name to (fill, step, window): ``fill()`` resets the
    implementation's cache to its starting length, ``step()`` decodes one
    token (growing the cache by one).  harness.measure cannot time these,
    since every call changes the next; here, in harness.ROUNDS rounds
    (order reversed every other round), every implementation in turn
    fills its cache (untimed), takes one untimed step to warm up, then
    ``window`` timed steps, and fills and steps again until about target
    / ROUNDS seconds have passed and min_repeats / ROUNDS samples are
    taken.  Whole windows only, so the cache lengths of the samples are
    the same for everyone and centred where the caller put them.
    """
    clock = time.perf_counter
    budget = target / harness.ROUNDS
    least = -(-min_repeats // harness.ROUNDS)
    samples = {key: [] for key in impls}
    order = list(impls)
    gc.collect()
    gc.disable()
    try:
        for r in range(harness.ROUNDS):
            for key in order if r % 2 == 0 else order[::-1]:
                fill, step, window = impls[key]
                times, n, begin = samples[key], 0, clock()
                while n < least or clock() - begin < budget:
                    fill()
                    step()
                    for _ in range(window):
                        start = clock()
                        step()
                        times.append(clock() - start)
                    n += window
    finally:
        gc.enable()
    return {key: (statistics.median(s), len(s)) for key, s in samples.items()}


def step_problem(torch, shape, seed):
    """The tokens X (1, cache + window + 1, E) and the state_dict of a
    fresh nn.MultiheadAttention."""
    E, heads, n, window = shape
    rng = np.random.default_rng([seed, E, heads, n])
    X = torch.from_numpy(rng.standard_normal((1, n + window + 1, E),
                                             dtype=np.float32))
    torch.manual_seed(seed)
    state = torch.nn.MultiheadAttention(E, heads, batch_first=True
                                        ).state_dict()
    return {"X": X, "state": state, "shape": shape, "embed": (E, heads)}


def step_impls(torch, p, start):
    """{name: (fill, step, window)}: ours with a KVCache, nn.MHA given the
    whole prefix, and a hand-written torch cache with SDPA; each fill
    leaves ``start`` positions cached, each step returns the token's
    output and moves to the next token.  Run under no_grad."""
    F = torch.nn.functional
    E, heads, n, window = p["shape"]
    d = E // heads
    X = p["X"]
    ours_cls, _, cache_cls = ours_api()
    ours = make_module(ours_cls, p, torch.float32).eval()
    ref = make_module(torch.nn.MultiheadAttention, p, torch.float32).eval()
    pos = {}
    capacity = start + window + 2
    cache = cache_cls(capacity)

    def ours_fill():
        cache.reset()
        prefix = X[:, :start]
        ours(prefix, prefix, prefix, cache=cache, need_weights=False)
        pos["ours"] = start

    def ours_step():
        i = pos["ours"]
        x = X[:, i:i + 1]
        pos["ours"] = i + 1
        return ours(x, x, x, cache=cache, need_weights=False)[0]

    def prefix_fill():
        pos["prefix"] = start

    def prefix_step():
        i = pos["prefix"]
        pos["prefix"] = i + 1
        seen = X[:, :i + 1]
        return ref(X[:, i:i + 1], seen, seen, need_weights=False)[0]

    w_in, b_in = ref.in_proj_weight, ref.in_proj_bias
    w_out, b_out = ref.out_proj.weight, ref.out_proj.bias
    kbuf, vbuf = (torch.empty(1, heads, capacity, d) for _ in range(2))

    def cache_fill():
        kv = F.linear(X[:, :start], w_in[E:], b_in[E:])
        k, v = kv.view(1, start, 2, heads, d).permute(2, 0, 3, 1, 4)
        kbuf[:, :, :start], vbuf[:, :, :start] = k, v
        pos["cache"] = start

    def cache_step():
        i = pos["cache"]
        pos["cache"] = i + 1
        q, k, v = F.linear(X[:, i:i + 1], w_in, b_in).view(
            1, 3, heads, 1, d).unbind(1)
        kbuf[:, :, i:i + 1], vbuf[:, :, i:i + 1] = k, v
        o = F.scaled_dot_product_attention(q, kbuf[:, :, :i + 1],
                                           vbuf[:, :, :i + 1])
        return F.linear(o.reshape(1, 1, E), w_out, b_out)

    return {"ours": (ours_fill, ours_step, window),
            "prefix": (prefix_fill, prefix_step, window),
            "cache": (cache_fill, cache_step, window)}


def run_step(torch, ctx, threads, p):
    """Check and time the module's decode step."""
    E, heads, n, window = p["shape"]
    row = {"part": "step", "case": f"cache {n}", "size": [E, heads, n],
           "threads": threads, "window": window}
    with torch.no_grad():
        # Checked on the step that sees exactly n positions.
        impls = step_impls(torch, p, n - 1)
        ref = make_module(torch.nn.MultiheadAttention, p,
                          torch.float64).eval()
        X = p["X"].double()
        exact = {"out": ref(X[:, n - 1:n], X[:, :n], X[:, :n],
                            need_weights=False)[0].numpy()}
        row["errors"] = {}
        for name, (fill, step, _) in impls.items():
            fill()
            out = step().double().numpy()
            row["errors"][name] = harness.errors({"out": out}, exact)
        # After a fill and the warm-up step, the timed steps see n -
        # window / 2 + 1 ... n + window / 2 positions: centred on n.
        impls = step_impls(torch, p, n - window // 2 - 1)
        _time(row, impls, ctx, scale=1e6, unit="us", measure=measure_steps)
    t = row["times_us"]
    row["ratios"] = {"ours/prefix": t["ours"] / t["prefix"],
                     "ours/cache": t["ours"] / t["cache"]}
    return row


# --------------------------------------------------------------------------
# Running and the targets

def run_all(options, ctx):
    """The parts asked for, at every thread count; returns the rows."""
    torch, rows = ctx["torch"], []

    def timed(label, threads, fn, *args):
        start = time.perf_counter()
        with harness.thread_count(threads, ctx["tpc"], torch):
            row = fn(torch, ctx, threads, *args)
        rows.append(row)
        for name, errs in row["errors"].items():
            bad = {k: e for k, e in errs.items() if not e <= TOLERANCE}
            if bad:
                print(f"WARNING: {name} is inaccurate on {row['part']} "
                      f"{row['case']} {threads} thr: {bad}",
                      file=sys.stderr)
        print(f"  {label:<28} {threads} thr "
              f"{time.perf_counter() - start:6.1f} s", file=sys.stderr)

    if "module" in options.parts:
        p = module_problem(torch, ctx["module_shape"], ctx["seed"])
        for case in MODULE_CASES:
            exact = module_result(torch, make_module(
                torch.nn.MultiheadAttention, p, torch.float64), p, case,
                torch.float64)
            for threads in options.threads:
                timed(f"module {case}", threads, run_module, p, case,
                      exact)
    if "decode" in options.parts:
        for n in ctx["decode_caches"]:
            for threads in options.threads:
                timed(f"decode cache {n}", threads, run_decode, n)
    if "step" in options.parts:
        p = step_problem(torch, ctx["step_shape"], ctx["seed"])
        for threads in options.threads:
            timed(f"step cache {p['shape'][2]}", threads, run_step, p)
    return rows


def evaluate(rows, decode_target):
    """One entry per (target, row) it applies to, with PASS or MISS."""
    results = []
    for part, case, ratio, limit, text in TARGETS:
        case = case or f"cache {decode_target}"
        for row in rows:
            if (row["part"], row["case"]) != (part, case):
                continue
            value = row["ratios"][ratio]
            results.append({
                "part": part, "case": row["case"], "target": ratio,
                "threads": row["threads"], "ratio": value, "limit": limit,
                "text": text, "status": "PASS" if value <= limit else "MISS",
                "disturbed": (row["others_load"] or 0) > harness.DISTURBED})
    return results


def verdicts(targets, row):
    """'ratio <= limit: PASS' for each target of ``row``, or '(none)'."""
    found = [t for t in targets if t["part"] == row["part"]
             and t["case"] == row["case"] and t["threads"] == row["threads"]]
    return "; ".join(f"{t['target']} {t['text']}: {t['status']}"
                     + "*" * t["disturbed"] for t in found) or "(none)"


# --------------------------------------------------------------------------
# The text report

def _cell(value, digits=3):
    return f"{value:.{digits}g}" if value < 1000 else f"{value:.0f}"


def _share(row):
    share = row.get("others_load")
    return "?" if share is None else f"{share:.0%}"


def report(meta, rows, targets):
    """The whole text report."""
    parts = header_lines(meta)
    if meta["quick"]:
        parts.append("--quick: tiny sizes, indicative only.")
    found = {part: [r for r in rows if r["part"] == part]
             for part in ("module", "decode", "step")}
    if found["module"]:
        B, T, E, heads = meta["module_shape"]
        parts += [
            "",
            "1. MultiheadAttention, forward + backward (loss out.sum(); "
            "weights, when asked for, computed but not in the loss),",
            f"   self-attention, (B, T, E, heads) = ({B}, {T}, {E}, "
            f"{heads}), batch_first; ours / nn.MultiheadAttention:",
            format_table(
                ["case", "thr", "ours ms", "torch ms", "ours/torch",
                 "target", "others"],
                [[MODULE_TEXT[r["case"]], str(r["threads"]),
                  _cell(r["times_ms"]["ours"]),
                  _cell(r["times_ms"]["torch"]),
                  f"{r['ratios']['ours/torch']:.2f}",
                  verdicts(targets, r), _share(r)]
                 for r in found["module"]], left=2)]
    if found["decode"]:
        heads, d = DECODE_HEADS
        parts += [
            "",
            f"2. Decode step, q (1, {heads}, 1, {d}) against views (1, "
            f"{heads}, n, {d}) of a cache of 2n, no_grad, per call;",
            "   ours = attention_c.torch.scaled_dot_product_attention, "
            "numpy = ac.dot_attention(return_weights=False):",
            format_table(
                ["cache n", "thr", "ours us", "numpy us", "SDPA us",
                 "ours/sdpa", "numpy/sdpa", "target", "others"],
                [[str(r["size"][0]), str(r["threads"])]
                 + [_cell(r["times_us"][k]) for k in ("ours", "numpy",
                                                      "sdpa")]
                 + [f"{r['ratios'][k]:.2f}" for k in ("ours/sdpa",
                                                      "numpy/sdpa")]
                 + [verdicts(targets, r), _share(r)]
                 for r in found["decode"]], left=1)]
    if found["step"]:
        E, heads, n, window = meta["step_shape"]
        parts += [
            "",
            f"3. Module decode step, one token, E = {E}, {heads} heads, "
            f"cache n +- {window // 2}, no_grad, eval, per step:",
            "   ours = MultiheadAttention with KVCache; prefix = "
            "nn.MultiheadAttention given the whole prefix;",
            "   cache = a hand-written torch cache + F.sdpa:",
            format_table(
                ["cache n", "thr", "ours us", "prefix us", "cache us",
                 "ours/prefix", "ours/cache", "target", "others"],
                [[str(r["size"][2]), str(r["threads"])]
                 + [_cell(r["times_us"][k]) for k in ("ours", "prefix",
                                                      "cache")]
                 + [f"{r['ratios'][k]:.2f}" for k in ("ours/prefix",
                                                      "ours/cache")]
                 + [verdicts(targets, r), _share(r)]
                 for r in found["step"]], left=1)]
    counts = [t["status"] for t in targets]
    worst = {}
    for r in rows:
        for name, errs in r["errors"].items():
            key = f"{r['part']} {name}"
            worst[key] = max(worst.get(key, 0.0), *errs.values())
    parts += [
        "",
        f"Ratios < 1: ours faster.  *: other processes used more than "
        f"{harness.DISTURBED:.0%} of the CPUs while timing.  Targets: "
        f"{counts.count('PASS')} PASS, {counts.count('MISS')} MISS.",
        "Accuracy before timing (worst ||x - r|| / ||r||, r: PyTorch in "
        "float64): " + ", ".join(f"{k} {e:.1e}" for k, e in worst.items())
        + "."]
    return "\n".join(parts)


# --------------------------------------------------------------------------
# The section of docs/performance.md

SECTION = "mha"
HEADING = "## Multi-head attention and decoding, measured"


def _pair(rows, key):
    """'x / y' of the rows' ratio ``key`` (at each thread count)."""
    return " / ".join(f"{r['ratios'][key]:.2f}" for r in rows)


def _loads(rows):
    """'x% / y%' of the CPU share other processes used while the rows
    were timed ('?' where unknown)."""
    return " / ".join(_share(r) for r in rows)


def _target_cell(targets, rows, ratios):
    """'[label] <= limit: PASS / MISS' of each of ``ratios`` ({ratio:
    label}) that has a target on the rows, or '(none)'."""
    cells = []
    for ratio, label in ratios.items():
        found = [t for r in rows for t in targets if t["target"] == ratio
                 and t["part"] == r["part"] and t["case"] == r["case"]
                 and t["threads"] == r["threads"]]
        if found:
            cells.append(f"{label}≤ {found[0]['limit']:g}: " + " / ".join(
                t["status"] + "*" * t["disturbed"] for t in found))
    return "; ".join(cells) or "(none)"


def _setup_text(meta, rows):
    """Where, how, on which SIMD path and threads the run was made."""
    cfg, threads = meta["config"], meta["threads"]
    loads = [r["others_load"] for r in rows if r["others_load"] is not None]
    busy = (f"other processes used at most {max(loads):.0%} of the CPUs "
            f"while a row was timed" if loads else
            "the CPU use of other processes was not measured")
    text = (
        f"`python -m attention_c.bench.mha` on {meta['cpu']} "
        f"({meta['cpus']} CPUs available), {meta['date'][:10]}: attention_c "
        f"{cfg['version']} on its **{cfg['simd']}** path (the best of this "
        f"CPU: {cfg['simd_best']}), PyTorch {meta['torch']}, float32, "
        f"{' and '.join(map(str, threads))} "
        f"thread{'s' if threads != [1] else ''} for both "
        f"(`attention_c.set_num_threads`, `torch.set_num_threads`); one "
        f"run of {meta.get('wall_seconds', 0):.0f} s in which {busy}.  "
        f"Medians of interleaved rounds after warm-up (at least "
        f"{meta['min_repeats']} timed "
        f"run{'s' if meta['min_repeats'] > 1 else ''} each); ratios below "
        f"1 mean attention_c is faster; pairs of numbers are at "
        f"{' / '.join(f'{n} thr' for n in threads)}; * marks a verdict on "
        f"a row timed while other processes used more than "
        f"{harness.DISTURBED:.0%} of the CPUs.")
    if meta.get("quick"):
        text += "  A `--quick` run (tiny sizes): indicative only."
    return text


def docs_section(meta, rows, targets):
    """The text of the ``mha`` section: setup, three tables, targets."""
    first = f"{meta['threads'][0]} thr"
    pairs = " / ".join(f"{n} thr" for n in meta["threads"])
    groups = {}
    for r in rows:
        groups.setdefault((r["part"], r["case"]), []).append(r)

    def table(part, head, cells):
        body = [cells(case, rs) + [_loads(rs)]
                for (p, case), rs in groups.items() if p == part]
        head = [h.format(first=first, pairs=pairs) for h in head]
        return (markdown_table(head + [f"others' CPU share, {pairs}"], body)
                if body else NOT_MEASURED)

    B, T, E, heads = meta["module_shape"]
    text = [_setup_text(meta, rows), (
        f"**`MultiheadAttention`, forward + backward**, self-attention, "
        f"(B, T, E, heads) = ({B}, {T}, {E}, {heads}), `batch_first`, "
        f"against `nn.MultiheadAttention` holding the same weights.  The "
        f"loss is `out.sum()`: with `need_weights=True` the weights "
        f"(averaged over the heads) are computed but left out of the loss; "
        f"the gradients are those of the input and every parameter.  "
        f"Causal: a bool (T, T) `attn_mask` with `is_causal=True`."),
        table("module", ("case", "ours ms, {first}", "torch ms, {first}",
                         "ours / torch, {pairs}", "target"),
              lambda case, rs: [
                  MODULE_TEXT[case], _cell(rs[0]["times_ms"]["ours"]),
                  _cell(rs[0]["times_ms"]["torch"]),
                  _pair(rs, "ours/torch"),
                  _target_cell(targets, rs, {"ours/torch": ""})])]
    heads, d = DECODE_HEADS
    text += [(
        f"**A decode step**: one query (1, {heads}, 1, {d}) against views "
        f"(1, {heads}, n, {d}) of a cache of 2n positions, per call, under "
        f"`torch.no_grad`: ours "
        f"`attention_c.torch.scaled_dot_product_attention` and the NumPy "
        f"call `ac.dot_attention(q, k, values=v, return_weights=False)` on "
        f"the same memory, against `F.scaled_dot_product_attention` "
        f"(SDPA).  The smallest cache gives the fixed cost of a call."),
        table("decode", ("cache n", "ours µs, {first}", "NumPy µs, {first}",
                         "SDPA µs, {first}", "ours / SDPA, {pairs}",
                         "NumPy / SDPA, {pairs}", "target"),
              lambda case, rs: [
                  str(rs[0]["size"][0])]
              + [_cell(rs[0]["times_us"][k]) for k in ("ours", "numpy",
                                                       "sdpa")]
              + [_pair(rs, "ours/sdpa"), _pair(rs, "numpy/sdpa"),
                 _target_cell(targets, rs, {"ours/sdpa": "ours ",
                                            "numpy/sdpa": "NumPy "})])]
    E, heads, _, window = meta["step_shape"]
    text += [(
        f"**The module's decode step**: one token, E = {E}, {heads} heads, "
        f"a cache of n ± {window // 2} positions, per step, under "
        f"`torch.no_grad`: ours with `KVCache` (`mha(x, x, x, cache=cache, "
        f"need_weights=False)`) against `nn.MultiheadAttention` given the "
        f"whole prefix as key and value (decoding without a cache: every "
        f"key projected again at every step) and against a hand-written "
        f"PyTorch cache (the token's in-projection, its key and value "
        f"written into preallocated buffers, SDPA on views of them, the "
        f"out-projection: the baseline's best form)."),
        table("step", ("cache n", "ours µs, {first}",
                       "nn.MHA on the prefix µs, {first}",
                       "torch cache + SDPA µs, {first}",
                       "ours / nn.MHA on the prefix, {pairs}",
                       "ours / torch cache, {pairs}", "target"),
              lambda case, rs: [
                  str(rs[0]["size"][2])]
              + [_cell(rs[0]["times_us"][k]) for k in ("ours", "prefix",
                                                       "cache")]
              + [_pair(rs, "ours/prefix"), _pair(rs, "ours/cache"),
                 "(none)"])]
    missed = [t for t in targets if t["status"] == "MISS"]
    line = (f"- **Targets of issue 20:** {len(targets) - len(missed)} of "
            f"{len(targets)} checks pass")
    if missed:
        line += "; missed: " + "; ".join(dict.fromkeys(
            f"{t['target']} {t['text']} ({t['part']}, {t['case']})"
            for t in missed))
    text.append(line + ".")
    return "\n\n".join(text)


def write_docs(path, text):
    """Rewrite the ``mha`` section of the page at ``path``
    (docs_page.write_page); a page without the section gets it appended,
    under its heading."""
    try:
        with open(path, encoding="utf-8") as f:
            page = f.read()
    except FileNotFoundError:
        page = None
    if page is None or f"<!-- bench:{SECTION} -->" in page:
        write_page(path, {SECTION: text})
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(("" if page.endswith("\n") else "\n")
                + f"\n{HEADING}\n\n<!-- bench:{SECTION} -->\n"
                f"{text.strip(chr(10))}\n<!-- /bench:{SECTION} -->\n")


# --------------------------------------------------------------------------
# Command line

PARTS = ("module", "decode", "step")


def parse_args(argv):
    """The options of ``python -m attention_c.bench.mha``."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c.bench.mha",
        description="Benchmark attention_c.torch.MultiheadAttention "
                    "(forward + backward), a decode step with "
                    "scaled_dot_product_attention and dot_attention on a "
                    "cache, and the module's decode step with a KVCache, "
                    "against PyTorch, float32, against the targets of "
                    "issue 20.")
    harness.add_run_options(parser, "mha")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated, from: " + ", ".join(PARTS)
                        + " (default: all)")
    options = harness.finish_run_options(parser.parse_args(argv), parser)
    options.parts = [s.strip() for s in options.parts.split(",")]
    if not options.parts or set(options.parts) - set(PARTS):
        parser.error(f"--parts: choose from {', '.join(PARTS)}")
    return options


def setup(options, torch):
    """The run's settings and the report's metadata."""
    quick = options.quick
    module_shape = QUICK_MODULE_SHAPE if quick else MODULE_SHAPE
    caches = QUICK_DECODE_CACHES if quick else DECODE_CACHES
    step_shape = QUICK_STEP_SHAPE if quick else STEP_SHAPE
    options.shapes = [f"{part} {size}" for part, size in (
        ("module", module_shape), ("decode", caches),
        ("step", step_shape)) if part in options.parts]
    options.dtypes = ["float32"]
    options.no_torch, options.compile = False, False
    ctx, meta = harness.setup(options)
    ctx.update(torch=torch, module_shape=module_shape,
               decode_caches=caches, step_shape=step_shape)
    meta.update(quick=quick, torch=torch.__version__,
                module_shape=list(module_shape),
                decode_caches=list(caches),
                decode_target=caches[DECODE_TARGET_INDEX],
                decode_heads=list(DECODE_HEADS),
                step_shape=list(step_shape))
    return ctx, meta


def main(argv=None):
    """Entry point of ``python -m attention_c.bench.mha``."""
    options = parse_args(sys.argv[1:] if argv is None else list(argv))
    torch = harness.baseline_torch()
    if torch is None:
        return 1
    start = time.perf_counter()
    ctx, meta = setup(options, torch)
    rows = run_all(options, ctx)
    targets = evaluate(rows, meta["decode_target"])
    meta["wall_seconds"] = time.perf_counter() - start
    meta["load_end"] = harness.load_average()
    emit(options, meta, report(meta, rows, targets),
         {"meta": meta, "results": rows, "targets": targets},
         lambda path: write_docs(path, docs_section(meta, rows, targets)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
