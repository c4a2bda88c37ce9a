"""Paths the other references leave out, against float64 numpy references built from first principles.

* A convolution under ``weight_sharing="reduce"``: each example's patches are
  averaged and its output gradients summed over the output positions before
  the outer products (docs/math.md, "Weights used several times per
  example"). Under ``"expand"`` a miscount of the examples cancels; here it
  does not.
* The inverse method on a layer the cost rule keeps one side of diagonal, for
  every damping form: ``(A + sa I)^-1 V (G + sg I)^-1`` with the diagonal
  side's factor the diagonal of its full factor (docs/math.md, "The inverse
  method" and "Diagonal sides").
"""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references as ref
from conftest import one_update

import kaisa_jax

F64 = jnp.float64
DAMPING = 0.03

# ------------------------------------------------------------------ conv, "reduce"

EXAMPLES, HEIGHT, WIDTH, CHANNELS = 3, 7, 6, 3
FEATURES, KERNEL, STRIDES, PADDING = 4, (3, 2), (2, 1), ((1, 2), (0, 1))


class ConvNet(nn.Module):
  """A strided, asymmetrically padded ``Conv`` followed by a tanh and a ``Dense`` head."""

  def setup(self) -> None:
    self.conv = nn.Conv(FEATURES, KERNEL, strides=STRIDES, padding=PADDING, param_dtype=F64)
    self.head = nn.Dense(2, param_dtype=F64)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.tail(self.conv(x))

  def tail(self, s: jax.Array) -> jax.Array:
    """Everything after the convolution's output ``s``."""
    return self.head(jnp.tanh(s).reshape(s.shape[0], -1))


def _conv_problem() -> tuple[ConvNet, dict, jax.Array, Callable[[jax.Array], jax.Array]]:
  """The net, its parameters, a batch and the loss as a function of the net's output."""
  kx, kt, kp = jax.random.split(jax.random.key(21), 3)
  x = jax.random.normal(kx, (EXAMPLES, HEIGHT, WIDTH, CHANNELS), F64)
  target = jax.random.normal(kt, (EXAMPLES, 2), F64)
  model = ConvNet()
  params = model.init(kp, x)

  def head(out: jax.Array) -> jax.Array:
    return jnp.mean(jnp.sum(0.5 * (jnp.sin(out) - target) ** 2, axis=-1))

  return model, params, x, head


