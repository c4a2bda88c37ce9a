"""Accounting: the bytes K-FAC moves and stores per device, measured and modelled.

`hlo_collectives` reads a compiled train step and lists every collective with the
bytes it moves per device, attributed to K-FAC's phases by the named scopes its
collectives run under. `communication_model` predicts the same figures from a
plan alone, and those of the KAISA reference's scheme (factors all-reduced to
every device) for comparison, so the cost of a grad worker fraction can be read
before running anything.

Bytes moved per device follow the ring algorithms, for a collective over ``n``
devices with result size ``S``: all-reduce ``2 (n - 1) / n * S``, all-gather
``(n - 1) / n * S``, reduce-scatter ``(n - 1) * S`` (its input is ``n S``),
all-to-all ``(n - 1) / n * S``, collective-permute ``S``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kaisa_jax import assignment, transform

FACTOR_REDUCTION = "factor reduction"
DECOMPOSITION_SHARING = "decomposition sharing"
GRADIENT_SHARING = "gradient sharing"
CHAIN_CHECK = "chain check"
OTHER = "other"
_SCOPES = {
  transform.FACTOR_REDUCTION: FACTOR_REDUCTION,
  transform.DECOMPOSITION_SHARING: DECOMPOSITION_SHARING,
  transform.GRADIENT_SHARING: GRADIENT_SHARING,
  transform.CHAIN_CHECK: CHAIN_CHECK,
}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_OP = re.compile(
  r"=\s*(?P<type>.+?)\s+(?P<kind>" + "|".join(_KINDS) + r")(?P<start>-start)?\((?P<rest>.*)$"
)


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


def _type_bytes(text: str) -> int:
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", text):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def _group_size(rest: str, num_devices: int) -> int:
  explicit = re.search(r"replica_groups=\{\{([0-9,]*)\}", rest)
  if explicit:
    return len(explicit.group(1).split(","))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
  if iota:
    return int(iota.group(2))
  pairs = re.search(r"source_target_pairs=\{([^}]*)\}", rest)
  if pairs:
    return 2
  return num_devices


def hlo_collectives(compiled: Any, num_devices: int | None = None) -> list[Collective]:
  """Every collective in a compiled program (``jax.jit(f).lower(...).compile()``).

  Args:
    compiled: a compiled JAX computation, or its HLO text.
    num_devices: devices of a collective whose groups the HLO leaves implicit.
  """
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  out = []
  for line in text.splitlines():
    match = _OP.search(line)
    if match is None:
      continue
    rest = match.group("rest")
    scope = re.search(r'op_name="([^"]*)"', rest)
    phase = next((p for s, p in _SCOPES.items() if scope and s in scope.group(1)), OTHER)
    type_text = match.group("type")
    if match.group("start"):  # async pairs: count the start, its result type holds the output
      type_text = type_text.split("), ")[-1] if "), " in type_text else type_text
    size = _type_bytes(type_text)
    n = _group_size(rest, num_devices or 1)
    kind = match.group("kind")
    out.append(collective(kind, phase, n, size))
  return out


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


def communication_model(plan: transform.Plan, itemsize: int = 4) -> tuple[Model, Model]:
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
