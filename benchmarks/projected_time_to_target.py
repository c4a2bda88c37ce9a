"""Projected time to target on N data-parallel devices: measured steps x projected seconds per step.

For each task of the scaling study's summary (``benchmarks/results/scaling.json``,
written by ``python -m experiments scale-summary --publish``), each optimizer and
each global batch ``B`` of the study where every seed reached the target, and
``N = 1, 2, 4, ..., 64`` devices (per-device batch ``b = B / N``)::

  time to target (N, B) = steps to target at B      (measured on this CPU; steps do not depend on hardware)
                        x seconds per step (N, b)    (PROJECTED: kaisa_jax.analysis.projection, per preset cluster)

The step is compiled for one device at the per-device batch; K-FAC's layers
are weighed at the global batch (as `kaisa_jax.kfac` on ``N`` devices weighs
them, so each layer gets the treatment it would get there), its phases are
amortised by its cadence (factors every 10 steps, decompositions every 100) and
its grad worker fraction is the one `kaisa_jax.plan_fractions` recommends for
``N`` on that cluster. A step's XLA costs are linear in the per-device batch:
each (optimizer, ``B``) is compiled at ``b = B`` and ``b = B / 64`` and
interpolated (a third compile checks it). Per ``N`` the table gives each
optimizer's fastest ``B``. Nothing here ran on the clusters named. A task whose
study is in progress (batches of its protocol not run yet) is not projected.

Run: ``python benchmarks/projected_time_to_target.py [--tasks TASK ...]
[--scaling FILE] [--publish]``; prints the tables (`render`). ``--publish`` writes the
projections to ``benchmarks/results/projected_time_to_target.json``, the tables into
``docs/benchmarks/projection.md`` (its block ``projected time to target``,
`benchmarks.generated`) and the figures to ``docs/figures/projected-TASK.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kaisa_jax
from benchmarks import generated, gpu_check
from experiments import optimizers, scale, tasks
from experiments.report import NAMES
from experiments.train import kfac_grad_fn, make_step
from kaisa_jax.analysis import projection

DEVICES = (1, 2, 4, 8, 16, 32, 64)
PRESETS = (kaisa_jax.DGX_A100, kaisa_jax.DGX_H100)
FACTOR_STEPS, INV_STEPS = 10, 100  # experiments.optimizers' K-FAC cadence
RESULTS = "projected_time_to_target.json"  # under benchmarks/results/
SCALING = generated.RESULTS / "scaling.json"
FIGURES = generated.ROOT / "docs" / "figures"


def weighed_at(layers: kaisa_jax.Layers, n: int) -> kaisa_jax.Layers:
  """The layers with the rows of ``n`` devices' batches: what the cost rule weighs on ``n`` devices."""
  specs = tuple(dataclasses.replace(s, rows=s.rows * n) for s in layers.specs)
  return kaisa_jax.Layers(specs, layers.skipped)


@dataclasses.dataclass(frozen=True)
class Costs:
  """One optimizer's per-device costs at one per-device batch."""

  step: projection.ProgramCost
  work: projection.KFACWork | None
  gradient_bytes: float


def costs(task: tasks.Task, name: str, settings: dict[str, Any], b: int, n: int) -> Costs:
  """Compiles ``name``'s step for one device at per-device batch ``b`` of an ``n``-device run."""
  at_b = dataclasses.replace(task, batch_size=b)
  x, y = (jnp.asarray(a[:b]) for a in task.train)
  params, state = task.init(jax.random.key(0), x[:1])
  gradient_bytes = 4.0 * sum(p.size for p in jax.tree.leaves(params))
  opt = optimizers.from_settings(name, settings)
  layers = work = None
  if optimizers.is_kfac(name):
    grad_fn = kfac_grad_fn(at_b)
    layers = weighed_at(grad_fn.layers(params, state, x, y), n)
  tx, step = make_step(at_b, opt, 1000, params, state, layers)
  opt_state = tx.init(params)
  step_cost = projection.program_cost(step.lower(params, state, opt_state, x, y).compile())
  if layers is not None:
    kfac = kaisa_jax.kfac(layers, lr=opt.lr, **optimizers.kfac_arguments(opt.kfac))
    _, grads, curvature = grad_fn(params, state, x, y)
    kfac_state = opt_state.inner_state[0]
    work = projection.kfac_work(kfac, kfac_state, grads, curvature, FACTOR_STEPS, INV_STEPS)
  return Costs(step_cost, work, gradient_bytes)


def interpolate(lo: projection.ProgramCost, hi: projection.ProgramCost, t: float):
  return lo + (hi + lo.scaled(-1.0)).scaled(t)


