"""Which step each per-step quantity belongs to, checked against numpy re-computations.

* a skipped (non-finite) factor update leaves the running average's total
  ``W`` where it was, so the next finite batch counts as a first update;
* the KL clip reads the ``lr`` schedule, and the running average the
  ``factor_decay`` schedule, at the current step;
* on several devices, one device's non-finite share skips the factor update
  on every device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references as ref
from distributed_setup import build

import kaisa_jax

LAYERS = ("Dense_0", "Dense_1")


class MLP(nn.Module):
  """Two dense layers with a tanh between them."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(3)(nn.tanh(nn.Dense(6)(x)))


MODEL = MLP()


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  """The mean over examples of the squared error summed over outputs."""
  return jnp.mean(jnp.sum((MODEL.apply(params, x) - y) ** 2, axis=-1))


def batches(count: int) -> list[tuple[jax.Array, jax.Array]]:
  """``count`` different float64 batches of 10 examples (call under ``jax.enable_x64``)."""
  rng = np.random.default_rng(11)
  return [
    (jnp.asarray(rng.normal(size=(10, 4))), jnp.asarray(rng.normal(size=(10, 3))))
    for _ in range(count)
  ]


def setup(x: jax.Array, y: jax.Array, **kwargs: Any) -> tuple[Any, Any, kaisa_jax.KFAC]:
  """``(params, grad_fn, kfac)`` in float64: decompositions every step, no cost rule."""
  params = jax.tree.map(lambda p: p.astype(jnp.float64), MODEL.init(jax.random.key(0), x))
  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  config = dict(
    factor_update_steps=1,
    inv_update_steps=1,
    max_cost_ratio=None,
    step_norm="natural",
    factor_dtype=jnp.float64,
  )
  return params, grad_fn, kaisa_jax.kfac(grad_fn.layers(params, x, y), **(config | kwargs))


