"""The plain-text report of ``python -m attention_c.bench --cache``
(attention_c.bench.cache, whose docstring says what each row times):
the header, the read bandwidth, the decode rows of ``dot_attention`` and
SDPA, ``cache_attention``'s rows, the targets of issue 34 and the
errors."""

from attention_c.bench import harness
from attention_c.bench.cache import (BLOCK_SIZE, CACHE_DTYPES, CACHE_IMPLS,
                                     DTYPES, IMPLS, SHORT, SLACK,
                                     STORED_LIMIT, TARGETS, TOLERANCE)
from attention_c.bench.report import format_load, format_table


def header(meta):
    """The lines saying what ran where."""
    Hq, Hkv, d = meta["heads"]
    flags = harness.cpu_flags()
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}"
                     for f in ("f16c", "avx512_bf16", "avx512_fp16",
                               "avx512_vnni", "amx_int8"))
    l3 = meta["l3_bytes"]
    share = meta["others_share"]
    lines = [
        f"Decode step: one float32 query per sequence against a key/value "
        f"cache, Hq/Hkv = {Hq}/{Hkv}, d = {d}; ours: dot_attention, "
        f"return_weights=False,",
        f"on strided views of (B, T + {SLACK}, Hkv, d) caches read in "
        f"place; sdpa: torch SDPA, enable_gqa, on contiguous copies, the "
        f"query in the cache dtype;",
        f"cache: cache_attention on the buffers themselves, cache_seqlens; "
        f"paged: the same on a paged copy (block_size {BLOCK_SIZE}, "
        f"shuffled block_table);",
        "torch: attention_c.torch.flash_attn_with_kvcache (causal, as "
        "cache) on torch tensors sharing the memory of cache's arrays "
        "(torch.from_numpy);",
        f"int8: quantize_kv(group {meta['group']}) of the float32 values "
        f"(once, untimed), float32 k_scales/v_scales beside the cache",
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
    lines.append(f"Before each timed step one thread reads "
                 f"{meta['evict_mib']} MiB (untimed)"
                 + (" (the L3's size unknown)" if l3 is None else
                    ": steps read the caches from memory, as a model's "
                    "layers do" if meta["evict_mib"] << 20 >= l3 else
                    ", less than the L3, which may still hold the caches"))
    if meta["quick"]:
        lines.append("--quick: tiny sizes, indicative only; the bandwidth "
                     "buffer and the caches may fit in L3 (not a DRAM "
                     "figure).")
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
    """One line per shape, cache dtype and thread count of equal lengths:
    ours and SDPA."""
    body = []
    for r in (r for r in rows if not r["ragged"]):
        for name in DTYPES:
            ours, sdpa = f"ours_{name}", f"sdpa_{name}"
            own = ("-" if name == "float32"
                   else f"{r['ratios'][SHORT[name] + '/f32']:.2f}")
            body.append(
                [str(r["B"]), str(r["T"]), name, str(r["threads"]),
                 f"{r['times_ms'][ours]:.3f}", f"{r['times_ms'][sdpa]:.3f}",
                 own, f"{r['ratios'][SHORT[name] + '/sdpa']:.2f}",
                 *read_cells(r, name, ours, sdpa)])
    return format_table(["B", "T", "cache", "thr", "ours ms", "sdpa ms",
                         "ours/f32", "ours/sdpa", "MB/step", "ours GB/s",
                         "sdpa GB/s", "others"], body, left=3)


def read_cells(r, name, *timed):
    """The last cells of a row of a cache dtype: the megabytes a step
    reads (* where they fit in L3), the GB/s of each timed call (share of
    the read bandwidth), the others' CPU share."""
    cells = [f"{r['bytes'][name] / 1e6:.3g}"
             + ("*" if r["in_l3"][name] else "")]
    cells += [f"{r['gbps'][t]:.2f} ({r['bandwidth_share'][t]:.0%})"
              for t in timed]
    cells.append("?" if r["others_load"] is None
                 else f"{r['others_load']:.0%}")
    return cells


def lengths_cell(r):
    """T of a row, or the range of the lengths of a ragged one."""
    return (f"{min(r['lengths'])}-{max(r['lengths'])}" if r["ragged"]
            else str(r["T"]))


def cache_table(rows):
    """One line per shape (ragged too), cache dtype and thread count:
    cache_attention on the contiguous and the paged cache, and the torch
    call against the NumPy one."""
    body = []
    for r in rows:
        for name in CACHE_DTYPES:
            cache, paged, short = f"cache_{name}", f"paged_{name}", SHORT[name]
            ours = r["ratios"].get(f"cache/ours {short}")
            body.append(
                [str(r["B"]), lengths_cell(r), name, str(r["threads"]),
                 f"{r['times_ms'][cache]:.3f}", f"{r['times_ms'][paged]:.3f}",
                 f"{r['ratios'][f'paged/cache {short}']:.2f}",
                 f"{r['ratios'][f'torch/cache {short}']:.2f}",
                 "-" if name == "float32"
                 else f"{r['ratios'][f'cache {short}/f32']:.2f}",
                 "-" if ours is None else f"{ours:.2f}",
                 *read_cells(r, name, cache, paged)])
    return format_table(["B", "T", "cache", "thr", "cache ms", "paged ms",
                         "paged/cache", "torch/cache", "cache/f32",
                         "cache/ours", "MB/step", "cache GB/s", "paged GB/s",
                         "others"], body, left=3)


def targets_lines(meta, rows):
    """The targets of issue 34, each over every row and thread count:
    how many pass, and the worst case."""
    targets = [t for r in rows for t in r["targets"]]
    lines = ["Targets of issue 34 on every row and thread count"
             + (" (--quick: tiny caches in L3, indicative only)"
                if meta["quick"] else "") + ":"]
    for name, limit in TARGETS.items():
        these = [t for t in targets if t["target"] == name]
        worst = max(these, key=lambda t: t["value"])
        passed = sum(t["status"] == "PASS" for t in these)
        lines.append(f"  {name} <= {limit}: {passed} of {len(these)} pass; "
                     f"worst {worst['value']:.2f} ({worst['case']})")
    return lines + [harness.targets_count(targets)]


def errors_table(rows, impls, key):
    """The errors of ``impls`` once per shape (of the rows where ``key``
    holds), their limits last."""
    seen = {}
    for r in rows:
        if key(r):
            seen.setdefault((r["B"], lengths_cell(r)), r)
    body = [[str(B), T] + [f"{r['errors'][k]:.1e}" for k in impls]
            for (B, T), r in seen.items()]
    body.append(["limit", ""] + [f"{TOLERANCE[k]:.0e}" for k in impls])
    return format_table(["B", "T"] + list(impls), body, left=2)


def stored_line(rows):
    """The int8 out's largest error against float64 on the values the
    int8 cache holds (dequantised), over the shapes."""
    worst = max(r["int8_stored_error"] for r in rows)
    return (f"cache_int8 against float64 on the values it holds "
            f"(dequantize_kv): worst {worst:.1e} (limit "
            f"{STORED_LIMIT:.0e}); cache_int8/paged_int8 above: against "
            f"the values before quantisation")


def report(meta, bandwidth, rows):
    """The plain-text report: header, bandwidth, decode rows, errors."""
    def bitwise(field):                 # "yes", or the shapes that differ
        same = {}
        for r in rows:
            key = (r["B"], lengths_cell(r))
            same[key] = same.get(key, True) and all(r[field].values())
        differ = [f"B={B} T={T}" for (B, T), s in same.items() if not s]
        return ("yes, every shape and dtype" if not differ
                else "NO on " + ", ".join(differ))
    return "\n".join(header(meta) + [""] + bandwidth_lines(meta, bandwidth)
                     + [
        "",
        "Median ms per decode step; ours/f32: ours on this cache / ours on "
        "the float32 cache; ours/sdpa:",
        "the same cache dtype (< 1: ours faster).  MB/step: keys + values "
        "read (*: fits in L3 beside the eviction read,",
        "so steps may read it from there); GB/s: that / the time (share "
        "of the read bandwidth of the threads used).",
        "others: share of the CPUs other processes used while the row was "
        "timed (/proc/stat: time a hypervisor",
        "stole counts too).",
        decode_table(rows),
        "",
        f"cache_attention, median ms per decode step; paged/cache: on the "
        f"paged copy (block_size {BLOCK_SIZE}) / on",
        "the buffers; torch/cache: flash_attn_with_kvcache on torch views "
        "of the buffers / the NumPy call;",
        "cache/f32: on this cache / on the float32 cache; cache/ours: / "
        "dot_attention (ours) on the same cache;",
        "T a-b: the ragged batch's lengths.  MB/step, GB/s and others as "
        "above (int8: the scales included).",
        cache_table(rows),
        "",
        *targets_lines(meta, rows),
        "",
        "Error of out against float64 on the same cache values "
        "(||x - r|| / ||r||)",
        errors_table(rows, IMPLS, lambda r: not r["ragged"]),
        errors_table(rows, CACHE_IMPLS, lambda r: True),
        stored_line(rows),
        "paged out bitwise the contiguous one: "
        + bitwise("paged_identical"),
        "torch out bitwise the NumPy one (so its errors are cache's): "
        + bitwise("torch_identical")])
