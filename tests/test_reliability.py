"""Reliability: checkpoint and resume, non-finite values, failed decompositions, low precision."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from distributed_setup import _local, build, relative_error
from sklearn.datasets import load_digits

import kaisa_jax
from kaisa_jax import distribution, preconditioning

# ---------------------------------------------------------------------------- checkpoints


def _train(fn, params, state, inputs):
  for x, y in inputs:
    params, state, _ = jax.block_until_ready(fn(params, state, x, y))
  return params, state


def _save_and_restore(tmp_path, kfac, params, state, new):
  """Saves with Orbax; restores into ``new = (kfac, params, state)``, a fresh run's objects."""
  path = tmp_path / "checkpoint"
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, {"params": params, "opt": kaisa_jax.to_portable(kfac, state)})
  ckpt.wait_until_finished()
  new_kfac, new_params, new_state = new
  target = {"params": new_params, "opt": kaisa_jax.to_portable(new_kfac, new_state)}
  restored = ckpt.restore(path, target)
  return restored["params"], kaisa_jax.from_portable(new_kfac, restored["opt"])


@pytest.mark.parametrize("fraction", distribution.valid_fractions(8))
def test_resume_is_bit_identical_to_uninterrupted(tmp_path, fraction):
  fn, (params, state), inputs, kfac = build("cnn", "shard_map", 8, fraction, 6, chained=True)
  uninterrupted, _ = _train(fn, params, state, inputs)
  params, state = _train(fn, params, state, inputs[:4])  # nothing donated: from the start again
  # A new run: fresh transformation and step function, as after a restart.
  fn2, (params2, state2), _, kfac2 = build("cnn", "shard_map", 8, fraction, 6, chained=True)
  params, state = _save_and_restore(tmp_path, kfac, params, state, (kfac2, params2, state2))
  assert int(state[0].count) == 4
  resumed, _ = _train(fn2, params, state, inputs[4:])
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _outside_kfac(fn, tree):
  """Applies ``fn`` to the leaves that are not part of a K-FAC state."""
  is_kfac = lambda x: isinstance(x, kaisa_jax.KFACState | kaisa_jax.PortableKFACState)  # noqa: E731
  return jax.tree.map(lambda x: x if is_kfac(x) else fn(x), tree, is_leaf=is_kfac)


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_restore_onto_other_devices_and_fraction_continues(tmp_path, mode):
  fn, (params, state), inputs, kfac = build("mlp", "shard_map", 8, "1/8", 8, chained=True)
  uninterrupted, _ = _train(fn, params, state, inputs)
  params, state = _train(fn, params, state, inputs[:4])  # nothing donated: from the start again
  # Onto 4 devices as 2 groups of 2 (MEM-OPT on 8 before).
  fn4, (params4, state4), inputs4, kfac4 = build("mlp", mode, 4, "1/2", 8, chained=True)
  if mode == "pmap":
    # A pmapped step holds a copy per device: restore one copy of the params and
    # of the rest of the optimizer state; K-FAC's own state comes back per device.
    params, params4 = _local(params), jax.tree.map(lambda a: np.asarray(a[0]), params4)
    state = _outside_kfac(lambda a: np.asarray(a.addressable_shards[0].data), state)
    state4 = _outside_kfac(lambda a: np.asarray(a[0]), state4)
  params, state = _save_and_restore(tmp_path, kfac, params, state, (kfac4, params4, state4))
  if mode == "pmap":
    params = jax.tree.map(lambda a: jnp.stack([a] * 4), params)
    state = _outside_kfac(lambda a: jnp.stack([a] * 4), state)
  assert not np.asarray(state[0].refresh).any()  # same treatments: nothing recomputed
  resumed, state = _train(fn4, params, state, inputs4[4:])
  if mode == "pmap":
    resumed = jax.tree.map(lambda a: a[0], resumed)
  resumed, uninterrupted = jax.tree.map(np.asarray, resumed), _local(uninterrupted)
  assert all(np.isfinite(a).all() for a in jax.tree.leaves(resumed))
  assert relative_error(resumed, uninterrupted) <= 1e-4


def _small_problem():
  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(nn.relu(nn.Dense(8)(x)))

  model = MLP()
  x = jax.random.normal(jax.random.key(0), (16, 6))
  y = jax.random.normal(jax.random.key(1), (16, 4))
  params = model.init(jax.random.key(2), x)

  def loss_fn(params, x, y):
    return jnp.mean((model.apply(params, x) - y) ** 2)

  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  return params, x, y, grad_fn, grad_fn.layers(params, x, y)


