"""The batch-size scaling study: steps to a task's target against the global batch size.

It finds each optimizer's critical batch size: the largest batch up to which
more examples per step still buy nearly proportionally fewer steps
(`critical_batch`).

The protocol is data fixed in advance (`PROTOCOLS`): per task, the batch
sizes, the step budget at each (the same for every optimizer), the optimizers
studied and each one's settings at batch 128, the centre of its grid. At batch
``B`` every optimizer tries the learning rates ``c * sqrt(B / 128) * (1/3, 1,
3)`` (`grid`; ``c`` its centre; K-FAC's damping stays at its centre, the
library's factors being averages per example, so a damping means the same at
every batch), each in two variants (`VARIANTS`): plain, and stabilised
(`stabilisers`: a linear warmup over the first 5 % of the steps, and for the
first-order optimizers the gradient clipped to global norm 1; K-FAC's KL clip
stays sized at the peak rate through the warmup): 6 trials for every optimizer.
Every trial trains on the training set less a 20 % validation split (seed 0)
for the batch's budget, the cosine decay spanning it; the trial
that reaches the target on the validation split in the fewest steps is chosen,
or when none does the best final validation metric (diverged trials last;
`choose`). When the chosen trial's factor is the lowest or the highest the
optimizer tried, its grid grows by a factor of 3 beyond that end (both
variants) and the choice is made again, at most `MAX_EXTENSIONS` times
(`beyond`), the same rule for every optimizer; each line records the factor of
every trial and whether the chosen one still sits at an end of its grid
(``chosen_at_edge``). Each seed then trains the chosen setting on the whole
training set and is scored on the test set; the summary keeps each seed's steps
to the target (``steps_by_seed``) and the tables show their range. Within a
batch the optimizers take turns, trial by trial (the extensions too) and seed by
seed, so that the machine's slow spells fall on all alike.

In ``docs/benchmarks/scaling.md`` (``benchmarks/results/scaling.json``)
every task's table is of this protocol: ``python -m experiments scale --task TASK``, then
``python -m experiments scale-summary --publish``, regenerates a task's table and keeps the
others'; a study in progress (`unrun_batches`) publishes the batches run so far and names
those left. Lines of the earlier protocol render as they always did, and the targets
(`targets_markdown`) count only the tasks of this protocol, and a task in progress only
where its batches left cannot change the verdict.

Every run writes its JSON-lines file to ``OUT/TASK/scale/`` (``sgd-b256-trial1.jsonl``,
``kfac-b256-seed0.jsonl``); ``scale.jsonl`` holds one line per optimizer and batch,
``scale.md`` the table and ``scale.png`` the figure.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.ticker import LogFormatter, NullLocator

from experiments import optimizers
from experiments.files import atomic_open, write_text
from experiments.optimizers import is_kfac
from experiments.report import NAMES, to_target
from experiments.sweep import VALIDATION_FRACTION, pick
from experiments.tasks import Task, with_validation
from experiments.train import finished_run, run_config, train, versions

FOLDER = "scale"  # under OUT/TASK/
LINES = "scale.jsonl"
REFERENCE_BATCH = 128  # the batch the centres are set at
LR_FACTORS = (1 / 3, 1.0, 3.0)  # the grid around c * sqrt(B / 128)
FACTOR_LABELS = ("1/3", "1", "3")  # of LR_FACTORS: what an older line's chosen_trial indexes
# An end of the grid that wins says the best rate may lie beyond it: the grid then grows by this
# factor past that end, at most MAX_EXTENSIONS times per optimizer and batch.
EXTENSION_STEP = 3.0
MAX_EXTENSIONS = 2
# The stabilised variant. Large batches take large rates (c * sqrt(B / 128) * 3), and an optimizer
# may lose a batch to an early divergence or a gradient spike that a standard remedy would have
# held; a grid that offered a remedy to some optimizers only would favour them. So every optimizer
# tries each rate plain and stabilised, the same number of trials for all: a linear warmup over
# the first WARMUP of the steps, and for the first-order optimizers the gradient clipped to the
# global norm CLIP. K-FAC takes the warmup only: its KL clip is its trust region, and a gradient
# clip between K-FAC and the optimizer it is chained with would undo the preconditioning's scale
# (`experiments.optimizers.Optimizer` refuses it); through the warmup its KL clip is sized at the
# peak rate (`experiments.optimizers.kl_clip_schedule`), so that the warmup shrinks its steps.
WARMUP = 0.05
CLIP = 1.0
VARIANTS = ("plain", "stabilised")
SLACK = 1.5  # steps may exceed perfect scaling from the smallest batch by this factor
TRIAL_SEED = 0  # the seed of every sweep trial
EVAL_EVERY = 5
ORDER = list(optimizers.DEFAULTS)  # optimizers in files and tables: in this order

Line = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Protocol:
  """A task's scaling study, fixed before any run.

  Attributes:
    batches: the batch sizes, smallest first.
    budgets: training steps at each batch size, for every optimizer alike.
    centres: per optimizer studied (in this order), its settings at batch
      `REFERENCE_BATCH`: ``{"lr": ...}`` and K-FAC's ``damping``.
  """

  batches: tuple[int, ...]
  budgets: dict[int, int]
  centres: dict[str, dict[str, float]]

  @property
  def optimizers(self) -> list[str]:
    """The optimizers studied."""
    return list(self.centres)


MNIST1D_BATCHES = (128, 256, 512, 1024, 2048, 3200)  # 3200: the whole sweep split (80 % of 4000)
MNIST1D_BUDGETS = {128: 600, 256: 400, 512: 300, 1024: 200, 2048: 200, 3200: 200}
# The character transformer's sweep split holds 11633 of its 14541 training windows: 8192 is the
# largest power of 2 it holds. Its batch-128 budget is the task's 600 steps, where the experiments
# reach 1.85 nats in 183 (K-FAC) and 237 (AdamW) steps; then the same shrinking budgets as the
# others (perfect scaling from 237 steps needs 30 at batch 1024).
CHARLM_BATCHES = (128, 256, 512, 1024, 2048, 4096, 8192)
CHARLM_BUDGETS = {128: 600, 256: 400, 512: 300, 1024: 200, 2048: 200, 4096: 200, 8192: 200}

PROTOCOLS: dict[str, Protocol] = {
  "mnist1d": Protocol(
    MNIST1D_BATCHES,
    MNIST1D_BUDGETS,
    {
      "sgd": {"lr": 0.1},
      "adamw": {"lr": 0.01},
      "kfac": {"lr": 0.1, "damping": 0.01},
    },
  ),
  "resnet": Protocol(
    MNIST1D_BATCHES,
    MNIST1D_BUDGETS,
    {
      "sgd": {"lr": 0.3},
      "adamw": {"lr": 0.003},
      "kfac": {"lr": 0.03, "damping": 0.01},
      "kfac_adamw": {"lr": 0.003, "damping": 0.01},
    },
  ),
  # The autoencoder's sweep split holds 1150 of the 1437 training examples.
  "autoencoder": Protocol(
    (128, 256, 512, 1024),
    {128: 400, 256: 300, 512: 200, 1024: 200},
    {
      "sgd": {"lr": 0.1},
      "adamw": {"lr": 0.0003},
      "kfac": {"lr": 0.1, "damping": 0.1},
    },
  ),
  # The centres are the experiments' tuned settings (docs/benchmarks/experiments.md). SGD is not
  # studied: at its tuned rate (0.1) it ends at 2.09 nats without reaching 1.85 at batch 128, so
  # its critical batch is undefined and AdamW is the baseline every figure of merit uses; its
  # trials would cost a third of the study for no figure.
  "charlm": Protocol(
    CHARLM_BATCHES,
    CHARLM_BUDGETS,
    {
      "adamw": {"lr": 0.01},
      "kfac": {"lr": 0.1, "damping": 0.01},
    },
  ),
}


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one run of the study trains.

  Attributes:
    batches: the batch sizes, smallest first.
    names: the optimizers, in the order they take turns.
    seeds: the seeds each chosen setting trains with.
    budgets: training steps at each batch.
    overridden: whether ``budgets`` replace the protocol's (``--steps``).
    eval_every: steps between evaluations.
    centres: each optimizer's settings at batch `REFERENCE_BATCH`.
    resume: whether a run whose file an earlier study finished alike is
      read back instead of trained again (`train_or_reuse`).
  """

  batches: tuple[int, ...]
  names: tuple[str, ...]
  seeds: tuple[int, ...]
  budgets: dict[int, int]
  overridden: bool
  eval_every: int
  centres: dict[str, dict[str, float]]
  resume: bool = False


def grid(
  centre: Mapping[str, float], batch: int, factors: Sequence[float] = LR_FACTORS
) -> list[dict[str, float]]:
  """The settings tried at ``batch``: learning rates ``c * sqrt(batch / 128) * factors``.

  The other settings (K-FAC's damping) stay at the centre's.
  """
  scale = math.sqrt(batch / REFERENCE_BATCH)
  return [{**centre, "lr": centre["lr"] * scale * f} for f in factors]


def stabilisers(name: str) -> dict[str, float]:
  """What the stabilised variant adds to a setting of ``name``: `WARMUP`; `CLIP` unless K-FAC."""
  return {"warmup": WARMUP} if is_kfac(name) else {"warmup": WARMUP, "clip": CLIP}


def variant_settings(name: str, variant: str) -> dict[str, float]:
  """What the variant (`VARIANTS`) adds to a setting of ``name``: nothing when plain."""
  return stabilisers(name) if variant == "stabilised" else {}


def trials_at(
  name: str, centre: Mapping[str, float], batch: int, factors: Sequence[float]
) -> list[dict[str, Any]]:
  """The trials of ``name`` at ``factors`` (`grid`), each factor plain then stabilised.

  Each is ``{"factor": ..., "variant": ..., "settings": ...}``, its results still to come.
  """
  return [
    {"factor": f, "variant": v, "settings": settings | variant_settings(name, v)}
    for f, settings in zip(factors, grid(centre, batch, factors))
    for v in VARIANTS
  ]


def beyond(trials: Sequence[Mapping[str, Any]]) -> float | None:
  """The factor past the end of the grid where the chosen trial sits; None when it sits inside.

  ``trials``: one optimizer's trials at a batch, each with its ``factor`` and
  whether it is ``chosen``. The lowest end first: the factor a third of it.
  """
  factors = [t["factor"] for t in trials]
  chosen = next(t for t in trials if t["chosen"])["factor"]
  if chosen == min(factors):
    return chosen / EXTENSION_STEP
  if chosen == max(factors):
    return chosen * EXTENSION_STEP
  return None


def factor_label(factor: float) -> str:
  """A factor of ``c * sqrt(B / 128)`` as the tables write it: ``"1/9"``, ``"1"``, ``"27"``."""
  return f"{factor:g}" if factor >= 1 else f"1/{1 / factor:g}"


def batches_text(batches: Sequence[int]) -> str:
  """``batch 8192`` or ``batches 4096, 8192``."""
  return ("batch " if len(batches) == 1 else "batches ") + ", ".join(map(str, batches))


def make_plan(
  protocol: Protocol,
  batches: Sequence[int] | None,
  names: Sequence[str] | None,
  seeds: Sequence[int],
  steps: int | None,
  eval_every: int,
  resume: bool = False,
) -> Plan:
  """The plan of a run: the protocol's batches and optimizers unless given.

  ``steps`` replaces every batch's budget; ``resume`` reads back the runs an
  earlier study finished alike (`Plan`). Raises `ValueError` for an
  optimizer the protocol has no centre for, or a batch it has no budget for
  (unless ``steps`` is given).
  """
  batches = sorted(batches or protocol.batches)
  names = list(names or protocol.optimizers)
  unknown = [n for n in names if n not in protocol.centres]
  if unknown:
    raise ValueError(
      f"no scaling protocol for {' '.join(unknown)} on this task "
      f"(it studies {' '.join(protocol.optimizers)})"
    )
  missing = [b for b in batches if b not in protocol.budgets]
  if steps is None and missing:
    known = ", ".join(f"{b}: {s}" for b, s in protocol.budgets.items())
    raise ValueError(
      f"no step budget for {batches_text(missing)} in the protocol ({known}): give --steps"
    )
  budgets = {b: steps or protocol.budgets[b] for b in batches}
  centres = {n: protocol.centres[n] for n in names}
  return Plan(
    tuple(batches),
    tuple(names),
    tuple(seeds),
    budgets,
    steps is not None,
    eval_every,
    centres,
    resume,
  )


def sweep_examples(task: Task) -> int:
  """The training examples of the task's sweep split (the training set less its validation split)."""
  return len(with_validation(task, VALIDATION_FRACTION).train[0])


def check_batches(task: Task, batches: Sequence[int]) -> None:
  """Raises `ValueError` when a batch exceeds the sweep split's training examples.

  The seeds train on the whole training set, which is larger.
  """
  room = sweep_examples(task)
  over = [b for b in batches if b > room]
  if over:
    raise ValueError(
      f"{batches_text(over)} exceed{'s' if len(over) == 1 else ''} the {room} training examples of "
      f"{task.name}'s sweep split (its training set less a {VALIDATION_FRACTION * 100:g} % "
      "validation split)"
    )


