"""The configuration of `kaisa_jax.kfac`, checked in one place.

`check` checks every argument of `kaisa_jax.kfac` but the layers and returns
a `Config`; the settings that decide a plan (each layer's treatment and owner,
the cadence the planner amortises over) are checked by `check_settings`,
which `check` calls and `kaisa_jax.plan_fractions` calls too, so both accept
and refuse the same values with the same messages. A bad value raises at
construction, before any step is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kaisa_jax import assignment, preconditioning
from kaisa_jax import factors as factors_lib
from kaisa_jax import hyperparameters as hp


@dataclasses.dataclass(frozen=True)
class Settings:
  """What decides a plan besides the layers and the devices, checked (`check_settings`).

  Attributes:
    factor_update_steps: the factor updates' cadence at step 0 (a schedule's
      first value; 1 if injected).
    inv_update_steps: the decompositions' cadence at step 0 (idem); it weighs
      each layer's decompositions in the cost of its treatments.
    compute_method: ``"eigen"`` or ``"inverse"``.
    max_cost_ratio: the cost ratio above which a layer gets a cheaper
      treatment (``None``: none).
    assignment_cost: ``"compute"`` or ``"memory"``.
    factor_dtype: the factors' floating dtype.
  """

  factor_update_steps: int
  inv_update_steps: int
  compute_method: str
  max_cost_ratio: float | None
  assignment_cost: str
  factor_dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class Config:
  """`kaisa_jax.kfac`'s arguments but the layers, checked (`check`).

  The hyperparameters that may be schedules or injected are kept as given;
  ``settings`` holds what decides the plan, the cadences at step 0.
  """

  damping: hp.ScalarOrSchedule
  damping_form: str
  factor_decay: hp.ScalarOrSchedule
  factor_update_steps: hp.IntOrSchedule
  inv_update_steps: hp.IntOrSchedule
  curvature_warmup: int | jax.Array
  step_norm: str
  kl_clip: hp.ScalarOrSchedule | None
  lr: hp.ScalarOrSchedule | None
  weight_sharing: str
  grad_worker_fraction: float | str | None
  mesh: Mesh | None
  axis_name: str | None
  axis_size: int | None
  settings: Settings


def _check_step_norm(step_norm: str, kl_clip: Any, lr: Any) -> None:
  """``kl_clip > 0``, ``lr >= 0``, ``step_norm`` one of its choices; the KL clip bounds K-FAC's own
  step and needs ``lr``; nothing else reads ``lr``."""
  if kl_clip is not None:
    hp.check_scalar("kl_clip", kl_clip, 0.0, open_low=True)
  if lr is not None:  # 0 too (a warmup's first step): the chained optimizer then moves nothing
    hp.check_scalar("lr", lr, 0.0)
  check_choice("step_norm", step_norm, preconditioning.STEP_NORMS)
  if step_norm == preconditioning.GRADIENT and kl_clip is not None:
    raise ValueError(
      "kl_clip bounds K-FAC's own step, but step_norm='gradient' (the default) gives each "
      "layer's step its gradient's norm already: pass step_norm='natural' with kl_clip= and "
      "lr= (the KAISA reference's rule), or drop kl_clip"
    )
  if kl_clip is not None and lr is None:
    raise ValueError(
      "kl_clip needs the learning rate: pass lr= (the chained optimizer's), or kl_clip=None"
    )
  if kl_clip is None and lr is not None:
    raise ValueError(
      "lr is read only by the KL clip, and no kl_clip is set: drop lr= (the chained "
      "optimizer's rate alone sets the step), or pass step_norm='natural' with kl_clip="
    )


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_factor_dtype(factor_dtype: Any) -> np.dtype:
  """``factor_dtype`` as a dtype; raises unless it names a floating one."""
  if isinstance(factor_dtype, jax.Array | np.ndarray):
    raise TypeError(
      "factor_dtype arrived as an array: optax.inject_hyperparams takes a dtype such as "
      "jnp.bfloat16 for a schedule; pass factor_dtype as a string ('bfloat16') or list it in "
      "static_args"
    )
  if not jnp.issubdtype(factor_dtype, jnp.floating):
    raise TypeError(f"factor_dtype must be a floating dtype, got {factor_dtype!r}")
  return jnp.dtype(factor_dtype)


def check_mesh(mesh: Any) -> None:
  """Raises unless ``mesh`` is ``None`` or a `jax.sharding.Mesh`.

  ``optax.inject_hyperparams`` takes every callable argument for a schedule: a
  ``Mesh`` is callable, so it arrives here as a function unless it is listed
  in ``static_args``.
  """
  if mesh is None or isinstance(mesh, Mesh):
    return
  how = ""
  if callable(mesh):
    how = (
      ": under optax.inject_hyperparams, list mesh in static_args (a Mesh is callable, so "
      f"inject_hyperparams takes it for a schedule), e.g. static_args={hp.STATIC!r}"
    )
  raise TypeError(f"mesh must be a jax.sharding.Mesh from kaisa_jax.make_mesh, got {mesh!r}{how}")


def check_settings(
  *,
  factor_update_steps: hp.IntOrSchedule,
  inv_update_steps: hp.IntOrSchedule,
  compute_method: str,
  max_cost_ratio: float | None,
  assignment_cost: str,
  factor_dtype: Any,
) -> Settings:
  """Checks what decides a plan; raises ``TypeError`` or ``ValueError`` saying what is wrong.

  The cadences are ints ``>= 1`` or schedules of them (checked at step 0),
  ``max_cost_ratio`` is ``None`` or ``> 0``, ``factor_dtype`` a floating dtype
  (or its name); ``inv_update_steps`` and ``max_cost_ratio`` must be concrete
  (`hyperparameters.static`).
  """
  inv_update_steps = hp.static("inv_update_steps", inv_update_steps)
  max_cost_ratio = hp.static("max_cost_ratio", max_cost_ratio)
  factor_steps = hp.check_steps("factor_update_steps", factor_update_steps)
  inv_steps = hp.check_steps("inv_update_steps", inv_update_steps)
  check_choice("compute_method", compute_method, preconditioning.METHODS)
  factor_dtype = _check_factor_dtype(factor_dtype)
  if max_cost_ratio is not None:
    hp.check_scalar("max_cost_ratio", max_cost_ratio, 0.0, open_low=True)
  check_choice("assignment_cost", assignment_cost, assignment.COSTS)
  return Settings(
    factor_steps, inv_steps, compute_method, max_cost_ratio, assignment_cost, factor_dtype
  )


def check(
  *,
  damping: hp.ScalarOrSchedule,
  damping_form: str | None,
  factor_decay: hp.ScalarOrSchedule,
  factor_update_steps: hp.IntOrSchedule,
  inv_update_steps: hp.IntOrSchedule,
  curvature_warmup: int,
  step_norm: str,
  kl_clip: hp.ScalarOrSchedule | None,
  lr: hp.ScalarOrSchedule | None,
  compute_method: str,
  weight_sharing: str,
  factor_dtype: Any,
  max_cost_ratio: float | None,
  grad_worker_fraction: float | str | None,
  mesh: Mesh | None,
  axis_name: str | None,
  axis_size: int | None,
  assignment_cost: str,
) -> Config:
  """Checks `kaisa_jax.kfac`'s arguments (as documented there) but the layers.

  ``damping > 0``, ``0 <= factor_decay < 1``, ``curvature_warmup`` an int
  ``>= 0``, ``kl_clip > 0`` (only with
  ``step_norm="natural"``; it needs ``lr``, which nothing else reads),
  ``lr >= 0``, numbers or schedules (checked at step 0); the plan's settings
  as `check_settings` checks them; the choices among their options. A
  ``damping_form`` of ``None`` becomes the step rule's
  (`kaisa_jax.preconditioning.default_form`).
  The mesh and the grid's size are checked when the collectives are made
  (`kaisa_jax.plan.collectives_for`).
  """
  check_mesh(mesh)
  inv_update_steps = hp.static("inv_update_steps", inv_update_steps)
  max_cost_ratio = hp.static("max_cost_ratio", max_cost_ratio)
  grad_worker_fraction = hp.static("grad_worker_fraction", grad_worker_fraction)
  axis_size = hp.static("axis_size", axis_size)
  hp.check_scalar("damping", damping, 0.0, open_low=True)
  hp.check_scalar("factor_decay", factor_decay, 0.0, 1.0)
  hp.check_count("curvature_warmup", curvature_warmup)
  settings = check_settings(
    factor_update_steps=factor_update_steps,
    inv_update_steps=inv_update_steps,
    compute_method=compute_method,
    max_cost_ratio=max_cost_ratio,
    assignment_cost=assignment_cost,
    factor_dtype=factor_dtype,
  )
  _check_step_norm(step_norm, kl_clip, lr)
  if damping_form is None:
    damping_form = preconditioning.default_form(step_norm)
  check_choice("damping_form", damping_form, preconditioning.DAMPING_FORMS)
  check_choice("weight_sharing", weight_sharing, factors_lib.WEIGHT_SHARING)
  return Config(
    damping,
    damping_form,
    factor_decay,
    factor_update_steps,
    inv_update_steps,
    curvature_warmup,
    step_norm,
    kl_clip,
    lr,
    weight_sharing,
    grad_worker_fraction,
    mesh,
    axis_name,
    axis_size,
    settings,
  )
