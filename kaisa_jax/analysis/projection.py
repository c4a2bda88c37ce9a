"""Projection: the time of a train step on a described cluster. A model, not a measurement.

Nothing here runs on the cluster it describes. From a train step compiled for
one device at the per-device batch (the global batch over ``N``), it projects
the seconds per step on ``N`` data-parallel devices:

* compute: ``(flops + lapack_flops) / flops_per_s + bytes / memory_bandwidth``
  per device, from XLA's cost analysis of the compiled program (``flops`` and
  ``bytes accessed``) and the LAPACK calls it does not count (`lapack_flops`),
  products and convolutions at the rate for their size where the cluster has
  one (`Cluster.matmul_rates`, `ProgramCost.seconds`). XLA
  counts a ``lax.cond`` as if its branch always ran, so K-FAC's factor and
  decomposition phases are compiled on their own (`kfac_work`) and amortised by
  their cadence; on ``N`` devices with grad worker fraction ``f`` each device
  decomposes only the factors it owns and preconditions only its group's
  layers, the largest share of any device (from the layout, weighted by each
  layer's flops, `kaisa_jax.cost`) setting the pace.
* communication: per collective, ``latency + moved_bytes / bandwidth``, with
  the bytes a ring algorithm moves per device (`kaisa_jax.communication.moved`)
  over the bandwidth within a node, or across nodes when the collective's
  devices span several nodes; amortised by the cadence of its K-FAC phase. The
  bytes come from the HLO of a compiled ``N``-device program when one is given
  (`kaisa_jax.analysis.accounting.hlo_collectives`), else from the layout
  (`kaisa_jax.communication.communication_model`) and the data-parallel gradient
  all-reduce.

Compute and communication are added, not overlapped. `Cluster` describes the
hardware (`kaisa_jax.cluster`), and `measure_host` times this machine into one.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import os
import re
import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kaisa_jax import cost, parameters, phases, transform
from kaisa_jax.cluster import MATMUL_SIZES, MATMUL_WIDTHS, Cluster
from kaisa_jax.communication import (
  Collective,
  communication_seconds,
  modelled_collectives,
)
from kaisa_jax.planning import busiest_shares, layout_for


def _median_seconds(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


class Probe(NamedTuple):
  """A small program that measures one of this machine's rates: ``fn(*args)``, of cost ``cost``."""

  fn: Any
  args: tuple
  cost: ProgramCost


def on_host(tree: Any) -> Any:
  """``tree``'s arrays as shapes placed on the host's CPU: a program lowered for them compiles
  for the CPU, whatever the default backend.

  On a GPU, XLA's cost analysis leaves out the convolutions and most matrix products (they run
  as library calls); the CPU's count holds every operation, so programs are counted as compiled
  for the CPU.
  """
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu), tree)


def _probe(fn: Any, *args: Any) -> Probe:
  """``fn`` jitted on the default device, its cost counted as compiled for the CPU (`on_host`)."""
  fn = jax.jit(fn)
  return Probe(fn, args, program_cost(fn.lower(*on_host(args)).compile()))


def _chain(links: int) -> Any:
  def f(x):
    for _ in range(links):
      x = jnp.tanh(x @ x)
    return x

  return f


def _dense(width: int) -> Probe:
  """Two ``width x width`` dense layers' forward and backward pass on 128 rows."""
  x = jnp.ones((128, width), jnp.float32)
  w = jnp.full((width, width), 1.0 / width, jnp.float32)
  return _probe(jax.grad(lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w)), argnums=(0, 1)), w, x)


