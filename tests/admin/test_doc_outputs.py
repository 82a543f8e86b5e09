"""Every output example docs/admin.md shows is what the command prints.

The page writes the rows of its examples as ``enqueue`` calls (a block after
``<!-- rows of the examples -->``); this test runs those calls, then each
command named by an ``<!-- output of: outboxkit admin ... -->`` marker, and
compares its output with the block that follows the marker. Times differ from
run to run and are compared as ``<time>``; runs of spaces (column widths) as one.
Every other fenced block must be commands (``outboxkit ...``) or a tested
Python snippet, so a new output example cannot go unchecked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases

import outboxkit
from outboxkit.schema import apply_schema

REPO = Path(__file__).resolve().parents[2]
ADMIN = REPO / "docs" / "admin.md"
FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(.*?)\s*-->\s*\Z", re.S)
TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z")
#: What the page says of its example rows: "both failed after one attempt with ...".
LAST_ERROR = "MSG_SIZE_TOO_LARGE: Broker: Message size too large"


def blocks() -> list[tuple[str, str, str]]:
    """(marker text or "", language, body) of every fenced block of the page."""
    text = ADMIN.read_text()
    out = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip()
        last = before[before.rfind("<!--") :]
        marker = MARKER.search(last) if before.endswith("-->") else None
        out.append((marker.group(1) if marker else "", match.group(1), match.group(2)))
    return out


def normalized(text: str) -> list[str]:
    lines = [re.sub(r" {2,}", " ", TIME.sub("<time>", line)).rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def test_every_block_of_the_page_is_a_command_a_snippet_or_a_checked_output() -> None:
    unchecked = [
        body
        for marker, lang, body in blocks()
        if not (
            marker.startswith(("output of:", "rows of the examples", "snippet:"))
            or all(  # commands and usage lines (continued lines indented)
                line.startswith(("outboxkit ", "export ", " ")) or not line.strip()
                for line in body.splitlines()
            )
        )
    ]
    assert not unchecked, "mark these blocks (see this test's docstring):\n" + "\n---\n".join(
        unchecked
    )
    assert sum(m.startswith("output of:") for m, _, _ in blocks()) >= 3


@pytest.mark.integration
@on_both_databases
def test_each_output_example_is_what_the_command_prints(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    try:
        apply_schema(engine)  # 64 shards, as the page says
        (rows,) = [body for marker, _, body in blocks() if marker == "rows of the examples"]
        with engine.begin() as conn:
            exec(rows, {"enqueue": outboxkit.enqueue, "conn": conn})  # noqa: S102 - the page's own calls
            conn.execute(
                sa.text(
                    "UPDATE outbox_events SET status = 'failed', attempts = 1, last_error = :e"
                ),
                {"e": LAST_ERROR},
            )
    finally:
        engine.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env["OUTBOXKIT_DB_URL"] = db_url
    checked = 0
    for marker, _, body in blocks():
        if not marker.startswith("output of:"):
            continue
        command = shlex.split(marker.removeprefix("output of:"))
        assert command[:2] == ["outboxkit", "admin"], marker
        ran = subprocess.run(
            [sys.executable, "-P", "-m", *command],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=120,
            check=False,
        )
        assert ran.returncode == 0, f"{marker}: {ran.stderr}"
        assert normalized(ran.stdout) == normalized(body), f"{marker}:\n{ran.stdout}"
        checked += 1
    assert checked >= 3
