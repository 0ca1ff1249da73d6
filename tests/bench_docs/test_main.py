"""What a newcomer meets first: ``python -m attention_c`` and its options,
and importing the package from a source tree where the C extension was
not built (the folder shadows an installed copy)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import attention_c as ac

PACKAGE = Path(ac.__file__).parent


def run(*args, cwd=None):
    return subprocess.run([sys.executable, *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def test_help_prints_usage_and_runs_nothing():
    r = run("-m", "attention_c", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m attention_c")
    for option in ("--version", "--config", "--no-timing", "--seed"):
        assert option in r.stdout
    assert "ATTENTION_C_SIMD" in r.stdout        # the environment, too
    assert "checks passed" not in r.stdout      # the demo did not run


def test_version_and_config():
    r = run("-m", "attention_c", "--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"attention_c "
                                                   f"{ac.__version__}")
    r = run("-m", "attention_c", "--config")
    assert r.returncode == 0, r.stderr
    assert "version" in r.stdout and ac._core._get_simd() in r.stdout
    assert "checks passed" not in r.stdout


def test_self_check_without_timing():
    r = run("-m", "attention_c", "--no-timing", "--seed", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("all checks passed")
    assert "times, float32" not in r.stdout


def test_unknown_option_is_a_usage_error():
    r = run("-m", "attention_c", "--fast")
    assert r.returncode == 2
    assert "unrecognized arguments: --fast" in r.stderr
    assert "checks passed" not in r.stdout


def copy_sources(dest):
    """The package's Python files only: a source tree before any build."""
    shutil.copytree(PACKAGE, dest / "attention_c",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd",
                                                  "__pycache__"))


@pytest.mark.parametrize("tree", [True, False], ids=["source_tree", "bare"])
def test_import_without_the_extension_says_what_to_do(tmp_path, tree):
    """From a source tree (setup.py beside the package), the error says the
    folder shadows the installed package and how to get out (pip install
    -e ., or another folder), as NumPy does; not Python's "partially
    initialized module (most likely due to a circular import)"."""
    copy_sources(tmp_path)
    if tree:
        (tmp_path / "setup.py").write_text("# the project's build\n")
    # -S: no site-packages, whose editable finder would find the built
    # package first (a plain install's copy is found after the folder)
    r = run("-S", "-c", "import attention_c", cwd=tmp_path)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), r.stderr
    assert "circular import" not in r.stderr, r.stderr   # no chain
    if tree:
        assert "source tree" in last and "shadows the installed" in last
        assert "pip install -e ." in last and "another folder" in last
        assert str(tmp_path) in last
    else:
        assert "attention_c._core is missing" in last
        assert "was not built" in last
