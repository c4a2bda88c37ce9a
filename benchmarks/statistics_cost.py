"""What `kaisa_jax.curvature_statistics` costs against the train step, on the MNIST-1D CNN.

With the experiments' K-FAC settings (``python -m experiments``' defaults:
factors every 10 steps, decompositions every 100) and, for comparison, the
same with ``compute_method="inverse"`` (whose statistics run one ``eigvalsh``
per dense factor), this times on the task's batches:

* ``step``: the jitted train step alone;
* ``step + statistics``: the same step returning the statistics of its new
  state as metrics, computed at every step (the most a step can pay);
* ``statistics``: one jitted call on a state, as a logging step makes it;
* ``statistics outside jit``: one call on the concrete state a step
  returned, as a logging loop makes it (which also runs `check_damping`).

Steps are timed in turns of 20, the variants alternating, after 100 warm-up
steps; each figure is the median over turns of the mean time per call.

Run: ``python benchmarks/statistics_cost.py [--turns 30]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kaisa_jax
from experiments import optimizers, tasks
from experiments.train import batches, kfac_layers, make_step

TURN = 20  # calls per variant before the next takes its turn
WARMUP = 100


def timings(compute_method: str | None, turns: int) -> dict[str, float]:
  """Median seconds per call of the step, the step with statistics, and the statistics."""
  task = tasks.mnist1d()
  opt = optimizers.DEFAULTS["kfac"]
  if compute_method is not None:
    opt = dataclasses.replace(opt, kfac={**opt.kfac, "compute_method": compute_method})
  x, y = (jnp.asarray(a) for a in task.train)
  params, state = task.init(jax.random.key(0), x[:1])
  layers = kfac_layers(task, params, state)
  tx, step = make_step(task, opt, 10**6, params, state, layers)
  kfac = optimizers.kfac_transform(opt, 10**6, layers)
  print(kfac.plan)
  stats_fn = jax.jit(partial(kaisa_jax.curvature_statistics, kfac))

  @jax.jit
  def step_with_statistics(params, state, opt_state, xb, yb):
    params, state, opt_state, loss = step(params, state, opt_state, xb, yb)
    return params, state, opt_state, loss, kaisa_jax.curvature_statistics(kfac, opt_state)

  opt_state = tx.init(params)
  index = batches(len(x), task.batch_size, 0)
  carry = (params, state, opt_state)
  for _ in range(WARMUP):
    i = next(index)
    carry = step(*carry, x[i], y[i])[:3]
  jax.block_until_ready(carry)
  jax.block_until_ready(step_with_statistics(*carry, x[i], y[i]))
  jax.block_until_ready(stats_fn(carry[2]))
  jax.block_until_ready(kaisa_jax.curvature_statistics(kfac, carry[2]))

  def run_step(carry, i):
    return step(*carry, x[i], y[i])[:3]

  def run_both(carry, i):
    return step_with_statistics(*carry, x[i], y[i])[:3]

  def run_stats(carry, i):
    jax.block_until_ready(stats_fn(carry[2]))
    return carry

  def run_outside(carry, i):
    jax.block_until_ready(kaisa_jax.curvature_statistics(kfac, carry[2]))
    return carry

  variants = {
    "step": run_step,
    "step + statistics": run_both,
    "statistics": run_stats,
    "outside jit": run_outside,
  }
  means: dict[str, list[float]] = {name: [] for name in variants}
  for _ in range(turns):
    for name, fn in variants.items():
      start = time.perf_counter()
      for _ in range(TURN):
        carry = jax.block_until_ready(fn(carry, next(index)))
      means[name].append((time.perf_counter() - start) / TURN)
  return {name: statistics.median(v) for name, v in means.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--turns", type=int, default=30, help="turns of each variant")
  args = parser.parse_args()
  print(f"{jax.devices()[0].device_kind}, {jax.device_count()} device(s)")
  rows = []
  for method in (None, "inverse"):
    t = timings(method, args.turns)
    rows.append((method or "default (eigen)", t))
  print(
    "\n| K-FAC | step (ms) | step + statistics (ms) | statistics alone (ms) | added per step "
    "| statistics outside jit (ms) |"
  )
  print("|---|---|---|---|---|---|")
  for method, t in rows:
    added = t["step + statistics"] / t["step"] - 1
    print(
      f"| {method} | {1e3 * t['step']:.3f} | {1e3 * t['step + statistics']:.3f} "
      f"| {1e3 * t['statistics']:.3f} | {100 * added:+.1f} % | {1e3 * t['outside jit']:.3f} |"
    )


if __name__ == "__main__":
  main()
