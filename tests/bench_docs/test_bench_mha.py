"""``python -m attention_c.bench.mha`` runs, checks and reports.

Times are never asserted (they depend on the machine and its load); what
is checked is that ``--quick`` runs end to end, that every part, case and
thread count gets a row with every time and ratio, that every
implementation agreed with float64 PyTorch before timing, that the
ratios and the targets follow their formulas, that the decode-step
baselines compute what ours does step after step, and that
``--write-docs`` writes the ``mha`` section of docs/performance.md and
nothing else.
"""

import pathlib
import re

import numpy as np
import pytest

from attention_c.bench import docs_page, harness, mha
from attention_c.testing import page_section, run_quick_bench

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "performance.md"
THREADS = (1, 2)
TIMES = {"module": ("ours", "torch"), "decode": ("ours", "numpy", "sdpa"),
         "step": ("ours", "prefix", "cache")}
RATIOS = {"module": {"ours/torch": ("ours", "torch")},
          "decode": {"ours/sdpa": ("ours", "sdpa"),
                     "numpy/sdpa": ("numpy", "sdpa")},
          "step": {"ours/prefix": ("ours", "prefix"),
                   "ours/cache": ("ours", "cache")}}
UNIT = {"module": "times_ms", "decode": "times_us", "step": "times_us"}


