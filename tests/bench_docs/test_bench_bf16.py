"""``python -m attention_c.bench --bf16`` runs, checks and reports.

Times are never asserted (they depend on the machine and its load); what
is checked is that a ``--quick`` run ends well, that every pass (the
forward, the forward then the backward), shape, case and thread count gets
a row with every time, that each output's and gradient's error against
float64 is what its products allow, and that the ratios and rates follow
the times.
"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from attention_c import _core
from attention_c.bench import bf16

THREADS = (1,)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One --quick run at 1 thread: (its JSON, its report)."""
    pytest.importorskip("torch")       # the baseline
    path = tmp_path_factory.mktemp("bf16") / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "attention_c.bench", "--bf16", "--quick",
         "--threads", ",".join(map(str, THREADS)), "--json", str(path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(path, encoding="utf-8") as f:
        return json.load(f), proc.stdout


def test_every_row_is_measured(run):
    data, _ = run
    found = {(r["pass"], r["case"], tuple(r["shape"]), r["threads"])
             for r in data["results"]}
    assert found == {(p, c, s, n) for p in bf16.PASSES
                     for s in bf16.QUICK_SHAPES for c in bf16.CASES
                     for n in THREADS}
    for row in data["results"]:
        assert math.prod(row["lead"]) == row["shape"][0]
        assert set(row["times_ms"]) == set(bf16.IMPLS)
        for t in row["times_ms"].values():
            assert np.isfinite(t) and t > 0, row
        assert set(row["errors"]) == set(bf16.IMPLS) | {bf16.FLOOR}
        for e in row["errors"].values():     # out, or dq, dk, dv
            assert len(e) == (1 if row["pass"] == "forward" else 3), row
            assert np.all(np.isfinite(e)), row


def test_errors_against_float64(run):
    data, stdout = run
    for row in data["results"]:
        errs = {k: max(e) for k, e in row["errors"].items()}
        assert errs["ours_fp32"] < 1e-4, row
        assert errs["ours_bf16"] < 2e-2, row
        assert errs["ours_bf16_in"] < 2e-2, row
        assert errs["torch_bf16"] < 2e-2, row
        assert errs["ours_f16_in"] < 5e-3, row
        assert errs["torch_f16"] < 5e-3, row
        # the floor: exact arithmetic on bf16 inputs, rounded once, is
        # more accurate than PyTorch's bf16 and not more than float32's
        assert errs["ours_fp32"] < errs[bf16.FLOOR] < errs["torch_bf16"]
    assert "WARNING" not in stdout


def test_ratios_and_rates_follow_the_times(run):
    data, _ = run
    for row in data["results"]:
        t = row["times_ms"]
        for name, (a, b) in bf16.RATIOS.items():
            assert row["ratios"][name] == pytest.approx(t[a] / t[b])
        flops = bf16.flops_forward(row["shape"], row["case"] == "causal")
        flops *= 3.5 if row["pass"] == "f+b" else 1
        for impl in bf16.IMPLS:
            gflops = row["gflops"][impl]
            assert gflops == pytest.approx(flops / t[impl] * 1e3 / 1e9)
            assert row["peak_share"][impl] == pytest.approx(
                gflops / row["peak_gflops"])


def test_targets_follow_the_rows(run):
    """Issue 33's targets: each ratio on every row against its pass's
    limit (those with bf16 products where this CPU runs them), the error
    once per case; the report counts them and names the worst."""
    data, stdout = run
    meta, rows = data["meta"], data["results"]
    targets = bf16.evaluate_targets(meta, rows)
    ratios = dict(bf16.TARGETS if meta["bf16_products"]
                  else bf16.TARGETS_WITHOUT, **bf16.TARGETS_F16)
    cases = {(r["pass"], r["case"], tuple(r["shape"])) for r in rows}
    assert len(targets) == len(rows) * len(ratios) + len(cases)
    for t in targets:
        assert t["status"] == ("PASS" if t["value"] <= t["limit"]
                               else "MISS")
    for t in targets:           # the error targets carry the floor's
        if "error" in t["target"]:
            r = [r for r in rows if t["case"] == f"{r['pass']} {r['case']} "
                 f"{bf16.shape_text(r)}"][0]
            e, torch_e = r["errors"][bf16.FLOOR], r["errors"]["torch_bf16"]
            assert t["floor"] == max(a / b for a, b in zip(e, torch_e))
    assert stdout.count(f"    {bf16.FLOOR} (exact arithmetic") == 2
    row = rows[0]
    first = [t for t in targets if t["case"].endswith(" thr")][0]
    name = first["target"].split(" ", 1)[1]
    assert first["value"] == row["ratios"][name]
    assert first["limit"] == ratios[name][row["pass"]]
    passed = sum(t["status"] == "PASS" for t in targets)
    assert (f"Targets: {passed} PASS, {len(targets) - passed} MISS"
            in stdout)
    assert "Targets of issue 33 " in stdout
    fake = [dict(r, ratios={k: 0.5 for k in r["ratios"]},
                 errors={k: [1e-3] * len(e) for k, e in r["errors"].items()})
            for r in rows]
    assert all(t["status"] == "PASS"
               for t in bf16.evaluate_targets(dict(meta, bf16_products=True),
                                              fake)
               if "error" not in t["target"])
    slow = [dict(r, ratios={k: 2.0 for k in r["ratios"]}) for r in rows]
    assert all(t["status"] == "MISS"
               for t in bf16.evaluate_targets(meta, slow)
               if "error" not in t["target"])


def test_header_says_what_ran_where(run):
    data, stdout = run
    meta = data["meta"]
    assert meta["bf16_products"] == bool(_core._bf16_products())
    assert meta["bf16_unit"] == _core._bf16_unit()
    assert f"(unit {meta['bf16_unit']};" in stdout
    assert meta["bf16_dot_speedup"] >= 0
    assert f"at {meta['bf16_dot_speedup']:.2f}x the FMA rate" in stdout
    assert f"SIMD path {meta['config']['simd']}" in stdout
    assert "amx_bf16" in stdout and "torch " in stdout
    assert ("runs float32 products" in stdout) == (not meta["bf16_products"])
    without = dict(meta, bf16_products=False)    # what other CPUs say
    assert any("runs float32 products" in line
               for line in bf16.header(without))


def test_problem_and_flops():
    assert bf16.split(8) == (1, 8) and bf16.split(2) == (2, 1)
    p = bf16.make_problem((16, 8, 4), "causal")
    assert p["q"].shape == (2, 8, 8, 4) and p["q"].dtype == np.float32
    assert p["causal"] and p["scale"] == 0.5
    assert bf16.flops_forward((2, 8, 4), False) == 4 * 2 * 8 * 8 * 4
    assert bf16.flops_forward((2, 8, 4), True) == 2 * 2 * 8 * 8 * 4


def test_help():
    proc = subprocess.run(
        [sys.executable, "-m", "attention_c.bench", "--bf16", "--help"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--bf16" in proc.stdout and "--quick" in proc.stdout
    with pytest.raises(SystemExit):
        bf16.parse_args(["--min-repeats", "0"])
