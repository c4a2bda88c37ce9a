"""Factor statistics: the Kronecker factors ``A`` and ``G`` of each layer.

For one call of a layer with ``r`` rows of input ``[a, 1]`` and output gradient
``g``, and a loss that averages over ``n`` examples:

  ``A = (1/r) sum_rows a a^T``,   ``G = (1/n) sum_rows (n g)(n g)^T``.

Multiplying ``g`` by ``n`` makes ``G`` a per-example quantity, so ``damping``
means the same at every batch size. A layer applied several times in a step
averages the factors of its calls. A diagonal side keeps only the diagonal.

Running average: the factors start at zero and are averaged with bias
correction, ``F <- F + w (F_batch - F)`` with ``w = (1 - decay) / W`` and
``W <- decay W + (1 - decay)`` (``W`` starts at 0). With a constant decay this
is the usual exponential average divided by ``1 - decay^k``; the first factor
update gives the batch factors themselves (no identity start, so the first
steps are already preconditioned), and ``decay = 0`` keeps only the current
batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kaisa_jax import layers as layers_lib
from kaisa_jax.capture import LayerCurvature

Array = jax.Array
HIGHEST = jax.lax.Precision.HIGHEST


def second_moment(rows: Array, scale: Array | float, diagonal: bool) -> Array:
  """``scale * rows^T rows`` per group: ``(groups, d, d)``, or its diagonal."""
  if diagonal:
    return scale * jnp.sum(rows * rows, axis=1)
  return scale * jnp.einsum("grd,gre->gde", rows, rows, precision=HIGHEST)


def batch_factors(
  spec: layers_lib.LayerSpec,
  curvature: LayerCurvature,
  diagonal: tuple[bool, bool],
  dtype: Any,
) -> tuple[Array, Array]:
  """The factors ``(A, G)`` of the current batch for one layer."""
  a_sum = g_sum = 0.0
  for a, g, n in zip(curvature.a, curvature.g, curvature.n, strict=True):
    a_rows = layers_lib.input_rows(spec, a, dtype)
    g_rows = layers_lib.output_rows(spec, g, dtype)
    a_sum = a_sum + second_moment(a_rows, 1.0 / a_rows.shape[1], diagonal[0])
    g_sum = g_sum + second_moment(g_rows, n.astype(dtype), diagonal[1])
  calls = len(curvature.a)
  return a_sum / calls, g_sum / calls


def running_average(old: Array, new: Array, weight: Array) -> Array:
  """``old + weight * (new - old)``, in the dtype of ``old``."""
  return (old + weight * (new - old)).astype(old.dtype)


def average_weight(total: Array, decay: Array) -> tuple[Array, Array]:
  """The bias-corrected weight of a new batch, and the updated total ``W``."""
  new_total = decay * total + (1.0 - decay)
  return (1.0 - decay) / new_total, new_total
