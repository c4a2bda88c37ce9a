"""Property-based: every invalid configuration raises, every valid one steps without NaN."""

import math
import numbers

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kaisa_jax

anything = st.one_of(
  st.floats(-0.5, 1.5, allow_nan=False),
  st.sampled_from([0.0, 1.0, -1.0, math.nan, math.inf, True, "0.1", None]),
  st.integers(-3, 5),
)
steps = st.one_of(st.integers(-2, 6), st.sampled_from([0, 2.5, True, "3", None]))
configs = st.fixed_dictionaries(
  {
    "damping": anything,
    "factor_decay": anything,
    "factor_update_steps": steps,
    "inv_update_steps": steps,
    "step_norm": st.sampled_from(["gradient", "natural", "euclidean"]),
    "kl_clip": anything,
    "lr": anything,
    "compute_method": st.sampled_from(["eigen", "inverse", "cholesky", ""]),
    "max_cost_ratio": st.one_of(st.none(), st.sampled_from([0.5, 4.0, -1.0, 0.0])),
  }
)
# The step rules: the gradient's norm, K-FAC's own step, or K-FAC's own under a KL clip.
step_rules = st.one_of(
  st.just({"step_norm": "gradient", "kl_clip": None, "lr": None}),
  st.just({"step_norm": "natural", "kl_clip": None, "lr": None}),
  st.fixed_dictionaries(
    {
      "step_norm": st.just("natural"),
      "kl_clip": st.floats(1e-5, 1.0),
      "lr": st.floats(0.0, 1.0),
    }
  ),
)
valid_configs = st.builds(
  dict.__or__,
  st.fixed_dictionaries(
    {
      "damping": st.floats(1e-6, 10.0),
      "factor_decay": st.floats(0.0, 0.99),
      "factor_update_steps": st.integers(1, 4),
      "inv_update_steps": st.integers(1, 4),
      "compute_method": st.sampled_from(["eigen", "inverse"]),
      "max_cost_ratio": st.one_of(st.none(), st.floats(0.1, 10.0)),
    }
  ),
  step_rules,
)
shapes = st.tuples(st.sampled_from([1, 3, 8]), st.sampled_from([2, 5]), st.sampled_from([1, 4]))


def _real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x) -> bool:
  return _real(x) and x > 0


def _valid(c) -> bool:
  """The documented rules, written out independently of the library."""
  count = lambda n: isinstance(n, int) and not isinstance(n, bool) and n >= 1  # noqa: E731
  return (
    _positive(c["damping"])
    and _real(c["factor_decay"])
    and 0 <= c["factor_decay"] < 1
    and count(c["factor_update_steps"])
    and count(c["inv_update_steps"])
    and c["step_norm"] in ("gradient", "natural")
    and (c["kl_clip"] is None or _positive(c["kl_clip"]))
    and (c["lr"] is None or (_real(c["lr"]) and c["lr"] >= 0))
    and (c["kl_clip"] is None) == (c["lr"] is None)  # lr is read by the clip alone
    and (c["kl_clip"] is None or c["step_norm"] == "natural")
    and c["compute_method"] in ("eigen", "inverse")
    and (c["max_cost_ratio"] is None or c["max_cost_ratio"] > 0)
  )


def _problem(batch, features, outputs, conv):
  layer = nn.Conv(outputs, (2,), padding="SAME") if conv else nn.Dense(outputs)
  x = jax.random.normal(jax.random.key(0), (batch, 3, features) if conv else (batch, features))
  params = layer.init(jax.random.key(1), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(jnp.tanh(layer.apply(p, x)) ** 2))
  return params, x, grad_fn


@settings(
  max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(config=st.one_of(valid_configs, configs), shape=shapes, conv=st.booleans())
def test_configuration_raises_or_steps_finitely(config, shape, conv):
  event("valid" if _valid(config) else "invalid")
  params, x, grad_fn = _problem(*shape, conv)
  layers = grad_fn.layers(params, x)
  if not _valid(config):
    try:
      kaisa_jax.kfac(layers, **config)
    except (ValueError, TypeError) as e:
      assert str(e)  # a message, naming what to change
      return
    raise AssertionError(f"accepted an invalid configuration: {config}")
  tx = kaisa_jax.kfac(layers, **config)
  state = tx.init(params)
  for _ in range(2):
    _, grads, curvature = jax.jit(grad_fn)(params, x)
    updates, state = jax.jit(tx.update)(grads, state, params, curvature=curvature)
    for leaf in jax.tree.leaves((updates, state)):
      assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
