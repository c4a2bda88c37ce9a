"""Tasks: a model, its data (built offline), its loss and its evaluation metric.

A task's model may keep state besides its parameters (BatchNorm's
``batch_stats``): `Task.mutable` names those collections. Such a model takes a
``train`` argument; training calls it with ``train=True`` and the collections
mutable, evaluation with ``train=False`` (BatchNorm's running averages).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import string
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = Any
State = dict[str, Any]
Batch = tuple[jax.Array, jax.Array]
Objective = Callable[[jax.Array, jax.Array], jax.Array]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy against integer labels."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Fraction of examples whose largest logit is the label."""
  return jnp.mean(jnp.argmax(logits, -1) == labels)


def mean_squared_error(predictions: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean over examples and features of the squared error."""
  return jnp.mean((predictions - targets) ** 2)


@dataclasses.dataclass(frozen=True)
class Task:
  """A task: model, data, loss, metric and target.

  Attributes:
    name: the task's name on the command line.
    model: the Flax model.
    train: ``(x, y)`` training arrays (for an autoencoder ``y`` is ``x``).
    test: ``(x, y)`` held-out arrays the metric is reported on.
    loss_fn: ``(outputs, y) -> scalar`` minimised in training.
    metric_fn: ``(outputs, y) -> scalar`` reported on the held-out arrays.
    metric_name: name of the evaluation metric.
    target: the metric value that counts as reaching the target.
    higher_is_better: whether a larger metric is better.
    batch_size: examples per step.
    steps: default number of training steps.
    sweep_steps: the step budget of each trial of a sweep.
    mutable: collections the model updates in training (``("batch_stats",)``);
      when not empty the model takes a ``train`` argument.
    terms_per_example: how many terms per example the loss averages over (64
      for a per-pixel MSE on 8x8 images); K-FAC is told the loss averages over
      ``batch_size * terms_per_example`` terms (`kaisa_jax.value_and_grad`'s
      ``n_examples``), so its factors and damping are per term.
  """

  name: str
  model: nn.Module
  train: tuple[np.ndarray, np.ndarray]
  test: tuple[np.ndarray, np.ndarray]
  loss_fn: Objective
  metric_fn: Objective
  metric_name: str
  target: float
  higher_is_better: bool
  batch_size: int
  steps: int
  sweep_steps: int
  mutable: tuple[str, ...] = ()
  terms_per_example: int = 1

  def n_examples(self) -> int | None:
    """`kaisa_jax.value_and_grad`'s ``n_examples`` (None: the batch)."""
    return None if self.terms_per_example == 1 else self.batch_size * self.terms_per_example

  def _mode(self, train: bool) -> dict[str, bool]:
    return {"train": train} if self.mutable else {}

  def init(self, key: jax.Array, x: jax.Array) -> tuple[Params, State]:
    """The parameters and the model state (empty unless `mutable`)."""
    variables = dict(self.model.init(key, x, **self._mode(False)))
    return variables.pop("params"), {k: variables[k] for k in self.mutable}

  def predict(self, params: Params, state: State, x: jax.Array) -> jax.Array:
    """The model's outputs in evaluation mode (running averages, no update)."""
    return self.model.apply({"params": params, **state}, x, **self._mode(False))

  def loss(
    self, params: Params, state: State, x: jax.Array, y: jax.Array
  ) -> tuple[jax.Array, State]:
    """The training loss and the updated state (``(loss, aux)`` for ``has_aux``)."""
    if not self.mutable:
      return self.loss_fn(self.model.apply({"params": params}, x), y), state
    outputs, updates = self.model.apply(
      {"params": params, **state}, x, **self._mode(True), mutable=list(self.mutable)
    )
    return self.loss_fn(outputs, y), {k: updates[k] for k in self.mutable}

  def evaluate(
    self, params: Params, state: State, train: Batch, test: Batch
  ) -> tuple[jax.Array, jax.Array]:
    """``(loss on train, metric on test)``, both in evaluation mode."""
    return (
      self.loss_fn(self.predict(params, state, train[0]), train[1]),
      self.metric_fn(self.predict(params, state, test[0]), test[1]),
    )

  def reached(self, metric: float) -> bool:
    """Whether a metric value reaches the target."""
    return metric >= self.target if self.higher_is_better else metric <= self.target


def with_validation(task: Task, fraction: float = 0.2, seed: int = 0) -> Task:
  """The task with a validation split carved from its training set as the held-out set.

  The test set is not used: hyperparameters are chosen on this split.
  """
  n = len(task.train[0])
  order = np.random.default_rng(seed).permutation(n)
  held = round(fraction * n)
  val, rest = order[:held], order[held:]
  x, y = task.train
  metric_name = task.metric_name.replace("test", "validation")
  return dataclasses.replace(
    task, train=(x[rest], y[rest]), test=(x[val], y[val]), metric_name=metric_name
  )


def subset(task: Task, n_train: int, n_test: int, batch_size: int) -> Task:
  """A smaller copy of the task (smoke tests): the first examples of each split."""
  (x, y), (xt, yt) = task.train, task.test
  return dataclasses.replace(
    task,
    train=(x[:n_train], y[:n_train]),
    test=(xt[:n_test], yt[:n_test]),
    batch_size=batch_size,
  )


# Models.


class MNIST1DCNN(nn.Module):
  """Three 5-wide convolutions of 32 channels (SAME padding) and a dense head."""

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.relu(nn.Conv(32, (5,))(x))
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


class MLP(nn.Module):
  """Dense layers of the given widths with tanh, then a linear layer."""

  widths: tuple[int, ...]
  outputs: int

  @nn.compact
  def __call__(self, x):
    for w in self.widths:
      x = nn.tanh(nn.Dense(w)(x))
    return nn.Dense(self.outputs)(x)


class Autoencoder(nn.Module):
  """A deep autoencoder: encoder widths down to a linear code, mirrored back.

  ``widths=(1000, 500, 250, 30)`` and ``outputs=64`` give
  64-1000-500-250-30-250-500-1000-64; the code and output layers are linear.
  """

  widths: tuple[int, ...]
  outputs: int
  activation: Callable[[jax.Array], jax.Array] = nn.tanh

  @nn.compact
  def __call__(self, x):
    *hidden, code = self.widths
    for w in hidden:
      x = self.activation(nn.Dense(w)(x))
    x = nn.Dense(code)(x)
    for w in reversed(hidden):
      x = self.activation(nn.Dense(w)(x))
    return nn.Dense(self.outputs)(x)


class ResidualBlock(nn.Module):
  """Two 3-wide convolutions with BatchNorm and a skip (a 1-wide projection when needed)."""

  channels: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, train: bool):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    y = nn.Conv(self.channels, (3,), strides=self.strides, use_bias=False)(x)
    y = nn.relu(norm()(y))
    y = nn.Conv(self.channels, (3,), use_bias=False)(y)
    y = norm()(y)
    if self.strides != 1 or x.shape[-1] != self.channels:
      x = norm()(nn.Conv(self.channels, (1,), strides=self.strides, use_bias=False)(x))
    return nn.relu(x + y)


class ResNet1D(nn.Module):
  """A small 1-D ResNet: a 5-wide stem, residual stages, global average pooling, a dense head.

  Each stage after the first halves the length.
  """

  channels: tuple[int, ...]
  outputs: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(self.channels[0], (5,), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    for i, c in enumerate(self.channels):
      x = ResidualBlock(c, strides=1 if i == 0 else 2)(x, train)
    return nn.Dense(self.outputs)(x.mean(axis=1))


class TransformerBlock(nn.Module):
  """Pre-norm causal self-attention and a 4x-wide GELU MLP, each with a residual."""

  heads: int

  @nn.compact
  def __call__(self, h, _):
    mask = nn.make_causal_mask(h[..., 0])
    attention = nn.MultiHeadDotProductAttention(self.heads)
    h = h + attention(nn.LayerNorm()(h), mask=mask)
    mlp = nn.Dense(h.shape[-1])(nn.gelu(nn.Dense(4 * h.shape[-1])(nn.LayerNorm()(h))))
    return h + mlp, None


class CharTransformer(nn.Module):
  """A character language model: token and position embeddings, a scanned stack of
  `TransformerBlock`, a final LayerNorm and logits from the tied token embedding."""

  vocab: int
  length: int
  width: int = 48
  heads: int = 4
  depth: int = 2

  @nn.compact
  def __call__(self, ids):
    tokens = nn.Embed(self.vocab, self.width)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)
    h = tokens(ids) + nn.Embed(self.length, self.width)(positions)
    blocks = nn.scan(
      TransformerBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=self.depth,
    )
    h, _ = blocks(self.heads, name="blocks")(h, None)
    return tokens.attend(nn.LayerNorm()(h))


# Data and tasks.

CHARS = string.printable  # 100 characters; any other character is one extra id
# Plain modules of every Python from 3.10 on (about 0.5 MB of source).
SOURCES = (
  "argparse.py",
  "configparser.py",
  "dataclasses.py",
  "difflib.py",
  "functools.py",
  "optparse.py",
  "shlex.py",
  "statistics.py",
  "textwrap.py",
  "traceback.py",
)
HELD_OUT_EVERY = 10  # every 10th block of windows is held out
BLOCK = 16  # windows per block


