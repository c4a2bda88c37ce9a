"""The projection of step times (`kaisa_jax.analysis.projection`) and the fraction planner.

Layout sizes are exact, so the planner's memory is checked against numbers
worked out by hand and against the buffers of real states on 8 devices; times
are a model, so they are checked for units, monotonicity, agreement with the
HLO byte counts they are given and the ranking the model implies.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import dense_stack
from distributed_setup import build
from sklearn.datasets import load_digits

import kaisa_jax
from kaisa_jax import cluster as cluster_lib
from kaisa_jax import communication, cpu_loop, preconditioning, transform
from kaisa_jax import cost as kaisa_cost
from kaisa_jax.analysis import accounting, projection


class TwoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.tanh(nn.Dense(8)(x)))


def two_dense_layers(batch: int = 16):
  model = TwoDense()
  x = jnp.ones((batch, 6))
  params = model.init(jax.random.key(0), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
  return grad_fn.layers(params, x)


CLUSTER = kaisa_jax.Cluster(
  name="test",
  flops_per_s=1e9,
  memory_bandwidth=1e10,
  intra_node_bandwidth=1e9,
  inter_node_bandwidth=1e8,
  devices_per_node=4,
  latency=1e-5,
  memory=1e9,
  kernel_overhead=1e-6,
)


def option(plan, fraction):
  return next(o for o in plan.options if o.fraction == Fraction(fraction))


def test_memory_of_each_fraction_worked_out_by_hand():
  # Dense 6 -> 8 (A 7x7 with the bias, G 8x8) and Dense 8 -> 4 (A 9x9, G 4x4), eigen
  # method: each side keeps its eigenvectors and eigenvalues.
  plan = kaisa_jax.plan_fractions(two_dense_layers(), 2, CLUSTER, max_cost_ratio=None)
  factors = max(7 * 7 + 8 * 8, 9 * 9 + 4 * 4) * 4  # one layer per device, the larger buffer
  decomposition = max(7 * 7 + 7 + 8 * 8 + 8, 9 * 9 + 9 + 4 * 4 + 4) * 4
  comm_opt, mem_opt = option(plan, 1), option(plan, "1/2")
  assert (comm_opt.factor_memory, comm_opt.decomposition_memory) == (factors, 2 * decomposition)
  assert (mem_opt.factor_memory, mem_opt.decomposition_memory) == (factors, decomposition)
  assert comm_opt.memory == 452 + 1024 and mem_opt.memory == 452 + 512


def test_communication_worked_out_by_hand():
  plan = kaisa_jax.plan_fractions(
    two_dense_layers(), 2, CLUSTER, max_cost_ratio=None, factor_update_steps=5, inv_update_steps=50
  )
  lat, bw = CLUSTER.latency, CLUSTER.intra_node_bandwidth
  factor_reduction = (lat + 113 * 4 / bw) + (lat + 4 / bw)  # reduce-scatter, health count
  # MEM-OPT: no decomposition gather (groups of one), the count still all-reduced; the
  # preconditioned gradients (the larger group: 7 x 8 weights) gathered every step.
  mem_opt = factor_reduction / 5 + (lat + 4 / bw) / 50 + (lat + 56 * 4 / bw)
  # COMM-OPT: the decompositions gathered within the group of 2, no gradient sharing.
  comm_opt = factor_reduction / 5 + ((lat + 128 * 4 / bw) + (lat + 4 / bw)) / 50
  np.testing.assert_allclose(option(plan, "1/2").communication, mem_opt, rtol=1e-12)
  np.testing.assert_allclose(option(plan, 1).communication, comm_opt, rtol=1e-12)


def test_ranking_follows_the_model():
  layers = two_dense_layers()
  # Collectives expensive, flops free: fewest collectives per step (COMM-OPT) wins.
  slow_network = dataclasses.replace(CLUSTER, latency=1.0, flops_per_s=1e18)
  assert kaisa_jax.plan_fractions(layers, 2, slow_network, max_cost_ratio=None).recommended == 1
  # Collectives free, flops expensive: each device preconditions its own layer only.
  slow_flops = dataclasses.replace(
    CLUSTER, latency=1e-12, flops_per_s=1.0, intra_node_bandwidth=1e18
  )
  chosen = kaisa_jax.plan_fractions(layers, 2, slow_flops, max_cost_ratio=None)
  assert chosen.recommended == Fraction(1, 2)
  assert option(chosen, "1/2").compute < option(chosen, 1).compute


def _wide_layers():
  class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
      for width in (48, 40, 32, 24, 16):
        x = nn.tanh(nn.Dense(width)(x))
      return nn.Dense(10)(x)

  model = Wide()
  x = jnp.ones((16, 30))
  params = model.init(jax.random.key(0), x)
  return kaisa_jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2)).layers(params, x)


def test_a_budget_below_comm_opt_decompositions_never_recommends_comm_opt():
  layers = _wide_layers()
  slow_network = dataclasses.replace(CLUSTER, latency=1e-2)
  free = kaisa_jax.plan_fractions(layers, 8, slow_network, max_cost_ratio=None)
  comm_opt = option(free, 1)
  assert free.recommended == 1  # without a budget, the model prefers it on this cluster
  for budget in np.linspace(comm_opt.decomposition_memory - 1, 1, 12):
    chosen = kaisa_jax.plan_fractions(layers, 8, slow_network, budget, max_cost_ratio=None)
    assert chosen.recommended != 1
    fitting = [o for o in chosen.options if o.memory <= budget]
    assert [o.fits for o in chosen.options] == [o.memory <= budget for o in chosen.options]
    if fitting:
      assert chosen.recommended == min(fitting, key=lambda o: (o.seconds, o.memory)).fraction
    else:
      assert chosen.recommended is None
      assert "no fraction fits" in str(chosen)


def test_memory_equals_the_buffers_of_real_states_on_8_devices():
  _, _, _, kfac = build("cnn", "shard_map", 8, "1", 1, chained=False)
  # build() traces the layers with one device's batch; its kfac has max_cost_ratio=None.
  layers = kaisa_jax.Layers(tuple(s for s, _ in kfac.plan.layers), kfac.plan.skipped)
  planned = kaisa_jax.plan_fractions(layers, 8, CLUSTER, inv_update_steps=3, max_cost_ratio=None)
  for fraction in ("1/8", "1/4", "1/2", "1"):
    _, (_, state), _, kfac = build("cnn", "shard_map", 8, fraction, 1, chained=False)
    shard = lambda a: a.addressable_shards[0].data.nbytes  # noqa: E731
    o = option(planned, fraction)
    assert (o.factor_memory, o.decomposition_memory) == (
      shard(state.factors),
      shard(state.decompositions),
    )


def test_auto_uses_the_planner_for_the_device_kind(monkeypatch):
  layers = two_dense_layers()
  with pytest.raises(ValueError, match="plan_fractions"):
    cluster_lib.cluster_of(jax.devices()[0])  # a CPU: no preset
  slow_flops = dataclasses.replace(
    CLUSTER, latency=1e-12, flops_per_s=1.0, intra_node_bandwidth=1e18
  )
  monkeypatch.setattr(transform, "cluster_of", lambda device: slow_flops)
  kfac = kaisa_jax.kfac(
    layers, axis_name="batch", axis_size=2, grad_worker_fraction="auto", step_norm="natural"
  )
  expected = kaisa_jax.plan_fractions(layers, 2, slow_flops)
  assert Fraction(kfac.plan.layout.cols, 2) == expected.recommended == Fraction(1, 2)
  with pytest.raises(ValueError, match="cannot change a mesh"):
    kaisa_jax.kfac(
      layers,
      mesh=kaisa_jax.make_mesh(1, jax.devices()[:2]),
      grad_worker_fraction="auto",
      step_norm="natural",
    )


def test_the_default_budget_is_the_device_memory_less_the_model():
  layers = two_dense_layers()
  h100 = kaisa_jax.DGX_H100
  assert kaisa_jax.plan_fractions(layers, 2, h100).memory_budget == 80e9 - 40e9  # half by default
  with_model = kaisa_jax.plan_fractions(layers, 2, h100, model_memory=30e9)
  assert with_model.memory_budget == 80e9 - 30e9 == 50e9
  assert "memory budget 46.57 GiB per device" in str(with_model)
  assert kaisa_jax.plan_fractions(layers, 2, h100, model_memory=0).memory_budget == 80e9
  assert kaisa_jax.plan_fractions(layers, 2, h100, 1e6).memory_budget == 1e6  # outright
  unlimited = kaisa_jax.plan_fractions(layers, 2, h100, math.inf)
  assert unlimited.memory_budget == math.inf and "memory budget none" in str(unlimited)
  assert all(o.fits for o in unlimited.options)


def _small_device(layers, n):
  """A cluster on which COMM-OPT is fastest, with memory for every fraction's K-FAC state but
  COMM-OPT's once half of it (the default model share) goes to the model."""
  slow_network = dataclasses.replace(CLUSTER, latency=1e-2)
  free = kaisa_jax.plan_fractions(layers, n, slow_network, math.inf, max_cost_ratio=None)
  assert free.recommended == 1
  comm_opt, smallest = option(free, 1).memory, min(o.memory for o in free.options)
  assert smallest < comm_opt
  return dataclasses.replace(slow_network, memory=float(smallest + comm_opt)), free


