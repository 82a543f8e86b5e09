"""Every command in the alert runbooks (docs/operations.md) works as written.

The runbook section is read from the page, not copied: every ``outboxkit ...``
command (inline code or a line of a ```sh block) and every SQL ``SELECT`` is
extracted, placeholders are filled with seeded values, and each runs against a
fresh database holding rows in every status. A command must exit 0 and, where
the runbook promises an effect, have it; a SQL query must be read-only and run.
A placeholder this test does not know fails it, so a new runbook step has to
come with a value here.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.metric_names import exported_metric_names

from outboxkit import Event, enqueue_many
from outboxkit.schema import apply_schema, outbox_table

REPO = Path(__file__).resolve().parents[2]
OPERATIONS = REPO / "docs" / "operations.md"
NODE_ID = "relay-7f3a"


def runbook_text(markdown: str) -> str:
    start = markdown.index("\n## Alert runbook")
    end = markdown.find("\n## ", start + 1)
    return markdown[start : end if end != -1 else len(markdown)]


def _spans(text: str) -> list[str]:
    """Inline code spans (may wrap lines) outside fenced blocks, whitespace collapsed."""
    prose = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    return [" ".join(m.split()) for m in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose)]


def _fenced_lines(text: str) -> list[str]:
    lines = []
    for block in re.findall(r"^\s*```(?:sh|bash|console)?\n(.*?)^\s*```", text, re.S | re.M):
        lines += [line.strip() for line in block.splitlines() if line.strip()]
    return lines


def commands(text: str) -> list[str]:
    found = [c for c in _spans(text) + _fenced_lines(text) if c.startswith("outboxkit ")]
    return list(dict.fromkeys(found))


def queries(text: str) -> list[str]:
    found = [q for q in _spans(text) if re.match(r"SELECT\s", q, re.I)]
    return list(dict.fromkeys(found))


RUNBOOK = runbook_text(OPERATIONS.read_text())


# --- seeded database ---------------------------------------------------------------


@dataclass
class Seeded:
    db_url: str
    engine: sa.Engine
    failed_ids: list[int]
    failed_event_ids: list[str]

    def status_counts(self) -> dict[str, int]:
        t = outbox_table()
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.status, sa.func.count()).group_by(t.c.status))
            return {str(status): int(n) for status, n in rows}

    def placeholders(self) -> dict[str, str]:
        return {
            "<event id>": self.failed_event_ids[0],
            "<id>": str(self.failed_ids[0]),
            "<node id>": NODE_ID,
            "<topic>": "orders",
        }


@pytest.fixture
def seeded(db_url: str) -> Seeded:
    """Rows in every status: 2 failed, 1 delivered long ago, 1 pending, 1 retryable,
    1 delivering under an expired lease of NODE_ID."""
    engine = sa.create_engine(db_url)
    apply_schema(engine, shards=8)
    t = outbox_table()
    events = [Event(topic="orders", key=f"order-{i}", payload={"n": i}) for i in range(6)]
    with engine.begin() as conn:
        event_ids = enqueue_many(conn, events)
    with engine.begin() as conn:
        ids = {e: int(i) for e, i in conn.execute(sa.select(t.c.event_id, t.c.id)).all()}
        now = sa.func.utc_timestamp(6)
        updates = [
            (
                event_ids[0],
                {"status": "failed", "attempts": 10, "last_error": "MSG_SIZE_TOO_LARGE"},
            ),
            (event_ids[1], {"status": "failed", "attempts": 10, "last_error": "_MSG_TIMED_OUT"}),
            (
                event_ids[2],
                {
                    "status": "delivered",
                    "delivered_at": sa.func.date_sub(now, sa.text("INTERVAL 30 DAY")),
                    "kafka_partition": 0,
                    "kafka_offset": 7,
                },
            ),
            (event_ids[3], {"status": "retryable", "attempts": 2, "last_error": "_TRANSPORT"}),
            (
                event_ids[4],
                {
                    "status": "delivering",
                    "attempts": 1,
                    "lease_owner": NODE_ID,
                    "lease_token": "f" * 32,
                    "lease_expires_at": sa.func.date_sub(now, sa.text("INTERVAL 1 MINUTE")),
                },
            ),
        ]
        for event_id, values in updates:
            conn.execute(sa.update(t).where(t.c.event_id == event_id).values(**values))
    return Seeded(
        db_url=db_url,
        engine=engine,
        failed_ids=[ids[event_ids[0]], ids[event_ids[1]]],
        failed_event_ids=list(event_ids[:2]),
    )


def fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace(key, value)
    unknown = re.findall(r"<[^<>]+>", text)
    assert not unknown, f"placeholder(s) {unknown} in {text!r}: add a value in this test"
    return text


# --- documented effects ------------------------------------------------------------------

Effect = Callable[[Seeded, dict[str, int]], None]


def _requeued_all(seeded: Seeded, before: dict[str, int]) -> None:
    after = seeded.status_counts()
    assert "failed" not in after, after
    assert after["pending"] == before["pending"] + before["failed"], (before, after)


def _requeued_one(seeded: Seeded, before: dict[str, int]) -> None:
    after = seeded.status_counts()
    assert after["failed"] == before["failed"] - 1, (before, after)


def _discarded_one(seeded: Seeded, before: dict[str, int]) -> None:
    after = seeded.status_counts()
    assert after.get("failed", 0) == before["failed"] - 1, (before, after)
    assert sum(after.values()) == sum(before.values()) - 1, (before, after)


def _unchanged(seeded: Seeded, before: dict[str, int]) -> None:
    assert seeded.status_counts() == before


def effect_of(command: str) -> Effect | None:
    """What the runbook promises the command does (None: exit 0 is all it says)."""
    if command.startswith("outboxkit admin requeue"):
        if "--dry-run" in command:
            return _unchanged
        return _requeued_all if "--all-failed" in command else _requeued_one
    if command.startswith("outboxkit admin discard"):
        return _unchanged if "--dry-run" in command else _discarded_one
    if command.startswith(("outboxkit admin status", "outboxkit admin failed")) or (
        command.startswith(("outboxkit admin show", "outboxkit admin recovery"))
    ):
        return _unchanged  # read-only
    return None


# --- tests ---------------------------------------------------------------------------


def test_the_runbooks_name_commands_and_queries() -> None:
    found = commands(RUNBOOK)
    assert "outboxkit admin status" in found
    assert any(c.startswith("outboxkit admin requeue") for c in found)
    assert queries(RUNBOOK), "the SELECT of the shutdown-pending runbook is gone"


def test_extraction_reads_inline_code_and_sh_blocks() -> None:
    text = (
        "## Alert runbook\n\nRun `outboxkit admin status` and\n`outboxkit admin show\n"
        "<event id>`.\n\n```sh\noutboxkit admin requeue --all-failed\n```\n"
        "`SELECT 1 FROM t WHERE\n  x='<node id>'`\n"
    )
    assert commands(text) == [
        "outboxkit admin status",
        "outboxkit admin show <event id>",
        "outboxkit admin requeue --all-failed",
    ]
    assert queries(text) == ["SELECT 1 FROM t WHERE x='<node id>'"]


#: Steps known to be wrong and being replaced; strict, so a fixed step fails here
#: until its entry is removed.
KNOWN_WRONG: dict[str, str] = {}


@pytest.mark.integration
@pytest.mark.parametrize(
    "command",
    [
        pytest.param(c, marks=pytest.mark.xfail(reason=KNOWN_WRONG[c], strict=True))
        if c in KNOWN_WRONG
        else c
        for c in commands(RUNBOOK)
    ],
)
def test_runbook_command_works_as_written(command: str, seeded: Seeded, tmp_path: Path) -> None:
    args = shlex.split(fill(command, seeded.placeholders()))
    before = seeded.status_counts()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env["OUTBOXKIT_DB_URL"] = seeded.db_url
    result = subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # not the repository: its outboxkit/ folder would shadow the package
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"{command!r} exited {result.returncode}:\n{result.stderr}"
    effect = effect_of(command)
    if effect is not None:
        effect(seeded, before)


@pytest.mark.integration
@pytest.mark.parametrize("query", queries(RUNBOOK))
def test_runbook_query_is_read_only_and_runs(query: str, seeded: Seeded) -> None:
    sql = fill(query, seeded.placeholders())
    assert re.match(r"SELECT\s", sql, re.I) and ";" not in sql, sql
    with seeded.engine.connect() as conn:
        rows = conn.execute(sa.text(sql)).all()
    assert rows, sql


# --- PromQL in the runbooks -----------------------------------------------------------

PROMQL_WORDS = {"by", "without", "on", "ignoring", "and", "or", "unless", "bool", "offset"}


def promql(text: str) -> list[str]:
    """Inline spans that are PromQL: metric names, selectors, function calls."""
    from outboxkit.schema.table import DEFAULT_TABLE

    promql_chars = re.compile(r"[\w:{}()\[\]=\"'!~,. <>*+/-]+")
    metric = re.compile(r"\b(?:outbox|worker|service)_\w+|\bup\b")
    found = [
        span
        for span in _spans(text)
        if span != DEFAULT_TABLE
        and not re.match(r"SELECT\s", span, re.I)
        and promql_chars.fullmatch(span)
        and metric.search(span)
    ]
    return list(dict.fromkeys(found))


def metric_names(query: str) -> set[str]:
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", query)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][\w:]*", bare):
        after = bare[match.end() :].lstrip()
        if after.startswith("(") or match.group(0) in PROMQL_WORDS:
            continue
        names.add(match.group(0))
    return names


def test_runbook_promql_names_exported_metrics_and_parses(tmp_path: Path) -> None:
    import shutil

    queries_found = promql(RUNBOOK)
    assert "sum(outbox_shards_owned)" in queries_found, queries_found
    known = exported_metric_names()
    unknown = {q: sorted(metric_names(q) - known) for q in queries_found}
    assert {q: n for q, n in unknown.items() if n} == {}
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("promtool not found (CI=true: a failure, not a skip)")
        pytest.skip("promtool not found; install Debian's `prometheus` package")
    rules = tmp_path / "runbook.rules.yml"
    body = "".join(
        f"      - record: runbook:query{i}\n        expr: '{q.replace(chr(39), chr(39) * 2)}'\n"
        for i, q in enumerate(queries_found)
    )
    rules.write_text(f"groups:\n  - name: runbook\n    rules:\n{body}")
    result = subprocess.run(
        [promtool, "check", "rules", str(rules)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_renamed_metric_in_a_runbook_is_caught() -> None:
    text = "## Alert runbook\n\nsee `rate(outbox_rows_delivred_total[5m])` and `outbox_events`\n"
    (query,) = promql(text)
    assert metric_names(query) - exported_metric_names() == {"outbox_rows_delivred_total"}
