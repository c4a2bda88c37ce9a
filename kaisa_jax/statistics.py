"""Curvature statistics: what the preconditioner sees, per layer, as JAX scalars.

For a layer with factors ``A`` and ``G`` (eigenvalues ``a_i`` and ``g_j``,
clamped at 0) and the damping ``lambda`` of the step:

* each factor's eigenvalues' minimum, maximum and mean;
* the relative damping ``lambda / (mean(a) mean(g))``: the damping against the
  mean eigenvalue of ``A (x) G``, the layer's curvature scale (with
  ``damping_form="relative"``, whose damping is already in those units, it is
  ``lambda`` itself; with ``"bounded"`` it is at most 1). Below about
  `NEGLIGIBLE_DAMPING` the damping does not regularise (directions the factors
  barely see are scaled by up to ``1 / lambda``); above about
  `DROWNING_DAMPING` it drowns the curvature (the step is about
  ``gradient / lambda``, plain SGD);
* the condition number of the damped Kronecker product that preconditioning
  inverts, ``max / min`` of its eigenvalues `damped_curvature`: with KAISA's
  damping ``(max(a) max(g) + lambda) / (min(a) min(g) + lambda)`` for the eigen
  method and ``(max(a) + lambda)(max(g) + lambda) / ((min(a) + lambda)(min(g) +
  lambda))`` for the inverse method, whose preconditioner is
  ``(A + lambda I)^-1 (x) (G + lambda I)^-1``; with a factored form (``"pi"``,
  ``"bounded"``, ``"relative"``) ``(max(a) + sa)(max(g) + sg) / ((min(a) + sa)(min(g) + sg))``
  for both methods, ``sa`` and ``sg`` the factors' shares of the damping.

A convolution with ``k > 1`` feature groups has one pair of factors per group:
the minimum, maximum and mean run over every group's eigenvalues, the scale is
the mean over groups of ``mean(a) mean(g)`` and the condition number is that of
the block-diagonal product (largest over smallest eigenvalue of all blocks).

Where the eigenvalues come from, and what they cost:

* eigen method: the eigenvalues stored by the latest decomposition (those
  preconditioning uses, up to ``inv_update_steps - 1`` steps older than the
  factors): nothing is decomposed, a few reductions per layer (on the
  MNIST-1D CNN 0.5 ms added to a 19 ms step);
* inverse method, dense side: ``eigvalsh`` of the current factor, in the
  decomposition dtype: ``O(d^3)``, and in JAX a full ``eigh`` (as much as an
  eigen-method decomposition; on the MNIST-1D CNN 89 ms against an 18 ms
  step on a 2-core CPU, `benchmarks/statistics_cost.py`): compute these at
  logging steps, or every ``N`` steps under ``jax.lax.cond``;
* a diagonal side: its current diagonal (inverse method) or the stored one
  (eigen method), clamped at 0.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kaisa_jax import checkpointing, config, cpu_loop, phases, preconditioning, transform
from kaisa_jax import hyperparameters as hp
from kaisa_jax import state as state_lib
from kaisa_jax.plan import Plan

Array = jax.Array

# Thresholds of `check_damping` on the relative damping, set from
# benchmarks/robustness.py (docs/benchmarks/robustness.md), for K-FAC's own step length
# (step_norm="natural"): of its runs under the KL clip, every one with a layer below 0.1 at the
# end, and most with a layer above 1e3, ended more than twice the tuned first-order optimizer's
# final loss. With each layer's step given its gradient's norm (the default) the relative damping
# marks no worse runs: of its 192 runs with damping_form="pi", whose layers ranged from 8e-5 to
# 4e4, three ended beyond twice the baseline, MNIST-1D's diverged seed (twice, at the same rate;
# its smallest 5e-4, beside ViT runs at 8e-5 that ended at a third of it) and a GRU run with its
# layers between 1.8 and 30; and at damping 0.1 four of eight models had a layer outside
# 0.1..1e3 while K-FAC ended below the baseline. So under that rule it flags nothing.
NEGLIGIBLE_DAMPING = 1e-1
DROWNING_DAMPING = 1e3
# The relative damping is computed in float32: within this relative margin of a threshold it
# is not flagged (under damping_form="relative" it is the damping itself, up to rounding, so
# the default 0.1 would otherwise be called negligible by a rounding error).
THRESHOLD_MARGIN = 1e-4


class Eigenvalues(NamedTuple):
  """The minimum, maximum and mean of one factor's eigenvalues (clamped at 0)."""

  min: Array
  max: Array
  mean: Array


