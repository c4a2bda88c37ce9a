"""Distribution: the grad worker fraction, the device mesh and K-FAC's collectives.

With ``N`` data-parallel devices and grad worker fraction ``f``, ``W = f N``
devices form a grad-worker group. Devices are a ``(N / W) x W`` grid; device
``(r, c)`` has the linear index ``r W + c``. The mesh made by `make_mesh` names
its axes `RECEIVERS` (size ``N / W``, across groups) and `GRAD_WORKERS` (size
``W``, within a group); shard the batch over both.

The collectives, per phase:

* factor reduction (factor steps): the batch factors of every layer are summed
  over all ``N`` devices straight onto the one device that owns the layer
  (``psum_scatter``), not all-reduced to everyone;
* decomposition sharing (inverse steps): each device's decompositions are
  gathered within its group (``all_gather`` over `GRAD_WORKERS`);
* gradient sharing (every step): each group's preconditioned gradients are
  gathered by the other groups (``all_gather`` over `RECEIVERS`).

``f = 1`` (COMM-OPT) has no gradient sharing; ``f = 1 / N`` (MEM-OPT) no
decomposition sharing.
"""

from __future__ import annotations

import dataclasses
import fractions
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

Array = jax.Array

RECEIVERS = "receivers"
GRAD_WORKERS = "grad_workers"
STRATEGIES = ("comm_opt", "hybrid_opt", "mem_opt")
AUTO = "auto"  # kaisa_jax.kfac resolves it with kaisa_jax.plan_fractions


def valid_fractions(n: int) -> list[str]:
  """The grad worker fractions allowed with ``n`` devices, as ``W/N``."""
  return [str(fractions.Fraction(w, n)) for w in range(1, n + 1) if n % w == 0]


def check_fraction(fraction: Any) -> None:
  """Raises unless ``fraction`` is a number in ``(0, 1]`` or a strategy name."""
  if isinstance(fraction, str):
    if fraction not in STRATEGIES:
      raise ValueError(
        f"grad_worker_fraction must be a number in (0, 1] or one of {STRATEGIES} (kaisa_jax.kfac "
        f"also takes {AUTO!r}), got {fraction!r}"
      )
    return
  if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
    raise TypeError(f"grad_worker_fraction must be a number or a name, got {fraction!r}")
  if not 0 < fraction <= 1:
    raise ValueError(f"grad_worker_fraction must lie in (0, 1], got {fraction}")


def grad_workers(fraction: float | str, n: int) -> int:
  """``W``, the grad workers per group, for fraction ``fraction`` of ``n`` devices.

  ``fraction`` is a number in ``(0, 1]`` with ``fraction * n`` an integer that
  divides ``n``, or ``"comm_opt"`` (1), ``"hybrid_opt"`` (1/2) or ``"mem_opt"``
  (``1 / n``).
  """
  check_fraction(fraction)
  if fraction == "comm_opt":
    return n
  if fraction == "mem_opt":
    return 1
  value = 0.5 if fraction == "hybrid_opt" else float(fraction)
  w = value * n
  if abs(w - round(w)) > 1e-9 or round(w) < 1 or n % round(w) != 0:
    raise ValueError(
      f"grad_worker_fraction={fraction!r} does not give an integer number of grad workers "
      f"dividing {n} devices; valid values for {n} devices: {', '.join(valid_fractions(n))} "
      f"(or {', '.join(STRATEGIES)} where they apply)"
    )
  return round(w)