def host_probes() -> dict[str, Probe]:
  """The programs `measure_host` times, by name; `host_rates` turns their seconds into rates.

  * ``"dense W"`` for each ``W`` of `MATMUL_WIDTHS`: a training-shaped float32
    workload, the forward and backward pass of two ``W x W`` dense layers on
    128 rows (three products of ``2 * 128 * W^2`` flops per layer, and their
    elementwise work).
  * ``"stream"``: ``x + 1`` on 4 MB (cache-sized, as a step's buffers are).
  * ``"short chain"``, ``"long chain"``: 10 and 110 links of an ``8 x 8``
    product and a tanh; the difference of their times per kernel is the cost
    of a kernel.
  """
  small = jnp.full((8, 8), 0.1, jnp.float32)
  return {
    "stream": _probe(lambda v: v + 1.0, jnp.ones((2**20,), jnp.float32)),
    "short chain": _probe(_chain(10), small),
    "long chain": _probe(_chain(110), small),
    **{f"dense {w}": _dense(w) for w in MATMUL_WIDTHS},
  }


def host_rates(probes: dict[str, Probe], seconds: dict[str, float]) -> dict[str, Any]:
  """`Cluster` rates from the seconds per call of `host_probes`' programs.

  ``matmul_rates`` (each dense workload's flops over its time),
  ``flops_per_s`` (the 256-wide one's, the shapes a small model's step runs),
  ``memory_bandwidth`` (the stream's bytes over its time; both collective
  bandwidths too: devices of a host share its memory) and
  ``kernel_overhead`` (the chains' difference in time over their difference
  in kernels), as keyword arguments of `Cluster` or ``dataclasses.replace``.

  Args:
    probes: `host_probes`' programs, by name.
    seconds: seconds per call of each of them, by the same names.
  """
  bandwidth = probes["stream"].cost.bytes / seconds["stream"]
  kernels = probes["long chain"].cost.kernels - probes["short chain"].cost.kernels
  extra = seconds["long chain"] - seconds["short chain"]
  return {
    "flops_per_s": probes["dense 256"].cost.flops / seconds["dense 256"],
    "memory_bandwidth": bandwidth,
    "intra_node_bandwidth": bandwidth,
    "inter_node_bandwidth": bandwidth,
    "kernel_overhead": max(extra, 1e-9) / max(kernels, 1.0),
    "matmul_rates": tuple(
      probes[f"dense {w}"].cost.flops / seconds[f"dense {w}"] for w in MATMUL_WIDTHS
    ),
  }


def measure_host(name: str = "this host") -> Cluster:
  """This machine's first device, measured by small programs timed at call.

  The rates come from `host_probes` (median of 30 calls each) through
  `host_rates`; the latency is that of a jitted call on a scalar. Timed apart
  from the work they are compared with, the rates follow the machine's speed at
  the moment they are taken (it drifts by tens of percent within minutes on a
  shared machine): time the probes in turns with that work where the
  comparison matters, as ``benchmarks/projection.py`` does.

  Args:
    name: what to call the machine in the `Cluster`'s name (its device kind
      is added).
  """
  probes = host_probes()
  seconds = {k: _median_seconds(p.fn, *p.args, repeats=30) for k, p in probes.items()}
  latency = _median_seconds(jax.jit(lambda s: s + 1.0), jnp.float32(0), repeats=50)
  stats = jax.devices()[0].memory_stats() or {}  # an accelerator's; None on a CPU
  try:
    memory = float(
      stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
  except (ValueError, OSError, AttributeError):  # pragma: no cover: not POSIX
    memory = 1e9
  return Cluster(
    name=f"{name} ({jax.devices()[0].device_kind})",
    devices_per_node=jax.local_device_count(),
    latency=latency,
    memory=memory,
    source="measured: 2 dense layers 16 to 1024 wide, forward and backward on 128 rows; "
    "x + 1 on 4 MB; a scalar call; chains of tiny kernels",
    **host_rates(probes, seconds),
  )


class ProgramCost(NamedTuple):
  """What XLA's cost analysis says of a compiled program, and what it leaves out.

  Attributes:
    flops: floating-point operations XLA counts.
    lapack_flops: those of the LAPACK decompositions it does not count.
    bytes: bytes its operations read and write.
    kernels: operations it launches (`kernel_count`).
    matmuls: the part of ``flops`` in matrix products and convolutions, by
      the size of the product (`binned` `matmul_flops`, one entry per
      `MATMUL_SIZES`).
  """

  flops: float
  lapack_flops: float
  bytes: float
  kernels: float = 0.0
  matmuls: tuple[float, ...] = (0.0,) * len(MATMUL_SIZES)

  def __add__(self, other: ProgramCost) -> ProgramCost:  # type: ignore[override]
    return ProgramCost(*_combine(lambda a, b: a + b, self, other))

  def scaled(self, factor: float) -> ProgramCost:
    return ProgramCost(*_combine(lambda a, _: factor * a, self, self))

  def seconds(self, cluster: Cluster) -> float:
    """``sum_s matmuls[s] / matmul_rates[s] + (other flops + lapack_flops) / flops_per_s + bytes / memory_bandwidth + kernels * kernel_overhead``.

    Without ``cluster.matmul_rates`` every flop runs at ``flops_per_s``.
    """
    if cluster.matmul_rates is None:
      flops = (self.flops + self.lapack_flops) / cluster.flops_per_s
    else:
      other = max(self.flops - sum(self.matmuls), 0.0) + self.lapack_flops
      flops = other / cluster.flops_per_s + sum(
        m / r for m, r in zip(self.matmuls, cluster.matmul_rates, strict=True)
      )
    return flops + self.bytes / cluster.memory_bandwidth + self.kernels * cluster.kernel_overhead


def _combine(op, x: ProgramCost, y: ProgramCost) -> list:
  return [
    tuple(map(op, a, b)) if isinstance(a, tuple) else op(a, b) for a, b in zip(x, y, strict=True)
  ]


_LAPACK = re.compile(r'custom_call_target="([^"]*(?:syevd|potrf|heevd|trsm)[^"]*)"')


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(",") if d]


