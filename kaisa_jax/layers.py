"""Layer kinds: what each supported Flax layer contributes to K-FAC.

A layer computes ``s = a W (+ b)`` on every row of its input. K-FAC needs

* rows of the layer input ``a`` with a trailing ``1`` when the layer has a bias
  (the bias is folded into the weight as an extra input row),
* rows of the gradient ``g = dL/ds`` at the layer output,
* the gradient of the weight as a matrix ``V`` laid out ``(in, out)`` like a
  Flax kernel, bias last.

Every kind here maps its input, output gradient and parameters onto those three
arrays, each with a leading ``groups`` axis (1 except for grouped convolutions,
whose groups are independent layers as far as K-FAC is concerned):

* ``nn.Dense``: all leading axes of the input are rows.
* ``nn.Conv`` (1, 2 or 3 spatial dims): rows are examples x output positions; the
  input rows are the input patches seen by the kernel at each output position
  (KFC, Grosse & Martens 2016), flattened in the kernel's own
  ``(*kernel_size, in_features // groups)`` order.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
KeyPath = tuple[Any, ...]

DENSE = "dense"
CONV = "conv"


class UnsupportedLayerError(ValueError):
  """A module has parameters that K-FAC cannot precondition."""


@dataclasses.dataclass(frozen=True)
class ConvConfig:
  """The static configuration of a convolution, as Flax accepts it."""

  kernel_size: tuple[int, ...]
  strides: tuple[int, ...]
  padding: str | tuple[tuple[int, int], ...]
  input_dilation: tuple[int, ...]
  kernel_dilation: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """Static description of one preconditioned layer.

  Attributes:
    name: the module path joined by ``/`` (``"encoder/Dense_0"``).
    param_path: the key path, in the params tree given to the loss function, of
      the dict that holds the layer's ``kernel`` (and ``bias``).
    kind: ``"dense"`` or ``"conv"``.
    kernel_shape: the shape of the layer's kernel.
    has_bias: whether the layer has a bias.
    groups: independent groups (``feature_group_count`` of a convolution).
    conv: the convolution's configuration, ``None`` for dense layers.
    calls: how many times the layer is applied in one loss evaluation.
    rows: rows per step (all calls) in the batch the layers were traced with;
      used only to estimate costs.
  """

  name: str
  param_path: KeyPath
  kind: str
  kernel_shape: tuple[int, ...]
  has_bias: bool
  groups: int = 1
  conv: ConvConfig | None = None
  calls: int = 1
  rows: int = dataclasses.field(default=0, compare=False)

  @property
  def a_dim(self) -> int:
    """Size of the input factor ``A`` of one group."""
    return math.prod(self.kernel_shape[:-1]) + int(self.has_bias)

  @property
  def g_dim(self) -> int:
    """Size of the output factor ``G`` of one group."""
    return self.kernel_shape[-1] // self.groups

  @property
  def num_weights(self) -> int:
    return self.groups * self.a_dim * self.g_dim


def layer_kind(module: nn.Module) -> str | None:
  """The kind of a Flax module, or ``None`` when it is not a supported layer.

  A subclass counts only if it keeps the parent's ``__call__``: a layer that
  computes something else must not be mistaken for a dense or a convolution.
  """
  call = type(module).__call__
  if isinstance(module, nn.Dense) and call is nn.Dense.__call__:
    return DENSE
  if isinstance(module, nn.Conv) and call is nn.Conv.__call__:
    return CONV
  return None


def _as_tuple(value: Any, rank: int) -> tuple[int, ...]:
  if value is None:
    return (1,) * rank
  if isinstance(value, int):
    return (value,) * rank
  return tuple(int(v) for v in value)


def _padding(padding: Any, rank: int) -> str | tuple[tuple[int, int], ...]:
  if isinstance(padding, str):
    return padding
  if isinstance(padding, int):
    return ((padding, padding),) * rank
  pads = []
  for p in padding:
    pads.append((p, p) if isinstance(p, int) else (int(p[0]), int(p[1])))
  return tuple(pads)


def make_spec(
  module: nn.Module,
  name: str,
  param_path: KeyPath,
  kernel_shape: tuple[int, ...],
  has_bias: bool,
) -> LayerSpec:
  """Describes a supported module, or raises `UnsupportedLayerError`."""
  kind = layer_kind(module)
  if kind == DENSE:
    return LayerSpec(name, param_path, DENSE, kernel_shape, has_bias)
  if kind != CONV:
    raise UnsupportedLayerError(f"{type(module).__name__} is not a supported layer")
  if module.mask is not None:
    raise UnsupportedLayerError("nn.Conv with a `mask` is not supported")
  if module.conv_general_dilated is not None or module.conv_general_dilated_cls:
    raise UnsupportedLayerError("nn.Conv with a custom convolution is not supported")
  rank = len(kernel_shape) - 2
  config = ConvConfig(
    kernel_size=tuple(kernel_shape[:rank]),
    strides=_as_tuple(module.strides, rank),
    padding=_padding(module.padding, rank),
    input_dilation=_as_tuple(module.input_dilation, rank),
    kernel_dilation=_as_tuple(module.kernel_dilation, rank),
  )
  groups = module.feature_group_count
  return LayerSpec(name, param_path, CONV, kernel_shape, has_bias, groups, config)


def default_examples(spec: LayerSpec, inputs: Array) -> int:
  """Examples the loss averages over by default: the input's leading axis."""
  unbatched_rank = 1 if spec.kind == DENSE else len(spec.kernel_shape) - 1
  return inputs.shape[0] if inputs.ndim > unbatched_rank else 1


