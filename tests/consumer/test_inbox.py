"""The inbox: the handler's writes and the inbox row commit together; duplicates skipped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from consumer_apps import effects
from kafkahelp import committed, produce, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message, RetryableError
from outboxkit.consumer.inbox import Inbox
from outboxkit.schema import apply_schema

pytestmark = pytest.mark.integration


class WriteThenMaybeFail(Consumer):
    """Writes its effect through ``message.tx``; ``fail-once`` raises after writing, once."""

    def __init__(self, settings: ConsumerSettings, engine: sa.Engine) -> None:
        super().__init__(settings, engine=engine)
        self.calls = 0
        self.failed_once = False

    def handle(self, message: Message) -> None:
        self.calls += 1
        message.tx.execute(
            effects.insert().values(
                event_id=message.identity[:64],
                kafka_partition=message.partition,
                kafka_offset=message.offset,
                pid=0,
            )
        )
        if message.value == b"fail-once" and not self.failed_once:
            self.failed_once = True
            raise RetryableError("lost the connection to the payment service")


def _rows(engine: sa.Engine, query: str) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(query)))


def test_duplicates_are_skipped_failed_attempts_roll_back_and_ids_fall_back(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    engine: sa.Engine,
    run_consumer: Any,
) -> None:
    apply_schema(engine, shards=8)
    effects.metadata.create_all(engine)
    topic = kafka_topics(1)
    group = f"g-{topic}"
    produce(
        kafka_bootstrap,
        topic,
        [
            (b"k", b"first", "ev-a"),
            (b"k", b"again", "ev-a"),  # the same event delivered twice
            (b"k", b"fail-once", "ev-b"),
            (b"k", b"no id 1", None),
            (b"k", b"no id 2", None),
        ],
    )
    consumer = WriteThenMaybeFail(settings(group_id=group, topics=(topic,), inbox=True), engine)
    with run_consumer(consumer) as running:
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 5}, 20, what="5 committed"
        )
        assert running.stop() == 0

    assert consumer.calls == 5  # ev-a once, ev-b twice (one rolled back), two without id
    assert [r[0] for r in _rows(engine, "SELECT event_id FROM effects ORDER BY id")] == [
        "ev-a",
        "ev-b",
        f"{topic}/0/3",
        f"{topic}/0/4",
    ]
    inbox = _rows(
        engine, "SELECT group_id, event_id, kafka_offset FROM outbox_inbox ORDER BY kafka_offset"
    )
    assert inbox == [
        (group, "ev-a", 0),
        (group, "ev-b", 2),
        (group, f"{topic}/0/3", 3),
        (group, f"{topic}/0/4", 4),
    ]
    sample = consumer.registry.get_sample_value
    assert sample("worker_messages_total", {"result": "duplicate"}) == 1
    assert sample("worker_messages_total", {"result": "success"}) == 4
    assert sample("worker_messages_total", {"result": "retry"}) == 1


def test_tx_without_the_inbox_is_a_clear_error() -> None:
    message = Message(topic="t", partition=0, offset=0, key=None, value=b"{}")
    with pytest.raises(RuntimeError, match="inbox"):
        _ = message.tx


def test_a_worker_keeps_its_connection_and_hands_it_back_after_a_failure(
    engine: sa.Engine,
) -> None:
    apply_schema(engine, shards=8)
    inbox = Inbox(engine, group_id="g-held", table="outbox_inbox")
    pool: Any = engine.pool
    seen: list[int] = []

    def handler(message: Message) -> None:
        seen.append(id(message.tx.connection.dbapi_connection))
        if message.value == b"boom":
            raise RuntimeError("handler bug")

    def msg(offset: int, value: bytes = b"ok") -> Message:
        return Message(topic="t-held", partition=0, offset=offset, key=None, value=value)

    assert inbox.run(msg(0), handler) is False
    assert inbox.run(msg(1), handler) is False
    assert seen[0] == seen[1] and pool.checkedout() == 1  # no checkout per message
    with pytest.raises(RuntimeError):
        inbox.run(msg(2, b"boom"), handler)
    assert pool.checkedout() == 0  # a failure hands the connection back
    assert inbox.run(msg(2), handler) is False  # the failed attempt left no inbox row
    assert inbox.run(msg(0), handler) is True  # duplicates still recognised

    # A connection the server dropped fails one attempt (transient) and is replaced.
    with engine.connect() as admin:
        held = inbox._held.conn
        assert held is not None
        conn_id = held.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
        held.rollback()
        admin.exec_driver_sql(f"KILL {conn_id}")
    with pytest.raises(sa.exc.OperationalError):
        inbox.run(msg(3), handler)
    assert inbox.run(msg(3), handler) is False
    inbox.release()
    assert pool.checkedout() == 0
    rows = _rows(engine, "SELECT kafka_offset FROM outbox_inbox WHERE group_id = 'g-held'")
    assert sorted(r[0] for r in rows) == [0, 1, 2, 3]
