"""Execute the notebooks in place, so that they are committed with outputs.

    python notebooks/run_notebooks.py [NAME.ipynb ...]

Runs each notebook (default: all in this folder) from a fresh ``python3``
kernel in this folder, replaces its outputs, and writes the figure of every
cell tagged ``figure:NAME.png`` to ``notebooks/img/NAME.png`` (the pictures
the README shows).  Needs ``pip install -e ".[test]"``.  The test suite runs
the notebooks too (tests/bench_docs/test_notebooks.py), on a temporary copy.

To read or edit them: ``pip install -e ".[notebooks]"`` (the kernel and
the Jupyter front end), then ``jupyter lab notebooks/``.  ``jupyter
nbconvert --to notebook --execute --inplace NAME.ipynb`` runs one too, but
records timestamps, may store a printout in pieces, and exports no figure:
commit what this script writes.
"""

import base64
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def execute(path):
    """Run the notebook at path and return it with its new outputs."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": str(path.parent)}},
                   record_timing=False,      # no timestamps in the diff
                   coalesce_streams=True,    # progress bars: final state
                   iopub_timeout=60,         # late output kept, not lost
                   raise_on_iopub_timeout=True,
                   ).execute()
    return nb


def save_figures(nb, folder):
    """Write the PNG of each cell tagged figure:NAME.png to folder/NAME.png."""
    for cell in nb.cells:
        for tag in cell.get("metadata", {}).get("tags", []):
            if not tag.startswith("figure:"):
                continue
            pngs = [o["data"]["image/png"] for o in cell.get("outputs", [])
                    if "image/png" in o.get("data", {})]
            if not pngs:
                raise RuntimeError(f"cell tagged {tag} made no figure")
            folder.mkdir(exist_ok=True)
            (folder / tag[len("figure:"):]).write_bytes(
                base64.b64decode(pngs[-1]))


def main(names):
    paths = ([HERE / n for n in names] if names
             else sorted(HERE.glob("*.ipynb")))
    for path in paths:
        print(f"running {path.name} ...", flush=True)
        nb = execute(path)
        nbformat.write(nb, path)
        save_figures(nb, HERE / "img")


if __name__ == "__main__":
    main(sys.argv[1:])
