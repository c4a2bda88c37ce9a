"""Relative links in the README and the documentation resolve, anchors included; the README is short.

A link ``[text](path#anchor)`` resolves when ``path`` (relative to the page) is an existing file
or folder and, for a Markdown page, ``anchor`` is the anchor of one of its headings. Anchors are
made as MyST makes them (``myst_heading_anchors`` in docs/conf.py, GitHub's rule): the heading's
text and inline code, lower case, spaces to hyphens, every other character that is not a letter,
digit, underscore or hyphen dropped, and ``-1``, ``-2``, ... appended to repeats. Links with a
scheme (``https:``, ``mailto:``) are not checked.
"""

import itertools
import pathlib
import re
import urllib.parse

import pytest
from markdown_it import MarkdownIt

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [
  README,
  *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts),
]
README_MAX_LINES = 250


def _docs_anchor_levels() -> int:
  """The deepest heading level MyST gives an anchor, from docs/conf.py."""
  found = re.search(r"^myst_heading_anchors\s*=\s*(\d+)", (DOCS / "conf.py").read_text(), re.M)
  return int(found[1]) if found else 0


def _tokens(page: pathlib.Path):
  return MarkdownIt("commonmark").parse(page.read_text())


def slugify(title: str) -> str:
  return re.sub(r"[^\w\u4e00-\u9fff\- ]", "", title.lower().replace(" ", "-"))


def anchors(page: pathlib.Path) -> set[str]:
  """The anchors of a page's headings: on GitHub every level, in the docs those MyST makes."""
  levels = _docs_anchor_levels() if page.resolve().is_relative_to(DOCS) else 6
  tokens = _tokens(page)
  found: set[str] = set()
  for opening, inline in itertools.pairwise(tokens):
    if opening.type != "heading_open" or int(opening.tag[1:]) > levels:
      continue
    title = "".join(c.content for c in inline.children or [] if c.type in ("text", "code_inline"))
    slug, base, i = slugify(title), slugify(title), 1
    while slug in found:
      slug, i = f"{base}-{i}", i + 1
    if slug:
      found.add(slug)
  return found


def links(page: pathlib.Path) -> list[tuple[int, str]]:
  """The page's link and image targets as ``(line, target)``: the 1-based line its block starts on."""
  out = []
  for token in _tokens(page):
    for child in token.children or []:
      target = child.attrs.get("href") if child.type == "link_open" else None
      target = child.attrs.get("src") if child.type == "image" else target
      if target is not None:
        out.append((token.map[0] + 1 if token.map else 0, str(target)))
  return out


def broken_links(page: pathlib.Path) -> list[str]:
  """Each relative link of ``page`` that does not resolve, with the reason."""
  problems = []
  for line, target in links(page):
    parts = urllib.parse.urlsplit(target)
    if parts.scheme or parts.netloc:
      continue
    path = urllib.parse.unquote(parts.path)
    resolved = (page.parent / path).resolve() if path else page
    name = page.relative_to(ROOT) if page.resolve().is_relative_to(ROOT) else page
    where = f"{name}:{line}: {target}"
    if not resolved.exists():
      problems.append(f"{where}: no file {path}")
    elif parts.fragment and resolved.suffix != ".md":
      problems.append(f"{where}: an anchor into a file that is not a Markdown page")
    elif parts.fragment and parts.fragment not in anchors(resolved):
      problems.append(f"{where}: {resolved.name} has no heading with anchor #{parts.fragment}")
  return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
  problems = broken_links(page)
  assert not problems, "\n".join(problems)


def test_readme_is_a_front_page():
  lines = README.read_text().splitlines()
  assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_broken_links_are_found(tmp_path):
  (tmp_path / "other.md").write_text(
    "# Other page\n\n## A `code` heading: yes\n\n## Repeat\n\n## Repeat\n"
  )
  page = tmp_path / "page.md"
  page.write_text(
    "# Page\n\n"
    "[ok](other.md#a-code-heading-yes) [ok](other.md#repeat-1) [ok](#page) [ok](https://x.org/y)\n"
    "![ok](other.md)\n\n"
    "[bad](missing.md) [bad](other.md#repeat-2) [bad](#nope)\n\n"
    "```\n[not a link](missing.md)\n```\n"
  )
  assert anchors(tmp_path / "other.md") == {
    "other-page",
    "a-code-heading-yes",
    "repeat",
    "repeat-1",
  }
  problems = broken_links(page)
  assert len(problems) == 3, problems
  assert "missing.md" in problems[0] and "#repeat-2" in problems[1] and "#nope" in problems[2]
