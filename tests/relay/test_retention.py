"""The relay's periodic retention: old delivered rows go, nothing else does."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay, add_events, db_time, fast_settings, rows, wait_for
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.relay.retention import _retention_lock, purge
from outboxkit.schema import outbox_table, recovery_table

pytestmark = [pytest.mark.integration, on_both_databases]


def test_relay_retention_purges_only_old_delivered_rows_and_stops_on_drain(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=1)
    ids = add_events(
        engine, outbox, [Event(topic=topic, key=f"k{i}", payload=b"x") for i in range(30)]
    )
    t = outbox_table(outbox)
    old, recent, failed = ids[:10], ids[10:20], ids[20:30]
    with engine.begin() as conn:  # history as a relay would have left it
        for event_ids, status, age in (
            (old, "delivered", 3),
            (recent, "delivered", 0),
            (failed, "failed", 3),
        ):
            conn.execute(
                t.update()
                .where(t.c.event_id.in_(event_ids))
                .values(
                    status=status,
                    delivered_at=db_time(-age * 86400) if status == "delivered" else None,
                    updated_at=db_time(-age * 86400),
                )
            )
    relay = embedded(
        fast_settings(db_url, kafka_bootstrap, retention=86400.0, retention_interval=0.5)
    )
    wait_for(lambda: len(rows(engine, outbox)) == 20, timeout=20, what="old rows purged")
    assert relay.stop() == 0
    left = {r.event_id: r.status for r in rows(engine, outbox)}
    assert set(left) == set(recent) | set(failed)
    with engine.connect() as conn:
        kinds = conn.execute(sa.select(recovery_table().c.kind)).scalars().all()
    assert "purge" in kinds
    assert not relay.relay._resources.retention or not relay.relay._resources.retention.is_alive()


def test_one_relay_per_table_purges_at_a_time(engine: sa.Engine, outbox: str) -> None:
    """The retention lock is the database's (a named lock, an advisory lock on
    PostgreSQL): a second relay skips the round while the first holds it, and
    gets it once it is given back."""
    with _retention_lock(engine, outbox) as first:
        assert first
        with _retention_lock(engine, outbox) as second:
            assert not second
        with _retention_lock(engine, "other_table") as other:
            assert other, "one lock per table"
    with _retention_lock(engine, outbox) as again:
        assert again


class _Seen(logging.Handler):
    """Keeps the messages that start with ``prefix``, from any thread."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix, self.messages = prefix, list[str]()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.prefix):
            self.messages.append(record.getMessage())


def test_a_purge_batch_that_waits_too_long_for_a_row_is_tried_again(
    engine: sa.Engine, outbox: str
) -> None:
    """A batch whose DELETE gives up waiting for a row another session holds
    (the purge's lock wait is 1 s here) is rolled back and tried again, and
    the purge then deletes every old row. Before, on MariaDB the lock wait
    timeout ended the purge with the error: the check read PyMySQL's SQLSTATE
    (HY000) as if it were PostgreSQL's and never looked at MySQL's error number."""
    ids = add_events(
        engine, outbox, [Event(topic="t", key=f"k{i}", payload=b"x") for i in range(10)]
    )
    t = outbox_table(outbox)
    with engine.begin() as conn:
        conn.execute(t.update().values(status="delivered", delivered_at=db_time(-3 * 86400)))
    short_wait = (
        {"options": "-c lock_timeout=1000"}
        if engine.dialect.name == "postgresql"
        else {"init_command": "SET SESSION innodb_lock_wait_timeout = 1"}
    )
    purger = sa.create_engine(engine.url, connect_args=short_wait)
    retried = _Seen("purge-batch-retry")
    log = logging.getLogger("outboxkit.relay.retention")
    log.addHandler(retried)
    try:
        with engine.connect() as holder, ThreadPoolExecutor(1) as pool:
            holder.execute(sa.select(t.c.id).where(t.c.event_id == ids[0]).with_for_update()).one()
            running = pool.submit(purge, purger, outbox, older_than_s=86400.0, pause_s=0)
            wait_for(
                lambda: retried.messages or running.done(),
                timeout=20,
                what="the purge to retry or end",
            )
            holder.rollback()
            assert retried.messages, running.exception()
            result = running.result(timeout=60)
    finally:
        log.removeHandler(retried)
        purger.dispose()
    assert result.deleted == 10
    assert rows(engine, outbox) == []
    assert retried.messages[0] == "purge-batch-retry error=OperationalError attempts_left=2"


def _purge_waiting(engine: sa.Engine) -> bool:
    """A DELETE of another session in this test's database is running (here:
    waiting for a row)."""
    if engine.dialect.name == "postgresql":
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'active' AND query LIKE 'DELETE FROM%%'"
        )
    else:
        query = (
            "SELECT count(*) FROM information_schema.PROCESSLIST WHERE db = DATABASE()"
            " AND command = 'Query' AND info LIKE 'DELETE FROM%%'"
        )
    with engine.connect() as conn:
        return bool(conn.exec_driver_sql(query).scalar())


def test_a_drain_does_not_wait_out_its_budget_for_a_purge_behind_a_held_row(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    embedded: Callable[..., EmbeddedRelay],
    kafka_bootstrap: str,
) -> None:
    """A transaction left open on one old delivered row (an operator's session,
    a report that reads ``FOR UPDATE``) makes the purge's DELETE wait for it.
    Before, that wait had no bound of the purge's own: on PostgreSQL the
    relay's statement timeout (its lease TTL, 60 s by default), on MySQL/MariaDB
    ``innodb_lock_wait_timeout`` (50 s by default).
    A drain then waited out its whole budget for retention and exited
    ``forced`` (code 4) with ``worker-abandoned``, as if the database had frozen.
    Now each DELETE waits at most a few seconds and is not tried again once the
    drain began, so the relay exits clean and the rows wait for the next run."""
    ids = add_events(
        engine, outbox, [Event(topic="t", key=f"k{i}", payload=b"x") for i in range(10)]
    )
    t = outbox_table(outbox)
    with engine.begin() as conn:
        conn.execute(t.update().values(status="delivered", delivered_at=db_time(-3 * 86400)))
    abandoned = _Seen("worker-abandoned")
    relay_log = logging.getLogger("outboxkit.relay")
    relay_log.addHandler(abandoned)
    try:
        with engine.connect() as holder:
            holder.execute(sa.select(t.c.id).where(t.c.event_id == ids[0]).with_for_update()).one()
            relay = embedded(
                fast_settings(
                    db_url,
                    kafka_bootstrap,
                    table=outbox,
                    retention=86400.0,
                    retention_interval=0.2,
                    # As with the defaults (60 s and 30 s): a statement may
                    # outlast the drain's budget.
                    lease_ttl=20.0,
                    shutdown_timeout=8.0,
                )
            )
            wait_for(lambda: _purge_waiting(engine), timeout=20, what="the purge to wait")
            code = relay.stop()
            holder.rollback()
    finally:
        relay_log.removeHandler(abandoned)
    assert abandoned.messages == []
    assert code == 0
    assert len(rows(engine, outbox)) == 10, "the held batch is left for the next run"
