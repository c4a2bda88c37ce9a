"""Command line: ``python -m experiments [compare|run|sweep|table|summary] ...``.

``compare`` (the default) trains several optimizers on one task for every seed,
writes one JSON-lines file per run, a figure (``compare.png``) and a Markdown
table (``table.md``) of steps and seconds to the task's target and the final
metric (mean +- std over seeds). ``run`` trains one optimizer (the first given).
``sweep`` tries each optimizer's grid on a validation split and writes the
chosen settings to ``best.json``; ``compare`` and ``run`` use them when present
(``--settings``), the defaults otherwise. ``table`` rebuilds the figure and
``table.md`` from the results files of an earlier ``compare`` (no training).
Everything goes to ``OUT/TASK/``. ``summary`` gathers the ``compare`` results of
several tasks (``--tasks``) into ``OUT/summary.md`` and, with ``--readme``,
into that file between its experiments-table markers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from experiments import optimizers, tasks
from experiments.plots import plot_runs
from experiments.report import markdown_table, summary_table
from experiments.sweep import sweep
from experiments.train import train

DEFAULT_OPTIMIZERS = ["sgd", "adamw", "kfac"]
SUMMARY_TASKS = ("mnist1d", "resnet", "autoencoder", "charlm")
BEGIN = "<!-- experiments table: written by python -m experiments summary -->"
END = "<!-- end of experiments table -->"


def parse(argv: list[str] | None) -> argparse.Namespace:
  """The command-line arguments."""
  parser = argparse.ArgumentParser(
    prog="python -m experiments", description=__doc__.splitlines()[0]
  )
  parser.add_argument(
    "mode",
    nargs="?",
    default="compare",
    choices=["compare", "run", "sweep", "table", "summary"],
  )
  parser.add_argument("--task", default="mnist1d", choices=sorted(tasks.TASKS))
  parser.add_argument(
    "--optimizers",
    nargs="+",
    default=None,
    choices=sorted(optimizers.DEFAULTS),
    help=(
      f"optimizers to compare or sweep (default: {' '.join(DEFAULT_OPTIMIZERS)}); the first "
      "one only in run mode; in summary mode, default: every one with results for the seeds"
    ),
  )
  parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help="training steps (default: the task's steps, or its sweep budget in sweep mode)",
  )
  parser.add_argument(
    "--seeds", type=int, nargs="+", default=[0], help="seeds (sweep mode: the first)"
  )
  parser.add_argument(
    "--eval-every", type=int, default=10, help="steps between evaluations (not timed)"
  )
  parser.add_argument("--out", type=Path, default=Path("results"))
  parser.add_argument(
    "--settings",
    type=Path,
    default=None,
    help="a sweep's best.json (default: OUT/TASK/best.json when it exists)",
  )
  parser.add_argument(
    "--tasks",
    nargs="+",
    default=list(SUMMARY_TASKS),
    choices=sorted(tasks.TASKS),
    help="summary mode: the tasks to gather",
  )
  parser.add_argument(
    "--readme",
    type=Path,
    default=None,
    help="summary mode: a file whose experiments table (between its markers) is replaced",
  )
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
  """Runs the mode the arguments name."""
  args = parse(argv)
  if args.mode == "summary":
    summarise(args)
    return
  args.optimizers = args.optimizers or DEFAULT_OPTIMIZERS
  task = tasks.TASKS[args.task]()
  out = args.out / task.name
  out.mkdir(parents=True, exist_ok=True)
  if args.mode == "sweep":
    steps = args.steps or task.sweep_steps
    summary = sweep(
      task, args.optimizers, steps, args.seeds[0], args.eval_every, out, not args.no_progress
    )
    for name in args.optimizers:
      print(f"{name}: {summary['best'][name]}")
    print(f"results: {out}/best.json, {out}/sweep.md, {out}/sweep/*.jsonl")
    return

  names = args.optimizers if args.mode in ("compare", "table") else args.optimizers[:1]
  if args.mode == "table":
    runs = read_runs(out, names, args.seeds)
  else:
    runs = train_all(task, names, args, out)
  write_outputs(task, runs, out, args.mode)


def read_records(path: Path) -> list[dict[str, Any]]:
  """The records of a JSON-lines results file."""
  if not path.exists():
    raise SystemExit(f"no results file {path}: run `compare` with these seeds first")
  return [json.loads(line) for line in path.read_text().splitlines()]


def read_runs(out: Path, names: list[str], seeds: list[int]) -> dict[str, list[list[Any]]]:
  """Every optimizer's records, one list per seed, from ``out``."""
  return {n: [read_records(out / f"{n}-seed{s}.jsonl") for s in seeds] for n in names}


def train_all(
  task: tasks.Task, names: list[str], args: argparse.Namespace, out: Path
) -> dict[str, list[list[dict[str, Any]]]]:
  """Trains every optimizer for every seed, with the sweep's settings when there are any.

  Seed by seed, every optimizer in turn: the machine's slow spells fall on all
  optimizers alike rather than on whichever ran through them.
  """
  steps = args.steps or task.steps
  best = optimizers.load_best(args.settings or out / "best.json")
  chosen = {name: optimizers.choose(name, best) for name in names}
  runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in names}
  for seed in args.seeds:
    for name, (opt, source) in chosen.items():
      path = out / f"{name}-seed{seed}.jsonl"
      extra = {"settings_from": source}
      records = train(
        task, opt, steps, seed, args.eval_every, path, not args.no_progress, extra_config=extra
      )
      runs[name].append(records)
  return runs


def settings_source(runs: dict[str, list[list[dict[str, Any]]]]) -> str:
  """Which optimizers ran with a sweep's settings and which with the defaults."""
  by_source: dict[str, list[str]] = {}
  for name, seeds in runs.items():
    by_source.setdefault(seeds[0][0]["config"].get("settings_from", "default"), []).append(name)
  labels = {"sweep": "from the sweep (best.json)", "default": "defaults"}
  return "; ".join(f"{labels.get(k, k)} for {', '.join(v)}" for k, v in by_source.items())


def write_outputs(
  task: tasks.Task, runs: dict[str, list[list[dict[str, Any]]]], out: Path, mode: str
) -> None:
  """The figure, and in compare and table modes ``table.md``; prints the table."""
  names = list(runs)
  figure = out / (f"{names[0]}.png" if mode == "run" else "compare.png")
  plot_runs(runs, task.metric_name, task.target, figure, task.higher_is_better)
  table = markdown_table(task, runs, settings_source(runs))
  print(table)
  written = f"results: {out}/*.jsonl, figure: {figure}"
  if mode != "run":
    (out / "table.md").write_text(table)
    written += f", table: {out}/table.md"
  print(written)


def summarise(args: argparse.Namespace) -> None:
  """Gathers the results of several tasks into one table (and into the README)."""
  results = []
  for name in args.tasks:
    out = args.out / name
    names = args.optimizers or [n for n in optimizers.DEFAULTS if any(out.glob(f"{n}-seed*.jsonl"))]
    if not names:
      raise SystemExit(f"no results in {out}: run `python -m experiments compare --task {name}`")
    results.append((tasks.TASKS[name](), read_runs(out, names, args.seeds)))
  table = summary_table(results)
  print(table)
  (args.out / "summary.md").write_text(table + "\n")
  if args.readme is not None:
    text = args.readme.read_text()
    if BEGIN not in text or END not in text:
      raise SystemExit(f"{args.readme} has no experiments-table markers {BEGIN!r} ... {END!r}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    args.readme.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    print(f"table written to {args.readme}")


if __name__ == "__main__":
  main()
