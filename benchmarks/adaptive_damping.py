"""Adaptive damping by the Levenberg-Marquardt rule: does it pay for its extra forward pass?

Martens and Grosse (2015, section 6.5) adapt the damping ``lambda`` every ``T`` steps from the
reduction ratio of the step ``delta`` just proposed,

    rho = (L(theta + delta) - L(theta)) / M(delta),
    M(delta) = g^T delta + 1/2 delta^T (F + lambda) delta,

on the same batch: ``lambda <- omega lambda`` when ``rho > 3/4`` (the quadratic model is
trusted), ``lambda <- lambda / omega`` when ``rho < 1/4``, with ``omega = (19/20)^T``. It costs
one forward pass every ``T`` steps, at ``theta + delta``.

This prototype builds it around `kaisa_jax.kfac` without changing the library: K-FAC's damping
is injected (`optax.inject_hyperparams`), K-FAC returns its own step ``P g``
(`step_norm="natural"`), and the step rule is applied outside with the library's formula, so
that each layer's ``s_l = g_l^T P_l g_l`` is at hand. With the step ``delta = -lr u`` the damped
K-FAC model gives ``M(delta) = sum_l (-lr c_l s_l + 1/2 (lr c_l)^2 s_l)`` for ``u_l = c_l P_l g_l``.
Two step rules (``--step-rule``):

- ``kl_clip``: the KAISA reference's, one ``c = nu = min(1, sqrt(kl_clip / |lr^2 sum_l s_l|))``
  for all layers with a KL clip of 1e-3, the library's default when first measured; at the
  rate tuned under it (``tuned_kl_clip`` of ``benchmarks/results/robustness.json``). Its sum
  runs over every parameter, as when first measured, where the library's runs over the
  preconditioned layers only: the two differ on a model with parameters K-FAC passes through
  (the ResNet's BatchNorms), by their ``|g|^2``.
- ``gradient``: the library's default, ``c_l = |g_l| / |P_l g_l|`` layer by layer (each layer's
  step given its gradient's norm; a layer is a parameter's parent module, as for
  the models of `RULES`, none of which stacks layers in one parameter), at K-FAC's tuned rate at
  its defaults (``tuned``).

The step then goes to the chained first-order optimizer, as in `experiments.suite`.

For each model it trains K-FAC under the rule at that learning rate from each initial damping of
`benchmarks.robustness.DAMPINGS`, with the damping fixed and adapted every ``T`` steps, and prints
the final losses (the mean of the last 20 steps, over 3 seeds), their spread over the dampings,
and the damping the adaptation ends at. Results go to ``benchmarks/results/adaptive_damping.json``
(``kl_clip``) or ``adaptive_damping_gradient.json``.

Run: ``python benchmarks/adaptive_damping.py [--step-rule kl_clip|gradient] [--problems ...]``
(the KL clip's four default models: about 15 minutes on 2 CPU cores; the gradient rule's seven,
every model of the robustness suite but the character transformer: about an hour). Models
measured before with the same seeds stay in the results file.
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
from kaisa_jax import preconditioning

KL_CLIP = 1e-3  # the KAISA reference's
PERIODS = (None, 1, 5)  # None: the damping stays fixed
# kfac's arguments that decide its layout: static under inject_hyperparams.
STATIC = ("layers", "step_norm", "inv_update_steps", "max_cost_ratio", "grad_worker_fraction")
# Per step rule: the tuning in robustness.json whose rate it trains at, the models measured by
# default, the results file and the block of docs/benchmarks/robustness.md.
RULES = {
  "kl_clip": ("tuned_kl_clip", ("gru", "lstm", "nnx_mlp", "resnet_bn"), "adaptive_damping.json"),
  "gradient": (
    "tuned",
    ("mnist1d", "vit", "gru", "lstm", "nnx_mlp", "autoencoder", "resnet_bn"),
    "adaptive_damping_gradient.json",
  ),
}
BLOCKS = {"kl_clip": "adaptive damping", "gradient": "adaptive damping, gradient rule"}


def _layer_sums(a: Any, b: Any) -> dict[str, jax.Array]:
  """``<a, b>`` summed per parent module of the parameters (one layer each here)."""
  sums: dict[str, jax.Array] = {}
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    key = jax.tree_util.keystr(path[:-1])
    sums[key] = sums.get(key, 0.0) + jnp.vdot(x, y)
  return sums


def step_rule(rule: str, grads: Any, pg: Any, lr: jax.Array) -> tuple[Any, jax.Array]:
  """``(u, M(-lr u))``: K-FAC's step ``P g`` scaled by ``rule``, and what the damped quadratic
  model predicts for it, ``sum_l (-lr c_l s_l + 1/2 (lr c_l)^2 s_l)`` with ``s_l = <g_l, P_l g_l>``.
  """
  s = _layer_sums(grads, pg)
  if rule == "kl_clip":
    c = dict.fromkeys(s, preconditioning.kl_clip_scale(sum(s.values()), KL_CLIP, lr))
  else:
    pp, vv = _layer_sums(pg, pg), _layer_sums(grads, grads)
    c = {k: preconditioning.gradient_norm_scale(pp[k], vv[k]) for k in s}
  flat, treedef = jax.tree_util.tree_flatten_with_path(pg)
  u = treedef.unflatten([c[jax.tree_util.keystr(path[:-1])] * v for path, v in flat])
  model = sum(-lr * c[k] * s[k] + 0.5 * (lr * c[k]) ** 2 * s[k] for k in s)
  return u, model


def make_run(problem: suite.Problem, period: int | None, rule: str = "kl_clip"):
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

    def adapt(damping, params, state, xb, yb, loss, u, model):
      delta = jax.tree.map(lambda v: -lr * v, u)
      new = problem.loss(optax.apply_updates(params, delta), state, xb, yb)[0]
      rho = (new - loss) / model
      damping = jnp.where(rho > 0.75, damping * omega, damping)
      return jnp.where((rho < 0.25) | ~jnp.isfinite(rho), damping / omega, damping)

    def step(carry, at):
      i, idx = at
      params, state, k_state, f_state, damping = carry
      xb, yb = x[idx], y[idx]
      (loss, new_state), grads, curvature = grad_fn(params, state, xb, yb)
      k_state.hyperparams["damping"] = damping
      pg, k_state = kfac.update(grads, k_state, params, curvature=curvature)
      u, model = step_rule(rule, grads, pg, lr)
      if period is not None:
        damping = jax.lax.cond(
          i % period == 0,
          lambda d: adapt(d, params, state, xb, yb, loss, u, model),
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


def measure(name: str, lr: float, seeds: int, rule: str = "kl_clip") -> dict[str, Any]:
  problem = suite.SUITE[name]()
  out: dict[str, Any] = {"lr": lr}
  for period in PERIODS:
    run = make_run(problem, period, rule)
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
  parser.add_argument("--step-rule", choices=sorted(RULES), default="kl_clip")
  parser.add_argument("--problems", nargs="+", help="default: the rule's in RULES")
  parser.add_argument("--seeds", type=int, default=3)
  args = parser.parse_args(argv)
  tuning, measured, path = RULES[args.step_rule]
  measured = args.problems or measured
  tuned = json.loads(robustness.RESULTS.read_text())["problems"]
  # Models measured before with the same seeds are kept (the provenance names them all).
  previous = generated.load(path) if (generated.RESULTS / path).exists() else {}
  kept = {}
  if previous.get("seeds") == args.seeds:
    kept = {n: r for n, r in previous["problems"].items() if n not in measured}
  problems = [*kept, *measured]
  results = {
    "provenance": f"written by `python benchmarks/adaptive_damping.py --step-rule {args.step_rule} "
    f"--problems {' '.join(problems)} --seeds {args.seeds}`",
    "step_rule": args.step_rule,
    "steps": robustness.STEPS,
    "seeds": args.seeds,
    "jax": jax.__version__,
    "problems": dict(kept),
  }
  for name in measured:
    print(name, flush=True)
    lr = tuned[name][tuning]["lr"]
    results["problems"][name] = measure(name, lr, args.seeds, args.step_rule)
    generated.save(path, results)
  print(render(results))
  for written in generated.write(BLOCKS[args.step_rule], render(results)):
    print(f"table written to {written}")


if __name__ == "__main__":
  main()
