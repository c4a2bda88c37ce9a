"""Command line: ``python -m experiments [compare|run] ...``.

``compare`` (the default) trains several optimizers on one task, writes one
JSON-lines file per run and a figure, and prints a table of steps and seconds
to the task's target. ``run`` trains one optimizer.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from experiments import optimizers, tasks
from experiments.plots import plot_runs
from experiments.train import train


def to_target(records, target: float, higher_is_better: bool):
  """``(step, seconds)`` of the first evaluation that reaches the target, or None."""
  for r in records:
    if (r["metric"] >= target) if higher_is_better else (r["metric"] <= target):
      return r["step"], r["wall_seconds"]
  return None


def summarize(task: tasks.Task, runs: dict[str, list[list[dict]]]) -> str:
  head = f"{'optimizer':<10} {'final ' + task.metric_name:>20} {'steps to target':>16} {'seconds to target':>18}"
  lines = [f"{task.name}: target {task.metric_name} {task.target}", head]
  seconds_to = {}
  for name, seeds in runs.items():
    finals = [s[-1]["metric"] for s in seeds]
    hits = [to_target(s, task.target, task.higher_is_better) for s in seeds]
    reached = [h for h in hits if h is not None]
    final = f"{statistics.mean(finals):.4f}" + (
      f" +- {statistics.stdev(finals):.4f}" if len(finals) > 1 else ""
    )
    if len(reached) == len(hits):
      steps = statistics.mean(h[0] for h in reached)
      secs = statistics.mean(h[1] for h in reached)
      seconds_to[name] = secs
      lines.append(f"{name:<10} {final:>20} {steps:>16.0f} {secs:>18.2f}")
    else:
      lines.append(
        f"{name:<10} {final:>20} {'not reached':>16} {f'({len(reached)}/{len(hits)} seeds)':>18}"
      )
  baselines = {k: v for k, v in seconds_to.items() if k != "kfac"}
  if "kfac" in seconds_to and baselines:
    best = min(baselines, key=baselines.get)
    ratio = seconds_to["kfac"] / baselines[best]
    lines.append(
      f"kfac time to target / best baseline ({best}): {ratio:.2f} ({(1 - ratio) * 100:+.0f}% less time)"
    )
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m experiments", description=__doc__.splitlines()[0]
  )
  parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "run"])
  parser.add_argument("--task", default="mnist1d", choices=sorted(tasks.TASKS))
  parser.add_argument(
    "--optimizers",
    nargs="+",
    default=["sgd", "adam", "kfac"],
    choices=sorted(optimizers.DEFAULTS),
    help="optimizers to compare (compare mode); the first one only in run mode",
  )
  parser.add_argument(
    "--steps", type=int, default=None, help="training steps (default: the task's)"
  )
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  parser.add_argument("--eval-every", type=int, default=50)
  parser.add_argument("--out", type=Path, default=Path("results"))
  args = parser.parse_args(argv)

  task = tasks.TASKS[args.task]()
  steps = args.steps or task.steps
  names = args.optimizers if args.mode == "compare" else args.optimizers[:1]
  out = args.out / task.name
  out.mkdir(parents=True, exist_ok=True)
  runs = {}
  for name in names:
    opt = optimizers.DEFAULTS[name]
    runs[name] = [
      train(task, opt, steps, seed, args.eval_every, out / f"{name}-seed{seed}.jsonl")
      for seed in args.seeds
    ]
  figure = out / ("compare.png" if args.mode == "compare" else f"{names[0]}.png")
  plot_runs(runs, task.metric_name, task.target, figure)
  print(summarize(task, runs))
  print(f"results: {out}/*.jsonl, figure: {figure}")


if __name__ == "__main__":
  main()