def make_mesh(grad_worker_fraction: float | str, devices: Sequence[Any] | None = None) -> Mesh:
  """A ``(N / W, W)`` mesh with axes ``(RECEIVERS, GRAD_WORKERS)``.

  Args:
    grad_worker_fraction: see `grad_workers`.
    devices: the devices, in order (default: all of ``jax.devices()``).

  Returns:
    A `jax.sharding.Mesh`; pass it to `kaisa_jax.kfac` as ``mesh=`` and run the
    train step under ``jax.shard_map`` over it with the batch sharded over
    ``(RECEIVERS, GRAD_WORKERS)``.
  """
  devices = list(jax.devices() if devices is None else devices)
  w = grad_workers(grad_worker_fraction, len(devices))
  grid = np.asarray(devices, dtype=object).reshape(len(devices) // w, w)
  return Mesh(grid, (RECEIVERS, GRAD_WORKERS))


def flatten_into(arrays: Sequence[Array], size: int, dtype: Any) -> Array:
  """The arrays flattened one after another, zero-padded to ``size`` elements."""
  parts = [a.reshape(-1).astype(dtype) for a in arrays]
  used = sum(p.shape[0] for p in parts)
  return jnp.concatenate([*parts, jnp.zeros((size - used,), dtype)])


def split(flat: Array, shapes: Sequence[tuple[int, ...]]) -> list[Array]:
  """Inverse of `flatten_into`: the arrays of ``shapes`` at the start of ``flat``."""
  out, start = [], 0
  for shape in shapes:
    n = int(np.prod(shape))
    out.append(flat[start : start + n].reshape(shape))
    start += n
  return out


def mapped_axes() -> dict[Any, int]:
  """The named axes the current trace is mapped over, with their sizes.

  ``jax.pmap``, ``jax.shard_map`` and a ``jax.vmap`` given an ``axis_name``
  bind them. JAX has no public query for this; an empty dict if its internals
  move (the check that uses it is then skipped).
  """
  try:
    from jax._src import core as jax_core

    return dict(jax_core.get_axis_env().axis_sizes)
  except (ImportError, AttributeError):  # pragma: no cover: another JAX version
    return {}


@dataclasses.dataclass(frozen=True)
class Collectives:
  """K-FAC's collectives for one way of running the step.

  ``mode`` is ``"single"`` (one device), ``"shard_map"`` (over a mesh from
  `make_mesh`) or ``"pmap"`` (over the pmapped axis ``axis_name``, the groups
  expressed with ``axis_index_groups``).
  """

  mode: str
  rows: int
  cols: int
  axis_name: str | None = None

  @property
  def size(self) -> int:
    return self.rows * self.cols

  def check(self) -> None:
    """Raises if the step does not run over the devices kfac was built for.

    That includes a step mapped over devices that kfac was not told about: each
    device would then precondition with the factors of its own share of the
    batch, and the replicas would drift apart without any error.
    """
    names = {
      "single": (),
      "shard_map": (RECEIVERS, GRAD_WORKERS),
      "pmap": (self.axis_name,),
    }[self.mode]
    unknown = {k: v for k, v in mapped_axes().items() if k not in names and v > 1}
    if unknown:
      built = "one device" if self.mode == "single" else f"{self.mode} over the axes {names}"
      raise ValueError(
        f"kfac's update runs mapped over the axes {unknown} (jax.pmap, jax.shard_map or a "
        f"named jax.vmap), but kfac was built for {built}: every device would "
        "precondition with the factors of its own share of the batch. Build kfac for the "
        "data-parallel devices: kaisa_jax.kfac(..., axis_name=NAME) under jax.pmap(..., "
        "axis_name=NAME), or kaisa_jax.kfac(..., mesh=kaisa_jax.make_mesh(fraction)) under "
        "jax.shard_map over that mesh. (An axis that is not data parallel, such as a "
        "jax.vmap over an ensemble, must not be named.)"
      )
    if self.mode == "single":
      return
    try:
      sizes = [jax.lax.psum(1, name) for name in names]
    except NameError as e:
      raise ValueError(
        f"kfac was built for {self.mode} over axes {names}; call its update inside "
        + (
          "jax.shard_map over the mesh given to kfac"
          if self.mode == "shard_map"
          else "jax.pmap with that axis_name"
        )
      ) from e
    expected = [self.rows, self.cols] if self.mode == "shard_map" else [self.size]
    if sizes != expected:
      raise ValueError(f"kfac was built for axis sizes {expected}, but the step runs over {sizes}")

  def index(self) -> Array:
    """This device's index ``r W + c``."""
    if self.mode == "single":
      return jnp.zeros([], jnp.int32)
    if self.mode == "pmap":
      return jax.lax.axis_index(self.axis_name)
    r, c = self.position()
    return r * self.cols + c

  def vary(self, x: Array, over_group: bool) -> Array:
    """Types ``x`` as differing across groups (and members, if ``over_group``).

    Only ``shard_map`` tracks this; the branches of a `jax.lax.switch` on the
    device must agree on it even where a device has nothing to compute.
    """
    if self.mode != "shard_map":
      return x
    axes = (RECEIVERS, GRAD_WORKERS) if over_group else (RECEIVERS,)
    manual = getattr(jax.typeof(x), "mat", None)
    missing = tuple(a for a in axes if a not in getattr(manual, "varying", ()))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  def position(self) -> tuple[Array, Array]:
    """``(r, c)``: this device's group and its position in the group."""
    if self.mode == "single":
      return jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32)
    if self.mode == "shard_map":
      return jax.lax.axis_index(RECEIVERS), jax.lax.axis_index(GRAD_WORKERS)
    i = jax.lax.axis_index(self.axis_name)
    return i // self.cols, i % self.cols

  def _all_axes(self) -> str | tuple[str, str]:
    return (RECEIVERS, GRAD_WORKERS) if self.mode == "shard_map" else self.axis_name

  def total(self, x: Array) -> Array:
    """The sum of ``x`` over all devices."""
    return x if self.mode == "single" else jax.lax.psum(x, self._all_axes())

  def everywhere(self, flag: Array) -> Array:
    """Whether ``flag`` holds on every device."""
    return self.total((~flag).astype(jnp.int32)) == 0

  def reduce_to_owners(self, stack: Array) -> Array:
    """``(rows, cols, ...)``, one entry per device, summed over devices onto its owner.

    Returns this device's entry of the sum, shape ``(1, 1, ...)``.
    """
    if self.mode == "single":
      return stack
    flat = stack.reshape(self.size, *stack.shape[2:])
    mine = jax.lax.psum_scatter(flat, self._all_axes(), scatter_dimension=0, tiled=True)
    return mine.reshape(1, 1, *stack.shape[2:])

  def gather_group(self, x: Array) -> Array:
    """``(1, 1, ...)`` per device to ``(1, cols, ...)``: all members of this group.

    Under ``shard_map`` the result is typed invariant over the group (it is the
    same on every member), even for a group of one.
    """
    if self.mode == "shard_map":
      return jax.lax.all_gather(x, GRAD_WORKERS, axis=1, tiled=True, to="invarying")
    if self.cols == 1:
      return x
    groups = [[r * self.cols + c for c in range(self.cols)] for r in range(self.rows)]
    return jax.lax.all_gather(x, self.axis_name, axis=1, tiled=True, axis_index_groups=groups)

  def gather_receivers(self, x: Array) -> Array:
    """``(1, ...)`` per device (the same on every member of a group) to ``(rows, ...)``."""
    if self.mode == "shard_map":
      return jax.lax.all_gather(x, RECEIVERS, axis=0, tiled=True, to="invarying")
    if self.rows == 1:
      return x
    groups = [[r * self.cols + c for r in range(self.rows)] for c in range(self.cols)]
    return jax.lax.all_gather(x, self.axis_name, axis=0, tiled=True, axis_index_groups=groups)
