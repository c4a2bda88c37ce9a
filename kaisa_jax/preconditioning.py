"""Decompositions of the factors and the preconditioned gradient.

For a layer with factors ``A`` (input side) and ``G`` (output side) and its
gradient as a matrix ``V`` of shape ``(a_dim, g_dim)``:

* ``"eigen"``: ``A = Qa diag(da) Qa^T``, ``G = Qg diag(dg) Qg^T`` and

    ``P = Qa [ (Qa^T V Qg) / D ] Qg^T``,

  with ``D`` the eigenvalues of the damped Kronecker product (below): with
  KAISA's damping ``D = da dg^T + damping``, which is exactly
  ``(A (x) G + damping I)^-1 vec(V)``. The damping enters at every step, so a
  damping schedule acts between decompositions too.
* ``"inverse"``: ``P = (A + sa I)^-1 V (G + sg I)^-1``, each factor damped
  separately by its share ``sa``, ``sg`` of the damping (below); applied when
  the inverses are computed. If the Cholesky factorisation fails (a factor
  singular up to rounding at a tiny damping), it is retried once with the
  damping raised by ``eps * d * max(diag)``.

The damping's form (``damping_form``), with ``mA = tr(A) / a_dim`` and
``mG = tr(G) / g_dim`` the factors' mean eigenvalues (a factor whose mean is 0
counts as 1) and ``lambda`` the ``damping`` hyperparameter:

* ``"relative"``: each factor damped relative to its own scale,
  ``(A + sqrt(lambda) mA I) (x) (G + sqrt(lambda) mG I)``. Eigen:
  ``D = (da + sqrt(lambda) mA) (dg + sqrt(lambda) mG)^T``; inverse:
  ``sa = sqrt(lambda) mA``, ``sg = sqrt(lambda) mG``. This is the pi-corrected
  form below with the damping measured in units of the layer's curvature,
  ``lambda mA mG``: scaling a layer's ``A`` or ``G`` by ``c`` scales its
  preconditioned gradient by ``1 / c``, as the undamped inverse does, so one
  ``lambda`` means the same on every layer and model.
* ``"pi"``: factored Tikhonov damping with the pi-correction
  (Martens and Grosse 2015, section 6.3), ``(A + pi sqrt(lambda) I) (x) (G + sqrt(lambda) /
  pi I)`` with ``pi = sqrt(mA / mG)``. Eigen:
  ``D = (da + pi sqrt(lambda)) (dg + sqrt(lambda) / pi)^T``; inverse:
  ``sa = pi sqrt(lambda)``, ``sg = sqrt(lambda) / pi``.
* ``"bounded"`` (`DEFAULT_FORM`): the pi-corrected form with the damping bounded by the
  layer's mean curvature, ``min(lambda, mA mG)`` for ``lambda``: where
  ``lambda`` exceeds it, each factor is damped by its own mean eigenvalue,
  ``sa = mA``, ``sg = mG``, the relative form at ``lambda = 1``. A damping
  above the curvature turns the step towards the plain gradient's direction;
  the bound keeps every layer's step a curvature step.
* ``"kaisa"``: the absolute damping of the KAISA reference. Eigen:
  ``D = da dg^T + lambda``; inverse: ``sa = sg = lambda`` (a different, stronger
  regulariser than the eigen method's for the same ``lambda``).

The three factored forms give the same preconditioner with either method, up
to rounding.

A side may be kept diagonal (its factor is then a vector of the diagonal):
its basis is the identity and its eigenvalues are the diagonal itself.

The step's length (``step_norm``): with ``"gradient"`` (the default) each
preconditioned layer's update ``nu P`` is rescaled to the norm of its
gradient, ``nu = |V| / |P|`` layer by layer (`gradient_norm_scale`); with
``"natural"`` it keeps K-FAC's own length, ``nu = 1``, or with a KL clip
``nu = min(1, sqrt(kl_clip / |lr^2 sum <P, V>|))`` (`kl_clip_scale`, the KAISA
reference's).

Decompositions run in float32 or better whatever the model dtype: factors are
symmetrised first and eigenvalues clamped at zero.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kaisa_jax import cpu_loop

Array = jax.Array
HIGHEST = jax.lax.Precision.HIGHEST

EIGEN = "eigen"
INVERSE = "inverse"
METHODS = (EIGEN, INVERSE)

KAISA = "kaisa"
PI = "pi"
BOUNDED = "bounded"
RELATIVE = "relative"
DAMPING_FORMS = (PI, BOUNDED, RELATIVE, KAISA)
# The default form, and the damping it is used with. Over the eight models of
# benchmarks/robustness.py (final loss against each model's tuned first-order
# optimizer, K-FAC's rate tuned alike), the bounded form at 0.1 ends at or below
# every baseline and within 2x of its best over the dampings 1e-4 to 1e-1 on all
# eight, "pi" on six (docs/guides/damping.md). 0.1 was the best damping of the
# unbounded forms; the bound makes every larger one the same.
DEFAULT_FORM = BOUNDED
DEFAULT_DAMPING = 0.1

# How long a step is (`gradient_norm_scale`, `kl_clip_scale`): each layer's gradient's norm (the
# default: on the same models, at or below the baselines on more of them than the KL clip, and
# flatter over the damping than one norm for all layers), or K-FAC's own, bounded by the KL clip
# if one is set.
GRADIENT = "gradient"
NATURAL = "natural"
STEP_NORMS = (GRADIENT, NATURAL)


def default_form(step_norm: str) -> str:
  """The damping form ``kfac`` takes when none is given: `DEFAULT_FORM` under the default step
  rule, ``"pi"`` under K-FAC's own step length (``"natural"``).

  With K-FAC's own step the damping is what bounds the step in directions the factors barely
  see, and the bound would lift that floor: under the KAISA KL clip at damping 0.1,
  benchmarks/robustness.py measured ``"bounded"`` at or below the first-order baseline on three
  models of eight, ``"pi"`` on six (the GRU and the LSTM at 270x and 1700x the baseline's loss
  against 0.23x and 17x; docs/guides/damping.md). With each layer's step given its gradient's
  norm the damping only sets the step's direction.
  """
  return DEFAULT_FORM if step_norm == GRADIENT else PI


class Decomposition(NamedTuple):
  """What preconditioning uses from one factor, batched over groups.

  Attributes:
    basis: eigenvectors (eigen method) or the damped inverse (inverse method),
      ``(groups, d, d)``; ``None`` for a diagonal side.
    values: eigenvalues (eigen method, or a diagonal side of it) or the damped
      inverse of a diagonal side (inverse method), ``(groups, d)``; ``None``
      for a dense side of the inverse method.
  """

  basis: Array | None
  values: Array | None


def decomposition_dtype(factor_dtype: Any) -> Any:
  """Decompositions run in the factor dtype, but never below float32."""
  return jnp.promote_types(factor_dtype, jnp.float32)


def _scale(mean: Array) -> Array:
  """A factor's mean eigenvalue as a scale: 1 where it is 0 (a factor with no curvature)."""
  return jnp.where(mean > 0, mean, jnp.ones_like(mean))


