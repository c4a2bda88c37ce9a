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


def test_kfac_at_its_defaults_is_tuned_like_the_baseline():
  """K-FAC's learning rate is the best of its grid and, like the baseline's, not an end of it;
  every damping was then run at that rate from the same seeds."""
  robustness = _benchmark()
  results = json.loads(robustness.RESULTS.read_text())
  readme = (ROOT / "README.md").read_text()
  assert robustness.generated.body(readme, robustness.README_BLOCK) == robustness.readme(results)
  for name, r in results["problems"].items():
    for by_lr, lr in ((r["tuned"]["by_lr"], r["tuned"]["lr"]), (r["baseline"], r["lr"])):
      rates = sorted(float(k) for k in by_lr)
      assert lr == robustness.best_lr(by_lr), name
      assert rates[0] < lr < rates[-1], name
      assert set(robustness.LEARNING_RATES[r["optimizer"]]) <= set(rates), name
    dampings = r["tuned"]["dampings"]
    assert sorted(float(d) for d in dampings) == sorted(robustness.DAMPINGS), name
    assert all(len(losses) == results["seeds"] for losses in dampings.values()), name
    default = repr(robustness.preconditioning.DEFAULT_DAMPING)
    assert dampings[default] == r["tuned"]["by_lr"][repr(r["tuned"]["lr"])], name