def choose(task: Task, trials: Sequence[Mapping[str, Any]]) -> int:
  """Index of the chosen trial.

  The fewest validation steps to the target (``steps_to_target``; ties: the
  better final metric, then the earlier trial); when no trial reached it, the
  best ``final_metric``, diverged trials (None) last (`experiments.sweep.pick`).
  """
  reached = [i for i, t in enumerate(trials) if t["steps_to_target"] is not None]
  if not reached:
    return pick(task, list(trials))

  def score(i: int) -> tuple[int, float]:
    final = trials[i]["final_metric"]
    return trials[i]["steps_to_target"], -final if task.higher_is_better else final

  return min(reached, key=score)


def critical_batch(steps: Mapping[int, float | None]) -> int | None:
  """The critical batch size given the steps to target at each batch (None: missed).

  With ``B0`` the smallest batch and ``S0`` its steps, the largest batch ``B``
  such that the target is reached at ``B`` and at every batch from ``B0`` to
  ``B`` in ``steps(B) <= SLACK * S0 * B0 / B``: perfect scaling from ``B0``
  (twice the batch, half the steps) with `SLACK` (1.5x) room. None (undefined)
  when the target is missed at ``B0``.
  """
  batches = sorted(steps)
  b0 = batches[0]
  s0 = steps[b0]
  if s0 is None:
    return None
  critical = b0
  for b in batches[1:]:
    s = steps[b]
    if s is None or s > SLACK * s0 * b0 / b:
      break
    critical = b
  return critical


def train_once(
  task: Task,
  name: str,
  settings: dict[str, Any],
  steps: int,
  seed: int,
  eval_every: int,
  path: Path,
  progress: bool,
  extra: dict[str, Any],
) -> dict[str, Any]:
  """Trains one run into ``path`` and summarises it.

  Steps and seconds to the target (None: missed), the final metric (None:
  diverged, and no file) and the training seconds.
  """
  opt = optimizers.from_settings(name, settings)
  try:
    records = train(task, opt, steps, seed, eval_every, path, progress, extra_config=extra)
  except FloatingPointError:
    path.unlink(missing_ok=True)  # no earlier run's file under this run's name
    return {
      "steps_to_target": None,
      "final_metric": None,
      "diverged": True,
      "seconds_to_target": None,
      "training_seconds": None,
    }
  return run_summary(task, records)


def run_summary(task: Task, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """`train_once`'s summary of a run that did not diverge, from its records."""
  hit = to_target(records, task)
  return {
    "steps_to_target": None if hit is None else hit[0],
    "final_metric": records[-1]["metric"],
    "diverged": False,
    "seconds_to_target": None if hit is None else hit[1],
    "training_seconds": records[-1]["wall_seconds"],
  }


def train_or_reuse(
  plan: Plan,
  task: Task,
  name: str,
  settings: dict[str, Any],
  steps: int,
  seed: int,
  path: Path,
  progress: bool,
  extra: dict[str, Any],
) -> dict[str, Any]:
  """`train_once`, unless ``plan.resume`` and ``path`` holds this run finished alike.

  Alike: the same config (task, seed, steps, settings, trial) and package
  versions (`experiments.train.finished_run`); its records, clock included,
  are then summarised as they stand. A diverged run leaves no file and trains
  again. The code itself is not compared: resume only a study of this commit.
  """
  if plan.resume:
    opt = optimizers.from_settings(name, settings)
    records = finished_run(path, run_config(task, opt, steps, seed, extra))
    if records is not None:
      return run_summary(task, records)
  return train_once(task, name, settings, steps, seed, plan.eval_every, path, progress, extra)


def result_line(
  task: Task,
  plan: Plan,
  batch: int,
  name: str,
  trials: list[dict[str, Any]],
  runs: list[dict[str, Any]],
) -> Line:
  """The ``scale.jsonl`` line of one optimizer at one batch.

  With its trial rule (``variants``, the settings ``stabilised`` adds,
  ``max_extensions``), the ``factors`` tried, the chosen trial's factor and
  variant and whether it sits at an end of the grid (``chosen_at_edge``).
  """
  chosen = next(i for i, t in enumerate(trials) if t["chosen"])
  steps = [r["steps_to_target"] for r in runs]
  reached = sum(s is not None for s in steps)
  return {
    "task": task.name,
    "batch": batch,
    "budget": plan.budgets[batch],
    "budget_overridden": plan.overridden,
    "optimizer": name,
    "metric_name": task.metric_name,
    "target": task.target,
    "higher_is_better": task.higher_is_better,
    "eval_every": plan.eval_every,
    "seeds": list(plan.seeds),
    "validation_fraction": VALIDATION_FRACTION,
    "trial_seed": TRIAL_SEED,
    "centre": plan.centres[name],
    "variants": list(VARIANTS),
    "stabilised": stabilisers(name),
    "max_extensions": MAX_EXTENSIONS,
    "factors": sorted({t["factor"] for t in trials}),
    "chosen_trial": chosen,
    "chosen": trials[chosen]["settings"],
    "chosen_factor": trials[chosen]["factor"],
    "chosen_variant": trials[chosen]["variant"],
    "chosen_at_edge": beyond(trials) is not None,
    "grid": trials,
    "runs": runs,
    "reached": reached,
    "mean_steps_to_target": sum(steps) / len(steps) if reached == len(steps) else None,
    "versions": versions(),
  }


def common_config(plan: Plan, batch: int) -> dict[str, Any]:
  """What every run of the study at ``batch`` adds to its records' config."""
  return {"study": FOLDER, "batch_size": batch, "budget_overridden": plan.overridden}


def train_trials(
  val_task: Task,
  plan: Plan,
  todo: Mapping[str, Sequence[dict[str, Any]]],
  trials: dict[str, list[dict[str, Any]]],
  out: Path,
  progress: bool,
) -> None:
  """Trains each optimizer's ``todo`` trials (`trials_at`) and appends them to its ``trials``.

  The optimizers take turns, trial by trial; each trial is numbered after its
  optimizer's earlier ones at this batch, and marked not chosen.
  """
  batch = val_task.batch_size
  steps = plan.budgets[batch]
  for i in range(max(map(len, todo.values()), default=0)):
    for n, pending in todo.items():
      if i >= len(pending):
        continue
      trial = pending[i]
      number = len(trials[n])
      path = out / f"{n}-b{batch}-trial{number}.jsonl"
      extra = common_config(plan, batch) | {
        "sweep_trial": number,
        "lr_factor": trial["factor"],
        "variant": trial["variant"],
      }
      summary = train_or_reuse(
        plan, val_task, n, trial["settings"], steps, TRIAL_SEED, path, progress, extra
      )
      trials[n].append({"trial": number, **trial, **summary, "chosen": False})


def choose_again(val_task: Task, trials: Sequence[dict[str, Any]]) -> None:
  """Marks the one chosen trial (`choose`) among an optimizer's trials."""
  best = choose(val_task, trials)
  for i, t in enumerate(trials):
    t["chosen"] = i == best


def sweep_batch(
  val_task: Task, plan: Plan, out: Path, progress: bool
) -> dict[str, list[dict[str, Any]]]:
  """Every optimizer's trials at the batch of ``val_task``, the chosen one marked.

  First its `LR_FACTORS`, plain and stabilised; then, while the chosen trial
  sits at an end of its grid, the factor `beyond` it (both variants), at most
  `MAX_EXTENSIONS` times. The optimizers take turns within each round.
  """
  batch = val_task.batch_size
  trials: dict[str, list[dict[str, Any]]] = {n: [] for n in plan.names}
  factors = {n: LR_FACTORS for n in plan.names}
  for extension in range(MAX_EXTENSIONS + 1):
    if extension > 0:
      factors = {n: [f] for n in plan.names if (f := beyond(trials[n])) is not None}
      if not factors:
        break
    todo = {n: trials_at(n, plan.centres[n], batch, fs) for n, fs in factors.items()}
    train_trials(val_task, plan, todo, trials, out, progress)
    for n in factors:
      choose_again(val_task, trials[n])
  return trials


def run_batch(task: Task, plan: Plan, batch: int, out: Path, progress: bool) -> list[Line]:
  """Sweeps every optimizer at ``batch`` on the validation split (`sweep_batch`), then the seeds.

  The optimizers take turns, trial by trial, then seed by seed.
  """
  at_batch = dataclasses.replace(task, batch_size=batch)
  val_task = with_validation(at_batch, VALIDATION_FRACTION)
  steps = plan.budgets[batch]
  common = common_config(plan, batch)
  trials = sweep_batch(val_task, plan, out, progress)
  runs: dict[str, list[dict[str, Any]]] = {n: [] for n in plan.names}
  for s in plan.seeds:
    for n in plan.names:
      chosen = next(t for t in trials[n] if t["chosen"])
      path = out / f"{n}-b{batch}-seed{s}.jsonl"
      extra = common | {"settings_from": f"scale sweep, trial {chosen['trial']}"}
      summary = train_or_reuse(
        plan, at_batch, n, chosen["settings"], steps, s, path, progress, extra
      )
      runs[n].append({"seed": s, **summary})
  return [result_line(task, plan, batch, n, trials[n], runs[n]) for n in plan.names]


def rank(name: str) -> tuple[int, str]:
  """Sort key of an optimizer: its place in `ORDER` (any other after, by name)."""
  return ORDER.index(name) if name in ORDER else len(ORDER), name


def order(line: Line) -> tuple[int, tuple[int, str]]:
  """Sort key of ``scale.jsonl`` lines: by batch, then optimizer (`rank`)."""
  return line["batch"], rank(line["optimizer"])


def read_lines(path: Path) -> list[Line]:
  """The lines of a ``scale.jsonl``."""
  return [json.loads(text) for text in path.read_text().splitlines() if text.strip()]


def write_lines(path: Path, lines: Sequence[Line]) -> None:
  """Writes ``scale.jsonl`` atomically, sorted (`order`)."""
  write_text(path, "".join(json.dumps(line) + "\n" for line in sorted(lines, key=order)))


def trial_rule(line: Mapping[str, Any]) -> str:
  """How a line's trials were laid out: its variants and extensions (older lines: plain, none)."""
  variants = " ".join(line.get("variants", ["plain"]))
  return f"variants {variants}, at most {line.get('max_extensions', 0)} extensions"


def mixed(lines: Sequence[Mapping[str, Any]]) -> str | None:
  """How a task's lines differ in budget, evaluations, seeds or trials; None if one table fits.

  Lines of one batch must share its budget; overridden budgets (``--steps``)
  must be one number for every line, and not mixed with the protocol's; every
  line must follow one `trial_rule`.
  """
  problems = []
  for b in sorted({line["batch"] for line in lines}):
    budgets = sorted({line["budget"] for line in lines if line["batch"] == b})
    if len(budgets) > 1:
      problems.append(f"batch {b}: budgets of {', '.join(map(str, budgets))} steps")
  overridden = {line["budget_overridden"] for line in lines}
  if len(overridden) > 1:
    problems.append("budgets overridden (--steps) for some lines only")
  elif overridden == {True} and len({line["budget"] for line in lines}) > 1:
    problems.append("budgets overridden (--steps) with different steps")
  every = sorted({line["eval_every"] for line in lines})
  if len(every) > 1:
    problems.append(f"evaluated every {', '.join(map(str, every))} steps")
  seeds = sorted({tuple(line["seeds"]) for line in lines})
  if len(seeds) > 1:
    problems.append(f"seeds {'; '.join(' '.join(map(str, s)) for s in seeds)}")
  rules = sorted({trial_rule(line) for line in lines})
  if len(rules) > 1:
    problems.append(f"trials with {'; '.join(rules)}")
  return "; ".join(problems) or None


def planned_lines(plan: Plan) -> list[Line]:
  """Stand-ins for the lines a plan will write: what `mixed` compares."""
  return [
    {
      "batch": b,
      "optimizer": n,
      "budget": plan.budgets[b],
      "budget_overridden": plan.overridden,
      "eval_every": plan.eval_every,
      "seeds": list(plan.seeds),
      "variants": list(VARIANTS),
      "max_extensions": MAX_EXTENSIONS,
    }
    for b in plan.batches
    for n in plan.names
  ]


def kept_lines(path: Path, plan: Plan) -> list[Line]:
  """The lines of an earlier ``scale.jsonl`` that the plan does not train again.

  Raises `ValueError` when they were made with other budgets, evaluations,
  seeds or trials than the plan's (`mixed`): one table would mix them.
  """
  if not path.exists():
    return []
  again = {(b, n) for b in plan.batches for n in plan.names}
  kept = [line for line in read_lines(path) if (line["batch"], line["optimizer"]) not in again]
  problem = mixed([*kept, *planned_lines(plan)])
  if problem is not None:
    raise ValueError(
      f"{path} holds results made with other budgets, evaluations, seeds or trials ({problem}): "
      "give another --out, or remove it"
    )
  return kept


def study(task: Task, plan: Plan, out: Path, kept: Sequence[Line], progress: bool) -> list[Line]:
  """Runs the study batch by batch into ``out`` and returns every line, ``kept`` ones included.

  ``scale.jsonl`` is rewritten after each batch (the batches done so far and
  ``kept``); ``scale.md`` and ``scale.png`` are written at the end.
  """
  out.mkdir(parents=True, exist_ok=True)
  lines = list(kept)
  for batch in plan.batches:
    if progress:
      print(f"{task.name}: batch {batch}, {plan.budgets[batch]} steps")
    lines = sorted([*lines, *run_batch(task, plan, batch, out, progress)], key=order)
    write_lines(out / LINES, lines)
  write_text(out / "scale.md", report(summary_lines(lines)) + "\n")
  plot(lines, out / "scale.png")
  return lines


# The summary and its tables.

# What a summary keeps of a ``scale.jsonl`` line (`summary_lines`), with ``n_runs``, the seeds
# trained, and ``steps_by_seed``, each seed's steps to target (None: missed): every figure of the
# tables, and the settings chosen.
SUMMARY_FIELDS = (
  "task",
  "batch",
  "budget",
  "budget_overridden",
  "optimizer",
  "metric_name",
  "target",
  "higher_is_better",
  "eval_every",
  "seeds",
  "validation_fraction",
  "centre",
  "chosen_trial",
  "chosen",
  "reached",
  "mean_steps_to_target",
)
# What it keeps too of a line made with the stabilised variant and the extensions (`run_batch`):
# the trial rule and where the chosen trial sits. Older lines have none of them.
TRIAL_RULE_FIELDS = (
  "variants",
  "stabilised",
  "max_extensions",
  "factors",
  "chosen_factor",
  "chosen_variant",
  "chosen_at_edge",
)


def summary_lines(lines: Sequence[Line]) -> list[Line]:
  """A task's ``scale.jsonl`` lines reduced to what its table shows, in table order.

  This is what ``benchmarks/results/scaling.json`` holds per task, and what `report` reads.
  """
  return [
    {k: line[k] for k in SUMMARY_FIELDS}
    | {k: line[k] for k in TRIAL_RULE_FIELDS if k in line}
    | {"n_runs": len(line["runs"]), "steps_by_seed": [r["steps_to_target"] for r in line["runs"]]}
    for line in sorted(lines, key=order)
  ]


def unrun_batches(task: str, lines: Sequence[Line]) -> list[int]:
  """The batches of the task's protocol that ``lines`` hold no line for: a study in progress.

  Empty for a task with no protocol. A summary keeps them per task (``"unrun"``),
  so that a table says what it lacks, and a target is decided only where the
  batches left cannot change it (`target_row`).
  """
  protocol = PROTOCOLS.get(task)
  done = {line["batch"] for line in lines}
  return [] if protocol is None else [b for b in protocol.batches if b not in done]


def unrun_of(summary: Mapping[str, Any], task: str) -> list[int]:
  """The task's batches not yet run, as a summary records them (none for older summaries)."""
  return list(summary.get("unrun", {}).get(task, []))


def summary_markdown(summary: Mapping[str, Any]) -> str:
  """Every task's table (`report`) of a summary ``{"tasks": {task: summary lines}}``.

  What ``python -m experiments scale-summary`` prints and writes, and the block ``scaling`` of
  ``docs/benchmarks/scaling.md``; the targets (`targets_markdown`) close it.
  """
  tables = [report(lines, unrun_of(summary, task)) for task, lines in summary["tasks"].items()]
  return "\n\n".join([*tables, "### Targets", targets_markdown(summary)])


def by_batch(lines: Sequence[Line]) -> dict[int, dict[str, Line]]:
  """The lines by batch (smallest first), then by optimizer."""
  table: dict[int, dict[str, Line]] = {}
  for line in sorted(lines, key=order):
    table.setdefault(line["batch"], {})[line["optimizer"]] = line
  return table


def names_of(lines: Sequence[Line]) -> list[str]:
  """The optimizers of the lines, in `ORDER`."""
  return sorted({line["optimizer"] for line in lines}, key=rank)


def mean_steps(at: Mapping[str, Line], name: str) -> float | None:
  """The optimizer's mean steps to target at a batch (None: missed or not run)."""
  line = at.get(name)
  return None if line is None else line["mean_steps_to_target"]


def steps_by_batch(table: Mapping[int, Mapping[str, Line]], name: str) -> dict[int, float | None]:
  """The optimizer's mean steps to target at every batch of the study (None: missed or not run)."""
  return {b: mean_steps(at, name) for b, at in table.items()}


def best_baseline(at: Mapping[str, Line]) -> str | None:
  """The first-order optimizer with the fewest mean steps to target at a batch, if any reached it."""
  reached = [n for n in at if not is_kfac(n) and mean_steps(at, n) is not None]
  return min(reached, key=lambda n: mean_steps(at, n)) if reached else None


def steps_cell(line: Line | None) -> str:
  """Mean steps to target and the seeds' range, or ``missed (k/n)`` when not every seed reached it.

  The range, ``183 (175 to 195)``, where the line keeps each seed's steps
  (``steps_by_seed``) of more than one seed; the mean alone otherwise.
  """
  if line is None:
    return "not run"
  if line["mean_steps_to_target"] is None:
    return f"missed ({line['reached']}/{line['n_runs']})"
  mean = f"{line['mean_steps_to_target']:.0f}"
  seeds = line.get("steps_by_seed")
  if seeds is None or len(seeds) < 2:
    return mean
  return f"{mean} ({min(seeds):.0f} to {max(seeds):.0f})"


def ratio_cell(at: Mapping[str, Line], kfac: str) -> str:
  """K-FAC's steps to target relative to the best baseline's at a batch."""
  best = best_baseline(at)
  if kfac not in at:
    return "not run"
  if mean_steps(at, kfac) is None:
    return f"{NAMES.get(kfac, kfac)} missed"
  if best is None:
    return "no baseline reached"
  if mean_steps(at, best) == 0:
    return "baseline at step 0"
  return f"{mean_steps(at, kfac) / mean_steps(at, best):.2f}x ({NAMES.get(best, best)})"


def critical_text(
  table: Mapping[int, Mapping[str, Line]], name: str, unrun: Sequence[int] = ()
) -> str:
  """One optimizer's critical batch as a list item (``unrun``: the batches not yet run)."""
  steps = steps_by_batch(table, name)
  b0, largest = min(steps), max(steps)
  critical = critical_batch(steps)
  label = NAMES.get(name, name)
  if critical is None:
    why = "not run" if name not in table[b0] else "missed the target"
    return f"* {label}: undefined ({why} at batch {b0})"
  studied = "the largest batch run so far" if unrun else "the largest batch studied"
  bound = f" ({studied}: at least that)" if critical == largest else ""
  return f"* {label}: {critical}{bound}; {steps[b0]:.0f} steps at batch {b0}"


@dataclasses.dataclass(frozen=True)
class Figures:
  """One K-FAC variant's figures of merit on a task; None where undefined.

  Attributes:
    name: the K-FAC variant.
    critical: its critical batch (`critical_batch`).
    top: the first-order optimizer with the largest critical batch, and that batch.
    largest: the largest batch where a first-order optimizer reaches the target.
    best: the first-order optimizer with the fewest steps at ``largest``.
    steps: the K-FAC variant's mean steps at ``largest`` and the best baseline's there.
  """

  name: str
  critical: int | None
  top: tuple[str, int] | None
  largest: int | None
  best: str | None
  steps: tuple[float | None, float] | None

  @property
  def critical_ratio(self) -> float | None:
    """K-FAC's critical batch over the best baseline's."""
    if self.critical is None or self.top is None:
      return None
    return self.critical / self.top[1]

  @property
  def steps_ratio(self) -> float | None:
    """K-FAC's steps over the best baseline's at ``largest`` (None: missed, or the baseline at 0)."""
    if self.steps is None or self.steps[0] is None or self.steps[1] == 0:
      return None
    return self.steps[0] / self.steps[1]


def figures(table: Mapping[int, Mapping[str, Line]], names: Sequence[str], k: str) -> Figures:
  """The figures of merit of the K-FAC variant ``k`` among ``names`` (`Figures`)."""
  critical = {n: critical_batch(steps_by_batch(table, n)) for n in names}
  baselines = [(n, critical[n]) for n in names if not is_kfac(n) and critical[n] is not None]
  top = max(baselines, key=lambda c: c[1]) if baselines else None
  reached = [b for b, at in table.items() if best_baseline(at) is not None]
  if not reached:
    return Figures(k, critical[k], top, None, None, None)
  largest = max(reached)
  at = table[largest]
  best = best_baseline(at)
  return Figures(k, critical[k], top, largest, best, (mean_steps(at, k), mean_steps(at, best)))


def merits(
  table: Mapping[int, Mapping[str, Line]], names: Sequence[str], unrun: Sequence[int] = ()
) -> list[str]:
  """The figures of merit: each K-FAC variant's critical batch and steps against the baselines'.

  ``unrun``: the batches not yet run, where the largest batch a baseline reaches is so far.
  """
  label = {n: NAMES.get(n, n) for n in names}
  out = []
  for k in (n for n in names if is_kfac(n)):
    f = figures(table, names, k)
    head = f"{label[k]}'s critical batch / the best baseline's"
    if f.critical is None:
      out.append(f"* {head}: undefined ({label[k]} has none).")
    elif f.top is None:
      out.append(f"* {head}: undefined (no baseline has one).")
    else:
      name, batch = f.top
      out.append(
        f"* {head} ({label[name]}, {batch}): {f.critical_ratio:.2f}x ({f.critical} / {batch})."
      )
    if f.largest is None:
      out.append(
        f"* {label[k]}'s steps against a baseline's at the largest batch it reaches: "
        "undefined (no baseline reaches the target at any batch)."
      )
      continue
    at = table[f.largest]
    head = (
      f"* At batch {f.largest}, the largest where a baseline reaches the target"
      f"{' so far' if unrun else ''} "
      f"({label.get(f.best, f.best)}, {f.steps[1]:.0f} steps)"
    )
    if f.steps[0] is None:
      done = "not run" if k not in at else f"missed ({at[k]['reached']}/{at[k]['n_runs']})"
      out.append(f"{head}: {label[k]} {done}.")
    elif f.steps[1] == 0:
      out.append(f"{head}: no ratio (the baseline met it at step 0).")
    else:
      out.append(f"{head}: {label[k]} {f.steps_ratio:.2f}x its steps ({f.steps[0]:.0f}).")
  return out


def has_variants(line: Mapping[str, Any]) -> bool:
  """Whether the line was made with the stabilised variant and extensions (`TRIAL_RULE_FIELDS`)."""
  return "chosen_factor" in line


def chosen_label(line: Line) -> str:
  """The trial a line chose, as a factor of ``c * sqrt(B / 128)``.

  ``"1/3"``; on a line with variants, ``"3 stabilised"`` for the stabilised
  one and ``"(edge)"`` after a factor still at an end of the grid.
  """
  if not has_variants(line):
    return FACTOR_LABELS[line["chosen_trial"]]
  text = factor_label(line["chosen_factor"])
  text += " stabilised" if line["chosen_variant"] == "stabilised" else ""
  return text + (" (edge)" if line["chosen_at_edge"] else "")


def chosen_text(table: Mapping[int, Mapping[str, Line]], name: str) -> str:
  """The trial each batch chose for an optimizer (`chosen_label`)."""
  chosen = [chosen_label(at[name]) if name in at else "-" for at in table.values()]
  return f"{NAMES.get(name, name)} {', '.join(chosen)}"


def stabilised_text(lines: Sequence[Line]) -> str:
  """What the stabilised variant adds, by optimizer: ``"SGD and AdamW: a linear warmup ..."``."""
  groups: dict[str, list[str]] = {}
  for line in sorted(lines, key=order):
    added = line["stabilised"]
    parts = []
    if "warmup" in added:
      parts.append(f"a linear warmup over the first {added['warmup'] * 100:g} % of the steps")
    if "clip" in added:
      parts.append(f"the gradient clipped to global norm {added['clip']:g}")
    label = NAMES.get(line["optimizer"], line["optimizer"])
    names = groups.setdefault(" and ".join(parts) or "nothing", [])
    if label not in names:
      names.append(label)
  return "; ".join(f"{' and '.join(names)}: {added}" for added, names in groups.items())


def method_text(lines: Sequence[Line]) -> str:
  """How each batch's setting was chosen, and what a cell shows."""
  first = lines[0]
  grid_text = (
    f"At each batch B every optimizer's learning rate is chosen from "
    f"c x sqrt(B/{REFERENCE_BATCH}) x (1/3, 1, 3), c its batch-{REFERENCE_BATCH} setting "
    "(K-FAC's damping stays at its own)"
  )
  validation = f"{first['validation_fraction'] * 100:g} % validation split"
  cells = (
    "Cells: test steps to the target, mean over seeds, or missed (k/n) when not every seed "
    "reached it within the budget; K-FAC / best baseline: steps relative to the first-order "
    "optimizer with the fewest."
  )
  if not has_variants(first):
    return (
      "Earlier protocol (3 plain rates, no extension, no seeds' range): "
      f"{grid_text}, on a {validation}: the fewest steps to the target, else the best final "
      f"metric. {cells}"
    )
  return (
    f"{grid_text}, each rate plain and stabilised ({stabilised_text(lines)}); when an end of an "
    f"optimizer's grid wins, the factor {EXTENSION_STEP:g}x beyond it is tried too (both "
    f"variants), at most {first['max_extensions']} times. Chosen on a {validation}: the fewest "
    "steps to the target, else the best final metric. "
    + cells.replace("mean over seeds,", "mean over seeds (the seeds' range),")
  )


def report(lines: Sequence[Line], unrun: Sequence[int] = ()) -> str:
  """A task's study as Markdown: the table by batch, the critical batches, the figures of merit.

  ``lines``: the task's `summary_lines`; ``unrun``: its protocol's batches not
  yet run (`unrun_batches`), which the table names.
  """
  table = by_batch(lines)
  names = names_of(lines)
  kfacs = [n for n in names if is_kfac(n)]
  first = lines[0]
  direction = ">=" if first["higher_is_better"] else "<="
  budgets = {b: next(iter(at.values()))["budget"] for b, at in table.items()}
  overridden = first["budget_overridden"]
  budget_text = (
    f"budget overridden: {first['budget']} steps at every batch"
    if overridden
    else "step budgets " + ", ".join(f"{budgets[b]} at batch {b}" for b in table)
  )
  columns = [NAMES.get(n, n) for n in names] + [f"{NAMES.get(k, k)} / best baseline" for k in kfacs]
  b0 = min(table)
  out = [
    f"### {first['task']}: steps to {first['metric_name']} {direction} {first['target']:g} "
    "against the batch size",
    "",
    f"Seeds {' '.join(map(str, first['seeds']))}, evaluated every {first['eval_every']} steps; "
    f"{budget_text}. {method_text(lines)}",
    *(["", progress_text(unrun)] if unrun else []),
    "",
    "| batch | budget | " + " | ".join(columns) + " |",
    "|---|---|" + "---|" * len(columns),
  ]
  for b, at in table.items():
    cells = [steps_cell(at.get(n)) for n in names] + [ratio_cell(at, k) for k in kfacs]
    out.append(f"| {b} | {budgets[b]} | " + " | ".join(cells) + " |")
  chosen_head = (
    f"Learning rate chosen at {batches_text(list(table))}, "
    f"as a factor of c x sqrt(B/{REFERENCE_BATCH})"
  )
  if has_variants(first):
    chosen_head += (
      " (stabilised: its stabilised variant; (edge): still an end of the grid after the "
      "extensions, the best rate may lie beyond)"
    )
  out += [
    "",
    f"Critical batch: the largest batch B reached, as every batch from {b0} up to it, in at most "
    f"{SLACK:g} x S0 x {b0} / B steps (S0: the steps at batch {b0}, the smallest):",
    "",
    *(critical_text(table, n, unrun) for n in names),
    "",
    "Figures of merit:",
    "",
    *(merits(table, names, unrun) or ["* none: no K-FAC variant studied."]),
    "",
    f"{chosen_head}: " + "; ".join(chosen_text(table, n) for n in names) + ".",
  ]
  return "\n".join(out)


def progress_text(unrun: Sequence[int]) -> str:
  """What a table of a study in progress lacks."""
  verb = "is" if len(unrun) == 1 else "are"
  return (
    f"**In progress:** {batches_text(unrun)} of the protocol {verb} not run yet; "
    "the figures below are those of the batches run so far."
  )


# The targets, as the README states them.

CRITICAL_TARGET = 4.0  # K-FAC's critical batch over the best baseline's: at least this
# K-FAC's steps over the best baseline's at the largest batch a baseline reaches: at most this
STEPS_TARGET = 0.5
TASKS_TARGET = 2  # each target on at least this many tasks


def at_edge(line: Line) -> bool | None:
  """Whether the line's chosen setting sits at an end of its grid; None for an older line.

  Older lines (`has_variants` false) tried 3 rates and never extended: their
  edges were not checked.
  """
  return line["chosen_at_edge"] if has_variants(line) else None


def edges(lines: Sequence[Line]) -> list[str]:
  """``"AdamW at 128"`` for each line whose chosen setting still sits at an end of its grid."""
  return [
    f"{NAMES.get(x['optimizer'], x['optimizer'])} at {x['batch']}"
    for x in sorted(lines, key=order)
    if at_edge(x)
  ]


def target_row(
  table: Mapping[int, Mapping[str, Line]], f: Figures, unrun: Sequence[int] = ()
) -> tuple[list[str], str, str]:
  """One K-FAC variant's row of the targets table, and its verdict on each target.

  A verdict is ``"met"``, ``"missed"``, ``"undefined"``, ``"open"`` (K-FAC's
  critical batch is the largest studied, so larger batches may still meet it),
  ``"met at an edge"`` (met, but a setting its figure compares sits at an end
  of its grid, where a better rate may lie beyond). With batches ``unrun``
  (a study in progress) the steps figure is ``"pending"``: a baseline may reach
  the target at a larger batch. The critical batch needs no such care: a
  verdict other than ``"open"`` has K-FAC's critical batch below the largest
  batch run, where it is final, and met means a baseline's below it too.
  """
  label = NAMES.get(f.name, f.name)
  largest_studied = max(table)
  compared = [at[f.name] for at in table.values() if f.name in at]
  if f.critical is None or f.top is None:
    who = label if f.critical is None else "no baseline"
    critical_cell, critical = f"undefined ({who} has none)", "undefined"
  else:
    name, batch = f.top
    bound = "at least " if f.critical == largest_studied else ""
    critical_cell = (
      f"{bound}{f.critical} / {batch} ({NAMES.get(name, name)}) = {bound}{f.critical_ratio:.2f}x"
    )
    critical = "met" if f.critical_ratio >= CRITICAL_TARGET else "open" if bound else "missed"
    if critical == "met" and edges(compared + [at[name] for at in table.values() if name in at]):
      critical = "met at an edge"
  if f.largest is None:
    steps_cell, steps = "undefined (no baseline reaches the target)", "undefined"
  else:
    at = table[f.largest]
    where = f"at {f.largest} ({NAMES.get(f.best, f.best)})"
    if f.steps_ratio is None:
      steps_cell, steps = f"{label} missed {where}", "missed"
    else:
      steps_cell = f"{f.steps_ratio:.2f}x {where}"
      steps = "met" if f.steps_ratio <= STEPS_TARGET else "missed"
      if steps == "met" and edges([at[f.name], at[f.best]]):
        steps = "met at an edge"
  if unrun:
    steps_cell += ", so far"
    steps = "pending"
  return [label, critical_cell, critical, steps_cell, steps], critical, steps


def targets(summary: Mapping[str, Any]) -> tuple[list[str], list[str]]:
  """The targets table's rows, and the verdicts as list items (`targets_markdown`).

  A task in progress (`unrun_of`) whose verdict on a target its batches left may
  still change (``"pending"``, or ``"open"``) is undecided on it; a target is
  called only where the undecided tasks cannot change it.
  """
  rows, current, earlier, progress = [], [], [], []
  met: dict[str, list[str]] = {"critical": [], "steps": []}
  undecided: dict[str, list[str]] = {"critical": [], "steps": []}
  for task, lines in summary["tasks"].items():
    table, names, unrun = by_batch(lines), names_of(lines), unrun_of(summary, task)
    new = has_variants(lines[0])
    (current if new else earlier).append(task)
    if new and unrun:
      progress.append(f"{task} ({batches_text(unrun)} not run yet)")
    edge = ", ".join(edges(lines)) or "none" if new else "not checked (3 rates, no extension)"
    for k in (n for n in names if is_kfac(n)):
      cells, critical, steps = target_row(table, figures(table, names, k), unrun)
      protocol = "current" if new else "earlier"
      rows.append(f"| {task} | {protocol} | " + " | ".join(cells) + f" | {edge} |")
      for target, verdict in (("critical", critical), ("steps", steps)):
        if new and verdict == "met" and task not in met[target]:
          met[target].append(task)
        if new and unrun and verdict in ("pending", "open") and task not in undecided[target]:
          undecided[target].append(task)
  missing = [t for t in PROTOCOLS if t not in summary["tasks"]]

  def verdict(target: str, text: str) -> str:
    tasks = met[target]
    open_ = [t for t in undecided[target] if t not in tasks]
    if len(tasks) >= TASKS_TARGET:
      held = "holds"
    elif len(tasks) + len(open_) < TASKS_TARGET:
      held = "does not hold"
    else:
      held = "not decided yet"
    which = f" ({', '.join(tasks)})" if tasks else ""
    line = (
      f"* {text}, on at least {TASKS_TARGET} tasks: {held}; met on {len(tasks)} of the "
      f"{len(current)} tasks run under the current protocol{which}"
    )
    if open_:
      whether = "" if held == "not decided yet" else ", which cannot change the verdict"
      line += f"; undecided on {', '.join(open_)} (in progress){whether}"
    return line + "."

  verdicts = [
    verdict(
      "critical", f"K-FAC's critical batch at least {CRITICAL_TARGET:g}x the best baseline's"
    ),
    verdict(
      "steps",
      f"K-FAC at most {STEPS_TARGET:g}x the best baseline's steps at the largest batch where a "
      "baseline still reaches the target",
    ),
  ]
  if earlier or missing:
    pending = [f"{t} (lines of the earlier protocol: 3 plain rates, no extension)" for t in earlier]
    pending += [f"{t} (not run)" for t in missing]
    verdicts.append(f"* Not counted, not yet run under the current protocol: {', '.join(pending)}.")
  if progress:
    verdicts.append(f"* In progress: {'; '.join(progress)}.")
  return rows, verdicts


def targets_markdown(summary: Mapping[str, Any]) -> str:
  """Which of the study's targets hold, task by task: a table, then the verdicts.

  The targets: K-FAC's critical batch at least `CRITICAL_TARGET` times the
  best baseline's, and at most `STEPS_TARGET` times the best baseline's steps
  at the largest batch where a baseline still reaches the target, each on at
  least `TASKS_TARGET` tasks. Only tasks run under the current protocol
  (`has_variants`) count; a figure that compares a setting still at an end of
  its grid does not (``met at an edge``, `target_row`).
  """
  rows, verdicts = targets(summary)
  head = [
    "| task | protocol | K-FAC | critical batch: K-FAC / best baseline | "
    f">= {CRITICAL_TARGET:g}x | steps: K-FAC / best baseline, at the largest batch a baseline "
    f"reaches | <= {STEPS_TARGET:g}x | settings at a grid edge |",
    "|---|---|---|---|---|---|---|---|",
  ]
  return "\n".join([*head, *rows, "", *verdicts])


def targets_readme(summary: Mapping[str, Any]) -> str:
  """The verdicts alone (`targets`): the README's block ``scaling targets``."""
  return "\n".join(targets(summary)[1])


# The figure.


def plot(lines: Sequence[Line], path: Path) -> None:
  """Steps to target against batch size, log-log, one line per optimizer.

  A filled marker where every seed reached the target, a hollow triangle at
  the budget where not; a dashed line of perfect scaling from each
  optimizer's smallest-batch point.
  """
  table = by_batch(lines)
  batches = list(table)
  first = lines[0]
  fig, ax = plt.subplots(figsize=(7, 5))
  for i, name in enumerate(names_of(lines)):
    color = f"C{i}"
    steps = steps_by_batch(table, name)
    ys = np.array([np.nan if s is None or s <= 0 else s for s in steps.values()], float)
    ax.plot(batches, ys, marker="o", color=color, label=NAMES.get(name, name))
    missed = [(b, at[name]["budget"]) for b, at in table.items() if name in at and steps[b] is None]
    if missed:
      xs, budget = zip(*missed)
      ax.scatter(xs, budget, marker="v", s=60, facecolors="none", edgecolors=color)
    b0 = batches[0]
    if steps[b0] is not None and steps[b0] > 0:
      ideal = [steps[b0] * b0 / b for b in batches]
      ax.plot(batches, ideal, linestyle="--", linewidth=0.8, color=color, alpha=0.7)
  handles, labels = ax.get_legend_handles_labels()
  handles += [
    Line2D([], [], linestyle="--", color="gray", linewidth=0.8),
    Line2D([], [], marker="v", linestyle="", markerfacecolor="none", color="gray"),
  ]
  labels += ["perfect scaling from the smallest batch", "missed (drawn at the budget)"]
  direction = ">=" if first["higher_is_better"] else "<="
  title = f"{first['task']}: steps to {first['metric_name']} {direction} {first['target']:g}"
  if first["budget_overridden"]:
    title += f" (budget overridden: {first['budget']} steps)"
  ax.set_title(title)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xticks(batches)
  ax.set_xticklabels([str(b) for b in batches])
  ax.xaxis.set_minor_locator(NullLocator())
  ax.yaxis.set_major_formatter(LogFormatter())  # 20, 50, 100 rather than 2 x 10^1
  ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
  ax.set_xlabel("batch size")
  ax.set_ylabel("steps to target (mean over seeds)")
  ax.grid(alpha=0.3)
  ax.legend(handles, labels)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  try:
    with atomic_open(path, "wb") as f:
      fig.savefig(f, format="png", dpi=110)
  finally:
    plt.close(fig)
