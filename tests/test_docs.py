"""The documentation: its code runs, it builds without a warning, and its API reference is complete.

Every ```python block of a page under docs/ runs, the page's blocks in order in one namespace (as
tests/test_readme.py runs the README's); a block fenced as ```{code-block} python is shown but not
run. The Sphinx build is the one docs/development.md documents.
"""

import inspect
import pathlib
import re
import subprocess
import sys

import pytest
from markdown_it import MarkdownIt

import kaisa_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
  """The page's ```python blocks as ``(first line of code, 0-based; code)``, in order."""
  tokens = MarkdownIt("commonmark").parse(page.read_text())
  return [
    (t.map[0] + 1, t.content)
    for t in tokens
    if t.type == "fence" and t.info.split()[:1] == ["python"]
  ]


def test_pages_are_found():
  names = {p.relative_to(DOCS).as_posix() for p in PAGES}
  assert {"index.md", "getting_started.md", "math.md", "api.md", "development.md"} <= names


def run_page(page: pathlib.Path) -> None:
  """Runs the page's ```python blocks in order, in one namespace of their own."""
  namespace: dict = {"__name__": f"docs.{page.stem}"}
  for line, code in python_blocks(page):
    # Padded so that a traceback's line numbers are the page's.
    exec(compile("\n" * line + code, str(page), "exec"), namespace)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_code_runs(page, capsys):
  run_page(page)
  if page.name == "getting_started.md":
    losses = [float(m) for m in re.findall(r"loss (\S+)", capsys.readouterr().out)]
    assert len(losses) >= 2 and losses[-1] < 0.01 < losses[0], losses


def test_a_failing_block_fails(tmp_path):
  page = tmp_path / "page.md"
  page.write_text(
    "# Page\n\n```python\nx = 1\n```\n\n```{code-block} python\nundefined\n```\n\n"
    "- item\n\n  ```python\n  assert x == 2, 'line 14'\n  ```\n"
  )
  assert [line for line, _ in python_blocks(page)] == [3, 13]
  with pytest.raises(AssertionError, match="line 14") as raised:
    run_page(page)
  assert raised.traceback[-1].lineno + 1 == 14


def test_sphinx_build_is_warning_free(tmp_path):
  command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
  result = subprocess.run(
    [*command, str(DOCS), str(tmp_path / "html")], cwd=ROOT, capture_output=True, text=True
  )
  assert result.returncode == 0, f"the docs build failed:\n{result.stderr}\n{result.stdout}"


def documented(page: pathlib.Path) -> dict[str, str]:
  """The objects a page documents with autodoc directives: ``{full name: directive}``."""
  found = {}
  for t in MarkdownIt("commonmark").parse(page.read_text()):
    if t.type != "fence":
      continue
    m = re.fullmatch(r"\{(auto\w+)\}\s+(\S+)", t.info.strip())
    if m:
      found[m[2]] = m[1]
    if t.info.strip() == "{eval-rst}":
      for directive, name in re.findall(r"^\s*\.\. (auto\w+):: +(\S+)", t.content, flags=re.M):
        found[name] = directive
  return found


def directive_for(obj) -> str:
  if inspect.ismodule(obj):
    return "automodule"
  if inspect.isclass(obj):
    return "autoclass"
  if inspect.isfunction(obj):
    return "autofunction"
  return "autodata"


def test_api_reference_documents_every_public_name():
  import kaisa_jax.analysis

  found = documented(DOCS / "api.md")
  public = {f"kaisa_jax.{n}": getattr(kaisa_jax, n) for n in kaisa_jax.__all__}
  public["kaisa_jax.analysis"] = kaisa_jax.analysis
  public |= {
    f"kaisa_jax.analysis.{n}": getattr(kaisa_jax.analysis, n) for n in kaisa_jax.analysis.__all__
  }
  missing = {}
  for name, obj in public.items():
    # A module may be documented under its own name where that differs from its public one.
    names = {name, obj.__name__} if inspect.ismodule(obj) else {name}
    if not any(found.get(n) == directive_for(obj) for n in names):
      missing[name] = directive_for(obj)
  assert not missing, f"docs/api.md lacks (name: directive): {missing}"


def _public_callables() -> dict[str, object]:
  """Every public function and class of the package and of its analysis modules."""
  import dataclasses

  from kaisa_jax.analysis import accounting, projection

  out = {f"kaisa_jax.{n}": getattr(kaisa_jax, n) for n in kaisa_jax.__all__}
  for module in (accounting, projection):
    for n in dir(module):
      obj = getattr(module, n)
      if not n.startswith("_") and getattr(obj, "__module__", None) == module.__name__:
        out[f"{module.__name__}.{n}"] = obj
  return {
    name: obj
    for name, obj in out.items()
    if callable(obj)
    and not inspect.ismodule(obj)
    # Records list their fields under Attributes: their constructors take exactly those.
    and not (inspect.isclass(obj) and (dataclasses.is_dataclass(obj) or hasattr(obj, "_fields")))
  }


def undocumented_arguments(obj: object) -> list[str]:
  """The parameters of ``obj``'s signature that its docstring never names."""
  doc = inspect.getdoc(obj) or ""
  try:
    params = inspect.signature(obj).parameters
  except (TypeError, ValueError):
    return []
  return [
    p
    for p, v in params.items()
    if v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)
    and p != "self"
    and not re.search(rf"(?<![\w.]){re.escape(p)}(?!\w)", doc)
  ]


def test_every_public_argument_is_documented():
  missing = {}
  for name, obj in _public_callables().items():
    if inspect.isclass(obj) and "Built by `" in (inspect.getdoc(obj) or ""):
      continue  # made by a factory function, whose arguments are documented
    if names := undocumented_arguments(obj):
      missing[name] = names
  assert not missing, f"arguments missing from the docstrings: {missing}"


def test_the_argument_check_sees_a_missing_argument():
  def documented(a, b):
    """Adds.

    Args:
      a: one.
      b: the other.
    """

  def half(a, b):
    """Adds ``a`` to another."""

  assert undocumented_arguments(documented) == []
  assert undocumented_arguments(half) == ["b"]
