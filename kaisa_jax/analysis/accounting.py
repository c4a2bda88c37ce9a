"""The collectives of a compiled program: every one with the bytes it moves per device.

`hlo_collectives` reads a compiled train step's HLO text and attributes each
collective to K-FAC's phases by the named scopes its collectives run under
(`kaisa_jax.phases`, `kaisa_jax.chain_order`), so the model of `kaisa_jax.communication` can be
checked against what XLA compiled. Bytes moved follow the ring algorithms of
`kaisa_jax.communication.moved`.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from kaisa_jax import chain_order, phases
from kaisa_jax.communication import (
  CHAIN_CHECK,
  DECOMPOSITION_SHARING,
  FACTOR_REDUCTION,
  GRADIENT_SHARING,
  OTHER,
  Collective,
  collective,
)

_SCOPES = {
  phases.FACTOR_REDUCTION: FACTOR_REDUCTION,
  phases.DECOMPOSITION_SHARING: DECOMPOSITION_SHARING,
  phases.GRADIENT_SHARING: GRADIENT_SHARING,
  chain_order.CHAIN_CHECK: CHAIN_CHECK,
}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_OP = re.compile(
  r"=\s*(?P<type>.+?)\s+(?P<kind>" + "|".join(_KINDS) + r")(?P<start>-start)?\((?P<rest>.*)$"
)


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
