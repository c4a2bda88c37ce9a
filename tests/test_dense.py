"""Dense layers: factors and preconditioned gradients against dense numpy solves."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references as ref
from conftest import one_update

import kaisa_jax

DAMPING = 0.05


def _problem(input_shape, bias):
  model = nn.Dense(3, use_bias=bias, param_dtype=jnp.float64)
  kx, kt, kp = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, input_shape, jnp.float64)
  target = jax.random.normal(kt, (*input_shape[:-1], 3), jnp.float64)
  params = model.init(kp, x)

  def head(s):
    # A mean over the batch (leading axis) of a nonlinear per-example loss.
    return jnp.mean(jnp.sum(0.5 * (jnp.tanh(s) - target) ** 2, axis=tuple(range(1, s.ndim))))

  def loss_fn(params, x):
    return head(model.apply(params, x))

  return model, params, x, head, loss_fn


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_shape", [(8, 5), (4, 3, 5)], ids=["2d", "3d"])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_dense_matches_dense_solve(x64, bias, input_shape, method):
  model, params, x, head, loss_fn = _problem(input_shape, bias)
  grads, _, tx, state, updates = one_update(
    loss_fn, params, x, damping=DAMPING, compute_method=method, factor_dtype=jnp.float64
  )
  # Capturing curvature must not change the gradient.
  expected_grads = jax.grad(loss_fn)(params, x)
  np.testing.assert_allclose(
    grads["params"]["kernel"], expected_grads["params"]["kernel"], rtol=1e-12
  )

  s = model.apply(params, x)
  g = np.asarray(jax.grad(head)(s))
  a_ref = ref.input_factor(ref.dense_rows(np.asarray(x), bias))
  g_ref = ref.output_factor(g.reshape(-1, 3), n=input_shape[0])
  (factors,) = kaisa_jax.layer_factors(tx.plan, state).values()
  np.testing.assert_allclose(factors.a, a_ref, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(factors.g, g_ref, rtol=1e-10, atol=1e-12)

  v = ref.gradient_matrix(grads["params"]["kernel"], grads["params"].get("bias"), 1)[0]
  if method == "eigen":
    expected = ref.kronecker_solve(a_ref, g_ref, v, DAMPING)
  else:
    expected = ref.two_sided_inverse(a_ref, g_ref, v, DAMPING)
  got = ref.gradient_matrix(updates["params"]["kernel"], updates["params"].get("bias"), 1)[0]
  np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-12)
  # The preconditioned gradient differs from the plain one: the test can fail.
  assert not np.allclose(got, v, rtol=1e-2)


def test_float32_close_to_float64():
  """The default float32 path agrees with the float64 reference to float32 accuracy."""
  model = nn.Dense(4)
  x = jax.random.normal(jax.random.key(1), (16, 6))
  params = model.init(jax.random.key(2), x)

  def loss_fn(params, x):
    return jnp.mean(jnp.sum(jnp.sin(model.apply(params, x)), axis=-1))

  grads, curvature, _, _, updates = one_update(loss_fn, params, x, damping=DAMPING)
  a_ref = ref.input_factor(ref.dense_rows(np.asarray(x), True))
  g_ref = ref.output_factor(np.asarray(curvature["Dense"].g[0]), n=16)
  v = ref.gradient_matrix(grads["params"]["kernel"], grads["params"]["bias"], 1)[0]
  expected = ref.kronecker_solve(a_ref, g_ref, v, DAMPING)
  got = ref.gradient_matrix(updates["params"]["kernel"], updates["params"]["bias"], 1)[0]
  np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-6)