def reference_factors(
  curvature: dict[str, kaisa_jax.LayerCurvature],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Each dense layer's batch factors ``(A, G)`` by numpy from its captured rows."""
  out = {}
  for name in LAYERS:
    entry = curvature[name]
    a = ref.input_factor(ref.dense_rows(np.asarray(entry.a[0]), bias=True))
    g_rows = np.asarray(entry.g[0], np.float64).reshape(-1, entry.g[0].shape[-1])
    out[name] = (a, ref.output_factor(g_rows, float(entry.n[0])))
  return out


def bias_corrected(
  batch_factors: Sequence[dict[str, tuple[np.ndarray, np.ndarray]]], decays: Sequence[float]
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float]:
  """The running average of ``batch_factors`` with decay ``decays[i]`` at update ``i``, and ``W``.

  ``W <- d W + (1 - d)``, ``F <- F + (1 - d) / W (F_batch - F)``, from ``W = 0``
  and ``F = 0`` (docs/math.md, "Running averages").
  """
  total = 0.0
  average = {name: (0.0, 0.0) for name in LAYERS}
  for factors, d in zip(batch_factors, decays, strict=True):
    total = d * total + (1.0 - d)
    w = (1.0 - d) / total
    average = {
      name: tuple(old + w * (new - old) for old, new in zip(average[name], factors[name]))
      for name in LAYERS
    }
  return average, total


def assert_factors(
  kfac: kaisa_jax.KFAC,
  state: kaisa_jax.KFACState,
  expected: dict[str, tuple[np.ndarray, np.ndarray]],
  step: int,
) -> None:
  """The state's running averages of both factors of both layers match ``expected``.

  The decay and the total ``W`` are float32 scalars whatever the factors'
  dtype, so the float64 averages agree to about 1e-7 of a factor's largest
  entry (measured 7e-8); the bugs these tests catch are off by 1e-2 or more.
  """
  got = kaisa_jax.layer_factors(kfac.plan, state)
  for name in LAYERS:
    for side, want in zip(got[name], expected[name], strict=True):
      scale = np.abs(want).max()
      message = f"{name} after step {step}"
      np.testing.assert_allclose(side, want, rtol=1e-6, atol=1e-6 * scale, err_msg=message)


def test_skipped_factor_update_leaves_the_average_total_unchanged(x64: None) -> None:
  """A NaN batch at the first and at the fourth factor update: both are skipped.

  The first finite batch then gives its own factors (weight ``(1 - d) / (1 - d)
  = 1``, where a total advanced by the skip would give ``(1 - d) / (d (1 - d) +
  1 - d) = 1 / (1 + d)``, 0.51 at ``d = 0.95``), and every later update follows
  the bias-corrected average over the finite batches alone.
  """
  decay = 0.95
  clean = batches(6)
  nan_steps = (0, 3)
  data = [
    (x.at[3, 2].set(jnp.nan), y) if k in nan_steps else (x, y) for k, (x, y) in enumerate(clean)
  ]
  params, grad_fn, kfac = setup(*clean[0], factor_decay=decay)
  update = jax.jit(kfac.update)
  state = kfac.init(params)
  finite_factors, totals = [], []
  for k, (x, y) in enumerate(data):
    _, grads, curvature = grad_fn(params, x, y)
    before = state
    _, state = update(grads, state, params, curvature=curvature)
    skipped = sum(j <= k for j in nan_steps)
    assert int(state.skipped_factor_updates) == skipped, k
    if k in nan_steps:
      np.testing.assert_array_equal(state.factors, before.factors)
      continue
    finite_factors.append(reference_factors(curvature))
    if len(finite_factors) == 1:  # the first finite batch: its own factors, weight 1
      assert_factors(kfac, state, finite_factors[0], k)
    expected, total = bias_corrected(finite_factors, [decay] * len(finite_factors))
    assert_factors(kfac, state, expected, k)
    totals.append((float(state.factor_total), total))
  np.testing.assert_allclose(*zip(*totals), rtol=1e-6)  # W counts the finite updates only


def test_kl_clip_reads_the_lr_schedule_at_the_current_step(x64: None) -> None:
  """``nu_k = min(1, sqrt(kl_clip / |lr(k)^2 sum <P, V>|))`` at each step ``k``.

  ``lr`` halves every step, so reading it one step early or late changes ``nu``
  by a factor of 2. ``P`` comes from the same transformation without the clip,
  fed the same batches: the clip does not change the factors.
  """
  kl_clip = 1e-6
  lr = optax.exponential_decay(1.0, transition_steps=1, decay_rate=0.5)
  data = batches(5)
  params, grad_fn, clipped = setup(*data[0], kl_clip=kl_clip, lr=lr)
  _, _, plain = setup(*data[0])
  clipped_update, plain_update = jax.jit(clipped.update), jax.jit(plain.update)
  clipped_state, plain_state = clipped.init(params), plain.init(params)
  for k, (x, y) in enumerate(data):
    _, grads, curvature = grad_fn(params, x, y)
    p, plain_state = plain_update(grads, plain_state, params, curvature=curvature)
    c, clipped_state = clipped_update(grads, clipped_state, params, curvature=curvature)
    vg = sum(
      np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64))
      for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(grads), strict=True)
    )
    lr_k = float(lr(k))
    assert lr_k == 0.5**k
    nu = min(1.0, np.sqrt(kl_clip / abs(lr_k**2 * vg)))
    assert nu < 0.5, (k, nu)  # the clip is active, and lr(k +- 1) gives another nu
    for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(p), strict=True):
      np.testing.assert_allclose(a, nu * np.asarray(b), rtol=1e-9, atol=1e-15, err_msg=f"step {k}")
    np.testing.assert_allclose(float(clipped_state.kl_scale), nu, rtol=1e-9, err_msg=f"step {k}")


def test_factor_decay_schedule_is_read_at_the_current_step(x64: None) -> None:
  """A decay that grows by 0.1 every step: the averages follow ``decay(k)`` at update ``k``."""
  schedule = optax.linear_schedule(0.3, 0.8, transition_steps=5)
  data = batches(5)
  params, grad_fn, kfac = setup(*data[0], factor_decay=schedule)
  update = jax.jit(kfac.update)
  state = kfac.init(params)
  batch_factors, decays, totals = [], [], []
  for k, (x, y) in enumerate(data):
    _, grads, curvature = grad_fn(params, x, y)
    _, state = update(grads, state, params, curvature=curvature)
    batch_factors.append(reference_factors(curvature))
    decays.append(float(schedule(k)))
    expected, total = bias_corrected(batch_factors, decays)
    assert_factors(kfac, state, expected, k)
    totals.append((float(state.factor_total), total))
  np.testing.assert_allclose(*zip(*totals), rtol=1e-6)
  np.testing.assert_allclose(decays, [0.3, 0.4, 0.5, 0.6, 0.7], rtol=1e-6)  # changed every step


