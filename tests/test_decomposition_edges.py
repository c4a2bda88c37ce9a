"""Edge cases of the decompositions and the damping, against numpy references from docs/math.md.

* A factor with no curvature (mean eigenvalue 0, e.g. a layer whose inputs are
  all 0) counts with scale 1 in the factored damping forms.
* The inverse method symmetrises each factor, damps it by its own share (one
  per matrix, also on a diagonal side), inverts a well-conditioned factor
  without the Cholesky retry, and sizes the retry's jitter as
  ``eps * d * max_i F_ii`` over the member.
* A member whose decomposition is finite in part only (one of its groups
  singular) counts as failed: it is retried, or keeps its last good
  decomposition.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from kaisa_jax import preconditioning

DAMPING = 0.01


def _spd(rng: np.random.Generator, d: int, rank: int) -> np.ndarray:
  rows = rng.standard_normal((rank, d))
  return rows.T @ rows / rank


def _dense_solve(a: np.ndarray, g: np.ndarray, v: np.ndarray, sa: float, sg: float) -> np.ndarray:
  """``P`` with ``((A + sa I) (x) (G + sg I)) vec(P) = vec(V)``, row-major, by one dense solve."""
  kron = np.kron(a + sa * np.eye(len(a)), g + sg * np.eye(len(g)))
  return np.linalg.solve(kron, v.reshape(-1)).reshape(v.shape)


@pytest.mark.parametrize("form", ["pi", "relative"])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_a_factor_with_no_curvature_counts_with_scale_one(x64, form, method):
  """``A = 0``: its mean eigenvalue counts as 1 (docs/math.md, "Damping")."""
  rng = np.random.default_rng(0)
  a = np.zeros((5, 5))
  g = _spd(rng, 3, 8)
  v = rng.standard_normal((5, 3))
  m_a, m_g = 1.0, np.trace(g) / 3
  root = np.sqrt(DAMPING)
  if form == "pi":
    pi = np.sqrt(m_a / m_g)
    sa, sg = root * pi, root / pi
  else:
    sa, sg = root * m_a, root * m_g
  expected = _dense_solve(a, g, v, sa, sg)

  damping = jnp.float64(DAMPING)
  fa, fg = jnp.asarray(a)[None, None], jnp.asarray(g)[None, None]
  if method == "inverse":
    share_a, share_g = preconditioning.side_damping(
      form,
      damping,
      preconditioning.factor_mean(fa, False),
      preconditioning.factor_mean(fg, False),
    )
  else:
    share_a = share_g = damping
  da = preconditioning.decompose(fa, method, False, share_a)
  dg = preconditioning.decompose(fg, method, False, share_g)
  got = preconditioning.precondition(jnp.asarray(v)[None, None], da, dg, method, damping, form)
  np.testing.assert_allclose(np.asarray(got[0, 0]), expected, rtol=1e-9, atol=1e-12)


def test_the_inverse_method_inverts_the_symmetric_part_of_a_factor(x64):
  rng = np.random.default_rng(1)
  s = _spd(rng, 6, 12)
  k = rng.standard_normal((6, 6))
  f = s + 0.3 * (k - k.T)  # its symmetric part is s
  inverse = preconditioning.decompose(jnp.asarray(f)[None, None], "inverse", False, DAMPING).basis
  expected = np.linalg.inv(s + DAMPING * np.eye(6))
  np.testing.assert_allclose(np.asarray(inverse[0, 0]), expected, rtol=1e-9)


def test_a_diagonal_side_is_damped_by_each_matrix_own_share():
  """A stack of 3 members of 2 groups, one share per matrix: ``1 / (F_ii + s)`` each."""
  rng = np.random.default_rng(2)
  factor = rng.uniform(0.0, 2.0, (3, 2, 7)).astype(np.float32)
  shares = rng.uniform(0.01, 1.0, (3, 2)).astype(np.float32)
  got = preconditioning.decompose(jnp.asarray(factor), "inverse", True, jnp.asarray(shares)).values
  np.testing.assert_allclose(np.asarray(got), 1.0 / (factor + shares[..., None]), rtol=1e-6)


def test_a_well_conditioned_factor_is_inverted_without_the_retry():
  """A wide diagonal: a retry's jitter, ``eps * d * 1e4``, would change the inverse by 2 %."""
  d = 16
  f = np.eye(d, dtype=np.float32)
  f[3, 3] = 1e4
  inverse = preconditioning.decompose(jnp.asarray(f)[None, None], "inverse", False, 1.0).basis
  np.testing.assert_allclose(np.asarray(inverse[0, 0]), np.linalg.inv(f + np.eye(d)), rtol=1e-5)


def test_the_retry_damps_by_the_rounding_error_of_the_member_diagonal():
  """A singular member at damping 0: ``(F + eps d max_i F_ii I)^-1``, the maximum over its groups."""
  d = 8
  eps = np.finfo(np.float32).eps
  singular = np.diag([0.0] * (d - 1) + [3.0])  # its largest diagonal entry last
  other = np.diag(np.linspace(1.0, 5.0, d))  # the member's other group, positive definite
  member = np.stack([singular, other]).astype(np.float32)[None]
  inverse = np.asarray(preconditioning.decompose(jnp.asarray(member), "inverse", False, 0.0).basis)
  jitter = eps * d * 5.0
  for j, f in enumerate([singular, other]):
    np.testing.assert_allclose(inverse[0, j], np.linalg.inv(f + jitter * np.eye(d)), rtol=1e-5)


def test_a_member_finite_in_part_only_is_retried():
  """One group of a member fails its first Cholesky; the member as a whole is retried, finite."""
  d = 6
  singular = np.zeros((d, d), np.float32)
  singular[0, 0] = 1.0
  good = np.eye(d, dtype=np.float32)
  member = jnp.asarray(np.stack([good, singular]))[None]
  inverse = np.asarray(preconditioning.decompose(member, "inverse", False, 0.0).basis)
  assert np.isfinite(inverse).all()


def test_a_member_finite_in_part_only_counts_as_not_finite():
  x = jnp.asarray([[1.0, 2.0, 3.0], [1.0, jnp.nan, 3.0], [jnp.inf, jnp.nan, jnp.nan]])
  np.testing.assert_array_equal(preconditioning.finite_per_member(x), [True, False, False])


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_bfloat16_factors_are_decomposed_in_float32(method):
  """``factor_dtype="bfloat16"``: the decomposition is that of the same factor in float32."""
  rng = np.random.default_rng(3)
  stack = jnp.asarray(np.stack([_spd(rng, 6, 9) for _ in range(2)])[:, None], jnp.bfloat16)
  got = preconditioning.decompose(stack, method, False, 0.1)
  want = preconditioning.decompose(stack.astype(jnp.float32), method, False, 0.1)
  for x, y in zip(got, want, strict=True):
    assert (x is None) == (y is None)
    if x is not None:
      assert x.dtype == jnp.float32
      np.testing.assert_array_equal(x, y)
