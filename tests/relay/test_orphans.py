"""Payload rows left behind by a purge that knew no payload table (0.2.x's
``admin purge``, a purge job built on it, a 0.2.x relay's retention), on MariaDB
and PostgreSQL: the sweep deletes them, never the payload of a row that is
there, nor that of a writer's open transaction."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases

from outboxkit import Event, enqueue, enqueue_many
from outboxkit.relay.orphans import sweep_orphans
from outboxkit.relay.retention import purge, run_retention
from outboxkit.schema import outbox_table, payload_table

pytestmark = [pytest.mark.integration, on_both_databases]


def payloads(engine: sa.Engine, table: str) -> dict[str, bytes]:
    """The payload table's rows: event id -> payload."""
    p = payload_table(table)
    with engine.connect() as conn:
        return {r.event_id: bytes(r.payload) for r in conn.execute(sa.select(p))}


def delete_outbox_rows_as_release_2(engine: sa.Engine, table: str, event_ids: list[str]) -> None:
    """What a 0.2.x purge does: delete outbox rows, their payload rows left alone."""
    t = outbox_table(table)
    with engine.begin() as conn:
        conn.execute(t.delete().where(t.c.event_id.in_(event_ids)))


def enqueue_thirty(engine: sa.Engine) -> list[str]:
    with engine.begin() as conn:
        return enqueue_many(
            conn, [Event(topic="t", payload=f"p{n}", key=f"k{n}") for n in range(30)]
        )


def test_the_sweep_deletes_orphans_and_spares_live_rows_and_an_open_writer(
    engine: sa.Engine, outbox: str
) -> None:
    ids = enqueue_thirty(engine)
    orphaned, live = ids[:20], ids[20:]
    delete_outbox_rows_as_release_2(engine, outbox, orphaned)
    assert set(payloads(engine, outbox)) == set(ids)
    reused = orphaned[7]
    # A writer's transaction, open while the sweep runs: a new event, and an event
    # whose id is an orphan's (its INSERT rewrites the orphaned payload row).
    with engine.connect() as writer:
        writer.begin()
        fresh = enqueue(writer, topic="t", payload="fresh", key="f")
        enqueue(writer, topic="t", payload="reused", key="r", event_id=reused)

        result = sweep_orphans(engine, outbox, batch_size=6, pause_s=0)

        writer.commit()
    left = payloads(engine, outbox)
    assert result.deleted == 19
    assert set(left) == {*live, fresh, reused}
    assert left[reused] == b"reused"
    assert left[fresh] == b"fresh"
    assert all(left[i] == f"p{n + 20}".encode() for n, i in enumerate(live))
    # Every payload row now has its outbox row: a second sweep deletes nothing.
    again = sweep_orphans(engine, outbox, batch_size=6, pause_s=0)
    assert (again.deleted, again.left, again.scanned) == (0, 0, 12)
    assert set(payloads(engine, outbox)) == {*live, fresh, reused}


def test_the_purge_sweeps_orphans_after_its_own_batches(engine: sa.Engine, outbox: str) -> None:
    ids = enqueue_thirty(engine)
    delete_outbox_rows_as_release_2(engine, outbox, ids[:10])

    result = purge(engine, outbox, older_than_s=86400, batch_size=4, pause_s=0)

    assert (result.deleted, result.orphans) == (0, 10)
    assert set(payloads(engine, outbox)) == set(ids[10:])


def test_a_stopped_purge_sweeps_nothing(engine: sa.Engine, outbox: str) -> None:
    ids = enqueue_thirty(engine)
    delete_outbox_rows_as_release_2(engine, outbox, ids[:10])

    result = purge(engine, outbox, older_than_s=86400, stop=lambda: True)

    assert (result.orphans, result.stopped) == (0, True)
    assert set(payloads(engine, outbox)) == set(ids)