def test_restore_with_another_treatment_converts_and_recomputes(tmp_path):
  params, x, y, grad_fn, layers = _small_problem()
  kaisa = dict(damping=1e-2, damping_form="kaisa")  # each basis below is (F + 1e-2 I)^-1
  kfac = kaisa_jax.kfac(
    layers, step_norm="natural", factor_update_steps=1, inv_update_steps=50, **kaisa
  )
  state = kfac.init(params)
  for _ in range(3):
    _, grads, curvature = jax.jit(grad_fn)(params, x, y)
    _, state = jax.jit(kfac.update)(grads, state, params, curvature=curvature)
  # Now the inverse method: the eigendecompositions do not apply; recompute them.
  inverse = kaisa_jax.kfac(
    layers, step_norm="natural", compute_method="inverse", inv_update_steps=50, **kaisa
  )
  _, restored = _save_and_restore(
    tmp_path, kfac, params, state, (inverse, params, inverse.init(params))
  )
  assert bool(restored.refresh) and int(restored.count) == 3
  _, grads, curvature = jax.jit(grad_fn)(params, x, y)
  _, after = jax.jit(inverse.update)(grads, restored, params, curvature=curvature)
  assert not bool(after.refresh)
  factors = kaisa_jax.layer_factors(inverse.plan, after)
  for name, dec in kaisa_jax.layer_decompositions(inverse.plan, after).items():
    for side, factor in zip(dec, factors[name]):  # each basis is now (F + damping)^-1
      eye = np.eye(factor.shape[-1])
      np.testing.assert_allclose(side.basis @ (factor + 1e-2 * eye), eye, atol=1e-3)


# -------------------------------------------------------------------- non-finite values


def _guarded(layers, **kwargs):
  kfac = kaisa_jax.kfac(layers, factor_update_steps=1, inv_update_steps=2, **kwargs)
  # apply_if_finite drops a non-finite update after K-FAC has recorded the skip.
  return kfac, optax.chain(kfac, optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5))


def _step_fn(grad_fn, tx, poison=None):
  @jax.jit
  def step(params, state, x, y):
    loss, grads, curvature = grad_fn(params, x, y)
    if poison is not None:
      grads = poison(grads)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state, loss

  return step


def _finite(tree) -> bool:
  return all(
    bool(jnp.all(jnp.isfinite(x)))
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(x.dtype, jnp.floating)
  )


def test_nan_in_activations_skips_the_factor_update_and_training_continues():
  params, x, y, grad_fn, layers = _small_problem()
  _, tx = _guarded(layers)
  state = tx.init(params)
  step = _step_fn(grad_fn, tx)
  params, state, first = step(params, state, x, y)
  bad_x = x.at[3, 2].set(jnp.nan)
  before = state
  params_bad, state, loss = step(params, state, bad_x, y)
  assert not np.isfinite(float(loss))
  assert int(state[0].skipped_factor_updates) == 1
  np.testing.assert_array_equal(state[0].factors, before[0].factors)  # untouched
  assert _finite(state[0]) and _finite(params_bad)
  for a, b in zip(jax.tree.leaves(params_bad), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)  # the update was dropped
  for _ in range(10):
    params_bad, state, loss = step(params_bad, state, x, y)
  assert float(loss) < float(first) and int(state[0].skipped_factor_updates) == 1


def test_inf_in_a_gradient_leaves_the_state_finite():
  params, x, y, grad_fn, layers = _small_problem()
  _, tx = _guarded(layers)
  state = tx.init(params)

  def poison(grads):
    return jax.tree.map(lambda g: g.at[..., 0].set(jnp.inf) if g.ndim == 2 else g, grads)

  params, state, first = _step_fn(grad_fn, tx, poison)(params, state, x, y)
  assert _finite(state[0]) and _finite(params)
  step = _step_fn(grad_fn, tx)
  for _ in range(10):
    params, state, loss = step(params, state, x, y)
  assert float(loss) < float(first)


