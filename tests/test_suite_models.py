"""Models written as a new user writes them: every layer captured, and K-FAC trains them.

The five digits models of the robustness suite (`experiments.suite`): a ViT, a
GRU and an LSTM under ``nn.RNN``, a ResNet with eleven BatchNorms and a Flax
NNX MLP. Each is traced as its loss calls it and trained a few steps with
K-FAC at its defaults, chained with the model's first-order optimizer, against
that optimizer alone from the same initialisation and batches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compiled_optimised

import kaisa_jax
from experiments import suite

STEPS = 40

LAYERS = {
  "vit": [
    "Conv_0",
    *(
      f"MultiHeadDotProductAttention_{i}/{p}"
      for i in (0, 1)
      for p in ("query", "key", "value", "out")
    ),
    *(f"Dense_{i}" for i in range(5)),
  ],
  "gru": [*(f"GRUCell_0/{g}" for g in ("ir", "hr", "iz", "hz", "in", "hn")), "Dense_0"],
  "lstm": [*(f"LSTMCell_0/{g}{s}" for s in "ifgo" for g in "ih"), "Dense_0"],
  "resnet_bn": [
    "Conv_0",
    *(f"Block2D_{b}/Conv_{c}" for b, n in enumerate((2, 3, 3, 2)) for c in range(n)),
    "Dense_0",
  ],
  "nnx_mlp": ["hidden", "middle", "out"],
}
# Modules with parameters that pass through, and the start of the reason why.
PASSED = {
  "vit": {
    "ViT": "parameter(s) cls, position created with self.param",
    **{f"LayerNorm_{i}": "normalisation layer" for i in range(5)},
  },
  "gru": {},
  "lstm": {},
  "resnet_bn": {
    "BatchNorm_0": "normalisation layer",
    **{
      f"Block2D_{b}/BatchNorm_{c}": "normalisation layer"
      for b, n in enumerate((2, 3, 3, 2))
      for c in range(n)
    },
  },
  "nnx_mlp": {},
}
# The learning rate each model's first-order optimizer was tuned to in benchmarks/robustness.py.
LR = {"vit": 3e-3, "gru": 0.3, "lstm": 0.9, "resnet_bn": 0.3, "nnx_mlp": 0.3}
# K-FAC's loss over the baseline's after `STEPS` steps must stay at most this. At the
# defaults (damping form "bounded") K-FAC is ahead this early on the GRU, the LSTM and the
# NNX MLP (measured 0.75, 0.60, 0.34), level on the ViT and behind on the ResNet (1.01 to
# 1.19 and 1.01 to 1.37 over three runs of the same training: one this short and at the
# baseline's rate amplifies the rounding, which differs between processes; with
# damping_form="pi", 0.87 to 0.91 and 0.58). After 300 steps at its own tuned rate it
# ends ahead of the baseline on all five (README, "On models it was not tuned on": ViT
# 0.76, ResNet 0.94); the bound holds K-FAC to what was measured here.
AT_MOST = {"vit": 1.3, "gru": 1.0, "lstm": 1.0, "resnet_bn": 1.5, "nnx_mlp": 1.0}
# Models whose runs take longer than an optimised compilation (tests/conftest.py `OPTIMISED`):
# with it the ResNet's test took 38.5 s against 83.5 s; the ViT's 36.6 s against 34.4 s (kept at 0).
RUN_LONG = {"resnet_bn"}


@pytest.fixture(scope="module", params=sorted(LAYERS))
def problem(request):
  return suite.SUITE[request.param]()


def test_every_layer_captured(problem):
  params, state = problem.init(jax.random.key(0))
  x, y = (jnp.asarray(a[:8]) for a in problem.train)
  layers = kaisa_jax.value_and_grad(problem.loss, has_aux=True).layers(params, state, x, y)
  assert sorted(s.name for s in layers.specs) == sorted(LAYERS[problem.name])
  passed = {s.name: s.reason for s in layers.skipped}
  assert sorted(passed) == sorted(PASSED[problem.name])
  for name, reason in passed.items():
    assert reason.startswith(PASSED[problem.name][name]), (name, reason)


def test_kfac_at_its_defaults_against_the_baseline(problem):
  params, state = problem.init(jax.random.key(0))
  order = suite.batch_order(len(problem.train[0]), problem.batch_size, STEPS, seed=0)
  lr = jnp.float32(LR[problem.name])
  args = (params, state, order, lr)
  prepare = compiled_optimised if problem.name in RUN_LONG else lambda fn, *a: fn
  baseline = np.asarray(prepare(suite.make_run(problem, None), *args)(*args)[0])
  kfac = np.asarray(prepare(suite.make_run(problem, {}), *args)(*args)[0])
  assert np.all(np.isfinite(kfac))
  assert kfac[-10:].mean() < 0.5 * kfac[:5].mean()
  assert kfac[-10:].mean() <= AT_MOST[problem.name] * baseline[-10:].mean()
