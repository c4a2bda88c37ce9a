"""Step time of K-FAC+SGD over SGD, against the ratio FLOPs alone imply.

For each model and cadence (factor_update_steps, inv_update_steps) this prints
the step time of SGD (momentum 0.9) and of K-FAC chained with it, their ratio,
the ratio implied by FLOPs alone, and where K-FAC's time goes per phase.

* Step time: a K-FAC step's cost depends on whether it updates factors or
  decompositions, so steps are timed in blocks of 100 (whole cadence cycles) and
  the median block mean is reported. SGD and both cadences take turns block by
  block, so the machine's slow spells hit them alike.
* FLOPs: XLA's cost analysis of each compiled phase (a `lax.cond` is counted as
  if its branch always ran, so the phases are compiled separately and
  amortised: ``plain + factors / factor_update_steps + decomposition /
  inv_update_steps``). XLA does not count LAPACK custom calls; they are added at
  the flop-equivalents of `kaisa_jax.cost` (`kaisa_jax.analysis.projection.lapack_flops`).

Run: ``python benchmarks/step_time.py [--quick] [--publish]``. ``--publish`` writes the
results to ``benchmarks/results/step_time.json`` and the table (`render`) into
``docs/benchmarks/speed.md`` (its block ``step time``, `benchmarks.generated`). The same page's
block ``allocator`` (`render_allocator`) is rendered from ``benchmarks/results/allocator.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import kaisa_jax
from kaisa_jax import distribution, parameters
from kaisa_jax import phases as kfac_phases
from kaisa_jax.analysis import projection

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import generated
from experiments.tasks import MNIST1DCNN

# Ratios measured on this machine (2 CPU cores) for the KAISA reference
# (kfac-pytorch) and kfac-jax, quoted for comparison.
REFERENCE = {
  "mlp": "KAISA reference 6.2x",
  "cnn": "KAISA reference 1.55x",
  "mnist1d": "kfac-jax 8.8-87x",
}
# What the table calls each model.
LABELS = {
  "mlp": "MLP 784-512-512-512-10",
  "cnn": "CNN 32x32x3, conv 32-64-64 + dense",
  "mnist1d": "MNIST-1D CNN, 3 conv1d(32, k5) + dense",
}
RESULTS = "step_time.json"  # under benchmarks/results/
CADENCES = ((1, 10), (10, 100))
BATCH = 128
DAMPING, DECAY = jnp.float32(1e-2), jnp.float32(0.95)
SINGLE = distribution.Collectives("single", 1, 1)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.relu(nn.Dense(512)(x))
    return nn.Dense(10)(x)


class SmallCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    for features in (32, 64, 64):
      x = nn.relu(nn.Conv(features, (3, 3))(x))
      x = nn.avg_pool(x, (2, 2), (2, 2))
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


MODELS = {
  "mlp": (MLP(), (BATCH, 784)),
  "cnn": (SmallCNN(), (BATCH, 32, 32, 3)),
  "mnist1d": (MNIST1DCNN(), (BATCH, 40, 1)),
}


def flops(fn: Callable, *args) -> float:
  cost = projection.cost_of(fn, *args)
  return cost.flops + cost.lapack_flops


def seconds(fn: Callable, *args, repeats: int = 20) -> float:
  """Median seconds of one call of a jitted function."""
  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
  """Has glibc's malloc keep the memory a program frees for the next call; whether it could.

  By default glibc serves a block above its mmap threshold (which grows with
  the blocks freed, up to 32 MB) with fresh pages from the OS and unmaps it
  when freed. XLA's CPU runtime allocates a program's temporaries as one block
  per call, so a step whose temporaries exceed 32 MB takes a page fault on
  each of their 4 KB pages at every call: the MLP's K-FAC step of
  ``benchmarks/projection.py`` (52 MB of temporaries) about 8,800 per step,
  32.8 ms a step against 21 ms with freed memory kept. An accelerator's
  allocator keeps its pool (XLA's BFC allocator on a GPU). With no ``mmap``
  for large blocks and no trimming of the heap, freed blocks are reused. Set
  it before the first large allocation; it stays for the process. Outside
  glibc it does nothing and returns ``False``.
  """
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    return False
  return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def page_faults(fn: Callable, state: tuple, batch, steps: int = 20) -> float:
  """Page faults of this process per call of a step, over ``steps`` calls (state carried)."""
  state = jax.block_until_ready(fn(*state, *batch))
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(steps):
    state = fn(*state, *batch)
  jax.block_until_ready(state)
  return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def interleaved_seconds(steps: dict[str, tuple[Callable, tuple]], batch, block: int, blocks: int):
  """Per step function, the median over ``blocks`` of its mean step time in a block.

  The functions take turns block by block, so a slow spell of the machine
  touches all of them alike and their ratios stay meaningful; the order of the
  turns rotates from block to block, since a function's place in the turn
  shifts its time.
  """
  states = {name: jax.block_until_ready(fn(*state, *batch)) for name, (fn, state) in steps.items()}
  means: dict[str, list[float]] = {name: [] for name in steps}
  names = list(steps)
  for b in range(blocks):
    for name in names[b % len(names) :] + names[: b % len(names)]:
      fn, state = steps[name][0], states[name]
      start = time.perf_counter()
      for _ in range(block):
        state = fn(*state, *batch)
      jax.block_until_ready(state)
      means[name].append((time.perf_counter() - start) / block)
      states[name] = state
  return {name: statistics.median(m) for name, m in means.items()}


def bench_model(name: str, blocks: int) -> dict[str, Any]:
  """Times one model's SGD and K-FAC steps, prints them, and returns its row of the results."""
  model, shape = MODELS[name]
  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, shape)
  y = jax.random.randint(ky, (BATCH,), 0, 10)
  params = model.init(kp, x)

  def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

  sgd = optax.sgd(0.01, momentum=0.9)

  def sgd_step(params, opt_state, x, y):
    _, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = sgd.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  sgd_state = (params, sgd.init(params))
  f_sgd = flops(sgd_step, *sgd_state, x, y)
  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  layers = grad_fn.layers(params, x, y)
  steps = {"sgd": (jax.jit(sgd_step), sgd_state)}
  kfacs = {}
  for cadence in CADENCES:
    kfac = kaisa_jax.kfac(layers, factor_update_steps=cadence[0], inv_update_steps=cadence[1])
    tx = optax.chain(kfac, optax.sgd(0.01, momentum=0.9))

    def kfac_step(params, opt_state, x, y, tx=tx):
      _, grads, curvature = grad_fn(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params, curvature=curvature)
      return optax.apply_updates(params, updates), opt_state

    kfacs[cadence] = kfac
    steps[cadence] = (jax.jit(kfac_step), (params, tx.init(params)))
  # Every cadence divides 100 steps: a block holds whole cadence cycles.
  times = interleaved_seconds(steps, (x, y), 100, blocks)
  t_sgd = times["sgd"]

  # Per-phase costs; they do not depend on the cadence but the plan may.
  print(f"\n== {name}: SGD step {t_sgd * 1e3:.2f} ms, {f_sgd / 1e6:.1f} MFLOP ({REFERENCE[name]})")
  row: dict[str, Any] = {
    "model": name,
    "label": LABELS[name],
    "sgd_ms": t_sgd * 1e3,
    "sgd_mflop": f_sgd / 1e6,
    "cadences": [],
  }
  print(
    f"{'cadence':>9} {'K-FAC ms':>9} {'ratio':>7} {'FLOP ratio':>10} {'measured/FLOP':>13} |"
    f" per phase, ms per call (amortised ms per step): capture, factors, decomposition, preconditioning"
  )
  for factor_steps, inv_steps in CADENCES:
    kfac = kfacs[(factor_steps, inv_steps)]
    t_kfac = times[(factor_steps, inv_steps)]
    kfac_state = steps[(factor_steps, inv_steps)][1]
    plan, state = kfac.plan, kfac_state[1][0]
    _, grads, curvature = grad_fn(params, x, y)
    layer_grads = parameters.layer_params(grads, plan, "updates")

    def capture(params, x, y):
      return grad_fn(params, x, y)

    def plain_grad(params, x, y):
      return jax.value_and_grad(loss_fn)(params, x, y)

    def factors(state, curvature, plan=plan):
      return kfac_phases.update_factors(plan, state, curvature, DECAY, jnp.float32, SINGLE)

    def decomposition(state, plan=plan):
      return kfac_phases.decompose_factors(plan, state, DAMPING, SINGLE)

    def precondition(layer_grads, state, plan=plan):
      return kfac_phases.precondition_grads(
        plan, layer_grads, state.decompositions, DAMPING, jnp.float32, SINGLE, state.stack_offsets
      )

    state = jax.jit(factors)(state, curvature)
    phases = {
      "capture": (
        max(seconds(capture, params, x, y) - seconds(plain_grad, params, x, y), 0.0),
        flops(capture, params, x, y) - flops(plain_grad, params, x, y),
        1,
      ),
      "factors": (
        seconds(factors, state, curvature),
        flops(factors, state, curvature),
        factor_steps,
      ),
      "decomposition": (seconds(decomposition, state), flops(decomposition, state), inv_steps),
      "preconditioning": (
        seconds(precondition, layer_grads, state),
        flops(precondition, layer_grads, state),
        1,
      ),
    }
    f_kfac = f_sgd + sum(f / every for _, f, every in phases.values())
    ratio, f_ratio = t_kfac / t_sgd, f_kfac / f_sgd
    per_phase = ", ".join(
      f"{t * 1e3:.2f} ({t * 1e3 / every:.2f})" for t, _, every in phases.values()
    )
    print(
      f"{f'({factor_steps},{inv_steps})':>9} {t_kfac * 1e3:>9.2f} {ratio:>6.2f}x {f_ratio:>9.2f}x"
      f" {ratio / f_ratio:>13.2f} | {per_phase}"
    )
    row["cadences"].append(
      {
        "cadence": [factor_steps, inv_steps],
        "kfac_ms": t_kfac * 1e3,
        "ratio": ratio,
        "flop_ratio": f_ratio,
        "measured_over_flop": ratio / f_ratio,
        "phases_ms": {k: t * 1e3 for k, (t, _, _) in phases.items()},
      }
    )
  print(kfac.plan)
  return row


