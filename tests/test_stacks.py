"""Stacks: layers that differ only in their names are computed as one batch.

A stack's factor statistics, decompositions and preconditioned gradients are
each one batched computation. Its results are checked against the same layers
computed one by one (every layer its own stack) and, for the decompositions,
against each factor decomposed alone.
"""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import dense_stack
from distributed_setup import relative_error, run

import kaisa_jax
from kaisa_jax import assignment, cost, cpu_loop, phases, preconditioning, stacking
from kaisa_jax.layers import LayerSpec

EIGEN = cost.Treatment("eigen")
INVERSE = cost.Treatment("inverse")


def dense(name, a, g):
  return LayerSpec(name, (name,), "dense", (a - 1, g), has_bias=True)


def test_layers_that_differ_only_in_name_and_place_share_a_stack():
  layers = [
    (dense("a", 5, 3), EIGEN),
    (dense("b", 5, 3), EIGEN),
    (dense("c", 4, 3), EIGEN),
    (dense("d", 5, 3), EIGEN),
    (dense("e", 5, 3), INVERSE),  # another treatment
    (LayerSpec("f", ("f",), "dense", (4, 3), has_bias=False), EIGEN),  # no bias: 4 x 3 too
  ]
  assert assignment.stack_keys(layers) == (0, 0, 1, 0, 2, 3)
  one = assignment.make_layout(layers, 1, 1)
  assert one.stacks(0, 0) == one.all_stacks() == [[0, 1, 3], [2], [4], [5]]
  grid = assignment.make_layout(layers, 2, 2)
  for r in range(2):
    for c in range(2):
      stacks = grid.stacks(r, c)
      assert sorted(i for s in stacks for i in s) == grid.owned(r, c)
      assert all(len({grid.stack_ids[i] for i in s}) == 1 for s in stacks)
      assert len({grid.stack_ids[s[0]] for s in stacks}) == len(stacks)
    assert sorted(i for s in grid.group_stacks(r) for i in s) == sorted(grid.group(r))
  # The assignment itself does not depend on the stacks: as for layers apart.
  assert grid.owners == assignment.make_layout(layers, 2, 2).owners


def test_buffer_order_is_stack_by_stack_then_array_then_member():
  parts = {0: ["A0", "G0"], 1: ["A1", "G1"], 2: ["A2", "G2"]}
  order = assignment.stacked([[0, 2], [1]], parts.__getitem__)
  assert order == ["A0", "A2", "G0", "G2", "A1", "G1"]


def _factors(k, d, rank, seed):
  rows = jax.random.normal(jax.random.key(seed), (k, 1, rank, d))
  return jnp.einsum("kgrd,kgre->kgde", rows, rows) / rank


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_a_stack_decomposes_every_member_as_if_alone(method):
  stack = _factors(5, 12, 40, 0)
  damping = jnp.float32(1e-3)
  together = preconditioning.decompose(stack, method, False, damping)
  for j in range(stack.shape[0]):
    alone = preconditioning.decompose(stack[j : j + 1], method, False, damping)
    for x, y in zip(together, alone, strict=True):
      if x is not None:
        np.testing.assert_array_equal(x[j : j + 1], y)


@pytest.mark.parametrize("k", [2, 9, 16, 21])
@pytest.mark.parametrize("loop_from", [4, cpu_loop.LOOP_FROM])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_a_stack_preconditions_every_member_as_if_alone(monkeypatch, method, loop_from, k):
  """Member by member, or on the CPU in a loop for a deep stack (turns of several members,
  some computed twice when the turns do not divide the stack): each member's result is
  where the batched call puts it, bit for bit what it is alone."""
  monkeypatch.setattr(cpu_loop, "LOOP_FROM", loop_from)  # small stacks in a loop too
  a, g = _factors(k, 7, 20, 2), _factors(k, 5, 20, 3)
  damping = jnp.float32(1e-2)
  dec_a, dec_g = (preconditioning.decompose(f, method, False, damping) for f in (a, g))
  v = jax.random.normal(jax.random.key(4), (k, 1, 7, 5))

  def fn(v, a, g, d):
    return preconditioning.precondition(v, a, g, method, d)

  offsets = tuple(jnp.asarray(j, jnp.int32) for j in range(k))

  def stack(flat, v, dec_a, dec_g):
    if not cpu_loop.looped(k):
      together = cpu_loop.at_once(fn, (v, dec_a, dec_g), offsets, damping)
      return jax.lax.dynamic_update_slice(flat, together.reshape(-1), (3,))
    return cpu_loop.in_loop(fn, lambda: (v, dec_a, dec_g), flat, 3, offsets, damping)

  flat = jnp.full((3 + v.size + 4,), -1.0)
  out = jax.jit(stack)(flat, v, dec_a, dec_g)
  np.testing.assert_array_equal(out[:3], -1.0)
  np.testing.assert_array_equal(out[3 + v.size :], -1.0)
  members = out[3 : 3 + v.size].reshape(v.shape)
  for j in range(k):
    alone = jax.tree.map(lambda x, j=j: x[j : j + 1], (v, dec_a, dec_g))
    np.testing.assert_array_equal(members[j : j + 1], jax.jit(fn)(*alone, damping), err_msg=j)


