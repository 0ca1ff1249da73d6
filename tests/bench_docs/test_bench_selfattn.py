"""``python -m attention_c.bench --selfattn`` runs, checks and reports.

Times are never asserted (they depend on the machine and its load); what
is checked is that ``--quick`` runs end to end, that every case, shape and
thread count gets a row with every time and ratio, that both sides agreed
with float64 before timing, that the ratios, the flop count and the
targets follow their formulas, and that ``--write-docs`` rewrites the
``selfattn`` section of docs/performance.md and nothing else.
"""

import math
import pathlib
import re

import numpy as np
import pytest

from attention_c.bench import cli, docs_page, harness, selfattn
from attention_c.bench.targets import (CAUSAL_FULL, DROPOUT_FULL, FB_PEAK,
                                       PEAK, SELFATTN_SCALING,
                                       add_selfattn_ratios,
                                       evaluate_selfattn)
from attention_c.testing import page_section, run_quick_bench

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "performance.md"
THREADS = (1, 2)
TIMES = ("ours_fwd", "ours_fwdbwd", "sdpa_fwd", "sdpa_fwdbwd")


def expected_rows():
    """(case, shape, threads) of every row of a --quick run."""
    found = set()
    for index, shape in enumerate(selfattn.QUICK_SHAPES):
        cases = (selfattn.CASES if index in selfattn.DROPOUT_BIAS_SHAPES
                 else selfattn.CASES[:2])
        found |= {(c, shape, n) for c in cases for n in THREADS}
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One --quick run, its JSON, its report and the page it rewrote."""
    pytest.importorskip("torch")       # the baseline
    return run_quick_bench(["attention_c.bench", "--selfattn"],
                           tmp_path_factory.mktemp("selfattn"), PAGE)


def by_key(data):
    return {(r["case"], tuple(r["shape"]), r["threads"]): r
            for r in data["results"]}


def test_every_row_is_measured(run):
    data, _, _ = run
    rows = by_key(data)
    assert set(rows) == expected_rows()
    for (case, shape, threads), row in rows.items():
        assert math.prod(row["lead"]) == shape[0]
        for key in TIMES:
            t = row["times_ms"][key]
            assert np.isfinite(t) and t > 0, (case, shape, threads, key)


def test_every_ratio_follows_its_times(run):
    data, _, _ = run
    rows = by_key(data)
    for (case, shape, threads), row in rows.items():
        t, r = row["times_ms"], row["ratios"]
        assert r["f+b/sdpa"] == pytest.approx(
            t["ours_fwdbwd"] / t["sdpa_fwdbwd"])
        assert r["fwd/sdpa"] == pytest.approx(t["ours_fwd"] / t["sdpa_fwd"])
        if case == "causal":
            full = rows["full", shape, threads]["times_ms"]
            assert r[CAUSAL_FULL] == pytest.approx(
                t["ours_fwdbwd"] / full["ours_fwdbwd"])
        else:
            assert CAUSAL_FULL not in r
        if threads > 1:
            one = rows[case, shape, 1]["times_ms"]
            assert r[SELFATTN_SCALING] == pytest.approx(
                t["ours_fwdbwd"] / one["ours_fwdbwd"])
        else:
            assert SELFATTN_SCALING not in r
        flops = selfattn.flops_forward(shape, case in ("causal", "mask"))
        assert row["fwd_gflops"] == pytest.approx(
            flops / t["ours_fwd"] * 1e3 / 1e9)
        # the peak timed in the row's rounds (no bound against the
        # header's: the host's speed drifts between them)
        peak = row["peak_gflops"]
        assert np.isfinite(peak) and peak > 0
        assert harness.PROBE not in t
        assert r[PEAK] == pytest.approx(row["fwd_gflops"] / peak)


def test_both_sides_agree_before_timing(run):
    data, stdout, _ = run
    for row in data["results"]:
        names = {"ours"} if row["case"] == "dropout" else {"ours", "sdpa"}
        assert set(row["errors"]) == names
        for impl, errs in row["errors"].items():
            expected = {"out", "dq", "dk", "dv"}
            if row["case"] == "bias":
                expected.add("dbias")
            assert set(errs) == expected
            assert max(errs.values()) <= selfattn.TOLERANCE, (row, impl)
    assert "WARNING" not in stdout


def test_memory_and_long_call(run):
    data, _, _ = run
    memory, long = data["memory"], data["long"]
    assert tuple(memory["shape"]) == selfattn.QUICK_MEMORY_SHAPE
    assert memory["ours_mib"] >= 0 and memory["sdpa_mib"] > 0
    assert memory["ratio"] == pytest.approx(
        memory["ours_mib"] / memory["sdpa_mib"])
    assert tuple(long["shape"]) == selfattn.QUICK_LONG_SHAPE
    assert long["threads"] == max(THREADS)
    assert long["ours_s"] > 0 and long["sdpa_s"] > 0
    assert long["ratio"] == pytest.approx(long["ours_s"] / long["sdpa_s"])
    assert "others_load" in long
    assert max(long["difference"].values()) <= selfattn.TOLERANCE


def test_every_target_gets_a_verdict(run):
    data, stdout, _ = run
    found = {(t["target"], t["case"]) for t in data["targets"]}
    assert found == {("f+b/sdpa", "full"), ("f+b/sdpa", "causal"),
                     ("f+b/sdpa", "dropout"), ("f+b/sdpa", "bias"),
                     ("f+b/sdpa", "mask"), ("fwd/sdpa", "mask"),
                     ("fwd/sdpa", "full"), ("fwd/sdpa", "causal"),
                     (DROPOUT_FULL, "dropout"), (FB_PEAK, "full"),
                     (FB_PEAK, "causal"), (CAUSAL_FULL, "causal"),
                     (SELFATTN_SCALING, "full"),
                     (SELFATTN_SCALING, "causal"), (PEAK, "full"),
                     (PEAK, "causal"), ("peak memory ours/sdpa", "full")}
    # against SDPA and dropout/full on every row; the others from the
    # second shape on
    n_rows = len(data["results"])
    assert sum(t["target"] == "f+b/sdpa" for t in data["targets"]) == n_rows
    small = tuple(selfattn.QUICK_SHAPES[0])
    assert not any(tuple(t["shape"]) == small for t in data["targets"]
                   if t["target"] not in ("f+b/sdpa", "fwd/sdpa",
                                          DROPOUT_FULL))
    assert all(t["status"] in ("PASS", "MISS") for t in data["targets"])
    assert re.search(r"Targets: \d+ PASS, \d+ MISS", stdout)


def test_report_names_the_simd_path(run):
    data, stdout, _ = run
    simd = data["meta"]["config"]["simd"]
    assert f"SIMD path {simd}" in stdout
    for case, shape, threads in expected_rows():
        pattern = (rf"^{case}\s+\({', '.join(map(str, shape))}\) = .*"
                   rf"\s{threads}\s")
        assert re.search(pattern, stdout, re.M), (case, shape, threads)


def outside(text, name):
    return docs_page.replace_sections(text, {name: ""})


def test_write_docs_rewrites_the_section(run):
    data, _, page = run
    committed = PAGE.read_text(encoding="utf-8")
    assert outside(page, "selfattn") == outside(committed, "selfattn")
    section = page_section(page, "selfattn")
    simd = data["meta"]["config"]["simd"]
    assert f"**{simd}** path" in section and "1 and 2 threads" in section
    assert "--quick" in section
    lines = [line for line in section.splitlines()
             if line.startswith("| ") and not line.startswith("| case")]
    assert len(lines) == len([k for k in expected_rows() if k[2] == 1])
    for line in lines:             # every ratio cell is filled in
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert all(re.fullmatch(r"[\d.]+", c) for c in cells[2:6]), line
        assert re.fullmatch(r"[\d.]+", cells[7]), line
        assert re.fullmatch(r"\d+% / \d+%", cells[8]), line
        assert re.fullmatch(r"\d+% / \d+%", cells[9]), line
        assert re.fullmatch(r"(\d+%|\?) / (\d+%|\?)", cells[10]), line
        if cells[0] == "causal":
            assert re.fullmatch(r"[\d.]+ / [\d.]+", cells[6]), line
    assert "**Peak memory**" in section
    assert "**One causal forward + backward**" in section
    assert "**Targets of issues 32, 26 and 19:**" in section


def test_ratios_and_targets_from_a_fake_run():
    peak = {"simd": "avx512", "seconds": 0.2, "peaks": [
        {"simd": "avx512", "dtype": "float32", "threads": n,
         "gflops": 64.0 * n} for n in (1, 2)]}
    rows = []
    for case, threads, fb in (("full", 1, 10.0), ("full", 2, 6.0),
                              ("causal", 1, 5.0), ("causal", 2, 2.0)):
        rows.append({"case": case, "shape": [8, 1024, 64],
                     "threads": threads, "at_scale": True,
                     "others_load": 0.0, "fwd_gflops": 32.0,
                     "fwdbwd_gflops": 48.0,
                     "times_ms": {"ours_fwd": 1.0, "ours_fwdbwd": fb,
                                  "sdpa_fwd": 4.0, "sdpa_fwdbwd": 20.0}})
    add_selfattn_ratios(rows, peak)
    full1, full2, causal1, causal2 = (r["ratios"] for r in rows)
    assert full1["f+b/sdpa"] == 0.5 and full1["fwd/sdpa"] == 0.25
    assert causal1[CAUSAL_FULL] == 0.5 and causal2[CAUSAL_FULL] == 2 / 6
    assert full2[SELFATTN_SCALING] == 0.6
    assert causal2[SELFATTN_SCALING] == 0.4
    assert full1[PEAK] == 0.5 and full2[PEAK] == 0.25   # 64, 128 GF/s
    assert full1[FB_PEAK] == 0.75 and full2[FB_PEAK] == 0.375
    memory = {"shape": [8, 8192, 64], "threads": 2, "ratio": 1.6}
    verdicts = {(t["target"], t["case"], t["threads"]): t["status"]
                for t in evaluate_selfattn(rows, memory)}
    assert verdicts["f+b/sdpa", "full", 1] == "PASS"          # 0.5
    assert verdicts["f+b/sdpa", "causal", 1] == "PASS"        # 0.25
    assert verdicts["fwd/sdpa", "full", 1] == "PASS"          # 0.25
    assert verdicts[SELFATTN_SCALING, "full", 2] == "MISS"    # 0.6
    assert verdicts[SELFATTN_SCALING, "causal", 2] == "PASS"  # 0.4
    assert verdicts[CAUSAL_FULL, "causal", 2] == "PASS"       # 0.33
    assert verdicts[PEAK, "full", 1] == "MISS"                # 50%
    assert verdicts[FB_PEAK, "full", 1] == "MISS"             # 75% < 80%
    assert verdicts[FB_PEAK, "full", 2] == "MISS"             # 38%
    assert verdicts["peak memory ours/sdpa", "full", 2] == "MISS"
    rows[0]["at_scale"] = False       # T < 1024: against SDPA only
    assert {t["target"] for t in evaluate_selfattn(rows[:1])} == {
        "f+b/sdpa", "fwd/sdpa"}


def test_problem_and_flops():
    assert selfattn.split(32) == (4, 8) and selfattn.split(2) == (2, 1)
    p = selfattn.make_problem((16, 8, 4), "causal")
    assert p["q"].shape == (2, 8, 8, 4) and p["q"].dtype == np.float32
    assert p["kwargs"] == {"causal": True, "scale": 0.5} and p["bias"] is None
    p = selfattn.make_problem((2, 8, 4), "bias")
    assert p["bias"].shape == (1, 1, 8, 8)
    assert p["kwargs"]["bias"] is p["bias"]
    p = selfattn.make_problem((2, 8, 4), "dropout")
    assert p["kwargs"]["dropout"] == 0.1 and p["kwargs"]["seed"] is not None
    p = selfattn.make_problem((2, 8, 4), "mask")
    assert p["mask"].dtype == bool and p["kwargs"]["attn_mask"] is p["mask"]
    assert np.array_equal(p["mask"][0, 0], np.tril(np.ones((8, 8), bool)))
    assert not p["kwargs"]["causal"] and p["bias"] is None
    assert selfattn.flops_forward((2, 8, 4), False) == 4 * 2 * 8 * 8 * 4
    assert selfattn.flops_forward((2, 8, 4), True) == 2 * 2 * 8 * 8 * 4


def test_options(capsys):
    options = selfattn.parse_args([])
    assert options.threads == [1, 2] and options.min_repeats >= 3
    assert selfattn.parse_args(["--quick"]).target < options.target
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--help"])
    assert exc.value.code == 0
    assert "--selfattn" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        selfattn.parse_args(["--min-repeats", "0"])


def test_the_page_has_the_section():
    text = PAGE.read_text(encoding="utf-8")
    assert text.count("<!-- bench:selfattn -->") == 1
    assert docs_page.replace_sections(text, {"selfattn": "x"}).count(
        "<!-- bench:selfattn -->\nx\n<!-- /bench:selfattn -->") == 1