def _pad_like_flax(x: Array, config: ConvConfig) -> Array:
  """Pads a ``(batch, *spatial, features)`` input as ``nn.Conv`` does; then no more padding."""
  rank = len(config.kernel_size)
  extents = [
    (k - 1) * d + 1 for k, d in zip(config.kernel_size, config.kernel_dilation, strict=True)
  ]
  if config.padding in ("CIRCULAR", "REFLECT"):
    mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[config.padding]
    pads = [((e - 1) // 2, e // 2) for e in extents]
    x = jnp.pad(x, [(0, 0), *pads, (0, 0)], mode=mode)
  elif config.padding == "CAUSAL":
    x = jnp.pad(x, [(0, 0), (extents[0] - 1, 0), (0, 0)])
  zero = jnp.zeros((), x.dtype)
  if any(d > 1 for d in config.input_dilation):
    interior = [(0, 0, d - 1) for d in config.input_dilation]
    x = jax.lax.pad(x, zero, [(0, 0, 0), *interior, (0, 0, 0)])
  if config.padding in ("SAME", "SAME_LOWER", "VALID"):
    pads = jax.lax.padtype_to_pads(x.shape[1 : rank + 1], extents, config.strides, config.padding)
  elif isinstance(config.padding, str):
    pads = [(0, 0)] * rank
  else:
    pads = config.padding
  return jax.lax.pad(x, zero, [(0, 0, 0), *((lo, hi, 0) for lo, hi in pads), (0, 0, 0)])


def _conv_patches(spec: LayerSpec, inputs: Array, dtype: Any) -> Array:
  """Input patches of a convolution, shape ``(rows, prod(kernel_size), in_features)``.

  One strided slice of the padded input per kernel tap: data movement only.
  """
  config = spec.conv
  assert config is not None
  rank = len(config.kernel_size)
  x = inputs.astype(dtype).reshape(-1, *inputs.shape[inputs.ndim - rank - 1 :])
  x = _pad_like_flax(x, config)
  out = [
    (size - ((k - 1) * d + 1)) // s + 1
    for size, k, d, s in zip(
      x.shape[1:-1], config.kernel_size, config.kernel_dilation, config.strides, strict=True
    )
  ]
  taps = []
  for tap in itertools.product(*(range(k) for k in config.kernel_size)):
    start = [t * d for t, d in zip(tap, config.kernel_dilation, strict=True)]
    limit = [b + (o - 1) * s + 1 for b, o, s in zip(start, out, config.strides, strict=True)]
    taps.append(
      jax.lax.slice(x, (0, *start, 0), (x.shape[0], *limit, x.shape[-1]), (1, *config.strides, 1))
    )
  patches = jnp.stack(taps, axis=-2)
  return patches.reshape(-1, len(taps), x.shape[-1])


def input_rows(spec: LayerSpec, inputs: Array, dtype: Any) -> Array:
  """Rows of ``[a, 1]``, shape ``(groups, rows, a_dim)``."""
  if spec.kind == DENSE:
    rows = inputs.astype(dtype).reshape(1, -1, spec.kernel_shape[0])
  else:
    patches = _conv_patches(spec, inputs, dtype)
    num_rows, taps, in_features = patches.shape
    per_group = in_features // spec.groups
    patches = patches.reshape(num_rows, taps, spec.groups, per_group)
    rows = patches.transpose(2, 0, 1, 3).reshape(spec.groups, num_rows, taps * per_group)
  if spec.has_bias:
    ones = jnp.ones((*rows.shape[:-1], 1), dtype)
    rows = jnp.concatenate([rows, ones], axis=-1)
  return rows


def output_rows(spec: LayerSpec, out_grad: Array, dtype: Any) -> Array:
  """Rows of the output gradient, shape ``(groups, rows, g_dim)``."""
  rows = out_grad.astype(dtype).reshape(-1, spec.groups, spec.g_dim)
  return rows.transpose(1, 0, 2)


def to_matrix(spec: LayerSpec, layer_grads: dict[str, Array], dtype: Any) -> Array:
  """The layer's gradient as ``V`` of shape ``(groups, a_dim, g_dim)``."""
  kernel = layer_grads["kernel"].astype(dtype)
  v = kernel.reshape(-1, spec.groups, spec.g_dim).transpose(1, 0, 2)
  if spec.has_bias:
    bias = layer_grads["bias"].astype(dtype).reshape(spec.groups, 1, spec.g_dim)
    v = jnp.concatenate([v, bias], axis=1)
  return v


def from_matrix(spec: LayerSpec, v: Array) -> dict[str, Array]:
  """Inverse of `to_matrix` (without the dtype cast)."""
  weights = v[:, : v.shape[1] - int(spec.has_bias)]
  kernel = weights.transpose(1, 0, 2).reshape(spec.kernel_shape)
  out = {"kernel": kernel}
  if spec.has_bias:
    out["bias"] = v[:, -1].reshape(-1)
  return out