def _conv_rows(model: ConvNet, params: dict, x: jax.Array, head: Callable) -> tuple:
  """Per example and output position: the patches ``[a, 1]`` and ``g = dL/ds``.

  ``g`` is the gradient of the loss with respect to an additive perturbation of
  the convolution's output, taken at zero.
  """
  s = model.apply(params, x, method=lambda m, x: m.conv(x))

  def perturbed(delta: jax.Array) -> jax.Array:
    return head(model.apply(params, s + delta, method=ConvNet.tail))

  g = np.asarray(jax.grad(perturbed)(jnp.zeros_like(s)), np.float64)
  patches = ref.conv_patches(np.asarray(x), KERNEL, STRIDES, PADDING, (1, 1), (1, 1), 1)[0]
  a = np.concatenate([patches, np.ones((patches.shape[0], 1))], axis=1)
  positions = s.shape[1] * s.shape[2]
  return a.reshape(EXAMPLES, positions, -1), g.reshape(EXAMPLES, positions, FEATURES)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_conv_reduce_factors_and_preconditioned_gradient(x64, method: str) -> None:
  """``~a_e = mean_u a_eu``, ``~g_e = sum_u g_eu``, ``A = mean_e ~a ~a^T``,
  ``G = (1/n) sum_e (n ~g)(n ~g)^T``; the update is the damped solve with them."""
  model, params, x, head = _conv_problem()
  grads, _, tx, state, updates = one_update(
    lambda p, x: head(model.apply(p, x)),
    params,
    x,
    damping=DAMPING,
    compute_method=method,
    factor_dtype=F64,
    weight_sharing="reduce",
  )
  spec, treatment = next((s, t) for s, t in tx.plan.layers if s.name == "conv")
  assert spec.kind == "conv" and treatment == kaisa_jax.cost.Treatment(method)

  a, g = _conv_rows(model, params, x, head)
  assert a.shape[1] == 4 * 6 > 1  # several positions per example: "reduce" is not "expand"
  a_ref = ref.input_factor(a.mean(axis=1))
  g_ref = ref.output_factor(g.sum(axis=1), n=EXAMPLES)
  factors = kaisa_jax.layer_factors(tx.plan, state)["conv"]
  np.testing.assert_allclose(factors.a, a_ref, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(factors.g, g_ref, rtol=1e-10, atol=1e-14)
  # The expand factors of the same rows differ: the test tells the modes apart.
  a_expand = ref.input_factor(a.reshape(-1, a.shape[-1]))
  g_expand = ref.output_factor(g.reshape(-1, FEATURES), n=EXAMPLES)
  assert not np.allclose(a_expand, a_ref, rtol=1e-2)
  assert not np.allclose(g_expand, g_ref, rtol=1e-2)

  p, u = grads["params"]["conv"], updates["params"]["conv"]
  v = ref.gradient_matrix(p["kernel"], p["bias"], 1)[0]
  got = ref.gradient_matrix(u["kernel"], u["bias"], 1)[0]
  if method == "eigen":
    expected = ref.kronecker_solve(a_ref, g_ref, v, DAMPING)
  else:
    expected = ref.two_sided_inverse(a_ref, g_ref, v, DAMPING)
  np.testing.assert_allclose(got, expected, rtol=1e-7, atol=1e-12)
  assert not np.allclose(got, v, rtol=1e-2)


# ------------------------------------------------ inverse method, a diagonal side

FORMS = ["pi", "relative", "kaisa"]
ROWS = 8
# (inputs, outputs) of the Dense layer: the larger side is the one the cost rule
# keeps diagonal; the bias makes A's side ``inputs + 1``.
SHAPES = {"diagonal A": (12, 3), "diagonal G": (3, 12)}
# Between the cost of the dense inverse method (about 5x the layer's own flops
# for these shapes) and that of the larger side kept diagonal (about 0.2x).
MAX_COST_RATIO = 1.0


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("sides", sorted(SHAPES))
def test_inverse_method_with_a_diagonal_side_each_form(x64, sides: str, form: str) -> None:
  """``(A' + sa I)^-1 V (G' + sg I)^-1`` by dense numpy algebra, where the side the
  cost rule keeps diagonal is replaced by the diagonal of its full factor and
  ``(sa, sg)`` are the form's shares, computed from those factors."""
  d_in, d_out = SHAPES[sides]
  model = nn.Dense(d_out, param_dtype=F64)
  kx, kt, kp = jax.random.split(jax.random.key(5), 3)
  # Far from unit scale, so that A's and G's mean eigenvalues differ: the forms differ.
  x = 5.0 * jax.random.normal(kx, (ROWS, d_in), F64) + 1.0
  target = jax.random.normal(kt, (ROWS, d_out), F64)
  params = model.init(kp, x)

  def head(s: jax.Array) -> jax.Array:
    return jnp.mean(jnp.sum(0.5 * (jnp.tanh(0.2 * s) - target) ** 2, axis=-1))

  grads, _, tx, state, updates = one_update(
    lambda p, x: head(model.apply(p, x)),
    params,
    x,
    damping=DAMPING,
    damping_form=form,
    compute_method="inverse",
    factor_dtype=F64,
    max_cost_ratio=MAX_COST_RATIO,
  )
  diagonal = (True, False) if sides == "diagonal A" else (False, True)
  ((spec, treatment),) = tx.plan.layers
  assert treatment == kaisa_jax.cost.Treatment("inverse", diagonal), treatment
  assert tx.plan.damping_form == form

  a_full = ref.input_factor(ref.dense_rows(np.asarray(x), True))
  g_rows = np.asarray(jax.grad(head)(model.apply(params, x)), np.float64)
  g_full = ref.output_factor(g_rows, n=ROWS)
  factors = kaisa_jax.layer_factors(tx.plan, state)[spec.name]
  for got_factor, full, diag in zip((factors.a, factors.g), (a_full, g_full), diagonal):
    expected_factor = np.diag(full) if diag else full
    assert np.shape(got_factor) == expected_factor.shape
    np.testing.assert_allclose(got_factor, expected_factor, rtol=1e-10, atol=1e-14)
  a_ref, g_ref = (np.diag(np.diag(f)) if d else f for f, d in zip((a_full, g_full), diagonal))
  assert not np.isclose(np.trace(a_ref) / len(a_ref), np.trace(g_ref) / len(g_ref), rtol=0.5)

  v = ref.gradient_matrix(grads["params"]["kernel"], grads["params"]["bias"], 1)[0]
  got = ref.gradient_matrix(updates["params"]["kernel"], updates["params"]["bias"], 1)[0]
  expected = ref.damped_solve(a_ref, g_ref, v, DAMPING, form, "inverse")
  np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-12)
  # The other forms, and the full (non-diagonal) factors, give other updates.
  for other in FORMS:
    if other != form:
      assert not np.allclose(got, ref.damped_solve(a_ref, g_ref, v, DAMPING, other, "inverse"))
  assert not np.allclose(got, ref.damped_solve(a_full, g_full, v, DAMPING, form, "inverse"))