class LayerStatistics(NamedTuple):
  """What one layer's preconditioner sees (module docstring: the formulas).

  Attributes:
    a: the eigenvalues of the input-side factor ``A``.
    g: the eigenvalues of the output-side factor ``G``.
    relative_damping: ``damping / (mean(a) mean(g))``; ``inf`` while the
      factors are zero (before the first factor update and decomposition).
    condition: the condition number of the damped Kronecker product.
  """

  a: Eigenvalues
  g: Eigenvalues
  relative_damping: Array
  condition: Array


class CurvatureStatistics(NamedTuple):
  """`curvature_statistics`' result: per layer, and K-FAC's global numbers.

  Attributes:
    layers: `LayerStatistics` by layer name.
    damping: the damping the statistics use (that of the last step).
    kl_scale: the length of the last step's preconditioned updates over
      K-FAC's own, ``|nu P| / |P|`` over all layers (`KFACState.kl_scale`; 1
      with ``step_norm="natural"`` and no clip).
    steps: K-FAC steps taken.
    skipped_factor_updates: factor updates skipped for non-finite factors.
    failed_decompositions: decompositions that failed (each kept the last good one).
  """

  layers: dict[str, LayerStatistics]
  damping: Array
  kl_scale: Array
  steps: Array
  skipped_factor_updates: Array
  failed_decompositions: Array


class DampingCheck(NamedTuple):
  """The layers `check_damping` flagged, with their relative damping."""

  negligible: dict[str, float]
  drowning: dict[str, float]


def damped_curvature(
  a: Array, g: Array, method: str, damping: Array, form: str, shares: tuple[Array, Array]
) -> Array:
  """The eigenvalue of the damped product that pairs ``a`` (of ``A``) with ``g`` (of ``G``).

  With KAISA's damping ``a g + damping`` for the eigen method and
  ``(a + damping)(g + damping)`` for the inverse method; with a factored form
  ``(a + sa)(g + sg)`` for both, ``shares = (sa, sg)`` from
  `kaisa_jax.preconditioning.side_damping`. The one place where the statistics
  apply the damping.
  """
  if form == preconditioning.KAISA and method == preconditioning.EIGEN:
    return a * g + damping
  sa, sg = shares
  return (a + sa) * (g + sg)


def eigenvalues(factor: Array, diagonal: bool) -> Array:
  """A factor's eigenvalues clamped at 0, ``(groups, d)``, as the eigen method computes them.

  ``factor`` is ``(groups, d, d)`` (symmetrised, then ``eigvalsh``) or, for a
  diagonal side, ``(groups, d)`` (its entries).
  """
  factor = factor.astype(preconditioning.decomposition_dtype(factor.dtype))
  if diagonal:
    return jnp.maximum(factor, 0.0)
  factor = 0.5 * (factor + jnp.swapaxes(factor, -1, -2))
  return jnp.maximum(cpu_loop.each_matrix(jnp.linalg.eigvalsh, factor), 0.0)