def test_the_cholesky_retry_is_decided_per_member():
  """One member singular at a tiny damping: only it is retried, with its own jitter."""
  good = _factors(3, 16, 64, 1)
  singular = jnp.zeros((1, 1, 16, 16)).at[0, 0, 0, 0].set(1.0)  # rank 1
  stack = jnp.concatenate([good[:1], singular, good[1:]])
  damping = jnp.float32(0.0)
  inverse = preconditioning.decompose(stack, "inverse", False, damping).basis
  assert np.isfinite(np.asarray(inverse[0])).all()
  for j, member in enumerate([good[0], None, good[1], good[2]]):
    alone = preconditioning.decompose(stack[j : j + 1], "inverse", False, damping).basis
    np.testing.assert_array_equal(inverse[j : j + 1], alone)
    if member is not None:  # no retry: the plain damped inverse
      np.testing.assert_allclose(
        np.asarray(inverse[j, 0]) @ np.asarray(member[0], np.float64), np.eye(16), atol=1e-3
      )
  assert np.isfinite(np.asarray(inverse[1])).all()  # retried with its own, larger damping


class Tower(nn.Module):
  """An input layer, ``hidden`` equal hidden layers (the fourth applied to twice the rows), a head."""

  hidden: int = 6

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(16)(x))
    for i in range(self.hidden):
      if i == 3:  # same layer description, inputs of another shape: computed one by one
        pair = jnp.stack([h, -h], axis=1)
        h = nn.tanh(nn.Dense(16)(pair)).mean(axis=1)
      else:
        h = nn.tanh(nn.Dense(16)(h))
    return nn.Dense(4)(h)


def _train(monkeypatch, apart: bool, compute_method: str, kl_clip: float | None, hidden: int = 6):
  """Four K-FAC+SGD steps; with ``apart`` every layer is its own stack."""
  if apart:
    monkeypatch.setattr(assignment, "stack_keys", lambda layers: tuple(range(len(layers))))
  model = Tower(hidden)
  x = jax.random.normal(jax.random.key(0), (32, 10))
  y = jax.random.normal(jax.random.key(1), (32, 4))
  params = model.init(jax.random.key(2), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x, y: optax.l2_loss(model.apply(p, x), y).mean())
  kfac = kaisa_jax.kfac(
    grad_fn.layers(params, x, y),
    step_norm="natural",
    kl_clip=kl_clip,
    **({} if kl_clip is None else {"lr": 0.1}),
    factor_update_steps=1,
    inv_update_steps=2,
    compute_method=compute_method,
    max_cost_ratio=None,
  )
  tx = optax.chain(kfac, optax.sgd(0.1, momentum=0.9))

  @jax.jit
  def step(params, state):
    _, grads, curvature = grad_fn(params, x, y)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(4):
    params, state = step(params, state)
  return kfac, params, kaisa_jax.layer_factors(kfac.plan, state[0])


