"""The training loop: one task, one optimizer, one seed; a record per evaluation."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.metadata
import json
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

import kaisa_jax
from experiments.files import atomic_open
from experiments.optimizers import Optimizer, build, is_kfac, kfac_arguments, kfac_transform
from experiments.tasks import Task


def versions() -> dict[str, str]:
  """Versions of the packages a result depends on, and of Python."""
  pkgs = ("jax", "jaxlib", "flax", "optax", "kaisa_jax")
  out = {p: importlib.metadata.version(p) for p in pkgs}
  out["python"] = platform.python_version()
  return out


def batches(n: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
  """Indices of shuffled batches, epoch after epoch (the last partial batch is dropped)."""
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(n)
    for i in range(n // batch_size):
      yield order[i * batch_size : (i + 1) * batch_size]


# The training loss is evaluated on at most this many training examples, evenly
# spaced (only the transformer's training set is larger).
TRAIN_LOSS_EXAMPLES = 4096


def kfac_grad_fn(task: Task) -> kaisa_jax.ValueAndGrad:
  """The task's loss under `kaisa_jax.value_and_grad` (its curvature comes with the gradient)."""
  return kaisa_jax.value_and_grad(task.loss, has_aux=True, n_examples=task.n_examples())


def kfac_layers(task: Task, params: Any, state: Any) -> kaisa_jax.Layers:
  """The task's layers, traced on the first batch of its training set."""
  first = tuple(jnp.asarray(a[: task.batch_size]) for a in task.train)
  return kfac_grad_fn(task).layers(params, state, *first)


# Significant digits of the curvature statistics in the records (plenty for a plot).
CURVATURE_DIGITS = 4


def finite_or_none(x: Any) -> float | None:
  """``x`` to `CURVATURE_DIGITS` significant digits, or None if NaN or infinite (not JSON)."""
  value = float(x)
  return float(f"{value:.{CURVATURE_DIGITS}g}") if np.isfinite(value) else None


def curvature_record(stats: kaisa_jax.CurvatureStatistics) -> dict[str, Any]:
  """K-FAC's curvature statistics as a record's ``curvature`` entry.

  ``kl_scale`` (the KL clip's scale of the last step), ``worst_layer`` (the
  largest condition number) and, per layer, ``condition`` and
  ``relative_damping`` (None while there is no curvature yet).
  """
  layers = {
    name: {
      "condition": finite_or_none(s.condition),
      "relative_damping": finite_or_none(s.relative_damping),
    }
    for name, s in stats.layers.items()
  }
  conditions = {n: v["condition"] for n, v in layers.items() if v["condition"] is not None}
  return {
    "kl_scale": finite_or_none(stats.kl_scale),
    "worst_layer": max(conditions, key=conditions.get) if conditions else None,
    "layers": layers,
  }


def _step_function(
  task: Task, opt: Optimizer, steps: int, layers: kaisa_jax.Layers | None
) -> Callable[..., Any]:
  """``step(params, state, opt_state, x, y, lr) -> (params, state, opt_state, loss)``.

  One step of ``opt`` at the peak learning rate ``lr`` (``opt.lr`` is not
  read) on one batch. ``lr`` may be traced: runs alike but for their rate can
  share one compiled step. For K-FAC the step passes the captured curvature to
  ``update``.
  """
  if not is_kfac(opt.name):

    def gradients(params, state, xb, yb):
      (loss, state), grads = jax.value_and_grad(task.loss, has_aux=True)(params, state, xb, yb)
      return loss, state, grads, {}

  else:
    grad_fn = kfac_grad_fn(task)

    def gradients(params, state, xb, yb):
      (loss, state), grads, curvature = grad_fn(params, state, xb, yb)
      return loss, state, grads, {"curvature": curvature}

  def step(params, state, opt_state, xb, yb, lr):
    tx = build(dataclasses.replace(opt, lr=lr), steps, layers)
    loss, state, grads, extra = gradients(params, state, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), state, opt_state, loss

  return step


