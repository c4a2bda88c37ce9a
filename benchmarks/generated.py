"""Generated text: the blocks of README.md and docs/ that scripts write from committed results.

A block is the text between ``<!-- NAME: begin -->`` and ``<!-- NAME: end -->`` (each marker
on a line of its own). `BLOCKS` names, for every block, the results files it is rendered from
(under ``benchmarks/results/``) and the function that renders it: the function the owning script
uses when it prints or publishes a run, so that a new run rewrites the results file and every
block drawn from it. A block may appear in several files; it reads the same in each.

``python benchmarks/generated.py`` rewrites every block from the committed results;
``--check`` only lists the blocks whose committed text differs (exit status 1 when any does),
``--list`` every block with its files, renderer, results file and the command that remeasures it.
``tests/test_generated.py`` runs that check, and checks that no table in README.md or
``docs/benchmarks/`` lies outside a block.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
DOCS = ROOT / "docs"

if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))


@dataclasses.dataclass(frozen=True)
class Block:
  """How one block is made.

  Attributes:
    results: its results file under ``benchmarks/results/``; None for a block rendered from the
      library's own data (the cluster presets).
    renderer: ``"module:function"``; the function takes the loaded results (nothing when
      ``results`` is None) and returns the block's Markdown.
    command: the command that measures the results anew and rewrites the block.
    also: further results files, passed to the renderer after ``results``, in order.
  """

  results: str | None
  renderer: str
  command: str
  also: tuple[str, ...] = ()


BLOCKS: dict[str, Block] = {
  "mutation": Block(
    "mutation.json",
    "mutation.report:summary_markdown",
    "python -m mutation, then python -m mutation --publish mutation/reports/all.json",
  ),
  "robustness": Block(
    "robustness.json",
    "benchmarks.robustness:report",
    "python benchmarks/robustness.py --page",
    also=("robustness_rerun.json",),
  ),
  "robustness targets": Block(
    "robustness.json",
    "benchmarks.robustness:readme",
    "python benchmarks/robustness.py --page",
    also=("robustness_rerun.json",),
  ),
  "adaptive damping": Block(
    "adaptive_damping.json",
    "benchmarks.adaptive_damping:render",
    "python benchmarks/adaptive_damping.py",
  ),
  "adaptive damping, gradient rule": Block(
    "adaptive_damping_gradient.json",
    "benchmarks.adaptive_damping:render",
    "python benchmarks/adaptive_damping.py --step-rule gradient",
  ),
  "results table": Block(
    "experiments.json",
    "experiments.report:summary_markdown",
    "python -m experiments summary --seeds 0 1 2 --publish",
  ),
  "scaling": Block(
    "scaling.json",
    "experiments.scale:summary_markdown",
    "python -m experiments scale-summary --publish",
  ),
  "scaling targets": Block(
    "scaling.json",
    "experiments.scale:targets_readme",
    "python -m experiments scale-summary --publish",
  ),
  "step time": Block(
    "step_time.json", "benchmarks.step_time:render", "python benchmarks/step_time.py --publish"
  ),
  "allocator": Block(
    "allocator.json",
    "benchmarks.step_time:render_allocator",
    "python benchmarks/generated.py (after editing benchmarks/results/allocator.json)",
  ),
  "compile time": Block(
    "compile_time.json",
    "benchmarks.compile_time:render",
    "python benchmarks/compile_time.py --publish",
  ),
  "stacks step time": Block(
    "compile_time.json",
    "benchmarks.compile_time:render_step_comparison",
    "python benchmarks/generated.py (after editing benchmarks/results/compile_time.json)",
  ),
  "cluster presets": Block(
    None, "benchmarks.projection:render_presets", "python benchmarks/generated.py"
  ),
  "projected step time": Block(
    "projection.json", "benchmarks.projection:render", "python benchmarks/projection.py --publish"
  ),
  "device drift": Block(
    "device_drift.json",
    "benchmarks.device_drift:render",
    "python benchmarks/device_drift.py --publish",
  ),
  "gpu check": Block(
    "gpu_check.json",
    "benchmarks.gpu_check:render",
    "python benchmarks/gpu_check.py --repeats 1 --out benchmarks/results/gpu_check.json (on the "
    "GPU), then python benchmarks/generated.py",
  ),
  "gpu check xla defaults": Block(
    "gpu_check_xla_defaults.json",
    "benchmarks.gpu_check:render",
    "XLA_FLAGS=--xla_gpu_enable_triton_gemm=true python benchmarks/gpu_check.py --repeats 1 "
    "--no-projection --out benchmarks/results/gpu_check_xla_defaults.json (on the GPU), then "
    "python benchmarks/generated.py",
  ),
  "gpu check autotuning off": Block(
    "gpu_check_autotune0.json",
    "benchmarks.gpu_check:render",
    "XLA_FLAGS='--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=true' python "
    "benchmarks/gpu_check.py --models resnet50 --steps 11 --repeats 1 --out "
    "benchmarks/results/gpu_check_autotune0.json (on the GPU), then python benchmarks/generated.py",
  ),
  "production plans": Block(
    "production_plans.json",
    "benchmarks.production:render_plans",
    "python benchmarks/production.py --publish",
  ),
  "production cpu": Block(
    "production_cpu.json",
    "benchmarks.gpu_check:render",
    "python benchmarks/gpu_check.py --batch 2 --repeats 1 --out "
    "benchmarks/results/production_cpu.json, then python benchmarks/generated.py",
  ),
  "projected time to target": Block(
    "projected_time_to_target.json",
    "benchmarks.projected_time_to_target:render",
    "python benchmarks/projected_time_to_target.py --publish",
  ),
  "memory at scale": Block(
    "memory_at_scale.json",
    "benchmarks.memory_at_scale:render",
    "python benchmarks/memory_at_scale.py --publish",
  ),
}

_MARKER = re.compile(r"^<!-- (?P<name>[^:>]+): (?P<kind>begin|end) -->$")


def begin(name: str) -> str:
  return f"<!-- {name}: begin -->"


def end(name: str) -> str:
  return f"<!-- {name}: end -->"


def blocks_in(text: str) -> list[tuple[str, int, int]]:
  """The blocks of ``text`` as ``(name, first line, last line)`` (0-based, markers included).

  Raises `ValueError` for an end without its begin, a begin without its end or a block inside
  another.
  """
  found, open_ = [], None
  for i, line in enumerate(text.splitlines()):
    m = _MARKER.match(line.strip())
    if m is None:
      continue
    name, kind = m["name"], m["kind"]
    if kind == "begin":
      if open_ is not None:
        raise ValueError(f"line {i + 1}: block {name!r} begins inside block {open_[0]!r}")
      open_ = (name, i)
    else:
      if open_ is None or open_[0] != name:
        raise ValueError(f"line {i + 1}: block {name!r} ends where it did not begin")
      found.append((name, open_[1], i))
      open_ = None
  if open_ is not None:
    raise ValueError(f"block {open_[0]!r} begins on line {open_[1] + 1} and never ends")
  return found


def body(text: str, name: str) -> str:
  """The text of the block ``name`` in ``text`` (its first, if it occurs more than once)."""
  lines = text.splitlines()
  for found, first, last in blocks_in(text):
    if found == name:
      return "\n".join(lines[first + 1 : last])
  raise KeyError(f"no block {name!r}")


def replace(text: str, name: str, markdown: str) -> str:
  """``text`` with every block ``name`` holding ``markdown``."""
  lines = text.splitlines(keepends=True)
  for found, first, last in reversed(blocks_in(text)):
    if found == name:
      lines[first : last + 1] = [f"{begin(name)}\n{markdown}\n{end(name)}\n"]
  out = "".join(lines)
  return out if text.endswith("\n") else out.removesuffix("\n")


def pages() -> list[Path]:
  """The files that may hold blocks: README.md and every Markdown page under docs/."""
  docs = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
  return [README, *docs] if README.exists() else docs


def load(name: str) -> Any:
  """The committed results file ``name`` (under ``benchmarks/results/``)."""
  return json.loads((RESULTS / name).read_text())


def write_whole(path: Path, text: str) -> None:
  """Writes ``path`` under a temporary name, then renames it: whole or not at all."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  tmp.replace(path)


