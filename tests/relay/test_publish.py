"""Kafka faults on a dedicated broker that the tests stop and start: an outage,
and rows that use up their attempts."""

from __future__ import annotations

import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic
from relay_support import (
    EmbeddedRelay,
    add_events,
    consume,
    fast_settings,
    missing_service,
    rows,
    status_counts,
    wait_for,
)
from support.services import KafkaInstance, free_ports

from outboxkit import Event
from outboxkit.runtime.testing import capture_json_logs
from outboxkit.schema import outbox_table

pytestmark = [pytest.mark.integration, pytest.mark.fault]

BROKER_DOWN = {
    "batch_size": 50,
    "lease_ttl": 4.0,
    "flush_timeout": 0.5,
    "retry_backoff_base": 0.3,
    "retry_backoff_cap": 3.0,
    "kafka_config": {"message.timeout.ms": "1000", "reconnect.backoff.max.ms": "500"},
}


@pytest.fixture(scope="module")
def broker() -> Iterator[KafkaInstance]:
    kafka = KafkaInstance(f"relay-{uuid.uuid4().hex[:6]}", *free_ports(2))
    try:
        kafka.start(fresh=True)
    except Exception as exc:
        missing_service(f"dedicated Kafka broker did not start: {exc}")
    yield kafka
    kafka.stop()
    shutil.rmtree(kafka.state_dir, ignore_errors=True)  # a fresh name per run


def _topic(kafka: KafkaInstance, partitions: int = 3) -> str:
    name = f"okt_{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    futures[name].result(timeout=20)
    return name


def test_broker_down_rows_retry_with_backoff_using_no_attempt_then_all_delivered(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    broker: KafkaInstance,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    broker.start()
    topic = _topic(broker)
    add_events(
        engine, outbox, [Event(topic=topic, key=f"k{i % 10}", payload=b"a") for i in range(100)]
    )
    relay = embedded(fast_settings(db_url, broker.bootstrap, max_attempts=40, **BROKER_DOWN))
    wait_for(lambda: relay.metric("outbox_rows_delivered_total") == 100, timeout=20, what="first")

    broker.stop()
    add_events(
        engine, outbox, [Event(topic=topic, key=f"k{i % 10}", payload=b"b") for i in range(200)]
    )
    wait_for(lambda: relay.metric("outbox_rows_retryable_total") >= 50, timeout=20, what="retries")
    first = {r.id: r for r in rows(engine, outbox) if r.status == "retryable"}
    time.sleep(6)
    later = {r.id: r for r in rows(engine, outbox)}
    again = [
        i
        for i in first
        if later[i].status == "retryable" and later[i].next_attempt_at > first[i].next_attempt_at
    ]
    assert again, "rows were retried during the outage"
    # The broker, not the rows: every try's attempt is refunded (relay/outage.py).
    assert {later[i].attempts for i in again} == {0}
    assert all(
        any(
            name in (later[i].last_error or "")
            for name in ("_MSG_TIMED_OUT", "_TRANSPORT", "_ALL_BROKERS_DOWN")
        )
        for i in again
    )
    assert "failed" not in status_counts(engine, outbox)
    assert relay.relay.lifecycle.state.value == "running" and relay.thread.is_alive()
    assert relay.relay.supervisor.crashes == 0

    broker.start()
    wait_for(
        lambda: status_counts(engine, outbox) == {"delivered": 300}, timeout=90, what="recovery"
    )
    assert relay.stop() == 0

    table = rows(engine, outbox)
    messages = consume(broker.bootstrap, topic, expected=300)
    first_copy: dict[str, tuple[int, int]] = {}
    for m in messages:
        eid = m.headers["event_id"].decode()
        first_copy[eid] = min(first_copy.get(eid, (m.partition, m.offset)), (m.partition, m.offset))
    assert set(first_copy) == {r.event_id for r in table}, "nothing lost"
    per_key: dict[object, list[tuple[int, int]]] = defaultdict(list)
    for r in table:
        per_key[r.message_key].append(first_copy[r.event_id])
    assert all(v == sorted(v) for v in per_key.values()), "per-key order held through the outage"


def test_max_attempts_fails_the_row_and_the_relay_never_touches_it_again(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    broker: KafkaInstance,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    # A broker outage no longer uses attempts (relay/outage.py): these rows have
    # used theirs already (claims that crashed relays), the next claim is one too many.
    broker.start()
    topic = _topic(broker, partitions=1)
    add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"doomed") for _ in range(5)])
    t = outbox_table(outbox)
    with engine.begin() as conn:
        conn.execute(t.update().values(attempts=2))
    # skip: every row of the key fails (with hold, the first failed row holds the
    # others, which then wait without using their attempts).
    settings = fast_settings(
        db_url, broker.bootstrap, max_attempts=2, failed_rows="skip", **BROKER_DOWN
    )
    relay = embedded(settings)
    wait_for(lambda: status_counts(engine, outbox) == {"failed": 5}, timeout=30, what="failed")
    failed = rows(engine, outbox)
    assert all(r.attempts == 3 and "(max_attempts=2)" in r.last_error for r in failed)
    assert all(r.lease_owner is None and r.lease_token is None for r in failed)
    assert relay.metric("outbox_rows_failed_total") == 5

    add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"fresh")])
    wait_for(lambda: relay.metric("outbox_rows_delivered_total") == 1, timeout=60, what="fresh")
    time.sleep(1)
    assert relay.stop() == 0
    assert rows(engine, outbox)[:5] == failed, "failed rows are never touched again"
    assert [m.value for m in consume(broker.bootstrap, topic, expected=1)] == [b"fresh"]


