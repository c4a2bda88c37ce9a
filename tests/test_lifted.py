"""Layers inside nn.scan, nn.remat and nn.vmap against the same network written out.

The reference for each lifted model is the same network with the transformation
unrolled by hand (the same weights, layer by layer): its factors and its
preconditioned gradients are what the lifted model's must be. The unrolled
network itself is checked against numpy in the other test files.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_update
from flax import nnx

import kaisa_jax

F64 = jnp.float64
WIDTH = 6
STACK = 4


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    return jnp.tanh(nn.Dense(WIDTH, param_dtype=F64)(x)), None


class Scanned(nn.Module):
  """A Dense, a scanned stack of ``STACK`` blocks, an output Dense."""

  remat: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH, param_dtype=F64)(x)
    block = nn.remat(Block) if self.remat else Block
    stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=STACK)
    x, _ = stack(name="stack")(x, None)
    return nn.Dense(3, param_dtype=F64)(x)


class Unrolled(nn.Module):
  """`Scanned` with the stack written out."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH, param_dtype=F64, name="first")(x)
    for i in range(STACK):
      x = jnp.tanh(nn.Dense(WIDTH, param_dtype=F64, name=f"block{i}")(x))
    return nn.Dense(3, param_dtype=F64, name="last")(x)


def _loss(model, target):
  def loss(params, x):
    return jnp.mean(jnp.sum((model.apply(params, x) - target) ** 2, axis=-1))

  return loss


def _unroll(scanned):
  """The `Unrolled` params holding `Scanned`'s weights."""
  p = scanned["params"]
  stack = p["stack"]["Dense_0"]
  out = {"first": p["Dense_0"], "last": p["Dense_1"]}
  for i in range(STACK):
    out[f"block{i}"] = jax.tree.map(lambda w, i=i: w[i], stack)
  return {"params": out}


@pytest.fixture(scope="module")
def data():
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(0), (8, 5), F64)
    target = jax.random.normal(jax.random.key(1), (8, 3), F64)
    yield x, target


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan-of-remat"])
def test_scanned_stack_has_one_set_of_factors_per_layer(x64, data, remat):
  x, target = data
  model = Scanned(remat=remat)
  params = model.init(jax.random.key(2), x)
  assert params["params"]["stack"]["Dense_0"]["kernel"].shape == (STACK, WIDTH, WIDTH)
  grads, curv, tx, state, updates = one_update(_loss(model, target), params, x, damping=0.05)
  ref_params = _unroll(params)
  ref_grads, ref_curv, ref_tx, ref_state, ref_updates = one_update(
    _loss(Unrolled(), target), ref_params, x, damping=0.05
  )
  names = [s.name for s, _ in tx.plan.layers]
  assert names == ["Dense_0", *(f"stack/Dense_0[{i}]" for i in range(STACK)), "Dense_1"]
  assert not tx.plan.skipped
  mine = kaisa_jax.layer_factors(tx.plan, state)
  theirs = kaisa_jax.layer_factors(ref_tx.plan, ref_state)
  pairs = [("Dense_0", "first"), ("Dense_1", "last")]
  pairs += [(f"stack/Dense_0[{i}]", f"block{i}") for i in range(STACK)]
  for name, ref_name in pairs:
    np.testing.assert_allclose(curv[name].a[0], ref_curv[ref_name].a[0], rtol=1e-12)
    np.testing.assert_allclose(curv[name].g[0], ref_curv[ref_name].g[0], rtol=1e-10, atol=1e-14)
    for f in ("a", "g"):
      np.testing.assert_allclose(
        getattr(mine[name], f), getattr(theirs[ref_name], f), rtol=1e-10, atol=1e-14
      )
  # The blocks' factors differ from each other: each slot got its own layer's data.
  assert not np.allclose(mine["stack/Dense_0[0]"].a, mine["stack/Dense_0[1]"].a)
  stacked = updates["params"]["stack"]["Dense_0"]
  for i in range(STACK):
    for key in ("kernel", "bias"):
      np.testing.assert_allclose(
        stacked[key][i], ref_updates["params"][f"block{i}"][key], rtol=1e-8, atol=1e-12
      )
  np.testing.assert_allclose(
    grads["params"]["stack"]["Dense_0"]["kernel"][2],
    ref_grads["params"]["block2"]["kernel"],
    rtol=1e-12,
  )
  assert not np.allclose(stacked["kernel"], grads["params"]["stack"]["Dense_0"]["kernel"])


