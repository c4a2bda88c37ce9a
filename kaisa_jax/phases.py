"""The phases of a K-FAC step over stacks of equal layers, with their collectives.

Each phase computes a stack as one batch (`kaisa_jax.stacking`); on the CPU,
`kaisa_jax.cpu_loop` decides how. In the order `kaisa_jax.kfac` runs them:

1. `update_factors`: ``F <- (1 - w) F + w F_batch`` for each factor, the batch
   factors reduced onto the factor's owner (`kaisa_jax.factors`);
2. `decompose_factors`: each device decomposes the factors it owns
   (`kaisa_jax.preconditioning`); its grad-worker group receives them;
3. `precondition_grads`: ``P = (A (x) G + damping)^-1 V`` for every layer, each
   group its own layers, shared with the other groups;
4. `step_scale`: ``nu``, by which each layer's step takes its gradient's norm,
   or the KL clip's ``nu = min(1, sqrt(kl_clip / |lr^2 sum <P, V>|))``;
5. `write_back`: ``nu P`` written over each layer's update.

Each device runs the branch of its own place on the grid (`jax.lax.switch`
over ``(group, grad worker)``): what a device does not own it does not
compute.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kaisa_jax import (
  assignment,
  cpu_loop,
  distribution,
  parameters,
  preconditioning,
  stacking,
)
from kaisa_jax import factors as factors_lib
from kaisa_jax import hyperparameters as hp
from kaisa_jax import layers as layers_lib
from kaisa_jax.capture import Curvature
from kaisa_jax.plan import Plan
from kaisa_jax.stacking import LayerDecompositions, LayerFactors, Stacks
from kaisa_jax.state import KFACState

Array = jax.Array

# Named scopes of each phase's collectives (`kaisa_jax.analysis.accounting` reads them).
FACTOR_REDUCTION = "kaisa_factor_reduction"
DECOMPOSITION_SHARING = "kaisa_decomposition_sharing"
GRADIENT_SHARING = "kaisa_gradient_sharing"


def _switch(index: Array, branches: list, *operands):
  """`jax.lax.switch`, or the only branch when there is one."""
  if len(branches) == 1:
    return branches[0](*operands)
  return jax.lax.switch(index, branches, *operands)


def layer_damping_form(spec: layers_lib.LayerSpec, form: str) -> str:
  """The damping form of a layer: ``form``, but KAISA's for a normalisation layer.

  A normalisation layer's ``G`` is exactly 1 (its per-feature 2x2 block is all of
  its curvature, in ``A``), so there is no second factor to share the damping
  with: the block is solved as ``(A + damping I)^-1``.
  """
  return preconditioning.KAISA if spec.kind in layers_lib.NORMS else form


# ----------------------------------------------------------------- 1. factors


def _batch_factors(plan: Plan, curvature: Curvature, dtype: Any, sharing: str) -> Stacks:
  """Every stack's factors of the current batch, from this device's rows."""
  return {
    tuple(members): stacking.per_stack(
      plan,
      members,
      lambda spec, c, t=plan.layers[members[0]][1]: factors_lib.batch_factors(
        spec, c, t.diagonal, dtype, sharing
      ),
      [curvature[plan.layers[i][0].name] for i in members],
    )
    for members in plan.layout.all_stacks()
  }


def update_factors(
  plan: Plan,
  state: KFACState,
  curvature: Curvature,
  decay: Array,
  dtype: Any,
  comm: distribution.Collectives,
  sharing: str = factors_lib.EXPAND,
) -> KFACState:
  """Phase 1: folds the current batch's factors into the running averages.

  Every device computes the batch factors of every layer from its own rows, one
  batched computation per stack of equal layers; their mean over devices lands
  on the layer's owner only (one reduce-scatter).
  If any device's share is not finite, no device updates and the skip is
  counted.
  """
  layout = plan.layout
  weight, total = factors_lib.average_weight(state.factor_total, decay)
  batch = _batch_factors(plan, curvature, dtype, sharing)
  send = [
    distribution.flatten_into(
      [x for members in layout.stacks(r, c) for x in stacking.select(batch, members)],
      layout.factor_size,
      dtype,
    )
    for r in range(layout.rows)
    for c in range(layout.cols)
  ]
  send = jnp.stack(send).reshape(layout.rows, layout.cols, layout.factor_size)
  with jax.named_scope(FACTOR_REDUCTION):
    mine = comm.reduce_to_owners(send) / comm.size
    finite = comm.everywhere(jnp.all(jnp.isfinite(mine)))
  averaged = factors_lib.running_average(state.factors, mine, weight.astype(dtype))
  return state._replace(
    factors=jnp.where(finite, averaged, state.factors),
    factor_total=jnp.where(finite, total, state.factor_total),
    skipped_factor_updates=state.skipped_factor_updates + (~finite).astype(jnp.int32),
  )


# ------------------------------------------------------------ 2. decompositions


def _inverse_damping(
  plan: Plan, members: Sequence[int], f: LayerFactors, damping: Array
) -> tuple[Array, Array]:
  """What the inverse method adds to each of a stack's factors ``f`` (the eigen method adds
  nothing here), by the stack's damping form (`layer_damping_form`)."""
  spec, t = plan.layers[members[0]]
  form = layer_damping_form(spec, plan.damping_form)
  if t.method == preconditioning.EIGEN or form == preconditioning.KAISA:
    return damping, damping
  means = [preconditioning.factor_mean(x, d) for x, d in zip(f, t.diagonal, strict=True)]
  return preconditioning.side_damping(form, damping, *means)


