"""K-FAC on ResNet-50 and BERT-Base at production shapes on one accelerator, in one command.

For each model at a per-device batch of 32 (`benchmarks.production`), this prints and writes:

* the environment (device kind, JAX, Flax and Optax versions) and the plan's size;
* the seconds to trace and lower, then to compile, the train step of SGD (momentum 0.9) and of
  K-FAC chained with it, and their ratio;
* the step time of SGD, and of K-FAC by phase (`production.phase_seconds`) with the mean step at
  cadence (10, 100), measured over one whole cycle and amortised from the phases, and at (50, 500)
  amortised; each against SGD and against the ratio of their flops (XLA's count of the programs
  compiled for the host's CPU, which holds every convolution and product where a GPU's count
  leaves out its library calls (`_costs`), with the decompositions added at `kaisa_jax.cost`'s
  flop-equivalents, as `kaisa_jax.analysis.projection` counts them);
* the decomposition phase alone: one ``eigh`` and one Cholesky inverse per distinct factor size,
  and each stack of the plan as the step decomposes it (one batched call);
* the step that each cluster preset of `kaisa_jax.cluster` projects for one device
  (`kaisa_jax.analysis.projection.project_step`), and one projected from this device's own
  measured rates (`measure_host`), each against the measured step;
* the losses of the first steps on the fixed batch (they must fall).

Run: ``python benchmarks/gpu_check.py [--out gpu_check.json]`` on the machine with the GPU. It
turns XLA's Triton GEMM fusions off (`TRITON_GEMM`) unless ``XLA_FLAGS`` sets them: on one H200
the whole check then took 243 s, against 548 s with XLA's defaults and without the flop count
(``--no-projection`` skips the count and the projections). ``--tiny`` runs the same code on toy
versions of both models on any machine (the tests run it on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kaisa_jax
from benchmarks import production
from benchmarks.compile_time import compile_seconds
from kaisa_jax import cluster as cluster_lib
from kaisa_jax.analysis import projection

# XLA autotunes each Triton GEMM fusion on a GPU at compile time, one search per product shape.
# On an H200 that made K-FAC's ResNet-50 step compile in 213 s against 17 s with those fusions
# off, at the same step time (docs/benchmarks/production.md). The check turns them off unless
# XLA_FLAGS already sets them.
TRITON_GEMM = "--xla_gpu_enable_triton_gemm"
CADENCES = ((10, 100), (50, 500))  # KAISA's, and one typical of large runs
TINY = {"resnet50": "tiny_resnet", "bert_base": "tiny_bert", "bert_large": "tiny_bert"}


def environment() -> dict[str, Any]:
  """The device and the versions the figures come from."""
  device = jax.devices()[0]
  return {
    "device": f"{device.platform}: {device.device_kind}",
    "devices": jax.device_count(),
    "python": platform.python_version(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    **{name: metadata.version(name) for name in ("jax", "jaxlib", "flax", "optax")},
  }


def default_xla_flags() -> None:
  """Turns XLA's Triton GEMM fusions off (`TRITON_GEMM`) unless XLA_FLAGS sets them either way.

  XLA reads XLA_FLAGS when the first computation starts its backend, so this runs before any.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if TRITON_GEMM not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {TRITON_GEMM}=false".strip()


def say(*args: Any, end: str = "\n") -> None:
  print(*args, end=end, flush=True)


def compile_row(name: str, fn, carry, batch) -> tuple[Any, dict[str, float]]:
  """Compiles ``fn`` as a train step (its carry donated), timing trace and lower, then compile."""
  lower, comp, compiled = compile_seconds(fn, (*carry, batch), donate_argnums=(0, 1, 2))
  say(f"  {name}: trace+lower {lower:.2f} s, compile {comp:.2f} s")
  return compiled, {"lower": lower, "compile": comp}