def save(name: str, results: Any) -> Path:
  """Writes the results file ``name`` (under ``benchmarks/results/``) whole."""
  path = RESULTS / name
  write_whole(path, json.dumps(results, indent=1) + "\n")
  return path


def renderer(name: str) -> Callable[..., str]:
  module, function = BLOCKS[name].renderer.split(":")
  return getattr(importlib.import_module(module), function)


def render(name: str) -> str:
  """The block ``name`` as its renderer writes it from the committed results."""
  block = BLOCKS[name]
  fn = renderer(name)
  if block.results is None:
    return fn()
  return fn(load(block.results), *(load(name) for name in block.also))


def differences(files: Iterable[Path] | None = None) -> list[str]:
  """``"FILE: block NAME"`` for every block whose committed text is not what its renderer writes.

  A block of no known name, or markers that do not pair, count as differences too.
  """
  out, rendered = [], {}
  for path in pages() if files is None else files:
    text = path.read_text()
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    try:
      found = blocks_in(text)
    except ValueError as error:
      out.append(f"{where}: {error}")
      continue
    lines = text.splitlines()
    for name, first, last in found:
      if name not in BLOCKS:
        out.append(f"{where}: block {name!r} has no renderer in benchmarks/generated.py")
        continue
      if name not in rendered:
        rendered[name] = render(name)
      if "\n".join(lines[first + 1 : last]) != rendered[name]:
        out.append(f"{where}: block {name!r} differs from what {BLOCKS[name].renderer} writes")
  return out


