"""K-FAC's cost per step on the experiment tasks, and the time to target it allows.

For each task, with the settings ``python -m experiments compare`` uses (the
task's ``best.json``, else the defaults), this times on the task's own batches:

* each baseline's step (``sgd``, ``adamw``) and each K-FAC variant's step
  (``kfac``, ``kfac_adamw``) at its cadence (factors every 10 steps,
  decompositions every 100);
* each K-FAC variant with its factor updates switched off after the first
  step ("free statistics"): what a K-FAC step would cost if its curvature
  statistics cost nothing, a lower bound on its step time. Decompositions keep
  their cadence, which also fixes each layer's treatment (`kaisa_jax.cost`
  amortises the decompositions over it).

Steps are timed in blocks of 100 (whole cadence cycles). Within a block the
variants take turns every 10 steps, so that the machine's slow spells touch all
of them; each variant's step time is the median of its block means, its ratio
to the fastest baseline the median over blocks of the ratio within a block.

With a task's ``compare`` results present (``OUT/TASK/*-seedS.jsonl``) it also
reads the steps to target of the fastest baseline and K-FAC variant there, and
prints the time ratio they imply: ``(K-FAC steps / baseline steps) x (K-FAC step
time / baseline step time)``, with the measured step time and with the lower
bound. A bound above 0.70 means that no cheaper way of computing the curvature
statistics could make K-FAC reach the target in 30 % less wall-clock than the
baseline at this batch size and step count.

Run: ``python benchmarks/task_step_time.py [--tasks mnist1d resnet autoencoder]``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments import optimizers, report, tasks
from experiments.__main__ import read_runs
from experiments.train import batches, make_step

NAMES = ("sgd", "adamw", "kfac", "kfac_adamw")
BLOCK = 100  # steps per timed block: whole cadence cycles
CHUNK = 10  # steps a variant runs before the next takes its turn
NEVER = 10**9  # a cadence no run reaches: factors only at the first step


def step_times(
  task: tasks.Task, variants: dict[str, optimizers.Optimizer], blocks: int
) -> dict[str, list[float]]:
  """Each variant's mean step time in each of ``blocks`` blocks of `BLOCK` steps.

  Within a block the variants take turns every `CHUNK` steps, so that they share
  the machine's slow spells even when its speed drifts within seconds. The order
  of the turns rotates from chunk to chunk: a variant's place in the turn shifts
  its time (by 3-7 % measured on the ResNet task), so no variant keeps one place.
  """
  x, y = (jnp.asarray(a) for a in task.train)
  params, state = task.init(jax.random.key(0), x[:1])
  index = batches(len(x), task.batch_size, seed=0)
  data = [(x[i], y[i]) for i in (next(index) for _ in range(BLOCK))]
  runs = {}
  for name, opt in variants.items():
    tx, step = make_step(task, opt, blocks * BLOCK + 1, params, state)
    carry = jax.block_until_ready(step(params, state, tx.init(params), *data[0])[:3])
    runs[name] = [step, carry]
  names = list(runs)
  means: dict[str, list[float]] = {name: [] for name in variants}
  turns = itertools.count()
  for _ in range(blocks):
    spent = dict.fromkeys(variants, 0.0)
    for first in range(0, BLOCK, CHUNK):
      k = next(turns) % len(names)
      for name in names[k:] + names[:k]:
        step, carry = run = runs[name]
        start = time.perf_counter()
        for xb, yb in data[first : first + CHUNK]:
          *carry, _ = step(*carry, xb, yb)
        jax.block_until_ready(carry)
        spent[name] += time.perf_counter() - start
        run[1] = carry
    for name in variants:
      means[name].append(spent[name] / BLOCK)
  return means


def ratio(times: dict[str, list[float]], name: str, base: str) -> float:
  """Median over blocks of ``name``'s step time over ``base``'s in the same block."""
  return statistics.median(t / b for t, b in zip(times[name], times[base], strict=True))


def bench_task(name: str, out: Path, seeds: list[int], blocks: int) -> None:
  task = tasks.TASKS[name]()
  best = optimizers.load_best(out / name / "best.json")
  variants = {n: optimizers.choose(n, best)[0] for n in NAMES}
  for n in NAMES:
    if optimizers.is_kfac(n):
      opt = variants[n]
      off = {"factor_update_steps": NEVER}
      variants[f"{n} (free statistics)"] = optimizers.Optimizer(opt.name, opt.lr, opt.kfac | off)
  times = step_times(task, variants, blocks)
  base = min((n for n in NAMES if not optimizers.is_kfac(n)), key=lambda n: min(times[n]))
  print(f"\n== {name}: batch {task.batch_size}, {blocks} blocks of {BLOCK} steps")
  for n, t in times.items():
    print(
      f"{n:<30} {statistics.median(t) * 1e3:8.2f} ms  {ratio(times, n, base):5.2f}x {base}"
      f"  (blocks: {' '.join(f'{v * 1e3:.1f}' for v in t)})"
    )

  ran = [n for n in NAMES if all((out / name / f"{n}-seed{s}.jsonl").exists() for s in seeds)]
  if not ran:
    print(f"(no compare results in {out / name} for seeds {seeds}: no time ratio)")
    return
  rows = {
    n: report.optimizer_row(task, runs) for n, runs in read_runs(out / name, ran, seeds).items()
  }
  found = report.ratios(rows)
  if found is None:
    print(report.kfac_ratio(rows))
    return
  kfac, baseline, time_ratio, step_ratio = found
  per_step = ratio(times, kfac, baseline)
  floor = ratio(times, f"{kfac} (free statistics)", baseline)
  print(
    f"compare results (seeds {' '.join(map(str, seeds))}): {kfac} reaches the target in "
    f"{step_ratio:.2f}x the steps of {baseline}, measured time ratio {time_ratio:.2f}x.\n"
    f"Implied by the step times above: {step_ratio:.2f} x {per_step:.2f} = "
    f"{step_ratio * per_step:.2f}x; with free curvature statistics: {step_ratio:.2f} x "
    f"{floor:.2f} = {step_ratio * floor:.2f}x."
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tasks", nargs="+", default=["mnist1d", "resnet", "autoencoder"])
  parser.add_argument("--out", type=Path, default=Path("results"))
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--blocks", type=int, default=5)
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
  for name in args.tasks:
    bench_task(name, args.out, args.seeds, args.blocks)


if __name__ == "__main__":
  main()
