"""Planning: which grad worker fraction to use on a cluster, and what each one costs.

KAISA's grad worker fraction ``f`` trades memory for communication: with
``W = f N`` grad workers per group, each device stores the decompositions of
its whole group (``W`` devices' worth) and preconditions its group's layers;
fewer, larger groups (``f`` near 1) store more and share preconditioned
gradients less. `plan_fractions` lays the layers out for every valid ``f`` on
``N`` devices exactly as `kaisa_jax.kfac` would and reports, per device:

* second-order memory: the factor buffer and the decomposition buffers of the
  group, in bytes (exact: these are the shapes of `kaisa_jax.KFACState`);
* K-FAC's projected seconds per step (a model):
  factor statistics of every layer on the device's rows (every
  ``factor_update_steps``), decompositions of the factors it owns (every
  ``inv_update_steps``) and preconditioning of its group's layers (every
  step), in flops from `kaisa_jax.cost` over the cluster's FLOP/s; plus the
  collectives of each phase (`kaisa_jax.modelled_collectives`).
  The model's own forward and backward pass is the same for every ``f`` and
  left out.

It recommends the fastest fraction whose memory fits the memory budget (ties:
the one using less memory). The budget is what the device leaves to K-FAC
(`budget_for`): ``cluster.memory - model_memory``, with ``model_memory``
the bytes per device the model and its first-order training need (parameters,
gradients, optimizer state, activations), by default half the device's memory;
or a ``memory_budget`` given outright.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import numbers
from typing import Any

import numpy as np

from kaisa_jax import assignment, cost, distribution, preconditioning
from kaisa_jax.capture import Layers
from kaisa_jax.cluster import Cluster
from kaisa_jax.communication import communication_seconds, modelled_collectives
from kaisa_jax.config import Settings, check_settings
from kaisa_jax.plan import Plan, make_plan

PLANNED_AXIS = "planned"
# Without a model_memory, the model and its first-order training are assumed to need
# this share of the device's memory, and K-FAC may use the rest.
DEFAULT_MODEL_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class FractionOption:
  """One grad worker fraction on ``N`` devices, per device.

  Attributes:
    fraction: ``f = W / N``.
    grad_workers: ``W``.
    factor_memory: bytes of factors stored.
    decomposition_memory: bytes of decompositions stored (the group's).
    compute: projected seconds of K-FAC compute per step.
    communication: projected seconds of K-FAC's collectives per step.
    fits: whether the memory is within the budget.
  """

  fraction: fractions.Fraction
  grad_workers: int
  factor_memory: int
  decomposition_memory: int
  compute: float
  communication: float
  fits: bool

  @property
  def memory(self) -> int:
    """Second-order bytes per device: factors and decompositions."""
    return self.factor_memory + self.decomposition_memory

  @property
  def seconds(self) -> float:
    """Projected seconds of K-FAC per step."""
    return self.compute + self.communication


@dataclasses.dataclass(frozen=True)
class FractionPlan:
  """Every valid fraction on ``devices`` devices and the recommended one.

  Attributes:
    devices: ``N``.
    cluster: the cluster the times are projected for.
    memory_budget: bytes per device allowed for K-FAC's state (``math.inf``: any).
    options: one `FractionOption` per valid fraction, ``W`` from 1 to ``N``.
    recommended: the fastest fraction that fits (ties: less memory); pass it
      as ``grad_worker_fraction``. ``None`` if none fits.
  """

  devices: int
  cluster: Cluster
  memory_budget: float
  options: tuple[FractionOption, ...]
  recommended: fractions.Fraction | None

  def __str__(self) -> str:
    budget = "none" if math.isinf(self.memory_budget) else _bytes(self.memory_budget)
    lines = [
      f"K-FAC grad worker fraction on {self.devices} device(s) of {self.cluster.name}; "
      f"memory budget {budget} per device; times PROJECTED ({self.cluster.source})",
      f"{'f':>7} {'W':>4} {'factors':>11} {'decomps':>11} {'total':>11} {'fits':>5}"
      f" {'compute ms':>11} {'comm ms':>9} {'K-FAC ms':>9}",
    ]
    for o in self.options:
      mark = "  <- recommended" if o.fraction == self.recommended else ""
      lines.append(
        f"{o.fraction!s:>7} {o.grad_workers:>4} {_bytes(o.factor_memory):>11}"
        f" {_bytes(o.decomposition_memory):>11} {_bytes(o.memory):>11} {'yes' if o.fits else 'no':>5}"
        f" {1e3 * o.compute:>11.4f} {1e3 * o.communication:>9.4f} {1e3 * o.seconds:>9.4f}{mark}"
      )
    if self.recommended is None:
      lines.append(
        "no fraction fits the memory budget: raise it (a smaller model_memory or a larger "
        "memory_budget), or use more devices"
      )
    return "\n".join(lines)


def _bytes(n: float) -> str:
  """Bytes in KiB, MiB or GiB, whichever keeps the number below 1024."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n / 2**10:.1f} KiB"


def layout_for(plan: Plan, devices: int, fraction: float | str) -> assignment.Layout:
  """The layout `kaisa_jax.kfac` makes for ``plan``'s layers on ``devices`` with ``fraction``."""
  cols = distribution.grad_workers(fraction, devices)
  return assignment.make_layout(plan.layers, devices // cols, cols, plan.layout.cost_kind)


def busiest_flops(plan: Plan, layout: assignment.Layout) -> tuple[float, float]:
  """Flops of the decompositions the busiest device owns, and of the preconditioning the busiest group runs.

  From `kaisa_jax.cost`; SPMD makes every device wait for the busiest.
  """
  dec = [cost.decomposition_flops(s, t) for s, t in plan.layers]
  pre = [cost.preconditioning_flops(s, t) for s, t in plan.layers]
  devices = [(r, c) for r in range(layout.rows) for c in range(layout.cols)]
  return (
    max(sum(dec[i] for i in layout.owned(*d)) for d in devices),
    max(sum(pre[i] for i in layout.group(r)) for r in range(layout.rows)),
  )


def busiest_shares(plan: Plan, layout: assignment.Layout) -> tuple[float, float]:
  """`busiest_flops` as shares of all the layers' decomposition and preconditioning flops."""
  dec, pre = busiest_flops(plan, layout)
  dec_all, pre_all = busiest_flops(plan, layout_for(plan, 1, 1))
  return dec / max(dec_all, 1.0), pre / max(pre_all, 1.0)


def _compute_seconds(
  plan: Plan,
  cluster: Cluster,
  factor_update_steps: int,
  inv_update_steps: int,
) -> float:
  """Per-device K-FAC compute per step of the busiest device, from `kaisa_jax.cost`."""
  factors = sum(cost.factor_flops(s, t) for s, t in plan.layers)
  decompositions, preconditioning_flops = busiest_flops(plan, plan.layout)
  flops = factors / factor_update_steps + decompositions / inv_update_steps + preconditioning_flops
  return flops / cluster.flops_per_s


def state_bytes(layout: assignment.Layout, factor_dtype: Any) -> tuple[int, int]:
  """Bytes per device of K-FAC's state on ``layout``: its factor buffer and its group's decompositions.

  ``factor_size`` elements of ``factor_dtype``, and ``cols x decomposition_size``
  of the decompositions' dtype (`preconditioning.decomposition_dtype`): the
  sizes of `kaisa_jax.KFACState`'s ``factors`` and ``decompositions`` on one
  device. On the layout of one device (``layout_for(plan, 1, 1)``), every
  layer's factors and decompositions.
  """
  itemsize = np.dtype(factor_dtype).itemsize
  dec_itemsize = np.dtype(preconditioning.decomposition_dtype(factor_dtype)).itemsize
  return layout.factor_size * itemsize, layout.cols * layout.decomposition_size * dec_itemsize


def _option(
  layers: Layers,
  cluster: Cluster,
  memory_budget: float,
  settings: Settings,
  n_devices: int,
  w: int,
) -> FractionOption:
  """Memory and projected time per device with ``W = w`` grad workers on ``n_devices``."""
  comm = distribution.Collectives("pmap", n_devices // w, w, PLANNED_AXIS)
  plan = make_plan(layers, comm, settings)
  layout = plan.layout
  itemsize = settings.factor_dtype.itemsize
  factor_memory, decomposition_memory = state_bytes(layout, settings.factor_dtype)
  collectives = modelled_collectives(layout, n_devices, gradient_bytes=None, itemsize=itemsize)
  cadence = (settings.factor_update_steps, settings.inv_update_steps)
  communication = communication_seconds(cluster, collectives, n_devices, w, *cadence)
  memory = factor_memory + decomposition_memory
  return FractionOption(
    fraction=fractions.Fraction(w, n_devices),
    grad_workers=w,
    factor_memory=factor_memory,
    decomposition_memory=decomposition_memory,
    compute=_compute_seconds(plan, cluster, *cadence),
    communication=sum(communication.values()),
    fits=memory <= memory_budget,
  )


def _positive_bytes(name: str, value: Any, allow_zero: bool, allow_inf: bool = False) -> float:
  """``value`` as a float of bytes; raises unless it is a real number in range."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a number of bytes, got {value!r}")
  value = float(value)
  finite = math.isfinite(value) or (allow_inf and value == math.inf)
  if not finite or value < 0 or (value == 0 and not allow_zero):
    bound = ">= 0" if allow_zero else "> 0"
    also = " (math.inf: no limit)" if allow_inf else ""
    raise ValueError(f"{name} must be a finite number of bytes {bound}{also}, got {value!r}")
  return value


def budget_for(
  cluster: Cluster,
  model_memory: float | None = None,
  memory_budget: float | None = None,
) -> float:
  """Bytes per device K-FAC's factors and decompositions may use on ``cluster``.

  ``memory_budget`` when given (``math.inf``: no limit); else what the device
  leaves, ``cluster.memory - model_memory``, with ``model_memory`` the bytes per
  device of the model and its first-order training (parameters, gradients,
  optimizer state, activations) and, when it is ``None``, `DEFAULT_MODEL_SHARE`
  of ``cluster.memory``. Giving both raises: each sets the budget.
  """
  if memory_budget is not None:
    if model_memory is not None:
      raise ValueError(
        "give memory_budget (the bytes per device K-FAC may use) or model_memory (the bytes "
        "per device the model needs; K-FAC gets the device's memory less them), not both"
      )
    return _positive_bytes("memory_budget", memory_budget, allow_zero=False, allow_inf=True)
  if model_memory is None:
    return (1.0 - DEFAULT_MODEL_SHARE) * cluster.memory
  model_memory = _positive_bytes("model_memory", model_memory, allow_zero=True)
  if model_memory >= cluster.memory:
    raise ValueError(
      f"model_memory ({_bytes(model_memory)}) is at or above the memory of one device of "
      f"{cluster.name} ({_bytes(cluster.memory)}): nothing is left for K-FAC. Give the model's "
      "bytes per device (with the per-device batch), a cluster with more memory per device "
      "(kaisa_jax.Cluster(memory=...)), or memory_budget= outright"
    )
  return cluster.memory - model_memory


def plan_fractions(
  layers: Layers,
  n_devices: int,
  cluster: Cluster,
  memory_budget: float | None = None,
  *,
  model_memory: float | None = None,
  factor_update_steps: int = 10,
  inv_update_steps: int = 100,
  compute_method: str = preconditioning.EIGEN,
  max_cost_ratio: float | None = 4.0,
  assignment_cost: str = "compute",
  factor_dtype: Any = "float32",
) -> FractionPlan:
  """Memory and projected K-FAC time per step of every grad worker fraction.

  Args:
    layers: the model's layers traced at the per-device batch
      (``grad_fn.layers(params, local_batch)``).
    n_devices: ``N``, the data-parallel devices.
    cluster: the hardware (`kaisa_jax.DGX_A100`, ``DGX_H100``, or a
      `kaisa_jax.Cluster` of your own).
    memory_budget: bytes per device K-FAC's factors and decompositions may use,
      given outright (``math.inf``: no limit). ``None`` (the default): what
      the device leaves, ``cluster.memory - model_memory``.
    model_memory: bytes per device the model and its first-order training
      need: parameters, gradients, optimizer state and activations at the
      per-device batch. ``None`` (the default): half of ``cluster.memory``
      (`DEFAULT_MODEL_SHARE`). Not with ``memory_budget``; at or above
      ``cluster.memory`` it raises.
    factor_update_steps, inv_update_steps, compute_method, max_cost_ratio, assignment_cost, factor_dtype:
      as given to `kaisa_jax.kfac`, and checked as it checks them
      (`kaisa_jax.config.check_settings`; a cadence's schedule counts at its
      value at step 0); they decide each layer's treatment, its owner and the
      cadence of the phases.

  Returns:
    A `FractionPlan`; ``print`` it for a table, pass ``.recommended`` as
    ``grad_worker_fraction``.
  """
  if not isinstance(layers, Layers):
    raise TypeError(
      f"plan_fractions takes the model's layers (grad_fn.layers(...)), got {type(layers).__name__}"
    )
  if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
    raise ValueError(f"n_devices must be an int >= 1, got {n_devices!r}")
  if not isinstance(cluster, Cluster):
    raise TypeError(
      f"cluster must be a kaisa_jax.Cluster (e.g. kaisa_jax.DGX_A100), got {type(cluster).__name__}"
    )
  budget = budget_for(cluster, model_memory, memory_budget)
  settings = check_settings(
    factor_update_steps=factor_update_steps,
    inv_update_steps=inv_update_steps,
    compute_method=compute_method,
    max_cost_ratio=max_cost_ratio,
    assignment_cost=assignment_cost,
    factor_dtype=factor_dtype,
  )
  return fraction_options(layers, n_devices, cluster, budget, settings)


def fraction_options(
  layers: Layers,
  n_devices: int,
  cluster: Cluster,
  memory_budget: float,
  settings: Settings,
) -> FractionPlan:
  """`plan_fractions` with its arguments checked, the settings by `kaisa_jax.config.check_settings`."""
  options = [
    _option(layers, cluster, memory_budget, settings, n_devices, w)
    for w in range(1, n_devices + 1)
    if n_devices % w == 0
  ]
  fitting = [o for o in options if o.fits]
  best = min(fitting, key=lambda o: (o.seconds, o.memory), default=None)
  return FractionPlan(
    n_devices, cluster, memory_budget, tuple(options), None if best is None else best.fraction
  )
