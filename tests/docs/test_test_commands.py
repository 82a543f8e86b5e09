"""The docs' commands that run tests give the tests their services.

Without ``OUTBOXKIT_TEST_*`` every test that needs a service skips locally, and
a command copied from the docs reported ``6 skipped`` and exit 0: a run that
checked nothing, looking like a pass. So every ``pytest`` command in README.md
and docs/ is a line of a ```sh block that first sets the services' addresses
(``eval "$(deploy/local/up.sh)"``), and each such block is run here as written,
in a shell without those variables, with ``--collect-only`` added to pytest
(the long runs themselves are not this test's business), and must end with the
addresses set.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SH_BLOCK = re.compile(r"^```(?:sh|bash)[ \t]*\n(.*?)^```", re.S | re.M)
PYTEST = re.compile(r"(?:\S*python3?\s+-m\s+)?\bpytest\b")
SERVICES = ("OUTBOXKIT_TEST_DB_URL", "OUTBOXKIT_TEST_KAFKA_BOOTSTRAP", "OUTBOXKIT_TEST_REDIS_URL")


def pytest_blocks() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in SH_BLOCK.finditer(text):
            if PYTEST.search(match.group(1)):
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{path.relative_to(REPO)}:{line}", match.group(1)))
    return found


def test_no_pytest_command_is_inline_prose() -> None:
    """An inline `python -m pytest ...` cannot carry the line that sets the services."""
    bad = []
    for path in DOCS:
        prose = SH_BLOCK.sub("", path.read_text())
        for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose):
            if re.search(r"-m pytest\b", span):
                bad.append(f"{path.relative_to(REPO)}: `{span}`")
    assert not bad, 'make these ```sh blocks that start with eval "$(deploy/local/up.sh)":\n' + (
        "\n".join(bad)
    )


BLOCKS = pytest_blocks()


def test_the_docs_have_test_commands() -> None:
    assert BLOCKS, "no ```sh block with pytest found: the extraction is broken"


@pytest.mark.parametrize(("where", "block"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_a_test_command_runs_as_written_with_the_services_set(where: str, block: str) -> None:
    script = block.replace(".venv/bin/python", sys.executable)
    script = re.sub(r"-m pytest\b", "-m pytest --collect-only -q -p no:cacheprovider", script)
    check = " && ".join(f'test -n "${var}"' for var in SERVICES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    ran = subprocess.run(
        ["bash", "-e", "-c", f"{script}\n{check}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
        check=False,
    )
    assert ran.returncode == 0, (
        f"{where}: the block leaves the tests without their services (they would all "
        f'skip): start it with eval "$(deploy/local/up.sh)"\n{block}\n{ran.stderr[-3000:]}'
    )


def test_a_skip_for_a_missing_service_gives_the_command_that_sets_it(tmp_path: Path) -> None:
    """``up.sh`` alone only prints the exports: the reason names the eval form."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_") and k != "CI"}
    env["DOCKER_HOST"] = "unix:///nonexistent/docker.sock"  # no testcontainers either
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-rs",
         "tests/test_topics.py::test_kafka_unreachable_is_exit_3",
         "tests/test_topics.py::test_ensure_creates_then_finds_the_topics_as_asked"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300, check=False,
    )  # fmt: skip
    assert "1 passed, 1 skipped" in ran.stdout, ran.stdout[-3000:]
    assert (
        "OUTBOXKIT_TEST_KAFKA_BOOTSTRAP is not set and no Docker engine answers "
        '(run: eval "$(deploy/local/up.sh)")'
    ) in ran.stdout, ran.stdout[-3000:]
