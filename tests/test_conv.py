"""Convolutions: factors from explicit patch loops, preconditioning by dense solves."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references as ref
from conftest import one_update

import kaisa_jax

DAMPING = 0.03

# (input shape, Conv kwargs). Together they cover 1-3 spatial dims, strides,
# SAME / VALID / explicit / circular padding, kernel and input dilation, grouped
# and depthwise convolutions, with and without bias, and one image without a batch axis.
CASES = {
  "2d-stride-same": ((2, 7, 6, 3), dict(features=4, kernel_size=(3, 3), strides=2, padding="SAME")),
  "2d-dilation-valid-groups": (
    (2, 8, 7, 4),
    dict(
      features=6, kernel_size=(3, 2), padding="VALID", kernel_dilation=(2, 1), feature_group_count=2
    ),
  ),
  "2d-explicit-depthwise": (
    (2, 6, 6, 3),
    dict(
      features=6,
      kernel_size=(2, 3),
      strides=(1, 2),
      padding=((1, 2), (0, 1)),
      feature_group_count=3,
    ),
  ),
  "1d-dilated-same-nobias": (
    (3, 11, 2),
    dict(features=3, kernel_size=(5,), padding="SAME", kernel_dilation=2, use_bias=False),
  ),
  "3d-valid": ((2, 4, 4, 3, 2), dict(features=3, kernel_size=(2, 2, 2), padding="VALID")),
  "2d-input-dilation": (
    (2, 4, 4, 2),
    dict(features=3, kernel_size=(3, 3), padding=((1, 1), (2, 0)), input_dilation=(2, 1)),
  ),
  "1d-circular": ((2, 7, 2), dict(features=2, kernel_size=(4,), padding="CIRCULAR")),
  "2d-reflect-strided": (
    (2, 6, 5, 2),
    dict(features=2, kernel_size=(3, 2), strides=2, padding="REFLECT"),
  ),
  "1d-causal-dilated": (
    (2, 9, 3),
    dict(features=2, kernel_size=(3,), padding="CAUSAL", kernel_dilation=2),
  ),
  "2d-batch-dims": ((2, 3, 5, 5, 2), dict(features=3, kernel_size=(3, 3), padding=1)),
  "2d-unbatched": ((6, 5, 2), dict(features=3, kernel_size=(3, 3), padding="SAME")),
}


def _reference_patches(x, conv: nn.Conv):
  rank = len(conv.kernel_size)
  x = x.reshape(-1, *x.shape[-rank - 1 :])  # batch dimensions flattened, as Flax does
  pad = lambda v: (v,) * rank if isinstance(v, int) else tuple(v)  # noqa: E731
  padding = conv.padding
  extents = [(k - 1) * d + 1 for k, d in zip(conv.kernel_size, pad(conv.kernel_dilation))]
  if padding in ("CIRCULAR", "REFLECT"):
    mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]
    x = np.pad(x, [(0, 0), *[((e - 1) // 2, e // 2) for e in extents], (0, 0)], mode=mode)
    padding = "VALID"
  elif padding == "CAUSAL":
    x = np.pad(x, [(0, 0), (extents[0] - 1, 0), (0, 0)])
    padding = "VALID"
  elif isinstance(padding, int):
    padding = ((padding, padding),) * rank
  return ref.conv_patches(
    x,
    tuple(conv.kernel_size),
    pad(conv.strides),
    padding,
    pad(conv.kernel_dilation),
    pad(conv.input_dilation),
    conv.feature_group_count,
  )


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_conv_matches_explicit_patches_and_dense_solve(x64, case, method):
  input_shape, kwargs = CASES[case]
  conv = nn.Conv(param_dtype=jnp.float64, **kwargs)
  kx, kt, kp = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(kx, input_shape, jnp.float64)
  params = jax.jit(conv.init)(kp, x)
  out = jax.jit(conv.apply)(params, x)
  out_shape = out.shape
  target = jax.random.normal(kt, out_shape, jnp.float64)
  unbatched = len(input_shape) == len(conv.kernel_size) + 1
  batch = 1 if unbatched else input_shape[0]

  def head(s):
    return jnp.sum(0.5 * (jnp.tanh(s) - target) ** 2) / batch

  def loss_fn(params, x):
    return head(conv.apply(params, x))

  grads, _, tx, state, updates = one_update(
    loss_fn, params, x, damping=DAMPING, compute_method=method, factor_dtype=jnp.float64
  )
  groups = conv.feature_group_count
  bias = conv.use_bias
  patches = _reference_patches(np.asarray(x), conv)
  g_rows = np.asarray(jax.jit(jax.grad(head))(out)).reshape(-1, groups, out_shape[-1] // groups)
  (factors,) = kaisa_jax.layer_factors(tx.plan, state).values()
  # One factor per group; a layer of one group has no group axis.
  a_factors, g_factors = (f if groups > 1 else f[None] for f in factors)
  p = grads["params"]
  v = ref.gradient_matrix(p["kernel"], p.get("bias"), groups)
  got = ref.gradient_matrix(updates["params"]["kernel"], updates["params"].get("bias"), groups)
  for j in range(groups):
    a_rows = patches[j]
    if bias:
      a_rows = np.concatenate([a_rows, np.ones((a_rows.shape[0], 1))], axis=1)
    a_ref = ref.input_factor(a_rows)
    g_ref = ref.output_factor(g_rows[:, j], n=batch)
    np.testing.assert_allclose(a_factors[j], a_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g_factors[j], g_ref, rtol=1e-10, atol=1e-12)
    if method == "eigen":
      expected = ref.kronecker_solve(a_ref, g_ref, v[j], DAMPING)
    else:
      expected = ref.two_sided_inverse(a_ref, g_ref, v[j], DAMPING)
    np.testing.assert_allclose(got[j], expected, rtol=1e-7, atol=1e-10)
  assert not np.allclose(got, v, rtol=1e-2)


def test_an_image_without_a_batch_axis_is_one_example_under_reduce(x64):
  """``weight_sharing="reduce"`` averages the patches of each example: here there is one."""
  input_shape, kwargs = CASES["2d-unbatched"]
  conv = nn.Conv(param_dtype=jnp.float64, **kwargs)
  kx, kt, kp = jax.random.split(jax.random.key(4), 3)
  x = jax.random.normal(kx, input_shape, jnp.float64)
  params = conv.init(kp, x)
  out = conv.apply(params, x)
  target = jax.random.normal(kt, out.shape, jnp.float64)

  def head(s):
    return jnp.sum(0.5 * (jnp.tanh(s) - target) ** 2)

  _, _, tx, state, _ = one_update(
    lambda p, x: head(conv.apply(p, x)),
    params,
    x,
    damping=DAMPING,
    factor_dtype=jnp.float64,
    weight_sharing="reduce",
  )
  (patches,) = _reference_patches(np.asarray(x), conv)
  a = np.concatenate([patches, np.ones((patches.shape[0], 1))], axis=1).mean(axis=0)
  g = np.asarray(jax.grad(head)(out)).reshape(-1, out.shape[-1]).sum(axis=0)
  (factors,) = kaisa_jax.layer_factors(tx.plan, state).values()
  np.testing.assert_allclose(factors.a, ref.input_factor(a[None]), rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(factors.g, ref.output_factor(g[None], n=1), rtol=1e-10, atol=1e-14)
