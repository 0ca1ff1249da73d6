"""Type information: mypy --strict accepts a user's script, and the stubs
(attention_c/__init__.pyi) agree with the running package (mypy.stubtest).

mypy runs in a subprocess on the package that the tests import (its parent
folder goes first on MYPYPATH and PYTHONPATH, except MYPYPATH for an
installed package, which mypy finds by itself), in a fresh temporary
folder, so the result does not depend on an earlier run.

The submodules that import an optional extra (OPTIONAL) are checked
against their stubs where it is installed; where it is not, stubtest
cannot import them and leaves them out, and test_optional_module_checked
skips, naming the extra.
"""

import importlib
import importlib.util
import os
import re
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import attention_c

HERE = Path(__file__).resolve().parents[1] / "typing_examples"
ROOT = Path(attention_c.__file__).resolve().parent.parent
# Installed (not editable): mypy finds the package in site-packages itself
# (PEP 561) and refuses site-packages on MYPYPATH.
INSTALLED = str(ROOT) in {
    str(Path(p).resolve()) for p in [*site.getsitepackages(),
                                     sysconfig.get_paths()["purelib"],
                                     sysconfig.get_paths()["platlib"]]}
# The submodules that import an optional extra when imported, and the
# packages each imports.  (attention_c.torch is in the allowlist either
# way: mypy checks it, tests/typing_examples/example_torch.py.)
OPTIONAL = {"attention_c.dask": ["dask"],
            "attention_c.integrations.transformers": ["torch",
                                                      "transformers"],
            "attention_c.integrations.compact_cache": ["torch",
                                                       "transformers"]}


def missing(module):
    """The packages that module imports and this environment lacks."""
    return [p for p in OPTIONAL[module] if importlib.util.find_spec(p) is None]


def run(args, cwd):
    """Run python -m <args> on the imported package in the folder cwd (a
    temporary one, for mypy's cache); (exit code, output)."""
    env = dict(os.environ)
    for var in ("PYTHONPATH",) if INSTALLED else ("MYPYPATH", "PYTHONPATH"):
        env[var] = os.pathsep.join(filter(None, [str(ROOT), env.get(var)]))
    proc = subprocess.run([sys.executable, "-m", *map(str, args)], env=env,
                          cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_package_declares_typing():
    assert (ROOT / "attention_c" / "py.typed").is_file()
    assert (ROOT / "attention_c" / "__init__.pyi").is_file()


def test_mypy_strict_accepts_example_script(tmp_path):
    rc, out = run(["mypy", "--strict", HERE / "example.py"], tmp_path)
    assert rc == 0, out


def test_stubs_match_runtime(tmp_path):
    """Fails when a function's signature changes without its stub.  A
    submodule whose extra is missing is allowlisted (stubtest fails to
    import it), for this run only."""
    absent = tmp_path / "absent_extras.txt"
    absent.write_text("".join(rf"{re.escape(m)}(\..*)?" + "\n"
                              for m in OPTIONAL if missing(m)))
    rc, out = run(["mypy.stubtest", "attention_c",
                   "--mypy-config-file", HERE / "stubtest.ini",
                   "--allowlist", HERE / "stubtest_allowlist.txt",
                   "--allowlist", absent], tmp_path)
    assert rc == 0, out


@pytest.mark.parametrize("module", OPTIONAL)
def test_optional_module_checked(module):
    """With its extra, the submodule imports, so test_stubs_match_runtime
    checked it; without, this skips, saying what was left unchecked."""
    if lacking := missing(module):
        pytest.skip(f"stubs of {module} unchecked: no {', '.join(lacking)}")
    importlib.import_module(module)


def test_mypy_strict_accepts_torch_example(tmp_path):
    pytest.importorskip("torch")
    rc, out = run(["mypy", "--strict", HERE / "example_torch.py"], tmp_path)
    assert rc == 0, out


def test_mypy_strict_accepts_dask_example(tmp_path):
    pytest.importorskip("dask.array")
    rc, out = run(["mypy", "--strict", HERE / "example_dask.py"], tmp_path)
    assert rc == 0, out