def flop_ratio(sgd: projection.ProgramCost, work: projection.KFACWork, cadence) -> float:
  """K-FAC+SGD's flops per step at ``cadence`` over SGD's (every phase amortised)."""
  fus, ivs = cadence

  def total(c: projection.ProgramCost) -> float:
    return c.flops + c.lapack_flops

  kfac = (
    total(sgd)
    + total(work.factors) / fus
    + total(work.decompositions) / ivs
    + total(work.preconditioning)
  )
  return kfac / total(sgd)


def _compiled(row: dict[str, Any], s: production.Setup, sgd, kfac) -> tuple[Any, Any]:
  """Compiles both steps, recording their compile times and memory."""
  sgd_compiled, row["sgd_compile"] = compile_row("SGD", *sgd, s.batch)
  kfac_compiled, row["kfac_compile"] = compile_row("K-FAC", *kfac, s.batch)
  row["sgd_memory"] = production.memory_bytes(sgd_compiled)
  row["kfac_memory"] = production.memory_bytes(kfac_compiled)
  say(
    f"  memory of a step (arguments, outputs, temporaries): SGD {row['sgd_memory'] / 2**30:.2f}"
    f" GiB, K-FAC {row['kfac_memory'] / 2**30:.2f} GiB"
  )
  return sgd_compiled, kfac_compiled


def _timed_steps(row, s: production.Setup, sgd, kfac, steps: int) -> float | None:
  """Times SGD's steps and K-FAC's step by step; returns the mean of a whole (10, 100) cycle."""
  sgd_seconds, sgd_losses = production.step_seconds(*sgd, s.batch, 30)
  t_sgd = float(np.median(sgd_seconds[1:]))
  kfac_seconds, losses = production.step_seconds(*kfac, s.batch, steps)
  phases = production.phase_seconds(kfac_seconds, CADENCES[0])
  row |= {"sgd_step": t_sgd, "phases": phases, "losses": losses[:11], "sgd_losses": sgd_losses[:11]}
  by_phase = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in phases.items())
  say(f"  SGD step {1e3 * t_sgd:.2f} ms; K-FAC steps by phase: {by_phase}")
  say(f"  losses, steps 0 and 10: K-FAC {losses[0]:.4f} -> {losses[10]:.4f}", end="")
  say(f"; SGD {sgd_losses[0]:.4f} -> {sgd_losses[10]:.4f}")
  cycle = CADENCES[0][1]
  return float(np.mean(kfac_seconds[1 : cycle + 1])) if steps > cycle else None


def _costs(row, s: production.Setup, kfac, sgd, kfac_step, compiled) -> tuple:
  """Each program's cost as XLA's CPU compiler counts it, K-FAC's phases compiled alone.

  On a GPU, XLA's cost analysis leaves out the convolutions and most matrix products (they run
  as library calls): SGD's step on ResNet-50 counts 8.8e9 of its about 7.9e11 flops. On any
  device the programs are counted as compiled for the host's CPU (`projection.on_host`; on a
  CPU, the programs already compiled).
  """
  start = time.perf_counter()
  # The programs are compiled from shapes: the gradient and curvature need not be computed.
  _, grads, curvature = jax.eval_shape(production.grad_fn(s), s.params, s.state, s.batch)
  (sgd_fn, sgd_carry), (kfac_fn, kfac_carry) = sgd, kfac_step
  if jax.default_backend() == "cpu":
    sgd_cost, kfac_cost = map(projection.program_cost, compiled)
  else:
    sgd_cost = projection.cost_of(sgd_fn, *projection.on_host((*sgd_carry, s.batch)))
    kfac_cost = projection.cost_of(kfac_fn, *projection.on_host((*kfac_carry, s.batch)))
  state = projection.on_host(kfac_carry[2][0])
  work = projection.kfac_work(
    kfac, state, projection.on_host(grads), projection.on_host(curvature), *CADENCES[0]
  )
  say(f"  programs compiled for the CPU's flop count in {time.perf_counter() - start:.1f} s")
  row["flops_counted_on"] = "cpu"
  row["flops"] = {
    name: {"xla": c.flops, "lapack": c.lapack_flops, "bytes": c.bytes, "kernels": c.kernels}
    for name, c in (
      ("sgd", sgd_cost),
      ("kfac_step", kfac_cost),
      ("factors", work.factors),
      ("decompositions", work.decompositions),
      ("preconditioning", work.preconditioning),
    )
  }
  return sgd_cost, kfac_cost, work


