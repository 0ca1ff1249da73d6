"""The ratios the layer's benchmark derives from its times, and the
project's performance targets they are held to (PASS / MISS)."""

from attention_c.bench.harness import DISTURBED
from attention_c.bench.run import SHAPES

# Ratios: (name, numerator, denominator).
RATIOS = (
    ("fwd/S1", "ours_fwd", "s1"),
    ("bwd/S1", "ours_bwd", "s1"),
    ("bwd_sv/S1", "ours_bwd_saved", "s1"),
    ("fwd/pt", "ours_fwd", "torch_fwd"),
    ("f+b/pt", "ours_fwdbwd", "torch_fwdbwd"),
    ("fwd/seed", "ours_fwd", "seed_fwd"),
    ("f+b/seed", "ours_fwdbwd", "seed_fwdbwd"),
    ("fwd/cmp", "ours_fwd", "compile_fwd"),
    ("f+b/cmp", "ours_fwdbwd", "compile_fwdbwd"),
    ("fwd/np", "ours_fwd", "ref_fwd"),
    ("f+b/np", "ours_fwdbwd", "ref_fwdbwd"),
)
# Ours at N threads / ours at 1 thread: (name, key).
SCALING = (
    ("fwd N/1", "ours_fwd"),
    ("bwd N/1", "ours_bwd"),
    ("bwd_sv N/1", "ours_bwd_saved"),
    ("f+b N/1", "ours_fwdbwd"),
)


def _limits(default=None, **by_shape):
    """{shape: limit} from a default and per-shape exceptions."""
    return {s: by_shape.get(s, default) for s in SHAPES}


# Targets: (ratio, thread counts it applies to, {shape: limit or None},
# text).  "one": 1 thread; "every": all counts; "many": counts > 1.
_SCALING_LIMITS = _limits(tiny=1.05, small=1.05, large=0.6, long=0.6,
                          wide=0.6)
TARGETS = (
    ("fwd/S1", "one", _limits(1.15, tiny=1.3, small=1.3),
     "<= 1.15 (1.3 where H <= 64)"),
    ("bwd/S1", "one", _limits(3.3), "<= 3.3"),
    ("bwd_sv/S1", "one", _limits(2.3), "<= 2.3"),
    ("fwd/pt", "every", _limits(0.6, tiny=0.1), "<= 0.6 (0.1 on tiny)"),
    ("f+b/pt", "every", _limits(0.8, tiny=0.1), "<= 0.8 (0.1 on tiny)"),
    ("fwd/cmp", "every", _limits(1.0), "< 1"),
    ("f+b/cmp", "every", _limits(1.0), "< 1"),
    ("fwd N/1", "many", _SCALING_LIMITS, "<= 0.6 large+, 1.05 tiny/small"),
    ("bwd N/1", "many", _SCALING_LIMITS, "<= 0.6 large+, 1.05 tiny/small"),
    ("bwd_sv N/1", "many", _SCALING_LIMITS,
     "<= 0.6 large+, 1.05 tiny/small"),
)


def add_ratios(rows):
    """Add the ratios (ours / theirs, N threads / 1 thread) to every row."""
    single = {(r["shape"], r["dtype"]): r["times_ms"] for r in rows
              if r["threads"] == 1}
    for row in rows:
        times = row["times_ms"]
        row["ratios"] = {name: times[num] / times[den]
                         for name, num, den in RATIOS
                         if num in times and den in times}
        base = single.get((row["shape"], row["dtype"]))
        if row["threads"] > 1 and base:
            row["ratios"].update((name, times[key] / base[key])
                                 for name, key in SCALING)


def evaluate_targets(rows):
    """One entry per (target, row) it applies to, with PASS or MISS (n/a
    where torch.compile failed; left out where a comparison was not run).

    ``disturbed`` tells whether other processes were busy while the row
    (or, for N/1, its 1-thread row) was timed.
    """
    applies = {"one": lambda n: n == 1, "every": lambda n: True,
               "many": lambda n: n > 1}
    load = {(r["shape"], r["dtype"], r["threads"]): r["others_load"] or 0.0
            for r in rows}
    results = []
    for ratio, which, limits, _ in TARGETS:
        for row in rows:
            limit = limits[row["shape"]]
            value = row["ratios"].get(ratio)
            if limit is None or not applies[which](row["threads"]) or (
                    value is None and "compile_error" not in row):
                continue
            passed = None if value is None else value <= limit
            shape, dtype, n = row["shape"], row["dtype"], row["threads"]
            busy = max(load[shape, dtype, n], load.get((shape, dtype, 1), 0))
            results.append({"target": ratio, "shape": shape, "dtype": dtype,
                            "threads": n, "ratio": value, "limit": limit,
                            "status": {True: "PASS", False: "MISS",
                                       None: "n/a"}[passed],
                            "disturbed": busy > DISTURBED})
    return results
