"""The adaptive-damping prototype (`benchmarks/adaptive_damping.py`) measures the library's rules.

With the damping fixed it must train as `kaisa_jax.kfac` under the same step rule does, since it
applies that rule outside K-FAC; and the decrease it predicts for a step must be the damped
quadratic model's, checked against a dense inverse.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from sklearn.datasets import load_digits

from benchmarks import adaptive_damping
from experiments import suite

STEPS = 30


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.tanh(nn.Dense(32)(x)))


def digits_mlp() -> suite.Problem:
  x, y = load_digits(return_X_y=True)
  model = MLP()

  def init(key):
    return model.init(key, x[:1].astype(np.float32)), None

  def loss(params, state, xb, yb):
    logits = model.apply(params, xb)
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), state

  return suite.Problem("digits_mlp", init, loss, ((x / 16).astype(np.float32), y), batch_size=64)


@pytest.fixture(scope="module")
def problem():
  return digits_mlp()


@pytest.mark.parametrize(
  "rule, kfac",
  [("gradient", {}), ("kl_clip", {"step_norm": "natural", "kl_clip": adaptive_damping.KL_CLIP})],
)
def test_fixed_damping_trains_as_the_library_does_under_the_same_rule(problem, rule, kfac):
  params, state = problem.init(jax.random.key(0))
  order = suite.batch_order(len(problem.train[0]), problem.batch_size, STEPS, 0)
  lr, damping = jnp.float32(0.1), jnp.float32(1e-3)
  library = np.asarray(suite.make_run(problem, kfac)(params, state, order, lr, damping)[0])
  losses, dampings = adaptive_damping.make_run(problem, None, rule)(
    params, state, order, lr, damping
  )
  assert np.all(np.asarray(dampings) == damping)
  # Only the order of the sums differs; the loss falls well beyond that meanwhile.
  assert library[-1] < 0.5 * library[0]
  np.testing.assert_allclose(np.asarray(losses), library, rtol=2e-5)


@pytest.mark.parametrize("rule", sorted(adaptive_damping.RULES))
def test_predicted_decrease_is_the_damped_quadratic_model(rule):
  rng = np.random.default_rng(0)
  shapes = {"a": {"kernel": (3, 2), "bias": (2,)}, "b": {"kernel": (2, 4)}}
  grads = {k: {p: jnp.asarray(rng.normal(size=s)) for p, s in v.items()} for k, v in shapes.items()}
  # One dense SPD preconditioner per layer, acting on its flattened parameters.
  flat, unravel = {}, {}
  for k in shapes:
    v, unravel[k] = ravel_pytree(grads[k])
    flat[k] = np.asarray(v)
  dense = {}
  for k, v in flat.items():
    m = rng.normal(size=(v.size, v.size))
    dense[k] = m @ m.T + v.size * np.eye(v.size)
  pflat = {k: dense[k] @ flat[k] for k in shapes}
  pg = {k: unravel[k](jnp.asarray(pflat[k])) for k in shapes}
  lr = 0.3
  u, model = adaptive_damping.step_rule(rule, grads, pg, jnp.asarray(lr))
  uflat = {k: np.asarray(ravel_pytree(u[k])[0]) for k in shapes}
  delta = {k: -lr * uflat[k] for k in shapes}
  expected = sum(
    flat[k] @ delta[k] + 0.5 * delta[k] @ np.linalg.solve(dense[k], delta[k]) for k in shapes
  )
  np.testing.assert_allclose(float(model), expected, rtol=1e-5)
  for k in shapes:  # the step points along P g
    cos = uflat[k] @ pflat[k] / np.linalg.norm(uflat[k]) / np.linalg.norm(pflat[k])
    np.testing.assert_allclose(cos, 1.0, rtol=1e-6)
    if rule == "gradient":
      np.testing.assert_allclose(np.linalg.norm(uflat[k]), np.linalg.norm(flat[k]), rtol=1e-6)
