"""The README's examples run as pasted.

Every ```python block of README.md is fed, in order, to one fresh
``python -i`` (the REPL a newcomer pastes into), which reads them as
typed lines: a block that runs as a script but not when pasted (a
statement right after an indented block, with no blank line between)
fails here with the REPL's SyntaxError.  Blocks that import torch or dask
run only where those are installed; the NumPy blocks run everywhere.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
DONE = "README-BLOCKS-DONE"
# The README's length is part of its contract (issue 18): a screenful of
# tables belongs to docs/performance.md.
MAX_LINES = 350


def python_blocks(text):
    """The bodies of the ```python blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


def needs(block):
    """The optional modules a block imports ('torch', 'dask',
    'transformers')."""
    return {name for name in ("torch", "dask", "transformers")
            if re.search(rf"^\s*(import|from)\s+(\S+\.)?{name}\b", block,
                         re.M)}


def paste(blocks, cwd):
    """Feed the blocks to a fresh ``python -i``, each followed by the blank
    line a user types to end a pasted block; returns (stdout, stderr)."""
    typed = "".join(block + "\n" for block in blocks)
    typed += f"print({DONE!r})\n"
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-q", "-i"], input=typed,
                          capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)
    return proc.stdout, proc.stderr


def failures(stderr):
    """The REPL's error reports in its stderr (prompts aside)."""
    return [line for line in stderr.replace(">>> ", "\n").replace(
        "... ", "\n").splitlines()
        if line.startswith("Traceback")
        or re.match(r"\w+(Error|Exception)\b", line)]


def check(blocks, cwd):
    stdout, stderr = paste(blocks, cwd)
    assert not failures(stderr), stderr
    assert DONE in stdout, stderr


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < MAX_LINES, f"README.md has {lines} lines"


def test_blocks_are_found():
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 5
    assert any(needs(b) == set() for b in blocks)
    assert any("torch" in needs(b) for b in blocks)


def test_numpy_blocks_paste_and_run(tmp_path):
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    check([b for b in blocks if not needs(b)], tmp_path)


def test_every_block_pastes_and_runs(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("dask.array")
    # transformers is no test dependency: its block runs where it is there
    have = importlib.util.find_spec("transformers") is not None
    check([b for b in python_blocks(README.read_text(encoding="utf-8"))
           if have or "transformers" not in needs(b)], tmp_path)


# The checker itself must be able to fail.

def test_a_missing_blank_line_after_a_loop_fails(tmp_path):
    block = "total = 0\nfor i in range(3):\n    total += i\nprint(total)\n"
    exec(compile(block, "<block>", "exec"), {})   # fine as a script
    _, stderr = paste([block], tmp_path)
    assert any("SyntaxError" in line for line in failures(stderr)), stderr
    with pytest.raises(AssertionError):
        check([block], tmp_path)


def test_an_undefined_name_fails(tmp_path):
    with pytest.raises(AssertionError, match="NameError"):
        check(["out = pool(enc, mask)\n"], tmp_path)


def test_blocks_and_their_needs_are_parsed():
    text = ("Intro\n\n```python\nimport numpy as np\n```\n\n```bash\n"
            "pip install .\n```\n\n```python\nimport torch\nx = 1\n\n"
            "y = 2\n```\n\n```python\nimport attention_c.dask as acd\n"
            "```\n")
    blocks = python_blocks(text)
    assert blocks == ["import numpy as np\n", "import torch\nx = 1\n\n"
                      "y = 2\n", "import attention_c.dask as acd\n"]
    assert [needs(b) for b in blocks] == [set(), {"torch"}, {"dask"}]