def _lapack_call_flops(line: str) -> float:
  """Flops of one instruction if it is a LAPACK custom call, else 0."""
  target = _LAPACK.search(line)
  if target is None:
    return 0.0
  operand = re.search(r"custom-call\((?:[a-z0-9]+)\[([\d,]+)\]", line)
  if operand is None:
    operand = re.search(r"= \(?\w+\[([\d,]+)\]", line)
  dims = _dims(operand.group(1))
  r, c, batch = dims[-2], dims[-1], int(np.prod(dims[:-2]))
  if "trsm" in target.group(1):
    return batch * cost.SOLVE_CUBE * r * c * max(r, c)
  return batch * (cost.CHOLESKY_CUBE if "potrf" in target.group(1) else cost.EIGH_CUBE) * c**3


def lapack_flops(hlo: str) -> float:
  """Flop-equivalents of the LAPACK custom calls in an HLO text, which XLA's cost analysis does not count.

  The planner's constants (`kaisa_jax.cost`): ``EIGH_CUBE n^3`` per eigh and
  ``CHOLESKY_CUBE n^3`` per Cholesky of an ``n x n`` matrix, ``SOLVE_CUBE r c
  max(r, c)`` per triangular solve with an ``r x c`` result (``n^2 m`` for
  ``m`` right-hand sides of an ``n x n`` triangle: exact when square, more
  otherwise); a Cholesky inverse, a Cholesky and two solves for ``n``
  right-hand sides, counts ``INVERSE_CUBE n^3``, as the planner counts it. A
  call in a loop counts once per trip (`_runs`); a call in a branch of a
  conditional counts as if the branch ran.

  Args:
    hlo: the HLO text of a compiled program (``compiled.as_text()``).
  """
  computations, entry = _computations(hlo)
  runs = _runs(computations, entry)
  return sum(
    runs.get(name, 1.0) * _lapack_call_flops(line)
    for name, lines in computations.items()
    for line in lines
  )


_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}
_CALLED = re.compile(
  r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+)|body=%?([\w.\-]+))"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
  """An HLO text's computations (their instruction lines, by name) and the entry's name."""
  computations: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      computations[current].append(line)
  return computations, entry


