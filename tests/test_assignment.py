"""Assignment and the grad worker fraction: worked examples computed by hand."""

import jax
import jax.numpy as jnp
import pytest

import kaisa_jax
from kaisa_jax import assignment, cost, distribution
from kaisa_jax.layers import LayerSpec

EIGEN = cost.Treatment("eigen")


def dense(name, a, g):
  return LayerSpec(name, (), "dense", (a - 1, g), has_bias=True)


def test_greedy_lpt_worked_example():
  # Heaviest first: 5 -> bin 0; 3 -> bin 1; 3 -> bin 1 (3 < 5); 2 -> bin 0 (5 < 6); 2 -> bin 1 (6 < 7).
  assert assignment.greedy_lpt([5, 3, 3, 2, 2], 2) == [0, 1, 1, 0, 1]
  # Ties: equal costs keep their order, equally loaded bins take the lower index.
  assert assignment.greedy_lpt([1, 1, 1, 1], 2) == [0, 1, 0, 1]
  assert assignment.greedy_lpt([2, 7, 2], 3) == [1, 0, 2]
  assert assignment.greedy_lpt([], 4) == []


def test_layer_costs():
  spec = dense("d", 4, 3)
  assert assignment.layer_cost(spec, EIGEN, assignment.COMPUTE) == 4**3 + 3**3
  assert assignment.layer_cost(spec, EIGEN, assignment.MEMORY) == 4**2 + 3**2
  diag_a = cost.Treatment("eigen", (True, False))
  assert assignment.layer_cost(spec, diag_a, assignment.COMPUTE) == 4 + 3**3
  # 4 groups of A 19x19, G 2x2
  conv = LayerSpec("c", (), "conv", (3, 3, 2, 8), True, in_ndim=3, groups=4)
  assert assignment.layer_cost(conv, EIGEN, assignment.COMPUTE) == 4 * (19**3 + 2**3)


def test_make_layout_worked_example():
  # Compute costs, a^3 + g^3.
  specs = [
    dense("L0", 10, 2),
    dense("L1", 6, 2),
    dense("L2", 8, 2),
    dense("L3", 3, 2),
    dense("L4", 5, 2),
  ]
  costs = [1008, 224, 520, 35, 133]
  assert [assignment.layer_cost(s, EIGEN, "compute") for s in specs] == costs
  layers = [(s, EIGEN) for s in specs]
  # Two groups: L0 (1008) -> g0; L2 (520) -> g1; L1 (224) -> g1 (744); L4 (133) -> g1 (877); L3 (35) -> g1 (912).
  # Then within group 1 (two members): L2 -> m0; L1 -> m1; L4 -> m1 (357 < 520); L3 -> m1 (392 < 520).
  layout = assignment.make_layout(layers, rows=2, cols=2)
  assert layout.owners == ((0, 0), (1, 1), (1, 0), (1, 1), (1, 1))
  assert layout.owned(1, 1) == [1, 3, 4]
  assert layout.group(1) == [2, 1, 3, 4]
  # Buffers: the largest share. Factors of L0: 10^2 + 2^2 = 104; of member (1, 1): 40 + 13 + 29 = 82.
  assert layout.factor_size == 104
  # Eigen decompositions: d^2 + d per side. L0: 110 + 6 = 116.
  assert layout.decomposition_size == 116
  # Preconditioned gradients per group: group 1 has 8*2 + 6*2 + 3*2 + 5*2 = 44 elements.
  assert layout.gradient_size == 44


@pytest.mark.parametrize(
  "fraction, n, w",
  [
    ("comm_opt", 8, 8),
    ("mem_opt", 8, 1),
    ("hybrid_opt", 8, 4),
    (0.25, 8, 2),
    (1, 1, 1),
    (1 / 3, 6, 2),
  ],
)
def test_grad_workers(fraction, n, w):
  assert distribution.grad_workers(fraction, n) == w


