"""Assignment: which device decomposes and preconditions which layer.

KAISA splits ``N`` data-parallel devices into ``N / W`` grad-worker groups of
``W`` devices (a ``(N / W) x W`` grid: row ``r`` is a group, column ``c`` a
position in it, device index ``r W + c``). Every layer is owned by one group,
and within it by one device, which holds the layer's factors and decomposes
them; every member of the group preconditions the layer.

Layers are assigned by greedy longest-processing-time: heaviest first, each to
the least-loaded group (ties: the lower index), then within each group to the
least-loaded member. The cost of a layer is ``sum d^3`` over its dense factors
(``"compute"``: the decompositions) or ``sum d^2`` (``"memory"``); a diagonal
factor costs ``d``. Among equal costs the earlier layer goes first, so the
assignment is deterministic.

Storage: each device keeps the factors it owns in one flat buffer, and the
decompositions of its group in another. SPMD needs one shape for every device,
so each buffer is as long as the largest device's share; the rest is zeros (the
balance slack, reported as overhead).

Stacks: layers whose factors have the same shapes and treatment (every block of
a transformer, every convolution of a ResNet stage) form a stack on each device
that owns some of them. A device's buffer holds its stacks one after another;
within a stack each array of the layers' factors (or decompositions) is stored
for every member in turn, so it reads as one ``(k, ...)`` array and the stack is
decomposed and preconditioned by one batched operation, whatever ``k``. Any
assignment keeps stacks stackable, so the assignment above does not depend on
them and stays the same for every grad worker fraction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from kaisa_jax import cost, preconditioning
from kaisa_jax import layers as layers_lib

COMPUTE = "compute"
MEMORY = "memory"
COSTS = (COMPUTE, MEMORY)

Shape = tuple[int, ...]
T = TypeVar("T")


def layer_cost(spec: layers_lib.LayerSpec, treatment: cost.Treatment, kind: str) -> float:
  """``sum d^3`` (compute) or ``sum d^2`` (memory) over the layer's dense factors."""
  power = 3 if kind == COMPUTE else 2
  return float(
    sum(
      spec.groups * (d if diag else d**power)
      for d, diag in zip((spec.a_dim, spec.g_dim), treatment.diagonal, strict=True)
    )
  )


def greedy_lpt(costs: Sequence[float], bins: int) -> list[int]:
  """Longest processing time first: heaviest item to the least-loaded bin.

  Ties are resolved by order: among equal costs the earlier item goes first,
  among equally loaded bins the lower index wins.
  """
  loads = [0.0] * bins
  out = [0] * len(costs)
  for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
    b = min(range(bins), key=lambda b: (loads[b], b))
    out[i] = b
    loads[b] += costs[i]
  return out


def factor_shapes(spec: layers_lib.LayerSpec, t: cost.Treatment) -> list[Shape]:
  """Shapes of the layer's ``A`` and ``G`` (a diagonal side is a vector)."""
  return [
    (spec.groups, d) if diag else (spec.groups, d, d)
    for d, diag in zip((spec.a_dim, spec.g_dim), t.diagonal, strict=True)
  ]


def decomposition_shapes(spec: layers_lib.LayerSpec, t: cost.Treatment) -> list[list[Shape]]:
  """Per side, the arrays of its `preconditioning.Decomposition` that are not ``None``."""
  out = []
  for d, diag in zip((spec.a_dim, spec.g_dim), t.diagonal, strict=True):
    if diag:
      out.append([(spec.groups, d)])
    elif t.method == preconditioning.EIGEN:
      out.append([(spec.groups, d, d), (spec.groups, d)])
    else:
      out.append([(spec.groups, d, d)])
  return out


def size(shapes: Sequence[Shape]) -> int:
  return sum(math.prod(s) for s in shapes)


def stack_keys(layers: Sequence[tuple[layers_lib.LayerSpec, cost.Treatment]]) -> tuple[int, ...]:
  """Per layer, its stack: layers that differ only in their names and places share one.

  Members of a stack have equal weights, factors and treatment, so one batched
  computation serves them all. Stacks are numbered in order of their first layer.
  """
  keys: dict[tuple, int] = {}
  anonymous = {"name": "", "param_path": (), "param_suffix": (), "param_index": ()}
  return tuple(
    keys.setdefault((dataclasses.replace(spec, **anonymous), t), len(keys)) for spec, t in layers
  )