def _branches(line: str) -> list[str]:
  """The computations a conditional or a loop instruction runs."""
  called = []
  for m in _CALLED.finditer(line):
    names = m.group(1).split(",") if m.group(1) else [m.group(2) or m.group(3)]
    called += [n.strip().lstrip("%") for n in names]
  return called


def _trips(line: str) -> int:
  """How many times a control-flow instruction runs what it calls: a loop's known trip count;
  once for a conditional or a loop whose trip count XLA does not know."""
  found = _TRIP_COUNT.search(line)
  return int(found.group(1)) if found else 1


def _runs(computations: dict[str, list[str]], entry: str | None) -> dict[str, float]:
  """How many times each computation reachable from the entry runs per run of the program.

  A loop's body runs its trip count times per run of the loop; each branch of a
  conditional counts as if it ran.
  """
  runs: dict[str, float] = {}

  def visit(name: str, times: float, depth: int) -> None:
    runs[name] = runs.get(name, 0.0) + times
    for line in computations.get(name, ()):
      op = _INSTRUCTION.search(line)
      if op is not None and op.group(1) in ("conditional", "while") and depth < 16:
        for called in _branches(line):
          visit(called, times * _trips(line), depth + 1)

  if entry is not None:
    visit(entry, 1.0, 0)
  return runs


def kernel_count(hlo: str) -> float:
  """Operations a compiled program launches, from its HLO text.

  Every instruction of the entry computation but parameters, constants and
  tuple plumbing counts one (a fusion is one kernel); a conditional counts its
  largest branch (as XLA's cost analysis counts its flops, as if the branch
  always ran), a loop its body once per trip (once if XLA does not know the
  trip count).

  Args:
    hlo: the HLO text of a compiled program (``compiled.as_text()``).
  """
  computations, entry = _computations(hlo)

  def count(name: str, depth: int = 0) -> float:
    total = 0.0
    for line in computations.get(name, ()):
      op = _INSTRUCTION.search(line)
      if op is None or op.group(1) in _NOT_KERNELS:
        continue
      if op.group(1) in ("conditional", "while") and depth < 16:
        total += _trips(line) * max((count(c, depth + 1) for c in _branches(line)), default=0.0)
      else:
        total += 1.0
    return total

  return count(entry) if entry is not None else 0.0


_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")
_OPERANDS = re.compile(r"\s(dot|convolution)\(%?([\w.\-]+),\s*%?([\w.\-]+)\)")
_FUSED = re.compile(r"\bcalls=%?([\w.\-]+)")


def _product_flops(line: str, shapes: dict[str, list[int]]) -> float | None:
  """The flops of a ``dot`` or ``convolution`` instruction (``None`` for any other)."""
  operands, defined = _OPERANDS.search(line), _DEFINED.match(line)
  if operands is None or defined is None:
    return None
  result = math.prod(_dims(defined.group(2)))
  lhs, rhs = shapes.get(operands.group(2)), shapes.get(operands.group(3))
  if lhs is None or rhs is None:
    return None
  if operands.group(1) == "dot":
    contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    k = math.prod(lhs[i] for i in _dims(contracted.group(1))) if contracted else 1
    return 2.0 * result * k
  labels = re.search(r"dim_labels=\w+_(\w+)->", line)
  features = rhs[labels.group(1).index("o")] if labels else 1
  return 2.0 * result * math.prod(rhs) / max(features, 1)


def _shapes(lines: Sequence[str]) -> dict[str, list[int]]:
  return {m.group(1): _dims(m.group(2)) for m in map(_DEFINED.match, lines) if m}


