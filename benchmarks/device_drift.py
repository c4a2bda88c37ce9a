"""One device against several: how far data-parallel training drifts, and why.

A data-parallel step sums the same examples in another order than one device does (each
device its share, then a collective), so its float32 results differ in the last bits. Training
carries such differences forward, and how fast they grow depends on the optimizer and, for
K-FAC, on the damping: ``(F + lambda)^-1`` amplifies a perturbation of ``F`` by up to
``1 / lambda^2``.

For each configuration this trains the same model from the same initialisation on the same
global batches three times and prints the relative distance of the parameters,
``|theta - theta_1| / |theta_1|``, to the one-device run ``theta_1`` after each step:

* on ``N`` devices under ``jax.shard_map`` (COMM-OPT; any fraction trains bit for bit alike);
* on one device with the rows of every batch permuted: the same mean gradient and the same
  factors, up to the order of summation, and nothing else.

Where the two distances agree, the drift is float32 rounding amplified by the training dynamics,
not an error of the distribution; a distribution error shows at the first step, far above
rounding. The model is the robustness suite's GRU under ``nn.RNN`` (`experiments.suite`), batch
128, SGD with momentum 0.9 at lr 0.1, alone and with K-FAC chained before it.

Run: ``python benchmarks/device_drift.py [--steps 60] [--devices 4] [--publish]`` (about two
minutes on 2 CPU cores); ``--publish`` writes ``benchmarks/results/device_drift.json`` and the
table into the data-parallel guide (block ``device drift``, `benchmarks.generated`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the emulated devices must be set before JAX starts
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kaisa_jax
from benchmarks import generated
from experiments import optimizers, suite

LR = 0.1
# K-FAC's own step under the KAISA reference's KL clip (the experiments' `STEP_RULE`), told the
# chained rate.
KAISA_STEP = {**optimizers.STEP_RULE, "lr": LR}
# name -> kfac's arguments besides layers and mesh (None: SGD alone).
CONFIGS: dict[str, dict[str, Any] | None] = {
  "SGD": None,
  "K-FAC, defaults": {},
  "K-FAC, step_norm='natural', kl_clip=1e-3": KAISA_STEP,
  "K-FAC, the same, damping_form='kaisa', damping=1e-3": {
    **KAISA_STEP,
    "damping_form": "kaisa",
    "damping": 1e-3,
  },
}
AXES = (kaisa_jax.RECEIVERS, kaisa_jax.GRAD_WORKERS)
BLOCK = "device drift"


def _transform(layers, kfac: dict[str, Any] | None, mesh) -> optax.GradientTransformation:
  sgd = optax.sgd(LR, momentum=0.9)
  if kfac is None:
    return sgd
  return optax.chain(kaisa_jax.kfac(layers, mesh=mesh, **kfac), sgd)


def trajectories(
  problem: suite.Problem, kfac: dict[str, Any] | None, steps: int, devices: int
) -> dict[str, list[Any]]:
  """The parameters after every step: on one device (``"one"``), on ``devices`` devices
  (``"mesh"``), and on one device with each batch's rows permuted (``"permuted"``)."""
  x, y = (np.asarray(a) for a in problem.train)
  order = suite.batch_order(len(x), problem.batch_size, steps, 0)
  params0, state0 = problem.init(jax.random.key(0))
  grad_fn = kaisa_jax.value_and_grad(problem.loss, has_aux=True)
  local = problem.batch_size // devices
  layers = grad_fn.layers(params0, state0, x[:local], y[:local])

  def step(tx, params, state, opt_state, xb, yb, mean):
    (_, state), grads, curvature = grad_fn(params, state, xb, yb)
    updates, opt_state = tx.update(mean(grads), opt_state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state, opt_state

  def one(permute: bool) -> list[Any]:
    tx = _transform(layers, kfac, None)
    fn = jax.jit(lambda *a: step(tx, *a, lambda g: g))
    carry, out = (params0, state0, tx.init(params0)), []
    rng = np.random.default_rng(1)
    for idx in order:
      idx = idx[rng.permutation(len(idx))] if permute else idx
      carry = fn(*carry, x[idx], y[idx])
      out.append(jax.tree.map(np.asarray, carry[0]))
    return out

  def mesh_run() -> list[Any]:
    mesh = kaisa_jax.make_mesh(1, jax.devices()[:devices])
    tx = _transform(layers, kfac, mesh)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params0, replicated)
    opt_state = tx.init(params)
    specs = P() if kfac is None else kaisa_jax.partition_specs(opt_state)
    batch = P(AXES)
    # nn.RNN starts from an unvarying zero carry, which shard_map's varying-axis check refuses
    # once the carry depends on the batch: the check is off, and the gradients are averaged
    # over the mesh by hand.
    fn = jax.jit(
      jax.shard_map(
        lambda p, s, o, xb, yb: step(tx, p, s, o, xb, yb, lambda g: jax.lax.pmean(g, AXES)),
        mesh=mesh,
        in_specs=(P(), P(), specs, batch, batch),
        out_specs=(P(), P(), specs),
        check_vma=False,
      )
    )
    carry, out = (params, jax.device_put(state0, replicated), opt_state), []
    for idx in order:
      # Each step waits for the last: emulated CPU devices can deadlock with two in flight.
      carry = jax.block_until_ready(fn(*carry, x[idx], y[idx]))
      out.append(jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), carry[0]))
    return out

  return {"one": one(False), "mesh": mesh_run(), "permuted": one(True)}


def relative_distance(tree, reference) -> float:
  """``|tree - reference| / |reference|`` over all leaves together."""
  leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(reference), strict=True)
  num = sum(float(np.sum((a - b) ** 2)) for a, b in leaves)
  den = sum(float(np.sum(b**2)) for b in jax.tree.leaves(reference))
  return (num / den) ** 0.5


def drift(problem: suite.Problem, kfac: dict[str, Any] | None, steps: int, devices: int):
  """Per step, the distance to the one-device run of the mesh run and of the permuted run."""
  runs = trajectories(problem, kfac, steps, devices)
  return {
    key: [relative_distance(a, b) for a, b in zip(runs[key], runs["one"], strict=True)]
    for key in ("mesh", "permuted")
  }


def measure(steps: int, devices: int) -> dict[str, Any]:
  problem = suite.SUITE["gru"]()
  results = {
    "provenance": f"written by `python benchmarks/device_drift.py --steps {steps} --devices "
    f"{devices} --publish`",
    "steps": steps,
    "devices": devices,
    "jax": jax.__version__,
    "configs": {},
  }
  for name, kfac in CONFIGS.items():
    results["configs"][name] = drift(problem, kfac, steps, devices)
    print(name, flush=True)
  return results


def render(results: dict[str, Any]) -> str:
  """The table of distances at a few steps, as Markdown."""
  steps = [s for s in (1, 10, 30, 60, 100) if s <= results["steps"]]
  n = results["devices"]
  lines = [
    f"| training | {n} devices against one, after steps "
    + ", ".join(map(str, steps))
    + " | one device, rows permuted, against one |",
    "|---|---|---|",
  ]
  for name, d in results["configs"].items():
    cells = [", ".join(f"{d[key][s - 1]:.1e}" for s in steps) for key in ("mesh", "permuted")]
    lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--publish", action="store_true", help="save the results and the table")
  args = parser.parse_args(argv)
  results = measure(args.steps, args.devices)
  print(render(results))
  if args.publish:
    generated.save("device_drift.json", results)
    for path in generated.write(BLOCK, render(results)):
      print(f"table written to {path}")


if __name__ == "__main__":
  main()
