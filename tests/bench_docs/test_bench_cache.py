"""``python -m attention_c.bench --cache`` runs, checks and reports.

Times are never asserted (they depend on the machine and its load); what
is checked is that a ``--quick`` run ends well, that every thread count
gets a bandwidth and every shape (the ragged batch too) and thread count
a row with every time, that each output's error against float64 is within
its limit and the paged cache gives bitwise the contiguous one's out, that
the ratios, bytes, rates and targets follow the times, and that the
paged cache and the ragged lengths are laid out as the docstring says.
"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from attention_c.bench import cache

THREADS = (1, 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One --quick run at 1 and 2 threads: (its JSON, its report)."""
    pytest.importorskip("torch")       # the baseline
    pytest.importorskip("ml_dtypes")   # the bfloat16 cache
    path = tmp_path_factory.mktemp("cache") / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "attention_c.bench", "--cache", "--quick",
         "--threads", ",".join(map(str, THREADS)), "--json", str(path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(path, encoding="utf-8") as f:
        return json.load(f), proc.stdout, proc.stderr


def finite_positive(value):
    return np.isfinite(value) and value > 0


def impls(row):
    """The implementations timed on a row: cache_attention's alone on the
    ragged batch."""
    return (set(cache.CACHE_IMPLS) if row["ragged"]
            else set(cache.IMPLS + cache.CACHE_IMPLS))


def test_every_row_is_measured(run):
    data, _, _ = run
    found = {(r["B"], r["T"], r["ragged"], r["threads"])
             for r in data["results"]}
    assert found == ({(B, T, False, n) for B, T in cache.QUICK_SIZES
                      for n in THREADS}
                     | {(B, T, True, n) for B, T in cache.QUICK_RAGGED_SIZES
                        for n in THREADS})
    Hq, Hkv, d = cache.QUICK_HEADS
    for row in data["results"]:
        assert (row["Hq"], row["Hkv"], row["d"]) == (Hq, Hkv, d)
        assert row["T_max"] == row["T"] + cache.SLACK
        assert row["block_size"] == cache.BLOCK_SIZE
        assert set(row["times_ms"]) == impls(row)
        assert all(finite_positive(t) for t in row["times_ms"].values())
        assert all(n >= 1 for n in row["repeats"].values())
        assert set(row["errors"]) == impls(row)
        assert row["lengths"] == (
            cache.ragged_lengths(row["B"], row["T"]) if row["ragged"]
            else [row["T"]] * row["B"])


def test_ragged_batch_is_spread():
    (B, T), = cache.QUICK_RAGGED_SIZES
    assert B == cache.RAGGED_SIZES[0][0] == 8
    lengths = cache.ragged_lengths(B, T)
    assert sorted(lengths) == sorted(
        np.linspace(T // 8, T, B).round().astype(int).tolist())
    assert lengths != sorted(lengths)               # shuffled
    assert lengths == cache.ragged_lengths(B, T)    # the same every run


def test_bandwidth(run):
    data, stdout, _ = run
    bandwidth = data["bandwidth"]
    assert [b["threads"] for b in bandwidth] == list(THREADS)
    for b in bandwidth:
        assert b["mib"] == cache.QUICK_BANDWIDTH_MIB
        assert b["passes"] >= 1
        assert finite_positive(b["gbps"])
        assert b["min_gbps"] <= b["gbps"] <= b["max_gbps"]
        assert finite_positive(b["cpu_per_wall"])
    by_threads = {b["threads"]: b["gbps"] for b in bandwidth}
    for row in data["results"]:
        assert row["bandwidth_gbps"] == by_threads[row["threads"]]
    assert "Read bandwidth" in stdout


def test_errors_within_tolerance(run):
    data, _, stderr = run
    for row in data["results"]:
        for impl, err in row["errors"].items():
            assert np.isfinite(err) and err <= cache.TOLERANCE[impl], row
        assert row["paged_identical"] == {n: True for n in cache.DTYPES}
    assert "WARNING" not in stderr


def test_ratios_bytes_and_rates_follow_the_times(run):
    data, _, _ = run
    for row in data["results"]:
        t = row["times_ms"]
        ratios = (cache.CACHE_RATIOS if row["ragged"]
                  else {**cache.RATIOS, **cache.CACHE_RATIOS})
        assert set(row["ratios"]) == set(ratios)
        for name, (a, b) in ratios.items():
            assert finite_positive(row["ratios"][name])
            assert row["ratios"][name] == pytest.approx(t[a] / t[b])
        assert len(row["targets"]) == len(cache.TARGETS)
        for target in row["targets"]:
            value = row["ratios"][target["target"]]
            assert target["value"] == value
            assert target["limit"] == cache.TARGETS[target["target"]]
            assert target["status"] == ("PASS" if value <= target["limit"]
                                        else "MISS")
        for dtype in cache.DTYPES:
            size = 2 if dtype != "float32" else 4
            assert row["bytes"][dtype] == (sum(row["lengths"]) * row["Hkv"]
                                           * row["d"] * 2 * size)
        for impl in impls(row):
            dtype = impl.split("_", 1)[1]
            gbps = row["gbps"][impl]
            assert gbps == pytest.approx(row["bytes"][dtype] / t[impl]
                                         * 1e3 / 1e9)
            assert row["bandwidth_share"][impl] == pytest.approx(
                gbps / row["bandwidth_gbps"])
            assert finite_positive(row["bandwidth_share"][impl])


def test_report_says_what_ran_where(run):
    data, stdout, _ = run
    meta = data["meta"]
    assert meta["quick"] and meta["heads"] == list(cache.QUICK_HEADS)
    assert meta["tolerance"] == cache.TOLERANCE
    assert f"SIMD path {meta['config']['simd']}" in stdout
    assert "torch " in stdout and "--quick" in stdout
    assert "cache_attention" in stdout and "block_size 16" in stdout
    for name in cache.DTYPES + cache.IMPLS + cache.CACHE_IMPLS:
        assert name in stdout
    lines = stdout.splitlines()
    # A line per shape, cache dtype and thread count in the decode table
    # (ours and SDPA), and in cache_attention's (the ragged batch too).
    assert sum(line.split()[2:3] == [dtype] for line in lines
               for dtype in cache.DTYPES) == ((2 * len(cache.QUICK_SIZES)
                                               + len(cache.QUICK_RAGGED_SIZES))
                                              * len(THREADS)
                                              * len(cache.DTYPES))
    for name, limit in cache.TARGETS.items():
        assert f"  {name} <= {limit}: " in stdout
    passed = sum(t["status"] == "PASS" for r in data["results"]
                 for t in r["targets"])
    total = len(data["results"]) * len(cache.TARGETS)
    assert f"Targets: {passed} PASS, {total - passed} MISS" in stdout
    assert ("paged out bitwise the contiguous one: yes, every shape and "
            "dtype") in stdout


def test_problem_is_a_strided_view_of_the_cache():
    p = cache.make_problem((4, 2, 8), 2, 16)
    assert p["q"].shape == (2, 2, 2, 1, 8) and p["q"].dtype == np.float32
    assert p["scale"] == 1 / math.sqrt(8)
    widened = {}
    for name, (k, v) in p["caches"].items():
        assert k.shape == v.shape == (2, 2, 1, 16, 8)
        assert k.dtype == cache.np_dtype(name)
        assert not k.flags.c_contiguous          # a view, not a copy
        assert k.base is not None and k.base.shape == (2, 16 + cache.SLACK,
                                                       2, 8)
        widened[name] = k.astype(np.float64)
    # The 16-bit caches round the same values as the float32 one.
    for name in ("bfloat16", "float16"):
        np.testing.assert_allclose(widened[name], widened["float32"],
                                   rtol=1e-2)
    assert cache.step_bytes(p, "bfloat16") == 2 * 16 * 2 * 8 * 2 * 2
    # cache_attention's query: the same values, (B, 1, Hq, d).
    assert p["q_rows"].shape == (2, 1, 4, 8)
    np.testing.assert_array_equal(p["q_rows"].reshape(p["q"].shape), p["q"])
    assert p["seqlens"].tolist() == [16, 16] and p["seqlens"].dtype == np.int32


def test_paged_copy_holds_the_same_positions():
    p = cache.make_problem((4, 2, 8), 2, 16, ragged=True)
    per = -(-(16 + cache.SLACK) // cache.BLOCK_SIZE)
    table = p["block_table"]
    assert table.shape == (2, per) and table.dtype == np.int32
    assert sorted(table.ravel()) == list(range(2 * per))  # a permutation
    assert not np.array_equal(table.ravel(), np.arange(2 * per))
    for name in cache.DTYPES:
        for buf, paged in zip(p["buffers"][name], p["paged"][name]):
            assert buf.flags.c_contiguous
            assert buf.shape == (2, 16 + cache.SLACK, 2, 8)
            assert paged.shape == (2 * per, cache.BLOCK_SIZE, 2, 8)
            assert paged.dtype == buf.dtype
            for b in range(2):
                for t in range(buf.shape[1]):
                    blk, row = divmod(t, cache.BLOCK_SIZE)
                    np.testing.assert_array_equal(
                        paged[table[b, blk], row], buf[b, t])
    assert p["lengths"] == cache.ragged_lengths(2, 16)
    assert cache.step_bytes(p, "float32") == sum(p["lengths"]) * 2 * 8 * 2 * 4


def test_exact_of_a_ragged_batch_is_each_sequence_on_its_own():
    p = cache.make_problem((4, 2, 8), 8, 16, ragged=True)
    ref = cache.exact(p, "bfloat16")
    for b, n in enumerate(p["lengths"]):
        one = {"q": p["q"][b:b + 1], "ragged": False, "scale": p["scale"],
               "caches": {"bfloat16": tuple(x[b:b + 1, :, :, :n]
                                            for x in p["caches"]["bfloat16"])}}
        np.testing.assert_allclose(ref[b:b + 1], cache.exact(one, "bfloat16"),
                                   rtol=1e-12)
        # a key past the sequence's length changes nothing
        k = p["buffers"]["bfloat16"][0]
        if n < 16:
            saved = k[b, n].copy()
            k[b, n] = 100
            np.testing.assert_array_equal(cache.exact(p, "bfloat16")[b],
                                          ref[b])
            k[b, n] = saved
    assert cache.bandwidth_bytes(True, None) == 16 << 20
    assert cache.bandwidth_bytes(False, 105 << 20) == 420 << 20
    assert cache.bandwidth_bytes(False, None) == 256 << 20


def test_more_threads_no_faster_is_said():
    meta = {"bandwidth_mib": 16}
    same = [{"threads": n, "gbps": 8.0, "min_gbps": 8.0, "max_gbps": 8.0,
             "passes": 3, "cpu_per_wall": n * 0.95, "others_load": 0.0}
            for n in (1, 2)]
    text = "\n".join(cache.bandwidth_lines(meta, same))
    assert "NOTE: 2 threads read no faster than 1" in text
    assert "memory bandwidth is shared" in text
    same[1]["gbps"] = 15.0
    assert "NOTE" not in "\n".join(cache.bandwidth_lines(meta, same))


def test_help():
    proc = subprocess.run(
        [sys.executable, "-m", "attention_c.bench", "--cache", "--help"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--cache" in proc.stdout and "--quick" in proc.stdout
    with pytest.raises(SystemExit):
        cache.parse_args(["--min-repeats", "0"])