def matmul_flops(hlo: str) -> list[float]:
  """The flops of each matrix product and convolution a compiled program runs, from its HLO text.

  ``2 * prod(result) * prod(contracted dims)`` per ``dot``, ``2 * prod(result)
  * prod(kernel) / output features`` per ``convolution``, inside fusions too;
  a conditional counts its branch of most such flops, a loop its body once per
  trip (as `kernel_count`). XLA's CPU programs keep them as such; a GPU program
  runs them as library calls (cuBLAS, cuDNN), which this does not count, so its
  flops all go at ``flops_per_s``.

  Args:
    hlo: the HLO text of a compiled program (``compiled.as_text()``).
  """
  computations, entry = _computations(hlo)

  def products(name: str, depth: int = 0) -> list[float]:
    if depth >= 16:
      return []
    lines = computations.get(name, ())
    shapes = _shapes(lines)
    out: list[float] = []
    for line in lines:
      op = _INSTRUCTION.search(line)
      if op is None:
        continue
      if op.group(1) in ("conditional", "while"):
        out += _trips(line) * max(
          (products(c, depth + 1) for c in _branches(line)), key=sum, default=[]
        )
      elif op.group(1) == "fusion" and (fused := _FUSED.search(line)):
        out += products(fused.group(1), depth + 1)
      elif (flops := _product_flops(line, shapes)) is not None:
        out.append(flops)
    return out

  return products(entry) if entry is not None else []


# What XLA's cost analysis counts once per loop, whatever its trip count.
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
_ELEMENTWISE = {  # XLA counts transcendental functions apart from its flops
  "abs", "add", "and", "ceil", "clamp", "compare", "convert", "divide", "floor", "is-finite",
  "maximum", "minimum", "multiply", "negate", "not", "or", "remainder", "round-nearest-afz",
  "round-nearest-even", "select", "sign", "subtract", "xor",
}  # fmt: skip
_SLICES = {"slice", "dynamic-slice"}


class _Instruction(NamedTuple):
  name: str
  op: str
  result: str
  operands: list[str]
  root: bool
  line: str


def _instruction(line: str) -> _Instruction | None:
  """An instruction line's name, opcode, result type and operands."""
  op = _INSTRUCTION.search(line)
  if op is None:
    return None
  name, rest = line.split("=", 1)
  start = rest.index(f" {op.group(1)}(") + len(op.group(1)) + 2
  depth, end = 1, start
  while depth and end < len(rest):
    depth += {"(": 1, ")": -1}.get(rest[end], 0)
    end += 1
  root = name.strip().startswith("ROOT")
  name = name.strip().removeprefix("ROOT").strip().lstrip("%")
  result = rest[: start - len(op.group(1)) - 2]
  return _Instruction(name, op.group(1), result, _NAME.findall(rest[start:end]), root, line)


