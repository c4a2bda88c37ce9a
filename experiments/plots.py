"""Figures: train loss and the evaluation metric against steps and wall-clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_runs(
  runs: dict[str, list[list[dict[str, Any]]]], metric_name: str, target: float, path: Path
) -> None:
  """One line per optimizer (mean over seeds); a 2x2 grid of loss/metric vs steps/seconds."""
  fig, axes = plt.subplots(2, 2, figsize=(11, 8))
  for name, seeds in runs.items():
    n = min(len(s) for s in seeds)
    steps = [seeds[0][i]["step"] for i in range(n)]
    loss, metric, wall = (
      [sum(s[i][key] for s in seeds) / len(seeds) for i in range(n)]
      for key in ("train_loss", "metric", "wall_seconds")
    )
    axes[0, 0].plot(steps, loss, label=name)
    axes[0, 1].plot(steps, metric, label=name)
    axes[1, 0].plot(wall, loss, label=name)
    axes[1, 1].plot(wall, metric, label=name)
  for ax in axes[0]:
    ax.set_xlabel("step")
  for ax in axes[1]:
    ax.set_xlabel("training wall-clock (s)")
  for ax in axes[:, 0]:
    ax.set_ylabel("train loss")
    ax.set_yscale("log")
  for ax in axes[:, 1]:
    ax.set_ylabel(metric_name)
    ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label=f"target {target}")
    lo = min(line.get_ydata().min() for line in ax.get_lines() if len(line.get_ydata()) > 2)
    ax.set_ylim(max(lo, target - 0.3), None)
  for ax in axes.flat:
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
