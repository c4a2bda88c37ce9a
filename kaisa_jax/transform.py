"""The Optax transformation: K-FAC preconditioning of a gradient.

Each step, with ``k`` the step count kept in the state:

1. if ``k % factor_update_steps == 0``: the factors of the current batch
   update the running averages (`kaisa_jax.factors`);
2. if ``k % inv_update_steps == 0``: the factors are decomposed again
   (`kaisa_jax.preconditioning`); in between the last decompositions are used;
3. every step: each layer's gradient ``V`` becomes ``P = (A (x) G + damping)^-1 V``
   and all of them are scaled by the KL clip ``nu``.

Steps 1 and 2 sit under `jax.lax.cond`: work that a step skips is not executed,
and one compiled step serves every step.
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kaisa_jax import cost, preconditioning
from kaisa_jax import factors as factors_lib
from kaisa_jax import layers as layers_lib
from kaisa_jax.capture import EXCLUDED, Curvature, Layers, Skipped

Array = jax.Array
ScalarOrSchedule = float | Callable[[Array], Any]
IntOrSchedule = int | Callable[[Array], Any]


class LayerFactors(NamedTuple):
  """Running averages of one layer's factors (a diagonal side is a vector)."""

  a: Array
  g: Array


class LayerDecompositions(NamedTuple):
  """The decompositions of one layer's two factors."""

  a: preconditioning.Decomposition
  g: preconditioning.Decomposition


class KFACState(NamedTuple):
  """State of `kfac`.

  Attributes:
    count: steps taken (int32).
    factor_total: ``W``, the total weight of the bias-corrected running
      average of the factors (0 before the first factor update).
    factors: per layer name, the running averages of ``A`` and ``G``.
    decompositions: per layer name, the latest decompositions.
  """

  count: Array
  factor_total: Array
  factors: dict[str, LayerFactors]
  decompositions: dict[str, LayerDecompositions]


@dataclasses.dataclass(frozen=True)
class Plan:
  """Every layer with the treatment it gets, and what is not preconditioned."""

  layers: tuple[tuple[layers_lib.LayerSpec, cost.Treatment], ...]
  skipped: tuple[Skipped, ...]
  inv_update_steps: int

  def __str__(self) -> str:
    lines = [f"{'layer':<28} {'kind':<6} {'A':>14} {'G':>14}  {'treatment':<22} {'cost/layer':>10}"]
    for spec, t in self.layers:
      sides = []
      for dim, diag in zip((spec.a_dim, spec.g_dim), t.diagonal, strict=True):
        shape = f"{dim}" if diag else f"{dim}x{dim}"
        sides.append(f"{spec.groups}x{shape}" if spec.groups > 1 else shape)
      ratio = cost.step_cost_ratio(spec, t, self.inv_update_steps)
      lines.append(
        f"{spec.name:<28} {spec.kind:<6} {sides[0]:>14} {sides[1]:>14}  {t!s:<22} {ratio:>9.2f}x"
      )
    for k in self.skipped:
      lines.append(f"{k.name:<28} not preconditioned ({k.module_type}): {k.reason}")
    return "\n".join(lines)


class KFAC(optax.GradientTransformationExtraArgs):
  """The transformation returned by `kfac`; ``plan`` lists what it does per layer."""

  plan: Plan


def _check_scalar(name: str, value: Any, low: float, high: float, closed_high: bool) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
    raise TypeError(f"{name} must be a real number or a schedule, got {value!r}")
  if np.ndim(value) != 0:
    raise TypeError(f"{name} must be a scalar, got shape {np.shape(value)}")
  v = float(value)
  inside = low <= v and (v <= high if closed_high else v < high)
  if not inside:
    bound = "]" if closed_high else ")"
    raise ValueError(f"{name} must lie in [{low}, {high}{bound}, got {v}")


def _check_hyperparameter(
  name: str, value: Any, low: float, high: float = float("inf"), closed_high: bool = False
) -> None:
  """Checks a float or schedule; a schedule is checked at step 0."""
  if callable(value):
    try:
      at_zero = value(jnp.asarray(0, jnp.int32))
    except Exception as e:
      raise TypeError(f"schedule {name} failed at step 0: {e}") from e
    _check_scalar(f"{name}(0)", at_zero, low, high, closed_high)
  else:
    _check_scalar(name, value, low, high, closed_high)


