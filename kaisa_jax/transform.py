"""The Optax transformation: K-FAC preconditioning of a gradient, optionally distributed.

Each step, with ``k`` the step count kept in the state:

1. if ``k % factor_update_steps == 0`` (or ``k < curvature_warmup``): the
   factors of the current batch update the running averages
   (`kaisa_jax.factors`); each layer's factors are reduced over the
   data-parallel devices onto the one device that owns it;
2. if ``k % inv_update_steps == 0`` (or ``k < curvature_warmup``): every
   device decomposes the factors it owns (`kaisa_jax.preconditioning`) and
   shares them within its grad-worker group; in between the last
   decompositions are used;
3. every step: each group preconditions its layers' gradients,
   ``P = (A (x) G + damping)^-1 V``, shares them with the other groups, and all
   of them are scaled by the KL clip ``nu``.

Steps 1 and 2 sit under `jax.lax.cond`: work that a step skips is not executed,
and one compiled step serves every step. The state is stored in slots (see
`kaisa_jax.assignment`): on one device, one slot per layer. Layers that differ
only in their names (the blocks of a transformer, the convolutions of a ResNet
stage) form stacks: each phase computes a stack as one batch (`jax.vmap` of the
per-layer computation, batched ``eigh``, Cholesky and matrix products), so the
compiled step does not grow with the number of equal layers but with the number
of stacks. Each member's numbers are bit for bit those it has computed alone;
the KL clip's sum over layers adds stack by stack, so with the clip on a step
agrees with one computed layer by layer to float32 rounding.

This module holds the factory, `kfac`, and the sequence of the phases in a
step (`_update`). The phases themselves are in `kaisa_jax.phases` and
`kaisa_jax.chain_order`, the state in `kaisa_jax.state`, the checks of the
configuration in `kaisa_jax.config` and of the update's inputs in
`kaisa_jax.checks`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from kaisa_jax import assignment, checks, distribution, parameters, phases, preconditioning
from kaisa_jax import config as config_lib
from kaisa_jax import factors as factors_lib
from kaisa_jax import hyperparameters as hp
from kaisa_jax.capture import EXCLUDED, Curvature, Layers, Skipped
from kaisa_jax.chain_order import check_chain_order
from kaisa_jax.cluster import cluster_of
from kaisa_jax.plan import Plan, collectives_for, make_plan
from kaisa_jax.planning import budget_for, fraction_options
from kaisa_jax.state import (
  KFACState,
  initial_state,
  layer_decompositions,
  layer_factors,
  partition_specs,
  stack_offsets,
)

__all__ = [
  "KFAC",
  "KFACState",
  "Plan",
  "kfac",
  "layer_decompositions",
  "layer_factors",
  "partition_specs",
]

Array = jax.Array


class KFAC(optax.GradientTransformationExtraArgs):
  """The transformation returned by `kfac`.

  ``plan`` lists what it does per layer; ``damping`` is its damping as given
  (a number or a schedule), which `kaisa_jax.curvature_statistics` reads.
  """

  plan: Plan
  damping: hp.ScalarOrSchedule


def kfac(
  layers: Layers,
  *,
  damping: hp.ScalarOrSchedule = preconditioning.DEFAULT_DAMPING,
  damping_form: str | None = None,
  factor_decay: hp.ScalarOrSchedule = 0.95,
  factor_update_steps: hp.IntOrSchedule = 10,
  inv_update_steps: hp.IntOrSchedule = 100,
  curvature_warmup: int = 0,
  step_norm: str = preconditioning.GRADIENT,
  kl_clip: hp.ScalarOrSchedule | None = None,
  lr: hp.ScalarOrSchedule | None = None,
  compute_method: str = preconditioning.EIGEN,
  weight_sharing: str = factors_lib.EXPAND,
  factor_dtype: Any = "float32",
  max_cost_ratio: float | None = 4.0,
  grad_worker_fraction: float | str | None = None,
  mesh: Mesh | None = None,
  axis_name: str | None = None,
  axis_size: int | None = None,
  assignment_cost: str = assignment.COMPUTE,
) -> KFAC:
  """K-FAC preconditioning as an Optax transformation, distributed as KAISA.

  Turns the gradient of every captured layer into
  ``nu * (A (x) G + damping I)^-1 vec(grad)`` and passes every other gradient
  through unchanged, with ``nu`` by default giving the preconditioned layers'
  update the norm of their gradient (``step_norm``). The result is not
  negated or scaled by a learning rate: chain it with an optimizer, K-FAC first,
  ``optax.chain(kfac(...), optax.sgd(lr, 0.9))``, and pass ``curvature=``
  (from `kaisa_jax.value_and_grad`) to ``update``. The first step checks the
  order: incoming updates that point against the gradient the curvature
  implies (cosine below -0.5, as an optimizer's step does) raise.

  Misuse raises rather than training wrongly: an ``update`` mapped over devices
  (``jax.pmap``, ``jax.shard_map``) that kfac was not built for, with
  ``axis_name=`` or ``mesh=``, raises at trace time.

  Args:
    layers: the model's layers, from ``grad_fn.layers(params, batch)`` where
      ``grad_fn = kaisa_jax.value_and_grad(loss_fn)``.
    damping: the damping ``lambda > 0``; what it adds depends on ``damping_form``.
    damping_form: how ``damping`` enters (`kaisa_jax.preconditioning`, with
      ``mA``, ``mG`` each factor's mean eigenvalue): ``"bounded"`` (the
      default with ``step_norm="gradient"``: factored Tikhonov damping with the pi-correction, Martens and Grosse
      2015, ``(A + pi sqrt(l) I) (x) (G + sqrt(l) / pi I)`` with
      ``pi = sqrt(mA / mG)`` and ``l = min(lambda, mA mG)``, the damping
      bounded by each layer's mean curvature: a large damping cannot turn a
      layer's step into the gradient's direction), ``"pi"`` (the same
      without the bound, ``l = lambda``; the default with
      ``step_norm="natural"``, whose step length the damping bounds in the
      directions the factors barely see), ``"relative"``
      (``(A + sqrt(lambda) mA I) (x) (G + sqrt(lambda) mG I)``: each factor
      damped relative to its own scale) or ``"kaisa"`` (the KAISA reference's
      absolute ``A (x) G + lambda I``; with the inverse method
      ``(A + lambda I)^-1 V (G + lambda I)^-1``). Over the eight models of
      ``benchmarks/robustness.py``, the default pair, ``"bounded"`` at 0.1,
      ends at or below each tuned first-order baseline and every damping
      from 1e-4 to 1e-1 within 2x of the best on all eight; ``"pi"`` keeps
      that range on six. Under the KAISA KL clip ``"bounded"`` ended at or
      below the baseline on three of them, ``"pi"`` on six
      (`kaisa_jax.preconditioning.default_form`). ``"kaisa"``
      reproduces the KAISA reference.
    factor_decay: running-average decay of the factors, in ``[0, 1)``; 0 keeps
      only the current batch.
    factor_update_steps: update the factors every this many steps (int >= 1).
    inv_update_steps: recompute the decompositions every this many steps.
    curvature_warmup: for the steps ``k < curvature_warmup``, update the
      factors and recompute the decompositions at every step, whatever the
      two cadences; from then on, on the cadences. The factors of the first
      batch otherwise precondition every step until the first decompositions
      after it, while the parameters move fastest. 0 (default): on the
      cadences from step 0, as the KAISA reference. The plan weighs each
      layer's decompositions by ``inv_update_steps``, not by the warmup's.
    step_norm: how long the preconditioned step is. ``"gradient"`` (default):
      each preconditioned layer's update ``nu P`` takes the norm of its
      gradient ``V`` (weight and bias together), ``nu = |V| / |P|`` layer by
      layer, so K-FAC chooses each layer's direction and the chained
      optimizer's learning rate means what it means without K-FAC (tune it as
      for that optimizer alone). ``"natural"``: K-FAC's own step, ``nu = 1``,
      or bounded by ``kl_clip``. On the eight models of
      ``benchmarks/robustness.py`` the default, its rate tuned, ends below each
      tuned first-order baseline (0.22x to 0.94x), where K-FAC's own step under
      the KAISA KL clip (with ``"pi"``) trailed on two (3.6x, 1.6x), though it
      led further on others.
    kl_clip: with ``step_norm="natural"`` only: scale the preconditioned
      gradients by ``nu = min(1, sqrt(kl_clip / |lr^2 sum <P, V>|))`` (the KAISA
      reference's KL clip, which it sets to 1e-3); ``None`` (default): no clip.
      While it is active the step no longer depends on ``lr``.
    lr: the learning rate of the chained optimizer, read only by the KL clip:
      required with ``kl_clip``, refused without it.
    compute_method: ``"eigen"`` (exact damped Kronecker inverse) or
      ``"inverse"`` (``(A + damping)^-1 V (G + damping)^-1``, cheaper, a
      different regulariser for the same damping).
    weight_sharing: how a layer whose weight is used several times per
      example counts the uses (Eschenhagen et al., 2023), the rows of one call
      (sequence positions, pixels) and the calls of a layer applied several
      times (a recurrent cell, a block reused in a loop) alike: ``"expand"``
      (every use is a sample: ``A`` the mean over uses, ``G`` the sum over an
      example's uses) or ``"reduce"`` (each example's inputs averaged and
      output gradients summed over its uses first); see `kaisa_jax.factors`.
      Embedding lookups always expand.
    factor_dtype: dtype of the factors (a dtype or its name); decompositions
      run in this dtype but never below float32, and results are cast back to
      the gradient dtype.
    max_cost_ratio: a layer whose preconditioning and amortised decompositions
      would cost more than this many times its own forward and backward pass
      gets a cheaper treatment (inverse method, then diagonal sides); see
      `kaisa_jax.cost`. ``None`` keeps ``compute_method`` everywhere.
    grad_worker_fraction: KAISA's ``f``: ``W = f N`` of the ``N`` data-parallel
      devices form a grad-worker group. A number in ``(0, 1]`` with ``f N`` an
      integer dividing ``N``, or ``"comm_opt"`` (1, the default),
      ``"hybrid_opt"`` (1/2) or ``"mem_opt"`` (``1/N``), or ``"auto"``
      (with ``axis_name=``): the fraction `kaisa_jax.plan_fractions`
      recommends for the preset cluster of the device kind
      (`kaisa_jax.cluster.cluster_of`: A100, H100, H200; others raise), with its
      default memory budget: half the preset's memory per device for K-FAC's
      state (the other half left to the model; it raises if no fraction
      fits). For another budget, pass
      ``plan_fractions(layers, n, cluster, model_memory=...).recommended``.
      With ``mesh=`` it defaults to the mesh's. No effect on a single device.
    mesh: for a train step under ``jax.shard_map``: the mesh from
      `kaisa_jax.make_mesh`. ``init`` then returns the state sharded over it
      (``kaisa_jax.partition_specs`` gives the specs for ``shard_map``).
    axis_name: for a train step under ``jax.pmap``: the pmapped axis name.
      ``init`` returns one device's state; replicate it over the devices.
    axis_size: the number of devices the pmapped axis spans (default: all,
      ``jax.device_count()``).
    assignment_cost: ``"compute"`` (``n^3``) or ``"memory"`` (``n^2``), the cost
      by which layers are assigned to devices.

  Every number but ``curvature_warmup``, ``max_cost_ratio`` and the
  distribution arguments may be an Optax schedule.
  Under ``optax.inject_hyperparams``, ``damping``, ``lr``, ``kl_clip``,
  ``factor_decay``, ``factor_update_steps`` and ``curvature_warmup`` may be
  injected (changed in the state between jitted steps); ``inv_update_steps``,
  ``max_cost_ratio``, ``grad_worker_fraction`` and ``axis_size`` decide the
  layout of the state and must be listed in ``static_args`` (a traced one raises saying so).

  Returns:
    A `KFAC` transformation (an ``optax.GradientTransformationExtraArgs``);
    ``print(tx.plan)`` lists each layer's factor shapes, treatment and device.
  """
  _check_layers(layers)
  config = config_lib.check(
    damping=damping,
    damping_form=damping_form,
    factor_decay=factor_decay,
    factor_update_steps=factor_update_steps,
    inv_update_steps=inv_update_steps,
    curvature_warmup=curvature_warmup,
    step_norm=step_norm,
    kl_clip=kl_clip,
    lr=lr,
    compute_method=compute_method,
    weight_sharing=weight_sharing,
    factor_dtype=factor_dtype,
    max_cost_ratio=max_cost_ratio,
    grad_worker_fraction=grad_worker_fraction,
    mesh=mesh,
    axis_name=axis_name,
    axis_size=axis_size,
    assignment_cost=assignment_cost,
  )
  plan = _make_plan(layers, config)
  offsets = stack_offsets(plan)

  def init_fn(params: Any) -> KFACState:
    parameters.layer_params(params, plan, "params")  # raises unless they are the layers'
    return initial_state(plan, offsets)

  def update_fn(updates, state, params=None, *, curvature: Curvature | None = None, **extra):
    del params, extra
    return _update(plan, config, updates, state, curvature)

  tx = KFAC(init_fn, update_fn)
  tx.plan = plan
  tx.damping = damping
  return tx


def _check_layers(layers: Any) -> None:
  """Raises unless ``layers`` are a model's layers with at least one to precondition."""
  if not isinstance(layers, Layers):
    raise TypeError(
      "kfac's first argument is the model's layers: grad_fn = "
      "kaisa_jax.value_and_grad(loss_fn); kaisa_jax.kfac(grad_fn.layers(params, batch), ...)"
      f"; got {type(layers).__name__}"
    )
  if not layers.specs:
    raise ValueError(
      "kfac has no layer to precondition: the loss calls no layer kind kaisa_jax captures "
      "(nn.Dense, nn.DenseGeneral, nn.Conv, nn.Embed, their NNX twins, or a type given to "
      "kaisa_jax.register_layer) on the params it is given. Compute the loss by calling "
      "model.apply(params, ...) (unjitted) or nnx.merge(graphdef, params) inside it; "
      f"print(grad_fn.layers(...)) lists what was found:\n{layers}"
    )


def _make_plan(layers: Layers, config: config_lib.Config) -> Plan:
  """The plan of ``config`` for ``layers``: the fraction, the collectives, each layer's treatment and owner.

  Warns about the modules with parameters that will not be preconditioned.
  """
  settings = config.settings
  fraction = config.grad_worker_fraction
  if fraction == distribution.AUTO:
    fraction = _auto_fraction(layers, config)
  comm = collectives_for(fraction, config.mesh, config.axis_name, config.axis_size)
  plan = make_plan(layers, comm, settings, config.mesh, config.damping_form, config.step_norm)
  unsupported = [k for k in layers.skipped if k.reason != EXCLUDED]
  if unsupported:
    warnings.warn(_skipped_warning(unsupported), stacklevel=3)
  return plan


WARNED_MODULES = 10


def _skipped_warning(skipped: Sequence[Skipped]) -> str:
  """The warning about modules that are not preconditioned: one a line, the first few."""
  lines = [
    f"kaisa_jax: {len(skipped)} module(s) with parameters will not be preconditioned (their "
    "gradients pass through unchanged):",
    *(f"  {k.name} ({k.module_type}): {k.reason}" for k in skipped[:WARNED_MODULES]),
  ]
  if len(skipped) > WARNED_MODULES:
    lines.append(f"  ... and {len(skipped) - WARNED_MODULES} more; print(tx.plan) lists them all")
  return "\n".join(lines)


def _auto_fraction(layers: Layers, config: config_lib.Config) -> Any:
  """``grad_worker_fraction="auto"``: the fraction `kaisa_jax.plan_fractions` recommends.

  A `fractions.Fraction`, or ``"comm_opt"`` on one device (nothing to choose).

  The cluster is the preset for the first device's kind
  (`kaisa_jax.cluster.cluster_of`), with the planner's default memory budget
  (`kaisa_jax.planning.budget_for`: half the device's memory). The plan must
  be the same whenever kfac is built, so the factor cadence it weighs must be
  concrete: not an array, which `optax.inject_hyperparams` traces in update.
  """
  if config.mesh is not None:
    raise ValueError(
      "grad_worker_fraction='auto' cannot change a mesh's shape: build the mesh with "
      "kaisa_jax.make_mesh(kaisa_jax.plan_fractions(layers, n_devices, cluster).recommended)"
    )
  if config.axis_name is None:
    return "comm_opt"  # one device: nothing to choose
  if isinstance(config.factor_update_steps, jax.Array):
    raise ValueError(
      "grad_worker_fraction='auto' plans with factor_update_steps, which is an array here: "
      "optax.inject_hyperparams makes it one, and traces it in update, where the plan could "
      "then differ from init's. List it in static_args, e.g. "
      f"static_args={(*hp.STATIC, 'factor_update_steps')!r}, or give a fraction"
    )
  n = jax.device_count() if config.axis_size is None else config.axis_size
  cluster = cluster_of(jax.devices()[0])
  planned = fraction_options(layers, n, cluster, budget_for(cluster), config.settings)
  if planned.recommended is None:
    raise ValueError(
      f"grad_worker_fraction='auto': no grad worker fraction on {n} devices of {cluster.name} "
      "fits K-FAC's state in the default memory budget (half the device's memory):\n"
      f"{planned}\nplan with kaisa_jax.plan_fractions(layers, n_devices, cluster, "
      "model_memory=...) and pass its recommended fraction, or use more devices"
    )
  return planned.recommended


# ------------------------------------------------------------------ the step


def _update(
  plan: Plan,
  config: config_lib.Config,
  updates: Any,
  state: KFACState,
  curvature: Curvature | None,
) -> tuple[Any, KFACState]:
  """One step: the checks, then the phases in order (the module docstring)."""
  checks.check_curvature(curvature, plan)
  checks.check_state(state, plan)
  plan.collectives.check()
  grads = parameters.layer_params(updates, plan, "updates")
  step = state.count
  dtype = preconditioning.decomposition_dtype(plan.factor_dtype)
  damping = hp.at(config.damping, step, dtype)
  in_order = check_chain_order(plan, step, grads, curvature, dtype)
  state = _update_factors_on_cadence(plan, config, state, step, curvature)
  state = _decompose_on_cadence(plan, config, state, step, damping)
  preconditioned, matrices = phases.precondition_grads(
    plan, grads, state.decompositions, damping, dtype, plan.collectives, state.stack_offsets
  )
  scales, nu = phases.step_scale(
    in_order, preconditioned, matrices, config.step_norm, config.kl_clip, config.lr, step, dtype
  )
  new_updates = phases.write_back(plan, updates, grads, preconditioned, scales, state.stack_offsets)
  return new_updates, state._replace(count=step + 1, kl_scale=nu)


def _warming_up(config: config_lib.Config, step: Array) -> Array:
  """Whether ``step`` is one of the first ``curvature_warmup``, refreshed whatever the cadences."""
  return step < jnp.asarray(config.curvature_warmup, jnp.int32)


def _update_factors_on_cadence(
  plan: Plan, config: config_lib.Config, state: KFACState, step: Array, curvature: Curvature
) -> KFACState:
  """`phases.update_factors` at the steps ``k`` with ``k % factor_update_steps == 0`` or ``k <
  curvature_warmup``; else ``state``."""
  every = hp.at(config.factor_update_steps, step, jnp.int32)
  decay = hp.at(config.factor_decay, step)
  return jax.lax.cond(
    (step % every == 0) | _warming_up(config, step),
    lambda: phases.update_factors(
      plan,
      state,
      curvature,
      decay,
      plan.factor_dtype,
      plan.collectives,
      config.weight_sharing,
    ),
    lambda: state,
  )


def _decompose_on_cadence(
  plan: Plan, config: config_lib.Config, state: KFACState, step: Array, damping: Array
) -> KFACState:
  """`phases.decompose_factors` at the steps with ``k % inv_update_steps == 0`` or ``k <
  curvature_warmup``, or if the state asks."""
  every = hp.at(config.inv_update_steps, step, jnp.int32)
  return jax.lax.cond(
    (step % every == 0) | _warming_up(config, step) | state.refresh,
    lambda: phases.decompose_factors(plan, state, damping, plan.collectives),
    lambda: state,
  )
