"""Generated means generated: the tables of README.md and docs/ are written from committed results.

Every block of README.md and of the pages under docs/ (``<!-- NAME: begin -->`` ...
``<!-- NAME: end -->``) must read exactly as its renderer (`benchmarks.generated.BLOCKS`) writes it
from the committed file under benchmarks/results/; no Markdown table of README.md or
docs/benchmarks/ may lie outside such a block. The renderers only read JSON, so this is fast.
"""

from __future__ import annotations

import pathlib

import pytest

from benchmarks import generated

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The files where every table must be generated; the guides and the reference pages may hold
# small explanatory tables, but their blocks, if any, are checked like all others.
NO_HAND_TABLES = [ROOT / "README.md", *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]


def hand_tables(text: str) -> list[int]:
  """The 1-based lines of ``text`` that are Markdown table rows outside blocks and code fences."""
  inside = set()
  for _, first, last in generated.blocks_in(text):
    inside.update(range(first, last + 1))
  found, fence = [], None
  for i, line in enumerate(text.splitlines()):
    stripped = line.lstrip()
    if fence is None and stripped[:3] in ("```", "~~~"):
      fence = stripped[:3]
    elif fence is not None and stripped.startswith(fence):
      fence = None
    elif fence is None and stripped.startswith("|") and i not in inside:
      found.append(i + 1)
  return found


def spans(lines: list[int]) -> str:
  """``[1, 2, 3, 7]`` as ``"1-3, 7"``."""
  out: list[list[int]] = []
  for n in lines:
    if out and n == out[-1][-1] + 1:
      out[-1].append(n)
    else:
      out.append([n])
  return ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in out)


def test_every_block_reads_as_its_renderer_writes_it():
  wrong = generated.differences()
  assert not wrong, (
    "blocks that differ from what their renderer writes from benchmarks/results/ (run "
    "`python benchmarks/generated.py` after changing a results file or a renderer; never edit a "
    "block by hand):\n" + "\n".join(wrong)
  )


def test_every_block_is_published_and_every_results_file_read():
  held = {
    name for path in generated.pages() for name, _, _ in generated.blocks_in(path.read_text())
  }
  assert sorted(set(generated.BLOCKS) - held) == [], "renderers whose block no page holds"
  read = {f for b in generated.BLOCKS.values() for f in (b.results, *b.also)}
  committed = {p.name for p in generated.RESULTS.glob("*.json")}
  assert sorted(committed - read) == [], "results files no block is rendered from"
  assert sorted(read - {None} - committed) == [], "blocks whose results file is not committed"


@pytest.mark.parametrize("path", NO_HAND_TABLES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_table_outside_a_generated_block(path):
  lines = hand_tables(path.read_text())
  assert not lines, (
    f"{path.relative_to(ROOT)}: table rows outside a generated block, lines {spans(lines)}: put "
    "the "
    "figures in a results file under benchmarks/results/ and render the table from it "
    "(benchmarks/generated.py)"
  )


def test_a_transcribed_results_file_says_where_it_comes_from():
  for block in generated.BLOCKS.values():
    if block.results not in (None, "robustness.json"):  # robustness.json: the runs themselves
      assert "provenance" in generated.load(block.results), block.results


def test_a_number_edited_by_hand_is_found(tmp_path):
  page = ROOT / "docs" / "benchmarks" / "experiments.md"
  text = page.read_text()
  row = "| 180 | 2.17 |"
  assert text.count(row) == 1
  edited = tmp_path / "experiments.md"
  edited.write_text(text.replace(row, "| 180 | 2.07 |"))
  assert generated.differences([page]) == []
  assert generated.differences([edited]) == [
    f"{edited}: block 'results table' differs from what experiments.report:summary_markdown writes"
  ]
  # Rewriting the block restores it.
  assert generated.regenerate(files=[edited]) == [edited]
  assert edited.read_text() == text


def test_a_table_outside_a_block_or_an_unknown_block_is_found(tmp_path):
  body = generated.render("step time")
  page = "\n".join(
    [
      "# Page",
      "<!-- step time: begin -->",
      body,
      "<!-- step time: end -->",
      "",
      "```text",
      "| inside a code fence |",
      "```",
      "| a | b |",
      "|---|---|",
    ]
  )
  first = len(body.splitlines()) + 8
  assert hand_tables(page) == [first, first + 1]
  unknown = tmp_path / "page.md"
  unknown.write_text("<!-- made up: begin -->\n| 1 |\n<!-- made up: end -->\n")
  assert generated.differences([unknown]) == [
    f"{unknown}: block 'made up' has no renderer in benchmarks/generated.py"
  ]


@pytest.mark.parametrize(
  ("text", "message"),
  [
    ("<!-- a: begin -->\n", "never ends"),
    ("<!-- a: end -->\n", "ends where it did not begin"),
    ("<!-- a: begin -->\n<!-- b: begin -->\n<!-- b: end -->\n<!-- a: end -->\n", "inside block"),
  ],
)
def test_markers_must_pair(text, message):
  with pytest.raises(ValueError, match=message):
    generated.blocks_in(text)


def test_replace_keeps_the_rest_of_the_file():
  text = "intro\n<!-- x: begin -->\nold\nlines\n<!-- x: end -->\noutro"
  assert (
    generated.replace(text, "x", "new") == "intro\n<!-- x: begin -->\nnew\n<!-- x: end -->\noutro"
  )
  assert generated.replace(text + "\n", "x", "new").endswith("outro\n")