@pytest.mark.parametrize(
  "fraction, n, error, match",
  [
    (0.3, 8, ValueError, r"valid values for 8 devices: 1/8, 1/4, 1/2, 1"),
    (0.25, 6, ValueError, r"valid values for 6 devices: 1/6, 1/3, 1/2, 1"),
    ("hybrid_opt", 3, ValueError, r"valid values for 3 devices: 1/3, 1"),
    (0.0, 8, ValueError, r"must lie in \(0, 1\]"),
    (1.5, 8, ValueError, r"must lie in \(0, 1\]"),
    ("fast", 8, ValueError, "one of"),
    (True, 8, TypeError, "number or a name"),
  ],
)
def test_invalid_fractions_are_rejected(fraction, n, error, match):
  with pytest.raises(error, match=match):
    distribution.grad_workers(fraction, n)


def test_make_mesh_shapes():
  mesh = kaisa_jax.make_mesh("hybrid_opt")
  assert mesh.axis_names == (kaisa_jax.RECEIVERS, kaisa_jax.GRAD_WORKERS)
  assert mesh.devices.shape == (2, 4)
  assert kaisa_jax.make_mesh("mem_opt", jax.devices()[:4]).devices.shape == (4, 1)
  with pytest.raises(ValueError, match="valid values for 8 devices"):
    kaisa_jax.make_mesh(3 / 8)


def _layers():
  import flax.linen as nn

  model = nn.Dense(3)
  x = jnp.ones((8, 2))
  params = model.init(jax.random.key(0), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
  return params, grad_fn, grad_fn.layers(params, x)


def test_bad_distribution_arguments():
  _, _, layers = _layers()
  mesh = kaisa_jax.make_mesh("hybrid_opt")
  with pytest.raises(ValueError, match="not both"):
    kaisa_jax.kfac(layers, step_norm="natural", mesh=mesh, axis_name="batch")
  with pytest.raises(ValueError, match="means 8 grad workers, but the mesh has 4"):
    kaisa_jax.kfac(layers, step_norm="natural", mesh=mesh, grad_worker_fraction="comm_opt")
  with pytest.raises(ValueError, match=r"make it with kaisa_jax\.make_mesh"):
    kaisa_jax.kfac(layers, step_norm="natural", mesh=jax.make_mesh((8,), ("data",)))
  with pytest.raises(ValueError, match="valid values for 8 devices"):
    kaisa_jax.kfac(layers, step_norm="natural", axis_name="batch", grad_worker_fraction=0.3)
  with pytest.raises(ValueError, match="axis_size goes with axis_name"):
    kaisa_jax.kfac(layers, step_norm="natural", axis_size=4)
  with pytest.raises(ValueError, match="one of"):
    kaisa_jax.kfac(layers, step_norm="natural", grad_worker_fraction="fastest")
  with pytest.raises(ValueError, match="assignment_cost"):
    kaisa_jax.kfac(layers, step_norm="natural", assignment_cost="flops")
  # On a single device the fraction has no effect but is still checked.
  single = kaisa_jax.kfac(layers, step_norm="natural", grad_worker_fraction="mem_opt")
  assert single.plan.layout.devices == 1


def test_update_outside_its_mesh_says_so():
  params, grad_fn, layers = _layers()
  tx = kaisa_jax.kfac(layers, step_norm="natural", axis_name="batch")
  _, grads, curvature = grad_fn(params, jnp.ones((8, 2)))
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"call its update inside jax\.pmap"):
    tx.update(grads, state, params, curvature=curvature)


def test_plan_lists_the_assignment():
  _, _, layers = _layers()
  tx = kaisa_jax.kfac(layers, step_norm="natural", mesh=kaisa_jax.make_mesh("hybrid_opt"))
  text = str(tx.plan)
  assert "2 group(s) x 4 grad worker(s), assignment by compute cost" in text
  assert "group" in text.splitlines()[0] and "worker" in text.splitlines()[0]
