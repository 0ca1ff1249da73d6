"""Sphinx configuration of the attention_c API docs.

Build (from the repository root, with the docs extra installed, torch
installed, and attention_c importable, e.g. after ``pip install -e
".[docs]"``)::

    sphinx-build -W --keep-going -b html docs docs/_build/html

``bash .ci/docs`` does that and runs the examples.  ``contract.md`` is
included as it is (MyST), so it stays the single source of the contract.

torch is needed, not mocked: attention_c.torch registers its PyTorch
operators when imported (torch.library calls at module level, an
autograd.Function made with type()), which autodoc's mock objects cannot
run.  The docs extra installs Dask (attention_c.dask imports it).
"""

import contextlib
import importlib
import importlib.util
import io
import os

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

import attention_c

project = "attention_c"
author = "the attention_c authors"
copyright = "the attention_c authors"
version = release = attention_c.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# README.md is docs/'s index for readers of the repository, not a page.
exclude_patterns = ["_build", "README.md"]
templates_path = []

if importlib.util.find_spec("torch") is None:
    raise RuntimeError(
        "the docs build needs torch, to document attention_c.torch: "
        "install it first (a CPU build, e.g. pip install torch==2.13.0)")
autodoc_member_order = "bysource"
autodoc_typehints = "none"          # the numpydoc sections give the types
autodoc_preserve_defaults = True
autosummary_generate = False        # tables only; the pages are written

# numpydoc: docstrings are checked by the doctests, not by its validator;
# class members are listed by autodoc's :members: on each page.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
numpydoc_validation_checks = set()

# MyST: GitHub-style anchors for the headings of contract.md, so that its
# own links (#1-the-mathematics-...) and the pages' links resolve.
myst_heading_anchors = 4

html_theme = "alabaster"
html_title = f"attention_c {release}"
html_static_path = []
html_theme_options = {
    "description": "Exact attention and its gradients for NumPy and "
                   "PyTorch, in C",
    "page_width": "1100px",
    "sidebar_width": "230px",
}


def _dask_page_guard(app, docname, source):
    """attention_c.dask arrives from another branch: until its module is in
    the package, its page says so instead of failing the build."""
    if docname != "api/dask":
        return
    if importlib.util.find_spec("attention_c.dask") is None:
        source[0] = ("attention_c.dask\n================\n\n"
                     ".. note::\n\n   ``attention_c.dask`` is not part of "
                     "this build of the package.\n")


class CliHelp(SphinxDirective):
    """``.. cli-help:: module``: the ``--help`` text of a command-line
    module (its ``parse_args(argv)``), as of this build, so that the page
    never lags behind the options."""

    required_arguments = 1

    def run(self):
        module = importlib.import_module(self.arguments[0])
        text = io.StringIO()
        old = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "79"          # argparse wraps to this
        try:
            with contextlib.redirect_stdout(text):
                module.parse_args(["--help"])
        except SystemExit:
            pass
        finally:
            if old is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = old
        help_text = text.getvalue().rstrip()
        if not help_text:
            raise self.error(f"{self.arguments[0]}.parse_args(['--help']) "
                             f"printed nothing")
        block = nodes.literal_block(help_text, help_text)
        block["language"] = "text"
        return [block]


def setup(app):
    app.add_directive("cli-help", CliHelp)
    app.connect("source-read", _dask_page_guard)