def _array_bytes(text: str) -> float:
  """Bytes of the arrays an HLO type names (a tuple's summed)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(text):
    bits = 8 if dtype == "pred" else int(dtype.lstrip("sufbc"))
    total += math.prod(_dims(dims)) * bits / 8
  return total


def _elements(text: str) -> float:
  return float(sum(math.prod(_dims(dims)) for _, dims in _ARRAY.findall(text)))


def _fusion_bytes(
  computations: dict[str, list[str]], fused: str
) -> tuple[list[float | None], float | None]:
  """Per operand of a fusion, the bytes it reads of it (``None``: all); the bytes it writes.

  A fused parameter that is only sliced is read as much as its slices hold; a
  fusion that updates a slice of a buffer in place (a ``dynamic-update-slice``
  at its root) writes that slice and reads nothing else of the buffer.
  """
  instructions = [i for i in map(_instruction, computations.get(fused, ())) if i is not None]
  by_name = {i.name: i for i in instructions}
  params = {
    int(re.search(r"parameter\((\d+)\)", i.line).group(1)): i.name
    for i in instructions
    if i.op == "parameter"
  }
  buffer, written = None, None
  root = next((i for i in instructions if i.root), None)
  while root is not None and root.op == "bitcast" and root.operands[0] in by_name:
    root = by_name[root.operands[0]]
  if root is not None and root.op == "dynamic-update-slice" and len(root.operands) > 1:
    buffer = root.operands[0]
    while buffer in by_name and by_name[buffer].op == "bitcast":
      buffer = by_name[buffer].operands[0]
    if root.operands[1] in by_name:
      written = _array_bytes(by_name[root.operands[1]].result)
  reads: list[float | None] = []
  for index in range(max(params, default=-1) + 1):
    param = params.get(index)
    users = [i for i in instructions if param in i.operands]
    if param == buffer:
      reads.append(0.0)
    elif users and all(u.op in _SLICES and u.operands[0] == param for u in users):
      reads.append(sum(_array_bytes(u.result) for u in users))
    else:
      reads.append(None)
  return reads, written


def _xla_cost(computations: dict[str, list[str]], name: str, depth: int = 0) -> tuple[float, float]:
  """Flops and bytes of one run of a computation, counted as XLA's cost analysis counts them.

  Flops: products as `matmul_flops`, one per element an elementwise operation
  writes and per element a reduction reads, inside fusions too. Bytes: every
  instruction but parameters, constants, tuple plumbing and custom calls reads
  its operands and writes its result; a slice reads what it returns; an
  in-place update of a slice reads and writes that slice (`_fusion_bytes`). A
  nested loop's body counts once and a conditional's larger branch.
  """
  if depth >= 16:
    return 0.0, 0.0
  lines = computations.get(name, ())
  shapes, elements, sizes = _shapes(lines), {}, {}
  flops = bytes_ = 0.0
  for line in lines:
    ins = _instruction(line)
    if ins is None:
      continue
    elements[ins.name], sizes[ins.name] = _elements(ins.result), _array_bytes(ins.result)
    if ins.op in ("conditional", "while"):
      branches = [_xla_cost(computations, c, depth + 1) for c in _branches(line)]
      flops += max((f for f, _ in branches), default=0.0)
      bytes_ += max((b for _, b in branches), default=0.0)
      continue
    fused = _FUSED.search(line) if ins.op == "fusion" else None
    if ins.op in _ELEMENTWISE:
      flops += elements[ins.name]
    elif ins.op in ("reduce", "reduce-window") and ins.operands:
      flops += elements.get(ins.operands[0], 0.0)
    elif fused is not None:
      flops += _xla_cost(computations, fused.group(1), depth + 1)[0]
    elif (product := _product_flops(line, shapes)) is not None:
      flops += product
    if ins.op in _NOT_KERNELS or ins.op == "custom-call":  # XLA counts no bytes for either
      continue
    reads: list[float | None] = [None] * len(ins.operands)
    written = sizes[ins.name]
    if ins.op in _SLICES:
      reads[0] = written
    elif ins.op == "dynamic-update-slice" and len(ins.operands) > 1:
      reads[0], written = 0.0, sizes.get(ins.operands[1], written)
    elif fused is not None:
      fusion_reads, fusion_written = _fusion_bytes(computations, fused.group(1))
      reads = (fusion_reads + reads)[: len(ins.operands)]
      written = written if fusion_written is None else fusion_written
    bytes_ += written + sum(
      sizes.get(operand, 0.0) if read is None else read
      for operand, read in zip(ins.operands, reads, strict=True)
    )
  return flops, bytes_


def _loop_shortfall(hlo: str) -> tuple[float, float]:
  """The flops and bytes XLA's cost analysis leaves out of a program's loops.

  XLA counts a loop's body once, whatever its trip count: a loop of ``n`` trips
  adds ``n - 1`` times its body's cost (`_xla_cost`), times the trips of the
  loops around it. A conditional counts its larger branch. (On a CPU, kaisa_jax
  decomposes each stack of equal layers in a loop, and preconditions a stack of
  more than `kaisa_jax.cpu_loop.LOOP_FROM` layers in one; ``nn.scan`` and ``lax.map``
  make loops too.)
  """
  computations, entry = _computations(hlo)

  def visit(name: str, times: float, depth: int) -> tuple[float, float]:
    flops = bytes_ = 0.0
    if depth >= 16:
      return flops, bytes_
    for line in computations.get(name, ()):
      op = _INSTRUCTION.search(line)
      if op is None or op.group(1) not in ("conditional", "while"):
        continue
      if op.group(1) == "while":
        n, (body,) = _trips(line), _branches(line)
        missing = times * (n - 1)
        inner = visit(body, times * n, depth + 1)
        body_flops, body_bytes = _xla_cost(computations, body)
        flops += missing * body_flops + inner[0]
        bytes_ += missing * body_bytes + inner[1]
      else:
        branches = [visit(c, times, depth + 1) for c in _branches(line)]
        f, b = max(branches, default=(0.0, 0.0))
        flops, bytes_ = flops + f, bytes_ + b
    return flops, bytes_

  return visit(entry, 1.0, 0) if entry is not None else (0.0, 0.0)


def binned(flops: Sequence[float]) -> tuple[float, ...]:
  """Products' flops summed by the nearest of `MATMUL_SIZES` (on a log scale)."""
  out = [0.0] * len(MATMUL_SIZES)
  logs = np.log(MATMUL_SIZES)
  for f in flops:
    out[int(np.argmin(np.abs(logs - np.log(max(f, 1.0)))))] += f
  return tuple(out)


