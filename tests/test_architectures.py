"""DenseGeneral, attention, embeddings, weight sharing and custom layers against references.

Every reference here is independent of kaisa_jax: inputs and output gradients
come from hand-written forward passes differentiated with respect to zero
perturbations of the layer outputs, factors from numpy, and the preconditioned
gradient from a dense `numpy.linalg.solve` of the Kronecker system.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references as ref
from conftest import one_update
from flax import nnx

import kaisa_jax

DAMPING = 0.05
F64 = jnp.float64


def _factors(x_rows, g_rows, bias, n, sharing):
  """``A`` and ``G`` from ``(examples, positions, d)`` inputs and output gradients."""
  x_rows, g_rows = np.asarray(x_rows, np.float64), np.asarray(g_rows, np.float64)
  if sharing == "reduce":
    a, g = x_rows.mean(axis=1), g_rows.sum(axis=1)
  else:
    a, g = x_rows.reshape(-1, x_rows.shape[-1]), g_rows.reshape(-1, g_rows.shape[-1])
  return ref.input_factor(ref.dense_rows(a, bias)), ref.output_factor(g, n)


def _check(tx, state, updates, grads, name, a_ref, g_ref, v, rtol=1e-8):
  factors = kaisa_jax.layer_factors(tx.plan, state)[name]
  a = factors.a if factors.a.ndim == 2 else np.diag(factors.a)
  np.testing.assert_allclose(a, a_ref, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(factors.g, g_ref, rtol=1e-9, atol=1e-12)
  expected = ref.kronecker_solve(a_ref, g_ref, v, DAMPING)
  np.testing.assert_allclose(updates, expected, rtol=rtol, atol=1e-11)
  assert not np.allclose(updates, v, rtol=1e-2)  # preconditioning changed it


def _head(target):
  def head(s):  # a mean over the examples of a nonlinear per-example loss
    return jnp.mean(jnp.sum(0.5 * (jnp.tanh(s) - target) ** 2, axis=tuple(range(1, s.ndim))))

  return head


@pytest.mark.parametrize(
  "features, axis, shape, moved",
  [
    ((2, 3), (-2, -1), (4, 5, 3, 2), (4, 5, 3, 2)),
    (4, 1, (4, 3, 5), (4, 5, 3)),  # contracts a middle axis
  ],
  ids=["two-axes-in-two-out", "middle-axis"],
)
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_dense_general_matches_dense_solve(x64, features, axis, shape, moved, sharing):
  layer = nn.DenseGeneral(features, axis=axis, param_dtype=F64)
  x = jax.random.normal(jax.random.key(0), shape, F64)
  params = layer.init(jax.random.key(1), x)
  out = layer.apply(params, x)
  head = _head(jax.random.normal(jax.random.key(2), out.shape, F64))
  grads, _, tx, state, updates = one_update(
    lambda p, x: head(layer.apply(p, x)),
    params,
    x,
    damping=DAMPING,
    factor_dtype=F64,
    weight_sharing=sharing,
  )
  kernel = params["params"]["kernel"]
  d_in = int(np.prod(kernel.shape[: len(np.atleast_1d(axis))]))
  # Contracted axes last, in the kernel's order: the rows of the input.
  x_rows = np.moveaxis(np.asarray(x), 1, -1) if moved != shape else np.asarray(x)
  g = np.asarray(jax.grad(head)(out))
  d_out = int(np.prod(np.atleast_1d(features)))
  a_ref, g_ref = _factors(
    x_rows.reshape(shape[0], -1, d_in), g.reshape(shape[0], -1, d_out), True, shape[0], sharing
  )
  p, u = grads["params"], updates["params"]
  v = np.concatenate([p["kernel"].reshape(d_in, -1), p["bias"].reshape(1, -1)])
  got = np.concatenate([u["kernel"].reshape(d_in, -1), u["bias"].reshape(1, -1)])
  _check(tx, state, got, grads, "DenseGeneral", a_ref, g_ref, v)


def test_dense_reduce_differs_from_expand(x64):
  """The two variants are different estimates on sequence data (the option matters)."""
  layer = nn.Dense(3, param_dtype=F64)
  x = jax.random.normal(jax.random.key(0), (4, 6, 5), F64)
  params = layer.init(jax.random.key(1), x)
  head = _head(jax.random.normal(jax.random.key(2), (4, 6, 3), F64))
  factors = {}
  for sharing in ("expand", "reduce"):
    _, _, tx, state, _ = one_update(
      lambda p, x: head(layer.apply(p, x)), params, x, factor_dtype=F64, weight_sharing=sharing
    )
    factors[sharing] = kaisa_jax.layer_factors(tx.plan, state)["Dense"]
  g = np.asarray(jax.grad(head)(layer.apply(params, x)))
  for sharing, f in factors.items():
    a_ref, g_ref = _factors(np.asarray(x), g, True, 4, sharing)
    np.testing.assert_allclose(f.a, a_ref, rtol=1e-10)
    np.testing.assert_allclose(f.g, g_ref, rtol=1e-10)
  assert not np.allclose(factors["expand"].a, factors["reduce"].a, rtol=1e-2)


# -------------------------------------------------------------------------- attention

HEADS, DEPTH, WIDTH = 2, 3, 6


def _attention_by_hand(params, x, mask, eps):
  """Multi-head self-attention written out, with perturbations ``eps`` on the projections."""
  p = params["params"]
  q, k, v = (
    jnp.einsum("btd,dhk->bthk", x, p[n]["kernel"]) + p[n]["bias"] + eps[n]
    for n in ("query", "key", "value")
  )
  logits = jnp.einsum("bqhk,bshk->bhqs", q / jnp.sqrt(DEPTH), k)
  weights = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(F64).min), axis=-1)
  heads = jnp.einsum("bhqs,bshk->bqhk", weights, v)
  out = jnp.einsum("bqhk,hkd->bqd", heads, p["out"]["kernel"]) + p["out"]["bias"] + eps["out"]
  return out, heads


def test_attention_projections_match_dense_solve(x64):
  attention = nn.MultiHeadDotProductAttention(HEADS, qkv_features=HEADS * DEPTH, param_dtype=F64)
  x = jax.random.normal(jax.random.key(0), (3, 4, WIDTH), F64)
  mask = nn.make_causal_mask(jnp.ones((3, 4)))
  params = attention.init(jax.random.key(1), x, mask=mask)
  head = _head(jax.random.normal(jax.random.key(2), (3, 4, WIDTH), F64))
  zeros = {n: 0.0 for n in ("query", "key", "value", "out")}
  out, heads = _attention_by_hand(params, x, mask, zeros)
  np.testing.assert_allclose(out, attention.apply(params, x, mask=mask), rtol=1e-10)

  grads, _, tx, state, updates = one_update(
    lambda p, x: head(attention.apply(p, x, mask=mask)),
    params,
    x,
    damping=DAMPING,
    factor_dtype=F64,
  )
  shapes = {n: (3, 4, HEADS, DEPTH) for n in ("query", "key", "value")} | {"out": (3, 4, WIDTH)}
  eps = {n: jnp.zeros(s, F64) for n, s in shapes.items()}
  g = jax.grad(lambda e: head(_attention_by_hand(params, x, mask, e)[0]))(eps)
  inputs = {"query": x, "key": x, "value": x, "out": heads}
  names = [s.name for s, _ in tx.plan.layers]
  assert [name.split("/")[-1] for name in names] == ["query", "key", "value", "out"]
  for n, name in zip(("query", "key", "value", "out"), names, strict=True):
    d_in = int(np.prod(params["params"][n]["kernel"].shape[: 2 if n == "out" else 1]))
    a_ref, g_ref = _factors(
      np.asarray(inputs[n]).reshape(3, 4, d_in),
      np.asarray(g[n]).reshape(3, 4, -1),
      True,
      3,
      "expand",
    )
    p, u = grads["params"][n], updates["params"][n]
    v = np.concatenate([p["kernel"].reshape(d_in, -1), p["bias"].reshape(1, -1)])
    got = np.concatenate([u["kernel"].reshape(d_in, -1), u["bias"].reshape(1, -1)])
    _check(tx, state, got, grads, name, a_ref, g_ref, v)


# -------------------------------------------------------------------------- embedding

VOCAB, FEATURES = 7, 4


class TiedLM(nn.Module):
  """Embedding lookup, a dense layer, and logits from the same embedding."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(VOCAB, FEATURES, param_dtype=F64)
    h = jnp.tanh(nn.Dense(FEATURES, param_dtype=F64)(embed(ids)))
    return embed.attend(h)