def regenerate(
  names: Iterable[str] | None = None, files: Iterable[Path] | None = None
) -> list[Path]:
  """Rewrites the blocks ``names`` (every block when None) in ``files``; the files changed."""
  wanted = set(BLOCKS if names is None else names)
  changed, rendered = [], {}
  for path in pages() if files is None else files:
    text = new = path.read_text()
    for name in {n for n, _, _ in blocks_in(text)} & wanted:
      if name not in rendered:
        rendered[name] = render(name)
      new = replace(new, name, rendered[name])
    if new != text:
      write_whole(path, new)
      changed.append(path)
  return changed


def write(name: str, markdown: str, files: Iterable[Path] | None = None) -> list[Path]:
  """Writes ``markdown`` into every block ``name`` of ``files`` (every page when None).

  Returns the files changed; raises `KeyError` when no file holds the block.
  """
  changed, held = [], False
  for path in pages() if files is None else files:
    text = path.read_text()
    if name not in {n for n, _, _ in blocks_in(text)}:
      continue
    held = True
    new = replace(text, name, markdown)
    if new != text:
      write_whole(path, new)
      changed.append(path)
  if not held:
    raise KeyError(f"no file holds the block {name!r} ({begin(name)} ... {end(name)})")
  return changed


def publish(results_file: str, results: Any) -> list[Path]:
  """Writes a results file, then every block rendered from it; the files written."""
  path = save(results_file, results)
  names = [n for n, b in BLOCKS.items() if results_file in (b.results, *b.also)]
  return [path, *regenerate(names)]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--check", action="store_true", help="only list the blocks that differ")
  parser.add_argument(
    "--list", action="store_true", help="list every block: where it is, what writes it, from what"
  )
  args = parser.parse_args(argv)
  if args.list:
    held: dict[str, list[str]] = {}
    for path in pages():
      for name, _, _ in blocks_in(path.read_text()):
        held.setdefault(name, []).append(str(path.relative_to(ROOT)))
    for name, block in BLOCKS.items():
      where = ", ".join(held.get(name, ["(no file)"]))
      files = ", ".join(filter(None, (block.results, *block.also)))
      print(f"{name}: in {where}; {block.renderer} from {files}; rerun: {block.command}")
    return
  if args.check:
    wrong = differences()
    print("\n".join(wrong) or "every block matches its results")
    raise SystemExit(1 if wrong else 0)
  for path in regenerate():
    print(f"rewrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
  main()
