"""pytest fixtures and hooks of the tests; the shared helpers (problems,
tolerances, the error metric, pure-PyTorch references) are in
``attention_c.testing``."""

import os
import warnings

import numpy as np
import pytest

import attention_c as ac
from attention_c import _core
from attention_c.testing import FIGURES


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture
def restore_settings():
    """The test leaves the SIMD path, the thread count, the float32
    precision and the unit of bf16 products as it found them."""
    simd, threads = _core._get_simd(), ac.get_num_threads()
    precision, unit = ac.get_fp32_precision(), _core._get_bf16_unit()
    yield
    _core._set_simd(simd)
    ac.set_num_threads(threads)
    ac.set_fp32_precision(precision)
    _core._set_bf16_unit(unit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Inside each test's warning filters (the modules' "error" too):
    the NumPy reference's products may meet OpenBLAS kernels that raise
    the invalid flag for finite inputs (numpy issues 24067 and 28967;
    once in a full run here, on a Sapphire-Rapids-class Xeon, not again
    in isolation).  Its results are compared all the same, so a real NaN
    still fails the test; only that warning from the reference is
    ignored."""
    warnings.filterwarnings("ignore", "invalid value encountered in matmul",
                            RuntimeWarning, r"attention_c\.reference")
    yield


def pytest_terminal_summary(terminalreporter):
    """The figures the hard-conditions tests recorded
    (attention_c.testing.record_figure)."""
    if FIGURES:
        terminalreporter.section("attention_c figures")
        for key in sorted(FIGURES):
            terminalreporter.write_line(f"{key}: {FIGURES[key]}")


# CI (.ci/run) runs the suite twice: first as a newcomer would, without
# torch and transformers, writing what that run skipped to the file
# ATTENTION_C_SKIPPED_TO names; then, with them installed, only those
# tests (ATTENTION_C_RUN_ONLY, the same file), not the thousands that
# already passed.  A skipped module is listed as its path: all its tests.
_SKIPPED_TO = os.environ.get("ATTENTION_C_SKIPPED_TO")
_RUN_ONLY = os.environ.get("ATTENTION_C_RUN_ONLY")


def _note_skipped(report):
    if _SKIPPED_TO and report.skipped:
        with open(_SKIPPED_TO, "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")


def pytest_runtest_logreport(report):
    _note_skipped(report)


def pytest_collectreport(report):
    _note_skipped(report)


def pytest_collection_modifyitems(config, items):
    if not _RUN_ONLY:
        return
    with open(_RUN_ONLY, encoding="utf-8") as f:
        wanted = {line.strip() for line in f if line.strip()}
    keep, drop = [], []
    for item in items:
        path = item.nodeid.split("::")[0]
        (keep if item.nodeid in wanted or path in wanted else drop).append(
            item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
