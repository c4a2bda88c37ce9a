"""Common setups that must work or say what to change: a jitted apply, parameters no layer holds,
a learning rate warming up from 0, NNX's Optimizer, Optax's wrappers on a mesh and after a restore."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from distributed_setup import BATCH, BATCH_SPEC, KFAC, MODELS, _global, batches, initial_params
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kaisa_jax
from kaisa_jax import hyperparameters, preconditioning

XENT = optax.softmax_cross_entropy_with_integer_labels


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.tanh(nn.Dense(6)(x)))


MODEL = MLP()
X = jax.random.normal(jax.random.key(0), (8, 4))
Y = jnp.arange(8) % 3
PARAMS = MODEL.init(jax.random.key(1), X)


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------------ a jitted apply


def test_a_jitted_apply_already_run_raises_naming_jax_jit():
  apply = jax.jit(MODEL.apply)
  apply(PARAMS, X)  # compiled: calling it again runs no Python, so no layer is seen
  grad_fn = kaisa_jax.value_and_grad(lambda p, b: XENT(apply(p, b[0]), b[1]).mean())
  with pytest.raises(ValueError, match=r"jax\.jit-compiled.*Call model\.apply unjitted"):
    grad_fn.layers(PARAMS, (X, Y))
  with pytest.raises(ValueError, match=r"jax\.jit-compiled"):
    grad_fn(PARAMS, (X, Y))


def test_a_jitted_apply_not_run_yet_raises_naming_jax_jit():
  traces = []

  def apply(params, x):
    traces.append(1)
    return MODEL.apply(params, x)

  jitted = jax.jit(apply)
  grad_fn = kaisa_jax.value_and_grad(lambda p, b: XENT(jitted(p, b[0]), b[1]).mean())
  with pytest.raises(ValueError, match=r"jax\.jit-compiled.*jit the train step instead"):
    grad_fn.layers(PARAMS, (X, Y))
  assert len(traces) == 1  # the layers ran, in the jitted function's own trace
  # A jitted function that takes no parameter, or parameters the layers hold, is fine.
  head = jax.jit(lambda logits, y: XENT(logits, y).mean())
  penalty = jax.jit(lambda p: sum(jnp.vdot(w, w) for w in jax.tree.leaves(p)))
  layers = kaisa_jax.value_and_grad(
    lambda p, b: head(MODEL.apply(p, b[0]), b[1]) + penalty(p)
  ).layers(PARAMS, (X, Y))
  assert [s.name for s in layers.specs] == ["Dense_1", "Dense_0"] and not layers.skipped


def test_kfac_without_a_layer_to_precondition_raises():
  params = {"w": jnp.ones((4, 3))}
  layers = kaisa_jax.value_and_grad(lambda p, x: jnp.mean((x @ p["w"]) ** 2)).layers(params, X)
  assert not layers.specs and [k.name for k in layers.skipped] == ["w"]
  with pytest.raises(ValueError, match=r"no layer to precondition.*model\.apply\(params"):
    kaisa_jax.kfac(layers)


# --------------------------------------------------------------- parameters no layer holds


class Tokens(nn.Module):
  """A class token and position embeddings of its own, beside layers."""

  @nn.compact
  def __call__(self, x):
    cls = self.param("cls_token", nn.initializers.normal(1.0), (x.shape[-1],))
    pos = self.param("pos_embedding", nn.initializers.normal(1.0), (x.shape[-1],))
    x = nn.LayerNorm()(x + cls + pos)
    return nn.Dense(3)(nn.tanh(nn.Dense(6)(x)))


def test_parameters_of_no_layer_are_listed_with_the_reason():
  params = Tokens().init(jax.random.key(0), X)["params"]
  loose = {"model": params, "temperature": jnp.ones(())}

  def loss_fn(p, x, y):
    logits = Tokens().apply({"params": p["model"]}, x) * p["temperature"]
    return XENT(logits, y).mean()

  layers = kaisa_jax.value_and_grad(loss_fn).layers(loose, X, Y)
  assert [s.name for s in layers.specs] == ["Dense_1", "Dense_0"]
  reasons = {k.name: k.reason for k in layers.skipped}
  assert sorted(reasons) == ["LayerNorm_0", "Tokens", "temperature"]
  assert "cls_token, pos_embedding created with self.param directly" in reasons["Tokens"]
  assert "normalisation" in reasons["LayerNorm_0"]
  assert "read outside model.apply" in reasons["temperature"]


class NnxTokens(nnx.Module):
  def __init__(self, rngs):
    self.cls_token = nnx.Param(jnp.zeros((4,)))
    self.encoder = NnxEncoder(rngs)
    self.head = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(self.encoder(x + self.cls_token))


class NnxEncoder(nnx.Module):
  def __init__(self, rngs):
    self.pos_embedding = nnx.Param(jnp.zeros((4,)))
    self.norm = nnx.LayerNorm(4, rngs=rngs)
    self.dense = nnx.Linear(4, 6, rngs=rngs)

  def __call__(self, x):
    return nnx.tanh(self.dense(self.norm(x + self.pos_embedding)))


def test_nnx_parameters_of_no_layer_are_listed_with_the_reason():
  graphdef, params = nnx.split(NnxTokens(nnx.Rngs(0)), nnx.Param)

  def loss_fn(p, x, y):
    return XENT(nnx.merge(graphdef, p)(x), y).mean()

  layers = kaisa_jax.value_and_grad(loss_fn).layers(params, X, Y)
  assert [s.name for s in layers.specs] == ["encoder/dense", "head"]
  reasons = {k.name: k.reason for k in layers.skipped}
  assert sorted(reasons) == ["cls_token", "encoder/norm", "encoder/pos_embedding"]
  for name in ("cls_token", "encoder/pos_embedding"):
    assert "created with nnx.Param directly in a module" in reasons[name]
  assert "not a layer kind" in reasons["encoder/norm"]


class Affine(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x * self.param("scale", nn.initializers.ones, (x.shape[-1],))


class ManyAffine(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(12):
      x = Affine()(x)
    return nn.Dense(3)(x)


def test_warning_lists_one_module_a_line_and_stops_after_ten():
  model = ManyAffine()
  params = model.init(jax.random.key(0), X)
  layers = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2)).layers(params, X)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kaisa_jax.kfac(layers, step_norm="natural")
  (warning,) = caught
  lines = str(warning.message).splitlines()
  assert lines[0].startswith("kaisa_jax: 12 module(s) with parameters will not be preconditioned")
  assert [line.split()[0] for line in lines[1:11]] == [f"Affine_{i}" for i in range(10)]
  assert lines[11] == "  ... and 2 more; print(tx.plan) lists them all"
  assert max(map(len, lines)) < 200


# --------------------------------------------------------------------- a warmup from lr = 0


def test_a_learning_rate_warming_up_from_zero_trains():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 0.1, 10, 150)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x, y: XENT(MODEL.apply(p, x), y).mean())
  kfac = kaisa_jax.kfac(
    grad_fn.layers(PARAMS, X, Y),
    step_norm="natural",
    kl_clip=1e-3,
    lr=schedule,
    factor_update_steps=1,
  )
  tx = optax.chain(kfac, optax.sgd(schedule, momentum=0.9))

  @jax.jit
  def step(params, state):
    loss, grads, curvature = grad_fn(params, X, Y)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state, loss, updates

  params, state = PARAMS, tx.init(PARAMS)
  params, state, first, updates = step(params, state)  # at lr = 0 the KL clip's nu is 1
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  assert all(np.all(np.isfinite(s)) for s in jax.tree.leaves(state))
  for _ in range(30):
    params, state, loss, _ = step(params, state)
  assert float(loss) < 0.5 * float(first)
  one = preconditioning.kl_clip_scale(jnp.float32(3.0), jnp.float32(1e-3), jnp.float32(0.0))
  assert float(one) == 1.0


# ---------------------------------------------------------------------- NNX's Optimizer


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(4, 6, rngs=rngs)
    self.out = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.tanh(self.hidden(x)))


def test_nnx_optimizer_trains_as_the_plain_nnx_recipe():
  graphdef, params = nnx.split(NnxMLP(nnx.Rngs(0)), nnx.Param)

  def loss_fn(p, x, y):
    return XENT(nnx.merge(graphdef, p)(x), y).mean()

  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  kfac = kaisa_jax.kfac(grad_fn.layers(params, X, Y), factor_update_steps=1)
  tx = optax.chain(kfac, optax.sgd(0.1, momentum=0.9))

  @jax.jit
  def step(params, state, x, y):  # the plain recipe: split params, tx.init and tx.update
    _, grads, curvature = grad_fn(params, x, y)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(3):
    params, state = step(params, state, X, Y)

  model = NnxMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # init gets the variables

  @nnx.jit
  def optimizer_step(model, optimizer, x, y):  # update gets plain arrays, and curvature=
    _, grads, curvature = grad_fn(nnx.state(model, nnx.Param), x, y)
    optimizer.update(model, grads, curvature=curvature)

  for _ in range(3):
    optimizer_step(model, optimizer, X, Y)
  _assert_trees_equal(nnx.state(model, nnx.Param), params)
  assert int(optimizer.opt_state[0].count[...]) == 3


# ------------------------------------------------------- Optax's wrappers on a mesh, restored

MESH = kaisa_jax.make_mesh("hybrid_opt")  # 8 devices: 2 groups x 4 grad workers
MESH_PARAMS = initial_params("mlp")
XS, YS = batches(3)


def _mesh_loss(params, x, y):
  return XENT(MODELS["mlp"].apply(params, x), y).mean()


MESH_GRAD_FN = kaisa_jax.value_and_grad(_mesh_loss)
LOCAL = BATCH // MESH.size
MESH_LAYERS = MESH_GRAD_FN.layers(MESH_PARAMS, XS[0][:LOCAL], YS[0][:LOCAL])


def test_inject_hyperparams_with_a_mesh_says_to_keep_it_static():
  injected = optax.inject_hyperparams(
    kaisa_jax.kfac, static_args=("inv_update_steps", "max_cost_ratio")
  )(MESH_LAYERS, mesh=MESH, **KFAC)
  with pytest.raises(TypeError, match=r"list mesh in static_args.*'mesh'"):
    injected.init(MESH_PARAMS)
  # Listed in static_args, it trains: see the restore test below.
  assert "mesh" in hyperparameters.STATIC


def _wrapped(wrapper: str):
  """``(kfac, tx)``: K-FAC chained with SGD, under ``wrapper``."""
  kfac = kaisa_jax.kfac(MESH_LAYERS, mesh=MESH, **KFAC)
  if wrapper == "inject_hyperparams":
    injected = optax.inject_hyperparams(kaisa_jax.kfac, static_args=hyperparameters.STATIC)(
      MESH_LAYERS, mesh=MESH, **KFAC
    )
    return kfac, optax.chain(injected, optax.sgd(0.1, momentum=0.9))
  chain = optax.chain(kfac, optax.sgd(0.1, momentum=0.9))
  if wrapper == "multi_steps":
    return kfac, optax.MultiSteps(chain, every_k_schedule=2)
  return kfac, optax.apply_if_finite(chain, 5)


def _mesh_step(tx, specs):
  def step(params, state, x, y):
    _, grads, curvature = MESH_GRAD_FN(params, x, y)
    grads = jax.tree.map(lambda g: g / MESH.size, grads)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state

  return jax.jit(
    jax.shard_map(
      step, mesh=MESH, in_specs=(P(), specs, BATCH_SPEC, BATCH_SPEC), out_specs=(P(), specs)
    )
  )


@pytest.mark.parametrize("wrapper", ["apply_if_finite", "multi_steps", "inject_hyperparams"])
def test_restore_on_a_mesh_continues_under_optax_wrappers(tmp_path, wrapper):
  kfac, tx = _wrapped(wrapper)
  params = jax.tree.map(lambda a: _global(a, NamedSharding(MESH, P())), MESH_PARAMS)
  state = tx.init(params)
  step = _mesh_step(tx, kaisa_jax.partition_specs(state))
  inputs = [
    (_global(x, NamedSharding(MESH, BATCH_SPEC)), _global(y, NamedSharding(MESH, BATCH_SPEC)))
    for x, y in zip(XS, YS)
  ]

  def train(params, state, inputs):
    for x, y in inputs:
      # One step in flight at a time: emulated CPU devices can deadlock in a collective
      # when a second step is dispatched before the first has finished.
      params, state = jax.block_until_ready(step(params, state, x, y))
    return params, state

  uninterrupted, _ = train(params, state, inputs)
  saved_params, saved_state = train(params, state, inputs[:2])
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(
    tmp_path / "ckpt", {"params": saved_params, "opt": kaisa_jax.to_portable(kfac, saved_state)}
  )
  ckpt.wait_until_finished()
  # As after a restart: a fresh state as the target, the recipe of the README.
  target = {"params": params, "opt": kaisa_jax.to_portable(kfac, tx.init(params))}
  restored = ckpt.restore(tmp_path / "ckpt", target)
  resumed, _ = train(restored["params"], kaisa_jax.from_portable(kfac, restored["opt"]), inputs[2:])
  _assert_trees_equal(resumed, uninterrupted)
