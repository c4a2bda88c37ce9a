"""What `kaisa_jax.kfac`'s update checks before it computes anything.

The curvature must be the one `kaisa_jax.value_and_grad` captured for the
layers the plan was made for, and the state one made by this plan: a
mismatch raises at trace time with what to do, rather than training wrongly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kaisa_jax import layers as layers_lib
from kaisa_jax.plan import Plan
from kaisa_jax.stacking import shapes
from kaisa_jax.state import KFACState, largest_stack


def check_curvature(curvature: Any, plan: Plan) -> None:
  """Raises unless ``curvature`` has every layer of ``plan``, called as traced, in fitting shapes."""
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
  checked = set()  # members of a stack with equal arrays pass or fail alike: check one
  for (spec, _), stack in zip(plan.layers, plan.layout.stack_ids, strict=True):
    entry = curvature[spec.name]
    if len(entry.a) != spec.calls:
      raise ValueError(
        f"layer {spec.name!r} was called {len(entry.a)} times, but {spec.calls} "
        "times when kfac's layers were traced"
      )
    for method, a, g in zip(spec.methods, entry.a, entry.g, strict=True):
      key = (stack, method, shapes((a, g)))
      if key not in checked:
        _check_call(spec, method, a, g)
        checked.add(key)


def _check_call(spec: layers_lib.LayerSpec, method: str, a: Any, g: Any) -> None:
  """Whether one call's captured arrays fit the layer (shapes only, nothing computed)."""
  kind = spec.layer_kind
  transposed = kind.transposed(method)
  expected = [spec.a_dim, spec.g_dim] if transposed else [spec.g_dim, spec.a_dim]
  try:
    g_rows = jax.eval_shape(lambda g: layers_lib.output_rows(spec, method, g, g.dtype), g)
    got = [g_rows.shape[-1]]
    if not (spec.kind == layers_lib.EMBED and not transposed):  # ids, not rows
      a_rows = jax.eval_shape(lambda a: layers_lib.input_rows(spec, method, a, a.dtype), a)
      got.append(a_rows.shape[-1])
  except (TypeError, ValueError) as e:
    raise ValueError(
      f"the curvature of layer {spec.name!r} does not fit its weight {spec.kernel_shape} "
      f"(input {jnp.shape(a)}, output gradient {jnp.shape(g)}): {e}"
    ) from e
  if got != expected[: len(got)]:
    raise ValueError(
      f"the curvature of layer {spec.name!r} has output and input features {got}; kfac's "
      f"layers expect {expected[: len(got)]}"
    )


def check_state(state: KFACState, plan: Plan) -> None:
  """Raises unless ``state`` was made for ``plan`` (its stack offsets tell)."""
  needed = largest_stack(plan)
  if len(state.stack_offsets) != needed:
    raise ValueError(
      f"this K-FAC state has {len(state.stack_offsets)} stack offsets where this kfac's plan "
      f"needs {needed}: it was made by another kfac. Start from this kfac's init, or "
      "carry a state over with kaisa_jax.to_portable and kaisa_jax.from_portable"
    )
