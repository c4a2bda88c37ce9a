"""Robustness: K-FAC against each model's tuned first-order optimizer, over damping and its form.

For every problem of `experiments.suite` (eight models, five of which no
other experiment or test tunes anything on):

1. its first-order optimizer alone (SGD with momentum 0.9, or AdamW) over a
   grid of learning rates, extended by one point past whichever end wins,
   until an inner point wins (at most `MAX_EXTENSIONS` times); the tuned rate
   is the one with the lowest final loss averaged over the seeds;
2. K-FAC chained with that optimizer at the tuned rate, under the KAISA
   reference's step rule (`FORMS_STEP`), every other argument at its default,
   for each damping form (`FORMS`) and each damping in `DAMPINGS`, from the
   same seeds;
3. K-FAC at its defaults (`kaisa_jax.kfac` given only ``layers`` and ``lr``;
   the damping form ``"bounded"``) with its own learning rate, tuned by the
   same rule on the same grid, then each damping of `DAMPINGS` at that rate
   (`tune_kfac`). The targets are read from these runs (`targets`): at its
   defaults K-FAC ends at or below the baseline, and every damping from 1e-4
   to 1e-1 within 2x of the best.

The final loss of a run is the mean training loss of its last
`experiments.suite.TAIL` steps (minibatch losses, dropout included). Every run
starts from the seed's initialisation and visits the seed's batches in the same
order. A run whose loss becomes non-finite counts as diverged (an infinite
final loss). Each K-FAC run also records, after its last step, the smallest and
largest relative damping over its layers and the largest condition number
(`kaisa_jax.curvature_statistics`).

The runs of one problem and optimizer are one compiled program
(``jax.lax.scan`` over the steps, learning rate and damping as arguments), so
the grid costs one compilation per problem and form.

Results go to ``benchmarks/results/robustness.json`` (``--out`` another file);
``--table`` prints the tables from it without training (`report`): K-FAC at
its defaults and its own rate against the baseline, over the dampings, and the
targets (`readme`, also README.md's block); per form,
K-FAC's final loss over the tuned baseline's for each problem and damping; per
form and damping, the wins and the worst and typical ratio over the problems;
per form, the spread over `DAMPINGS`; the runs grouped by their relative
damping. ``--page`` writes them into docs/benchmarks/robustness.md (its block
``robustness``) and README.md (``robustness targets``, `benchmarks.generated`),
``--figure PATH`` draws them.

Final losses this close to zero depend on the CPU's rounding (its vector
width changes the order of XLA's sums), and a training run amplifies that:
``--forms --out benchmarks/results/robustness_rerun.json`` on another machine
trains the baselines and K-FAC at its defaults again, and the tables then show
both runs side by side (`rerun_table`; ``--rerun`` names another file). Each
results file records the CPU it was trained on (`machine`).

``--kl-clips 0.01 none --problems lstm ...`` trains, for problems already
in the results, K-FAC at its defaults but for each KL clip (`tune_clip`; a
table of its own, `clip_table`). ``--tune-at 0.01`` tunes K-FAC at its
defaults at damping 0.01 instead (``tuned_0.01``, a step rule's column of
`clip_table` and `rule_spread_table`, and beside the defaults in the figure
and the curvature tables). ``--curvature-warmup 100`` tunes K-FAC at its
defaults but for ``curvature_warmup=100`` (`WARMUP`, a step rule's column of
the same two tables), and ``--damping-form pi`` for ``damping_form="pi"``, the
default before ``"bounded"`` (`FORMER_DEFAULT`, likewise, and its verdicts beside
the defaults').

Run: ``python benchmarks/robustness.py [--problems vit gru ...] [--seeds 3]``
(about two and a half hours on 2 CPU cores for the whole suite); more dampings
for some forms, keeping the tuned baselines and K-FAC's tuned runs: ``--forms pi
relative --dampings 1 10 100 --reuse-baseline``; only step 3, keeping the rest:
``--forms --reuse-baseline``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kaisa_jax
from benchmarks import generated
from experiments import optimizers, suite
from kaisa_jax import preconditioning

RESULTS = Path(__file__).parent / "results" / "robustness.json"
# The same benchmark but for the forms at the baseline's rate (``--forms``), run again on another
# CPU: how much of a verdict is the machine's rounding (`rerun_table`).
RERUN = Path(__file__).parent / "results" / "robustness_rerun.json"
STEPS = 300
DAMPINGS = (1e-4, 1e-3, 1e-2, 1e-1)
FORMS = ("relative", "pi", "bounded", "kaisa")
LEARNING_RATES = {"sgd": (0.01, 0.03, 0.1, 0.3), "adamw": (3e-4, 1e-3, 3e-3, 1e-2)}
MAX_EXTENSIONS = 3
# The targets: K-FAC's final loss at its defaults at most this times the tuned baseline's (1), and
# every damping of `DAMPINGS` within this times the best one's (2).
TARGET_RATIO = 1.0
TARGET_SPREAD = 2.0
# The step rule the forms were compared under at the baseline's rate (step 2): the KAISA
# reference's KL clip, the default when they were trained, as the experiments keep it.
FORMS_STEP = optimizers.STEP_RULE
# The default damping form before ``"bounded"``, under which the step rules were compared
# (``--tune-at``, ``--curvature-warmup``, ``--kl-clips`` pin it, so that a rerun trains what their
# columns hold).
FORMER_FORM = preconditioning.PI
STEP_RULES_FORM = {"damping_form": FORMER_FORM}


def curvature_summary(stats: kaisa_jax.CurvatureStatistics) -> dict[str, float]:
  """The extremes over layers of the relative damping and the condition number."""
  relative = [float(s.relative_damping) for s in stats.layers.values()]
  condition = [float(s.condition) for s in stats.layers.values()]
  return {
    "min_relative_damping": min(relative),
    "max_relative_damping": max(relative),
    "max_condition": max(condition),
  }


def train_seeds(
  run, problem: suite.Problem, seeds: int, lr: float, damping: float | None
) -> tuple[list[float], list[dict[str, float]]]:
  """Final losses over the seeds, and for K-FAC the curvature after each run's last step."""
  losses, curvature = [], []
  for seed in range(seeds):
    params, state = problem.init(jax.random.key(seed))
    order = suite.batch_order(len(problem.train[0]), problem.batch_size, STEPS, seed)
    damp = None if damping is None else jnp.float32(damping)
    per_step, stats = run(params, state, order, jnp.float32(lr), damp)
    losses.append(suite.final_loss(np.asarray(per_step)))
    if stats is not None:
      curvature.append(curvature_summary(stats))
  return losses, curvature