def _cadences(row, measured: float | None, sgd_cost, work) -> None:
  """K-FAC's mean step at each cadence, over SGD's, and the flop ratio where counted."""
  row["cadences"] = []
  for cadence in CADENCES:
    t = production.amortised(row["phases"], cadence)
    entry: dict[str, Any] = {"cadence": list(cadence), "kfac_step": t, "ratio": t / row["sgd_step"]}
    if work is not None:
      entry["flop_ratio"] = flop_ratio(sgd_cost, work, cadence)
    if cadence == CADENCES[0] and measured is not None:
      entry |= {"measured_cycle": measured, "measured_ratio": measured / row["sgd_step"]}
    row["cadences"].append(entry)
    say(
      f"  cadence {cadence}: K-FAC {1e3 * t:.2f} ms ({entry['ratio']:.2f}x SGD)"
      + (f", flop ratio {entry['flop_ratio']:.2f}x" if "flop_ratio" in entry else "")
      + (f"; whole cycle measured {1e3 * measured:.2f} ms" if "measured_cycle" in entry else "")
    )


def _decompositions(row, kfac: kaisa_jax.KFAC, repeats: int) -> None:
  """Each factor size decomposed alone, each stack as the step does, the spread over 8."""
  sizes = production.factor_sizes(kfac)
  row["decompositions"] = production.decomposition_seconds(sizes, repeats=repeats)
  for d in row["decompositions"]:
    say(
      f"  size {d['size']:>6}: eigh {1e3 * d['eigen']:9.2f} ms, inverse {1e3 * d['inverse']:9.2f} ms"
    )
  row["batched_seconds"] = production.batch_seconds(kfac, repeats=repeats)
  total = sum(r["seconds"] for r in row["batched_seconds"])
  say(f"  every factor decomposed once, one batched call per size: {total:.2f} s in all")
  row["spread_8"] = production.spread(kfac, 8)


def check_model(
  name: str,
  batch: int,
  steps: int,
  repeats: int,
  project: bool = True,
  save: Callable[[dict[str, Any]], None] = lambda row: None,
) -> dict[str, Any]:
  """Every figure of the module docstring for one model; prints them as they come.

  ``save`` is called with the row so far after each stage, so that a run stopped midway (a
  device lent for a fixed time) keeps what it measured.
  """
  start = time.perf_counter()
  s = production.setup(name, batch)
  say(f"\n== {s.shape.label}, batch {batch} (set up in {time.perf_counter() - start:.1f} s)")
  sgd_fn, sgd_carry = production.sgd_step(s)
  kfac_fn, kfac_carry, kfac = production.kfac_step(s, CADENCES[0])
  plan = kfac.plan
  row: dict[str, Any] = {
    "model": name,
    "label": s.shape.label,
    "batch": batch,
    "layers": len(plan.layers),
    "treatments": sorted({str(t) for _, t in plan.layers}),
    "stacks": len(plan.layout.all_stacks()),
    "plan": str(plan),
  }
  say(f"  plan: {row['layers']} layers, {row['stacks']} stacks, treatments {row['treatments']}")
  sgd_c, kfac_c = _compiled(row, s, (sgd_fn, sgd_carry), (kfac_fn, kfac_carry))
  save(row)
  measured = _timed_steps(row, s, (sgd_c, sgd_carry), (kfac_c, kfac_carry), steps)
  save(row)
  programs = ((sgd_fn, sgd_carry), (kfac_fn, kfac_carry))
  costs = _costs(row, s, kfac, *programs, (sgd_c, kfac_c)) if project else (None,) * 3
  _cadences(row, measured, costs[0], costs[2])
  save(row)
  _decompositions(row, kfac, repeats)
  save(row)
  if project:
    row["projections"] = projections(*costs, row["sgd_step"], row["cadences"][0]["kfac_step"])
  return row