class _Side(NamedTuple):
  """One side of a stack to decompose: its factors, treatment and last good decomposition.

  ``share`` is what the inverse method adds to its factors (`_inverse_damping`),
  ``members`` the stack's number of layers.
  """

  factor: Array
  method: str
  diagonal: bool
  previous: preconditioning.Decomposition
  share: Array
  members: int


def _sides(
  plan: Plan,
  stacks: Sequence[Sequence[int]],
  new: Sequence[LayerFactors],
  old: Sequence[LayerDecompositions],
  damping: Array,
) -> list[tuple[_Side, ...]]:
  """Each stack's sides (``A``, ``G``), with the inverse method's share of the damping."""
  out = []
  for members, f, last in zip(stacks, new, old, strict=True):
    t = plan.layers[members[0]][1]
    shares = _inverse_damping(plan, members, f, damping)
    out.append(
      tuple(
        _Side(factor, t.method, diag, previous, share, len(members))
        for factor, diag, previous, share in zip(f, t.diagonal, last, shares, strict=True)
      )
    )
  return out


def _matrices(x: Array, diagonal: bool) -> Array:
  """A stack's ``(k, groups, ...)`` array as one matrix (or vector, if diagonal) per row."""
  return x.reshape(-1, *x.shape[-1 if diagonal else -2 :])


def decomposition_batches(
  plan: Plan, stacks: Sequence[Sequence[int]]
) -> dict[tuple[str, bool, int], list[tuple[int, int]]]:
  """Which sides of ``stacks`` are decomposed by one batched call: those of one method, form
  (diagonal or dense) and size, keyed so. A side is named ``(i, j)``: stack ``i``'s ``A``
  (``j = 0``) or ``G`` (``j = 1``).
  """
  out: dict[tuple[str, bool, int], list[tuple[int, int]]] = {}
  for i, members in enumerate(stacks):
    spec, t = plan.layers[members[0]]
    for j, (dim, diagonal) in enumerate(zip((spec.a_dim, spec.g_dim), t.diagonal, strict=True)):
      out.setdefault((t.method, diagonal, dim), []).append((i, j))
  return out


