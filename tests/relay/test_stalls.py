"""A relay that stalls, and a drain that meets a failing database: both found by
the chaos suite (docs/reliability.md), reproduced here on the real services."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay, add_events, consume, fast_settings, rows, wait_for
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.relay import Relay
from outboxkit.relay import pipeline as pipeline_module
from outboxkit.relay.rows import Batch
from outboxkit.runtime.testing import capture_json_logs

pytestmark = [pytest.mark.integration, on_both_databases]


def test_a_relay_that_wakes_after_its_batch_expired_sends_nothing(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Relay A stops between claim and publish for longer than its lease (SIGSTOP,
    a long pause); B reclaims and delivers. A must not publish its stale batch:
    that would only put a second copy of every row in Kafka."""
    topic = kafka_topics(partitions=1)
    add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"x") for _ in range(10)])
    # Every shard to both relays: B must reach A's rows (with advisory locks,
    # PostgreSQL's default ownership, the stalled A would keep its shard).
    fast = {
        "lease_ttl": 4.0,
        "flush_timeout": 0.5,
        "kafka_config": {"message.timeout.ms": "1000"},
        "shard_ownership": "all",
    }
    stalled: list[Batch] = []

    def stall(batch: Batch) -> None:
        if not stalled:
            stalled.append(batch)
            time.sleep(5.5)

    with capture_json_logs(level="INFO") as logs:
        a = embedded(
            fast_settings(db_url, kafka_bootstrap, node_id="relay-a", **fast), on_batch=stall
        )
        wait_for(lambda: stalled, timeout=10, what="relay A's claim")
        b = embedded(fast_settings(db_url, kafka_bootstrap, node_id="relay-b", **fast))
        wait_for(lambda: b.metric("outbox_rows_delivered_total") == 10, timeout=20, what="B")
        wait_for(lambda: a.metric("outbox_lease_lost_total") == 10, timeout=10, what="A's settle")
        assert a.stop() == 0 and b.stop() == 0

    messages = consume(kafka_bootstrap, topic, expected=10)
    assert len(messages) == 10, "relay A sent its expired batch as well"
    (expired,) = logs.events("batch-expired-before-publish")
    assert expired["rows"] == 10 and expired["stalled_s"] >= 5.0
    assert all(r.status == "delivered" and r.lease_owner == "relay-b" for r in rows(engine, outbox))


def test_a_claim_failed_by_the_database_during_the_drain_is_a_clean_stop(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM arrives while a claim waits on a connection the database dropped (a
    redeploy during a database blip): the relay held nothing, so it exits 0."""
    relay = Relay(fast_settings(db_url, kafka_bootstrap, start_jitter=0.0))

    def claim_then_lose_the_connection(*args: object, **kwargs: object) -> None:
        relay.stop()
        raise sa.exc.OperationalError(
            "SELECT ...", {}, Exception(2013, "Lost connection to server during query")
        )

    monkeypatch.setattr(pipeline_module, "claim_batch", claim_then_lose_the_connection)
    with capture_json_logs(level="INFO") as logs:
        code = relay.run()
    (record,) = logs.events("relay-exit")
    assert code == 0, record
    assert record["result"] == "clean" and record["left_leased"] == 0
    assert logs.events("claim-interrupted")
    assert not logs.events("worker-crashed-during-drain")