def program_cost(compiled: Any) -> ProgramCost:
  """The cost of a compiled program (``jax.jit(f).lower(...).compile()``)."""
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  text = compiled.as_text()
  flops, bytes_ = _loop_shortfall(text)
  return ProgramCost(
    float(analysis.get("flops", 0.0)) + flops,
    lapack_flops(text),
    float(analysis.get("bytes accessed", 0.0)) + bytes_,
    kernel_count(text),
    binned(matmul_flops(text)),
  )


def cost_of(fn: Any, *args: Any) -> ProgramCost:
  """`program_cost` of ``jax.jit(fn)`` compiled for ``args``."""
  return program_cost(jax.jit(fn).lower(*args).compile())


@dataclasses.dataclass(frozen=True)
class KFACWork:
  """K-FAC's phases on one device, to amortise and to split over devices.

  Attributes:
    plan: the plan of a `kaisa_jax.kfac` built for one device.
    factors: cost of one factor update (statistics of every layer's rows).
    decompositions: cost of decomposing every factor once.
    preconditioning: cost of preconditioning every layer's gradient once.
    factor_update_steps: the cadence of the factor updates.
    inv_update_steps: the cadence of the decompositions.
  """

  plan: transform.Plan
  factors: ProgramCost
  decompositions: ProgramCost
  preconditioning: ProgramCost
  factor_update_steps: int
  inv_update_steps: int


