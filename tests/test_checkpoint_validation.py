"""Checkpoints of another model, treatment or device layout raise instead of restoring garbage."""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from distributed_setup import build

import kaisa_jax
from kaisa_jax import preconditioning

# Two layers; the same wider; the same with a third layer of the same dims as the second.
SMALL, WIDE, DEEPER = (32, 4), (64, 4), (32, 4, 4)
KFAC = dict(step_norm="natural", factor_update_steps=1, inv_update_steps=1, max_cost_ratio=None)


class MLP(nn.Module):
  widths: tuple[int, ...]

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(self.widths):
      x = nn.Dense(width)(x)
      x = nn.relu(x) if i < len(self.widths) - 1 else x
    return x


X = jax.random.normal(jax.random.key(0), (16, 6))


@functools.cache
def _model(widths: tuple[int, ...]):
  """``(params, grad_fn, layers)`` of the MLP of ``widths``."""
  model = MLP(widths)
  params = model.init(jax.random.key(1), X)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean((model.apply(p, x) - 1.0) ** 2))
  return params, grad_fn, grad_fn.layers(params, X)


def _kfac(widths: tuple[int, ...], **kwargs) -> kaisa_jax.KFAC:
  return kaisa_jax.kfac(_model(widths)[2], **{**KFAC, **kwargs})


def _fresh(widths: tuple[int, ...], **kwargs):
  """A kfac for ``widths`` and its initial state (zeros: enough to check layouts)."""
  kfac = _kfac(widths, **kwargs)
  return kfac, kfac.init(_model(widths)[0])


def _orbax_round_trip(tmp_path, saved, target):
  """Saves ``saved`` with Orbax and restores it into ``target``, as a resumed run does."""
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "checkpoint", {"opt": saved})
  ckpt.wait_until_finished()
  return ckpt.restore(tmp_path / "checkpoint", {"opt": target})["opt"]


# ------------------------------------------------------------------------- to_portable


def test_to_portable_refuses_a_state_of_another_model():
  small, _ = _fresh(SMALL)
  wide, state = _fresh(WIDE)
  with pytest.raises(ValueError, match="not made by this kfac") as e:
    kaisa_jax.to_portable(small, state)
  message = str(e.value)
  assert f"factor buffer has {wide.plan.layout.factor_size} elements" in message
  assert f"this kfac's {small.plan.layout.factor_size}" in message
  assert "Pass to_portable the kfac the state was made with" in message


def test_curvature_statistics_refuses_a_state_of_another_model():
  small, _ = _fresh(SMALL, damping=1e-2)
  _, state = _fresh(WIDE)
  with pytest.raises(ValueError, match="not made by this kfac") as e:
    kaisa_jax.curvature_statistics(small, state)
  assert "Pass curvature_statistics the kfac the state was made with" in str(e.value)


def test_to_portable_refuses_a_state_of_other_devices():
  mesh = kaisa_jax.make_mesh(0.5, jax.devices()[:8])
  single, single_state = _fresh(SMALL)
  meshed, mesh_state = _fresh(SMALL, mesh=mesh)
  rows, cols = meshed.plan.layout.rows, meshed.plan.layout.cols
  with pytest.raises(
    ValueError, match=rf"factors \(1, 1, \d+\) where this kfac makes \({rows}, {cols}, "
  ):
    kaisa_jax.to_portable(meshed, single_state)
  with pytest.raises(ValueError, match=r"not made by this kfac \(for one device\)"):
    kaisa_jax.to_portable(single, mesh_state)


def test_to_portable_refuses_a_state_of_as_many_groups_but_more_grad_workers():
  """``(1, 2, F2)`` for a ``(1, 4, F4)`` kfac: the devices differ, not only the buffer sizes."""
  _, two = _fresh(SMALL, mesh=kaisa_jax.make_mesh(1.0, jax.devices()[:2]))
  four = _kfac(SMALL, mesh=kaisa_jax.make_mesh(1.0, jax.devices()[:4]))
  with pytest.raises(ValueError, match=r"factors \(1, 2, \d+\) where this kfac makes \(1, 4, "):
    kaisa_jax.to_portable(four, two)


