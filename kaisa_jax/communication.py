"""Communication: the bytes K-FAC moves and stores per device, and their seconds on a cluster.

A model from the layout alone, so the cost of a grad worker fraction can be read
before running anything: `layout_collectives` lists the collectives of each
K-FAC phase, `communication_model` sums them with the memory they leave on a
device (and does the same for the KAISA reference's scheme, factors all-reduced
to every device), and `communication_seconds` prices them on a `Cluster`.
`kaisa_jax.analysis.accounting.hlo_collectives` reads the same figures from a
compiled program, to check this model.

Bytes moved per device follow the ring algorithms, for a collective over ``n``
devices with result size ``S``: all-reduce ``2 (n - 1) / n * S``, all-gather
``(n - 1) / n * S``, reduce-scatter ``(n - 1) * S`` (its input is ``n S``),
all-to-all ``(n - 1) / n * S``, collective-permute ``S``. A collective costs
``latency + moved_bytes / bandwidth`` seconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kaisa_jax import assignment
from kaisa_jax.cluster import Cluster
from kaisa_jax.plan import Plan

FACTOR_REDUCTION = "factor reduction"
DECOMPOSITION_SHARING = "decomposition sharing"
GRADIENT_SHARING = "gradient sharing"
CHAIN_CHECK = "chain check"
OTHER = "other"


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program.

  Attributes:
    kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``,
      ``"all-to-all"`` or ``"collective-permute"``.
    phase: the K-FAC phase it belongs to, ``"chain check"`` (the first step's
      check that kfac comes first in its chain: one small all-reduce, run once),
      or ``"other"`` (for instance the data-parallel gradient all-reduce of the
      train step).
    group_size: devices taking part in each of its groups.
    result_bytes: bytes of its result on one device.
    moved_bytes: bytes it moves per device (ring algorithms).
  """

  kind: str
  phase: str
  group_size: int
  result_bytes: int
  moved_bytes: float


def moved(kind: str, n: int, result_bytes: float) -> float:
  """Bytes one device moves in a collective over ``n`` devices (ring algorithms)."""
  if n <= 1:
    return 0.0
  return {
    "all-reduce": 2.0 * (n - 1) / n,
    "all-gather": (n - 1) / n,
    "reduce-scatter": float(n - 1),
    "all-to-all": (n - 1) / n,
    "collective-permute": 1.0,
  }[kind] * result_bytes


def collective(kind: str, phase: str, n: int, result_bytes: float) -> Collective:
  """A collective over ``n`` devices with a result of ``result_bytes``, and the bytes it moves."""
  return Collective(kind, phase, n, int(result_bytes), moved(kind, n, result_bytes))


def amortised(
  collectives: Sequence[Collective],
  factor_update_steps: int,
  inv_update_steps: int,
  value: Callable[[Collective], float],
) -> dict[str, float]:
  """``value`` of the collectives summed per phase and per step, each divided by its phase's cadence.

  The chain check runs on the first step only: amortised over a run, nothing.
  """
  every = {FACTOR_REDUCTION: factor_update_steps, DECOMPOSITION_SHARING: inv_update_steps}
  out = {p: 0.0 for p in (FACTOR_REDUCTION, DECOMPOSITION_SHARING, GRADIENT_SHARING, OTHER)}
  for c in collectives:
    if c.phase != CHAIN_CHECK:
      out[c.phase] += value(c) / every.get(c.phase, 1)
  return out


def per_step(
  collectives: list[Collective], factor_update_steps: int, inv_update_steps: int
) -> dict[str, float]:
  """Bytes moved per device per step by phase, amortised over the cadence."""
  return amortised(collectives, factor_update_steps, inv_update_steps, lambda c: c.moved_bytes)


@dataclasses.dataclass(frozen=True)
class Model:
  """Per-device bytes of one scheme: communication per occurrence, and memory.

  Attributes:
    factor_reduction: bytes moved by one factor reduction (factor steps).
    decomposition_sharing: bytes moved by one decomposition sharing (inverse steps).
    gradient_sharing: bytes moved by one gradient sharing (every step).
    factor_memory: bytes of factors stored.
    decomposition_memory: bytes of decompositions stored.
  """

  factor_reduction: float
  decomposition_sharing: float
  gradient_sharing: float
  factor_memory: float
  decomposition_memory: float

  def per_step(self, factor_update_steps: int, inv_update_steps: int) -> dict[str, float]:
    return {
      FACTOR_REDUCTION: self.factor_reduction / factor_update_steps,
      DECOMPOSITION_SHARING: self.decomposition_sharing / inv_update_steps,
      GRADIENT_SHARING: self.gradient_sharing,
    }


