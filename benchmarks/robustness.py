"""Robustness: K-FAC against each model's tuned first-order optimizer, over damping and its form.

For every problem of `experiments.suite` (eight models, five of which no
other experiment or test tunes anything on):

1. its first-order optimizer alone (SGD with momentum 0.9, or AdamW) over a
   grid of learning rates, extended by one point past whichever end wins,
   until an inner point wins (at most `MAX_EXTENSIONS` times); the tuned rate
   is the one with the lowest final loss averaged over the seeds;
2. K-FAC chained with that optimizer at the tuned rate, every other argument
   at its default, for each damping form (``"relative"``, ``"pi"``,
   ``"kaisa"``) and each damping in `DAMPINGS`, from the same seeds.

The final loss of a run is the mean training loss of its last
`experiments.suite.TAIL` steps
(minibatch losses, dropout included). Every run starts from the seed's
initialisation and visits the seed's batches in the same order. A run whose
loss becomes non-finite counts as diverged (an infinite final loss).

The runs of one problem and optimizer are one compiled program
(``jax.lax.scan`` over the steps, learning rate and damping as arguments), so
the grid costs one compilation per problem and form.

Results go to ``benchmarks/results/robustness.json`` (every run's final loss);
``--table`` prints the tables from that file without training:

* final loss relative to the tuned baseline (mean over seeds of K-FAC's
  final loss, divided by the baseline's mean), per problem, form and damping;
* per form, how far the damping range is from the best damping (largest ratio
  of a damping's final loss to the best damping's, per problem);

and ``--figure PATH`` draws them.

Run: ``python benchmarks/robustness.py [--problems vit gru ...] [--seeds 3]``
(about an hour on 2 CPU cores for the whole suite); ``python
benchmarks/robustness.py --table``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kaisa_jax
from experiments import suite

RESULTS = Path(__file__).parent / "results" / "robustness.json"
STEPS = 300
DAMPINGS = (1e-4, 1e-3, 1e-2, 1e-1)
FORMS = ("relative", "pi", "kaisa")
LEARNING_RATES = {"sgd": (0.01, 0.03, 0.1, 0.3), "adamw": (3e-4, 1e-3, 3e-3, 1e-2)}
MAX_EXTENSIONS = 3


def curvature_summary(stats: kaisa_jax.CurvatureStatistics) -> dict[str, float]:
  """The extremes over layers of the relative damping and the condition number."""
  relative = [float(s.relative_damping) for s in stats.layers.values()]
  condition = [float(s.condition) for s in stats.layers.values()]
  return {
    "min_relative_damping": min(relative),
    "max_relative_damping": max(relative),
    "max_condition": max(condition),
  }


def train_seeds(
  run, problem: suite.Problem, seeds: int, lr: float, damping: float | None
) -> tuple[list[float], list[dict[str, float]]]:
  """Final losses over the seeds, and for K-FAC the curvature after each run's last step."""
  losses, curvature = [], []
  for seed in range(seeds):
    params, state = problem.init(jax.random.key(seed))
    order = suite.batch_order(len(problem.train[0]), problem.batch_size, STEPS, seed)
    damp = None if damping is None else jnp.float32(damping)
    per_step, stats = run(params, state, order, jnp.float32(lr), damp)
    losses.append(suite.final_loss(np.asarray(per_step)))
    if stats is not None:
      curvature.append(curvature_summary(stats))
  return losses, curvature


def mean(values: list[float]) -> float:
  return float(np.mean(values)) if all(map(math.isfinite, values)) else math.inf


def tune_baseline(problem: suite.Problem, seeds: int, log) -> dict[str, list[float]]:
  """Final losses per learning rate; the grid grows past a winning end."""
  run = suite.make_run(problem, None)
  grid = list(LEARNING_RATES[problem.optimizer])
  results: dict[str, list[float]] = {}
  for _ in range(MAX_EXTENSIONS + 1):
    for lr in grid:
      if repr(lr) not in results:
        results[repr(lr)] = train_seeds(run, problem, seeds, lr, None)[0]
        log(f"  {problem.optimizer} lr={lr:g}: {mean(results[repr(lr)]):.4g}")
    best = min(grid, key=lambda lr: mean(results[repr(lr)]))
    if best == grid[0]:
      grid.insert(0, float(f"{grid[0] / 3:.3g}"))
    elif best == grid[-1]:
      grid.append(float(f"{grid[-1] * 3:.3g}"))
    else:
      break
  return results


