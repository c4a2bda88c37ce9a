"""Cadence, damping schedules, the KL clip, lax.cond and compilation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxpr_tools
import numpy as np
import optax
import pytest
import references as ref

import kaisa_jax
from kaisa_jax import preconditioning


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(6)(x))
    return nn.Dense(3)(x)


MODEL = MLP()


def loss_fn(params, x, y):
  return jnp.mean(jnp.sum((MODEL.apply(params, x) - y) ** 2, axis=-1))


def batches(n, dtype=jnp.float32):
  key = jax.random.key(7)
  out = []
  for k in jax.random.split(key, n):
    kx, ky = jax.random.split(k)
    out.append((jax.random.normal(kx, (10, 4), dtype), jax.random.normal(ky, (10, 3), dtype)))
  return out


def setup(dtype=jnp.float32, **kwargs):
  data = batches(8, dtype)
  params = MODEL.init(jax.random.key(0), data[0][0])
  params = jax.tree.map(lambda p: p.astype(dtype), params)
  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  config = dict(step_norm="natural", max_cost_ratio=None, factor_dtype=dtype) | kwargs
  tx = kaisa_jax.kfac(grad_fn.layers(params, *data[0]), **config)
  return data, params, grad_fn, tx


def _run(tx, params, grad_fn, data, state=None):
  """The states after each step of ``data``."""
  state = tx.init(params) if state is None else state
  update = jax.jit(tx.update)
  history = []
  for x, y in data:
    _, grads, curvature = grad_fn(params, x, y)
    _, state = update(grads, state, params, curvature=curvature)
    history.append(state)
  return history


def _changed(new, old) -> bool:
  return not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)))


def test_factors_and_decompositions_change_only_on_their_steps():
  data, params, grad_fn, tx = setup(factor_update_steps=2, inv_update_steps=3, factor_decay=0.5)
  history = _run(tx, params, grad_fn, data[:7])
  for k in range(1, 7):
    assert _changed(history[k].factors, history[k - 1].factors) == (k % 2 == 0), k
    assert _changed(history[k].decompositions, history[k - 1].decompositions) == (k % 3 == 0), k
  # A decomposition made at an inverse step reproduces the factor of that step.
  for k in (0, 3, 6):
    factors = kaisa_jax.layer_factors(tx.plan, history[k])
    for name, dec in kaisa_jax.layer_decompositions(tx.plan, history[k]).items():
      for factor, side in zip(factors[name], dec):
        rebuilt = (side.basis * side.values[..., None, :]) @ np.swapaxes(side.basis, -1, -2)
        np.testing.assert_allclose(rebuilt, factor, rtol=1e-4, atol=1e-5)
  assert int(history[-1].count) == 7


def test_curvature_warmup_refreshes_every_step_then_follows_the_cadences():
  cadences = dict(factor_update_steps=2, inv_update_steps=3, factor_decay=0.5)
  data, params, grad_fn, tx = setup(curvature_warmup=4, **cadences)
  history = _run(tx, params, grad_fn, data[:7])
  for k in range(1, 7):
    assert _changed(history[k].factors, history[k - 1].factors) == (k < 4 or k % 2 == 0), k
    assert _changed(history[k].decompositions, history[k - 1].decompositions) == (
      k < 4 or k % 3 == 0
    ), k
  # Through the warmup the state is that of cadences of 1, bit for bit.
  _, _, _, every_step = setup(factor_update_steps=1, inv_update_steps=1, factor_decay=0.5)
  for warm, ref_state in zip(history[:4], _run(every_step, params, grad_fn, data[:4])):
    for a, b in zip(jax.tree.leaves(warm), jax.tree.leaves(ref_state)):
      np.testing.assert_array_equal(a, b)
  # Injected, the warmup is read from the state: at 0 the steps follow the cadences alone.
  injected = optax.inject_hyperparams(kaisa_jax.kfac, static_args=("inv_update_steps",))(
    grad_fn.layers(params, *data[0]),
    step_norm="natural",
    max_cost_ratio=None,
    curvature_warmup=4,
    **cadences,
  )
  state = injected.init(params)
  state.hyperparams["curvature_warmup"] = jnp.asarray(0, jnp.int32)
  _, _, _, plain = setup(**cadences)
  for got, want in zip(
    _run(injected, params, grad_fn, data[:3], state), _run(plain, params, grad_fn, data[:3])
  ):
    for a, b in zip(jax.tree.leaves(got.inner_state), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)


def test_curvature_warmup_leaves_the_plan_as_the_cadences_make_it():
  # A cadence of 1 weighs the decompositions 100x: the plan must not see the warmup's.
  data, params, grad_fn, _ = setup()
  layers = grad_fn.layers(params, *data[0])
  for ratio in (4.0, 0.05):
    plain = kaisa_jax.kfac(layers, max_cost_ratio=ratio)
    warm = kaisa_jax.kfac(layers, max_cost_ratio=ratio, curvature_warmup=1000)
    every_step = kaisa_jax.kfac(layers, max_cost_ratio=ratio, inv_update_steps=1)
    assert str(warm.plan) == str(plain.plan)
  assert str(every_step.plan) != str(plain.plan)  # the small ratio tells the cadences apart


@pytest.mark.parametrize(
  "value, error, message",
  [
    (-1, ValueError, "curvature_warmup must be at least 0"),
    (2.5, TypeError, "curvature_warmup must be an int"),
    (True, TypeError, "curvature_warmup must be an int"),
    (lambda step: 10, TypeError, "not a schedule"),
  ],
)
def test_curvature_warmup_is_a_count_of_steps(value, error, message):
  data, params, grad_fn, _ = setup()
  with pytest.raises(error, match=message):
    kaisa_jax.kfac(grad_fn.layers(params, *data[0]), curvature_warmup=value)


def test_running_average_is_bias_corrected():
  data, params, grad_fn, tx = setup(factor_update_steps=1, factor_decay=0.7)
  state = tx.init(params)
  batch_factors = []
  for x, y in data[:3]:
    _, grads, curvature = grad_fn(params, x, y)
    _, state = tx.update(grads, state, params, curvature=curvature)
    a = np.asarray(curvature["Dense_0"].a[0], np.float64)
    rows = ref.dense_rows(a, True)
    batch_factors.append(ref.input_factor(rows))
  weights = np.array([0.7**2, 0.7, 1.0]) * 0.3
  expected = sum(w * f for w, f in zip(weights, batch_factors)) / weights.sum()
  factors = kaisa_jax.layer_factors(tx.plan, state)["Dense_0"]
  np.testing.assert_allclose(factors.a, expected, rtol=1e-5, atol=1e-6)


def test_damping_schedule_is_honoured_step_by_step(x64):
  schedule = lambda step: 0.02 * (1.0 + step)  # noqa: E731
  data, params, grad_fn, tx = setup(
    jnp.float64,
    damping=schedule,
    damping_form="kaisa",  # the form kronecker_solve checks
    factor_update_steps=1,
    inv_update_steps=3,
    factor_decay=0.0,
  )
  state = tx.init(params)
  update = jax.jit(tx.update)
  last_inverse_factors = None
  for k, (x, y) in enumerate(data[:6]):
    _, grads, curvature = grad_fn(params, x, y)
    updates, state = update(grads, state, params, curvature=curvature)
    if k % 3 == 0:
      last_inverse_factors = jax.tree.map(np.asarray, kaisa_jax.layer_factors(tx.plan, state))
    for name in ("Dense_0", "Dense_1"):
      f = last_inverse_factors[name]
      v = ref.gradient_matrix(grads["params"][name]["kernel"], grads["params"][name]["bias"], 1)[0]
      expected = ref.kronecker_solve(f.a, f.g, v, schedule(k))
      got = ref.gradient_matrix(
        updates["params"][name]["kernel"], updates["params"][name]["bias"], 1
      )[0]
      np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("kl_clip", [1e-5, 1e3])
def test_kl_clip_matches_formula(kl_clip):
  lr = 0.3
  data, params, grad_fn, plain = setup(factor_update_steps=1, inv_update_steps=1)
  _, _, _, clipped = setup(factor_update_steps=1, inv_update_steps=1, kl_clip=kl_clip, lr=lr)
  x, y = data[0]
  _, grads, curvature = grad_fn(params, x, y)
  p, _ = plain.update(grads, plain.init(params), params, curvature=curvature)
  c, _ = clipped.update(grads, clipped.init(params), params, curvature=curvature)
  vg = sum(
    np.sum(np.asarray(a, np.float64) * np.asarray(b))
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(grads))
  )
  nu = min(1.0, np.sqrt(kl_clip / abs(lr**2 * vg)))
  assert (nu < 1.0) == (kl_clip < 1.0)
  for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(p)):
    np.testing.assert_allclose(a, nu * np.asarray(b), rtol=1e-5, atol=1e-8)


def _by_layer(tree) -> dict[str, list[np.ndarray]]:
  """A parameter tree's leaves grouped by their layer (the path above the leaf)."""
  layers: dict[str, list[np.ndarray]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    layers.setdefault(jax.tree_util.keystr(path[:-1]), []).append(np.asarray(leaf))
  return layers


def test_the_default_step_gives_each_layer_its_gradients_norm(x64):
  """Each layer's ``nu = sqrt(|V|^2 / |P|^2)`` (its weight and bias together), float64 throughout;
  the state keeps the whole step's ``sqrt(sum |V|^2 / sum |P|^2)``."""
  data, params, grad_fn, natural = setup(jnp.float64, factor_update_steps=1, inv_update_steps=1)
  config = dict(factor_update_steps=1, inv_update_steps=1, max_cost_ratio=None)
  default = kaisa_jax.kfac(grad_fn.layers(params, *data[0]), factor_dtype=jnp.float64, **config)
  x, y = data[0]
  _, grads, curvature = grad_fn(params, x, y)
  p, _ = natural.update(grads, natural.init(params), params, curvature=curvature)
  u, state = default.update(grads, default.init(params), params, curvature=curvature)
  p, u, v = _by_layer(p), _by_layer(u), _by_layer(grads)

  def square(leaves):
    return sum(np.sum(np.square(a)) for a in leaves)

  nus = {name: np.sqrt(square(v[name]) / square(p[name])) for name in v}
  assert len(nus) > 1 and np.ptp(list(nus.values())) > 1e-2  # the layers' scales differ
  for name, nu in nus.items():
    for a, b in zip(u[name], p[name], strict=True):
      np.testing.assert_allclose(a, nu * b, rtol=1e-10, err_msg=name)
    np.testing.assert_allclose(np.sqrt(square(u[name])), np.sqrt(square(v[name])), rtol=1e-10)
  whole = np.sqrt(sum(map(square, v.values())) / sum(map(square, p.values())))
  np.testing.assert_allclose(float(state.kl_scale), whole, rtol=1e-10)


def test_kl_clip_scale_is_the_formula_bit_for_bit():
  """``sqrt(min(1, r))`` (the square root last) against ``min(1, sqrt(r))`` in float32.

  Ratios stay above float32's smallest normal number: XLA's CPU code flushes
  subnormal results to zero, NumPy does not.
  """
  rng = np.random.default_rng(0)
  vg = (10.0 ** rng.uniform(-30, 27, 4000) * rng.choice([-1, 1], 4000)).astype(np.float32)
  vg[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, np.float32(1e-45)]
  kl = (10.0 ** rng.uniform(-8, 2, 4000)).astype(np.float32)
  lr = (10.0 ** rng.uniform(-4, 1, 4000)).astype(np.float32)
  # ratios just below 1, at 1 and just above it
  kl[6:9] = lr[6:9] ** 2 * np.abs(vg[6:9]) * np.float32([1 - 2**-23, 1, 1 + 2**-23])
  denom = np.abs(lr**2 * vg)
  with np.errstate(divide="ignore", invalid="ignore"):
    expected = np.where(
      denom > 0, np.minimum(np.float32(1), np.sqrt(kl / np.where(denom > 0, denom, 1))), 1
    ).astype(np.float32)
  got = np.asarray(jax.jit(jax.vmap(preconditioning.kl_clip_scale))(vg, kl, lr))
  np.testing.assert_array_equal(got.view(np.int32), expected.view(np.int32))
  assert (got < 1).sum() > 1000 and (got == 1).sum() > 1000


def test_skipped_work_sits_under_cond():
  data, params, grad_fn, tx = setup(factor_update_steps=2, inv_update_steps=3)
  state = tx.init(params)
  x, y = data[0]
  _, grads, curvature = grad_fn(params, x, y)
  closed = jax.make_jaxpr(lambda g, s, c: tx.update(g, s, params, curvature=c))(
    grads, state, curvature
  )
  outside = jaxpr_tools.primitives(closed.jaxpr, into_cond=False)
  assert "cond" in outside
  assert "eigh" not in outside
  assert "eigh" in jaxpr_tools.primitives(closed.jaxpr, into_cond=True)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_jit_chain_trains_without_recompiling(optimizer):
  data, params, grad_fn, kfac = setup(
    factor_update_steps=2, inv_update_steps=3, kl_clip=1e-2, lr=0.1
  )
  inner = optax.sgd(0.1) if optimizer == "sgd" else optax.adam(0.05)
  tx = optax.chain(kfac, inner)
  state = tx.init(params)
  traces = []

  @jax.jit
  def step(params, state, x, y):
    traces.append(1)
    loss, grads, curvature = grad_fn(params, x, y)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state, loss

  x, y = data[0]
  first = float(loss_fn(params, x, y))
  for _ in range(25):
    params, state, loss = step(params, state, x, y)
  assert len(traces) == 1
  assert step._cache_size() == 1
  assert float(loss) < 0.5 * first
