"""Curvature statistics: against float64 numpy, under Optax wrappers, in jit, on a mesh; the warning."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxpr_tools
import numpy as np
import optax
import pytest
from distributed_setup import build
from jax.sharding import PartitionSpec as P

import kaisa_jax
from kaisa_jax import preconditioning, statistics


class Net(nn.Module):
  """A grouped convolution (two factors per side) and two dense layers."""

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Conv(4, (3,), feature_group_count=2)(x))
    x = nn.tanh(nn.Dense(6)(x.reshape(x.shape[0], -1)))
    return nn.Dense(3)(x)


X = jax.random.normal(jax.random.key(0), (24, 5, 2))
Y = jnp.arange(24) % 3
SETTINGS = dict(factor_decay=0.5, factor_update_steps=1, inv_update_steps=1)
# A method, alone or with the cost rule making some sides diagonal.
METHODS = {
  "eigen": dict(compute_method="eigen", max_cost_ratio=None),
  "inverse": dict(compute_method="inverse", max_cost_ratio=None),
  "eigen, diagonal sides": dict(compute_method="eigen", max_cost_ratio=0.5),
  "inverse, diagonal sides": dict(compute_method="inverse", max_cost_ratio=0.5),
}


def _loss(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(Net().apply(params, x), y).mean()


@functools.cache
def _trained(method: str, steps: int = 3, **kwargs):
  """``(kfac, opt_state)`` of ``optax.chain(kfac, sgd)`` after ``steps`` steps."""
  grad_fn = kaisa_jax.value_and_grad(_loss)
  params = Net().init(jax.random.key(1), X)
  kfac = kaisa_jax.kfac(grad_fn.layers(params, X, Y), **{**SETTINGS, **METHODS[method], **kwargs})
  tx = optax.chain(kfac, optax.sgd(0.1))

  @jax.jit
  def step(params, opt_state, x, y):
    _, grads, curvature = grad_fn(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, curvature=curvature)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  for k in range(steps):
    params, opt_state = step(params, opt_state, X * (1 + 0.1 * k), Y)
  return kfac, opt_state


def _reference(kfac, state, damping: float) -> dict:
  """Float64 numpy: per layer ``(a_min, a_max, a_mean, g_min, g_max, g_mean, relative, condition)``."""
  out = {}
  for (spec, t), (name, f) in zip(
    kfac.plan.layers, kaisa_jax.layer_factors(kfac.plan, state).items(), strict=True
  ):
    assert spec.name == name
    sides = []
    for factor, diagonal in zip(f, t.diagonal, strict=True):
      factor = np.asarray(factor, np.float64)
      if spec.groups == 1:
        factor = factor[None]
      values = factor if diagonal else np.linalg.eigvalsh(factor)
      sides.append(np.maximum(values, 0.0).reshape(spec.groups, -1))
    a, g = sides
    ext = [(a.min(1), g.min(1)), (a.max(1), g.max(1))]
    form = kfac.plan.damping_form
    # The damping's shares of each factor, per group (kaisa: all of it on both).
    ma, mg = a.mean(1), g.mean(1)
    bounded = np.minimum(damping, ma * mg)
    sa, sg = {
      "kaisa": (damping, damping),
      "pi": (np.sqrt(damping * ma / mg), np.sqrt(damping * mg / ma)),
      "bounded": (np.sqrt(bounded * ma / mg), np.sqrt(bounded * mg / ma)),
      "relative": (np.sqrt(damping) * ma, np.sqrt(damping) * mg),
    }[form]
    if t.method == "eigen" and form == "kaisa":
      lo, hi = (x * y + damping for x, y in ext)
    else:
      lo, hi = ((x + sa) * (y + sg) for x, y in ext)
    scale = np.mean(ma * mg)
    absolute = np.mean(sa * sg) if form in ("relative", "bounded") else damping
    out[name] = (a.min(), a.max(), a.mean(), g.min(), g.max(), g.mean())
    out[name] += (absolute / scale, hi.max() / lo.min())
  return out


def _flat(stats: statistics.CurvatureStatistics) -> dict:
  return {name: (*s.a, *s.g, s.relative_damping, s.condition) for name, s in stats.layers.items()}


def _assert_close(stats, reference, rtol=2e-4):
  got = _flat(stats)
  assert got.keys() == reference.keys()
  for name, values in reference.items():
    scale = max(abs(values[1]), abs(values[4]))  # eigenvalues: error relative to the largest
    for i, (x, r) in enumerate(zip(got[name], values, strict=True)):
      atol = 1e-6 * scale if i < 6 else 0.0
      np.testing.assert_allclose(float(x), r, rtol=rtol, atol=atol, err_msg=f"{name} entry {i}")


@pytest.mark.parametrize("method", list(METHODS))
def test_statistics_equal_a_float64_computation_from_the_factors(method):
  kfac, opt_state = _trained(method)
  diagonal = [d for _, t in kfac.plan.layers for d in t.diagonal]
  assert any(diagonal) == method.endswith("diagonal sides") and not all(diagonal)
  assert {t.method for _, t in kfac.plan.layers} == {METHODS[method]["compute_method"]}
  stats = kaisa_jax.curvature_statistics(kfac, opt_state)
  reference = _reference(kfac, opt_state[0], preconditioning.DEFAULT_DAMPING)
  _assert_close(stats, reference)
  # Not trivially equal: the layers' conditioning differs, and differs from 1.
  conditions = [v[-1] for v in reference.values()]
  assert min(conditions) > 1.5 and max(conditions) > 1.5 * min(conditions)
  assert float(stats.damping) == np.float32(preconditioning.DEFAULT_DAMPING)
  state = opt_state[0]
  assert int(stats.steps) == 3 == int(state.count)
  assert int(stats.skipped_factor_updates) == 0 and int(stats.failed_decompositions) == 0
  np.testing.assert_array_equal(stats.kl_scale, state.kl_scale)


@pytest.mark.parametrize("form", ["pi", "bounded", "relative"])
@pytest.mark.parametrize("method", ["eigen", "inverse, diagonal sides"])
def test_statistics_of_the_factored_damping_forms(method, form):
  """A factored form damps both sides by shares: the same condition number for either method."""
  kfac, opt_state = _trained(method, damping_form=form)
  stats = kaisa_jax.curvature_statistics(kfac, opt_state)
  reference = _reference(kfac, opt_state[0], preconditioning.DEFAULT_DAMPING)
  _assert_close(stats, reference)
  if form == "relative":  # the damping is in units of the curvature already
    for s in stats.layers.values():
      np.testing.assert_allclose(
        float(s.relative_damping), preconditioning.DEFAULT_DAMPING, rtol=1e-5
      )
    # The default damping sits on the threshold: rounding below it is not negligible.
    assert kaisa_jax.check_damping(stats, "natural") == ({}, {})
  if form == "bounded":  # at most the layer's curvature, and here the bound acts on some layers
    relative = [float(s.relative_damping) for s in stats.layers.values()]
    assert max(relative) == pytest.approx(1.0, rel=1e-5) and min(relative) < 0.9


def test_a_damping_schedule_is_read_at_the_last_step():
  schedule = optax.linear_schedule(1e-2, 1e-3, 10)
  kfac, opt_state = _trained("eigen", damping=schedule)
  stats = kaisa_jax.curvature_statistics(kfac, opt_state)
  assert float(stats.damping) == pytest.approx(float(schedule(2)))  # 3 steps: 0, 1, 2
  _assert_close(stats, _reference(kfac, opt_state[0], float(schedule(2))))
  given = kaisa_jax.curvature_statistics(kfac.plan, opt_state, damping=0.5)
  _assert_close(given, _reference(kfac, opt_state[0], 0.5))
  with pytest.raises(TypeError, match="needs the damping"):
    kaisa_jax.curvature_statistics(kfac.plan, opt_state)


def _replace_kfac_state(tree, state):
  is_state = lambda x: isinstance(x, kaisa_jax.KFACState)  # noqa: E731
  return jax.tree.map(lambda x: state if is_state(x) else x, tree, is_leaf=is_state)


def test_found_alike_under_optax_wrappers():
  kfac, opt_state = _trained("eigen")
  state = opt_state[0]
  expected = kaisa_jax.curvature_statistics(kfac, opt_state)
  params = Net().init(jax.random.key(1), X)
  chain = optax.chain(kfac, optax.sgd(0.1))
  static = ("inv_update_steps", "max_cost_ratio", "grad_worker_fraction", "axis_size")
  injected = optax.inject_hyperparams(kaisa_jax.kfac, static_args=static)(
    _layers(), **SETTINGS, **METHODS["eigen"]
  )
  wrappers = {
    "kfac": kfac,
    "chain": chain,
    "apply_if_finite": optax.apply_if_finite(chain, 3),
    "MultiSteps": optax.MultiSteps(chain, 2),
    "MultiSteps(apply_if_finite)": optax.MultiSteps(optax.apply_if_finite(chain, 3), 2),
    "inject_hyperparams": optax.chain(injected, optax.sgd(0.1)),
  }
  for name, tx in wrappers.items():
    wrapped = _replace_kfac_state(tx.init(params), state)
    stats = kaisa_jax.curvature_statistics(kfac, wrapped)
    for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(expected), strict=True):
      np.testing.assert_array_equal(a, b, err_msg=name)
  # An injected damping is the one used: here changed between steps.
  wrapped = _replace_kfac_state(wrappers["inject_hyperparams"].init(params), state)
  wrapped[0].hyperparams["damping"] = jnp.float32(0.25)
  stats = kaisa_jax.curvature_statistics(kfac, wrapped)
  assert float(stats.damping) == 0.25
  _assert_close(stats, _reference(kfac, state, 0.25))
  # Exactly one K-FAC state, or a clear error.
  with pytest.raises(ValueError, match="has 2"):
    kaisa_jax.curvature_statistics(kfac, (opt_state, opt_state))
  with pytest.raises(ValueError, match="has 0"):
    kaisa_jax.curvature_statistics(kfac, optax.sgd(0.1).init(params))


@functools.cache
def _layers():
  grad_fn = kaisa_jax.value_and_grad(_loss)
  return grad_fn.layers(Net().init(jax.random.key(1), X), X, Y)


def test_inside_jit_equal_and_no_decomposition_for_the_eigen_method():
  for method in ("eigen", "inverse"):
    kfac, opt_state = _trained(method)
    fn = functools.partial(kaisa_jax.curvature_statistics, kfac)
    eager, jitted = fn(opt_state), jax.jit(fn)(opt_state)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-6)
    eighs = jaxpr_tools.count(jax.make_jaxpr(fn)(opt_state).jaxpr, "eigh")
    dense = sum(not d for _, t in kfac.plan.layers for d in t.diagonal)
    # The eigen method reads the stored eigenvalues; the inverse method decomposes each factor.
    assert eighs == (0 if method == "eigen" else dense), method


# ------------------------------------------------------------------------------ devices


@functools.cache
def _distributed(mode: str, n: int, fraction: str):
  """``(kfac, state)`` after 4 chained steps of the CNN of the distributed tests."""
  fn, (params, state), inputs, kfac = build("cnn", mode, n, fraction, 4, chained=True)
  for x, y in inputs:
    params, state, _ = jax.block_until_ready(fn(params, state, x, y))
  return kfac, state


@pytest.mark.parametrize(
  "mode, fraction", [("shard_map", "1/8"), ("shard_map", "1/2"), ("pmap", "1/2")]
)
def test_a_mesh_and_pmap_give_the_single_device_statistics(mode, fraction):
  kfac1, state1 = _distributed("single", 1, "1")
  single = kaisa_jax.curvature_statistics(kfac1, state1)
  assert float(single.kl_scale) < 1  # the clip is active: its scale is compared too
  kfac, state = _distributed(mode, 8, fraction)
  stats = kaisa_jax.curvature_statistics(kfac, state)
  jitted = jax.jit(functools.partial(kaisa_jax.curvature_statistics, kfac))(state)
  for got in (stats, jitted):
    assert got.layers.keys() == single.layers.keys()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(single), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_one_device_view_raises():
  kfac, state = _distributed("shard_map", 8, "1/2")
  specs = kaisa_jax.partition_specs(state)
  inside = jax.shard_map(
    lambda s: kaisa_jax.curvature_statistics(kfac, s).kl_scale,
    mesh=kfac.plan.mesh,
    in_specs=(specs,),
    out_specs=P(),
  )
  with pytest.raises(ValueError, match="one device's view"):
    jax.jit(inside)(state)
  kfac, state = _distributed("pmap", 8, "1/2")
  with pytest.raises(ValueError, match="one device's view"):
    jax.pmap(lambda s: kaisa_jax.curvature_statistics(kfac, s).kl_scale, axis_name="batch")(state)
  with pytest.raises(ValueError, match="one device's view"):
    kaisa_jax.curvature_statistics(kfac, jax.tree.map(lambda a: a[0], state))


# ------------------------------------------------------------------------------ KL clip


def test_kl_scale_is_the_clip_of_the_preconditioned_and_raw_gradients():
  grad_fn = kaisa_jax.value_and_grad(_loss)
  params = Net().init(jax.random.key(1), X)
  layers = grad_fn.layers(params, X, Y)
  kw = dict(factor_update_steps=1, inv_update_steps=1, max_cost_ratio=None)
  clipped = kaisa_jax.kfac(layers, step_norm="natural", kl_clip=1e-4, lr=0.3, **kw)
  plain = kaisa_jax.kfac(layers, step_norm="natural", **kw)
  state = clipped.init(params)
  assert float(kaisa_jax.curvature_statistics(clipped, state).kl_scale) == 1.0
  for k in range(2):
    _, grads, curvature = grad_fn(params, X * (1 + 0.1 * k), Y)
    unclipped, _ = jax.jit(plain.update)(grads, state, params, curvature=curvature)
    updates, state = jax.jit(clipped.update)(grads, state, params, curvature=curvature)
    # Every parameter of Net is preconditioned: the sum runs over all of them.
    vg = sum(
      np.sum(np.asarray(p, np.float64) * np.asarray(v, np.float64))
      for p, v in zip(jax.tree.leaves(unclipped), jax.tree.leaves(grads), strict=True)
    )
    nu = min(1.0, np.sqrt(1e-4 / abs(0.3**2 * vg)))
    assert nu < 0.9  # the clip is active
    stats = kaisa_jax.curvature_statistics(clipped, state)
    np.testing.assert_allclose(float(stats.kl_scale), nu, rtol=1e-5)
    ratio = jax.tree.map(lambda u, p: float(jnp.vdot(u, p) / jnp.vdot(p, p)), updates, unclipped)
    np.testing.assert_allclose(jax.tree.leaves(ratio), nu, rtol=1e-5)


# ------------------------------------------------------------------------------ warnings


def _flagging_dampings(kfac, opt_state) -> tuple[float, float, float]:
  """Dampings at which every layer's relative damping is below `NEGLIGIBLE_DAMPING`, between the
  thresholds, and above `DROWNING_DAMPING`: the relative damping is proportional to the damping,
  so it is read at damping 1 (in jit, where nothing warns)."""
  unit = jax.jit(functools.partial(kaisa_jax.curvature_statistics, kfac, damping=1.0))
  relative = [float(s.relative_damping) for s in unit(opt_state).layers.values()]
  lowest, highest = (
    statistics.NEGLIGIBLE_DAMPING / min(relative),
    statistics.DROWNING_DAMPING / max(relative),
  )
  assert lowest < highest  # this model's layers fit between the thresholds at one damping
  low = 0.5 * statistics.NEGLIGIBLE_DAMPING / max(relative)
  high = 2 * statistics.DROWNING_DAMPING / min(relative)
  return low, float(np.sqrt(lowest * highest)), high


def test_the_damping_warning_fires_once(monkeypatch):
  """With K-FAC's own step length, the thresholds' rule: each case warns once per process."""
  monkeypatch.setattr(statistics, "_warned", set())
  kfac, opt_state = _trained("eigen", step_norm="natural")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fresh = kaisa_jax.curvature_statistics(kfac, kfac.init(Net().init(jax.random.key(1), X)))
    assert np.isinf(float(next(iter(fresh.layers.values())).relative_damping))
    low, within, high = _flagging_dampings(kfac, opt_state)
    kaisa_jax.curvature_statistics(kfac, opt_state, damping=within)
    assert not caught  # no curvature yet: not flagged; a sensible damping: not flagged
    for damping, kind, word in ((low, "negligible", "negligible"), (high, "drowning", "drowns")):
      for _ in range(2):
        stats = kaisa_jax.curvature_statistics(kfac, opt_state, damping=damping)
        assert len(caught) == 1  # called outside jit, it checks (and warns once) itself
        jitted = jax.jit(functools.partial(kaisa_jax.curvature_statistics, kfac, damping=damping))
        found = kaisa_jax.check_damping(jitted(opt_state), "natural")
        assert set(getattr(found, kind)) == set(stats.layers)  # every layer flagged
      assert len(caught) == 1, [str(w.message) for w in caught]
      assert word in str(caught[0].message) and "Conv_0" in str(caught[0].message)
      caught.clear()
  with pytest.raises(TypeError, match="concrete values"):
    jax.jit(lambda s: kaisa_jax.check_damping(kaisa_jax.curvature_statistics(kfac, s), "natural"))(
      opt_state
    )


def test_the_default_step_rule_flags_no_damping(monkeypatch):
  """Each layer's step given its gradient's norm (the default): the robustness benchmark found no
  relative damping that marks a worse run, so nothing is flagged and nothing warns, at dampings
  the thresholds flag under K-FAC's own step length (read with ``"pi"``, whose relative damping
  is proportional to the damping). With the default form, ``"bounded"``, no layer's relative
  damping exceeds 1 at any damping: none drowns."""
  monkeypatch.setattr(statistics, "_warned", set())
  kfac, opt_state = _trained("eigen")
  assert (kfac.plan.step_norm, kfac.plan.damping_form) == ("gradient", "bounded")
  stats = kaisa_jax.curvature_statistics(kfac, opt_state, damping=1e6)
  assert max(float(s.relative_damping) for s in stats.layers.values()) <= 1.0 + 1e-6
  assert kaisa_jax.check_damping(stats, "natural").drowning == {}
  kfac, opt_state = _trained("eigen", damping_form="pi")
  assert kfac.plan.step_norm == "gradient"
  low, _, high = _flagging_dampings(kfac, opt_state)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for damping, kind in ((low, "negligible"), (high, "drowning")):
      stats = kaisa_jax.curvature_statistics(kfac, opt_state, damping=damping)
      assert not caught, [str(w.message) for w in caught]
      assert kaisa_jax.check_damping(stats, "gradient") == ({}, {})
      # The same statistics under K-FAC's own step length: every layer flagged.
      assert set(getattr(kaisa_jax.check_damping(stats, "natural"), kind)) == set(stats.layers)
      caught.clear()
  with pytest.raises(ValueError, match="step_norm must be one of"):
    kaisa_jax.check_damping(stats, "kl")