def expected_rows():
    """(part, case, threads) of every row of a --quick run."""
    cases = ([("module", c) for c in mha.MODULE_CASES]
             + [("decode", f"cache {n}") for n in mha.QUICK_DECODE_CACHES]
             + [("step", f"cache {mha.QUICK_STEP_SHAPE[2]}")])
    return {(part, case, n) for part, case in cases for n in THREADS}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One --quick run, its JSON, its report and the page it rewrote."""
    pytest.importorskip("torch")       # the baseline
    return run_quick_bench(["attention_c.bench.mha"],
                           tmp_path_factory.mktemp("mha"), PAGE)


def by_key(data):
    return {(r["part"], r["case"], r["threads"]): r for r in data["results"]}


def test_every_row_is_measured(run):
    data, _, _ = run
    rows = by_key(data)
    assert set(rows) == expected_rows()
    for (part, case, threads), row in rows.items():
        times = row[UNIT[part]]
        assert set(times) == set(TIMES[part])
        for key, t in times.items():
            assert np.isfinite(t) and t > 0, (part, case, threads, key)
            assert row["repeats"][key] >= 1


def test_every_ratio_follows_its_times(run):
    data, _, _ = run
    for row in data["results"]:
        times = row[UNIT[row["part"]]]
        assert set(row["ratios"]) == set(RATIOS[row["part"]])
        for name, (num, den) in RATIOS[row["part"]].items():
            assert row["ratios"][name] == pytest.approx(times[num]
                                                        / times[den])


def test_everyone_agrees_before_timing(run):
    data, stdout, _ = run
    params = {"din_proj_weight", "din_proj_bias", "dout_proj.weight",
              "dout_proj.bias"}
    for row in data["results"]:
        assert set(row["errors"]) == set(TIMES[row["part"]])
        for impl, errs in row["errors"].items():
            expected = {"out"}
            if row["part"] == "module":
                expected |= {"dx"} | params
                if row["case"] == "weights":
                    expected.add("weights")
            assert set(errs) == expected, (row["part"], impl)
            assert max(errs.values()) <= mha.TOLERANCE, (row, impl)
    assert "WARNING" not in stdout


def test_step_samples_whole_windows(run):
    data, _, _ = run
    window = mha.QUICK_STEP_SHAPE[3]
    for row in data["results"]:
        if row["part"] == "step":
            assert row["window"] == window
            for n in row["repeats"].values():
                assert n % window == 0 and n >= harness.ROUNDS * window


def test_every_target_gets_a_verdict(run):
    data, stdout, _ = run
    target = f"cache {mha.QUICK_DECODE_CACHES[mha.DECODE_TARGET_INDEX]}"
    found = {(t["part"], t["case"], t["target"], t["threads"])
             for t in data["targets"]}
    assert found == {(part, case, ratio, n) for n in THREADS
                     for part, case, ratio in (
                         ("module", "no_weights", "ours/torch"),
                         ("module", "weights", "ours/torch"),
                         ("decode", target, "ours/sdpa"),
                         ("decode", target, "numpy/sdpa"))}
    rows = by_key(data)
    for t in data["targets"]:
        ratio = rows[t["part"], t["case"], t["threads"]]["ratios"][
            t["target"]]
        assert t["ratio"] == ratio
        assert t["status"] == ("PASS" if ratio <= t["limit"] else "MISS")
    counts = [t["status"] for t in data["targets"]]
    assert (f"Targets: {counts.count('PASS')} PASS, "
            f"{counts.count('MISS')} MISS.") in stdout


def test_report_names_the_simd_path_and_every_row(run):
    data, stdout, _ = run
    simd = data["meta"]["config"]["simd"]
    assert f"SIMD path {simd}" in stdout
    for part, case, threads in expected_rows():
        first = (mha.MODULE_TEXT[case] if part == "module"
                 else case.split()[1])
        pattern = rf"^{re.escape(first)}\s+{threads}\s"
        assert re.search(pattern, stdout, re.M), (part, case, threads)
    # every row of a part with targets names them, the others "(none)"
    assert stdout.count("ours/torch <= 0.6: ") == len(THREADS)
    assert stdout.count("ours/torch <= 0.9 (issue 26): ") == len(THREADS)
    assert stdout.count("ours/torch <= 0.4: ") == len(THREADS)
    assert stdout.count("numpy/sdpa <= 0.5: ") == len(THREADS)


def test_write_docs_writes_the_section_only(run):
    data, _, page = run
    committed = PAGE.read_text(encoding="utf-8")
    if "<!-- bench:mha -->" in committed:
        assert (docs_page.replace_sections(page, {"mha": ""})
                == docs_page.replace_sections(committed, {"mha": ""}))
    else:                            # appended under its heading
        assert page.startswith(committed)
        assert mha.HEADING in page[len(committed):]
    section = page_section(page, "mha")
    simd = data["meta"]["config"]["simd"]
    assert f"**{simd}** path" in section and "1 and 2 threads" in section
    assert "--quick" in section
    tables = [[line for line in block.splitlines()
               if line.startswith("| ")]
              for block in section.split("\n\n") if block.startswith("| ")]
    assert len(tables) == 3
    rows = [len(t) - 1 for t in tables]        # less the header
    assert rows == [len(mha.MODULE_CASES), len(mha.QUICK_DECODE_CACHES), 1]
    for table in tables:
        for line in table[1:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            pairs = [c for c in cells if re.fullmatch(r"[\d.]+ / [\d.]+",
                                                      c)]
            assert pairs, line          # the ratios at 1 and 2 threads
            assert re.fullmatch(r"(\d+%|\?) / (\d+%|\?)", cells[-1]), line
            assert re.search(r"(PASS|MISS)|\(none\)", cells[-2]), line
    assert "**Targets of issue 20:**" in section


def test_write_docs_replaces_an_existing_section(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\nprose\n", encoding="utf-8")
    mha.write_docs(str(page), "first")
    once = page.read_text(encoding="utf-8")
    assert once == ("# Performance\n\nprose\n\n" + mha.HEADING
                    + "\n\n<!-- bench:mha -->\nfirst\n<!-- /bench:mha -->\n")
    mha.write_docs(str(page), "second")
    assert page.read_text(encoding="utf-8") == once.replace("first",
                                                            "second")
    mha.write_docs(str(tmp_path / "new.md"), "alone")
    assert "<!-- bench:mha -->\nalone\n<!-- /bench:mha -->" in (
        tmp_path / "new.md").read_text(encoding="utf-8")


def fake_row(part, case, threads, ratios, load=0.0):
    return {"part": part, "case": case, "threads": threads,
            "ratios": ratios, "others_load": load}


def test_targets_from_fake_rows():
    rows = [fake_row("module", "no_weights", 1, {"ours/torch": 0.6}),
            fake_row("module", "no_weights", 2, {"ours/torch": 0.61}),
            fake_row("module", "weights", 1, {"ours/torch": 0.39}, 0.5),
            fake_row("module", "causal", 1, {"ours/torch": 9.0}),
            fake_row("decode", "cache 1024", 1,
                     {"ours/sdpa": 0.5, "numpy/sdpa": 0.7}),
            fake_row("decode", "cache 16", 1,
                     {"ours/sdpa": 9.0, "numpy/sdpa": 9.0}),
            fake_row("step", "cache 1024", 1,
                     {"ours/prefix": 9.0, "ours/cache": 9.0})]
    found = {(t["part"], t["case"], t["target"], t["threads"]):
             (t["status"], t["disturbed"])
             for t in mha.evaluate(rows, 1024)}
    assert found == {
        ("module", "no_weights", "ours/torch", 1): ("PASS", False),
        ("module", "no_weights", "ours/torch", 2): ("MISS", False),
        ("module", "weights", "ours/torch", 1): ("PASS", True),
        ("decode", "cache 1024", "ours/sdpa", 1): ("PASS", False),
        ("decode", "cache 1024", "numpy/sdpa", 1): ("MISS", False)}
    issue26 = [t["status"] for t in mha.evaluate(rows, 1024)
               if t["limit"] == 0.9]
    assert issue26 == ["PASS", "PASS"]             # 0.6 and 0.61 <= 0.9
    assert mha.verdicts(mha.evaluate(rows, 1024), rows[3]) == "(none)"
    assert mha.verdicts(mha.evaluate(rows, 1024), rows[4]) == (
        "ours/sdpa <= 0.5: PASS; numpy/sdpa <= 0.5: MISS")


def test_measure_steps_fills_then_times_whole_windows():
    log = []

    def impl(name, window):
        state = {}

        def fill():
            state["n"] = 10
            log.append((name, "fill"))

        def step():
            state["n"] += 1
            log.append((name, state["n"]))

        return fill, step, window

    found = mha.measure_steps({"a": impl("a", 4), "b": impl("b", 3)},
                              target=0.0, min_repeats=7)
    # 7 samples over 3 rounds: 3 a round, so one window of 4 (a) and one
    # of 3 (b) a round, each after a fill and one untimed step
    assert found["a"][1] == 3 * 4 and found["b"][1] == 3 * 3
    assert all(t >= 0 for t, _ in found.values())
    a = [entry for name, entry in log if name == "a"]
    assert a == 3 * ["fill", 11, 12, 13, 14, 15]
    order = [name for name, entry in log if entry == "fill"]
    assert order == ["a", "b", "b", "a", "a", "b"]     # reversed rounds


@pytest.mark.parametrize("heads,start", [(1, 1), (3, 4), (4, 17)])
def test_step_baselines_decode_like_ours(heads, start):
    torch = pytest.importorskip("torch")
    E = 4 * heads
    p = mha.step_problem(torch, (E, heads, start + 3, 3), seed=heads)
    with torch.no_grad():
        impls = mha.step_impls(torch, p, start)
        outs = {}
        for name, (fill, step, window) in impls.items():
            assert window == 3
            fill()
            outs[name] = [step() for _ in range(window + 1)]
        ref = mha.make_module(torch.nn.MultiheadAttention, p,
                              torch.float64).eval()
        X = p["X"].double()
        for i in range(4):
            n = start + i + 1           # the positions step i sees
            exact = ref(X[:, n - 1:n], X[:, :n], X[:, :n],
                        need_weights=False)[0]
            for name, found in outs.items():
                assert found[i].shape == (1, 1, E)
                err = harness.errors({"out": found[i].double().numpy()},
                                     {"out": exact.numpy()})["out"]
                assert err <= 2e-6, (name, i, err)


def test_decode_problem_reads_strided_views():
    p = mha.decode_problem(17, seed=3)
    heads, d = mha.DECODE_HEADS
    assert p["q"].shape == (1, heads, 1, d)
    for name in ("k", "v"):
        x = p[name]
        assert x.shape == (1, heads, 17, d) and x.dtype == np.float32
        assert not x.flags.c_contiguous
        assert x.strides[1] == 2 * 17 * d * 4    # a cache of 2n positions


def test_options():
    options = mha.parse_args([])
    assert options.threads == [1, 2] and options.min_repeats >= 3
    assert options.parts == list(mha.PARTS)
    quick = mha.parse_args(["--quick", "--parts", "decode,step"])
    assert quick.target < options.target and quick.parts == ["decode",
                                                             "step"]
    for bad in (["--min-repeats", "0"], ["--parts", "module,nope"],
                ["--threads", "0"]):
        with pytest.raises(SystemExit):
            mha.parse_args(bad)
