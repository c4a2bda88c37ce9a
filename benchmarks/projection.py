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
[--allocator kept|default] [--publish]``. ``--publish`` adds the run to
``benchmarks/results/projection.json`` (which keeps the latest `RUNS_KEPT`) and writes the table
(`render`) into ``docs/benchmarks/projection.md`` (its block ``projected step time``,
`benchmarks.generated`). The same page's block ``cluster presets`` (`render_presets`) is written
from the library's presets, `kaisa_jax.cluster.PRESETS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_time import MLP, interleaved_seconds, keep_freed_memory, page_faults

import kaisa_jax
from benchmarks import generated
from experiments import optimizers, tasks
from experiments.train import kfac_grad_fn, make_step
from kaisa_jax import cluster as cluster_lib
from kaisa_jax.analysis import projection

BATCH = 128
SGD = optimizers.Optimizer("sgd", 0.01)
KFAC = optimizers.Optimizer("kfac", 0.01, {"damping": 1e-2})
FACTOR_STEPS, INV_STEPS = 10, 100  # experiments.optimizers' K-FAC cadence (kaisa_jax's defaults)
TOLERANCE = 0.3
RESULTS = "projection.json"  # under benchmarks/results/
RUNS_KEPT = 2  # runs the results file and its table keep
PROVENANCE = (
  f"runs of `python benchmarks/projection.py` with freed memory kept, the latest {RUNS_KEPT} "
  "(`--publish` adds one); each run says where it comes from"
)
LABELS = {
  "mnist1d": "MNIST-1D CNN",
  "resnet": "ResNet with BatchNorm (the task's)",
  "mlp": "MLP 784-512-512-512-10",
}


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
  grad_fn = kfac_grad_fn(task)
  layers = grad_fn.layers(params, state, *batch)
  kfac = kaisa_jax.kfac(layers, lr=KFAC.lr, **optimizers.kfac_arguments(KFAC.kfac))
  _, grads, curvature = grad_fn(params, state, *batch)
  return projection.kfac_work(
    kfac, opt_state.inner_state[0], grads, curvature, FACTOR_STEPS, INV_STEPS
  )


def render(results: dict[str, Any]) -> str:
  """Measured against projected step time, each run's figures side by side (``a, b``)."""
  runs = [r["models"] for r in results["runs"]]
  lines = [
    "| model | SGD measured | SGD projected | ratio | K-FAC measured | K-FAC projected | ratio |",
    "|---|---|---|---|---|---|---|",
  ]
  for model, label in results["labels"].items():
    cells = [label]
    for opt in ("SGD", "K-FAC"):
      at = [r[model][opt] for r in runs if model in r]
      cells += [
        ", ".join(f"{m['measured_ms']:.2f}" for m in at) + " ms",
        ", ".join(f"{m['projected_ms']:.2f}" for m in at) + " ms",
        ", ".join(f"{m['ratio']:.2f}x" for m in at),
      ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def render_presets() -> str:
  """The cluster presets' figures (`kaisa_jax.cluster.PRESETS`) as a table."""
  gb = cluster_lib.GB
  lines = [
    "| preset | FP32 FLOP/s | memory | NVLink (one direction) | InfiniBand per GPU "
    "| devices per node | assumed: collective latency, kernel launch |",
    "|---|---|---|---|---|---|---|",
  ]
  for key, c in cluster_lib.PRESETS.items():
    cells = [
      f"`{key.upper()}`",
      f"{c.flops_per_s / 1e12:g} T",
      f"{c.memory / gb:g} GB, {c.memory_bandwidth / gb:g} GB/s",
      f"{c.intra_node_bandwidth / gb:g} GB/s",
      f"{c.inter_node_bandwidth / gb:g} GB/s ({c.inter_node_bandwidth * 8 / 1e9:g} Gb/s)",
      str(c.devices_per_node),
      f"{c.latency * 1e6:g} us, {c.kernel_overhead * 1e6:g} us",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


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
  parser.add_argument(
    "--publish",
    action="store_true",
    help=f"add the run to benchmarks/results/{RESULTS} and write its table into "
    "docs/benchmarks/projection.md",
  )
  args = parser.parse_args()
  if args.publish and (args.allocator != "kept" or set(args.models) != set(MODELS)):
    parser.error("--publish publishes a run of every model with freed memory kept")
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
  run: dict[str, Any] = {
    "provenance": f"written by `python benchmarks/projection.py --blocks {args.blocks} --publish`",
    "jax": jax.__version__,
    "models": {},
  }
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
      run["models"].setdefault(name, {})[opt] = {
        "measured_ms": 1e3 * measured[opt],
        "projected_ms": 1e3 * projected[opt].total,
        "ratio": ratio,
        "page_faults": faults[opt],
      }
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
  if args.publish:
    committed = generated.load(RESULTS)
    results = committed | {
      "provenance": PROVENANCE,
      "labels": LABELS,
      "runs": [*committed["runs"], run][-RUNS_KEPT:],
    }
    print(render(results))
    for path in generated.publish(RESULTS, results):
      print(f"written: {path}")


if __name__ == "__main__":
  main()
