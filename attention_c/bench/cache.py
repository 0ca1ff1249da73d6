"""A decode step on a key/value cache held in float32, bfloat16 or float16,
against the host's read bandwidth and PyTorch's
``scaled_dot_product_attention``.

``python -m attention_c.bench --cache`` (or ``python -m
attention_c.bench.cache``) runs it; ``--quick`` runs tiny sizes in seconds.
PyTorch (the baseline) and ml_dtypes (``pip install
attention_c[bfloat16]``) are required.

1. **Read bandwidth**, per thread count N: N Python threads each reduce
   their own buffer of BANDWIDTH_MIB MiB (or 4 times the L3 cache if
   more; written before timing, so no page is the shared zero page) with
   ``buf.view(np.int32).max()``, started together by a barrier; a pass
   is timed from the barrier to the last thread's end: N x size / that
   time in GB/s, the median of the passes (at least ``--min-repeats``,
   about ``--target`` seconds per thread count, the counts interleaved
   as ``harness.measure`` interleaves implementations).  NumPy releases
   the GIL in the reduction; the process's CPU seconds per wall second
   (about N when the N threads ran throughout) are reported beside it.
   On the development host the int32 max read as fast as the int8 and
   float32 max, a float32 dot and a C AVX-512 loop (8-9 GB/s, 1 or 2
   threads alike), and faster than a float32 sum (5 GB/s).

2. **Decode rows**: one query per sequence, GQA with Hq = 32 query heads
   sharing Hkv = 8 key/value heads (G = 4), d = 128; caches of T = 4096
   (B = 1 and 8 sequences) and T = 32768 (B = 1 only: at B = 8 the float32
   keys and values take 2.1 GB, slow to make and check for little more to
   learn).  Every sequence of a batch has the same length: a ragged batch
   (a key mask per sequence) is not timed here.  The cache is laid out
   as a serving engine keeps it: a (B, T_max, Hkv, d) buffer per keys and
   values, T_max = T + 64, in the cache dtype; the step reads its view
   ``[:, :T]`` transposed to (B, Hkv, 1, T, d), strided, without a copy.
   Timed in interleaved rounds (``harness.measure``) at each thread count
   (ours through ``attention_c.set_num_threads``, PyTorch through
   ``torch.set_num_threads``):

   * ours_<dtype>: ``dot_attention(q, k, values=v, return_weights=False)``
     with the float32 query q (B, Hkv, G, 1, d) and the strided cache
     views; the 16-bit caches are read in place, widened as loaded;
   * sdpa_<dtype>: ``scaled_dot_product_attention(q, k, v,
     enable_gqa=True)`` under no_grad with q (B, Hq, 1, d) in the cache
     dtype (as a user of a 16-bit model holds it; query head h uses key
     head h // G, as ours) and contiguous (B, Hkv, T, d) copies of the
     cache (made once, outside the timing).

   The scale is 1 / sqrt(d) on both sides.  Bytes per step: the keys and
   values read, B T Hkv d 2 itemsize (the query and out are negligible);
   GB/s = that / the time, and its share of the read bandwidth measured
   at the same thread count.  Caches that fit in the L3 cache are marked:
   repeated steps may then read them from L3, beyond the DRAM bandwidth.

Before timing, once per shape, every output is compared with a float64
computation (NumPy) on the same rounded cache values widened to float64
and the float32 query, normwise (||x - r|| / ||r||).
"""

import concurrent.futures
import math
import os
import sys
import threading
import time

import numpy as np

import attention_c as ac
from attention_c.bench import harness
from attention_c.bench.report import emit, format_load, format_table
from attention_c.testing import rel_err

HEADS = (32, 8, 128)                    # (Hq, Hkv, d)
QUICK_HEADS = (8, 2, 16)
SIZES = ((1, 4096), (8, 4096), (1, 32768))      # (B, T)
QUICK_SIZES = ((1, 64), (2, 64), (1, 128), (2, 128))
SLACK = 64                              # T_max = T + SLACK
DTYPES = ("float32", "bfloat16", "float16")
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
IMPLS = tuple(f"{who}_{dt}" for who in ("ours", "sdpa") for dt in DTYPES)
BANDWIDTH_MIB = 256                     # at least, per thread
QUICK_BANDWIDTH_MIB = 16
# Ours computes in float32 on exactly the values the reference widens
# (the cache read in place, the float32 query), whatever the cache dtype:
# only float32 rounding.  SDPA rounds its query to the cache dtype and
# returns out in it: their unit roundoff (float16 2^-11 = 4.9e-4,
# bfloat16 2^-9 = 2.0e-3) bounds what it can reach, hence looser limits.
TOLERANCE = {"ours_float32": 1e-5, "ours_bfloat16": 1e-5,
             "ours_float16": 1e-5, "sdpa_float32": 1e-5,
             "sdpa_float16": 2e-3, "sdpa_bfloat16": 1e-2}
