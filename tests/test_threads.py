"""Capture from several threads at once, and the transformations it wraps outside capture.

Each pair of models is traced from two threads that meet at a barrier inside
``model.apply`` (so both are inside capture at the same time, each with its
layers half called). Each thread must list its own model's layers, and only
those, and give the curvature that the same model gives traced alone.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import ad_checkpoint, api
from jax._src.lax.control_flow import loops

import kaisa_jax

REPEATS = 3
_sync = threading.local()  # the barrier a thread's models wait at (none in the main thread)


def _meet() -> None:
  """Waits for the other thread (``_sync.waits`` times) when this one was given a barrier."""
  barrier = getattr(_sync, "barrier", None)
  for _ in range(getattr(_sync, "waits", 1) if barrier is not None else 0):
    barrier.wait()


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    return jnp.tanh(nn.Dense(4)(x)), None


class ScannedCNN(nn.Module):
  """A convolution, a scanned stack of rematerialised blocks, a Dense head."""

  @nn.compact
  def __call__(self, x):  # x: (batch, length, channels)
    x = nn.relu(nn.Conv(4, (3,))(x)).mean(axis=1)
    _meet()
    stack = nn.scan(
      nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
    x, _ = stack(name="stack")(x, None)
    return nn.Dense(3)(x)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):  # x: (batch, length, channels)
    x = nn.tanh(nn.Dense(5)(x.reshape(x.shape[0], -1)))
    _meet()
    return nn.Dense(3)(nn.tanh(nn.Dense(5)(x)))


class Ensemble(nn.Module):
  """Members with their own params (``nn.vmap``) and a head shared over positions."""

  @nn.compact
  def __call__(self, x):  # x: (batch, length, channels)
    members = nn.vmap(
      nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None, axis_size=2
    )(4, name="members")
    h = jnp.tanh(members(x)).mean(axis=0)
    _meet()
    shared = nn.vmap(
      nn.Dense,
      variable_axes={"params": None},
      split_rngs={"params": False},
      in_axes=1,
      out_axes=1,
    )(3, name="shared")
    return shared(h).mean(axis=1)


class NnxMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(12, 6, rngs=rngs)
    self.out = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    h = nnx.tanh(self.hidden(x.reshape(x.shape[0], -1)))
    _meet()
    return self.out(h)


X = jax.random.normal(jax.random.key(0), (4, 4, 3))
Y = jnp.array([0, 1, 2, 1])


def _xent(logits):
  return jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(Y)), Y])


def _linen(model: nn.Module):
  """``(loss, params)`` of a linen model."""
  params = model.init(jax.random.key(1), X)["params"]
  return lambda p, x: _xent(model.apply({"params": p}, x)), params


def _nnx(model: nnx.Module):
  """``(loss, params)`` of an NNX model, rebuilt from its params inside the loss."""
  graphdef, params = nnx.split(model, nnx.Param)
  return lambda p, x: _xent(nnx.merge(graphdef, p)(x)), params


MODELS = {
  "scanned_cnn": lambda: _linen(ScannedCNN()),
  "mlp": lambda: _linen(MLP()),
  "ensemble": lambda: _linen(Ensemble()),
  "nnx_mlp": lambda: _nnx(NnxMLP(nnx.Rngs(2))),
}


def _capture(name: str, barrier: threading.Barrier | None = None, waits: int = 1):
  """The layers, then ``(value, grads, curvature)``, of a model's loss, traced afresh.

  With a ``barrier``, the model waits at it ``waits`` times in each trace.
  """
  loss, params = MODELS[name]()  # init calls the model too: before the barrier
  _sync.barrier, _sync.waits = barrier, waits
  try:
    grad_fn = kaisa_jax.value_and_grad(loss)
    layers = grad_fn.layers(params, X)  # one trace: layers() ...
    return layers, jax.jit(grad_fn)(params, X)  # ... and one under jax.jit
  except BaseException:
    if barrier is not None:
      barrier.abort()  # do not leave the other thread waiting
    raise
  finally:
    _sync.barrier = None


@functools.cache
def _alone(name: str):
  return _capture(name)


def _assert_same(got, want) -> None:
  (got_layers, got_result), (want_layers, want_result) = got, want
  assert got_layers == want_layers
  assert str(got_layers) == str(want_layers)
  assert jax.tree.structure(got_result) == jax.tree.structure(want_result)
  for a, b in zip(jax.tree.leaves(got_result), jax.tree.leaves(want_result), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("names", [("mlp", "scanned_cnn"), ("nnx_mlp", "ensemble")])
def test_two_threads_capture_their_own_models(names):
  want = {name: _alone(name) for name in names}
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    for _ in range(REPEATS):
      barrier = threading.Barrier(2, timeout=30)
      futures = {name: pool.submit(_capture, name, barrier) for name in names}
      for name, future in futures.items():
        _assert_same(future.result(), want[name])


def _transformed(x):
  """Uses each wrapped transformation once."""
  y = jax.vmap(jnp.sin)(x)
  y = jax.checkpoint(jnp.cos)(y)
  y = jax.remat(jnp.tanh)(y)
  return jax.lax.scan(lambda c, v: (c + v, c * v), 0.0, y)


def _originals(x):
  y = api.vmap(jnp.sin)(x)
  y = ad_checkpoint.checkpoint(jnp.cos)(y)
  y = ad_checkpoint.remat(jnp.tanh)(y)
  return loops.scan(lambda c, v: (c + v, c * v), 0.0, y)


def test_transformations_outside_capture_are_the_originals():
  _alone("scanned_cnn")  # capture has run in this process
  x = jnp.arange(3.0)
  assert str(jax.make_jaxpr(_transformed)(x)) == str(jax.make_jaxpr(_originals)(x))
  for public, original in [
    (jax.lax.scan, loops.scan),
    (jax.vmap, api.vmap),
    (jax.checkpoint, ad_checkpoint.checkpoint),
    (jax.remat, ad_checkpoint.remat),
  ]:
    assert public.__name__ == original.__name__
    assert public.__doc__ == original.__doc__
    assert inspect.signature(public) == inspect.signature(original)
  assert type(jax.vmap(jnp.sin)) is type(api.vmap(jnp.sin))


def test_a_thread_outside_capture_sees_the_originals_while_another_captures():
  barrier = threading.Barrier(2, timeout=30)
  x = jnp.arange(3.0)

  def plain():  # runs while the other thread waits inside its loss, in each of its traces
    jaxprs = []
    try:
      for _ in range(2):
        barrier.wait()
        jaxprs.append(str(jax.make_jaxpr(_transformed)(x)))
        barrier.wait()
    except BaseException:
      barrier.abort()
      raise
    return jaxprs

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    plain_jaxprs = pool.submit(plain)
    captured = pool.submit(_capture, "scanned_cnn", barrier, 2)
    assert plain_jaxprs.result() == [str(jax.make_jaxpr(_originals)(x))] * 2
    _assert_same(captured.result(), _alone("scanned_cnn"))