def projections(sgd_cost, kfac_cost, work, t_sgd: float, t_kfac: float) -> list:
  """One device's projected SGD and K-FAC (10, 100) steps per cluster, against the measured."""
  clusters = [*cluster_lib.PRESETS.values(), projection.measure_host("measured here")]
  rows = []
  for c in clusters:
    sgd = projection.project_step(sgd_cost, c).total
    kfac = projection.project_step(kfac_cost, c, kfac=work).total
    row = {"cluster": c.name, "sgd": sgd, "kfac": kfac}
    row |= {"sgd_error": sgd / t_sgd - 1, "kfac_error": kfac / t_kfac - 1}
    rows.append(row)
    say(
      f"  PROJECTED on {c.name}: SGD {1e3 * sgd:.2f} ms ({100 * row['sgd_error']:+.0f} % of "
      f"measured), K-FAC {1e3 * kfac:.2f} ms ({100 * row['kfac_error']:+.0f} %)"
    )
  return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", nargs="+", default=["resnet50", "bert_base"])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--steps", type=int, default=101, help="K-FAC steps timed (101: a cycle)")
  parser.add_argument("--repeats", type=int, default=2, help="timed calls per decomposition")
  parser.add_argument("--tiny", action="store_true", help="toy models, batch 4: the CPU path")
  parser.add_argument("--no-projection", action="store_true", help="skip the flop count")
  parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
  args = parser.parse_args(argv)
  models = [TINY.get(m, m) for m in args.models] if args.tiny else args.models
  batch = 4 if args.tiny else args.batch
  results: dict[str, Any] = {"environment": environment(), "models": {}, "failed": {}}
  say(results["environment"])

  def save(name: str, row: dict[str, Any]) -> None:
    """Writes a model's figures so far, apart from the finished ones (`render` reads those)."""
    if args.out is not None:
      partial = {**results, "unfinished": {name: row}}
      args.out.write_text(json.dumps(partial, indent=1))

  for name in models:
    try:
      results["models"][name] = check_model(
        name,
        batch,
        args.steps,
        args.repeats,
        not args.no_projection,
        save=lambda row, name=name: save(name, row),
      )
    except Exception:  # one model's failure must not lose the other's figures
      results["failed"][name] = traceback.format_exc()
      say(results["failed"][name])
    if args.out is not None:
      args.out.write_text(json.dumps(results, indent=1))
  peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  if peak:
    results["environment"]["peak_bytes_in_use"] = peak
    say(f"peak device memory in use: {peak / 2**30:.2f} GiB")
  if args.out is not None:
    args.out.write_text(json.dumps(results, indent=1))
  return results


def _ms(seconds: float | None) -> str:
  return "" if seconds is None else f"{1e3 * seconds:.1f}"