@pytest.mark.parametrize(
  ("method", "loop_from", "hidden"),
  [("eigen", 64, 6), ("inverse", 64, 6), ("eigen", 2, 6), ("eigen", 64, 2)],
)
def test_stacked_layers_train_as_layers_computed_one_by_one(monkeypatch, method, loop_from, hidden):
  """Without the KL clip, bit for bit: a batch computes each member as it would alone (on
  the CPU with ``loop_from=2`` the six hidden layers are preconditioned in a loop)."""
  monkeypatch.setattr(cpu_loop, "LOOP_FROM", loop_from)
  kfac, params, factors = _train(monkeypatch, False, method, kl_clip=None, hidden=hidden)
  stacks = kfac.plan.layout.all_stacks()
  assert sorted(len(s) for s in stacks) == [1, 1, hidden]  # input layer, head, the hidden
  with monkeypatch.context() as m:
    apart, ref_params, ref_factors = _train(m, True, method, kl_clip=None, hidden=hidden)
  assert len(apart.plan.layout.all_stacks()) == hidden + 2
  for name, (a, g) in ref_factors.items():
    np.testing.assert_array_equal(factors[name].a, a, err_msg=name)
    np.testing.assert_array_equal(factors[name].g, g, err_msg=name)
  for p, q in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
    np.testing.assert_array_equal(p, q)
  initial = Tower(hidden).init(jax.random.key(2), jnp.zeros((1, 10)))
  moved = [float(jnp.abs(p - q).max()) for p, q in zip(*map(jax.tree.leaves, (params, initial)))]
  assert max(moved) > 1e-2


def test_with_the_kl_clip_stacks_agree_to_float32_rounding(monkeypatch):
  """The clip's sum over layers adds stack by stack, so its float32 rounding differs."""
  _, params, _ = _train(monkeypatch, False, "eigen", kl_clip=1e-3)
  with monkeypatch.context() as m:
    _, ref_params, _ = _train(m, True, "eigen", kl_clip=1e-3)
  for p, q in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
    np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)


def _deep(depth: int = 16):
  """A kfac for ``depth`` equal layers (one stack) and its update on one batch."""
  kfac, params, grad_fn, x = dense_stack(depth)

  def step(params, state):
    _, grads, curvature = grad_fn(params, x)
    return kfac.update(grads, state, params, curvature=curvature)

  return kfac, params, step


def test_a_stack_is_one_batched_decomposition():
  """Sixteen equal layers: two eigendecompositions in the program, not thirty-two."""
  kfac, params, step = _deep()
  jaxpr = jax.make_jaxpr(step)(params, kfac.init(params))
  text = str(jaxpr)
  assert text.count("eigh[") == 2
  assert len(kfac.plan.layout.all_stacks()) == 1


