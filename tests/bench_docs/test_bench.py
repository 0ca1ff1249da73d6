"""The benchmark runs, checks its implementations, and writes its report.

Times are never asserted (they depend on the machine and its load); what is
checked is that ``python -m attention_c.bench --quick`` runs end to end,
that its baselines do the layer's work (S1 multiplies exactly the rows the
layer computes, PyTorch gets the same mask), that every implementation it
times agreed with the float64 reference before timing, that every target
of issue 10 gets a verdict on full and ragged sequences at 1 and 2
threads, that the derived figures (ratios, GFLOP/s, the share of the
FMA peak) follow their formulas, and that the FMA peak is measured on
this CPU, named in the report's header with the CPU.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from attention_c.bench import cli, docs_page, harness
from attention_c.bench.core import gflops
from attention_c.bench.report import peak_lines
from attention_c.bench.run import (QUICK_SHAPES, SHAPES, make_problem,
                                   numpy_functions)
from attention_c.bench.targets import forward_gflops
from attention_c.testing import page_section

ARGS = ["--quick", "--threads", "1,2", "--target", "0.005",
        "--min-repeats", "1"]
MASKS = ("full", "ragged")
# The targets of issue 10: (target, shapes, thread counts).
ISSUE_TARGETS = (
    ("fwd/S1", ("small", "medium", "large", "long", "wide", "wide2"),
     (1, 2)),
    ("fwd/S1", ("tiny",), (1, 2)),
    ("f+b_sv/pt", ("wide", "wide2"), (1, 2)),
    ("f+b/pt", ("wide", "wide2", "tiny"), (1, 2)),
    ("f+b N/1", ("long1",), (2,)),
    ("fwd %peak", ("large", "wide", "wide2"), (1, 2)),
)
LIMITS = {("fwd/S1", "tiny"): 2.0, ("fwd/S1", "small"): 1.15,
          ("fwd/S1", "wide2"): 1.15, ("f+b_sv/pt", "wide"): 0.8,
          ("f+b_sv/pt", "wide2"): 0.8, ("f+b/pt", "wide2"): 0.9,
          ("f+b/pt", "tiny"): 0.1, ("f+b N/1", "long1"): 0.6,
          ("fwd %peak", "large"): 0.8}


PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "performance.md"


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    """The run's files, with a copy of docs/performance.md to rewrite."""
    path = tmp_path_factory.mktemp("bench")
    shutil.copy(PAGE, path / "performance.md")
    return path


@pytest.fixture(scope="module")
def report(bench_dir):
    pytest.importorskip("torch")      # a baseline of most targets
    path = bench_dir / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "attention_c.bench", *ARGS, "--json",
         str(path), "--write-docs", str(bench_dir / "performance.md")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    with open(path) as f:
        return json.load(f), proc.stdout


def test_every_configuration_is_measured(report):
    data, stdout = report
    got = {(r["shape"], r["mask"], r["dtype"], r["threads"])
           for r in data["results"]}
    assert got == {(s, m, "float32", n) for s in SHAPES for m in MASKS
                   for n in (1, 2)}
    for row in data["results"]:
        assert (row["B"], row["T"], row["H"], row["A"]) == QUICK_SHAPES[
            row["shape"]]
        for key in ("ours_fwd", "ours_bwd", "ours_bwd_saved",
                    "ours_fwdbwd_saved", "s1", "torch_fwdbwd"):
            t = row["times_ms"][key]
            assert np.isfinite(t) and t > 0, (row["shape"], key)
        assert row["ratios"]["fwd/S1"] == pytest.approx(
            row["times_ms"]["ours_fwd"] / row["times_ms"]["s1"])
        assert row["ratios"]["f+b_sv/pt"] == pytest.approx(
            row["times_ms"]["ours_fwdbwd_saved"]
            / row["times_ms"]["torch_fwdbwd"])
    assert "Beyond the tolerance: none" in stdout


def test_full_and_ragged_rows(report):
    """Full rows compute every item; ragged ones between half and all;
    both labels reach the tables."""
    data, stdout = report
    for row in data["results"]:
        items = row["B"] * row["T"]
        if row["mask"] == "full":
            assert row["n_valid"] == items
        else:
            assert items // 2 <= row["n_valid"] <= items
    assert any(r["n_valid"] < r["B"] * r["T"] for r in data["results"])
    lines = stdout.splitlines()
    for mask in MASKS:
        assert any(line.startswith("fwd/S1") and f" {mask} " in line
                   for line in lines), mask


def test_implementations_agree_before_timing(report):
    data, _ = report
    for row in data["results"]:
        assert {"ours", "ours_saved", "torch"} <= set(row["errors"])
        tol = 1e-4 if row["dtype"] == "float32" else 1e-10
        for impl, errs in row["errors"].items():
            for name, err in errs.items():
                assert err <= tol, (row["shape"], row["mask"], impl, name)


def test_every_issue_target_has_a_verdict(report):
    data, stdout = report
    found = {(t["target"], t["shape"], t["mask"], t["threads"]): t
             for t in data["targets"]}
    for target, shapes, threads in ISSUE_TARGETS:
        for shape in shapes:
            for mask in MASKS:
                for n in threads:
                    t = found[target, shape, mask, n]
                    assert t["status"] in ("PASS", "MISS"), t
    for (target, shape), limit in LIMITS.items():
        n = 2 if target.endswith("N/1") else 1
        assert found[target, shape, "full", n]["limit"] == limit
    for t in data["targets"]:
        assert t["status"] in ("PASS", "MISS", "n/a")
        if t["status"] != "n/a":
            passed = (t["ratio"] <= t["limit"] if t["op"] == "<="
                      else t["ratio"] >= t["limit"])
            assert (t["status"] == "PASS") == passed, t
    count = {s: sum(t["status"] == s for t in data["targets"])
             for s in ("PASS", "MISS")}
    assert f"Targets: {count['PASS']} PASS, {count['MISS']} MISS" in stdout


def test_call_cost_and_product_core_are_reported(report):
    data, stdout = report
    calls = {(c["dtype"], c["threads"]) for c in data["call_cost"]}
    assert calls == {("float32", 1), ("float32", 2)}
    for c in data["call_cost"]:
        assert c["shape"] == [1, 1, 1, 1]
        assert all(us > 0 for us in c["us"].values())
        assert {"ours_fwd", "ours_fwdbwd"} <= set(c["us"])
    assert "Fixed cost of a call" in stdout
    rows = {(g["shape"], g["threads"]): g for g in data["product_core"]}
    assert set(rows) == {(s, n) for s in ("medium", "large", "wide", "wide2")
                         for n in (1, 2)}
    for g in rows.values():
        B, T, H, A = QUICK_SHAPES[g["shape"]]
        assert (g["M"], g["K"], g["N"]) == (B * T, H, A)
        assert max(g["errors"].values()) <= 1e-4
        for impl in ("core", "blas"):
            assert g["gflops"][impl] == pytest.approx(gflops(
                g["M"], g["N"], g["K"], g["times_ms"][impl] / 1e3))
        layer = [r for r in data["results"] if r["mask"] == "full"
                 and (r["shape"], r["threads"]) == (g["shape"], g["threads"])]
        assert g["layer_fwd_gflops"] == layer[0]["fwd_gflops"]
    peak = data["meta"]["peak"]
    assert peak["simd"] == data["meta"]["config"]["simd"]
    assert peak["cpu"] == data["meta"]["cpu"]
    assert {(p["simd"], p["dtype"], p["threads"]) for p in peak["peaks"]} \
        == {(peak["simd"], "float32", n) for n in (1, 2)}
    for p in peak["peaks"]:
        assert np.isfinite(p["gflops"]) and p["gflops"] > 0
        assert f"  {p['simd']} float32 {p['threads']} thr: " \
               f"{p['gflops']:.1f} GF/s" in stdout
    # each row's peak is the probe timed among its calls, not a timing of
    # its own (no bound against the header's: this VM's speed drifts by
    # more than any bound a test could hold on every host)
    for r in list(rows.values()) + data["results"]:
        assert np.isfinite(r["peak_gflops"]) and r["peak_gflops"] > 0
        assert harness.PROBE not in r["times_ms"]
    for r in data["results"]:
        assert r["ratios"]["fwd %peak"] == pytest.approx(
            r["fwd_gflops"] / r["peak_gflops"])


def test_header_names_the_cpu_and_the_measured_peak(report):
    data, stdout = report
    header = stdout.split("\n\n")[0]
    assert f"CPU: {harness.cpu_model()}," in header
    assert f"CPU flags: {' '.join(harness.cpu_flags()) or 'unknown'};" \
        in header
    assert "FMA peak, measured" in header
    assert "FMA units" not in stdout and "assumed" not in stdout


def test_s1_multiplies_exactly_the_valid_rows():
    shape = (5, 9, 4, 3)
    for mask in MASKS:
        p = make_problem(shape, "float32", mask=mask)
        valid = (np.ones((5, 9), bool) if p["mask"] is None else p["mask"])
        assert p["n_valid"] == int(valid.sum())
        assert p["X"].shape == (p["n_valid"], 4)
        np.testing.assert_array_equal(p["X"], p["h"][valid])
        np.testing.assert_array_equal(p["Y"], p["W"][:, :4].T)
        product = numpy_functions(p, extras=False)["s1"]()
        assert product.shape == (p["n_valid"], 3)
    assert make_problem(shape, "float32", mask="full")["mask"] is None
    assert make_problem(shape, "float32", mask="ragged")["n_valid"] < 45