class Recurrent(nn.Module):
  """One Dense cell applied ``STACK`` times by nn.scan with broadcast params."""

  @nn.compact
  def __call__(self, x):
    cell = nn.scan(
      Block,
      variable_broadcast="params",
      split_rngs={"params": False},
      length=STACK,
    )
    x, _ = cell(name="cell")(x, None)
    return x


class RecurrentUnrolled(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(WIDTH, param_dtype=F64, name="cell")
    for _ in range(STACK):
      x = jnp.tanh(dense(x))
    return x


def test_scan_with_shared_params_accumulates_every_step(x64):
  x = jax.random.normal(jax.random.key(0), (8, WIDTH), F64)
  target = jax.random.normal(jax.random.key(1), (8, WIDTH), F64)
  params = Recurrent().init(jax.random.key(2), x)
  _, curv, tx, state, updates = one_update(_loss(Recurrent(), target), params, x, damping=0.05)
  ref_params = {"params": {"cell": params["params"]["cell"]["Dense_0"]}}
  _, ref_curv, ref_tx, ref_state, ref_updates = one_update(
    _loss(RecurrentUnrolled(), target), ref_params, x, damping=0.05
  )
  ((spec, _),) = tx.plan.layers
  assert (spec.name, spec.calls) == ("cell/Dense_0", STACK)
  for k in range(STACK):
    np.testing.assert_allclose(curv["cell/Dense_0"].a[k], ref_curv["cell"].a[k], rtol=1e-12)
    np.testing.assert_allclose(
      curv["cell/Dense_0"].g[k], ref_curv["cell"].g[k], rtol=1e-10, atol=1e-14
    )
  mine = kaisa_jax.layer_factors(tx.plan, state)["cell/Dense_0"]
  theirs = kaisa_jax.layer_factors(ref_tx.plan, ref_state)["cell"]
  np.testing.assert_allclose(mine.a, theirs.a, rtol=1e-10)
  np.testing.assert_allclose(mine.g, theirs.g, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(
    updates["params"]["cell"]["Dense_0"]["kernel"],
    ref_updates["params"]["cell"]["kernel"],
    rtol=1e-8,
  )


class Ensemble(nn.Module):
  """nn.vmap over members with their own params, and over positions with shared ones."""

  @nn.compact
  def __call__(self, x):  # x: (batch, positions, features)
    members = nn.vmap(
      nn.Dense,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=None,
      axis_size=3,
    )(WIDTH, param_dtype=F64, name="members")
    h = jnp.tanh(members(x))  # (3, batch, positions, WIDTH)
    shared = nn.vmap(
      nn.Dense,
      variable_axes={"params": None},
      split_rngs={"params": False},
      in_axes=1,
      out_axes=1,
    )(2, param_dtype=F64, name="shared")
    return shared(h.mean(axis=0))  # mapped over positions


class EnsembleUnrolled(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = [jnp.tanh(nn.Dense(WIDTH, param_dtype=F64, name=f"member{i}")(x)) for i in range(3)]
    h = sum(h) / 3
    shared = nn.Dense(2, param_dtype=F64, name="shared")
    return jnp.stack([shared(h[:, p]) for p in range(h.shape[1])], axis=1)


def test_vmapped_layers(x64):
  x = jax.random.normal(jax.random.key(0), (8, 4, 5), F64)
  target = jax.random.normal(jax.random.key(1), (8, 4, 2), F64)
  params = Ensemble().init(jax.random.key(2), x)
  assert params["params"]["members"]["kernel"].shape == (3, 5, WIDTH)
  _, _, tx, state, updates = one_update(_loss(Ensemble(), target), params, x, damping=0.05)
  p = params["params"]
  ref_params = {"params": {"shared": p["shared"]}}
  for i in range(3):
    ref_params["params"][f"member{i}"] = jax.tree.map(lambda w, i=i: w[i], p["members"])
  _, _, ref_tx, ref_state, ref_updates = one_update(
    _loss(EnsembleUnrolled(), target), ref_params, x, damping=0.05
  )
  names = sorted(s.name for s, _ in tx.plan.layers)
  assert names == ["members[0]", "members[1]", "members[2]", "shared"]
  assert dict((s.name, s.calls) for s, _ in tx.plan.layers)["shared"] == 4  # one call per position
  mine = kaisa_jax.layer_factors(tx.plan, state)
  theirs = kaisa_jax.layer_factors(ref_tx.plan, ref_state)
  for name, ref_name in [(f"members[{i}]", f"member{i}") for i in range(3)] + [("shared",) * 2]:
    for f in ("a", "g"):
      np.testing.assert_allclose(
        getattr(mine[name], f), getattr(theirs[ref_name], f), rtol=1e-10, atol=1e-14
      )
  for i in range(3):
    np.testing.assert_allclose(
      updates["params"]["members"]["kernel"][i],
      ref_updates["params"][f"member{i}"]["kernel"],
      rtol=1e-8,
    )
  np.testing.assert_allclose(
    updates["params"]["shared"]["kernel"], ref_updates["params"]["shared"]["kernel"], rtol=1e-8
  )


def test_what_is_not_followed_is_listed_and_passed_through():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, flag):
      dense = nn.Dense(4, name="in_cond")
      # A layer applied under lax.cond: kaisa_jax does not follow cond branches.
      x = nn.cond(flag, lambda m, x: m(x), lambda m, x: m(-x), dense, x)
      # Params stacked along axis 1, not 0.
      moved = nn.vmap(
        nn.Dense,
        variable_axes={"params": 1},
        split_rngs={"params": True},
        in_axes=None,
        axis_size=2,
      )(3, name="moved")
      return nn.Dense(2, name="out")(moved(x).sum(0))

  model = Model()
  x = jnp.ones((5, 4))
  params = model.init(jax.random.key(0), x, True)

  def loss_fn(params, x):
    return jnp.sum(model.apply(params, x, True) ** 2)

  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  layers = grad_fn.layers(params, x)
  assert [s.name for s in layers.specs] == ["out"]
  reasons = {k.name: k.reason for k in layers.skipped}
  assert "does not follow" in reasons["in_cond"], reasons
  assert "variable_axes" in reasons["moved"], reasons
  with pytest.warns(
    UserWarning, match="2 module\\(s\\) with parameters will not be preconditioned"
  ):
    tx = kaisa_jax.kfac(layers, step_norm="natural")
  _, grads, curvature = jax.jit(grad_fn)(params, x)
  updates, _ = tx.update(grads, tx.init(params), params, curvature=curvature)
  for name in ("in_cond", "moved"):
    np.testing.assert_array_equal(
      updates["params"][name]["kernel"], grads["params"][name]["kernel"]
    )


def test_nnx_modules_that_are_not_captured_are_listed():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(3, 3, rngs=rngs)
      self.norm = nnx.LayerNorm(3, rngs=rngs)
      self.lifted = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
      x = self.norm(self.dense(x))
      return nnx.remat(lambda layer, x: layer(x))(self.lifted, x)

  graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, x):
    return jnp.sum(nnx.merge(graphdef, params)(x) ** 2)

  layers = kaisa_jax.value_and_grad(loss_fn).layers(params, jnp.ones((2, 3)))
  assert [s.name for s in layers.specs] == ["dense"]
  reasons = {k.name: k.reason for k in layers.skipped}
  assert sorted(reasons) == ["lifted", "norm"]
  assert "Linear applied inside nnx.scan, nnx.vmap or nnx.remat" in reasons["lifted"]
