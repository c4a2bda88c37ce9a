"""The flop-equivalents of a decomposition: its time over that of a matrix product of its size.

`kaisa_jax.cost` counts an ``eigh`` of an ``n x n`` factor as ``EIGH_CUBE n^3`` flops and a
Cholesky inverse as ``INVERSE_CUBE n^3``, at the rate of matrix products; the projection
(`kaisa_jax.analysis.projection.lapack_flops`) counts the LAPACK calls of a compiled program with
the same constants. This script measures them on this machine: for each size ``n`` it times
`kaisa_jax.preconditioning.decompose` (one matrix, ``"eigen"`` and ``"inverse"``, as K-FAC calls
it) and one ``n x n`` by ``n x n`` float32 product (``2 n^3`` flops), in turns, and prints

  ``c(n) = t_decomposition / (t_product / (2 n^3)) / n^3 = 2 t_decomposition / t_product``,

the decomposition's cost in flops at the product's rate, over ``n^3``. With ``--rate FLOPS``
it also prints the constants of timings given on the command line against that rate
(``--given eigen 4608 0.134``), as for a GPU whose product rate is its preset's.

Run: ``python benchmarks/decomposition_cost.py [--sizes 256 512 1024 2048] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kaisa_jax import preconditioning


def spd(n: int) -> jax.Array:
  """A well-conditioned symmetric positive definite ``n x n`` float32 matrix."""
  x = jax.random.normal(jax.random.key(n), (n, 2 * n), jnp.float32)
  return x @ x.T / (2 * n) + 1e-3 * jnp.eye(n)


def programs(n: int) -> dict[str, tuple]:
  """The jitted programs timed at size ``n`` and their arguments, by name.

  ``"product"``: ``n x n`` by ``n x n``; ``"eigen"``, ``"inverse"``: `decompose` of one matrix;
  ``"potrf"``: its Cholesky factor alone; ``"trsm"``: one triangular solve for ``n``
  right-hand sides (the inverse method runs one Cholesky and two such solves).
  """
  a = spd(n)
  lower = jnp.linalg.cholesky(a)
  out = {
    "product": (jax.jit(lambda x, y: x @ y), (a, a + 1.0)),
    "potrf": (jax.jit(jnp.linalg.cholesky), (a,)),
    "trsm": (
      jax.jit(lambda t, b: jax.scipy.linalg.solve_triangular(t, b, lower=True)),
      (lower, a),
    ),
  }
  for method in preconditioning.METHODS:
    fn = functools.partial(preconditioning.decompose, method=method, diagonal=False)
    out[method] = (jax.jit(lambda f, d, fn=fn: fn(f, damping=d)), (a[None], jnp.float32(1e-3)))
  return out


def seconds_in_turns(progs: dict[str, tuple], repeats: int) -> dict[str, float]:
  """Median seconds per call of each program, the programs called in turns ``repeats`` times."""
  for fn, args in progs.values():
    jax.block_until_ready(fn(*args))
  times: dict[str, list[float]] = {k: [] for k in progs}
  for _ in range(repeats):
    for name, (fn, args) in progs.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {k: statistics.median(v) for k, v in times.items()}


def constant(seconds: float, n: int, rate: float) -> float:
  """``seconds x rate / n^3``: a decomposition's flop-equivalents over ``n^3`` at ``rate``."""
  return seconds * rate / n**3


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--rate", type=float, help="FLOP/s of products for --given timings")
  parser.add_argument(
    "--given", nargs=3, action="append", default=[], metavar=("METHOD", "N", "SECONDS")
  )
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; medians of {args.repeats}")
  names = ("eigen", "inverse", "potrf", "trsm")
  print(
    f"{'n':>6} {'product ms':>11} {'GFLOP/s':>8}"
    + "".join(f" {k + ' ms':>11} {'c':>6}" for k in names)
  )
  for n in args.sizes:
    s = seconds_in_turns(programs(n), args.repeats)
    rate = 2.0 * n**3 / s["product"]
    cells = "".join(f" {1e3 * s[k]:>11.2f} {constant(s[k], n, rate):>6.2f}" for k in names)
    print(f"{n:>6} {1e3 * s['product']:>11.2f} {rate / 1e9:>8.1f}" + cells)
  for method, n, seconds in args.given:
    c = constant(float(seconds), int(n), args.rate)
    print(
      f"given {method} n={n}: {1e3 * float(seconds):.2f} ms at {args.rate:.3g} FLOP/s: c = {c:.1f}"
    )


if __name__ == "__main__":
  main()
