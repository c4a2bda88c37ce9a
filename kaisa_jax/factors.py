"""Factor statistics: the Kronecker factors ``A`` and ``G`` of each layer.

A layer computes ``s = a W (+ b)``. In one step each example uses the weight
``U`` times: once per row that shares it, whether the rows are positions of
one call (sequence positions, output pixels) or calls of a layer applied
several times (a recurrent cell, a block reused in a loop); calls and
positions are counted alike. Use ``u`` of example ``e`` has the input row
``a_eu`` (``[a, 1]`` with a bias) and the output gradient ``g_eu``; for a loss
that averages over ``n`` examples, ``n g`` is in per-example units, so
``damping`` means the same at every batch size. With ``R`` the rows of all
calls:

* ``"expand"`` (default): every use is a sample,

  ``A = (1/R) sum_{e,u} a a^T``,   ``G = (1/n) sum_{e,u} (n g)(n g)^T``,

  the mean over uses and the per-example sum over uses. For one call of ``r``
  rows this is ``A = (1/r) sum_rows a a^T``; over calls, ``A`` is the mean of
  the calls' ``A`` weighted by their rows and ``G`` the sum of their ``G``. (The
  KAISA reference averages both over calls, so ``T`` calls of one position
  get ``1/T`` of the ``G`` of one call of ``T`` positions.)
* ``"reduce"``: each example's uses are reduced first, the inputs by their
  mean and the output gradients by their sum, over calls and positions alike,

  ``a~_e = (1/U) sum_u a_eu``,   ``g~_e = sum_u g_eu``,
  ``A = mean_e a~ a~^T``,   ``G = (1/n) sum_e (n g~)(n g~)^T``,

  cheaper, and the paper's choice when the loss has one term per example.
  Pairing the calls' rows by example needs calls over the same examples: calls
  with the same number of examples (the leading axis of their rows) are taken
  to be, and reduced together; calls with different numbers form groups of
  their own, which add as the calls of ``"expand"`` do (``A`` weighted by
  their rows, ``G`` summed). A layer applied both to the batch and to a single
  unbatched input so works, its two kinds of use counted apart.

Either way ``T`` positions of one call and ``T`` calls of one position give
the same factors. With ``F = (1/n) sum_e vec(d_e) vec(d_e)^T`` the Fisher block
of the per-example gradients ``d_e = sum_u a_eu (n g_eu)^T``: ``"reduce"`` is
exact when an example's uses share their input (``d_e = a~ (n g~)^T``) and
that input is the same in every example (one example, say); ``"expand"``
then gives ``(1/n) sum_{e,u} vec(a (n g)^T) vec(a (n g)^T)^T``, the Fisher of
the uses taken as independent terms (Eschenhagen et al., 2023,
"Kronecker-Factored Approximate Curvature for Modern Neural Network
Architectures").

The rule is about the weight's two sides, whichever of ``a`` and ``g`` lies on
them:

* A call that uses the weight transposed (``Embed.attend``, ``x W^T``) puts
  ``n g`` on the input (vocabulary) side and ``x`` on the output (features)
  side: ``A = (1/R) sum n^2 g g^T``, ``G = (1/n) sum x x^T``; the product of one
  such call is the usual one, and lookups and attends of a tied embedding add
  up as calls do.
* An embedding lookup has one-hot inputs: ``A`` is the token frequencies over
  its rows (diagonal, from counts). Lookups always expand (reducing would need
  a token histogram per example); under ``"reduce"`` they count as a group of
  their own.
* A normalisation layer gets the exact per-example Fisher block of each
  feature's ``(scale, bias)`` whatever ``weight_sharing`` says: one example's
  gradient ``v = sum_u [x^ g, g]`` sums its uses over calls and positions,
  ``A = (1/n) sum_e (n v)(n v)^T`` (2x2) and ``G = 1``; calls with different
  numbers of examples add their blocks.

A diagonal side keeps only the diagonal.

Running average: the factors start at zero and are averaged with bias
correction, ``F <- F + w (F_batch - F)`` with ``w = (1 - decay) / W`` and
``W <- decay W + (1 - decay)`` (``W`` starts at 0). With a constant decay this
is the usual exponential average divided by ``1 - decay^k``; the first factor
update gives the batch factors themselves (no identity start, so the first
steps are already preconditioned), and ``decay = 0`` keeps only the current
batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kaisa_jax import layers as layers_lib
from kaisa_jax.capture import LayerCurvature

Array = jax.Array
HIGHEST = jax.lax.Precision.HIGHEST
# One part of a layer's factors: ``A`` as a mean over its rows, ``G`` as a sum
# over them (per example), and how many rows (uses) it covers.
Part = tuple[Array, Array, int]
# One call's rows on the weight's input and output sides, and its ``n``.
Sides = tuple[Array, Array, Array]


EXPAND = "expand"
REDUCE = "reduce"
WEIGHT_SHARING = (EXPAND, REDUCE)


def second_moment(rows: Array, scale: Array | float, diagonal: bool) -> Array:
  """``scale * rows^T rows`` per group: ``(groups, d, d)``, or its diagonal."""
  if diagonal:
    return scale * jnp.sum(rows * rows, axis=1)
  return scale * jnp.einsum("grd,gre->gde", rows, rows, precision=HIGHEST)


def _flat(rows: Array) -> Array:
  """``(groups, examples, positions, d)`` as ``(groups, examples * positions, d)``."""
  return rows.reshape(rows.shape[0], -1, rows.shape[-1])


def call_sides(
  spec: layers_lib.LayerSpec, method: str, a: Array, g: Array, n: Array, dtype: Any
) -> Sides:
  """One call's rows ``(groups, examples, positions, d)`` on the weight's two sides.

  The input side holds ``[a, 1]`` and the output side ``n g``; a transposed
  call (``Embed.attend``) holds ``n g`` on the input side and ``a`` on the
  output side.
  """
  n = n.astype(dtype)
  inputs = layers_lib.input_rows(spec, method, a, dtype)
  grads = n * layers_lib.output_rows(spec, method, g, dtype)
  if spec.layer_kind.transposed(method):
    return grads, inputs, n
  return inputs, grads, n


def expand_part(sides: Sides, diagonal: tuple[bool, bool]) -> Part:
  """Every row a use: ``A = (1/r) sum_rows u u^T``, ``G = (1/n) sum_rows v v^T``."""
  u, v, n = sides
  u, v = _flat(u), _flat(v)
  rows = u.shape[1]
  return second_moment(u, 1.0 / rows, diagonal[0]), second_moment(v, 1.0 / n, diagonal[1]), rows


def reduce_part(calls: Sequence[Sides], diagonal: tuple[bool, bool]) -> Part:
  """Calls over the same examples, each example's uses reduced first.

  ``u~ = mean`` and ``v~ = sum`` over the calls' positions, then
  ``A = mean_e u~ u~^T`` and ``G = (1/n) sum_e v~ v~^T`` (``n`` of the first
  call: the calls of one loss share it).
  """
  positions = sum(u.shape[2] for u, _, _ in calls)
  u = sum(u.sum(axis=2) for u, _, _ in calls) / positions
  v = sum(v.sum(axis=2) for _, v, _ in calls)
  examples = u.shape[1]
  n = calls[0][2]
  return (
    second_moment(u, 1.0 / examples, diagonal[0]),
    second_moment(v, 1.0 / n, diagonal[1]),
    examples * positions,
  )


def lookup_part(
  spec: layers_lib.LayerSpec, ids: Array, g: Array, n: Array, diagonal: bool, dtype: Any
) -> Part:
  """An embedding lookup: ``A`` is the token frequencies (one-hot rows, from counts)."""
  counts = jnp.zeros((1, spec.a_dim), dtype).at[0, ids.reshape(-1)].add(1.0)
  n = n.astype(dtype)
  v = _flat(n * layers_lib.output_rows(spec, layers_lib.CALL, g, dtype))
  return counts / ids.size, second_moment(v, 1.0 / n, diagonal), ids.size


def combine(parts: Sequence[Part]) -> tuple[Array, Array]:
  """``A``: the parts' mean weighted by their rows; ``G``: their sum."""
  total = sum(rows for _, _, rows in parts)
  a = sum(a * (rows / total) for a, _, rows in parts)
  g = sum(g for _, g, _ in parts)
  return a, g


