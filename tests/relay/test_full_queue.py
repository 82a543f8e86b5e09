"""A bounded producer queue (``queue.buffering.max.messages``) in front of a broker
that cannot be reached: the produce loop must stop at the batch's deadline, no
row may be released while a copy of it can still leave the producer, and a
drain must be able to interrupt the loop.

The relays reach a dedicated broker through a TCP proxy the tests cut (every
connection closed, new ones closed at once: the broker looks gone) and restore
within a fraction of a second.
"""

from __future__ import annotations

import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic
from relay_support import (
    EmbeddedRelay,
    RelayProcess,
    add_events,
    cli_args,
    consume,
    fast_settings,
    missing_service,
    rows,
    status_counts,
    wait_for,
)
from support.databases import on_both_databases
from support.services import KafkaInstance, free_ports
from support.tcpproxy import TcpProxy

from outboxkit import Event
from outboxkit.relay.finalize import Fate, decide
from outboxkit.relay.publish import ErrorKind, Publisher
from outboxkit.relay.rows import ClaimedRow
from outboxkit.runtime.testing import capture_json_logs

pytestmark = [pytest.mark.integration, pytest.mark.fault]


@dataclass
class ProxiedBroker:
    kafka: KafkaInstance
    proxy: TcpProxy

    @property
    def relay_bootstrap(self) -> str:
        return f"127.0.0.1:{self.proxy.listen_port}"

    def topic(self, partitions: int = 1) -> str:
        name = f"okt_{uuid.uuid4().hex[:10]}"
        admin = AdminClient({"bootstrap.servers": self.kafka.bootstrap})
        futures = admin.create_topics([NewTopic(name, num_partitions=partitions)])
        futures[name].result(timeout=20)
        return name


@pytest.fixture(scope="module")
def broker() -> Iterator[ProxiedBroker]:
    port, controller, proxied, listen = free_ports(4)
    kafka = KafkaInstance(
        f"queue-{uuid.uuid4().hex[:6]}",
        port,
        controller,
        proxied_port=proxied,
        proxied_advertised_port=listen,
    )
    try:
        kafka.start(fresh=True)
    except Exception as exc:
        missing_service(f"dedicated Kafka broker did not start: {exc}")
    with TcpProxy(listen, proxied) as proxy:
        yield ProxiedBroker(kafka, proxy)
    kafka.stop()
    shutil.rmtree(kafka.state_dir, ignore_errors=True)  # a fresh name per run


@pytest.fixture
def proxied(broker: ProxiedBroker) -> Iterator[ProxiedBroker]:
    broker.proxy.restore()
    yield broker
    broker.proxy.restore()


#: Four messages fit in the producer; each waits at most 5 s for a broker that
#: answers quickly once it is back.
BOUNDED = {
    "queue.buffering.max.messages": "4",
    "message.timeout.ms": "5000",
    "reconnect.backoff.ms": "50",
    "reconnect.backoff.max.ms": "200",
}


def _row(row_id: int, payload: bytes = b"x") -> ClaimedRow:
    return ClaimedRow(
        id=row_id,
        event_id=f"e{row_id}",
        topic="t",
        key=b"k",
        payload=payload,
        headers=None,
        shard=0,
        attempts=1,
        age_at_claim=0.0,
        reclaimed_from=None,
    )


def _unreachable_publisher(**kafka_config: str) -> Publisher:
    settings = fast_settings("mysql+pymysql://u@h/db", "127.0.0.1:1", kafka_config=kafka_config)
    return Publisher(settings)


@pytest.mark.unit
def test_rows_that_find_no_room_by_the_produce_deadline_are_not_sent_nor_any_after_them() -> None:
    publisher = _unreachable_publisher(**{"queue.buffering.max.messages": "1"})
    try:
        with capture_json_logs(level="INFO") as logs:
            inflight = publisher.publish(
                [_row(1), _row(2), _row(3)], until=lambda: time.monotonic() + 0.0
            )
        reports = inflight.snapshot()
        assert 1 not in reports, "the first row is in the producer, awaiting its report"
        assert [reports[i].kind for i in (2, 3)] == [ErrorKind.NOT_SENT] * 2
        # (not ``queued() == 1``: librdkafka counts its unserved error events
        # about the absent broker there too, more of them on a busy machine)
        assert logs.events("batch-produce-stopped")[0]["unsent"] == 2
        # Giving up on the batch purges what is queued: row 1 was never sent either.
        publisher.wait(inflight, deadline=lambda: 0.0)
        reports = inflight.snapshot()
        assert reports[1].kind is ErrorKind.NOT_SENT and "_PURGE_QUEUE" in (reports[1].error or "")
        decisions = decide(
            [_row(1), _row(2), _row(3)], reports, max_attempts=5, refund_unknown=False
        )
        assert [(d.fate, d.refund) for d in decisions] == [(Fate.RELEASED, True)] * 3, (
            "certainly not sent: released with the attempt refunded, even after a crash"
        )
    finally:
        publisher.close(0)


