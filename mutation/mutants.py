"""The mutants of a Python source file: one small, plausible bug each.

Each mutant is an edit of the source text, ``source[start:end] -> replacement``,
so that the rest of the file stays byte for byte as it was. The operators:

* ``arithmetic``: ``+`` and ``-`` swapped, ``*`` and ``/`` swapped, ``**`` to
  ``*``, ``//`` to ``/``, ``%`` to ``*``; binary operators and augmented
  assignments alike;
* ``compare``: ``<`` and ``<=``, ``>`` and ``>=``, ``==`` and ``!=``, ``is``
  and ``is not``, ``in`` and ``not in`` swapped;
* ``boolean``: ``and`` and ``or`` swapped;
* ``unary``: a ``-`` or a ``not`` removed;
* ``constant``: an integer or float ``n`` to ``n + 1``, ``True`` and ``False``
  swapped;
* ``function``: ``maximum`` and ``minimum``, ``max`` and ``min``, ``all`` and
  ``any``, ``argmax`` and ``argmin``, ``sum`` and ``mean`` swapped in a call;
* ``condition``: the test of an ``if``, ``while`` or conditional expression
  that is not a comparison negated (a comparison is mutated by ``compare``);
* ``einsum``: the two last indices of one operand or of the output of an
  ``einsum`` swapped (a missing or extra transpose);
* ``statement``: a reassignment that reads what it assigns (``x = f(x)``,
  ``x += y``) or a call made for its effect replaced by ``pass``.

What is never mutated (it is not numerics): docstrings and every other string
(the einsum subscripts aside), f-strings, ``raise`` and ``assert`` statements,
an ``if`` whose body only raises (an argument check) and its test, calls of
``print``, ``warnings.warn`` and logging, type annotations, decorators,
imports, ``__all__``, ``__repr__`` and ``__str__``, and any line that ends with
``# pragma: no mutate``.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import re
from collections.abc import Iterator

ARITHMETIC = {
  ast.Add: (ast.Sub, "+", "-"),
  ast.Sub: (ast.Add, "-", "+"),
  ast.Mult: (ast.Div, "*", "/"),
  ast.Div: (ast.Mult, "/", "*"),
  ast.Pow: (ast.Mult, "**", "*"),
  ast.FloorDiv: (ast.Div, "//", "/"),
  ast.Mod: (ast.Mult, "%", "*"),
}
COMPARE = {
  ast.Lt: "<=",
  ast.LtE: "<",
  ast.Gt: ">=",
  ast.GtE: ">",
  ast.Eq: "!=",
  ast.NotEq: "==",
  ast.Is: "is not",
  ast.IsNot: "is",
  ast.In: "not in",
  ast.NotIn: "in",
}
COMPARE_TEXT = {
  ast.Lt: "<",
  ast.LtE: "<=",
  ast.Gt: ">",
  ast.GtE: ">=",
  ast.Eq: "==",
  ast.NotEq: "!=",
  ast.Is: "is",
  ast.IsNot: "is not",
  ast.In: "in",
  ast.NotIn: "not in",
}
FUNCTIONS = {
  "maximum": "minimum",
  "minimum": "maximum",
  "max": "min",
  "min": "max",
  "all": "any",
  "any": "all",
  "argmax": "argmin",
  "argmin": "argmax",
  "sum": "mean",
  "mean": "sum",
}
# Calls that only report: never mutated, nor anything inside them.
REPORTING_CALLS = {"print", "warn", "debug", "info", "warning", "error", "exception", "critical"}
REPORTING_OWNERS = {"warnings", "logging", "logger", "log", "_logger", "LOGGER"}
NO_MUTATE = "# pragma: no mutate"
UNMUTATED_FUNCTIONS = {"__repr__", "__str__"}


@dataclasses.dataclass(frozen=True)
class Mutant:
  """One edit of a module's source.

  Attributes:
    index: 1-based position among the module's mutants (stable while the source is).
    path: the file, as given to `generate`.
    line: the 1-based line the edit starts on.
    function: the enclosing function's qualified name (``<module>`` at the top).
    operator: the operator's name (see the module docstring).
    description: what changes, e.g. ``"`*` -> `/`"``.
    start: offset of the replaced text in the source.
    end: offset just past it.
    replacement: the text put in its place.
    before: the source line as it was, stripped.
    after: the same line (or the first line of the edit) as the mutant has it, stripped.
  """

  index: int
  path: str
  line: int
  function: str
  operator: str
  description: str
  start: int
  end: int
  replacement: str
  before: str
  after: str

  def apply(self, source: str) -> str:
    """The mutated source."""
    return source[: self.start] + self.replacement + source[self.end :]


@dataclasses.dataclass(frozen=True)
class _Edit:
  start: int
  end: int
  replacement: str
  operator: str
  description: str


class _Offsets:
  """Character offsets from the (line, UTF-8 byte column) positions the ``ast`` module gives."""

  def __init__(self, source: str):
    self.lines = source.splitlines(keepends=True)
    self.starts = [0]
    for line in self.lines:
      self.starts.append(self.starts[-1] + len(line))

  def __call__(self, line: int, col: int) -> int:
    text = self.lines[line - 1] if line - 1 < len(self.lines) else ""
    return self.starts[line - 1] + len(text.encode("utf-8")[:col].decode("utf-8"))

  def start(self, node: ast.AST) -> int:
    return self(node.lineno, node.col_offset)

  def end(self, node: ast.AST) -> int:
    return self(node.end_lineno, node.end_col_offset)


def _call_name(call: ast.Call) -> tuple[str | None, str | None]:
  """``(owner, name)`` of a call: ``("warnings", "warn")``, ``(None, "print")``."""
  func = call.func
  if isinstance(func, ast.Name):
    return None, func.id
  if isinstance(func, ast.Attribute):
    owner = func.value
    owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
    return owner_name, func.attr
  return None, None


def _is_reporting(call: ast.Call) -> bool:
  owner, name = _call_name(call)
  if owner is None:
    return name == "print"
  return name in REPORTING_CALLS and owner in REPORTING_OWNERS


def _only_raises(node: ast.If) -> bool:
  return all(isinstance(s, ast.Raise) for s in node.body)


def _is_docstring(node: ast.stmt) -> bool:
  return (
    isinstance(node, ast.Expr)
    and isinstance(node.value, ast.Constant)
    and isinstance(node.value.value, str)
  )


def _reads(name: str, node: ast.AST) -> bool:
  return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _swap_einsum_term(term: str) -> str | None:
  """``"...ij"`` -> ``"...ji"``: the last two index letters swapped; None if fewer than two."""
  letters = [i for i, c in enumerate(term) if c.isalpha()]
  if len(letters) < 2 or term[letters[-1]] == term[letters[-2]]:
    return None
  chars = list(term)
  i, j = letters[-2], letters[-1]
  chars[i], chars[j] = chars[j], chars[i]
  return "".join(chars)


def _einsum_variants(spec: str) -> Iterator[tuple[str, str]]:
  """``(new_spec, which)`` for each operand and the output with its last two indices swapped."""
  inputs, arrow, output = spec.partition("->")
  terms = inputs.split(",")
  for k, term in enumerate(terms):
    swapped = _swap_einsum_term(term)
    if swapped is not None:
      yield ",".join([*terms[:k], swapped, *terms[k + 1 :]]) + arrow + output, f"operand {k + 1}"
  swapped = _swap_einsum_term(output) if arrow else None
  if swapped is not None:
    yield inputs + arrow + swapped, "output"


class _Collector(ast.NodeVisitor):
  """Walks a module and collects `_Edit`s with their enclosing function, skipping what is not numerics."""

  def __init__(self, source: str):
    self.source = source
    self.offsets = _Offsets(source)
    self.scope: list[str] = []
    self.found: list[tuple[str, _Edit]] = []

  # Helpers.

  def text(self, node: ast.AST) -> str:
    return self.source[self.offsets.start(node) : self.offsets.end(node)]

  def add(self, start: int, end: int, replacement: str, operator: str, description: str) -> None:
    function = ".".join(self.scope) or "<module>"
    self.found.append((function, _Edit(start, end, replacement, operator, description)))

  def operator_between(self, left: ast.AST, right: ast.AST, symbol: str) -> tuple[int, int] | None:
    """The offsets of ``symbol`` between two operands, or None if a comment hides it."""
    lo, hi = self.offsets.end(left), self.offsets.start(right)
    gap = self.source[lo:hi]
    if "#" in gap:
      return None
    pattern = r"(?<![\w*/<>=!])" + r"\s+".join(map(re.escape, symbol.split())) + r"(?![\w*/<>=])"
    match = re.search(pattern, gap)
    return (lo + match.start(), lo + match.end()) if match else None

  # Scopes and what is skipped whole.

  def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
    if node.name in UNMUTATED_FUNCTIONS:
      return
    self.scope.append(node.name)
    for default in (*node.args.defaults, *node.args.kw_defaults):
      if default is not None:
        self.visit(default)
    self.visit_body(node.body)
    self.scope.pop()

  visit_AsyncFunctionDef = visit_FunctionDef

  def visit_ClassDef(self, node: ast.ClassDef) -> None:
    self.scope.append(node.name)
    self.visit_body(node.body)
    self.scope.pop()

  def visit_Module(self, node: ast.Module) -> None:
    self.visit_body(node.body)

  def visit_body(self, body: list[ast.stmt]) -> None:
    for i, statement in enumerate(body):
      if i == 0 and _is_docstring(statement):
        continue
      self.visit(statement)

  def generic_visit(self, node: ast.AST) -> None:
    for field, value in ast.iter_fields(node):
      if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
        self.visit_body_no_docstring(value)
      elif field in ("annotation", "returns", "decorator_list", "type_comment"):
        continue
      elif isinstance(value, list):
        for item in value:
          if isinstance(item, ast.AST):
            self.visit(item)
      elif isinstance(value, ast.AST):
        self.visit(value)

  def visit_body_no_docstring(self, body: list[ast.stmt]) -> None:
    for statement in body:
      self.visit(statement)

  def skip(self, node: ast.AST) -> None:
    """Nothing in ``node`` is mutated."""

  visit_Import = visit_ImportFrom = visit_Raise = visit_Assert = visit_JoinedStr = skip
  visit_Global = visit_Nonlocal = skip

  def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
    if node.value is not None:
      self.visit(node.value)

  def visit_If(self, node: ast.If) -> None:
    if _only_raises(node):
      self.visit_body_no_docstring(node.orelse)
      return
    if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
      return
    self.condition(node.test)
    self.generic_visit(node)

  def visit_While(self, node: ast.While) -> None:
    self.condition(node.test)
    self.generic_visit(node)

  def visit_IfExp(self, node: ast.IfExp) -> None:
    self.condition(node.test)
    self.generic_visit(node)

  # The operators.

  def condition(self, test: ast.expr) -> None:
    if isinstance(test, ast.Compare | ast.BoolOp) or (
      isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    ):
      return
    start, end = self.offsets.start(test), self.offsets.end(test)
    self.add(start, end, f"not ({self.text(test)})", "condition", "condition negated")

  def visit_Assign(self, node: ast.Assign) -> None:
    target = node.targets[0]
    if node.targets and all(isinstance(t, ast.Name) for t in node.targets):
      if target.id == "__all__":
        return
      if len(node.targets) == 1 and _reads(target.id, node.value):
        self.statement(node, f"`{target.id} = ...` removed")
    self.generic_visit(node)

  def visit_AugAssign(self, node: ast.AugAssign) -> None:
    entry = ARITHMETIC.get(type(node.op))
    if entry is not None:
      _, old, new = entry
      start = self.offsets.end(node.target)
      gap = self.source[start : self.offsets.start(node.value)]
      at = gap.find(old + "=")
      if at >= 0 and "#" not in gap:
        lo = start + at
        self.add(lo, lo + len(old) + 1, new + "=", "arithmetic", f"`{old}=` -> `{new}=`")
    self.statement(node, f"`{self.text(node.target)} {_symbol(node.op)}= ...` removed")
    self.generic_visit(node)

  def visit_Expr(self, node: ast.Expr) -> None:
    if isinstance(node.value, ast.Call):
      if _is_reporting(node.value):
        return
      self.statement(node, "call removed")
    self.generic_visit(node)

  def statement(self, node: ast.stmt, description: str) -> None:
    start, end = self.offsets.start(node), self.offsets.end(node)
    self.add(start, end, "pass", "statement", description)

  def visit_Call(self, node: ast.Call) -> None:
    if _is_reporting(node):
      return
    func = node.func
    name_node = func if isinstance(func, ast.Name) else None
    if isinstance(func, ast.Attribute) and func.attr in FUNCTIONS:
      end = self.offsets.end(func)
      new = FUNCTIONS[func.attr]
      self.add(end - len(func.attr), end, new, "function", f"`{func.attr}` -> `{new}`")
    elif name_node is not None and name_node.id in FUNCTIONS and name_node.id in {"max", "min"}:
      start, end = self.offsets.start(func), self.offsets.end(func)
      new = FUNCTIONS[name_node.id]
      self.add(start, end, new, "function", f"`{name_node.id}` -> `{new}`")
    if isinstance(func, ast.Attribute) and func.attr == "einsum" and node.args:
      self.einsum(node.args[0])
    self.generic_visit(node)

  def einsum(self, spec: ast.expr) -> None:
    if not (isinstance(spec, ast.Constant) and isinstance(spec.value, str)):
      return
    start, end = self.offsets.start(spec), self.offsets.end(spec)
    for new, which in _einsum_variants(spec.value):
      self.add(start, end, repr(new), "einsum", f"{which} transposed: `{new}`")

  def visit_BinOp(self, node: ast.BinOp) -> None:
    entry = ARITHMETIC.get(type(node.op))
    literal = (ast.List, ast.Tuple, ast.JoinedStr)
    strings = any(
      isinstance(side, literal) or (isinstance(side, ast.Constant) and isinstance(side.value, str))
      for side in (node.left, node.right)
    )
    if entry is not None and not strings:
      _, old, new = entry
      span = self.operator_between(node.left, node.right, old)
      if span is not None:
        self.add(*span, new, "arithmetic", f"`{old}` -> `{new}`")
    self.generic_visit(node)

  def visit_Compare(self, node: ast.Compare) -> None:
    left = node.left
    for op, right in zip(node.ops, node.comparators, strict=True):
      old, new = COMPARE_TEXT[type(op)], COMPARE[type(op)]
      span = self.operator_between(left, right, old)
      if span is not None:
        self.add(*span, new, "compare", f"`{old}` -> `{new}`")
      left = right
    self.generic_visit(node)

  def visit_BoolOp(self, node: ast.BoolOp) -> None:
    old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
    for left, right in zip(node.values, node.values[1:], strict=False):
      span = self.operator_between(left, right, old)
      if span is not None:
        self.add(*span, new, "boolean", f"`{old}` -> `{new}`")
    self.generic_visit(node)

  def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
    if isinstance(node.op, ast.USub | ast.Not):
      symbol = "-" if isinstance(node.op, ast.USub) else "not"
      start, end = self.offsets.start(node), self.offsets.end(node)
      operand = self.text(node.operand)
      if isinstance(node.operand, ast.BinOp | ast.BoolOp | ast.Compare | ast.IfExp):
        operand = f"({operand})"
      self.add(start, end, operand, "unary", f"`{symbol}` removed")
    self.generic_visit(node)

  def visit_Constant(self, node: ast.Constant) -> None:
    value = node.value
    start, end = self.offsets.start(node), self.offsets.end(node)
    if isinstance(value, bool):
      self.add(start, end, repr(not value), "constant", f"`{value}` -> `{not value}`")
    elif isinstance(value, int | float) and self.source[start:end].strip("0123456789.eE+-_"):
      return  # complex or hex literals: left alone
    elif isinstance(value, int | float):
      new = value + 1
      self.add(start, end, repr(new), "constant", f"`{self.source[start:end]}` -> `{new!r}`")


def _symbol(op: ast.operator) -> str:
  entry = ARITHMETIC.get(type(op))
  return entry[1] if entry else "?"


def _line_of(source: str, offset: int) -> str:
  lo = source.rfind("\n", 0, offset) + 1
  hi = source.find("\n", offset)
  return source[lo : hi if hi >= 0 else len(source)].strip()


def _selected(
  function: str, line: int, functions: list[str] | None, lines: tuple[int, int] | None
) -> bool:
  if lines is not None and not lines[0] <= line <= lines[1]:
    return False
  return functions is None or any(fnmatch.fnmatchcase(function, p) for p in functions)


def generate(
  source: str,
  path: str = "<source>",
  functions: list[str] | None = None,
  lines: tuple[int, int] | None = None,
) -> list[Mutant]:
  """Every mutant of ``source``, in source order.

  Args:
    source: the module's text.
    path: the file's name, recorded in each mutant.
    functions: if given, only mutants inside a function whose qualified name
      matches one of these ``fnmatch`` patterns (``"decompose*"``, ``"LayerSpec.*"``).
    lines: if given, ``(first, last)``: only mutants that start on these lines.

  Indices count every mutant of the file, so that a mutant keeps its index
  whatever the selection.
  """
  collector = _Collector(source)
  collector.visit(ast.parse(source))
  offsets = collector.offsets
  skipped = {i + 1 for i, text in enumerate(offsets.lines) if text.rstrip().endswith(NO_MUTATE)}
  found = sorted(collector.found, key=lambda item: (item[1].start, item[1].end))
  mutants, seen, index = [], set(), 0
  for function, edit in found:
    key = (edit.start, edit.end, edit.replacement)
    line = source.count("\n", 0, edit.start) + 1
    if key in seen or line in skipped or source[edit.start : edit.end] == edit.replacement:
      continue
    seen.add(key)
    mutated = source[: edit.start] + edit.replacement + source[edit.end :]
    try:
      compile(mutated, path, "exec", dont_inherit=True)
    except SyntaxError:
      continue
    index += 1
    mutant = Mutant(
      index=index,
      path=path,
      line=line,
      function=function,
      operator=edit.operator,
      description=edit.description,
      start=edit.start,
      end=edit.end,
      replacement=edit.replacement,
      before=_line_of(source, edit.start),
      after=_line_of(mutated, edit.start),
    )
    if _selected(function, line, functions, lines):
      mutants.append(mutant)
  return mutants
