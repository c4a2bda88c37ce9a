"""Compile time of K-FAC's train step against SGD's, as the model deepens.

For a stack of ``Dense(128)`` layers (8 to 128 of them, batch 64) and for the
character transformer with its blocks unrolled (no ``nn.scan``; 4, 8 and 16
blocks), this prints, for SGD (momentum 0.9) and K-FAC chained with it at
cadence (10, 100):

* the seconds to trace and lower the jitted train step, and to compile it
  (``jax.jit(step).trace(...).lower()`` then ``.compile()``), each timed once
  on a cold cache;
* the step time (median over blocks of 100 steps, SGD and K-FAC taking turns
  block by block), and K-FAC's ratio to SGD for each figure;
* how many preconditioned layers the plan has and in how many stacks of equal
  shapes its decompositions run.

Cold single measurements in one process move by 10 to 20 % between runs, so
``--fresh N`` then also compiles the 128-layer stack's two steps in ``N`` fresh
processes (SGD then K-FAC in each, nothing compiled before) and prints each
pair, the median ratio with its quartiles, and the ratio of the median times.
``--fresh N --model resnet50`` (or ``bert_base``, ``bert_large``) does only that, for a
production-shaped model of `benchmarks.production` at batch 2 (its steps, carry donated).

Run: ``python benchmarks/compile_time.py [--quick] [--fresh N [--model M]] [--publish]``. ``--publish``
writes the results to ``benchmarks/results/compile_time.json`` (keeping each model's figures from
before stacks) and the table (`render`) into ``docs/benchmarks/compile_time.md`` (its block
``compile time``, `benchmarks.generated`); the same file's ``stacks_step_time`` gives the page's
block ``stacks step time`` (`render_step_comparison`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import kaisa_jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import generated, production
from benchmarks.step_time import interleaved_seconds
from experiments.tasks import CHARS, TransformerBlock

BATCH = 64
WIDTH = 128
CADENCE = (10, 100)
RESULTS = "compile_time.json"  # under benchmarks/results/
PRODUCTION_BATCH = 2  # for --model: the batch of the production pages' CPU compile times
LABELS = {"dense": "{depth} x Dense(128)", "transformer": "transformer, {depth} blocks"}


class DenseStack(nn.Module):
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.relu(nn.Dense(WIDTH)(x))
    return nn.Dense(10)(x)


class UnrolledTransformer(nn.Module):
  """`experiments.tasks.CharTransformer` with its blocks as separate layers."""

  depth: int
  vocab: int = len(CHARS) + 1
  length: int = 32
  width: int = 48
  heads: int = 4

  @nn.compact
  def __call__(self, ids):
    tokens = nn.Embed(self.vocab, self.width)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)
    h = tokens(ids) + nn.Embed(self.length, self.width)(positions)
    for _ in range(self.depth):
      h, _ = TransformerBlock(self.heads)(h, None)
    return tokens.attend(nn.LayerNorm()(h))


def dense_problem(depth: int):
  kx, ky = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (BATCH, WIDTH))
  y = jax.random.randint(ky, (BATCH,), 0, 10)
  return DenseStack(depth), x, y


def transformer_problem(depth: int):
  model = UnrolledTransformer(depth)
  ids = jax.random.randint(jax.random.key(0), (BATCH, model.length + 1), 0, model.vocab)
  return model, ids[:, :-1], ids[:, 1:]


def steps(model: nn.Module, x, y):
  """The jitted SGD and K-FAC train steps, with their initial states and K-FAC's plan."""
  params = model.init(jax.random.key(1), x)

  def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

  sgd = optax.sgd(0.01, momentum=0.9)

  def sgd_step(params, opt_state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = sgd.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  with warnings.catch_warnings():  # LayerNorms pass through, as in the transformer task
    warnings.simplefilter("ignore")
    kfac = kaisa_jax.kfac(
      grad_fn.layers(params, x, y),
      factor_update_steps=CADENCE[0],
      inv_update_steps=CADENCE[1],
    )
  tx = optax.chain(kfac, optax.sgd(0.01, momentum=0.9))

  def kfac_step(params, opt_state, x, y):
    _, grads, curvature = grad_fn(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, curvature=curvature)
    return optax.apply_updates(params, updates), opt_state

  return {
    "sgd": (sgd_step, (params, sgd.init(params))),
    "kfac": (kfac_step, (params, tx.init(params))),
  }, kfac.plan


def compile_seconds(fn, args, donate_argnums: tuple[int, ...] = ()) -> tuple[float, float, object]:
  """Seconds to trace and lower ``jax.jit(fn)`` on ``args``, seconds to compile, the executable."""
  start = time.perf_counter()
  lowered = jax.jit(fn, donate_argnums=donate_argnums).trace(*args).lower()
  middle = time.perf_counter()
  compiled = lowered.compile()
  return middle - start, time.perf_counter() - middle, compiled


def bench(label: str, depth: int, problem, blocks: int) -> dict[str, Any]:
  """Compiles and times one model's two steps, prints them, and returns its row of the results."""
  model, x, y = problem(depth)
  fns, plan = steps(model, x, y)
  times, compiled = {}, {}
  for name, (fn, state) in fns.items():
    lower, comp, compiled[name] = compile_seconds(fn, (*state, x, y))
    times[name] = (lower, comp)
  step = interleaved_seconds(
    {name: (compiled[name], state) for name, (_, state) in fns.items()}, (x, y), 100, blocks
  )
  (sl, sc), (kl, kc) = times["sgd"], times["kfac"]
  stacks = len(plan.layout.all_stacks())
  print(
    f"{label:<12} {depth:>5} {len(plan.layers):>6} {stacks:>6} | {sl:>6.2f} {sc:>7.2f}"
    f" {sl + sc:>7.2f} | {kl:>6.2f} {kc:>7.2f} {kl + kc:>7.2f} | {(kl + kc) / (sl + sc):>6.1f}x"
    f" | {step['sgd'] * 1e3:>8.2f} {step['kfac'] * 1e3:>8.2f} {step['kfac'] / step['sgd']:>6.2f}x",
    flush=True,
  )
  return {
    "model": LABELS[label].format(depth=depth),
    "layers": len(plan.layers),
    "stacks": stacks,
    "sgd_seconds": sl + sc,
    "kfac_seconds": kl + kc,
    "ratio": (kl + kc) / (sl + sc),
    "step_ratio": step["kfac"] / step["sgd"],
    "sgd_lower_compile": [sl, sc],
    "kfac_lower_compile": [kl, kc],
    "step_ms": {"sgd": step["sgd"] * 1e3, "kfac": step["kfac"] * 1e3},
  }


def render(results: dict[str, Any]) -> str:
  """The compile-time table: seconds to trace, lower and compile each step, before stacks and now.

  The columns before stacks are shown where a model has them (``before``).
  """
  lines = [
    "| model | layers | stacks | SGD s | K-FAC s before stacks | ratio before | K-FAC s now "
    "| ratio now | step ratio now |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for m in results["models"]:
    before = m.get("before")
    was = [f"{before['kfac_seconds']:.2f}", f"{before['ratio']:.1f}x"] if before else ["", ""]
    cells = [
      m["model"],
      str(m["layers"]),
      str(m["stacks"]),
      f"{m['sgd_seconds']:.2f}",
      *was,
      f"{m['kfac_seconds']:.2f}",
      f"**{m['ratio']:.1f}x**",
      f"{m['step_ratio']:.2f}x",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def render_step_comparison(results: dict[str, Any]) -> str:
  """K-FAC+SGD over SGD per process, before stacks and now (``stacks_step_time``).

  "Now" is in bold where every process now is below every process before.
  """

  def cell(m: dict[str, Any], bold: bool) -> str:
    text = ", ".join(f"{r:.2f}x" for r in m["ratios"])
    text = f"**{text}**" if bold else text
    if "kfac_ms" in m:
      text += " (" + ", ".join(f"{t:.1f}" for t in m["kfac_ms"]) + " ms)"
    return text

  lines = ["| model | before stacks | now |", "|---|---|---|"]
  for row in results["stacks_step_time"]["rows"]:
    faster = max(row["now"]["ratios"]) < min(row["before"]["ratios"])
    lines.append(f"| {row['model']} | {cell(row['before'], False)} | {cell(row['now'], faster)} |")
  return "\n".join(lines)


def cold_pair(model: str) -> tuple[float, float]:
  """Seconds to trace, lower and compile SGD's then K-FAC's step, nothing compiled before.

  ``model`` is a depth of the dense stack (``"128"``), or a production-shaped model of
  `benchmarks.production` (``"resnet50"``) at batch `PRODUCTION_BATCH`, its steps as there.
  """
  if model.isdigit():
    net, x, y = dense_problem(int(model))
    fns, _ = steps(net, x, y)
    pairs = [(fn, (*state, x, y), ()) for fn, state in fns.values()]
  else:
    s = production.setup(model, PRODUCTION_BATCH)
    pairs = [
      (fn, (*carry, s.batch), (0, 1, 2))
      for fn, carry in (production.sgd_step(s), production.kfac_step(s, CADENCE)[:2])
    ]
  seconds = []
  for fn, args, donate in pairs:
    lower, comp, _ = compile_seconds(fn, args, donate_argnums=donate)
    seconds.append(lower + comp)
  return seconds[0], seconds[1]


def fresh_processes(model: str, n: int) -> None:
  """Prints each fresh process's pair (`cold_pair`), then the median ratio and its spread.

  Single pairs on this kind of shared machine spread by tens of percent (the
  same compile can take 1.4 s or 2.2 s), so the verdict is the median over many
  processes, given with its quartiles and the ratio of the median times.
  """
  label = f"{model} dense layers" if model.isdigit() else f"{model}, batch {PRODUCTION_BATCH}"
  times = []
  for i in range(n):
    out = subprocess.run(
      [sys.executable, __file__, "--cold", model], capture_output=True, text=True, check=True
    )
    sgd, kfac = map(float, out.stdout.split()[-2:])
    times.append((sgd, kfac))
    print(
      f"fresh process {i + 1}: {label}, SGD {sgd:.2f} s, K-FAC {kfac:.2f} s, {kfac / sgd:.2f}x",
      flush=True,
    )
  ratios = [kfac / sgd for sgd, kfac in times]
  sgd, kfac = (statistics.median(t) for t in zip(*times))
  spread = (
    f", quartiles {' to '.join(f'{q:.2f}x' for q in statistics.quantiles(ratios)[::2])}"
    if n > 1
    else ""
  )
  print(
    f"median over {n} fresh processes: {statistics.median(ratios):.2f}x{spread};"
    f" median times SGD {sgd:.2f} s, K-FAC {kfac:.2f} s ({kfac / sgd:.2f}x)"
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer depths and timing blocks")
  parser.add_argument(
    "--fresh",
    type=int,
    default=0,
    metavar="N",
    help="also the deepest stack in N fresh processes (with --model: that model alone)",
  )
  parser.add_argument(
    "--model",
    choices=[m for m in production.SHAPES if not m.startswith("tiny")],
    help=f"with --fresh: only this production-shaped model's steps (batch {PRODUCTION_BATCH})",
  )
  parser.add_argument("--cold", help=argparse.SUPPRESS)  # one fresh process's pair
  parser.add_argument(
    "--publish",
    action="store_true",
    help=f"write benchmarks/results/{RESULTS} and the table in docs/benchmarks/compile_time.md",
  )
  args = parser.parse_args()
  if args.publish and args.quick:
    parser.error("--publish publishes a full run, not --quick")
  if args.fresh < 0:
    parser.error(f"--fresh takes a number of processes, 0 or more; got {args.fresh}")
  if args.model and (args.fresh < 1 or args.publish or args.quick):
    parser.error("--model compiles only that model in fresh processes: give --fresh N alone")
  if args.cold:
    warnings.simplefilter("ignore")  # the parent reads the last line
    print(*cold_pair(args.cold))
    return
  if args.model:
    fresh_processes(args.model, args.fresh)
    return
  blocks = 2 if args.quick else 3
  dense = (8, 32) if args.quick else (8, 32, 64, 128)
  blocks_tf = (4,) if args.quick else (4, 8, 16)
  print(
    f"jax {jax.__version__} on {jax.devices()[0].device_kind}, batch {BATCH}, cadence {CADENCE}"
  )
  print(
    f"{'model':<12} {'depth':>5} {'layers':>6} {'stacks':>6} | {'SGD: lower':>6} {'compile':>7}"
    f" {'total':>7} | {'K-FAC: lower':>6} {'compile':>7} {'total':>7} | {'ratio':>7}"
    f" | {'SGD ms':>8} {'K-FAC ms':>8} {'ratio':>7}"
  )
  totals = {d: bench("dense", d, dense_problem, blocks) for d in dense}
  rows = [
    *totals.values(),
    *(bench("transformer", d, transformer_problem, blocks) for d in blocks_tf),
  ]
  first, last = dense[0], dense[-1]
  for name in ("sgd", "kfac"):
    growth = totals[last][f"{name}_seconds"] / totals[first][f"{name}_seconds"]
    print(f"{name} compile growth from {first} to {last} dense layers: {growth:.1f}x")
  if args.publish:
    committed = generated.load(RESULTS)
    before = {m["model"]: m["before"] for m in committed["models"] if "before" in m}
    results = committed | {
      "provenance": f"models: written by `python benchmarks/compile_time.py --publish` (jax "
      f"{jax.__version__}); each model's `before` kept from the earlier file",
      "jax": jax.__version__,
      "models": [
        m | ({"before": before[m["model"]]} if m["model"] in before else {}) for m in rows
      ],
    }
    print(render(results))
    for path in generated.publish(RESULTS, results):
      print(f"written: {path}")
  if args.fresh:
    fresh_processes(str(last), args.fresh)


if __name__ == "__main__":
  main()
