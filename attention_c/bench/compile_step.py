"""A training step under ``torch.compile`` against the same step eager.

``python -m attention_c.bench.compile_step`` trains small models one SGD
step at a time on a fixed random batch and prints the median CPU time of
a step, eager and under ``torch.compile(fullgraph=True)`` (default mode),
and the ratio compiled / eager.  Everything runs in one process at one
thread (``torch.set_num_threads(1)`` and ``attention_c.set_num_threads(1)``),
the variants timed in interleaved rounds.

The models (``--models``):

* ``context``: the bags-of-digits model (issue 13, notebook 02): an MLP over
  each item, context-pooled attention, a BatchNorm head;
* ``additive``: the same MLP over the keys, then additive attention from
  4 learned queries to the keys (the family's ``AdditiveAttention``), the
  4 results concatenated into the head.

Each with three poolings (``--pools``): ``attention_c`` (the modules of
``attention_c.torch``), ``pytorch`` (the same attention written with torch
operations, as in the tests' references), and ``mean`` (a masked mean, no
attention: the model around the attention alone).  And with the MLP's
activation as a choice (``--acts``): for ReLU (and LeakyReLU) inductor
saves a boolean mask for the backward, and on an AVX2 CPU its kernels
that store and load that mask are far slower than the activation itself
(torch 2.13, size small: 1.2 ms a step for the fused ReLU that stores the
mask, 7 us for the same ReLU without it), which makes compiled ReLU
models slower than eager whatever the pooling, the mean included; GELU
and Tanh have no such mask.  The last table, the pooling's own time (its
step minus the mean pooling's step, eager and compiled), tells the
attention apart from the code around it.

Compiled variants compile a function of their own (see ``_own_code``) and
are compiled during the warm-up, which is not timed.
"""

import argparse
import statistics
import sys
import time
import types

from attention_c.bench import harness
from attention_c.bench.report import format_load, format_table

SIZES = {"tiny": (8, 5, 8, 16), "small": (64, 20, 32, 64),
         "medium": (256, 50, 64, 128)}          # B, T, D, H
MODELS = ("context", "additive")
POOLS = ("attention_c", "pytorch", "mean")
ACTS = ("ReLU", "LeakyReLU", "GELU", "Tanh")
QUERIES = 4                                     # of the additive model
QUICK = {"models": ["context"], "sizes": ["small"],
         "acts": ["ReLU", "Tanh"], "repeats": 5, "steps": 20}


def _masked_mean(torch, h, mask):
    m = mask.to(h.dtype).unsqueeze(-1)
    return (h * m).sum(-2) / m.sum(-2).clamp(min=1)


def _pooling(torch, model, pool, H):
    """The pooling module: ``(h, mask) -> (B, P)``, and P."""
    nn = torch.nn
    A = H // 2
    if model == "context":
        if pool == "attention_c":
            from attention_c.torch import ContextAttention
            return ContextAttention(H, A), H
        if pool == "mean":
            return _Mean(torch), H
        from attention_c.testing.pytorch import torch_context_attention

        class PureContext(nn.Module):
            """ContextAttention's W, v, b in PyTorch operations."""

            def __init__(self):
                super().__init__()
                self.W = nn.Parameter(torch.randn(A, 2 * H) / (2 * H) ** .5)
                self.v = nn.Parameter(torch.randn(A) / A ** .5)
                self.b = nn.Parameter(torch.zeros(A))

            def forward(self, h, mask):
                return torch_context_attention(h, self.W, self.v, b=self.b,
                                               mask=mask)[0]

        return PureContext(), H
    return _Queries(torch, pool, H, A), QUERIES * H


def _Mean(torch):
    class Mean(torch.nn.Module):
        """The masked mean of the items: no attention."""

        def forward(self, h, mask):
            return _masked_mean(torch, h, mask)

    return Mean()