def test_a_default_budget_below_comm_opt_changes_the_recommendation():
  layers = _wide_layers()
  small, free = _small_device(layers, 8)
  budget = small.memory / 2
  default = kaisa_jax.plan_fractions(layers, 8, small, max_cost_ratio=None)
  assert default.memory_budget == budget
  assert default.recommended != 1 and not option(default, 1).fits
  fitting = [o for o in default.options if o.memory <= budget]
  assert default.recommended == min(fitting, key=lambda o: (o.seconds, o.memory)).fraction
  # The same memory given as the model's: a smaller model leaves COMM-OPT room again.
  roomy = kaisa_jax.plan_fractions(layers, 8, small, model_memory=0, max_cost_ratio=None)
  assert roomy.memory_budget == small.memory and roomy.recommended == 1
  tight = small.memory - option(free, 1).memory + 1  # one byte short of COMM-OPT's state
  assert (
    kaisa_jax.plan_fractions(layers, 8, small, model_memory=tight, max_cost_ratio=None).recommended
    != 1
  )


def test_auto_plans_with_the_default_budget(monkeypatch):
  layers = _wide_layers()
  small, _ = _small_device(layers, 8)
  monkeypatch.setattr(transform, "cluster_of", lambda device: small)
  kwargs = dict(axis_name="batch", axis_size=8, step_norm="natural", max_cost_ratio=None)
  kfac = kaisa_jax.kfac(layers, grad_worker_fraction="auto", **kwargs)
  expected = kaisa_jax.plan_fractions(layers, 8, small, max_cost_ratio=None).recommended
  assert Fraction(kfac.plan.layout.cols, 8) == expected != 1
  tiny = dataclasses.replace(small, memory=2.0 * 1000)  # 1000 bytes for K-FAC: nothing fits
  monkeypatch.setattr(transform, "cluster_of", lambda device: tiny)
  with pytest.raises(ValueError, match=r"fits K-FAC's state in the default memory budget"):
    kaisa_jax.kfac(layers, grad_worker_fraction="auto", **kwargs)


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    (dict(model_memory=-1.0), ValueError, r"model_memory must be a finite number of bytes >= 0"),
    (dict(model_memory=math.nan), ValueError, "model_memory must be a finite"),
    (dict(model_memory=math.inf), ValueError, "model_memory must be a finite"),
    (dict(model_memory="40GB"), TypeError, "model_memory must be a number of bytes"),
    (dict(model_memory=True), TypeError, "model_memory must be a number of bytes"),
    (dict(model_memory=1e9), ValueError, r"at or above the memory of one device.*memory_budget="),
    (dict(model_memory=2e9), ValueError, r"model_memory \(1\.86 GiB\) is at or above"),
    (dict(memory_budget=1e6, model_memory=1e6), ValueError, "not both"),
    (dict(memory_budget=0.0), ValueError, r"memory_budget must be a finite number of bytes > 0"),
    (dict(memory_budget=math.nan), ValueError, "memory_budget must be"),
    (dict(memory_budget=-math.inf), ValueError, "memory_budget must be"),
  ],
)
def test_the_budget_rejects_bad_input(kwargs, error, match):
  with pytest.raises(error, match=match):
    kaisa_jax.plan_fractions(two_dense_layers(), 2, CLUSTER, **kwargs)  # CLUSTER: 1 GB


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    (dict(n_devices=0), "n_devices"),
    (dict(cluster="a100"), "Cluster"),
    (dict(memory_budget=-1.0), "memory_budget"),
    (dict(inv_update_steps=0), "inv_update_steps"),
    (dict(compute_method="qr"), "compute_method"),
  ],
)
def test_planner_rejects_bad_input(kwargs, match):
  args = dict(layers=two_dense_layers(), n_devices=2, cluster=CLUSTER) | kwargs
  with pytest.raises((TypeError, ValueError), match=match):
    kaisa_jax.plan_fractions(**args)


