"""The relay loop end to end on real MariaDB and PostgreSQL and Kafka: happy path, ordering."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay, add_events, consume, fast_settings, rows, wait_for
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.relay import relay as relay_module

pytestmark = [pytest.mark.integration, on_both_databases]


@pytest.mark.parametrize("pipeline", [False, True], ids=["no-pipeline", "pipeline"])
def test_20000_rows_over_500_keys_delivered_once_in_key_order(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
    pipeline: bool,
) -> None:
    topic = kafka_topics(partitions=6)
    events = [
        Event(
            topic=topic,
            key=f"key-{i % 500}",
            payload={"n": i},
            headers={"source": "test", "bin": bytes([i % 256])},
        )
        for i in range(20_000)
    ]
    event_ids = add_events(engine, outbox, events)

    relay = embedded(fast_settings(db_url, kafka_bootstrap, batch_size=1000, pipeline=pipeline))
    wait_for(
        lambda: relay.metric("outbox_backlog_rows", {"status": "pending"}) > 0,
        timeout=10,
        what="a backlog sample",
    )
    assert relay.metric("outbox_oldest_pending_age_seconds") > 0
    wait_for(
        lambda: relay.metric("outbox_rows_delivered_total") >= 20_000,
        timeout=120,
        what="20,000 deliveries",
    )
    wait_for(
        lambda: relay.metric("outbox_backlog_rows", {"status": "pending"}) == 0,
        timeout=5,
        what="the backlog gauge to drain",
    )
    assert relay.metric("outbox_oldest_pending_age_seconds") == 0
    assert relay.metric("outbox_publish_latency_seconds_count") == 20_000
    assert relay.metric("outbox_batch_size_sum") == 20_000
    assert relay.stop() == 0

    messages = consume(kafka_bootstrap, topic, expected=20_000)
    assert len(messages) == 20_000, "exactly once without faults"
    by_event = {m.headers["event_id"].decode(): m for m in messages}
    assert set(by_event) == set(event_ids)

    table = rows(engine, outbox)
    assert {r.status for r in table} == {"delivered"}
    position: dict[int, int] = {}
    for r in table:
        m = by_event[r.event_id]
        assert (m.partition, m.offset) == (r.kafka_partition, r.kafka_offset)
        assert m.key == r.message_key
        assert m.value == r.payload
        n = json.loads(m.value)["n"]
        assert m.headers["source"] == b"test" and m.headers["bin"] == bytes([n % 256])
        assert r.attempts == 1 and r.lease_token is None and r.delivered_at is not None
        position[r.id] = m.offset

    # Per key, Kafka order (offsets in the key's partition) equals id order.
    offsets_by_key: dict[bytes, list[int]] = defaultdict(list)
    for r in table:
        offsets_by_key[r.message_key].append(position[r.id])
    assert len(offsets_by_key) == 500
    for key, offsets in offsets_by_key.items():
        assert offsets == sorted(offsets), f"key {key!r} out of order"
    assert relay.metric("outbox_rows_claimed_total") == 20_000
    assert relay.metric("outbox_lease_lost_total") == 0


@pytest.mark.parametrize("pipeline", [False, True], ids=["no-pipeline", "pipeline"])
def test_the_pipeline_writes_a_batch_while_the_next_one_is_claimed(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
    monkeypatch: pytest.MonkeyPatch,
    pipeline: bool,
) -> None:
    # Every claim takes at least 0.3 s (a slow database); the pipelined relay
    # waits for the previous batch's reports and writes its outcomes meanwhile,
    # on the finalizer thread's own connection. Without the pipeline nothing
    # overlaps. The rows end up delivered once, in key order, either way.
    topic = kafka_topics(partitions=3)
    events = [Event(topic=topic, key=f"k{i % 30}", payload=b"p") for i in range(60)]
    add_events(engine, outbox, events)
    claims: list[tuple[float, float]] = []
    writes: list[tuple[float, float, str]] = []
    slow_claim = relay_module.claim_batch

    def timed_claim(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        time.sleep(0.3)
        try:
            return slow_claim(*args, **kwargs)
        finally:
            claims.append((start, time.monotonic()))

    write = relay_module.Relay._write

    def timed_write(self: Any, held: Any, decisions: Any) -> Any:
        start = time.monotonic()
        try:
            return write(self, held, decisions)
        finally:
            writes.append((start, time.monotonic(), threading.current_thread().name))

    monkeypatch.setattr(relay_module, "claim_batch", timed_claim)
    monkeypatch.setattr(relay_module.Relay, "_write", timed_write)
    relay = embedded(fast_settings(db_url, kafka_bootstrap, batch_size=10, pipeline=pipeline))
    wait_for(lambda: relay.metric("outbox_rows_delivered_total") >= 60, timeout=60, what="60 rows")
    assert relay.stop() == 0

    overlapping = [
        (ws, we) for ws, we, _ in writes if any(cs < we and ws < ce for cs, ce in claims)
    ]
    if pipeline:
        assert len(writes) >= 6
        assert {name for *_, name in writes} == {"outboxkit-finalize_0"}
        # Every batch but the last is written beside the next claim.
        assert len(overlapping) >= len(writes) - 1, (claims, writes)
    else:
        assert not overlapping, (claims, writes)
    table = rows(engine, outbox)
    assert {r.status for r in table} == {"delivered"} and {r.attempts for r in table} == {1}
    messages = consume(kafka_bootstrap, topic, expected=60)
    assert len(messages) == 60
    by_id = {m.headers["event_id"].decode(): m for m in messages}
    offsets: dict[bytes, list[int]] = defaultdict(list)
    for r in table:
        offsets[r.message_key].append(by_id[r.event_id].offset)
    assert all(o == sorted(o) for o in offsets.values()), "a key overtook itself"