def layout_collectives(layout: assignment.Layout, itemsize: int = 4) -> list[Collective]:
  """The collectives of K-FAC's phases for a layout, one occurrence of each phase.

  Factor steps: a reduce-scatter of every device's factor buffer over all
  ``N`` devices and an all-reduce of the int32 health count. Inverse steps: an
  all-gather of the decompositions within each group of ``W`` and an all-reduce
  of the count. Every step: an all-gather of the preconditioned gradients
  across the ``N / W`` groups. A collective over one device moves nothing.
  """
  rows, cols, n = layout.rows, layout.cols, layout.devices
  return [
    collective("reduce-scatter", FACTOR_REDUCTION, n, layout.factor_size * itemsize),
    collective("all-reduce", FACTOR_REDUCTION, n, 4),
    collective(
      "all-gather", DECOMPOSITION_SHARING, cols, cols * layout.decomposition_size * itemsize
    ),
    collective("all-reduce", DECOMPOSITION_SHARING, n, 4),
    collective("all-gather", GRADIENT_SHARING, rows, rows * layout.gradient_size * itemsize),
  ]


def communication_model(plan: Plan, itemsize: int = 4) -> tuple[Model, Model]:
  """``(kaisa_jax, reference)`` per-device bytes for a plan's layout.

  ``kaisa_jax`` reduces each factor onto its owner and stores it there (buffers
  as long as the largest device's share), and each phase agrees on one int32
  health count (non-finite factors, failed decompositions); ``reference`` all-reduces every factor
  to every device and stores all of them, as the KAISA reference implementation
  does. Both share decompositions within groups and preconditioned gradients
  across them.
  """
  layout = plan.layout
  rows, cols, n = layout.rows, layout.cols, layout.devices
  ours_collectives = layout_collectives(layout, itemsize)

  def phase_bytes(phase: str) -> float:
    return sum(c.moved_bytes for c in ours_collectives if c.phase == phase)

  ours = Model(
    factor_reduction=phase_bytes(FACTOR_REDUCTION),
    decomposition_sharing=phase_bytes(DECOMPOSITION_SHARING),
    gradient_sharing=phase_bytes(GRADIENT_SHARING),
    factor_memory=layout.factor_size * itemsize,
    decomposition_memory=cols * layout.decomposition_size * itemsize,
  )
  factors = sum(assignment.size(assignment.factor_shapes(s, t)) for s, t in plan.layers)
  decomps = sum(
    assignment.size([x for side in assignment.decomposition_shapes(s, t) for x in side])
    for s, t in plan.layers
  )
  grads = sum(s.num_weights for s, _ in plan.layers)
  reference = Model(
    factor_reduction=moved("all-reduce", n, factors * itemsize),
    decomposition_sharing=moved("all-gather", cols, decomps / rows * itemsize),
    gradient_sharing=moved("all-gather", rows, grads * itemsize),
    factor_memory=factors * itemsize,
    decomposition_memory=decomps / rows * itemsize,
  )
  return ours, reference


def _spans_nodes(cluster: Cluster, phase: str, devices: int, cols: int) -> bool:
  """Whether a phase's collective runs over devices of more than one node.

  Devices are numbered node by node; a grad-worker group is ``W`` consecutive
  devices, the receivers of a position are ``W`` apart, the data-parallel
  reductions span all ``N``.
  """
  if phase == DECOMPOSITION_SHARING:
    return cols > cluster.devices_per_node
  return devices > cluster.devices_per_node


def communication_seconds(
  cluster: Cluster,
  collectives: Sequence[Collective],
  devices: int,
  cols: int,
  factor_update_steps: int = 1,
  inv_update_steps: int = 1,
) -> dict[str, float]:
  """Seconds per step by phase of a list of collectives, amortised by phase cadence.

  Each collective costs ``latency + moved_bytes / bandwidth``; one over a
  single device costs nothing. The chain check runs once: nothing per step.
  """

  def seconds(c: Collective) -> float:
    if c.group_size <= 1:
      return 0.0
    bandwidth = cluster.bandwidth(_spans_nodes(cluster, c.phase, devices, cols))
    return cluster.latency + c.moved_bytes / bandwidth

  return amortised(collectives, factor_update_steps, inv_update_steps, seconds)


def modelled_collectives(
  layout: assignment.Layout | None,
  devices: int,
  gradient_bytes: float | None,
  itemsize: int = 4,
) -> list[Collective]:
  """The collectives of a data-parallel step on ``devices``, from the layout.

  The gradient all-reduce of data parallelism (``gradient_bytes``; ``None``
  leaves it out), and with a K-FAC ``layout`` those of its phases
  (`kaisa_jax.layout_collectives`).
  """
  out = []
  if gradient_bytes is not None:
    out.append(collective("all-reduce", OTHER, devices, gradient_bytes))
  if layout is not None:
    out += layout_collectives(layout, itemsize)
  return out
