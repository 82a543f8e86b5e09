"""Retention: ``purge_delivered`` and ``outboxkit admin purge`` against a real MariaDB."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases

from outboxkit import enqueue
from outboxkit.admin import purge, purge_delivered, run_retention
from outboxkit.schema import outbox_table, payload_table, recovery_table
from outboxkit.schema.table import db_now

pytestmark = [pytest.mark.integration, on_both_databases]

ReadRows = Callable[..., dict[int, sa.Row[Any]]]
DAY = 86400.0


def recovery_events(engine: sa.Engine, kind: str = "purge") -> list[dict[str, Any]]:
    r = recovery_table()
    with engine.connect() as conn:
        rows = conn.execute(sa.select(r.c.detail).where(r.c.kind == kind).order_by(r.c.id))
        return [json.loads(d) for d in rows.scalars()]


def make_mixed_table(make_rows: Any, old: int) -> tuple[list[int], list[int]]:
    """``old`` delivered rows ten days old, plus rows purge must leave: returns (old, kept)."""
    old_ids = make_rows(old, status="delivered", age_s=10 * DAY)
    kept = make_rows(5, status="delivered", age_s=3600)  # recent
    for status in ("pending", "failed", "retryable"):
        kept += make_rows(3, status=status, age_s=10 * DAY)
    kept += make_rows(2, status="delivering", age_s=10 * DAY, lease_s=-DAY)
    # delivered long ago per created_at, but only just now per delivered_at
    kept += make_rows(2, status="delivered", age_s=10 * DAY, delivered_at=db_now())
    return old_ids, kept


def test_purge_deletes_only_old_delivered_rows_in_batches(
    engine: sa.Engine, make_rows: Any, read_rows: ReadRows, outbox: str
) -> None:
    _old, kept = make_mixed_table(make_rows, 2500)
    before = read_rows(kept)
    batches: list[int] = []

    deleted = purge_delivered(
        engine,
        outbox,
        7 * DAY,
        batch_size=1000,
        pause_s=0.01,
        stop=lambda: False,
        on_batch=batches.append,
    )

    assert deleted == 2500
    assert batches == [1000, 1000, 500]
    assert read_rows() == before
    [event] = recovery_events(engine)
    assert (event["deleted"], event["batches"], event["stopped"]) == (2500, 3, False)
    assert event["older_than_s"] == 7 * DAY


def test_a_concurrent_writer_keeps_writing_during_a_purge(
    engine: sa.Engine, make_rows: Any, outbox: str
) -> None:
    old = make_rows(3000, status="delivered", age_s=10 * DAY)
    t = outbox_table(outbox)
    done = threading.Event()
    written: list[str] = []
    errors: list[BaseException] = []
    purge_started = threading.Event()

    def writer() -> None:
        try:
            purge_started.wait(10)
            while not done.is_set():
                with engine.begin() as conn:  # one business transaction per event
                    written.append(enqueue(conn, topic="orders", payload={"n": len(written)}))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    batches: list[int] = []
    writes_during: list[int] = []

    def on_batch(n: int) -> None:
        batches.append(n)
        writes_during.append(len(written))

    try:
        purge_started.set()
        started = time.monotonic()
        result = purge(
            engine,
            table=outbox,
            older_than_s=7 * DAY,
            batch_size=250,
            pause_s=0.05,
            on_batch=on_batch,
        )
        elapsed = time.monotonic() - started
    finally:
        done.set()
        thread.join(30)
    assert not errors, errors
    assert (result.deleted, result.batches, result.stopped) == (3000, 12, False)
    assert elapsed < 30
    # The writer made progress while the purge ran, not only before or after it.
    assert writes_during[-1] - writes_during[0] > 10
    with engine.connect() as conn:
        present = set(conn.execute(sa.select(t.c.event_id)).scalars())
        left_old = conn.execute(sa.select(sa.func.count()).where(t.c.id.in_(old))).scalar()
    assert present == set(written), "every committed insert of the writer is still there"
    assert left_old == 0


def test_stop_ends_the_purge_between_batches(
    engine: sa.Engine, make_rows: Any, outbox: str
) -> None:
    make_rows(500, status="delivered", age_s=10 * DAY)
    batches: list[int] = []
    result = purge(
        engine,
        table=outbox,
        older_than_s=DAY,
        batch_size=100,
        pause_s=5,
        stop=lambda: len(batches) >= 2,
        on_batch=batches.append,
    )
    assert (result.deleted, result.batches, result.stopped) == (200, 2, True)
    [event] = recovery_events(engine)
    assert event["stopped"] is True
    # Stopped before the first batch: nothing at all is deleted (a draining relay).
    assert purge_delivered(engine, outbox, DAY, 100, 0, stop=lambda: True) == 0


def test_nothing_to_purge_records_nothing_unless_asked(engine: sa.Engine, outbox: str) -> None:
    assert purge_delivered(engine, outbox, DAY, 100, 0, lambda: False) == 0
    assert recovery_events(engine) == []
    purge(engine, table=outbox, older_than_s=DAY, record_empty=True)
    assert [e["deleted"] for e in recovery_events(engine)] == [0]


def test_cli_purge_and_dry_run(
    engine: sa.Engine, make_rows: Any, read_rows: ReadRows, admin: Any
) -> None:
    _old, kept = make_mixed_table(make_rows, 30)
    before = read_rows()

    res = admin("purge", "--older-than", "7d", "--dry-run")
    assert res.code == 0, res.err
    assert res.out.startswith("dry run: would delete 30 delivered rows from outbox_events")
    assert read_rows() == before

    res = admin("purge", "--older-than", "7d", "--batch-size", "8", "--pause", "0")
    assert res.code == 0, res.err
    assert "deleted 30 delivered rows from outbox_events" in res.out
    assert "in 4 batches" in res.out
    assert set(read_rows()) == set(kept)

    res = admin("purge", "--older-than", "7d", "--json")
    assert json.loads(res.out)["deleted"] == 0
    assert [e["deleted"] for e in recovery_events(engine)] == [30, 0]


def test_run_retention_purges_periodically_until_stopped(
    engine: sa.Engine, make_rows: Any, outbox: str
) -> None:
    make_rows(10, status="delivered", age_s=10 * DAY)
    stop = threading.Event()
    thread = threading.Thread(
        target=run_retention,
        kwargs={
            "engine": engine,
            "table": outbox,
            "retention_s": DAY,
            "interval_s": 0.2,
            "stop": stop.is_set,
            "pause_s": 0,
        },
    )
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not recovery_events(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        make_rows(5, status="delivered", age_s=10 * DAY)
        while len(recovery_events(engine)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive(), "retention did not return promptly after stop()"
    assert [e["deleted"] for e in recovery_events(engine)] == [10, 5]


def test_cli_purge_sweeps_payload_rows_a_release_2_purge_left(
    engine: sa.Engine, outbox: str, admin: Any
) -> None:
    """A 0.2.x purge deleted outbox rows and left their payload rows; the next
    ``admin purge`` deletes them and says so."""
    with engine.begin() as conn:
        ids = [enqueue(conn, topic="t", payload=f"p{n}", key=f"k{n}") for n in range(12)]
    t, p = outbox_table(outbox), payload_table(outbox)
    with engine.begin() as conn:
        conn.execute(t.delete().where(t.c.event_id.in_(ids[:10])))

    res = admin("purge", "--older-than", "7d", "--batch-size", "4", "--pause", "0")

    assert res.code == 0, res.err
    assert "and 10 payload rows whose outbox row was gone" in res.out
    with engine.connect() as conn:
        assert set(conn.execute(sa.select(p.c.event_id)).scalars()) == set(ids[10:])
    assert [e["payload_orphans"] for e in recovery_events(engine)] == [10]
    res = admin("purge", "--older-than", "7d", "--json")
    assert json.loads(res.out)["payload_orphans"] == 0
