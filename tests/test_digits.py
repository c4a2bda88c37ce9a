"""Behaviour: K-FAC+SGD trains a small MLP on scikit-learn's digits faster than SGD."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits

import kaisa_jax

LR, STEPS, BATCH = 0.03, 200, 128


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for width in (64, 64):
      x = nn.tanh(nn.Dense(width)(x))
    return nn.Dense(10)(x)


MODEL = MLP()
X, Y = load_digits(return_X_y=True)
X, Y = (X / 16.0).astype(np.float32), Y.astype(np.int32)


def loss_fn(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(MODEL.apply(params, x), y).mean()


def final_training_loss(use_kfac: bool, seed: int) -> float:
  params = MODEL.init(jax.random.key(seed), X[:1])
  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  sgd = optax.sgd(LR, momentum=0.9)
  if use_kfac:
    layers = grad_fn.layers(params, X[:BATCH], Y[:BATCH])
    kfac = kaisa_jax.kfac(layers, factor_update_steps=1, inv_update_steps=10)
    tx = optax.chain(kfac, sgd)
  else:
    tx = sgd
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    if use_kfac:
      _, grads, curvature = grad_fn(params, x, y)
      updates, state = tx.update(grads, state, params, curvature=curvature)
    else:
      grads = jax.grad(loss_fn)(params, x, y)
      updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  rng = np.random.default_rng(seed)
  for _ in range(STEPS):
    idx = rng.choice(len(X), BATCH, replace=False)
    params, state = step(params, state, X[idx], Y[idx])
  return float(loss_fn(params, X, Y))


@pytest.mark.parametrize("seed", [0, 1])
def test_kfac_reaches_lower_training_loss_than_sgd(seed):
  sgd, kfac = final_training_loss(False, seed), final_training_loss(True, seed)
  assert np.isfinite(kfac)
  assert kfac < sgd, (kfac, sgd)