def _check_steps(name: str, value: Any) -> int:
  """Checks a step count or its schedule; returns its value at step 0."""
  at_zero = value(jnp.asarray(0, jnp.int32)) if callable(value) else value
  label = f"{name}(0)" if callable(value) else name
  if isinstance(at_zero, bool) or not isinstance(
    at_zero, numbers.Integral | np.ndarray | jax.Array
  ):
    raise TypeError(f"{label} must be a positive int, got {at_zero!r}")
  if np.ndim(at_zero) != 0 or not np.issubdtype(np.asarray(at_zero).dtype, np.integer):
    raise TypeError(f"{label} must be a positive int, got {at_zero!r}")
  if int(at_zero) < 1:
    raise ValueError(f"{label} must be at least 1, got {int(at_zero)}")
  return int(at_zero)


def _at(value: Any, step: Array, dtype: Any = jnp.float32) -> Array:
  return jnp.asarray(value(step) if callable(value) else value, dtype)


def _make_plan(
  layers: Layers, method: str, inv_update_steps: int, max_cost_ratio: float | None
) -> Plan:
  treated = tuple(
    (spec, cost.choose_treatment(spec, method, inv_update_steps, max_cost_ratio))
    for spec in layers.specs
  )
  return Plan(treated, layers.skipped, inv_update_steps)


def _layer_params(tree: Any, plan: Plan, what: str) -> dict[str, dict[str, Array]]:
  """Each layer's ``kernel``/``bias`` leaves in ``tree``; a clear error if absent."""
  leaves = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
  out = {}
  for spec, _ in plan.layers:
    entry = {}
    for key in ("kernel", "bias") if spec.has_bias else ("kernel",):
      path = (*spec.param_path, jax.tree_util.DictKey(key))
      leaf = leaves.get(path)
      if leaf is None:
        raise ValueError(
          f"the {what} have no {key} for layer {spec.name!r} at "
          f"{jax.tree_util.keystr(path)}: were kfac's layers traced from this model "
          "and the same params structure?"
        )
      expected = spec.kernel_shape if key == "kernel" else (spec.kernel_shape[-1],)
      if tuple(leaf.shape) != expected:
        raise ValueError(
          f"the {what} for layer {spec.name!r} {key} have shape {tuple(leaf.shape)}, "
          f"but kfac's layers say {expected}"
        )
      entry[key] = leaf
    out[spec.name] = entry
  return out


def _check_curvature(curvature: Any, plan: Plan) -> None:
  if curvature is None:
    raise ValueError(
      "kfac's update needs the curvature: pass update(grads, state, params, "
      "curvature=curvature) with the curvature from kaisa_jax.value_and_grad"
    )
  if not isinstance(curvature, dict):
    raise TypeError(
      f"curvature must be the dict from kaisa_jax.value_and_grad, got {type(curvature)}"
    )
  names = {spec.name for spec, _ in plan.layers}
  missing, extra = sorted(names - curvature.keys()), sorted(curvature.keys() - names)
  if missing or extra:
    raise ValueError(
      "the curvature does not match kfac's layers "
      f"(missing {missing}, unexpected {extra}): build kfac from "
      "grad_fn.layers(...) of the same kaisa_jax.value_and_grad that computes the curvature"
    )
  for spec, _ in plan.layers:
    entry = curvature[spec.name]
    in_features = spec.kernel_shape[-2] * spec.groups
    if len(entry.a) != spec.calls:
      raise ValueError(
        f"layer {spec.name!r} was called {len(entry.a)} times, but {spec.calls} "
        "times when kfac's layers were traced"
      )
    for a, g in zip(entry.a, entry.g, strict=True):
      if a.shape[-1] != in_features or g.shape[-1] != spec.kernel_shape[-1]:
        raise ValueError(
          f"the curvature of layer {spec.name!r} has input features {a.shape[-1]} and "
          f"output features {g.shape[-1]}; kfac's layers expect {in_features} and "
          f"{spec.kernel_shape[-1]}"
        )


def _initial_factors(spec: layers_lib.LayerSpec, t: cost.Treatment, dtype: Any) -> LayerFactors:
  shapes = [
    (spec.groups, d) if diag else (spec.groups, d, d)
    for d, diag in zip((spec.a_dim, spec.g_dim), t.diagonal, strict=True)
  ]
  return LayerFactors(*(jnp.zeros(s, dtype) for s in shapes))


