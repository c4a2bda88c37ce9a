"""Stacks of equal layers, and the flat buffers that hold them.

Layers that differ only in their names form a stack (`kaisa_jax.assignment`):
each phase computes a stack as one batch, its arrays ``(k, ...)`` for ``k``
members. A device's factors and decompositions lie in flat buffers, stack
after stack in the order of `assignment.Layout.stacks`; `factor_stacks` and
`decomposition_stacks` read them back as arrays. A member is read out of its
stack at a runtime offset (`member`), so that the members of a stack share
one compiled kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kaisa_jax import assignment, distribution, preconditioning
from kaisa_jax.plan import Plan

Array = jax.Array
# Arrays of stacks, keyed by the stack's members (layer indices of the plan).
Stacks = dict[tuple[int, ...], Any]


class LayerFactors(NamedTuple):
  """One layer's factors (a diagonal side is a vector), batched over its groups."""

  a: Array
  g: Array


class LayerDecompositions(NamedTuple):
  """The decompositions of one layer's two factors."""

  a: preconditioning.Decomposition
  g: preconditioning.Decomposition


def shapes(tree: Any) -> Any:
  """Each leaf's shape and dtype."""
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def stack(trees: Sequence[Any]) -> Any:
  """Pytrees of one structure stacked along a new leading axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def select(stacks: Stacks, members: Sequence[int]) -> Any:
  """The stacked entries of ``members``: a whole stack as it is, else restacked member by member.

  On one device every stack is whole; a device that owns part of a stack takes
  its members out of the whole (every device computes every layer's statistics).
  """
  if tuple(members) in stacks:
    return stacks[tuple(members)]
  where = {i: (key, j) for key in stacks for j, i in enumerate(key)}
  return stack([jax.tree.map(lambda x, i=i: x[where[i][1]], stacks[where[i][0]]) for i in members])


def vmap(fn: Callable, stacked: Any) -> Any:
  """``jax.vmap(fn)(stacked)``; a stack of one is computed as the layer alone."""
  if jax.tree.leaves(stacked)[0].shape[0] == 1:
    return jax.tree.map(lambda x: x[None], fn(jax.tree.map(lambda x: x[0], stacked)))
  return jax.vmap(fn)(stacked)


def per_stack(plan: Plan, members: Sequence[int], fn: Callable, inputs: Sequence[Any]) -> Any:
  """``fn(spec, input)`` for every member, as one batched computation (`jax.vmap`).

  Members of a stack have the same description but for their names, so the
  first one's serves them all; members whose inputs differ in shape (a layer
  applied at two resolutions) are computed one by one.
  """
  spec = plan.layers[members[0]][0]
  if all(shapes(x) == shapes(inputs[0]) for x in inputs):
    return vmap(lambda x: fn(spec, x), stack(inputs))
  return stack([fn(plan.layers[i][0], x) for i, x in zip(members, inputs, strict=True)])


def member(stacked: Array, offsets: Sequence[Array], j: int) -> Array:
  """Member ``j`` of ``stacked``, read at its runtime offset ``offsets[j]``.

  A stack of one is read at its only place: a read is clamped into the stack,
  so that is the value whatever the offset, without a runtime read.
  """
  if stacked.shape[0] > 1:
    stacked = jax.lax.dynamic_slice_in_dim(stacked, offsets[j], 1, allow_negative_indices=False)
  return stacked[0]


def by_member(stacks: Sequence[Sequence[int]], stacked: Sequence[Any]) -> dict[int, Any]:
  """Each member's entry of its stack's arrays, by layer index."""
  return {
    i: jax.tree.map(lambda x, j=j: x[j], value)
    for members, value in zip(stacks, stacked, strict=True)
    for j, i in enumerate(members)
  }


def decomposition_arrays(dec: preconditioning.Decomposition) -> list[Array]:
  """The arrays of a decomposition, in buffer order (a side's ``None`` left out)."""
  return [x for x in dec if x is not None]


def _stacked_shapes(members: Sequence[int], shapes: Sequence[tuple[int, ...]]) -> list:
  return [(len(members), *shape) for shape in shapes]


def factor_stacks(plan: Plan, buffer: Array, stacks: Sequence[Sequence[int]]) -> list[LayerFactors]:
  """The factors of ``stacks`` (see `assignment.stacked`) in ``buffer``, each ``(k, ...)``."""
  shapes = [
    x
    for members in stacks
    for x in _stacked_shapes(members, assignment.factor_shapes(*plan.layers[members[0]]))
  ]
  parts = distribution.split(buffer, shapes)
  return [LayerFactors(parts[2 * k], parts[2 * k + 1]) for k in range(len(stacks))]


def decomposition_stacks(
  plan: Plan, buffer: Array, stacks: Sequence[Sequence[int]]
) -> list[LayerDecompositions]:
  """The decompositions of ``stacks`` in ``buffer``, each array ``(k, ...)``."""
  shapes = []
  for members in stacks:
    sides = assignment.decomposition_shapes(*plan.layers[members[0]])
    shapes += _stacked_shapes(members, [x for side in sides for x in side])
  parts = iter(distribution.split(buffer, shapes))
  out = []
  for members in stacks:
    t = plan.layers[members[0]][1]
    decs = []
    for diag in t.diagonal:
      if diag:
        decs.append(preconditioning.Decomposition(None, next(parts)))
      elif t.method == preconditioning.EIGEN:
        decs.append(preconditioning.Decomposition(next(parts), next(parts)))
      else:
        decs.append(preconditioning.Decomposition(next(parts), None))
    out.append(LayerDecompositions(*decs))
  return out
