"""Validation of the projected step time (`kaisa_jax.analysis.projection`) against this machine.

This machine is described by `kaisa_jax.analysis.projection.measure_host`; each
model's SGD and K-FAC steps (factors every 10 steps, decompositions every 100,
batch 128) are compiled for one device, projected from XLA's cost analysis, and
timed: SGD, K-FAC and the host's probes (`kaisa_jax.analysis.projection.host_probes`:
dense layers 16 to 1024 wide, a stream, chains of tiny kernels) take turns in
blocks of 100 calls (whole cadence cycles), the median block mean is reported,
and the projection uses the rates the probes gave in those same turns. The
projection must land within 30 % of the measured time.

The process keeps the memory its programs free (`step_time.keep_freed_memory`)
unless ``--allocator default``: glibc's default unmaps blocks above 32 MB, so
a step whose temporaries exceed that (the MLP's K-FAC step) takes a page fault
per 4 KB of them at every call, which is neither compute nor memory traffic
and which a GPU's allocator, keeping its pool, does not do. The page faults
per step are printed either way.

Run: ``python benchmarks/projection.py [--blocks 5] [--models mnist1d resnet mlp]
[--allocator kept|default]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_time import MLP, interleaved_seconds, keep_freed_memory, page_faults

import kaisa_jax
from experiments import optimizers, tasks
from experiments.train import make_step
from kaisa_jax import cluster as cluster_lib
from kaisa_jax.analysis import projection

BATCH = 128
SGD = optimizers.Optimizer("sgd", 0.01)
KFAC = optimizers.Optimizer("kfac", 0.01, {"damping": 1e-2})
FACTOR_STEPS, INV_STEPS = 10, 100  # experiments.optimizers' K-FAC cadence (kaisa_jax's defaults)
TOLERANCE = 0.3


def mlp_task() -> tasks.Task:
  """The step-time benchmark's MLP (3 x 512 ReLU) on random 784-pixel inputs."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(1024, 784)).astype(np.float32)
  y = rng.integers(0, 10, 1024).astype(np.int32)
  return tasks.Task(
    name="mlp",
    model=MLP(),
    train=(x, y),
    test=(x[:128], y[:128]),
    loss_fn=tasks.cross_entropy,
    metric_fn=tasks.accuracy,
    metric_name="accuracy",
    target=1.0,
    higher_is_better=True,
    batch_size=BATCH,
    steps=1000,
    sweep_steps=1000,
  )


MODELS = {"mnist1d": tasks.mnist1d, "resnet": tasks.resnet, "mlp": mlp_task}


def built(task: tasks.Task, opt: optimizers.Optimizer):
  """``(step, carry, compiled)`` of one optimizer's train step on the first batch."""
  x, y = (jnp.asarray(a[:BATCH]) for a in task.train)
  params, state = task.init(jax.random.key(0), x[:1])
  tx, step = make_step(task, opt, 1000, params, state)
  carry = (params, state, tx.init(params))
  compiled = step.lower(*carry, x, y).compile()
  return step, carry, compiled, (x, y)


def carried(step):
  """The step without its loss: ``(params, state, opt_state)``, as `interleaved_seconds` carries."""
  return lambda *args: step(*args)[:3]


def probed(probe: projection.Probe):
  """A host probe as `interleaved_seconds` calls a step: its carry is its last result."""
  return lambda *_: (probe.fn(*probe.args),)


def temporaries(compiled) -> float:
  """Bytes of temporaries XLA allocates at every call of a compiled program."""
  return float(compiled.memory_analysis().temp_size_in_bytes)