def test_cluster_rejects_bad_figures():
  with pytest.raises(ValueError, match="flops_per_s"):
    dataclasses.replace(CLUSTER, flops_per_s=0.0)
  with pytest.raises(ValueError, match="devices_per_node"):
    dataclasses.replace(CLUSTER, devices_per_node=0)
  with pytest.raises(ValueError, match="matmul_rates"):
    dataclasses.replace(CLUSTER, matmul_rates=(1e9,) * 3)
  with pytest.raises(ValueError, match="matmul_rates"):
    dataclasses.replace(CLUSTER, matmul_rates=(0.0,) * len(cluster_lib.MATMUL_SIZES))


# ------------------------------------------------------------------------- projection


def test_projected_compute_is_flops_over_rate_plus_bytes_over_bandwidth_plus_kernels():
  step = projection.ProgramCost(flops=3e9, lapack_flops=1e9, bytes=5e9, kernels=1000)
  t = projection.project_step(step, CLUSTER)
  assert t.compute == pytest.approx(4e9 / 1e9 + 5e9 / 1e10 + 1000 * 1e-6)  # seconds
  assert sum(t.communication.values()) == 0.0  # one device, no gradient all-reduce
  faster = projection.project_step(step, dataclasses.replace(CLUSTER, flops_per_s=2e9))
  assert faster.compute == pytest.approx(2.0 + 0.5 + 1e-3)
  assert "PROJECTED" in str(t)


