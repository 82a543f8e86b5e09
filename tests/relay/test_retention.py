"""The relay's periodic retention: old delivered rows go, nothing else does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay, add_events, db_time, fast_settings, rows, wait_for
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.relay.retention import _retention_lock
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
    assert not relay.relay._retention or not relay.relay._retention.is_alive()


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
