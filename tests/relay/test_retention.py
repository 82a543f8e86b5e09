"""The relay's periodic retention: old delivered rows go, nothing else does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay, add_events, fast_settings, rows, wait_for

from outboxkit import Event
from outboxkit.schema import outbox_table, recovery_table

pytestmark = pytest.mark.integration


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
                    delivered_at=sa.text(f"UTC_TIMESTAMP(6) - INTERVAL {age} DAY")
                    if status == "delivered"
                    else None,
                    updated_at=sa.text(f"UTC_TIMESTAMP(6) - INTERVAL {age} DAY"),
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