def test_program_cost_counts_lapack_and_the_kernels_of_the_larger_branch():
  def f(x, p):
    y = jnp.tanh(x @ x)
    z = jax.lax.cond(p, lambda: jnp.linalg.eigh(y)[0].sum() * y, lambda: y)
    return jnp.sum(z, axis=0)

  cost = projection.cost_of(f, jnp.ones((8, 8)), True)
  assert (
    cost.lapack_flops == kaisa_cost.EIGH_CUBE * 8**3
  )  # one 8x8 eigh, which XLA's flops leave out
  # Outside the cond: the product, the predicate's conversion, tanh, the sum; in the
  # eigh branch: a layout copy, the symmetrisation, eigh, the eigenvalue sum, the product.
  assert cost.kernels == 4 + 5
  assert cost.flops >= 2 * 8**3


def test_products_and_convolutions_are_counted_by_size_and_run_at_their_rates():
  def f(x, w, k, p):
    y = x @ w  # 2 * 128 * 256 * 64 flops
    z = jax.lax.conv_general_dilated(  # 2 * (8 * 30 * 4) * (3 * 2) flops: 3 taps, 2 in
      k, jnp.ones((3, 2, 4)), (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")
    )
    big = jax.lax.cond(p, lambda: jnp.sum(w.T @ w), lambda: 0.0)  # 2 * 64 * 256 * 64
    return jnp.sum(y) + jnp.sum(z) + big

  args = (jnp.ones((128, 256)), jnp.ones((256, 64)), jnp.ones((8, 32, 2)), True)
  text = jax.jit(f).lower(*args).compile().as_text()
  flops = sorted(projection.matmul_flops(text))
  assert flops == [2 * 8 * 30 * 4 * 3 * 2, 2 * 64 * 256 * 64, 2 * 128 * 256 * 64]
  cost = projection.cost_of(f, *args)
  assert sum(cost.matmuls) == sum(flops)  # each in the bin of its size
  sizes = np.log(cluster_lib.MATMUL_SIZES)
  for size in flops:
    assert cost.matmuls[int(np.argmin(np.abs(sizes - np.log(size))))] >= size
  # At the cluster's rates: each bin at its own, the rest of XLA's flops at flops_per_s.
  rates = tuple(1e9 * (i + 1) for i in range(len(cluster_lib.MATMUL_SIZES)))
  host = dataclasses.replace(CLUSTER, matmul_rates=rates)
  expected = (
    sum(m / r for m, r in zip(cost.matmuls, rates))
    + (cost.flops - sum(cost.matmuls)) / CLUSTER.flops_per_s
    + cost.bytes / CLUSTER.memory_bandwidth
    + cost.kernels * CLUSTER.kernel_overhead
  )
  assert cost.seconds(host) == pytest.approx(expected)
  assert cost.seconds(CLUSTER) == pytest.approx(  # without rates: every flop at flops_per_s
    cost.flops / CLUSTER.flops_per_s
    + cost.bytes / CLUSTER.memory_bandwidth
    + cost.kernels * CLUSTER.kernel_overhead
  )
  both = cost + cost.scaled(0.5)
  assert both.matmuls == tuple(1.5 * m for m in cost.matmuls)
  assert both.flops == 1.5 * cost.flops


def test_program_cost_counts_the_triangular_solves_of_a_cholesky_inverse():
  def f(x):
    factor = jnp.linalg.cholesky(x @ x.T + 8.0 * jnp.eye(8))
    return jax.scipy.linalg.solve_triangular(factor, jnp.eye(8), lower=True)

  cost = projection.cost_of(f, jnp.ones((8, 8)))
  # One 8x8 Cholesky and one solve for 8 right-hand sides (n^2 m), at the planner's constants.
  assert cost.lapack_flops == pytest.approx(
    (kaisa_cost.CHOLESKY_CUBE + kaisa_cost.SOLVE_CUBE) * 8**3
  )


@pytest.mark.parametrize("n", [8, 33])
def test_planner_and_projection_count_a_decomposition_alike(n):
  """One cost model: the projection's LAPACK flops of a compiled decomposition of an ``n x n``
  factor are the planner's constant times ``n^3`` (`kaisa_jax.cost`)."""
  factor = jnp.eye(n)[None] * 2.0
  eigen = projection.cost_of(lambda f: preconditioning.decompose(f, "eigen", False, 0.0), factor)
  assert eigen.lapack_flops == pytest.approx(kaisa_cost.EIGH_CUBE * n**3)

  def cholesky_inverse(f):
    chol = jax.scipy.linalg.cho_factor(f, lower=True)
    return jax.scipy.linalg.cho_solve(chol, jnp.eye(n))

  inverse = projection.cost_of(cholesky_inverse, factor[0])
  assert inverse.lapack_flops == pytest.approx(kaisa_cost.INVERSE_CUBE * n**3)
  # The inverse method retries a failed Cholesky in a conditional, whose branch counts as if
  # it ran: the projection counts the inverse twice where the planner counts it once.
  method = projection.cost_of(lambda f: preconditioning.decompose(f, "inverse", False, 1.0), factor)
  assert method.lapack_flops == pytest.approx(2 * kaisa_cost.INVERSE_CUBE * n**3)
  spec = two_dense_layers().specs[0]
  for method in preconditioning.METHODS:
    t = kaisa_cost.Treatment(method)
    cube = kaisa_cost.EIGH_CUBE if method == "eigen" else kaisa_cost.INVERSE_CUBE
    assert kaisa_cost.decomposition_flops(spec, t) == cube * (spec.a_dim**3 + spec.g_dim**3)


def _members_in_place(loop: bool):
  """Twelve members' products written into one buffer at runtime offsets: in a loop of three
  turns of four members, or unrolled; the same operations for every member either way."""

  def member(buffer, x, w, at):
    y = jnp.tanh(jax.lax.dynamic_index_in_dim(x, at, keepdims=False) @ w)
    return jax.lax.dynamic_update_index_in_dim(buffer, y, at, 0)

  def f(x, w, offsets):
    buffer = jnp.zeros((12, 16, 32))
    if not loop:
      for j in range(12):
        buffer = member(buffer, x, w, offsets[j])
      return buffer

    def turn(i, buffer):
      for lane in range(4):
        buffer = member(buffer, x, w, 3 * offsets[lane] + i)
      return buffer

    return jax.lax.fori_loop(0, 3, turn, buffer)

  return f


def test_program_cost_counts_a_loop_body_once_per_trip():
  """XLA's cost analysis counts a loop's body once; the cost adds the other trips."""
  args = (jnp.ones((12, 16, 24)), jnp.ones((24, 32)), jnp.arange(12, dtype=jnp.int32))
  looped = jax.jit(_members_in_place(True)).lower(*args).compile()
  unrolled = jax.jit(_members_in_place(False)).lower(*args).compile()
  assert '"known_trip_count":{"n":"3"}' in looped.as_text()
  xla = looped.cost_analysis()
  xla = xla[0] if isinstance(xla, list) else xla
  one, every = projection.program_cost(looped), projection.program_cost(unrolled)
  assert sum(every.matmuls) == 12 * 2 * 16 * 24 * 32
  assert one.matmuls == every.matmuls
  assert one.flops == pytest.approx(every.flops, rel=1e-3)
  assert one.flops > 2.5 * xla["flops"]  # three trips, not one
  assert one.bytes == pytest.approx(every.bytes, rel=0.01)
  assert one.kernels >= every.kernels
  # Nested loops multiply; an eigh in a loop counts once per trip.
  nested = projection.cost_of(
    lambda x: jax.lax.fori_loop(
      0, 3, lambda i, y: jax.lax.fori_loop(0, 4, lambda j, z: jnp.tanh(z @ x), y), x
    ),
    jnp.ones((8, 8)),
  )
  assert sum(nested.matmuls) == 12 * 2 * 8**3
  eighs = projection.cost_of(lambda f: jax.lax.map(jnp.linalg.eigh, f), jnp.ones((5, 6, 6)))
  assert eighs.lapack_flops == 5 * kaisa_cost.EIGH_CUBE * 6**3


def test_a_stack_preconditioned_in_a_loop_costs_what_it_does_member_by_member(monkeypatch):
  """On the CPU a deep stack's preconditioning runs in a loop: its projected work is that of
  the same members computed one by one (XLA's own analysis would count one turn of it)."""

  kfac, params, grad_fn, x = dense_stack(16)
  state = kfac.init(params)
  _, grads, curvature = grad_fn(params, x)
  costs = {}
  for loop_from in (64, 8):  # 16 members: one by one, then in a loop of two turns
    monkeypatch.setattr(cpu_loop, "LOOP_FROM", loop_from)
    costs[loop_from] = projection.kfac_work(kfac, state, grads, curvature, 10, 100)
  apart, looped = costs[64].preconditioning, costs[8].preconditioning
  # Per member: two products by A's basis (9 x 9, bias row in), two by G's (8 x 8).
  assert sum(apart.matmuls) == 16 * 2 * (2 * 9 * 9 * 8 + 2 * 9 * 8 * 8)
  assert looped.matmuls == apart.matmuls
  assert looped.flops == pytest.approx(apart.flops, rel=0.01)
  assert looped.bytes == pytest.approx(apart.bytes, rel=0.02)


def test_loop_corrections_count_as_xla_counts():
  """A loop body's flops and bytes are counted by XLA's rules: on whole programs without
  loops (a gradient, eigendecompositions, a K-FAC step) the counts are XLA's cost analysis."""
  model = TwoDense()
  x = jnp.ones((32, 6))
  params = model.init(jax.random.key(1), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
  tx = optax.chain(kaisa_jax.kfac(grad_fn.layers(params, x), step_norm="natural"), optax.sgd(0.1))

  def kfac_step(params, opt_state):
    _, grads, curvature = grad_fn(params, x)
    return tx.update(grads, opt_state, params, curvature=curvature)

  programs = [
    (jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2)), (params,)),
    (lambda f: [jnp.linalg.eigh(f[i]) for i in range(3)], (jnp.ones((3, 32, 32)),)),
    (kfac_step, (params, tx.init(params))),
  ]
  for fn, args in programs:
    compiled = jax.jit(fn).lower(*args).compile()
    assert " while(" not in compiled.as_text()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    flops, bytes_ = projection._xla_cost(*projection._computations(compiled.as_text()))
    assert flops == pytest.approx(xla["flops"], rel=0.01)
    assert bytes_ == pytest.approx(xla["bytes accessed"], rel=0.01)


