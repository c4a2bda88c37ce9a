"""Layer kinds: what each supported layer contributes to K-FAC, and how to add one.

A layer computes ``s = a W (+ b)`` on every row of its input, with ``W`` the
weight seen as a matrix of shape ``(in, out)``. K-FAC needs, for each call,

* rows of the layer input ``a`` (a trailing ``1`` is appended when the layer
  has a bias: the bias is folded into the weight as an extra input row),
* rows of the gradient ``g = dL/ds`` at the layer output,

each as ``(groups, examples, positions, features)``: the leading ``groups``
axis is 1 except for grouped convolutions (whose groups are independent layers
as far as K-FAC is concerned); ``positions`` are the rows of one example that
share the weight (sequence positions, output pixels), 1 for a plain dense layer
on a batch of vectors. The weight itself is reshaped to ``(in, out)``: its first
``in_ndim`` axes are the input side.

Built-in kinds:

* ``nn.Dense``: all leading axes of the input are rows.
* ``nn.DenseGeneral`` (and so the query, key, value and output projections of
  ``nn.MultiHeadDotProductAttention``): the contracted input axes are the
  input features, the ``features`` axes the output features, every other axis
  is rows. ``batch_dims`` is not supported.
* ``nn.Conv`` (1, 2 or 3 spatial dims): rows are examples x output positions;
  the input rows are the input patches seen by the kernel at each output
  position (KFC, Grosse & Martens 2016), flattened in the kernel's own
  ``(*kernel_size, in_features // groups)`` order.
* ``nn.Embed``: ``W`` is the embedding ``(vocab, features)``; a lookup's input
  rows are one-hot token vectors, so its input factor is diagonal (the token
  frequencies) and is computed from counts, never from one-hot rows.
  ``Embed.attend`` (logits of tied input/output embeddings) uses the transposed
  weight: its input ``x`` lies on the features side and its output gradient
  on the vocabulary side, so both uses accumulate into the same two factors.
* ``nn.LayerNorm`` and ``nn.BatchNorm`` (when asked for, see
  `kaisa_jax.value_and_grad`): ``s = x^ * scale + bias`` per feature, with
  ``x^`` the normalised input. Each feature is a group of its own, whose input
  rows are ``x^`` and whose weight is ``[scale, bias]``; its factors are the
  exact per-example Fisher block of ``(scale, bias)`` (see
  `kaisa_jax.factors`), a 2x2 matrix per feature.

Your own layer: `register_layer`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
KeyPath = tuple[Any, ...]

DENSE = "dense"
DENSE_GENERAL = "dense_general"
CONV = "conv"
EMBED = "embed"
LAYER_NORM = "layer_norm"
BATCH_NORM = "batch_norm"
NORMS = (LAYER_NORM, BATCH_NORM)
CALL = "__call__"


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
      the dict that holds the layer's weight (and bias).
    param_suffix: what follows the parameter's name in its key path (the
      ``.value`` of a Flax NNX variable; empty for linen).
    param_index: the layer's index into parameters stacked by ``nn.scan`` or
      ``nn.vmap`` (``variable_axes={"params": 0}``): the layer's weight is
      ``leaf[param_index]``. Empty for a layer with parameters of its own.
    kind: the name of its `LayerKind` (``"dense"``, ``"conv"``, ...).
    kernel_shape: the shape of the layer's weight.
    has_bias: whether the layer has a bias.
    in_ndim: how many leading axes of the weight are its input side.
    groups: independent groups (``feature_group_count`` of a convolution).
    conv: the convolution's configuration, ``None`` for other layers.
    contract: the contracted input axes of a ``DenseGeneral``, as it gives them.
    methods: the method of each call in one loss evaluation, in call order.
    diagonal_input: the input factor is diagonal by nature (an embedding's
      one-hot inputs) or by request (``normalization="diagonal"``).
    rows: rows per step (all calls) in the batch the layers were traced with;
      used only to estimate costs.
  """

  name: str
  param_path: KeyPath
  kind: str
  kernel_shape: tuple[int, ...]
  has_bias: bool
  in_ndim: int = 1
  param_suffix: KeyPath = ()
  param_index: tuple[int, ...] = ()
  groups: int = 1
  conv: ConvConfig | None = None
  contract: tuple[int, ...] = (-1,)
  methods: tuple[str, ...] = (CALL,)
  diagonal_input: bool = False
  rows: int = dataclasses.field(default=0, compare=False)

  @property
  def calls(self) -> int:
    """How many times the layer is applied in one loss evaluation."""
    return len(self.methods)

  @property
  def a_dim(self) -> int:
    """Size of the input factor ``A`` of one group."""
    return math.prod(self.kernel_shape[: self.in_ndim]) + int(self.has_bias)

  @property
  def g_dim(self) -> int:
    """Size of the output factor ``G`` of one group."""
    return math.prod(self.kernel_shape[self.in_ndim :]) // self.groups

  @property
  def num_weights(self) -> int:
    return self.groups * self.a_dim * self.g_dim

  @property
  def layer_kind(self) -> LayerKind:
    return KINDS[self.kind]


