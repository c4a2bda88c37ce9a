"""The plan: what `kaisa_jax.kfac` decides at construction, before any step runs.

Every captured layer gets a treatment (`kaisa_jax.cost`: eigen or inverse
method, sides kept diagonal) weighed at the whole data-parallel batch, and an
owner on the device grid (`kaisa_jax.assignment`); `Plan` holds them with the
collectives of the mode (one device, ``shard_map`` or ``pmap``), the factor
dtype and the damping form. ``print(tx.plan)`` shows it as a table.
`kaisa_jax.plan_fractions` builds one plan per grad worker fraction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kaisa_jax import assignment, cost, distribution, preconditioning
from kaisa_jax import layers as layers_lib
from kaisa_jax.capture import Layers, Skipped
from kaisa_jax.config import Settings


@dataclasses.dataclass(frozen=True)
class Plan:
  """Every layer with its treatment and its place, and what is not preconditioned."""

  layers: tuple[tuple[layers_lib.LayerSpec, cost.Treatment], ...]
  skipped: tuple[Skipped, ...]
  layout: assignment.Layout
  inv_update_steps: int
  collectives: distribution.Collectives
  mesh: Mesh | None
  factor_dtype: Any
  damping_form: str = preconditioning.DEFAULT_FORM
  step_norm: str = preconditioning.GRADIENT

  def __str__(self) -> str:
    w = max([28, *(len(x.name) + 1 for x in (*(s for s, _ in self.layers), *self.skipped))])
    k = max([6, *(len(s.kind) for s, _ in self.layers)])
    lines = [
      f"{'layer':<{w}} {'kind':<{k}} {'A':>12} {'G':>12}  {'treatment':<22} {'cost/layer':>10}"
      f" {'group':>5} {'worker':>6} {'stack':>5}"
    ]
    layout = self.layout
    for (spec, t), (row, col), stack in zip(
      self.layers, layout.owners, layout.stack_ids, strict=True
    ):
      sides = []
      for dim, diag in zip((spec.a_dim, spec.g_dim), t.diagonal, strict=True):
        shape = f"{dim}" if diag else f"{dim}x{dim}"
        sides.append(f"{spec.groups}x{shape}" if spec.groups > 1 else shape)
      ratio = cost.step_cost_ratio(whole_batch(spec, self.collectives), t, self.inv_update_steps)
      lines.append(
        f"{spec.name:<{w}} {spec.kind:<{k}} {sides[0]:>12} {sides[1]:>12}  {t!s:<22}"
        f" {ratio:>9.2f}x {row:>5} {col:>6} {stack:>5}"
      )
    for x in self.skipped:
      lines.append(f"{x.name:<{w}} not preconditioned ({x.module_type}): {x.reason}")
    real = sum(assignment.size(assignment.factor_shapes(s, t)) for s, t in self.layers)
    slack = layout.devices * layout.factor_size / max(real, 1) - 1
    lines.append(
      f"{layout.rows} group(s) x {layout.cols} grad worker(s), assignment by "
      f"{layout.cost_kind} cost; factor buffer {layout.factor_size} elements per device "
      f"({100 * slack:.0f}% balance slack); {len(layout.all_stacks())} stack(s) of equal layers, "
      "each preconditioned as one batch; factors of one size decomposed as one batch"
    )
    return "\n".join(lines)


def whole_batch(spec: layers_lib.LayerSpec, comm: distribution.Collectives) -> layers_lib.LayerSpec:
  """The layer as the cost rule weighs it: the rows of the whole data-parallel batch.

  Layers are traced with one device's batch; weighing the whole batch makes a
  layer's treatment independent of the device count.
  """
  return dataclasses.replace(spec, rows=spec.rows * comm.size)


def collectives_for(
  grad_worker_fraction: float | str | None,
  mesh: Mesh | None,
  axis_name: str | None,
  axis_size: int | None,
) -> distribution.Collectives:
  if mesh is not None and axis_name is not None:
    raise ValueError("pass mesh= (for shard_map) or axis_name= (for pmap), not both")
  if axis_size is not None and axis_name is None:
    raise ValueError("axis_size goes with axis_name (pmap)")
  if grad_worker_fraction is not None:
    distribution.check_fraction(grad_worker_fraction)
  if mesh is not None:
    if tuple(mesh.axis_names) != (distribution.RECEIVERS, distribution.GRAD_WORKERS):
      raise ValueError(
        f"mesh must have axes {(distribution.RECEIVERS, distribution.GRAD_WORKERS)}; "
        f"make it with kaisa_jax.make_mesh, got {mesh.axis_names}"
      )
    rows, cols = mesh.devices.shape
    if grad_worker_fraction is not None:
      w = distribution.grad_workers(grad_worker_fraction, mesh.size)
      if w != cols:
        raise ValueError(
          f"grad_worker_fraction={grad_worker_fraction!r} means {w} grad workers, but the "
          f"mesh has {cols}; leave grad_worker_fraction out to use the mesh's"
        )
    return distribution.Collectives("shard_map", rows, cols)
  if axis_name is not None:
    n = jax.device_count() if axis_size is None else axis_size
    if not isinstance(n, int) or n < 1:
      raise ValueError(f"axis_size must be a positive int, got {axis_size!r}")
    w = distribution.grad_workers(grad_worker_fraction or "comm_opt", n)
    return distribution.Collectives("pmap", n // w, w, axis_name)
  return distribution.Collectives("single", 1, 1)


def make_plan(
  layers: Layers,
  comm: distribution.Collectives,
  settings: Settings,
  mesh: Mesh | None = None,
  damping_form: str = preconditioning.DEFAULT_FORM,
  step_norm: str = preconditioning.GRADIENT,
) -> Plan:
  """Each layer's treatment (`kaisa_jax.cost`) and owner (`kaisa_jax.assignment`) on ``comm``'s devices.

  ``settings`` (checked by `kaisa_jax.config.check_settings`) give the method,
  the decompositions' cadence and the cost ratio that choose each treatment,
  the cost the assignment balances and the factor dtype.
  """
  treated = tuple(
    (
      spec,
      cost.choose_treatment(
        whole_batch(spec, comm),
        settings.compute_method,
        settings.inv_update_steps,
        settings.max_cost_ratio,
      ),
    )
    for spec in layers.specs
  )
  layout = assignment.make_layout(treated, comm.rows, comm.cols, settings.assignment_cost)
  return Plan(
    treated,
    layers.skipped,
    layout,
    settings.inv_update_steps,
    comm,
    mesh,
    jnp.dtype(settings.factor_dtype),
    damping_form,
    step_norm,
  )