def test_host_rates_are_the_probes_costs_over_their_seconds():
  probes = projection.host_probes()
  dense, stream = probes["dense 256"].cost, probes["stream"].cost
  short, long = probes["short chain"].cost, probes["long chain"].cost
  assert stream.bytes == 2 * 4 * 2**20  # 1 Mi float32s read and written
  assert long.kernels - short.kernels == 2 * 100  # a product and a tanh per link
  seconds = {"stream": 1e-4, "short chain": 3e-5, "long chain": 2.3e-4}
  seconds |= {f"dense {w}": 1e-5 * w for w in cluster_lib.MATMUL_WIDTHS}
  for w in cluster_lib.MATMUL_WIDTHS:  # three products of 2 * 128 * w^2 per layer, and tanh
    products = 3 * 2 * (2 * 128 * w * w)
    assert products <= probes[f"dense {w}"].cost.flops <= 1.05 * products
  rates = projection.host_rates(probes, seconds)
  assert rates["flops_per_s"] == pytest.approx(dense.flops / 2.56e-3)
  assert rates["memory_bandwidth"] == pytest.approx(stream.bytes / 1e-4)
  assert rates["inter_node_bandwidth"] == rates["intra_node_bandwidth"] == rates["memory_bandwidth"]
  assert rates["kernel_overhead"] == pytest.approx(2e-4 / 200)
  assert rates["matmul_rates"] == pytest.approx(
    [probes[f"dense {w}"].cost.flops / seconds[f"dense {w}"] for w in cluster_lib.MATMUL_WIDTHS]
  )
  host = dataclasses.replace(CLUSTER, **rates)  # a valid Cluster
  assert host.flops_per_s == rates["flops_per_s"]