def kfac_work(task: tasks.Task, carry, batch) -> projection.KFACWork:
  """K-FAC's phases for the task, compiled alone (same layers and settings as the step)."""
  params, state, opt_state = carry
  grad_fn = kaisa_jax.value_and_grad(task.loss, has_aux=True, n_examples=task.n_examples())
  layers = grad_fn.layers(params, state, *batch)
  kfac = kaisa_jax.kfac(layers, lr=KFAC.lr, **optimizers.kfac_arguments(KFAC.kfac))
  _, grads, curvature = grad_fn(params, state, *batch)
  return projection.kfac_work(
    kfac, opt_state.inner_state[0], grads, curvature, FACTOR_STEPS, INV_STEPS
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--blocks", type=int, default=5, help="timed blocks of 100 steps")
  parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  parser.add_argument(
    "--allocator",
    choices=("kept", "default"),
    default="kept",
    help="kept: freed memory is reused (step_time.keep_freed_memory), as a GPU's allocator "
    "does; default: glibc's, which unmaps blocks above 32 MB and faults them in at every call",
  )
  args = parser.parse_args()
  kept = args.allocator == "kept" and keep_freed_memory()
  host = projection.measure_host()
  probes = projection.host_probes()
  print(
    f"jax {jax.__version__}; {host.name}: {host.flops_per_s / 1e9:.1f} GFLOP/s, "
    f"{host.memory_bandwidth / 1e9:.1f} GB/s, {1e6 * host.kernel_overhead:.2f} us per kernel "
    f"({host.source}); batch {BATCH}, K-FAC "
    f"cadence ({FACTOR_STEPS}, {INV_STEPS}); allocator: "
    + ("freed memory kept" if kept else "the C library's default")
  )
  print(
    f"{'model':<8} {'optimizer':<9} {'GFLOP':>7} {'MB':>7} {'kernels':>7} {'measured ms':>11} "
    f"{'projected ms':>12} {'projected/measured':>18} {'faults/step':>11} {'temp MB':>7}"
  )
  try:  # the data-sheet preset of this device, where there is one (A100, H100)
    preset = cluster_lib.cluster_of(jax.devices()[0])
  except ValueError:
    preset = None
  if preset is not None:
    print(f"also projected with the preset {preset.name} ({preset.source})")
  worst = 0.0
  for name in args.models:
    task = dataclasses.replace(MODELS[name](), batch_size=BATCH)
    sgd_step, sgd_carry, sgd_compiled, batch = built(task, SGD)
    kfac_step, kfac_carry, kfac_compiled, _ = built(task, KFAC)
    work = kfac_work(task, kfac_carry, batch)
    # The host's rates are timed in the same turns as the steps: the machine's
    # speed drifts by tens of percent over a minute, which a rate measured once
    # at start would carry into every ratio.
    measured = interleaved_seconds(
      {
        "SGD": (carried(sgd_step), sgd_carry),
        "K-FAC": (carried(kfac_step), kfac_carry),
        **{k: (probed(p), (p.fn(*p.args),)) for k, p in probes.items()},
      },
      batch,
      100,
      args.blocks,
    )
    host = dataclasses.replace(host, **projection.host_rates(probes, measured))
    print(
      f"{name}: the host in the same turns: {host.flops_per_s / 1e9:.1f} GFLOP/s, "
      f"{host.memory_bandwidth / 1e9:.1f} GB/s, {1e6 * host.kernel_overhead:.2f} us per kernel; "
      "dense probes at W = "
      + ", ".join(
        f"{w}: {r / 1e9:.0f}" for w, r in zip(cluster_lib.MATMUL_WIDTHS, host.matmul_rates)
      )
      + " GFLOP/s"
    )
    compiled = {"SGD": sgd_compiled, "K-FAC": kfac_compiled}
    costs = {opt: projection.program_cost(c) for opt, c in compiled.items()}
    projected = {
      "SGD": projection.project_step(costs["SGD"], host),
      "K-FAC": projection.project_step(costs["K-FAC"], host, kfac=work),
    }
    faults = {
      "SGD": page_faults(carried(sgd_step), sgd_carry, batch),
      "K-FAC": page_faults(carried(kfac_step), kfac_carry, batch),
    }
    for opt, c in costs.items():
      ratio = projected[opt].total / measured[opt]
      worst = max(worst, abs(ratio - 1.0))
      extra = ""
      if preset is not None:
        kfac = work if opt == "K-FAC" else None
        on_preset = projection.project_step(c, preset, kfac=kfac).total
        extra = f"   preset {1e3 * on_preset:.3f} ms ({on_preset / measured[opt]:.2f}x)"
      print(
        f"{name:<8} {opt:<9} {(c.flops + c.lapack_flops) / 1e9:>7.3f} {c.bytes / 1e6:>7.1f}"
        f" {c.kernels:>7.0f} {1e3 * measured[opt]:>11.2f} {1e3 * projected[opt].total:>12.2f}"
        f" {ratio:>17.2f}x {faults[opt]:>11.0f} {temporaries(compiled[opt]) / 1e6:>7.1f}{extra}"
      )
  verdict = "within" if worst <= TOLERANCE else "NOT within"
  print(f"largest deviation {100 * worst:.0f}%: {verdict} the {100 * TOLERANCE:.0f}% target")


if __name__ == "__main__":
  main()
