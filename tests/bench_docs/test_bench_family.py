"""The attention-family benchmark runs, checks its baselines, and reports.

Times are never asserted (they depend on the machine and its load); what is
checked is that ``python -m attention_c.bench.family --quick`` (and the same
through ``python -m attention_c.bench --family``) runs end to end, that ours
and every PyTorch baseline it times agreed with PyTorch in float64 on every
output and gradient before timing, that the baselines compute what the
NumPy reference computes, and that the JSON carries the times, the ratios,
the target verdicts and the peak memory.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from attention_c import reference as ref
from attention_c.bench import family as bf
from attention_c.bench import docs_page, harness
from attention_c.bench.torch_forms import family_forms, stack_steps

torch = pytest.importorskip("torch")

ARGS = ["--quick", "--target", "0.01", "--min-repeats", "1"]
MASKS = {"additive": ("full", "ragged"), "decoder": ("full", "ragged"),
         "decoder_once": ("full", "ragged"),
         "dot": ("full", "causal"), "general": ("full", "causal")}
# The arrays each implementation's results are checked on.
ARRAYS = {
    "additive": {"out", "alpha", "dquery", "dkeys", "dvalues", "dW", "dv"},
    "decoder": {"out", "alpha", "dquery", "dkeys", "dW", "dv"},
    "decoder_once": {"out", "alpha", "dquery", "dkeys", "dW", "dv"},
    "dot": {"out", "alpha", "dquery", "dkeys", "dvalues"},
    "general": {"out", "alpha", "dquery", "dkeys", "dvalues", "dW"},
}
# The per-step form of the decoder (full gradients every step) is reported
# without a target; the target is on the form that projects once each way.
LIMITS = {"additive": 0.35, "decoder_once": 0.4, "dot": 0.8, "general": 0.8}


def run(module, *args):
    proc = subprocess.run([sys.executable, "-m", module, *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "performance.md"
SECTIONS = ("family-setup", "family-table")


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    """The run's files, with a copy of docs/performance.md to rewrite."""
    path = tmp_path_factory.mktemp("bench_family")
    shutil.copy(PAGE, path / "performance.md")
    return path


@pytest.fixture(scope="module")
def report(bench_dir):
    path = bench_dir / "family.json"
    stdout = run("attention_c.bench.family", *ARGS, "--json", str(path),
                 "--write-docs", str(bench_dir / "performance.md"))
    with open(path) as f:
        return json.load(f), stdout


def test_every_case_and_mask_is_measured(report):
    data, _ = report
    got = {(r["case"], r["mask"], r["threads"]) for r in data["results"]}
    assert got == {(c, m, 1) for c, masks in MASKS.items() for m in masks}
    for row in data["results"]:
        times = row["times_ms"]
        expected = {f"{impl}_{metric}" for metric in ("fwd", "fwdbwd")
                    for impl in ("ours", "torch")
                    + ("sdpa",) * (row["case"] == "dot")
                    + ("sdpa_causal",) * (row["case"] == "dot"
                                          and row["mask"] == "causal")}
        assert set(times) == expected, (row["case"], row["mask"])
        for key, t in times.items():
            assert np.isfinite(t) and t > 0, (row["case"], key)


def test_implementations_agree_before_timing(report):
    data, stdout = report
    for row in data["results"]:
        arrays = ARRAYS[row["case"]]
        for impl, errs in row["errors"].items():
            # sdpa returns no weights; every other array is compared
            want = arrays - {"alpha"} if impl.startswith("sdpa") else arrays
            assert set(errs) == want, (row["case"], impl)
            for name, err in errs.items():
                assert err <= bf.TOLERANCE, (row["case"], row["mask"], impl,
                                             name, err)
    assert "Flagged above 0.0001: 0." in stdout


