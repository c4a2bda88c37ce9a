"""The Markdown report of a run, and the triage of survivors it reads.

A survivor is either a real gap in the tests or an equivalent mutant (one no
test could kill, because it computes the same thing). ``mutation/triage.toml``
records the verdicts reached so far, one ``[[survivor]]`` table each:

```toml
[[survivor]]
module = "preconditioning"           # the module's name in [tool.mutation.modules]
function = "decompose.cholesky_inverse"
before = "chol = jax.scipy.linalg.cho_factor(damped, lower=True)"  # the line, stripped
after = "chol = jax.scipy.linalg.cho_factor(damped, lower=False)"  # the mutated line, stripped
verdict = "equivalent"               # or "gap"
reason = "cho_solve reads which triangle cho_factor filled from its result"
```

A mutant is matched by its module, function and line before and after, not
by its number or line number, so a verdict outlives edits elsewhere in the
file. Equivalent mutants leave the kill rate's denominator:
``kill rate = killed / (mutants run - equivalent - error)``; a timeout counts
as not killed.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tomllib

from mutation.mutants import Mutant
from mutation.runner import ERROR, KILLED, SURVIVED, TIMEOUT, Result

EQUIVALENT, GAP = "equivalent", "gap"


@dataclasses.dataclass
class ModuleRun:
  """One module's part of a run.

  Attributes:
    name: the module's name in the configuration.
    path: its file, relative to the repository root.
    tests: the tests run against it.
    absent: configured tests that do not exist (yet), left out.
    total: how many mutants the module has.
    selection: how the mutants run were chosen, in words.
    selected: how many were chosen.
    baseline: seconds the unmutated tests took (None if skipped).
    timeout: the per-mutant limit in seconds.
    results: the outcome of each mutant run so far.
  """

  name: str
  path: str
  tests: list[str]
  absent: list[str]
  total: int
  selection: str
  selected: int
  baseline: float | None
  timeout: float
  results: list[Result] = dataclasses.field(default_factory=list)


def load_triage(path: pathlib.Path) -> list[dict]:
  """The ``[[survivor]]`` entries of a triage file (none if it does not exist)."""
  if not path.exists():
    return []
  return tomllib.loads(path.read_text()).get("survivor", [])


def verdict(triage: list[dict], module: str, result: Result) -> dict | None:
  """The triage entry that matches a survivor, or None."""
  m = result.mutant
  for entry in triage:
    if (entry["module"], entry["function"], entry["before"], entry["after"]) == (
      module,
      m.function,
      m.before,
      m.after,
    ):
      return entry
  return None


def counts(run: ModuleRun, triage: list[dict]) -> dict[str, float | int | None]:
  """Per-outcome counts and the kill rate over the non-equivalent mutants."""
  c = {k: 0 for k in (KILLED, SURVIVED, TIMEOUT, ERROR, EQUIVALENT)}
  for result in run.results:
    c[result.outcome] += 1
    if result.outcome == SURVIVED:
      entry = verdict(triage, run.name, result)
      c[EQUIVALENT] += entry is not None and entry["verdict"] == EQUIVALENT
  judged = len(run.results) - c[EQUIVALENT] - c[ERROR]
  c["rate"] = c[KILLED] / judged if judged else None
  return c


def _cell(text: str) -> str:
  return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
  text = _cell(text)
  return f"``{text}``" if "`" in text else f"`{text}`"


def _summary(runs: list[ModuleRun], triage: list[dict]) -> list[str]:
  rows = [
    "| module | mutants run | killed | survived | timeout | error | equivalent | kill rate |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for run in runs:
    c = counts(run, triage)
    rate = "n/a" if c["rate"] is None else f"{100 * c['rate']:.0f} %"
    rows.append(
      f"| {run.name} | {len(run.results)} of {run.total} | {c[KILLED]} | {c[SURVIVED]} |"
      f" {c[TIMEOUT]} | {c[ERROR]} | {c[EQUIVALENT]} | {rate} |"
    )
  return rows


def _survivors(run: ModuleRun, triage: list[dict]) -> list[str]:
  survivors = [r for r in run.results if r.outcome in (SURVIVED, TIMEOUT)]
  if not survivors:
    return ["No survivors and no timeouts."]
  rows = [
    "| # | where | mutation | mutated line | outcome | verdict |",
    "|---:|---|---|---|---|---|",
  ]
  for r in survivors:
    m = r.mutant
    entry = verdict(triage, run.name, r) if r.outcome == SURVIVED else None
    judged = f"**{entry['verdict']}**: {_cell(entry['reason'])}" if entry else "not triaged"
    rows.append(
      f"| {m.index} | {m.path}:{m.line} (`{m.function}`) | {_cell(m.description)} |"
      f" {_code(m.after)} | {r.outcome} | {judged} |"
    )
  return rows


def _all_mutants(run: ModuleRun) -> list[str]:
  rows = ["| # | line | mutation | outcome | s | first failure |", "|---:|---:|---|---|---:|---|"]
  for r in run.results:
    m = r.mutant
    rows.append(
      f"| {m.index} | {m.line} | {_cell(m.description)} | {r.outcome} | {r.seconds:.0f} |"
      f" {_cell(r.detail)} |"
    )
  return rows


def _module_section(run: ModuleRun, triage: list[dict]) -> list[str]:
  baseline = "skipped" if run.baseline is None else f"{run.baseline:.0f} s"
  lines = [
    f"## {run.name}",
    "",
    f"`{run.path}`: {run.selected} of its {run.total} mutants selected ({run.selection}),"
    f" {len(run.results)} run. Unmutated tests: {baseline}; limit per mutant: {run.timeout:.0f} s.",
    "",
    "Tests, in the order they run:",
    "",
    *[f"- `{t}`" for t in run.tests],
  ]
  if run.absent:
    lines += ["", "Configured but absent, left out: " + ", ".join(f"`{t}`" for t in run.absent)]
  lines += ["", "### Survivors and timeouts", "", *_survivors(run, triage)]
  lines += ["", "### Every mutant run", "", *_all_mutants(run)]
  return lines


def render(
  runs: list[ModuleRun], triage: list[dict], header: dict[str, str], complete: bool
) -> str:
  """The report's Markdown.

  Args:
    runs: the modules run, in order.
    triage: the triage entries (`load_triage`).
    header: facts printed at the top (command, commit, machine, wall time...), in order.
    complete: False while the run is still going or was interrupted: the report says so.
  """
  lines = ["# Mutation testing report", ""]
  if not complete:
    lines += ["**Incomplete**: the run was interrupted or is still going.", ""]
  lines += [f"- {key}: {value}" for key, value in header.items()]
  lines += [
    "",
    "Kill rate: killed / (mutants run - equivalent - error); a timeout counts as not killed."
    " Verdicts on survivors come from `mutation/triage.toml`.",
    "",
    *_summary(runs, triage),
  ]
  for run in runs:
    lines += ["", *_module_section(run, triage)]
  return "\n".join(lines) + "\n"


def to_json(runs: list[ModuleRun], header: dict[str, str], complete: bool) -> str:
  """The run's results as JSON, to render again later (`from_json`) with a newer triage."""
  data = {"header": header, "complete": complete, "runs": [dataclasses.asdict(r) for r in runs]}
  return json.dumps(data, indent=1) + "\n"