def test_failed_decomposition_keeps_the_last_good_one(monkeypatch):
  params, x, y, grad_fn, layers = _small_problem()
  _, tx = _guarded(layers)
  state = tx.init(params)
  params, state, _ = _step_fn(grad_fn, tx)(params, state, x, y)  # step 0 decomposes
  good = state[0].decompositions
  real = preconditioning.decompose
  monkeypatch.setattr(
    preconditioning, "decompose", lambda *a: jax.tree.map(lambda v: v * jnp.nan, real(*a))
  )
  broken = _step_fn(grad_fn, tx)  # traced with the failing decomposition
  params, state, _ = broken(params, state, x, y)  # step 1: no inverse step
  params, state, loss = broken(params, state, x, y)  # step 2: every decomposition fails
  assert int(state[0].failed_decompositions) == 4  # two layers, two factors each
  np.testing.assert_array_equal(state[0].decompositions, good)
  assert _finite(state[0]) and np.isfinite(float(loss))
  monkeypatch.setattr(preconditioning, "decompose", real)
  step = _step_fn(grad_fn, tx)
  for _ in range(3):
    params, state, loss = step(params, state, x, y)
  assert int(state[0].failed_decompositions) == 4  # step 4 decomposed fine
  assert not np.array_equal(state[0].decompositions, good)
  assert _finite(state[0]) and _finite(params)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_rank_deficient_factors_stay_finite_at_tiny_damping(method):
  class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(64)(x) - 3.0)  # most units dead
      return nn.Dense(3)(h)

  model = Wide()
  x = jax.random.normal(jax.random.key(0), (4, 40))  # 4 rows: factors of rank <= 4
  params = model.init(jax.random.key(1), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
  kfac = kaisa_jax.kfac(
    grad_fn.layers(params, x),
    damping=1e-7,
    step_norm="natural",
    compute_method=method,
    factor_update_steps=1,
    inv_update_steps=1,
    max_cost_ratio=None,
  )
  state = kfac.init(params)
  for _ in range(3):
    _, grads, curvature = jax.jit(grad_fn)(params, x)
    updates, state = jax.jit(kfac.update)(grads, state, params, curvature=curvature)
    assert _finite(updates) and _finite(state)
  assert int(state.failed_decompositions) == 0


def test_kl_clip_bounds_the_step_in_the_curvature_metric_at_tiny_damping():
  """The clip gives ``lr^2 u^T (A (x) G + damping) u = kl_clip``, so ``|u|^2 <= kl_clip / (lr^2 damping)``.

  Two examples of 64 inputs make rank-deficient factors; at damping 1e-7 the
  step is then up to 1e3 long in directions the factors barely see, which is
  why the loss can grow while the clip holds (the README's "What the KL clip
  bounds"). The quadratic form is recomputed in float64 from the state's own
  factors; float32 eigenvalues near zero leave it within 2 % of the clip.
  """

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(10)(nn.tanh(nn.Dense(64)(x)))

  x, y = load_digits(return_X_y=True)
  batch = (jnp.asarray(x[:2] / 16.0, jnp.float32), jnp.asarray(y[:2]))
  model = MLP()
  params = model.init(jax.random.key(0), batch[0])
  grad_fn = kaisa_jax.value_and_grad(
    lambda p, b: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, b[0]), b[1]).mean()
  )
  damping, kl_clip, lr = 1e-7, 1e-3, 0.1
  kfac = kaisa_jax.kfac(
    grad_fn.layers(params, batch),
    damping=damping,
    damping_form="kaisa",  # the metric A (x) G + damping of the docstring
    step_norm="natural",
    kl_clip=kl_clip,
    lr=lr,
    factor_update_steps=1,
    inv_update_steps=1,
    max_cost_ratio=None,
  )
  sgd = optax.sgd(lr, momentum=0.9)

  @jax.jit
  def step(params, kfac_state, sgd_state):
    _, grads, curvature = grad_fn(params, batch)
    u, kfac_state = kfac.update(grads, kfac_state, params, curvature=curvature)
    updates, sgd_state = sgd.update(u, sgd_state, params)
    return optax.apply_updates(params, updates), kfac_state, sgd_state, u

  kfac_state, sgd_state = kfac.init(params), sgd.init(params)
  lengths = []
  for _ in range(6):
    params, kfac_state, sgd_state, u = step(params, kfac_state, sgd_state)
    factors = kaisa_jax.layer_factors(kfac.plan, kfac_state)
    quadratic, length = 0.0, 0.0
    for name in ("Dense_0", "Dense_1"):
      leaves = u["params"][name]
      m = np.concatenate(
        [np.asarray(leaves["kernel"], np.float64), np.asarray(leaves["bias"])[None]]
      )
      a, g = np.asarray(factors[name].a, np.float64), np.asarray(factors[name].g, np.float64)
      quadratic += np.sum(m * (a @ m @ g)) + damping * np.sum(m * m)
      length += np.sum(m * m)
    np.testing.assert_allclose(lr**2 * quadratic, kl_clip, rtol=2e-2)
    assert length <= kl_clip / (lr**2 * damping)
    lengths.append(length)
  assert (
    max(lengths) > 1e3
  )  # steps far longer than the gradient's: the clip holds, the step is long


