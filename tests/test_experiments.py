"""Smoke tests of the experiments: a few steps per task and optimizer on tiny data.

They check the results files' fields, the figures, the table, the sweep's
best.json and that a run is reproducible bit for bit (wall-clock aside); that
``run`` keeps its results apart from ``compare``'s, that the command line
refuses bad arguments before training and that files are written whole or not
at all.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import string

import numpy as np
import pytest

from experiments import __main__ as cli
from experiments import files, optimizers, report, tasks
from experiments.train import train

FIELDS = {"step", "wall_seconds", "train_loss", "metric", "config", "versions"}
CONFIG = {"task", "seed", "steps", "batch_size", "optimizer", "lr", "metric_name", "target"}
OPTIMIZERS = ["sgd", "adamw", "kfac"]
SMALL = ("mnist1d", "autoencoder", "resnet", "charlm")


def small(name: str) -> tasks.Task:
  """The task at a toy size: small model, 96 training and 32 held-out examples, batch 16."""
  build = {
    "mnist1d": functools.partial(tasks.mnist1d, num_samples=300),
    "autoencoder": functools.partial(tasks.autoencoder, widths=(32, 16, 4)),
    "resnet": functools.partial(tasks.resnet, (8,), num_samples=300),
    "charlm": functools.partial(tasks.charlm, length=8, width=8),
  }
  return tasks.subset(build[name](), 96, 32, 16)


@pytest.fixture
def small_tasks(monkeypatch):
  for name in SMALL:
    monkeypatch.setitem(tasks.TASKS, name, functools.partial(small, name))


def read(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def strip_wall(records):
  return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in records]


@pytest.mark.parametrize("task", SMALL)
def test_compare_writes_records_figure_table_reproducibly(task, small_tasks, tmp_path):
  names = [*OPTIMIZERS, "kfac_adamw"] if task == "charlm" else OPTIMIZERS
  argv = ["compare", "--task", task, "--optimizers", *names, "--steps", "3", "--eval-every", "2"]
  cli.main([*argv, "--out", str(tmp_path), "--no-progress"])
  out = tmp_path / task
  for name in names:
    records = read(out / f"{name}-seed0.jsonl")
    assert [r["step"] for r in records] == [0, 2, 3]
    for r in records:
      assert set(r) >= FIELDS, set(r)
      assert set(r["config"]) >= CONFIG
      assert r["config"]["optimizer"] == name and r["config"]["settings_from"] == "default"
      assert {"jax", "flax", "optax", "kaisa_jax", "python"} <= set(r["versions"])
    assert records[-1]["wall_seconds"] > 0
    assert records[-1]["skipped_steps"] == 0  # every optimizer runs under apply_if_finite
    if optimizers.is_kfac(name):
      assert records[-1]["skipped_factor_updates"] == 0
      assert records[-1]["failed_decompositions"] == 0
  assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  table = (out / "table.md").read_text()
  for name in names:
    assert f"| {name} |" in table
  assert "K-FAC" in table
  # The same seed again gives the same records bit for bit (wall-clock aside).
  kfac, extra = optimizers.DEFAULTS["kfac"], {"settings_from": "default"}
  again = train(small(task), kfac, 3, 0, 2, progress=False, extra_config=extra)
  assert strip_wall(again) == strip_wall(read(out / "kfac-seed0.jsonl"))
  if task == "mnist1d":  # table mode rebuilds the same table from the results files
    (out / "table.md").unlink()
    cli.main(["table", "--task", task, "--out", str(tmp_path)])
    assert (out / "table.md").read_text() == table


def test_sweep_chooses_on_validation_and_compare_uses_it(small_tasks, monkeypatch, tmp_path):
  grid = {"sgd": [{"lr": 0.01}, {"lr": 0.1}], "kfac": [{"lr": 0.1, "damping": 1e-2}]}
  monkeypatch.setattr(optimizers, "GRID", grid)
  common = ["--task", "mnist1d", "--optimizers", "sgd", "kfac", "--eval-every", "2"]
  cli.main(["sweep", *common, "--steps", "2", "--out", str(tmp_path), "--no-progress"])
  out = tmp_path / "mnist1d"
  summary = json.loads((out / "best.json").read_text())
  assert set(summary["best"]) == {"sgd", "kfac"}
  assert [t["settings"] for t in summary["trials"]["sgd"]] == grid["sgd"]
  assert sum(t["chosen"] for t in summary["trials"]["kfac"]) == 1
  trial = read(out / "sweep" / "sgd-trial0.jsonl")[-1]
  assert trial["config"]["metric_name"] == "validation accuracy"
  assert (out / "sweep.md").exists()

  run_argv = ["run", "--optimizers", "sgd", "--eval-every", "2", "--steps", "2"]
  cli.main([*run_argv, "--out", str(tmp_path), "--no-progress"])
  record = read(out / "run" / "sgd-seed0.jsonl")[-1]
  assert record["config"]["settings_from"] == "sweep"
  assert record["config"]["lr"] == summary["best"]["sgd"]["lr"]
  assert (out / "run" / "sgd.png").exists()


def test_compare_takes_the_optimizers_in_turns_seed_by_seed(monkeypatch, tmp_path):
  calls = []

  def fake_train(task, opt, steps, seed, *args, **kwargs):
    calls.append((opt.name, seed))
    return [{"step": steps, "seed": seed}]

  monkeypatch.setattr(cli, "train", fake_train)
  args = cli.parse(["compare", "--seeds", "0", "1", "--steps", "5", "--out", str(tmp_path)])
  runs = cli.train_all(small("mnist1d"), ["sgd", "kfac"], args, tmp_path, {})
  assert calls == [("sgd", 0), ("kfac", 0), ("sgd", 1), ("kfac", 1)]
  assert [[r[0]["seed"] for r in runs[n]] for n in ("sgd", "kfac")] == [[0, 1], [0, 1]]


def test_validation_split_is_carved_from_training_set():
  t = small("autoencoder")
  v = tasks.with_validation(t, 0.25)
  assert len(v.train[0]) == 72 and len(v.test[0]) == 24
  train_rows = {r.tobytes() for r in t.train[0]}
  assert all(r.tobytes() in train_rows for r in v.test[0])
  assert v.metric_name.startswith("validation")


def test_text_held_out_from_every_module_and_disjoint_from_training():
  (x, _), (x_test, y_test) = tasks.text_data(32)
  lib = pathlib.Path(string.__file__).parent
  sources = [(lib / name).read_text() for name in tasks.SOURCES]
  assert len(x) + len(x_test) == (sum(map(len, sources)) - 1) // 32
  assert 0.09 < len(x_test) / (len(x) + len(x_test)) < 0.11
  np.testing.assert_array_equal(x_test[:, 1:], y_test[:, :-1])  # targets: next characters

  def text(ids):
    return "".join(tasks.CHARS[i] for i in ids if i < len(tasks.CHARS))

  held = [text(w) for w in x_test]
  for source in sources:  # each module holds some held-out windows
    assert sum(w in source for w in held) > 10
  train_windows = {w.tobytes() for w in x}
  unique = [w for w in x_test if w.tobytes() not in train_windows]
  assert len(unique) > 0.95 * len(x_test)  # repeats: only boilerplate lines


def run(metrics, seconds, seed):
  """Records of a made-up run: one evaluation every 10 steps."""
  config = {"seed": seed, "lr": 0.1}
  return [
    {"step": 10 * i, "wall_seconds": s, "metric": m, "config": config}
    for i, (m, s) in enumerate(zip(metrics, seconds))
  ]


def test_table_reports_misses_and_kfac_ratio():
  task = small("autoencoder")  # lower is better, target 0.01

  runs = {
    "sgd": [run([0.3, 0.02, 0.009], [0, 1, 2], 0), run([0.3, 0.008, 0.007], [0, 1, 2], 1)],
    "adamw": [run([0.3, 0.2, 0.1], [0, 1, 2], 0), run([0.3, 0.009, 0.008], [0, 1, 2], 1)],
    "kfac": [run([0.3, 0.005, 0.004], [0, 3, 6], 0), run([0.3, 0.006, 0.004], [0, 3, 6], 1)],
  }
  table = report.markdown_table(task, runs, "defaults")
  assert "| sgd | lr 0.1 | 15 | 1.50 | 0.0080 +- 0.0014 |" in table
  assert "not reached (1/2 seeds)" in table
  assert "K-FAC (kfac) time to target / best baseline (sgd): 2.00x" in table
  assert "steps: 0.67x" in table
  # A second K-FAC variant, faster to the target in time, is the one compared.
  runs["kfac_adamw"] = [run([0.3, 0.005, 0.004], [0, 2, 4], s) for s in (0, 1)]
  table = report.markdown_table(task, runs, "defaults")
  assert "K-FAC (kfac_adamw) time to target / best baseline (sgd): 1.33x" in table


def test_target_met_at_the_first_evaluation_counts_as_reached():
  task = small("autoencoder")  # lower is better, target 0.01
  # A run whose first evaluation already meets the target took 0.0 training seconds.
  runs = {
    "sgd": [run([0.3, 0.02, 0.009], [0, 1, 2], s) for s in (0, 1)],
    "kfac": [run([0.005, 0.004], [0, 3], s) for s in (0, 1)],
  }
  table = report.markdown_table(task, runs, "defaults")
  assert "| kfac | lr 0.1 | 0 | 0.00 |" in table
  assert "K-FAC (kfac) time to target / best baseline (sgd): 0.00x" in table
  # The ratio is undefined when the baseline meets the target before training.
  runs["sgd"] = [run([0.009, 0.008], [0, 1], s) for s in (0, 1)]
  table = report.markdown_table(task, runs, "defaults")
  assert "| sgd | lr 0.1 | 0 | 0.00 |" in table
  assert "A baseline met the target before training: no ratio." in table


def test_summary_gathers_tasks_into_the_readme(small_tasks, tmp_path):
  # autoencoder (lower is better, target 0.01): K-FAC half the steps and time of sgd, the best baseline.
  # mnist1d (higher is better, target 0.94): K-FAC 1.5x the time of adamw.
  made_up = {
    "autoencoder": {
      "sgd": [run([0.3, 0.02, 0.009], [0, 1, 2], s) for s in (0, 1)],
      "adamw": [run([0.3, 0.2, 0.009], [0, 2, 4], s) for s in (0, 1)],
      "kfac": [run([0.3, 0.009, 0.005], [0, 1, 2], s) for s in (0, 1)],
    },
    "mnist1d": {
      "sgd": [run([0.1, 0.5, 0.9], [0, 1, 2], s) for s in (0, 1)],
      "adamw": [run([0.1, 0.95, 0.96], [0, 2, 4], s) for s in (0, 1)],
      "kfac": [run([0.1, 0.95, 0.97], [0, 3, 6], s) for s in (0, 1)],
    },
  }
  for task, runs in made_up.items():
    (tmp_path / task).mkdir()
    for name, seeds in runs.items():
      for seed, records in enumerate(seeds):
        text = "".join(json.dumps(r) + "\n" for r in records)
        (tmp_path / task / f"{name}-seed{seed}.jsonl").write_text(text)
  readme = tmp_path / "README.md"
  readme.write_text(f"intro\n{cli.BEGIN}\nold table\n{cli.END}\noutro\n")
  argv = ["summary", "--tasks", "autoencoder", "mnist1d", "--seeds", "0", "1"]
  cli.main([*argv, "--out", str(tmp_path), "--readme", str(readme)])
  text = readme.read_text()
  assert text.startswith("intro\n") and text.endswith(f"{cli.END}\noutro\n")
  assert "old table" not in text
  assert "|  | K-FAC | lr 0.1 | 10 | 1.00 | 0.0050 +- 0.0000 |" in text
  assert "autoencoder: K-FAC 0.50x the time of SGD to the target, 0.50x the steps" in text
  assert "mnist1d: K-FAC 1.50x the time of AdamW to the target, 1.00x the steps" in text
  assert "not met, 1 of 3" in text
  assert (tmp_path / "summary.md").read_text().strip() in text


def test_run_keeps_its_results_apart_from_compare(small_tasks, tmp_path):
  common = ["--task", "mnist1d", "--out", str(tmp_path), "--no-progress"]
  compare = ["compare", "--optimizers", "sgd", "adamw", "--steps", "4", "--eval-every", "2"]
  cli.main([*compare, *common])
  out = tmp_path / "mnist1d"
  table = (out / "table.md").read_text()
  # A run with other settings, then the table again: the same table as after compare.
  cli.main(["run", "--optimizers", "adamw", "--steps", "2", "--eval-every", "1", *common])
  (out / "table.md").unlink()
  cli.main(["table", "--optimizers", "sgd", "adamw", "--task", "mnist1d", "--out", str(tmp_path)])
  assert (out / "table.md").read_text() == table
  assert [r["step"] for r in read(out / "adamw-seed0.jsonl")] == [0, 2, 4]
  assert [r["step"] for r in read(out / "run" / "adamw-seed0.jsonl")] == [0, 1, 2]
  assert (out / "run" / "adamw.png").exists()


def test_table_refuses_results_made_with_different_steps(small_tasks, tmp_path):
  out = tmp_path / "mnist1d"
  out.mkdir()
  made_up = {"sgd": run([0.1, 0.5, 0.9], [0, 1, 2], 0), "kfac": run([0.1, 0.95], [0, 3], 0)}
  for name, records in made_up.items():
    lines = [json.dumps(r | {"train_loss": 1.0}) + "\n" for r in records]
    (out / f"{name}-seed0.jsonl").write_text("".join(lines))
  with pytest.raises(SystemExit, match="different steps or evaluations") as raised:
    cli.main(["table", "--optimizers", "sgd", "kfac", "--out", str(tmp_path)])
  assert "sgd seed 0: 20 steps, 3 evaluations; kfac seed 0: 10 steps, 2 evaluations" in str(
    raised.value
  )
  assert sorted(p.name for p in out.iterdir()) == ["kfac-seed0.jsonl", "sgd-seed0.jsonl"]


BAD_ARGUMENTS = [
  (["--steps", "-5"], "argument --steps: -5 is not positive"),
  (["compare", "--steps", "0"], "argument --steps: 0 is not positive"),
  (["--eval-every", "0"], "argument --eval-every: 0 is not positive"),
  (["run", "--eval-every", "-1"], "argument --eval-every: -1 is not positive"),
  (["sweep", "--steps", "0"], "argument --steps: 0 is not positive"),
  (["compare", "--steps", "ten"], "argument --steps: 'ten' is not an integer"),
  (["compare", "--seeds", "0", "1", "0"], "argument --seeds: given more than once: 0"),
  (["run", "--seeds", "-1"], "argument --seeds: -1 is not a seed"),
  (["sweep", "--seed", str(2**32)], "is not a seed from 0 to 4294967295"),
  (["compare", "--optimizers", "kfac", "sgd", "kfac"], "given more than once: kfac"),
  (["run", "--optimizers", "sgd", "kfac"], "unrecognized arguments: kfac"),
  (["table", "--steps", "3"], "unrecognized arguments: --steps 3"),
  (["sweep", "--seeds", "0", "1"], "unrecognized arguments: --seeds 0 1"),
  (["summary", "--tasks", "mnist1d", "mnist1d"], "given more than once: mnist1d"),
  (["compare", "--settings", "{tmp}/missing.json"], "no file"),
  (["run", "--settings", "{tmp}/notes.txt"], "is not a sweep's best.json"),
  (["summary", "--readme", "{tmp}/notes.txt"], "has no experiments-table markers"),
  (["compare", "--out", "{tmp}/notes.txt"], "exists and is not a folder"),
  (["comapre"], "invalid choice: 'comapre'"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_ARGUMENTS)
def test_bad_arguments_exit_2_before_training_or_writing(
  argv, message, small_tasks, monkeypatch, tmp_path, capsys
):
  def no_training(*args, **kwargs):
    raise AssertionError("trained despite bad arguments")

  monkeypatch.setattr(cli, "train", no_training)
  monkeypatch.setattr(cli, "sweep", no_training)
  (tmp_path / "notes.txt").write_text("no markers here\n")
  argv = [a.format(tmp=tmp_path) for a in argv]
  out = [] if "--out" in argv else ["--out", str(tmp_path / "results")]
  with pytest.raises(SystemExit) as raised:
    cli.main([*argv, *out])
  assert raised.value.code == 2
  assert message in capsys.readouterr().err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_no_mode_is_compare_with_the_defaults():
  args = cli.parse([])
  assert args.mode == "compare" and args.task == "mnist1d"
  assert args.optimizers == ["sgd", "adamw", "kfac"] and args.seeds == [0]
  assert (args.steps, args.eval_every, args.out, args.settings) == (
    None,
    10,
    pathlib.Path("results"),
    None,
  )
  args = cli.parse(["--task", "digits", "--seeds", "1", "2", "--no-progress"])
  assert (args.mode, args.task, args.seeds, args.no_progress) == ("compare", "digits", [1, 2], True)
  assert cli.parse(["run", "--optimizers", "kfac"]).optimizer == "kfac"


HELP = {  # per mode: options its help lists, options it must not
  "compare": (
    ["--optimizers", "--steps", "--eval-every", "--seeds", "--settings"],
    ["--tasks", "--readme", "--seed"],
  ),
  "run": (
    ["--optimizer", "--steps", "--eval-every", "--seeds", "--settings"],
    ["--tasks", "--readme", "--seed"],
  ),
  "sweep": (
    ["--optimizers", "--steps", "--eval-every", "--seed"],
    ["--seeds", "--settings", "--tasks", "--readme"],
  ),
  "table": (
    ["--task", "--optimizers", "--seeds", "--out"],
    ["--steps", "--eval-every", "--settings", "--no-progress", "--readme"],
  ),
  "summary": (
    ["--tasks", "--optimizers", "--seeds", "--readme"],
    ["--task", "--steps", "--eval-every", "--settings", "--no-progress"],
  ),
}


@pytest.mark.parametrize("mode", sorted(HELP))
def test_each_mode_has_its_own_help_with_defaults(mode, capsys):
  with pytest.raises(SystemExit) as raised:
    cli.main([mode, "--help"])
  assert raised.value.code == 0
  text = capsys.readouterr().out
  assert text.startswith(f"usage: python -m experiments {mode}")
  present, absent = HELP[mode]
  for option in present:
    assert re.search(rf"{option}(?![\w-])", text), (mode, option)
  for option in absent:
    assert not re.search(rf"{option}(?![\w-])", text), (mode, option)
  words = " ".join(text.split())  # the help as one line, whatever the terminal's width
  assert "(default: results)" in words
  if mode != "summary":
    assert "(default: mnist1d)" in words


def test_a_failing_run_leaves_no_partial_file(tmp_path):
  path = tmp_path / "sgd-seed0.jsonl"
  path.write_text("earlier\n")
  with pytest.raises(FloatingPointError, match="diverged"):
    train(small("mnist1d"), optimizers.Optimizer("sgd", 1e30), 5, 0, 1, path, progress=False)
  assert path.read_text() == "earlier\n"
  assert list(tmp_path.iterdir()) == [path]
  # An interrupted write as well; a finished one replaces the file.
  with pytest.raises(KeyboardInterrupt), files.atomic_open(path) as f:
    f.write("half")
    raise KeyboardInterrupt
  assert path.read_text() == "earlier\n" and list(tmp_path.iterdir()) == [path]
  files.write_text(path, "whole\n")
  assert path.read_text() == "whole\n" and list(tmp_path.iterdir()) == [path]