def _decompose_alike(sides: Sequence[_Side]) -> tuple[list[list[Array]], Array]:
  """Sides of one size and treatment, from any stacks, decomposed by one batched call.

  Their matrices are joined along one axis, so a Cholesky retry is decided and
  sized per matrix (`preconditioning.decompose`). A member (one layer) any of
  whose matrices is not finite keeps its last good decomposition. Returns each
  side's arrays (buffer order, the side's shapes) and how many members failed.
  """
  method, diag = sides[0].method, sides[0].diagonal
  matrices = [_matrices(s.factor, diag) for s in sides]
  factor = jnp.concatenate(matrices)
  share = jnp.concatenate(
    [jnp.broadcast_to(s.share, s.factor.shape[: -1 if diag else -2]).reshape(-1) for s in sides]
  )
  dec = preconditioning.decompose(factor, method, diag, share)
  # Judged by the eigenvalues alone for ``eigh`` (a failed ``eigh`` returns NaN in both outputs,
  # and a non-finite factor gives non-finite eigenvalues), then per member: a layer whose groups
  # did not all succeed keeps its last decomposition whole.
  ok = preconditioning.finite_per_member(dec.basis if dec.values is None else dec.values)
  sizes = [m.shape[0] for m in matrices]
  count = sum(s.members for s in sides)
  if count != factor.shape[0]:  # grouped layers: one test per member over its groups
    firsts = np.cumsum([0] + [s.members for s in sides[:-1]])
    member = np.concatenate(
      [f + np.repeat(np.arange(s.members), n // s.members) for s, n, f in zip(sides, sizes, firsts)]
    )
    ok = jax.ops.segment_min(ok, jnp.asarray(member), count, indices_are_sorted=True)
    failed = jnp.sum(~ok, dtype=jnp.int32)
    ok = ok[member]
  else:
    failed = jnp.sum(~ok, dtype=jnp.int32)
  new = stacking.decomposition_arrays(dec)
  out, start = [], 0
  for s, n in zip(sides, sizes, strict=True):
    keep = ok[start : start + n]
    out.append(
      [
        jnp.where(
          keep.reshape(-1, *[1] * (x.ndim - 1)), x[start : start + n], y.reshape(-1, *x.shape[1:])
        ).reshape(y.shape)
        for x, y in zip(new, stacking.decomposition_arrays(s.previous), strict=True)
      ]
    )
    start += n
  return out, failed


def _decompose_owned(
  plan: Plan,
  row: int,
  col: int,
  damping: Array,
  comm: distribution.Collectives,
  dtype: Any,
  factors: Array,
  previous: Array,
) -> tuple[Array, Array]:
  """The branch of device ``(row, col)``: the buffer of its decompositions, and its failures.

  The sides of every stack it owns are decomposed by size and treatment: on
  the CPU member by member in place in the flat buffers (`_decompose_in_place`;
  its offsets are int32, so buffers of fewer than 2^31 elements), elsewhere one
  batched call for all sides alike (`decomposition_batches`, `_decompose_alike`).
  """
  layout = plan.layout
  stacks = layout.stacks(row, col)
  new = stacking.factor_stacks(plan, factors[0, 0], stacks)
  if cpu_loop.on_cpu() and max(layout.factor_size, layout.decomposition_size) < 2**31:
    flat, failures = _decompose_in_place(
      plan, stacks, new, factors[0, 0], previous[0, col], damping, comm
    )
    return flat[None, None], failures
  old = stacking.decomposition_stacks(plan, previous[0, col], stacks)
  sides = _sides(plan, stacks, new, old, damping)
  arrays: dict[tuple[int, int], list[Array]] = {}
  failures = jnp.zeros([], jnp.int32)
  for index in decomposition_batches(plan, stacks).values():
    parts, failed = _decompose_alike([sides[i][j] for i, j in index])
    arrays.update(zip(index, parts, strict=True))
    failures = failures + failed
  # Buffer order: stack by stack, each stack's A then G.
  out = [x for i, pair in enumerate(sides) for j in range(len(pair)) for x in arrays[i, j]]
  flat = distribution.flatten_into(out, plan.layout.decomposition_size, dtype)
  return comm.vary(flat[None, None], over_group=True), comm.vary(failures, over_group=True)


class _Loop(NamedTuple):
  """The members that one loop of `_decompose_in_place` decomposes: those of one treatment and shape.

  ``factor`` is the shape of a member's factor, ``arrays`` those of its decomposition's
  arrays (`assignment.decomposition_shapes`); ``sides`` lists the sides ``(i, j)`` (stack
  ``i``'s ``A`` or ``G``) whose members it holds, in order; ``at`` each member's offset of its
  factor in the factor buffer and of each of its arrays in the decomposition buffer.
  """

  method: str
  diagonal: bool
  factor: tuple[int, ...]
  arrays: tuple[tuple[int, ...], ...]
  sides: list[tuple[int, int]]
  at: list[tuple[int, ...]]


def _loops(plan: Plan, stacks: Sequence[Sequence[int]]) -> list[_Loop]:
  """The loops of `_decompose_in_place` for ``stacks``, with every member's offsets."""
  loops: dict[tuple, _Loop] = {}
  f_start = d_start = 0
  for i, members in enumerate(stacks):
    spec, t = plan.layers[members[0]]
    k = len(members)
    shapes = zip(
      assignment.factor_shapes(spec, t), assignment.decomposition_shapes(spec, t), strict=True
    )
    for j, (f_shape, d_shapes) in enumerate(shapes):
      key = (t.method, t.diagonal[j], f_shape, tuple(d_shapes))
      loop = loops.setdefault(key, _Loop(*key, [], []))
      loop.sides.append((i, j))
      f_size, d_sizes = math.prod(f_shape), [math.prod(x) for x in d_shapes]
      d_starts = d_start + np.cumsum([0] + [k * n for n in d_sizes[:-1]])
      for m in range(k):
        loop.at.append((f_start + m * f_size, *(int(s + m * n) for s, n in zip(d_starts, d_sizes))))
      f_start += k * f_size
      d_start += k * sum(d_sizes)
  return list(loops.values())


def _decompose_in_place(
  plan: Plan,
  stacks: Sequence[Sequence[int]],
  new: Sequence[LayerFactors],
  factors: Array,
  previous: Array,
  damping: Array,
  comm: distribution.Collectives,
) -> tuple[Array, Array]:
  """On the CPU: every owned side decomposed member by member, written over ``previous``.

  One `jax.lax.fori_loop` for each treatment and shape (`_loops`): each turn
  reads one member's factor out of the flat factor buffer, decomposes it
  (`preconditioning.decompose`) and writes its arrays into the flat
  decomposition buffer, or keeps the member's last good decomposition if any of
  them is not finite. Every read and write is at an offset from a table, so the
  program holds a handful of kernels per loop whatever the number of members:
  XLA's CPU backend compiles one kernel per distinct fused computation, and a
  slice at a fixed offset is one of its own. Each matrix is decomposed alone,
  as in the batched call.
  """
  shares = [_inverse_damping(plan, m, f, damping) for m, f in zip(stacks, new, strict=True)]
  # The loops' carries are typed as they leave the branch (see `comm.vary`).
  failures = comm.vary(jnp.zeros([], jnp.int32), over_group=True)
  flat = comm.vary(previous, over_group=True)
  for loop in _loops(plan, stacks):
    # Each member's share of the damping, one per group (the eigen method ignores it).
    groups = loop.factor[0]
    share = jnp.concatenate(
      [jnp.broadcast_to(shares[i][j], (len(stacks[i]), groups)) for i, j in loop.sides]
    )
    flat, failures = _decompose_members(loop, factors, previous, share, flat, failures)
  return flat, failures


def _decompose_members(
  loop: _Loop, factors: Array, previous: Array, share: Array, flat: Array, failures: Array
) -> tuple[Array, Array]:
  """One loop of `_decompose_in_place`: ``flat`` (``previous`` as the loops write it) with each
  member's arrays written in; ``share`` is each member's damping for the inverse method.
  """
  at = jnp.asarray(loop.at, jnp.int32)

  def turn(m, carry):
    flat, failed = carry
    factor = jax.lax.dynamic_slice_in_dim(factors, at[m, 0], math.prod(loop.factor))
    dec = preconditioning.decompose(
      factor.reshape(loop.factor), loop.method, loop.diagonal, share[m]
    )
    arrays = stacking.decomposition_arrays(dec)
    # Judged by the eigenvalues alone for ``eigh``, as in `_decompose_alike`.
    ok = jnp.all(jnp.isfinite(arrays[0] if dec.values is None else dec.values))
    for x, offset, shape in zip(arrays, at[m, 1:], loop.arrays, strict=True):
      last = jax.lax.dynamic_slice_in_dim(previous, offset, math.prod(shape))
      new = jnp.where(ok, x.reshape(-1).astype(flat.dtype), last)
      flat = jax.lax.dynamic_update_slice_in_dim(flat, new, offset, 0)
    return flat, failed + (~ok).astype(jnp.int32)

  return jax.lax.fori_loop(0, len(loop.at), turn, (flat, failures))


def decompose_factors(
  plan: Plan,
  state: KFACState,
  damping: Array,
  comm: distribution.Collectives,
) -> KFACState:
  """Phase 2: each device decomposes the factors it owns; its group receives them.

  The factors of one size and treatment that a device owns, whatever their
  stacks, are decomposed by one batched call; on the CPU by one loop, member
  by member in place in the flat buffers. A decomposition that is not
  finite (a failed ``eigh`` or Cholesky; for ``eigh``, its eigenvalues) keeps
  the factor's previous decomposition and is counted. The inverse method damps
  each factor here by its share of the damping of the plan's form
  (`preconditioning.side_damping`).
  """
  layout = plan.layout
  dtype = preconditioning.decomposition_dtype(state.factors.dtype)
  branches = [
    functools.partial(_decompose_owned, plan, r, c, damping, comm, dtype)
    for r in range(layout.rows)
    for c in range(layout.cols)
  ]
  mine, failures = _switch(comm.index(), branches, state.factors, state.decompositions)
  with jax.named_scope(DECOMPOSITION_SHARING):
    gathered = comm.gather_group(mine)
    failures = comm.total(failures)
  return state._replace(
    decompositions=gathered,
    failed_decompositions=state.failed_decompositions + failures,
    refresh=jnp.zeros([], bool),
  )


# ------------------------------------------------------------ 3. preconditioning


def _gradient_matrices(plan: Plan, grads: dict[str, dict[str, Array]], dtype: Any) -> Stacks:
  """Every stack's gradients as matrices ``V``, ``(k, groups, a_dim, g_dim)``."""
  return {
    tuple(members): stacking.per_stack(
      plan,
      members,
      lambda spec, g: layers_lib.to_matrix(spec, g, dtype),
      [grads[plan.layers[i][0].name] for i in members],
    )
    for members in plan.layout.all_stacks()
  }


def _stack_preconditioner(plan: Plan, members: Sequence[int]) -> Callable:
  """``fn(V, A, G, damping)``: the preconditioned gradient of a stack's members."""
  spec, t = plan.layers[members[0]]
  layer_form = layer_damping_form(spec, plan.damping_form)

  def fn(v, a, g, d, method=t.method, layer_form=layer_form):
    return preconditioning.precondition(v, a, g, method, d, layer_form)

  return fn


def _precondition_group(
  plan: Plan,
  row: int,
  matrices: Stacks,
  damping: Array,
  dtype: Any,
  comm: distribution.Collectives,
  offsets: Sequence[Array],
  decompositions: Array,
) -> Array:
  """The branch of group ``row``: its layers' preconditioned gradients, one flat buffer.

  A stack is preconditioned at once (`cpu_loop.at_once`), or, for a deep
  stack on the CPU, in a loop (`cpu_loop.in_loop`) that writes its members
  over zeros left for them in the buffer.
  """
  layout = plan.layout
  parts, loops, start = [], [], 0
  for col in range(layout.cols):
    mine = layout.stacks(row, col)
    decs = stacking.decomposition_stacks(plan, decompositions[0, col], mine)
    for s, (members, dec) in enumerate(zip(mine, decs, strict=True)):
      fn = _stack_preconditioner(plan, members)
      v = stacking.select(matrices, members)
      if cpu_loop.looped(len(members)):

        def inputs(v=v, s=s, col=col, mine=mine):  # read inside the loop, where used
          return v, *stacking.decomposition_stacks(plan, decompositions[0, col], mine)[s]

        parts.append(jnp.zeros(v.shape, dtype))
        loops.append((fn, inputs, start))
      else:
        parts.append(cpu_loop.at_once(fn, (v, dec.a, dec.g), offsets, damping))
      start += v.size
  flat = distribution.flatten_into(parts, layout.gradient_size, dtype)
  for member_fn, stacks, at in loops:  # each writes over its stack's zeros
    flat = cpu_loop.in_loop(member_fn, stacks, flat, at, offsets, damping)
  return comm.vary(flat[None], over_group=False)


def _received(plan: Plan, everyone: Array, matrices: Stacks) -> Stacks:
  """Every stack's preconditioned gradients out of the groups' gathered buffers."""
  layout = plan.layout
  shape = {i: m.shape[1:] for key, m in matrices.items() for i in key}
  received = {}
  for r in range(layout.rows):
    group = layout.group_stacks(r)
    parts = distribution.split(everyone[r], [(len(m), *shape[m[0]]) for m in group])
    received.update(zip(map(tuple, group), parts, strict=True))
  return {tuple(m): stacking.select(received, m) for m in layout.all_stacks()}


def precondition_grads(
  plan: Plan,
  grads: dict[str, dict[str, Array]],
  decompositions: Array,
  damping: Array,
  dtype: Any,
  comm: distribution.Collectives,
  offsets: Sequence[Array],
) -> tuple[Stacks, Stacks]:
  """Phase 3: the preconditioned gradient matrices, stack by stack, and the gradients'.

  Returns ``P`` and ``V`` per stack of `assignment.Layout.all_stacks` (keyed by
  its members, ``(k, groups, a_dim, g_dim)``). Each group
  preconditions its own layers, one batched product per stack of equal
  shapes (on the CPU member by member, in a loop for a deep stack, see
  `kaisa_jax.cpu_loop`; ``offsets`` are `KFACState.stack_offsets`); the
  other groups receive them (one all-gather).
  """
  matrices = _gradient_matrices(plan, grads, dtype)
  branches = [
    functools.partial(_precondition_group, plan, r, matrices, damping, dtype, comm, offsets)
    for r in range(plan.layout.rows)
  ]
  row, _ = comm.position()
  mine = _switch(row, branches, decompositions)
  with jax.named_scope(GRADIENT_SHARING):
    everyone = comm.gather_receivers(mine)
  preconditioned = _received(plan, everyone, matrices)
  return preconditioned, matrices


# ---------------------------------------------------- 4. step scale, 5. write-back


def _member_sums(products: Sequence[Array]) -> Array:
  """``(len(products), k)``: each product summed over each member of its stack.

  One reduction per stack, of the products stacked (one kernel to compile per
  stack, as for one sum).
  """
  k = products[0].shape[0]
  return jnp.sum(jnp.stack(products).reshape(len(products), k, -1), axis=2)


def _per_member(values: Array, stacked: Array) -> Array:
  """``values`` of shape ``(k,)`` shaped to scale the ``k`` members of ``stacked``."""
  return values.reshape(-1, *[1] * (stacked.ndim - 1))


def step_scale(
  in_order: Array,
  preconditioned: Stacks,
  matrices: Stacks,
  step_norm: str,
  kl_clip: hp.ScalarOrSchedule | None,
  lr: hp.ScalarOrSchedule | None,
  step: Array,
  dtype: Any,
) -> tuple[Stacks, Array]:
  """Phase 4: the scale ``nu`` of each stack's preconditioned updates, times ``in_order``.

  ``step_norm="gradient"``: each layer's own ``nu = |V| / |P|``, one per
  member of each stack; ``"natural"``: the KL clip's
  ``nu = min(1, sqrt(kl_clip / |lr^2 sum <P, V>|))`` over every layer, or 1
  without a clip (`kaisa_jax.preconditioning`). ``in_order`` is the chain
  check's exact 1 (`kaisa_jax.chain_order`): the product leaves every bit of
  ``nu`` as it was.

  Also returns the preconditioned layers' update norm over K-FAC's own,
  ``|nu P| / |P|`` over all of them (the state's ``kl_scale``): the KL clip's
  ``nu``, or ``sqrt(sum |V|^2 / sum |P|^2)``. Each sum is taken stack by stack,
  whatever the layout, so every ``nu`` is bit for bit the same for every grad
  worker fraction.
  """
  if step_norm == preconditioning.GRADIENT:
    sums = {key: _member_sums([p * p, matrices[key] ** 2]) for key, p in preconditioned.items()}
    scales = {
      key: in_order * _per_member(preconditioning.gradient_norm_scale(pp, vv), preconditioned[key])
      for key, (pp, vv) in sums.items()
    }
    pp, vv = sum(jnp.sum(s, axis=1) for s in sums.values())
    return scales, preconditioning.gradient_norm_scale(pp, vv)
  nu = in_order
  if kl_clip is not None:
    pv = sum(jnp.sum(p * matrices[key]) for key, p in preconditioned.items())
    nu = nu * preconditioning.kl_clip_scale(pv, hp.at(kl_clip, step, dtype), hp.at(lr, step, dtype))
  return {key: nu for key in preconditioned}, nu


def write_back(
  plan: Plan,
  updates: Any,
  grads: dict[str, dict[str, Array]],
  preconditioned: Stacks,
  scales: Stacks,
  offsets: Sequence[Array],
) -> Any:
  """Phase 5: ``updates`` with each layer's weight and bias replaced by those of ``nu P``.

  ``scales``: each stack's ``nu`` (`step_scale`).

  Each stack is turned back into parameter shapes as one batch; each member
  is read out at its runtime offset and cast to its gradient's dtype. Every
  other leaf passes through unchanged.
  """
  replacements: parameters.Replacements = {}
  for members, p in preconditioned.items():
    first = plan.layers[members[0]][0]  # members share their shapes
    stacked = stacking.vmap(
      lambda v, spec=first: layers_lib.from_matrix(spec, v), scales[members] * p
    )
    for j, i in enumerate(members):
      spec = plan.layers[i][0]
      for key, value in stacked.items():
        value = stacking.member(value, offsets, j).astype(grads[spec.name][key].dtype)
        path = parameters.leaf_path(spec, key)
        replacements.setdefault(path, []).append((spec.param_index, value))
  return parameters.with_replacements(updates, replacements)
