"""Every function of the package fits on a screen: at most `LIMIT` lines of code.

A function's code lines are the lines of its whole body (nested functions and
classes included) that hold code: blank lines, comment lines and docstrings
(its own and those of what it nests) do not count, and neither does the
signature.
"""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

import kaisa_jax

PACKAGE = pathlib.Path(kaisa_jax.__file__).parent
LIMIT = 60
_NOT_CODE = {
  tokenize.COMMENT,
  tokenize.NL,
  tokenize.NEWLINE,
  tokenize.INDENT,
  tokenize.DEDENT,
  tokenize.ENDMARKER,
}
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _code_rows(source: str) -> set[int]:
  """The rows (1-based) that hold a token of code; a multi-line token holds every row it spans."""
  rows = set()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type not in _NOT_CODE:
      rows.update(range(token.start[0], token.end[0] + 1))
  return rows


def _docstring_rows(tree: ast.AST) -> set[int]:
  """The rows of every function's and class's docstring."""
  rows = set()
  for node in ast.walk(tree):
    if isinstance(node, _DEFINITIONS) and ast.get_docstring(node, clean=False) is not None:
      doc = node.body[0]
      rows.update(range(doc.lineno, doc.end_lineno + 1))
  return rows


def code_lengths(source: str) -> list[tuple[str, int, int]]:
  """``(name, line, code lines)`` of every function in ``source``, nested ones too."""
  tree = ast.parse(source)
  code = _code_rows(source) - _docstring_rows(tree)
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      body = range(node.body[0].lineno, node.end_lineno + 1)
      out.append((node.name, node.lineno, sum(row in code for row in body)))
  return out


def offenders(limit: int = LIMIT) -> list[str]:
  """``file:line name (n code lines)`` for every function of the package over ``limit``."""
  out = []
  for path in sorted(PACKAGE.rglob("*.py")):
    for name, line, n in code_lengths(path.read_text()):
      if n > limit:
        out.append(f"{path.relative_to(PACKAGE.parent)}:{line} {name} ({n} code lines)")
  return out


def test_no_function_is_longer_than_the_limit():
  found = offenders()
  assert not found, f"functions over {LIMIT} lines of code:\n" + "\n".join(found)


def test_code_lines_leave_out_blanks_comments_docstrings_and_the_signature():
  source = '''
def f(
  a,
  b,
):
  """A docstring
  over three lines.
  """
  # a comment

  x = (a +
       b)  # a trailing comment
  def g():
    """Nested docstring."""
    return """a string
    over two lines"""
  return x
'''
  lengths = {name: n for name, _, n in code_lengths(source)}
  assert lengths == {"f": 6, "g": 2}


def test_the_walk_sees_the_whole_package():
  names = {p.name for p in PACKAGE.rglob("*.py")}
  assert {"transform.py", "capture.py", "__init__.py"} <= names
  assert any(p.parent.name == "analysis" for p in PACKAGE.rglob("*.py"))