def by_examples(calls: Sequence[Sides]) -> list[list[Sides]]:
  """The calls grouped by their number of examples, in order of first appearance."""
  groups: dict[int, list[Sides]] = {}
  for call in calls:
    groups.setdefault(call[0].shape[1], []).append(call)
  return list(groups.values())


def _normalisation(
  spec: layers_lib.LayerSpec,
  curvature: LayerCurvature,
  diagonal: tuple[bool, bool],
  dtype: Any,
) -> tuple[Array, Array]:
  """A normalisation layer: the exact per-example Fisher block of ``(scale, bias)``.

  Per feature, one example's gradient is ``v = sum_uses [x^ g, g]``, its uses
  summed over calls and positions; ``A = (1/n) sum_examples (n v)(n v)^T``
  (2x2, or its diagonal) and ``G = 1``, so preconditioning solves
  ``(A + damping I) p = [dscale, dbias]`` per feature, whatever
  ``weight_sharing`` says. Calls with different numbers of examples add their
  blocks.
  """
  calls = []
  for method, a, g, n in zip(spec.methods, curvature.a, curvature.g, curvature.n, strict=True):
    x_rows, g_rows, n = call_sides(spec, method, a, g, n, dtype)  # [x^, 1] and n g
    calls.append((jnp.sum(x_rows * g_rows, axis=2), g_rows, n))  # (features, examples, 2)
  block = sum(
    second_moment(sum(v for v, _, _ in group), 1.0 / group[0][2], diagonal[0])
    for group in by_examples(calls)
  )
  ones = jnp.ones((spec.groups, 1) if diagonal[1] else (spec.groups, 1, 1), dtype)
  return block, ones