def stacked(stacks: Sequence[Sequence[int]], parts: Callable[[int], Sequence[T]]) -> list[T]:
  """The parts of the members of ``stacks`` in buffer order.

  ``parts(i)`` lists layer ``i``'s arrays (its two factors, or its
  decompositions' arrays); members of a stack have the same list of shapes. The
  order is stack by stack, then array by array, then member by member, so each
  array of a stack is one contiguous ``(k, ...)`` block.
  """
  return [parts(i)[p] for members in stacks for p in range(len(parts(members[0]))) for i in members]


@dataclasses.dataclass(frozen=True)
class Layout:
  """The assignment of every layer to a device, and the buffer sizes it implies.

  Attributes:
    rows: number of grad-worker groups, ``N / W``.
    cols: grad workers per group, ``W``.
    owners: per layer (in plan order), the ``(group, member)`` that owns it.
    stack_ids: per layer, its stack (`stack_keys`).
    factor_size: elements of each device's factor buffer.
    decomposition_size: elements of each device's own decompositions.
    gradient_size: elements of each group's preconditioned gradients.
    cost_kind: ``"compute"`` or ``"memory"``.
  """

  rows: int
  cols: int
  owners: tuple[tuple[int, int], ...]
  stack_ids: tuple[int, ...]
  factor_size: int
  decomposition_size: int
  gradient_size: int
  cost_kind: str = COMPUTE

  @property
  def devices(self) -> int:
    return self.rows * self.cols

  def owned(self, row: int, col: int) -> list[int]:
    """Indices of the layers device ``(row, col)`` owns, in plan order."""
    return [i for i, o in enumerate(self.owners) if o == (row, col)]

  def group(self, row: int) -> list[int]:
    """Indices of group ``row``'s layers, member by member."""
    return [i for c in range(self.cols) for i in self.owned(row, c)]

  def stacks(self, row: int, col: int) -> list[list[int]]:
    """The layers device ``(row, col)`` owns, stack by stack (in order of first layer)."""
    out: dict[int, list[int]] = {}
    for i in self.owned(row, col):
      out.setdefault(self.stack_ids[i], []).append(i)
    return list(out.values())

  def all_stacks(self) -> list[list[int]]:
    """Every layer, stack by stack: the stacks as computed where all devices compute all layers."""
    out: dict[int, list[int]] = {}
    for i, key in enumerate(self.stack_ids):
      out.setdefault(key, []).append(i)
    return list(out.values())

  def group_stacks(self, row: int) -> list[list[int]]:
    """Group ``row``'s stacks, member by member: the order of its preconditioned gradients."""
    return [s for c in range(self.cols) for s in self.stacks(row, c)]


def make_layout(
  layers: Sequence[tuple[layers_lib.LayerSpec, cost.Treatment]],
  rows: int,
  cols: int,
  cost_kind: str = COMPUTE,
) -> Layout:
  """Assigns layers to groups, then members (greedy LPT), and sizes the buffers."""
  costs = [layer_cost(spec, t, cost_kind) for spec, t in layers]
  group_of = greedy_lpt(costs, rows)
  owners: list[tuple[int, int]] = [(0, 0)] * len(layers)
  for r in range(rows):
    members = [i for i in range(len(layers)) if group_of[i] == r]
    for i, c in zip(members, greedy_lpt([costs[i] for i in members], cols), strict=True):
      owners[i] = (r, c)

  def total(indices, shapes_of) -> int:
    return sum(size(shapes_of(*layers[i])) for i in indices)

  def owned(r, c):
    return [i for i, o in enumerate(owners) if o == (r, c)]

  devices = [(r, c) for r in range(rows) for c in range(cols)]
  factor = max(total(owned(*d), factor_shapes) for d in devices)
  decomposition = max(
    total(owned(*d), lambda s, t: [x for side in decomposition_shapes(s, t) for x in side])
    for d in devices
  )
  gradient = max(
    sum(s.num_weights for c in range(cols) for s, _ in (layers[i] for i in owned(r, c)))
    for r in range(rows)
  )
  return Layout(
    rows, cols, tuple(owners), stack_keys(layers), factor, decomposition, gradient, cost_kind
  )
