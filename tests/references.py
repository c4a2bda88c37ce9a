"""Independent reference computations for the tests (numpy, float64).

Nothing here calls kaisa_jax: factors are built from explicitly extracted rows
and the preconditioned gradient from a dense solve of the Kronecker system.
"""

from __future__ import annotations

import itertools

import numpy as np


def dense_rows(x: np.ndarray, bias: bool) -> np.ndarray:
  rows = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
  if bias:
    rows = np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)
  return rows


def input_factor(rows: np.ndarray) -> np.ndarray:
  """``A = (1/r) sum_rows a a^T``."""
  return rows.T @ rows / rows.shape[0]


def output_factor(g_rows: np.ndarray, n: float) -> np.ndarray:
  """``G = (1/n) sum_rows (n g)(n g)^T``."""
  scaled = n * np.asarray(g_rows, np.float64)
  return scaled.T @ scaled / n


def lax_pads(size: int, k: int, stride: int, dilation: int, padding) -> tuple[int, int]:
  """Low and high padding of one spatial axis, as XLA defines SAME and VALID."""
  if padding == "VALID":
    return 0, 0
  if padding == "SAME":
    extent = (k - 1) * dilation + 1
    out = -(-size // stride)
    total = max((out - 1) * stride + extent - size, 0)
    return total // 2, total - total // 2
  return padding


def conv_patches(
  x: np.ndarray,
  kernel_size: tuple[int, ...],
  strides: tuple[int, ...],
  padding,
  kernel_dilation: tuple[int, ...],
  input_dilation: tuple[int, ...],
  groups: int,
) -> np.ndarray:
  """Patches of a channels-last input, shape ``(groups, rows, prod(k) * c_in/groups)``.

  A plain loop over output positions and kernel taps: the feature order is
  ``(*kernel_size, channel)``, the layout of a Flax kernel.
  """
  x = np.asarray(x, np.float64)
  batch, spatial, channels = x.shape[0], x.shape[1:-1], x.shape[-1]
  rank = len(spatial)
  # Input dilation: insert zeros between input elements.
  dilated_shape = tuple((s - 1) * d + 1 for s, d in zip(spatial, input_dilation))
  xd = np.zeros((batch, *dilated_shape, channels))
  xd[(slice(None), *(slice(None, None, d) for d in input_dilation), slice(None))] = x
  pads = [
    lax_pads(
      dilated_shape[i],
      kernel_size[i],
      strides[i],
      kernel_dilation[i],
      padding if isinstance(padding, str) else padding[i],
    )
    for i in range(rank)
  ]
  xp = np.pad(xd, [(0, 0), *pads, (0, 0)])
  out_shape = [
    (xp.shape[1 + i] - ((kernel_size[i] - 1) * kernel_dilation[i] + 1)) // strides[i] + 1
    for i in range(rank)
  ]
  per_group = channels // groups
  rows = []
  for b in range(batch):
    for pos in itertools.product(*(range(o) for o in out_shape)):
      feats = np.zeros((groups, int(np.prod(kernel_size)), per_group))
      for t, tap in enumerate(itertools.product(*(range(k) for k in kernel_size))):
        idx = tuple(pos[i] * strides[i] + tap[i] * kernel_dilation[i] for i in range(rank))
        pixel = xp[(b, *idx)]
        feats[:, t, :] = pixel.reshape(groups, per_group)
      rows.append(feats.reshape(groups, -1))
  return np.stack(rows, axis=1)


def kronecker_solve(a: np.ndarray, g: np.ndarray, v: np.ndarray, damping: float) -> np.ndarray:
  """``(A (x) G + damping I)^-1 vec(V)`` by a dense solve, V of shape ``(a_dim, g_dim)``."""
  system = np.kron(a, g) + damping * np.eye(a.shape[0] * g.shape[0])
  return np.linalg.solve(system, v.reshape(-1)).reshape(v.shape)


def two_sided_inverse(a: np.ndarray, g: np.ndarray, v: np.ndarray, damping: float) -> np.ndarray:
  """``(A + damping I)^-1 V (G + damping I)^-1``."""
  left = np.linalg.inv(a + damping * np.eye(a.shape[0]))
  right = np.linalg.inv(g + damping * np.eye(g.shape[0]))
  return left @ v @ right


def gradient_matrix(
  kernel_grad: np.ndarray, bias_grad: np.ndarray | None, groups: int
) -> np.ndarray:
  """Per group, ``[kernel; bias]`` as ``(groups, a_dim, g_dim)``."""
  k = np.asarray(kernel_grad, np.float64)
  out = k.shape[-1] // groups
  mats = k.reshape(-1, groups, out).transpose(1, 0, 2)
  if bias_grad is not None:
    b = np.asarray(bias_grad, np.float64).reshape(groups, 1, out)
    mats = np.concatenate([mats, b], axis=1)
  return mats


def damped_solve(
  a: np.ndarray, g: np.ndarray, v: np.ndarray, damping: float, form: str, method: str
) -> np.ndarray:
  """The preconditioned gradient under each damping form, by dense solves.

  ``mA = tr(A) / a_dim`` and ``mG = tr(G) / g_dim``. ``"kaisa"``: eigen solves
  ``A (x) G + damping I``, inverse ``(A + damping I)^-1 V (G + damping I)^-1``.
  The factored forms solve ``(A + sa I) (x) (G + sg I)`` with either method:
  ``sa, sg = sqrt(damping) mA, sqrt(damping) mG`` (``"relative"``) or
  ``pi sqrt(damping), sqrt(damping) / pi`` with ``pi = sqrt(mA / mG)`` (``"pi"``; with
  ``"bounded"`` the damping first replaced by ``min(damping, mA mG)``).
  """
  ia, ig = np.eye(a.shape[0]), np.eye(g.shape[0])
  ma, mg = np.trace(a) / a.shape[0], np.trace(g) / g.shape[0]
  root, pi = np.sqrt(damping), np.sqrt(ma / mg)
  if form == "kaisa":
    if method == "inverse":
      return np.linalg.inv(a + damping * ia) @ v @ np.linalg.inv(g + damping * ig)
    system = np.kron(a, g) + damping * np.eye(a.shape[0] * g.shape[0])
  else:
    if form == "bounded":
      root = min(root, np.sqrt(ma * mg))
    sa, sg = (root * ma, root * mg) if form == "relative" else (root * pi, root / pi)
    system = np.kron(a + sa * ia, g + sg * ig)
  return np.linalg.solve(system, v.reshape(-1)).reshape(v.shape)
