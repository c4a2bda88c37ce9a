"""The Optax transformation: K-FAC preconditioning of a gradient, optionally distributed.

Each step, with ``k`` the step count kept in the state:

1. if ``k % factor_update_steps == 0``: the factors of the current batch
   update the running averages (`kaisa_jax.factors`); each layer's factors are
   reduced over the data-parallel devices onto the one device that owns it;
2. if ``k % inv_update_steps == 0``: every device decomposes the factors it
   owns (`kaisa_jax.preconditioning`) and shares them within its grad-worker
   group; in between the last decompositions are used;
3. every step: each group preconditions its layers' gradients,
   ``P = (A (x) G + damping)^-1 V``, shares them with the other groups, and all
   of them are scaled by the KL clip ``nu``.

Steps 1 and 2 sit under `jax.lax.cond`: work that a step skips is not executed,
and one compiled step serves every step. The state is stored in slots (see
`kaisa_jax.assignment`): on one device, one slot per layer. Layers that differ
only in their names (the blocks of a transformer, the convolutions of a ResNet
stage) form stacks: each phase computes a stack as one batch (`jax.vmap` of the
per-layer computation, batched ``eigh``, Cholesky and matrix products), so the
compiled step does not grow with the number of equal layers but with the number
of stacks. Each member's numbers are bit for bit those it has computed alone;
the KL clip's sum over layers adds stack by stack, so with the clip on a step
agrees with one computed layer by layer to float32 rounding.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kaisa_jax import assignment, cost, distribution, preconditioning
from kaisa_jax import factors as factors_lib
from kaisa_jax import hyperparameters as hp
from kaisa_jax import layers as layers_lib
from kaisa_jax.capture import EXCLUDED, Curvature, Layers, Skipped, plain_path
from kaisa_jax.cluster import cluster_of
from kaisa_jax.plan import Plan, collectives_for, make_plan
from kaisa_jax.planning import plan_fractions

Array = jax.Array

FACTOR_REDUCTION = "kaisa_factor_reduction"
DECOMPOSITION_SHARING = "kaisa_decomposition_sharing"
GRADIENT_SHARING = "kaisa_gradient_sharing"
CHAIN_CHECK = "kaisa_chain_check"


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
    kl_scale: the KL clip's scale ``nu`` of the last step (1 at init, and at
      every step without ``kl_clip``); `kaisa_jax.curvature_statistics`
      reports it.
    refresh: decompose at the next step whatever the cadence (set when a
      checkpoint is restored with another treatment of some layer).
    stack_offsets: ``0, 1, ..., K - 1`` (int32 scalars, ``K`` the size of the
      largest stack of equal layers): where each member's result lies in its
      stack's (and, on the CPU, where the lanes of each turn of a stack's
      preconditioning loop start, `_in_loop`). Constants, held as arrays
      on purpose: XLA compiles an update that reads its layer at a constant
      offset into a kernel of its own for every layer, but one kernel for all
      the members of a stack when the offset is a runtime value, so compile
      time stays flat with depth.

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


class LayerFactors(NamedTuple):
  """One layer's factors (a diagonal side is a vector), batched over its groups."""

  a: Array
  g: Array


class LayerDecompositions(NamedTuple):
  """The decompositions of one layer's two factors."""

  a: preconditioning.Decomposition
  g: preconditioning.Decomposition


class KFAC(optax.GradientTransformationExtraArgs):
  """The transformation returned by `kfac`.

  ``plan`` lists what it does per layer; ``damping`` is its damping as given
  (a number or a schedule), which `kaisa_jax.curvature_statistics` reads.
  """

  plan: Plan
  damping: hp.ScalarOrSchedule


