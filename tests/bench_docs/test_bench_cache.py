"""``python -m attention_c.bench --cache`` runs, checks and reports.

Times are never asserted (they depend on the machine and its load); what
is checked is that a ``--quick`` run ends well, that every thread count
gets a bandwidth and every shape and thread count a row with every time,
that each output's error against float64 is within its limit, and that
the ratios, bytes and rates follow the times.
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


def test_every_row_is_measured(run):
    data, _, _ = run
    found = {(r["B"], r["T"], r["threads"]) for r in data["results"]}
    assert found == {(B, T, n) for B, T in cache.QUICK_SIZES
                     for n in THREADS}
    Hq, Hkv, d = cache.QUICK_HEADS
    for row in data["results"]:
        assert (row["Hq"], row["Hkv"], row["d"]) == (Hq, Hkv, d)
        assert row["T_max"] == row["T"] + cache.SLACK
        assert set(row["times_ms"]) == set(cache.IMPLS)
        assert all(finite_positive(t) for t in row["times_ms"].values())
        assert all(n >= 1 for n in row["repeats"].values())
        assert set(row["errors"]) == set(cache.IMPLS)


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
    assert "WARNING" not in stderr


def test_ratios_bytes_and_rates_follow_the_times(run):
    data, _, _ = run
    for row in data["results"]:
        t = row["times_ms"]
        assert set(row["ratios"]) == set(cache.RATIOS)
        for name, (a, b) in cache.RATIOS.items():
            assert finite_positive(row["ratios"][name])
            assert row["ratios"][name] == pytest.approx(t[a] / t[b])
        for dtype in cache.DTYPES:
            size = 2 if dtype != "float32" else 4
            assert row["bytes"][dtype] == (row["B"] * row["T"] * row["Hkv"]
                                           * row["d"] * 2 * size)
        for impl in cache.IMPLS:
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
    for name in cache.DTYPES + tuple(cache.IMPLS):
        assert name in stdout
    lines = stdout.splitlines()
    # A line per shape, cache dtype and thread count in the decode table.
    assert sum(line.split()[2:3] == [dtype] for line in lines
               for dtype in cache.DTYPES) == (len(cache.QUICK_SIZES)
                                              * len(THREADS)
                                              * len(cache.DTYPES))


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
