"""The benchmark runs, checks its implementations, and writes its report.

Times are never asserted (they depend on the machine and its load); what is
checked is that ``python -m attention_c.bench`` runs end to end on a small
configuration, that every implementation it times agreed with the float64
reference before timing, and that its JSON carries the times, the ratios
and the target verdicts.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

ARGS = ["--shapes", "tiny,small", "--dtypes", "float32,float64",
        "--threads", "1", "--target", "0.01", "--min-repeats", "1",
        "--no-compile"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "attention_c.bench", *ARGS, "--json",
         str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    with open(path) as f:
        return json.load(f), proc.stdout


def test_every_configuration_is_measured(report):
    data, stdout = report
    got = {(r["shape"], r["dtype"], r["threads"]) for r in data["results"]}
    assert got == {(s, d, 1) for s in ("tiny", "small")
                   for d in ("float32", "float64")}
    for row in data["results"]:
        for key in ("ours_fwd", "ours_bwd", "ours_bwd_saved", "s1",
                    "ref_fwd"):
            t = row["times_ms"][key]
            assert np.isfinite(t) and t > 0, (row["shape"], key)
        assert row["ratios"]["fwd/S1"] == pytest.approx(
            row["times_ms"]["ours_fwd"] / row["times_ms"]["s1"])
    assert "Targets:" in stdout and "Beyond the tolerance: none" in stdout


def test_implementations_agree_before_timing(report):
    data, _ = report
    for row in data["results"]:
        tol = 1e-4 if row["dtype"] == "float32" else 1e-10
        for impl, errs in row["errors"].items():
            for name, err in errs.items():
                assert err <= tol, (row["shape"], row["dtype"], impl, name)


def test_targets_have_verdicts(report):
    data, _ = report
    assert data["targets"]
    for t in data["targets"]:
        assert t["status"] in ("PASS", "MISS", "n/a")
        if t["status"] != "n/a":
            assert (t["status"] == "PASS") == (t["ratio"] <= t["limit"])
