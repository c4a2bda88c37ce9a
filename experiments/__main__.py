"""Command line: ``python -m experiments [compare|run|sweep|table|summary|scale|scale-summary] ...``.

``compare`` (the default: no mode, or options only) trains several optimizers
on one task for every seed, writes one JSON-lines file per run, a figure
(``compare.png``) and a Markdown table (``table.md``) of steps and seconds to
the task's target and the final metric (mean +- std over seeds), all in
``OUT/TASK/``. ``run`` trains one optimizer and writes its files to
``OUT/TASK/run/``, which ``table`` and ``summary`` never read. ``sweep`` tries
each optimizer's grid on a validation split and writes the chosen settings to
``OUT/TASK/best.json``; ``compare`` and ``run`` use them when present
(``--settings``), the defaults otherwise. ``table`` rebuilds the figure and
``table.md`` from the results files of an earlier ``compare`` (no training),
and refuses results made with different steps or evaluations. ``summary``
gathers the ``compare`` results of several tasks (``--tasks``) into
``OUT/summary.json`` (`experiments.report.summarise`) and ``OUT/summary.md``;
with ``--readme FILE`` it also writes the table into FILE's block ``results
table`` (`benchmarks.generated`), and with ``--publish`` it writes the summary to
``benchmarks/results/experiments.json`` and every block drawn from it (the
README's results table, ``docs/benchmarks/experiments.md``). ``scale`` runs the
batch-size scaling study of one task (`experiments.scale`: steps to target
against the batch size, critical batch sizes) into ``OUT/TASK/scale/``;
``scale-summary`` gathers several tasks' studies into
``OUT/scale-summary.json`` and ``OUT/scale-summary.md``, and with ``--publish``
into ``benchmarks/results/scaling.json``, ``docs/benchmarks/scaling.md`` and the
figures ``docs/figures/scale-TASK.png``.

Arguments are checked before anything trains or is written (exit status 2 and
a message otherwise), and every file is written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import generated
from experiments import files, optimizers, scale, tasks
from experiments.plots import plot_curvature, plot_runs
from experiments.report import markdown_table, summarise, summary_markdown
from experiments.sweep import sweep
from experiments.train import train

MODES = ("compare", "run", "sweep", "table", "summary", "scale", "scale-summary")
DEFAULT_MODE = "compare"
DEFAULT_OPTIMIZERS = ["sgd", "adamw", "kfac"]
RUN_OPTIMIZER = "sgd"
RUN_FOLDER = "run"  # run mode's results, apart from compare's
SUMMARY_TASKS = ("mnist1d", "resnet", "autoencoder", "charlm")
SEED_LIMIT = 2**32  # seeds are 0 .. 2**32 - 1
BLOCK = "results table"  # the README's block that summary writes (benchmarks/generated.py)
BEGIN, END = generated.begin(BLOCK), generated.end(BLOCK)
SUMMARY_RESULTS = "experiments.json"  # under benchmarks/results/: what --publish writes
SCALE_TASKS = ("mnist1d", "resnet", "autoencoder", "charlm")
SCALE_RESULTS = "scaling.json"
FIGURES = generated.ROOT / "docs" / "figures"  # scale-summary --publish draws scale-TASK.png

Runs = dict[str, list[list[dict[str, Any]]]]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows each option's default after its help, a list as its words; none when unset."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    default = action.default
    if "%(default)" in text or default is None or default is False or default == argparse.SUPPRESS:
      return text
    shown = " ".join(map(str, default)) if isinstance(default, list) else "%(default)s"
    return f"{text} (default: {shown})"


def positive_int(text: str) -> int:
  """An integer of at least 1 (an argparse ``type``)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} is not positive (at least 1)")
  return value


def seed(text: str) -> int:
  """A random seed, ``0 <= seed < 2**32`` (an argparse ``type``)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if not 0 <= value < SEED_LIMIT:
    raise argparse.ArgumentTypeError(f"{value} is not a seed from 0 to {SEED_LIMIT - 1}")
  return value


def output_folder(text: str) -> Path:
  """A folder to write into: absent (it is made) or a folder (an argparse ``type``)."""
  path = Path(text)
  if path.exists() and not path.is_dir():
    raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
  return path


def settings_file(text: str) -> Path:
  """A sweep's ``best.json`` that exists and holds its chosen settings (an argparse ``type``)."""
  path = Path(text)
  if not path.is_file():
    raise argparse.ArgumentTypeError(f"no file {text}: run `sweep` first or leave it out")
  try:
    best = json.loads(path.read_text()).get("best")
  except (ValueError, AttributeError):
    best = None
  if not isinstance(best, dict):
    raise argparse.ArgumentTypeError(f"{text} is not a sweep's best.json (no 'best' settings)")
  return path


