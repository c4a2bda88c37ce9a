"""How a stack of equal layers is computed on the CPU: member by member, or in a loop.

Elsewhere (a GPU) each phase computes a stack of ``k`` equal layers as one
batch: one batched ``eigh`` or Cholesky, one batched matrix product. XLA's CPU
backend and jaxlib's LAPACK kernels serve batches poorly, so on the CPU:

* decompositions run one matrix at a time in a loop (`each_matrix`), and the
  decomposition phase runs one loop per size over the members of every stack,
  in place in the flat buffers (`kaisa_jax.phases`);
* preconditioning runs each member on its own (`at_once`), or, for a stack of
  more than `LOOP_FROM` members, in a loop of `LANES` members a turn
  (`in_loop`); `looped` says which.

Each member is computed by the operations that compute it alone, so its
numbers are bit for bit those of the batch. The constants below are tuning
measured on a 2-core CPU (docs/guides/performance.md, docs/benchmarks/compile_time.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

# A stack of more than LOOP_FROM members is preconditioned in a loop (`in_loop`),
# a smaller one member by member (`at_once`). Measured on 2 cores, the
# preconditioning phase of a stack of Dense(128) layers compiled alone (medians of
# seven, in turns): member by member against in a loop, 0.39 s against 0.51 s at
# 32 members, 0.43 against 0.53 at 48, 0.59 against 0.61 at 64, and 0.71 against
# 0.38 s at 128 (medians of five).
LOOP_FROM = 64
# Members computed side by side in each turn of the loop. Measured in the step of
# 128 Dense(128) layers (step time over the members one by one, in one process, in
# turns): one a turn 1.11x, two 1.02x to 1.08x, four 0.99x to 1.00x, eight 0.91x to
# 0.98x, sixteen 0.94x (one run).
LANES = 8


def on_cpu() -> bool:
  """Whether JAX computes on the CPU (the default backend)."""
  return jax.default_backend() == "cpu"


def looped(k: int) -> bool:
  """Whether a stack of ``k`` members is computed in a loop (`in_loop`) rather than at once."""
  return k > LOOP_FROM and on_cpu()


def _read(stack: Array, offset: Array) -> Array:
  """``stack[offset:offset + 1]`` at a runtime offset (never negative: no wrapping)."""
  return jax.lax.dynamic_slice_in_dim(stack, offset, 1, allow_negative_indices=False)


def at_once(fn: Callable, stacks: tuple, offsets: Sequence[Array], *shared: Any) -> Array:
  """``fn(*stacks, *shared)``, ``fn`` batched over the stacks' leading axis; on the CPU, member by member.

  XLA's CPU backend runs a batched matrix product as one kernel over the
  batch, slower than separate products that its threads run side by side
  (the step of 128 layers took 57 to 64 ms member by member against 72 to
  77 ms batched, that of 32 layers 11.0 against 13.2 ms), so on the CPU each
  member is computed alone, read at its runtime offset ``offsets[j]`` so that
  the members' kernels compile once, and the results are joined. Elsewhere
  (a GPU) one batched call.
  """
  k = jax.tree.leaves(stacks)[0].shape[0]
  if k == 1 or not on_cpu():
    return fn(*stacks, *shared)
  member_fn = jax.jit(fn, inline=True)  # traced once, inlined for each member
  parts = [
    member_fn(*jax.tree.map(lambda x, j=j: _read(x, offsets[j]), stacks), *shared) for j in range(k)
  ]
  return jnp.concatenate(parts)


def in_loop(
  fn: Callable,
  stacks: Callable[[], tuple],
  flat: Array,
  start: int,
  offsets: Sequence[Array],
  *shared: Any,
) -> Array:
  """``flat`` with ``fn(*stacks(), *shared)`` written in place from ``start``, in a loop.

  For a stack of more than `LOOP_FROM` members on the CPU (`looped`): a
  `jax.lax.fori_loop` of ``T = ceil(k / LANES)`` turns; turn ``i`` computes
  members ``i + offsets[lane] * T`` for ``lane < ceil(k / T)`` (clamped to
  ``k - 1``), independently of each other, so that the CPU's threads run them
  side by side, as `at_once` does with all ``k``. The program then holds ``fn``
  `LANES` times per stack whatever the stack's size. ``stacks`` is called
  inside the loop, so that each member is read where it lies (no copy of the
  stacks), and each result is written in place into ``flat``. Each turn's
  members start at the runtime ``offsets`` (`kaisa_jax.KFACState.stack_offsets`),
  so their reads and writes share compiled kernels. Each member is computed by
  the operations that compute it alone.
  """
  k = jax.tree.leaves(jax.eval_shape(stacks))[0].shape[0]
  turns = -(-k // LANES)
  lanes = -(-k // turns)  # lanes * turns - k < turns: members computed twice, in the last turn
  member_fn = jax.jit(fn, inline=True)  # traced once, inlined for each lane
  size = jax.eval_shape(lambda: fn(*jax.tree.map(lambda x: x[:1], stacks()), *shared)).size

  def turn(i, flat):
    whole = stacks()
    for lane in range(lanes):
      j = jnp.minimum(i + offsets[lane] * turns, k - 1)
      member = jax.tree.map(lambda x, j=j: jax.lax.dynamic_slice_in_dim(x, j, 1), whole)
      flat = jax.lax.dynamic_update_slice(
        flat, member_fn(*member, *shared).reshape(-1), (start + j * size,)
      )
    return flat

  return jax.lax.fori_loop(0, turns, turn, flat)


def each_matrix(fn: Callable, x: Array) -> Any:
  """``fn`` applied to every ``(d, d)`` matrix of ``x`` (``(..., d, d)``).

  Elsewhere one batched call. On the CPU one matrix at a time, in a loop (one
  call in the program whatever the number of matrices): jaxlib's batched LAPACK
  kernels split their batch over XLA's CPU thread pool and wait for the parts
  on a thread of that same pool, so two batched decompositions running at once
  on a pool of two threads wait for each other forever (seen on 2 cores with
  two stacks of 32 layers).
  """
  batch = x.shape[:-2]
  if not on_cpu():
    return fn(x)
  flat = x.reshape(-1, *x.shape[-2:])
  if flat.shape[0] == 1:
    out = jax.tree.map(lambda y: y[None], fn(flat[0]))
  else:
    out = jax.lax.map(fn, flat)
  return jax.tree.map(lambda y: y.reshape(*batch, *y.shape[1:]), out)
