"""``outboxkit admin discard``: failed rows deleted for good, each one in the recovery log."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases

from outboxkit.schema import outbox_table, recovery_table

pytestmark = [pytest.mark.integration, on_both_databases]


def recovery_events(engine: sa.Engine, kind: str = "discard") -> list[dict[str, Any]]:
    r = recovery_table()
    with engine.connect() as conn:
        rows = conn.execute(sa.select(r).where(r.c.kind == kind).order_by(r.c.id)).all()
    return [json.loads(row.detail) | {"node_id": row.node_id} for row in rows]


def failed_count(engine: sa.Engine, table: str) -> int:
    """What the failed-rows alert counts (the relay's outbox_backlog_rows{status="failed"})."""
    t = outbox_table(table)
    with engine.connect() as conn:
        return int(
            conn.execute(sa.select(sa.func.count()).where(t.c.status == "failed")).scalar_one()
        )


def test_discard_deletes_only_failed_rows_and_records_each(
    engine: sa.Engine, outbox: str, make_rows: Any, read_rows: Any, admin: Any
) -> None:
    failed = make_rows(3, status="failed", topic="payments", key="k-1")
    others = make_rows(1, status="pending") + make_rows(1, status="delivered")
    others += make_rows(1, status="retryable") + make_rows(1, status="delivering")
    others += make_rows(1, status="delivering", lease_s=-5)  # expired lease
    before = read_rows(others)
    event_ids = {i: r.event_id for i, r in read_rows(failed).items()}

    res = admin("discard", "--all-failed", "--reason", "INC-42: poison payload")

    assert res.code == 0, res.err
    assert f"discarded 3 failed rows from {outbox} for good: ids {failed[0]}, " in res.out
    assert read_rows(failed) == {}
    assert read_rows(others) == before, "nothing but failed rows is touched"
    assert failed_count(engine, outbox) == 0
    [event] = recovery_events(engine)
    assert event["count"] == 3 and event["reason"] == "INC-42: poison payload"
    assert event["node_id"].startswith("admin@")
    assert event["selection"] == {"statuses": ["failed"], "all_failed": True}
    assert [(r["id"], r["event_id"], r["topic"], r["key"]) for r in event["rows"]] == [
        (i, event_ids[i], "payments", {"text": "k-1"}) for i in failed
    ]
    assert all(r["last_error"] == "KafkaError: MSG_SIZE_TOO_LARGE" for r in event["rows"])
    assert all(r["attempts"] == 5 and r["created_at"].endswith("Z") for r in event["rows"])
    # The operator finds it where the runbook says.
    shown = admin("recovery", "--kind", "discard")
    assert shown.code == 0 and "INC-42: poison payload" in shown.out
    [as_json] = json.loads(admin("recovery", "--kind", "discard", "--json").out)
    assert as_json["detail"]["count"] == 3


def test_named_rows_that_are_not_failed_are_never_discarded(
    engine: sa.Engine, outbox: str, make_rows: Any, read_rows: Any, admin: Any
) -> None:
    [failed] = make_rows(1, status="failed")
    [leased] = make_rows(1, status="delivering")
    [pending] = make_rows(1, status="pending")
    before = read_rows([leased, pending])

    res = admin("discard", "--id", f"{failed},{leased},{pending}")

    assert res.code == 0, res.err
    assert f"discarded 1 failed row from {outbox} for good: ids {failed};" in res.out
    assert f"id {leased} " in res.out and "a relay holds its lease; never discarded" in res.out
    assert f"id {pending} " in res.out and "pending: only failed rows are discarded" in res.out
    assert read_rows([leased, pending]) == before
    assert [e["count"] for e in recovery_events(engine)] == [1]
    assert recovery_events(engine)[0]["reason"] is None


def test_dry_run_and_bad_input_change_nothing(
    engine: sa.Engine, outbox: str, make_rows: Any, read_rows: Any, admin: Any
) -> None:
    failed = make_rows(2, status="failed", topic="a") + make_rows(1, status="failed", topic="b")
    before = read_rows()

    res = admin("discard", "--topic", "a", "--dry-run")
    assert res.code == 0, res.err
    assert f"dry run: would discard 2 failed rows from {outbox}: ids {failed[0]}, {failed[1]}" in (
        res.out
    )
    for args, message in [
        (["discard"], "nothing selected"),
        (["discard", "--id", "99999"], "no such row"),
        (["discard", "--id", str(failed[0]), "--topic", "a"], "conflicting selectors"),
        (["discard", "--all-failed", "--reason", "x" * 501], "at most 500"),
    ]:
        res = admin(*args)
        assert res.code == 2 and message in res.err, (args, res.err)
    assert read_rows() == before
    assert recovery_events(engine) == []


def test_a_row_locked_by_someone_else_is_skipped_not_waited_for(
    engine: sa.Engine, outbox: str, make_rows: Any, read_rows: Any, admin: Any
) -> None:
    """A row another transaction holds (a requeue, a relay's claim in progress) is
    reported and left; the rest are discarded without waiting."""
    locked_row, free_row = make_rows(2, status="failed")
    t = outbox_table(outbox)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with engine.connect() as conn:
            conn.execute(sa.select(t.c.id).where(t.c.id == locked_row).with_for_update())
            holding.set()
            release.wait(30)
            conn.rollback()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        res = admin("discard", "--all-failed")
    finally:
        release.set()
        holder.join()
    assert res.code == 0, res.err
    assert f"ids {free_row};" in res.out
    assert f"id {locked_row} " in res.out and "locked by another transaction" in res.out
    assert list(read_rows()) == [locked_row]
    [event] = recovery_events(engine)
    assert [r["id"] for r in event["rows"]] == [free_row]
