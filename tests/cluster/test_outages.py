"""Outages that last longer than a few retries, on the three-node cluster.

An ISR below ``min.insync.replicas`` for longer than ``--max-attempts``
message timeouts must fail no row and use up no attempt; a hung (SIGSTOPped,
not dead) partition leader must not hold the other partitions' rows for the
message timeout. The errors name the cluster's state, not the bare timeout.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay, add_events, consume, fast_settings, rows, wait_for
from support.cluster import KafkaCluster

from outboxkit import Event
from outboxkit.runtime.testing import capture_json_logs
from outboxkit.schema.table import db_now

pytestmark = [pytest.mark.integration, pytest.mark.fault]


def keyed(topic: str, count: int, keys: int, start: int = 0) -> list[Event]:
    """Event ``i`` is number ``i // keys`` of key ``i % keys``: id order is per-key order."""
    return [
        Event(topic=topic, key=f"k{i % keys}", payload={"k": i % keys, "n": i // keys})
        for i in range(start, start + count)
    ]


def statuses(engine: sa.Engine, table: str) -> Counter[str]:
    return Counter(r.status for r in rows(engine, table))


def in_key_order(messages: list[Any]) -> set[tuple[int, int]]:
    """Assert that per key the first copy of each event comes in event order;
    the events seen."""
    seen: set[tuple[int, int]] = set()
    firsts: dict[int, list[int]] = defaultdict(list)
    for m in messages:
        body = json.loads(m.value)
        ident = (body["k"], body["n"])
        if ident not in seen:
            seen.add(ident)
            firsts[body["k"]].append(body["n"])
    for key, order in firsts.items():
        assert order == sorted(order), f"key k{key} overtook itself: {order[:20]}"
    return seen


def test_an_isr_shortage_longer_than_max_attempts_timeouts_fails_no_row(
    cluster: KafkaCluster,
    cluster_topic: Callable[..., str],
    db_url: str,
    engine: sa.Engine,
    outbox: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """The issue's reproduction: replicas [1, 2], ``min.insync.replicas=2``,
    node 2 stopped, ``--max-attempts 2``, ``message.timeout.ms=2000``. Every
    produce is refused (NOT_ENOUGH_REPLICAS) and librdkafka reports only a
    message timeout; the relay names the cause from the partition's ISR, refunds
    the attempt each time, and after the heal delivers every row in key order."""
    max_attempts, keys, outage_rows = 2, 5, 20
    topic = cluster_topic(partitions=1, assignment=[[1, 2]], config={"min.insync.replicas": "2"})
    settings = fast_settings(
        db_url,
        cluster.bootstrap,
        max_attempts=max_attempts,
        lease_ttl=20.0,
        retry_backoff_base=0.2,
        retry_backoff_cap=0.5,
        kafka_config={"message.timeout.ms": "2000"},
    )
    with capture_json_logs(level="INFO") as logs:
        relay = embedded(settings)
        add_events(engine, outbox, keyed(topic, keys, keys))
        wait_for(lambda: statuses(engine, outbox) == {"delivered": keys}, timeout=60, what="warm")

        cluster.node(2).stop()
        cluster.wait_isr(topic, 0, 1)
        add_events(engine, outbox, keyed(topic, outage_rows, keys, start=keys))
        # Longer than max_attempts message timeouts: every row was sent and
        # timed out more times than max_attempts allows (or, before the fix,
        # failed after max_attempts of them).
        wait_for(
            lambda: (
                relay.metric("outbox_rows_retryable_total") >= outage_rows * (max_attempts + 1)
                or relay.metric("outbox_rows_failed_total") > 0
            ),
            timeout=120,
            interval=0.2,
            what="the outage outlasting max_attempts message timeouts",
        )
        during = [r for r in rows(engine, outbox) if r.status != "delivered"]
        assert relay.metric("outbox_rows_failed_total") == 0
        assert not [r for r in during if r.status == "failed"], "a row failed in the outage"
        at_rest = [r for r in during if r.status != "delivering"]
        assert at_rest and all(r.attempts == 0 for r in at_rest), [
            (r.id, r.status, r.attempts) for r in at_rest
        ]
        tried = [r for r in at_rest if r.status == "retryable"]
        assert tried and all(
            (r.last_error or "").startswith("NOT_ENOUGH_REPLICAS:") for r in tried
        ), [r.last_error for r in tried]
        assert "ISR is [1] of replicas [1, 2]" in (tried[0].last_error or "")
        labels = {"topic": topic, "error": "NOT_ENOUGH_REPLICAS"}
        assert (
            relay.metric("outbox_kafka_delivery_errors_total", labels) > outage_rows * max_attempts
        )
        timed_out = {"topic": topic, "error": "_MSG_TIMED_OUT"}
        assert relay.metric("outbox_kafka_delivery_errors_total", timed_out) == 0
        retries = [e for e in logs.events("delivery-retry") if e.get("topic") == topic]
        assert retries and set(retries[0]["errors"]) == {"NOT_ENOUGH_REPLICAS"}, retries[0]
        assert retries[0]["refunded"] == retries[0]["rows"], retries[0]
        outage_ids = {r.id for r in during}
        named = {i for e in logs.events("possibly-written") for i in e["row_ids"]}
        assert not named & outage_ids, "rows the broker refused were named possibly-written"

        cluster.node(2).start()
        total = keys + outage_rows
        wait_for(
            lambda: statuses(engine, outbox) == {"delivered": total},
            timeout=120,
            interval=0.5,
            what="every row delivered after the heal",
        )
    stored = rows(engine, outbox)
    assert Counter(r.attempts for r in stored) == {1: total}, "an attempt was burnt"
    seen = in_key_order(consume(cluster.bootstrap, topic, expected=total, timeout=60))
    assert len(seen) == total, "an event is missing"


def test_a_hung_leader_does_not_hold_the_other_partitions_for_the_message_timeout(
    cluster: KafkaCluster,
    cluster_topic: Callable[..., str],
    db_url: str,
    engine: sa.Engine,
    outbox: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """SIGSTOP of the broker that leads partition 0 (and follows the others):
    its requests are taken and never answered. The producer gives a request up
    after ``socket.timeout.ms`` (derived from the message timeout, a quarter of
    it) and sends it again once a new leader is elected, so the batch, and with
    it every other partition's rows, waits for that, not for the message
    timeout (30 s, the relay's default); and no row is charged an attempt."""
    message_timeout_s, keys = 30.0, 30
    hung = 3
    topic = cluster_topic(partitions=3, assignment=[[hung, 1, 2], [1, 2, hung], [2, hung, 1]])
    settings = fast_settings(
        db_url,
        cluster.bootstrap,
        lease_ttl=40.0,
        kafka_config={"message.timeout.ms": str(int(message_timeout_s * 1000))},
    )
    relay = embedded(settings)
    add_events(engine, outbox, keyed(topic, keys, keys))
    wait_for(lambda: statuses(engine, outbox) == {"delivered": keys}, timeout=60, what="warm")

    cluster.freeze(hung)
    with engine.connect() as conn:
        frozen_at = conn.scalar(sa.select(db_now()))
    add_events(engine, outbox, keyed(topic, 3 * keys, keys, start=keys))
    try:
        wait_for(
            lambda: statuses(engine, outbox) == {"delivered": 4 * keys},
            timeout=90,
            interval=0.2,
            what="every row delivered while the leader is hung",
        )
    finally:
        cluster.resume(hung)
    stored = rows(engine, outbox)
    late = [r for r in stored[keys:] if r.kafka_partition != 0]
    assert late, "no row went to another partition"
    # Database clock on both sides: the first delivery of another partition's
    # row after the freeze, against the message timeout it no longer waits for.
    waited = min(r.delivered_at for r in late) - frozen_at
    assert waited.total_seconds() < message_timeout_s * 0.75, waited
    assert Counter(r.attempts for r in stored) == {1: 4 * keys}, "an attempt was charged"
    assert relay.metric("outbox_rows_failed_total") == 0
    seen = in_key_order(consume(cluster.bootstrap, topic, expected=4 * keys, timeout=60))
    assert len(seen) == 4 * keys