def factor_mean(factor: Array, diagonal: bool) -> Array:
  """``tr(F) / d`` of each matrix of a stack of factors (``(..., d, d)``, or ``(..., d)`` if diagonal)."""
  return jnp.mean(factor if diagonal else jnp.diagonal(factor, axis1=-2, axis2=-1), axis=-1)


def side_damping(form: str, damping: Array, mean_a: Array, mean_g: Array) -> tuple[Array, Array]:
  """``(sa, sg)``: the shares of the damping that the inverse method adds to ``A`` and ``G``.

  ``mean_a`` and ``mean_g`` are the factors' mean eigenvalues (`factor_mean`),
  batched alike; see the module docstring for each form.
  """
  if form == KAISA:
    return damping, damping
  mean_a, mean_g = _scale(mean_a), _scale(mean_g)
  root = jnp.sqrt(damping)
  if form == RELATIVE:
    return root * mean_a, root * mean_g
  if form == BOUNDED:
    root = jnp.minimum(root, jnp.sqrt(mean_a * mean_g))
  pi = jnp.sqrt(mean_a / mean_g)
  return root * pi, root / pi


def damped_eigenvalues(da: Array, dg: Array, damping: Array, form: str) -> Array:
  """``D``, ``(..., a_dim, g_dim)``: the eigenvalues of the damped ``A (x) G`` (eigen method).

  ``da`` and ``dg`` are the eigenvalues of ``A`` and ``G``, ``(..., a_dim)`` and
  ``(..., g_dim)``; see the module docstring for each form.
  """
  if form == KAISA:
    return da[..., :, None] * dg[..., None, :] + damping
  sa, sg = side_damping(form, damping, jnp.mean(da, axis=-1), jnp.mean(dg, axis=-1))
  return (da + sa[..., None])[..., :, None] * (dg + sg[..., None])[..., None, :]


def finite_per_member(x: Array) -> Array:
  """``(k,)``: whether each entry of a stack's leading axis is finite throughout."""
  return jnp.all(jnp.isfinite(x).reshape(x.shape[0], -1), axis=1)


