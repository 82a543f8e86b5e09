"""One version, from one source, everywhere a user reads it; the changelog and the
license that go with it.

``pyproject.toml``'s ``version`` is the source: the installed metadata,
``outboxkit.__version__``, ``outboxkit --version`` and CHANGELOG.md's headings
must agree with it, the docs name versions rather than "release 2" or "this
release", and a built wheel declares the license as an SPDX expression and
carries the LICENSE file.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import outboxkit
from outboxkit.schema.table import SCHEMA_VERSION

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
#: ``## [0.3.0] - 2026-12-06``
RELEASED = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.MULTILINE)
#: Where a user reads what a version does: the docs, and the text the code prints.
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ["outboxkit", "relay", "consumer", "schema", "deploy", "examples", "bench", "chaos"]
#: A release named by a number of its own, or as "this release".
UNVERSIONED = re.compile(r"\brelease[- ]\d\b|\bthis release\b", re.IGNORECASE)


def test_the_version_is_semantic_and_one_everywhere() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
    assert importlib.metadata.version("outboxkit") == VERSION
    assert outboxkit.__version__ == VERSION


def test_outboxkit_version_prints_the_package_and_schema_versions() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "outboxkit", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"outboxkit {VERSION} (outbox schema {SCHEMA_VERSION})\n"


def test_the_changelog_has_a_heading_for_the_package_version() -> None:
    """Keep a Changelog: ``[Unreleased]`` on top, then the releases, newest first,
    each dated and linked at the bottom."""
    headings = re.findall(r"^## \[([^\]]+)\]", CHANGELOG, re.MULTILINE)
    assert headings[0] == "Unreleased"
    released = RELEASED.findall(CHANGELOG)
    assert [v for v, _ in released] == headings[1:], "a release heading without its date"
    assert VERSION in headings
    numbers = [tuple(int(p) for p in v.split(".")) for v, _ in released]
    assert numbers == sorted(numbers, reverse=True), "releases not newest first"
    assert [d for _, d in released] == sorted((d for _, d in released), reverse=True)
    for name in headings:
        assert re.search(rf"^\[{re.escape(name)}\]: \S+$", CHANGELOG, re.MULTILINE), name


def test_the_changelog_says_each_change_once() -> None:
    """An entry merged twice (two branches each adding the same line, or a line
    rewritten beside its old self) reads as two changes: every entry of a section
    starts differently from the others (its first 60 characters)."""
    for section in re.split(r"^## ", CHANGELOG, flags=re.MULTILINE)[1:]:
        for group in re.split(r"^### ", section, flags=re.MULTILINE)[1:]:
            entries = re.findall(r"^- (.*(?:\n  .*)*)", group, re.MULTILINE)
            starts = [" ".join(e.split())[:60] for e in entries]
            twice = sorted({s for s in starts if starts.count(s) > 1})
            assert not twice, f"{section.splitlines()[0]} / {group.splitlines()[0]}: {twice}"


def test_the_docs_and_messages_name_versions_not_releases() -> None:
    found = []
    files = DOC_PAGES + [
        p
        for d in CODE_DIRS
        for p in sorted((ROOT / d).rglob("*"))
        if p.suffix in (".py", ".md", ".yaml", ".yml", ".sh") and ".state" not in p.parts
    ]
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if UNVERSIONED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_the_license_file_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_wheel_declares_the_license_and_carries_its_file(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    [wheel] = tmp_path.glob(f"outboxkit-{VERSION}-*.whl")
    info = f"outboxkit-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"{info}/METADATA").decode()
        carried = zf.read(f"{info}/licenses/LICENSE").decode()
    headers = metadata.split("\n\n", 1)[0].splitlines()
    assert f"Version: {VERSION}" in headers
    assert "License-Expression: Apache-2.0" in headers
    assert "License-File: LICENSE" in headers
    assert not [h for h in headers if h.startswith(("License:", "Classifier: License"))]
    assert carried == (ROOT / "LICENSE").read_text()
