"""K-FAC's memory per device at scale: ResNet-50 and BERT on 8 to 256 devices, from the layout.

For each model of `MODELS` (`benchmarks.production`, at its real shapes) and each ``N`` of
`DEVICES`, the layers are traced at the per-device batch `BATCH` (abstractly: no parameter is
initialised, nothing is computed) and laid out for every valid grad worker fraction ``f = W / N``
exactly as `kaisa_jax.kfac` lays them out (`kaisa_jax.plan_fractions`, with kfac's default
settings: eigen method, ``max_cost_ratio`` 4, cadence (10, 100), float32 factors). Each layer's
treatment is weighed at the whole data-parallel batch, ``BATCH x N`` examples, as kfac weighs it
on ``N`` devices. Per device, in bytes, for three ways of keeping K-FAC's state:

* ``kaisa_jax``: the factor buffer (the factors the device owns, as long as the largest device's
  share) and the decompositions of its grad-worker group (``W`` devices' buffers): the sizes of
  `kaisa_jax.KFACState`'s arrays, what `kaisa_jax.planning.FractionOption` reports;
* ``kaisa`` (the KAISA reference's scheme): every factor on every device (all-reduced to all),
  and each layer's decompositions on its ``W`` grad workers, ``f N`` devices: per device, the
  decompositions of one group of the same layout, as kaisa_jax's at that fraction;
* ``replicated``: every factor and every decomposition on every device (K-FAC without KAISA's
  distribution, as kfac-jax keeps it): the layout of one device holding every layer.

Every figure is exact for the shapes it describes, computed from the layout without allocating
anything. What is projected is the recommended fraction: `kaisa_jax.plan_fractions` on
`kaisa_jax.DGX_H100`, with the default memory budget (the preset's 80 GB less half of it for the
model, `kaisa_jax.planning.budget_for`) and with none.

Run: ``python benchmarks/memory_at_scale.py [--models resnet50 bert_base bert_large]
[--devices 8 64 256] [--batch 32] [--publish]``; prints the tables (`render`). ``--publish``
writes ``benchmarks/results/memory_at_scale.json`` and the block ``memory at scale`` of
``docs/benchmarks/memory.md`` (`benchmarks.generated`).
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kaisa_jax
from benchmarks import generated, production
from kaisa_jax import assignment, config, distribution, planning, preconditioning
from kaisa_jax.plan import make_plan

MODELS = ("resnet50", "bert_base", "bert_large")
DEVICES = (8, 64, 256)
BATCH = 32  # per device: images for ResNet-50, sequences of 128 tokens for BERT
CLUSTER = kaisa_jax.DGX_H100
RESULTS = "memory_at_scale.json"  # under benchmarks/results/
MIB = 2**20
PLANNED = planning.PLANNED_AXIS


def local_layers(name: str, batch: int) -> kaisa_jax.Layers:
  """``production.SHAPES[name]``'s layers at ``batch`` examples per device, from abstract params."""
  shape = production.SHAPES[name]
  if shape.tokens:
    x = y = jnp.zeros((batch, *shape.example), jnp.int32)
  else:
    x, y = jnp.zeros((batch, *shape.example)), jnp.zeros((batch,), jnp.int32)
  variables = dict(jax.eval_shape(shape.model.init, jax.random.key(0), x[:1]))
  params = variables.pop("params")  # shapes only: the layers' specs do not depend on values
  state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), variables)  # BatchNorm's
  s = production.Setup(shape, params, state, (x, y))
  return production.grad_fn(s).layers(s.params, s.state, s.batch)


def decomposition_sizes(plan: kaisa_jax.Plan) -> list[int]:
  """Elements of each layer's decompositions (eigenvectors and eigenvalues, or inverses)."""
  return [
    assignment.size([x for side in assignment.decomposition_shapes(s, t) for x in side])
    for s, t in plan.layers
  ]


