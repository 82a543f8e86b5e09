"""Relative links between README.md and docs/ point at files and headings that exist.

The close order and the requeue-order rule are written once (docs/relay.md) and
linked from elsewhere; a renamed heading must not leave those links dangling.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """Heading anchors as GitHub renders them: lower case, punctuation dropped."""
    out = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if match:
            text = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            problems.append(f"{page.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{page.name}: {target}: no heading #{anchor}")
    return problems


def test_links_between_pages_resolve() -> None:
    problems = [p for page in PAGES for p in broken_links(page)]
    assert problems == []


def test_the_link_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Title\n\n## Close order\n")
    page.write_text("[x](b.md#close-order) [y](b.md#gone) [z](c.md)\n")
    assert broken_links(page) == [
        "a.md: b.md#gone: no heading #gone",
        "a.md: c.md: no such file",
    ]