def test_gflops_and_peak_formulas():
    assert gflops(1000, 1000, 1000, 2.0) == pytest.approx(1.0)
    assert gflops(4096, 128, 256, 1e-3) == pytest.approx(
        2 * 4096 * 128 * 256 / 1e-3 / 1e9)
    facts = {"simd": "avx2", "seconds": 0.2, "peaks": [
        {"simd": "avx2", "dtype": "float32", "threads": 2, "gflops": 128.0},
        {"simd": "scalar", "dtype": "float32", "threads": 2,
         "gflops": 16.0}]}
    # the measured figure of the path (the facts' own by default)
    assert harness.fma_peak(facts, 2, "float32") == 128.0
    assert harness.fma_peak(facts, 2, np.float32, simd="scalar") == 16.0
    row = {"n_valid": 1000, "H": 100, "A": 50,
           "times_ms": {"ours_fwd": 1.0}}
    assert forward_gflops(row) == pytest.approx(10.0)


def test_options():
    options = cli.parse_args([])
    assert options.shapes == list(SHAPES) and options.masks == list(MASKS)
    assert options.dtypes == ["float32", "float64"]
    quick = cli.parse_args(["--quick", "--masks", "full"])
    assert quick.dtypes == ["float32"] and quick.masks == ["full"]
    assert not quick.compile
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--help"])
    assert exc.value.code == 0


def test_plot(report, tmp_path):
    pytest.importorskip("matplotlib")
    from attention_c.bench.report import make_plot
    data, _ = report
    make_plot(tmp_path / "bench.png", data["results"], data["meta"])
    assert (tmp_path / "bench.png").stat().st_size > 0


# --------------------------------------------------------------------------
# docs/performance.md: the measured sections, rewritten by --write-docs

def outside(text, names):
    """The page without the bodies of the sections ``names`` (only
    between their markers: a body's text may occur elsewhere too)."""
    return docs_page.replace_sections(text, dict.fromkeys(names, ""))


def fake_run(threads=(1, 2)):
    """meta and rows of a made-up run of two shapes, float32 only."""
    meta = {"cpu": "Test CPU", "cpus": 2, "date": "2030-01-02T03:04:05",
            "config": {"version": "9.9", "simd": "avx2",
                       "simd_best": "avx2"},
            "python": "3.x", "numpy": "2.x", "blas": "OpenBLAS",
            "torch": "2.x", "threads": list(threads),
            "shapes": ["tiny", "small"], "masks": ["full", "ragged"],
            "shape_sizes": {"tiny": (8, 16, 32, 32),
                            "small": (32, 64, 64, 64)},
            "quick": False, "wall_seconds": 12.3}
    rows = []
    for i, (shape, mask, n) in enumerate(
            (s, m, n) for s in meta["shapes"] for m in meta["masks"]
            for n in threads):
        ratios = {"fwd/S1": 1 + i / 100, "bwd/S1": 3.0, "bwd_sv/S1": 2.0,
                  "fwd/pt": 0.5, "f+b/pt": 0.6, "f+b_sv/pt": 0.5 + i / 100}
        if n > 1:
            ratios["f+b N/1"] = 0.55
        rows.append({"shape": shape, "mask": mask, "dtype": "float32",
                     "threads": n, "times_ms": {"ours_fwd": 0.0123 * (i + 1)},
                     "ratios": ratios, "others_load": 0.03})
    return meta, rows


def table_rows(body):
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in body.splitlines()[2:]]


def test_layer_tables_from_a_fake_run():
    meta, rows = fake_run()
    sections = docs_page.layer_sections(meta, rows)
    assert set(sections) == {"layer-setup", "layer-float32",
                             "layer-float64"}
    table = table_rows(sections["layer-float32"])
    assert [r[:2] for r in table] == [
        ["tiny (8, 16, 32, 32)", "full"], ["tiny (8, 16, 32, 32)", "ragged"],
        ["small (32, 64, 64, 64)", "full"],
        ["small (32, 64, 64, 64)", "ragged"]]
    one = [r for r in rows if r["threads"] == 1]
    two = [r for r in rows if r["threads"] == 2]
    for line, r1, r2 in zip(table, one, two):
        assert line[2] == f"{r1['times_ms']['ours_fwd']:.3g}"
        assert line[3] == f"{r1['ratios']['fwd/S1']:.2f}"
        assert line[9] == f"{r2['ratios']['f+b_sv/pt']:.2f}"
        assert line[10] == "0.55"
    assert sections["layer-float64"] == docs_page.NOT_MEASURED
    assert "Test CPU" in sections["layer-setup"]
    assert "2030-01-02" in sections["layer-setup"]
    assert "at most 3%" in sections["layer-setup"]
    # one thread only: the N-thread columns are '-'
    meta, rows = fake_run(threads=(1,))
    table = table_rows(docs_page.layer_sections(meta, rows)["layer-float32"])
    assert all(line[-2:] == ["-", "-"] for line in table)