# ratios: name -> (numerator, denominator)
RATIOS = {"bf16/f32": ("ours_bfloat16", "ours_float32"),
          "f16/f32": ("ours_float16", "ours_float32"),
          **{f"{SHORT[dt]}/sdpa": (f"ours_{dt}", f"sdpa_{dt}")
             for dt in DTYPES}}


def np_dtype(name):
    """The NumPy dtype of a DTYPES name (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# --------------------------------------------------------------------------
# Read bandwidth

def l3_bytes():
    """The size of the L3 cache in bytes (from sysfs), or None."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        names = os.listdir(base)
    except OSError:
        return None
    for name in names:
        try:
            with open(f"{base}/{name}/level", encoding="utf-8") as f:
                if f.read().strip() != "3":
                    continue
            with open(f"{base}/{name}/size", encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units and text[:-1].isdigit():
            return int(text[:-1]) * units[text[-1]]
        if text.isdigit():
            return int(text)
    return None


def bandwidth_bytes(quick, l3):
    """Bytes of each thread's buffer: QUICK_BANDWIDTH_MIB with --quick
    (it may fit in L3: not a DRAM figure), else BANDWIDTH_MIB MiB or 4
    times the L3 cache, the larger, so every pass misses the caches."""
    if quick:
        return QUICK_BANDWIDTH_MIB << 20
    size = max(BANDWIDTH_MIB << 20, 4 * (l3 or 0))
    return -(-size // (1 << 20)) << 20              # whole MiB


def _pass(pool, barrier, bufs):
    """One pass: each thread of ``pool`` reduces one of ``bufs``, started
    together by ``barrier``; (wall seconds, CPU seconds of the process)."""
    def reduce(buf):
        barrier.wait()
        return int(buf.max())

    futures = [pool.submit(reduce, b) for b in bufs]
    barrier.wait()
    cpu, start = time.process_time(), time.perf_counter()
    for fut in futures:
        fut.result()
    return time.perf_counter() - start, time.process_time() - cpu


def measure_bandwidth(counts, size, target, min_repeats):
    """The read bandwidth of each thread count n of ``counts``: n threads
    each reducing its own buffer of ``size`` bytes at once.  Timed as
    ``harness.measure`` times (and for the same reason): ROUNDS rounds
    over the counts, order reversed every other round, a pass untimed
    after each switch, then passes for about target / ROUNDS seconds and
    at least min_repeats in all.  A list of dicts, one per count: the
    median GB/s, the slowest and fastest pass, passes, CPU seconds per
    wall second, and the others' CPU share over the whole measurement."""
    # Written (arange), not np.zeros: untouched pages would all map the
    # one zero page, read from the caches.
    bufs = [np.arange(size // 4, dtype=np.int32) for _ in range(max(counts))]
    pools = {n: concurrent.futures.ThreadPoolExecutor(n) for n in counts}
    barriers = {n: threading.Barrier(n + 1) for n in counts}
    least = -(-min_repeats // harness.ROUNDS)
    samples = {n: [] for n in counts}
    before, begin = harness.cpu_seconds(), time.perf_counter()
    try:
        for r in range(harness.ROUNDS):
            for n in counts if r % 2 == 0 else counts[::-1]:
                args = pools[n], barriers[n], bufs[:n]
                _pass(*args)                        # untimed
                done, start = 0, time.perf_counter()
                while done < least or (time.perf_counter() - start
                                       < target / harness.ROUNDS):
                    samples[n].append(_pass(*args))
                    done += 1
    finally:
        for pool in pools.values():
            pool.shutdown()
    others = harness.others_load(before, time.perf_counter() - begin)
    found = []
    for n in counts:
        rates = [n * size / wall / 1e9 for wall, _ in samples[n]]
        found.append({
            "threads": n, "mib": size >> 20,
            "gbps": float(np.median(rates)), "min_gbps": min(rates),
            "max_gbps": max(rates), "passes": len(rates),
            "cpu_per_wall": (sum(c for _, c in samples[n])
                             / sum(w for w, _ in samples[n])),
            "others_load": others})
    return found


# --------------------------------------------------------------------------
# Decode rows

def make_problem(heads, B, T, seed=0):
    """The caches of every dtype and the query of one shape: a dict of
    ``q`` (B, Hkv, G, 1, d) float32, ``caches`` {dtype: (k, v)} strided
    (B, Hkv, 1, T, d) views of (B, T + SLACK, Hkv, d) buffers, rounded
    from the same float32 normal values, and the sizes."""
    Hq, Hkv, d = heads
    rng = np.random.default_rng([seed, B, T, Hq, Hkv, d])
    full = [rng.standard_normal((B, T + SLACK, Hkv, d), dtype=np.float32)
            for _ in range(2)]
    caches = {}
    for name in DTYPES:
        kv = [b.astype(np_dtype(name)) for b in full]
        caches[name] = tuple(b[:, :T].transpose(0, 2, 1, 3)[:, :, None]
                             for b in kv)
    q = rng.standard_normal((B, Hkv, Hq // Hkv, 1, d), dtype=np.float32)
    return {"q": q, "caches": caches, "B": B, "T": T, "heads": heads,
            "scale": 1 / math.sqrt(d)}


def ours_call(p, name):
    """Our decode step on the cache of dtype ``name``."""
    q, (k, v) = p["q"], p["caches"][name]

    def step():
        return ac.dot_attention(q, k, values=v, scale=p["scale"],
                                return_weights=False)[0]
    return step


def sdpa_call(torch, p, name):
    """SDPA's decode step on contiguous (B, Hkv, T, d) copies of the cache
    of dtype ``name``, the query in that dtype."""
    B, (Hq, _, d) = p["B"], p["heads"]
    tdtype = getattr(torch, name)

    def tensor(view):                       # (B, Hkv, 1, T, d) -> 4-D
        a = np.ascontiguousarray(view[:, :, 0])
        if name == "bfloat16":              # the same bits, via int16
            return torch.from_numpy(a.view(np.int16)).view(tdtype)
        return torch.from_numpy(a)

    k, v = (tensor(x) for x in p["caches"][name])
    q = torch.from_numpy(p["q"].reshape(B, Hq, 1, d)).to(tdtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step():
        with torch.no_grad():
            return sdpa(q, k, v, scale=p["scale"], enable_gqa=True)
    return step


def functions(torch, p):
    """The timed steps, by IMPLS name."""
    funcs = {f"ours_{n}": ours_call(p, n) for n in DTYPES}
    funcs.update({f"sdpa_{n}": sdpa_call(torch, p, n) for n in DTYPES})
    return funcs


def exact(p, name):
    """out in float64 of the cache of dtype ``name``, (B, Hkv, G, 1, d)."""
    k, v = (x.astype(np.float64) for x in p["caches"][name])
    s = p["q"].astype(np.float64) @ k.swapaxes(-1, -2) * p["scale"]
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def check(torch, p, funcs):
    """{impl: normwise error of its out} against float64 on the same
    cache values."""
    errs = {}
    for name in DTYPES:
        ref = exact(p, name)
        for impl in (f"ours_{name}", f"sdpa_{name}"):
            out = funcs[impl]()
            if torch.is_tensor(out):
                out = out.to(torch.float64).numpy()
            errs[impl] = rel_err(
                np.asarray(out, np.float64).reshape(ref.shape), ref)
    return errs


def step_bytes(p, name):
    """Bytes of keys and values one step reads: B T Hkv d 2 itemsize."""
    _, Hkv, d = p["heads"]
    return p["B"] * p["T"] * Hkv * d * 2 * np_dtype(name).itemsize


def run_row(p, threads, ctx, funcs, errs, bandwidth):
    """Time the steps on one shape and thread count."""
    Hq, Hkv, d = p["heads"]
    row = {"B": p["B"], "T": p["T"], "T_max": p["T"] + SLACK, "Hq": Hq,
           "Hkv": Hkv, "d": d, "threads": threads, "errors": errs}
    harness.measure_into(row, funcs, ctx["target"], ctx["min_repeats"])
    t = row["times_ms"]
    row["ratios"] = {r: t[a] / t[b] for r, (a, b) in RATIOS.items()}
    row["bytes"] = {n: step_bytes(p, n) for n in DTYPES}
    row["in_l3"] = {n: bool(ctx["l3"]) and b <= ctx["l3"]
                    for n, b in row["bytes"].items()}
    row["gbps"] = {k: row["bytes"][k.split("_", 1)[1]] / (ms / 1e3) / 1e9
                   for k, ms in t.items()}
    row["bandwidth_gbps"] = bandwidth
    row["bandwidth_share"] = {k: g / bandwidth
                              for k, g in row["gbps"].items()}
    return row


def run_all(options, ctx):
    """The bandwidth per thread count, then every shape and thread count;
    returns (bandwidth records, rows)."""
    torch, rows = ctx["torch"], []
    start = time.perf_counter()
    bandwidth = measure_bandwidth(options.threads, ctx["bandwidth_bytes"],
                                  ctx["target"], ctx["min_repeats"])
    print(f"  bandwidth {time.perf_counter() - start:6.1f} s",
          file=sys.stderr)
    by_threads = {b["threads"]: b["gbps"] for b in bandwidth}
    for B, T in ctx["sizes"]:
        p = make_problem(ctx["heads"], B, T, ctx["seed"])
        funcs = functions(torch, p)
        errs = check(torch, p, funcs)           # once, before timing
        harness.warn_inaccurate(errs, TOLERANCE, f"B={B} T={T}")
        rows += harness.rows_by_threads(
            options.threads, ctx, torch, f"B={B:<2} T={T:<6}",
            lambda n: run_row(p, n, ctx, funcs, errs, by_threads[n]))
        del p, funcs                            # free the caches
    return bandwidth, rows


# --------------------------------------------------------------------------
# Report

def header(meta):
    """The lines saying what ran where."""
    Hq, Hkv, d = meta["heads"]
    flags = harness.cpu_flags()
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}"
                     for f in ("f16c", "avx512_bf16", "avx512_fp16"))
    l3 = meta["l3_bytes"]
    share = meta["others_share"]
    lines = [
        f"Decode step: one float32 query per sequence against a key/value "
        f"cache, Hq/Hkv = {Hq}/{Hkv}, d = {d}; ours: dot_attention, "
        f"return_weights=False,",
        f"on strided views of (B, T + {SLACK}, Hkv, d) caches read in "
        f"place; sdpa: torch SDPA, enable_gqa, on contiguous copies, the "
        f"query in the cache dtype",
        f"CPU {meta['cpu']} ({meta['cpus']} CPUs available); {have}; L3 "
        + ("?" if l3 is None else f"{l3 / 2**20:.0f} MiB"),
        f"attention_c {meta['config']['version']}: SIMD path "
        f"{meta['config']['simd']}; torch {meta['torch']} (CPU capability "
        f"{meta['torch_capability']}); threads "
        + ", ".join(map(str, meta["threads"])),
        "Other processes used "
        + ("?" if share is None else f"{share:.0%}")
        + " of the CPUs during the run; load average at start "
        + format_load(meta["load_start"])]
    if meta["quick"]:
        lines.append("--quick: tiny sizes, indicative only; the bandwidth "
                     "buffer may fit in L3 (not a DRAM figure).")
    return lines


def bandwidth_lines(meta, bandwidth):
    """The bandwidth table, and a note when more threads read no faster."""
    body = [[str(b["threads"]), f"{b['gbps']:.2f}",
             f"{b['min_gbps']:.2f}-{b['max_gbps']:.2f}", str(b["passes"]),
             f"{b['cpu_per_wall']:.2f}"] for b in bandwidth]
    others = bandwidth[0]["others_load"] if bandwidth else None
    lines = [f"Read bandwidth: each thread reduces its own "
             f"{meta['bandwidth_mib']} MiB buffer "
             f"(buf.view(np.int32).max()); median GB/s of the passes,",
             "thread counts interleaved; CPU/wall: CPU seconds of the "
             "process per second of the passes (n when n threads ran "
             "throughout); others: "
             + ("?" if others is None else f"{others:.0%}"),
             format_table(["thr", "GB/s", "range", "passes", "CPU/wall"],
                          body, left=0)]
    one = next((b for b in bandwidth if b["threads"] == 1), None)
    for b in bandwidth:
        if one is None or b["threads"] == 1 or b["gbps"] > 1.05 * one["gbps"]:
            continue
        why = ("the threads ran at once (CPU/wall "
               f"{b['cpu_per_wall']:.2f}): the memory bandwidth is shared"
               if b["cpu_per_wall"] > 0.75 * b["threads"] else
               f"the threads did not run at once (CPU/wall "
               f"{b['cpu_per_wall']:.2f}): other processes or the GIL")
        lines.append(f"NOTE: {b['threads']} threads read no faster than 1 "
                     f"({b['gbps']:.2f} against {one['gbps']:.2f} GB/s); "
                     + why + ".")
    return lines


def decode_table(rows):
    """One line per shape, cache dtype and thread count."""
    body = []
    for r in rows:
        for name in DTYPES:
            ours, sdpa = f"ours_{name}", f"sdpa_{name}"
            own = ("-" if name == "float32"
                   else f"{r['ratios'][SHORT[name] + '/f32']:.2f}")
            body.append(
                [str(r["B"]), str(r["T"]), name, str(r["threads"]),
                 f"{r['times_ms'][ours]:.3f}", f"{r['times_ms'][sdpa]:.3f}",
                 own, f"{r['ratios'][SHORT[name] + '/sdpa']:.2f}",
                 f"{r['bytes'][name] / 1e6:.3g}"
                 + ("*" if r["in_l3"][name] else ""),
                 f"{r['gbps'][ours]:.2f} "
                 f"({r['bandwidth_share'][ours]:.0%})",
                 f"{r['gbps'][sdpa]:.2f} "
                 f"({r['bandwidth_share'][sdpa]:.0%})",
                 "?" if r["others_load"] is None
                 else f"{r['others_load']:.0%}"])
    return format_table(["B", "T", "cache", "thr", "ours ms", "sdpa ms",
                         "ours/f32", "ours/sdpa", "MB/step", "ours GB/s",
                         "sdpa GB/s", "others"], body, left=3)


def report(meta, bandwidth, rows):
    """The plain-text report: header, bandwidth, decode rows, errors."""
    seen = {}
    for r in rows:                  # errors: once per shape
        seen.setdefault((r["B"], r["T"]), r["errors"])
    errors = [[str(B), str(T)] + [f"{e[k]:.1e}" for k in IMPLS]
              for (B, T), e in seen.items()]
    errors.append(["limit", ""] + [f"{TOLERANCE[k]:.0e}" for k in IMPLS])
    return "\n".join(header(meta) + [""] + bandwidth_lines(meta, bandwidth)
                     + [
        "",
        "Median ms per decode step; ours/f32: ours on this cache / ours on "
        "the float32 cache; ours/sdpa:",
        "the same cache dtype (< 1: ours faster).  MB/step: keys + values "
        "read (*: fits in L3, so steps may",
        "read it from there); GB/s: that / the time (share of the read "
        "bandwidth of the threads used).",
        "others: share of the CPUs other processes used while the row was "
        "timed (/proc/stat: time a hypervisor",
        "stole counts too).",
        decode_table(rows),
        "",
        "Error of out against float64 on the same cache values "
        "(||x - r|| / ||r||)",
        format_table(["B", "T"] + list(IMPLS), errors, left=2)])


# --------------------------------------------------------------------------
# Command line

def parse_args(argv):
    """The options of ``python -m attention_c.bench --cache``."""
    return harness.parse_mode_args(
        "cache",
        "Benchmark a GQA decode step of dot_attention on "
        "key/value caches in float32, bfloat16 and float16 "
        "(strided views, read in place) against the host's "
        "measured read bandwidth and torch.nn.functional."
        "scaled_dot_product_attention with the same cache "
        "dtype, with each one's error against float64.",
        argv)


def setup(options, torch):
    """The run's settings and the report's metadata."""
    sizes = QUICK_SIZES if options.quick else SIZES
    heads = QUICK_HEADS if options.quick else HEADS
    options.shapes = [f"B={B} T={T}" for B, T in sizes]
    options.dtypes = list(DTYPES)
    options.no_torch, options.compile = False, False
    ctx, meta = harness.setup(options)
    l3 = l3_bytes()
    size = bandwidth_bytes(options.quick, l3)
    meta.update(harness.torch_facts(torch), quick=options.quick,
                heads=list(heads), sizes=[list(s) for s in sizes],
                slack=SLACK, l3_bytes=l3, bandwidth_mib=size >> 20,
                tolerance=TOLERANCE)
    ctx.update(torch=torch, sizes=sizes, heads=heads, l3=l3,
               bandwidth_bytes=size)
    return ctx, meta


def main(argv=None):
    """Entry point of ``python -m attention_c.bench --cache``."""
    options = parse_args(sys.argv[1:] if argv is None else list(argv))
    torch = harness.baseline_torch()
    if torch is None:
        return 2
    if harness.optional_import("ml_dtypes") is None:
        print("ml_dtypes is required (the bfloat16 cache): pip install "
              "attention_c[bfloat16]", file=sys.stderr)
        return 2

    def run():
        ac.set_fp32_precision("ieee")       # float32 products throughout
        ctx, meta = setup(options, torch)
        return meta, run_all(options, ctx)
    meta, (bandwidth, rows) = harness.run_baseline_bench(torch, run)
    emit(options, meta, report(meta, bandwidth, rows),
         {"meta": meta, "bandwidth": bandwidth, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