def _tied_by_hand(params, ids, eps):
  p = params["params"]
  table = p["Embed_0"]["embedding"]
  h = jnp.tanh((table[ids] + eps["lookup"]) @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
  return h @ table.T + eps["attend"], h


def test_embedding_lookup_and_tied_attend_share_factors(x64):
  model = TiedLM()
  ids = jax.random.randint(jax.random.key(0), (3, 5), 0, VOCAB)
  params = model.init(jax.random.key(1), ids)
  labels = jax.random.randint(jax.random.key(2), (3, 5), 0, VOCAB)

  def head(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum(-1).mean()

  grads, _, tx, state, updates = one_update(
    lambda p, ids: head(model.apply(p, ids)), params, ids, damping=DAMPING, factor_dtype=F64
  )
  spec, treatment = next((s, t) for s, t in tx.plan.layers if s.name == "Embed_0")
  assert spec.methods == ("__call__", "attend") and treatment.diagonal == (True, False)

  eps = {"lookup": jnp.zeros((3, 5, FEATURES), F64), "attend": jnp.zeros((3, 5, VOCAB), F64)}
  logits, h = _tied_by_hand(params, ids, eps)
  np.testing.assert_allclose(logits, model.apply(params, ids), rtol=1e-12)
  g = jax.grad(lambda e: head(_tied_by_hand(params, ids, e)[0]))(eps)
  counts = np.bincount(np.asarray(ids).reshape(-1), minlength=VOCAB) / ids.size
  # Every use of the weight counts alike: the vocabulary side (A, diagonal) is
  # a mean over the 30 uses, the features side (G) a sum over an example's uses
  # and a mean over the n = 3 examples. Lookup: token frequencies on the
  # vocabulary side, n g on the features side. Attend uses the weight
  # transposed: n times the logits' gradient on the vocabulary side, the input
  # h on the features side.
  g_logits = ref.input_factor(3.0 * np.asarray(g["attend"]).reshape(-1, VOCAB))
  a_ref = np.diag(0.5 * (counts + np.diag(g_logits)))
  h_rows = np.asarray(h).reshape(-1, FEATURES)
  g_ref = (
    ref.output_factor(np.asarray(g["lookup"]).reshape(-1, FEATURES), n=3) + h_rows.T @ h_rows / 3
  )
  v = np.asarray(grads["params"]["Embed_0"]["embedding"])
  got = np.asarray(updates["params"]["Embed_0"]["embedding"])
  _check(tx, state, got, grads, "Embed_0", a_ref, g_ref, v)


class Readout(nn.Module):
  """A tied output layer alone: ``Embed.attend``."""

  @nn.compact
  def __call__(self, h):
    return nn.Embed(VOCAB, FEATURES, param_dtype=F64).attend(h)


def test_attend_on_one_query_without_a_batch_axis_is_one_example(x64):
  """``attend(h)`` with ``h`` of shape ``(features,)``: the factors of the same query batched as one."""
  h = jax.random.normal(jax.random.key(5), (FEATURES,), F64)
  params = Readout().init(jax.random.key(6), h)

  def factors(query):
    *_, tx, state, _ = one_update(
      lambda p, q: jnp.sum(jnp.sin(Readout().apply(p, q))), params, query, factor_dtype=F64
    )
    return kaisa_jax.layer_factors(tx.plan, state)

  unbatched, batched = factors(h), factors(h[None])
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12), unbatched, batched)


