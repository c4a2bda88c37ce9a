"""Capture: nested modules, batch statistics, dropout, patterns, the listing."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references as ref

import kaisa_jax


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.Dropout(0.3, deterministic=not train)(x)
    return nn.relu(x)


class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    x = nn.relu(nn.Conv(4, (3,))(x))
    x = x.reshape(x.shape[0], -1)
    x = Block(name="enc")(x, train)
    return nn.Dense(5)(x)


NET = Net()
X = jax.random.normal(jax.random.key(0), (6, 7, 2))
Y = jnp.arange(6) % 5
VARIABLES = NET.init(jax.random.key(1), X, train=False)


def loss_fn(params, batch_stats, x, y, rng):
  logits, updates = NET.apply(
    {"params": params, "batch_stats": batch_stats},
    x,
    train=True,
    rngs={"dropout": rng},
    mutable=["batch_stats"],
  )
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss, updates["batch_stats"]


def test_nested_modules_batch_stats_dropout_under_jit():
  grad_fn = kaisa_jax.value_and_grad(loss_fn, has_aux=True)
  params, stats, rng = VARIABLES["params"], VARIABLES["batch_stats"], jax.random.key(2)
  layers = grad_fn.layers(params, stats, X, Y, rng)
  assert [s.name for s in layers.specs] == ["Conv_0", "enc/Dense_0", "Dense_0"]
  assert [k.name for k in layers.skipped] == ["enc/BatchNorm_0"]
  assert layers.specs[1].param_path == (
    jax.tree_util.DictKey("enc"),
    jax.tree_util.DictKey("Dense_0"),
  )

  args = (params, stats, X, Y, rng)
  (loss, new_stats), grads, curvature = grad_fn(*args)
  (loss_ref, stats_ref), grads_ref = jax.value_and_grad(loss_fn, has_aux=True)(*args)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  for a, b in zip(jax.tree.leaves((grads, new_stats)), jax.tree.leaves((grads_ref, stats_ref))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
  # Under jit: the same numbers up to float32 reassociation.
  jitted = jax.jit(grad_fn)(*args)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(((loss, new_stats), grads, curvature))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

  # The head's input is the block's output; its output gradient is (softmax - onehot) / n.
  _, inter = NET.apply(
    {"params": params, "batch_stats": stats},
    X,
    train=True,
    rngs={"dropout": rng},
    mutable=["batch_stats", "intermediates"],
    capture_intermediates=True,
  )
  features = inter["intermediates"]["enc"]["__call__"][0]
  np.testing.assert_allclose(curvature["Dense_0"].a[0], features, rtol=1e-6)
  logits = inter["intermediates"]["__call__"][0]
  expected_g = (jax.nn.softmax(logits) - jax.nn.one_hot(Y, 5)) / 6
  np.testing.assert_allclose(curvature["Dense_0"].g[0], expected_g, rtol=1e-5, atol=1e-7)
  assert float(curvature["Dense_0"].n[0]) == 6.0


def test_patterns_select_layers_and_listing_reports_the_rest():
  args = (VARIABLES["params"], VARIABLES["batch_stats"], X, Y, jax.random.key(2))
  only_enc = kaisa_jax.value_and_grad(loss_fn, has_aux=True, include="enc/*").layers(*args)
  assert [s.name for s in only_enc.specs] == ["enc/Dense_0"]
  reasons = {k.name: k.reason for k in only_enc.skipped}
  assert "excluded" in reasons["Conv_0"] and "excluded" in reasons["Dense_0"]
  no_conv = kaisa_jax.value_and_grad(loss_fn, has_aux=True, exclude=["Conv_*"]).layers(*args)
  assert [s.name for s in no_conv.specs] == ["enc/Dense_0", "Dense_0"]
  listing = str(no_conv)
  assert "enc/Dense_0" in listing and "9x9" in listing and "8x8" in listing
  assert "enc/BatchNorm_0" in listing and "Conv_0" in listing
  with pytest.raises(ValueError, match="'decoder/\\*' matches no layer"):
    kaisa_jax.value_and_grad(loss_fn, has_aux=True, include="decoder/*").layers(*args)

  # Excluded layers are not captured and their gradients pass through.
  grad_fn = kaisa_jax.value_and_grad(loss_fn, has_aux=True, include="enc/*")
  _, grads, curvature = grad_fn(*args)
  assert list(curvature) == ["enc/Dense_0"]
  tx = kaisa_jax.kfac(only_enc, step_norm="natural")
  updates, _ = tx.update(grads, tx.init(args[0]), args[0], curvature=curvature)
  np.testing.assert_array_equal(updates["Conv_0"]["kernel"], grads["Conv_0"]["kernel"])
  assert not np.allclose(updates["enc"]["Dense_0"]["kernel"], grads["enc"]["Dense_0"]["kernel"])


def test_loss_that_casts_its_params_is_matched_by_path():
  model = nn.Dense(3)
  x = jnp.ones((4, 2))
  params = model.init(jax.random.key(0), x)

  def loss_fn(params, x):
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    return jnp.mean(model.apply(params, x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  layers = grad_fn.layers(params, x)
  assert layers.specs[0].param_path == (jax.tree_util.DictKey("params"),)
  _, grads, curvature = grad_fn(params, x)
  tx = kaisa_jax.kfac(layers, step_norm="natural")
  updates, _ = tx.update(grads, tx.init(params), params, curvature=curvature)
  assert updates["params"]["kernel"].dtype == jnp.float32


def test_layer_called_twice_counts_its_calls_as_uses(x64):
  """Two calls over the same examples: ``A`` is their mean, ``G`` their sum (per example)."""

  class Shared(nn.Module):
    @nn.compact
    def __call__(self, x1, x2):
      dense = nn.Dense(3, param_dtype=jnp.float64)
      return dense(x1), dense(x2)

  model = Shared()
  x1 = jax.random.normal(jax.random.key(0), (5, 4), jnp.float64)
  x2 = jax.random.normal(jax.random.key(1), (5, 4), jnp.float64)
  params = model.init(jax.random.key(2), x1, x2)

  def head(s1, s2):
    return jnp.mean(jnp.sum(jnp.sin(s1) * jnp.cos(s2), axis=-1))

  def loss_fn(params):
    return head(*model.apply(params, x1, x2))

  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  layers = grad_fn.layers(params)
  assert layers.specs[0].calls == 2
  _, grads, curvature = grad_fn(params)
  tx = kaisa_jax.kfac(layers, factor_decay=0.0, step_norm="natural", factor_dtype=jnp.float64)
  _, state = tx.update(grads, tx.init(params), params, curvature=curvature)
  g1, g2 = jax.grad(head, argnums=(0, 1))(*model.apply(params, x1, x2))
  a_ref = 0.5 * (
    ref.input_factor(ref.dense_rows(x1, True)) + ref.input_factor(ref.dense_rows(x2, True))
  )
  g_ref = ref.output_factor(g1, 5) + ref.output_factor(g2, 5)
  (factors,) = kaisa_jax.layer_factors(tx.plan, state).values()
  np.testing.assert_allclose(factors.a, a_ref, rtol=1e-10)
  np.testing.assert_allclose(factors.g, g_ref, rtol=1e-10)


def test_n_examples_override_scales_g_factor():
  model = nn.Dense(2)
  x = jax.random.normal(jax.random.key(0), (4, 3, 5))
  params = model.init(jax.random.key(1), x)

  def loss_fn(params, x):  # averaged over all 12 tokens
    return jnp.mean(jnp.sin(model.apply(params, x)))

  layers = kaisa_jax.value_and_grad(loss_fn).layers(params, x)
  states = []
  for n in (None, 12):
    grad_fn = kaisa_jax.value_and_grad(loss_fn, n_examples=n)
    _, grads, curvature = grad_fn(params, x)
    tx = kaisa_jax.kfac(layers, factor_decay=0.0, step_norm="natural")
    states.append(tx.update(grads, tx.init(params), params, curvature=curvature)[1])
  g_default, g_tokens = (kaisa_jax.layer_factors(tx.plan, s)["Dense"].g for s in states)
  np.testing.assert_allclose(g_tokens, 3.0 * g_default, rtol=1e-5)


class Pooled(nn.Module):
  strides: int = 1
  kernel_dilation: int = 1

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3,), strides=self.strides, kernel_dilation=self.kernel_dilation)(x)
    return nn.Dense(5)(nn.relu(x).mean(axis=1))


def test_abstract_trace_is_kept_and_checked_against_each_call(monkeypatch):
  """Calls with the same argument types reuse the trace; a loss that changed is traced again."""
  traces = []
  original = kaisa_jax.capture._trace

  def counted(*args):
    traces.append(1)
    return original(*args)

  monkeypatch.setattr(kaisa_jax.capture, "_trace", counted)
  current = {"model": Pooled()}

  def loss(params, x, y):
    logits = current["model"].apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  params = Pooled().init(jax.random.key(1), X)
  grad_fn = kaisa_jax.value_and_grad(loss)
  grad_fn.layers(params, X, Y)
  first = grad_fn(params, X, Y)
  jax.jit(grad_fn)(params, X, Y)
  assert len(traces) == 1  # layers() traced; the eager and the jitted call reused it
  grad_fn(params, X[:4], Y[:4])
  assert len(traces) == 2  # another batch size is another trace

  # The same parameters and output shape, another dilation; then another output
  # shape. Each is traced again and matches a new value_and_grad.
  for model in (Pooled(kernel_dilation=2), Pooled(strides=2)):
    current["model"] = model
    before = len(traces)
    got = grad_fn(params, X, Y)
    assert len(traces) == before + 1
    want = kaisa_jax.value_and_grad(loss)(params, X, Y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(a, b)
    g, g0 = got[2]["Conv_0"].g[0], first[2]["Conv_0"].g[0]
    assert g.shape != g0.shape or not np.allclose(g, g0)  # the model did change


def test_loss_calling_its_layers_differently_each_time_raises():
  calls = []

  def loss(params, x, y):
    calls.append(1)
    h = NET.apply({"params": params, "batch_stats": VARIABLES["batch_stats"]}, x, train=False)
    if len(calls) % 2 == 0:  # every other evaluation calls the head a second time
      h = h + NET.apply({"params": params, "batch_stats": VARIABLES["batch_stats"]}, x, train=False)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

  with pytest.raises(RuntimeError, match="called differently"):
    kaisa_jax.value_and_grad(loss)(VARIABLES["params"], X, Y)