def mean(values: list[float]) -> float:
  return float(np.mean(values)) if all(map(math.isfinite, values)) else math.inf


def tune_lr(
  run, problem: suite.Problem, seeds: int, log, label: str, damping: float | None = None
) -> dict[str, list[float]]:
  """Final losses per learning rate; the grid grows past a winning end.

  The grid starts at `LEARNING_RATES` of the problem's optimizer; whenever its lowest or
  highest rate wins (the lowest mean final loss over the seeds), one more rate, a third or three
  times that end, is trained, at most `MAX_EXTENSIONS` times.
  """
  grid = list(LEARNING_RATES[problem.optimizer])
  results: dict[str, list[float]] = {}
  for _ in range(MAX_EXTENSIONS + 1):
    for lr in grid:
      if repr(lr) not in results:
        results[repr(lr)] = train_seeds(run, problem, seeds, lr, damping)[0]
        log(f"  {label} lr={lr:g}: {mean(results[repr(lr)]):.4g}")
    best = min(grid, key=lambda lr: mean(results[repr(lr)]))
    if best == grid[0]:
      grid.insert(0, float(f"{grid[0] / 3:.3g}"))
    elif best == grid[-1]:
      grid.append(float(f"{grid[-1] * 3:.3g}"))
    else:
      break
  return results


def best_lr(by_lr: dict[str, list[float]]) -> float:
  """The learning rate of the lowest mean final loss."""
  return float(min(by_lr, key=lambda k: mean(by_lr[k])))


