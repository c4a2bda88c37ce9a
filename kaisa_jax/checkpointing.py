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

Resuming with the same layout is exact: the state is moved, not recomputed, so
training continues bit for bit. With another device count, fraction or
assignment the factors and decompositions move to their new owners. If a
layer's method changed (eigen and inverse store the same shapes), the
decompositions are recomputed at the first step after the restore; a side that
changed between dense and diagonal cannot be restored (Orbax refuses the shape).
Treatments do not depend on the device count: the cost rule uses the rows of the
whole data-parallel batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kaisa_jax import assignment, preconditioning, transform

Array = Any


class PortableKFACState(NamedTuple):
  """A `KFACState` per layer (host numpy arrays), independent of the device layout."""

  count: np.ndarray
  factor_total: np.ndarray
  skipped_factor_updates: np.ndarray
  failed_decompositions: np.ndarray
  factors: dict[str, transform.LayerFactors]
  decompositions: dict[str, transform.LayerDecompositions]
  treatments: dict[str, np.ndarray]


def _treatment_code(t) -> np.ndarray:
  """``[method, A diagonal, G diagonal]`` as int32 (method: 0 eigen, 1 inverse)."""
  return np.asarray([preconditioning.METHODS.index(t.method), *t.diagonal], np.int32)


def _is_state(x: Any) -> bool:
  return isinstance(x, transform.KFACState | PortableKFACState)


# The per-device scalars of a KFACState (pmap keeps one copy per device).
_SCALARS = ("count", "factor_total", "skipped_factor_updates", "failed_decompositions", "refresh")


def _unstack(plan: transform.Plan, state: transform.KFACState) -> transform.KFACState:
  """A pmap-replicated state ``(N, ...)`` as the global ``(N / W, W, ...)`` one."""
  rows, cols = plan.layout.rows, plan.layout.cols
  return state._replace(
    factors=state.factors.reshape(rows, cols, -1),
    decompositions=state.decompositions[::cols, 0],
    **{k: getattr(state, k)[0] for k in _SCALARS},
  )


def _portable(plan: transform.Plan, state: transform.KFACState) -> PortableKFACState:
  if plan.collectives.mode == "pmap" and state.count.ndim == 1:
    state = _unstack(plan, state)
  host = jax.tree.map(np.asarray, jax.device_get(state))
  return PortableKFACState(
    host.count,
    host.factor_total,
    host.skipped_factor_updates,
    host.failed_decompositions,
    transform.layer_factors(plan, host),
    transform.layer_decompositions(plan, host),
    {spec.name: _treatment_code(t) for spec, t in plan.layers},
  )


def to_portable(kfac: transform.KFAC, tree: Any) -> Any:
  """``tree`` with every `KFACState` of ``kfac`` replaced by a `PortableKFACState`."""
  return jax.tree.map(
    lambda x: _portable(kfac.plan, x) if isinstance(x, transform.KFACState) else x,
    tree,
    is_leaf=_is_state,
  )


def _layout_state(
  plan: transform.Plan, portable: PortableKFACState, factor_dtype: Any, dec_dtype: Any
) -> transform.KFACState:
  """The global ``(N / W, W, ...)`` state of ``plan`` from a portable one (numpy)."""
  layout = plan.layout
  names = [spec.name for spec, _ in plan.layers]
  missing = sorted(set(names) - portable.factors.keys())
  if missing:
    raise ValueError(
      f"the checkpoint has no factors for layers {missing}: was it saved from this model?"
    )
  refresh = False
  factors, decompositions = {}, {}
  for spec, t in plan.layers:
    saved = [np.asarray(x) for x in portable.factors[spec.name]]
    wanted = assignment.factor_shapes(spec, t)
    if [x.shape for x in saved] != [tuple(w) for w in wanted]:
      raise ValueError(
        f"layer {spec.name!r} has factors of shapes {[x.shape for x in saved]} in the "
        f"checkpoint but {wanted} here: a side is dense in one and diagonal in the other; "
        "restore with the compute_method and max_cost_ratio the checkpoint was made with"
      )
    factors[spec.name] = saved
    shapes = [x for side in assignment.decomposition_shapes(spec, t) for x in side]
    if np.array_equal(np.asarray(portable.treatments[spec.name]), _treatment_code(t)):
      decompositions[spec.name] = [
        x for side in portable.decompositions[spec.name] for x in side if x is not None
      ]
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
            buffer([x for i in layout.owned(r, c) for x in parts[names[i]]], size, dtype)
            for c in range(layout.cols)
          ]
        )
        for r in range(layout.rows)
      ]
    )

  return transform.KFACState(
    count=np.asarray(portable.count, np.int32),
    factor_total=np.asarray(portable.factor_total, np.float32),
    factors=grid(factors, layout.factor_size, factor_dtype),
    decompositions=grid(decompositions, layout.decomposition_size, dec_dtype),
    skipped_factor_updates=np.asarray(portable.skipped_factor_updates, np.int32),
    failed_decompositions=np.asarray(portable.failed_decompositions, np.int32),
    refresh=np.asarray(refresh),
  )


def _place(kfac: transform.KFAC, portable: PortableKFACState) -> transform.KFACState:
  plan = kfac.plan
  dec_dtype = preconditioning.decomposition_dtype(plan.factor_dtype)
  state = _layout_state(plan, portable, plan.factor_dtype, dec_dtype)
  mode, layout = plan.collectives.mode, plan.layout
  if mode == "shard_map":
    specs = transform.state_partition_specs(state)
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
    )
    return jax.tree.map(jnp.asarray, stacked)
  return jax.tree.map(jnp.asarray, state)


def from_portable(kfac: transform.KFAC, tree: Any) -> Any:
  """``tree`` with every `PortableKFACState` laid out as a `KFACState` for ``kfac``.

  The result is sharded over ``kfac``'s mesh (``shard_map``), replicated with a
  leading device axis (``pmap``: pass it to the pmapped step as is), or on the
  default device.
  """
  return jax.tree.map(
    lambda x: _place(kfac, x) if isinstance(x, PortableKFACState) else x,
    tree,
    is_leaf=_is_state,
  )
