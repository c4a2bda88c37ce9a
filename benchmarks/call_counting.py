"""Layers applied several times per step: K-FAC+SGD against SGD on scikit-learn's digits.

Each 8x8 digit is a sequence of 8 rows (time steps) of 8 pixels. Three
classifiers whose weights are used once per step of a loop:

* ``gru``: ``nn.RNN(nn.GRUCell(32))``, its last output into ``nn.Dense(10)``;
* ``lstm``: the same with ``nn.LSTMCell(32)``;
* ``loop``: the flattened image into ``nn.Dense(32)``, then one
  ``nn.Dense(32)`` applied 4 times in a Python loop (tanh between), then
  ``nn.Dense(10)``.

Each trains for 300 steps of batch 128 (batches drawn with seed 0, the same for
every optimizer; parameters from seed 0) with
``optax.chain(kaisa_jax.kfac(layers, lr=lr, damping=d), optax.sgd(lr, momentum=0.9))``
(every other `kaisa_jax.kfac` setting at its default, unless ``--cadence``
gives ``factor_update_steps`` and ``inv_update_steps``) for each damping, and with
``optax.sgd(lr, momentum=0.9)`` alone. It prints the final training loss: the
mean of the last 10 steps' batch losses.

Run: ``python benchmarks/call_counting.py [--lr 0.1] [--steps 300] [--cadence 1 10]
[--models gru lstm loop]``
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import kaisa_jax

BATCH, HIDDEN, CLASSES, LOOP_CALLS, LAST = 128, 32, 10, 4, 10
DAMPINGS = (1e-3, 1e-2)


class Recurrent(nn.Module):
  """A recurrent cell over the 8 rows; its last output is classified."""

  cell: type[nn.RNNCellBase]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.RNN(self.cell(HIDDEN))(x)
    return nn.Dense(CLASSES)(h[:, -1])


class Loop(nn.Module):
  """One ``nn.Dense`` applied ``LOOP_CALLS`` times in a Python loop."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.tanh(nn.Dense(HIDDEN)(x.reshape(x.shape[0], -1)))
    shared = nn.Dense(HIDDEN)
    for _ in range(LOOP_CALLS):
      h = nn.tanh(shared(h))
    return nn.Dense(CLASSES)(h)


MODELS = {"gru": Recurrent(nn.GRUCell), "lstm": Recurrent(nn.LSTMCell), "loop": Loop()}


def digits() -> tuple[np.ndarray, np.ndarray]:
  """Images as ``(examples, 8 steps, 8 pixels)`` in ``[0, 1]``, and their labels."""
  x, y = load_digits(return_X_y=True)
  return (x / 16.0).reshape(-1, 8, 8).astype(np.float32), y.astype(np.int32)


def train(
  model: nn.Module, damping: float | None, lr: float, steps: int, cadence: dict[str, int]
) -> float:
  """The mean batch loss of the last ``LAST`` steps; ``damping=None`` trains with SGD alone."""
  x, y = digits()
  params = model.init(jax.random.key(0), x[:1])

  def loss_fn(params, xb, yb):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, xb), yb).mean()

  grad_fn = kaisa_jax.value_and_grad(loss_fn)
  sgd = optax.sgd(lr, momentum=0.9)
  if damping is None:
    tx = sgd
  else:
    layers = grad_fn.layers(params, x[:BATCH], y[:BATCH])
    # The KL clip of the KAISA reference, the default when the study was run.
    rule = {"step_norm": "natural", "kl_clip": 1e-3, "lr": lr}
    tx = optax.chain(kaisa_jax.kfac(layers, damping=damping, **rule, **cadence), sgd)

  @jax.jit
  def step(params, state, xb, yb):
    if damping is None:
      loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
      updates, state = tx.update(grads, state, params)
    else:
      loss, grads, curvature = grad_fn(params, xb, yb)
      updates, state = tx.update(grads, state, params, curvature=curvature)
    return optax.apply_updates(params, updates), state, loss

  state = tx.init(params)
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(steps):
    batch = rng.choice(len(x), BATCH, replace=False)
    params, state, loss = step(params, state, jnp.asarray(x[batch]), jnp.asarray(y[batch]))
    losses.append(loss)
  return float(np.mean(jax.device_get(losses[-LAST:])))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
  parser.add_argument(
    "--cadence",
    nargs=2,
    type=int,
    metavar=("FACTOR_STEPS", "INV_STEPS"),
    help="factor_update_steps and inv_update_steps (default: kfac's defaults)",
  )
  parser.add_argument("--sgd-only", action="store_true", help="only the SGD column")
  args = parser.parse_args()
  cadence = (
    dict(zip(("factor_update_steps", "inv_update_steps"), args.cadence, strict=True))
    if args.cadence
    else {}
  )
  runs = [None] if args.sgd_only else [*DAMPINGS, None]
  names = ["SGD" if d is None else f"K-FAC d={d:g}" for d in runs]
  print(
    f"final training loss (mean of the last {LAST} steps), lr={args.lr}, {args.steps} steps, "
    f"cadence {cadence or 'default'}"
  )
  print(f"{'model':<6} " + " ".join(f"{n:>14}" for n in names))
  for name in args.models:
    start = time.perf_counter()
    losses = [train(MODELS[name], d, args.lr, args.steps, cadence) for d in runs]
    row = " ".join(f"{v:>14.4f}" for v in losses)
    print(f"{name:<6} {row}   ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