def kfac_work(
  kfac: transform.KFAC,
  state: transform.KFACState,
  grads: Any,
  curvature: Any,
  factor_update_steps: int,
  inv_update_steps: int,
) -> KFACWork:
  """Compiles K-FAC's three phases alone and returns their costs.

  Args:
    kfac: a `kaisa_jax.kfac` built for one device (no ``mesh=``/``axis_name=``).
    state: its state (``kfac.init(params)``, or any later one).
    grads: gradients shaped like the params.
    curvature: the curvature from ``kaisa_jax.value_and_grad`` on the same batch.
    factor_update_steps, inv_update_steps: the cadence ``kfac`` was built with.
  """
  plan = kfac.plan
  if plan.collectives.mode != "single":
    raise ValueError(
      "kfac_work needs a kfac built for one device (no mesh= or axis_name=): the projection "
      "splits its phases over the devices itself"
    )
  cadence = (factor_update_steps, inv_update_steps)
  if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in cadence):
    raise ValueError(f"the cadences must be ints >= 1, got {cadence}")
  comm = plan.collectives
  damping, decay = jnp.float32(1e-2), jnp.float32(0.95)  # any values: the costs do not change
  dtype = plan.factor_dtype
  dec_dtype = state.decompositions.dtype
  layer_grads = parameters.layer_params(grads, plan, "gradients")
  return KFACWork(
    plan=plan,
    factors=cost_of(
      lambda s, c: phases.update_factors(plan, s, c, decay, dtype, comm), state, curvature
    ),
    decompositions=cost_of(lambda s: phases.decompose_factors(plan, s, damping, comm), state),
    preconditioning=cost_of(
      lambda g, s: phases.precondition_grads(
        plan, g, s.decompositions, damping, dec_dtype, comm, s.stack_offsets
      ),
      layer_grads,
      state,
    ),
    factor_update_steps=factor_update_steps,
    inv_update_steps=inv_update_steps,
  )


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A projected step: seconds of compute and of communication per phase.

  Attributes:
    cluster: the cluster's name.
    devices: ``N``.
    fraction: the grad worker fraction (``None`` without K-FAC).
    compute: seconds of compute per step (K-FAC's phases amortised).
    communication: seconds per step by phase (``"other"`` is the gradient
      all-reduce of data parallelism).
  """

  cluster: str
  devices: int
  fraction: str | None
  compute: float
  communication: dict[str, float]

  @property
  def total(self) -> float:
    """Projected seconds per step: compute plus communication, no overlap."""
    return self.compute + sum(self.communication.values())

  def __str__(self) -> str:
    comm = ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in self.communication.items() if v)
    where = f"{self.devices} device(s)" + (f", f = {self.fraction}" if self.fraction else "")
    return (
      f"PROJECTED on {self.cluster}, {where}: {1e3 * self.total:.3f} ms per step "
      f"(compute {1e3 * self.compute:.3f} ms; communication: {comm or 'none'})"
    )


def project_step(
  step: ProgramCost,
  cluster: Cluster,
  devices: int = 1,
  *,
  gradient_bytes: float = 0.0,
  kfac: KFACWork | None = None,
  grad_worker_fraction: float | str = "comm_opt",
  collectives: Sequence[Collective] | None = None,
) -> StepTime:
  """Projects the seconds per step of a train step on ``devices`` devices of ``cluster``.

  Args:
    step: `program_cost` of the train step compiled for one device at the
      per-device batch (global batch / ``devices``); for K-FAC, the step with
      ``kfac`` in its chain.
    cluster: the hardware.
    devices: ``N``, the data-parallel devices.
    gradient_bytes: bytes of the gradient all-reduced over the devices each
      step (all parameters' gradients; 4 bytes per float32 parameter).
    kfac: K-FAC's phases (`kfac_work`); ``None`` for a first-order step.
    grad_worker_fraction: KAISA's ``f`` on ``devices`` (with ``kfac``).
    collectives: the collectives of the same step compiled for ``devices``
      devices (`kaisa_jax.analysis.accounting.hlo_collectives`), replacing the modelled
      ones.

  Returns:
    A `StepTime`: a projection, labelled as one when printed.
  """
  if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
    raise ValueError(f"devices must be an int >= 1, got {devices!r}")
  if gradient_bytes < 0:
    raise ValueError(f"gradient_bytes must be >= 0, got {gradient_bytes}")
  compute = step
  fraction, layout = None, None
  fus = ivs = 1
  if kfac is not None:
    layout = layout_for(kfac.plan, devices, grad_worker_fraction)
    fraction = str(fractions.Fraction(layout.cols, devices))
    fus, ivs = kfac.factor_update_steps, kfac.inv_update_steps
    dec_share, pre_share = busiest_shares(kfac.plan, layout)
    # The compiled step counts each phase's branch as if it ran every step, on
    # every layer: keep the amortised share of the busiest device instead.
    compute = (
      step
      + kfac.factors.scaled(1.0 / fus - 1.0)
      + kfac.decompositions.scaled(dec_share / ivs - 1.0)
      + kfac.preconditioning.scaled(pre_share - 1.0)
    )
  cols = layout.cols if layout is not None else devices
  if collectives is None:
    itemsize = np.dtype(kfac.plan.factor_dtype).itemsize if kfac is not None else 4
    collectives = modelled_collectives(layout, devices, gradient_bytes, itemsize)
  communication = communication_seconds(cluster, collectives, devices, cols, fus, ivs)
  return StepTime(cluster.name, devices, fraction, compute.seconds(cluster), communication)