def update_factors(
  plan: Plan,
  factors: dict[str, LayerFactors],
  total: Array,
  curvature: Curvature,
  decay: Array,
  dtype: Any,
) -> tuple[dict[str, LayerFactors], Array]:
  """Phase 1: folds the current batch's factors into the running averages."""
  weight, total = factors_lib.average_weight(total, decay)
  weight = weight.astype(dtype)
  out = {}
  for spec, t in plan.layers:
    batch = factors_lib.batch_factors(spec, curvature[spec.name], t.diagonal, dtype)
    out[spec.name] = LayerFactors(
      *(
        factors_lib.running_average(old, new, weight)
        for old, new in zip(factors[spec.name], batch, strict=True)
      )
    )
  return out, total


def decompose_factors(
  plan: Plan, factors: dict[str, LayerFactors], damping: Array
) -> dict[str, LayerDecompositions]:
  """Phase 2: decomposes every factor."""
  return {
    spec.name: LayerDecompositions(
      *(
        preconditioning.decompose(f, t.method, diag, damping)
        for f, diag in zip(factors[spec.name], t.diagonal, strict=True)
      )
    )
    for spec, t in plan.layers
  }


def precondition_grads(
  plan: Plan,
  grads: dict[str, dict[str, Array]],
  decompositions: dict[str, LayerDecompositions],
  damping: Array,
  dtype: Any,
) -> tuple[dict[str, Array], Array]:
  """Phase 3: each layer's preconditioned gradient matrix, and ``sum <P, V>``."""
  out, vg_sum = {}, jnp.zeros([], dtype)
  for spec, t in plan.layers:
    v = layers_lib.to_matrix(spec, grads[spec.name], dtype)
    dec = decompositions[spec.name]
    p = preconditioning.precondition(v, dec.a, dec.g, t.method, damping)
    vg_sum = vg_sum + jnp.sum(p * v)
    out[spec.name] = p
  return out, vg_sum


