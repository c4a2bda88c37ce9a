"""Damping forms: the preconditioned gradient of each form against dense numpy solves."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references as ref
from conftest import one_update

import kaisa_jax

FORMS = ["relative", "pi", "kaisa"]
METHODS = ["eigen", "inverse"]
DAMPING = 0.05


def _dense_problem():
  model = nn.Dense(3, param_dtype=jnp.float64)
  kx, kt, kp = jax.random.split(jax.random.key(0), 3)
  # Inputs far from unit scale, so that A's and G's mean eigenvalues differ
  # from 1 and from each other: every form then gives another result.
  x = 7.0 * jax.random.normal(kx, (8, 5), jnp.float64)
  target = jax.random.normal(kt, (8, 3), jnp.float64)
  params = model.init(kp, x)

  def head(s):
    return jnp.mean(jnp.sum(0.5 * (jnp.tanh(0.1 * s) - target) ** 2, axis=-1))

  return model, params, x, head


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("form", FORMS)
def test_dense_layer_each_form_matches_dense_solve(x64, form, method):
  model, params, x, head = _dense_problem()
  loss_fn = lambda p, x: head(model.apply(p, x))  # noqa: E731
  grads, _, _, _, updates = one_update(
    loss_fn,
    params,
    x,
    damping=DAMPING,
    damping_form=form,
    compute_method=method,
    factor_dtype=jnp.float64,
  )
  g = np.asarray(jax.grad(head)(model.apply(params, x)))
  a_ref = ref.input_factor(ref.dense_rows(np.asarray(x), True))
  g_ref = ref.output_factor(g, n=8)
  assert not np.isclose(np.trace(a_ref) / 6, np.trace(g_ref) / 3, rtol=0.5)
  v = ref.gradient_matrix(grads["params"]["kernel"], grads["params"]["bias"], 1)[0]
  expected = ref.damped_solve(a_ref, g_ref, v, DAMPING, form, method)
  got = ref.gradient_matrix(updates["params"]["kernel"], updates["params"]["bias"], 1)[0]
  np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-12)
  # The forms differ on this layer: the test can tell one from another.
  for other in FORMS:
    if other != form:
      assert not np.allclose(got, ref.damped_solve(a_ref, g_ref, v, DAMPING, other, method))


@pytest.mark.parametrize("method", METHODS)
def test_bounded_form_stops_the_damping_at_the_layers_curvature(x64, method):
  """``"bounded"`` is ``"pi"`` at a damping below the layer's mean curvature ``mA mG``
  (0.28 here), and ``"pi"`` at ``mA mG`` above it: the dense solve of each."""
  model, params, x, head = _dense_problem()
  loss_fn = lambda p, x: head(model.apply(p, x))  # noqa: E731
  g = np.asarray(jax.grad(head)(model.apply(params, x)))
  a_ref = ref.input_factor(ref.dense_rows(np.asarray(x), True))
  g_ref = ref.output_factor(g, n=8)
  curvature = np.trace(a_ref) / 6 * np.trace(g_ref) / 3
  for damping, as_pi in ((DAMPING, DAMPING), (20 * curvature, curvature)):
    grads, _, _, _, updates = one_update(
      loss_fn,
      params,
      x,
      damping=damping,
      damping_form="bounded",
      compute_method=method,
      factor_dtype=jnp.float64,
    )
    v = ref.gradient_matrix(grads["params"]["kernel"], grads["params"]["bias"], 1)[0]
    got = ref.gradient_matrix(updates["params"]["kernel"], updates["params"]["bias"], 1)[0]
    expected = ref.damped_solve(a_ref, g_ref, v, as_pi, "pi", method)
    np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(
      got, ref.damped_solve(a_ref, g_ref, v, damping, "bounded", method), rtol=1e-8, atol=1e-12
    )
  # Above the curvature the bound acts: pi's own damping would give another step.
  assert not np.allclose(got, ref.damped_solve(a_ref, g_ref, v, damping, "pi", method))


@pytest.mark.parametrize(
  ("step_norm", "form", "other"), [("gradient", "bounded", "pi"), ("natural", "pi", "bounded")]
)
def test_the_default_form_follows_the_step_rule(x64, step_norm, form, other):
  """With no ``damping_form`` (``None``), ``kfac`` damps as ``"bounded"`` under each layer's
  gradient norm and as ``"pi"`` under K-FAC's own step, at a damping (20x the layer's
  curvature) where the two forms give different updates."""
  model, params, x, head = _dense_problem()
  loss_fn = lambda p, x: head(model.apply(p, x))  # noqa: E731
  g = np.asarray(jax.grad(head)(model.apply(params, x)))
  a_ref = ref.input_factor(ref.dense_rows(np.asarray(x), True))
  g_ref = ref.output_factor(g, n=8)
  damping = 20 * np.trace(a_ref) / 6 * np.trace(g_ref) / 3

  def update(damping_form):
    *_, tx, _, updates = one_update(
      loss_fn,
      params,
      x,
      damping=damping,
      damping_form=damping_form,
      step_norm=step_norm,
      factor_dtype=jnp.float64,
    )
    return tx.plan.damping_form, np.asarray(updates["params"]["kernel"])

  default, named, unnamed = update(None), update(form), update(other)
  assert default[0] == named[0] == form
  np.testing.assert_array_equal(default[1], named[1])
  assert not np.allclose(default[1], unnamed[1])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("form", FORMS)
def test_embedding_diagonal_side_each_form_matches_dense_solve(x64, form, method):
  """An embedding lookup's ``A`` is diagonal (token frequencies): its scale enters alike."""
  model = nn.Embed(7, 3, param_dtype=jnp.float64)
  ids = jnp.array([[0, 1, 1, 2], [2, 2, 3, 6]])
  target = jax.random.normal(jax.random.key(1), (2, 4, 3), jnp.float64)
  params = model.init(jax.random.key(2), ids)

  def head(s):
    return jnp.mean(jnp.sum(0.5 * (jnp.tanh(s) - target) ** 2, axis=(1, 2)))

  loss_fn = lambda p, ids: head(model.apply(p, ids))  # noqa: E731
  grads, _, _, _, updates = one_update(
    loss_fn,
    params,
    ids,
    damping=DAMPING,
    damping_form=form,
    compute_method=method,
    factor_dtype=jnp.float64,
  )
  counts = np.bincount(np.asarray(ids).reshape(-1), minlength=7)
  a_ref = np.diag(counts / ids.size)
  g = np.asarray(jax.grad(head)(model.apply(params, ids)))
  g_ref = ref.output_factor(g.reshape(-1, 3), n=2)
  v = np.asarray(grads["params"]["embedding"], np.float64)
  expected = ref.damped_solve(a_ref, g_ref, v, DAMPING, form, method)
  np.testing.assert_allclose(updates["params"]["embedding"], expected, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_relative_damping_follows_the_scale_of_the_inputs(x64, method):
  """Inputs ``c`` times larger and a kernel ``c`` times smaller compute the same function,
  with ``A`` ``c^2`` times larger and the gradient ``c`` times larger: under
  ``"relative"`` the update is exactly ``1 / c`` times the original, as the undamped
  inverse's would be; under ``"kaisa"`` the absolute damping changes it otherwise."""
  model = nn.Dense(3, use_bias=False, param_dtype=jnp.float64)
  x = jax.random.normal(jax.random.key(0), (8, 5), jnp.float64)
  target = jax.random.normal(jax.random.key(1), (8, 3), jnp.float64)
  params = model.init(jax.random.key(2), x)
  loss_fn = lambda p, x: jnp.mean(jnp.sum((jnp.tanh(model.apply(p, x)) - target) ** 2, -1))  # noqa: E731
  c = 10.0
  small = jax.tree.map(lambda w: w / c, params)

  def kernel_update(form, p, inputs):
    *_, updates = one_update(
      loss_fn,
      p,
      inputs,
      damping=1.0,
      damping_form=form,
      compute_method=method,
      factor_dtype=jnp.float64,
    )
    return np.asarray(updates["params"]["kernel"])

  base, scaled = kernel_update("relative", params, x), kernel_update("relative", small, c * x)
  np.testing.assert_allclose(scaled, base / c, rtol=1e-10)
  kaisa_base, kaisa_scaled = kernel_update("kaisa", params, x), kernel_update("kaisa", small, c * x)
  assert not np.allclose(kaisa_scaled, kaisa_base / c, rtol=1e-2)


def test_damping_form_rejected_when_unknown():
  model = nn.Dense(2)
  x = jnp.ones((2, 3))
  params = model.init(jax.random.key(0), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x)))
  with pytest.raises(ValueError, match="damping_form must be one of"):
    kaisa_jax.kfac(grad_fn.layers(params, x), damping_form="absolute")
