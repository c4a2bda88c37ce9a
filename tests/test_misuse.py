"""Misuse that used to give silently wrong results now raises, and Optax's combinators compose."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from distributed_setup import BATCH_SPEC, _global, batches, relative_error
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kaisa_jax
from kaisa_jax import cost, hyperparameters

KFAC = dict(factor_update_steps=1, inv_update_steps=1, max_cost_ratio=None)


def _loss(model):
  def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

  return loss_fn


class Small(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(12)(x.reshape(x.shape[0], -1)))
    return nn.Dense(5)(x)


MODEL = Small()
LOSS = _loss(MODEL)
GRAD_FN = kaisa_jax.value_and_grad(LOSS)
XS, YS = batches(4)
PARAMS = MODEL.init(jax.random.key(0), XS[0])
LAYERS = GRAD_FN.layers(PARAMS, XS[0], YS[0])


def _train(tx, steps=3, xs=XS, ys=YS, params=PARAMS):
  """``steps`` jitted steps of ``tx``; returns the params and the optimizer state."""

  @jax.jit
  def step(params, state, x, y):
    _, grads, curvature = GRAD_FN(params, x, y)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for x, y in zip(xs[:steps], ys[:steps]):
    params, state = step(params, state, x, y)
  return jax.block_until_ready(params), state


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------- devices kfac was not told about


def test_pmap_without_axis_name_raises():
  kfac = kaisa_jax.kfac(LAYERS, **KFAC)
  tx = optax.chain(kfac, optax.sgd(0.1))
  n = 2
  stack = lambda tree: jax.tree.map(lambda a: jnp.stack([a] * n), tree)  # noqa: E731

  def step(params, state, x, y):
    _, grads, curvature = GRAD_FN(params, x, y)
    grads = jax.lax.pmean(grads, "batch")
    return tx.update(grads, state, params, curvature=curvature)

  x = XS[0].reshape(n, -1, *XS.shape[2:])
  y = YS[0].reshape(n, -1)
  fn = jax.pmap(step, axis_name="batch", devices=jax.devices()[:n])
  with pytest.raises(ValueError, match=r"built for one device.*axis_name=NAME"):
    fn(stack(PARAMS), stack(tx.init(PARAMS)), x, y)


def _shard_map_step(tx, mesh, state_specs):
  def step(params, state, x, y):
    _, grads, curvature = GRAD_FN(params, x, y)
    grads = jax.tree.map(lambda g: g / mesh.size, grads)
    return tx.update(grads, state, params, curvature=curvature)[1]

  return jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(P(), state_specs, BATCH_SPEC, BATCH_SPEC), out_specs=state_specs
    )
  )


def test_shard_map_with_a_kfac_built_without_mesh_raises():
  mesh = kaisa_jax.make_mesh("hybrid_opt", jax.devices()[:4])
  tx = kaisa_jax.kfac(LAYERS, **KFAC)
  state = tx.init(PARAMS)
  # The usual recipe: the specs of the state say that it was not made for a mesh.
  with pytest.raises(ValueError, match=r"built without mesh=.*make_mesh"):
    kaisa_jax.partition_specs(state)
  # Replicating the state by hand instead: the update says what to change.
  params = jax.tree.map(lambda a: _global(a, NamedSharding(mesh, P())), PARAMS)
  x, y = (_global(a, NamedSharding(mesh, BATCH_SPEC)) for a in (XS[0], YS[0]))
  fn = _shard_map_step(tx, mesh, P())
  with pytest.raises(ValueError, match=r"built for one device.*mesh=kaisa_jax.make_mesh"):
    fn(params, state, x, y)
  # Built for the mesh, the same step runs.
  tx = kaisa_jax.kfac(LAYERS, mesh=mesh, **KFAC)
  state = tx.init(params)
  specs = kaisa_jax.partition_specs(state)
  assert int(_shard_map_step(tx, mesh, specs)(params, state, x, y).count) == 1


def test_named_vmap_axis_raises_unnamed_vmap_runs():
  """A named vmap axis looks like data parallelism; an unnamed one (an ensemble) is fine."""
  tx = kaisa_jax.kfac(LAYERS, **KFAC)
  seeds = jnp.arange(2)
  params = jax.vmap(lambda s: MODEL.init(jax.random.key(s), XS[0]))(seeds)

  def step(params, state):
    _, grads, curvature = GRAD_FN(params, XS[0], YS[0])
    return tx.update(grads, state, params, curvature=curvature)[0]

  states = jax.vmap(tx.init)(params)
  with pytest.raises(ValueError, match="must not be named"):
    jax.jit(jax.vmap(step, axis_name="ensemble"))(params, states)
  updates = jax.jit(jax.vmap(step))(params, states)
  alone = jax.jit(step)(jax.tree.map(lambda a: a[1], params), jax.tree.map(lambda a: a[1], states))
  # vmap batches the matmuls and eigh: equal up to float32 rounding, not bit for bit.
  assert relative_error(jax.tree.map(lambda a: a[1], updates), alone) <= 1e-5


# ---------------------------------------------------------------------------- chain order


@pytest.mark.parametrize("first", ["sgd", "momentum", "adam"])
def test_optimizer_before_kfac_raises_at_the_first_step(first):
  optimizer = {
    "sgd": optax.sgd(0.1),
    "momentum": optax.sgd(0.1, momentum=0.9),
    "adam": optax.adam(1e-3),
  }[first]
  tx = optax.chain(optimizer, kaisa_jax.kfac(LAYERS, **KFAC))
  with pytest.raises(Exception, match=r"another optimizer runs before kfac.*comes first"):
    _train(tx, steps=1)


def test_the_chain_check_leaves_the_step_without_side_effects():
  # A jax.debug.callback anywhere in the step, even in a branch that runs once, sends
  # every call through JAX's dispatch path for effects: 1.4 ms per call measured on this
  # CPU, about 10 % of a K-FAC step on the MNIST-1D CNN. The check must stay pure.
  tx = optax.chain(kaisa_jax.kfac(LAYERS, **KFAC), optax.sgd(0.1))

  def step(params, state, x, y):
    _, grads, curvature = GRAD_FN(params, x, y)
    return tx.update(grads, state, params, curvature=curvature)

  jaxpr = jax.make_jaxpr(step)(PARAMS, tx.init(PARAMS), XS[0], YS[0])
  assert not jaxpr.effects
  assert "pure_callback" in str(jaxpr)  # the check is there, in the first step's branch


def test_transformations_of_the_gradient_before_kfac_are_accepted():
  kfac = kaisa_jax.kfac(LAYERS, **KFAC)
  tx = optax.chain(
    optax.clip_by_global_norm(1e-3), optax.add_decayed_weights(1e-4), kfac, optax.sgd(0.1)
  )
  params, state = _train(tx, steps=2)
  assert int(state[2].count) == 2
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))


# ---------------------------------------------------------------------------- combinators


def _one_update(tx, params=PARAMS, state=None, x=XS[0], y=YS[0]):
  state = tx.init(params) if state is None else state
  _, grads, curvature = GRAD_FN(params, x, y)
  return jax.jit(tx.update)(grads, state, params, curvature=curvature)


def test_inject_hyperparams_changes_damping_lr_kl_clip_and_decay_in_a_jitted_step():
  values = dict(damping=3e-2, lr=0.2, kl_clip=1e-4, factor_decay=0.5)
  injected = optax.inject_hyperparams(kaisa_jax.kfac, static_args=("inv_update_steps",))(
    LAYERS,
    damping=1e-2,
    step_norm="natural",
    lr=0.1,
    kl_clip=1e-3,
    factor_decay=0.9,
    max_cost_ratio=None,
  )
  state = injected.init(PARAMS)
  # Change every injected value in the state; the jitted update must use the new ones.
  state.hyperparams.update({k: jnp.asarray(v, jnp.float32) for k, v in values.items()})
  updates, state = _one_update(injected, state=state)
  direct, _ = _one_update(
    kaisa_jax.kfac(LAYERS, inv_update_steps=100, max_cost_ratio=None, step_norm="natural", **values)
  )
  _assert_trees_equal(updates, direct)
  # The second step reuses the factors made with the injected decay.
  updates, _ = _one_update(injected, state=state, x=XS[1], y=YS[1])
  ref = kaisa_jax.kfac(
    LAYERS, inv_update_steps=100, max_cost_ratio=None, step_norm="natural", **values
  )
  _, ref_state = _one_update(ref)
  direct, _ = _one_update(ref, state=ref_state, x=XS[1], y=YS[1])
  _assert_trees_equal(updates, direct)


def test_inject_hyperparams_says_which_arguments_must_stay_static():
  injected = optax.inject_hyperparams(kaisa_jax.kfac)(LAYERS)
  state = injected.init(PARAMS)
  with pytest.raises(TypeError, match=r"inv_update_steps.*static_args="):
    _one_update(injected, state=state)


def test_apply_if_finite_skips_a_non_finite_batch():
  """A NaN batch is skipped whole: the run equals one that never saw it."""
  tx = optax.apply_if_finite(
    optax.chain(kaisa_jax.kfac(LAYERS, **KFAC), optax.sgd(0.1, momentum=0.9)), 5
  )
  xs = XS.copy()
  xs[1, 0, 0, 0, 0] = np.nan
  params, state = _train(tx, steps=3, xs=xs)
  assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 1
  ref, _ = _train(tx, steps=2, xs=XS[[0, 2]], ys=YS[[0, 2]])
  _assert_trees_equal(params, ref)


def test_multi_steps_preconditions_the_mean_gradient_with_the_last_curvature():
  inner = optax.chain(kaisa_jax.kfac(LAYERS, **KFAC), optax.sgd(0.1))
  params, _ = _train(optax.MultiSteps(inner, every_k_schedule=2), steps=2)
  # Reference: one step of the inner chain on the mean of the two batches'
  # gradients, with the curvature of the second.
  g0 = GRAD_FN(PARAMS, XS[0], YS[0])[1]
  _, g1, curvature = GRAD_FN(PARAMS, XS[1], YS[1])
  mean = jax.tree.map(lambda a, b: (a + b) / 2, g0, g1)
  updates, _ = jax.jit(inner.update)(mean, inner.init(PARAMS), PARAMS, curvature=curvature)
  ref = optax.apply_updates(PARAMS, updates)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------- small things


def test_layer_factors_are_each_layers_factor():
  tx = kaisa_jax.kfac(LAYERS, **KFAC)
  _, state = _train(tx, steps=1)
  factors = kaisa_jax.layer_factors(tx.plan, state)
  decs = kaisa_jax.layer_decompositions(tx.plan, state)
  assert factors["Dense_0"].a.shape == (8 * 8 * 2 + 1,) * 2
  assert factors["Dense_0"].g.shape == (12, 12)
  assert decs["Dense_1"].a.basis.shape == (13, 13) and decs["Dense_1"].a.values.shape == (13,)
  # A grouped convolution keeps one factor per group.
  conv = nn.Conv(4, (3, 3), feature_group_count=2)
  x = jnp.ones((2, 5, 5, 2))
  params = conv.init(jax.random.key(0), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.sum(conv.apply(p, x) ** 2))
  tx = kaisa_jax.kfac(grad_fn.layers(params, x), **{**KFAC, "step_norm": "natural"})
  _, grads, curvature = grad_fn(params, x)
  _, state = tx.update(grads, tx.init(params), params, curvature=curvature)
  (conv_factors,) = kaisa_jax.layer_factors(tx.plan, state).values()
  assert conv_factors.a.shape == (2, 10, 10) and conv_factors.g.shape == (2, 2, 2)


def test_plan_prints_the_cost_ratio_the_rule_used():
  tx = kaisa_jax.kfac(LAYERS, axis_name="batch", axis_size=8)
  spec, t = tx.plan.layers[0]
  whole = cost.step_cost_ratio(dataclasses.replace(spec, rows=spec.rows * 8), t, 100)
  local = cost.step_cost_ratio(spec, t, 100)
  assert abs(whole - local) > 0.05
  line = str(tx.plan).splitlines()[1]
  assert f"{whole:.2f}x" in line and f"{local:.2f}x" not in line


def test_auto_fraction_under_inject_hyperparams_needs_a_static_factor_cadence():
  """The planner weighs the factor cadence: a traced one could give update another plan than init."""
  static = hyperparameters.STATIC
  kwargs = dict(axis_name="batch", grad_worker_fraction="auto", factor_update_steps=10)
  injected = optax.inject_hyperparams(kaisa_jax.kfac, static_args=static)(LAYERS, **kwargs)
  with pytest.raises(ValueError, match=r"factor_update_steps.*static_args=.*'factor_update_steps'"):
    injected.init(PARAMS)
  static = (*static, "factor_update_steps")
  injected = optax.inject_hyperparams(kaisa_jax.kfac, static_args=static)(LAYERS, **kwargs)
  with pytest.raises(ValueError, match="no cluster preset for device kind 'cpu'"):  # planned
    injected.init(PARAMS)
  one_device = {k: v for k, v in kwargs.items() if k != "axis_name"}  # nothing to plan
  optax.inject_hyperparams(kaisa_jax.kfac, static_args=hyperparameters.STATIC)(
    LAYERS, **one_device
  ).init(PARAMS)