def _as_rows(x: Array, batched: bool, features: int) -> Array:
  """``(1, examples, positions, features)``: the leading axis is the examples if ``batched``."""
  examples = x.shape[0] if batched else 1
  return x.reshape(1, examples, -1, features)


@dataclasses.dataclass(frozen=True)
class LayerKind:
  """How K-FAC reads one type of layer: the extension point (see `register_layer`).

  Attributes:
    name: the kind's name, shown in listings.
    module_types: the Flax module classes (linen or NNX); a subclass counts
      only if it keeps the class's methods (a layer that computes something
      else must not be mistaken for this one).
    describe: ``describe(module, weight_shape) -> dict`` of `LayerSpec` fields
      beyond name, path, weight shape and bias (``in_ndim``, ``groups``, ...);
      raises `UnsupportedLayerError` for a configuration it cannot handle.
    input_rows: ``input_rows(spec, method, x) -> (groups, examples, positions,
      in)``: the call's input as rows of ``a`` (without the bias column).
    output_rows: ``output_rows(spec, method, g)``: the gradient at the call's
      output as rows ``(groups, examples, positions, out)``.
    weight: the name of the weight parameter.
    bias: the name of the bias parameter.
    methods: the module methods that apply the layer, each mapped to whether
      it uses the weight transposed (its input on the output side).
    record: ``record(module, args, kwargs)``, what to record as a call's input
      (default: its first argument).
    unbatched_ndim: ``unbatched_ndim(spec, method)``, the rank of one
      example's input; a larger input has a leading batch axis, which is ``n``
      by default.
  """

  name: str
  module_types: tuple[type, ...]
  describe: Callable[[nn.Module, tuple[int, ...]], dict[str, Any]]
  input_rows: Callable[[LayerSpec, str, Array], Array]
  output_rows: Callable[[LayerSpec, str, Array], Array]
  weight: str = "kernel"
  bias: str = "bias"
  methods: tuple[tuple[str, bool], ...] = ((CALL, False),)
  record: Callable[[nn.Module, tuple, dict], Array] | None = None
  unbatched_ndim: Callable[[LayerSpec, str], int] = lambda spec, method: spec.in_ndim

  def transposed(self, method: str) -> bool:
    return dict(self.methods)[method]

  def matches(self, module: Any) -> bool:
    cls = type(module)
    return any(
      isinstance(module, t) and all(getattr(cls, m) is getattr(t, m) for m, _ in self.methods)
      for t in self.module_types
    )


# ----------------------------------------------------------------------------- dense


def _dense_describe(module: nn.Module, shape: tuple[int, ...]) -> dict[str, Any]:
  del module, shape
  return {}


def _dense_in(spec: LayerSpec, method: str, x: Array) -> Array:
  return _as_rows(x, x.ndim > 1, spec.kernel_shape[0])


def _dense_out(spec: LayerSpec, method: str, g: Array) -> Array:
  return _as_rows(g, g.ndim > 1, spec.kernel_shape[-1])


# --------------------------------------------------------------------- dense general


def _general_describe(module: Any, shape: tuple[int, ...]) -> dict[str, Any]:
  kind = type(module).__name__
  if getattr(module, "batch_dims", None) or getattr(module, "batch_axis", None):
    raise UnsupportedLayerError(f"{kind} with batch axes is not supported")
  default = getattr(module, "dot_general", None) in (None, jax.lax.dot_general)
  if not default or module.dot_general_cls is not None:
    raise UnsupportedLayerError(f"{kind} with a custom dot_general is not supported")
  axis = tuple(module.axis) if isinstance(module.axis, tuple | list) else (module.axis,)
  return {"in_ndim": len(axis), "contract": axis}