def batch_factors(
  spec: layers_lib.LayerSpec,
  curvature: LayerCurvature,
  diagonal: tuple[bool, bool],
  dtype: Any,
  sharing: str = EXPAND,
) -> tuple[Array, Array]:
  """The factors ``(A, G)`` of the current batch for one layer, over all its uses.

  Calls and positions count alike (see the module docstring): ``A`` is a mean
  over uses, ``G`` a sum over an example's uses. Embedding lookups and
  normalisation layers have statistics of their own.
  """
  if spec.kind in layers_lib.NORMS:
    return _normalisation(spec, curvature, diagonal, dtype)
  parts, shared = [], []
  for method, a, g, n in zip(spec.methods, curvature.a, curvature.g, curvature.n, strict=True):
    if spec.kind == layers_lib.EMBED and method == layers_lib.CALL:
      parts.append(lookup_part(spec, a, g, n, diagonal[1], dtype))
    elif sharing == REDUCE:
      shared.append(call_sides(spec, method, a, g, n, dtype))
    else:
      parts.append(expand_part(call_sides(spec, method, a, g, n, dtype), diagonal))
  parts += [reduce_part(group, diagonal) for group in by_examples(shared)]
  return combine(parts)


def running_average(old: Array, new: Array, weight: Array) -> Array:
  """``old + weight * (new - old)``, in the dtype of ``old``."""
  return (old + weight * (new - old)).astype(old.dtype)


def average_weight(total: Array, decay: Array) -> tuple[Array, Array]:
  """The bias-corrected weight of a new batch, and the updated total ``W``."""
  new_total = decay * total + (1.0 - decay)
  return (1.0 - decay) / new_total, new_total