def from_json(text: str) -> tuple[list[ModuleRun], dict[str, str], bool]:
  """``(runs, header, complete)`` as `to_json` wrote them."""
  data = json.loads(text)
  runs = []
  for raw in data["runs"]:
    results = [Result(**{**r, "mutant": Mutant(**r["mutant"])}) for r in raw.pop("results")]
    runs.append(ModuleRun(**raw, results=results))
  return runs, data["header"], data["complete"]


def published(runs: list[tuple[ModuleRun, dict[str, str]]], triage: list[dict]) -> dict:
  """The summary the docs show: per module, its run's counts and every survivor with its verdict.

  Args:
    runs: each module's run with the header of the run it came from, in the configured order.
    triage: the triage entries (`load_triage`), whose verdicts are copied in.
  """
  modules = []
  for run, header in runs:
    c = counts(run, triage)
    survivors = []
    for r in run.results:
      if r.outcome in (SURVIVED, TIMEOUT):
        entry = verdict(triage, run.name, r) if r.outcome == SURVIVED else None
        m = r.mutant
        survivors.append(
          {
            "where": f"#{m.index}: {m.path}:{m.line} (`{m.function}`)",
            "mutation": m.description,
            "after": m.after,
            "outcome": r.outcome,
            "verdict": entry["verdict"] if entry else "not triaged",
            "reason": entry["reason"] if entry else "",
          }
        )
    modules.append(
      {
        "module": run.name,
        "path": run.path,
        "mutants": run.total,
        "run": len(run.results),
        "selection": run.selection,
        "tests": len(run.tests),
        **{k: c[k] for k in (KILLED, SURVIVED, TIMEOUT, ERROR, EQUIVALENT)},
        "rate": c["rate"],
        "survivors": survivors,
        "run_from": {k: header[k] for k in header if k != "pytest"},
      }
    )
  provenance = "python -m mutation, the reports under mutation/reports/ (`--publish`)"
  return {"provenance": provenance, "modules": modules}


def summary_markdown(data: dict) -> str:
  """The block ``mutation`` of docs/development.md: kill rates, then every survivor and why."""
  lines = [
    "| module | mutants run | killed | survived | timeout | equivalent | kill rate | run |",
    "|---|---:|---:|---:|---:|---:|---:|---|",
  ]
  for m in data["modules"]:
    rate = "n/a" if m["rate"] is None else f"{100 * m['rate']:.0f} %"
    frm = m["run_from"]
    run = f"{frm['Started']}, commit {frm['Commit']}"
    if "Survivors run again" in frm:
      run += "; survivors again: " + frm["Survivors run again"]
    lines.append(
      f"| `{m['module']}` | {m['run']} of {m['mutants']} | {m[KILLED]} | {m[SURVIVED]} |"
      f" {m[TIMEOUT]} | {m[EQUIVALENT]} | {rate} | {_cell(run)} |"
    )
  lines += ["", "Every survivor and timeout, with its verdict:", ""]
  lines += ["| module | where | mutation | mutated line | verdict |", "|---|---|---|---|---|"]
  for m in data["modules"]:
    for s in m["survivors"]:
      outcome = "" if s["outcome"] == SURVIVED else f" ({s['outcome']})"
      reason = f"**{s['verdict']}**{outcome}" + (f": {_cell(s['reason'])}" if s["reason"] else "")
      lines.append(
        f"| `{m['module']}` | {_cell(s['where'])} | {_cell(s['mutation'])} | {_code(s['after'])}"
        f" | {reason} |"
      )
  return "\n".join(lines) + "\n"
