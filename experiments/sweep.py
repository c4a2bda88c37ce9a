"""The sweep: for each optimizer, the trials of its `GRID`, chosen on a validation split.

Every trial trains on the training set less a validation split (20 %, seed 0)
for the task's ``sweep_steps`` (the cosine schedule spans that budget) and is
scored by its final validation metric; a trial that diverges scores worst.
The test set is never looked at. The chosen settings go to ``best.json``,
which ``compare`` and ``run`` use when present.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments import optimizers
from experiments.files import write_text
from experiments.report import sweep_table
from experiments.tasks import Task, with_validation
from experiments.train import train

VALIDATION_FRACTION = 0.2


def pick(task: Task, trials: list[dict[str, Any]]) -> int:
  """Index of the best trial by final metric (diverged ones last; ties: the earlier)."""

  def score(i: int) -> tuple[bool, float]:
    m = trials[i]["final_metric"]
    if m is None:
      return (True, 0.0)
    return (False, -m if task.higher_is_better else m)

  return min(range(len(trials)), key=score)


def run_trials(
  val_task: Task, name: str, steps: int, seed: int, eval_every: int, out: Path, progress: bool
) -> list[dict[str, Any]]:
  """Trains every setting of ``GRID[name]`` on ``val_task`` (the validation split); one summary per trial."""
  out.mkdir(parents=True, exist_ok=True)
  trials = []
  for i, settings in enumerate(optimizers.GRID[name]):
    opt = optimizers.from_settings(name, settings)
    path = out / f"{name}-trial{i}.jsonl"
    try:
      records = train(
        val_task, opt, steps, seed, eval_every, path, progress, extra_config={"sweep_trial": i}
      )
      final, seconds = records[-1]["metric"], records[-1]["wall_seconds"]
    except FloatingPointError:
      final, seconds = None, float("nan")
    trials.append(
      {"settings": settings, "final_metric": final, "wall_seconds": seconds, "chosen": False}
    )
  trials[pick(val_task, trials)]["chosen"] = True
  return trials


def sweep(
  task: Task,
  names: list[str],
  steps: int,
  seed: int,
  eval_every: int,
  out: Path,
  progress: bool = True,
) -> dict[str, Any]:
  """Sweeps ``names`` and writes ``out/best.json`` (merged with earlier sweeps) and ``out/sweep.md``."""
  val_task = with_validation(task, VALIDATION_FRACTION)
  best_path = out / "best.json"
  summary: dict[str, Any] = {"best": {}, "trials": {}}
  if best_path.exists():
    summary = json.loads(best_path.read_text())
  for name in names:
    trials = run_trials(val_task, name, steps, seed, eval_every, out / "sweep", progress)
    summary["trials"][name] = trials
    summary["best"][name] = next(t["settings"] for t in trials if t["chosen"])
  summary |= {
    "task": task.name,
    "steps": steps,
    "seed": seed,
    "validation_fraction": VALIDATION_FRACTION,
    "criterion": f"final validation metric ({'higher' if task.higher_is_better else 'lower'} is better)",
  }
  out.mkdir(parents=True, exist_ok=True)
  write_text(best_path, json.dumps(summary, indent=2) + "\n")
  write_text(out / "sweep.md", sweep_table(val_task, summary["trials"], steps))
  return summary
