"""Bad configuration is rejected at once, with a message naming the fix."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kaisa_jax

MODEL = nn.Dense(3)
X = jnp.ones((4, 2))
PARAMS = MODEL.init(jax.random.key(0), X)


def loss_fn(params, x):
  return jnp.mean(MODEL.apply(params, x) ** 2)


GRAD_FN = kaisa_jax.value_and_grad(loss_fn)
LAYERS = GRAD_FN.layers(PARAMS, X)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(damping=-1e-3), ValueError, "damping must lie in"),
    (dict(damping=0.0), ValueError, r"damping must lie in \(0.0, inf\)"),
    (dict(damping=lambda step: 0.0), ValueError, r"damping\(0\) must lie in \(0.0, inf\)"),
    (dict(damping="big"), TypeError, "damping must be a real number"),
    (dict(damping=lambda step: "x"), TypeError, r"damping\(0\) must be a real number"),
    (dict(damping=lambda step: jnp.ones(3)), TypeError, r"damping\(0\) must be a scalar"),
    (dict(damping=lambda step: 0.1 * step), ValueError, r"damping\(0\) must lie in"),
    (dict(factor_decay=1.0), ValueError, r"factor_decay must lie in \[0.0, 1.0\)"),
    (dict(factor_decay=-0.1), ValueError, "factor_decay must lie in"),
    (dict(factor_update_steps=0), ValueError, "factor_update_steps must be at least 1"),
    (
      dict(factor_update_steps=lambda step: jnp.where(step == 0, 0, 5)),
      ValueError,
      r"factor_update_steps\(0\) must be at least 1",
    ),
    (dict(factor_update_steps=-5), ValueError, "factor_update_steps must be at least 1"),
    (dict(factor_update_steps=2.5), TypeError, "factor_update_steps must be a positive int"),
    (dict(inv_update_steps=0), ValueError, "inv_update_steps must be at least 1"),
    (dict(inv_update_steps=jnp.asarray([3])), TypeError, "inv_update_steps must be a positive int"),
    (dict(max_cost_ratio=jnp.asarray([2.0])), TypeError, r"max_cost_ratio must be a scalar"),
    (
      dict(inv_update_steps=lambda s: 0.5),
      TypeError,
      r"inv_update_steps\(0\) must be a positive int",
    ),
    (dict(compute_method="cholesky"), ValueError, "compute_method must be one of"),
    (dict(weight_sharing="mean"), ValueError, "weight_sharing must be one of"),
    (dict(step_norm="euclidean"), ValueError, "step_norm must be one of"),
    (dict(step_norm="natural", kl_clip=1e-3, lr=None), ValueError, "kl_clip needs the learning"),
    (dict(step_norm="natural", kl_clip=-1.0, lr=0.1), ValueError, "kl_clip must lie in"),
    (dict(step_norm="natural", lr=-0.1), ValueError, "lr must lie in"),
    (dict(step_norm="natural", lr=0.1), ValueError, "lr is read only by the KL clip"),
    (dict(lr=0.1), ValueError, "drop lr="),
    (
      dict(step_norm="gradient", kl_clip=1e-3, lr=0.1),
      ValueError,
      "pass step_norm='natural' with kl_clip= and lr=",
    ),
    (
      dict(step_norm="natural", factor_dtype=jnp.int32),
      TypeError,
      "factor_dtype must be a floating dtype",
    ),
    (dict(step_norm="natural", max_cost_ratio=-1.0), ValueError, "max_cost_ratio must lie in"),
  ],
)
def test_bad_hyperparameters_raise_at_construction(kwargs, error, match):
  with pytest.raises(error, match=match):
    kaisa_jax.kfac(LAYERS, **({"step_norm": "natural"} | kwargs))


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(factor_update_steps=0),
    dict(factor_update_steps=2.5),
    dict(inv_update_steps=0),
    dict(inv_update_steps=lambda s: 0.5),
    dict(compute_method="cholesky"),
    dict(factor_dtype=jnp.int32),
    dict(max_cost_ratio=-1.0),
    dict(assignment_cost="time"),
  ],
)
def test_the_planner_refuses_what_kfac_refuses_with_the_same_message(kwargs):
  # One check (kaisa_jax.config.check_settings) serves both.
  with pytest.raises((TypeError, ValueError)) as by_kfac:
    kaisa_jax.kfac(LAYERS, step_norm="natural", **kwargs)
  with pytest.raises(by_kfac.type) as by_planner:
    kaisa_jax.plan_fractions(LAYERS, 2, kaisa_jax.DGX_A100, **kwargs)
  assert str(by_planner.value) == str(by_kfac.value)


def test_layers_argument_is_required_and_checked():
  with pytest.raises(TypeError, match=r"grad_fn\.layers"):
    kaisa_jax.kfac(PARAMS, step_norm="natural")


def test_bad_value_and_grad_arguments():
  with pytest.raises(ValueError, match="n_examples"):
    kaisa_jax.value_and_grad(loss_fn, n_examples=0)
  with pytest.raises(TypeError, match="include"):
    kaisa_jax.value_and_grad(loss_fn, include=[3])
  with pytest.raises(TypeError, match="callable"):
    kaisa_jax.value_and_grad("loss")


def test_update_without_or_with_foreign_curvature_raises():
  tx = kaisa_jax.kfac(LAYERS, step_norm="natural")
  state = tx.init(PARAMS)
  _, grads, _ = GRAD_FN(PARAMS, X)
  with pytest.raises(ValueError, match="needs the curvature"):
    tx.update(grads, state, PARAMS)

  class Other(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(nn.Dense(4)(x))

  other = Other()
  other_params = other.init(jax.random.key(0), X)
  other_grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(other.apply(p, x) ** 2))
  _, _, other_curvature = other_grad_fn(other_params, X)
  with pytest.raises(ValueError, match="curvature does not match kfac's layers"):
    tx.update(grads, state, PARAMS, curvature=other_curvature)
  with pytest.raises(ValueError, match="have no kernel for layer"):
    tx.init(other_params)

  wide = nn.Dense(5)
  wide_params = wide.init(jax.random.key(0), X)
  with pytest.raises(ValueError, match=r"have shape \(2, 5\), but kfac's layers say \(2, 3\)"):
    tx.init(wide_params)


def test_chained_update_still_requires_curvature():
  tx = optax.chain(kaisa_jax.kfac(LAYERS, step_norm="natural"), optax.sgd(0.1))
  state = tx.init(PARAMS)
  _, grads, _ = GRAD_FN(PARAMS, X)
  with pytest.raises(ValueError, match="needs the curvature"):
    tx.update(grads, state, PARAMS)


def test_concrete_scalar_arrays_count_as_the_numbers_they_hold():
  """``optax.inject_hyperparams`` hands numbers over as 0-d arrays: the static ones act as numbers."""
  as_numbers = dict(inv_update_steps=3, max_cost_ratio=2.0)
  as_arrays = {k: jnp.asarray(v) for k, v in as_numbers.items()}
  _, grads, curvature = GRAD_FN(PARAMS, X)

  def four_steps(hyperparameters):
    tx = kaisa_jax.kfac(LAYERS, step_norm="natural", **hyperparameters)
    state = tx.init(PARAMS)
    for _ in range(4):
      updates, state = tx.update(grads, state, PARAMS, curvature=curvature)
    return updates, state

  jax.tree.map(np.testing.assert_array_equal, four_steps(as_numbers), four_steps(as_arrays))
