"""pytest fixtures and hooks of the tests; the shared helpers (problems,
tolerances, the error metric, pure-PyTorch references) are in
``attention_c.testing``."""

import numpy as np
import pytest

from attention_c.testing import FIGURES


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def pytest_terminal_summary(terminalreporter):
    """The figures the hard-conditions tests recorded
    (attention_c.testing.record_figure)."""
    if FIGURES:
        terminalreporter.section("attention_c figures")
        for key in sorted(FIGURES):
            terminalreporter.write_line(f"{key}: {FIGURES[key]}")
