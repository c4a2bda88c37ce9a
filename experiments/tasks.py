"""Tasks: a model, its data (built offline), its loss and its evaluation metric."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Task:
  """A supervised task.

  Attributes:
    name: the task's name on the command line.
    model: the Flax model.
    train: ``(x, y)`` training arrays.
    test: ``(x, y)`` held-out arrays the metric is reported on.
    metric_name: name of the evaluation metric.
    target: the metric value that counts as reaching the target.
    higher_is_better: whether a larger metric is better.
    batch_size: examples per step.
    steps: default number of training steps.
  """

  name: str
  model: nn.Module
  train: tuple[np.ndarray, np.ndarray]
  test: tuple[np.ndarray, np.ndarray]
  metric_name: str
  target: float
  higher_is_better: bool
  batch_size: int
  steps: int

  def loss(self, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = self.model.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def metric(self, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(self.model.apply(params, x), -1) == y)


class MNIST1DCNN(nn.Module):
  """Three 5-wide convolutions of 32 channels (SAME padding) and a dense head."""

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.relu(nn.Conv(32, (5,))(x))
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


class MLP(nn.Module):
  widths: tuple[int, ...]
  outputs: int

  @nn.compact
  def __call__(self, x):
    for w in self.widths:
      x = nn.tanh(nn.Dense(w)(x))
    return nn.Dense(self.outputs)(x)


def mnist1d() -> Task:
  """MNIST-1D (Greydanus 2020) built offline: 4000 train / 1000 test sequences of 40."""
  from mnist1d.data import get_dataset_args, make_dataset

  data = make_dataset(get_dataset_args())
  x, x_test = (data[k].astype(np.float32)[..., None] for k in ("x", "x_test"))
  y, y_test = (data[k].astype(np.int32) for k in ("y", "y_test"))
  return Task(
    "mnist1d", MNIST1DCNN(), (x, y), (x_test, y_test), "test accuracy", 0.94, True, 128, 3000
  )


def digits() -> Task:
  """scikit-learn's 8x8 digits, a small MLP (1437 train / 360 test)."""
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  y = y.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  x, y = x[order], y[order]
  split = int(0.8 * len(x))
  return Task(
    "digits",
    MLP((64, 64), 10),
    (x[:split], y[:split]),
    (x[split:], y[split:]),
    "test accuracy",
    0.97,
    True,
    128,
    500,
  )


TASKS: dict[str, Callable[[], Task]] = {"mnist1d": mnist1d, "digits": digits}
