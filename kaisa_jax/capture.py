"""Capture: the layer inputs ``a`` and output gradients ``g`` of a Flax model.

`value_and_grad` wraps a loss function whose body calls ``model.apply``. Flax
method interceptors see every call of a supported layer: they record its input
``a`` and add a zero perturbation ``e`` to its output. Differentiating the loss
with respect to the parameters and the perturbations together gives the
parameter gradients and ``g = dL/de = dL/ds`` in the same, single backward
pass; nothing is evaluated twice.

The perturbations need the shapes of the layer outputs, so the loss is first
traced abstractly (`jax.eval_shape`, no computation). The same abstract trace
gives the registry of layers (`Layers`) that `kaisa_jax.kfac` is built from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import FrozenDict

from kaisa_jax import layers as layers_lib

Array = jax.Array


class LayerCurvature(NamedTuple):
  """What one layer contributes to the curvature, one entry per call.

  Attributes:
    a: the layer inputs.
    g: the gradients of the loss at the layer outputs.
    n: the number of examples the loss averages over (a float32 scalar).
  """

  a: tuple[Array, ...]
  g: tuple[Array, ...]
  n: tuple[Array, ...]


Curvature = dict[str, LayerCurvature]
EXCLUDED = "excluded by a layer pattern"


@dataclasses.dataclass(frozen=True)
class Skipped:
  """A module with parameters that is not preconditioned, and why."""

  name: str
  module_type: str
  reason: str


@dataclasses.dataclass(frozen=True)
class Layers:
  """The registry of a model's layers, as found by tracing its loss once.

  Attributes:
    specs: the layers that are captured and can be preconditioned.
    skipped: modules with parameters that are not preconditioned (their
      gradients pass through K-FAC unchanged), with the reason.
  """

  specs: tuple[layers_lib.LayerSpec, ...]
  skipped: tuple[Skipped, ...] = ()

  def __str__(self) -> str:
    w = max([28, *(len(x.name) + 1 for x in (*self.specs, *self.skipped))])
    k = max([6, *(len(x.kind) for x in self.specs)])
    lines = [
      f"{'layer':<{w}} {'kind':<{k}} {'kernel':<18} {'calls':>5} {'rows':>8} {'A':>16} {'G':>16}"
    ]
    for s in self.specs:
      a_shape = f"{s.a_dim}" if s.diagonal_input else f"{s.a_dim}x{s.a_dim}"
      a_shape = f"{s.groups}x{a_shape}" if s.groups > 1 else a_shape
      g_shape = f"{s.groups}x{s.g_dim}x{s.g_dim}" if s.groups > 1 else f"{s.g_dim}x{s.g_dim}"
      lines.append(
        f"{s.name:<{w}} {s.kind:<{k}} {s.kernel_shape!s:<18} {s.calls:>5}"
        f" {s.rows:>8} {a_shape:>16} {g_shape:>16}"
      )
    for x in self.skipped:
      lines.append(f"{x.name:<{w}} not preconditioned ({x.module_type}): {x.reason}")
    return "\n".join(lines)


@dataclasses.dataclass
class _Call:
  """One intercepted call of a supported layer, in call order."""

  name: str
  method: str
  spec: layers_lib.LayerSpec | None
  out: jax.ShapeDtypeStruct
  rows: int
  varying: tuple[str, ...]


def _varying_axes(x: Any) -> tuple[str, ...]:
  """The ``shard_map`` axes a traced value varies over (empty outside ``shard_map``)."""
  manual = getattr(jax.typeof(x), "mat", None)
  return tuple(sorted(getattr(manual, "varying", ())))


def _trace_of(x: Any) -> Any:
  """The JAX trace a traced value belongs to (``None`` for concrete arrays)."""
  return getattr(x, "_trace", None)


def _key_name(key: Any) -> str:
  return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def _module_name(module: Any, leaf_paths: dict[int, tuple]) -> str:
  """The module path joined by ``/``; for NNX, the path of its weight in the params."""
  if isinstance(module, nnx.Module):
    kind = layers_lib.find_kind(module)
    own = _direct_params(module)
    path = leaf_paths.get(id(own.get(kind.weight))) if kind is not None else None
    if path is None:
      return type(module).__name__
    prefix, _ = _split_path(path, kind.weight)
    return "/".join(_key_name(k) for k in prefix) or type(module).__name__
  return "/".join(module.path) if module.path else type(module).__name__


def _direct_params(module: Any) -> dict[str, Any]:
  """The parameters a module holds itself (not through submodules)."""
  if isinstance(module, nnx.Module):
    return {k: v.get_value() for k, v in vars(module).items() if isinstance(v, nnx.Param)}
  params = module.variables.get("params", {}) if module.scope is not None else {}
  return {k: v for k, v in params.items() if not isinstance(v, dict | FrozenDict)}


def _split_path(path: tuple, weight: str) -> tuple[tuple, tuple]:
  """``(prefix, suffix)`` around the weight's own key in a parameter's key path."""
  names = [_key_name(k) for k in path]
  i = len(names) - 1 - names[::-1].index(weight)
  return path[:i], path[i + 1 :]


def _param_path(
  module: Any, weight: str, own: dict[str, Any], leaf_paths: dict[int, tuple]
) -> tuple[tuple, tuple]:
  """Where the layer's parameters sit in the params given to the loss.

  Returns the key path before the weight's name and the one after it (empty for
  linen, ``.value`` for an NNX variable). The weight is found by identity (the
  loss passed it through unchanged); a linen loss that transforms its
  parameters (a dtype cast, say) is matched by module path instead.
  """
  path = leaf_paths.get(id(own[weight]))
  if path is not None:
    return _split_path(path, weight)
  if isinstance(module, nnx.Module):
    raise ValueError(
      f"kaisa_jax could not find the parameters of a {type(module).__name__} in the "
      "params given to the loss function: build the model inside the loss with "
      "nnx.merge(graphdef, params) from those params, unchanged."
    )
  suffix = (*module.path, weight)
  candidates = [
    p
    for p in leaf_paths.values()
    if tuple(getattr(k, "key", k) for k in p[-len(suffix) :]) == suffix
  ]
  if len(candidates) != 1:
    raise ValueError(
      f"kaisa_jax could not find the parameters of layer {_module_name(module, {})!r} in "
      "the params given to the loss function. Pass the params to model.apply "
      "unchanged (as the first argument of the loss)."
    )
  return candidates[0][:-1], ()


@contextlib.contextmanager
def _intercept(interceptor: Callable[..., Any]):
  """Runs ``interceptor`` around the calls of linen modules and of NNX layer kinds.

  Linen has method interceptors; NNX has none, so the methods of the NNX layer
  classes K-FAC knows are wrapped for the duration (subclasses that keep them
  are covered too).
  """
  patched = []
  for kind in layers_lib.all_kinds():
    for cls in kind.module_types:
      if not issubclass(cls, nnx.Module):
        continue
      for method, _ in kind.methods:
        original = cls.__dict__.get(method)
        if original is None:
          continue

        def wrapper(self, *args, _original=original, _method=method, **kwargs):
          context = types.SimpleNamespace(module=self, method_name=_method)
          return interceptor(lambda *a, **k: _original(self, *a, **k), args, kwargs, context)

        setattr(cls, method, wrapper)
        patched.append((cls, method, original))
  try:
    with nn.intercept_methods(interceptor):
      yield
  finally:
    for cls, method, original in reversed(patched):
      setattr(cls, method, original)


class _Selection(NamedTuple):
  include: tuple[str, ...] | None
  exclude: tuple[str, ...]
  normalization: str | None = None

  def selects(self, name: str) -> bool:
    if any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
      return False
    if self.include is None:
      return True
    return any(fnmatch.fnmatchcase(name, p) for p in self.include)

  def check_patterns(self, names: Sequence[str]) -> None:
    for pattern in (*(self.include or ()), *self.exclude):
      if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
        raise ValueError(
          f"layer pattern {pattern!r} matches no layer; the supported layers are "
          f"{sorted(set(names))}"
        )


NORMALIZATION = ("block", DIAGONAL := "diagonal")
_bypass = False  # set while a layer's own input is recomputed (normalisation layers)


def _kind(module: nn.Module, selection: _Selection) -> layers_lib.LayerKind | None:
  """The module's kind; normalisation layers only when a preconditioner was chosen."""
  kind = layers_lib.find_kind(module)
  if kind is not None and kind.name in layers_lib.NORMS and selection.normalization is None:
    return None
  return kind


