"""Runs a module's mutants one at a time against the tests mapped to it.

For each mutant: write the mutated source over the module, drop the module's
cached bytecode, run the tests in a fresh process (its own process group, so
that a timeout ends pytest and its workers together), record the outcome and
write the original back. The original is written back in a ``finally``
whatever happens, and a copy of it is kept in ``mutation/.backup/`` while the
module is mutated, so that even a run that is killed outright leaves it to be
restored by the next run (`restore_backups`).

Outcomes: ``killed`` (the tests failed or errored), ``survived`` (they
passed), ``timeout`` (they ran past the limit), ``error`` (pytest collected
no test or could not start: a problem of the set-up, not of the mutant).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable

from mutation.mutants import Mutant

KILLED, SURVIVED, TIMEOUT, ERROR = "killed", "survived", "timeout", "error"
BACKUP_DIR = pathlib.Path("mutation") / ".backup"


@dataclasses.dataclass
class Result:
  """The outcome of one mutant (or of the unmutated baseline, with ``mutant`` None)."""

  mutant: Mutant | None
  outcome: str
  seconds: float
  returncode: int | None
  detail: str = ""


@dataclasses.dataclass
class TestCommand:
  """How the mapped tests run: ``python -m pytest <args> <tests>`` in ``root``.

  Attributes:
    root: the repository root; it is put first on ``PYTHONPATH``.
    tests: test files or node ids, fastest and most pointed first (``-x`` stops at the first failure).
    pytest_args: pytest's options.
    workers: pytest-xdist workers; 0 runs the tests in the pytest process.
    python: the interpreter.
  """

  root: pathlib.Path
  tests: list[str]
  pytest_args: list[str]
  workers: int = 0
  python: str = sys.executable

  def argv(self) -> list[str]:
    workers = ["-n", str(self.workers)] if self.workers else ["-n", "0"]
    return [self.python, "-m", "pytest", *self.pytest_args, *workers, *self.tests]

  def env(self) -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(self.root) + (os.pathsep + path if path else "")
    # A mutant's bytecode is never cached: the next mutant may have the same size and mtime.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _first_failure(output: str) -> str:
  """The first ``FAILED``/``ERROR`` line of pytest's summary, or its last line."""
  for line in output.splitlines():
    if line.startswith(("FAILED ", "ERROR ")):
      return line[:300]
  lines = [line for line in output.splitlines() if line.strip()]
  return lines[-1][:300] if lines else ""


def run_tests(command: TestCommand, timeout: float) -> tuple[str, float, int | None, str]:
  """Runs the tests once: ``(outcome, seconds, returncode, detail)``."""
  start = time.monotonic()
  process = subprocess.Popen(
    command.argv(),
    cwd=command.root,
    env=command.env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  try:
    output, _ = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    _kill_group(process)
    process.communicate()
    return TIMEOUT, time.monotonic() - start, None, f"past {timeout:.0f} s"
  except BaseException:
    _kill_group(process)
    raise
  seconds = time.monotonic() - start
  code = process.returncode
  if code == 0:
    return SURVIVED, seconds, code, ""
  if code in (4, 5):  # usage error, no tests collected
    return ERROR, seconds, code, _first_failure(output)
  return KILLED, seconds, code, _first_failure(output)


def _kill_group(process: subprocess.Popen) -> None:
  with contextlib.suppress(ProcessLookupError):
    os.killpg(process.pid, signal.SIGKILL)
  process.wait()


def _drop_bytecode(path: pathlib.Path) -> None:
  cache = path.parent / "__pycache__"
  for pyc in cache.glob(f"{path.stem}.*.pyc"):
    pyc.unlink(missing_ok=True)


def _backup_path(root: pathlib.Path, module: pathlib.Path) -> pathlib.Path:
  relative = module.resolve().relative_to(root.resolve()).as_posix()
  return root / BACKUP_DIR / (urllib.parse.quote(relative, safe="") + ".orig")


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def restore_backups(root: pathlib.Path) -> list[pathlib.Path]:
  """Writes back every module a killed run left mutated; returns the modules restored.

  A backup whose run is still going (its process, named in the ``.pid`` file
  beside it, is alive) is left alone: that run restores its module itself.
  """
  restored = []
  for backup in sorted((root / BACKUP_DIR).glob("*.orig")):
    owner = backup.with_suffix(".pid")
    if owner.exists() and _alive(int(owner.read_text() or 0)):
      continue
    module = root / urllib.parse.unquote(backup.name[: -len(".orig")])
    module.write_bytes(backup.read_bytes())
    _drop_bytecode(module)
    backup.unlink()
    owner.unlink(missing_ok=True)
    restored.append(module)
  return restored


def raise_on_sigterm(signum, frame):
  """A SIGTERM handler that unwinds like Ctrl-C, so that every ``finally`` runs."""
  raise KeyboardInterrupt(f"signal {signum}")


def run_mutants(
  module: pathlib.Path,
  mutants: list[Mutant],
  command: TestCommand,
  timeout: float,
  on_result: Callable[[Result], None] = lambda result: None,
  tester: Callable[[TestCommand, float], tuple[str, float, int | None, str]] = run_tests,
) -> list[Result]:
  """Runs each mutant of ``module`` against ``command``; the module is restored whatever happens.

  Args:
    module: the file the mutants edit.
    mutants: the mutants, generated from the file's current text.
    command: the tests to run.
    timeout: seconds a run may take before the mutant counts as ``timeout``.
    on_result: called with each result as it comes (progress, partial reports).
    tester: runs the tests once (`run_tests`; a test of this module passes another).
  """
  original = module.read_bytes()
  source = original.decode("utf-8")
  backup = _backup_path(command.root, module)
  backup.parent.mkdir(parents=True, exist_ok=True)
  backup.write_bytes(original)
  backup.with_suffix(".pid").write_text(str(os.getpid()))
  previous = signal.signal(signal.SIGTERM, raise_on_sigterm)
  results = []
  try:
    for mutant in mutants:
      module.write_text(mutant.apply(source), encoding="utf-8")
      _drop_bytecode(module)
      try:
        outcome, seconds, code, detail = tester(command, timeout)
      finally:
        module.write_bytes(original)
        _drop_bytecode(module)
      results.append(Result(mutant, outcome, seconds, code, detail))
      on_result(results[-1])
  finally:
    module.write_bytes(original)
    _drop_bytecode(module)
    backup.unlink(missing_ok=True)
    backup.with_suffix(".pid").unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, previous)
  return results


def parse_lines(text: str | None) -> tuple[int, int] | None:
  """``"120-180"`` -> ``(120, 180)``; ``"150"`` -> ``(150, 150)``; None stays None."""
  if text is None:
    return None
  match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
  if match is None:
    raise ValueError(f"--lines takes FIRST-LAST or LINE, got {text!r}")
  first = int(match.group(1))
  return first, int(match.group(2) or first)


def spread(mutants: list[Mutant], cap: int | None) -> list[Mutant]:
  """At most ``cap`` mutants, evenly spaced through the module (all of them if ``cap`` is None)."""
  if cap is None or cap >= len(mutants):
    return list(mutants)
  if cap <= 0:
    return []
  step = len(mutants) / cap
  return [mutants[int(i * step + step / 2)] for i in range(cap)]