def fraction_row(plan: kaisa_jax.Plan, option: planning.FractionOption, whole: dict[str, int]):
  """One fraction's bytes per device in the three schemes (the module docstring).

  The KAISA reference's decompositions are those of the layers of the largest group of the same
  layout, layer by layer: kaisa_jax's group buffer without its padding (each device's share
  is padded to the largest device's, so that one SPMD program serves every device).
  """
  n = plan.layout.devices
  layout = planning.layout_for(plan, n, option.fraction)
  factors, decompositions = planning.state_bytes(layout, plan.factor_dtype)
  assert (factors, decompositions) == (option.factor_memory, option.decomposition_memory)
  sizes = decomposition_sizes(plan)
  itemsize = jnp.dtype(preconditioning.decomposition_dtype(plan.factor_dtype)).itemsize
  group = max(sum(sizes[i] for i in layout.group(r)) for r in range(layout.rows)) * itemsize
  return {
    "fraction": str(option.fraction),
    "grad_workers": option.grad_workers,
    "kaisa_jax": {"factors": factors, "decompositions": decompositions},
    "kaisa": {"factors": whole["factors"], "decompositions": group},
    "projected_ms": 1e3 * option.seconds,
  }


def at_scale(layers: kaisa_jax.Layers, n: int) -> dict[str, Any]:
  """Every fraction's bytes per device on ``n`` devices in the three schemes, and the
  fraction recommended on `CLUSTER` with the default memory budget and with none."""
  settings = config.check_settings(  # plan_fractions' defaults, which are kfac's
    factor_update_steps=10,
    inv_update_steps=100,
    compute_method="eigen",
    max_cost_ratio=4.0,
    assignment_cost="compute",
    factor_dtype="float32",
  )
  # The treatments depend on n only (the whole batch), not on the fraction.
  plan = make_plan(layers, distribution.Collectives("pmap", n, 1, PLANNED), settings)
  whole_layout = planning.layout_for(plan, 1, 1)
  factors, decompositions = planning.state_bytes(whole_layout, settings.factor_dtype)
  whole = {"factors": factors, "decompositions": decompositions}
  budgeted = kaisa_jax.plan_fractions(layers, n, CLUSTER)  # kfac's defaults, as settings
  unlimited = kaisa_jax.plan_fractions(layers, n, CLUSTER, math.inf)
  return {
    "devices": n,
    "treatments": dict(sorted(collections.Counter(str(t) for _, t in plan.layers).items())),
    "replicated": whole,
    "fractions": [fraction_row(plan, o, whole) for o in unlimited.options],
    "budget": budgeted.memory_budget,
    "recommended": {
      "default budget": _fraction(budgeted.recommended),
      "no budget": _fraction(unlimited.recommended),
    },
  }


def _fraction(f: Any) -> str | None:
  return None if f is None else str(f)


def _mib(n: float) -> str:
  return f"{n / MIB:,.1f}"


def _total(part: dict[str, int]) -> int:
  return part["factors"] + part["decompositions"]