def run_problem(name: str, seeds: int, log) -> dict[str, Any]:
  problem = suite.SUITE[name]()
  start = time.perf_counter()
  baseline = tune_baseline(problem, seeds, log)
  lr = min(baseline, key=lambda k: mean(baseline[k]))
  log(f"  tuned {problem.optimizer} lr={lr}: {mean(baseline[lr]):.4g}")
  kfac: dict[str, dict[str, list[float]]] = {}
  curvature: dict[str, dict[str, list[dict[str, float]]]] = {}
  for form in FORMS:
    run = suite.make_run(problem, {"damping_form": form})
    kfac[form], curvature[form] = {}, {}
    for damping in DAMPINGS:
      key = repr(damping)
      kfac[form][key], curvature[form][key] = train_seeds(run, problem, seeds, float(lr), damping)
      log(f"  kfac {form} damping={damping:g}: {mean(kfac[form][key]):.4g}")
  return {
    "optimizer": problem.optimizer,
    "lr": float(lr),
    "baseline": baseline,
    "kfac": kfac,
    "curvature": curvature,
    "seconds": time.perf_counter() - start,
  }


def load(path: Path) -> dict[str, Any]:
  return json.loads(path.read_text()) if path.exists() else {"problems": {}}


def relative_table(results: dict[str, Any]) -> str:
  """Final loss over the tuned baseline's, per problem (rows) and form x damping (columns)."""
  problems = results["problems"]
  head = [f"{f} {d:g}" for f in FORMS for d in DAMPINGS]
  lines = [
    "| model | baseline | " + " | ".join(head) + " |",
    "|---|---|" + "---|" * len(head),
  ]
  for name, r in problems.items():
    base = mean(r["baseline"][repr(r["lr"])])
    cells = [f"{mean(r['kfac'][f][repr(d)]) / base:.2f}" for f in FORMS for d in DAMPINGS]
    lines.append(
      f"| {name} | {r['optimizer']} {r['lr']:g}: {base:.3g} | " + " | ".join(cells) + " |"
    )
  return "\n".join(lines)


def spread_table(results: dict[str, Any]) -> str:
  """Per form and problem: the worst damping's final loss over the best damping's."""
  problems = results["problems"]
  lines = [
    "| form | " + " | ".join(problems) + " | worst |",
    "|---|" + "---|" * (len(problems) + 1),
  ]
  for form in FORMS:
    ratios = []
    for r in problems.values():
      finals = [mean(r["kfac"][form][repr(d)]) for d in DAMPINGS]
      ratios.append(max(finals) / min(finals))
    cells = [f"{x:.2f}" for x in ratios]
    lines.append(f"| {form} | " + " | ".join(cells) + f" | {max(ratios):.2f} |")
  return "\n".join(lines)


def figure(results: dict[str, Any], path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  problems = results["problems"]
  cols = 4
  rows = -(-len(problems) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
  for ax, (name, r) in zip(axes.flat, problems.items(), strict=False):
    base = mean(r["baseline"][repr(r["lr"])])
    for form in FORMS:
      ax.plot(DAMPINGS, [mean(r["kfac"][form][repr(d)]) / base for d in DAMPINGS], "o-", label=form)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set(xscale="log", yscale="log", title=name, xlabel="damping")
  for ax in axes.flat[len(problems) :]:
    ax.axis("off")
  axes[0, 0].set_ylabel("final loss / tuned baseline")
  axes[0, 0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--problems", nargs="+", choices=sorted(suite.SUITE), default=list(suite.SUITE)
  )
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--table", action="store_true", help="print the tables of the saved results")
  parser.add_argument("--figure", type=Path, help="draw the saved results into this file")
  parser.add_argument(
    "--out", type=Path, default=RESULTS, help="the results file (read, then updated)"
  )
  args = parser.parse_args(argv)
  if args.seeds < 1:
    parser.error("--seeds must be at least 1")
  results = load(args.out)
  if not (args.table or args.figure):
    for name in args.problems:
      print(name, flush=True)
      results["problems"][name] = run_problem(name, args.seeds, lambda s: print(s, flush=True))
      results |= {"steps": STEPS, "tail": suite.TAIL, "seeds": args.seeds, "jax": jax.__version__}
      args.out.parent.mkdir(parents=True, exist_ok=True)
      args.out.write_text(json.dumps(results, indent=1) + "\n")
  print(relative_table(results))
  print()
  print(spread_table(results))
  if args.figure:
    figure(results, args.figure)


if __name__ == "__main__":
  main()