def _Queries(torch, pool, H, A):
    from attention_c.testing.pytorch import torch_additive_attention
    nn = torch.nn

    class Queries(nn.Module):
        """Additive attention from QUERIES learned queries to the items;
        the results concatenated (B, QUERIES * H)."""

        def __init__(self):
            super().__init__()
            self.query = nn.Parameter(torch.randn(QUERIES, H))
            if pool == "attention_c":
                from attention_c.torch import AdditiveAttention
                self.attn = AdditiveAttention(H, H, A)
            elif pool == "pytorch":
                self.W = nn.Parameter(torch.randn(A, 2 * H) / (2 * H) ** .5)
                self.v = nn.Parameter(torch.randn(A) / A ** .5)
                self.b = nn.Parameter(torch.zeros(A))

        def forward(self, h, mask):
            q = self.query.expand(h.shape[0], QUERIES, H)
            if pool == "attention_c":
                out = self.attn(q, h, mask=mask)
            elif pool == "pytorch":
                out = torch_additive_attention(q, h, self.W, self.v,
                                               b=self.b, mask=mask)[0]
            else:                               # every query the same
                out = _masked_mean(torch, h, mask).unsqueeze(1).expand(
                    -1, QUERIES, -1)
            return out.flatten(1)

    return Queries()


def build(torch, model, pool, act, size):
    """The model: MLP over the items, pooling, BatchNorm head."""
    nn = torch.nn
    B, T, D, H = size
    activation = getattr(nn, act)
    pooling, P = _pooling(torch, model, pool, H)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.item = nn.Sequential(nn.Linear(D, H), activation(),
                                      nn.Linear(H, H), activation())
            self.pool = pooling
            self.head = nn.Sequential(nn.Linear(P, H), nn.BatchNorm1d(H),
                                      activation(), nn.Linear(H, 10))

        def forward(self, x, mask):
            return self.head(self.pool(self.item(x), mask=mask))

    return Net()


def _own_code(fn, tag):
    """``fn`` with a code object of its own.  Dynamo caches compiled code
    per code object: each variant then has its own cache (no recompile
    limit shared by the variants, no guard search through the others')."""
    code = fn.__code__.replace(co_name=f"step_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name,
                              fn.__defaults__, fn.__closure__)