def sig3(x: float) -> str:
  """``x`` to three significant digits, trailing zeros kept: 5.80, 125, 0.0123."""
  decimals = max(0, 2 - math.floor(math.log10(abs(x)))) if x else 2
  return f"{x:.{decimals}f}"


def render(results: dict[str, Any]) -> str:
  """The step-time table: SGD's step, and per cadence K-FAC+SGD over SGD against the FLOP ratio.

  The last cadence's ratio is in bold, with its measured ratio over the FLOP ratio.
  """
  cadences = [tuple(c["cadence"]) for c in results["models"][0]["cadences"]]
  last = cadences[-1]
  head = ["model", "SGD step"]
  for f, i in cadences:
    head += [f"K-FAC ({f}, {i})", "FLOP ratio"]
  head.append(f"measured / FLOP at ({last[0]}, {last[1]})")
  lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
  for m in results["models"]:
    cells = [m["label"], f"{sig3(m['sgd_ms'])} ms"]
    for c in m["cadences"]:
      ratio = f"{c['ratio']:.2f}x"
      cells += [f"**{ratio}**" if tuple(c["cadence"]) == last else ratio, f"{c['flop_ratio']:.2f}x"]
    cells.append(f"{m['cadences'][-1]['measured_over_flop']:.2f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def allocator_cell(m: dict[str, Any]) -> str:
  """One measurement of the allocator table: a ratio (with its step time), or times and faults."""
  ms = " and ".join(f"{t:.2f}" for t in m.get("ms", []))
  if "ratio" in m:
    return f"{m['ratio']:.2f}x" + (f" ({ms} ms)" if ms else "")
  faults = m["page_faults"]
  return f"{ms} ms, " + ("none" if faults == 0 else f"{faults:,} page faults per step")


def render_allocator(results: dict[str, Any]) -> str:
  """The allocator table: each step with glibc's default and with freed memory kept."""
  lines = [
    "| step | glibc's default | freed memory kept | command |",
    "|---|---|---|---|",
  ]
  for row in results["rows"]:
    cells = [row["step"], allocator_cell(row["default"]), allocator_cell(row["kept"])]
    lines.append("| " + " | ".join([*cells, row["command"]]) + " |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer timing blocks")
  parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
  parser.add_argument(
    "--publish",
    action="store_true",
    help=f"write benchmarks/results/{RESULTS} and the table in docs/benchmarks/speed.md",
  )
  args = parser.parse_args()
  if args.publish and (args.quick or set(args.models) != set(MODELS)):
    parser.error("--publish publishes a full run: every model, without --quick")
  device = jax.devices()[0].device_kind
  print(f"jax {jax.__version__} on {device}, batch {BATCH}")
  blocks = 3 if args.quick else 7
  rows = [bench_model(name, blocks=blocks) for name in args.models]
  results = {
    "provenance": f"written by `python benchmarks/step_time.py --publish` (jax {jax.__version__})",
    "device": device,
    "jax": jax.__version__,
    "batch": BATCH,
    "blocks": blocks,
    "models": rows,
  }
  print()
  print(render(results))
  if args.publish:
    for path in generated.publish(RESULTS, results):
      print(f"written: {path}")


if __name__ == "__main__":
  main()
