"""The robustness page's tables are those benchmarks/robustness.py writes from its committed results."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _benchmark():
  spec = importlib.util.spec_from_file_location("robustness", ROOT / "benchmarks" / "robustness.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_page_holds_the_tables_generated_from_the_committed_results():
  robustness = _benchmark()
  results = json.loads(robustness.RESULTS.read_text())
  page = (ROOT / "docs" / "benchmarks" / "robustness.md").read_text()
  assert robustness.generated.body(page, robustness.BLOCK) == robustness.report(results)
  # Every problem of the suite, every form at every damping of the grid, three seeds.
  assert sorted(results["problems"]) == sorted(robustness.suite.SUITE)
  for r in results["problems"].values():
    for form in robustness.FORMS:
      for d in robustness.DAMPINGS:
        assert len(r["kfac"][form][repr(d)]) == results["seeds"] == 3


def test_default_damping_is_the_benchmarks_best():
  """The default form and damping have the best typical ratio to the baseline over the suite."""
  robustness = _benchmark()
  from kaisa_jax import preconditioning

  results = json.loads(robustness.RESULTS.read_text())
  problems = results["problems"].values()

  def typical(form, d):
    logs = [robustness.math.log(robustness.ratio(r, form, d)) for r in problems]
    return sum(logs) / len(logs)

  grid = [(f, d) for f in robustness.FORMS for d in robustness.DAMPINGS]
  assert min(grid, key=lambda x: typical(*x)) == (
    preconditioning.DEFAULT_FORM,
    preconditioning.DEFAULT_DAMPING,
  )
