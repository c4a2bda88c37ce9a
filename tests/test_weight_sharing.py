"""Weight sharing across calls and positions, against float64 numpy references.

A weight used ``T`` times per example counts the same whether the uses are
positions of one call or calls of one layer: ``"expand"`` averages the inputs'
second moments over all uses and sums the output gradients' over an example's
uses; ``"reduce"`` averages the inputs and sums the output gradients over an
example's uses before the outer products. The references here build the
factors, and the Fisher blocks they approximate, from explicit rows with numpy.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references as ref
from conftest import one_update

import kaisa_jax

F64 = jnp.float64
EXAMPLES, USES, D_IN, D_OUT = 4, 3, 3, 2


class Positions(nn.Module):
  """One call of a shared ``Dense`` over ``(examples, uses, features)``."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(D_OUT, param_dtype=F64, name="shared")(x)


class Calls(nn.Module):
  """The same ``Dense`` applied once per use, in a Python loop; ``split`` uses per call."""

  split: int = 1

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(D_OUT, param_dtype=F64, name="shared")
    chunks = [x[:, t : t + self.split] for t in range(0, x.shape[1], self.split)]
    outs = [dense(c if self.split > 1 else c[:, 0]) for c in chunks]
    return jnp.concatenate([o if self.split > 1 else o[:, None] for o in outs], axis=1)


def _head(target):
  """A mean over the examples of a nonlinear loss of every use's output."""

  def head(s):
    return jnp.mean(jnp.sum(0.5 * (jnp.tanh(s) - target) ** 2, axis=(1, 2)))

  return head


def _batch_factors(model, params, x, head, sharing):
  """The layer's factors of this batch only, through the public API."""
  _, _, tx, state, _ = one_update(
    lambda p, x: head(model.apply(p, x)), params, x, factor_dtype=F64, weight_sharing=sharing
  )
  (spec, _), *_ = tx.plan.layers
  return spec, kaisa_jax.layer_factors(tx.plan, state)[spec.name]


def _problem(x=None):
  kx, kt, kp = jax.random.split(jax.random.key(0), 3)
  if x is None:
    x = jax.random.normal(kx, (EXAMPLES, USES, D_IN), F64)
  target = jax.random.normal(kt, (*x.shape[:2], D_OUT), F64)
  params = Positions().init(kp, x)
  params = jax.tree.map(lambda w: w + 0.3, params)  # a nonzero bias: outputs differ by use
  return params, x, _head(target)


def _rows(params, x, head):
  """``(examples, uses, d)`` inputs ``[a, 1]`` and output gradients, from a numpy forward."""
  p = params["params"]["shared"]
  x = np.asarray(x, np.float64)
  s = x @ np.asarray(p["kernel"]) + np.asarray(p["bias"])
  g = np.asarray(jax.grad(head)(jnp.asarray(s)))
  a = np.concatenate([x, np.ones((*x.shape[:2], 1))], axis=-1)
  return a, g


def _expand(a, g):
  """``A = mean_uses a a^T``, ``G = (1/n) sum_uses (n g)(n g)^T``, ``n`` the examples."""
  return ref.input_factor(a.reshape(-1, a.shape[-1])), ref.output_factor(
    g.reshape(-1, g.shape[-1]), a.shape[0]
  )


def _reduce(a, g):
  """Per example the mean input and the summed output gradient, then the outer products."""
  return ref.input_factor(a.mean(axis=1)), ref.output_factor(g.sum(axis=1), a.shape[0])


def _fisher(a, g):
  """``(1/n) sum_e vec(d_e) vec(d_e)^T`` with ``d_e = sum_u a (n g)^T``, vec row-major."""
  n = a.shape[0]
  d = np.einsum("eui,euo->eio", a, n * g).reshape(n, -1)
  return d.T @ d / n


def _per_use_fisher(a, g):
  """The Fisher of the uses taken as independent terms: ``(1/n) sum_{e,u} vec vec^T``."""
  n = a.shape[0]
  d = np.einsum("eui,euo->euio", a, n * g).reshape(-1, a.shape[-1] * g.shape[-1])
  return d.T @ d / n


