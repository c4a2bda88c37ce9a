"""The memory-at-scale benchmark: its three schemes' bytes, checked on the toy production models.

kaisa_jax's bytes are the planner's (`kaisa_jax.plan_fractions`), which
tests/test_planning.py checks against the buffers of real states; here the
KAISA reference's and the replicated state's bytes are checked against the
layers' factor and decomposition shapes, counted one by one.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

import kaisa_jax
from benchmarks import memory_at_scale as mas
from kaisa_jax import assignment


@pytest.fixture(scope="module", params=["tiny_resnet", "tiny_bert"])
def layers(request):
  return mas.local_layers(request.param, 4)


def _sizes(plan, shapes_of) -> list[int]:
  """Bytes (float32) of each layer's arrays, ``shapes_of(spec, treatment)`` a list of shapes."""
  return [4 * assignment.size(shapes_of(s, t)) for s, t in plan.layers]


def _decomposition_shapes(spec, t):
  return [x for side in assignment.decomposition_shapes(spec, t) for x in side]


@pytest.mark.parametrize("n", [4, 8])
def test_three_schemes_per_device(layers, n):
  at = mas.at_scale(layers, n)
  kfac = kaisa_jax.kfac(layers, axis_name="batch", axis_size=n, step_norm="natural")
  plan = kfac.plan  # the treatments of n devices, as the benchmark's
  factors = _sizes(plan, assignment.factor_shapes)
  decompositions = _sizes(plan, _decomposition_shapes)
  assert at["replicated"] == {"factors": sum(factors), "decompositions": sum(decompositions)}
  planned = kaisa_jax.plan_fractions(layers, n, kaisa_jax.DGX_H100, math.inf)
  assert [r["fraction"] for r in at["fractions"]] == [str(o.fraction) for o in planned.options]
  for row, option in zip(at["fractions"], planned.options, strict=True):
    ours, ref = row["kaisa_jax"], row["kaisa"]
    assert ours == {"factors": option.factor_memory, "decompositions": option.decomposition_memory}
    # The reference: every factor, and the decompositions of the largest group, layer by layer.
    layout = kaisa_jax.kfac(
      layers,
      axis_name="batch",
      axis_size=n,
      grad_worker_fraction=option.fraction,
      step_norm="natural",
    ).plan.layout
    largest = max(sum(decompositions[i] for i in layout.group(r)) for r in range(layout.rows))
    assert ref == {"factors": sum(factors), "decompositions": largest}
    assert ref["decompositions"] <= ours["decompositions"]  # kaisa_jax's buffers are padded
  # COMM-OPT: every device holds every decomposition in the reference; MEM-OPT: its own only.
  comm_opt, mem_opt = at["fractions"][-1], at["fractions"][0]
  assert comm_opt["kaisa"]["decompositions"] == sum(decompositions)
  assert Fraction(mem_opt["fraction"]) == Fraction(1, n)
  assert mem_opt["kaisa_jax"]["decompositions"] == mem_opt["kaisa"]["decompositions"]
  assert at["recommended"]["no budget"] == str(planned.recommended)
  assert at["budget"] == kaisa_jax.DGX_H100.memory / 2


def test_render_lists_every_fraction(layers):
  results = {
    "cluster": "c",
    "cluster_memory": 80e9,
    "models": [
      {"name": "m", "label": "Toy, small", "layers": len(layers.specs), "batch": 4}
      | {"scale": [mas.at_scale(layers, 4)]}
    ],
  }
  text = mas.render(results)
  assert text.count("| 4 | ") == 3 + 1  # fractions 1/4, 1/2, 1, and the recommendation's row
  assert "changes 0 of these 1 recommendations" in text
