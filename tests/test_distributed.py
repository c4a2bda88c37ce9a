"""Distributed K-FAC: the same numbers for every device count and grad worker fraction."""

import functools
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jaxpr_tools
import numpy as np
import pytest
from distributed_setup import build, initial_params, relative_error, run
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kaisa_jax
from kaisa_jax import communication, distribution
from kaisa_jax.analysis import accounting

STEPS = 20
CONFIGS = [(n, f) for n in (1, 2, 4, 8) for f in distribution.valid_fractions(n)]


@functools.cache
def trained(model_name: str, mode: str, n: int, fraction: str):
  """``(first update, final params)`` of 20 steps of K-FAC chained with SGD (momentum 0.9).

  The first update is ``-lr`` times K-FAC's first preconditioned gradient (the
  momentum starts at zero), so comparing it compares the preconditioned gradients.
  """
  return run(model_name, mode, n, fraction, STEPS, chained=True)[:2]


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
@pytest.mark.parametrize("n, fraction", CONFIGS, ids=[f"{n}dev-f{f}" for n, f in CONFIGS])
def test_same_preconditioned_gradient_and_training_as_one_device(mode, model_name, n, fraction):
  ref_update, ref_params = trained(model_name, "single", 1, "1")
  update, params = trained(model_name, mode, n, fraction)
  assert relative_error(update, ref_update) <= 1e-5
  # 20 steps: each step carries float32 differences of order 1e-6 from summing
  # the factors and gradients in another order; they compound, but stay far
  # below how far the parameters move.
  assert relative_error(params, ref_params) <= 1e-4
  initial = jax.tree.map(np.asarray, initial_params(model_name))
  assert relative_error(params, initial) > 1e-2
  # For a given device count the fraction only moves work between devices: the
  # numbers are bit for bit those of COMM-OPT.
  _, comm_opt = trained(model_name, mode, n, "1")
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(comm_opt)):
    np.testing.assert_array_equal(a, b)


KL_CLIP = (("step_norm", "natural"), ("kl_clip", 1e-2), ("lr", 0.1))


@pytest.mark.parametrize(
  "step_rule, modes",
  [((), ("shard_map", "pmap")), (KL_CLIP, ("pmap",))],
  ids=["each-layer-norm", "kl-clip"],
)
def test_every_fraction_and_both_mappings_train_bit_for_bit_alike_with_many_layers(
  step_rule, modes
):
  """12 layers: each step rule's sums (each layer's norms, one reduction per stack; the KL clip's
  sum over every layer) must not follow the device order. The clip runs under ``pmap``, where XLA
  once fused sums differently for different fractions."""
  fractions = distribution.valid_fractions(8)
  runs, orders = {}, set()
  for mode in modes:
    for fraction in fractions:
      _, params, kfac = run("deep", mode, 8, fraction, 4, chained=True, step_rule=step_rule)
      runs[mode, fraction] = params
      layout = kfac.plan.layout
      orders.add(tuple(i for r in range(layout.rows) for i in layout.group(r)))
  assert len(kfac.plan.layers) == 12 and kfac.plan.layers[0][0].kind == "conv"
  assert len(orders) > 2  # the fractions really order the layers differently
  reference = runs[modes[0], "1"]
  assert relative_error(reference, jax.tree.map(np.asarray, initial_params("deep"))) > 1e-2
  if step_rule:  # the clip binds, so its sum reaches the parameters
    fn, (params, state), inputs, _ = build("deep", "single", 1, "1", 1, True, step_rule)
    assert float(fn(params, state, *inputs[0])[1][0].kl_scale) < 1
  for key, params in runs.items():
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
      np.testing.assert_array_equal(a, b, err_msg=str(key))


