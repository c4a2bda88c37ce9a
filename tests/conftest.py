"""Shared helpers: one K-FAC update of a loss, in float64 where asked."""

from __future__ import annotations

import os
import sys

# Tests run tiny programs: XLA's backend optimisations cost far more compile
# time than they save. Eight CPU devices emulate a data-parallel machine; single
# device code runs on the first. Set before JAX initialises its backend.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"
).strip()

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import jax

import kaisa_jax

EXACT = dict(
  factor_decay=0.0,
  factor_update_steps=1,
  inv_update_steps=1,
  kl_clip=None,
  max_cost_ratio=None,
)


def one_update(loss_fn, params, *args, **kfac_kwargs):
  """Returns ``(grads, curvature, tx, state, updates)`` after one K-FAC update."""
  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  layers = grad_fn.layers(params, *args)
  tx = kaisa_jax.kfac(layers, **{**EXACT, **kfac_kwargs})
  state = jax.jit(tx.init)(params)
  _, grads, curvature = jax.jit(grad_fn)(params, *args)
  updates, state = jax.jit(tx.update)(grads, state, params, curvature=curvature)
  return grads, curvature, tx, state, updates


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield
