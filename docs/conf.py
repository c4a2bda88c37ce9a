"""Sphinx configuration of kaisa_jax's documentation: MyST Markdown pages, autodoc, book theme.

Build from the repository root (any warning fails the build):

  .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import logging
import os
import sys

# Document the package of this checkout, whatever else is installed.
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import kaisa_jax  # noqa: E402

project = "kaisa_jax"
author = "the kaisa_jax authors"
copyright = "the kaisa_jax authors"
release = kaisa_jax.__version__
version = release

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: ::: fences, $...$ and $$...$$ math, and anchors on headings of levels 1 to 4, so that
# links such as [text](page.md#a-heading) resolve (and a broken one warns).
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 4

# The docstrings are Google style (Args:, Returns:, Attributes:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
# Single backticks in a docstring name code: a cross-reference where the name resolves, code
# otherwise.
default_role = "py:obj"

html_theme = "sphinx_book_theme"
html_title = "kaisa_jax"
html_theme_options = {"show_toc_level": 2}

# Sections whose pages are globbed from a folder of their own (docs/index.md). Sphinx warns when
# a toctree glob matches nothing, and that warning has no type, so `suppress_warnings` cannot
# name it; `_EmptySection` lets it pass for these globs only, and only while the folder holds no
# page.
GLOBBED_SECTIONS = ("guides", "benchmarks")


class _EmptySection(logging.Filter):
  def filter(self, record):
    if getattr(record, "subtype", None) != "empty_glob" or not record.args:
      return True
    folder = os.path.join(os.path.dirname(__file__), str(record.args[0]).removesuffix("/*"))
    pages = os.path.isdir(folder) and any(f.endswith(".md") for f in os.listdir(folder))
    return not (str(record.args[0]) in {f"{s}/*" for s in GLOBBED_SECTIONS} and not pages)


def _skip_field_aliases(app, what, name, obj, skip, options):
  """Leaves out the docstrings Python generates for a named tuple's fields.

  Those read "Alias for field number 0"; the fields show in the class signature, and the class's
  ``Attributes:`` section documents them where it has one.
  """
  if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
    return True
  return None


def _drop_type_docstrings(app, what, name, obj, options, lines):
  """Drops a constant's docstring where it is its type's (``str``'s, say), not its own."""
  if what == "data" and type(obj).__doc__:
    text = [line.strip() for line in lines if line.strip()]
    if text == [line.strip() for line in type(obj).__doc__.splitlines() if line.strip()]:
      lines.clear()


def setup(app):
  logging.getLogger("sphinx.sphinx.directives.other").addFilter(_EmptySection())
  app.connect("autodoc-skip-member", _skip_field_aliases)
  app.connect("autodoc-process-docstring", _drop_type_docstrings, priority=100)