def kfac(
  layers: Layers,
  *,
  damping: ScalarOrSchedule = 1e-2,
  factor_decay: ScalarOrSchedule = 0.95,
  factor_update_steps: IntOrSchedule = 10,
  inv_update_steps: IntOrSchedule = 100,
  kl_clip: ScalarOrSchedule | None = 1e-3,
  lr: ScalarOrSchedule | None = None,
  compute_method: str = preconditioning.EIGEN,
  factor_dtype: Any = jnp.float32,
  max_cost_ratio: float | None = 4.0,
) -> KFAC:
  """K-FAC preconditioning as an Optax transformation.

  Turns the gradient of every captured layer into
  ``nu * (A (x) G + damping I)^-1 vec(grad)`` and passes every other gradient
  through unchanged. The result is not negated or scaled by a learning rate:
  chain it with an optimizer, ``optax.chain(kfac(...), optax.sgd(lr, 0.9))``,
  and pass ``curvature=`` (from `kaisa_jax.value_and_grad`) to ``update``.

  Args:
    layers: the model's layers, from ``grad_fn.layers(params, batch)`` where
      ``grad_fn = kaisa_jax.value_and_grad(loss_fn)``.
    damping: Tikhonov damping ``lambda >= 0`` added to the Kronecker product.
    factor_decay: running-average decay of the factors, in ``[0, 1)``; 0 keeps
      only the current batch.
    factor_update_steps: update the factors every this many steps (int >= 1).
    inv_update_steps: recompute the decompositions every this many steps.
    kl_clip: scale the preconditioned gradients by
      ``nu = min(1, sqrt(kl_clip / |lr^2 sum <P, V>|))``; ``None`` disables it.
      While it is active the step no longer depends on ``lr``.
    lr: the learning rate of the chained optimizer, used only by the KL clip
      (required when ``kl_clip`` is set).
    compute_method: ``"eigen"`` (exact damped Kronecker inverse) or
      ``"inverse"`` (``(A + damping)^-1 V (G + damping)^-1``, cheaper, a
      different regulariser for the same damping).
    factor_dtype: dtype of the factors; decompositions run in this dtype but
      never below float32, and results are cast back to the gradient dtype.
    max_cost_ratio: a layer whose preconditioning and amortised decompositions
      would cost more than this many times its own forward and backward pass
      gets a cheaper treatment (inverse method, then diagonal sides); see
      `kaisa_jax.cost`. ``None`` keeps ``compute_method`` everywhere.

  Every hyperparameter but ``compute_method``, ``factor_dtype`` and
  ``max_cost_ratio`` may be an Optax schedule (a function of the step count).

  Returns:
    A `KFAC` transformation (an ``optax.GradientTransformationExtraArgs``);
    ``print(tx.plan)`` lists each layer's factor shapes and treatment.
  """
  if not isinstance(layers, Layers):
    raise TypeError(
      "kfac's first argument is the model's layers: grad_fn = "
      "kaisa_jax.value_and_grad(loss_fn); kaisa_jax.kfac(grad_fn.layers(params, batch), ...)"
      f"; got {type(layers).__name__}"
    )
  _check_hyperparameter("damping", damping, 0.0)
  _check_hyperparameter("factor_decay", factor_decay, 0.0, 1.0)
  _check_steps("factor_update_steps", factor_update_steps)
  inv_steps_at_zero = _check_steps("inv_update_steps", inv_update_steps)
  if kl_clip is not None:
    _check_hyperparameter("kl_clip", kl_clip, 0.0)
    if lr is None:
      raise ValueError(
        "kl_clip needs the learning rate: pass lr= (the chained optimizer's), or kl_clip=None"
      )
  if lr is not None:
    _check_hyperparameter("lr", lr, 0.0)
  if compute_method not in preconditioning.METHODS:
    raise ValueError(
      f"compute_method must be one of {preconditioning.METHODS}, got {compute_method!r}"
    )
  if not jnp.issubdtype(factor_dtype, jnp.floating):
    raise TypeError(f"factor_dtype must be a floating dtype, got {factor_dtype!r}")
  if max_cost_ratio is not None:
    _check_hyperparameter("max_cost_ratio", max_cost_ratio, 0.0)
  plan = _make_plan(layers, compute_method, inv_steps_at_zero, max_cost_ratio)
  unsupported = [k for k in layers.skipped if k.reason != EXCLUDED]
  if unsupported:
    warnings.warn(
      f"kaisa_jax: {len(unsupported)} module(s) with parameters will not be preconditioned "
      "(their gradients pass through unchanged): "
      + ", ".join(f"{k.name} ({k.module_type}: {k.reason})" for k in unsupported),
      stacklevel=2,
    )
  dec_dtype = preconditioning.decomposition_dtype(factor_dtype)

  def init_fn(params: Any) -> KFACState:
    _layer_params(params, plan, "params")
    factors, decompositions = {}, {}
    for spec, t in plan.layers:
      factors[spec.name] = _initial_factors(spec, t, factor_dtype)
      decompositions[spec.name] = LayerDecompositions(
        *(
          preconditioning.initial(d, spec.groups, t.method, diag, dec_dtype)
          for d, diag in zip((spec.a_dim, spec.g_dim), t.diagonal, strict=True)
        )
      )
    return KFACState(
      count=jnp.zeros([], jnp.int32),
      factor_total=jnp.zeros([], jnp.float32),
      factors=factors,
      decompositions=decompositions,
    )

  def update_fn(updates, state, params=None, *, curvature: Curvature | None = None, **extra):
    del params, extra
    _check_curvature(curvature, plan)
    grads = _layer_params(updates, plan, "updates")
    step = state.count
    damp = _at(damping, step, dec_dtype)

    every = _at(factor_update_steps, step, jnp.int32)
    factors, total = jax.lax.cond(
      step % every == 0,
      lambda: update_factors(
        plan, state.factors, state.factor_total, curvature, _at(factor_decay, step), factor_dtype
      ),
      lambda: (state.factors, state.factor_total),
    )
    every = _at(inv_update_steps, step, jnp.int32)
    decompositions = jax.lax.cond(
      step % every == 0,
      lambda: decompose_factors(plan, factors, damp),
      lambda: state.decompositions,
    )
    preconditioned, vg_sum = precondition_grads(plan, grads, decompositions, damp, dec_dtype)
    nu = 1.0
    if kl_clip is not None:
      nu = preconditioning.kl_clip_scale(
        vg_sum, _at(kl_clip, step, dec_dtype), _at(lr, step, dec_dtype)
      )

    replacements = {}
    for spec, _ in plan.layers:
      new = layers_lib.from_matrix(spec, nu * preconditioned[spec.name])
      for key, value in new.items():
        path = (*spec.param_path, jax.tree_util.DictKey(key))
        replacements[path] = value.astype(grads[spec.name][key].dtype)
    new_updates = jax.tree_util.tree_map_with_path(
      lambda path, leaf: replacements.get(path, leaf), updates
    )
    new_state = KFACState(step + 1, total, factors, decompositions)
    return new_updates, new_state

  tx = KFAC(init_fn, update_fn)
  tx.plan = plan
  return tx
