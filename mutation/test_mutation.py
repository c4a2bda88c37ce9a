"""Tests of the mutation runner itself: ``python -m pytest -p no:cacheprovider mutation``.

They use small sources and a throw-away project under ``tmp_path``, never the
package: nothing here mutates ``kaisa_jax/``.
"""

from __future__ import annotations

import ast
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mutation import report, runner
from mutation.mutants import generate

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _descriptions(source: str, **kwargs) -> list[tuple[int, str, str]]:
  return [(m.line, m.operator, m.description) for m in generate(source, **kwargs)]


def test_each_operator_gives_the_expected_edit():
  source = textwrap.dedent(
    """\
    def f(a, b, flag):
      c = a + b * 2.0
      if flag:
        c = -c
      d = a < b and b >= 0
      e = jnp.maximum(a, b) ** 2
      e += 1
      return jnp.einsum("ij,jk->ik", a, b), c, d, e, True
    """
  )
  found = {(m.line, m.description): m.after for m in generate(source)}
  assert found[(2, "`+` -> `-`")] == "c = a - b * 2.0"
  assert found[(2, "`*` -> `/`")] == "c = a + b / 2.0"
  assert found[(2, "`2.0` -> `3.0`")] == "c = a + b * 3.0"
  assert found[(3, "condition negated")] == "if not (flag):"
  assert found[(4, "`-` removed")] == "c = c"
  assert found[(4, "`c = ...` removed")] == "pass"
  assert found[(5, "`<` -> `<=`")] == "d = a <= b and b >= 0"
  assert found[(5, "`>=` -> `>`")] == "d = a < b and b > 0"
  assert found[(5, "`and` -> `or`")] == "d = a < b or b >= 0"
  assert found[(6, "`maximum` -> `minimum`")] == "e = jnp.minimum(a, b) ** 2"
  assert found[(6, "`**` -> `*`")] == "e = jnp.maximum(a, b) * 2"
  assert found[(7, "`+=` -> `-=`")] == "e -= 1"
  assert found[(7, "`e += ...` removed")] == "pass"
  einsum = {d: a for (line, d), a in found.items() if line == 8 and "transposed" in d}
  assert set(einsum.values()) == {
    "return jnp.einsum('ji,jk->ik', a, b), c, d, e, True",
    "return jnp.einsum('ij,kj->ik', a, b), c, d, e, True",
    "return jnp.einsum('ij,jk->ki', a, b), c, d, e, True",
  }
  assert found[(8, "`True` -> `False`")].endswith("e, False")


