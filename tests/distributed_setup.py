"""Models, data and train loops shared by the distributed tests and the multi-process worker.

``run`` trains the same model on the same global batches on one device, under
``jax.shard_map`` over a mesh, or under ``jax.pmap``, and returns the first
update and the final parameters as numpy arrays.
"""

from __future__ import annotations

from fractions import Fraction

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kaisa_jax
from kaisa_jax import GRAD_WORKERS, RECEIVERS

BATCH = 16
BATCH_SPEC = P((RECEIVERS, GRAD_WORKERS))
KFAC = dict(factor_update_steps=1, inv_update_steps=3, max_cost_ratio=None)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for width in (24, 16, 12):
      x = nn.tanh(nn.Dense(width)(x))
    return nn.Dense(5)(x)


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(6, (3, 3), strides=2)(x))
    x = nn.relu(nn.Conv(8, (3, 3), feature_group_count=2)(x))
    x = nn.relu(nn.Dense(12)(x.reshape(x.shape[0], -1)))
    return nn.Dense(5)(x)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.tanh(nn.Dense(16)(x)), None


class ScannedMLP(nn.Module):
  """A stack of 3 dense blocks under nn.scan of nn.remat: one set of factors per block."""

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(16)(x.reshape(x.shape[0], -1)))
    stack = nn.scan(
      nn.remat(_Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
    x, _ = stack()(x, None)
    return nn.Dense(5)(x)


class Deep(nn.Module):
  """12 layers of several shapes (4 convolutions, 8 dense): their order on the devices
  differs from one grad worker fraction to another."""

  @nn.compact
  def __call__(self, x):
    for features, strides in ((4, 1), (6, 2), (8, 1), (8, 2)):
      x = nn.relu(nn.Conv(features, (3, 3), strides=strides)(x))
    x = x.reshape(x.shape[0], -1)
    for width in (32, 24, 16, 16, 12, 12, 8):
      x = nn.tanh(nn.Dense(width)(x))
    return nn.Dense(5)(x)


class Tower(nn.Module):
  """Six equal hidden layers, one stack: on several devices each owns some of its members."""

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(16)(x.reshape(x.shape[0], -1)))
    for _ in range(6):
      x = nn.tanh(nn.Dense(16)(x))
    return nn.Dense(5)(x)


MODELS = {"mlp": MLP(), "cnn": CNN(), "scanned": ScannedMLP(), "deep": Deep(), "tower": Tower()}


def batches(steps: int) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(0)
  x = rng.normal(size=(steps, BATCH, 8, 8, 2)).astype(np.float32)
  y = rng.integers(0, 5, size=(steps, BATCH)).astype(np.int32)
  return x, y


def initial_params(model_name: str):
  return MODELS[model_name].init(jax.random.key(2), batches(1)[0][0])


def fraction(text: str) -> float:
  return float(Fraction(text))


def _global(array, sharding):
  array = np.asarray(array)
  return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _local(tree):
  """A replicated global tree as numpy, read from this process's first shard."""
  return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), tree)


def replicate(tree, devices, axis_name: str):
  """One copy of ``tree`` per device along a new leading axis, placed as ``jax.pmap`` places
  its outputs (over a mesh of ``devices`` with the mapped axis's name): the step's second call
  then finds the program its first compiled."""
  placed = NamedSharding(jax.sharding.Mesh(np.array(devices), (axis_name,)), P(axis_name))
  return jax.device_put(jax.tree.map(lambda a: jnp.stack([a] * len(devices)), tree), placed)