def _steps_table(models: dict[str, Any]) -> list[str]:
  lines = [
    "| model | compile: SGD, K-FAC (ratio) | SGD step | K-FAC steps: preconditioning only, "
    "+ factors, + decomposition | K-FAC (10, 100) | K-FAC (50, 500) | flop ratio (10, 100), "
    "(50, 500) | memory of a step: SGD, K-FAC | loss at steps 0, 10 (K-FAC; SGD) |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in models.values():
    sgd_c, kfac_c = (r[k]["lower"] + r[k]["compile"] for k in ("sgd_compile", "kfac_compile"))
    p = r["phases"]
    cells = []
    for c in r["cadences"]:
      text = f"{_ms(c['kfac_step'])} ms ({c['kfac_step'] / r['sgd_step']:.2f}x)"
      if "measured_cycle" in c:
        text += f"; a whole cycle measured: {_ms(c['measured_cycle'])} ms"
      cells.append(text)
    flop = ", ".join(f"{c['flop_ratio']:.2f}x" for c in r["cadences"] if "flop_ratio" in c)
    lines.append(
      f"| {r['label']}, batch {r['batch']}, {r['layers']} layers | {sgd_c:.1f} s, {kfac_c:.1f} s "
      f"({kfac_c / sgd_c:.1f}x) | {_ms(r['sgd_step'])} ms | {_ms(p['plain'])}, "
      f"{_ms(p.get('factors'))}, {_ms(p['decomposition'])} ms | {cells[0]} | {cells[1]} | "
      f"{flop or 'not run'} | {r['sgd_memory'] / 2**30:.2f}, {r['kfac_memory'] / 2**30:.2f} GiB | "
      f"{r['losses'][0]:.3f}, {r['losses'][10]:.3f}; {r['sgd_losses'][0]:.3f}, "
      f"{r['sgd_losses'][10]:.3f} |"
    )
  return lines


def _decomposition_table(models: dict[str, Any]) -> list[str]:
  lines = [
    "| model | factor size | `eigh` | Cholesky inverse | busiest of 8 devices' share of the "
    "decompositions |",
    "|---|---|---|---|---|",
  ]
  for r in models.values():
    share = max(s["decomposition_share"] for s in r["spread_8"])
    # Results from before the step batched its decompositions by size give one call per stack.
    batched = "batched_seconds" in r
    calls = sum(s["seconds"] for s in r["batched_seconds" if batched else "stacks_seconds"])
    how = "every factor size of the plan, one batched call each"
    if not batched:
      how = "every stack of the plan, one batched call per side"
    for i, d in enumerate(r["decompositions"]):
      first = i == 0
      lines.append(
        f"| {r['label'] if first else ''} | {d['size']} | {_ms(d['eigen'])} ms | "
        f"{_ms(d['inverse'])} ms | {f'{100 * share:.0f} %' if first else ''} |"
      )
    lines.append(f"| | {how} | {1e3 * calls:.0f} ms in all | | |")
  return lines


def comparable(cluster: str, kind: str) -> bool:
  """Whether a projection on ``cluster`` can be checked on a device of ``kind``.

  The rates measured on the device itself always can; a preset on its own GPU, and the H100's
  on an H200: the same chip at the same FP32 peak, with faster memory (4.8 TB/s against 3.35),
  so that the preset projects an H200's memory-bound work up to 1.4x too slow.
  """
  own = any(gpu in cluster and gpu in kind for gpu, _ in cluster_lib.KINDS)
  return cluster.startswith("measured here") or own or ("H100" in cluster and "H200" in kind)


def _projection_table(models: dict[str, Any], kind: str) -> list[str]:
  lines = [
    "| model | cluster (PROJECTED for one device) | SGD step | K-FAC (10, 100) step |",
    "|---|---|---|---|",
  ]
  for r in models.values():
    for p in r.get("projections", []):
      if not comparable(p["cluster"], kind):
        continue
      lines.append(
        f"| {r['label']} | {p['cluster']} | {_ms(p['sgd'])} ms ({100 * p['sgd_error']:+.0f} %) "
        f"| {_ms(p['kfac'])} ms ({100 * p['kfac_error']:+.0f} %) |"
      )
  return lines


def render(results: dict[str, Any]) -> str:
  """The check's tables: steps and compile, decompositions by size, projections against measured."""
  env = results["environment"]
  flags = f", XLA_FLAGS={env['xla_flags']}" if env.get("xla_flags") else ""
  head = (
    f"Measured on {env['device']} ({env['devices']} device), Python {env['python']}, JAX "
    f"{env['jax']}, Flax {env['flax']}, Optax {env['optax']}{flags}. "
    f"{results.get('provenance', '')}"
  )
  parts = [head.strip(), "", *_steps_table(results["models"]), ""]
  parts += [*_decomposition_table(results["models"]), ""]
  projected = _projection_table(results["models"], env["device"])
  if len(projected) > 2:
    parts += ["Projected against measured (the error in brackets):", "", *projected]
  return "\n".join(parts).rstrip()


if __name__ == "__main__":
  default_xla_flags()
  main()