def test_frozen_broker_does_not_hang_the_drain(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    broker: KafkaInstance,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    broker.start()
    topic = _topic(broker, partitions=1)
    settings = fast_settings(
        db_url,
        broker.bootstrap,
        lease_ttl=30.0,
        flush_timeout=1.0,
        shutdown_timeout=8.0,
        kafka_config={"message.timeout.ms": "20000"},
    )
    with capture_json_logs(level="INFO") as logs:
        relay = embedded(settings)
        # One event first: the producer has its id and connections when the
        # broker freezes, so the batch's requests are really sent.
        add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"warm-up")])
        wait_for(
            lambda: status_counts(engine, outbox) == {"delivered": 1}, timeout=30, what="warm-up"
        )
        broker.pause()  # connections stay open, nothing answers: produce requests hang
        try:
            add_events(
                engine, outbox, [Event(topic=topic, key="k", payload=b"x") for _ in range(5)]
            )
            wait_for(
                lambda: status_counts(engine, outbox) == {"delivered": 1, "delivering": 5},
                timeout=10,
                what="claim",
            )
            # The rows are leased a moment before they are produced, and a request
            # leaves after linger.ms (1): on a busy machine a stop right after the
            # claim found them still queued (purged, never sent: no such log line).
            # The broker answers nothing, so waiting changes nothing but that.
            time.sleep(0.5)
            started = time.monotonic()
            assert relay.stop(timeout=20) == 0
            elapsed = time.monotonic() - started
        finally:
            broker.resume()
    assert elapsed < settings.shutdown_timeout, "bounded waits: no forced exit needed"
    assert status_counts(engine, outbox) == {"delivered": 1, "retryable": 5}
    batch = rows(engine, outbox)[1:]
    assert {r.attempts for r in batch} == {0}, "released with the attempt refunded"
    # The requests were on their way to the broker: a copy of each row may still
    # be written, and the log names the rows an operator may see twice.
    (released,) = logs.events("released-in-flight")
    assert released["rows"] == 5
    assert released["row_ids"] == [r.id for r in batch]


def test_a_send_the_broker_never_answered_names_its_rows_as_possibly_written(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    broker: KafkaInstance,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """A frozen broker takes the batch's request and answers nothing: the
    messages time out in flight (``_MSG_TIMED_OUT``), which may still have
    written them, and the rows are sent again. Seen as a duplicate in the
    cluster chaos smoke with only a rate-limited ``delivery-retry`` line (a
    count) to explain it; now the relay names the rows, and every extra copy
    in the topic is of a row it named."""
    broker.start()
    topic = _topic(broker, partitions=1)
    settings = fast_settings(
        db_url,
        broker.bootstrap,
        lease_ttl=20.0,
        retry_backoff_base=0.3,
        retry_backoff_cap=1.0,
        kafka_config={"message.timeout.ms": "2000", "reconnect.backoff.max.ms": "500"},
    )
    with capture_json_logs(level="INFO") as logs:
        relay = embedded(settings)
        add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"warm-up")])
        wait_for(
            lambda: status_counts(engine, outbox) == {"delivered": 1}, timeout=30, what="warm-up"
        )
        broker.pause()  # the request is taken, never answered
        try:
            add_events(
                engine, outbox, [Event(topic=topic, key="k", payload=b"x") for _ in range(3)]
            )
            wait_for(lambda: bool(logs.events("possibly-written")), timeout=20, what="the timeout")
        finally:
            broker.resume()
        wait_for(
            lambda: status_counts(engine, outbox) == {"delivered": 4},
            timeout=60,
            what="every row delivered once the broker answers",
        )
        assert relay.stop() == 0
    batch = rows(engine, outbox)[1:]
    first = logs.events("possibly-written")[0]
    assert first["row_ids"] == [r.id for r in batch], first
    assert first["errors"] == {"_MSG_TIMED_OUT": 3}, first
    # The broker never answered: the cluster's fault, no attempt used.
    assert {r.attempts for r in batch} == {1}, "the timed-out send counted an attempt"
    named = {i for e in logs.events("possibly-written") for i in e["row_ids"]}
    copies: dict[str, int] = defaultdict(int)
    for m in consume(broker.bootstrap, topic, expected=4):
        copies[m.headers["event_id"].decode()] += 1
    by_event = {r.event_id: r.id for r in rows(engine, outbox)}
    assert set(copies) == set(by_event), "nothing lost"
    twice = {by_event[e] for e, n in copies.items() if n > 1}
    assert twice <= named, f"copies of rows never named: {twice - named}"
