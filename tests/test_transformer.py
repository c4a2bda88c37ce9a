"""A 2-block character transformer on Python's own source trains with K-FAC everywhere it can.

The model and the data are the experiments' ``charlm`` task: token and position
embeddings (the token embedding tied to the output), two pre-norm blocks under
``nn.scan``, windows of standard-library source.
"""

import jax
import numpy as np
import optax
from conftest import compiled_optimised

import kaisa_jax
from experiments import tasks

LENGTH, WIDTH, BATCH, STEPS = 32, 48, 16, 200
VOCAB = len(tasks.CHARS) + 1


def test_character_transformer_trains_below_unigram_baseline():
  (x, y), (x_valid, y_valid) = tasks.text_data(LENGTH)
  model = tasks.CharTransformer(VOCAB, LENGTH, WIDTH)
  params = model.init(jax.random.key(0), x[:BATCH])

  def loss_fn(params, xb, yb):  # mean over every token of the batch
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, xb), yb).mean()

  # The loss averages over tokens: n is the number of tokens in a batch.
  grad_fn = kaisa_jax.value_and_grad(loss_fn, n_examples=BATCH * LENGTH)
  layers = grad_fn.layers(params, x[:BATCH], y[:BATCH])
  kinds = {s.kind for s in layers.specs}
  assert kinds == {"embed", "dense", "dense_general"}, kinds
  assert len(layers.specs) == 2 + 2 * (4 + 2)  # embeddings; per block 4 projections, 2 dense
  assert {k.module_type for k in layers.skipped} == {"LayerNorm"}

  lr = 0.05
  kfac = kaisa_jax.kfac(layers, damping=1e-2, factor_update_steps=5, inv_update_steps=25)
  tx = optax.chain(kfac, optax.sgd(lr, momentum=0.9))

  @jax.jit
  def step(params, opt_state, xb, yb):
    loss, grads, curvature = grad_fn(params, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params, curvature=curvature)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  step = compiled_optimised(step, params, opt_state, x[:BATCH], y[:BATCH])  # 200 steps to run
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(STEPS):
    batch = rng.integers(0, len(x), BATCH)
    params, opt_state, loss = step(params, opt_state, x[batch], y[batch])
    losses.append(float(loss))
  assert np.all(np.isfinite(losses))
  assert int(opt_state[0].skipped_factor_updates) == 0
  assert int(opt_state[0].failed_decompositions) == 0

  frequencies = np.bincount(y.ravel(), minlength=VOCAB) + 1.0
  frequencies /= frequencies.sum()
  unigram = -np.mean(np.log(frequencies[y_valid]))
  valid_loss = float(jax.jit(loss_fn)(params, x_valid, y_valid))
  print(f"unigram {unigram:.3f} nats, validation {valid_loss:.3f} after {STEPS} steps")
  # Measured: 2.33 nats on the 1600 held-out windows against the unigram model's 3.10.
  assert valid_loss < 0.8 * unigram, (valid_loss, unigram)
