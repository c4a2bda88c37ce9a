"""Cost model: per-layer flop estimates and the treatment each layer gets.

For a layer with ``r`` rows per step, groups of factor sizes ``a = a_dim`` and
``o = g_dim``:

* its own forward and backward pass: ``6 r a o`` flops per group;
* factor statistics (every ``factor_update_steps``): ``2 r (a^2 + o^2)``
  (``r (a + o)`` for diagonal sides);
* decompositions (every ``inv_update_steps``): ``c d^3`` per dense side, with
  ``c = EIGH_CUBE`` for ``eigh`` and ``c = INVERSE_CUBE`` for a Cholesky
  inverse (below);
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

The decompositions' constants are flop-equivalents: a kernel's time over the
time of one flop of a matrix product, over ``n^3`` for an ``n x n`` matrix.
The planner (`kaisa_jax.planning`) and the projection
(`kaisa_jax.analysis.projection.lapack_flops`, which counts the LAPACK calls of
a compiled program) both count with them. They come from
``benchmarks/decomposition_cost.py``: `kaisa_jax.preconditioning.decompose`
of one float32 matrix, its Cholesky factor alone and one triangular solve for
``n`` right-hand sides, timed in turns with an ``n x n`` product of the same
``n`` (``2 n^3`` flops), medians of 7 on one thread of a 2-core x86 CPU
(jax 0.10.2, LAPACK through jaxlib; one thread because the two cores are shared
and threaded LAPACK timed erratically there):

======  =====  ========================  =====  =====
n       eigh   inverse (whole method)    potrf  trsm
======  =====  ========================  =====  =====
256     14.1   6.3                       1.7    2.6
512     13.9   6.1                       1.5    2.3
1024    13.1   4.9                       1.2    2.4
2048    10.3   4.2                       1.1    1.6
======  =====  ========================  =====  =====

hence ``EIGH_CUBE = 13``, ``CHOLESKY_CUBE = 1.5``, ``SOLVE_CUBE = 2`` and the
inverse method, a Cholesky and two triangular solves against the identity,
``INVERSE_CUBE = 1.5 + 2 x 2 = 5.5``. On one NVIDIA H100 (float32, jax 0.11.2,
cuSOLVER) the same ``decompose`` took, for ``eigh``, 134, 33.2, 11.6, 5.2 and
2.3 ms at ``n`` = 4608, 2304, 1024, 512 and 256, and for the Cholesky inverse
11.9, 3.5 and 1.34 ms at 4608, 2304 and 1024: against the DGX H100 preset's
67 TFLOP/s (`kaisa_jax.cluster.DGX_H100`, the rate its projections use) that is
``eigh`` at 92, 182, 724, 2600 and 9200 ``n^3`` and the inverse at 8.1, 19 and
84 ``n^3``. A GPU's ``eigh`` is bound by latency, not flops, below a few
thousand, so no constant times ``n^3`` describes it; the CPU's constants, flat
in ``n`` as the model assumes, are the ones used, and a projection for a GPU
preset understates its decompositions (about 7x at the largest factors).
"""

from __future__ import annotations

import dataclasses

from kaisa_jax import layers as layers_lib
from kaisa_jax import preconditioning

# Flop-equivalents per n^3 of an n x n matrix (the module docstring): a symmetric
# eigendecomposition (LAPACK syevd), a Cholesky factorisation (potrf) and a triangular
# solve, per r c max(r, c) for an r x c result (trsm: n^3 for n right-hand sides).
EIGH_CUBE = 13.0
CHOLESKY_CUBE = 1.5
SOLVE_CUBE = 2.0
# The inverse method: a Cholesky factorisation and two triangular solves against I.
INVERSE_CUBE = CHOLESKY_CUBE + 2 * SOLVE_CUBE


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