def tune_kfac(
  problem: suite.Problem,
  seeds: int,
  log,
  damping: float | None = None,
  kfac: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """K-FAC at its defaults (`kaisa_jax.kfac` given only ``layers`` and ``lr``, and ``kfac`` if
  given; the entry records them with the damping form in effect): its learning rate
  tuned by the baseline's rule (`tune_lr`) at the default damping (or at ``damping``), then every
  damping of `DAMPINGS` at that rate, each with the curvature after its runs' last step (the
  tuning damping's runs trained again for it: the same program, seeds and rate, so the same
  losses)."""
  run = suite.make_run(problem, kfac or {})
  step_norm = (kfac or {}).get("step_norm", preconditioning.GRADIENT)
  default = preconditioning.DEFAULT_DAMPING if damping is None else damping
  by_lr = tune_lr(run, problem, seeds, log, "kfac (defaults)", default)
  lr = best_lr(by_lr)
  dampings, curvature = {}, {}
  for d in sorted({*DAMPINGS, default}):
    dampings[repr(d)], curvature[repr(d)] = train_seeds(run, problem, seeds, lr, d)
    log(f"  kfac (defaults) lr={lr:g} damping={d:g}: {mean(dampings[repr(d)]):.4g}")
  return {
    "by_lr": by_lr,
    "lr": lr,
    "damping": default,
    "dampings": dampings,
    "curvature": curvature,
    "machine": machine(),
    "kfac": {"damping_form": preconditioning.default_form(step_norm), **(kfac or {})},
  }


def tune_clip(problem: suite.Problem, seeds: int, log, kl_clip: float | None) -> dict[str, Any]:
  """K-FAC at its defaults but for ``kl_clip``: final losses per learning rate, the rate tuned by
  the baseline's rule (`tune_lr`)."""
  run = suite.make_run(problem, {"step_norm": "natural", "kl_clip": kl_clip, **STEP_RULES_FORM})
  label = f"kfac (defaults, kl_clip={kl_clip})"
  return tune_lr(run, problem, seeds, log, label, preconditioning.DEFAULT_DAMPING)


def run_problem(
  name: str,
  seeds: int,
  log,
  forms: tuple[str, ...] = FORMS,
  dampings: tuple[float, ...] = DAMPINGS,
  previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Tunes the baseline (or reuses ``previous``'s), trains K-FAC at ``forms`` x ``dampings`` at the
  baseline's rate, and K-FAC at its defaults at its own tuned rate (`tune_kfac`; kept from
  ``previous`` where it has them and ``forms`` are given)."""
  problem = suite.SUITE[name]()
  start = time.perf_counter()
  out = {"kfac": {}, "curvature": {}, "seconds": 0.0, **(previous or {})}
  if previous is None:
    out["baseline"] = tune_lr(suite.make_run(problem, None), problem, seeds, log, problem.optimizer)
    out |= {"optimizer": problem.optimizer, "lr": best_lr(out["baseline"])}
  log(f"  tuned {problem.optimizer} lr={out['lr']}: {mean(out['baseline'][repr(out['lr'])]):.4g}")
  for form in forms:
    run = suite.make_run(problem, {"damping_form": form, **FORMS_STEP})
    for damping in dampings:
      key = repr(damping)
      losses, curvature = train_seeds(run, problem, seeds, out["lr"], damping)
      out["kfac"].setdefault(form, {})[key] = losses
      out["curvature"].setdefault(form, {})[key] = curvature
      log(f"  kfac {form} damping={damping:g}: {mean(losses):.4g}")
  if not (forms and previous and "tuned" in previous):
    out["tuned"] = tune_kfac(problem, seeds, log)
  out["seconds"] += time.perf_counter() - start
  return out


def load(path: Path) -> dict[str, Any]:
  return json.loads(path.read_text()) if path.exists() else {"problems": {}}


def machine() -> str:
  """The CPU's model name, core count and vector extensions, from ``/proc/cpuinfo``."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return "unknown"
  fields = {}
  for line in text.splitlines():
    key, colon, value = line.partition(":")
    if colon:
      fields.setdefault(key.strip(), value.strip())
  flags = fields.get("flags", "").split()
  vector = [f for f in ("avx", "avx2", "fma", "avx512f") if f in flags]
  cores = text.count("processor\t:")
  return f"{fields.get('model name', 'unknown')}, {cores} cores, {' '.join(vector)}"


def save(results: dict[str, Any], path: Path) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(results, indent=1) + "\n")


def _ratio(x: float) -> str:
  return "diverged" if not math.isfinite(x) else f"{x:.2g}"


def dampings_of(results: dict[str, Any], form: str) -> list[float]:
  """Every damping measured for ``form`` on some problem, in increasing order."""
  keys = {k for r in results["problems"].values() for k in r["kfac"].get(form, {})}
  return sorted(float(k) for k in keys)


def measured_forms(results: dict[str, Any]) -> list[str]:
  """The forms of `FORMS` trained at the baseline's rate on some problem."""
  return [form for form in FORMS if dampings_of(results, form)]


def ratio(r: dict[str, Any], form: str, damping: float) -> float:
  """K-FAC's mean final loss over the tuned baseline's (NaN where not measured)."""
  losses = r["kfac"].get(form, {}).get(repr(damping))
  if losses is None:
    return math.nan
  return mean(losses) / mean(r["baseline"][repr(r["lr"])])


def form_table(results: dict[str, Any], form: str) -> str:
  """K-FAC's final loss over the tuned baseline's, per problem and damping, for one form."""
  dampings = dampings_of(results, form)
  lines = [
    "| model | baseline: lr, final loss | " + " | ".join(f"{d:g}" for d in dampings) + " |",
    "|---|---|" + "---:|" * len(dampings),
  ]
  for name, r in results["problems"].items():
    base = mean(r["baseline"][repr(r["lr"])])
    cells = ["" if math.isnan(x) else _ratio(x) for x in (ratio(r, form, d) for d in dampings)]
    lines.append(
      f"| {name} | {r['optimizer']} {r['lr']:g}, {base:.3g} | " + " | ".join(cells) + " |"
    )
  return "\n".join(lines)


def summary_table(results: dict[str, Any]) -> str:
  """Per form and damping, over the problems: K-FAC's wins, its worst and its typical ratio."""
  problems = results["problems"]
  lines = [
    "| form | damping | K-FAC <= baseline | worst ratio (model) | geometric mean ratio |",
    "|---|---:|---|---|---:|",
  ]
  for form in measured_forms(results):
    for d in dampings_of(results, form):
      at = {name: ratio(r, form, d) for name, r in problems.items()}
      at = {name: x for name, x in at.items() if not math.isnan(x)}
      worst = max(at, key=at.get)
      wins = sum(x <= 1.0 for x in at.values())
      logs = [math.log(x) for x in at.values()]
      typical = math.exp(float(np.mean(logs))) if all(map(math.isfinite, logs)) else math.inf
      lines.append(
        f"| {form} | {d:g} | {wins} of {len(at)} | {_ratio(at[worst])} ({worst}) "
        f"| {_ratio(typical)} |"
      )
  return "\n".join(lines)


def spread_table(results: dict[str, Any]) -> str:
  """Per form and problem, over `DAMPINGS`: the worst damping's final loss over the best's
  (empty where a problem was not trained at every damping of the form)."""
  problems = results["problems"]
  lines = [
    "| form | " + " | ".join(problems) + " | worst |",
    "|---|" + "---:|" * (len(problems) + 1),
  ]
  for form in measured_forms(results):
    spreads = []
    for r in problems.values():
      at = r["kfac"].get(form, {})
      finals = [mean(at[repr(d)]) for d in DAMPINGS if repr(d) in at]
      spreads.append(max(finals) / min(finals) if len(finals) == len(DAMPINGS) else math.nan)
    cells = ["" if math.isnan(x) else _ratio(x) for x in spreads]
    worst = max((x for x in spreads if not math.isnan(x)), default=math.nan)
    last = "" if math.isnan(worst) else _ratio(worst)  # no problem trained at every damping
    lines.append(f"| {form} | " + " | ".join(cells) + f" | {last} |")
  return "\n".join(lines)


def _with_range(losses: list[float]) -> str:
  """The mean over the seeds, with their lowest and highest."""
  if not all(map(math.isfinite, losses)):
    return "diverged"
  return f"{mean(losses):.3g} ({min(losses):.3g} to {max(losses):.3g})"


def tuned_rows(results: dict[str, Any], key: str = "tuned") -> dict[str, dict[str, float]]:
  """Per problem with K-FAC tuned (`tune_kfac`; ``key``: its runs, ``"tuned_kl_clip"`` those at the
  KL clip's former defaults): K-FAC's final loss at each of `DAMPINGS` over the baseline's
  (``ratios``), at its default damping (``ratio``), and the worst over the best final loss across
  `DAMPINGS` (``spread``)."""
  rows = {}
  for name, r in results["problems"].items():
    if key in r:
      t = r[key]
      base = mean(r["baseline"][repr(r["lr"])])
      finals = [mean(t["dampings"][repr(d)]) for d in DAMPINGS]
      default = mean(t["dampings"][repr(t["damping"])])
      rows[name] = {
        "ratios": [f / base for f in finals],
        "ratio": default / base,
        "spread": max(finals) / min(finals),
      }
  return rows


def tuned_table(results: dict[str, Any]) -> str:
  """K-FAC at its defaults, at its own tuned rate, against the tuned baseline; and over the
  dampings at that rate."""
  rows = tuned_rows(results)
  lines = [
    "| model | baseline: lr, final loss (seeds' range) | K-FAC: lr, final loss (seeds' range) "
    "| ratio | " + " | ".join(f"damping {d:g}" for d in DAMPINGS) + " | worst over best |",
    "|---|---|---|---:|" + "---:|" * (len(DAMPINGS) + 1),
  ]
  for name, row in rows.items():
    r = results["problems"][name]
    t = r["tuned"]
    cells = [_ratio(x) for x in row["ratios"]]
    lines.append(
      f"| {name} | {r['optimizer']} {r['lr']:g}, {_with_range(r['baseline'][repr(r['lr'])])} "
      f"| {t['lr']:g}, {_with_range(t['dampings'][repr(t['damping'])])} | {_ratio(row['ratio'])} | "
      + " | ".join(cells)
      + f" | {_ratio(row['spread'])} |"
    )
  return "\n".join(lines)


def _verdict(rows: dict[str, dict[str, float]], key: str, bound: float) -> str:
  """On how many problems ``row[key]`` is at most ``bound``, and the misses."""
  misses = {name: row[key] for name, row in rows.items() if not row[key] <= bound}
  text = f"met on {len(rows) - len(misses)} of {len(rows)}"
  if misses:
    # Three digits: a miss by 2 % must not read as the bound itself.
    text += "; missed on " + ", ".join(
      f"{n} ({x:.3g}x)" if math.isfinite(x) else f"{n} (diverged)" for n, x in misses.items()
    )
  return text


def targets(results: dict[str, Any], key: str = "tuned") -> str:
  """Which problems meet each target, from K-FAC at its own tuned rate (``results[key]``), and on
  how many that rate is the baseline's."""
  rows = tuned_rows(results, key)
  same = [n for n in rows if results["problems"][n][key]["lr"] == results["problems"][n]["lr"]]
  return (
    f"- K-FAC's tuned learning rate is the baseline's on {len(same)} of {len(rows)}.\n"
    "- Target 1, K-FAC at its defaults (only the learning rate chosen, on the baseline's grid) at "
    "or below the "
    f"tuned baseline's final loss: {_verdict(rows, 'ratio', TARGET_RATIO)}.\n"
    "- Target 2, at that rate, every damping from 1e-4 to 1e-1 within 2x of the best one's "
    f"final loss: {_verdict(rows, 'spread', TARGET_SPREAD)}."
  )


def _verdicts(rows: dict[str, dict[str, float]]) -> str:
  """Both targets' verdicts over ``rows`` (`tuned_rows`), as one clause."""
  return (
    f"target 1 {_verdict(rows, 'ratio', TARGET_RATIO)}; target 2 "
    f"{_verdict(rows, 'spread', TARGET_SPREAD)}"
  )


def former_targets(results: dict[str, Any]) -> str:
  """The targets' verdicts for the former default form at its own tuned rate (`FORMER_DEFAULT`),
  on the problems it was run on; empty where it was run on none."""
  rows = tuned_rows(results, FORMER_DEFAULT)
  if not rows:
    return ""
  return (
    f'- With the former default `damping_form="{FORMER_FORM}"` (run on {len(rows)} of '
    f"{len(results['problems'])}), its rate tuned alike: {_verdicts(rows)}."
  )


def _tuned_ratio(by_lr: dict[str, list[float]] | None, base: float) -> str:
  """The best rate's mean final loss over ``base``, and that rate (empty if not measured)."""
  if by_lr is None:
    return ""
  lr = best_lr(by_lr)
  return f"{_ratio(mean(by_lr[repr(lr)]) / base)} (lr {lr:g})"


# The defaults but for ``damping_form="pi"``, the default before ``"bounded"`` (``--damping-form
# pi``; the entry records it under ``kfac``). Every other tuning but ``tuned`` ran with it.
FORMER_DEFAULT = f"tuned_{FORMER_FORM}"
# The tunings at the default step rule and ``"pi"`` (`STEP_RULES`): the rate tuned at the default
# damping and at 0.01.
DEFAULT_RULE_TUNINGS = (FORMER_DEFAULT, "tuned_0.01")
# The same but for `kaisa_jax.kfac`'s ``curvature_warmup`` (``--curvature-warmup``; the entry
# records it under ``kfac``).
WARMUP = "tuned_warmup"
# The tunings run on some problems only: their cells are left empty where they were not.
PARTIAL_RULES = (WARMUP,)
# The step rules measured with their own tuned rate (`tune_kfac`), each at the damping its entry
# records: the defaults, each layer given its gradient's norm and the damping bounded by its
# curvature (``tuned``); the rest with the damping form ``"pi"``: each layer's gradient norm
# (`FORMER_DEFAULT`), the same with the curvature refreshed at every step of a warmup (`WARMUP`)
# and with its rate tuned at a damping of 0.01 instead (``tuned_0.01``); one norm for all layers
# together, the default before (``tuned_global``); and K-FAC's own step under the KAISA
# reference's KL clip, the default before that (``tuned_kl_clip``).
STEP_RULES = {
  "tuned": f"each layer's gradient norm, {preconditioning.DEFAULT_FORM} (default)",
  FORMER_DEFAULT: f"each layer's gradient norm, {FORMER_FORM}",
  WARMUP: f"each layer's gradient norm, {FORMER_FORM}, curvature warmup",
  "tuned_0.01": f"each layer's gradient norm, {FORMER_FORM}",
  "tuned_global": f"all layers' gradient norm as one, {FORMER_FORM}",
  "tuned_kl_clip": f"natural, kl_clip 0.001 (KAISA), {FORMER_FORM}",
}
# The step rules run on every problem that has the step rules' table.
FULL_RULES = tuple(k for k in STEP_RULES if k not in PARTIAL_RULES)


def _one_damping(found: set[float], what: str) -> float | None:
  """The one damping in ``found`` (``None`` if empty); several cannot share a table column."""
  if len(found) > 1:
    raise ValueError(f"{what} were tuned at several dampings: {sorted(found)}")
  return found.pop() if found else None


def tuned_damping(results: dict[str, Any], key: str = "tuned") -> float | None:
  """The damping at which the runs under ``key`` were tuned (the same on every problem), or
  ``None`` where no problem has them."""
  found = {r[key]["damping"] for r in results["problems"].values() if key in r}
  return _one_damping(found, f"the runs under {key!r}")


def _rule_labels(results: dict[str, Any]) -> list[str]:
  """Each step rule of `STEP_RULES` with the damping its rate was tuned at."""
  dampings = {k: tuned_damping(results, k) for k in STEP_RULES}
  warmups = {
    r[WARMUP]["kfac"]["curvature_warmup"] for r in results["problems"].values() if WARMUP in r
  }
  warmup = _one_damping(warmups, "the curvature warmups")  # one number, as a damping is
  labels = dict(STEP_RULES)
  if warmup is not None:
    labels[WARMUP] = f"{labels[WARMUP]} {warmup:g}"
  return [
    label if dampings[k] is None else f"{label}, damping {dampings[k]:g}"
    for k, label in labels.items()
  ]


def clip_table(results: dict[str, Any]) -> str:
  """K-FAC at its defaults and under the other step rules of `STEP_RULES`, then with K-FAC's own
  step (``step_norm="natural"``) under each other KL clip (`tune_clip`), each at its own tuned
  rate, over the tuned baseline; a rule not run on a problem is left empty."""
  measured = {
    name: r
    for name, r in results["problems"].items()
    if "kl_clip" in r and "tuned" in r and "tuned_kl_clip" in r
  }
  keys = {k for r in measured.values() for k in r["kl_clip"]}
  clips = sorted(keys, key=lambda k: (k == "None", 0.0 if k == "None" else float(k)))
  damping = _one_damping({r["kl_clip_damping"] for r in measured.values()}, "the KL clips")
  at = f", {FORMER_FORM}" + ("" if damping is None else f", damping {damping:g}")
  lines = [
    "| model | baseline: lr, final loss | "
    + " | ".join(
      _rule_labels(results)
      + [("natural, no clip" if k == "None" else f"natural, kl_clip {k}") + at for k in clips]
    )
    + " |",
    "|---|---|" + "---:|" * (len(STEP_RULES) + len(clips)),
  ]
  for name, r in measured.items():
    base = mean(r["baseline"][repr(r["lr"])])
    cells = [r[k]["by_lr"] if k in r else None for k in STEP_RULES]
    cells += [r["kl_clip"].get(k) for k in clips]
    lines.append(
      f"| {name} | {r['optimizer']} {r['lr']:g}, {base:.3g} | "
      + " | ".join(_tuned_ratio(c, base) for c in cells)
      + " |"
    )
  return "\n".join(lines)


def rule_spread_table(results: dict[str, Any]) -> str:
  """Per problem and step rule of `STEP_RULES`, at the rule's tuned rate: the worst over the best
  final loss across `DAMPINGS` (`tuned_rows`), and the target's verdict per rule."""
  rows = {key: tuned_rows(results, key) for key in STEP_RULES}
  # The problems every full rule ran on (the partial ones' cells left empty where they did not).
  names = [n for n in results["problems"] if all(n in rows[k] for k in FULL_RULES)]
  lines = [
    "| model | " + " | ".join(_rule_labels(results)) + " |",
    "|---|" + "---:|" * len(STEP_RULES),
  ]
  for name in names:
    cells = [_ratio(rows[k][name]["spread"]) if name in rows[k] else "" for k in STEP_RULES]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  within = " | ".join(
    str(sum(rows[k][n]["spread"] <= TARGET_SPREAD for n in names if n in rows[k]))
    + f" of {sum(n in rows[k] for n in names)}"
    for k in STEP_RULES
  )
  lines.append(f"| within 2x | {within} |")
  return "\n".join(lines)


def _median_ratio(r: dict[str, Any], key: str) -> float:
  """K-FAC tuned (``r[key]``) over the tuned baseline, each the median of its seeds' final losses."""
  kfac = r[key]["dampings"][repr(r[key]["damping"])]
  return float(np.median(kfac) / np.median(r["baseline"][repr(r["lr"])]))


def rerun_key(rerun: dict[str, Any]) -> str:
  """Which tuning the rerun holds: K-FAC at today's defaults (``"tuned"``) where it trained them on
  every problem, else at the KL clip's former ones (``"tuned_kl_clip"``)."""
  problems = rerun["problems"].values()
  return "tuned" if problems and all("tuned" in r for r in problems) else "tuned_kl_clip"


def rerun_table(results: dict[str, Any], rerun: dict[str, Any]) -> str:
  """K-FAC at its defaults against the tuned baseline, as ``results`` and ``rerun`` (the same
  code and seeds on another CPU) measured it: the rates each tuned, the ratio of the seeds' mean
  final losses (the targets') and of their medians, which one seed's spike does not move, and
  the spread over the dampings; then the targets as read from ``rerun``. Compares the runs of
  `rerun_key`."""
  key = rerun_key(rerun)
  first, second = tuned_rows(results, key), tuned_rows(rerun, key)
  lines = [
    "| model | baseline lr | K-FAC lr | ratio | ratio of the medians | worst over best |",
    "|---|---|---|---|---|---|",
  ]
  for name in (n for n in first if n in second):
    a, b = results["problems"][name], rerun["problems"][name]
    lines.append(
      f"| {name} | {a['lr']:g}, {b['lr']:g} | {a[key]['lr']:g}, {b[key]['lr']:g} "
      f"| {_ratio(first[name]['ratio'])}, {_ratio(second[name]['ratio'])} "
      f"| {_ratio(_median_ratio(a, key))}, {_ratio(_median_ratio(b, key))} "
      f"| {_ratio(first[name]['spread'])}, {_ratio(second[name]['spread'])} |"
    )
  return (
    "\n".join(lines)
    + "\n\n"
    + _agreement(results, rerun)
    + " Read from the second run:\n\n"
    + targets(rerun, key)
    + "\n- Target 1 by the ratio of the seeds' medians, in both runs: "
    + _median_verdict(results, rerun)
    + "."
  )


def run_pairs(results: dict[str, Any], rerun: dict[str, Any]) -> list[tuple[float, float]]:
  """The final losses of every run both trained, first run's and rerun's: each seed of each rate
  of the baseline and of K-FAC at its defaults, and of each damping where both tuned K-FAC to the
  same rate."""
  pairs = []
  key = rerun_key(rerun)
  for name, a in results["problems"].items():
    b = rerun["problems"].get(name)
    if b is None or key not in a or key not in b:
      continue
    groups = [(a["baseline"], b["baseline"]), (a[key]["by_lr"], b[key]["by_lr"])]
    if a[key]["lr"] == b[key]["lr"]:  # the default's runs are by_lr's: not twice
      default = repr(a[key]["damping"])
      groups.append(
        tuple({k: v for k, v in t["dampings"].items() if k != default} for t in (a[key], b[key]))
      )
    for x, y in groups:
      for run in x.keys() & y.keys():
        pairs += zip(x[run], y[run], strict=True)
  return pairs


def _agreement(results: dict[str, Any], rerun: dict[str, Any]) -> str:
  """How many runs both trained ended bit for bit alike, within 10 %, and more than 2x apart."""
  pairs = run_pairs(results, rerun)

  def apart(a: float, b: float) -> float:
    if a == b:
      return 1.0
    if min(a, b) <= 0 or not all(map(math.isfinite, (a, b))):
      return math.inf
    return max(a, b) / min(a, b)

  factors = [apart(a, b) for a, b in pairs]
  return (
    f"Of the {len(pairs)} runs both trained (every rate and damping, every seed), "
    f"{sum(f <= 1.1 for f in factors)} ended within 10 % of each other, "
    f"{sum(f == 1.0 for f in factors)} of them bit for bit, and {sum(f > 2.0 for f in factors)} "
    "more than 2x apart."
  )


def _median_verdict(results: dict[str, Any], rerun: dict[str, Any]) -> str:
  """Target 1 read from `_median_ratio` in both runs: where both meet it, where both miss it,
  where they disagree."""
  key = rerun_key(rerun)
  second = tuned_rows(rerun, key)
  both = [n for n in tuned_rows(results, key) if n in second]
  pairs = {
    n: (_median_ratio(results["problems"][n], key), _median_ratio(rerun["problems"][n], key))
    for n in both
  }
  met = [n for n, (a, b) in pairs.items() if a <= 1.0 and b <= 1.0]
  missed = [n for n, (a, b) in pairs.items() if a > 1.0 and b > 1.0]
  split = [n for n in both if n not in met and n not in missed]

  def named(names: list[str]) -> str:
    return ", ".join(f"{n} ({pairs[n][0]:.3g}x, {pairs[n][1]:.3g}x)" for n in names)

  text = f"met on {len(met)} of {len(both)}"
  if missed:
    text += f"; missed on {named(missed)}"
  if split:
    text += f"; met in one run only on {named(split)}"
  return text


def _rerun_subject(rerun: dict[str, Any]) -> str:
  if rerun_key(rerun) == "tuned":
    return "K-FAC at its defaults"
  return (
    "K-FAC at the former defaults (the KAISA reference's KL clip, "
    f"{', '.join(f'`{k}={v!r}`' for k, v in FORMS_STEP.items())})"
  )


def _machines(results: dict[str, Any], rerun: dict[str, Any]) -> str:
  return (
    f"first run: {results.get('machine', 'CPU not recorded')}; "
    f"second run: {rerun.get('machine', 'CPU not recorded')}"
  )


def same_cpu(results: dict[str, Any], rerun: dict[str, Any]) -> str:
  """Where ``results``' K-FAC runs were trained on ``rerun``'s CPU but its baselines were not:
  target 1 against the rerun's baselines, by the seeds' means and medians (empty otherwise)."""
  cpu = rerun.get("machine")
  problems = {
    n: r
    for n, r in results["problems"].items()
    if "tuned" in r and n in rerun["problems"] and "baseline" in rerun["problems"][n]
  }
  if not problems or results.get("machine") == cpu:
    return ""
  if any(r["tuned"].get("machine") != cpu for r in problems.values()):
    return ""
  means, medians = {}, {}
  for n, r in problems.items():
    b = rerun["problems"][n]
    kfac = r["tuned"]["dampings"][repr(r["tuned"]["damping"])]
    base = b["baseline"][repr(b["lr"])]
    means[n] = {"ratio": mean(kfac) / mean(base)}
    medians[n] = {"ratio": float(np.median(kfac) / np.median(base))}
  return (
    f"- K-FAC's runs above were trained on {cpu}, the baselines on the first run's CPU; against "
    "the baselines trained again on the same CPU as K-FAC (the rerun's), target 1 is "
    f"{_verdict(means, 'ratio', 1.0)}; by the ratio of the seeds' medians, "
    f"{_verdict(medians, 'ratio', 1.0)}."
  )


def readme(results: dict[str, Any], rerun: dict[str, Any] | None = None) -> str:
  """K-FAC at its defaults against each tuned baseline, and the targets (README's block); with
  ``rerun``, the targets as read from it."""
  text = tuned_table(results) + "\n\n" + targets(results)
  for line in (former_targets(results), same_cpu(results, rerun) if rerun is not None else ""):
    if line:
      text += "\n" + line
  if rerun is not None:
    rows = tuned_rows(rerun, rerun_key(rerun))
    text += (
      f"\n- {_rerun_subject(rerun)}, trained again on another CPU, same code and seeds: "
      f"{_verdicts(rows)}. Target 1 by the ratio of the seeds' medians, "
      f"in both runs: {_median_verdict(results, rerun)}."
    )
  return text


# Decades of the relative damping by which `curvature_table` groups the runs.
DECADES = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4)