def _recorded_input(module: nn.Module, args: tuple, kwargs: dict) -> Array:
  """What a call contributes as its input ``a`` (the kind may recompute it)."""
  global _bypass
  kind = layers_lib.find_kind(module)
  if kind is None or kind.record is None:
    return args[0] if args else next(iter(kwargs.values()))
  _bypass = True
  try:
    return kind.record(module, args, kwargs)
  finally:
    _bypass = False


def _as_patterns(patterns: str | Sequence[str] | None, arg: str) -> tuple[str, ...] | None:
  if patterns is None:
    return None
  if isinstance(patterns, str):
    return (patterns,)
  if not all(isinstance(p, str) for p in patterns):
    raise TypeError(f"{arg} must be a glob pattern or a sequence of them, got {patterns!r}")
  return tuple(patterns)


def _trace(
  fun: Callable[..., Any], params: Any, args: tuple, kwargs: dict, selection: _Selection
) -> tuple[Layers, list[_Call]]:
  """Traces the loss abstractly; returns the registry and the calls in order."""
  calls: list[_Call] = []
  skipped: dict[str, Skipped] = {}

  def traced(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    leaf_paths = {id(leaf): path for path, leaf in flat}
    outer = _trace_of(flat[0][1]) if flat else None

    def interceptor(next_fun, call_args, call_kwargs, context):
      module = context.module
      name = _module_name(module, leaf_paths)
      method = context.method_name
      kind = _kind(module, selection)
      if _bypass or kind is None or method not in dict(kind.methods):
        if not _bypass and kind is None and _direct_params(module) and name not in skipped:
          reason = "unsupported layer type; gradients pass through"
          if layers_lib.find_kind(module) is not None:  # a normalisation layer
            reason = "normalisation layer, passed through (value_and_grad(normalization=...))"
          skipped[name] = Skipped(name, type(module).__name__, reason)
        return next_fun(*call_args, **call_kwargs)
      out = next_fun(*call_args, **call_kwargs)
      own = _direct_params(module)
      spec, rows = None, 0
      if selection.selects(name):
        try:
          if _trace_of(out) is not outer:
            raise layers_lib.UnsupportedLayerError(
              "applied inside a Flax lifted transformation (nn.scan, nn.remat, nn.vmap, ...),"
              " which is not supported yet"
            )
          if not isinstance(out, jax.Array):
            raise layers_lib.UnsupportedLayerError(
              f"{method} returned {type(out).__name__}, not one array"
            )
          prefix, suffix = _param_path(module, kind.weight, own, leaf_paths)
          spec = layers_lib.make_spec(
            kind, module, name, prefix, tuple(own[kind.weight].shape), kind.bias in own
          )
          spec = dataclasses.replace(
            spec,
            param_suffix=suffix,
            methods=(method,),
            diagonal_input=spec.diagonal_input
            or (kind.name in layers_lib.NORMS and selection.normalization == DIAGONAL),
          )
          side = spec.kernel_shape[: spec.in_ndim] if kind.transposed(method) else None
          features = spec.g_dim * spec.groups if side is None else int(np.prod(side))
          rows = out.size // features
        except layers_lib.UnsupportedLayerError as e:
          skipped[name] = Skipped(name, type(module).__name__, str(e))
      elif name not in skipped:
        skipped[name] = Skipped(name, type(module).__name__, EXCLUDED)
      calls.append(
        _Call(
          name, method, spec, jax.ShapeDtypeStruct(out.shape, out.dtype), rows, _varying_axes(out)
        )
      )
      return out

    with _intercept(interceptor):
      return fun(params, *args, **kwargs)

  jax.eval_shape(traced, params)
  selection.check_patterns([c.name for c in calls])
  specs: dict[str, layers_lib.LayerSpec] = {}
  for c in calls:
    if c.spec is None or c.name in skipped:
      continue
    prev = specs.get(c.name)
    if prev is None:
      specs[c.name] = dataclasses.replace(c.spec, rows=c.rows)
    else:
      specs[c.name] = dataclasses.replace(
        prev, methods=(*prev.methods, c.method), rows=prev.rows + c.rows
      )
  return Layers(tuple(specs.values()), tuple(skipped.values())), calls


class ValueAndGrad:
  """A loss function's value, gradient and curvature in one backward pass.

  Built by `value_and_grad`; calling it returns ``(value, grads, curvature)``.
  """

  def __init__(
    self,
    fun: Callable[..., Any],
    has_aux: bool,
    selection: _Selection,
    n_examples: int | None,
  ):
    self._fun = fun
    self._has_aux = has_aux
    self._selection = selection
    self._n_examples = n_examples

  def layers(self, params: Any, *args: Any, **kwargs: Any) -> Layers:
    """Traces the loss abstractly (no computation) and lists its layers.

    Takes the same arguments as the loss function. The result is what
    `kaisa_jax.kfac` needs; ``print`` it to see every layer, its factor shapes,
    and every module with parameters that is not preconditioned.
    """
    return _trace(self._fun, params, args, kwargs, self._selection)[0]

  def __call__(self, params: Any, *args: Any, **kwargs: Any):
    registry, calls = _trace(self._fun, params, args, kwargs, self._selection)
    captured = {s.name for s in registry.specs}
    methods = {s.name: s.methods for s in registry.specs}
    # Zero perturbations of the layer outputs. Under shard_map they must vary over
    # the same axes as the outputs: the gradient of an unvarying input would be
    # summed over the devices.
    perturbations: dict[str, list[Array]] = {}
    for c in calls:
      if c.name in captured:
        zero = jnp.zeros(c.out.shape, c.out.dtype)
        if c.varying:
          zero = jax.lax.pcast(zero, c.varying, to="varying")
        perturbations.setdefault(c.name, []).append(zero)

    def loss_with_perturbations(params, perturbations):
      inputs: dict[str, list[Array]] = {name: [] for name in perturbations}
      flat = jax.tree_util.tree_flatten_with_path(params)[0]
      leaf_paths = {id(leaf): path for path, leaf in flat}

      def interceptor(next_fun, call_args, call_kwargs, context):
        name = _module_name(context.module, leaf_paths)
        if _bypass or name not in inputs or context.method_name not in methods[name]:
          return next_fun(*call_args, **call_kwargs)
        k = len(inputs[name])
        if k >= len(perturbations[name]) or methods[name][k] != context.method_name:
          raise RuntimeError(
            f"kaisa_jax: layer {name!r} was called differently than when the loss was "
            "traced; the loss must call its layers the same way every time."
          )
        inputs[name].append(_recorded_input(context.module, call_args, call_kwargs))
        return next_fun(*call_args, **call_kwargs) + perturbations[name][k]

      with _intercept(interceptor):
        result = self._fun(params, *args, **kwargs)
      for name, seen in inputs.items():
        if len(seen) != len(perturbations[name]):
          raise RuntimeError(
            f"kaisa_jax: layer {name!r} was called {len(seen)} times, but "
            f"{len(perturbations[name])} times when the loss was traced; the loss must call "
            "its layers the same way every time."
          )
      loss, aux = result if self._has_aux else (result, None)
      return loss, (aux, inputs)

    (loss, (aux, inputs)), (grads, out_grads) = jax.value_and_grad(
      loss_with_perturbations, argnums=(0, 1), has_aux=True
    )(params, perturbations)

    curvature: dict[str, LayerCurvature] = {}
    for spec in registry.specs:
      a, g = tuple(inputs[spec.name]), tuple(out_grads[spec.name])
      n = tuple(
        jnp.asarray(self._n_examples or layers_lib.default_examples(spec, m, x), jnp.float32)
        for m, x in zip(spec.methods, a, strict=True)
      )
      curvature[spec.name] = LayerCurvature(a, g, n)
    value = (loss, aux) if self._has_aux else loss
    return value, grads, curvature


def value_and_grad(
  fun: Callable[..., Any],
  has_aux: bool = False,
  *,
  include: str | Sequence[str] | None = None,
  exclude: str | Sequence[str] | None = None,
  n_examples: int | None = None,
  normalization: str | None = None,
) -> ValueAndGrad:
  """Like `jax.value_and_grad`, plus the curvature K-FAC needs.

  ``fun(params, *args, **kwargs)`` must compute the loss by calling a Flax
  linen model's ``apply`` with ``params`` (the whole variables dict, or the
  ``params`` collection that the loss wraps), or by rebuilding a Flax NNX
  model from them (``nnx.merge(graphdef, params)``). Every ``nn.Dense``,
  ``nn.DenseGeneral`` (attention projections included), ``nn.Conv`` and
  ``nn.Embed`` (lookups and ``attend``) called inside it is captured, wherever
  it is nested, as are their NNX twins (``nnx.Linear``, ``nnx.LinearGeneral``,
  ``nnx.Conv``, ``nnx.Embed``) and every layer type given to
  `kaisa_jax.register_layer`.
  The result is a callable returning ``(value, grads, curvature)``, where
  ``value`` is the loss (or ``(loss, aux)`` with ``has_aux``), ``grads`` the
  gradient with respect to ``params``, and ``curvature`` the layers' inputs
  and output gradients, to be
  passed to the K-FAC transformation as ``update(..., curvature=curvature)``.
  It costs one forward and one backward pass, as `jax.value_and_grad` does.

  Args:
    fun: the loss function; its first argument is differentiated.
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    include: glob patterns (``fnmatch``) over layer names (the module path
      joined by ``/``, e.g. ``"encoder/Dense_0"``); only matching layers are
      captured. ``None`` captures every supported layer.
    exclude: glob patterns of layers not to capture (applied after
      ``include``). A pattern that matches no layer is an error.
    n_examples: the number of examples the loss averages over, ``n`` in
      ``G = (1/n) sum_rows (n g)(n g)^T``. ``None`` uses the leading axis of
      each layer's input (the batch size, right for a loss that is a mean over
      the batch). Pass ``batch * length`` for a loss averaged over tokens and
      ``1`` for a summed loss.
    normalization: ``None`` (default) passes the scale and bias of
      ``nn.LayerNorm`` and ``nn.BatchNorm`` through to the chained optimizer;
      ``"block"`` preconditions each feature's ``(scale, bias)`` by the exact
      2x2 block of the per-example Fisher, ``"diagonal"`` by its diagonal.

  Returns:
    A `ValueAndGrad`; its ``layers(params, *args, **kwargs)`` method lists the
    captured layers without computing anything.
  """
  if not callable(fun):
    raise TypeError(f"value_and_grad needs a callable loss function, got {fun!r}")
  if n_examples is not None and (not isinstance(n_examples, int) or n_examples < 1):
    raise ValueError(f"n_examples must be a positive int or None, got {n_examples!r}")
  if normalization is not None and normalization not in NORMALIZATION:
    raise ValueError(f"normalization must be None or one of {NORMALIZATION}, got {normalization!r}")
  include_patterns = _as_patterns(include, "include")
  exclude_patterns = _as_patterns(exclude, "exclude") or ()
  selection = _Selection(include_patterns, exclude_patterns, normalization)
  return ValueAndGrad(fun, has_aux, selection, n_examples)
