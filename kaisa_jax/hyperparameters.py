"""Hyperparameters: checked at construction, resolved per step.

Every numeric hyperparameter is a number or an Optax-style schedule (a function
of the step count). A schedule is checked by evaluating it at step 0.
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


def _check_scalar(
  name: str, value: Any, low: float, high: float, open_low: bool, closed_high: bool
) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
    raise TypeError(f"{name} must be a real number or a schedule, got {value!r}")
  if np.ndim(value) != 0:
    raise TypeError(f"{name} must be a scalar, got shape {np.shape(value)}")
  v = float(value)
  above = low < v if open_low else low <= v
  below = v <= high if closed_high else v < high
  if not (above and below):
    interval = f"{'(' if open_low else '['}{low}, {high}{']' if closed_high else ')'}"
    raise ValueError(f"{name} must lie in {interval}, got {v}")


def check_scalar(
  name: str,
  value: Any,
  low: float,
  high: float = float("inf"),
  *,
  open_low: bool = False,
  closed_high: bool = False,
) -> None:
  """Checks a number or schedule against the interval ``[low, high)`` (or open/closed ends)."""
  if callable(value):
    try:
      at_zero = value(jnp.asarray(0, jnp.int32))
    except Exception as e:
      raise TypeError(f"schedule {name} failed at step 0: {e}") from e
    _check_scalar(f"{name}(0)", at_zero, low, high, open_low, closed_high)
  else:
    _check_scalar(name, value, low, high, open_low, closed_high)


def check_steps(name: str, value: Any) -> int:
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


def at(value: Any, step: Array, dtype: Any = jnp.float32) -> Array:
  """The value of a number or schedule at ``step``."""
  return jnp.asarray(value(step) if callable(value) else value, dtype)