def _curvature_runs(results: dict[str, Any], source: str):
  """Each K-FAC run's final loss over its baseline's and its curvature after the last step: the
  forms' runs at the baseline's rate (``source="forms"``) or those at the default step rule at
  their own tuned rates (``"tuned"``: every tuning of `DEFAULT_RULE_TUNINGS` that recorded it)."""
  for r in results["problems"].values():
    base = mean(r["baseline"][repr(r["lr"])])
    if source == "tuned":
      keys = [k for k in DEFAULT_RULE_TUNINGS if "curvature" in r.get(k, {})]
      by_damping = {k: (r[k]["curvature"], r[k]["dampings"]) for k in keys}
    else:
      by_damping = {f: (c, r["kfac"][f]) for f, c in r.get("curvature", {}).items()}
    for curvature, losses in by_damping.values():
      for d, runs in curvature.items():
        for loss, c in zip(losses[d], runs, strict=True):
          yield loss / base, c


def curvature_table(results: dict[str, Any], key: str, source: str = "forms") -> str:
  """K-FAC runs of ``source`` (`_curvature_runs`) grouped by ``key`` (the smallest or largest
  relative damping over the layers after the last step): how many, and how their final loss
  compares with the baseline's."""
  groups: dict[int, list[float]] = {}
  for ratio_, c in _curvature_runs(results, source):
    at = int(np.searchsorted(DECADES, c[key], side="right"))
    groups.setdefault(at, []).append(ratio_)
  edges = ["0", *(f"{x:g}" for x in DECADES), "inf"]
  lines = [
    "| relative damping | runs | median ratio | runs worse than 2x the baseline |",
    "|---|---:|---:|---:|",
  ]
  for at in sorted(groups):
    x = groups[at]
    worse = sum(v > 2.0 for v in x)
    lines.append(
      f"| [{edges[at]}, {edges[at + 1]}) | {len(x)} | {_ratio(float(np.median(x)))} "
      f"| {worse} ({100 * worse / len(x):.0f} %) |"
    )
  return "\n".join(lines)