@pytest.mark.parametrize("loop_from", [8, cpu_loop.LOOP_FROM])
def test_members_read_their_results_at_the_offsets_in_the_state(monkeypatch, loop_from):
  """The offsets are runtime values (so members share compiled kernels): permuted, so are the
  members' updates."""
  monkeypatch.setattr(cpu_loop, "LOOP_FROM", loop_from)  # 16 members: in a loop, or not
  kfac, params, step = _deep()
  state = kfac.init(params)
  assert [int(x) for x in state.stack_offsets] == list(range(16))
  updates, _ = jax.jit(step)(params, state)
  # The members rotated within the first and the last eight: a permutation that keeps the
  # starts of the loop's turns (`cpu_loop.in_loop`) among the first `lanes` offsets.
  turns = -(-16 // cpu_loop.LANES)
  lanes = -(-16 // turns)
  order = [(j + 1) % lanes for j in range(lanes)] + [
    lanes + (j + 1) % (16 - lanes) for j in range(16 - lanes)
  ]
  permuted = state._replace(stack_offsets=tuple(state.stack_offsets[j] for j in order))
  moved, _ = jax.jit(step)(params, permuted)
  # Each update is read at its offset. Computed member by member on the CPU (`cpu_loop.at_once`),
  # each member's gradient and decompositions are read at the offsets as well; in a loop
  # or batched, the members are computed in place.
  twice = jax.default_backend() == "cpu" and not cpu_loop.looped(16)
  source = [order[order[i]] if twice else order[i] for i in range(16)]
  for i in range(16):
    for key in ("kernel", "bias"):
      np.testing.assert_array_equal(
        moved["params"][f"Dense_{i}"][key],
        updates["params"][f"Dense_{source[i]}"][key],
        err_msg=f"Dense_{i} {key}",
      )
  # The members' updates differ, so the permutation above is seen.
  assert not np.array_equal(
    updates["params"]["Dense_0"]["kernel"], moved["params"]["Dense_0"]["kernel"]
  )


def test_a_state_with_other_stacks_raises():
  _, params, step = _deep(16)
  other, other_params, _ = _deep(4)
  with pytest.raises(ValueError, match="4 stack offsets where this kfac's plan needs 16"):
    step(params, other.init(other_params))


@pytest.mark.parametrize("fraction", ["1/4", "1/2"])
def test_a_stack_split_over_devices_preconditions_as_on_one_device(fraction):
  """Each device restacks the members it owns out of the whole stack (`stacking.select`)."""
  update, _, kfac = run("tower", "shard_map", 4, fraction, 1, chained=False)
  layout = kfac.plan.layout
  (whole,) = [s for s in layout.all_stacks() if len(s) == 6]
  owned = [s for r in range(layout.rows) for c in range(layout.cols) for s in layout.stacks(r, c)]
  assert any(0 < len(s) < 6 and set(s) < set(whole) for s in owned)  # the stack is split
  reference, _, _ = run("tower", "single", 1, "1", 1, chained=False)
  assert relative_error(update, reference) <= 1e-5


def test_per_stack_is_one_batched_call_unless_the_inputs_differ_in_shape():
  """Equal inputs: one ``dot_general`` for the stack; another shape among them: one per member."""
  kfac, *_ = dense_stack(4)
  members = kfac.plan.layout.all_stacks()[0]
  assert len(members) == 4

  def fn(spec, x):
    return x @ x.T

  def count(inputs):
    out = stacking.per_stack(kfac.plan, members, fn, inputs)
    for j, x in enumerate(inputs):
      np.testing.assert_allclose(out[j], x @ x.T, rtol=1e-6)
    text = str(jax.make_jaxpr(lambda xs: stacking.per_stack(kfac.plan, members, fn, xs))(inputs))
    return text.count("dot_general")

  rng = np.random.default_rng(0)
  same = [jnp.asarray(rng.standard_normal((3, 5)), jnp.float32) for _ in members]
  assert count(same) == 1
  other = [*same[:3], jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)]
  assert count(other) == 4


def test_a_member_whose_decomposition_fails_counts_alone_and_keeps_its_last(monkeypatch):
  """Member 1 of a stack of four fails both factors: 2 failures, its last decompositions kept."""
  kfac, params, step = _deep(4)
  (members,) = kfac.plan.layout.all_stacks()
  names = [kfac.plan.layers[i][0].name for i in members]
  _, state = jax.jit(step)(params, kfac.init(params))  # step 0 decomposes
  before = kaisa_jax.layer_decompositions(kfac.plan, state)
  refresh = state._replace(refresh=jnp.asarray(True))
  # The factors the next step decomposes: member 1's are told apart by their values, whether
  # the stack is decomposed as one batch or member by member.
  probe = jax.jit(step)(params, refresh)[1]
  ones = [x[1] for x in stacking.factor_stacks(kfac.plan, probe.factors[0, 0], [members])[0]]
  real = preconditioning.decompose

  def member_one_fails(factor, *args):
    matrices = factor.reshape(-1, *factor.shape[-2:])
    bad = sum(
      jnp.all(matrices == f[0], axis=(1, 2)) for f in ones if f.shape[1:] == matrices.shape[1:]
    )

    def fail(v):
      return jnp.where(jnp.reshape(bad, (-1, *[1] * (v.ndim - 1))) > 0, jnp.nan, v)

    return jax.tree.map(fail, real(factor, *args))

  monkeypatch.setattr(preconditioning, "decompose", member_one_fails)
  broken = jax.jit(lambda p, s: step(p, s))  # a new function: traced with the failing decompose
  _, state = broken(params, refresh)
  assert int(state.failed_decompositions) == 2
  after = kaisa_jax.layer_decompositions(kfac.plan, state)
  jax.tree.map(np.testing.assert_array_equal, after[names[1]], before[names[1]])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(after))


