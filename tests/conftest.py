"""Shared helpers: one K-FAC update of a loss, in float64 where asked; a stack of equal layers."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

# Tests run tiny programs: XLA's backend optimisations cost far more compile
# time than they save. Eight CPU devices emulate a data-parallel machine; single
# device code runs on the first. Set before JAX initialises its backend.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"
).strip()

# Many tests compile a program that another has compiled (a step built again as after a restart,
# a study's runs trained again, the same reference in each worker). One compilation cache on disk
# for the session, made by the first process that loads this file and inherited by the xdist
# workers and the subprocesses, compiles each once; it starts empty and is removed at the end.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="kaisa-jax-tests-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import flax.linen as nn
import jax
import jax.numpy as jnp

import kaisa_jax

# Damping as the KAISA reference adds it, (A (x) G + damping I): the form the dense
# solves of `references.kronecker_solve` check (tests/test_damping.py checks the others).
EXACT = dict(
  damping_form="kaisa",
  factor_decay=0.0,
  factor_update_steps=1,
  inv_update_steps=1,
  step_norm="natural",
  max_cost_ratio=None,
)


# Programs compile at XLA's backend optimisation level 0 (above): right for the tests' tiny
# programs, but a program that trains a convolutional model for tens of steps runs about 10x
# slower for it (the suite's ResNet with BatchNorm: 40 steps in 23 s against 2.4 s). Such a test
# compiles its program at this level instead (`compiled_optimised`).
OPTIMISED = {"xla_backend_optimization_level": 1}


def compiled_optimised(fn, *args):
  """The jitted ``fn`` compiled for ``args`` at `OPTIMISED`: a program that runs for long."""
  return fn.lower(*args).compile(OPTIMISED)


def one_update(loss_fn, params, *args, **kfac_kwargs):
  """Returns ``(grads, curvature, tx, state, updates)`` after one K-FAC update."""
  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  layers = grad_fn.layers(params, *args)
  tx = kaisa_jax.kfac(layers, **{**EXACT, **kfac_kwargs})
  state = jax.jit(tx.init)(params)
  _, grads, curvature = jax.jit(grad_fn)(params, *args)
  updates, state = jax.jit(tx.update)(grads, state, params, curvature=curvature)
  return grads, curvature, tx, state, updates


class DenseStack(nn.Module):
  """``depth`` equal ``Dense(8)`` layers with tanh: one stack of equal layers."""

  depth: int = 16

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.tanh(nn.Dense(8)(x))
    return x


def dense_stack(depth: int = 16):
  """Returns ``(kfac, params, grad_fn, x)`` for a `DenseStack` (no KL clip: no sum over layers)."""
  model = DenseStack(depth)
  x = jax.random.normal(jax.random.key(3), (4, 8))
  params = model.init(jax.random.key(0), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
  return kaisa_jax.kfac(grad_fn.layers(params, x), step_norm="natural"), params, grad_fn, x


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield
