"""The optimizers compared, each an Optax transformation built for one task.

Every optimizer's learning rate decays to 0 on a cosine over the run (`schedule`),
after a linear warmup from 0 over a fraction of the run where its ``warmup`` asks
for one, and every one is wrapped in ``optax.apply_if_finite``: a step with a NaN
or Inf gradient is skipped whole. A first-order optimizer may clip the gradient
to a global norm first (``clip``); a K-FAC optimizer may not (`Optimizer`), and
through a warmup its KL clip is sized at the peak rate (`kl_clip_schedule`).

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


# Each K-FAC optimizer and the first-order optimizer it is chained with.
KFAC_THEN = {"kfac": "sgd", "kfac_adamw": "adamw"}


def is_kfac(name: str) -> bool:
  """Whether the optimizer ``name`` preconditions with K-FAC (``kfac``, ``kfac_adamw``)."""
  return name in KFAC_THEN


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """An optimizer configuration.

  Attributes:
    name: ``"sgd"``, ``"adam"``, ``"adamw"``, ``"kfac"`` or ``"kfac_adamw"``.
    lr: peak learning rate; it decays to 0 on a cosine over the run.
    kfac: keyword arguments of `kaisa_jax.kfac` (K-FAC only), e.g. ``damping``.
    warmup: the fraction of the run's steps spent in a linear warmup from 0 to
      ``lr`` before the cosine decay (`schedule`); 0, no warmup.
    clip: the global norm the gradient is clipped to before a first-order
      optimizer (``optax.clip_by_global_norm``); None, no clip. Refused for
      K-FAC: its KL clip bounds its step, and a clip between K-FAC and the
      optimizer it is chained with would undo the preconditioning's scale.

  Raises:
    ValueError: ``warmup`` outside [0, 1), ``clip`` not positive, or a ``clip``
      for a K-FAC optimizer.
  """

  name: str
  lr: float
  kfac: dict[str, Any] = dataclasses.field(default_factory=dict)
  warmup: float = 0.0
  clip: float | None = None

  def __post_init__(self) -> None:
    if not 0.0 <= self.warmup < 1.0:
      raise ValueError(f"{self.name}: warmup {self.warmup} is not a fraction of the run in [0, 1)")
    if self.clip is None:
      return
    if is_kfac(self.name):
      raise ValueError(
        f"{self.name}: no gradient clip (clip={self.clip}) for a K-FAC optimizer: its KL clip "
        f"bounds the step, and a clip between K-FAC and {KFAC_THEN[self.name]} would undo the "
        "preconditioning's scale"
      )
    if not self.clip > 0:
      raise ValueError(f"{self.name}: clip {self.clip} is not a positive global norm")

  def config(self) -> dict[str, Any]:
    """The settings as a flat dict (recorded with every result)."""
    extra = {"weight_decay": WEIGHT_DECAY} if self.name.endswith("adamw") else {}
    # The step rule (`STEP_RULE`) is left out: every experiment runs with it, and the runs
    # recorded before it was named (which ``--resume`` matches by their config) hold none.
    kfac = {"damping_form": DAMPING_FORM, **self.kfac} if is_kfac(self.name) else {}
    stabilisers = {"warmup": self.warmup, "clip": self.clip}
    return {"optimizer": self.name, "lr": self.lr, **extra, **stabilisers, **kfac}

  def settings(self) -> dict[str, Any]:
    """What a sweep chooses: ``lr``, ``warmup`` and ``clip`` when set, the K-FAC keyword arguments.

    `from_settings` takes it back.
    """
    stabilisers = {"warmup": self.warmup} if self.warmup else {}
    stabilisers |= {} if self.clip is None else {"clip": self.clip}
    return {"lr": self.lr, **stabilisers, **self.kfac}


# The settings of `Optimizer` that are not keyword arguments of `kaisa_jax.kfac`.
OWN_SETTINGS = ("lr", "warmup", "clip")


def from_settings(name: str, settings: dict[str, Any]) -> Optimizer:
  """The optimizer ``name`` with ``{"lr": ..., "warmup": ..., "clip": ..., **kfac_kwargs}``.

  ``warmup`` and ``clip`` are optional (no warmup, no clip).
  """
  rest = {k: v for k, v in settings.items() if k not in OWN_SETTINGS}
  return Optimizer(name, settings["lr"], rest, settings.get("warmup", 0.0), settings.get("clip"))


# The experiments' K-FAC damps as the KAISA reference does: their sweeps, tables
# and targets were measured with it (the library's default form came later, from
# benchmarks/robustness.py). A setting may name another form.
DAMPING_FORM = "kaisa"


# The step rule the experiments were tuned and run with: K-FAC's own step under the KAISA
# reference's KL clip (the library's default until it gave the step the gradient's norm).
STEP_RULE = {"step_norm": "natural", "kl_clip": 1e-3}


def kfac_arguments(settings: dict[str, Any]) -> dict[str, Any]:
  """`kaisa_jax.kfac`'s keyword arguments for a K-FAC setting: `DAMPING_FORM` and `STEP_RULE`
  unless it names others."""
  return {"damping_form": DAMPING_FORM, **STEP_RULE, **settings}


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


def warmup_steps(opt: Optimizer, steps: int) -> int:
  """The steps of ``opt``'s warmup in a run of ``steps``: 0 without one.

  With one, ``warmup * steps`` rounded, at least 1 (the rate starts at 0) and
  at most ``steps - 1`` (the decay has a step).
  """
  if opt.warmup == 0:
    return 0
  return max(1, min(round(opt.warmup * steps), steps - 1))


def schedule(opt: Optimizer, steps: int) -> optax.Schedule:
  """``opt``'s learning rate over a run of ``steps``.

  A linear warmup from 0 to ``opt.lr`` over `warmup_steps`, then a cosine
  decay to 0 over the rest; without a warmup (``warmup`` 0, or a run of one
  step), the cosine decay over the whole run.
  """
  warmup = warmup_steps(opt, steps)
  if warmup == 0:
    return optax.cosine_decay_schedule(opt.lr, steps)
  # optax.warmup_cosine_decay_schedule(0.0, opt.lr, warmup, steps), which reads the peak in
  # Python: here it may be traced (`experiments.train.programs`).
  rise = optax.linear_schedule(0.0, opt.lr, warmup)
  return optax.join_schedules([rise, optax.cosine_decay_schedule(opt.lr, steps - warmup)], [warmup])


def kl_clip_schedule(opt: Optimizer, steps: int) -> optax.Schedule:
  """The learning rate K-FAC's KL clip is told: `schedule`, but the peak rate during a warmup.

  While the KL clip binds, K-FAC's step no longer depends on the rate it is
  told (``lr * nu`` is fixed), and at a rate of 0 it does not clip at all; told
  a warmup, K-FAC would take full steps through it and hand an unclipped first
  preconditioned gradient to the chained optimizer's momentum, which the rising
  rate then applies (on MNIST-1D a loss of 2.4 jumped to 32 and the run never
  recovered). Told the peak, the clip bounds every step as it will at the end
  of the warmup, and the warmup shrinks it. After the warmup, the same rate as
  the chained optimizer's; without one, `schedule` itself.
  """
  warmup = warmup_steps(opt, steps)
  if warmup == 0:
    return schedule(opt, steps)
  peak = optax.constant_schedule(opt.lr)
  return optax.join_schedules([peak, optax.cosine_decay_schedule(opt.lr, steps - warmup)], [warmup])


def kfac_transform(opt: Optimizer, steps: int, layers: kaisa_jax.Layers) -> kaisa_jax.KFAC:
  """The K-FAC part of a K-FAC optimizer, as `build` makes it (its plan, damping and KL clip)."""
  return kaisa_jax.kfac(layers, lr=kl_clip_schedule(opt, steps), **kfac_arguments(opt.kfac))


def build(
  opt: Optimizer, steps: int, layers: kaisa_jax.Layers | None
) -> optax.GradientTransformationExtraArgs:
  """The Optax transformation; ``layers`` (from ``grad_fn.layers``) is needed for K-FAC.

  A ``clip`` clips the gradient before the first-order optimizer.
  """
  lr = schedule(opt, steps)
  first_order = {
    "sgd": lambda: optax.sgd(lr, momentum=0.9),
    "adam": lambda: optax.adam(lr),
    "adamw": lambda: optax.adamw(lr, weight_decay=WEIGHT_DECAY),
  }
  if opt.name in first_order:
    tx = first_order[opt.name]()
    if opt.clip is not None:
      tx = optax.chain(optax.clip_by_global_norm(opt.clip), tx)
  elif is_kfac(opt.name):
    then = first_order[KFAC_THEN[opt.name]]()
    tx = optax.chain(kfac_transform(opt, steps, layers), then)
  else:
    raise ValueError(f"unknown optimizer {opt.name!r}; choose from {sorted(DEFAULTS)}")
  return optax.apply_if_finite(tx, MAX_NONFINITE_STEPS)