def layer_statistics(
  a: Array, g: Array, method: str, damping: Array, form: str = preconditioning.DEFAULT_FORM
) -> LayerStatistics:
  """The statistics of a layer whose factors have eigenvalues ``a`` and ``g``, ``(groups, d)``.

  ``damping`` is the value at the step the statistics describe (a schedule
  resolved already), ``form`` its form (`kaisa_jax.preconditioning`).
  """
  lo_a, hi_a, mean_a = a.min(axis=1), a.max(axis=1), a.mean(axis=1)
  lo_g, hi_g, mean_g = g.min(axis=1), g.max(axis=1), g.mean(axis=1)
  shares = preconditioning.side_damping(form, damping, mean_a, mean_g)
  top = damped_curvature(hi_a, hi_g, method, damping, form, shares).max()
  bottom = damped_curvature(lo_a, lo_g, method, damping, form, shares).min()
  scale = jnp.mean(mean_a * mean_g)
  # The damping in units of the curvature: lambda for KAISA's, and for a factored form the
  # product of its shares (lambda for pi, lambda mA mG for relative, min(lambda, mA mG) bounded).
  absolute = damping if form == preconditioning.KAISA else jnp.mean(shares[0] * shares[1])
  relative = jnp.where(scale > 0, absolute / jnp.where(scale > 0, scale, 1.0), jnp.inf)
  return LayerStatistics(
    Eigenvalues(a.min(), a.max(), a.mean()),
    Eigenvalues(g.min(), g.max(), g.mean()),
    relative.astype(a.dtype),
    (top / bottom).astype(a.dtype),
  )


_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_node(x: Any) -> bool:
  return isinstance(x, (state_lib.KFACState, *_INJECTED))


def find_states(tree: Any, damping: Any = None) -> list[tuple[state_lib.KFACState, Any]]:
  """Every `KFACState` in an optimizer state, with the damping injected around it.

  One walk over ``tree`` (``optax.chain``, ``apply_if_finite``,
  ``MultiSteps`` ... states are pytrees); inside an ``optax.inject_hyperparams``
  state the walk goes on into its inner state, where ``hyperparams["damping"]``
  (if present) is the damping of the states found there. ``damping``: the
  damping injected further out, or ``None``.
  """
  found = []
  for node in jax.tree.leaves(tree, is_leaf=_is_node):
    if isinstance(node, state_lib.KFACState):
      found.append((node, damping))
    elif isinstance(node, _INJECTED):
      found += find_states(node.inner_state, node.hyperparams.get("damping", damping))
  return found


def _one_state(tree: Any) -> tuple[state_lib.KFACState, Any]:
  found = find_states(tree)
  if len(found) != 1:
    raise ValueError(
      f"curvature_statistics needs an optimizer state with one K-FAC state; this one has "
      f"{len(found)}"
      + (
        ": pass the part of the optimizer state that holds the K-FAC state you mean"
        if found
        else ": pass the state of a transformation that contains kaisa_jax.kfac"
      )
    )
  return found[0]


def _global_view(plan: Plan, state: state_lib.KFACState) -> state_lib.KFACState:
  """The global state, or a clear error for one device's view of a distributed state."""
  comm, layout = plan.collectives, plan.layout
  one_device_view = (comm.mode == "pmap" and layout.devices > 1 and np.ndim(state.count) == 0) or (
    comm.mode == "shard_map" and tuple(np.shape(state.factors)[:2]) != (layout.rows, layout.cols)
  )
  if one_device_view:
    raise ValueError(
      "curvature_statistics got one device's view of a distributed K-FAC state (inside "
      "jax.shard_map or jax.pmap, or one device's copy of a pmapped state): each device holds "
      "only the factors and decompositions of its own layers. Call it on the whole state: "
      "outside shard_map (e.g. in the jitted function that calls the shard_mapped step), or "
      "outside pmap on the state the pmapped step returns, with its leading device axis"
    )
  return checkpointing.global_state(plan, state, "curvature_statistics")


def _resolve_damping(
  kfac: transform.KFAC | Plan,
  state: state_lib.KFACState,
  injected: Any,
  damping: Any,
  dtype: Any,
) -> Array:
  """The damping of the last step: given, injected, or ``kfac``'s at step ``count - 1``."""
  if damping is None:
    damping = injected
  if damping is None:
    if not isinstance(kfac, transform.KFAC):
      raise TypeError(
        "curvature_statistics needs the damping: pass the kfac transformation (it knows its "
        "damping), or damping= with a plan"
      )
    last = jnp.maximum(jnp.asarray(state.count) - 1, 0)
    return hp.at(kfac.damping, last, dtype)
  return jnp.asarray(damping, dtype)


