"""Every ``pip install`` of outboxkit in the docs works as written, or says it
is for after publication.

outboxkit is not on the package index: ``pip install outboxkit`` finds
nothing today, or, were someone else to register the name, their package. So
a command that installs outboxkit by name must say on its line that it is for
after publication. The others install from this repository: a clone's folder
(``.`` / ``-e .``, or ``../outboxkit`` from a folder beside the clone, with
extras that pyproject.toml declares) or the wheel that
``python -m build`` writes (``dist/outboxkit-<version>-py3-none-any.whl``, the
name tests/test_packaging.py builds and installs).
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").rglob("*.md")),
    *sorted((REPO / "examples").rglob("README.md")),
    *sorted((REPO / "deploy").rglob("README.md")),
]
# "pip install" and what follows it on the line, up to the end of an inline
# code span or a shell comment.
COMMAND = re.compile(r"pip install([^`#\n]*)")
AFTER_PUBLICATION = re.compile(r"after publication", re.I)


def _project() -> dict[str, Any]:
    with (REPO / "pyproject.toml").open("rb") as f:
        project: dict[str, Any] = tomllib.load(f)["project"]
    return project


def _extras(requirement: str) -> tuple[str, set[str]]:
    m = re.fullmatch(r"([^\[\]]*)(?:\[([\w,\s-]*)\])?(.*)", requirement)
    assert m is not None, requirement
    extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
    return m.group(1), extras


def problems_of(line: str) -> list[str]:
    """What is wrong with each ``pip install`` of outboxkit on ``line``."""
    project = _project()
    declared = set(project["optional-dependencies"])
    wheel = re.compile(
        r"dist/outboxkit-(<version>|" + re.escape(str(project["version"])) + r")"
        r"-py3-none-any\.whl"
    )
    found = []
    for m in COMMAND.finditer(line):
        try:
            words = shlex.split(m.group(1))
        except ValueError:
            words = m.group(1).split()
        for word in words:
            if word.startswith("-") or word.startswith("<"):
                continue
            where, extras = _extras(word)
            unknown = extras - declared
            if unknown:
                found.append(f"{word}: no extra {sorted(unknown)} in pyproject.toml")
            if re.match(r"outboxkit\b", where):
                if not AFTER_PUBLICATION.search(line):
                    found.append(f"{word}: installs from the index; mark it 'after publication'")
            elif where.startswith("dist/"):
                if not wheel.fullmatch(where):
                    found.append(f"{word}: not the wheel `python -m build` writes")
            elif where in (".", "./") or re.fullmatch(r"(\.\./)+outboxkit/?", where):
                pass  # the clone: this folder, or one named outboxkit beside it
            elif "outboxkit" in where:
                found.append(f"{word}: an outboxkit source this test does not know")
    return found


def test_every_install_command_works_or_is_marked_for_after_publication() -> None:
    problems = []
    seen = 0
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "pip install" in line:
                seen += 1
                problems += [f"{path.relative_to(REPO)}:{n}: {p}" for p in problems_of(line)]
    assert seen >= 6
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("pip install 'outboxkit[postgres]'", "after publication"),
        ("`pip install outboxkit` and go", "after publication"),
        ("pip install '.[postgress]'", "no extra"),
        ("pip install 'dist/outboxkit-9.9.9-py3-none-any.whl'", "not the wheel"),
        ("pip install ../outboxkit-main", "does not know"),
    ],
)
def test_the_check_catches_a_bad_line(line: str, expected: str) -> None:
    assert any(expected in p for p in problems_of(line)), problems_of(line)


@pytest.mark.parametrize(
    "line",
    [
        "pip install 'outboxkit[otel]'      # after publication on the package index",
        "pip install '.[postgres]'",
        "pip install -e '.[dev]'",
        "pip install '../outboxkit[async]'   # the clone beside this folder",
        "pip install 'dist/outboxkit-<version>-py3-none-any.whl[postgres,otel]'",
        "`pip install py-spy`",
    ],
)
def test_the_check_passes_a_good_line(line: str) -> None:
    assert problems_of(line) == []
