"""What the grad worker fraction costs: memory and communication per device, on 8 devices.

For a ResNet-style CNN and a stack of transformer blocks, one row per fraction
``f`` in {1/8, 1/4, 1/2, 1}: K-FAC's second-order state per device (measured from
the arrays' addressable shards), and the bytes each device moves per step by
phase, amortised over the cadence (measured from the compiled train step's HLO,
with the analytic model beside it), then the same figures for the KAISA
reference's scheme (every factor all-reduced to and stored on every device).

Run: ``python benchmarks/distributed.py`` (sets up 8 emulated CPU devices).
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
warnings.filterwarnings("ignore", message="kaisa_jax: .* will not be preconditioned")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import kaisa_jax  # noqa: E402
from kaisa_jax import GRAD_WORKERS, RECEIVERS, communication  # noqa: E402
from kaisa_jax.analysis import accounting  # noqa: E402

FACTOR_STEPS, INV_STEPS = 10, 100
FRACTIONS = ("1/8", "1/4", "1/2", "1")
BATCH = P((RECEIVERS, GRAD_WORKERS))


class ResNet(nn.Module):
  """ResNet-20-style: a stem, three stages of residual blocks (16, 32, 64 channels), a head."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    for stage, width in enumerate((16, 32, 64)):
      for block in range(3):
        stride = 2 if stage > 0 and block == 0 else 1
        y = nn.relu(nn.Conv(width, (3, 3), strides=stride)(x))
        y = nn.Conv(width, (3, 3))(y)
        if stride > 1 or x.shape[-1] != width:
          x = nn.Conv(width, (1, 1), strides=stride)(x)
        x = nn.relu(x + y)
    return nn.Dense(10)(x.mean(axis=(1, 2)))


class Block(nn.Module):
  heads: int = 4

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    h = nn.LayerNorm()(x)
    q, k, v = (nn.Dense(d)(h).reshape(*x.shape[:2], self.heads, -1) for _ in range(3))
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads))
    x = x + nn.Dense(d)(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape))
    h = nn.LayerNorm()(x)
    return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(h)))


class Transformer(nn.Module):
  """Four pre-norm blocks of width 128 over sequences of 32, and a 256-way head."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(128)(x)
    for _ in range(4):
      x = Block()(x)
    return nn.Dense(256)(nn.LayerNorm()(x))


MODELS = {
  "resnet": (ResNet(), (64, 32, 32, 3), 10),
  "transformer": (Transformer(), (32, 32, 64), 256),
}


def setup(name: str, fraction: str):
  model, shape, classes = MODELS[name]
  x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  y = np.random.default_rng(1).integers(
    0, classes, size=shape[: -1 if name == "transformer" else 1]
  )
  params = model.init(jax.random.key(0), x[:1])

  def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

  mesh = kaisa_jax.make_mesh(eval(fraction))
  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  local = shape[0] // mesh.size
  kfac = kaisa_jax.kfac(
    grad_fn.layers(params, x[:local], y[:local]),
    mesh=mesh,
    factor_update_steps=FACTOR_STEPS,
    inv_update_steps=INV_STEPS,
  )
  tx = optax.chain(kfac, optax.sgd(0.1, momentum=0.9))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  state = tx.init(params)
  specs = kaisa_jax.partition_specs(state)

  def step(params, state, x, y):
    _, grads, curvature = grad_fn(params, x, y)
    grads = jax.tree.map(lambda g: g / mesh.size, grads)
    updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state

  fn = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, BATCH, BATCH), out_specs=(P(), specs))
  )
  batch = [jax.device_put(a, NamedSharding(mesh, BATCH)) for a in (x, y)]
  compiled = fn.lower(params, state, *batch).compile()
  return kfac, state[0], compiled, mesh.size


def kib(n: float) -> str:
  return f"{n / 1024:9.1f}"


def main() -> None:
  phases = (
    communication.FACTOR_REDUCTION,
    communication.DECOMPOSITION_SHARING,
    communication.GRADIENT_SHARING,
  )
  print(
    f"{jax.device_count()} devices, cadence ({FACTOR_STEPS}, {INV_STEPS}); KiB per device; "
    "traffic per step amortised over the cadence, measured from HLO (model in brackets)"
  )
  for name in MODELS:
    print(f"\n== {name}")
    print(
      f"{'f':>4} | {'factors':>9} {'decomps':>9} | {'factor red.':>21} {'decomp. sharing':>21}"
      f" {'grad. sharing':>21} | {'K-FAC total':>11} | reference: {'factors':>9} {'decomps':>9}"
      f" {'traffic':>9}"
    )
    for fraction in FRACTIONS:
      kfac, state, compiled, n = setup(name, fraction)
      factors = state.factors.addressable_shards[0].data.nbytes
      decomps = state.decompositions.addressable_shards[0].data.nbytes
      measured = communication.per_step(
        accounting.hlo_collectives(compiled, n), FACTOR_STEPS, INV_STEPS
      )
      ours, reference = communication.communication_model(kfac.plan)
      model = ours.per_step(FACTOR_STEPS, INV_STEPS)
      ref_traffic = sum(reference.per_step(FACTOR_STEPS, INV_STEPS).values())
      cells = " ".join(f"{kib(measured[p])} ({kib(model[p]).strip():>7})" for p in phases)
      total = sum(measured[p] for p in phases)
      print(
        f"{fraction:>4} | {kib(factors)} {kib(decomps)} | {cells} | {kib(total):>11} |"
        f"            {kib(reference.factor_memory)} {kib(reference.decomposition_memory)}"
        f" {kib(ref_traffic)}"
      )
    plan = kfac.plan
    print(f"{len(plan.layers)} preconditioned layers; {str(plan).splitlines()[-1]}")
    print(
      f"data-parallel gradient all-reduce (not K-FAC's): {kib(measured[communication.OTHER])} KiB per step"
    )


if __name__ == "__main__":
  main()
