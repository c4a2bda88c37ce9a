"""Summaries of runs: steps and seconds to the target, final metric, as a Markdown table."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from experiments.optimizers import is_kfac
from experiments.tasks import Task

Record = dict[str, Any]


def to_target(records: Sequence[Record], task: Task) -> tuple[int, float] | None:
  """``(step, wall seconds)`` of the first evaluation that reaches the target, or None."""
  for r in records:
    if task.reached(r["metric"]):
      return r["step"], r["wall_seconds"]
  return None


def mean_std(values: Sequence[float], digits: int = 4) -> str:
  """``"mean +- std"`` (sample standard deviation; the mean alone for one value)."""
  text = f"{statistics.mean(values):.{digits}f}"
  return text + (f" +- {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def settings_text(config: Record) -> str:
  """The swept settings of a run's config, e.g. ``"lr 0.1, damping 0.01"``."""
  keys = ("lr", "damping")
  return ", ".join(f"{k} {config[k]:g}" for k in keys if k in config)


def optimizer_row(task: Task, seeds: Sequence[Sequence[Record]]) -> dict[str, Any]:
  """Steps and seconds to target (means over seeds, None unless every seed reached it)."""
  hits = [to_target(s, task) for s in seeds]
  reached = [h for h in hits if h is not None]
  everywhere = len(reached) == len(hits)
  return {
    "settings": settings_text(seeds[0][-1]["config"]),
    "reached": len(reached),
    "seeds": len(hits),
    "steps": statistics.mean(h[0] for h in reached) if everywhere else None,
    "seconds": statistics.mean(h[1] for h in reached) if everywhere else None,
    "final": [s[-1]["metric"] for s in seeds],
    "final_seconds": [s[-1]["wall_seconds"] for s in seeds],
  }


def fastest(rows: dict[str, dict[str, Any]], kfac: bool) -> str | None:
  """The K-FAC variant (``kfac``, ``kfac_adamw``) or baseline fastest to target, if any."""
  reached = [k for k, r in rows.items() if is_kfac(k) == kfac and r["seconds"] is not None]
  return min(reached, key=lambda k: rows[k]["seconds"]) if reached else None


def ratios(rows: dict[str, dict[str, Any]]) -> tuple[str, str, float, float] | None:
  """``(K-FAC variant, best baseline, time ratio, step ratio)`` to target; None if undefined.

  Both sides are the fastest to the target in wall-clock: the best K-FAC
  variant against the best baseline. Undefined when either side misses the
  target on a seed or the baseline meets it before training (at step 0).
  """
  kfac, best = fastest(rows, kfac=True), fastest(rows, kfac=False)
  if kfac is None or best is None or rows[best]["steps"] == 0:
    return None
  time_ratio = rows[kfac]["seconds"] / rows[best]["seconds"]
  return kfac, best, time_ratio, rows[kfac]["steps"] / rows[best]["steps"]


def kfac_ratio(rows: dict[str, dict[str, Any]]) -> str:
  """K-FAC's steps and time to target relative to the fastest (by time) baseline."""
  found = ratios(rows)
  if found is None:
    if fastest(rows, kfac=True) is None:
      return "K-FAC did not reach the target on every seed: no ratio."
    if fastest(rows, kfac=False) is None:
      return "No baseline reached the target on every seed: no ratio."
    return "A baseline met the target before training: no ratio."
  kfac, best, time_ratio, step_ratio = found
  change = f"{abs(1 - time_ratio) * 100:.0f}% {'less' if time_ratio <= 1 else 'more'} time"
  return (
    f"K-FAC ({kfac}) time to target / best baseline ({best}): {time_ratio:.2f}x "
    f"({change}); steps: {step_ratio:.2f}x."
  )


def target_cells(row: dict[str, Any]) -> tuple[str, str]:
  """A row's steps and seconds to target as table cells, or "not reached (k/n seeds)"."""
  if row["steps"] is None:
    missing = f"not reached ({row['reached']}/{row['seeds']} seeds)"
    return missing, missing
  return f"{row['steps']:.0f}", f"{row['seconds']:.2f}"


def markdown_table(task: Task, runs: dict[str, list[list[Record]]], source: str) -> str:
  """The comparison as Markdown: one row per optimizer, then K-FAC's ratio."""
  rows = {name: optimizer_row(task, seeds) for name, seeds in runs.items()}
  first = next(iter(runs.values()))
  steps = first[0][-1]["step"]
  seed_list = " ".join(str(s[0]["config"]["seed"]) for s in first)
  direction = ">=" if task.higher_is_better else "<="
  lines = [
    f"# {task.name}: {task.metric_name}, target {direction} {task.target:g}",
    "",
    f"Seeds {seed_list}; {steps} steps, batch {task.batch_size}; settings: {source}. "
    "Steps and seconds to target: first evaluation at the target, mean over seeds "
    "(training wall-clock, compilation and evaluation excluded).",
    "",
    f"| optimizer | settings | steps to target | seconds to target | final {task.metric_name} | training seconds |",
    "|---|---|---|---|---|---|",
  ]
  for name, r in rows.items():
    steps_text, seconds_text = target_cells(r)
    lines.append(
      f"| {name} | {r['settings']} | {steps_text} | {seconds_text} | {mean_std(r['final'])} "
      f"| {mean_std(r['final_seconds'], 1)} |"
    )
  lines += ["", kfac_ratio(rows), ""]
  return "\n".join(lines)