def test_to_portable_refuses_a_pmapped_state_of_another_device_count():
  kfac8, state = _fresh(SMALL, axis_name="batch", axis_size=8)
  kfac4 = _kfac(SMALL, axis_name="batch", axis_size=4)
  replicated = jax.tree.map(lambda a: np.stack([a] * 8), state)
  kaisa_jax.to_portable(kfac8, replicated)  # its own kfac: fine
  with pytest.raises(ValueError, match=r"count \(8,\) where this kfac makes \(4,\)"):
    kaisa_jax.to_portable(kfac4, replicated)


def test_to_portable_refuses_one_device_copy_of_a_pmapped_state():
  kfac, fresh = _fresh(SMALL, axis_name="batch", axis_size=8)
  kaisa_jax.to_portable(kfac, fresh)  # a fresh state stands for every device's (a target)
  trained = fresh._replace(count=jnp.asarray(5, jnp.int32))
  with pytest.raises(ValueError, match="one device's copy of a pmapped state"):
    kaisa_jax.to_portable(kfac, trained)


# ----------------------------------------------------------------------- from_portable


def _portable(widths: tuple[int, ...], **kwargs) -> kaisa_jax.PortableKFACState:
  return kaisa_jax.to_portable(*_fresh(widths, **kwargs))


def test_from_portable_names_layers_the_model_lacks():
  # DEEPER's first two layers are SMALL's: only Dense_2 is not SMALL's.
  with pytest.raises(ValueError, match=r"layers \['Dense_2'\] that this model lacks"):
    kaisa_jax.from_portable(_kfac(SMALL), _portable(DEEPER))


def test_from_portable_names_layers_the_checkpoint_lacks():
  with pytest.raises(ValueError, match=r"no factors for this model's layers \['Dense_2'\]") as e:
    kaisa_jax.from_portable(_kfac(DEEPER), _portable(SMALL))
  assert "saved from another model" in str(e.value)


def test_from_portable_names_renamed_layers_both_ways():
  portable = _portable(SMALL)
  rename = lambda d: {("head" if k == "Dense_1" else k): v for k, v in d.items()}  # noqa: E731
  renamed = portable._replace(
    factors=rename(portable.factors),
    decompositions=rename(portable.decompositions),
    treatments=rename(portable.treatments),
  )
  with pytest.raises(ValueError, match=r"\['head'\] that this model lacks") as e:
    kaisa_jax.from_portable(_kfac(SMALL), renamed)
  assert "no factors for this model's layers ['Dense_1']" in str(e.value)


def test_from_portable_refuses_treatments_missing_a_layer():
  portable = _portable(SMALL)
  partial = portable._replace(treatments={"Dense_0": portable.treatments["Dense_0"]})
  with pytest.raises(ValueError, match=r"treatments are for layers \['Dense_0'\]"):
    kaisa_jax.from_portable(_kfac(SMALL), partial)


def test_restoring_another_width_names_the_layer_and_not_the_treatment(tmp_path):
  # What a resumed run does: the target is the new model's own portable state.
  # Orbax restores the arrays with the shapes they were saved with.
  small, small_state = _fresh(SMALL)
  restored = _orbax_round_trip(tmp_path, _portable(WIDE), kaisa_jax.to_portable(small, small_state))
  with pytest.raises(ValueError, match="layer 'Dense_0' has factors of shapes") as e:
    kaisa_jax.from_portable(small, restored)
  message = str(e.value)
  assert "saved from another model" in message
  assert "compute_method" not in message and "max_cost_ratio" not in message
  assert "diagonal" not in message


@pytest.mark.parametrize("saved_diagonal", [False, True])
def test_a_side_turned_diagonal_still_blames_the_treatment(saved_diagonal):
  """Either way round, the message names the layer and the sides whose treatment changed."""
  cheap = dict(max_cost_ratio=1e-6)
  diagonal = _kfac(SMALL, **cheap)
  spec, t = next((spec, t) for spec, t in diagonal.plan.layers if any(t.diagonal))
  sides = [name for name, d in zip("AG", t.diagonal, strict=True) if d]
  target, saved = (
    (_kfac(SMALL), _portable(SMALL, **cheap)) if saved_diagonal else (diagonal, _portable(SMALL))
  )
  with pytest.raises(ValueError, match="dense in one and diagonal in the other") as e:
    kaisa_jax.from_portable(target, saved)
  message = str(e.value)
  assert f"layer {spec.name!r}" in message
  assert f"its {' and '.join(sides)} side{'s are' if len(sides) > 1 else ' is'} dense" in message
  assert "compute_method and max_cost_ratio" in message
  assert "another model" not in message