def curvature_statistics(
  kfac: transform.KFAC | Plan, opt_state: Any, damping: Any = None
) -> CurvatureStatistics:
  """Per layer, the eigenvalues, relative damping and condition number K-FAC works with.

  Finds K-FAC's state in ``opt_state`` (inside ``optax.chain``,
  ``optax.apply_if_finite``, ``optax.MultiSteps``, ``optax.inject_hyperparams``
  or any nesting of them) and returns, for every preconditioned layer,
  `LayerStatistics` (see the module docstring for each formula and what it
  is computed from), with K-FAC's KL-clip scale and health counters. Every
  entry is a JAX scalar: call it inside a jitted step and return the result as
  metrics, or on the state a step returned. With the eigen method it reads the
  stored eigenvalues and decomposes nothing; the inverse method costs one
  ``eigvalsh`` per dense factor.

  On concrete values (not traced), it computes them as one program, compiled
  at the first call for each plan, and also runs `check_damping` for the
  plan's step rule, which warns once per process where the damping is
  negligible or drowns the curvature (with ``step_norm="natural"``).

  Distributed: it reads a single-device state, the global state of a mesh
  (outside ``jax.shard_map``, also inside ``jax.jit``) and a pmapped state
  with its leading device axis (outside ``jax.pmap``), all giving the same
  numbers. Inside ``shard_map`` or ``pmap`` a device sees only its own layers'
  factors: it raises, saying where to call it instead.

  Args:
    kfac: the `kaisa_jax.kfac` transformation the state belongs to, or its
      ``plan``. Under ``optax.inject_hyperparams`` build ``kaisa_jax.kfac`` with
      the same layers and static settings to get it.
    opt_state: an optimizer state holding exactly one `kaisa_jax.KFACState`.
    damping: the damping of the step the state comes from. Default: the
      injected ``hyperparams["damping"]`` of an enclosing
      ``optax.inject_hyperparams``, else ``kfac``'s damping (a schedule at the
      last step taken, ``count - 1``). Required with a plan outside
      ``inject_hyperparams``.

  Returns:
    `CurvatureStatistics`: ``layers`` (name to `LayerStatistics`), ``damping``,
    ``kl_scale``, ``steps``, ``skipped_factor_updates`` and
    ``failed_decompositions``.
  """
  plan = kfac.plan if isinstance(kfac, transform.KFAC) else kfac
  if not isinstance(plan, Plan):
    raise TypeError(
      f"curvature_statistics' first argument is a kaisa_jax.kfac transformation or its plan, "
      f"got {type(kfac).__name__}"
    )
  state, injected = _one_state(opt_state)
  state = _global_view(plan, state)
  dtype = preconditioning.decomposition_dtype(plan.factor_dtype)
  damp = _resolve_damping(kfac, state, injected, damping, dtype)
  if any(hp.is_traced(x) for x in jax.tree.leaves((state, damp))):
    return _statistics(plan, state, damp)
  # Concrete: one compiled program per plan, rather than an operation at a time.
  stats = _compiled_statistics(plan, state, damp)
  check_damping(stats, plan.step_norm)
  return stats


def _statistics(plan: Plan, state: state_lib.KFACState, damp: Array) -> CurvatureStatistics:
  """`curvature_statistics` of a global K-FAC state at damping ``damp``, without the check."""
  dtype = preconditioning.decomposition_dtype(plan.factor_dtype)
  form = plan.damping_form
  decompositions = state_lib.grouped_decompositions(plan, state)
  needs_factors = any(t.method != preconditioning.EIGEN for _, t in plan.layers)
  factors = state_lib.grouped_factors(plan, state) if needs_factors else {}
  layers = {}
  for spec, t in plan.layers:
    values = []
    for side, diagonal in zip("ag", t.diagonal, strict=True):
      if t.method == preconditioning.EIGEN:
        values.append(getattr(decompositions[spec.name], side).values.astype(dtype))
      else:
        values.append(eigenvalues(getattr(factors[spec.name], side), diagonal))
    layers[spec.name] = layer_statistics(
      *values, t.method, damp, phases.layer_damping_form(spec, form)
    )
  return CurvatureStatistics(
    layers,
    damp,
    state.kl_scale,
    state.count,
    state.skipped_factor_updates,
    state.failed_decompositions,
  )