# -------------------------------------------------------------------- custom layers


class Affine(nn.Module):
  """A user's own dense layer: ``x @ w + b`` with its own parameter names."""

  features: int

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
    return x @ w + self.param("b", nn.initializers.normal(1.0), (self.features,))


def test_registered_custom_layer_is_preconditioned_like_dense():
  x = jax.random.normal(jax.random.key(0), (8, 5))
  custom = nn.Sequential([Affine(4), jnp.tanh, Affine(3)])
  params = custom.init(jax.random.key(1), x)

  def loss(model):
    return lambda p, x: jnp.mean(model.apply(p, x) ** 2)

  before = kaisa_jax.value_and_grad(loss(custom)).layers(params, x)
  assert not before.specs and {k.module_type for k in before.skipped} == {"Affine"}

  kaisa_jax.register_layer(Affine, weight="w", bias="b")
  grads, _, tx, _, updates = one_update(loss(custom), params, x, damping=DAMPING)
  assert [s.name for s, _ in tx.plan.layers] == ["layers_0", "layers_2"]

  dense = nn.Sequential([nn.Dense(4), jnp.tanh, nn.Dense(3)])
  dense_params = {
    "params": {k: {"kernel": v["w"], "bias": v["b"]} for k, v in params["params"].items()}
  }
  _, _, _, _, expected = one_update(loss(dense), dense_params, x, damping=DAMPING)
  for k in ("layers_0", "layers_2"):
    np.testing.assert_allclose(
      updates["params"][k]["w"], expected["params"][k]["kernel"], rtol=1e-5
    )
    np.testing.assert_allclose(updates["params"][k]["b"], expected["params"][k]["bias"], rtol=1e-5)
    assert not np.allclose(updates["params"][k]["w"], grads["params"][k]["w"], rtol=1e-2)