def test_comparisons_have_ratios_and_verdicts(report):
    data, stdout = report
    found = data["comparisons"]
    targets = {(c["case"], c["mask"]): c for c in found
               if c["limit"] is not None and c["measure"] == "f+b ms"}
    assert set(targets) == {(c, m) for c, masks in MASKS.items()
                            for m in masks if c in LIMITS}
    for (case, _), c in targets.items():
        assert c["limit"] == LIMITS[case] and c["baseline"] == "torch"
    for c in found:
        assert c["ratio"] == pytest.approx(c["ours"] / c["theirs"])
        if c["limit"] is None:
            assert c["status"] == "-"
        else:
            assert c["status"] == ("PASS" if c["ratio"] <= c["limit"]
                                   else "MISS")
    head = stdout.split("Targets:")[0]
    for word in ("case", "ours", "other", "ratio", "target", "verdict"):
        assert word in head


def test_peak_memory_is_measured(report):
    data, stdout = report
    memory = data["memory"]
    B, Tq, T, H, A = bf.SIZES["full"]["additive"].values()
    # PyTorch's d2l form holds at least one (B, Tq, T, A) float32 tensor.
    assert memory["torch_mib"] >= B * Tq * T * A * 4 / bf.MiB
    assert memory["ours_mib"] > 0
    (c,) = [c for c in data["comparisons"] if c["measure"] == "peak MiB"]
    assert c["limit"] == bf.MEMORY_LIMIT
    assert c["ours"] == memory["ours_mib"] and "peak MiB" in stdout


def test_reachable_from_bench(tmp_path):
    path = tmp_path / "family.json"
    run("attention_c.bench", "--family", *ARGS, "--cases", "dot",
        "--no-memory", "--json", str(path))
    with open(path) as f:
        data = json.load(f)
    assert {r["case"] for r in data["results"]} == {"dot"}
    assert data["memory"] is None


def reference_results(case, p):
    """What attention_c.reference gives on a problem, as the family's
    benchmark names the arrays."""
    p = {k: None if x is None else
         x.astype(np.float64) if x.dtype != bool else x for k, x in p.items()}
    q, k, vals, W, v, mask, G = (p.get(n) for n in (
        "query", "keys", "values", "W", "v", "mask", "G"))
    if case == "decoder":
        steps = []
        for qs, gs in zip(q, G):
            out, a = ref.additive_attention(qs, k, W, v, mask=mask)
            g = ref.additive_attention_backward(gs, qs, k, W, v, a, mask=mask)
            steps.append({"out": out, "alpha": a,
                          **bf.grad_dict(g, "additive")})
        return stack_steps(steps)
    if case == "decoder_once":            # gradients summed over the steps
        per_step = reference_results("decoder", p)
        return dict(per_step, dkeys=per_step["dkeys"].sum(0),
                    dW=per_step["dW"].sum(0), dv=per_step["dv"].sum(0))
    if case == "additive":
        out, a = ref.additive_attention(q, k, W, v, mask=mask, values=vals)
        g = ref.additive_attention_backward(G, q, k, W, v, a, mask=mask,
                                            values=vals)
    elif case == "dot":
        vis = bf.visibility(case, p)          # causal=True on causal rows
        out, a = ref.dot_attention(q, k, values=vals, **vis)
        g = ref.dot_attention_backward(G, q, k, a, values=vals, **vis)
    else:
        vis = bf.visibility(case, p)
        out, a = ref.general_attention(q, k, W, values=vals, **vis)
        g = ref.general_attention_backward(G, q, k, W, a, values=vals,
                                           **vis)
    return {"out": out, "alpha": a, **bf.grad_dict(g, case)}


ODD = {"additive": {"B": 3, "Tq": 5, "T": 17, "H": 3, "A": 7},
       "decoder": {"steps": 3, "B": 5, "T": 17, "H": 3, "A": 1},
       "dot": {"lead": (1, 3), "Tq": 17, "T": 17, "H": 5}}


@pytest.mark.parametrize("case,mask", [(c, m) for c, masks in MASKS.items()
                                       for m in masks])