def _general_contract(spec: LayerSpec, x: Array) -> tuple[int, ...]:
  return tuple(a % x.ndim for a in spec.contract)


def _general_in(spec: LayerSpec, method: str, x: Array) -> Array:
  axes = _general_contract(spec, x)
  moved = jnp.moveaxis(x, axes, tuple(range(x.ndim - len(axes), x.ndim)))
  batched = 0 not in axes and x.ndim > len(axes)
  return _as_rows(moved, batched, math.prod(spec.kernel_shape[: spec.in_ndim]))


def _general_out(spec: LayerSpec, method: str, g: Array) -> Array:
  out_ndim = len(spec.kernel_shape) - spec.in_ndim
  return _as_rows(g, g.ndim > out_ndim, spec.g_dim)


# ---------------------------------------------------------------------- convolution


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


def _conv_describe(module: Any, shape: tuple[int, ...]) -> dict[str, Any]:
  if module.mask is not None:
    raise UnsupportedLayerError("a convolution with a `mask` is not supported")
  default = module.conv_general_dilated in (None, jax.lax.conv_general_dilated)
  if not default or getattr(module, "conv_general_dilated_cls", None):
    raise UnsupportedLayerError("a convolution with a custom convolution is not supported")
  rank = len(shape) - 2
  config = ConvConfig(
    kernel_size=tuple(shape[:rank]),
    strides=_as_tuple(module.strides, rank),
    padding=_padding(module.padding, rank),
    input_dilation=_as_tuple(module.input_dilation, rank),
    kernel_dilation=_as_tuple(module.kernel_dilation, rank),
  )
  return {"in_ndim": rank + 1, "groups": module.feature_group_count, "conv": config}


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


def _conv_in(spec: LayerSpec, method: str, inputs: Array) -> Array:
  """Input patches, one strided slice of the padded input per kernel tap (data movement only)."""
  config = spec.conv
  assert config is not None
  rank = len(config.kernel_size)
  examples = inputs.shape[0] if inputs.ndim > rank + 1 else 1
  x = inputs.reshape(-1, *inputs.shape[inputs.ndim - rank - 1 :])
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
  patches = jnp.stack(taps, axis=-2)  # (..., taps, in_features)
  per_group = x.shape[-1] // spec.groups
  patches = patches.reshape(examples, -1, len(taps), spec.groups, per_group)
  return patches.transpose(3, 0, 1, 2, 4).reshape(spec.groups, examples, -1, len(taps) * per_group)


def _conv_out(spec: LayerSpec, method: str, g: Array) -> Array:
  rank = len(spec.kernel_shape) - 2
  examples = g.shape[0] if g.ndim > rank + 1 else 1
  return g.reshape(examples, -1, spec.groups, spec.g_dim).transpose(2, 0, 1, 3)


# ------------------------------------------------------------------------ embedding


def _embed_describe(module: Any, shape: tuple[int, ...]) -> dict[str, Any]:
  if module.num_embeddings == 1:
    raise UnsupportedLayerError("an embedding with num_embeddings=1 broadcasts; not supported")
  return {"diagonal_input": True}


def _embed_in(spec: LayerSpec, method: str, x: Array) -> Array:
  if method == CALL:
    raise UnsupportedLayerError("an embedding lookup's input factor is diagonal only")
  return _as_rows(x, x.ndim > 1, spec.kernel_shape[1])


def _embed_out(spec: LayerSpec, method: str, g: Array) -> Array:
  features = spec.kernel_shape[1] if method == CALL else spec.kernel_shape[0]
  return _as_rows(g, g.ndim > 1, features)


# -------------------------------------------------------------------- normalisation


def _norm_describe(module: nn.Module, shape: tuple[int, ...]) -> dict[str, Any]:
  if not module.use_scale:
    raise UnsupportedLayerError(f"{type(module).__name__} without a scale is not supported")
  axes = module.feature_axes if isinstance(module, nn.LayerNorm) else module.axis
  axes = tuple(axes) if isinstance(axes, tuple | list) else (axes,)
  if sorted(axes) != list(range(-len(axes), 0)):
    raise UnsupportedLayerError(
      f"{type(module).__name__} with feature axes {axes}: only trailing feature axes are supported"
    )
  return {"in_ndim": 0, "groups": math.prod(shape)}