# ------------------------------------------------------------------------ consistency


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("split", [1, 2], ids=["one-call-per-use", "calls-of-two-positions"])
def test_positions_and_calls_give_the_same_factors(x64, sharing, split):
  x = jax.random.normal(jax.random.key(1), (EXAMPLES, 2 * USES, D_IN), F64)
  params, x, head = _problem(x)
  spec_p, by_positions = _batch_factors(Positions(), params, x, head, sharing)
  spec_c, by_calls = _batch_factors(Calls(split), params, x, head, sharing)
  assert (spec_p.calls, spec_c.calls) == (1, 2 * USES // split)
  np.testing.assert_allclose(by_calls.a, by_positions.a, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(by_calls.g, by_positions.g, rtol=1e-12, atol=1e-14)
  # Both are the formula of the mode, from rows made by hand.
  a_ref, g_ref = (_expand if sharing == "expand" else _reduce)(*_rows(params, x, head))
  np.testing.assert_allclose(by_positions.a, a_ref, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(by_positions.g, g_ref, rtol=1e-10, atol=1e-14)


def test_calls_with_different_examples_count_apart(x64):
  """A layer applied to a batch and to one unbatched row: two groups of uses.

  ``A`` is the mean over all rows, ``G`` the sum of each group's ``G`` (the
  unbatched call is one example, ``n = 1``), in both modes.
  """

  class Mixed(nn.Module):
    @nn.compact
    def __call__(self, x, query):
      dense = nn.Dense(D_OUT, param_dtype=F64, name="shared")
      return dense(x), dense(query)

  x = jax.random.normal(jax.random.key(1), (EXAMPLES, D_IN), F64)
  query = jax.random.normal(jax.random.key(2), (D_IN,), F64)
  model = Mixed()
  params = model.init(jax.random.key(3), x, query)

  def loss_fn(p, x):
    out, q = model.apply(p, x, query)
    return jnp.mean(jnp.sum(jnp.sin(out) * jnp.cos(q), axis=-1))

  p = params["params"]["shared"]
  s, q = x @ p["kernel"] + p["bias"], query @ p["kernel"] + p["bias"]
  g_s, g_q = jax.grad(lambda s, q: jnp.mean(jnp.sum(jnp.sin(s) * jnp.cos(q), axis=-1)), (0, 1))(
    s, q
  )
  a_x, a_q = ref.dense_rows(np.asarray(x), True), ref.dense_rows(np.asarray(query)[None], True)
  a_ref = (a_x.T @ a_x + a_q.T @ a_q) / (EXAMPLES + 1)
  g_ref = ref.output_factor(np.asarray(g_s), EXAMPLES) + ref.output_factor(np.asarray(g_q)[None], 1)
  for sharing in ("expand", "reduce"):
    _, _, tx, state, _ = one_update(loss_fn, params, x, factor_dtype=F64, weight_sharing=sharing)
    factors = kaisa_jax.layer_factors(tx.plan, state)["shared"]
    np.testing.assert_allclose(factors.a, a_ref, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(factors.g, g_ref, rtol=1e-10, atol=1e-14)


# -------------------------------------------------------------------------- exactness


def _shared_input_problem(examples):
  """Every use of every example sees the same input row; the outputs differ by use."""
  row = jax.random.normal(jax.random.key(4), (D_IN,), F64)
  return _problem(jnp.broadcast_to(row, (examples, USES, D_IN)))


@pytest.mark.parametrize("examples", [1, EXAMPLES])
def test_reduce_is_the_exact_fisher_when_uses_share_their_input(x64, examples):
  params, x, head = _shared_input_problem(examples)
  a, g = _rows(params, x, head)
  fisher = _fisher(a, g)
  # The reference's per-example gradients add up to the batch gradient.
  grads = jax.grad(lambda p: head(Calls().apply(p, x)))(params)["params"]["shared"]
  v = ref.gradient_matrix(grads["kernel"], grads["bias"], 1)[0]
  d = np.einsum("eui,euo->eio", a, g).sum(axis=0)
  np.testing.assert_allclose(d, v, rtol=1e-12, atol=1e-15)
  _, factors = _batch_factors(Calls(), params, x, head, "reduce")
  np.testing.assert_allclose(np.kron(factors.a, factors.g), fisher, rtol=1e-10, atol=1e-14)
  # The uses' gradients are not parallel: the cross terms matter, and expand
  # (which drops them) is not this Fisher.
  assert not np.allclose(_per_use_fisher(a, g), fisher, rtol=1e-2)


def test_reduce_is_the_exact_fisher_when_uses_share_their_output_gradient(x64):
  """One example whose uses have different inputs and feed one sum: ``g`` is shared."""
  x = jax.random.normal(jax.random.key(5), (1, USES, D_IN), F64)
  params, x, _ = _problem(x)
  target = jax.random.normal(jax.random.key(6), (D_OUT,), F64)

  def head(s):
    return jnp.mean(jnp.sum(0.5 * (jnp.tanh(s.sum(axis=1)) - target) ** 2, axis=-1))

  a, g = _rows(params, x, head)
  np.testing.assert_allclose(g[:, 1:], np.broadcast_to(g[:, :1], g[:, 1:].shape), rtol=1e-14)
  _, factors = _batch_factors(Calls(), params, x, head, "reduce")
  np.testing.assert_allclose(np.kron(factors.a, factors.g), _fisher(a, g), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("examples", [1, EXAMPLES])
def test_expand_is_the_per_use_fisher_when_uses_share_their_input(x64, examples):
  """``A (x) G = (1/n) sum_{e,u} (a a^T) (x) (n g)(n g)^T`` when every use has the same ``a``."""
  params, x, head = _shared_input_problem(examples)
  a, g = _rows(params, x, head)
  _, factors = _batch_factors(Calls(), params, x, head, "expand")
  np.testing.assert_allclose(
    np.kron(factors.a, factors.g), _per_use_fisher(a, g), rtol=1e-10, atol=1e-14
  )


# -------------------------------------------------------------------------- recurrence


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_gru_under_rnn_counts_every_step_as_a_use(x64, sharing):
  steps, hidden = 5, 4
  model = nn.RNN(nn.GRUCell(hidden, param_dtype=F64))
  x = jax.random.normal(jax.random.key(8), (EXAMPLES, steps, D_IN), F64)
  target = jax.random.normal(jax.random.key(9), (EXAMPLES, hidden), F64)
  params = model.init(jax.random.key(10), x)

  def loss_fn(p, x):
    return jnp.mean(jnp.sum((model.apply(p, x)[:, -1] - target) ** 2, axis=-1))

  _, curvature, tx, state, _ = one_update(
    loss_fn, params, x, factor_dtype=F64, weight_sharing=sharing
  )
  factors = kaisa_jax.layer_factors(tx.plan, state)
  assert {s.calls for s, _ in tx.plan.layers} == {steps}
  assert sorted(factors) == sorted(f"cell/{k}" for k in ("ir", "iz", "in", "hr", "hz", "hn"))
  for t in range(steps):  # the input projections see the sequence, step by step
    np.testing.assert_allclose(curvature["cell/ir"].a[t], x[:, t], rtol=0)
  for spec, _ in tx.plan.layers:
    entry = curvature[spec.name]
    a = np.stack([np.asarray(a) for a in entry.a], axis=1)  # (examples, steps, d)
    if spec.has_bias:
      a = np.concatenate([a, np.ones((*a.shape[:2], 1))], axis=-1)
    g = np.stack([np.asarray(g) for g in entry.g], axis=1)
    a_ref, g_ref = (_expand if sharing == "expand" else _reduce)(a, g)
    np.testing.assert_allclose(factors[spec.name].a, a_ref, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(factors[spec.name].g, g_ref, rtol=1e-10, atol=1e-14)


# ------------------------------------------------------- attend and normalisation layers

VOCAB = 5


class Attend(nn.Module):
  """Logits of a tied embedding, ``h W^T``, over every position at once or position by position."""

  by_calls: bool

  @nn.compact
  def __call__(self, h):
    embed = nn.Embed(VOCAB, D_IN, param_dtype=F64, name="embed")
    if not self.by_calls:
      return embed.attend(h)
    return jnp.stack([embed.attend(h[:, t]) for t in range(h.shape[1])], axis=1)


def test_attend_counts_positions_and_calls_alike(x64):
  """The transposed weight: ``n g`` on the vocabulary side (a mean), ``h`` on the other (a sum)."""
  h = jax.random.normal(jax.random.key(11), (EXAMPLES, USES, D_IN), F64)
  target = jax.random.normal(jax.random.key(12), (EXAMPLES, USES, VOCAB), F64)
  params = Attend(False).init(jax.random.key(13), h)
  head = _head(target)
  factors = [_batch_factors(Attend(c), params, h, head, "expand")[1] for c in (False, True)]
  for f in ("a", "g"):
    np.testing.assert_allclose(getattr(factors[1], f), getattr(factors[0], f), rtol=1e-12)
  table = np.asarray(params["params"]["embed"]["embedding"])
  g = np.asarray(jax.grad(head)(jnp.asarray(np.asarray(h) @ table.T))).reshape(-1, VOCAB)
  h_rows = np.asarray(h).reshape(-1, D_IN)
  a_ref = np.mean((EXAMPLES * g) ** 2, axis=0)  # the embedding's A is diagonal
  np.testing.assert_allclose(factors[0].a, a_ref, rtol=1e-10)
  np.testing.assert_allclose(factors[0].g, h_rows.T @ h_rows / EXAMPLES, rtol=1e-10)


class Norm(nn.Module):
  """One ``LayerNorm`` over every position at once, or position by position."""

  by_calls: bool

  @nn.compact
  def __call__(self, x):
    norm = nn.LayerNorm(param_dtype=F64, name="norm")
    if not self.by_calls:
      return norm(x)
    return jnp.stack([norm(x[:, t]) for t in range(x.shape[1])], axis=1)


def test_normalisation_sums_an_examples_uses_before_the_block(x64):
  """Per feature, ``v = sum_uses [x^ g, g]`` over calls and positions; ``(1/n) sum (n v)(n v)^T``.

  One call over every position and one call per position give that block.
  """
  x = 1.0 + jax.random.normal(jax.random.key(14), (EXAMPLES, USES, D_IN), F64)
  target = jax.random.normal(jax.random.key(15), (EXAMPLES, USES, D_IN), F64)
  params = Norm(False).init(jax.random.key(16), x)
  params = jax.tree.map(lambda p: p + jax.random.normal(jax.random.key(17), p.shape, F64), params)
  head = _head(target)

  xn = np.asarray(x)
  xhat = (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, keepdims=True) + 1e-6)
  p = params["params"]["norm"]
  y = xhat * np.asarray(p["scale"]) + np.asarray(p["bias"])
  g = np.asarray(jax.grad(head)(jnp.asarray(y)))
  v = EXAMPLES * np.stack([(xhat * g).sum(1), g.sum(1)], axis=-1)  # (examples, features, 2)
  expected = np.einsum("efi,efj->fij", v, v) / EXAMPLES

  for by_calls in (False, True):
    model = Norm(by_calls)
    np.testing.assert_allclose(model.apply(params, x), y, rtol=1e-10)
    grad_fn = kaisa_jax.value_and_grad(
      lambda p, x, m=model: head(m.apply(p, x)), normalization="block"
    )
    layers = grad_fn.layers(params, x)
    assert layers.specs[0].calls == (USES if by_calls else 1)
    tx = kaisa_jax.kfac(layers, factor_dtype=F64, factor_decay=0.0, step_norm="natural")
    _, grads, curvature = grad_fn(params, x)
    _, state = tx.update(grads, tx.init(params), params, curvature=curvature)
    block = kaisa_jax.layer_factors(tx.plan, state)["norm"].a  # (features, 2, 2)
    np.testing.assert_allclose(block, expected, rtol=1e-9)
