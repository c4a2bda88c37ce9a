"""The optimizers compared, each an Optax transformation built for one task."""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

import kaisa_jax


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """An optimizer configuration.

  Attributes:
    name: ``"sgd"`` (momentum 0.9), ``"adam"``, or ``"kfac"`` (K-FAC chained
      with SGD momentum 0.9).
    lr: peak learning rate; it decays to 0 on a cosine over the run.
    kfac: keyword arguments of `kaisa_jax.kfac` (K-FAC only).
  """

  name: str
  lr: float
  kfac: dict[str, Any] = dataclasses.field(default_factory=dict)

  def config(self) -> dict[str, Any]:
    return {"optimizer": self.name, "lr": self.lr, **self.kfac}


# Learning rates (and K-FAC damping) picked by the sweep in the README.
DEFAULTS = {
  "sgd": Optimizer("sgd", 0.1),
  "adam": Optimizer("adam", 3e-3),
  "kfac": Optimizer("kfac", 0.1, {"damping": 1e-2}),
}


def build(
  opt: Optimizer, steps: int, layers: kaisa_jax.Layers | None
) -> optax.GradientTransformationExtraArgs:
  schedule = optax.cosine_decay_schedule(opt.lr, steps)
  if opt.name == "sgd":
    return optax.sgd(schedule, momentum=0.9)
  if opt.name == "adam":
    return optax.adam(schedule)
  if opt.name == "kfac":
    kfac = kaisa_jax.kfac(layers, lr=schedule, **opt.kfac)
    return optax.chain(kfac, optax.sgd(schedule, momentum=0.9))
  raise ValueError(f"unknown optimizer {opt.name!r}; choose from {sorted(DEFAULTS)}")