def test_baselines_compute_what_ours_computes(case, mask):
    # Each PyTorch form, in float64, against the NumPy reference: the
    # baselines do the same maths (weight layout, scale, mask) as ours.
    p = bf.make_problem(case, mask, ODD[bf.CASES[case][0]], seed=3)
    exact = reference_results(case, p)
    for name, (_, fwdbwd, results) in family_forms(
            torch, case, p, np.float64).items():
        got = results(fwdbwd())
        want = set(exact) - ({"alpha"} if name.startswith("sdpa") else set())
        assert set(got) == want, name
        errs = harness.errors(got, exact)
        assert max(errs.values()) <= 1e-12, (name, errs)


def test_masks_are_the_stated_kinds():
    size = bf.SIZES["quick"]["additive"]
    p = bf.make_problem("additive", "ragged", size)
    lengths = p["mask"].sum(-1)
    assert p["mask"].shape == (size["B"], size["T"])
    assert np.all(lengths >= size["T"] // 2) and np.all(lengths <= size["T"])
    assert np.array_equal(p["mask"], np.arange(size["T"]) < lengths[:, None])
    size = bf.SIZES["quick"]["dot"]
    p = bf.make_problem("dot", "causal", size)
    tri = np.tril(np.ones((size["Tq"], size["T"]), bool))
    assert np.array_equal(p["mask"], np.broadcast_to(tri, p["mask"].shape))
    assert bf.make_problem("general", "full", size)["mask"] is None
    # Ours is told causal=True where PyTorch gets the explicit mask, a key
    # mask stays a key mask, and no mask stays none.
    assert bf.visibility("dot", p) == {"causal": True}
    assert bf.visibility("general", p) == {"causal": True}
    ragged = bf.make_problem("additive", "ragged",
                             bf.SIZES["quick"]["additive"])
    assert bf.visibility("additive", ragged)["mask"] is ragged["mask"]
    assert bf.visibility("dot", bf.make_problem("dot", "full", size)) == {
        "mask": None}


def test_causal_is_the_explicit_mask():
    # causal=True (ours) and the causal rows' explicit mask (PyTorch's)
    # make the same weights, so the rows compare the same work.
    p = bf.make_problem("dot", "causal", ODD["dot"], seed=1)
    q, k = (p[n].astype(np.float64) for n in ("query", "keys"))
    _, alpha = ref.dot_attention(q, k, **bf.visibility("dot", p))
    _, want = ref.dot_attention(q, k, attn_mask=p["mask"])
    assert np.array_equal(alpha, want)
    assert np.all(alpha[..., 0, 1:] == 0) and np.all(alpha[..., -1, :] > 0)


def test_grad_dict_names_every_score_s_fields():
    # general: (q, k, vals, W, bias, alibi_slopes, sinks)
    g = (1, 2, None, 4, 5, None, 7)
    assert bf.grad_dict(g, "general") == {"dquery": 1, "dkeys": 2,
                                          "dW": 4, "dbias": 5, "dsinks": 7}
    assert bf.grad_dict((1, 2, 3, None, None, None), "dot") == {
        "dquery": 1, "dkeys": 2, "dvalues": 3}
    with pytest.raises(AssertionError):
        bf.grad_dict((1, 2, 3, None), "dot")


def test_errors_catch_a_wrong_result():
    exact = {"out": np.array([1.0, -2.0, 4.0])}
    assert harness.errors({"out": exact["out"] * (1 + 1e-6)}, exact)["out"] \
        <= bf.TOLERANCE
    # normwise: ||(0, 0, 0.01)|| / ||(1, -2, 4)||
    assert harness.errors({"out": exact["out"] + [0, 0, 0.01]}, exact)[
        "out"] == pytest.approx(0.01 / np.sqrt(21))


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="VmHWM is Linux's")
def test_peak_watch_sees_an_allocation():
    method, before = harness.peak_start()
    block = np.ones(64 * 2 ** 20 // 8)          # 64 MiB, every page touched
    rise = (harness.peak_now(method) - before) / 1024
    del block
    assert 60 <= rise <= 80


# --------------------------------------------------------------------------
# docs/performance.md: the family's sections, rewritten by --write-docs

def section(text, name):
    start = text.index(f"<!-- bench:{name} -->\n") + len(
        f"<!-- bench:{name} -->\n")
    return text[start:text.index(f"\n<!-- /bench:{name} -->")]


def table_rows(body):
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in body.splitlines()[2:]]