def test_register_layer_rejects_bad_arguments():
  with pytest.raises(TypeError, match="Module class"):
    kaisa_jax.register_layer(lambda x: x)
  with pytest.raises(ValueError, match="in_ndim"):
    kaisa_jax.register_layer(Affine, in_ndim=0)
  with pytest.raises(ValueError, match="no method 'project'"):
    kaisa_jax.register_layer(Affine, method="project")


# -------------------------------------------------------------------- normalisation


def _normalised(x, axes, epsilon):
  mean = x.mean(axis=axes, keepdims=True)
  return (x - mean) / np.sqrt(x.var(axis=axes, keepdims=True) + epsilon)


@pytest.mark.parametrize("layer_type", ["layer_norm", "batch_norm"])
@pytest.mark.parametrize("normalization", ["block", "diagonal"])
def test_normalisation_scale_and_bias_match_per_example_fisher(x64, layer_type, normalization):
  if layer_type == "layer_norm":
    layer = nn.LayerNorm(param_dtype=F64)
    apply = lambda p, x: layer.apply(p, x)  # noqa: E731
    axes = -1
  else:
    layer = nn.BatchNorm(use_running_average=False, param_dtype=F64)
    apply = lambda p, x: layer.apply(p, x, mutable=["batch_stats"])[0]  # noqa: E731
    axes = (0, 1)
  x = 2.0 + jax.random.normal(jax.random.key(0), (4, 3, 5), F64)
  params = layer.init(jax.random.key(1), x)
  params = jax.tree.map(lambda p: p + jax.random.normal(jax.random.key(2), p.shape, F64), params)
  head = _head(jax.random.normal(jax.random.key(3), (4, 3, 5), F64))

  def loss_fn(p, x):
    return head(apply(p, x))

  grad_fn = kaisa_jax.value_and_grad(loss_fn, normalization=normalization)
  layers = grad_fn.layers(params, x)
  (spec,) = layers.specs
  assert spec.kind == layer_type and spec.groups == 5
  # The exact block whatever the method asked for (the inverse method would damp
  # G = 1 too).
  tx = kaisa_jax.kfac(
    layers,
    damping=DAMPING,
    factor_dtype=F64,
    compute_method="inverse",
    **{
      "factor_decay": 0.0,
      "factor_update_steps": 1,
      "inv_update_steps": 1,
      "step_norm": "natural",
    },
  )
  _, grads, curvature = grad_fn(params, x)
  updates, _ = tx.update(grads, tx.init(params), params, curvature=curvature)

  xhat = _normalised(np.asarray(x), axes, layer.epsilon)
  p = params["params"]
  y = xhat * np.asarray(p["scale"]) + np.asarray(p["bias"])
  np.testing.assert_allclose(apply(params, x), y, rtol=1e-10)
  g = np.asarray(jax.grad(head)(jnp.asarray(y)))
  per_example = np.stack([(xhat * g).sum(1), g.sum(1)], axis=-1)  # (examples, features, 2)
  for f in range(5):
    block = 4.0 * per_example[:, f].T @ per_example[:, f]  # (1/n) sum (n v)(n v)^T, n = 4
    if normalization == "diagonal":
      block = np.diag(np.diag(block))
    v = np.asarray([grads["params"]["scale"][f], grads["params"]["bias"][f]])
    expected = np.linalg.solve(block + DAMPING * np.eye(2), v)
    got = [updates["params"]["scale"][f], updates["params"]["bias"][f]]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert not np.allclose(got, v, rtol=1e-2)