def build(
  model_name: str,
  mode: str,
  n: int,
  grad_worker_fraction: str,
  steps: int,
  chained: bool,
  step_rule: tuple[tuple[str, object], ...] = (),
):
  """The jitted step, its initial ``(params, state)``, the per-step inputs and the K-FAC transform.

  ``chained`` trains K-FAC chained with SGD momentum; otherwise the update is
  K-FAC's preconditioned gradient alone. ``step_rule``: `kaisa_jax.kfac`'s
  arguments besides `KFAC` (``step_norm``, ``kl_clip``, ``lr``), as pairs.
  """
  config = KFAC | dict(step_rule)
  model = MODELS[model_name]
  xs, ys = batches(steps)
  params = initial_params(model_name)

  def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  local = BATCH // n
  layers = grad_fn.layers(params, xs[0][:local], ys[0][:local])
  devices = jax.devices()[:n]
  if mode == "single":
    kfac = kaisa_jax.kfac(layers, **config)
  elif mode == "shard_map":
    mesh = kaisa_jax.make_mesh(fraction(grad_worker_fraction), devices)
    kfac = kaisa_jax.kfac(layers, mesh=mesh, **config)
  else:
    kfac = kaisa_jax.kfac(
      layers,
      axis_name="batch",
      axis_size=n,
      grad_worker_fraction=fraction(grad_worker_fraction),
      **config,
    )
  tx = optax.chain(kfac, optax.sgd(0.1, momentum=0.9)) if chained else kfac

  def step(params, state, x, y, mean_grads):
    _, grads, curvature = grad_fn(params, x, y)
    grads = mean_grads(grads)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state, updates

  if mode == "single":
    state = tx.init(params)
    fn = jax.jit(lambda p, s, x, y: step(p, s, x, y, lambda g: g))
    inputs = list(zip(xs, ys))
  elif mode == "shard_map":
    # Under shard_map, JAX sums the gradient of the replicated params over the
    # mesh: divide by the device count for the mean.
    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(lambda a: _global(a, replicated), params)
    state = tx.init(params)
    specs = kaisa_jax.partition_specs(state)

    def mean(g):
      return jax.tree.map(lambda t: t / n, g)

    fn = jax.jit(
      jax.shard_map(
        lambda p, s, x, y: step(p, s, x, y, mean),
        mesh=mesh,
        in_specs=(P(), specs, BATCH_SPEC, BATCH_SPEC),
        out_specs=(P(), specs, P()),
      )
    )
    sharded = NamedSharding(mesh, BATCH_SPEC)
    inputs = [(_global(x, sharded), _global(y, sharded)) for x, y in zip(xs, ys)]
  else:
    params, state = replicate((params, tx.init(params)), devices, "batch")
    fn = jax.pmap(
      lambda p, s, x, y: step(p, s, x, y, lambda g: jax.lax.pmean(g, "batch")),
      axis_name="batch",
      devices=devices,
    )
    inputs = [(x.reshape(n, local, *x.shape[1:]), y.reshape(n, local)) for x, y in zip(xs, ys)]
  return fn, (params, state), inputs, kfac


def run(
  model_name: str,
  mode: str,
  n: int,
  grad_worker_fraction: str,
  steps: int,
  chained: bool,
  step_rule: tuple[tuple[str, object], ...] = (),
):
  """Trains ``steps`` steps; returns ``(first update, final params, kfac)`` (see `build`)."""
  fn, (params, state), inputs, kfac = build(
    model_name, mode, n, grad_worker_fraction, steps, chained, step_rule
  )
  first = None
  for x, y in inputs:
    params, state, updates = jax.block_until_ready(fn(params, state, x, y))
    first = updates if first is None else first
  if mode == "pmap":
    first, params = jax.tree.map(lambda a: np.asarray(a[0]), (first, params))
  elif mode == "shard_map":
    first, params = _local((first, params))
  else:
    first, params = jax.tree.map(np.asarray, (first, params))
  return first, params, kfac


def relative_error(tree, reference) -> float:
  """``|tree - reference| / |reference|`` over all leaves together."""
  num = sum(
    float(np.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference))
  )
  den = sum(float(np.sum(b**2)) for b in jax.tree.leaves(reference))
  return (num / den) ** 0.5
