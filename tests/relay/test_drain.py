"""Drain of a relay process: SIGTERM, a second SIGTERM, and a crash (SIGKILL).

Every test runs on MariaDB and on PostgreSQL (``on_both_databases``).
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer as KafkaConsumer
from confluent_kafka import TopicPartition
from relay_support import (
    Message,
    Pushgateway,
    RelayProcess,
    add_events,
    cli_args,
    consume,
    fast_settings,
    http_get,
    rows,
    status_counts,
    wait_for,
)
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.schema import recovery_table

pytestmark = [pytest.mark.integration, on_both_databases]

#: Rows sit in the producer for 8 s unless 10 of them fill a partition's
#: batch: a claimed batch is then partly acknowledged at once, partly unknown
#: for seconds, which is what a drain has to sort out.
SLOW_KAFKA = {"linger.ms": "8000", "batch.num.messages": "10", "message.timeout.ms": "10000"}


def _slow_relay_args(db_url: str, bootstrap: str, **overrides: object) -> list[str]:
    values: dict[str, object] = {
        "batch_size": 100,
        "lease_ttl": 15.0,
        "flush_timeout": 1.0,
        "shutdown_timeout": 10.0,
        "kafka_config": SLOW_KAFKA,
    }
    values.update(overrides)
    return cli_args(fast_settings(db_url, bootstrap, **values))  # type: ignore[arg-type]


def _messages_in(bootstrap: str, topic: str, partitions: int) -> int:
    probe = KafkaConsumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4()}"})
    try:
        return sum(
            probe.get_watermark_offsets(TopicPartition(topic, p), timeout=5)[1]
            for p in range(partitions)
        )
    finally:
        probe.close()


def _delivering(engine: sa.Engine, table: str) -> int:
    return status_counts(engine, table).get("delivering", 0)


def _assert_first_deliveries_in_id_order(
    messages: list[Message], table_rows: list[sa.Row[object]]
) -> None:
    """For every key, the first copy of each event comes in id order (duplicates may follow)."""
    first_offset: dict[str, tuple[int, int]] = {}
    for m in messages:
        eid = m.headers["event_id"].decode()
        first_offset.setdefault(eid, (m.partition, m.offset))
        first_offset[eid] = min(first_offset[eid], (m.partition, m.offset))
    per_key: dict[object, list[tuple[int, int]]] = defaultdict(list)
    for r in table_rows:
        per_key[r.message_key].append(first_offset[r.event_id])  # type: ignore[attr-defined]
    for key, positions in per_key.items():
        assert positions == sorted(positions), f"key {key!r}: first deliveries out of id order"


def _sent_again(
    bootstrap: str, topic: str | tuple[str, ...], table_rows: list[sa.Row[Any]], *, held: set[str]
) -> set[str]:
    """After a takeover: every row's event is in the topic(s) (nothing lost), only
    the rows held at the kill were sent twice, and each key's first copies are in
    id order. Returns the event ids sent more than once."""
    topics = (topic,) if isinstance(topic, str) else topic
    messages = [
        m for t in topics for m in consume(bootstrap, t, expected=len(table_rows) // len(topics))
    ]
    copies: dict[str, int] = defaultdict(int)
    for m in messages:
        copies[m.headers["event_id"].decode()] += 1
    assert set(copies) == {r.event_id for r in table_rows}, "nothing lost"
    duplicated = {eid for eid, n in copies.items() if n > 1}
    assert duplicated <= held, "duplicates only of rows held at the kill"
    _assert_first_deliveries_in_id_order(messages, table_rows)
    return duplicated


def test_sigterm_drains_releases_with_refund_and_restart_finishes(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    topic = kafka_topics(partitions=3)
    add_events(
        engine, outbox, [Event(topic=topic, key=f"k{i % 40}", payload=b"x") for i in range(2000)]
    )

    relay = relay_process(_slow_relay_args(db_url, kafka_bootstrap))
    url = relay.health_url()
    wait_for(lambda: _delivering(engine, outbox) > 0, timeout=20, what="a batch in flight")
    # Full producer batches of 10 go out at once (acknowledged during the drain's
    # flush at the latest); the rest lingers 8 s and is released unknown.
    wait_for(
        lambda: _messages_in(kafka_bootstrap, topic, 3) > 0,
        timeout=6,
        what="part of the batch sent",
    )
    assert http_get(f"{url}/healthz/ready")[0] == 200

    sent = time.monotonic()
    relay.signal(signal.SIGTERM)
    while True:
        status, body = http_get(f"{url}/healthz/ready")
        if status == 503:
            break
    assert time.monotonic() - sent < 0.1, "readiness must turn 503 at once"
    assert isinstance(body, dict) and body["state"] == "draining"

    assert relay.wait(timeout=10) == 0
    assert time.monotonic() - sent < 10
    exit_line = relay.events("relay-exit")[0]
    assert exit_line["result"] == "clean" and exit_line["signal"] == "SIGTERM"
    assert exit_line["service"] == "outboxkit-relay" and exit_line["node_id"]
    assert exit_line["left_leased"] == 0 and exit_line["state"] == "stopped"
    assert exit_line["shutdown_deadline_ms"] == 10_000 and exit_line["duration_ms"] >= 1000
    parts = ("delivered", "failed", "retryable", "unknown", "left_leased", "lease_lost")
    assert sum(exit_line[p] for p in parts) == exit_line["batch_size"] == 100
    assert exit_line["delivered"] > 0 and exit_line["unknown"] > 0, exit_line

    table = rows(engine, outbox)
    assert not [r for r in table if r.status == "delivering"]
    released = [r for r in table if r.status == "retryable"]
    assert len(released) == exit_line["unknown"]
    assert all(r.attempts == 0 and r.lease_token is None for r in released), "attempt refunded"
    assert len([r for r in table if r.status == "delivered"]) == exit_line["delivered"]

    second = relay_process(_slow_relay_args(db_url, kafka_bootstrap, kafka_config={}))
    wait_for(
        lambda: status_counts(engine, outbox) == {"delivered": 2000}, timeout=60, what="backlog"
    )
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=10) == 0

    table = rows(engine, outbox)
    messages = consume(kafka_bootstrap, topic, expected=2000)
    assert {m.headers["event_id"].decode() for m in messages} == {r.event_id for r in table}
    _assert_first_deliveries_in_id_order(messages, table)
    assert all(r.attempts == 1 for r in table), "each row used exactly one attempt"


def test_second_sigterm_hurries_and_logs_unfinished_rows(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    topic = kafka_topics(partitions=1)
    add_events(engine, outbox, [Event(topic=topic, payload=b"x") for _ in range(5)])
    # 5 rows never fill a producer batch of 10: no report for 8 s.
    relay = relay_process(
        _slow_relay_args(
            db_url, kafka_bootstrap, flush_timeout=8.0, lease_ttl=25.0, shutdown_timeout=15.0
        )
    )
    wait_for(lambda: _delivering(engine, outbox) == 5, timeout=20, what="a batch in flight")

    relay.signal(signal.SIGTERM)
    relay.wait_event("state-changed")
    time.sleep(0.5)
    hurried = time.monotonic()
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=8) == 0
    assert time.monotonic() - hurried < 2.5, "a hurry must not wait out the flush timeout"
    assert relay.wait_event("drain-hurried")["unfinished_rows"] == 5
    exit_line = relay.events("relay-exit")[0]
    assert exit_line["unknown"] == 5 and exit_line["result"] == "clean"
    assert status_counts(engine, outbox) == {"retryable": 5}
    assert {r.attempts for r in rows(engine, outbox)} == {0}


def test_sigkill_mid_batch_rows_reclaimed_after_lease_expiry_attempts_kept(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    topic = kafka_topics(partitions=3)
    add_events(
        engine, outbox, [Event(topic=topic, key=f"k{i % 25}", payload=b"y") for i in range(500)]
    )
    first = relay_process(_slow_relay_args(db_url, kafka_bootstrap, lease_ttl=14.0))
    wait_for(lambda: _delivering(engine, outbox) > 0, timeout=20, what="a batch in flight")
    # Full producer batches of 10 go out at once; the rest lingers 8 s. Kill once some
    # of the batch is in Kafka (those become the duplicates), before the linger ends.
    wait_for(
        lambda: _messages_in(kafka_bootstrap, topic, 3) > 0,
        timeout=6,
        what="part of the batch sent",
    )
    first.signal(signal.SIGKILL)
    first.wait(timeout=10)
    in_flight = {r.event_id: r for r in rows(engine, outbox) if r.status == "delivering"}
    assert len(in_flight) == 100
    first_owner = next(iter(in_flight.values())).lease_owner

    second = relay_process(_slow_relay_args(db_url, kafka_bootstrap, kafka_config={}))
    time.sleep(3)
    assert _delivering(engine, outbox) == 100, "held until the lease expires"
    reclaim = second.wait_event("lease-reclaimed", timeout=20)
    assert reclaim["previous_owner"] == first_owner and reclaim["rows"] == 100
    wait_for(
        lambda: status_counts(engine, outbox) == {"delivered": 500}, timeout=60, what="backlog"
    )
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=10) == 0

    table = rows(engine, outbox)
    assert all(r.attempts == (2 if r.event_id in in_flight else 1) for r in table), (
        "the crashed claim is not refunded"
    )
    with engine.connect() as conn:
        recovered = conn.execute(sa.select(recovery_table())).all()
    assert [(e.kind, json.loads(e.detail)["previous_owner"]) for e in recovered] == [
        ("lease-reclaimed", first_owner)
    ]
    assert sorted(json.loads(recovered[0].detail)["row_ids"]) == sorted(
        r.id for r in in_flight.values()
    )

    duplicated = _sent_again(kafka_bootstrap, topic, table, held=set(in_flight))
    assert duplicated, "the acknowledged part of the killed batch is sent again"


def _two_topics(kafka_topics: Callable[..., str]) -> tuple[str, str]:
    return kafka_topics(partitions=3), kafka_topics(partitions=3)


def _two_batches_of_events(topics: tuple[str, str]) -> list[Event]:
    """600 rows over 200 keys, three each: with batches of 100, batch N holds
    k0..k99 and batch N+1 (claimed while N is leased, over the next 100 due
    rows) k100..k199: 200 rows leased under two tokens, and every key's later
    rows held back behind them.

    k0..k99 go to the first topic, k100..k199 to the second. In one topic, N+1's
    messages (produced as soon as N+1 is claimed) would fill the producer batches
    where N's last messages linger and carry them out: N would be acknowledged
    and settled within milliseconds and the relay would claim a third batch."""
    return [
        Event(topic=topics[(i % 200) // 100], key=f"k{i % 200}", payload=b"p") for i in range(600)
    ]


def _messages_in_both(bootstrap: str, topics: tuple[str, str]) -> int:
    return sum(_messages_in(bootstrap, t, 3) for t in topics)


def _two_batches_leased(engine: sa.Engine, table: str) -> dict[str, sa.Row[object]]:
    """The rows held once the pipelined relay leased two batches (asserted)."""
    wait_for(lambda: _delivering(engine, table) == 200, timeout=20, what="two batches leased")
    held = {r.event_id: r for r in rows(engine, table) if r.status == "delivering"}
    assert len({r.lease_token for r in held.values()}) == 2, "two batches, two tokens"
    keys_by_token: dict[str, set[object]] = defaultdict(set)
    for r in held.values():
        keys_by_token[r.lease_token].add(r.message_key)
    first, second = keys_by_token.values()
    assert not first & second, "a key is never in both batches"
    return held


def test_sigkill_with_two_batches_in_flight_loses_and_reorders_nothing(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    topics = _two_topics(kafka_topics)
    add_events(engine, outbox, _two_batches_of_events(topics))
    first = relay_process(_slow_relay_args(db_url, kafka_bootstrap, lease_ttl=14.0, pipeline=True))
    held = _two_batches_leased(engine, outbox)
    # Full producer batches of 10 go out at once; the rest lingers 8 s.
    wait_for(
        lambda: _messages_in_both(kafka_bootstrap, topics) > 0,
        timeout=6,
        what="part of the batches sent",
    )
    first.signal(signal.SIGKILL)
    first.wait(timeout=10)
    assert {r.event_id for r in rows(engine, outbox) if r.status == "delivering"} == set(held)

    second = relay_process(
        _slow_relay_args(db_url, kafka_bootstrap, kafka_config={}, pipeline=True)
    )
    second.wait_event("lease-reclaimed", timeout=20)
    wait_for(
        lambda: status_counts(engine, outbox) == {"delivered": 600}, timeout=60, what="backlog"
    )
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=10) == 0

    table = rows(engine, outbox)
    assert all(r.attempts == (2 if r.event_id in held else 1) for r in table), (
        "the crashed claims are not refunded"
    )
    reclaimed = second.events("lease-reclaimed")
    assert sum(e["rows"] for e in reclaimed) == 200
    _sent_again(kafka_bootstrap, topics, table, held=set(held))


def test_sigterm_with_two_batches_in_flight_settles_both_within_flush_timeout(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    topics = _two_topics(kafka_topics)
    add_events(engine, outbox, _two_batches_of_events(topics))
    relay = relay_process(_slow_relay_args(db_url, kafka_bootstrap, pipeline=True))
    held = _two_batches_leased(engine, outbox)
    # Full producer batches of 10 go out at once (acknowledged during the drain's
    # flush at the latest); the rest lingers 8 s and is released unknown.
    wait_for(
        lambda: _messages_in_both(kafka_bootstrap, topics) > 0,
        timeout=6,
        what="part of the batches sent",
    )

    sent = time.monotonic()
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=10) == 0
    # flush_timeout (1 s) for the reports, then finalize and close: not 8 s of linger.
    assert time.monotonic() - sent < 5
    exit_line = relay.events("relay-exit")[0]
    assert exit_line["result"] == "clean" and exit_line["left_leased"] == 0
    parts = ("delivered", "failed", "retryable", "unknown", "left_leased", "lease_lost")
    assert sum(exit_line[p] for p in parts) == exit_line["batch_size"] == 200, exit_line
    assert exit_line["delivered"] > 0 and exit_line["unknown"] > 0, exit_line

    table = rows(engine, outbox)
    after = {r.event_id: r for r in table if r.event_id in held}
    assert {r.status for r in after.values()} <= {"delivered", "retryable"}
    released = [r for r in after.values() if r.status == "retryable"]
    assert len(released) == exit_line["unknown"]
    assert all(r.attempts == 0 and r.lease_token is None for r in released), "attempt refunded"
    delivered = [r for r in after.values() if r.status == "delivered"]
    assert len(delivered) == exit_line["delivered"]
    assert all(r.attempts == 1 for r in delivered)
    assert {r.status for r in table if r.event_id not in held} == {"pending"}, "no third claim"


def test_pushgateway_gets_zero_shutdown_pending_after_clean_drain(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
    pushgateway: Pushgateway,
) -> None:
    topic = kafka_topics(partitions=1)
    add_events(engine, outbox, [Event(topic=topic, payload=b"z") for _ in range(3)])
    args = _slow_relay_args(db_url, kafka_bootstrap, kafka_config={})
    node_id = pushgateway.track(args[args.index("--node-id") + 1])
    relay = relay_process([*args, "--pushgateway-url", pushgateway.url])
    wait_for(lambda: status_counts(engine, outbox) == {"delivered": 3}, timeout=20, what="rows")
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=10) == 0
    assert relay.events("relay-exit")[0]["metrics_pushed"] is True
    assert pushgateway.value("outbox_shutdown_pending", node_id) == 0.0
    # Exit metrics only (outboxkit/runtime/metrics.py): counters and gauges of live
    # work are scraped, never pushed.
    assert pushgateway.value("outbox_rows_delivered_total", node_id) is None
    assert pushgateway.value("outbox_backlog_rows", node_id) is None
