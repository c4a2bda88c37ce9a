"""The chain check: K-FAC must come first in an Optax chain, before any optimizer.

At the first step, the incoming updates ``V`` of one layer are compared with
the gradient its curvature implies (`gradient_alignment`): an optimizer's
step ``-lr * grad`` points against it (cosine -1, about -0.8 for Adam's first
step), the gradient along it (cosine 1). A cosine below `MIN_ALIGNMENT` raises
(`check_chain_order`); later steps skip the check, at no cost.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kaisa_jax import distribution, preconditioning
from kaisa_jax import layers as layers_lib
from kaisa_jax.capture import Curvature
from kaisa_jax.plan import Plan

Array = jax.Array

CHAIN_CHECK = "kaisa_chain_check"
# A cosine below this between kfac's incoming updates and the gradient means an
# optimizer ran first. A legitimate transformation before kfac (clipping, weight
# decay) keeps the cosine near 1; one whose result is discarded (the partial sums
# of optax.MultiSteps) may lower it, hence the margin below 0.
MIN_ALIGNMENT = -0.5


def alignment_layer(plan: Plan) -> int | None:
  """The cheapest layer whose gradient `gradient_alignment` can rebuild, if any."""
  eligible = [
    i
    for i, (spec, _) in enumerate(plan.layers)
    if spec.kind not in (*layers_lib.NORMS, layers_lib.EMBED)
    and not any(spec.layer_kind.transposed(m) for m in spec.methods)
  ]
  return min(eligible, key=lambda i: plan.layers[i][0].num_weights, default=None)


def gradient_alignment(
  spec: layers_lib.LayerSpec, entry: Any, v: Array, dtype: Any, comm: distribution.Collectives
) -> Array:
  """The cosine between ``V`` and the layer's gradient as its curvature implies it.

  The gradient is rebuilt from the captured inputs and output gradients,
  ``sum_devices sum_calls sum_rows [a, 1] g^T``: the cosine is 1 when ``V`` is
  the data-parallel gradient (or a positive multiple of it), -1 when ``V`` is
  an optimizer's step ``-lr * grad``, and about -0.8 for Adam's first step.
  """
  grad = jnp.zeros((spec.groups, spec.a_dim, spec.g_dim), dtype)
  for method, a, g in zip(spec.methods, entry.a, entry.g, strict=True):
    a_rows = layers_lib.input_rows(spec, method, a, dtype).reshape(spec.groups, -1, spec.a_dim)
    g_rows = layers_lib.output_rows(spec, method, g, dtype).reshape(spec.groups, -1, spec.g_dim)
    grad = grad + jnp.einsum("gra,gro->gao", a_rows, g_rows, precision=preconditioning.HIGHEST)
  with jax.named_scope(CHAIN_CHECK):
    grad = comm.total(grad)
  norms = jnp.linalg.norm(v) * jnp.linalg.norm(grad)
  return jnp.where(norms > 0, jnp.sum(v * grad) / jnp.where(norms > 0, norms, 1.0), 0.0)


def _one_unless_against_gradient(cosine: Any) -> np.ndarray:
  """1 (an int32) if the cosine is at least `MIN_ALIGNMENT`; raises otherwise.

  An int32, whatever the cosine's dtype: the callback may run on one of XLA's
  threads, where the caller's ``jax.enable_x64`` context does not hold, so JAX
  would turn a float64 result into a float32 one there and reject it.

  Called back from the compiled step through ``jax.pure_callback``, whose
  result the step multiplies in: unlike ``jax.debug.callback``, whose effect
  makes every call of the step take JAX's slow dispatch path (measured 1.4 ms
  per call on a 2-core CPU), a pure callback costs nothing on the steps its
  branch does not run.
  """
  if cosine < MIN_ALIGNMENT:
    raise ValueError(
      "kfac received updates that point against the gradient (cosine "
      f"{float(cosine):.2f} with the gradient its curvature implies): another optimizer runs "
      "before kfac in the chain. K-FAC preconditions the gradient, so it comes first: "
      "optax.chain(kaisa_jax.kfac(...), optax.sgd(lr, momentum=0.9))"
    )
  return np.ones((), np.int32)


def check_chain_order(
  plan: Plan,
  step: Array,
  grads: dict[str, dict[str, Array]],
  curvature: Curvature,
  dtype: Any,
) -> Array:
  """Exactly 1 in ``dtype``; at step 0, raises first if ``grads`` point against the gradient.

  The check runs under `jax.lax.cond` on the first step only, on the layer of
  `alignment_layer` (none: no check). The step multiplies the result into the
  KL clip's scale, which keeps every bit of it and keeps the check in the
  compiled program.
  """
  in_order = jnp.ones([], dtype)  # 1, or the first step raises
  check_layer = alignment_layer(plan)
  if check_layer is None:
    return in_order
  spec = plan.layers[check_layer][0]

  def check_order():
    v = layers_lib.to_matrix(spec, grads[spec.name], dtype)
    alignment = gradient_alignment(spec, curvature[spec.name], v, dtype, plan.collectives)
    shape = jax.ShapeDtypeStruct((), jnp.int32)
    one = jax.pure_callback(
      _one_unless_against_gradient, shape, alignment, vmap_method="sequential"
    )
    return one.astype(dtype)

  return jax.lax.cond(step == 0, check_order, lambda: in_order)
