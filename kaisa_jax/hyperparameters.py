"""Hyperparameters: checked at construction, resolved per step.

Every numeric hyperparameter is a number or an Optax-style schedule (a function
of the step count). A schedule is checked by evaluating it at step 0.

Under ``optax.inject_hyperparams`` the transformation is built again inside the
traced step with the hyperparameters as traced scalars. Those that only enter
the step's arithmetic (`RUNTIME`) may be traced: their shape and dtype are
checked, their values were checked when the initial state was made. Those that
decide the layout of the state (`STATIC`) must be concrete: `static` says which
``static_args`` to pass. A ``jax.sharding.Mesh`` is callable, so Optax would
take it for a schedule: it is listed there too.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
ScalarOrSchedule = float | Callable[[Array], Any]
IntOrSchedule = int | Callable[[Array], Any]


RUNTIME = ("damping", "factor_decay", "factor_update_steps", "curvature_warmup", "kl_clip", "lr")
STATIC = ("inv_update_steps", "max_cost_ratio", "grad_worker_fraction", "axis_size", "mesh")


def is_traced(value: Any) -> bool:
  """Whether ``value`` is a traced array (its value is unknown while tracing)."""
  return isinstance(value, jax.core.Tracer)


def static(name: str, value: Any) -> Any:
  """``value`` as a Python number (a concrete scalar array is converted); raises if traced."""
  if is_traced(value):
    raise TypeError(
      f"kfac's {name} decides how each layer is treated and laid out when kfac is built, so "
      "it cannot be a traced value. Under optax.inject_hyperparams, keep it static: "
      f"optax.inject_hyperparams(kaisa_jax.kfac, static_args={STATIC!r}); only {RUNTIME} "
      "may be injected"
    )
  if isinstance(value, np.ndarray | jax.Array) and np.ndim(value) == 0:
    return value.item()
  return value


def _check_scalar(name: str, value: Any, low: float, high: float, open_low: bool) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
    raise TypeError(f"{name} must be a real number or a schedule, got {value!r}")
  if np.ndim(value) != 0:
    raise TypeError(f"{name} must be a scalar, got shape {np.shape(value)}")
  if is_traced(value):  # injected: checked at init, when it was concrete
    return
  v = float(value)
  above = low < v if open_low else low <= v
  if not (above and v < high):
    interval = f"{'(' if open_low else '['}{low}, {high})"
    raise ValueError(f"{name} must lie in {interval}, got {v}")


def check_scalar(
  name: str,
  value: Any,
  low: float,
  high: float = float("inf"),
  *,
  open_low: bool = False,
) -> None:
  """Checks a number or schedule (at step 0) against ``[low, high)``, or ``(low, high)`` if ``open_low``."""
  if callable(value):
    try:
      at_zero = value(jnp.asarray(0, jnp.int32))
    except Exception as e:
      raise TypeError(f"schedule {name} failed at step 0: {e}") from e
    _check_scalar(f"{name}(0)", at_zero, low, high, open_low)
  else:
    _check_scalar(name, value, low, high, open_low)


def _check_int(label: str, value: Any, what: str) -> None:
  """Raises ``TypeError`` unless ``value`` is an int or a scalar integer array (``what`` names it)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral | np.ndarray | jax.Array):
    raise TypeError(f"{label} must be {what}, got {value!r}")
  if np.ndim(value) != 0 or not jnp.issubdtype(jnp.result_type(value), jnp.integer):
    raise TypeError(f"{label} must be {what}, got {value!r}")


def check_count(name: str, value: Any) -> None:
  """Checks a count of steps: an int (or a scalar integer array, as injected) ``>= 0``."""
  if callable(value):
    raise TypeError(f"{name} must be an int, not a schedule, got {value!r}")
  _check_int(name, value, "an int")
  if not is_traced(value) and int(value) < 0:
    raise ValueError(f"{name} must be at least 0, got {int(value)}")


def check_steps(name: str, value: Any) -> int:
  """Checks a step count or its schedule; returns its value at step 0 (1 if traced)."""
  at_zero = value(jnp.asarray(0, jnp.int32)) if callable(value) else value
  label = f"{name}(0)" if callable(value) else name
  _check_int(label, at_zero, "a positive int")
  if is_traced(at_zero):  # injected: checked at init, when it was concrete
    return 1
  if int(at_zero) < 1:
    raise ValueError(f"{label} must be at least 1, got {int(at_zero)}")
  return int(at_zero)


def at(value: Any, step: Array, dtype: Any = jnp.float32) -> Array:
  """The value of a number or schedule at ``step``."""
  return jnp.asarray(value(step) if callable(value) else value, dtype)