def text_data(
  length: int = 32,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """Characters of some standard-library modules' source, as next-character windows.

  The concatenated text is cut into non-overlapping windows: inputs
  ``(n, length)`` of ids and targets the same windows shifted by one character.
  Consecutive windows are grouped in blocks of `BLOCK` (512 characters for
  ``length=32``) and every `HELD_OUT_EVERY`-th block is held out, so the
  held-out text comes from every module and never overlaps the training text.
  """
  lib = pathlib.Path(string.__file__).parent
  text = "".join((lib / name).read_text() for name in SOURCES)
  table = {c: i for i, c in enumerate(CHARS)}
  ids = np.asarray([table.get(c, len(CHARS)) for c in text], np.int32)
  n = (len(ids) - 1) // length
  take = (np.arange(n) * length)[:, None] + np.arange(length + 1)
  x, y = ids[take[:, :-1]], ids[take[:, 1:]]
  held = (np.arange(n) // BLOCK) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
  return (x[~held], y[~held]), (x[held], y[held])


@functools.cache
def mnist1d_data(
  num_samples: int = 5000,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """MNIST-1D (Greydanus 2020) generated offline (seed 42, 80/20 split), inputs ``(n, 40, 1)``.

  Cached: the mnist1d and resnet tasks share one generation per process.
  """
  from mnist1d.data import get_dataset_args, make_dataset

  args = get_dataset_args()
  args.num_samples = num_samples
  data = make_dataset(args)
  x, x_test = (data[k].astype(np.float32)[..., None] for k in ("x", "x_test"))
  y, y_test = (data[k].astype(np.int32) for k in ("y", "y_test"))
  return (x, y), (x_test, y_test)


def digits_data() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """scikit-learn's 8x8 digits scaled to [0, 1], shuffled (seed 0), 1437 train / 360 test."""
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  y = y.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  x, y = x[order], y[order]
  split = int(0.8 * len(x))
  return (x[:split], y[:split]), (x[split:], y[split:])


def mnist1d(num_samples: int = 5000) -> Task:
  """MNIST-1D with a 3-layer CNN: 4000 train / 1000 test sequences of 40; cross-entropy."""
  train, test = mnist1d_data(num_samples)
  return Task(
    "mnist1d",
    MNIST1DCNN(),
    train,
    test,
    cross_entropy,
    accuracy,
    "test accuracy",
    target=0.94,
    higher_is_better=True,
    batch_size=128,
    steps=3000,
    sweep_steps=1000,
  )


def digits() -> Task:
  """scikit-learn's digits, a small MLP (64-64 tanh); cross-entropy."""
  train, test = digits_data()
  return Task(
    "digits",
    MLP((64, 64), 10),
    train,
    test,
    cross_entropy,
    accuracy,
    "test accuracy",
    target=0.97,
    higher_is_better=True,
    batch_size=128,
    steps=500,
    sweep_steps=250,
  )


def autoencoder(widths: tuple[int, ...] = (1000, 500, 250, 30)) -> Task:
  """A deep tanh autoencoder (64-1000-500-250-30-...-64) on digits; MSE loss and metric."""
  (x, _), (x_test, _) = digits_data()
  return Task(
    "autoencoder",
    Autoencoder(widths, 64),
    (x, x),
    (x_test, x_test),
    mean_squared_error,
    mean_squared_error,
    "test reconstruction MSE",
    target=0.01,
    higher_is_better=False,
    batch_size=128,
    steps=500,
    sweep_steps=200,
    terms_per_example=64,
  )


def resnet(channels: tuple[int, ...] = (32, 64), num_samples: int = 5000) -> Task:
  """A small BatchNorm ResNet (Conv1D residual blocks) on MNIST-1D; cross-entropy."""
  train, test = mnist1d_data(num_samples)
  return Task(
    "resnet",
    ResNet1D(channels, 10),
    train,
    test,
    cross_entropy,
    accuracy,
    "test accuracy",
    target=0.97,
    higher_is_better=True,
    batch_size=128,
    steps=1000,
    sweep_steps=300,
    mutable=("batch_stats",),
  )


def charlm(length: int = 32, width: int = 48) -> Task:
  """A 2-block character transformer on standard-library source; per-character cross-entropy."""
  train, test = text_data(length)
  return Task(
    "charlm",
    CharTransformer(len(CHARS) + 1, length, width),
    train,
    test,
    cross_entropy,
    cross_entropy,
    "test loss (nats/char)",
    target=1.85,  # about where the best baseline's sweep trial ended (AdamW, 1.847)
    higher_is_better=False,
    batch_size=128,
    steps=600,
    sweep_steps=300,
    terms_per_example=length,
  )


TASKS: dict[str, Callable[[], Task]] = {
  "mnist1d": mnist1d,
  "digits": digits,
  "autoencoder": autoencoder,
  "resnet": resnet,
  "charlm": charlm,
}