def _norm_rows(spec: LayerSpec, method: str, x: Array) -> Array:
  """``(features, examples, positions, 1)``: every feature is a group of one."""
  features = spec.groups
  batched = x.ndim > len(spec.kernel_shape)
  return _as_rows(x, batched, features)[0].transpose(2, 0, 1)[..., None]


def _normalised_input(module: nn.Module, args: tuple, kwargs: dict) -> Array:
  """``x^``: the module's own normalisation of its input, without scale and bias."""
  bare = module.clone(parent=None, use_scale=False, use_bias=False)
  if isinstance(module, nn.BatchNorm):
    stats = module.variables.get("batch_stats", {})
    out, _ = bare.apply({"batch_stats": stats}, *args, **kwargs, mutable=["batch_stats"])
    return out
  return bare.apply({}, *args, **kwargs)


BUILTIN_KINDS = (
  LayerKind(DENSE, (nn.Dense, nnx.Linear), _dense_describe, _dense_in, _dense_out),
  LayerKind(
    DENSE_GENERAL,
    (nn.DenseGeneral, nnx.LinearGeneral),
    _general_describe,
    _general_in,
    _general_out,
  ),
  LayerKind(
    CONV,
    (nn.Conv, nnx.Conv),
    _conv_describe,
    _conv_in,
    _conv_out,
    unbatched_ndim=lambda spec, method: len(spec.kernel_shape) - 1,
  ),
  LayerKind(
    EMBED,
    (nn.Embed, nnx.Embed),
    _embed_describe,
    _embed_in,
    _embed_out,
    weight="embedding",
    methods=((CALL, False), ("attend", True)),
    unbatched_ndim=lambda spec, method: 0 if method == CALL else 1,
  ),
  *(
    LayerKind(
      name,
      module_type,
      _norm_describe,
      _norm_rows,
      _norm_rows,
      weight="scale",
      record=_normalised_input,
      unbatched_ndim=lambda spec, method: len(spec.kernel_shape),
    )
    for name, module_type in ((LAYER_NORM, (nn.LayerNorm,)), (BATCH_NORM, (nn.BatchNorm,)))
  ),
)


KINDS: dict[str, LayerKind] = {k.name: k for k in BUILTIN_KINDS}
_REGISTERED: list[LayerKind] = []


def register_layer(
  module_type: type,
  *,
  weight: str = "kernel",
  bias: str = "bias",
  in_ndim: int = 1,
  inputs: Callable[[Array], Array] | None = None,
  outputs: Callable[[Array], Array] | None = None,
  method: str = CALL,
) -> LayerKind:
  """Registers a custom Flax linen layer so that K-FAC preconditions it.

  The layer must compute ``s = a W (+ b)`` row by row: ``W`` is the parameter
  ``weight``, whose first ``in_ndim`` axes are the input side and the rest the
  output side; ``b`` (the parameter ``bias``, if the layer has one) has the
  output side's shape. By default a call's input ``x`` and its output's
  gradient are taken as they are, their trailing axes being the features
  (``W.shape[:in_ndim]`` and ``W.shape[in_ndim:]``) and their leading axis the
  batch. Pass ``inputs`` (or ``outputs``) to map them into that form first,
  e.g. ``inputs=lambda x: jnp.swapaxes(x, 1, 2)`` for a layer that contracts
  axis 1.

  Args:
    module_type: the module class (its subclasses count when they keep its
      ``method``).
    weight: the name of the weight parameter.
    bias: the name of the bias parameter (absent parameters are fine).
    in_ndim: how many leading axes of the weight are its input side.
    inputs: maps a call's input to ``(batch, ..., *W.shape[:in_ndim])``.
    outputs: maps the output gradient to ``(batch, ..., *W.shape[in_ndim:])``.
    method: the method that applies the layer.

  Returns:
    The registered `LayerKind`; registering a type again replaces it.
  """
  if not (isinstance(module_type, type) and issubclass(module_type, nn.Module | nnx.Module)):
    raise TypeError(f"register_layer needs a Flax (linen or NNX) Module class, got {module_type!r}")
  if not isinstance(in_ndim, int) or in_ndim < 1:
    raise ValueError(f"in_ndim must be a positive int, got {in_ndim!r}")
  if not callable(getattr(module_type, method, None)):
    raise ValueError(f"{module_type.__name__} has no method {method!r}")
  to_in = inputs or (lambda x: x)
  to_out = outputs or (lambda g: g)

  def rows(x: Array, features: tuple[int, ...]) -> Array:
    if tuple(x.shape[x.ndim - len(features) :]) != features:
      raise ValueError(
        f"a registered {module_type.__name__} gave an array of shape {x.shape}, whose "
        f"trailing axes should be {features}: check in_ndim, inputs and outputs"
      )
    return _as_rows(x, x.ndim > len(features), math.prod(features))

  kind = LayerKind(
    f"{module_type.__module__}.{module_type.__qualname__}",
    (module_type,),
    lambda module, shape: {"in_ndim": in_ndim},
    lambda spec, m, x: rows(to_in(x), spec.kernel_shape[: spec.in_ndim]),
    lambda spec, m, g: rows(to_out(g), spec.kernel_shape[spec.in_ndim :]),
    weight=weight,
    bias=bias,
    methods=((method, False),),
  )
  _REGISTERED[:] = [k for k in _REGISTERED if k.module_types != (module_type,)] + [kind]
  KINDS[kind.name] = kind
  return kind