def _layer_params(tree: Any, plan: Plan, what: str) -> dict[str, dict[str, Array]]:
  """Each layer's ``kernel``/``bias`` leaves in ``tree``; a clear error if absent.

  NNX leaves are found as variables and as plain arrays alike (`plain_path`).
  """
  leaves = {plain_path(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
  out = {}
  for spec, _ in plan.layers:
    entry = {}
    kind = spec.layer_kind
    for key in (kind.weight, kind.bias) if spec.has_bias else (kind.weight,):
      path = (*spec.param_path, jax.tree_util.DictKey(key), *spec.param_suffix)
      leaf = leaves.get(plain_path(path))
      if leaf is not None and spec.param_index:
        leaf = leaf[spec.param_index]
      if leaf is None:
        raise ValueError(
          f"the {what} have no {key} for layer {spec.name!r} at "
          f"{jax.tree_util.keystr(path)}: were kfac's layers traced from this model "
          "and the same params structure?"
        )
      expected = spec.kernel_shape if key == kind.weight else spec.kernel_shape[spec.in_ndim :]
      if tuple(leaf.shape) != expected:
        raise ValueError(
          f"the {what} for layer {spec.name!r} {key} have shape {tuple(leaf.shape)}, "
          f"but kfac's layers say {expected}"
        )
      entry[key] = leaf
    out[spec.name] = entry
  return out


def _replace(leaf: Array, parts: Sequence[tuple[tuple[int, ...], Array]]) -> Array:
  """``leaf`` with each ``(index, value)`` of ``parts`` written at ``leaf[index]``.

  A layer with parameters of its own has one part, at index ``()``; parameters
  stacked by ``nn.scan`` have one part per layer of the stack.
  """
  for index, value in parts:
    leaf = value if index == () else leaf.at[index].set(value)
  return leaf


def _check_curvature(curvature: Any, plan: Plan) -> None:
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
      key = (stack, method, _shapes((a, g)))
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


def _decomposition_arrays(dec: preconditioning.Decomposition) -> list[Array]:
  return [x for x in dec if x is not None]


def _stacked_shapes(members: Sequence[int], shapes: Sequence[tuple[int, ...]]) -> list:
  return [(len(members), *shape) for shape in shapes]


def _factor_stacks(
  plan: Plan, buffer: Array, stacks: Sequence[Sequence[int]]
) -> list[LayerFactors]:
  """The factors of ``stacks`` (see `assignment.stacked`) in ``buffer``, each ``(k, ...)``."""
  shapes = [
    x
    for members in stacks
    for x in _stacked_shapes(members, assignment.factor_shapes(*plan.layers[members[0]]))
  ]
  parts = distribution.split(buffer, shapes)
  return [LayerFactors(parts[2 * k], parts[2 * k + 1]) for k in range(len(stacks))]


def _decomposition_stacks(
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


def _members(stacks: Sequence[Sequence[int]], stacked: Sequence[Any]) -> dict[int, Any]:
  """Each member's entry of its stack's arrays, by layer index."""
  return {
    i: jax.tree.map(lambda x, j=j: x[j], value)
    for members, value in zip(stacks, stacked, strict=True)
    for j, i in enumerate(members)
  }


Stacks = dict[tuple[int, ...], Any]


def _stack(trees: Sequence[Any]) -> Any:
  """Pytrees of one structure stacked along a new leading axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _select(stacks: Stacks, members: Sequence[int]) -> Any:
  """The stacked entries of ``members``: a whole stack as it is, else restacked member by member.

  On one device every stack is whole; a device that owns part of a stack takes
  its members out of the whole (every device computes every layer's statistics).
  """
  if tuple(members) in stacks:
    return stacks[tuple(members)]
  where = {i: (key, j) for key in stacks for j, i in enumerate(key)}
  return _stack([jax.tree.map(lambda x, i=i: x[where[i][1]], stacks[where[i][0]]) for i in members])


def _shapes(tree: Any) -> Any:
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def _vmap(fn, stacked: Any) -> Any:
  """``jax.vmap(fn)(stacked)``; a stack of one is computed as the layer alone."""
  if jax.tree.leaves(stacked)[0].shape[0] == 1:
    return jax.tree.map(lambda x: x[None], fn(jax.tree.map(lambda x: x[0], stacked)))
  return jax.vmap(fn)(stacked)


def _member(stack: Array, offsets: Sequence[Array], j: int, keepdims: bool = False) -> Array:
  """Member ``j`` of ``stack``, read at its runtime offset ``offsets[j]``.

  A stack of one is read at its only place: a read is clamped into the stack,
  so that is the value whatever the offset, without a runtime read.
  """
  if stack.shape[0] > 1:
    stack = jax.lax.dynamic_slice_in_dim(stack, offsets[j], 1, allow_negative_indices=False)
  return stack if keepdims else stack[0]


# On the CPU: a stack of more than LOOP_FROM members is computed in a loop, LANES
# members side by side in each turn (`_in_loop`); a smaller one member by member
# (`_at_once`). Measured on 2 cores, stacks of Dense(128): the loop compiles more
# slowly than the members one by one up to 48 members, as fast at 64 and twice as
# fast at 128.
LOOP_FROM = 64
LANES = 8


def _looped(k: int) -> bool:
  """Whether a stack of ``k`` members is computed in a loop (`_in_loop`) rather than at once."""
  return k > LOOP_FROM and jax.default_backend() == "cpu"


def _at_once(fn, stacks: tuple, offsets: Sequence[Array], *shared: Any) -> Array:
  """``fn(*stacks, *shared)``, ``fn`` batched over the stacks' leading axis; on the CPU, member by member.

  XLA's CPU backend runs a batched matrix product as one kernel over the
  batch, slower than separate products that its threads run side by side, so
  on the CPU each member is computed alone, read at its runtime offset
  (`_member`) so that the members' kernels compile once, and the results are
  joined. Elsewhere (a GPU) one batched call.
  """
  k = jax.tree.leaves(stacks)[0].shape[0]
  if k == 1 or jax.default_backend() != "cpu":
    return fn(*stacks, *shared)
  member_fn = jax.jit(fn, inline=True)  # traced once, inlined for each member
  parts = [
    member_fn(*jax.tree.map(lambda x, j=j: _member(x, offsets, j, keepdims=True), stacks), *shared)
    for j in range(k)
  ]
  return jnp.concatenate(parts)


def _in_loop(fn, stacks, flat: Array, start: int, offsets: Sequence[Array], *shared: Any) -> Array:
  """``flat`` with ``fn(*stacks(), *shared)`` written in place from ``start``, in a loop.

  For a stack of more than `LOOP_FROM` members on the CPU (`_looped`): a
  `jax.lax.fori_loop` of ``ceil(k / LANES)`` turns, each computing up to
  `LANES` members independently of each other, so that the CPU's threads run
  them side by side, as `_at_once` does with all ``k``. The program then holds
  ``fn`` `LANES` times per stack whatever the stack's size. ``stacks`` is
  called inside the loop, so that each member is read where it lies (no copy of
  the stacks), and each result is written in place into ``flat``. Each turn's
  members start at the runtime ``offsets`` (`KFACState.stack_offsets`), so
  their reads and writes share compiled kernels. Each member is computed by the
  operations that compute it alone.
  """
  k = jax.tree.leaves(jax.eval_shape(stacks))[0].shape[0]
  turns = -(-k // LANES)
  lanes = -(-k // turns)  # lanes * turns - k < turns: members computed twice, in the last turn
  member_fn = jax.jit(fn, inline=True)  # traced once, inlined for each lane
  size = jax.eval_shape(lambda: fn(*jax.tree.map(lambda x: x[:1], stacks()), *shared)).size

  def turn(i, flat):
    whole = stacks()
    for lane in range(lanes):
      j = jnp.minimum(i + offsets[lane] * turns, k - 1)
      member = jax.tree.map(lambda x, j=j: jax.lax.dynamic_slice_in_dim(x, j, 1), whole)
      flat = jax.lax.dynamic_update_slice(
        flat, member_fn(*member, *shared).reshape(-1), (start + j * size,)
      )
    return flat

  return jax.lax.fori_loop(0, turns, turn, flat)


def _per_stack(plan: Plan, members: Sequence[int], fn, inputs: Sequence[Any]) -> Any:
  """``fn(spec, input)`` for every member, as one batched computation (`jax.vmap`).

  Members of a stack have the same description but for their names, so the
  first one's serves them all; members whose inputs differ in shape (a layer
  applied at two resolutions) are computed one by one.
  """
  spec = plan.layers[members[0]][0]
  if all(_shapes(x) == _shapes(inputs[0]) for x in inputs):
    return _vmap(lambda x: fn(spec, x), _stack(inputs))
  return _stack([fn(plan.layers[i][0], x) for i, x in zip(members, inputs, strict=True)])


def stack_offsets(plan: Plan) -> tuple[Array, ...]:
  """`KFACState.stack_offsets` for ``plan``: ``0, ..., K - 1``, ``K`` its largest stack."""
  largest = max((len(m) for m in plan.layout.all_stacks()), default=0)
  return tuple(jnp.asarray(j, jnp.int32) for j in range(largest))


def _switch(index: Array, branches: list, *operands):
  """`jax.lax.switch`, or the only branch when there is one."""
  if len(branches) == 1:
    return branches[0](*operands)
  return jax.lax.switch(index, branches, *operands)


def _alignment_layer(plan: Plan) -> int | None:
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


# A cosine below this between kfac's incoming updates and the gradient means an
# optimizer ran first. A legitimate transformation before kfac (clipping, weight
# decay) keeps the cosine near 1; one whose result is discarded (the partial sums
# of optax.MultiSteps) may lower it, hence the margin below 0.
MIN_ALIGNMENT = -0.5


def _one_unless_against_gradient(cosine: Any) -> np.ndarray:
  """1 (an int32) if the cosine is at least `MIN_ALIGNMENT`; raises otherwise.

  An int32, whatever the cosine's dtype: the callback may run on one of XLA's
  threads, where the caller's ``jax.enable_x64`` context does not hold, so JAX
  would turn a float64 result into a float32 one there and reject it.

  Called back from the compiled step through ``jax.pure_callback``, whose
  result the step multiplies in: unlike ``jax.debug.callback``, whose effect
  makes every call of the step take JAX's slow dispatch path (measured 1.4 ms
  per call on this CPU), a pure callback costs nothing on the steps its branch
  does not run.
  """
  if cosine < MIN_ALIGNMENT:
    raise ValueError(
      "kfac received updates that point against the gradient (cosine "
      f"{float(cosine):.2f} with the gradient its curvature implies): another optimizer runs "
      "before kfac in the chain. K-FAC preconditions the gradient, so it comes first: "
      "optax.chain(kaisa_jax.kfac(...), optax.sgd(lr, momentum=0.9))"
    )
  return np.ones((), np.int32)


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
  batch = {
    tuple(members): _per_stack(
      plan,
      members,
      lambda spec, c, t=plan.layers[members[0]][1]: factors_lib.batch_factors(
        spec, c, t.diagonal, dtype, sharing
      ),
      [curvature[plan.layers[i][0].name] for i in members],
    )
    for members in layout.all_stacks()
  }
  send = [
    distribution.flatten_into(
      [x for members in layout.stacks(r, c) for x in _select(batch, members)],
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


def layer_damping_form(spec: layers_lib.LayerSpec, form: str) -> str:
  """The damping form of a layer: ``form``, but KAISA's for a normalisation layer.

  A normalisation layer's ``G`` is exactly 1 (its per-feature 2x2 block is all of
  its curvature, in ``A``), so there is no second factor to share the damping
  with: the block is solved as ``(A + damping I)^-1``.
  """
  return preconditioning.KAISA if spec.kind in layers_lib.NORMS else form


def _inverse_damping(
  f: LayerFactors, t: cost.Treatment, damping: Array, form: str
) -> tuple[Array, Array]:
  """What the inverse method adds to each of a stack's factors (the eigen method adds nothing here)."""
  if t.method == preconditioning.EIGEN or form == preconditioning.KAISA:
    return damping, damping
  means = [preconditioning.factor_mean(x, d) for x, d in zip(f, t.diagonal, strict=True)]
  return preconditioning.side_damping(form, damping, *means)


def decompose_factors(
  plan: Plan,
  state: KFACState,
  damping: Array,
  comm: distribution.Collectives,
) -> KFACState:
  """Phase 2: each device decomposes the factors it owns; its group receives them.

  Each stack of equal shapes is decomposed by one batched call. A decomposition
  that is not finite (a failed ``eigh`` or Cholesky) keeps the factor's previous
  decomposition and is counted. The inverse method damps each factor here by
  its share of the damping of the plan's form (`preconditioning.side_damping`).
  """
  layout = plan.layout
  dtype = preconditioning.decomposition_dtype(state.factors.dtype)

  def branch(row: int, col: int):
    def decompose(factors, previous):
      stacks = layout.stacks(row, col)
      old = _decomposition_stacks(plan, previous[0, col], stacks)
      new = _factor_stacks(plan, factors[0, 0], stacks)
      out, failures = [], jnp.zeros([], jnp.int32)
      for members, f, o in zip(stacks, new, old, strict=True):
        spec, t = plan.layers[members[0]]
        shares = _inverse_damping(f, t, damping, layer_damping_form(spec, plan.damping_form))
        for factor, diag, last, share in zip(f, t.diagonal, o, shares, strict=True):
          arrays = _decomposition_arrays(preconditioning.decompose(factor, t.method, diag, share))
          ok = jnp.stack([preconditioning.finite_per_member(x) for x in arrays]).all(axis=0)
          out += [
            jnp.where(ok.reshape(-1, *[1] * (x.ndim - 1)), x, y)
            for x, y in zip(arrays, _decomposition_arrays(last), strict=True)
          ]
          failures = failures + jnp.sum(~ok, dtype=jnp.int32)
      flat = distribution.flatten_into(out, layout.decomposition_size, dtype)
      return comm.vary(flat[None, None], over_group=True), comm.vary(failures, over_group=True)

    return decompose

  branches = [branch(r, c) for r in range(layout.rows) for c in range(layout.cols)]
  mine, failures = _switch(comm.index(), branches, state.factors, state.decompositions)
  with jax.named_scope(DECOMPOSITION_SHARING):
    gathered = comm.gather_group(mine)
    failures = comm.total(failures)
  return state._replace(
    decompositions=gathered,
    failed_decompositions=state.failed_decompositions + failures,
    refresh=jnp.zeros([], bool),
  )


def precondition_grads(
  plan: Plan,
  grads: dict[str, dict[str, Array]],
  decompositions: Array,
  damping: Array,
  dtype: Any,
  comm: distribution.Collectives,
  offsets: Sequence[Array],
) -> tuple[Stacks, Array]:
  """Phase 3: the preconditioned gradient matrices, stack by stack, and ``sum <P, V>``.

  Returns ``P`` per stack of `assignment.Layout.all_stacks` (keyed by its
  members, ``(k, groups, a_dim, g_dim)``) and the sum. Each group
  preconditions its own layers, one batched product per stack of equal
  shapes (on the CPU member by member, in a loop for a deep stack, see
  `_at_once` and `_in_loop`; ``offsets`` are `KFACState.stack_offsets`); the
  other groups receive them (one all-gather).
  """
  layout = plan.layout
  stacks = layout.all_stacks()
  matrices = {
    tuple(members): _per_stack(
      plan,
      members,
      lambda spec, g: layers_lib.to_matrix(spec, g, dtype),
      [grads[plan.layers[i][0].name] for i in members],
    )
    for members in stacks
  }

  def branch(row: int):
    def precondition(decompositions):
      parts, loops, start = [], [], 0
      for col in range(layout.cols):
        mine = layout.stacks(row, col)
        decs = _decomposition_stacks(plan, decompositions[0, col], mine)
        for s, (members, dec) in enumerate(zip(mine, decs, strict=True)):
          spec, t = plan.layers[members[0]]
          v = _select(matrices, members)
          layer_form = layer_damping_form(spec, plan.damping_form)

          def fn(v, a, g, d, method=t.method, layer_form=layer_form):
            return preconditioning.precondition(v, a, g, method, d, layer_form)

          if _looped(len(members)):

            def inputs(v=v, s=s, col=col, mine=mine):  # read inside the loop, where used
              return v, *_decomposition_stacks(plan, decompositions[0, col], mine)[s]

            parts.append(jnp.zeros(v.shape, dtype))
            loops.append((fn, inputs, start))
          else:
            parts.append(_at_once(fn, (v, dec.a, dec.g), offsets, damping))
          start += v.size
      flat = distribution.flatten_into(parts, layout.gradient_size, dtype)
      for member_fn, stacks, at in loops:  # each writes over its stack's zeros
        flat = _in_loop(member_fn, stacks, flat, at, offsets, damping)
      return comm.vary(flat[None], over_group=False)

    return precondition

  row, _ = comm.position()
  mine = _switch(row, [branch(r) for r in range(layout.rows)], decompositions)
  with jax.named_scope(GRADIENT_SHARING):
    everyone = comm.gather_receivers(mine)
  shape = {i: m.shape[1:] for key, m in matrices.items() for i in key}
  received = {}
  for r in range(layout.rows):
    group = layout.group_stacks(r)
    parts = distribution.split(everyone[r], [(len(m), *shape[m[0]]) for m in group])
    received.update(zip(map(tuple, group), parts, strict=True))
  preconditioned = {tuple(m): _select(received, m) for m in stacks}
  # Summed stack by stack over the stacks of all layers, whatever the layout: the
  # float32 sum, and so the KL clip, are then bit for bit the same for every grad
  # worker fraction. One reduction per stack: XLA copies the additions that
  # produce the clip into every parameter's update, so a sum layer by layer
  # would cost compile time and work quadratic in the depth.
  vg_sum = jnp.zeros([], dtype)
  for key, p in preconditioned.items():
    vg_sum = vg_sum + jnp.sum(p * matrices[key])
  return preconditioned, vg_sum


WARNED_MODULES = 10


def _skipped_warning(skipped: Sequence[Skipped]) -> str:
  """The warning about modules that are not preconditioned: one a line, the first few."""
  lines = [
    f"kaisa_jax: {len(skipped)} module(s) with parameters will not be preconditioned (their "
    "gradients pass through unchanged):",
    *(f"  {k.name} ({k.module_type}): {k.reason}" for k in skipped[:WARNED_MODULES]),
  ]
  if len(skipped) > WARNED_MODULES:
    lines.append(f"  ... and {len(skipped) - WARNED_MODULES} more; print(tx.plan) lists them all")
  return "\n".join(lines)


def _check_mesh(mesh: Any) -> None:
  """Raises unless ``mesh`` is ``None`` or a `jax.sharding.Mesh`.

  ``optax.inject_hyperparams`` takes every callable argument for a schedule: a
  ``Mesh`` is callable, so it arrives here as a function unless it is listed
  in ``static_args``.
  """
  if mesh is None or isinstance(mesh, Mesh):
    return
  how = ""
  if callable(mesh):
    how = (
      ": under optax.inject_hyperparams, list mesh in static_args (a Mesh is callable, so "
      f"inject_hyperparams takes it for a schedule), e.g. static_args={hp.STATIC!r}"
    )
  raise TypeError(f"mesh must be a jax.sharding.Mesh from kaisa_jax.make_mesh, got {mesh!r}{how}")


def _auto_fraction(
  layers: Layers, mesh: Mesh | None, axis_name: str | None, axis_size: int | None, **settings
) -> Any:
  """``grad_worker_fraction="auto"``: the fraction `kaisa_jax.plan_fractions` recommends.

  A `fractions.Fraction`, or ``"comm_opt"`` on one device (nothing to choose).

  The cluster is the preset for the first device's kind
  (`kaisa_jax.cluster.cluster_of`), with no memory budget.
  """
  if mesh is not None:
    raise ValueError(
      "grad_worker_fraction='auto' cannot change a mesh's shape: build the mesh with "
      "kaisa_jax.make_mesh(kaisa_jax.plan_fractions(layers, n_devices, cluster).recommended)"
    )
  if axis_name is None:
    return "comm_opt"  # one device: nothing to choose
  n = jax.device_count() if axis_size is None else axis_size
  cluster = cluster_of(jax.devices()[0])
  choice = plan_fractions(layers, n, cluster, **settings)
  return choice.recommended


def kfac(
  layers: Layers,
  *,
  damping: hp.ScalarOrSchedule = preconditioning.DEFAULT_DAMPING,
  damping_form: str = preconditioning.DEFAULT_FORM,
  factor_decay: hp.ScalarOrSchedule = 0.95,
  factor_update_steps: hp.IntOrSchedule = 10,
  inv_update_steps: hp.IntOrSchedule = 100,
  kl_clip: hp.ScalarOrSchedule | None = 1e-3,
  lr: hp.ScalarOrSchedule | None = None,
  compute_method: str = preconditioning.EIGEN,
  weight_sharing: str = factors_lib.EXPAND,
  factor_dtype: Any = "float32",
  max_cost_ratio: float | None = 4.0,
  grad_worker_fraction: float | str | None = None,
  mesh: Mesh | None = None,
  axis_name: str | None = None,
  axis_size: int | None = None,
  assignment_cost: str = assignment.COMPUTE,
) -> KFAC:
  """K-FAC preconditioning as an Optax transformation, distributed as KAISA.

  Turns the gradient of every captured layer into
  ``nu * (A (x) G + damping I)^-1 vec(grad)`` and passes every other gradient
  through unchanged. The result is not negated or scaled by a learning rate:
  chain it with an optimizer, K-FAC first,
  ``optax.chain(kfac(...), optax.sgd(lr, 0.9))``, and pass ``curvature=``
  (from `kaisa_jax.value_and_grad`) to ``update``. The first step checks the
  order: incoming updates that point against the gradient the curvature
  implies (cosine below -0.5, as an optimizer's step does) raise.

  Misuse raises rather than training wrongly: an ``update`` mapped over devices
  (``jax.pmap``, ``jax.shard_map``) that kfac was not built for, with
  ``axis_name=`` or ``mesh=``, raises at trace time.

  Args:
    layers: the model's layers, from ``grad_fn.layers(params, batch)`` where
      ``grad_fn = kaisa_jax.value_and_grad(loss_fn)``.
    damping: the damping ``lambda > 0``; what it adds depends on ``damping_form``.
    damping_form: how ``damping`` enters (`kaisa_jax.preconditioning`, with
      ``mA``, ``mG`` each factor's mean eigenvalue): ``"pi"`` (default:
      factored Tikhonov damping with the pi-correction, Martens and Grosse
      2015, ``(A + pi sqrt(lambda) I) (x) (G + sqrt(lambda) / pi I)``,
      ``pi = sqrt(mA / mG)``), ``"relative"`` (``(A + sqrt(lambda) mA I) (x)
      (G + sqrt(lambda) mG I)``: each factor damped relative to its own scale)
      or ``"kaisa"`` (the KAISA reference's absolute ``A (x) G + lambda I``;
      with the inverse method ``(A + lambda I)^-1 V (G + lambda I)^-1``). The
      default pair, ``"pi"`` at 0.1, is the best of the three forms at
      dampings 1e-4 to 1e-1 over the eight models of
      ``benchmarks/robustness.py``.
    factor_decay: running-average decay of the factors, in ``[0, 1)``; 0 keeps
      only the current batch.
    factor_update_steps: update the factors every this many steps (int >= 1).
    inv_update_steps: recompute the decompositions every this many steps.
    kl_clip: scale the preconditioned gradients by
      ``nu = min(1, sqrt(kl_clip / |lr^2 sum <P, V>|))``; ``None`` disables it.
      While it is active the step no longer depends on ``lr``.
    lr: the learning rate of the chained optimizer, used only by the KL clip
      (required when ``kl_clip`` is set).
    compute_method: ``"eigen"`` (exact damped Kronecker inverse) or
      ``"inverse"`` (``(A + damping)^-1 V (G + damping)^-1``, cheaper, a
      different regulariser for the same damping).
    weight_sharing: how a layer whose weight is used several times per
      example counts the uses (Eschenhagen et al., 2023), the rows of one call
      (sequence positions, pixels) and the calls of a layer applied several
      times (a recurrent cell, a block reused in a loop) alike: ``"expand"``
      (every use is a sample: ``A`` the mean over uses, ``G`` the sum over an
      example's uses) or ``"reduce"`` (each example's inputs averaged and
      output gradients summed over its uses first); see `kaisa_jax.factors`.
      Embedding lookups always expand.
    factor_dtype: dtype of the factors (a dtype or its name); decompositions
      run in this dtype but never below float32, and results are cast back to
      the gradient dtype.
    max_cost_ratio: a layer whose preconditioning and amortised decompositions
      would cost more than this many times its own forward and backward pass
      gets a cheaper treatment (inverse method, then diagonal sides); see
      `kaisa_jax.cost`. ``None`` keeps ``compute_method`` everywhere.
    grad_worker_fraction: KAISA's ``f``: ``W = f N`` of the ``N`` data-parallel
      devices form a grad-worker group. A number in ``(0, 1]`` with ``f N`` an
      integer dividing ``N``, or ``"comm_opt"`` (1, the default),
      ``"hybrid_opt"`` (1/2) or ``"mem_opt"`` (``1/N``), or ``"auto"``
      (with ``axis_name=``): the fraction `kaisa_jax.plan_fractions`
      recommends for the preset cluster of the device kind
      (`kaisa_jax.cluster.cluster_of`: A100, H100; others raise). With
      ``mesh=`` it defaults to the mesh's. No effect on a single device.
    mesh: for a train step under ``jax.shard_map``: the mesh from
      `kaisa_jax.make_mesh`. ``init`` then returns the state sharded over it
      (``kaisa_jax.partition_specs`` gives the specs for ``shard_map``).
    axis_name: for a train step under ``jax.pmap``: the pmapped axis name.
      ``init`` returns one device's state; replicate it over the devices.
    axis_size: the number of devices the pmapped axis spans (default: all,
      ``jax.device_count()``).
    assignment_cost: ``"compute"`` (``n^3``) or ``"memory"`` (``n^2``), the cost
      by which layers are assigned to devices.

  Every hyperparameter but ``compute_method``, ``factor_dtype``,
  ``max_cost_ratio`` and the distribution arguments may be an Optax schedule.
  Under ``optax.inject_hyperparams``, ``damping``, ``lr``, ``kl_clip``,
  ``factor_decay`` and ``factor_update_steps`` may be injected (changed in the
  state between jitted steps); ``inv_update_steps``, ``max_cost_ratio``,
  ``grad_worker_fraction`` and ``axis_size`` decide the layout of the state
  and must be listed in ``static_args`` (a traced one raises saying so).

  Returns:
    A `KFAC` transformation (an ``optax.GradientTransformationExtraArgs``);
    ``print(tx.plan)`` lists each layer's factor shapes, treatment and device.
  """
  if not isinstance(layers, Layers):
    raise TypeError(
      "kfac's first argument is the model's layers: grad_fn = "
      "kaisa_jax.value_and_grad(loss_fn); kaisa_jax.kfac(grad_fn.layers(params, batch), ...)"
      f"; got {type(layers).__name__}"
    )
  if not layers.specs:
    raise ValueError(
      "kfac has no layer to precondition: the loss calls no layer kind kaisa_jax captures "
      "(nn.Dense, nn.DenseGeneral, nn.Conv, nn.Embed, their NNX twins, or a type given to "
      "kaisa_jax.register_layer) on the params it is given. Compute the loss by calling "
      "model.apply(params, ...) (unjitted) or nnx.merge(graphdef, params) inside it; "
      f"print(grad_fn.layers(...)) lists what was found:\n{layers}"
    )
  _check_mesh(mesh)
  inv_update_steps = hp.static("inv_update_steps", inv_update_steps)
  max_cost_ratio = hp.static("max_cost_ratio", max_cost_ratio)
  grad_worker_fraction = hp.static("grad_worker_fraction", grad_worker_fraction)
  axis_size = hp.static("axis_size", axis_size)
  hp.check_scalar("damping", damping, 0.0, open_low=True)
  hp.check_scalar("factor_decay", factor_decay, 0.0, 1.0)
  factor_steps_at_zero = hp.check_steps("factor_update_steps", factor_update_steps)
  inv_steps_at_zero = hp.check_steps("inv_update_steps", inv_update_steps)
  if kl_clip is not None:
    hp.check_scalar("kl_clip", kl_clip, 0.0, open_low=True)
    if lr is None:
      raise ValueError(
        "kl_clip needs the learning rate: pass lr= (the chained optimizer's), or kl_clip=None"
      )
  if lr is not None:  # 0 too (a warmup's first step): the chained optimizer then moves nothing
    hp.check_scalar("lr", lr, 0.0)
  if compute_method not in preconditioning.METHODS:
    raise ValueError(
      f"compute_method must be one of {preconditioning.METHODS}, got {compute_method!r}"
    )
  if damping_form not in preconditioning.DAMPING_FORMS:
    raise ValueError(
      f"damping_form must be one of {preconditioning.DAMPING_FORMS}, got {damping_form!r}"
    )
  if weight_sharing not in factors_lib.WEIGHT_SHARING:
    raise ValueError(
      f"weight_sharing must be one of {factors_lib.WEIGHT_SHARING}, got {weight_sharing!r}"
    )
  if isinstance(factor_dtype, jax.Array | np.ndarray):
    raise TypeError(
      "factor_dtype arrived as an array: optax.inject_hyperparams takes a dtype such as "
      "jnp.bfloat16 for a schedule; pass factor_dtype as a string ('bfloat16') or list it in "
      "static_args"
    )
  if not jnp.issubdtype(factor_dtype, jnp.floating):
    raise TypeError(f"factor_dtype must be a floating dtype, got {factor_dtype!r}")
  factor_dtype = jnp.dtype(factor_dtype)
  if max_cost_ratio is not None:
    hp.check_scalar("max_cost_ratio", max_cost_ratio, 0.0, open_low=True)
  if assignment_cost not in assignment.COSTS:
    raise ValueError(f"assignment_cost must be one of {assignment.COSTS}, got {assignment_cost!r}")
  if grad_worker_fraction == distribution.AUTO:
    grad_worker_fraction = _auto_fraction(
      layers,
      mesh,
      axis_name,
      axis_size,
      factor_update_steps=factor_steps_at_zero,
      inv_update_steps=inv_steps_at_zero,
      compute_method=compute_method,
      max_cost_ratio=max_cost_ratio,
      assignment_cost=assignment_cost,
      factor_dtype=factor_dtype,
    )
  comm = collectives_for(grad_worker_fraction, mesh, axis_name, axis_size)
  plan = make_plan(
    layers,
    comm,
    mesh,
    compute_method=compute_method,
    inv_update_steps=inv_steps_at_zero,
    max_cost_ratio=max_cost_ratio,
    assignment_cost=assignment_cost,
    factor_dtype=factor_dtype,
    damping_form=damping_form,
  )
  layout = plan.layout
  unsupported = [k for k in layers.skipped if k.reason != EXCLUDED]
  if unsupported:
    warnings.warn(_skipped_warning(unsupported), stacklevel=2)
  dec_dtype = preconditioning.decomposition_dtype(factor_dtype)
  check_layer = _alignment_layer(plan)
  offsets = stack_offsets(plan)

  def zero_state(rows: int, cols: int) -> KFACState:
    return KFACState(
      count=jnp.zeros([], jnp.int32),
      factor_total=jnp.zeros([], jnp.float32),
      factors=jnp.zeros((rows, cols, layout.factor_size), factor_dtype),
      decompositions=jnp.zeros((rows, layout.cols, layout.decomposition_size), dec_dtype),
      skipped_factor_updates=jnp.zeros([], jnp.int32),
      failed_decompositions=jnp.zeros([], jnp.int32),
      kl_scale=jnp.ones([], dec_dtype),
      refresh=jnp.zeros([], bool),
      stack_offsets=offsets,
    )

  def init_fn(params: Any) -> KFACState:
    _layer_params(params, plan, "params")
    if comm.mode != "shard_map":
      return zero_state(1, 1)
    shape = jax.eval_shape(lambda: zero_state(layout.rows, layout.cols))
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_partition_specs(shape))
    return jax.jit(lambda: zero_state(layout.rows, layout.cols), out_shardings=shardings)()

  def update_fn(updates, state, params=None, *, curvature: Curvature | None = None, **extra):
    del params, extra
    _check_curvature(curvature, plan)
    if len(state.stack_offsets) != len(offsets):
      raise ValueError(
        f"this K-FAC state has {len(state.stack_offsets)} stack offsets where this kfac's plan "
        f"needs {len(offsets)}: it was made by another kfac. Start from this kfac's init, or "
        "carry a state over with kaisa_jax.to_portable and kaisa_jax.from_portable"
      )
    comm.check()
    grads = _layer_params(updates, plan, "updates")
    step = state.count
    damp = hp.at(damping, step, dec_dtype)
    in_order = jnp.ones([], dec_dtype)  # 1, or the first step raises
    if check_layer is not None:  # chain order, once: the first step only
      spec = plan.layers[check_layer][0]

      def check_order():
        v = layers_lib.to_matrix(spec, grads[spec.name], dec_dtype)
        alignment = gradient_alignment(spec, curvature[spec.name], v, dec_dtype, comm)
        shape = jax.ShapeDtypeStruct((), jnp.int32)
        one = jax.pure_callback(
          _one_unless_against_gradient, shape, alignment, vmap_method="sequential"
        )
        return one.astype(dec_dtype)

      in_order = jax.lax.cond(step == 0, check_order, lambda: in_order)

    every = hp.at(factor_update_steps, step, jnp.int32)
    decay = hp.at(factor_decay, step)
    state = jax.lax.cond(
      step % every == 0,
      lambda: update_factors(plan, state, curvature, decay, factor_dtype, comm, weight_sharing),
      lambda: state,
    )
    every = hp.at(inv_update_steps, step, jnp.int32)
    state = jax.lax.cond(
      (step % every == 0) | state.refresh,
      lambda: decompose_factors(plan, state, damp, comm),
      lambda: state,
    )
    preconditioned, vg_sum = precondition_grads(
      plan, grads, state.decompositions, damp, dec_dtype, comm, state.stack_offsets
    )
    nu = in_order  # exactly 1: the product leaves every bit as it was
    if kl_clip is not None:
      nu = nu * preconditioning.kl_clip_scale(
        vg_sum, hp.at(kl_clip, step, dec_dtype), hp.at(lr, step, dec_dtype)
      )

    replacements: dict[Any, list[tuple[tuple[int, ...], Array]]] = {}
    for members, p in preconditioned.items():
      first = plan.layers[members[0]][0]  # members share their shapes
      stacked = _vmap(lambda v, spec=first: layers_lib.from_matrix(spec, v), nu * p)
      for j, i in enumerate(members):
        spec = plan.layers[i][0]
        for key, value in stacked.items():
          path = plain_path((*spec.param_path, jax.tree_util.DictKey(key), *spec.param_suffix))
          value = _member(value, state.stack_offsets, j).astype(grads[spec.name][key].dtype)
          replacements.setdefault(path, []).append((spec.param_index, value))
    new_updates = jax.tree_util.tree_map_with_path(
      lambda path, leaf: _replace(leaf, replacements.get(plain_path(path), ())), updates
    )
    return new_updates, state._replace(count=step + 1, kl_scale=nu)

  tx = KFAC(init_fn, update_fn)
  tx.plan = plan
  tx.damping = damping
  return tx


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
      out.update(_members(stacks, _factor_stacks(plan, state.factors[r % rows, c % cols], stacks)))
  return {spec.name: out[i] for i, (spec, _) in enumerate(plan.layers)}


def grouped_decompositions(plan: Plan, state: KFACState) -> dict[str, LayerDecompositions]:
  """Each layer's latest decompositions with their leading groups axis (as `grouped_factors`)."""
  out = {}
  rows = state.decompositions.shape[0]
  for r in range(plan.layout.rows):
    for c in range(plan.layout.cols):
      stacks = plan.layout.stacks(r, c)
      buffer = state.decompositions[r % rows, c]
      out.update(_members(stacks, _decomposition_stacks(plan, buffer, stacks)))
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
  """
  return _drop_groups_axis(plan, grouped_factors(plan, state))


def layer_decompositions(plan: Plan, state: KFACState) -> dict[str, LayerDecompositions]:
  """Each layer's latest decompositions, shaped as `layer_factors` shapes the factors."""
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