def make_step(
  task: Task,
  opt: Optimizer,
  steps: int,
  params: Any,
  state: Any,
  layers: kaisa_jax.Layers | None = None,
) -> tuple[optax.GradientTransformationExtraArgs, Callable[..., Any]]:
  """The optimizer's Optax transformation and the jitted training step.

  ``step(params, state, opt_state, x, y) -> (params, state, opt_state, loss)``
  on one batch, ``opt.lr`` compiled in. For K-FAC the layers are ``layers``,
  or traced on the first batch of the training set, and the step passes the
  captured curvature to ``update``.
  """
  if is_kfac(opt.name) and layers is None:
    layers = kfac_layers(task, params, state)
  step = _step_function(task, opt, steps, layers)
  return build(opt, steps, layers), jax.jit(lambda *carry_and_batch: step(*carry_and_batch, opt.lr))


class Programs(NamedTuple):
  """The jitted programs of `train`'s runs of one task and optimizer, the rate an argument.

  ``step`` is `_step_function` jitted; ``curvature(opt_state, lr)`` is K-FAC's
  `kaisa_jax.curvature_statistics` (None for a first-order optimizer);
  ``evaluate(params, state)`` gives the task's training loss and metric.
  ``task`` is kept so that no other task takes its ``id`` while they are kept.
  """

  task: Task
  layers: kaisa_jax.Layers | None
  step: Callable[..., Any]
  curvature: Callable[..., Any] | None
  evaluate: Callable[..., Any]


# The programs of recent runs, by task, settings but the rate, and steps: a sweep's trials and
# a study's seeds compile their step once between them.
_PROGRAMS: collections.OrderedDict[tuple[Any, ...], Programs] = collections.OrderedDict()
PROGRAMS_KEPT = 4


def _curvature_program(
  opt: Optimizer, steps: int, layers: kaisa_jax.Layers
) -> Callable[[Any, Any], kaisa_jax.CurvatureStatistics]:
  """K-FAC's `kaisa_jax.curvature_statistics` of an ``opt_state``, jitted, the rate an argument."""

  def curvature(opt_state, lr):
    kfac = kfac_transform(dataclasses.replace(opt, lr=lr), steps, layers)
    return kaisa_jax.curvature_statistics(kfac, opt_state)

  return jax.jit(curvature)


