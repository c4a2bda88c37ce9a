"""Cost model: per-layer flop estimates and the treatment each layer gets.

For a layer with ``r`` rows per step, groups of factor sizes ``a = a_dim`` and
``o = g_dim``:

* its own forward and backward pass: ``6 r a o`` flops per group;
* factor statistics (every ``factor_update_steps``): ``2 r (a^2 + o^2)``
  (``r (a + o)`` for diagonal sides);
* decompositions (every ``inv_update_steps``): ``c d^3`` per dense side, with
  ``c = 20`` for ``eigh`` and ``c = 4`` for a Cholesky inverse (what these
  kernels cost, in matmul-flop equivalents, measured on CPU);
* preconditioning (every step): ``4 a o (a + o)`` for the eigen method (four
  products), ``2 a o (a + o)`` for the inverse method (two), less for
  diagonal sides.

`choose_treatment` keeps the requested method where it is affordable. A layer
whose preconditioning and amortised decompositions would cost more than
``max_cost_ratio`` times its own forward and backward pass gets the first
cheaper treatment that fits, in order of faithfulness: the inverse method, the
larger side diagonal, both sides diagonal. An embedding's input side is always
diagonal (its inputs are one-hot). Normalisation layers always get the exact
eigen method on their 2x2 blocks (or their diagonal, when asked for). Factor
statistics are left out of the rule: their cost is set by
``factor_update_steps``, which the user picks.
"""

from __future__ import annotations

import dataclasses

from kaisa_jax import layers as layers_lib
from kaisa_jax import preconditioning

EIGH_CUBE = 20.0
INVERSE_CUBE = 4.0


@dataclasses.dataclass(frozen=True)
class Treatment:
  """How a layer is preconditioned.

  Attributes:
    method: ``"eigen"`` or ``"inverse"``.
    diagonal: whether the ``A`` and ``G`` sides are kept diagonal.
  """

  method: str
  diagonal: tuple[bool, bool] = (False, False)

  def __str__(self) -> str:
    sides = {(False, False): "", (True, False): ", diagonal A", (False, True): ", diagonal G"}
    return self.method + sides.get(self.diagonal, ", diagonal A and G")


def layer_flops(spec: layers_lib.LayerSpec) -> float:
  """Forward and backward flops of the layer itself, per step."""
  return 6.0 * spec.rows * spec.num_weights


def factor_flops(spec: layers_lib.LayerSpec, t: Treatment) -> float:
  """Flops of one factor update."""
  return float(
    sum(
      spec.groups * spec.rows * (d if diag else 2 * d * d)
      for d, diag in zip((spec.a_dim, spec.g_dim), t.diagonal, strict=True)
    )
  )


def decomposition_flops(spec: layers_lib.LayerSpec, t: Treatment) -> float:
  """Flop-equivalents of one decomposition of both factors."""
  cube = EIGH_CUBE if t.method == preconditioning.EIGEN else INVERSE_CUBE
  return float(
    sum(
      spec.groups * (d if diag else cube * d**3)
      for d, diag in zip((spec.a_dim, spec.g_dim), t.diagonal, strict=True)
    )
  )


def preconditioning_flops(spec: layers_lib.LayerSpec, t: Treatment) -> float:
  """Flops of preconditioning the layer's gradient once."""
  a, o = spec.a_dim, spec.g_dim
  per_product = 2.0 * a * o
  products = (0 if t.diagonal[0] else a) + (0 if t.diagonal[1] else o)
  passes = 2 if t.method == preconditioning.EIGEN else 1
  return spec.groups * (passes * per_product * products + 2 * a * o)


def step_cost_ratio(spec: layers_lib.LayerSpec, t: Treatment, inv_update_steps: int) -> float:
  """Preconditioning plus amortised decompositions, over the layer's own flops."""
  extra = preconditioning_flops(spec, t) + decomposition_flops(spec, t) / inv_update_steps
  return extra / max(layer_flops(spec), 1.0)


def candidates(spec: layers_lib.LayerSpec, method: str) -> list[Treatment]:
  """Treatments from the most faithful to the cheapest."""
  if spec.kind in layers_lib.NORMS:  # 2x2 blocks: the exact damped inverse is always cheap
    return [Treatment(preconditioning.EIGEN, (spec.diagonal_input, False))]
  if spec.diagonal_input:  # one-hot inputs
    out = [Treatment(method, (True, False))]
    if method == preconditioning.EIGEN:
      out.append(Treatment(preconditioning.INVERSE, (True, False)))
    return [*out, Treatment(method, (True, True))]
  larger = (True, False) if spec.a_dim >= spec.g_dim else (False, True)
  out = [Treatment(method)]
  if method == preconditioning.EIGEN:
    out.append(Treatment(preconditioning.INVERSE))
  out += [Treatment(method, larger), Treatment(method, (True, True))]
  return out


def choose_treatment(
  spec: layers_lib.LayerSpec,
  method: str,
  inv_update_steps: int,
  max_cost_ratio: float | None,
) -> Treatment:
  """The most faithful treatment whose cost ratio is at most ``max_cost_ratio``."""
  options = candidates(spec, method)
  if max_cost_ratio is None:
    return options[0]
  for t in options:
    if step_cost_ratio(spec, t, inv_update_steps) <= max_cost_ratio:
      return t
  return options[-1]