def test_a_factor_that_is_not_finite_fails_its_real_decomposition_alone():
  """No stand-in for ``eigh``: a NaN in member 2's ``A`` gives non-finite eigenvalues, which is
  what the fallback tests; that decomposition alone keeps its last, the others are renewed
  (every factor doubled: their eigenvalues double)."""
  kfac, params, step = _deep(4)
  (members,) = kfac.plan.layout.all_stacks()
  names = [kfac.plan.layers[i][0].name for i in members]
  step = jax.jit(step)
  _, state = step(params, kfac.init(params))  # step 0 decomposes
  before = kaisa_jax.layer_decompositions(kfac.plan, state)
  a = np.asarray(kaisa_jax.layer_factors(kfac.plan, state)[names[2]].a).ravel()
  flat = np.asarray(state.factors).ravel()
  (start,) = [i for i in range(flat.size - a.size + 1) if np.array_equal(flat[i : i + a.size], a)]
  poisoned = 2 * flat  # every eigenvalue renewed doubles
  poisoned[start + a.size // 2] = np.nan
  state = state._replace(
    factors=jnp.asarray(poisoned.reshape(state.factors.shape)), refresh=jnp.asarray(True)
  )
  _, state = step(params, state)
  assert int(state.failed_decompositions) == 1
  after = kaisa_jax.layer_decompositions(kfac.plan, state)
  jax.tree.map(np.testing.assert_array_equal, after[names[2]].a, before[names[2]].a)
  for name in names:
    for side in ("g",) if name == names[2] else ("a", "g"):
      np.testing.assert_allclose(
        getattr(after[name], side).values, 2 * getattr(before[name], side).values, atol=1e-6
      )
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(after))