def has_block(text: str, name: str = BLOCK) -> bool:
  """Whether ``text`` holds the block ``name`` (by default the results table's), well formed."""
  try:
    return name in {found for found, _, _ in generated.blocks_in(text)}
  except ValueError:
    return False


def readme_file(text: str) -> Path:
  """A file holding the results-table block (an argparse ``type``)."""
  path = Path(text)
  if not path.is_file():
    raise argparse.ArgumentTypeError(f"no file {text}")
  if not has_block(path.read_text()):
    raise argparse.ArgumentTypeError(f"{text} has no results-table markers {BEGIN} ... {END}")
  return path


class Distinct(argparse.Action):
  """Stores a list of values, refusing one given twice."""

  def __call__(
    self,
    parser: argparse.ArgumentParser,
    namespace: argparse.Namespace,
    values: Any,
    option_string: str | None = None,
  ) -> None:
    twice = sorted({str(v) for v in values if list(values).count(v) > 1})
    if twice:
      parser.error(f"argument {option_string}: given more than once: {' '.join(twice)}")
    setattr(namespace, self.dest, list(values))


def add_tasks(parser: argparse.ArgumentParser, default: Sequence[str], known: Any) -> None:
  """``--tasks``: the tasks to gather, each named once, any of ``known``."""
  parser.add_argument(
    "--tasks",
    nargs="+",
    action=Distinct,
    default=list(default),
    choices=sorted(known),
    metavar="TASK",
    help=f"the tasks to gather; any of {', '.join(sorted(known))}",
  )


def add_task(parser: argparse.ArgumentParser) -> None:
  """``--task``."""
  parser.add_argument("--task", default="mnist1d", choices=sorted(tasks.TASKS), help="the task")


def add_optimizers(
  parser: argparse.ArgumentParser, default: list[str] | None, text: str, unset: str = ""
) -> None:
  """``--optimizers``: one or more distinct names (``unset``: what no ``--optimizers`` means)."""
  names = sorted(optimizers.DEFAULTS)
  parser.add_argument(
    "--optimizers",
    nargs="+",
    action=Distinct,
    default=default,
    choices=names,
    metavar="NAME",
    help=f"{text}; any of {', '.join(names)}" + (f" (default: {unset})" if unset else ""),
  )


def add_seeds(
  parser: argparse.ArgumentParser,
  text: str = "seeds, each trained in turn",
  default: Sequence[int] = (0,),
) -> None:
  """``--seeds``: one or more distinct seeds."""
  parser.add_argument(
    "--seeds",
    type=seed,
    nargs="+",
    action=Distinct,
    default=list(default),
    metavar="SEED",
    help=text,
  )


def add_training(parser: argparse.ArgumentParser, steps: str, eval_every: int = 10) -> None:
  """``--steps`` and ``--eval-every``."""
  parser.add_argument("--steps", type=positive_int, default=None, help=f"training steps ({steps})")
  parser.add_argument(
    "--eval-every",
    type=positive_int,
    default=eval_every,
    metavar="STEPS",
    help="steps between evaluations (not timed); the last step is always evaluated",
  )


def add_progress(parser: argparse.ArgumentParser) -> None:
  """``--no-progress``."""
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def add_out(parser: argparse.ArgumentParser, text: str) -> None:
  """``--out``."""
  parser.add_argument("--out", type=output_folder, default=Path("results"), help=text)