def programs(task: Task, opt: Optimizer, steps: int, params: Any, state: Any) -> Programs:
  """The `Programs` of ``opt`` on ``task`` for runs of ``steps``, made or reused.

  Runs alike but for ``opt.lr`` share them, hence one compilation each; the
  `PROGRAMS_KEPT` most recently used are kept.
  """
  key = (id(task), json.dumps(opt.config() | {"lr": None}, sort_keys=True), steps)
  if key in _PROGRAMS:
    _PROGRAMS.move_to_end(key)
    return _PROGRAMS[key]
  layers = kfac_layers(task, params, state) if is_kfac(opt.name) else None
  x, y = (jnp.asarray(a) for a in task.train)
  x_test, y_test = (jnp.asarray(a) for a in task.test)
  seen = slice(None, None, -(-len(x) // TRAIN_LOSS_EXAMPLES))

  @jax.jit
  def evaluate(params, state):
    return task.evaluate(params, state, (x[seen], y[seen]), (x_test, y_test))

  _PROGRAMS[key] = Programs(
    task,
    layers,
    jax.jit(_step_function(task, opt, steps, layers)),
    None if layers is None else _curvature_program(opt, steps, layers),
    evaluate,
  )
  while len(_PROGRAMS) > PROGRAMS_KEPT:
    _PROGRAMS.popitem(last=False)
  return _PROGRAMS[key]


def run_config(
  task: Task, opt: Optimizer, steps: int, seed: int, extra_config: dict[str, Any] | None = None
) -> dict[str, Any]:
  """The ``config`` of every record `train` writes: task, seed, optimizer settings, ``extra_config``."""
  config = {
    "task": task.name,
    "seed": seed,
    "steps": steps,
    "batch_size": task.batch_size,
    "metric_name": task.metric_name,
    "target": task.target,
    "higher_is_better": task.higher_is_better,
  }
  return config | opt.config() | (extra_config or {})


def finished_run(path: Path, config: dict[str, Any]) -> list[dict[str, Any]] | None:
  """The records of a run `train` finished into ``path`` with ``config``, or None.

  None unless the file exists, every record holds ``config`` (as JSON gives it
  back) and this process's `versions`, and the last record is at
  ``config["steps"]``: a file is only ever written whole (`atomic_open`), so this
  is the run `train` would write again, its clock aside, when the code is the same.
  """
  if not path.exists():
    return None
  records = [json.loads(line) for line in path.read_text().splitlines()]
  expected, made = json.loads(json.dumps(config)), versions()
  made_alike = all(r.get("config") == expected and r.get("versions") == made for r in records)
  if not records or not made_alike or records[-1]["step"] != config["steps"]:
    return None
  return records


def train(
  task: Task,
  opt: Optimizer,
  steps: int,
  seed: int = 0,
  eval_every: int = 50,
  out: Path | None = None,
  progress: bool = True,
  extra_config: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
  """Trains and returns one record per evaluation (also written as JSON lines to ``out``).

  ``out`` is written under a temporary name in its folder (flushed at every
  evaluation) and takes its final name only when training ends; a failing or
  interrupted run leaves no partial file and an earlier ``out`` as it was.

  Each record holds ``step``, ``wall_seconds`` (training steps only: compilation
  and evaluation excluded), ``train_loss`` (on the training set, or at most
  `TRAIN_LOSS_EXAMPLES` of it; evaluation mode), ``metric`` (on the held-out
  set), K-FAC's health counters and ``curvature`` (`curvature_record`;
  `kaisa_jax.check_damping` warns from it), ``config`` (task, seed, optimizer
  settings and ``extra_config``) and ``versions``.
  The model state (BatchNorm's ``batch_stats``) is carried from step to step.
  Runs alike but for ``opt.lr`` share their compiled programs (`programs`).
  Raises `FloatingPointError` when the training loss becomes NaN or infinite,
  `ValueError` unless ``steps`` and ``eval_every`` are positive.
  """
  if steps < 1 or eval_every < 1:
    raise ValueError(f"steps ({steps}) and eval_every ({eval_every}) must be positive")
  x, y = (jnp.asarray(a) for a in task.train)
  params, state = task.init(jax.random.key(seed), x[:1])
  run = programs(task, opt, steps, params, state)
  opt_state = build(opt, steps, run.layers).init(params)
  lr, evaluate = opt.lr, run.evaluate

  meta = {"config": run_config(task, opt, steps, seed, extra_config), "versions": versions()}
  index = batches(len(task.train[0]), task.batch_size, seed)
  first = next(index)
  # Compile outside the clock.
  run.step.lower(params, state, opt_state, x[first], y[first], lr).compile()
  records: list[dict[str, Any]] = []
  wall = 0.0
  sink = atomic_open(out) if out is not None else contextlib.nullcontext()
  bar = tqdm(total=steps, desc=f"{task.name}/{opt.name}/seed{seed}", disable=not progress)

  def record(k: int, file: Any) -> None:
    loss, metric = (float(v) for v in evaluate(params, state))
    rec = {"step": k, "wall_seconds": wall, "train_loss": loss, "metric": metric}
    rec["skipped_steps"] = int(opt_state.total_notfinite)  # non-finite gradients
    if run.curvature is not None:  # K-FAC's health counters and curvature
      stats = run.curvature(opt_state, lr)
      kaisa_jax.check_damping(stats, kfac_arguments(opt.kfac)["step_norm"])
      rec["skipped_factor_updates"] = int(stats.skipped_factor_updates)
      rec["failed_decompositions"] = int(stats.failed_decompositions)
      rec["curvature"] = curvature_record(stats)
    rec |= meta
    records.append(rec)
    if file is not None:
      file.write(json.dumps(rec) + "\n")
      file.flush()
    bar.set_postfix(loss=f"{loss:.4f}", metric=f"{metric:.4f}")

  with bar, sink as file:
    record(0, file)
    idx = first
    for k in range(1, steps + 1):
      start = time.perf_counter()
      params, state, opt_state, loss = run.step(params, state, opt_state, x[idx], y[idx], lr)
      loss.block_until_ready()
      wall += time.perf_counter() - start
      if not np.isfinite(float(loss)):
        raise FloatingPointError(f"{opt.name} diverged at step {k} (loss {float(loss)})")
      idx = next(index)
      bar.update(1)
      if k % eval_every == 0 or k == steps:
        record(k, file)
  return records