def test_pmap_replicas_placed_as_its_outputs_compile_the_step_once():
  """The replicas of `distributed_setup.replicate` (the data-parallel guide's recipe) lie where
  ``jax.pmap`` puts its outputs: the calls after the first compile nothing."""
  compiles = []

  def listen(name, secs, **kwargs):
    if name.endswith("backend_compile_duration"):
      compiles.append(name)

  fn, (params, state), inputs, _ = build("mlp", "pmap", 2, "1", 3, chained=True)
  counts = []
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    for x, y in inputs:
      before = len(compiles)
      params, state, _ = jax.block_until_ready(fn(params, state, x, y))
      counts.append(len(compiles) - before)
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert counts[0] >= 1 and counts[1:] == [0, 0]


@pytest.mark.parametrize("mode, n, fraction", [("shard_map", 8, "1/4"), ("pmap", 4, "1/2")])
def test_scanned_layers_distribute_like_one_device(mode, n, fraction):
  kfac = build("scanned", mode, n, fraction, 1, chained=False)[3]
  stack = [f"ScanCheckpoint_Block_0/Dense_0[{i}]" for i in range(3)]
  assert [s.name for s, _ in kfac.plan.layers] == ["Dense_0", *stack, "Dense_1"]
  ref_update, ref_params = trained("scanned", "single", 1, "1")
  update, params = trained("scanned", mode, n, fraction)
  assert relative_error(update, ref_update) <= 1e-5
  assert relative_error(params, ref_params) <= 1e-4
  initial = jax.tree.map(np.asarray, initial_params("scanned"))
  assert relative_error(params, initial) > 1e-2