def report(results: dict[str, Any], rerun: dict[str, Any] | None = None) -> str:
  """Every table, as Markdown (what ``--table`` prints and the block ``robustness`` holds); with
  ``rerun``, `rerun_table` after the targets."""
  parts = [
    f"{results['seeds']} seeds, {results['steps']} steps, final loss the mean of the last "
    f"{results['tail']}; each cell: K-FAC's mean final loss over the tuned baseline's "
    "(below 1: K-FAC ahead).",
  ]
  tuned = tuned_rows(results)
  if tuned:
    parts += [
      "K-FAC at its defaults (step norm the gradient's, damping form "
      f"`{preconditioning.DEFAULT_FORM}`, damping {tuned_damping(results):g}), its "
      "learning rate tuned on the baseline's grid by the same rule; ratio: its final loss over the "
      "baseline's; then each damping at that rate, over the baseline's:",
      tuned_table(results),
      targets(results)
      + ("\n" + line if (line := former_targets(results)) else "")
      + ("\n" + line if rerun is not None and (line := same_cpu(results, rerun)) else ""),
    ]
  if tuned and rerun is not None:
    parts += [
      f"{_rerun_subject(rerun)}, the same comparison trained again, same code and seeds, on "
      f"another CPU ({_machines(results, rerun)}); each cell: the first run's, then the second's:",
      rerun_table(results, rerun),
    ]
  if any("kl_clip" in r for r in results["problems"].values()):
    parts += [
      "K-FAC at its defaults (each layer's step given its gradient's norm, the damping bounded by "
      'each layer\'s mean curvature), then with the former default `damping_form="pi"`: alone, '
      "with the curvature refreshed at every step of a warmup (`curvature_warmup`), with one "
      "norm for all layers together (the default before), then with K-FAC's own step length "
      '(`step_norm="natural"`) under each KL clip (`kl_clip`; 1e-3 the KAISA reference\'s, this '
      "library's default before the gradient's norm), each learning rate tuned by the same rule; "
      "each cell its final loss over the baseline's, and its rate:",
      clip_table(results),
    ]
  if any(all(k in r for k in FULL_RULES) for r in results["problems"].values()):
    parts += [
      "Worst over best final loss across dampings 1e-4 to 1e-1, each step rule at its own tuned "
      "rate:",
      rule_spread_table(results),
    ]
  if any(r.get(FORMER_DEFAULT, {}).get("curvature") for r in results["problems"].values()):
    runs = sum(1 for _ in _curvature_runs(results, "tuned"))
    parts += [
      'K-FAC at its defaults but for `damping_form="pi"` (unbounded), each damping at the rate '
      "tuned at the default damping and at the rate tuned at 0.01 (the step rules' table), "
      f"{runs} runs, by the smallest relative damping over their layers after the last step:",
      curvature_table(results, "min_relative_damping", "tuned"),
      "The same runs by the largest relative damping over their layers:",
      curvature_table(results, "max_relative_damping", "tuned"),
    ]
  forms = measured_forms(results)
  if not forms:  # a rerun (``--forms``): K-FAC at its own rate only
    return "\n\n".join(parts)
  if tuned:
    parts += [
      "The tables below run K-FAC at the baseline's learning rate, with the KAISA reference's "
      f"step rule ({', '.join(f'`{k}={v!r}`' for k, v in FORMS_STEP.items())}), the default "
      "when the forms were compared."
    ]
  for form in forms:
    parts += [f"Damping form `{form}`:", form_table(results, form)]
  parts += [
    "Over the models, per form and damping:",
    summary_table(results),
    "Worst over the damping range 1e-4..1e-1 of each model's final loss over its best:",
    spread_table(results),
    "Runs by the smallest relative damping over their layers after the last step:",
    curvature_table(results, "min_relative_damping"),
    "Runs by the largest relative damping over their layers after the last step:",
    curvature_table(results, "max_relative_damping"),
  ]
  return "\n\n".join(parts)