def test_communication_shrinks_with_bandwidth_and_crosses_nodes_beyond_one_node():
  step = projection.ProgramCost(1e9, 0.0, 0.0)
  kw = dict(gradient_bytes=4e8)
  within = projection.project_step(step, CLUSTER, 4, **kw)
  assert within.communication["other"] == pytest.approx(1e-5 + 2 * 3 / 4 * 4e8 / 1e9)
  across = projection.project_step(step, CLUSTER, 8, **kw)  # 2 nodes of 4
  assert across.communication["other"] == pytest.approx(1e-5 + 2 * 7 / 8 * 4e8 / 1e8)
  times = [
    projection.project_step(step, dataclasses.replace(CLUSTER, inter_node_bandwidth=b), 8, **kw)
    for b in (1e7, 1e8, 1e9)
  ]
  assert times[0].total > times[1].total > times[2].total


def _kfac_step(n_devices_traced: int = 1):
  model = TwoDense()
  x = jax.random.normal(jax.random.key(0), (32, 6))
  params = model.init(jax.random.key(1), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
  kfac = kaisa_jax.kfac(
    grad_fn.layers(params, x), factor_update_steps=2, inv_update_steps=4, step_norm="natural"
  )
  tx = optax.chain(kfac, optax.sgd(0.1))

  def step(params, opt_state, x):
    _, grads, curvature = grad_fn(params, x)
    updates, opt_state = tx.update(grads, opt_state, params, curvature=curvature)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  _, grads, curvature = grad_fn(params, x)
  work = projection.kfac_work(kfac, opt_state[0], grads, curvature, 2, 4)
  return projection.cost_of(step, params, opt_state, x), work


def test_kfac_phases_are_amortised_and_split_by_the_layout():
  step, work = _kfac_step()
  # The planner's flops of each layer's decompositions (`kaisa_jax.cost`) are the projection's.
  planned = sum(kaisa_cost.decomposition_flops(s, t) for s, t in work.plan.layers)
  assert planned == kaisa_cost.EIGH_CUBE * (7**3 + 8**3 + 9**3 + 4**3)
  assert work.decompositions.lapack_flops == pytest.approx(planned)
  assert step.lapack_flops == work.decompositions.lapack_flops  # the step holds the branch
  one = projection.project_step(step, CLUSTER, kfac=work)
  expected = (
    step
    + work.factors.scaled(1 / 2 - 1)
    + work.decompositions.scaled(1 / 4 - 1)
    + work.preconditioning.scaled(0.0)
  )
  assert one.compute == pytest.approx(expected.seconds(CLUSTER))
  assert 0 < one.compute < step.seconds(CLUSTER)
  # MEM-OPT on 2 devices: each device decomposes and preconditions one layer.
  two = projection.project_step(step, CLUSTER, 2, kfac=work, grad_worker_fraction="mem_opt")
  assert two.fraction == "1/2" and two.compute < one.compute
  assert two.communication["gradient sharing"] > 0
  only_the_count = (CLUSTER.latency + 4 / CLUSTER.intra_node_bandwidth) / 4  # no gather in MEM-OPT
  assert two.communication["decomposition sharing"] == pytest.approx(only_the_count)


@pytest.mark.parametrize("fraction", ["1/8", "1"])
def test_projected_communication_matches_the_hlo_bytes_it_is_given(fraction):
  fn, (params, state), inputs, kfac = build("cnn", "shard_map", 8, fraction, 1, chained=True)
  collectives = accounting.hlo_collectives(fn.lower(params, state, *inputs[0]).compile(), 8)
  no_latency = dataclasses.replace(CLUSTER, latency=1e-30, devices_per_node=8)
  step = projection.ProgramCost(0.0, 0.0, 0.0)
  work = projection.KFACWork(kfac.plan, step, step, step, 10, 100)  # the layout's plan, no compute
  t = projection.project_step(
    step, no_latency, 8, kfac=work, grad_worker_fraction=Fraction(fraction), collectives=collectives
  )
  per_step = communication.per_step(collectives, 10, 100)
  for phase, moved in per_step.items():
    assert t.communication[phase] * no_latency.intra_node_bandwidth == pytest.approx(moved)
  # The modelled collectives of the same layout give the same K-FAC bytes (within the
  # 10 % the accounting tests allow for XLA's layout of the buffers).
  modelled = projection.project_step(
    step, no_latency, 8, kfac=work, grad_worker_fraction=Fraction(fraction)
  )
  for phase in ("factor reduction", "decomposition sharing", "gradient sharing"):
    assert modelled.communication[phase] == pytest.approx(t.communication[phase], rel=0.1)


def test_the_readme_example_of_the_planner():
  class MLP(nn.Module):  # the README's first example
    @nn.compact
    def __call__(self, x):
      return nn.Dense(10)(nn.tanh(nn.Dense(64)(x)))

  x, y = load_digits(return_X_y=True)
  x, y = x[:16] / 16.0, y[:16]
  model = MLP()
  params = model.init(jax.random.key(0), x)
  grad_fn = kaisa_jax.value_and_grad(
    lambda p, b: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, b[0]), b[1]).mean()
  )
  local = grad_fn.layers(params, (x, y))
  choice = kaisa_jax.plan_fractions(local, 8, kaisa_jax.DGX_A100, memory_budget=100_000)
  assert choice.recommended == Fraction(1, 8)
  assert [o.fits for o in choice.options] == [True, False, False, False]
  # A 65x65 and G 64x64 of the first layer, the larger share one device holds (float32).
  assert {o.factor_memory for o in choice.options} == {(65 * 65 + 64 * 64) * 4}
  assert "<- recommended" in str(choice) and "PROJECTED" in str(choice)
  assert kaisa_jax.plan_fractions(local, 8, kaisa_jax.DGX_A100).recommended == 1
  kfac = kaisa_jax.kfac(
    local, axis_name="batch", axis_size=8, grad_worker_fraction=choice.recommended
  )
  assert kfac.plan.layout.cols == 1


class _Device:
  """A stand-in for a GPU device: its kind and the memory statistics it reports."""

  def __init__(self, kind, stats):
    self.device_kind, self._stats = kind, stats

  def memory_stats(self):
    return self._stats


def test_a_device_plans_with_the_memory_it_reports():
  a100_40gb = cluster_lib.cluster_of(_Device("NVIDIA A100-SXM4-40GB", {"bytes_limit": 30e9}))
  assert a100_40gb.memory == 30e9
  assert a100_40gb.flops_per_s == kaisa_jax.DGX_A100.flops_per_s
  # a device that reports nothing keeps the preset's memory
  assert cluster_lib.cluster_of(_Device("NVIDIA H100 80GB HBM3", None)) == kaisa_jax.DGX_H100
  assert cluster_lib.cluster_of(_Device("NVIDIA H100 80GB HBM3", {})) == kaisa_jax.DGX_H100
  # the kind an H200 reports (jax 0.11.2, driver 580) finds its own preset
  h200 = cluster_lib.cluster_of(_Device("NVIDIA H200", {"bytes_limit": 1.1e11}))
  assert h200 == dataclasses.replace(kaisa_jax.DGX_H200, memory=1.1e11)
