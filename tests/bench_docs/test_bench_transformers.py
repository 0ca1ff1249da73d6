"""``python -m attention_c.bench --transformers`` runs, checks and
reports.

Times are never asserted (they depend on the machine and its load); what
is checked is that ``--quick`` runs end to end, that every case is timed
at every thread count with both backends and its ratio follows its times,
that every memory pair is there, that every model agreed with its
baseline before timing, that every target gets a verdict, and that
``--write-docs`` rewrites the ``transformers`` section of
docs/performance.md and nothing else.
"""

import pathlib
import re

import numpy as np
import pytest

from attention_c.bench import cli, docs_page
from attention_c.bench import transformers as bt
from attention_c.testing import page_section, run_quick_bench

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "performance.md"
THREADS = (1, 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One --quick run, its JSON, its report and the page it rewrote."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return run_quick_bench(["attention_c.bench", "--transformers"],
                           tmp_path_factory.mktemp("transformers"), PAGE)


def test_json_keys(run):
    data, _, _ = run
    assert set(data) == {"meta", "checks", "rows", "memory", "targets"}
    meta = data["meta"]
    assert meta["quick"] and meta["cpu"] and meta["transformers"]
    assert meta["threads"] == list(THREADS)
    assert set(meta["sizes"]) == set(bt.QUICK_SIZES)


def test_every_case_is_timed(run):
    data, _, _ = run
    rows = {(r["case"], r["threads"]): r for r in data["rows"]}
    assert set(rows) == {(c[0], n) for c in bt.CASES for n in THREADS}
    for name, model, task, base, _, target in bt.CASES:
        for n in THREADS:
            r = rows[name, n]
            assert (r["model"], r["task"], r["baseline"]) == (model, task,
                                                              base)
            assert set(r["times_ms"]) == {bt.OURS, base}
            assert all(np.isfinite(t) and t > 0
                       for t in r["times_ms"].values())
            assert r["ratio"] == pytest.approx(
                r["times_ms"][bt.OURS] / r["times_ms"][base])
            assert r["target"] == target


def test_memory(run):
    data, _, _ = run
    memory = {m["model"]: m for m in data["memory"]}
    assert set(memory) == {m for m, _, _ in bt.MEMORY}
    for m in memory.values():
        assert m["threads"] == max(THREADS)
        assert m["baseline"] == bt.BASELINE[m["model"]]
        assert m["ours_mib"] >= 0 and m["baseline_mib"] > 0
        assert m["ratio"] == pytest.approx(m["ours_mib"] / m["baseline_mib"])


def test_checked_before_timing(run):
    data, stdout, _ = run
    assert set(data["checks"]) == set(bt.BASELINE)
    for model, check in data["checks"].items():
        assert check["baseline"] == bt.BASELINE[model]
        assert check["logits"] <= bt.TOLERANCE, model
    assert "ERROR" not in stdout


def test_every_target_gets_a_verdict(run):
    data, stdout, _ = run
    found = {(t["case"], t["threads"]) for t in data["targets"]}
    expected = {(c[0], n) for c in bt.CASES for n in THREADS}
    expected |= {(m, max(THREADS)) for m, _, _ in bt.MEMORY}
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
    assert outside(page, "transformers") == outside(committed,
                                                    "transformers")
    section = page_section(page, "transformers")
    assert data["meta"]["cpu"] in section and "--quick" in section
    assert f"**{data['meta']['config']['simd']}** path" in section
    for name, *_ in bt.CASES:
        assert f"| {name} |" in section
    for model, _, _ in bt.MEMORY:
        assert f"| {model} |" in section
    assert "**Checked before timing:**" in section
    assert "**Targets of issue 27:**" in section


def test_options(capsys):
    options = bt.parse_args([])
    assert options.threads == [1, 2] and options.min_repeats >= 3
    assert bt.parse_args(["--quick"]).target < options.target
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--help"])
    assert exc.value.code == 0
    assert "--transformers" in capsys.readouterr().out


def test_the_page_has_the_section():
    text = PAGE.read_text(encoding="utf-8")
    assert text.count("<!-- bench:transformers -->") == 1
    assert "## Inside transformers models, measured" in text