def between(lo: Costs, hi: Costs, b_lo: int, b_hi: int, b: int) -> Costs:
  """``Costs`` at batch ``b``, linear between ``b_lo`` and ``b_hi``."""
  t = 0.0 if b_hi == b_lo else (b - b_lo) / (b_hi - b_lo)
  work = None
  if lo.work is not None:
    work = dataclasses.replace(
      hi.work,
      factors=interpolate(lo.work.factors, hi.work.factors, t),
      decompositions=interpolate(lo.work.decompositions, hi.work.decompositions, t),
      preconditioning=interpolate(lo.work.preconditioning, hi.work.preconditioning, t),
    )
  return Costs(interpolate(lo.step, hi.step, t), work, hi.gradient_bytes)


def local_layers(task: tasks.Task, b: int) -> kaisa_jax.Layers:
  """The task's layers traced at per-device batch ``b`` (abstractly: nothing is computed)."""
  at_b = dataclasses.replace(task, batch_size=b)
  x, y = (jnp.asarray(a[:b]) for a in task.train)
  params, state = task.init(jax.random.key(0), x[:1])
  return kfac_grad_fn(at_b).layers(params, state, x, y)


def seconds_per_step(c: Costs, cluster: kaisa_jax.Cluster, n: int, layers: kaisa_jax.Layers):
  """Projected seconds per step on ``n`` devices, and K-FAC's fraction (``layers`` per device)."""
  if c.work is None:
    t = projection.project_step(c.step, cluster, n, gradient_bytes=c.gradient_bytes)
    return t.total, None
  plan = kaisa_jax.plan_fractions(
    layers, n, cluster, factor_update_steps=FACTOR_STEPS, inv_update_steps=INV_STEPS
  )
  t = projection.project_step(
    c.step,
    cluster,
    n,
    gradient_bytes=c.gradient_bytes,
    kfac=c.work,
    grad_worker_fraction=plan.recommended,
  )
  return t.total, plan.recommended


def flat(cost: projection.ProgramCost) -> list[float]:
  """A cost's figures as one list, its matrix products' flops summed over their sizes.

  The sizes are not compared one by one: a product moves between them as the batch grows.
  """
  return [sum(f) if isinstance(f, tuple) else f for f in cost]


