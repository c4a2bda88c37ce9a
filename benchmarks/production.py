"""ResNet-50 and BERT at their real shapes, on synthetic data: what K-FAC costs at production size.

The models are the published architectures in Flax linen: ResNet-50 (He et al. 2016; bottleneck
blocks 3-4-6-3, BatchNorm, 224 x 224 x 3 images, 1000 classes) and BERT (Devlin et al. 2019;
post-norm encoder, token, position and segment embeddings, a masked-language-model head whose
decoder is the token embedding, tied). Their data are random inputs at the real shapes with random
labels; a fixed batch is enough for what is measured here:

* the plan: every layer captured, its factor shapes and treatment;
* the compile time of the jitted train step (trace and lower, then compile), K-FAC against SGD;
* the step time by phase: one compiled K-FAC step is timed step by step over whole cadence
  cycles, and its steps split into those that only precondition, those that also update the
  factors and those that also decompose them; their medians give the mean step at any cadence,
  ``plain + (factors - plain) / factor_update_steps + (decomposition - factors) / inv_update_steps``,
  against SGD's step and against the ratio of their flops;
* the decomposition phase alone: each distinct factor size decomposed by itself (``eigh``, and
  the Cholesky inverse), and each stack of the plan decomposed as the step does it (one batched
  call per stack);
* how a grad worker fraction spreads the decompositions over devices (the busiest device's share
  of the total);
* whether ten K-FAC steps lower the loss on the fixed batch.

`benchmarks/gpu_check.py` runs these at batch 32 on one GPU, or at a small batch on this machine.
``python benchmarks/production.py [--batch 32] [--publish]`` prints each model's plan (``--publish``
writes ``benchmarks/results/production_plans.json`` and the block ``production plans`` of
``docs/benchmarks/production.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kaisa_jax
from kaisa_jax import phases, planning, preconditioning


class Bottleneck(nn.Module):
  """ResNet's bottleneck block: 1x1, 3x3 (strided), 1x1 at 4x the width, BatchNorm after each."""

  width: int
  strides: int

  @nn.compact
  def __call__(self, x, train: bool):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    y = nn.relu(norm()(nn.Conv(self.width, (1, 1), use_bias=False)(x)))
    y = nn.Conv(self.width, (3, 3), self.strides, padding=((1, 1), (1, 1)), use_bias=False)(y)
    y = nn.relu(norm()(y))
    y = norm(scale_init=nn.initializers.zeros)(nn.Conv(4 * self.width, (1, 1), use_bias=False)(y))
    if self.strides != 1 or x.shape[-1] != 4 * self.width:
      x = norm()(nn.Conv(4 * self.width, (1, 1), self.strides, use_bias=False)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """A bottleneck ResNet: a 7x7 stem, ``stages`` blocks per stage, average pooling, a classifier.

  ResNet-50 is ``stages=(3, 4, 6, 3)``, ``width=64``, 1000 classes.
  """

  stages: tuple[int, ...]
  width: int
  classes: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(self.width, (7, 7), 2, padding=((3, 3), (3, 3)), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
    for i, blocks in enumerate(self.stages):
      for j in range(blocks):
        x = Bottleneck(self.width * 2**i, 2 if i > 0 and j == 0 else 1)(x, train)
    return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


class EncoderBlock(nn.Module):
  """BERT's post-norm block: self-attention, then a GELU MLP, each added and normalised."""

  heads: int
  mlp: int

  @nn.compact
  def __call__(self, h):
    h = nn.LayerNorm(epsilon=1e-12)(h + nn.MultiHeadDotProductAttention(self.heads)(h))
    mlp = nn.Dense(h.shape[-1])(nn.gelu(nn.Dense(self.mlp)(h)))
    return nn.LayerNorm(epsilon=1e-12)(h + mlp)


class Bert(nn.Module):
  """BERT's encoder and masked-language-model head, the decoder tied to the token embedding.

  BERT-Base: ``depth=12, width=768, heads=12, mlp=3072``; BERT-Large: ``24, 1024, 16, 4096``;
  both with a vocabulary of 30522 and 512 positions (128 used here, as in pre-training's phase 1).
  """

  vocab: int
  positions: int
  depth: int
  width: int
  heads: int
  mlp: int

  @nn.compact
  def __call__(self, ids):
    tokens = nn.Embed(self.vocab, self.width)
    where = jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)
    h = tokens(ids) + nn.Embed(self.positions, self.width)(where)
    h = nn.LayerNorm(epsilon=1e-12)(h + nn.Embed(2, self.width)(jnp.zeros_like(ids)))
    for _ in range(self.depth):
      h = EncoderBlock(self.heads, self.mlp)(h)
    h = nn.LayerNorm(epsilon=1e-12)(nn.gelu(nn.Dense(self.width)(h)))
    return tokens.attend(h) + self.param("decoder_bias", nn.initializers.zeros, (self.vocab,))


@dataclasses.dataclass(frozen=True)
class Shape:
  """A model at one size, with the shape of one example and the number of classes."""

  label: str
  model: nn.Module
  example: tuple[int, ...]  # one input's shape
  classes: int
  tokens: bool  # integer ids (a language model) rather than images

  @property
  def batch_norm(self) -> bool:
    return not self.tokens


SHAPES = {
  "resnet50": Shape(
    "ResNet-50, 224x224x3, 1000 classes", ResNet((3, 4, 6, 3), 64, 1000), (224, 224, 3), 1000, False
  ),
  "bert_base": Shape(
    "BERT-Base, sequence 128, vocabulary 30522",
    Bert(30522, 512, 12, 768, 12, 3072),
    (128,),
    30522,
    True,
  ),
  "bert_large": Shape(
    "BERT-Large, sequence 128, vocabulary 30522",
    Bert(30522, 512, 24, 1024, 16, 4096),
    (128,),
    30522,
    True,
  ),
  # The same architectures at toy sizes, for the tests.
  "tiny_resnet": Shape("tiny ResNet, 32x32x3", ResNet((1, 1, 1, 1), 4, 10), (32, 32, 3), 10, False),
  "tiny_bert": Shape("tiny BERT, sequence 16", Bert(64, 16, 2, 16, 2, 32), (16,), 64, True),
}


@dataclasses.dataclass(frozen=True)
class Setup:
  """A model's parameters, state (BatchNorm's statistics), fixed batch and loss."""

  shape: Shape
  params: Any
  state: Any
  batch: tuple[jax.Array, jax.Array]

  def loss(self, params: Any, state: Any, batch: tuple[jax.Array, jax.Array]) -> tuple[Any, Any]:
    """Mean cross-entropy over the examples (over every token, for BERT), and the new state."""
    x, y = batch
    variables = {"params": params, **state}
    if self.shape.batch_norm:
      logits, state = self.shape.model.apply(variables, x, train=True, mutable=["batch_stats"])
    else:
      logits = self.shape.model.apply(variables, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state

  @property
  def terms(self) -> int | None:
    """`kaisa_jax.value_and_grad`'s ``n_examples``: BERT's loss is a mean over tokens."""
    return int(np.prod(self.batch[1].shape)) if self.shape.tokens else None


def setup(name: str, batch: int, seed: int = 0) -> Setup:
  """Initialises ``SHAPES[name]`` and draws a fixed random batch of ``batch`` examples."""
  shape = SHAPES[name]
  kx, ky, kp = jax.random.split(jax.random.key(seed), 3)
  if shape.tokens:
    x = jax.random.randint(kx, (batch, *shape.example), 0, shape.classes)
    y = jax.random.randint(ky, (batch, *shape.example), 0, shape.classes)
  else:
    x = jax.random.normal(kx, (batch, *shape.example))
    y = jax.random.randint(ky, (batch,), 0, shape.classes)
  variables = dict(jax.jit(shape.model.init)(kp, x[:1]))
  params = variables.pop("params")
  return Setup(shape, params, variables, (x, y))


def sgd_step(s: Setup, lr: float = 0.01) -> tuple[Callable, tuple]:
  """The jitted SGD (momentum 0.9) step and its initial carry ``(params, state, opt_state)``."""
  tx = optax.sgd(lr, momentum=0.9)

  def step(params, state, opt_state, batch):
    (loss, state), grads = jax.value_and_grad(s.loss, has_aux=True)(params, state, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), state, opt_state, loss

  return step, (s.params, s.state, tx.init(s.params))


def grad_fn(s: Setup) -> kaisa_jax.ValueAndGrad:
  """The loss wrapped by `kaisa_jax.value_and_grad` (the state as its aux)."""
  return kaisa_jax.value_and_grad(s.loss, has_aux=True, n_examples=s.terms)


def kfac_step(
  s: Setup, cadence: tuple[int, int], lr: float = 0.01, **kfac_args: Any
) -> tuple[Callable, tuple, kaisa_jax.KFAC]:
  """K-FAC chained with the same SGD: the step, its initial carry and the `kaisa_jax.kfac`."""
  grads = grad_fn(s)
  layers = grads.layers(s.params, s.state, s.batch)
  kfac = kaisa_jax.kfac(
    layers, factor_update_steps=cadence[0], inv_update_steps=cadence[1], **kfac_args
  )
  tx = optax.chain(kfac, optax.sgd(lr, momentum=0.9))

  def step(params, state, opt_state, batch):
    (loss, state), g, curvature = grads(params, state, batch)
    updates, opt_state = tx.update(g, opt_state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state, opt_state, loss

  return step, (s.params, s.state, tx.init(s.params)), kfac


def memory_bytes(compiled: Any) -> float:
  """Bytes a compiled step holds while it runs: its arguments, outputs and temporaries.

  Donated arguments alias their outputs and are counted once.
  """
  m = compiled.memory_analysis()
  return float(
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )


def _copy(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def step_seconds(compiled: Any, carry: tuple, batch: Any, steps: int) -> tuple[list[float], list]:
  """Each of ``steps`` calls timed alone (waiting for its result), and the losses."""
  carry = _copy(carry)  # the step donates its carry
  seconds, losses = [], []
  for _ in range(steps):
    start = time.perf_counter()
    *carry, loss = jax.block_until_ready(compiled(*carry, batch))
    seconds.append(time.perf_counter() - start)
    losses.append(float(loss))
  return seconds, losses


def phase_seconds(seconds: list[float], cadence: tuple[int, int]) -> dict[str, float]:
  """Median seconds of the steps that only precondition, that update factors, that decompose.

  Step ``k`` (from 0) updates the factors when ``k % factor_update_steps == 0`` and decomposes
  them when ``k % inv_update_steps == 0``; step 0 also compiles nothing (the step is compiled
  ahead) but is the first to touch the buffers, so each kind's median is taken over its later
  steps where there are some.
  """
  fus, ivs = cadence
  kinds: dict[str, list[float]] = {"plain": [], "factors": [], "decomposition": []}
  for k, t in enumerate(seconds):
    kind = "decomposition" if k % ivs == 0 else "factors" if k % fus == 0 else "plain"
    kinds[kind].append(t)
  return {
    kind: statistics.median(ts[1:] if len(ts) > 1 else ts) for kind, ts in kinds.items() if ts
  }


def amortised(phases: dict[str, float], cadence: tuple[int, int]) -> float:
  """The mean step at ``cadence`` from the phases' step times (`phase_seconds`)."""
  fus, ivs = cadence
  plain = phases["plain"]
  factors = phases.get("factors", plain)
  return plain + (factors - plain) / fus + (phases["decomposition"] - factors) / ivs


def _timed(fn: Callable, *args: Any, repeats: int, **kwargs: Any) -> float:
  """Median seconds of ``fn(*args, **kwargs)`` over ``repeats`` calls, after one to compile."""
  jax.block_until_ready(fn(*args, **kwargs))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args, **kwargs))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _spd(n: int, members: int = 0, seed: int = 0) -> jax.Array:
  """A well-conditioned symmetric positive definite matrix (a stack of ``members``, if any)."""
  x = jax.random.normal(jax.random.key(seed), (max(members, 1), n, 2 * n), jnp.float32)
  a = x @ jnp.swapaxes(x, -1, -2) / (2 * n) + 1e-3 * jnp.eye(n)
  return a if members else a[0]


def decomposition_seconds(sizes: list[int], repeats: int = 3) -> list[dict[str, float]]:
  """Seconds of one ``eigh`` and one Cholesky inverse of each factor size, as K-FAC calls them."""
  damping = jnp.float32(1e-3)
  rows = []
  for n in sorted(set(sizes)):
    a = _spd(n, 1)
    row: dict[str, float] = {"size": n}
    for method in (preconditioning.EIGEN, preconditioning.INVERSE):
      fn = jax.jit(functools.partial(preconditioning.decompose, method=method, diagonal=False))
      row[method] = _timed(fn, a, damping=damping, repeats=repeats)
    rows.append(row)
    del a
  return rows


def batch_seconds(kfac: kaisa_jax.KFAC, repeats: int = 3) -> list[dict[str, Any]]:
  """Seconds of the plan's decompositions as the step runs them on one device.

  On a GPU the step decomposes the dense factors of one size and method together, whatever their
  stacks (`kaisa_jax.phases`): one batched call for each, of every matrix of that size (layers
  times groups). On the CPU it decomposes them one matrix at a time in a loop, as the batched
  call below does there (`kaisa_jax.cpu_loop.each_matrix`).
  """
  plan = kfac.plan
  damping = jnp.float32(1e-3)
  stacks = plan.layout.stacks(0, 0)  # one device: it owns every stack
  matrices = {
    (method, dim): sum(len(stacks[i]) * plan.layers[stacks[i][0]][0].groups for i, _ in sides)
    for (method, diagonal, dim), sides in phases.decomposition_batches(plan, stacks).items()
    if not diagonal
  }
  rows = []
  for (method, dim), count in sorted(matrices.items(), key=lambda item: item[0][::-1]):
    fn = jax.jit(functools.partial(preconditioning.decompose, method=method, diagonal=False))
    x = _spd(dim, count)
    seconds = _timed(fn, x, damping=jnp.full((count,), damping), repeats=repeats)
    rows.append({"size": dim, "matrices": count, "method": method, "seconds": seconds})
    del x
  return rows


def factor_sizes(kfac: kaisa_jax.KFAC) -> list[int]:
  """The sizes of the dense (not diagonal) factors of the plan."""
  return [
    dim
    for spec, t in kfac.plan.layers
    for dim, diagonal in zip((spec.a_dim, spec.g_dim), t.diagonal, strict=True)
    if not diagonal
  ]


def spread(kfac: kaisa_jax.KFAC, devices: int) -> list[dict[str, Any]]:
  """Per grad worker fraction on ``devices``: the busiest device's share of the decompositions."""
  rows = []
  for workers in (w for w in range(1, devices + 1) if devices % w == 0):
    layout = planning.layout_for(kfac.plan, devices, workers / devices)
    dec, pre = planning.busiest_shares(kfac.plan, layout)
    fraction = f"{workers}/{devices}"
    rows.append({"fraction": fraction, "decomposition_share": dec, "preconditioning_share": pre})
  return rows


PLANS = "production_plans.json"  # under benchmarks/results/


def plans(names: list[str], batch: int) -> dict[str, Any]:
  """Each model's K-FAC plan on one device at ``batch``: every layer, its factors and treatment."""
  out = {}
  for name in names:
    s = setup(name, batch)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # the skipped modules are listed in the plan itself
      _, _, kfac = kfac_step(s, (10, 100))
    out[name] = {"label": s.shape.label, "batch": batch, "plan": str(kfac.plan)}
  return {"provenance": f"python benchmarks/production.py --batch {batch} --publish", **out}


def render_plans(results: dict[str, Any]) -> str:
  """The plans as text, one fenced block per model."""
  parts = []
  for name, r in results.items():
    if name == "provenance":
      continue
    parts += [
      f"**{r['label']}**, batch {r['batch']} on one device:",
      "",
      "```text",
      r["plan"],
      "```",
      "",
    ]
  return "\n".join(parts).rstrip()


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description="K-FAC's plan of each production-shaped model")
  parser.add_argument("--models", nargs="+", default=["resnet50", "bert_base"])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--publish", action="store_true", help=f"write results/{PLANS} and the page")
  args = parser.parse_args(argv)
  results = plans(args.models, args.batch)
  print(render_plans(results))
  if args.publish:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import generated

    for path in generated.publish(PLANS, results):
      print(f"written: {path}")


if __name__ == "__main__":
  main()
