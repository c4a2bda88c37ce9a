"""The state of `kaisa_jax.kfac`: its buffers, its initial value, its sharding, each layer's view.

A device holds the running averages of the factors it owns in one flat buffer
and the decompositions of its grad-worker group in another
(`kaisa_jax.assignment` lays them out); `layer_factors` and
`layer_decompositions` read them back per layer, and `partition_specs` gives
the ``shard_map`` specs of a state made for a mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kaisa_jax import distribution, preconditioning, stacking
from kaisa_jax import hyperparameters as hp
from kaisa_jax.plan import Plan
from kaisa_jax.stacking import LayerDecompositions, LayerFactors

Array = jax.Array


class KFACState(NamedTuple):
  """State of `kfac`, as one device sees it.

  Attributes:
    count: steps taken (int32).
    factor_total: ``W``, the total weight of the bias-corrected running
      average of the factors (0 before the first factor update).
    factors: ``(1, 1, F)``: the running averages of the factors this device
      owns, flattened in plan order (`kaisa_jax.layer_factors` unpacks them).
    decompositions: ``(1, W, D)``: the latest decompositions of the factors of
      every member of this device's grad-worker group.
    skipped_factor_updates: factor updates skipped because the batch's factors
      were not finite (NaN or Inf in the activations or output gradients).
    failed_decompositions: decompositions of one factor that failed or came
      back not finite; each kept that factor's last good decomposition.
    kl_scale: the length of the last step's preconditioned updates over
      K-FAC's own, ``|nu P| / |P|`` over all layers (`kaisa_jax.phases.step_scale`:
      ``sqrt(sum |V|^2 / sum |P|^2)`` when each layer takes its gradient's
      norm, or the KL clip's ``nu``; 1 at init, and with ``step_norm="natural"``
      and no clip);
      `kaisa_jax.curvature_statistics` reports it.
    refresh: decompose at the next step whatever the cadence (set when a
      checkpoint is restored with another treatment of some layer).
    stack_offsets: ``0, 1, ..., K - 1`` (int32 scalars, ``K`` the size of the
      largest stack of equal layers): where each member's result lies in its
      stack's (and, on the CPU, where the lanes of each turn of a stack's
      preconditioning loop start, `kaisa_jax.cpu_loop.in_loop`). Constants,
      held as arrays on purpose: XLA compiles an update that reads its layer
      at a constant offset into a kernel of its own for every layer, but one
      kernel for all the members of a stack when the offset is a runtime
      value, so compile time stays flat with depth.

  Under ``shard_map`` the global arrays are ``(N / W, W, ...)``: factors split
  over both mesh axes, decompositions over the receivers axis.
  """

  count: Array
  factor_total: Array
  factors: Array
  decompositions: Array
  skipped_factor_updates: Array
  failed_decompositions: Array
  kl_scale: Array
  refresh: Array
  stack_offsets: tuple[Array, ...]


def largest_stack(plan: Plan) -> int:
  """``K``, the number of members of ``plan``'s largest stack of equal layers."""
  return max((len(m) for m in plan.layout.all_stacks()), default=0)


def stack_offsets(plan: Plan) -> tuple[Array, ...]:
  """`KFACState.stack_offsets` for ``plan``: ``0, ..., K - 1``, ``K`` its largest stack."""
  return tuple(jnp.asarray(j, jnp.int32) for j in range(largest_stack(plan)))


def zero_state(plan: Plan, offsets: tuple[Array, ...], rows: int, cols: int) -> KFACState:
  """The state at step 0 on a ``rows x cols`` grid of devices: no factor, no decomposition."""
  layout = plan.layout
  dec_dtype = preconditioning.decomposition_dtype(plan.factor_dtype)
  return KFACState(
    count=jnp.zeros([], jnp.int32),
    factor_total=jnp.zeros([], jnp.float32),
    factors=jnp.zeros((rows, cols, layout.factor_size), plan.factor_dtype),
    decompositions=jnp.zeros((rows, layout.cols, layout.decomposition_size), dec_dtype),
    skipped_factor_updates=jnp.zeros([], jnp.int32),
    failed_decompositions=jnp.zeros([], jnp.int32),
    kl_scale=jnp.ones([], dec_dtype),
    refresh=jnp.zeros([], bool),
    stack_offsets=offsets,
  )


def initial_state(plan: Plan, offsets: tuple[Array, ...]) -> KFACState:
  """`zero_state` as one device holds it, or, for a mesh, the global state sharded over it."""
  layout = plan.layout
  if plan.collectives.mode != "shard_map":
    return zero_state(plan, offsets, 1, 1)
  shape = jax.eval_shape(lambda: zero_state(plan, offsets, layout.rows, layout.cols))
  shardings = jax.tree.map(
    lambda spec: NamedSharding(plan.mesh, spec), state_partition_specs(shape)
  )
  return jax.jit(
    lambda: zero_state(plan, offsets, layout.rows, layout.cols), out_shardings=shardings
  )()