# ------------------------------------------------------------------------ several devices


POISONED_EXAMPLE = 11  # of 16: on 8 devices, one of the two examples of the sixth device


def _poisoned(inputs: list, mode: str) -> list:
  """``inputs`` with a NaN in one input of example `POISONED_EXAMPLE` of the second batch."""
  x, y = inputs[1]
  if mode == "shard_map":
    bad = np.array(jax.device_get(x))
    bad[POISONED_EXAMPLE, 0, 0, 0] = np.nan
    bad = jax.make_array_from_callback(bad.shape, x.sharding, lambda index: bad[index])
    shares = [np.asarray(s.data) for s in bad.addressable_shards]
  else:  # one device's global batch, or pmap's (devices, examples per device, ...)
    bad = np.array(x).reshape(-1, *x.shape[-3:])
    bad[POISONED_EXAMPLE, 0, 0, 0] = np.nan
    bad = bad.reshape(x.shape)
    shares = list(bad) if mode == "pmap" else [bad]
  assert sum(not np.isfinite(share).all() for share in shares) == 1  # one device's share
  return [inputs[0], (bad, y), *inputs[2:]]


def _per_device(array: Any, mode: str) -> list[np.ndarray]:
  """Each device's copy (or part) of a state array."""
  if mode == "shard_map":
    return [np.asarray(s.data) for s in array.addressable_shards]
  return list(np.asarray(array)) if mode == "pmap" else [np.asarray(array)]


def _factors(kfac: kaisa_jax.KFAC, state: Any, mode: str) -> dict[str, Any]:
  """Each layer's factors, read from the device that owns it."""
  factors = np.asarray(state.factors)
  if mode == "pmap":  # (devices, 1, 1, F) as the mesh's (rows, cols, F)
    layout = kfac.plan.layout
    factors = factors.reshape(layout.rows, layout.cols, -1)
  return kaisa_jax.layer_factors(kfac.plan, state._replace(factors=factors))


@functools.cache
def _two_steps(mode: str) -> tuple[kaisa_jax.KFAC, Any, Any]:
  """``(kfac, state after a finite step, state after the poisoned one)`` on 8 devices or one.

  `distributed_setup`'s MLP and batches of 16; on 8 devices, 4 groups of 2.
  """
  fn, (params, state), inputs, kfac = build("mlp", mode, 8, "1/4", 2, chained=False)
  states = []
  for x, y in _poisoned(inputs, mode):
    params, state, _ = jax.block_until_ready(fn(params, state, x, y))
    states.append(state)
  return kfac, states[0], states[1]


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_one_device_with_a_nan_skips_the_factor_update_on_every_device(mode: str) -> None:
  """A NaN in one example on one of 8 devices skips the factor update everywhere.

  Every device keeps its factors and total bit for bit (the devices whose own
  factors saw no NaN too), and counts the skip; the one-device run on the same
  global batches skips the same update and holds the same factors.
  """
  kfac, before, after = _two_steps(mode)
  for name in ("factors", "factor_total"):
    old, new = _per_device(getattr(before, name), mode), _per_device(getattr(after, name), mode)
    assert len(new) == 8
    for device, (a, b) in enumerate(zip(new, old, strict=True)):
      np.testing.assert_array_equal(a, b, err_msg=f"{name} on device {device}")
  assert np.isfinite(np.asarray(after.factors)).all()
  assert [int(s) for s in _per_device(before.skipped_factor_updates, mode)] == [0] * 8
  assert [int(s) for s in _per_device(after.skipped_factor_updates, mode)] == [1] * 8

  single_kfac, single_before, single_after = _two_steps("single")
  assert int(single_after.skipped_factor_updates) == 1
  np.testing.assert_array_equal(single_after.factors, single_before.factors)
  got = _factors(kfac, after, mode)
  for name, factors in _factors(single_kfac, single_after, "single").items():
    assert np.abs(factors.a).max() > 0 and np.abs(factors.g).max() > 0, name  # the first step's
    for side, want in zip(got[name], factors, strict=True):
      np.testing.assert_allclose(side, want, rtol=1e-5, atol=1e-7, err_msg=name)
