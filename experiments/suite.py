"""The robustness suite: models K-FAC was not tuned on, as a new user would write them.

Each `Problem` is a model, its training data and its loss, trained from a
seed. Five are small models on scikit-learn's digits (8x8 images) in the
shapes users bring: a ViT (convolutional patches, a CLS token, attention,
LayerNorm and dropout), a GRU and an LSTM under ``nn.RNN`` (the rows as time
steps), a 2-D ResNet with eleven BatchNorms, and a Flax NNX MLP. Three are the
experiments' tasks (`experiments.tasks`): the MNIST-1D CNN, the deep
autoencoder and the character transformer.

``benchmarks/robustness.py`` trains every problem with K-FAC at every damping
and damping form, and with its first-order optimizer alone.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import kaisa_jax
from experiments import tasks

Loss = Callable[[Any, Any, jax.Array, jax.Array], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class Problem:
  """A model with its data and loss.

  Attributes:
    name: the problem's name.
    init: ``key -> (params, state)``; ``state`` is what the loss carries from
      step to step besides the parameters (BatchNorm statistics, a dropout key).
    loss: ``(params, state, x, y) -> (loss, state)``, a mean over the batch.
    train: ``(x, y)`` training arrays.
    batch_size: examples per step.
    optimizer: the first-order optimizer users train it with, ``"sgd"``
      (momentum 0.9) or ``"adamw"``.
    n_examples: `kaisa_jax.value_and_grad`'s ``n_examples`` (``None``: the batch).
  """

  name: str
  init: Callable[[jax.Array], tuple[Any, Any]]
  loss: Loss
  train: tuple[np.ndarray, np.ndarray]
  batch_size: int = 128
  optimizer: str = "sgd"
  n_examples: int | None = None


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return tasks.cross_entropy(logits, labels)


class ViT(nn.Module):
  """A small vision transformer: 2x2 convolutional patches, a CLS token, pre-norm blocks."""

  width: int = 32
  heads: int = 4
  depth: int = 2
  dropout: float = 0.1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    patches = nn.Conv(self.width, (2, 2), strides=(2, 2))(x)
    h = patches.reshape(x.shape[0], -1, self.width)
    cls = self.param("cls", nn.initializers.zeros, (1, 1, self.width))
    h = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, self.width)), h], axis=1)
    h = h + self.param("position", nn.initializers.normal(0.02), h.shape[1:])
    for _ in range(self.depth):
      y = nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(h))
      h = h + nn.Dropout(self.dropout, deterministic=not train)(y)
      y = nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(h))))
      h = h + nn.Dropout(self.dropout, deterministic=not train)(y)
    return nn.Dense(10)(nn.LayerNorm()(h[:, 0]))


class Recurrent(nn.Module):
  """A recurrent cell over the image rows (8 time steps), a dense head on the last output."""

  cell: Callable[[], nn.RNNCellBase]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(10)(nn.RNN(self.cell())(x)[:, -1])


class Block2D(nn.Module):
  """Two 3x3 convolutions with BatchNorm and a skip (a 1x1 projection when needed)."""

  channels: int
  strides: int = 1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)  # noqa: E731
    s = (self.strides, self.strides)
    y = nn.relu(norm()(nn.Conv(self.channels, (3, 3), strides=s, use_bias=False)(x)))
    y = norm()(nn.Conv(self.channels, (3, 3), use_bias=False)(y))
    if self.strides != 1 or x.shape[-1] != self.channels:
      x = norm()(nn.Conv(self.channels, (1, 1), strides=s, use_bias=False)(x))
    return nn.relu(x + y)


class ResNet2D(nn.Module):
  """A 3x3 stem and four residual blocks (8, 16/2, 32/2, 32 channels): eleven BatchNorms."""

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    x = nn.Conv(8, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    for channels, strides in ((8, 1), (16, 2), (32, 2), (32, 1)):
      x = Block2D(channels, strides)(x, train)
    return nn.Dense(10)(x.mean(axis=(1, 2)))


class NNXMLP(nnx.Module):
  """A Flax NNX MLP, 64-64-64-10 with ReLU."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, 64, rngs=rngs)
    self.middle = nnx.Linear(64, 64, rngs=rngs)
    self.out = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(nnx.relu(self.middle(nnx.relu(self.hidden(x)))))


def _images() -> tuple[np.ndarray, np.ndarray]:
  (x, y), _ = tasks.digits_data()
  return x.reshape(-1, 8, 8, 1), y


def vit() -> Problem:
  model = ViT()
  x, y = _images()

  def init(key):
    params = model.init(key, jnp.asarray(x[:1]), train=False)["params"]
    return params, jax.random.fold_in(key, 1)

  def loss(params, key, xb, yb):
    step_key, key = jax.random.split(key)
    logits = model.apply({"params": params}, xb, train=True, rngs={"dropout": step_key})
    return cross_entropy(logits, yb), key

  return Problem("vit", init, loss, (x, y), optimizer="adamw")


def recurrent(name: str, cell: Callable[[], nn.RNNCellBase]) -> Problem:
  model = Recurrent(cell)
  x, y = _images()
  x = x[..., 0]

  def init(key):
    return model.init(key, jnp.asarray(x[:1]))["params"], {}

  def loss(params, state, xb, yb):
    return cross_entropy(model.apply({"params": params}, xb), yb), state

  return Problem(name, init, loss, (x, y))