def grouped_factors(plan: Plan, state: KFACState) -> dict[str, LayerFactors]:
  """Each layer's running-average factors with their leading groups axis.

  Works on a single-device state and on the global state of a mesh (outside
  ``shard_map``), where it reads each factor from the device that owns it.
  """
  out = {}
  rows, cols = state.factors.shape[:2]
  for r in range(plan.layout.rows):
    for c in range(plan.layout.cols):
      stacks = plan.layout.stacks(r, c)
      buffer = state.factors[r % rows, c % cols]
      out.update(stacking.by_member(stacks, stacking.factor_stacks(plan, buffer, stacks)))
  return {spec.name: out[i] for i, (spec, _) in enumerate(plan.layers)}


def grouped_decompositions(plan: Plan, state: KFACState) -> dict[str, LayerDecompositions]:
  """Each layer's latest decompositions with their leading groups axis (as `grouped_factors`)."""
  out = {}
  rows = state.decompositions.shape[0]
  for r in range(plan.layout.rows):
    for c in range(plan.layout.cols):
      stacks = plan.layout.stacks(r, c)
      buffer = state.decompositions[r % rows, c]
      out.update(stacking.by_member(stacks, stacking.decomposition_stacks(plan, buffer, stacks)))
  return {spec.name: out[i] for i, (spec, _) in enumerate(plan.layers)}


def _drop_groups_axis(plan: Plan, per_layer: dict[str, Any]) -> dict[str, Any]:
  """Removes the leading groups axis of the layers with one group (all but grouped convs)."""
  groups = {spec.name: spec.groups for spec, _ in plan.layers}
  return {
    name: jax.tree.map(lambda x, g=groups[name]: x[0] if g == 1 else x, value)
    for name, value in per_layer.items()
  }


def layer_factors(plan: Plan, state: KFACState) -> dict[str, LayerFactors]:
  """Each layer's running-average factors ``A`` and ``G``, from a state.

  A dense side is ``(d, d)``, a diagonal one ``(d,)``; a convolution with
  ``feature_group_count = k > 1`` has one factor per group, ``(k, d, d)``.
  Works on a single-device state and on the global state of a mesh (outside
  ``shard_map``), where it reads each factor from the device that owns it.

  Args:
    plan: the plan of the `kaisa_jax.kfac` that made the state (``kfac.plan``).
    state: its `KFACState`, as ``kaisa_jax.curvature_statistics`` finds it in
      an optimizer state, or the state itself.

  Returns:
    ``{layer name: LayerFactors(a, g)}``.
  """
  return _drop_groups_axis(plan, grouped_factors(plan, state))


def layer_decompositions(plan: Plan, state: KFACState) -> dict[str, LayerDecompositions]:
  """Each layer's latest decompositions, shaped as `layer_factors` shapes the factors.

  Args:
    plan: the plan of the `kaisa_jax.kfac` that made the state (``kfac.plan``).
    state: its `KFACState`.

  Returns:
    ``{layer name: LayerDecompositions(a, g)}``, each side a
    `kaisa_jax.preconditioning.Decomposition`.
  """
  return _drop_groups_axis(plan, grouped_decompositions(plan, state))


def state_partition_specs(state: KFACState) -> KFACState:
  """The ``shard_map`` specs of a `KFACState` made for a mesh."""
  owned = P(distribution.RECEIVERS, distribution.GRAD_WORKERS)
  group = P(distribution.RECEIVERS)
  return KFACState(P(), P(), owned, group, P(), P(), P(), P(), (P(),) * len(state.stack_offsets))


def partition_specs(tree: Any) -> Any:
  """``shard_map`` specs for an optimizer state that contains a `KFACState`.

  K-FAC's factors are split over both mesh axes, its decompositions over the
  receivers (each group holds its own); everything else is replicated.

  Args:
    tree: an optimizer state (or any pytree) holding the `KFACState` of a
      `kaisa_jax.kfac` built with ``mesh=``.

  Returns:
    A pytree of `jax.sharding.PartitionSpec` shaped like ``tree``, for
    ``jax.shard_map``'s ``in_specs`` and ``out_specs``.
  """
  return jax.tree.map(
    lambda x: state_partition_specs(_check_made_for_mesh(x)) if isinstance(x, KFACState) else P(),
    tree,
    is_leaf=lambda x: isinstance(x, KFACState),
  )


def _check_made_for_mesh(state: KFACState) -> KFACState:
  """Raises if ``state`` is a concrete one-device state (not sharded over a mesh)."""
  factors = state.factors
  if (
    isinstance(factors, jax.Array)
    and not hp.is_traced(factors)
    and not isinstance(factors.sharding, NamedSharding)
  ):
    raise ValueError(
      "this K-FAC state was made by a kfac built without mesh=, for one device: it cannot "
      "be split over a mesh. Build kaisa_jax.kfac(..., mesh=mesh) with the mesh the train "
      "step's jax.shard_map runs over (mesh = kaisa_jax.make_mesh(fraction)), and init the "
      "state with it"
    )
  return state
