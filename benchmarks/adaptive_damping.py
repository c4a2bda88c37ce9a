"""Adaptive damping by the Levenberg-Marquardt rule: does it pay for its extra forward pass?

Martens and Grosse (2015, section 6.5) adapt the damping ``lambda`` every ``T`` steps from the
reduction ratio of the step ``delta`` just proposed,

    rho = (L(theta + delta) - L(theta)) / M(delta),
    M(delta) = g^T delta + 1/2 delta^T (F + lambda) delta,

on the same batch: ``lambda <- omega lambda`` when ``rho > 3/4`` (the quadratic model is
trusted), ``lambda <- lambda / omega`` when ``rho < 1/4``, with ``omega = (19/20)^T``. It costs
one forward pass every ``T`` steps, at ``theta + delta``.

It was measured under the KAISA reference's step rule, K-FAC's own step with a KL clip of 1e-3
(`step_norm="natural"`), the library's default then. This prototype builds it around
`kaisa_jax.kfac` without changing the library: K-FAC's damping is injected
(`optax.inject_hyperparams`) and its KL clip applied outside, with the same formula,
so that the clip's ``nu`` and ``s = g^T P g`` are at hand. For ``delta = -lr nu P g``, the damped
K-FAC model gives ``M(delta) = -lr nu s + 1/2 (lr nu)^2 s``. The step then goes to the chained
first-order optimizer, as in `experiments.suite`.

For each model it trains K-FAC under that rule at its tuned learning rate (from
``benchmarks/results/robustness.json``, the tuning of that rule, ``tuned_kl_clip``) from each
initial damping of `benchmarks.robustness.DAMPINGS`, with the damping fixed and adapted every
``T`` steps, and prints the final losses (the mean of the last 20 steps, over 3 seeds), their
spread over the dampings, and the damping the adaptation ends at. Results go to
``benchmarks/results/adaptive_damping.json``.

Run: ``python benchmarks/adaptive_damping.py [--problems gru lstm nnx_mlp resnet_bn]`` (about 15
minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kaisa_jax
from benchmarks import generated, robustness
from experiments import suite

KL_CLIP = 1e-3  # the KAISA reference's
PERIODS = (None, 1, 5)  # None: the damping stays fixed
# kfac's arguments that decide its layout: static under inject_hyperparams.
STATIC = ("layers", "step_norm", "inv_update_steps", "max_cost_ratio", "grad_worker_fraction")
BLOCK = "adaptive damping"


def make_run(problem: suite.Problem, period: int | None):
  """``run(params, state, order, lr, damping) -> (losses, dampings)``, one jitted scan."""
  x, y = (jnp.asarray(a) for a in problem.train)
  grad_fn = kaisa_jax.value_and_grad(problem.loss, has_aux=True, n_examples=problem.n_examples)
  params0, state0 = problem.init(jax.random.key(0))
  b = problem.batch_size
  layers = grad_fn.layers(params0, state0, x[:b], y[:b])
  omega = (19 / 20) ** (period or 1)

  @jax.jit
  def run(params, state, order, lr, damping):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # modules passed through are listed by print(layers)
      return _run(params, state, order, lr, damping)

  def _run(params, state, order, lr, damping):
    kfac = optax.inject_hyperparams(kaisa_jax.kfac, static_args=STATIC)(
      layers=layers, damping=damping, step_norm="natural"
    )
    first_order = suite.first_order(problem.optimizer, lr)

    def adapt(damping, params, state, xb, yb, loss, u, nu, s):
      delta = jax.tree.map(lambda v: -lr * v, u)
      new = problem.loss(optax.apply_updates(params, delta), state, xb, yb)[0]
      rho = (new - loss) / (-lr * nu * s + 0.5 * (lr * nu) ** 2 * s)
      damping = jnp.where(rho > 0.75, damping * omega, damping)
      return jnp.where((rho < 0.25) | ~jnp.isfinite(rho), damping / omega, damping)

    def step(carry, at):
      i, idx = at
      params, state, k_state, f_state, damping = carry
      xb, yb = x[idx], y[idx]
      (loss, new_state), grads, curvature = grad_fn(params, state, xb, yb)
      k_state.hyperparams["damping"] = damping
      u, k_state = kfac.update(grads, k_state, params, curvature=curvature)
      s = sum(jnp.vdot(g, v) for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(u)))
      nu = jnp.minimum(1.0, jnp.sqrt(KL_CLIP / jnp.abs(lr * lr * s)))
      u = jax.tree.map(lambda v: nu * v, u)
      if period is not None:
        damping = jax.lax.cond(
          i % period == 0,
          lambda d: adapt(d, params, state, xb, yb, loss, u, nu, s),
          lambda d: d,
          damping,
        )
      updates, f_state = first_order.update(u, f_state, params)
      carry = (optax.apply_updates(params, updates), new_state, k_state, f_state, damping)
      return carry, (loss, damping)

    carry = (params, state, kfac.init(params), first_order.init(params), damping)
    steps = jnp.arange(order.shape[0])
    return jax.lax.scan(step, carry, (steps, order))[1]

  return run


def measure(name: str, lr: float, seeds: int) -> dict[str, Any]:
  problem = suite.SUITE[name]()
  out: dict[str, Any] = {"lr": lr}
  for period in PERIODS:
    run = make_run(problem, period)
    rows = {}
    for d in robustness.DAMPINGS:
      finals, ends = [], []
      for seed in range(seeds):
        params, state = problem.init(jax.random.key(seed))
        order = suite.batch_order(len(problem.train[0]), problem.batch_size, robustness.STEPS, seed)
        losses, dampings = run(params, state, order, jnp.float32(lr), jnp.float32(d))
        finals.append(suite.final_loss(np.asarray(losses)))
        ends.append(float(dampings[-1]))
      rows[repr(d)] = {"losses": finals, "final_damping": ends}
      print(f"  {name} T={period} damping {d:g}: {robustness.mean(finals):.3g}", flush=True)
    out["fixed" if period is None else f"every {period}"] = rows
  return out


def render(results: dict[str, Any]) -> str:
  """Per model and mode: final loss at each initial damping, best, and worst over best."""
  head = " | ".join(f"from {d:g}" for d in robustness.DAMPINGS)
  lines = [
    f"| model, lr | damping | {head} | best | worst over best |",
    "|---|---|" + "---:|" * (len(robustness.DAMPINGS) + 2),
  ]
  for name, r in results["problems"].items():
    for i, mode in enumerate(m for m in r if m != "lr"):
      finals = [robustness.mean(r[mode][repr(d)]["losses"]) for d in robustness.DAMPINGS]
      ends = [np.median(r[mode][repr(d)]["final_damping"]) for d in robustness.DAMPINGS]
      cells = [
        f"{f:.2g}" + ("" if mode == "fixed" else f" (ends {e:.2g})") for f, e in zip(finals, ends)
      ]
      label = f"{name}, {r['lr']:g}" if i == 0 else ""
      lines.append(
        f"| {label} | {mode} | " + " | ".join(cells) + f" | {min(finals):.2g} | "
        f"{max(finals) / min(finals):.2g} |"
      )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--problems", nargs="+", default=["gru", "lstm", "nnx_mlp", "resnet_bn"])
  parser.add_argument("--seeds", type=int, default=3)
  args = parser.parse_args(argv)
  tuned = json.loads(robustness.RESULTS.read_text())["problems"]
  results = {
    "provenance": "written by `python benchmarks/adaptive_damping.py --problems "
    f"{' '.join(args.problems)} --seeds {args.seeds}`",
    "steps": robustness.STEPS,
    "seeds": args.seeds,
    "jax": jax.__version__,
    "problems": {},
  }
  for name in args.problems:
    print(name, flush=True)
    results["problems"][name] = measure(name, tuned[name]["tuned_kl_clip"]["lr"], args.seeds)
    generated.save("adaptive_damping.json", results)
  print(render(results))
  for path in generated.write(BLOCK, render(results)):
    print(f"table written to {path}")


if __name__ == "__main__":
  main()