def sweep_table(task: Task, trials: dict[str, list[Record]], steps: int) -> str:
  """The sweep's trials as Markdown, the chosen one in bold per optimizer."""
  lines = [
    f"# {task.name} sweep: final {task.metric_name}, {steps} steps",
    "",
    "| optimizer | settings | final metric | training seconds |",
    "|---|---|---|---|",
  ]
  for name, rows in trials.items():
    for t in rows:
      metric = "diverged" if t["final_metric"] is None else f"{t['final_metric']:.4f}"
      mark = "**" if t["chosen"] else ""
      settings = ", ".join(f"{k} {v:g}" for k, v in t["settings"].items())
      lines.append(f"| {name} | {mark}{settings}{mark} | {metric} | {t['wall_seconds']:.1f} |")
  return "\n".join([*lines, ""])


NAMES = {
  "sgd": "SGD",
  "adam": "Adam",
  "adamw": "AdamW",
  "kfac": "K-FAC",
  "kfac_adamw": "K-FAC + AdamW",
}
FASTER = 0.7  # "at least 30 % less wall-clock than the best baseline"
TARGET_TASKS = ("mnist1d", "autoencoder", "resnet")  # the target counts these


def summarise(results: Sequence[tuple[Task, dict[str, list[list[Record]]]]]) -> dict[str, Any]:
  """Every task's comparison, as the summary that `summary_markdown` renders (JSON-ready).

  ``results`` holds, per task, its runs by optimizer (one record list per seed). Per task: its
  target, each optimizer's `optimizer_row` reduced to what the table shows (``final_mean`` and
  ``final_std`` over the seeds' final metrics, ``final_std`` None for one seed), and the best
  K-FAC variant's ratio to the best baseline (`ratios`; None, with ``no_ratio`` saying why,
  when it is undefined).
  """
  out = []
  for task, runs in results:
    rows = {name: optimizer_row(task, seeds) for name, seeds in runs.items()}
    found = ratios(rows)
    out.append(
      {
        "task": task.name,
        "metric_name": task.metric_name,
        "target": task.target,
        "higher_is_better": task.higher_is_better,
        "optimizers": {
          name: {
            "settings": r["settings"],
            "reached": r["reached"],
            "seeds": r["seeds"],
            "steps": r["steps"],
            "seconds": r["seconds"],
            "final_mean": statistics.mean(r["final"]),
            "final_std": statistics.stdev(r["final"]) if len(r["final"]) > 1 else None,
          }
          for name, r in rows.items()
        },
        "ratio": None
        if found is None
        else dict(zip(("kfac", "baseline", "time", "steps"), found, strict=True)),
        "no_ratio": kfac_ratio(rows).rstrip(".") if found is None else None,
      }
    )
  return {"seeds": len(next(iter(results[0][1].values()))), "tasks": out}


def summary_markdown(summary: dict[str, Any]) -> str:
  """The summary (`summarise`) as one Markdown table, then K-FAC's ratios and the verdict.

  What ``python -m experiments summary`` prints and writes, and the README's results table.
  """
  lines = [
    "| task (target) | optimizer | settings | steps to target | seconds to target | final metric |",
    "|---|---|---|---|---|---|",
  ]
  notes, faster = [], {}
  for task in summary["tasks"]:
    direction = ">=" if task["higher_is_better"] else "<="
    label = f"{task['task']} ({task['metric_name']} {direction} {task['target']:g})"
    for i, (name, r) in enumerate(task["optimizers"].items()):
      steps_text, seconds_text = target_cells(r)
      final = f"{r['final_mean']:.4f}"
      if r["final_std"] is not None:
        final += f" +- {r['final_std']:.4f}"
      lines.append(
        f"| {label if i == 0 else ''} | {NAMES.get(name, name)} | {r['settings']} "
        f"| {steps_text} | {seconds_text} | {final} |"
      )
    found = task["ratio"]
    if found is None:
      notes.append(f"{task['task']}: {task['no_ratio']}")
      faster[task["task"]] = False
    else:
      kfac, best = found["kfac"], found["baseline"]
      notes.append(
        f"{task['task']}: {NAMES.get(kfac, kfac)} {found['time']:.2f}x the time of "
        f"{NAMES.get(best, best)} to the target, {found['steps']:.2f}x the steps"
      )
      faster[task["task"]] = found["time"] <= FASTER
  hits = sum(faster.get(name, False) for name in TARGET_TASKS)
  verdict = "met" if hits >= 2 else "not met"
  return "\n".join(
    [
      *lines,
      "",
      f"Means over {summary['seeds']} seeds. K-FAC's time to target relative to the best "
      "baseline: " + "; ".join(notes) + ".",
      "",
      f"Target (at least 30 % less wall-clock than the best baseline on 2 of "
      f"{', '.join(TARGET_TASKS)}): {verdict}, {hits} of 3.",
    ]
  )
