"""``python -m mutation``: mutation testing of the numerics (docs/development.md, "Mutation testing").

The modules and the tests mapped to each are configured in ``pyproject.toml``
under ``[tool.mutation]``. Examples, from the repository root:

    python -m mutation                                   # every module, each capped as configured
    python -m mutation --module preconditioning --all    # one module, every mutant
    python -m mutation --module preconditioning --lines 140-180 --max-mutants 10
    python -m mutation --module preconditioning --list   # the mutants, without running them
    python -m mutation --again mutation/reports/all.json  # its survivors again, with today's tests
    python -m mutation --publish mutation/reports/all.json  # the docs' summary of that run
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import shlex
import signal
import subprocess
import sys
import time
import tomllib

from mutation import mutants as mutants_lib
from mutation import report as report_lib
from mutation import runner

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRIAGE = ROOT / "mutation" / "triage.toml"
REPORTS = ROOT / "mutation" / "reports"


def load_config(root: pathlib.Path) -> dict:
  """``[tool.mutation]`` of the repository's ``pyproject.toml``."""
  with open(root / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["tool"]["mutation"]


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m mutation", description=__doc__.splitlines()[0])
  p.add_argument("--module", action="append", help="a module of [tool.mutation.modules] (repeat)")
  p.add_argument("--lines", help="FIRST-LAST: only mutants starting on these lines (one module)")
  p.add_argument("--function", action="append", help="only inside functions matching (fnmatch)")
  p.add_argument("--mutant", action="append", type=int, help="only the mutant of this number")
  p.add_argument("--max-mutants", type=int, help="at most this many, spread through each module")
  p.add_argument("--all", action="store_true", help="no cap: every mutant of each module")
  p.add_argument("--tests", action="append", help="run these tests instead of the mapped ones")
  p.add_argument("--timeout", type=float, help="seconds per mutant (default: from the baseline)")
  p.add_argument("--skip-baseline", action="store_true", help="do not run the unmutated tests")
  p.add_argument("--workers", type=int, help="pytest-xdist workers (0: none; default configured)")
  p.add_argument("--report", type=pathlib.Path, help="where the Markdown report goes")
  p.add_argument("--list", action="store_true", help="list the selected mutants and stop")
  p.add_argument(
    "--render", type=pathlib.Path, help="write a run's report again from its .json (new triage)"
  )
  p.add_argument(
    "--again",
    type=pathlib.Path,
    metavar="JSON",
    help="run a saved run's survivors (but those triaged equivalent) and timeouts again with the"
    " current tests; updates its report",
  )
  p.add_argument(
    "--publish",
    type=pathlib.Path,
    nargs="+",
    metavar="JSON",
    help="write these runs' summary to benchmarks/results/mutation.json and to docs/development.md",
  )
  return p


def _git(*args: str) -> str:
  try:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
  except (OSError, subprocess.CalledProcessError):
    return ""
  return out.stdout.strip()


def _present(root: pathlib.Path, tests: list[str]) -> tuple[list[str], list[str]]:
  """``(present, absent)``: the test files or ids of ``tests`` whose file exists, and the others."""
  present = [t for t in tests if (root / t.split("::")[0]).exists()]
  return present, [t for t in tests if t not in present]


def _plan(name: str, module: dict, args: argparse.Namespace) -> tuple[report_lib.ModuleRun, list]:
  """The module's run (no results yet) and the mutants selected for it."""
  path = module["path"]
  source = (ROOT / path).read_text(encoding="utf-8")
  functions = args.function or module.get("functions")
  lines = runner.parse_lines(args.lines)
  selected = mutants_lib.generate(source, path, functions=functions, lines=lines)
  total = len(mutants_lib.generate(source, path))
  words = []
  if functions:
    words.append("functions " + ", ".join(f"`{f}`" for f in functions))
  if lines:
    words.append(f"lines {lines[0]}-{lines[1]}")
  if args.mutant:
    selected = [m for m in selected if m.index in set(args.mutant)]
    words.append("numbers " + ", ".join(map(str, args.mutant)))
  cap = None if args.all else args.max_mutants or module.get("max_mutants")
  if cap is not None and cap < len(selected):
    words.append(f"{cap} of {len(selected)} spread evenly")
    selected = runner.spread(selected, cap)
  present, absent = _present(ROOT, args.tests or module["tests"])
  run = report_lib.ModuleRun(
    name, path, present, absent, total, "; ".join(words) or "all", len(selected), None, 0.0
  )
  return run, selected


def _commit() -> str:
  """The checked-out commit, and whether kaisa_jax/ or tests/ differ from it."""
  dirty = _git("status", "--porcelain", "--", "kaisa_jax", "tests")
  commit = _git("rev-parse", "--short", "HEAD") or "unknown"
  return commit + (" with uncommitted changes to kaisa_jax/ or tests/" if dirty else "")


def _header(args_text: str, workers: int, pytest_args: list[str], started: float) -> dict:
  return {
    "Command": f"`{('python -m mutation ' + args_text).strip()}`",
    "Commit": _commit(),
    "Started": datetime.datetime.fromtimestamp(started).strftime("%Y-%m-%d %H:%M"),
    "Machine": f"{os.cpu_count()} cores, {platform.system()}, Python {platform.python_version()}",
    "pytest": f"`{shlex.join(pytest_args)} -n {workers}`",
    "Wall time": f"{(time.monotonic() - _T0) / 60:.1f} min",
  }


_T0 = time.monotonic()


def _baseline(run: report_lib.ModuleRun, command: runner.TestCommand, config: dict) -> None:
  """Times the unmutated tests (they must pass) and sets the run's per-mutant limit from them."""
  print(f"{run.name}: baseline: {len(run.tests)} test entries ...", flush=True)
  outcome, seconds, _, detail = runner.run_tests(command, timeout=3600)
  if outcome != runner.SURVIVED:
    raise SystemExit(f"{run.name}: the unmutated tests do not pass ({outcome}): {detail}")
  run.baseline = seconds
  run.timeout = config["timeout_factor"] * seconds + config["timeout_margin"]


def _run_module(run, selected, command, args, config, write) -> None:
  if not args.skip_baseline:
    _baseline(run, command, config)
  elif args.timeout is None:
    raise SystemExit("--skip-baseline needs --timeout")
  run.timeout = args.timeout or run.timeout
  print(f"{run.name}: {len(selected)} mutants, {run.timeout:.0f} s each at most", flush=True)

  def progress(result: runner.Result) -> None:
    run.results.append(result)
    m = result.mutant
    print(
      f"  #{m.index:<4d} {m.path}:{m.line:<5d} {m.description:40.40s} {result.outcome:8s}"
      f" {result.seconds:5.0f} s",
      flush=True,
    )
    write(complete=False)

  runner.run_mutants(ROOT / run.path, selected, command, run.timeout, on_result=progress)


def main(argv: list[str] | None = None) -> int:
  """Runs the command line; returns the exit status."""
  argv = sys.argv[1:] if argv is None else argv
  args = _parser().parse_args(argv)
  if args.render is not None:
    runs, header, complete = report_lib.from_json(args.render.read_text())
    text = report_lib.render(runs, report_lib.load_triage(TRIAGE), header, complete)
    (args.report or args.render.with_suffix(".md")).write_text(text)
    return 0
  if args.publish:
    return _publish(args.publish)
  config = load_config(ROOT)
  if args.again is not None:
    _restore()
    return again(ROOT, args.again, args.report, config, args.workers)
  names = args.module or list(config["modules"])
  unknown = [n for n in names if n not in config["modules"]]
  if unknown:
    raise SystemExit(f"unknown module(s) {unknown}; configured: {list(config['modules'])}")
  if args.lines and len(names) != 1:
    raise SystemExit("--lines needs exactly one --module")
  plans = [_plan(name, config["modules"][name], args) for name in names]
  if args.list:
    for run, selected in plans:
      print(f"{run.name}: {len(selected)} of {run.total} mutants ({run.selection})")
      for m in selected:
        print(f"  #{m.index:<4d} {m.path}:{m.line:<5d} {m.function:30s} {m.description}")
        print(f"        {m.before}\n     -> {m.after}")
    return 0
  _restore()
  partial = any([args.lines, args.function, args.mutant, args.max_mutants])
  default = f"{names[0] if len(names) == 1 else 'all'}{'.partial' if partial else ''}.md"
  report_path = args.report or REPORTS / default
  report_path.parent.mkdir(parents=True, exist_ok=True)
  workers = config.get("workers", 0) if args.workers is None else args.workers
  triage = report_lib.load_triage(TRIAGE)
  started = time.time()

  def write(complete: bool) -> None:
    header = _header(shlex.join(argv), workers, config["pytest_args"], started)
    runs = [run for run, _ in plans]
    report_path.write_text(report_lib.render(runs, triage, header, complete))
    report_path.with_suffix(".json").write_text(report_lib.to_json(runs, header, complete))

  try:
    for run, selected in plans:
      command = runner.TestCommand(ROOT, run.tests, config["pytest_args"], workers, sys.executable)
      _run_module(run, selected, command, args, config, write)
  except KeyboardInterrupt:
    write(complete=False)
    print(f"interrupted; every module restored; partial report: {report_path}", file=sys.stderr)
    return 130
  write(complete=True)
  print(f"report: {report_path}")
  return 0


def _restore() -> None:
  """Before mutating: SIGTERM unwinds like Ctrl-C, and what a killed run left mutated is restored."""
  signal.signal(signal.SIGTERM, runner.raise_on_sigterm)
  for restored in runner.restore_backups(ROOT):
    print(f"restored {restored} from an interrupted run", file=sys.stderr)


def current_mutant(saved: mutants_lib.Mutant, mutants: list) -> mutants_lib.Mutant | None:
  """The mutant of today's source that makes the edit ``saved`` made: same function and lines.

  The one of the same number if it matches, else the only match; None if there is none (the code
  changed) or several.
  """

  def same(m):
    return (m.function, m.before, m.after) == (saved.function, saved.before, saved.after)

  if 0 < saved.index <= len(mutants) and same(mutants[saved.index - 1]):
    return mutants[saved.index - 1]
  matches = [m for m in mutants if same(m)]
  return matches[0] if len(matches) == 1 else None


def again(
  root: pathlib.Path,
  path: pathlib.Path,
  report: pathlib.Path | None,
  config: dict,
  workers: int | None = None,
) -> int:
  """Runs the survivors and timeouts of the saved run ``path`` again; rewrites its report.

  Survivors triaged equivalent are not run: no test can kill them.

  Args:
    root: the repository root (module and test paths are relative to it).
    path: the run's ``.json``.
    report: where the Markdown goes (default: next to ``path``).
    config: ``[tool.mutation]``; the modules' current tests are run.
    workers: pytest-xdist workers (default: configured).
  """
  runs, header, complete = report_lib.from_json(path.read_text())
  workers = config.get("workers", 0) if workers is None else workers
  report = report or path.with_suffix(".md")
  triage = report_lib.load_triage(root / "mutation" / "triage.toml")
  again = {"count": 0}
  started = time.time()

  def write(done: bool) -> None:
    when = datetime.datetime.fromtimestamp(started).strftime("%Y-%m-%d %H:%M")
    notes = {
      **header,
      "Survivors run again": f"{again['count']} mutants, {when}, commit {_commit()},"
      f" `python -m mutation --again {path}`" + ("" if done else " (still going)"),
    }
    report.write_text(report_lib.render(runs, triage, notes, complete))
    report.with_suffix(".json").write_text(report_lib.to_json(runs, notes, complete))

  for run in runs:
    redo = [
      i
      for i, r in enumerate(run.results)
      if r.outcome == runner.TIMEOUT
      or (
        r.outcome == runner.SURVIVED
        and (report_lib.verdict(triage, run.name, r) or {}).get("verdict") != report_lib.EQUIVALENT
      )
    ]
    if not redo:
      continue
    module = config["modules"][run.name]
    source = (root / run.path).read_text(encoding="utf-8")
    today = mutants_lib.generate(source, run.path)
    run.tests, run.absent = _present(root, module["tests"])
    command = runner.TestCommand(root, run.tests, config["pytest_args"], workers, sys.executable)
    _baseline(run, command, config)
    pairs = [(i, current_mutant(run.results[i].mutant, today)) for i in redo]
    for i, m in pairs:
      if m is None:
        run.results[i] = runner.Result(
          run.results[i].mutant, runner.ERROR, 0.0, None, "the code changed: no such mutant now"
        )
    slots = {m.index: i for i, m in pairs if m is not None}

    def progress(result: runner.Result, run=run, slots=slots) -> None:
      run.results[slots[result.mutant.index]] = result
      again["count"] += 1
      m = result.mutant
      print(f"  #{m.index:<4d} {m.path}:{m.line:<5d} {result.outcome:8s} {result.seconds:5.0f} s")
      write(done=False)

    mutants = [m for _, m in pairs if m is not None]
    runner.run_mutants(root / run.path, mutants, command, run.timeout, on_result=progress)
  write(done=True)
  print(f"report: {report}")
  return 0


def _publish(paths: list[pathlib.Path]) -> int:
  """Writes the summary of the runs ``paths`` (the latest run of each module wins) and its block."""
  from benchmarks import generated

  modules = {}
  for path in paths:
    runs, header, complete = report_lib.from_json(path.read_text())
    if not complete:
      raise SystemExit(f"{path}: the run did not complete; finish it before publishing")
    for run in runs:
      modules[run.name] = (run, header)
  order = list(load_config(ROOT)["modules"])
  runs = [modules[name] for name in sorted(modules, key=order.index)]
  data = report_lib.published(runs, report_lib.load_triage(TRIAGE))
  for written in generated.publish("mutation.json", data):
    print(f"wrote {written.relative_to(ROOT)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