def decompose(factor: Array, method: str, diagonal: bool, damping: Array) -> Decomposition:
  """Decomposes a stack of factors, ``(k, ..., d, d)`` (``(k, ..., d)`` if diagonal).

  ``damping`` is what the inverse method adds to this factor (its share, see
  `side_damping`): a scalar, or one value per matrix (``factor``'s batch
  shape); the eigen method ignores it. Every matrix is decomposed on its own;
  the Cholesky retry below is decided and sized per entry of the leading axis
  (`kaisa_jax.phases` passes one matrix per entry), so no entry's result
  depends on the others.
  """
  dtype = decomposition_dtype(factor.dtype)
  factor = factor.astype(dtype)
  damping = jnp.asarray(damping, dtype)
  damping = damping.reshape(*damping.shape, *[1] * ((1 if diagonal else 2) if damping.ndim else 0))
  if diagonal:
    values = jnp.maximum(factor, 0.0)
    return Decomposition(None, values if method == EIGEN else 1.0 / (values + damping))
  factor = 0.5 * (factor + jnp.swapaxes(factor, -1, -2))
  if method == EIGEN:
    values, vectors = cpu_loop.each_matrix(jnp.linalg.eigh, factor)
    return Decomposition(vectors, jnp.maximum(values, 0.0))
  eye = jnp.eye(factor.shape[-1], dtype=dtype)
  per_member = (-1, *[1] * (factor.ndim - 1))

  def cholesky_inverse(damped):
    chol = jax.scipy.linalg.cho_factor(damped, lower=True)
    return jax.scipy.linalg.cho_solve(chol, jnp.broadcast_to(eye, damped.shape))

  # A factor that is singular up to rounding (rank-deficient batch, dead units)
  # can make the Cholesky fail at a tiny damping; retry once with the damping
  # raised by the rounding error of the factor's diagonal.
  inverse = cpu_loop.each_matrix(cholesky_inverse, factor + damping * eye)
  diag = jnp.abs(jnp.diagonal(factor, axis1=-2, axis2=-1))
  jitter = jnp.finfo(dtype).eps * factor.shape[-1] * diag.reshape(factor.shape[0], -1).max(axis=1)
  ok = finite_per_member(inverse).reshape(per_member)
  retry = damping + jitter.reshape(per_member)
  inverse = jax.lax.cond(
    jnp.all(ok),
    lambda: inverse,
    lambda: jnp.where(ok, inverse, cpu_loop.each_matrix(cholesky_inverse, factor + retry * eye)),
  )
  return Decomposition(inverse, None)


def _rotate_in(v: Array, a: Decomposition, g: Decomposition) -> Array:
  if a.basis is not None:
    v = jnp.einsum("...ij,...ik->...jk", a.basis, v, precision=HIGHEST)
  if g.basis is not None:
    v = jnp.einsum("...ij,...jk->...ik", v, g.basis, precision=HIGHEST)
  return v


def _rotate_out(v: Array, a: Decomposition, g: Decomposition) -> Array:
  if a.basis is not None:
    v = jnp.einsum("...ij,...jk->...ik", a.basis, v, precision=HIGHEST)
  if g.basis is not None:
    v = jnp.einsum("...ij,...kj->...ik", v, g.basis, precision=HIGHEST)
  return v


def precondition(
  v: Array,
  a: Decomposition,
  g: Decomposition,
  method: str,
  damping: Array,
  form: str = DEFAULT_FORM,
) -> Array:
  """Preconditioned gradients, ``v`` of shape ``(..., a_dim, g_dim)`` batched like the factors.

  ``damping`` and ``form`` enter the eigen method here (`damped_eigenvalues`);
  the inverse method's decompositions are already damped.
  """
  if method == EIGEN:
    scale = damped_eigenvalues(a.values, g.values, damping, form)
    return _rotate_out(_rotate_in(v, a, g) / scale, a, g)
  if a.basis is not None:
    v = jnp.einsum("...ij,...jk->...ik", a.basis, v, precision=HIGHEST)
  else:
    v = v * a.values[..., :, None]
  if g.basis is not None:
    return jnp.einsum("...ij,...jk->...ik", v, g.basis, precision=HIGHEST)
  return v * g.values[..., None, :]


def gradient_norm_scale(pp_sum: Array, vv_sum: Array) -> Array:
  """``nu = sqrt(|V|^2 / |P|^2)``, elementwise over layers; 1 where ``|P|^2`` is 0.

  ``nu P`` has the norm of the gradient ``V`` it was computed from: K-FAC
  gives a layer's step its direction and the gradient its length (grafting,
  Agarwal et al. 2020, layer by layer), so the chained optimizer's learning
  rate means what it means without K-FAC. Like `kl_clip_scale`, the square
  root comes last.
  """
  ratio = jnp.where(pp_sum > 0, vv_sum / jnp.where(pp_sum > 0, pp_sum, 1.0), 1.0)
  return jnp.sqrt(ratio)


def kl_clip_scale(vg_sum: Array, kl_clip: Array, lr: Array) -> Array:
  """``nu = min(1, sqrt(kl_clip / |lr^2 sum_layers <P, V>|))``; 1 when the sum is 0.

  Computed as ``sqrt(min(1, kl_clip / |lr^2 sum|))``, the same number bit for
  bit (a correctly rounded square root is monotone and keeps 1 and 0), with
  the square root last. XLA copies cheap scalar operations into every
  consumer of their result, here every parameter's update, but not a square
  root: so every update reads ``nu`` instead of recomputing it.
  """
  denom = jnp.abs(lr**2 * vg_sum)
  ratio = jnp.where(denom > 0, kl_clip / jnp.where(denom > 0, denom, 1.0), 1.0)
  return jnp.sqrt(jnp.minimum(1.0, ratio))