def add_settings(parser: argparse.ArgumentParser) -> None:
  """``--settings``."""
  parser.add_argument(
    "--settings",
    type=settings_file,
    default=None,
    help="a sweep's best.json (default: OUT/TASK/best.json when it exists, else the defaults)",
  )


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
  """The parser, with one subcommand per mode, each with its own options; and those by mode."""
  top = argparse.ArgumentParser(
    prog="python -m experiments",
    description="Trains and compares optimizers (K-FAC, SGD, AdamW) on small tasks.",
    epilog=f"Without a mode (no arguments, or options only) it runs `{DEFAULT_MODE}`. "
    "`python -m experiments MODE --help` lists a mode's options.",
    formatter_class=HelpFormatter,
  )
  modes = top.add_subparsers(dest="mode", metavar="MODE", title="modes", required=True)

  by_mode: dict[str, argparse.ArgumentParser] = {}

  def mode(name: str, summary: str, description: str) -> argparse.ArgumentParser:
    by_mode[name] = modes.add_parser(
      name, help=summary, description=description, formatter_class=HelpFormatter
    )
    return by_mode[name]

  compare = mode(
    "compare",
    "train several optimizers on one task, seed by seed (the default)",
    "Trains every optimizer for every seed (seed by seed, the optimizers in turn) and writes "
    "OUT/TASK/OPTIMIZER-seedS.jsonl, compare.png and table.md.",
  )
  add_task(compare)
  add_optimizers(compare, list(DEFAULT_OPTIMIZERS), "the optimizers to compare")
  add_training(compare, "default: the task's")
  add_seeds(compare)
  add_out(compare, "results folder; files go to OUT/TASK/")
  add_settings(compare)
  add_progress(compare)

  run = mode(
    "run",
    "train one optimizer on one task",
    f"Trains one optimizer for every seed and writes its results to OUT/TASK/{RUN_FOLDER}/ "
    "(a JSON-lines file per seed and a figure), apart from compare's results: table and "
    "summary never read them.",
  )
  add_task(run)
  run.add_argument(
    "--optimizer",
    "--optimizers",
    dest="optimizer",
    default=RUN_OPTIMIZER,
    choices=sorted(optimizers.DEFAULTS),
    metavar="NAME",
    help=f"the optimizer; any of {', '.join(sorted(optimizers.DEFAULTS))}",
  )
  add_training(run, "default: the task's")
  add_seeds(run)
  add_out(run, f"results folder; files go to OUT/TASK/{RUN_FOLDER}/")
  add_settings(run)
  add_progress(run)

  sweep_parser = mode(
    "sweep",
    "choose each optimizer's settings on a validation split",
    "Trains each optimizer's grid on the training set less a validation split and writes the "
    "chosen settings to OUT/TASK/best.json (merged with earlier sweeps), sweep.md and "
    "sweep/*.jsonl.",
  )
  add_task(sweep_parser)
  add_optimizers(sweep_parser, list(DEFAULT_OPTIMIZERS), "the optimizers to sweep")
  add_training(sweep_parser, "default: the task's sweep budget")
  sweep_parser.add_argument("--seed", type=seed, default=0, help="the seed of every trial")
  add_out(sweep_parser, "results folder; files go to OUT/TASK/")
  add_progress(sweep_parser)

  table = mode(
    "table",
    "rebuild table.md and compare.png from compare's results",
    "Reads OUT/TASK/OPTIMIZER-seedS.jsonl of an earlier compare (no training) and writes "
    "table.md and compare.png; refuses results made with different steps or evaluations.",
  )
  add_task(table)
  add_optimizers(table, list(DEFAULT_OPTIMIZERS), "the optimizers in the table")
  add_seeds(table, "the seeds whose results are read")
  add_out(table, "results folder; files are read from and written to OUT/TASK/")

  summary = mode(
    "summary",
    "gather several tasks' compare results into one table",
    "Reads the compare results of each task and writes OUT/summary.json and OUT/summary.md; "
    "with --readme, also replaces that file's results table (between its markers); with "
    f"--publish, writes benchmarks/results/{SUMMARY_RESULTS} and every block drawn from it.",
  )
  add_tasks(summary, SUMMARY_TASKS, tasks.TASKS)
  add_optimizers(
    summary, None, "the optimizers in the table", "every one with results for the seeds"
  )
  add_seeds(summary, "the seeds whose results are read")
  add_out(summary, "results folder; reads OUT/TASK/, writes OUT/summary.json and OUT/summary.md")
  summary.add_argument(
    "--readme",
    type=readme_file,
    default=None,
    help=f"a file whose results table (between {BEGIN} and {END}) is replaced",
  )
  summary.add_argument(
    "--publish",
    action="store_true",
    help=f"write benchmarks/results/{SUMMARY_RESULTS} and the README's and docs' blocks from it",
  )
  add_scale_modes(mode)
  return top, by_mode


