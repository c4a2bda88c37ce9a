"""The optimizers compared, each an Optax transformation built for one task.

Every optimizer's learning rate decays to 0 on a cosine over the run, and every
one is wrapped in ``optax.apply_if_finite``: a step with a NaN or Inf gradient
is skipped whole.

* ``sgd``: SGD with momentum 0.9.
* ``adam``: Adam (kept for the command line; ``adamw`` is the baseline).
* ``adamw``: AdamW, decoupled weight decay 1e-4.
* ``kfac``: `kaisa_jax.kfac` (factors every 10 steps, decompositions every 100,
  KL clip 1e-3) chained with SGD momentum 0.9.
* ``kfac_adamw``: the same K-FAC chained with AdamW (weight decay 1e-4).

`DEFAULTS` are used when no sweep has been run for a task; `GRID` is what
``python -m experiments sweep`` tries (the same number of trials for each).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import optax

import kaisa_jax

WEIGHT_DECAY = 1e-4
# Every optimizer skips a step whose gradient is not finite (the whole step, K-FAC's
# state included), as the quick start recommends; this many in a row let NaN through.
MAX_NONFINITE_STEPS = 5


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """An optimizer configuration.

  Attributes:
    name: ``"sgd"``, ``"adam"``, ``"adamw"``, ``"kfac"`` or ``"kfac_adamw"``.
    lr: peak learning rate; it decays to 0 on a cosine over the run.
    kfac: keyword arguments of `kaisa_jax.kfac` (K-FAC only), e.g. ``damping``.
  """

  name: str
  lr: float
  kfac: dict[str, Any] = dataclasses.field(default_factory=dict)

  def config(self) -> dict[str, Any]:
    """The settings as a flat dict (recorded with every result)."""
    extra = {"weight_decay": WEIGHT_DECAY} if self.name.endswith("adamw") else {}
    kfac = kfac_arguments(self.kfac) if is_kfac(self.name) else {}
    return {"optimizer": self.name, "lr": self.lr, **extra, **kfac}

  def settings(self) -> dict[str, Any]:
    """What a sweep chooses: ``lr`` and the K-FAC keyword arguments."""
    return {"lr": self.lr, **self.kfac}


def from_settings(name: str, settings: dict[str, Any]) -> Optimizer:
  """The optimizer ``name`` with ``{"lr": ..., **kfac_kwargs}``."""
  rest = {k: v for k, v in settings.items() if k != "lr"}
  return Optimizer(name, settings["lr"], rest)


# The experiments' K-FAC damps as the KAISA reference does: their sweeps, tables
# and targets were measured with it (the library's default form came later, from
# benchmarks/robustness.py). A setting may name another form.
DAMPING_FORM = "kaisa"


def kfac_arguments(settings: dict[str, Any]) -> dict[str, Any]:
  """`kaisa_jax.kfac`'s keyword arguments for a K-FAC setting: `DAMPING_FORM` unless it names one."""
  return {"damping_form": DAMPING_FORM, **settings}


# Learning rates (and K-FAC damping) from the MNIST-1D sweep (docs/benchmarks/experiments.md).
DEFAULTS: dict[str, Optimizer] = {
  "sgd": Optimizer("sgd", 0.1),
  "adam": Optimizer("adam", 3e-3),
  "adamw": Optimizer("adamw", 3e-3),
  "kfac": Optimizer("kfac", 0.1, {"damping": 1e-2}),
  "kfac_adamw": Optimizer("kfac_adamw", 3e-3, {"damping": 1e-2}),
}

# The sweep: four trials per optimizer. Learning rate for the first-order ones,
# learning rate x damping (2 x 2) for each K-FAC.
GRID: dict[str, list[dict[str, Any]]] = {
  "sgd": [{"lr": lr} for lr in (0.01, 0.03, 0.1, 0.3)],
  "adam": [{"lr": lr} for lr in (3e-4, 1e-3, 3e-3, 1e-2)],
  "adamw": [{"lr": lr} for lr in (3e-4, 1e-3, 3e-3, 1e-2)],
  "kfac": [{"lr": lr, "damping": d} for lr in (0.03, 0.1) for d in (1e-2, 1e-1)],
  "kfac_adamw": [{"lr": lr, "damping": d} for lr in (1e-3, 3e-3) for d in (1e-2, 1e-1)],
}


# Each K-FAC optimizer and the first-order optimizer it is chained with.
KFAC_THEN = {"kfac": "sgd", "kfac_adamw": "adamw"}


def is_kfac(name: str) -> bool:
  """Whether the optimizer ``name`` preconditions with K-FAC (``kfac``, ``kfac_adamw``)."""
  return name in KFAC_THEN


def load_best(path: Path) -> dict[str, dict[str, Any]]:
  """The settings a sweep chose, by optimizer name (empty if ``path`` does not exist)."""
  if not path.exists():
    return {}
  return json.loads(path.read_text())["best"]


def choose(name: str, best: dict[str, dict[str, Any]]) -> tuple[Optimizer, str]:
  """The optimizer ``name`` with the sweep's settings if any, else the default; and which."""
  if name in best:
    return from_settings(name, best[name]), "sweep"
  return DEFAULTS[name], "default"


def kfac_transform(opt: Optimizer, steps: int, layers: kaisa_jax.Layers) -> kaisa_jax.KFAC:
  """The K-FAC part of a K-FAC optimizer, as `build` makes it (its plan and damping)."""
  schedule = optax.cosine_decay_schedule(opt.lr, steps)
  return kaisa_jax.kfac(layers, lr=schedule, **kfac_arguments(opt.kfac))


def build(
  opt: Optimizer, steps: int, layers: kaisa_jax.Layers | None
) -> optax.GradientTransformationExtraArgs:
  """The Optax transformation; ``layers`` (from ``grad_fn.layers``) is needed for K-FAC."""
  schedule = optax.cosine_decay_schedule(opt.lr, steps)
  first_order = {
    "sgd": lambda: optax.sgd(schedule, momentum=0.9),
    "adam": lambda: optax.adam(schedule),
    "adamw": lambda: optax.adamw(schedule, weight_decay=WEIGHT_DECAY),
  }
  if opt.name in first_order:
    tx = first_order[opt.name]()
  elif is_kfac(opt.name):
    then = first_order[KFAC_THEN[opt.name]]()
    tx = optax.chain(kfac_transform(opt, steps, layers), then)
  else:
    raise ValueError(f"unknown optimizer {opt.name!r}; choose from {sorted(DEFAULTS)}")
  return optax.apply_if_finite(tx, MAX_NONFINITE_STEPS)