def test_normalisation_passes_through_by_default():
  layer = nn.LayerNorm()
  x = jax.random.normal(jax.random.key(0), (4, 5))
  params = layer.init(jax.random.key(1), x)
  layers = kaisa_jax.value_and_grad(lambda p, x: jnp.sum(layer.apply(p, x) ** 3)).layers(params, x)
  assert not layers.specs
  (skipped,) = layers.skipped
  assert "normalization=" in skipped.reason
  # Asked for, only the normalisation layer's input side becomes diagonal.
  model = nn.Sequential([nn.Dense(5), nn.LayerNorm()])
  params = model.init(jax.random.key(1), x)
  grad_fn = kaisa_jax.value_and_grad(
    lambda p, x: jnp.sum(model.apply(p, x) ** 3), normalization="diagonal"
  )
  specs = {s.kind: s for s in grad_fn.layers(params, x).specs}
  assert specs["layer_norm"].diagonal_input and not specs["dense"].diagonal_input
  with pytest.raises(ValueError, match="normalization must be None or one of"):
    kaisa_jax.value_and_grad(lambda p, x: 0.0, normalization="exact")


# ------------------------------------------------------------------------ Flax NNX


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(VOCAB, 6)
    h = embed(ids)
    h = nn.relu(nn.Conv(6, (3,), padding="SAME")(h))
    h = h + nn.MultiHeadDotProductAttention(2)(h)
    h = jnp.tanh(nn.Dense(6)(h))
    return embed.attend(h)


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, 6, rngs=rngs)
    self.conv = nnx.Conv(6, 6, (3,), padding="SAME", rngs=rngs)
    self.attention = nnx.MultiHeadAttention(2, 6, decode=False, rngs=rngs)
    self.dense = nnx.Linear(6, 6, rngs=rngs)

  def __call__(self, ids):
    h = self.embed(ids)
    h = nnx.relu(self.conv(h))
    h = h + self.attention(h)
    return self.embed.attend(jnp.tanh(self.dense(h)))


def test_nnx_and_linen_networks_precondition_alike():
  ids = jax.random.randint(jax.random.key(0), (3, 5), 0, VOCAB)
  labels = jax.random.randint(jax.random.key(1), (3, 5), 0, VOCAB)

  def head(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  linen = LinenNet()
  linen_params = linen.init(jax.random.key(2), ids)
  graphdef, nnx_params = nnx.split(NNXNet(nnx.Rngs(3)), nnx.Param)
  # The same weights in both: linen name -> NNX attribute.
  names = {
    "Embed_0": "embed",
    "Conv_0": "conv",
    "Dense_0": "dense",
    "MultiHeadDotProductAttention_0": "attention",
  }
  p = linen_params["params"]
  for linen_name, attr in names.items():
    for leaf, value in jax.tree_util.tree_flatten_with_path(p[linen_name])[0]:
      keys = [str(k.key) for k in leaf]
      target = nnx_params[attr]
      for k in keys[:-1]:
        target = target[k]
      target[keys[-1]].set_value(value)

  def nnx_loss(params, ids):
    return head(nnx.merge(graphdef, params)(ids))

  np.testing.assert_allclose(
    nnx_loss(nnx_params, ids), head(linen.apply(linen_params, ids)), rtol=1e-6
  )
  _, _, tx, _, linen_updates = one_update(
    lambda p, ids: head(linen.apply(p, ids)), linen_params, ids, damping=DAMPING
  )
  _, _, nnx_tx, _, nnx_updates = one_update(nnx_loss, nnx_params, ids, damping=DAMPING)
  assert len(nnx_tx.plan.layers) == len(tx.plan.layers) == 7
  assert [s.kind for s, _ in nnx_tx.plan.layers] == [s.kind for s, _ in tx.plan.layers]
  for linen_name, attr in names.items():
    for leaf, value in jax.tree_util.tree_flatten_with_path(linen_updates["params"][linen_name])[0]:
      keys = [str(k.key) for k in leaf]
      target = nnx_updates[attr]
      for k in keys:
        target = target[k]
      np.testing.assert_allclose(target.get_value(), value, rtol=2e-4, atol=1e-6)
