"""Factor statistics: the Kronecker factors ``A`` and ``G`` of each layer.

For one call of a layer with ``r`` rows of input ``[a, 1]`` and output gradient
``g``, and a loss that averages over ``n`` examples:

  ``A = (1/r) sum_rows a a^T``,   ``G = (1/n) sum_rows (n g)(n g)^T``.

Multiplying ``g`` by ``n`` makes ``G`` a per-example quantity, so ``damping``
means the same at every batch size. A layer applied several times in a step
averages the factors of its calls. A diagonal side keeps only the diagonal.

Weight sharing (Eschenhagen et al., 2023, "Kronecker-Factored Approximate
Curvature for Modern Neural Network Architectures"): when one example has
several rows that share the weight (sequence positions, output pixels), the
``"expand"`` variant (default) counts every position as a row, as above. The
``"reduce"`` variant first reduces each example's rows, the inputs by their
mean and the output gradients by their sum, then
``A = mean_examples a~ a~^T`` and ``G = (1/n) sum_examples (n g~)(n g~)^T``:
cheaper, and the paper's choice when the loss has one term per example (the
positions are pooled before the output) rather than one per position.

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


EXPAND = "expand"
REDUCE = "reduce"
WEIGHT_SHARING = (EXPAND, REDUCE)


def second_moment(rows: Array, scale: Array | float, diagonal: bool) -> Array:
  """``scale * rows^T rows`` per group: ``(groups, d, d)``, or its diagonal."""
  if diagonal:
    return scale * jnp.sum(rows * rows, axis=1)
  return scale * jnp.einsum("grd,gre->gde", rows, rows, precision=HIGHEST)


def activation_factor(rows: Array, diagonal: bool, sharing: str) -> Array:
  """``A`` from ``(groups, examples, positions, d)`` rows of layer inputs.

  ``"expand"``: every position is a row, ``A = mean_rows a a^T``.
  ``"reduce"``: the mean over positions is the example's row.
  """
  rows = rows.mean(axis=2) if sharing == REDUCE else rows.reshape(rows.shape[0], -1, rows.shape[-1])
  return second_moment(rows, 1.0 / rows.shape[1], diagonal)


def gradient_factor(rows: Array, n: Array, diagonal: bool, sharing: str) -> Array:
  """``G = (1/n) sum_rows (n g)(n g)^T`` from ``(groups, examples, positions, d)`` rows.

  ``"reduce"`` sums the gradients over positions first: one row per example.
  """
  rows = rows.sum(axis=2) if sharing == REDUCE else rows.reshape(rows.shape[0], -1, rows.shape[-1])
  return second_moment(rows, n.astype(rows.dtype), diagonal)


def _embedding_lookup(
  spec: layers_lib.LayerSpec, ids: Array, g: Array, n: Array, diagonal: bool, dtype: Any
) -> tuple[Array, Array]:
  """An embedding lookup: ``A`` is the token frequencies (one-hot rows, from counts)."""
  counts = jnp.zeros((1, spec.a_dim), dtype).at[0, ids.reshape(-1)].add(1.0)
  g_rows = layers_lib.output_rows(spec, layers_lib.CALL, g, dtype)
  return counts / ids.size, gradient_factor(g_rows, n, diagonal, EXPAND)


def _normalisation(
  spec: layers_lib.LayerSpec,
  x: Array,
  g: Array,
  n: Array,
  diagonal: tuple[bool, bool],
  dtype: Any,
) -> tuple[Array, Array]:
  """A normalisation layer: the exact per-example Fisher block of ``(scale, bias)``.

  Per feature, one example's gradient is ``v = sum_positions [x^ g, g]``;
  ``A = (1/n) sum_examples (n v)(n v)^T`` (2x2, or its diagonal) and ``G = 1``,
  so preconditioning solves ``(A + damping I) p = [dscale, dbias]`` per
  feature, whatever ``weight_sharing`` says.
  """
  a_rows = layers_lib.input_rows(spec, layers_lib.CALL, x, dtype)  # [x^, 1]
  g_rows = layers_lib.output_rows(spec, layers_lib.CALL, g, dtype)
  per_example = jnp.sum(a_rows * g_rows, axis=2)  # (features, examples, 2)
  ones = jnp.ones((spec.groups, 1) if diagonal[1] else (spec.groups, 1, 1), dtype)
  return second_moment(per_example, n.astype(dtype), diagonal[0]), ones


def batch_factors(
  spec: layers_lib.LayerSpec,
  curvature: LayerCurvature,
  diagonal: tuple[bool, bool],
  dtype: Any,
  sharing: str = EXPAND,
) -> tuple[Array, Array]:
  """The factors ``(A, G)`` of the current batch for one layer, averaged over its calls.

  A call that uses the weight transposed (``Embed.attend``) contributes its
  output gradients to ``A`` and its inputs to ``G``. Embedding lookups and
  normalisation layers have statistics of their own (above).
  """
  kind = spec.layer_kind
  a_sum = g_sum = 0.0
  for method, a, g, n in zip(spec.methods, curvature.a, curvature.g, curvature.n, strict=True):
    if spec.kind in layers_lib.NORMS:
      a_part, g_part = _normalisation(spec, a, g, n, diagonal, dtype)
    elif spec.kind == layers_lib.EMBED and method == layers_lib.CALL:
      a_part, g_part = _embedding_lookup(spec, a, g, n, diagonal[1], dtype)
    elif kind.transposed(method):
      a_part = gradient_factor(
        layers_lib.output_rows(spec, method, g, dtype), n, diagonal[0], sharing
      )
      g_part = activation_factor(
        layers_lib.input_rows(spec, method, a, dtype), diagonal[1], sharing
      )
    else:
      a_part = activation_factor(
        layers_lib.input_rows(spec, method, a, dtype), diagonal[0], sharing
      )
      g_part = gradient_factor(
        layers_lib.output_rows(spec, method, g, dtype), n, diagonal[1], sharing
      )
    a_sum, g_sum = a_sum + a_part, g_sum + g_part
  return a_sum / spec.calls, g_sum / spec.calls


def running_average(old: Array, new: Array, weight: Array) -> Array:
  """``old + weight * (new - old)``, in the dtype of ``old``."""
  return (old + weight * (new - old)).astype(old.dtype)


def average_weight(total: Array, decay: Array) -> tuple[Array, Array]:
  """The bias-corrected weight of a new batch, and the updated total ``W``."""
  new_total = decay * total + (1.0 - decay)
  return (1.0 - decay) / new_total, new_total
