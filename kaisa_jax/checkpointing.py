"""Checkpointing: K-FAC's state without its device layout, for Orbax or any pytree store.

A `KFACState` is laid out for one device count, grad worker fraction and
assignment. `to_portable` turns every K-FAC state in an optimizer state into a
`PortableKFACState` (per layer, keyed by name, as host numpy arrays), which
Orbax saves like any pytree; `from_portable` lays it out again for a K-FAC
transformation, possibly made for another mesh, fraction or device count::

  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, {"params": params, "opt": kaisa_jax.to_portable(kfac, opt_state)})
  ...
  target = {"params": params, "opt": kaisa_jax.to_portable(kfac, tx.init(params))}
  restored = ckpt.restore(path, target)
  opt_state = kaisa_jax.from_portable(kfac, restored["opt"])

On a mesh, `from_portable` also puts back on the mesh the other arrays of the
optimizer state that Orbax restores onto one device (the counters of Optax's
wrappers).

Resuming with the same layout is exact: the state is moved, not recomputed, so
training continues bit for bit. With another device count, fraction or
assignment the factors and decompositions move to their new owners. If a
layer's method changed (eigen and inverse store the same shapes), the
decompositions are recomputed at the first step after the restore; a side that
changed between dense and diagonal cannot be restored. Treatments do not depend
on the device count: the cost rule uses the rows of the whole data-parallel
batch.

Both ends check their input: `to_portable` that each state has the buffer sizes
and device axes its kfac makes (a pmapped state whole, with its device axis),
`from_portable` that the checkpoint has exactly the model's layers, each with
its dimensions and, where the treatment is the same, its decompositions' shapes.
Orbax restores the numpy arrays of a portable target with the shapes they were
saved with, so a checkpoint of another model reaches these checks as written.

A checkpoint written before the state held ``kl_scale`` (the KL clip's scale of
the last step) lacks it: Orbax's ``restore`` refuses it, naming ``kl_scale``.
Restore it with ``ocp.args.PyTreeRestore(item=target, partial_restore=True)``
(``ocp.Checkpointer(ocp.PyTreeCheckpointHandler())``): ``kl_scale`` then comes
from the target (1, as at init) and the next step sets it; nothing else depends
on it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kaisa_jax import assignment, cost, preconditioning, transform
from kaisa_jax import hyperparameters as hp
from kaisa_jax import layers as layers_lib
from kaisa_jax import state as state_lib
from kaisa_jax.plan import Plan
from kaisa_jax.stacking import LayerDecompositions, LayerFactors

Array = Any


class PortableKFACState(NamedTuple):
  """A `KFACState` per layer (host numpy arrays), independent of the device layout."""

  count: np.ndarray
  factor_total: np.ndarray
  skipped_factor_updates: np.ndarray
  failed_decompositions: np.ndarray
  kl_scale: np.ndarray
  factors: dict[str, LayerFactors]
  decompositions: dict[str, LayerDecompositions]
  treatments: dict[str, np.ndarray]


def _treatment_code(t) -> np.ndarray:
  """``[method, A diagonal, G diagonal]`` as int32 (method: 0 eigen, 1 inverse)."""
  return np.asarray([preconditioning.METHODS.index(t.method), *t.diagonal], np.int32)


def _is_state(x: Any) -> bool:
  return isinstance(x, state_lib.KFACState | PortableKFACState)


# The per-device scalars of a KFACState (pmap keeps one copy per device).
_SCALARS = (
  "count",
  "factor_total",
  "skipped_factor_updates",
  "failed_decompositions",
  "kl_scale",
  "refresh",
)


def _unstack(plan: Plan, state: state_lib.KFACState) -> state_lib.KFACState:
  """A pmap-replicated state ``(N, ...)`` as the global ``(N / W, W, ...)`` one."""
  rows, cols = plan.layout.rows, plan.layout.cols
  return state._replace(
    factors=state.factors.reshape(rows, cols, -1),
    decompositions=state.decompositions[::cols, 0],
    **{k: getattr(state, k)[0] for k in _SCALARS},
    stack_offsets=tuple(x[0] for x in state.stack_offsets),
  )


def _runs_on(plan: Plan) -> str:
  """Where ``plan``'s kfac runs, in words."""
  comm = plan.collectives
  grid = f"{comm.rows} group(s) x {comm.cols} grad worker(s)"
  if comm.mode == "shard_map":
    return f"a mesh of {grid}"
  if comm.mode == "pmap":
    return f"pmap over {comm.size} devices as {grid}"
  return "one device"


