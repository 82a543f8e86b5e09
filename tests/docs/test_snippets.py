"""Every ```python block in README.md and docs/ is a tested example.

Each block is preceded by a marker comment (invisible when rendered) that says
how it is tested:

* ``<!-- snippet: run -->``: executed as a script against the local services
  (a fresh database with the outbox schema applied, Kafka, Redis); also
  type-checked. The addresses in the text (``mysql+pymysql://...``,
  ``mysql+asyncmy://...``, ``redis://...``, ``"kafka:9092"``) are replaced by
  the local ones.
* ``<!-- snippet: typecheck -->``: a fragment that needs a running service or
  runs until stopped; type-checked with strict mypy only.

Lines after the first inside the comment are a hidden prelude, prepended to the
block (imports and objects the text takes for granted):

    <!-- snippet: run
    import threading
    draining = threading.Event()
    -->

A block without a marker, or with an unknown kind, fails the suite: a new
example must say how it is tested. So a renamed argument or a removed import
breaks the build instead of the reader.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KINDS = ("run", "typecheck")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*snippet:[ \t]*(\S*)([^\n]*)\n?(.*?)-->\s*\Z", re.S)


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int
    kind: str | None  # None: no marker
    prelude: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def module(self) -> str:
        stem = re.sub(r"\W", "_", self.path.stem.lower())
        return f"snippet_{stem}_{self.line}"

    def source(self) -> str:
        return f"{self.prelude}\n# --- {self.name}\n{self.code}"


def snippets(paths: list[Path] = DOCS) -> list[Snippet]:
    found = []
    for path in paths:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip() + "\n"
            marker = MARKER.search(before[before.rfind("<!--") :]) if "<!--" in before else None
            # The marker must be the last thing before the fence.
            if marker is not None and not before.rstrip().endswith("-->"):
                marker = None
            found.append(
                Snippet(
                    path=path,
                    line=line,
                    kind=marker.group(1) if marker else None,
                    prelude=marker.group(3) if marker else "",
                    code=match.group(1),
                )
            )
    return found


ALL = snippets()


def test_every_python_block_says_how_it_is_tested() -> None:
    assert ALL, "no ```python block found: the extraction is broken"
    bad = [f"{s.name}: {s.kind or 'no marker'}" for s in ALL if s.kind not in KINDS]
    assert not bad, (
        "mark each ```python block with <!-- snippet: run --> or "
        "<!-- snippet: typecheck --> (see tests/docs/test_snippets.py):\n" + "\n".join(bad)
    )


def test_an_unmarked_block_is_found(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "text\n\n```python\nprint(1)\n```\n\n<!-- snippet: run -->\n```python\nprint(2)\n```\n"
        "\n<!-- snippet: typecheck\nx: int\n-->\n\n```python\nprint(x)\n```\n"
    )
    kinds = [(s.kind, s.prelude.strip()) for s in snippets([doc])]
    assert kinds == [(None, ""), ("run", ""), ("typecheck", "x: int")]


# --- type checking -------------------------------------------------------------


def _mirror(tmp_path: Path) -> Path:
    """The installed package layout as symlinks (as deploy/local/typecheck.sh does):
    the editable install maps relay/, consumer/ and schema/ into outboxkit."""
    root = tmp_path / "mirror"
    pkg = root / "outboxkit"
    pkg.mkdir(parents=True)
    for entry in (REPO / "outboxkit").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for sub in ("relay", "consumer", "schema"):
        (pkg / sub).symlink_to(REPO / sub)
    return root


def _mypy(tmp_path: Path, chosen: list[Snippet]) -> subprocess.CompletedProcess[str]:
    src = tmp_path / "snippets"
    src.mkdir()
    for s in chosen:
        (src / f"{s.module}.py").write_text(s.source())
    env = {**os.environ, "MYPYPATH": str(_mirror(tmp_path))}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--config-file",
            os.devnull,
            *[str(p) for p in sorted(src.glob("*.py"))],
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
        check=False,
    )


def test_every_snippet_type_checks(tmp_path: Path) -> None:
    result = _mypy(tmp_path, [s for s in ALL if s.kind in KINDS])
    assert result.returncode == 0, result.stdout + result.stderr


def test_type_checking_catches_a_renamed_argument(tmp_path: Path) -> None:
    (target,) = [s for s in ALL if "handle_signals=False" in s.code and s.kind == "typecheck"]
    broken = Snippet(
        target.path,
        target.line,
        target.kind,
        target.prelude,
        target.code.replace("handle_signals=False", "handle_signal=False"),
    )
    result = _mypy(tmp_path, [broken])
    assert result.returncode != 0
    assert "handle_signal" in result.stdout, result.stdout


# --- running ---------------------------------------------------------------------


def _localize(source: str, *, db_url: str, bootstrap: str, redis_url: str) -> str:
    source = re.sub(r"mysql\+pymysql://[^\"'\s]+", lambda _: db_url, source)
    async_url = db_url.replace("mysql+pymysql://", "mysql+asyncmy://", 1)
    source = re.sub(r"mysql\+asyncmy://[^\"'\s]+", lambda _: async_url, source)
    source = re.sub(r"redis://[^\"'\s]+", lambda _: redis_url, source)
    return source.replace('"kafka:9092"', repr(bootstrap))


@pytest.mark.integration
@pytest.mark.parametrize("snippet", [s for s in ALL if s.kind == "run"], ids=lambda s: s.name)
def test_run_snippet_against_the_local_services(
    snippet: Snippet,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    redis_url: str,
    tmp_path: Path,
) -> None:
    script = tmp_path / f"{snippet.module}.py"
    script.write_text(
        _localize(snippet.source(), db_url=db_url, bootstrap=kafka_bootstrap, redis_url=redis_url)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # not the repository: its outboxkit/ folder would shadow the package
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"{snippet.name} failed:\n{result.stderr[-4000:]}"
