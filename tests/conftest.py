"""pytest fixtures and hooks of the tests; the shared helpers (problems,
tolerances, the error metric, pure-PyTorch references) are in
``attention_c.testing``."""

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
    """The test leaves the SIMD path and the thread count as it found
    them."""
    simd, threads = _core._get_simd(), ac.get_num_threads()
    yield
    _core._set_simd(simd)
    ac.set_num_threads(threads)


def pytest_terminal_summary(terminalreporter):
    """The figures the hard-conditions tests recorded
    (attention_c.testing.record_figure)."""
    if FIGURES:
        terminalreporter.section("attention_c figures")
        for key in sorted(FIGURES):
            terminalreporter.write_line(f"{key}: {FIGURES[key]}")