def resnet_bn() -> Problem:
  model = ResNet2D()
  x, y = _images()

  def init(key):
    variables = model.init(key, jnp.asarray(x[:1]), train=False)
    return variables["params"], variables["batch_stats"]

  def loss(params, stats, xb, yb):
    logits, updates = model.apply(
      {"params": params, "batch_stats": stats}, xb, train=True, mutable=["batch_stats"]
    )
    return cross_entropy(logits, yb), updates["batch_stats"]

  return Problem("resnet_bn", init, loss, (x, y))


def nnx_mlp() -> Problem:
  (x, y), _ = tasks.digits_data()
  graphdef, _ = nnx.split(NNXMLP(nnx.Rngs(0)), nnx.Param)

  def init(key):
    _, params = nnx.split(NNXMLP(nnx.Rngs(params=key)), nnx.Param)
    return params, {}

  def loss(params, state, xb, yb):
    return cross_entropy(nnx.merge(graphdef, params)(xb), yb), state

  return Problem("nnx_mlp", init, loss, (x, y))


def from_task(task: tasks.Task, optimizer: str = "sgd") -> Problem:
  """One of the experiments' tasks as a `Problem`."""

  def init(key):
    return task.init(key, jnp.asarray(task.train[0][:1]))

  return Problem(
    task.name,
    init,
    task.loss,
    task.train,
    task.batch_size,
    optimizer,
    task.n_examples(),
  )


# Training.

TAIL = 20  # the final loss is the mean loss of this many last steps
WEIGHT_DECAY = 1e-4


def first_order(name: str, lr: jax.Array) -> optax.GradientTransformation:
  """SGD with momentum 0.9 (``"sgd"``) or AdamW (``"adamw"``) at a constant rate."""
  if name == "sgd":
    return optax.sgd(lr, momentum=0.9)
  return optax.adamw(lr, weight_decay=WEIGHT_DECAY)


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
  """``(steps, batch_size)`` example indices: shuffled epochs, the last partial batch dropped."""
  rng = np.random.default_rng(seed)
  per_epoch = n // batch_size
  epochs = -(-steps // per_epoch)
  rows = [
    rng.permutation(n)[: per_epoch * batch_size].reshape(per_epoch, -1) for _ in range(epochs)
  ]
  return np.concatenate(rows)[:steps]


def make_run(problem: Problem, kfac: dict[str, Any] | None):
  """``run(params, state, order, lr, damping=None) -> (losses, curvature)``: one run, jitted.

  ``order`` is ``(steps, batch_size)`` example indices (`batch_order`); the
  run is one `jax.lax.scan` over them, so its learning rate, damping and
  initialisation change without compiling again. With ``kfac`` (arguments of
  `kaisa_jax.kfac` besides ``layers``, ``lr`` and ``damping``; ``{}`` for the
  defaults) K-FAC is chained before the problem's first-order optimizer, with
  ``damping`` if given (and ``lr``, if ``kfac`` sets a KL clip); ``kfac=None``
  trains with that optimizer alone.
  Returns the loss of every step and, for K-FAC, its curvature statistics
  after the last step (`kaisa_jax.curvature_statistics`; ``None`` without K-FAC).
  """
  x, y = (jnp.asarray(a) for a in problem.train)
  grad_fn = kaisa_jax.value_and_grad(problem.loss, has_aux=True, n_examples=problem.n_examples)
  layers = None
  if kfac is not None:
    params, state = problem.init(jax.random.key(0))
    b = problem.batch_size
    layers = grad_fn.layers(params, state, x[:b], y[:b])

  @jax.jit
  def run(params, state, order, lr, damping=None):
    tx = first_order(problem.optimizer, lr)
    if layers is not None:
      args = {**kfac} | ({} if damping is None else {"damping": damping})
      if kfac.get("kl_clip") is not None:
        args["lr"] = lr  # read only by the KL clip
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modules passed through are listed by print(layers)
        preconditioner = kaisa_jax.kfac(layers, **args)
      tx = optax.chain(preconditioner, tx)
    opt_state = tx.init(params)

    def step(carry, idx):
      params, state, opt_state = carry
      xb, yb = x[idx], y[idx]
      if layers is None:
        (loss, state), grads = jax.value_and_grad(problem.loss, has_aux=True)(params, state, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)
      else:
        (loss, state), grads, curvature = grad_fn(params, state, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params, curvature=curvature)
      return (optax.apply_updates(params, updates), state, opt_state), loss

    (_, _, opt_state), losses = jax.lax.scan(step, (params, state, opt_state), order)
    if layers is None:
      return losses, None
    return losses, kaisa_jax.curvature_statistics(preconditioner, opt_state)

  return run


def final_loss(losses: np.ndarray) -> float:
  """The mean of the last `TAIL` losses; infinite if any loss was not finite."""
  if not np.all(np.isfinite(losses)):
    return math.inf
  return float(np.mean(losses[-TAIL:]))


SUITE: dict[str, Callable[[], Problem]] = {
  "vit": vit,
  "gru": lambda: recurrent("gru", lambda: nn.GRUCell(32)),
  "lstm": lambda: recurrent("lstm", lambda: nn.LSTMCell(32)),
  "resnet_bn": resnet_bn,
  "nnx_mlp": nnx_mlp,
  "mnist1d": lambda: from_task(tasks.mnist1d()),
  "autoencoder": lambda: from_task(tasks.autoencoder()),
  "charlm": lambda: from_task(tasks.charlm(), optimizer="adamw"),
}