_compiled_statistics = jax.jit(_statistics, static_argnums=0)


_warned: set[str] = set()


def check_damping(stats: CurvatureStatistics, step_norm: str) -> DampingCheck:
  """Warns, once per process for each case, where the damping is off the layers' curvature.

  With K-FAC's own step length (``step_norm="natural"``), a layer's relative
  damping below `NEGLIGIBLE_DAMPING` means the damping does not regularise it;
  above `DROWNING_DAMPING`, that it drowns its curvature (each threshold with a
  margin of `THRESHOLD_MARGIN` for float32 rounding); in the robustness
  benchmark such runs mostly ended beyond twice the baseline's loss. With each
  layer's step given its gradient's norm (``"gradient"``, the default) nothing
  is flagged: there the relative damping marked no worse runs (the thresholds'
  comment gives the figures). Layers without curvature yet (relative damping
  ``inf``) are left out. Reads concrete values: call it on the statistics a
  jitted step returned.

  Args:
    stats: from `curvature_statistics`.
    step_norm: the ``step_norm`` of the `kaisa_jax.kfac` the statistics come
      from (`curvature_statistics` passes its own); required, since the
      statistics do not record it and the two rules flag differently.

  Returns:
    `DampingCheck`: the flagged layers with their relative damping (also when
    the warning was given before).
  """
  config.check_choice("step_norm", step_norm, preconditioning.STEP_NORMS)
  relative = {name: s.relative_damping for name, s in stats.layers.items()}
  if any(hp.is_traced(x) for x in relative.values()):
    raise TypeError(
      "check_damping reads concrete values: call it outside jit, on the statistics a jitted "
      "step returned"
    )
  relative = {name: float(x) for name, x in relative.items() if np.isfinite(float(x))}
  if step_norm == preconditioning.GRADIENT:
    return DampingCheck({}, {})
  found = DampingCheck(
    {n: r for n, r in relative.items() if r < NEGLIGIBLE_DAMPING * (1 - THRESHOLD_MARGIN)},
    {n: r for n, r in relative.items() if r > DROWNING_DAMPING * (1 + THRESHOLD_MARGIN)},
  )
  damping = float(stats.damping)
  if found.negligible and "negligible" not in _warned:
    _warned.add("negligible")
    least = damping * NEGLIGIBLE_DAMPING / min(found.negligible.values())
    warnings.warn(
      f"kaisa_jax: the damping {damping:g} is negligible against the curvature of "
      f"{_layers_text(found.negligible)} (relative damping damping / (mean eig A x mean eig G) "
      f"below {NEGLIGIBLE_DAMPING:g}): directions the factors barely see are scaled by up to "
      f"1 / damping. A damping of at least {least:.3g} brings every layer to {NEGLIGIBLE_DAMPING:g}",
      stacklevel=2,
    )
  if found.drowning and "drowning" not in _warned:
    _warned.add("drowning")
    most = damping * DROWNING_DAMPING / max(found.drowning.values())
    warnings.warn(
      f"kaisa_jax: the damping {damping:g} drowns the curvature of "
      f"{_layers_text(found.drowning, largest_first=True)} (relative damping above {DROWNING_DAMPING:g}): their "
      "step is about gradient / damping, plain SGD. A damping of at most "
      f"{most:.3g} brings every layer to {DROWNING_DAMPING:g}",
      stacklevel=2,
    )
  return found


def _layers_text(flagged: dict[str, float], largest_first: bool = False, shown: int = 3) -> str:
  """``layer(s) A (1e-08), B (3e-07) and 4 more``: the farthest from the threshold first."""
  items = sorted(flagged.items(), key=lambda kv: kv[1], reverse=largest_first)
  text = ", ".join(f"{n} ({r:.2g})" for n, r in items[:shown])
  more = len(items) - shown
  return f"layer(s) {text}" + (f" and {more} more" if more > 0 else "")