def test_from_portable_refuses_decompositions_that_do_not_fit_the_treatment():
  portable = _portable(SMALL)
  a, g = portable.decompositions["Dense_0"]
  cut = preconditioning.Decomposition(g.basis[:, :5, :5], g.values[:, :5])
  broken = {**portable.decompositions, "Dense_0": type(portable.decompositions["Dense_0"])(a, cut)}
  with pytest.raises(ValueError, match="layer 'Dense_0' has decompositions of shapes"):
    kaisa_jax.from_portable(_kfac(SMALL), portable._replace(decompositions=broken))


def test_round_trip_through_orbax_restores_bit_exactly(tmp_path):
  params, grad_fn, _ = _model(SMALL)
  kfac, state = _fresh(SMALL)
  _, grads, curvature = grad_fn(params, X)
  _, state = jax.jit(kfac.update)(grads, state, params, curvature=curvature)
  assert np.asarray(state.factors).any() and np.asarray(state.decompositions).any()
  restored = _orbax_round_trip(
    tmp_path, kaisa_jax.to_portable(kfac, state), kaisa_jax.to_portable(kfac, kfac.init(params))
  )
  back = kaisa_jax.from_portable(kfac, restored)
  for field, a, b in zip(state._fields, state, back, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field)


class _PortableBeforeKLScale(NamedTuple):
  """`kaisa_jax.PortableKFACState` as written before it held ``kl_scale``."""

  count: np.ndarray
  factor_total: np.ndarray
  skipped_factor_updates: np.ndarray
  failed_decompositions: np.ndarray
  factors: dict
  decompositions: dict
  treatments: dict


def test_a_checkpoint_without_kl_scale_is_refused_by_name_or_restored_partially(tmp_path):
  params, grad_fn, _ = _model(SMALL)
  kfac, state = _fresh(SMALL, step_norm="natural", kl_clip=1e-4, lr=0.1)
  _, grads, curvature = grad_fn(params, X)
  _, state = jax.jit(kfac.update)(grads, state, params, curvature=curvature)
  portable = kaisa_jax.to_portable(kfac, state)
  assert float(portable.kl_scale) < 1  # the clip was active
  target = kaisa_jax.to_portable(kfac, kfac.init(params))
  # The current layout round-trips kl_scale with the rest.
  back = kaisa_jax.from_portable(kfac, _orbax_round_trip(tmp_path / "new", portable, target))
  np.testing.assert_array_equal(back.kl_scale, state.kl_scale)

  old = _PortableBeforeKLScale(**{k: v for k, v in portable._asdict().items() if k != "kl_scale"})
  with pytest.raises(ValueError, match="kl_scale"):
    _orbax_round_trip(tmp_path / "old", old, target)
  # Restored partially, kl_scale comes from the target (1, as at init); the rest as saved.
  restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
    tmp_path / "old" / "checkpoint",
    args=ocp.args.PyTreeRestore(item={"opt": target}, partial_restore=True),
  )["opt"]
  back = kaisa_jax.from_portable(kfac, restored)
  assert float(back.kl_scale) == 1.0
  for field, a, b in zip(state._fields, state, back, strict=True):
    if field != "kl_scale":
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field)


@pytest.mark.parametrize("mode", ["pmap", "shard_map"])
def test_a_trained_distributed_state_round_trips_through_portable(mode):
  """Two steps on 4 devices at fraction 1/2, then ``from_portable(to_portable(state))``: the same."""
  step, (params, state), inputs, kfac = build("mlp", mode, 4, "1/2", 2, chained=False)
  for x, y in inputs:
    params, state, _ = jax.block_until_ready(step(params, state, x, y))
  restored = kaisa_jax.from_portable(kfac, kaisa_jax.to_portable(kfac, state))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