@pytest.mark.unit
def test_a_row_larger_than_the_empty_queue_fails_alone() -> None:
    publisher = _unreachable_publisher(**{"queue.buffering.max.kbytes": "1"})
    try:
        inflight = publisher.publish(
            [_row(1, b"x" * 5000), _row(2)], until=lambda: time.monotonic() + 30
        )
        reports = inflight.snapshot()
        assert reports[1].kind is ErrorKind.ROW_FAULT
        assert "queue.buffering.max.kbytes" in (reports[1].error or "")
        assert 2 not in reports and publisher.queued() >= 1, "the next row went on"
    finally:
        publisher.close(0)


def _first_copies_per_key(bootstrap: str, topic: str, table: list[Any]) -> dict[Any, list[int]]:
    """Each key's row ids in the order of their FIRST copies in the partition."""
    by_event = {r.event_id: r for r in table}
    seen: set[str] = set()
    order: dict[Any, list[int]] = {}
    messages = consume(bootstrap, topic, expected=len(table))
    for m in sorted(messages, key=lambda m: (m.partition, m.offset)):
        eid = m.headers["event_id"].decode()
        if eid in seen:
            continue
        seen.add(eid)
        row = by_event[eid]
        order.setdefault(row.message_key, []).append(row.id)
    assert seen == set(by_event), "every row arrived"
    return order


@on_both_databases
def test_a_full_queue_never_lets_a_stale_copy_of_a_later_row_go_first(
    request: pytest.FixtureRequest,
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    proxied: ProxiedBroker,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Five rows of one key, room for four in the producer, the broker gone.

    The fifth row waits for room until the first four time out; it must not be
    released while a copy of it is still queued in the producer (that copy would
    reach the partition first once the broker is back, ahead of rows 1-4 sent
    again). PostgreSQL runs the pipelined loop, MariaDB the plain one.
    """
    pipeline = request.node.callspec.params["db_url"] == "postgresql"
    topic = proxied.topic()
    settings = fast_settings(
        db_url,
        proxied.relay_bootstrap,
        pipeline=pipeline,
        lease_ttl=10.0,
        retry_backoff_base=0.2,
        retry_backoff_cap=1.0,
        kafka_config=BOUNDED,
    )
    with capture_json_logs(level="INFO") as logs:
        relay = embedded(settings)
        proxied.proxy.cut()
        add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"x") for _ in range(5)])

        def settled() -> bool:
            table = rows(engine, outbox)
            return all(r.status == "retryable" for r in table) and table[-1].attempts == 0

        # Rows 1-4 timed out (retryable, attempt used); row 5 went back unsent.
        wait_for(settled, timeout=30, what="the batch settled while the broker is gone")
        proxied.proxy.restore()
        wait_for(
            lambda: status_counts(engine, outbox) == {"delivered": 5},
            timeout=60,
            what="every row delivered once the broker is back",
        )
        assert relay.stop() == 0
    table = rows(engine, outbox)
    order = _first_copies_per_key(proxied.kafka.bootstrap, topic, table)
    reported = logs.events("acked-out-of-order")
    assert order[b"k"] == [r.id for r in table], (
        f"first copies in the order {order[b'k']}; acked-out-of-order reports: {reported}"
    )


def test_sigterm_while_the_queue_is_full_releases_every_row_and_exits_cleanly(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    proxied: ProxiedBroker,
    relay_process: Callable[..., RelayProcess],
) -> None:
    """One message fits in the producer and the broker is gone: the batch's other
    rows wait for room. SIGTERM must end that wait within the flush budget and
    release every row (none left leased, no forced exit)."""
    topic = proxied.topic()
    settings = fast_settings(
        db_url,
        proxied.relay_bootstrap,
        batch_size=20,
        lease_ttl=20.0,
        flush_timeout=1.0,
        shutdown_timeout=8.0,
        kafka_config={
            **BOUNDED,
            "queue.buffering.max.messages": "1",
            "message.timeout.ms": "10000",
        },
    )
    relay = relay_process(cli_args(settings))
    relay.wait_event("relay-started")
    proxied.proxy.cut()
    add_events(engine, outbox, [Event(topic=topic, key=f"k{i}", payload=b"x") for i in range(20)])
    wait_for(
        lambda: status_counts(engine, outbox) == {"delivering": 20},
        timeout=20,
        what="the batch claimed",
    )
    relay.signal(signal.SIGTERM)
    code = relay.wait(timeout=20)
    record = relay.events("relay-exit")[0]
    assert (code, record["result"], record["left_leased"]) == (0, "clean", 0), record
    assert record["unknown"] == 20, record
    assert status_counts(engine, outbox) == {"retryable": 20}
    assert {r.attempts for r in rows(engine, outbox)} == {0}, "released with the attempt refunded"