def test_write_docs_keeps_the_prose(tmp_path):
    meta, rows = fake_run()
    sections = docs_page.layer_sections(meta, rows)
    page = tmp_path / "performance.md"
    shutil.copy(PAGE, page)
    before = page.read_text(encoding="utf-8")
    docs_page.write_page(page, sections)
    after = page.read_text(encoding="utf-8")
    assert outside(after, sections) == outside(before, sections)
    for name, body in sections.items():
        assert page_section(after, name) == body
    # the committed tables have the columns the writer writes
    for name in ("layer-float32", "layer-float64"):
        assert (page_section(before, name).splitlines()[0]
                == page_section(after, "layer-float32").splitlines()[0])
    # writing again changes nothing
    docs_page.write_page(page, sections)
    assert page.read_text(encoding="utf-8") == after


def test_write_docs_needs_the_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Performance\n\nno markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bench:layer-setup"):
        docs_page.write_page(page, {"layer-setup": "x"})
    assert page.read_text(encoding="utf-8") == "# Performance\n\nno markers\n"
    # a page that does not exist is made from the sections
    fresh = tmp_path / "fresh.md"
    docs_page.write_page(fresh, {"layer-setup": "text"})
    assert page_section(fresh.read_text(encoding="utf-8"),
                        "layer-setup") == "text"


def test_bench_writes_the_page(report, bench_dir):
    data, stdout = report
    written = (bench_dir / "performance.md").read_text(encoding="utf-8")
    committed = PAGE.read_text(encoding="utf-8")
    names = ("layer-setup", "layer-float32", "layer-float64")
    assert outside(written, names) == outside(committed, names)
    assert "--quick" in page_section(written, "layer-setup")
    table = table_rows(page_section(written, "layer-float32"))
    assert len(table) == len(SHAPES) * len(MASKS)
    assert page_section(written, "layer-float64") == docs_page.NOT_MEASURED
    # the family's sections are left as they were
    assert (page_section(written, "family-table")
            == page_section(committed, "family-table"))
    assert f"wrote {bench_dir / 'performance.md'}" in stdout


def test_the_fma_peak_is_measured_and_cached():
    from attention_c import _core
    for simd in _core._simd_paths():
        for dtype in ("float32", "float64"):
            record = harness.fma_peak_record(simd, dtype, 1, seconds=0.01,
                                             repeats=2)
            assert np.isfinite(record["gflops"]) and record["gflops"] > 0
            assert record["iters"] >= 1 and record["call_s"] > 0
            # CPU time <= wall time x threads: the rate per CPU time is
            # at least the wall-clock one
            assert record["busy_gflops"] >= 0.9 * record["gflops"]
            assert (record["simd"], record["dtype"], record["threads"]) == (
                simd, dtype, 1)
            # measured once per key, then the same figure
            assert harness.measure_fma_peak(simd, np.dtype(dtype), 1,
                                            seconds=0.01, repeats=2) \
                == record["gflops"]
    with pytest.raises(ValueError, match="unknown SIMD path"):
        harness.measure_fma_peak("sse2", "float32", 1, seconds=0.01)


def test_peak_facts_name_the_cpu_and_its_flags():
    from attention_c import _core
    simd = _core._simd_paths()[-1]
    facts = harness.peak_facts(simd, ["float32", "float64"], [2, 1],
                               quick=True)
    assert facts["cpu"] == harness.cpu_model() and facts["simd"] == simd
    assert [(p["dtype"], p["threads"]) for p in facts["peaks"]] == [
        ("float32", 1), ("float32", 2), ("float64", 1), ("float64", 2)]
    assert all(p["seconds"] == harness.QUICK_PEAK_SECONDS
               for p in facts["peaks"])
    if pathlib.Path("/proc/cpuinfo").exists() and simd == "avx2":
        assert {"avx2", "fma"} <= set(facts["flags"])
    if simd == "avx512":
        assert "avx512f" in facts["flags"]
    lines = peak_lines(facts)
    assert len(lines) == 2 + 4 + 1
    assert "timed among each row's calls" in lines[-1]
    assert lines[2].startswith(f"  {simd} float32 1 thr: ")