def model_table(model: dict[str, Any]) -> list[str]:
  """One model's table: a row per device count and fraction, MiB per device."""
  lines = [
    f"**{model['label']}**: {model['layers']} layers, traced at {model['batch']} examples per "
    "device. MiB per device; padding: what kaisa_jax's group buffer holds beyond its layers' "
    "decompositions.",
    "",
    "| N | f | kaisa_jax factors | kaisa_jax decompositions (padding) | kaisa_jax total "
    "| KAISA reference: factors + decompositions = total | replicated: factors + decompositions "
    "= total | kaisa_jax / replicated |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for at in model["scale"]:
    rep = at["replicated"]
    for row in at["fractions"]:
      ours, ref = row["kaisa_jax"], row["kaisa"]
      padding = ours["decompositions"] - ref["decompositions"]
      lines.append(
        f"| {at['devices']} | {row['fraction']} | {_mib(ours['factors'])} "
        f"| {_mib(ours['decompositions'])} ({_mib(padding)}) | **{_mib(_total(ours))}** "
        f"| {_mib(ref['factors'])} + {_mib(ref['decompositions'])} = {_mib(_total(ref))} "
        f"| {_mib(rep['factors'])} + {_mib(rep['decompositions'])} = {_mib(_total(rep))} "
        f"| {_total(ours) / _total(rep):.2f} |"
      )
  return lines


def recommended_table(results: dict[str, Any]) -> list[str]:
  """The fraction `plan_fractions` recommends per model and device count, with and without the
  default budget, and the treatments the layers get there."""
  budget = results["models"][0]["scale"][0]["budget"] if results["models"] else 0.0
  lines = [
    f"**Recommended on {results['cluster']}** (PROJECTED times): the default memory budget is "
    f"{budget / 1e9:g} GB per device for K-FAC's state (the preset's "
    f"{results['cluster_memory'] / 1e9:g} GB less half for the model).",
    "",
    "| model | N | with the default budget | with no budget | treatments of the layers |",
    "|---|---|---|---|---|",
  ]
  for model in results["models"]:
    for at in model["scale"]:
      rec = at["recommended"]
      treatments = ", ".join(f"{k}: {v}" for k, v in at["treatments"].items())
      lines.append(
        f"| {model['label'].split(',')[0]} | {at['devices']} | {rec['default budget'] or 'none fits'} "
        f"| {rec['no budget']} | {treatments} |"
      )
  return [*lines, "", _budget_summary(results)]


def _budget_summary(results: dict[str, Any]) -> str:
  """How many recommendations the default budget changes, and the largest state of the tables."""
  ats = [(m, at) for m in results["models"] for at in m["scale"]]
  changed = sum(
    at["recommended"]["default budget"] != at["recommended"]["no budget"] for _, at in ats
  )
  model, at, row = max(
    ((m, at, row) for m, at in ats for row in at["fractions"]),
    key=lambda x: _total(x[2]["kaisa_jax"]),
  )
  return (
    f"The default budget changes {changed} of these {len(ats)} recommendations: the largest "
    f"kaisa_jax state above, {_total(row['kaisa_jax']) / 1e9:.1f} GB per device "
    f"({model['label'].split(',')[0]} on {at['devices']} devices at f = {row['fraction']}), is "
    f"{'within' if _total(row['kaisa_jax']) <= at['budget'] else 'above'} it."
  )


def render(results: dict[str, Any]) -> str:
  """Every model's table, then the recommended fractions (the block ``memory at scale``)."""
  lines: list[str] = []
  for model in results["models"]:
    lines += [*model_table(model), ""]
  return "\n".join([*lines, *recommended_table(results)])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  parser.add_argument("--devices", nargs="+", type=int, default=list(DEVICES))
  parser.add_argument("--batch", type=int, default=BATCH, help="examples per device")
  parser.add_argument(
    "--publish",
    action="store_true",
    help=f"write benchmarks/results/{RESULTS} and its block in docs/benchmarks/memory.md",
  )
  args = parser.parse_args()
  if args.publish and (set(args.models) != set(MODELS) or args.devices != list(DEVICES)):
    parser.error("--publish publishes every model on every device count of DEVICES")
  start = time.perf_counter()
  results: dict[str, Any] = {
    "provenance": f"python benchmarks/memory_at_scale.py --batch {args.batch}, jax "
    f"{jax.__version__}: from the layout, nothing allocated",
    "cluster": CLUSTER.name,
    "cluster_memory": CLUSTER.memory,
    "models": [],
  }
  for name in args.models:
    layers = local_layers(name, args.batch)
    scale = [at_scale(layers, n) for n in args.devices]
    label = production.SHAPES[name].label
    model = {"name": name, "label": label, "layers": len(layers.specs), "batch": args.batch}
    results["models"].append(model | {"scale": scale})
    print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
  print(render(results))
  if args.publish:
    for path in generated.publish(RESULTS, results):
      print(f"written: {path}")


if __name__ == "__main__":
  main()
