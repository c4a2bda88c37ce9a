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
It is kept for the next call with the same argument types; the real evaluation
checks every layer call against it and traces again when one differs. Layers
inside a ``jax.jit``-compiled function (a jitted ``model.apply``) run in its own
trace, or not at all once it is compiled: the trace raises, naming it, when
the loss hands such a function parameters that no module was seen to hold.

Layers inside ``lax.scan``, ``jax.vmap`` and ``jax.checkpoint`` (and so inside
``nn.scan``, ``nn.vmap`` and ``nn.remat``) run in a trace of their own, whose
values cannot leave it as side effects. While the loss runs, those three are
wrapped: the perturbations of the layers inside enter as extra scanned, mapped
or plain operands, and the recorded inputs leave as extra outputs, stacked
along one leading axis per scan or vmap. A layer whose parameters carry the
same leading axes (``variable_axes={"params": 0}``) becomes one layer per
slice; one whose parameters are shared becomes one call per iteration.

Capture may run in several threads at once, each tracing its own loss. What
an evaluation captures is kept per thread (the running sessions, and the flag
set while a layer's input is recomputed), as Flax keeps its method interceptors
and JAX its traces. The wrappers of ``lax.scan``, ``jax.vmap``,
``jax.checkpoint``, ``jax.remat`` and of the NNX layer methods are put in place
once for the process, under a lock, the first time capture runs (an NNX layer
type registered later, the first time capture sees it), and stay: each looks
up the sessions running in the calling thread and, with none, calls the
original with the same arguments and returns its result (what ``jax.vmap``
returns there is what the original returns); they carry the originals' names,
docstrings and signatures. Putting them in place around each trace and taking
them away after it, even counting the threads inside, would leave a window in
which a thread that has read ``jax.lax.scan`` but not yet called it gets the
other, and would let a reference taken while they were in place outlive them;
wrappers that pass through cost one thread-local read per call and leave no
such window.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import FrozenDict
from flax.core import tracers as flax_tracers
from jax.extend import core as jax_core

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
  """One intercepted call of a supported layer, in call order.

  ``depth`` counts the mapping transformations (``lax.scan``, ``vmap``) the
  call is inside: its recorded arrays carry one leading axis for each.
  ``config`` is what the layer kind's ``describe`` read from the module (``None``
  for a call that is not preconditioned).
  """

  name: str
  method: str
  spec: layers_lib.LayerSpec | None
  out: jax.ShapeDtypeStruct
  rows: int
  varying: tuple[str, ...]
  depth: int
  module_type: str
  config: dict[str, Any] | None = None


class _Slot(NamedTuple):
  """Where one call of a preconditioned layer comes from: ``(call, index)``.

  ``index`` picks the call out of the axes added by the scans and vmaps around
  it (empty for a call outside them).
  """

  layer: str
  call: int
  index: tuple[int, ...]


def _varying_axes(x: Any) -> tuple[str, ...]:
  """The ``shard_map`` axes a traced value varies over (empty outside ``shard_map``)."""
  manual = getattr(jax.typeof(x), "mat", None)
  return tuple(sorted(getattr(manual, "varying", ())))


class _Frame:
  """The loss, or the body of a scan, vmap or checkpoint inside it.

  Attributes:
    trace: the JAX trace the body runs in; layers called in another trace
      (a ``lax.cond`` branch, say) are not captured.
    feed: output perturbations of the calls in this body, by call number,
      with a leading axis for each mapping transformation still around them.
    record: what the calls in this body record, by call number; a mapping
      transformation stacks it along a new leading axis on the way out.
    mapped: whether the body is mapped (scan, vmap) rather than only
      rematerialised (checkpoint).
  """

  def __init__(self, feed: dict[int, Array], mapped: bool):
    self.trace = flax_tracers.current_trace()
    self.feed = feed
    self.record: dict[int, Any] = {}
    self.mapped = mapped


class _Session:
  """One evaluation of the loss under capture: its frames and its numbered calls.

  Layer calls are numbered in the order they run, and so are the bodies of
  scans, vmaps and checkpoints; the abstract trace fills ``ends`` (the call
  number after each body) and the real evaluation reads it to feed each body
  the perturbations of its calls. A body traced twice (JAX may retrace a scan
  body) restarts its numbering.

  ``on_call(session, number, name, module, method, kind, call, args, kwargs)``
  handles each call of a layer kind in the innermost frame's trace; ``call()``
  runs the layer.
  """

  def __init__(
    self,
    params: Any,
    selection: _Selection,
    on_call: Callable[..., Any],
    feed: dict[int, Array],
    ends: dict[int, int],
  ):
    self.leaf_paths = {id(leaf): path for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    self.selection = selection
    self.on_call = on_call
    self.frames = [_Frame(feed, mapped=False)]
    self.calls = 0
    self.bodies = 0
    self.ends = ends
    self.skipped: dict[str, Skipped] = {}
    self.elsewhere: dict[str, str] = {}  # layers called in a trace no frame follows
    self.nnx_lifted: set[str] = set()  # NNX layer types called inside a transformation
    self.owned: set[tuple] = set()  # key paths of the params of the modules called
    self.owners: set[tuple[str, ...]] = set()  # paths of the linen modules with params called here
    self.nnx = False  # whether an NNX module was called

  def skip(self, name: str, module: Any, reason: str) -> None:
    self.skipped[name] = Skipped(name, type(module).__name__, reason)

  def note_owner(self, module: Any) -> dict[str, Any]:
    """Notes which params a called module holds itself; returns them.

    A parameter counts by identity (the loss handed it on unchanged) and, for
    linen, by the module's path when the module runs in a followed trace (so
    not inside a ``jax.jit``-compiled function) and is not the root module.
    """
    own = _direct_params(module)
    for value in own.values():
      path = self.leaf_paths.get(id(value))
      if path is not None:
        self.owned.add(plain_path(path))
    if own and isinstance(module, nn.Module) and module.path and self.active():
      self.owners.add(tuple(module.path))  # the root's path, (), would match any top-level key
    self.nnx = self.nnx or isinstance(module, nnx.Module)
    return own

  def intercept(self, next_fun, args, kwargs, context):
    """The interceptor: numbers the calls of layer kinds and hands them to ``on_call``."""
    module, method = context.module, context.method_name
    if _state.bypass:
      return next_fun(*args, **kwargs)
    name = _module_name(module, self.leaf_paths)
    kind = _kind(module, self.selection)
    own = self.note_owner(module)
    if kind is None or method not in dict(kind.methods):
      if kind is None and own and name not in self.skipped:
        self.skip(name, module, _uncaptured_reason(module, own))
      return next_fun(*args, **kwargs)
    if not self.active():
      self.elsewhere[name] = type(module).__name__
      return next_fun(*args, **kwargs)
    if isinstance(module, nnx.Module) and len(self.frames) > 1:
      # Inside nnx.scan / nnx.vmap / nnx.remat its parameters are not those given
      # to the loss, so it cannot be named; `_list_uncaptured_nnx` lists it.
      self.nnx_lifted.add(type(module).__name__)
      return next_fun(*args, **kwargs)
    number = self.calls
    self.calls += 1
    call = lambda: next_fun(*args, **kwargs)  # noqa: E731
    return self.on_call(self, number, name, module, method, kind, call, args, kwargs)

  def active(self) -> bool:
    """Whether code runs in the innermost frame's own trace."""
    return flax_tracers.current_trace() == self.frames[-1].trace

  def depth(self) -> int:
    return sum(f.mapped for f in self.frames)

  def enter(self) -> tuple[int, int, dict[int, Array]]:
    """Numbers a body; returns its first call, its number and its calls' perturbations."""
    start, body = self.calls, self.bodies
    self.bodies += 1
    end = self.ends.get(body, start)
    feed = {c: x for c, x in self.frames[-1].feed.items() if start <= c < end}
    return start, body, feed

  @contextlib.contextmanager
  def body(self, start: int, body: int, feed: dict[int, Array], mapped: bool):
    self.calls, self.bodies = start, body + 1
    frame = _Frame(feed, mapped)
    self.frames.append(frame)
    try:
      yield frame
    finally:
      self.frames.pop()

  def leave(self, body: int, record: dict[int, Any]) -> None:
    self.ends[body] = self.calls
    self.frames[-1].record.update(record)


class _Capture(NamedTuple):
  """A session running in a thread, and the NNX layer methods it intercepts."""

  session: _Session
  methods: frozenset[tuple[type, str]]


class _ThreadState(threading.local):
  """What capture keeps for the calling thread alone.

  Attributes:
    captures: the sessions running in this thread, the innermost last.
    bypass: set while a layer's own input is recomputed (normalisation layers):
      the layer calls this makes are not captured.
  """

  def __init__(self):
    self.captures: tuple[_Capture, ...] = ()
    self.bypass = False


_state = _ThreadState()


def _current() -> _Session | None:
  """The innermost session running in the calling thread, if any."""
  captures = _state.captures
  return captures[-1].session if captures else None


def _patched_scan(original: Callable[..., Any]) -> Callable[..., Any]:
  """``lax.scan`` that threads the perturbations and records of its body's layers."""

  def scan(f, init, xs=None, length=None, **kwargs):
    s = _current()
    if s is None or not s.active():
      return original(f, init, xs, length, **kwargs)
    start, body, feed = s.enter()

    def body_fn(carry, x_and_feed):
      x, feed = x_and_feed
      with s.body(start, body, feed, mapped=True) as frame:
        carry, y = f(carry, x)
      return carry, (y, frame.record)

    carry, (ys, record) = original(body_fn, init, (xs, feed), length, **kwargs)
    s.leave(body, record)
    return carry, ys

  return scan


def _patched_vmap(original: Callable[..., Any]) -> Callable[..., Any]:
  """``jax.vmap`` that threads the perturbations and records of its body's layers."""

  def vmap(fun, in_axes=0, out_axes=0, **kwargs):
    plain = original(fun, in_axes, out_axes, **kwargs)
    in_axes = tuple(in_axes) if isinstance(in_axes, list) else in_axes

    @functools.wraps(fun)
    def mapped(*args, **call_kwargs):
      s = _current()
      if s is None or not s.active():
        return plain(*args, **call_kwargs)
      start, body, feed = s.enter()

      def body_fn(args, feed, **call_kwargs):
        with s.body(start, body, feed, mapped=True) as frame:
          out = fun(*args, **call_kwargs)
        return out, frame.record

      out, record = original(body_fn, (in_axes, 0), (out_axes, 0), **kwargs)(
        args, feed, **call_kwargs
      )
      s.leave(body, record)
      return out

    return mapped

  return vmap


def _patched_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
  """``jax.checkpoint`` that threads the perturbations and records of its body's layers."""

  def checkpoint(fun, **kwargs):
    plain = original(fun, **kwargs)

    @functools.wraps(fun)
    def rematerialised(*args, **call_kwargs):
      s = _current()
      if s is None or not s.active():
        return plain(*args, **call_kwargs)
      start, body, feed = s.enter()

      def body_fn(*args, kaisa_jax_feed, **call_kwargs):
        with s.body(start, body, kaisa_jax_feed, mapped=False) as frame:
          out = fun(*args, **call_kwargs)
        return out, frame.record

      out, record = original(body_fn, **kwargs)(*args, kaisa_jax_feed=feed, **call_kwargs)
      s.leave(body, record)
      return out

    return rematerialised

  return checkpoint


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


def _uncaptured_reason(module: Any, own: dict[str, Any]) -> str:
  """Why a called module that holds parameters itself is not preconditioned."""
  if layers_lib.find_kind(module) is not None:  # a normalisation layer
    return "normalisation layer, passed through (value_and_grad(normalization=...))"
  if type(module).__module__.startswith("flax."):
    return "unsupported layer type; gradients pass through"
  return (
    f"parameter(s) {', '.join(sorted(own))} created with self.param directly in a module "
    "that is not a layer kind kaisa_jax knows (see kaisa_jax.register_layer); gradients pass "
    "through"
  )


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


_TRANSFORMS = (
  (jax.lax, "scan", _patched_scan),
  (jax, "vmap", _patched_vmap),
  (jax, "checkpoint", _patched_checkpoint),
  (jax, "remat", _patched_checkpoint),
)
_PATCH_LOCK = threading.Lock()
_PATCHED = "_kaisa_jax_patched"  # marks the functions that `_install` puts in place


def _dispatcher(original: Callable[..., Any], patch: Callable[..., Any]) -> Callable[..., Any]:
  """``original`` (``lax.scan``, ...) as wrapped by each session running in the calling thread.

  With none, a call is a call of ``original`` itself; with one, of
  ``patch(original)``; nested sessions wrap it once each.
  """

  @functools.wraps(original)
  def dispatch(*args, **kwargs):
    fun = original
    for _ in _state.captures:
      fun = patch(fun)
    return fun(*args, **kwargs)

  setattr(dispatch, _PATCHED, patch)
  return dispatch


def _intercepted(session: _Session, next_fun, context, *args, **kwargs):
  return session.intercept(next_fun, args, kwargs, context)


def _method_dispatcher(cls: type, method: str, original: Callable[..., Any]) -> Callable[..., Any]:
  """An NNX layer method that the sessions running in the calling thread intercept.

  Only the sessions that were started while ``(cls, method)`` was the method of
  a layer kind do (`_nnx_methods`); the innermost runs first.
  """

  @functools.wraps(original)
  def dispatch(self, *args, **kwargs):
    captures = _state.captures
    if not captures:
      return original(self, *args, **kwargs)
    context = types.SimpleNamespace(module=self, method_name=method)
    fun = functools.partial(original, self)
    for capture in captures:
      if (cls, method) in capture.methods:
        fun = functools.partial(_intercepted, capture.session, fun, context)
    return fun(*args, **kwargs)

  setattr(dispatch, _PATCHED, (cls, method))
  return dispatch


def _nnx_methods() -> frozenset[tuple[type, str]]:
  """``(class, method)`` of each NNX layer method of a layer kind, where the class defines it.

  Subclasses that keep the method are covered by their base class's.
  """
  return frozenset(
    (cls, method)
    for kind in layers_lib.all_kinds()
    for cls in kind.module_types
    if issubclass(cls, nnx.Module)
    for method, _ in kind.methods
    if cls.__dict__.get(method) is not None
  )


def _install(methods: frozenset[tuple[type, str]]) -> None:
  """Puts the dispatchers in place, once for the process, where they are not yet.

  A function already in place stays so (another thread may be inside it);
  one that has been replaced since (by a test's monkeypatching, say) is wrapped
  again.
  """
  with _PATCH_LOCK:
    for owner, name, patch in _TRANSFORMS:
      current = getattr(owner, name)
      if getattr(current, _PATCHED, None) is not patch:
        setattr(owner, name, _dispatcher(current, patch))
    for cls, method in methods:
      current = cls.__dict__[method]
      if getattr(current, _PATCHED, None) is None:
        setattr(cls, method, _method_dispatcher(cls, method, current))


@contextlib.contextmanager
def _capturing(session: _Session):
  """Runs ``session`` around the layer calls of the loss, in the calling thread.

  Linen has method interceptors (kept per thread by Flax); NNX has none, so the
  methods of the NNX layer classes K-FAC knows are wrapped (subclasses that keep
  them are covered too). ``lax.scan``, ``jax.vmap`` and ``jax.checkpoint``
  (which ``nn.scan``, ``nn.vmap`` and ``nn.remat`` are built on) are wrapped so
  that layers inside them are captured too. See the module docstring for why
  these wrappers stay in place once installed.
  """
  methods = _nnx_methods()
  _install(methods)
  outer = _state.captures
  _state.captures = (*outer, _Capture(session, methods))
  try:
    with nn.intercept_methods(session.intercept):
      yield
  finally:
    _state.captures = outer


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


def _kind(module: nn.Module, selection: _Selection) -> layers_lib.LayerKind | None:
  """The module's kind; normalisation layers only when a preconditioner was chosen."""
  kind = layers_lib.find_kind(module)
  if kind is not None and kind.name in layers_lib.NORMS and selection.normalization is None:
    return None
  return kind


def _recorded_input(module: nn.Module, args: tuple, kwargs: dict) -> Array:
  """What a call contributes as its input ``a`` (the kind may recompute it)."""
  kind = layers_lib.find_kind(module)
  if kind is None or kind.record is None:
    return args[0] if args else next(iter(kwargs.values()))
  _state.bypass = True
  try:
    return kind.record(module, args, kwargs)
  finally:
    _state.bypass = False


def _as_patterns(patterns: str | Sequence[str] | None, arg: str) -> tuple[str, ...] | None:
  if patterns is None:
    return None
  if isinstance(patterns, str):
    return (patterns,)
  if not all(isinstance(p, str) for p in patterns):
    raise TypeError(f"{arg} must be a glob pattern or a sequence of them, got {patterns!r}")
  return tuple(patterns)


class _Traced(NamedTuple):
  """What the abstract trace of the loss found, for the real evaluation to follow."""

  calls: dict[int, _Call]
  count: int
  ends: dict[int, int]
  slots: tuple[_Slot, ...]
  outs: dict[int, jax.ShapeDtypeStruct]


def _spec_of_call(
  s: _Session,
  selection: _Selection,
  name: str,
  module: Any,
  method: str,
  kind: layers_lib.LayerKind,
  out: Any,
) -> tuple[layers_lib.LayerSpec | None, int, dict[str, Any] | None]:
  """``(spec, rows, config)`` of a call of a selected layer, as the abstract trace sees it.

  ``rows`` counts the rows the call adds to the factors; ``config`` is what the
  kind's ``describe`` reads from the module. A layer K-FAC cannot precondition
  is skipped, with the reason, and gives no rows.
  """
  own = _direct_params(module)
  spec, config = None, None
  try:
    if not isinstance(out, jax.Array):
      raise layers_lib.UnsupportedLayerError(
        f"{method} returned {type(out).__name__}, not one array"
      )
    prefix, suffix = _param_path(module, kind.weight, own, s.leaf_paths)
    spec = layers_lib.make_spec(
      kind, module, name, prefix, tuple(own[kind.weight].shape), kind.bias in own
    )
    config = kind.describe(module, spec.kernel_shape)
    spec = dataclasses.replace(
      spec,
      param_suffix=suffix,
      methods=(method,),
      diagonal_input=spec.diagonal_input
      or (kind.name in layers_lib.NORMS and selection.normalization == DIAGONAL),
    )
    side = spec.kernel_shape[: spec.in_ndim] if kind.transposed(method) else None
    features = spec.g_dim * spec.groups if side is None else int(np.prod(side))
    return spec, out.size // features, config
  except layers_lib.UnsupportedLayerError as e:
    s.skip(name, module, str(e))
    return spec, 0, config


def _traced_call(
  calls: dict[int, _Call],
  selection: _Selection,
  s: _Session,
  cid: int,
  name: str,
  module: Any,
  method: str,
  kind: layers_lib.LayerKind,
  call: Callable[[], Any],
  *_: Any,
) -> Any:
  """The abstract trace's ``on_call``: runs a layer call and notes it in ``calls``."""
  out = call()
  spec, rows, config = None, 0, None
  if selection.selects(name):
    spec, rows, config = _spec_of_call(s, selection, name, module, method, kind, out)
  elif name not in s.skipped:
    s.skip(name, module, EXCLUDED)
  calls[cid] = _Call(
    name,
    method,
    spec,
    jax.ShapeDtypeStruct(out.shape, out.dtype),
    rows,
    _varying_axes(out),
    s.depth(),
    type(module).__name__,
    config,
  )
  if isinstance(out, jax.Array):
    s.frames[-1].record[cid] = out
  return out


def _skip_elsewhere(session: _Session, calls: dict[int, _Call]) -> None:
  """Lists the layers called only in traces that capture does not follow."""
  for name, module_type in session.elsewhere.items():
    if all(c.name != name for c in calls.values()):
      session.skipped.setdefault(
        name,
        Skipped(
          name,
          module_type,
          "applied inside a JAX transformation kaisa_jax does not follow (lax.cond,"
          " lax.while_loop, custom_vjp, jax.jit, ...); gradients pass through",
        ),
      )


def _stacked_axes(
  calls: dict[int, _Call],
  outs: dict[int, jax.ShapeDtypeStruct],
  leaves: dict[tuple, Any],
  skipped: dict[str, Skipped],
) -> dict[int, int]:
  """How many leading axes of each preconditioned call's weight are stacked.

  The stacked axes must be leading axes of the scans and vmaps around the call
  (``variable_axes={"params": 0}``); a layer whose weight is stacked otherwise
  is skipped, with the reason.
  """
  stacks: dict[int, int] = {}
  for cid, c in calls.items():
    if c.spec is None or c.name in skipped:
      continue
    mapped = outs[cid].shape[: c.depth]
    weight = c.spec.layer_kind.weight
    leaf = leaves[(*c.spec.param_path, jax.tree_util.DictKey(weight), *c.spec.param_suffix)]
    stacks[cid] = leaf.ndim - len(c.spec.kernel_shape)
    stacked = tuple(leaf.shape[: stacks[cid]])
    if (
      tuple(leaf.shape[len(stacked) :]) != c.spec.kernel_shape or stacked != mapped[: len(stacked)]
    ):
      skipped[c.name] = Skipped(
        c.name,
        c.module_type,
        f"its {weight} has shape {tuple(leaf.shape)} in the params, not its shape "
        f"{c.spec.kernel_shape} stacked along the leading axes {mapped} of the scans "
        "and vmaps around it; stack it with variable_axes={'params': 0}",
      )
  return stacks


def _layer_slots(
  calls: dict[int, _Call],
  outs: dict[int, jax.ShapeDtypeStruct],
  stacks: dict[int, int],
  skipped: dict[str, Skipped],
) -> tuple[dict[str, layers_lib.LayerSpec], list[_Slot]]:
  """The preconditioned layers, by name, and where each of their calls comes from.

  A call inside scans or vmaps is one call per index of their axes: of one
  layer per slice of its stacked weight (named ``"stack/Dense_0[i]"``), or of
  the same layer when the weight is shared.
  """
  specs: dict[str, layers_lib.LayerSpec] = {}
  slots: list[_Slot] = []
  for cid in sorted(calls):
    c = calls[cid]
    if c.spec is None or c.name in skipped:
      continue
    for index in np.ndindex(*outs[cid].shape[: c.depth]):
      where = index[: stacks[cid]]
      name = f"{c.name}[{','.join(map(str, where))}]" if where else c.name
      slots.append(_Slot(name, cid, index))
      prev = specs.get(name)
      if prev is None:
        specs[name] = dataclasses.replace(c.spec, name=name, param_index=where, rows=c.rows)
      else:
        specs[name] = dataclasses.replace(
          prev, methods=(*prev.methods, c.method), rows=prev.rows + c.rows
        )
  return specs, slots


def _trace(
  fun: Callable[..., Any], params: Any, args: tuple, kwargs: dict, selection: _Selection
) -> tuple[Layers, _Traced]:
  """Traces the loss abstractly; returns the registry and the calls in order."""
  calls: dict[int, _Call] = {}
  ends: dict[int, int] = {}
  sessions: list[_Session] = []
  on_call = functools.partial(_traced_call, calls, selection)

  def traced(params):
    s = _Session(params, selection, on_call, {}, ends)
    sessions.append(s)
    with _capturing(s):
      fun(params, *args, **kwargs)
    return s.frames[0].record

  stage = jax.jit(traced).trace(params)  # what jax.eval_shape does, keeping the jaxpr
  outs = stage.out_info
  (session,) = sessions
  skipped = session.skipped
  _skip_elsewhere(session, calls)
  selection.check_patterns([c.name for c in calls.values()])
  leaves = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  stacks = _stacked_axes(calls, outs, leaves, skipped)
  specs, slots = _layer_slots(calls, outs, stacks, skipped)
  claimed = {plain_path(p) for s in specs.values() for p in _spec_leaves(s)} | session.owned
  is_nnx = isinstance(params, nnx.State) or session.nnx
  unclaimed = [p for p in leaves if not _explained(p, claimed, session, is_nnx)]
  _check_not_jitted(stage.jaxpr, list(leaves), {plain_path(p) for p in unclaimed})
  _list_unclaimed(list(leaves), unclaimed, skipped, session.nnx_lifted, is_nnx)
  traced_calls = _Traced(calls, session.calls, ends, tuple(slots), outs)
  return Layers(tuple(specs.values()), tuple(skipped.values())), traced_calls


def _spec_leaves(spec: layers_lib.LayerSpec) -> tuple[tuple, ...]:
  """The key paths of a layer's weight and bias in the params."""
  kind = spec.layer_kind
  keys = (kind.weight, kind.bias) if spec.has_bias else (kind.weight,)
  return tuple((*spec.param_path, jax.tree_util.DictKey(k), *spec.param_suffix) for k in keys)


def plain_path(path: tuple) -> tuple:
  """A key path without the attribute keys at its end.

  Flax NNX params come as variables (``nnx.split``: a layer's kernel at
  ``['hidden']['kernel'].value``) or as their arrays (``nnx.Optimizer`` hands
  ``update`` those: ``['hidden']['kernel']``); both name the same leaf.
  """
  while path and isinstance(path[-1], jax.tree_util.GetAttrKey):
    path = path[:-1]
  return path


def _names(path: tuple) -> tuple[str, ...]:
  return tuple(_key_name(k) for k in plain_path(path))


def _explained(path: tuple, claimed: set[tuple], s: _Session, nnx_: bool) -> bool:
  """Whether a parameter is held by a module the loss was seen to call.

  ``claimed``: the plain key paths held by captured layers or by modules called
  with them unchanged. A linen parameter also counts when its module's path
  (in the params collection, or after the collection's name in the whole
  variables) is that of a module called in a followed trace.
  """
  if plain_path(path) in claimed:
    return True
  n = _names(path)
  return not nnx_ and (n[:-1] in s.owners or (len(n) > 2 and n[1:-1] in s.owners))


def _list_unclaimed(
  paths: list[tuple],
  unclaimed: list[tuple],
  skipped: dict[str, Skipped],
  lifted: set[str],
  nnx_: bool,
) -> None:
  """Lists the ``unclaimed`` parameters that no listed module explains.

  A linen module that holds parameters is seen when it is called: a parameter
  of none of them is read outside every module call, or belongs to a module the
  loss does not call, or to one called where capture does not follow (listed
  already). NNX has no method interceptors, so only the layer kinds' own calls
  are seen: every other module is found here from the params, grouped by the
  path of the module that holds them. ``lifted`` names the NNX layer types seen
  inside NNX transformations, which are not followed.
  """
  if not nnx_:
    for n in map(_names, unclaimed):
      if "/".join(n[:-1]) in skipped or "/".join(n[1:-1]) in skipped:
        continue
      skipped.setdefault(
        "/".join(n),
        Skipped(
          "/".join(n),
          "no module",
          "a parameter no Flax module of the loss reads (read outside model.apply, or held by "
          "a module the loss does not call); gradients pass through",
        ),
      )
    return
  reason = "not a layer kind kaisa_jax captures"
  if lifted:
    reason += (
      f", or a {' or '.join(sorted(lifted))} applied inside nnx.scan, nnx.vmap or"
      " nnx.remat, which kaisa_jax does not follow yet"
    )
  reason += "; gradients pass through"
  containers = {n[:i] for n in map(_names, paths) for i in range(len(n) - 1)}
  for n in map(_names, unclaimed):
    if n[:-1] in containers:  # held beside submodules, or by the root module
      name = "/".join(n)
      skipped.setdefault(
        name,
        Skipped(
          name,
          "nnx.Param",
          "a parameter created with nnx.Param directly in a module that is not a layer kind "
          "kaisa_jax knows; gradients pass through",
        ),
      )
    else:
      skipped.setdefault("/".join(n[:-1]), Skipped("/".join(n[:-1]), "nnx.Module", reason))


_JIT = ("jit", "pjit")
_LAYER_OPS = ("dot_general", "conv_general_dilated")


def _has_layer_ops(jaxpr: Any) -> bool:
  """Whether a jaxpr (or one nested in it) multiplies as a dense layer or a convolution does."""
  return any(e.primitive.name in _LAYER_OPS for e in jaxpr.eqns) or any(
    _has_layer_ops(j) for j in jax_core.subjaxprs(jaxpr)
  )


def _check_not_jitted(closed: Any, paths: list[tuple], unclaimed: set[tuple]) -> None:
  """Raises if the loss hands ``unclaimed`` parameters to a ``jax.jit``-compiled function.

  Layers inside a compiled function run in the function's own trace, or not at
  all when its compiled form is reused: capture cannot see them. ``closed`` is
  the loss's jaxpr, whose inputs are the leaves at ``paths``; a parameter that
  no module was seen to hold, passed on as is (or cast) to a ``jit`` that
  multiplies as a dense layer or a convolution does, counts.
  """
  jaxpr = closed.jaxpr
  if not unclaimed or len(jaxpr.invars) != len(paths):
    return
  source = dict(zip(jaxpr.invars, map(plain_path, paths), strict=True))
  for eqn in jaxpr.eqns:
    inputs = [v for v in eqn.invars if not isinstance(v, jax_core.Literal)]
    if eqn.primitive.name in ("convert_element_type", "copy") and inputs[0] in source:
      source[eqn.outvars[0]] = source[inputs[0]]
    if eqn.primitive.name not in _JIT:
      continue
    hidden = [source[v] for v in inputs if source.get(v) in unclaimed]
    if hidden and _has_layer_ops(eqn.params["jaxpr"].jaxpr):
      shown = ", ".join(jax.tree_util.keystr(p) for p in hidden[:4])
      raise ValueError(
        f"kaisa_jax: the loss passes the parameters {shown}{', ...' if len(hidden) > 4 else ''}"
        f" to a jax.jit-compiled function ({eqn.params.get('name', 'jit')}: a jitted "
        "model.apply?), whose layers capture cannot see. Call model.apply unjitted inside "
        "the loss, and jit the train step instead (grad_fn and tx.update inside one "
        "jax.jit)."
      )


class _Mismatch(RuntimeError):
  """A layer call of the real evaluation differs from the abstract trace's."""


_TRACES_KEPT = 8
_TRACES_LOCK = threading.Lock()  # guards each `ValueAndGrad`'s kept traces


def _signature(params: Any, args: tuple, kwargs: dict) -> Any:
  """What the abstract trace depends on besides the loss: the arguments' types.

  Arrays (and tracers) count by their abstract value (shape, dtype, weak type,
  ``shard_map`` axes they vary over), other leaves by their value. ``None`` when
  a leaf cannot be hashed: such a call is traced every time.
  """
  leaves, treedef = jax.tree_util.tree_flatten((params, args, kwargs))
  key = (
    treedef,
    jax.config.jax_enable_x64,
    *(jax.typeof(x) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x for x in leaves),
  )
  try:
    hash(key)
  except TypeError:
    return None
  return key


def _check_call(expected: _Call | None, name: str, method: str, module: Any) -> _Call:
  """``expected`` if a layer call is the one the abstract trace saw, else raises `_Mismatch`."""
  if expected is None or (expected.name, expected.method, expected.module_type) != (
    name,
    method,
    type(module).__name__,
  ):
    raise _Mismatch(
      f"kaisa_jax: layer {name!r} was called differently than when the loss was "
      "traced; the loss must call its layers the same way every time."
    )
  return expected


def _check_output(expected: _Call, module: Any, kind, out: Any) -> None:
  """Raises `_Mismatch` unless a call's output and configuration are the traced ones."""
  got = (getattr(out, "shape", None), getattr(out, "dtype", None))
  if got != (expected.out.shape, expected.out.dtype):
    raise _Mismatch(
      f"kaisa_jax: layer {expected.name!r} returned {got[0]} {got[1]}, but "
      f"{expected.out.shape} {expected.out.dtype} when the loss was traced; the loss must "
      "call its layers the same way every time."
    )
  if expected.config is not None:
    try:
      config = kind.describe(module, expected.spec.kernel_shape)
    except layers_lib.UnsupportedLayerError:
      config = None
    if config != expected.config:
      raise _Mismatch(
        f"kaisa_jax: layer {expected.name!r} is configured as {config}, but as "
        f"{expected.config} when the loss was traced; the loss must call its layers the "
        "same way every time."
      )


class ValueAndGrad:
  """A loss function's value, gradient and curvature in one backward pass.

  Built by `value_and_grad`; calling it returns ``(value, grads, curvature)``.
  The abstract trace of the loss is kept for the next call with arguments of
  the same shapes and types (at most the last eight kinds of call), so a train
  step traced again, or after `layers`, does not trace the loss twice. Every
  layer call is checked against it (name, method, output shape and dtype, what
  the layer kind reads from the module); a loss that has changed since is
  traced again.
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
    self._traces: dict[Any, tuple[Layers, _Traced]] = {}

  def _trace(self, key: Any, params: Any, args: tuple, kwargs: dict) -> tuple:
    """A new abstract trace, kept under ``key`` (`_signature`) unless it is ``None``."""
    result = _trace(self._fun, params, args, kwargs, self._selection)
    if key is not None:
      with _TRACES_LOCK:
        self._traces.pop(key, None)
        self._traces[key] = result
        while len(self._traces) > _TRACES_KEPT:
          del self._traces[next(iter(self._traces))]
    return result

  def layers(self, params: Any, *args: Any, **kwargs: Any) -> Layers:
    """Traces the loss abstractly (no computation) and lists its layers.

    Takes the same arguments as the loss function. The result is what
    `kaisa_jax.kfac` needs; ``print`` it to see every layer, its factor shapes,
    and every module with parameters that is not preconditioned.
    """
    return self._trace(_signature(params, args, kwargs), params, args, kwargs)[0]

  def __call__(self, params: Any, *args: Any, **kwargs: Any):
    key = _signature(params, args, kwargs)
    kept = self._traces.get(key)
    trace = kept or self._trace(key, params, args, kwargs)
    try:
      return self._evaluate(trace, params, args, kwargs)
    except _Mismatch as e:
      if kept is None:
        raise RuntimeError(str(e)) from None
    return self._evaluate(self._trace(key, params, args, kwargs), params, args, kwargs)

  def _evaluate(self, trace: tuple[Layers, _Traced], params: Any, args: tuple, kwargs: dict):
    """The loss, its gradient and the curvature, following the abstract ``trace``."""
    registry, traced = trace
    # Zero perturbations of the layer outputs (with the axes of the scans and
    # vmaps around them). Under shard_map they must vary over the same axes as
    # the outputs: the gradient of an unvarying input would be summed over the
    # devices.
    perturbations: dict[int, Array] = {}
    for number in sorted({x.call for x in traced.slots}):
      c = traced.calls[number]
      zero = jnp.zeros(traced.outs[number].shape, c.out.dtype)
      if c.varying:
        zero = jax.lax.pcast(zero, c.varying, to="varying")
      perturbations[number] = zero

    def on_call(s: _Session, number, name, module, method, kind, call, call_args, call_kwargs):
      expected = _check_call(traced.calls.get(number), name, method, module)
      frame = s.frames[-1]
      if number in frame.feed:
        frame.record[number] = _recorded_input(module, call_args, call_kwargs)
      out = call()
      _check_output(expected, module, kind, out)
      return out + frame.feed[number] if number in frame.feed else out

    def loss_with_perturbations(params, perturbations):
      s = _Session(params, self._selection, on_call, perturbations, dict(traced.ends))
      with _capturing(s):
        result = self._fun(params, *args, **kwargs)
      inputs = s.frames[0].record
      if s.calls != traced.count or inputs.keys() != perturbations.keys():
        raise _Mismatch(
          f"kaisa_jax: the loss made {s.calls} layer calls, but {traced.count} when it was "
          "traced; the loss must call its layers the same way every time."
        )
      loss, aux = result if self._has_aux else (result, None)
      return loss, (aux, inputs)

    (loss, (aux, inputs)), (grads, out_grads) = jax.value_and_grad(
      loss_with_perturbations, argnums=(0, 1), has_aux=True
    )(params, perturbations)

    by_layer: dict[str, tuple[list[Array], list[Array]]] = {}
    for x in traced.slots:
      a, g = by_layer.setdefault(x.layer, ([], []))
      a.append(inputs[x.call][x.index])
      g.append(out_grads[x.call][x.index])
    curvature: dict[str, LayerCurvature] = {}
    for spec in registry.specs:
      a, g = by_layer[spec.name]
      n = tuple(
        jnp.asarray(self._n_examples or layers_lib.default_examples(spec, m, x), jnp.float32)
        for m, x in zip(spec.methods, a, strict=True)
      )
      curvature[spec.name] = LayerCurvature(tuple(a), tuple(g), n)
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
  it is nested (inside ``nn.scan``, ``nn.remat`` and ``nn.vmap`` too: a
  scanned stack of layers gives one layer per slice, named ``"stack/Dense_0[i]"``),
  as are their NNX twins (``nnx.Linear``, ``nnx.LinearGeneral``,
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