def protocol_text(field: Callable[[scale.Protocol], Sequence[Any]]) -> str:
  """A protocol field of every task, e.g. ``"autoencoder: 128 256; mnist1d: ..."``."""
  return "; ".join(
    f"{name}: {' '.join(map(str, field(p)))}" for name, p in sorted(scale.PROTOCOLS.items())
  )


def add_scale_modes(mode: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
  """The ``scale`` and ``scale-summary`` subcommands (``mode`` adds one)."""
  budgets = "; ".join(
    f"{name}: " + ", ".join(f"{s} at {b}" for b, s in p.budgets.items())
    for name, p in sorted(scale.PROTOCOLS.items())
  )
  study = mode(
    "scale",
    "steps to target against the batch size: each optimizer's critical batch size",
    "At each batch size B, tries each optimizer's learning rates c x sqrt(B/128) x (1/3, 1, 3) "
    f"(c its batch-128 setting), each plain and stabilised (warmup {scale.WARMUP * 100:g} % of "
    f"the steps; first-order optimizers also clip the gradient to norm {scale.CLIP:g}), on a "
    f"validation split, growing the grid {scale.EXTENSION_STEP:g}x past a winning end at most "
    f"{scale.MAX_EXTENSIONS} times; chooses the fewest steps to the target, "
    "then trains every seed on the training set; writes OUT/TASK/scale/: a JSON-lines file per "
    "run, scale.jsonl, scale.md and scale.png. Lines of an earlier study for other batches or "
    "optimizers are kept when made with the same budgets, evaluations, seeds and trials. "
    f"Budgets: {budgets}.",
  )
  study.add_argument("--task", default="mnist1d", choices=sorted(scale.PROTOCOLS), help="the task")
  study.add_argument(
    "--batches",
    type=positive_int,
    nargs="+",
    action=Distinct,
    default=None,
    metavar="B",
    help="batch sizes; at most the sweep split's training examples (default: the task's "
    f"protocol: {protocol_text(lambda p: p.batches)})",
  )
  add_optimizers(
    study,
    None,
    "the optimizers studied",
    f"the task's protocol: {protocol_text(lambda p: p.optimizers)}",
  )
  add_seeds(study, default=(0, 1, 2))
  add_training(
    study,
    "at every batch, replacing the protocol's budgets: smoke tests and quick looks; "
    "default: the protocol's",
    eval_every=scale.EVAL_EVERY,
  )
  add_out(study, f"results folder; files go to OUT/TASK/{scale.FOLDER}/")
  study.add_argument(
    "--resume",
    action="store_true",
    help="read back every run an earlier study finished in OUT/TASK/scale/ with the same task, "
    "seed, steps, settings and package versions instead of training it again, so that an "
    "interrupted batch goes on from its last finished run (the code is not compared: resume "
    "only a study of the same commit); default: train every run",
  )
  add_progress(study)

  gather = mode(
    "scale-summary",
    "gather several tasks' scaling studies into one file",
    f"Reads OUT/TASK/{scale.FOLDER}/{scale.LINES} of each task (skipping tasks without one) and "
    "writes every task's summary to OUT/scale-summary.json and its table to "
    f"OUT/scale-summary.md; with --publish, also to benchmarks/results/{SCALE_RESULTS}, "
    "docs/benchmarks/scaling.md and the README's scaling targets, where a task with no runs in "
    "OUT keeps its published lines.",
  )
  add_tasks(gather, SCALE_TASKS, scale.PROTOCOLS)
  add_out(
    gather,
    f"results folder; reads OUT/TASK/{scale.FOLDER}/, writes OUT/scale-summary.json and "
    "OUT/scale-summary.md",
  )
  gather.add_argument(
    "--publish",
    action="store_true",
    help=f"write benchmarks/results/{SCALE_RESULTS}, the docs' scaling tables and figures",
  )


def with_mode(argv: Sequence[str]) -> list[str]:
  """``argv`` with the default mode in front when it names none (empty, or options first)."""
  argv = list(argv)
  if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
    return [DEFAULT_MODE, *argv]
  return argv


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
  """The command-line arguments (``sys.argv[1:]`` when None); exits with status 2 if invalid.

  An option the mode does not take is reported with that mode's usage.
  """
  top, by_mode = build_parser()
  args, unknown = top.parse_known_args(with_mode(sys.argv[1:] if argv is None else argv))
  if unknown:
    by_mode[args.mode].error(
      f"unrecognized arguments: {' '.join(unknown)} "
      f"(`python -m experiments {args.mode} --help` lists its options)"
    )
  return args


def main(argv: Sequence[str] | None = None) -> None:
  """Runs the mode the arguments name."""
  args = parse(argv)
  if args.mode == "summary":
    summarise_mode(args)
    return
  if args.mode == "scale-summary":
    scale_summary(args)
    return
  task = tasks.TASKS[args.task]()
  handlers: dict[str, Callable[[tasks.Task, argparse.Namespace, Path], None]] = {
    "compare": compare_mode,
    "run": run_mode,
    "sweep": sweep_mode,
    "table": table_mode,
    "scale": scale_mode,
  }
  handlers[args.mode](task, args, args.out / task.name)


def compare_mode(task: tasks.Task, args: argparse.Namespace, folder: Path) -> None:
  """Trains ``args.optimizers`` for every seed into ``folder``; writes the figure and table."""
  best = optimizers.load_best(args.settings or folder / "best.json")
  folder.mkdir(parents=True, exist_ok=True)
  runs = train_all(task, args.optimizers, args, folder, best)
  write_outputs(task, runs, folder, "compare")


def run_mode(task: tasks.Task, args: argparse.Namespace, folder: Path) -> None:
  """Trains ``args.optimizer`` for every seed into ``folder/run``; writes its figure."""
  best = optimizers.load_best(args.settings or folder / "best.json")
  out = folder / RUN_FOLDER
  out.mkdir(parents=True, exist_ok=True)
  runs = train_all(task, [args.optimizer], args, out, best)
  write_outputs(task, runs, out, "run")


def sweep_mode(task: tasks.Task, args: argparse.Namespace, folder: Path) -> None:
  """Sweeps ``args.optimizers`` and prints the chosen settings."""
  folder.mkdir(parents=True, exist_ok=True)
  steps = args.steps or task.sweep_steps
  summary = sweep(
    task, args.optimizers, steps, args.seed, args.eval_every, folder, not args.no_progress
  )
  for name in args.optimizers:
    print(f"{name}: {summary['best'][name]}")
  print(f"results: {folder}/best.json, {folder}/sweep.md, {folder}/sweep/*.jsonl")


def table_mode(task: tasks.Task, args: argparse.Namespace, folder: Path) -> None:
  """Rebuilds the figure and ``table.md`` from an earlier compare's results."""
  write_outputs(task, read_runs(folder, args.optimizers, args.seeds), folder, "table")


def read_records(path: Path) -> list[dict[str, Any]]:
  """The records of a JSON-lines results file."""
  if not path.exists():
    raise SystemExit(f"no results file {path}: run `compare` with these seeds first")
  return [json.loads(line) for line in path.read_text().splitlines()]


def schedule(records: Sequence[dict[str, Any]]) -> tuple[int, ...]:
  """The steps a run was evaluated at (its last: the steps it trained)."""
  return tuple(r["step"] for r in records)


def mixed_schedules(runs: Runs, seeds: Sequence[int]) -> str | None:
  """Which runs were evaluated at which steps, when they differ; None when all agree."""
  groups: dict[tuple[int, ...], list[str]] = {}
  for name, per_seed in runs.items():
    for s, records in zip(seeds, per_seed):
      groups.setdefault(schedule(records), []).append(f"{name} seed {s}")
  if len(groups) < 2:
    return None
  return "; ".join(
    f"{', '.join(labels)}: {steps[-1]} steps, {len(steps)} evaluations"
    for steps, labels in groups.items()
  )


def read_runs(out: Path, names: list[str], seeds: list[int]) -> Runs:
  """Every optimizer's records, one list per seed, from ``out``.

  Raises `SystemExit` when a file is missing or when the runs were not
  trained for the same steps and evaluated at the same steps (a table of
  them would mix settings under one header).
  """
  runs = {n: [read_records(out / f"{n}-seed{s}.jsonl") for s in seeds] for n in names}
  mixed = mixed_schedules(runs, seeds)
  if mixed is not None:
    raise SystemExit(
      f"the results in {out} were made with different steps or evaluations ({mixed}): "
      "run `compare` again with the same settings for every optimizer and seed"
    )
  return runs


def train_all(
  task: tasks.Task,
  names: list[str],
  args: argparse.Namespace,
  out: Path,
  best: dict[str, dict[str, Any]],
) -> Runs:
  """Trains every optimizer for every seed, with the sweep's settings (``best``) when there are any.

  Seed by seed, every optimizer in turn: the machine's slow spells fall on all
  optimizers alike rather than on whichever ran through them.
  """
  steps = args.steps or task.steps
  chosen = {name: optimizers.choose(name, best) for name in names}
  runs: Runs = {name: [] for name in names}
  for s in args.seeds:
    for name, (opt, source) in chosen.items():
      path = out / f"{name}-seed{s}.jsonl"
      extra = {"settings_from": source}
      records = train(
        task, opt, steps, s, args.eval_every, path, not args.no_progress, extra_config=extra
      )
      runs[name].append(records)
  return runs


def settings_source(runs: Runs) -> str:
  """Which optimizers ran with a sweep's settings and which with the defaults."""
  by_source: dict[str, list[str]] = {}
  for name, seeds in runs.items():
    by_source.setdefault(seeds[0][0]["config"].get("settings_from", "default"), []).append(name)
  labels = {"sweep": "from the sweep (best.json)", "default": "defaults"}
  return "; ".join(f"{labels.get(k, k)} for {', '.join(v)}" for k, v in by_source.items())


def write_outputs(task: tasks.Task, runs: Runs, out: Path, mode: str) -> None:
  """The figures, and in compare and table modes ``table.md``; prints the table.

  Beside the loss and metric figure, K-FAC runs with curvature statistics get
  ``curvature.png`` (``OPTIMIZER-curvature.png`` in run mode), `plot_curvature`.
  """
  names = list(runs)
  figure = out / (f"{names[0]}.png" if mode == "run" else "compare.png")
  plot_runs(runs, task.metric_name, task.target, figure, task.higher_is_better)
  curvature = out / (f"{names[0]}-curvature.png" if mode == "run" else "curvature.png")
  table = markdown_table(task, runs, settings_source(runs))
  print(table)
  written = f"results: {out}/*.jsonl, figure: {figure}"
  if plot_curvature(runs, curvature):
    written += f", K-FAC's worst-conditioned layer: {curvature}"
  if mode != "run":
    files.write_text(out / "table.md", table)
    written += f", table: {out}/table.md"
  print(written)


def provenance(mode: str, args: argparse.Namespace) -> str:
  """Where a published summary comes from: the command that wrote it."""
  tasks_text = " ".join(args.tasks)
  seeds = f" --seeds {' '.join(map(str, args.seeds))}" if hasattr(args, "seeds") else ""
  return (
    f"written by `python -m experiments {mode} --tasks {tasks_text}{seeds} --out {args.out} "
    f"--publish` from the runs in {args.out}/"
  )


def published(results_file: str, summary: dict[str, Any]) -> None:
  """Writes ``benchmarks/results/RESULTS_FILE`` and every block drawn from it; says which."""
  for path in generated.publish(results_file, summary):
    print(f"written: {path}")


def summarise_mode(args: argparse.Namespace) -> None:
  """Gathers the results of several tasks into one table (and into the README)."""
  results = []
  for name in args.tasks:
    out = args.out / name
    names = args.optimizers or [n for n in optimizers.DEFAULTS if any(out.glob(f"{n}-seed*.jsonl"))]
    if not names:
      raise SystemExit(f"no results in {out}: run `python -m experiments compare --task {name}`")
    results.append((tasks.TASKS[name](), read_runs(out, names, args.seeds)))
  summary = summarise(results)
  table = summary_markdown(summary)
  print(table)
  files.write_text(args.out / "summary.json", json.dumps(summary, indent=1) + "\n")
  files.write_text(args.out / "summary.md", table + "\n")
  if args.readme is not None:
    text = args.readme.read_text()
    if not has_block(text):
      raise SystemExit(f"{args.readme} has no results-table markers {BEGIN!r} ... {END!r}")
    files.write_text(args.readme, generated.replace(text, BLOCK, table))
    print(f"table written to {args.readme}")
  if args.publish:
    published(SUMMARY_RESULTS, {"provenance": provenance("summary", args), **summary})


def refuse(mode: str, message: str) -> None:
  """Exits with status 2 and ``message`` under the mode's usage (arguments found invalid late)."""
  build_parser()[1][mode].error(message)


def scale_mode(task: tasks.Task, args: argparse.Namespace, folder: Path) -> None:
  """Runs the scaling study into ``folder/scale``; prints its table.

  The plan, the batches against the sweep split and an earlier ``scale.jsonl``
  are checked before anything trains (exit status 2 otherwise).
  """
  out = folder / scale.FOLDER
  protocol = scale.PROTOCOLS[args.task]
  try:
    plan = scale.make_plan(
      protocol, args.batches, args.optimizers, args.seeds, args.steps, args.eval_every, args.resume
    )
    scale.check_batches(task, plan.batches)
    kept = scale.kept_lines(out / scale.LINES, plan)
  except ValueError as error:
    refuse("scale", str(error))
    return
  lines = scale.study(task, plan, out, kept, not args.no_progress)
  print(scale.report(scale.summary_lines(lines)))
  print(f"results: {out}/*.jsonl, {out}/{scale.LINES}, {out}/scale.md, figure: {out}/scale.png")


def scale_source(args: argparse.Namespace, name: str, lines: Sequence[dict[str, Any]]) -> str:
  """Where a task's published scaling lines come from: the runs, the command, the versions."""
  made = lines[0].get("versions", {})
  packages = ", ".join(f"{k} {v}" for k, v in made.items() if k in ("jax", "flax", "optax"))
  return (
    f"runs of `python -m experiments scale --task {name}` in {args.out}/{name}/{scale.FOLDER}/"
    + (f" ({packages})" if packages else "")
  )


def published_scaling() -> dict[str, Any]:
  """The published scaling summary, each task's source given (older files had one for all)."""
  path = generated.RESULTS / SCALE_RESULTS
  if not path.exists():
    return {"tasks": {}, "sources": {}, "unrun": {}}
  results = json.loads(path.read_text())
  sources = results.get("sources") or {t: results["provenance"] for t in results["tasks"]}
  return {"tasks": results["tasks"], "sources": sources, "unrun": results.get("unrun", {})}


def scale_summary(args: argparse.Namespace) -> None:
  """Gathers the scaling studies of several tasks into one summary and its tables.

  With ``--publish``, a task with no runs in ``OUT`` keeps its published lines
  and their source: publishing one task's new study leaves the others as they were.
  """
  summary: dict[str, Any] = {"tasks": {}, "sources": {}, "unrun": {}}
  kept = published_scaling() if args.publish else {"tasks": {}, "sources": {}, "unrun": {}}
  reused = []  # the tasks whose published lines are kept
  for name in args.tasks:
    path = args.out / name / scale.FOLDER / scale.LINES
    if not path.exists():
      if name in kept["tasks"]:
        summary["tasks"][name] = kept["tasks"][name]
        summary["sources"][name] = kept["sources"][name]
        if name in kept["unrun"]:
          summary["unrun"][name] = kept["unrun"][name]
        reused.append(name)
        print(f"{name}: no scaling results ({path}): kept the published lines")
      else:
        print(f"{name}: no scaling results ({path}): skipped")
      continue
    lines = scale.read_lines(path)
    problem = scale.mixed(lines) if lines else "no lines"
    if problem is not None:
      raise SystemExit(
        f"{path} mixes results made with different budgets, evaluations, seeds or trials "
        f"({problem}): "
        f"run `python -m experiments scale --task {name}` again into an empty folder"
      )
    summary["tasks"][name] = scale.summary_lines(lines)
    summary["sources"][name] = scale_source(args, name, lines)
    if unrun := scale.unrun_batches(name, lines):
      summary["unrun"][name] = unrun
  if not summary["tasks"]:
    raise SystemExit(
      f"no scaling results in {args.out} for {' '.join(args.tasks)}: "
      "run `python -m experiments scale --task TASK` first"
    )
  table = scale.summary_markdown(summary)
  print(table)
  files.write_text(args.out / "scale-summary.json", json.dumps(summary, indent=1) + "\n")
  files.write_text(args.out / "scale-summary.md", table + "\n")
  if args.publish:
    source = provenance("scale-summary", args)
    if reused:
      source += f"; {', '.join(reused)} kept from the published file (each task's: sources)"
    published(SCALE_RESULTS, {"provenance": source, **summary})
    for name, lines in summary["tasks"].items():
      if name in reused:
        continue  # its figure stays as published
      figure = FIGURES / f"scale-{name}.png"
      scale.plot(lines, figure)
      print(f"written: {figure}")


if __name__ == "__main__":
  main()