def make_step(torch, model, pool, act, size, compiled, tag):
    """A function running one SGD step of a fresh model on a fixed random
    batch (the same batch and initial weights for every variant)."""
    B, T, D, _ = size
    torch.manual_seed(0)
    x, y = torch.randn(B, T, D), torch.randint(0, 10, (B,))
    mask = torch.rand(B, T) < 0.7
    mask[:, 0] = True
    net = build(torch, model, pool, act, size)
    run = net
    if compiled:
        run = torch.compile(_own_code(lambda x, m: net(x, m), tag),
                            fullgraph=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(run(x, mask), y)
        loss.backward()
        opt.step()
        return loss

    return step


def measure(funcs, steps, repeats):
    """Median CPU ms per call of each function, timed in interleaved
    rounds of ``steps`` calls; and the CPU share of other processes."""
    times = {n: [] for n in funcs}
    before, wall = harness.cpu_seconds(), time.perf_counter()
    for _ in range(repeats):
        for n, f in funcs.items():
            t = time.process_time()
            for _ in range(steps):
                f()
            times[n].append((time.process_time() - t) / steps * 1e3)
    load = harness.others_load(before, time.perf_counter() - wall)
    return {n: statistics.median(v) for n, v in times.items()}, load


def run(torch, options, out=sys.stdout):
    """Time every variant; returns ``{(model, size, act, pool, compiled):
    ms}`` and prints the tables."""
    results = {}
    loads = []
    for model in options.models:
        for size in options.sizes:
            funcs = {}
            for act in options.acts:
                for pool in options.pools:
                    for compiled in (False, True):
                        key = (model, size, act, pool, compiled)
                        tag = "_".join(str(k) for k in key)
                        funcs[key] = make_step(torch, model, pool, act,
                                               SIZES[size], compiled, tag)
            for f in funcs.values():          # compile, warm up
                for _ in range(3):
                    f()
            t, load = measure(funcs, options.steps, options.repeats)
            results.update(t)
            loads.append(load)
    known = [x for x in loads if x is not None]
    load = (f"{100 * max(known):.0f}% of the CPUs used by other processes "
            f"meanwhile" if known else "load of other processes unknown")
    print(f"CPU ms per SGD step, 1 thread, median of {options.repeats} "
          f"rounds of {options.steps} steps; {load}; load average "
          f"{format_load(harness.load_average())}", file=out)
    print("ratio = compiled / eager (<= 1: compiling pays)\n", file=out)
    body = []
    for (model, size, act, pool, compiled), ms in results.items():
        if compiled:
            continue
        c = results[model, size, act, pool, True]
        body.append([model, size, act, pool, f"{ms:.2f}", f"{c:.2f}",
                     f"{c / ms:.2f}"])
    print(format_table(["model", "size", "act", "pooling", "eager",
                        "compiled", "ratio"], body, left=4), file=out)
    if "mean" in options.pools and len(options.pools) > 1:
        print("\nThe pooling's own ms: its step minus the mean pooling's "
              "step", file=out)
        body = []
        for (model, size, act, pool, compiled), ms in results.items():
            if compiled or pool == "mean":
                continue
            e = ms - results[model, size, act, "mean", False]
            c = (results[model, size, act, pool, True]
                 - results[model, size, act, "mean", True])
            body.append([model, size, act, pool, f"{e:.2f}", f"{c:.2f}"])
        print(format_table(["model", "size", "act", "pooling", "eager",
                            "compiled"], body, left=4), file=out)
    return results


def parse_args(argv):
    """The options, lists expanded and checked."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_c.bench.compile_step",
        description="Time a training step eager and under "
                    "torch.compile(fullgraph=True), with attention_c's "
                    "attention, the same attention in PyTorch and a mean "
                    "pooling, per activation of the MLP.")
    parser.add_argument("--quick", action="store_true",
                        help="the context model, size small, ReLU and "
                             "Tanh, fewer steps (under a minute)")
    parser.add_argument("--models", help="comma-separated, from: "
                        + ", ".join(MODELS) + " (default: all)")
    parser.add_argument("--sizes", help="comma-separated, from: " + ", ".join(
        f"{k} (B, T, D, H) = {v}" for k, v in SIZES.items())
        + " (default: small)")
    parser.add_argument("--acts", help="comma-separated torch.nn "
                        "activations, from: " + ", ".join(ACTS)
                        + " (default: all)")
    parser.add_argument("--pools", help="comma-separated, from: "
                        + ", ".join(POOLS) + " (default: all)")
    parser.add_argument("--repeats", type=int, help="rounds (default 7, 5 "
                        "with --quick)")
    parser.add_argument("--steps", type=int,
                        help="steps per round (default 50, 20 with --quick)")
    options = parser.parse_args(argv)
    quick = QUICK if options.quick else {}
    for name, allowed, default in [
            ("models", MODELS, ["context", "additive"]),
            ("sizes", SIZES, ["small"]), ("acts", ACTS, list(ACTS)),
            ("pools", POOLS, list(POOLS))]:
        text = getattr(options, name)
        items = ([s.strip() for s in text.split(",")] if text
                 else quick.get(name, default))
        wrong = [s for s in items if s not in allowed]
        if wrong or not items:
            parser.error(f"unknown {name} {wrong}; choose from "
                         f"{', '.join(allowed)}")
        setattr(options, name, list(dict.fromkeys(items)))
    for name, default in [("repeats", 7), ("steps", 50)]:
        if getattr(options, name) is None:
            setattr(options, name, quick.get(name, default))
        if getattr(options, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return options


def main(argv=None):
    """Run the benchmark; returns the exit code (0, or 1 without
    PyTorch)."""
    options = parse_args(argv)
    torch = harness.optional_import("torch")
    if torch is None:
        print("compile_step needs PyTorch, which is not importable",
              file=sys.stderr)
        return 1
    import attention_c
    # Before any compiling: inductor specialises its kernels on the
    # thread count.
    torch.set_num_threads(1)
    attention_c.set_num_threads(1)
    # Compile in this process: a pool of compile workers costs more to
    # start than it saves on a few small graphs (--quick: 70 s against
    # 100 s from a cold cache on a loaded 2-core machine).
    from torch._inductor import config
    with config.patch(compile_threads=1):
        run(torch, options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