def _tower(hidden: int = 2):
  """A kfac for a `Tower` (no KL clip) and its update on one batch."""
  model = Tower(hidden)
  x = jax.random.normal(jax.random.key(0), (32, 10))
  params = model.init(jax.random.key(2), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
  kfac = kaisa_jax.kfac(grad_fn.layers(params, x), step_norm="natural", max_cost_ratio=None)

  def step(params, state):
    _, grads, curvature = grad_fn(params, x)
    return kfac.update(grads, state, params, curvature=curvature)

  return kfac, params, step


def _poisoned(state, factor, index, scale=2.0):
  """``state`` with every factor scaled by ``scale`` and entry ``index`` of ``factor`` NaN, to
  decompose at its next step (``factor`` found by its values in the buffer)."""
  f = np.asarray(factor).ravel()
  flat = np.asarray(state.factors).ravel()
  (start,) = [i for i in range(flat.size - f.size + 1) if np.array_equal(flat[i : i + f.size], f)]
  poisoned = scale * flat
  poisoned[start + index] = np.nan
  return state._replace(
    factors=jnp.asarray(poisoned.reshape(state.factors.shape)), refresh=jnp.asarray(True)
  )


def test_factors_of_one_size_decompose_in_one_call_across_stacks():
  """Three stacks (input layer, two hidden layers, head) hold six factors of four sizes (11, 16,
  17 and 4; three are 16 wide): four eigendecompositions in the program."""
  kfac, params, step = _tower(2)
  assert len(kfac.plan.layout.all_stacks()) == 3
  sizes = {d for spec, _ in kfac.plan.layers for d in (spec.a_dim, spec.g_dim)}
  assert sizes == {11, 16, 17, 4}
  assert str(jax.make_jaxpr(step)(params, kfac.init(params))).count("eigh[") == 4


def test_a_failure_among_factors_decomposed_together_stays_with_its_layer():
  """The hidden layers' ``G`` (16 wide, decomposed with the input layer's): a NaN in the second
  one's fails that decomposition alone; every other one is renewed (its eigenvalues doubled)."""
  kfac, params, step = _tower(2)
  step = jax.jit(step)
  _, state = step(params, kfac.init(params))  # step 0 decomposes
  names = [spec.name for spec, _ in kfac.plan.layers]
  hidden = names[2]
  assert (
    kfac.plan.layout.stack_ids[1] == kfac.plan.layout.stack_ids[2] != kfac.plan.layout.stack_ids[0]
  )
  before = kaisa_jax.layer_decompositions(kfac.plan, state)
  g = kaisa_jax.layer_factors(kfac.plan, state)[hidden].g
  _, state = step(params, _poisoned(state, g, 17))
  assert int(state.failed_decompositions) == 1
  after = kaisa_jax.layer_decompositions(kfac.plan, state)
  jax.tree.map(np.testing.assert_array_equal, after[hidden].g, before[hidden].g)
  for name in names:
    for side in ("a",) if name == hidden else ("a", "g"):
      np.testing.assert_allclose(
        getattr(after[name], side).values, 2 * getattr(before[name], side).values, atol=1e-6
      )


def test_a_grouped_layer_whose_group_fails_keeps_all_its_groups_and_counts_once():
  """A convolution of two groups, one NaN in the first group's ``A``: the layer keeps both
  groups' last ``A`` decompositions, one failure is counted, its ``G`` is renewed."""
  conv = nn.Conv(4, (3, 3), feature_group_count=2)
  x = jax.random.normal(jax.random.key(0), (4, 5, 5, 2))
  params = conv.init(jax.random.key(1), x)
  grad_fn = kaisa_jax.value_and_grad(lambda p, x: jnp.mean(conv.apply(p, x) ** 2))
  kfac = kaisa_jax.kfac(grad_fn.layers(params, x), step_norm="natural", max_cost_ratio=None)

  @jax.jit
  def step(params, state):
    _, grads, curvature = grad_fn(params, x)
    return kfac.update(grads, state, params, curvature=curvature)

  _, state = step(params, kfac.init(params))
  (name,) = kaisa_jax.layer_factors(kfac.plan, state)
  before = kaisa_jax.layer_decompositions(kfac.plan, state)[name]
  a = kaisa_jax.layer_factors(kfac.plan, state)[name].a
  assert a.shape == (2, 10, 10)
  _, state = step(params, _poisoned(state, a, 3))
  assert int(state.failed_decompositions) == 1
  after = kaisa_jax.layer_decompositions(kfac.plan, state)[name]
  jax.tree.map(np.testing.assert_array_equal, after.a, before.a)
  np.testing.assert_allclose(after.g.values, 2 * before.g.values, atol=1e-6)


class _Mixed(nn.Module):
  """A grouped convolution, a stack of three equal dense layers and a wide output layer."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3), feature_group_count=2)(x)).reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(16)(x))
    for _ in range(3):
      x = nn.relu(nn.Dense(16)(x))
    return nn.Dense(40)(x)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_on_the_cpu_the_decompositions_in_place_are_the_batched_calls_bit_for_bit(
  monkeypatch, method
):
  """The CPU decomposes member by member in place (`phases._decompose_in_place`); elsewhere one
  batched call per size. Same factors, same buffer, failures included: member 1 of the stack has
  a NaN in its ``A``."""
  model = _Mixed()
  x = jax.random.normal(jax.random.key(0), (6, 6, 6, 4))
  y = jax.random.randint(jax.random.key(1), (6,), 0, 40)
  params = model.init(jax.random.key(2), x)
  grad_fn = kaisa_jax.value_and_grad(
    lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
  )
  kfac = kaisa_jax.kfac(grad_fn.layers(params, x, y), compute_method=method, max_cost_ratio=0.5)
  plan = kfac.plan
  treatments = [t for _, t in plan.layers]
  assert any(spec.groups == 2 for spec, _ in plan.layers)  # a grouped layer
  assert any(any(t.diagonal) for t in treatments)  # a diagonal side
  assert any(not all(t.diagonal) for t in treatments)  # a dense side
  (stack,) = [s for s in plan.layout.all_stacks() if len(s) == 3]
  _, grads, curvature = grad_fn(params, x, y)
  _, state = jax.jit(lambda s: kfac.update(grads, s, params, curvature=curvature))(
    kfac.init(params)
  )
  # Member 1's A at its place in the factor buffer, read off a buffer that holds its own offsets.
  stacks = plan.layout.stacks(0, 0)
  places = stacking.factor_stacks(plan, jnp.arange(state.factors.size), stacks)
  offset = int(places[stacks.index(stack)].a[1].reshape(-1)[0])
  spoilt = state.factors.reshape(-1).at[offset].set(jnp.nan)
  state = state._replace(factors=spoilt.reshape(state.factors.shape))

  def decomposed(on_cpu):
    with monkeypatch.context() as m:  # the phase's choice only: `each_matrix` still loops
      names = {k: v for k, v in vars(cpu_loop).items() if not k.startswith("__")}
      m.setattr(phases, "cpu_loop", types.SimpleNamespace(**{**names, "on_cpu": on_cpu}))
      out = jax.jit(
        lambda s: phases.decompose_factors(plan, s, jnp.float32(1e-2), plan.collectives)
      )(state)
    return out.decompositions, out.failed_decompositions

  in_place, failed = decomposed(lambda: True)
  batched, failed_batched = decomposed(lambda: False)
  assert int(failed) == int(failed_batched) == int(state.failed_decompositions) + 1
  np.testing.assert_array_equal(in_place, batched)