def figure(results: dict[str, Any], path: Path) -> None:
  """Each model's final loss over its baseline's against the damping, one line per form."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  problems = results["problems"]
  lines = (
    (tuned_rows(results), "k*--", f"{preconditioning.DEFAULT_FORM} (default), K-FAC's own lr"),
    (tuned_rows(results, FORMER_DEFAULT), "s--", f"{FORMER_FORM}, K-FAC's own lr"),
    (
      tuned_rows(results, "tuned_0.01"),
      "^:",
      f"{FORMER_FORM}, K-FAC's own lr tuned at damping 0.01",
    ),
  )
  cols = 4
  rows = -(-len(problems) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
  for ax, (name, r) in zip(axes.flat, problems.items(), strict=False):
    for form in FORMS:
      dampings = [d for d in dampings_of(results, form) if repr(d) in r["kfac"][form]]
      ax.plot(
        dampings,
        [ratio(r, form, d) for d in dampings],
        "o-",
        label=f"{form}, baseline's lr, KL clip",
      )
    for rows_, style, label in lines:
      if name in rows_:
        ax.plot(DAMPINGS, rows_[name]["ratios"], style, label=label)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set(xscale="log", yscale="log", title=name, xlabel="damping")
  for ax in axes.flat[len(problems) :]:
    ax.axis("off")
  axes[0, 0].set_ylabel("final loss / tuned baseline")
  handles, labels = axes[0, 0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=4)
  fig.tight_layout(rect=(0, 0.1, 1, 1))
  fig.savefig(path, dpi=120)


BLOCK = "robustness"  # the block of docs/benchmarks/robustness.md that `report` writes
README_BLOCK = "robustness targets"  # README.md's, which `readme` writes


def tune_each(parser, args, results: dict[str, Any], flag: str, key: str, **kwargs) -> None:
  """`tune_kfac` (with ``kwargs``) into ``results[problem][key]`` for each of ``args.problems``,
  saved after each; a problem with no tuned baseline in the results is an error of ``flag``."""
  for name in args.problems:
    if name not in results["problems"]:
      parser.error(f"{flag}: {name} has no tuned baseline in {args.out}; train it first")
    print(name, flush=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    results["problems"][name][key] = tune_kfac(suite.SUITE[name](), args.seeds, log, **kwargs)
    save(results, args.out)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--problems", nargs="+", choices=sorted(suite.SUITE), default=list(suite.SUITE)
  )
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument(
    "--forms",
    nargs="*",
    choices=FORMS,
    default=list(FORMS),
    help="forms trained at the baseline's rate (none: only K-FAC at its own tuned rate)",
  )
  parser.add_argument("--dampings", nargs="+", type=float, default=list(DAMPINGS))
  parser.add_argument(
    "--reuse-baseline",
    action="store_true",
    help="keep each problem's tuned baseline from the results file (train K-FAC only)",
  )
  parser.add_argument(
    "--kl-clips",
    nargs="+",
    type=lambda x: None if x == "none" else float(x),
    help="train only K-FAC at its defaults but for each of these KL clips ('none': no clip), "
    "each at its own tuned rate, for problems already in the results file",
  )
  parser.add_argument(
    "--tune-at",
    type=float,
    help="train only K-FAC at its defaults, its rate tuned at this damping instead of the "
    "default (the results' tuned_<damping>), for problems already in the results file",
  )
  parser.add_argument(
    "--curvature-warmup",
    type=int,
    help="train only K-FAC at its defaults but for kfac's curvature_warmup, its rate tuned by "
    f"the same rule (the results' {WARMUP}), for problems already in the results file",
  )
  parser.add_argument(
    "--damping-form",
    choices=[FORMER_FORM],
    help="train only K-FAC at its defaults but for this damping form (the default before), its "
    f"rate tuned by the same rule (the results' {FORMER_DEFAULT}), for problems already in the "
    "results file",
  )
  parser.add_argument("--table", action="store_true", help="print the tables of the saved results")
  parser.add_argument("--figure", type=Path, help="draw the saved results into this file")
  parser.add_argument(
    "--page",
    action="store_true",
    help="write the tables into docs/benchmarks/robustness.md and README.md (their blocks)",
  )
  parser.add_argument(
    "--out", type=Path, default=RESULTS, help="the results file (read, then updated)"
  )
  parser.add_argument(
    "--rerun",
    type=Path,
    default=RERUN,
    help="results of the same benchmark trained again on another CPU, shown beside --out's "
    "in the tables (when the file exists)",
  )
  args = parser.parse_args(argv)
  if args.seeds < 1:
    parser.error("--seeds must be at least 1")
  results = load(args.out)
  if args.kl_clips and not (args.table or args.figure or args.page):
    for name in args.problems:
      if name not in results["problems"]:
        parser.error(f"--kl-clips: {name} has no tuned baseline in {args.out}; train it first")
      print(name, flush=True)
      problem = suite.SUITE[name]()
      for kl_clip in args.kl_clips:
        by_lr = tune_clip(problem, args.seeds, lambda s: print(s, flush=True), kl_clip)
        results["problems"][name].setdefault("kl_clip", {})[repr(kl_clip)] = by_lr
        results["problems"][name]["kl_clip_damping"] = preconditioning.DEFAULT_DAMPING
        save(results, args.out)
  elif args.tune_at is not None and not (args.table or args.figure or args.page):
    key = f"tuned_{args.tune_at!r}"
    tune_each(parser, args, results, "--tune-at", key, damping=args.tune_at, kfac=STEP_RULES_FORM)
  elif args.curvature_warmup is not None and not (args.table or args.figure or args.page):
    kfac = {"curvature_warmup": args.curvature_warmup, **STEP_RULES_FORM}
    tune_each(parser, args, results, "--curvature-warmup", WARMUP, kfac=kfac)
  elif args.damping_form is not None and not (args.table or args.figure or args.page):
    kfac = {"damping_form": args.damping_form}
    tune_each(parser, args, results, "--damping-form", FORMER_DEFAULT, kfac=kfac)
  elif not (args.table or args.figure or args.page):
    for name in args.problems:
      print(name, flush=True)
      previous = results["problems"].get(name) if args.reuse_baseline else None
      results["problems"][name] = run_problem(
        name,
        args.seeds,
        lambda s: print(s, flush=True),
        tuple(args.forms),
        tuple(args.dampings),
        previous,
      )
      results |= {"steps": STEPS, "tail": suite.TAIL, "seeds": args.seeds, "jax": jax.__version__}
      if (
        not args.reuse_baseline
      ):  # else the baselines' machine stays named (each `tuned` names its own)
        results["machine"] = machine()
      save(results, args.out)
  rerun = (
    load(args.rerun) if args.rerun.exists() and args.rerun.resolve() != args.out.resolve() else None
  )
  page = report(results, rerun)
  print(page)
  if args.page:
    for block, text in ((BLOCK, page), (README_BLOCK, readme(results, rerun))):
      for path in generated.write(block, text):
        print(f"tables written to {path}")
  if args.figure:
    figure(results, args.figure)


if __name__ == "__main__":
  main()
