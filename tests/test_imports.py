"""The package's shape: the core imports only downward and never loads the analysis tools."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import kaisa_jax

PACKAGE = pathlib.Path(kaisa_jax.__file__).parent
ANALYSIS = "kaisa_jax.analysis"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(name: str, path: pathlib.Path) -> set[str]:
  """The package's modules that ``name`` imports anywhere in its source (functions included)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.add(node.module)
      out |= {f"{node.module}.{a.name}" for a in node.names}
  return {m for m in out if m in MODULES and m != name and not name.startswith(m + ".")}


GRAPH = {name: _imported(name, path) for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A cycle of ``graph`` as a list of nodes, or ``None`` if it has none (depth-first search)."""
  state: dict[str, str] = {}
  stack: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        return [*stack[stack.index(nxt) :], nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_the_import_graph_has_no_cycle():
  assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH))


def test_the_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_core_never_imports_the_analysis_tools():
  core = {n: deps for n, deps in GRAPH.items() if not n.startswith(ANALYSIS)}
  offending = {n: sorted(d for d in deps if d.startswith(ANALYSIS)) for n, deps in core.items()}
  assert not {n: d for n, d in offending.items() if d}


def test_the_graph_sees_the_imports_it_should():
  # The walk must see imports inside functions as well as at the top.
  assert "kaisa_jax.planning" in GRAPH["kaisa_jax.transform"]
  assert "kaisa_jax.transform" in GRAPH["kaisa_jax.analysis.projection"]
  assert "kaisa_jax.layers" in GRAPH["kaisa_jax.capture"]


_FRESH = """
import importlib, sys
modules = sys.argv[1:]
for name in modules:
  for loaded in [m for m in sys.modules if m == "kaisa_jax" or m.startswith("kaisa_jax.")]:
    del sys.modules[loaded]
  importlib.import_module(name)
  if name == "kaisa_jax":
    assert not [m for m in sys.modules if m.startswith("kaisa_jax.analysis")], sorted(sys.modules)
print("ok", len(modules))
"""


def test_every_module_imports_first_in_a_fresh_interpreter():
  # Each module imported first, with no other module of the package loaded: an import
  # cycle shows up as an ImportError or AttributeError whichever module starts it.
  names = ["kaisa_jax", *sorted(n for n in MODULES if n != "kaisa_jax")]
  out = subprocess.run(
    [sys.executable, "-c", _FRESH, *names], capture_output=True, text=True, check=False
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip() == f"ok {len(names)}"