def _state_shapes(plan: Plan, replicated: bool) -> dict[str, tuple[int, ...]]:
  """The shape of each array of a `KFACState` that ``plan``'s kfac makes.

  ``replicated``: a pmapped state, one copy per device along a leading axis.
  """
  layout = plan.layout
  if plan.collectives.mode == "shard_map":
    factors, decompositions, scalar = (layout.rows, layout.cols), (layout.rows, layout.cols), ()
  elif replicated:
    n = layout.devices
    factors, decompositions, scalar = (n, 1, 1), (n, 1, layout.cols), (n,)
  else:
    factors, decompositions, scalar = (1, 1), (1, layout.cols), ()
  return {
    "factors": (*factors, layout.factor_size),
    "decompositions": (*decompositions, layout.decomposition_size),
    **dict.fromkeys(_SCALARS, scalar),
  }


def _is_replicated(plan: Plan, state: state_lib.KFACState) -> bool:
  """Whether ``state`` is a pmapped one, with a leading axis of one copy per device."""
  return plan.collectives.mode == "pmap" and np.ndim(state.count) == 1


def _device_axes(field: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The axes of a `KFACState` array that depend on the devices (all but a buffer's last)."""
  return shape if field in _SCALARS else shape[:-1]


def _check_state(plan: Plan, state: state_lib.KFACState, caller: str = "to_portable") -> None:
  """Raises unless ``state`` has the shapes of the states ``plan``'s kfac makes.

  The leading axes depend on the devices; the buffer sizes (the last axes) on
  the model's layers, their treatments and the assignment.
  """
  wanted = _state_shapes(plan, _is_replicated(plan, state))
  got = {k: tuple(np.shape(getattr(state, k))) for k in wanted}
  if got == wanted:
    return
  devices = [k for k in wanted if _device_axes(k, got[k]) != _device_axes(k, wanted[k])]
  if devices:  # the buffer sizes follow the devices: name only these
    shown = [k for k in devices if k in ("factors", "decompositions", "count")] or devices
    cause = (
      "its shapes differ: "
      + ", ".join(f"{k} {got[k]} where this kfac makes {wanted[k]}" for k in shown)
      + ": it was made for other devices (another mesh, grad worker fraction or device count, "
      "or one device)"
    )
  else:
    cause = (
      "; ".join(
        f"its {k[:-1]} buffer has {got[k][-1]} elements per device, this kfac's {wanted[k][-1]}"
        for k in ("factors", "decompositions")
        if got[k] != wanted[k]
      )
      + ": it was made for another model, other treatments (compute_method, max_cost_ratio) "
      "or another assignment (assignment_cost)"
    )
  raise ValueError(
    f"this K-FAC state was not made by this kfac (for {_runs_on(plan)}): {cause}. "
    f"Pass {caller} the kfac the state was made with"
  )


def _check_whole(plan: Plan, state: state_lib.KFACState) -> None:
  """Raises if ``state`` is one device's copy of a pmapped state that has taken steps.

  A fresh state (no steps yet) is all zeros and stands for any device's.
  """
  if plan.collectives.mode != "pmap" or plan.layout.devices == 1:
    return
  if _is_replicated(plan, state):
    return
  steps = int(np.asarray(jax.device_get(state.count)))
  if steps:
    raise ValueError(
      f"this K-FAC state is one device's copy of a pmapped state (after {steps} steps): each "
      "device keeps only the factors of the layers it owns, so one copy lacks the others'. "
      "Pass to_portable the state as the pmapped step returns it, with its leading device "
      "axis (do not unreplicate K-FAC's state)"
    )


def global_state(plan: Plan, state: state_lib.KFACState, caller: str) -> state_lib.KFACState:
  """``state`` in the global ``(N / W, W, ...)`` layout, after checking it is ``plan``'s.

  A pmapped state with its leading device axis is unstacked; a single-device
  state or a mesh's global state is returned as it is. Works on traced states.
  ``caller`` is the public function named in the error when the check fails.
  """
  _check_state(plan, state, caller)
  return _unstack(plan, state) if _is_replicated(plan, state) else state


def _portable(plan: Plan, state: state_lib.KFACState) -> PortableKFACState:
  _check_state(plan, state)
  _check_whole(plan, state)
  if _is_replicated(plan, state):
    state = _unstack(plan, state)
  host = jax.tree.map(np.asarray, jax.device_get(state))
  return PortableKFACState(
    host.count,
    host.factor_total,
    host.skipped_factor_updates,
    host.failed_decompositions,
    host.kl_scale,
    state_lib.grouped_factors(plan, host),
    state_lib.grouped_decompositions(plan, host),
    {spec.name: _treatment_code(t) for spec, t in plan.layers},
  )


def to_portable(kfac: transform.KFAC, tree: Any) -> Any:
  """``tree`` with every `KFACState` of ``kfac`` replaced by a `PortableKFACState`.

  Each state must be one ``kfac`` made: its buffers are read with ``kfac``'s
  layout, so a state of another model, treatment or device layout raises. A
  pmapped state is passed whole, with its leading device axis.
  """
  return jax.tree.map(
    lambda x: _portable(kfac.plan, x) if isinstance(x, state_lib.KFACState) else x,
    tree,
    is_leaf=_is_state,
  )


_RESTORE_INTO_ITS_MODEL = (
  "Restore it with a kfac built from the layers of the model it was saved from"
)


def _check_layer_names(plan: Plan, portable: PortableKFACState) -> None:
  """Raises unless the checkpoint has factors, decompositions and treatments for every layer."""
  names = [spec.name for spec, _ in plan.layers]
  saved = list(portable.factors)
  extra = sorted(set(saved) - set(names))
  missing = [n for n in names if n not in portable.factors]
  if extra or missing:
    problems = ([f"layers {extra} that this model lacks"] if extra else []) + (
      [f"no factors for this model's layers {missing}"] if missing else []
    )
    raise ValueError(
      f"the checkpoint has {' and '.join(problems)}: it was saved from another model (its "
      f"layers: {sorted(saved)}; this model's: {names}). {_RESTORE_INTO_ITS_MODEL}"
    )
  for field in ("decompositions", "treatments"):
    keys = set(getattr(portable, field))
    if keys != set(names):
      raise ValueError(
        f"the checkpoint's {field} are for layers {sorted(keys)} but its factors for "
        f"{sorted(names)}: it is not as kaisa_jax.to_portable writes it. Restore a checkpoint "
        "that to_portable wrote, with the kfac it was made with"
      )


def _factor_side(shape: tuple[int, ...]) -> tuple[int, int, bool] | None:
  """``(groups, dim, diagonal)`` of a factor of ``shape``; ``None`` if no factor has it."""
  if len(shape) == 2:
    return shape[0], shape[1], True
  if len(shape) == 3 and shape[1] == shape[2]:
    return shape[0], shape[1], False
  return None


def _check_factors(
  spec: layers_lib.LayerSpec, t: cost.Treatment, shapes: list[tuple[int, ...]]
) -> None:
  """Raises unless a layer's saved factors have the shapes ``t`` gives them here.

  Other dimensions mean another model; the same dimensions with a side dense in
  one and diagonal in the other mean another treatment.
  """
  wanted = [tuple(s) for s in assignment.factor_shapes(spec, t)]
  if shapes == wanted:
    return
  sides = [_factor_side(s) for s in shapes]
  dims = [(spec.groups, spec.a_dim), (spec.groups, spec.g_dim)]
  if len(sides) != 2 or None in sides or [side[:2] for side in sides] != dims:
    raise ValueError(
      f"layer {spec.name!r} has factors of shapes {shapes} in the checkpoint but {wanted} "
      f"here: its dimensions differ (here A is {spec.a_dim} and G {spec.g_dim} wide"
      + (f", in {spec.groups} groups" if spec.groups > 1 else "")
      + f"), so the checkpoint was saved from another model. {_RESTORE_INTO_ITS_MODEL}"
    )
  changed = [n for n, side, diag in zip("AG", sides, t.diagonal, strict=True) if side[2] != diag]
  raise ValueError(
    f"layer {spec.name!r} has factors of shapes {shapes} in the checkpoint but {wanted} "
    f"here: its {' and '.join(changed)} side{'s are' if len(changed) > 1 else ' is'} dense "
    "in one and diagonal in the other; "
    "restore with the compute_method and max_cost_ratio the checkpoint was made with (and the "
    "same batch size, which the cost rule weighs; print(kfac.plan) shows each layer's "
    "treatment)"
  )


def _check_decompositions(
  spec: layers_lib.LayerSpec, t: cost.Treatment, shapes: list[tuple[int, ...]]
) -> None:
  """Raises unless a layer's saved decompositions have the shapes its treatment ``t`` gives."""
  wanted = [tuple(x) for side in assignment.decomposition_shapes(spec, t) for x in side]
  if shapes != wanted:
    raise ValueError(
      f"layer {spec.name!r} has decompositions of shapes {shapes} in the checkpoint, but its "
      f"treatment there ({t}) makes {wanted}: the checkpoint is not as kaisa_jax.to_portable "
      "writes it. Restore a checkpoint that to_portable wrote, with the kfac it was made with"
    )


def _layout_state(
  plan: Plan, portable: PortableKFACState, factor_dtype: Any, dec_dtype: Any
) -> state_lib.KFACState:
  """The global ``(N / W, W, ...)`` state of ``plan`` from a portable one (numpy)."""
  layout = plan.layout
  names = [spec.name for spec, _ in plan.layers]
  _check_layer_names(plan, portable)
  refresh = False
  factors, decompositions = {}, {}
  for spec, t in plan.layers:
    saved = [np.asarray(x) for x in portable.factors[spec.name]]
    _check_factors(spec, t, [x.shape for x in saved])
    factors[spec.name] = saved
    shapes = [x for side in assignment.decomposition_shapes(spec, t) for x in side]
    if np.array_equal(np.asarray(portable.treatments[spec.name]), _treatment_code(t)):
      saved = [
        np.asarray(x) for side in portable.decompositions[spec.name] for x in side if x is not None
      ]
      _check_decompositions(spec, t, [x.shape for x in saved])
      decompositions[spec.name] = saved
    else:  # another method: recompute at the next step
      decompositions[spec.name] = [np.zeros(s, dec_dtype) for s in shapes]
      refresh = True

  def buffer(arrays, size, dtype):
    flat = [np.asarray(a, dtype).reshape(-1) for a in arrays]
    used = sum(f.size for f in flat)
    return np.concatenate([*flat, np.zeros(size - used, dtype)])

  def grid(parts, size, dtype):
    return np.stack(
      [
        np.stack(
          [
            buffer(assignment.stacked(layout.stacks(r, c), lambda i: parts[names[i]]), size, dtype)
            for c in range(layout.cols)
          ]
        )
        for r in range(layout.rows)
      ]
    )

  return state_lib.KFACState(
    count=np.asarray(portable.count, np.int32),
    factor_total=np.asarray(portable.factor_total, np.float32),
    factors=grid(factors, layout.factor_size, factor_dtype),
    decompositions=grid(decompositions, layout.decomposition_size, dec_dtype),
    skipped_factor_updates=np.asarray(portable.skipped_factor_updates, np.int32),
    failed_decompositions=np.asarray(portable.failed_decompositions, np.int32),
    kl_scale=np.asarray(portable.kl_scale, dec_dtype),
    refresh=np.asarray(refresh),
    stack_offsets=tuple(np.asarray(x) for x in state_lib.stack_offsets(plan)),
  )


def _place(kfac: transform.KFAC, portable: PortableKFACState) -> state_lib.KFACState:
  plan = kfac.plan
  dec_dtype = preconditioning.decomposition_dtype(plan.factor_dtype)
  state = _layout_state(plan, portable, plan.factor_dtype, dec_dtype)
  mode, layout = plan.collectives.mode, plan.layout
  if mode == "shard_map":
    specs = state_lib.state_partition_specs(state)
    return jax.tree.map(
      lambda x, spec: jax.device_put(x, NamedSharding(plan.mesh, spec)), state, specs
    )
  if mode == "pmap":
    n = layout.devices
    stacked = state._replace(
      factors=state.factors.reshape(n, 1, 1, -1),
      decompositions=np.repeat(state.decompositions[:, None], layout.cols, axis=1).reshape(
        n, 1, layout.cols, -1
      ),
      **{k: np.stack([getattr(state, k)] * n) for k in _SCALARS},
      stack_offsets=tuple(np.stack([x] * n) for x in state.stack_offsets),
    )
    return jax.tree.map(jnp.asarray, stacked)
  return jax.tree.map(jnp.asarray, state)


def _replicated(mesh: Mesh, x: Any) -> Any:
  """``x`` replicated over ``mesh`` if it is an array that lies on other devices.

  Orbax restores the arrays of a target that sit on one device (the counters
  Optax's wrappers make with ``jnp.zeros``) committed to that device; the
  train step over the mesh would refuse them.
  """
  if not isinstance(x, jax.Array) or hp.is_traced(x):
    return x
  if x.sharding.device_set == set(mesh.devices.flat):
    return x
  return jax.device_put(x, NamedSharding(mesh, P()))


def from_portable(kfac: transform.KFAC, tree: Any) -> Any:
  """``tree`` with every `PortableKFACState` laid out as a `KFACState` for ``kfac``.

  The result is sharded over ``kfac``'s mesh (``shard_map``), replicated with a
  leading device axis (``pmap``: pass it to the pmapped step as is), or on the
  default device. With a mesh, every other array of ``tree`` that is not on the
  mesh (the step counters of ``optax.apply_if_finite``, ``optax.MultiSteps``
  or ``optax.inject_hyperparams``, which Orbax restores onto one device) is
  replicated over it, as `kaisa_jax.partition_specs` says it is.
  """
  mesh = kfac.plan.mesh if kfac.plan.collectives.mode == "shard_map" else None

  def restore(x):
    if isinstance(x, PortableKFACState):
      return _place(kfac, x)
    return x if mesh is None else _replicated(mesh, x)

  return jax.tree.map(restore, tree, is_leaf=_is_state)
