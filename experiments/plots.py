"""Figures: train loss and the evaluation metric against steps and wall-clock; K-FAC's curvature."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from experiments.files import atomic_open
from kaisa_jax import statistics


def _save(fig: Any, path: Path) -> None:
  """Writes ``fig`` to ``path`` (its format from the suffix) atomically, then closes it."""
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  try:
    with atomic_open(path, "wb") as f:
      fig.savefig(f, format=path.suffix.lstrip(".") or "png", dpi=110)
  finally:
    plt.close(fig)


def curves(
  seeds: list[list[dict[str, Any]]], key: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Mean, minimum and maximum over seeds of ``key`` at each evaluation they share."""
  n = min(len(s) for s in seeds)
  values = np.array([[s[i][key] for i in range(n)] for s in seeds])
  return values.mean(0), values.min(0), values.max(0)


def plot_runs(
  runs: dict[str, list[list[dict[str, Any]]]],
  metric_name: str,
  target: float,
  path: Path,
  higher_is_better: bool = True,
) -> None:
  """A 2x2 grid, loss and metric against steps (top) and training wall-clock (bottom).

  One line per optimizer: the mean over seeds, with a band from the lowest to
  the highest seed when there are several. A metric where lower is better (an error)
  is drawn on a log scale.
  """
  fig, axes = plt.subplots(2, 2, figsize=(11, 8))
  for name, seeds in runs.items():
    n = min(len(s) for s in seeds)
    steps = np.array([seeds[0][i]["step"] for i in range(n)])
    wall = curves(seeds, "wall_seconds")[0]
    for col, key in enumerate(("train_loss", "metric")):
      mean, lo, hi = curves(seeds, key)
      for row, x in enumerate((steps, wall)):
        (line,) = axes[row, col].plot(x, mean, label=name)
        if len(seeds) > 1:
          axes[row, col].fill_between(x, lo, hi, color=line.get_color(), alpha=0.2)
  for ax in axes[0]:
    ax.set_xlabel("step")
  for ax in axes[1]:
    ax.set_xlabel("training wall-clock (s)")
  for ax in axes[:, 0]:
    ax.set_ylabel("train loss")
    ax.set_yscale("log")
  for ax in axes[:, 1]:
    ax.set_ylabel(metric_name)
    ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label=f"target {target:g}")
    if higher_is_better:
      lines = [ln.get_ydata() for ln in ax.get_lines() if len(ln.get_ydata()) > 2]
      lo = min((y.min() for y in lines), default=target)
      ax.set_ylim(max(lo, target - 0.3), None)
    else:
      ax.set_yscale("log")
  for ax in axes.flat:
    ax.grid(alpha=0.3)
    ax.legend()
  _save(fig, path)


def worst_layer(seeds: list[list[dict[str, Any]]]) -> str | None:
  """The layer whose condition number is largest at the last evaluation (mean over seeds).

  None unless every seed's records hold K-FAC's ``curvature`` statistics.
  """
  last = [s[-1].get("curvature") for s in seeds]
  if not all(last):
    return None

  def condition(name: str) -> float:
    values = [c["layers"][name]["condition"] for c in last]
    return float(np.mean([np.nan if v is None else v for v in values]))

  names = [n for n in last[0]["layers"] if np.isfinite(condition(n))]
  return max(names, key=condition, default=None)


def layer_curves(
  seeds: list[list[dict[str, Any]]], layer: str, key: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Mean, minimum and maximum over seeds of one layer's curvature ``key`` (NaN where None)."""
  n = min(len(s) for s in seeds)
  values = np.array(
    [[s[i]["curvature"]["layers"][layer][key] for i in range(n)] for s in seeds], dtype=float
  )
  return values.mean(0), values.min(0), values.max(0)


def plot_curvature(runs: dict[str, list[list[dict[str, Any]]]], path: Path) -> bool:
  """K-FAC's worst-conditioned layer: its condition number and relative damping against steps.

  One line per K-FAC optimizer (the layer with the largest condition number at
  the last evaluation, `worst_layer`), mean over seeds with a band from the
  lowest to the highest seed. Dashed lines: the relative damping below which
  the damping is negligible and above which it drowns the curvature
  (`kaisa_jax.check_damping`'s thresholds). Writes ``path`` and returns True
  when some run has curvature statistics; otherwise writes nothing and returns
  False.
  """
  chosen = {name: worst_layer(seeds) for name, seeds in runs.items()}
  chosen = {name: layer for name, layer in chosen.items() if layer is not None}
  if not chosen:
    return False
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for name, layer in chosen.items():
    seeds = runs[name]
    n = min(len(s) for s in seeds)
    steps = np.array([seeds[0][i]["step"] for i in range(n)])
    for ax, key in zip(axes, ("condition", "relative_damping"), strict=True):
      mean, lo, hi = layer_curves(seeds, layer, key)
      (line,) = ax.plot(steps, mean, label=f"{name}: {layer}")
      if len(seeds) > 1:
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
  axes[0].set_ylabel("condition number of damped A (x) G")
  axes[1].set_ylabel("relative damping")
  thresholds = {"negligible below": statistics.NEGLIGIBLE_DAMPING}
  thresholds["drowns above"] = statistics.DROWNING_DAMPING
  for text, value in thresholds.items():
    axes[1].axhline(value, color="gray", linestyle="--", linewidth=0.8, label=f"{text} {value:g}")
  for ax in axes:
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
  fig.suptitle(
    "K-FAC's worst-conditioned layer at the last evaluation; relative damping: "
    "damping / (mean eig A x mean eig G)",
    fontsize="medium",
  )
  _save(fig, path)
  return True