def test_every_mutant_compiles_differs_and_leaves_the_rest_of_the_file_alone():
  # As committed: a mutation run may have a mutant in the working tree right now.
  source = subprocess.run(
    ["git", "show", "HEAD:kaisa_jax/preconditioning.py"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  mutants = generate(source, "preconditioning.py")
  assert len(mutants) > 50
  assert [m.index for m in mutants] == list(range(1, len(mutants) + 1))
  original = ast.dump(ast.parse(source))
  for m in mutants:
    mutated = m.apply(source)
    assert ast.dump(ast.parse(mutated)) != original, m
    assert mutated[: m.start] == source[: m.start]
    assert mutated[m.start + len(m.replacement) :] == source[m.end :]


def test_what_is_not_numerics_is_not_mutated():
  source = textwrap.dedent(
    '''\
    """Module docstring with 1 + 2."""
    import numpy as np
    from typing import Any
    __all__ = ["f"]

    def f(x: int = 3, *, name: str = "a") -> float:
      """Docstring: 1 + 1."""
      if x < 0:
        raise ValueError(f"x must be >= 0, got {x + 1}")
      assert x > -1, "never"
      warnings.warn(f"x is {x * 2}")
      logger.info("x %d", x - 1)
      print(x / 2)
      y: float = 2.0
      z = x * 7  # pragma: no mutate
      return y

    class C:
      def __repr__(self):
        return str(1 + 1)
    '''
  )
  found = _descriptions(source)
  assert found == [(6, "constant", "`3` -> `4`"), (14, "constant", "`2.0` -> `3.0`")]


def test_an_if_that_does_more_than_raise_is_mutated():
  source = "def f(x):\n  if x < 0:\n    x = 0\n    raise ValueError('no')\n  return x\n"
  assert (2, "compare", "`<` -> `<=`") in _descriptions(source)


def test_columns_count_characters_not_bytes():
  source = 'def f(a, b):\n  s = "éπ€"; return a + b\n'
  (m,) = [m for m in generate(source) if m.operator == "arithmetic"]
  assert m.after == 's = "éπ€"; return a - b'


def test_selection_by_lines_and_functions_keeps_the_numbers():
  source = "def f(a):\n  return a + 1\n\n\ndef g(a):\n  return a - 1\n"
  every = generate(source)
  by_lines = generate(source, lines=(6, 6))
  by_function = generate(source, functions=["g"])
  assert by_lines == by_function == [m for m in every if m.function == "g"]
  assert {m.index for m in by_lines} == {3, 4}


def test_spread_and_parse_lines():
  source = "def f(a):\n" + "".join(f"  a = a + {i}\n" for i in range(10))
  mutants = generate(source)
  assert runner.spread(mutants, None) == mutants
  picked = runner.spread(mutants, 5)
  assert len(picked) == 5 and len({m.index for m in picked}) == 5
  assert picked[0].line < picked[-1].line
  assert runner.parse_lines("10-20") == (10, 20)
  assert runner.parse_lines("7") == (7, 7)
  with pytest.raises(ValueError):
    runner.parse_lines("a-b")


PROJECT = {
  "calc.py": textwrap.dedent(
    """\
    def add(a, b):
      return a + b


    def count(n):
      i = 0
      while i < n:
        i += 1
      return i


    def untested(x):
      return x * 2
    """
  ),
  "test_calc.py": textwrap.dedent(
    """\
    import calc


    def test_add():
      assert calc.add(2, 3) == 5


    def test_count():
      assert calc.count(3) == 3
    """
  ),
}


@pytest.fixture
def project(tmp_path):
  for name, text in PROJECT.items():
    (tmp_path / name).write_text(text)
  return tmp_path


def _command(project: pathlib.Path) -> runner.TestCommand:
  return runner.TestCommand(project, ["test_calc.py"], ["-x", "-q", "-p", "no:cacheprovider"])


def _pick(mutants, line: int, description: str):
  (m,) = [m for m in mutants if m.line == line and m.description == description]
  return m


def test_killed_survived_and_timeout_are_told_apart_and_the_file_is_restored(project):
  module = project / "calc.py"
  original = module.read_bytes()
  mutants = generate(original.decode(), "calc.py")
  chosen = [
    _pick(mutants, 2, "`+` -> `-`"),
    _pick(mutants, 8, "`+=` -> `-=`"),  # i counts down: the loop never ends
    _pick(mutants, 13, "`*` -> `/`"),
  ]
  command = _command(project)
  outcome, baseline, code, _ = runner.run_tests(command, timeout=120)
  assert (outcome, code) == (runner.SURVIVED, 0)
  seen = []
  results = runner.run_mutants(module, chosen, command, 3 * baseline + 5, on_result=seen.append)
  assert [r.outcome for r in results] == [runner.KILLED, runner.TIMEOUT, runner.SURVIVED]
  assert seen == results
  assert "test_add" in results[0].detail
  assert module.read_bytes() == original
  assert not list((project / runner.BACKUP_DIR).glob("*"))


def test_an_interrupted_run_restores_the_file(project):
  module = project / "calc.py"
  original = module.read_bytes()
  mutants = generate(original.decode(), "calc.py")
  calls = []

  def tester(command, timeout):
    calls.append(module.read_bytes())
    if len(calls) == 2:
      raise KeyboardInterrupt
    return runner.KILLED, 0.0, 1, ""

  with pytest.raises(KeyboardInterrupt):
    runner.run_mutants(module, mutants, _command(project), 10, tester=tester)
  assert calls[0] != original and calls[1] != original
  assert module.read_bytes() == original
  assert not list((project / runner.BACKUP_DIR).glob("*"))


def test_a_terminated_run_restores_the_file(project):
  """SIGTERM while a mutant's tests run: the runner unwinds and writes the original back."""
  (project / "test_calc.py").write_text("import time\n\ndef test_slow():\n  time.sleep(60)\n")
  script = textwrap.dedent(
    f"""\
    import pathlib, sys
    sys.path.insert(0, {str(ROOT)!r})
    from mutation import runner
    from mutation.mutants import generate
    module = pathlib.Path({str(project / "calc.py")!r})
    command = runner.TestCommand(module.parent, ["test_calc.py"], ["-q", "-p", "no:cacheprovider"])
    print("running", flush=True)
    runner.run_mutants(module, generate(module.read_text()), command, timeout=120)
    """
  )
  module = project / "calc.py"
  original = module.read_bytes()
  process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
  assert process.stdout.readline().strip() == "running"
  deadline = time.monotonic() + 30
  while module.read_bytes() == original and time.monotonic() < deadline:
    time.sleep(0.05)
  assert module.read_bytes() != original  # a mutant is in place
  time.sleep(1.0)
  process.send_signal(signal.SIGTERM)
  process.wait(timeout=30)
  assert process.returncode != 0
  assert module.read_bytes() == original
  assert not list((project / runner.BACKUP_DIR).glob("*"))


def test_a_killed_run_is_restored_from_its_backup_by_the_next(project):
  module = project / "calc.py"
  original = module.read_bytes()
  backup = runner._backup_path(project, module)
  backup.parent.mkdir(parents=True)
  backup.write_bytes(original)
  module.write_text("mutated = True\n")
  owner = backup.with_suffix(".pid")
  owner.write_text(str(os.getpid()))  # its run is still going: left alone
  assert runner.restore_backups(project) == []
  assert module.read_text() == "mutated = True\n"
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  owner.write_text(str(dead.pid))  # its run was killed
  assert runner.restore_backups(project) == [module]
  assert module.read_bytes() == original
  assert not backup.exists() and not owner.exists()


def test_report_counts_rates_and_round_trips(project):
  mutants = generate(PROJECT["calc.py"], "calc.py")
  survivor = _pick(mutants, 13, "`*` -> `/`")
  results = [
    runner.Result(_pick(mutants, 2, "`+` -> `-`"), runner.KILLED, 1.0, 1, "FAILED test_add"),
    runner.Result(survivor, runner.SURVIVED, 1.0, 0),
    runner.Result(_pick(mutants, 8, "`+=` -> `-=`"), runner.TIMEOUT, 9.0, None),
  ]
  run = report.ModuleRun("calc", "calc.py", ["test_calc.py"], [], len(mutants), "all", 3, 1.0, 9.0)
  run.results = results
  triage = [
    {
      "module": "calc",
      "function": "untested",
      "before": survivor.before,
      "after": survivor.after,
      "verdict": "equivalent",
      "reason": "for the sake of the test",
    }
  ]
  c = report.counts(run, triage)
  assert (c["killed"], c["survived"], c["timeout"], c["equivalent"]) == (1, 1, 1, 1)
  assert c["rate"] == 0.5  # killed / (3 run - 1 equivalent)
  text = report.render([run], triage, {"Command": "`x`"}, complete=True)
  assert "| calc | 3 of " in text and "| 50 % |" in text
  assert "**equivalent**: for the sake of the test" in text
  runs, header, complete = report.from_json(report.to_json([run], {"Command": "`x`"}, True))
  assert report.render(runs, triage, header, complete) == text
  untriaged = report.render([run], [], {}, complete=False)
  assert "not triaged" in untriaged and "**Incomplete**" in untriaged


def _saved_run(project: pathlib.Path) -> pathlib.Path:
  """A saved run of calc.py: ``add``'s mutant killed, ``untested``'s survived."""
  mutants = generate(PROJECT["calc.py"], "calc.py")
  run = report.ModuleRun("calc", "calc.py", ["test_calc.py"], [], len(mutants), "all", 2, 1.0, 9.0)
  run.results = [
    runner.Result(_pick(mutants, 2, "`+` -> `-`"), runner.KILLED, 1.0, 1, "FAILED test_add"),
    runner.Result(_pick(mutants, 13, "`*` -> `/`"), runner.SURVIVED, 1.0, 0),
  ]
  path = project / "run.json"
  header = {"Command": "`x`", "Commit": "abc1234", "Started": "2026-11-26 12:00"}
  path.write_text(report.to_json([run], header, True))
  return path


def _calc_config() -> dict:
  """``[tool.mutation]`` for the throw-away project: calc.py against test_calc.py."""
  return {
    "timeout_factor": 2.0,
    "timeout_margin": 30.0,
    "pytest_args": ["-x", "-q", "-p", "no:cacheprovider"],
    "modules": {"calc": {"path": "calc.py", "tests": ["test_calc.py"]}},
  }


def test_again_runs_only_the_survivors_with_the_current_tests(project):
  from mutation.__main__ import again

  saved = _saved_run(project)
  module = project / "calc.py"
  module.write_text("# a line more: the mutants move down\n" + PROJECT["calc.py"])
  (project / "test_calc.py").write_text(
    PROJECT["test_calc.py"] + "\n\ndef test_untested():\n  assert calc.untested(3) == 6\n"
  )
  config = _calc_config()
  (project / "mutation").mkdir()
  survivor = report.from_json(saved.read_text())[0][0].results[1].mutant
  (project / "mutation" / "triage.toml").write_text(
    f'[[survivor]]\nmodule = "calc"\nfunction = "untested"\nbefore = "{survivor.before}"\n'
    f'after = "{survivor.after}"\nverdict = "equivalent"\nreason = "x"\n'
  )
  again(project, saved, None, config, workers=0)
  assert report.from_json(saved.read_text())[0][0].results[1].outcome == runner.SURVIVED  # not run
  (project / "mutation" / "triage.toml").unlink()
  assert again(project, saved, None, config, workers=0) == 0
  (run,), header, complete = report.from_json(saved.read_text())
  assert [r.outcome for r in run.results] == [runner.KILLED, runner.KILLED]
  assert run.results[0].detail == "FAILED test_add"  # not run again
  assert "test_untested" in run.results[1].detail and run.results[1].mutant.line == 14
  assert "Survivors run again" in header and complete
  assert "| calc | 2 of " in (project / "run.md").read_text()


def test_a_survivor_whose_code_changed_is_an_error_when_run_again(project):
  from mutation.__main__ import again

  saved = _saved_run(project)
  (project / "calc.py").write_text(PROJECT["calc.py"].replace("x * 2", "x + x"))
  config = _calc_config()
  again(project, saved, None, config, workers=0)
  (run,), _, _ = report.from_json(saved.read_text())
  assert run.results[1].outcome == runner.ERROR and "code changed" in run.results[1].detail


def test_the_published_summary_gives_rates_and_verdicts(project):
  runs, header, _ = report.from_json(_saved_run(project).read_text())
  loop = _pick(generate(PROJECT["calc.py"], "calc.py"), 8, "`+=` -> `-=`")
  runs[0].results.append(runner.Result(loop, runner.TIMEOUT, 9.0, None))
  survivor = runs[0].results[1].mutant
  entry = {"module": "calc", "function": "untested", "before": survivor.before}
  triage = [{**entry, "after": survivor.after, "verdict": "gap", "reason": "no test calls it"}]
  data = report.published([(runs[0], header)], triage)
  (m,) = data["modules"]
  assert (m["killed"], m["survived"], m["timeout"], m["rate"]) == (1, 1, 1, 1 / 3)
  text = report.summary_markdown(data)
  assert "| `calc` | 3 of " in text and "| 33 % | 2026-11-26 12:00, commit abc1234 |" in text
  assert "**gap**: no test calls it" in text and "**not triaged** (timeout)" in text


def test_the_configured_modules_and_tests_exist():
  config = __import__("mutation.__main__", fromlist=["load_config"]).load_config(ROOT)
  optional = {"tests/test_escaped_math.py", "tests/test_step_timing.py"}
  for name, module in config["modules"].items():
    assert (ROOT / module["path"]).exists(), name
    for test in module["tests"]:
      path = test.split("::")[0]
      assert path in optional or (ROOT / path).exists(), (name, test)
    assert generate((ROOT / module["path"]).read_text(), functions=module.get("functions")), name