def project_task(task_name: str, lines: list[dict[str, Any]]) -> dict[str, Any]:
  """Per preset, N and optimizer: the fastest projected time to target over the study's batches."""
  task = tasks.TASKS[task_name]()
  names = list(dict.fromkeys(line["optimizer"] for line in lines))
  reached = [line for line in lines if line["mean_steps_to_target"] is not None]
  out: dict[str, Any] = {p.name: {str(n): {} for n in DEVICES} for p in PRESETS}
  check = None
  for line in reached:
    name, big = line["optimizer"], line["batch"]
    small = big // DEVICES[-1]
    lo = costs(task, name, line["chosen"], small, DEVICES[-1])
    hi = costs(task, name, line["chosen"], big, 1)
    if check is None and big // 8 not in (small, big):  # linearity, once per task
      mid = costs(task, name, line["chosen"], big // 8, 8)
      guess = between(lo, hi, small, big, big // 8).step
      check = max(
        abs(g - m) / max(m, 1.0) for g, m in zip(flat(guess), flat(mid.step), strict=True)
      )
    for n in (n for n in DEVICES if big % n == 0):
      b = big // n
      c = between(lo, hi, small, big, b)
      layers = local_layers(task, b) if c.work is not None else None
      for preset in PRESETS:
        seconds, fraction = seconds_per_step(c, preset, n, layers)
        total = line["mean_steps_to_target"] * seconds
        best = out[preset.name][str(n)].get(name)
        if best is None or total < best["seconds"]:
          out[preset.name][str(n)][name] = {
            "seconds": total,
            "batch": big,
            "steps": line["mean_steps_to_target"],
            "fraction": None if fraction is None else str(fraction),
          }
  return {
    "task": task_name,
    "names": names,
    "best": out,
    "ratios": {p: {n: best_ratio(row) for n, row in rows.items()} for p, rows in out.items()},
    "linearity": check,
  }


def best_ratio(row: dict[str, Any]) -> float | None:
  """The best K-FAC variant's seconds to target over the best baseline's (None: one missed)."""
  base = [r["seconds"] for name, r in row.items() if not optimizers.is_kfac(name)]
  kfac = [r["seconds"] for name, r in row.items() if optimizers.is_kfac(name)]
  return min(kfac) / min(base) if base and kfac else None


CHECK = "gpu_check.json"  # under benchmarks/results/: projected against measured on a GPU


def measured_errors(check: dict[str, Any], presets: list[str]) -> dict[str, float | None]:
  """Per preset, the largest error of its projected steps against those measured on its GPU.

  From ``benchmarks/gpu_check.py``'s results (SGD's and K-FAC's steps of each model, one device);
  None for a preset whose GPU has not been measured.
  """
  device = check["environment"]["device"]
  errors: dict[str, float | None] = {}
  for preset in presets:
    found = [
      abs(row[key])
      for model in check["models"].values()
      for row in model.get("projections", [])
      if row["cluster"] == preset and gpu_check.comparable(preset, device)
      for key in ("sgd_error", "kfac_error")
    ]
    errors[preset] = max(found) if found else None
  return errors


def established(ratio: float | None, error: float | None) -> str:
  """Whether K-FAC's projected advantage (``1 - ratio``) exceeds the projection's measured error."""
  if ratio is None:
    return "n/a"
  if ratio >= 1.0:
    return "no advantage"
  if error is None:
    return "not established (preset never measured)"
  return (
    "yes"
    if 1.0 - ratio > error
    else f"not established ({100 * (1 - ratio):.0f} % < {100 * error:.0f} %)"
  )


def error_text(preset: str, error: float | None) -> str:
  if error is None:
    return (
      f"No projection on {preset.split(' (')[0]} has been checked against a measured step, so "
      "no advantage projected on it is established."
    )
  return (
    f"Measured error of this preset's projection: up to {100 * error:.0f} % "
    "(`benchmarks/gpu_check.py` on a GPU of its chip, [production shapes](production.md)); an "
    "advantage smaller than that is not established."
  )


def table(result: dict[str, Any], presets: list[str], errors: dict[str, float | None]) -> str:
  """One task's projections as Markdown: per preset, each optimizer's best time per N."""
  names = result["names"]
  lines = []
  for preset in presets:
    lines += [
      f"**{result['task']}, PROJECTED on {preset}** (seconds to target = measured steps x "
      "projected seconds per step; best global batch B per N)",
      "",
      error_text(preset, errors.get(preset)),
      "",
      "| N | "
      + " | ".join(NAMES.get(n, n) for n in names)
      + " | best K-FAC / best baseline | advantage established |",
      "|---" * (len(names) + 3) + "|",
    ]
    for n, row in result["best"][preset].items():
      cells = []
      for name in names:
        r = row.get(name)
        if r is None:
          cells.append("missed")
          continue
        f = f", f={r['fraction']}" if r["fraction"] else ""
        cells.append(f"{r['seconds']:.3g} s (B={r['batch']}{f})")
      ratio = result["ratios"][preset][n]
      ratio_text = "n/a" if ratio is None else f"{ratio:.2f}x"
      verdict = established(ratio, errors.get(preset))
      lines.append(f"| {n} | " + " | ".join(cells) + f" | {ratio_text} | {verdict} |")
    lines.append("")
  linearity = result["linearity"] or 0
  lines.append(
    "Linear interpolation in the per-device batch checked at B/8: largest relative error "
    f"{linearity:.1e}."
  )
  return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
  """Every task's tables (what the script prints, and the block ``projected time to target``).

  Each preset's measured error comes from the committed `CHECK` results.
  """
  errors = measured_errors(generated.load(CHECK), results["presets"])
  return "\n\n".join(table(result, results["presets"], errors) for result in results["tasks"])


def figure(result: dict[str, Any], presets: list[str], path: Path) -> None:
  fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
  for ax, preset in zip(axes[0], presets, strict=True):
    for name in result["names"]:
      best = result["best"][preset]
      ns = [int(n) for n in best if name in best[n]]
      ts = [best[str(n)][name]["seconds"] for n in ns]
      ax.plot(ns, ts, marker="o", label=NAMES.get(name, name))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices N")
    ax.set_ylabel("PROJECTED seconds to target")
    ax.set_title(f"{result['task']}: {preset.split(' (')[0]} (projection)")
    ax.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--tasks", nargs="+", help="the tasks to project (default: every task of the summary)"
  )
  parser.add_argument(
    "--scaling",
    type=Path,
    default=SCALING,
    help="the scaling study's summary (python -m experiments scale-summary writes one)",
  )
  parser.add_argument(
    "--publish",
    action="store_true",
    help=f"write benchmarks/results/{RESULTS}, its block in the docs and the figures",
  )
  args = parser.parse_args()
  scaling = json.loads(args.scaling.read_text())  # summary lines per task (experiments.scale)
  args.tasks = args.tasks or list(scaling["tasks"])
  results: dict[str, Any] = {
    "provenance": "written by `python benchmarks/projected_time_to_target.py --tasks "
    f"{' '.join(args.tasks)} --publish` from {args.scaling.name}, jax {jax.__version__}",
    "presets": [p.name for p in PRESETS],
    "tasks": [],
  }
  errors = measured_errors(generated.load(CHECK), results["presets"])
  for name in args.tasks:
    lines = scaling["tasks"].get(name, [])
    if not lines:
      print(
        f"{name}: no scaling results in {args.scaling}; run python -m experiments scale-summary"
      )
      continue
    if left := scale.unrun_of(scaling, name):
      print(
        f"{name}: its study is in progress ({scale.batches_text(left)} not run yet): "
        "not projected, since a device count's fastest batch may be among them"
      )
      continue
    result = project_task(name, lines)
    print(table(result, results["presets"], errors) + "\n")
    results["tasks"].append(result)
  if args.publish and results["tasks"]:
    for path in generated.publish(RESULTS, results):
      print(f"written: {path}")
    for result in results["tasks"]:
      figure(result, results["presets"], FIGURES / f"projected-{result['task']}.png")


if __name__ == "__main__":
  main()