def _running(engine: sa.Engine, statement_like: str) -> bool:
    """Whether a statement like ``statement_like`` (SQL LIKE) runs in this database."""
    if engine.dialect.name == "postgresql":
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'active' AND query LIKE %(q)s"
        )
    else:
        query = (
            "SELECT count(*) FROM information_schema.PROCESSLIST WHERE db = DATABASE()"
            " AND command = 'Query' AND info LIKE %(q)s"
        )
    with engine.connect() as conn:
        return bool(conn.exec_driver_sql(query, {"q": statement_like}).scalar())


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def test_a_writer_reusing_an_orphans_id_during_the_sweeps_batch_keeps_its_payload(
    engine: sa.Engine, outbox: str
) -> None:
    """The sweep has decided a payload row is an orphan (no outbox row) and is
    about to delete it; a writer then enqueues an event with that event id (its
    INSERT rewrites the payload row) and commits. The writer's payload row must
    survive: the sweep deletes the orphan's old payload or nothing, never the
    writer's."""
    [orphan] = enqueue_thirty(engine)[:1]
    delete_outbox_rows_as_release_2(engine, outbox, [orphan])
    p = payload_table(outbox).name
    sweeper = sa.create_engine(engine.url)
    at_delete, go_on = threading.Event(), threading.Event()

    @sa.event.listens_for(sweeper, "before_cursor_execute")
    def hold_the_delete(*args: object) -> None:
        statement = str(args[2])
        if statement.lstrip().upper().startswith(f"DELETE FROM {p.upper()}"):
            at_delete.set()
            assert go_on.wait(60)

    enqueued, commit = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def write() -> None:
        try:
            with engine.connect() as writer:
                writer.begin()
                enqueue(writer, topic="t", payload="the writer's", key="w", event_id=orphan)
                enqueued.set()
                assert commit.wait(60)
                writer.commit()
        except BaseException as exc:  # reported by the test below
            failures.append(exc)
            enqueued.set()

    result: list[object] = []
    sweep = threading.Thread(
        target=lambda: result.append(sweep_orphans(sweeper, outbox, batch_size=100, pause_s=0))
    )
    sweep.start()
    try:
        _wait_for(at_delete.is_set, "the sweep's delete")
        writing = threading.Thread(target=write)
        writing.start()
        # The writer is done with its INSERTs, or waits in its payload row's.
        _wait_for(
            lambda: enqueued.is_set() or _running(engine, f"%INSERT INTO {p}%"),
            "the writer's insert",
        )
        go_on.set()
        # The sweep is done, or its delete waits for the writer's lock.
        _wait_for(
            lambda: not sweep.is_alive() or _running(engine, f"DELETE FROM {p}%"),
            "the sweep's delete to end or wait",
        )
        _wait_for(enqueued.is_set, "the writer's enqueue")
        commit.set()
        writing.join(60)
        sweep.join(60)
    finally:
        go_on.set()
        commit.set()
        sweeper.dispose()
    assert not failures
    assert result, "the sweep did not finish"
    t = outbox_table(outbox)
    with engine.connect() as conn:
        statuses = conn.execute(sa.select(t.c.status).where(t.c.event_id == orphan)).scalars()
        assert list(statuses) == ["pending"]
    assert payloads(engine, outbox).get(orphan) == b"the writer's"


def test_the_relays_retention_sweeps_a_bounded_share_per_run_and_resumes_there(
    engine: sa.Engine, outbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With a limit smaller than the payload table, a retention run scans at most
    that many payload rows, and the next run goes on after the last one: event
    ids grow with enqueue order, so which orphans are gone shows where."""
    ids = enqueue_thirty(engine)
    orphaned = ids[:24]
    delete_outbox_rows_as_release_2(engine, outbox, orphaned)
    caplog.set_level(logging.INFO, logger="outboxkit.relay.retention")

    def runs() -> list[int]:
        """Payload rows each finished run swept (its ``purge-finished`` line)."""
        found = (
            re.search(r"payload_orphans=(\d+)", r.getMessage())
            for r in caplog.records
            if r.getMessage().startswith("purge-finished")
        )
        return [int(m.group(1)) for m in found if m]

    run_retention(
        engine,
        table=outbox,
        retention_s=86400,
        interval_s=0.05,
        stop=lambda: len(runs()) >= 2,
        batch_size=4,
        pause_s=0,
        orphan_limit=10,
    )

    # The first run scanned ids[0:10], the second ids[10:20]: ids[20:24] wait.
    assert runs() == [10, 10]
    assert set(payloads(engine, outbox)) == set(ids[20:])


def test_a_sweep_that_reaches_the_end_starts_again_from_the_start(
    engine: sa.Engine, outbox: str
) -> None:
    ids = enqueue_thirty(engine)
    delete_outbox_rows_as_release_2(engine, outbox, ids[:5] + ids[25:])

    first = sweep_orphans(engine, outbox, batch_size=4, pause_s=0, limit=20, start_after=ids[9])

    # After ids[9]: 20 rows to the end, the last 5 orphaned; the walk reached the end.
    assert (first.scanned, first.deleted, first.resume_after) == (20, 5, "")
    assert set(payloads(engine, outbox)) == set(ids[:25])

    again = sweep_orphans(engine, outbox, batch_size=4, pause_s=0, limit=20, start_after="")

    # From the start: the first 5 orphans, and it stops after its 20 rows.
    assert (again.scanned, again.deleted, again.resume_after) == (20, 5, ids[19])
    assert set(payloads(engine, outbox)) == set(ids[5:25])
