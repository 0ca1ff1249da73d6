"""``python -m attention_c.bench --variants`` runs, checks and reports.

Times are never asserted (they depend on the machine and its load); what
is checked is that ``--quick`` runs end to end, that every ratio, PyTorch
comparison and memory pair is there and follows its times, that every
function agreed with the float64 reference before timing, that the
thread counts gave bitwise identical results, and that ``--write-docs``
rewrites the ``variants`` section of docs/performance.md and nothing
else.
"""

import pathlib
import re

import numpy as np
import pytest

from attention_c.bench import cli, docs_page, variants
from attention_c.testing import page_section, run_quick_bench

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "performance.md"
THREADS = (1, 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One --quick run, its JSON, its report and the page it rewrote."""
    pytest.importorskip("torch")       # the baseline
    return run_quick_bench(["attention_c.bench", "--variants"],
                           tmp_path_factory.mktemp("variants"), PAGE)


def test_json_keys(run):
    data, _, _ = run
    assert set(data) == {"meta", "checks", "groups", "ratios", "torch",
                         "memory", "bitwise", "targets"}
    assert data["meta"]["quick"] and data["meta"]["cpu"]
    sizes = dict(variants.QUICK_SIZES,
                 packed=list(variants.QUICK_SIZES["packed"]))
    assert data["meta"]["sizes"] == sizes


def test_every_group_is_timed(run):
    data, _, _ = run
    found = {(r["group"], r["threads"]) for r in data["groups"]}
    assert found == {(g, n) for g in variants.GROUPS for n in THREADS}
    for row in data["groups"]:
        assert set(row["times_ms"]) == set(variants.GROUPS[row["group"]])
        assert all(np.isfinite(t) and t > 0
                   for t in row["times_ms"].values())


def test_every_ratio_follows_its_times(run):
    data, _, _ = run
    groups = {(r["group"], r["threads"]): r["times_ms"]
              for r in data["groups"]}
    found = {(r["ratio"], r["threads"]): r for r in data["ratios"]}
    assert set(found) == {(r[0], n) for r in variants.RATIOS
                          for n in THREADS}
    for name, num, den, group, limit, kind in variants.RATIOS:
        for n in THREADS:
            r, t = found[name, n], groups[group, n]
            assert r["value"] == pytest.approx(t[num] / t[den])
            assert r["target"] == limit
            assert (r["theory"] is None) == (kind is None)
    sizes = variants.QUICK_SIZES
    assert found["window/causal", 1]["theory"] == pytest.approx(
        sizes["window"] / (sizes["window_T"] / 2))
    assert found["packed/causal", 1]["theory"] == pytest.approx(
        1 / sizes["packed"][0])


def test_torch_and_memory(run):
    data, _, _ = run
    rows = {(r["variant"], r["threads"]): r for r in data["torch"]}
    assert set(rows) == {(v, n) for v in variants.TORCH_VARIANTS
                         for n in THREADS}
    for row in rows.values():
        t = row["times_ms"]
        assert row["ratio"] == pytest.approx(t["ours"] / t["torch"])
    memory = {m["variant"]: m for m in data["memory"]}
    assert set(memory) == set(variants.TORCH_VARIANTS)
    for m in memory.values():
        assert m["threads"] == max(THREADS)
        assert m["ours_mib"] >= 0 and m["torch_mib"] > 0
        assert m["ratio"] == pytest.approx(m["ours_mib"] / m["torch_mib"])


def test_checked_before_timing_and_bitwise(run):
    data, stdout, _ = run
    expected = {"ours " + c for g in variants.GROUPS.values() for c in g}
    expected |= {"torch " + v for v in variants.TORCH_VARIANTS}
    assert set(data["checks"]) == expected
    for name, errs in data["checks"].items():
        assert {"out", "dq", "dk", "dv"} <= set(errs), name
        assert max(errs.values()) <= variants.TOLERANCE, name
    assert "dsinks" in data["checks"]["ours sinks"]
    assert "dsinks" in data["checks"]["torch sinks"]
    assert "dslopes" in data["checks"]["ours alibi_slopes"]
    bits = data["bitwise"]
    assert bits["threads"] == [1, 2, 3] and bits["identical"]
    assert {"window", "softcap", "alibi_slopes", "sinks",
            "cu_seqlens_q"} <= set(bits["kwargs"])
    assert "WARNING" not in stdout


def test_every_target_gets_a_verdict(run):
    data, stdout, _ = run
    found = {(t["target"], t["case"], t["threads"]) for t in data["targets"]}
    expected = {(r[0], r[0], n) for r in variants.RATIOS for n in THREADS}
    expected |= {("time ours/torch", v, n) for v in variants.TORCH_VARIANTS
                 for n in THREADS}
    expected |= {("memory ours/torch", v, max(THREADS))
                 for v in variants.TORCH_VARIANTS}
    assert found == expected
    assert all(t["status"] == ("PASS" if t["value"] <= t["limit"]
                               else "MISS") for t in data["targets"])
    assert re.search(r"Targets: \d+ PASS, \d+ MISS", stdout)
    assert f"CPU: {data['meta']['cpu']}" in stdout


def outside(text, name):
    return docs_page.replace_sections(text, {name: ""})


def test_write_docs_rewrites_the_section(run):
    data, _, page = run
    committed = PAGE.read_text(encoding="utf-8")
    assert outside(page, "variants") == outside(committed, "variants")
    section = page_section(page, "variants")
    assert data["meta"]["cpu"] in section and "--quick" in section
    assert f"**{data['meta']['config']['simd']}** path" in section
    for name, *_ in variants.RATIOS:
        assert f"| {name} |" in section
    for v in variants.TORCH_VARIANTS:
        assert f"| {v} |" in section
    assert "**Bitwise identical at 1, 2, 3 threads**" in section
    assert "**Targets of issue 25:**" in section


def test_options(capsys):
    options = variants.parse_args([])
    assert options.threads == [1, 2] and options.min_repeats >= 3
    assert variants.parse_args(["--quick"]).target < options.target
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--help"])
    assert exc.value.code == 0
    assert "--variants" in capsys.readouterr().out


def test_problem_and_forms():
    p = variants.make_problem(16, 4)
    assert p["q"].shape == (1, variants.HEADS, 16, 4)
    assert p["slopes"].shape == p["sinks"].shape == (1, variants.HEADS)
    assert list(variants.cu_seqlens(4, 16)) == [0, 4, 8, 12, 16]
    kw = variants.case_kwargs("min_bias", p, 4, 2)
    assert (kw["bias"][..., 12:] == np.finfo(np.float32).min).all()
    assert np.array_equal(kw["bias"][..., :12], p["bias"][..., :12])
    bias = variants.alibi_bias(p["slopes"], 16)
    assert bias.shape == (1, variants.HEADS, 16, 16)
    assert bias[0, 0, 3, 5] == pytest.approx(-2 * p["slopes"][0, 0])


def test_the_page_has_the_section():
    text = PAGE.read_text(encoding="utf-8")
    assert text.count("<!-- bench:variants -->") == 1