# ------------------------------------------------------------------------ low precision


class _Net(nn.Module):
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=self.dtype, param_dtype=self.dtype)
    x = nn.relu(nn.Conv(6, (3, 3), strides=2, **kw)(x))
    x = nn.tanh(nn.Dense(16, **kw)(x.reshape(x.shape[0], -1)))
    return nn.Dense(5, **kw)(x)


def _precondition(dtype, params, x, y, damping):
  model = _Net(dtype)
  params = jax.tree.map(lambda p: p.astype(dtype), params)

  def loss_fn(params, x, y):
    logits = model.apply(params, x.astype(dtype)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  kfac = kaisa_jax.kfac(grad_fn.layers(params, x, y), step_norm="natural", damping=damping)
  _, grads, curvature = jax.jit(grad_fn)(params, x, y)
  state = kfac.init(params)
  updates, state = jax.jit(kfac.update)(grads, state, params, curvature=curvature)
  assert state.factors.dtype == jnp.float32 and state.decompositions.dtype == jnp.float32
  assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
  return kfac, params, grads, curvature, updates


def _f32(tree):
  return jax.tree.map(
    lambda a: np.asarray(a, np.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
  )


def test_bfloat16_model_preconditions_like_float32():
  # Inputs exactly representable in bfloat16, so both models see the same data.
  x = jax.random.normal(jax.random.key(0), (128, 6, 6, 2)).astype(jnp.bfloat16).astype(jnp.float32)
  y = jax.random.randint(jax.random.key(1), (128,), 0, 5)
  params = _Net(jnp.bfloat16).init(jax.random.key(2), x.astype(jnp.bfloat16))
  # K-FAC's own arithmetic: the bfloat16 model's gradient and curvature give the
  # same preconditioned gradient as their values processed in float32 (measured
  # 1.6e-3, the final rounding to bfloat16).
  kfac, params16, grads, curvature, updates = _precondition(jnp.bfloat16, params, x, y, 1e-2)
  same, _ = jax.jit(kfac.update)(
    _f32(grads), kfac.init(_f32(params16)), None, curvature=_f32(curvature)
  )
  assert relative_error(_f32(updates), same) <= 1e-2
  # The whole model: bfloat16 activations change the gradient itself by 0.3%;
  # the preconditioned gradients agree within 1e-2 (measured 8e-3 at damping
  # 0.1; at 0.01 the factors' small eigenvalues amplify the model's own rounding
  # to 1.5e-2).
  *_, bf16 = _precondition(jnp.bfloat16, params, x, y, 0.1)
  *_, f32 = _precondition(jnp.float32, params, x, y, 0.1)
  assert relative_error(_f32(bf16), _f32(f32)) <= 1e-2


def test_bfloat16_model_trains():
  x = jax.random.normal(jax.random.key(0), (128, 6, 6, 2)).astype(jnp.bfloat16)
  y = jax.random.randint(jax.random.key(1), (128,), 0, 5)
  model = _Net(jnp.bfloat16)
  params = model.init(jax.random.key(2), x)

  def loss_fn(params, x, y):
    logits = model.apply(params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  kfac = kaisa_jax.kfac(grad_fn.layers(params, x, y), factor_update_steps=2, inv_update_steps=10)
  tx = optax.chain(kfac, optax.sgd(0.05, momentum=0.9))

  @jax.jit
  def step(params, state):
    loss, grads, curvature = grad_fn(params, x, y)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state, loss

  state = tx.init(params)
  losses = []
  for _ in range(30):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
  assert state[0].factors.dtype == jnp.float32 and _finite(state)
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