def all_kinds() -> tuple[LayerKind, ...]:
  """Every kind, registered ones first (the latest first)."""
  return (*reversed(_REGISTERED), *BUILTIN_KINDS)


def find_kind(module: Any) -> LayerKind | None:
  """The kind of a module, registered kinds first; ``None`` if unsupported."""
  for kind in all_kinds():
    if kind.matches(module):
      return kind
  return None


def make_spec(
  kind: LayerKind,
  module: nn.Module,
  name: str,
  param_path: KeyPath,
  kernel_shape: tuple[int, ...],
  has_bias: bool,
) -> LayerSpec:
  """Describes a supported module, or raises `UnsupportedLayerError`."""
  return LayerSpec(
    name, param_path, kind.name, kernel_shape, has_bias, **kind.describe(module, kernel_shape)
  )


def default_examples(spec: LayerSpec, method: str, inputs: Array) -> int:
  """Examples the loss averages over by default: the input's leading axis."""
  return inputs.shape[0] if inputs.ndim > spec.layer_kind.unbatched_ndim(spec, method) else 1


def input_rows(spec: LayerSpec, method: str, inputs: Array, dtype: Any) -> Array:
  """Rows of ``[a, 1]``, shape ``(groups, examples, positions, in)``."""
  rows = spec.layer_kind.input_rows(spec, method, inputs.astype(dtype))
  if spec.has_bias and not spec.layer_kind.transposed(method):
    ones = jnp.ones((*rows.shape[:-1], 1), dtype)
    rows = jnp.concatenate([rows, ones], axis=-1)
  return rows


def output_rows(spec: LayerSpec, method: str, out_grad: Array, dtype: Any) -> Array:
  """Rows of the output gradient, shape ``(groups, examples, positions, out)``."""
  return spec.layer_kind.output_rows(spec, method, out_grad.astype(dtype))


def to_matrix(spec: LayerSpec, layer_grads: dict[str, Array], dtype: Any) -> Array:
  """The layer's gradient as ``V`` of shape ``(groups, a_dim, g_dim)``."""
  kind = spec.layer_kind
  kernel = layer_grads[kind.weight].astype(dtype)
  v = kernel.reshape(-1, spec.groups, spec.g_dim).transpose(1, 0, 2)
  if spec.has_bias:
    bias = layer_grads[kind.bias].astype(dtype).reshape(spec.groups, 1, spec.g_dim)
    v = jnp.concatenate([v, bias], axis=1)
  return v


def from_matrix(spec: LayerSpec, v: Array) -> dict[str, Array]:
  """Inverse of `to_matrix` (without the dtype cast)."""
  kind = spec.layer_kind
  weights = v[:, : v.shape[1] - int(spec.has_bias)]
  out = {kind.weight: weights.transpose(1, 0, 2).reshape(spec.kernel_shape)}
  if spec.has_bias:
    out[kind.bias] = v[:, -1].reshape(spec.kernel_shape[spec.in_ndim :])
  return out