def _equal_layers_params():
  """16 equal dense layers: a model whose factors can be split evenly over 8 devices."""
  import flax.linen as nn
  import jax.numpy as jnp
  import optax

  class Deep(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(16):
        x = nn.tanh(nn.Dense(31)(x))
      return x

  model = Deep()
  x = jnp.ones((8, 31))
  params = model.init(jax.random.key(0), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: optax.l2_loss(model.apply(p, x)).mean())
  return params, grad_fn.layers(params, x[:1])


def _shard_bytes(array) -> set[int]:
  return {s.data.nbytes for s in array.addressable_shards}


def test_second_order_state_is_sharded():
  params, layers = _equal_layers_params()
  # One treatment everywhere (the cost rule would weigh 1 row against 8).
  kw = dict(step_norm="natural", max_cost_ratio=None)
  single = kaisa_jax.kfac(layers, **kw).init(params)
  per_device = {}
  for fraction in ("mem_opt", "hybrid_opt", "comm_opt"):
    mesh = kaisa_jax.make_mesh(fraction)
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    state = kaisa_jax.kfac(layers, mesh=mesh, **kw).init(replicated)
    factors, decompositions = _shard_bytes(state.factors), _shard_bytes(state.decompositions)
    assert len(factors) == 1 and len(decompositions) == 1  # every device holds the same share
    per_device[fraction] = (factors.pop(), decompositions.pop())
  mem, hybrid, comm = (per_device[f] for f in ("mem_opt", "hybrid_opt", "comm_opt"))
  assert mem[1] <= 1.15 / 8 * comm[1]
  assert hybrid[1] <= 1.15 / 2 * comm[1]
  # Factors live on their owner only, whatever the fraction.
  for factor_bytes, _ in per_device.values():
    assert factor_bytes <= 1.15 / 8 * single.factors.nbytes


@pytest.mark.parametrize("fraction", ["1/8", "1/4", "1/2", "1"])
def test_collectives_in_compiled_step_match_the_model(fraction):
  fn, (params, state), inputs, kfac = build("cnn", "shard_map", 8, fraction, 1, chained=True)
  collectives = accounting.hlo_collectives(fn.lower(params, state, *inputs[0]).compile(), 8)
  measured = {
    phase: 0.0 for phase in (*communication.per_step([], 1, 1), communication.CHAIN_CHECK)
  }
  for c in collectives:
    measured[c.phase] += c.moved_bytes
  model, _ = communication.communication_model(kfac.plan)
  expected = {
    communication.FACTOR_REDUCTION: model.factor_reduction,
    communication.DECOMPOSITION_SHARING: model.decomposition_sharing,
    communication.GRADIENT_SHARING: model.gradient_sharing,
  }
  for phase, value in expected.items():
    assert abs(measured[phase] - value) <= 0.1 * value, (phase, measured[phase], value)
  assert expected[communication.FACTOR_REDUCTION] > 0
  gathers = {
    phase: sum(c.moved_bytes for c in collectives if c.phase == phase and c.kind == "all-gather")
    for phase in expected
  }
  if fraction == "1":  # COMM-OPT: no preconditioned gradient is gathered
    assert gathers[communication.GRADIENT_SHARING] == 0
  if fraction == "1/8":  # MEM-OPT: no decomposition is gathered
    assert gathers[communication.DECOMPOSITION_SHARING] == 0
  assert (
    gathers[
      communication.GRADIENT_SHARING if fraction != "1" else communication.DECOMPOSITION_SHARING
    ]
    > 0
  )
  # The data-parallel gradient all-reduce is there too, attributed to no phase.
  assert measured[communication.OTHER] > 0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_train_like_one(tmp_path):
  here = os.path.dirname(__file__)
  out = tmp_path / "params.npz"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
  port = str(_free_port())
  worker = os.path.join(here, "multiprocess_worker.py")
  procs = [
    subprocess.Popen(
      [sys.executable, worker, str(i), "2", port, str(out)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
    )
    for i in range(2)
  ]
  logs = [p.communicate(timeout=600)[0].decode() for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
  results = np.load(out)
  for fraction in ("1/8", "1/2"):
    _, params, _ = run("mlp", "shard_map", 8, fraction, 5, chained=True)
    other = [results[f"{fraction}/{i}"] for i in range(len(jax.tree.leaves(params)))]
    assert relative_error(other, jax.tree.leaves(params)) <= 1e-5


@pytest.mark.parametrize("fraction", ["1/8", "1/2", "1"])
def test_each_factor_is_decomposed_by_exactly_one_device(fraction):
  fn, (params, state), inputs, kfac = build("cnn", "shard_map", 8, fraction, 1, chained=False)
  jaxpr = jax.make_jaxpr(fn)(params, state, *inputs[0]).jaxpr
  plan = kfac.plan
  per_device = [
    sum(not diag for i in plan.layout.owned(r, c) for diag in plan.layers[i][1].diagonal)
    for r in range(plan.layout.rows)
    for c in range(plan.layout.cols)
  ]
  # One branch per device, run by that device alone; each holds the eigh of its own factors.
  switches = [
    b
    for b in jaxpr_tools.switches(jaxpr)
    if len(b) == 8 and any(jaxpr_tools.count(x, "eigh") for x in b)
  ]
  assert len(switches) == 1
  assert [jaxpr_tools.count(b, "eigh") for b in switches[0]] == per_device
  assert sum(per_device) == 2 * len(plan.layers)
  assert jaxpr_tools.count(jaxpr, "eigh") == sum(per_device)


def test_many_devices_drift_from_one_no_more_than_a_reordered_batch():
  """A recurrent model, and a damping small enough to amplify rounding: over 10 steps, 4 devices
  stay as close to one device as one device does with each batch's rows permuted (the same
  sums in another order). An error of the distribution shows at the first step."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from benchmarks import device_drift
  from experiments import suite

  kfac = device_drift.CONFIGS["K-FAC, the same, damping_form='kaisa', damping=1e-3"]
  d = device_drift.drift(suite.SUITE["gru"](), kfac, steps=10, devices=4)
  assert d["mesh"][0] < 1e-5 and d["permuted"][0] < 1e-5
  for mesh, permuted in zip(d["mesh"], d["permuted"], strict=True):
    assert mesh <= 3 * permuted + 1e-7
  assert d["permuted"][-1] > 10 * d["permuted"][0]  # the rounding does grow