def fake_comparisons():
    """A made-up run at 1 and 2 threads: {(case, mask, threads): ratio}
    and its comparisons as family.comparisons makes them."""
    found, ratios = [], {}
    for case, (_, masks, limit) in bf.CASES.items():
        for mask in masks:
            for n in (1, 2):
                ratio = round(0.1 + len(found) / 100, 2)
                ratios[case, mask, n] = ratio
                bases = ("torch", "sdpa") if case == "dot" else ("torch",)
                for base in bases:
                    found.append(bf.verdict({
                        "case": case, "mask": mask, "measure": "f+b ms",
                        "threads": n, "baseline": base, "ours": 10 * ratio,
                        "theirs": 10.0,
                        "limit": limit if base == "torch" else None,
                        "others_load": 0.01}))
    found.append(bf.verdict({
        "case": "additive", "mask": "full", "measure": "peak MiB",
        "threads": 1, "baseline": "torch", "ours": 6.0, "theirs": 96.0,
        "limit": bf.MEMORY_LIMIT, "others_load": None}))
    return found, ratios


def fake_meta():
    return {"cpu": "Test CPU", "cpus": 2, "date": "2030-01-02T03:04:05",
            "config": {"simd": "avx2"}, "torch": "2.x", "threads": [1, 2],
            "sizes": bf.SIZES["full"], "quick": False}


def test_family_table_from_a_fake_run():
    found, ratios = fake_comparisons()
    sections = docs_page.family_sections(fake_meta(), [], found)
    assert set(sections) == set(SECTIONS)
    rows = table_rows(sections["family-table"])
    torch_rows = [r for r in rows if r[3] and "MiB" not in r[3]]
    masks = [(c, m) for c, (_, ms, _) in bf.CASES.items() for m in ms]
    assert len(torch_rows) == len(masks)
    order = ["additive", "decoder_once", "decoder", "dot", "general"]
    expected = sorted(masks, key=lambda cm: order.index(cm[0]))
    for row, (case, mask) in zip(torch_rows, expected):
        assert row[2] == mask
        assert row[5] == f"{ratios[case, mask, 1]:.2f}"
        assert row[6] == f"{ratios[case, mask, 2]:.2f}"
        limit = bf.CASES[case][2]
        verdict = ("(none)" if limit is None else
                   f"≤ {limit:g} " + ("pass" if ratios[case, mask, 1]
                                      <= limit else "miss"))
        assert row[7] == verdict
    (memory,) = [r for r in rows if "MiB" in r[3]]
    assert memory[3:6] == ["6.0 MiB", "96.0 MiB", "0.06"]
    (sdpa,) = [r for r in rows if "scaled_dot_product" in r[0]]
    assert sdpa[2] == "full / causal"
    committed = PAGE.read_text(encoding="utf-8")
    assert (section(committed, "family-table").splitlines()[0]
            == sections["family-table"].splitlines()[0])
    assert "Test CPU" in sections["family-setup"]


def test_family_bench_writes_the_page(report, bench_dir):
    data, stdout = report
    written = (bench_dir / "performance.md").read_text(encoding="utf-8")
    committed = PAGE.read_text(encoding="utf-8")
    for name in ("layer-setup", "layer-float32", "layer-float64"):
        assert section(written, name) == section(committed, name)
    rows = table_rows(section(written, "family-table"))
    timed = [r for r in rows if r[3] and "MiB" not in r[3]]
    assert len(timed) == len(data["results"])      # one thread: a row each
    assert any("MiB" in r[3] for r in rows)
    assert "--quick" in section(written, "family-setup")
