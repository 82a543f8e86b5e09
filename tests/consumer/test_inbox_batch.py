"""The batched inbox (``inbox_batch > 1``): several messages in one transaction, same guarantees.

Each test runs the real consumer against Kafka and MariaDB/PostgreSQL and checks
what a user sees: effect rows, inbox rows, committed offsets, the dead-letter
topic, metrics and the drain report.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from consumer_apps import effects
from kafkahelp import committed, headers_of, produce, read_all, wait_for
from prometheus_client import CollectorRegistry
from support.databases import on_both_databases

from outboxkit.consumer import Consumer, ConsumerSettings, Message, RetryableError
from outboxkit.consumer.batching import InboxGroups
from outboxkit.consumer.inbox import Inbox, inbox_group_key
from outboxkit.consumer.metrics import ConsumerMetrics, HandleTimes
from outboxkit.consumer.workers import Dispatcher, WorkItem
from outboxkit.schema import apply_schema
from outboxkit.schema.table import db_now, inbox_table

pytestmark = pytest.mark.integration


class Effects(Consumer):
    """Writes one ``effects`` row per message through ``message.tx``, then maybe fails:
    ``fail-once`` raises a transient error once, ``bad`` a permanent one every time."""

    def __init__(self, settings: ConsumerSettings, engine: sa.Engine) -> None:
        super().__init__(settings, engine=engine)
        self.failed_once = False
        self.gave_up: list[int] = []
        #: offset -> (called, released): a handler that waits until the test lets it go.
        self.gates: dict[int, tuple[threading.Event, threading.Event]] = {}

    def handle(self, message: Message) -> None:
        message.tx.execute(
            effects.insert().values(
                event_id=message.event_id or "",
                kafka_partition=message.partition,
                kafka_offset=message.offset,
                pid=0,
            )
        )
        gate = self.gates.get(message.offset)
        if gate is not None:
            gate[0].set()
            assert gate[1].wait(30), "the test never let the handler go"
        if message.value == b"fail-once" and not self.failed_once:
            self.failed_once = True
            raise RetryableError("the payment service did not answer")
        if message.value == b"bad":
            raise ValueError("order refers to an unknown customer")

    def on_failure(self, message: Message, error: BaseException) -> None:
        self.gave_up.append(message.offset)


@contextmanager
def _commits(engine: sa.Engine) -> Iterator[list[int]]:
    """Counts the database transactions committed through ``engine`` meanwhile."""
    count = [0]

    def on_commit(_conn: Any) -> None:
        count[0] += 1

    sa.event.listen(engine, "commit", on_commit)
    try:
        yield count
    finally:
        sa.event.remove(engine, "commit", on_commit)


def _effect_ids(engine: sa.Engine) -> Counter[str]:
    with engine.connect() as conn:
        return Counter(r[0] for r in conn.execute(sa.select(effects.c.event_id)))


def _inbox_ids(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return {r[0] for r in conn.execute(sa.text("SELECT event_id FROM outbox_inbox"))}


@on_both_databases
@pytest.mark.parametrize("batch", [1, 8], ids=["one-per-tx", "batch-8"])
def test_a_failure_inside_a_group_costs_only_the_failing_message(
    batch: int,
    db_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    engine: sa.Engine,
    run_consumer: Any,
) -> None:
    """The same stream, batched or not, gives the same rows, offsets, DLQ and counts."""
    apply_schema(engine, shards=8)
    effects.metadata.create_all(engine)
    topic = kafka_topics(1)
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    group = f"g-{topic}"
    records: list[tuple[bytes, bytes, str]] = [(b"k", b"ok", f"ev-{n}") for n in range(20)]
    records[5] = (b"k", b"fail-once", "ev-5")  # transient, inside the first group
    records[12] = (b"k", b"bad", "ev-12")  # permanent: dead-lettered
    records.insert(8, (b"k", b"again", "ev-7"))  # redelivered right behind itself
    produce(kafka_bootstrap, topic, records)
    # ev-15 was handled before (by an earlier owner of the partition, say).
    with engine.begin() as conn:
        conn.execute(
            inbox_table().insert().values(processed_at=db_now()),
            {
                "group_id": inbox_group_key(group),
                "event_id": "ev-15",
                "topic": topic,
                "kafka_partition": 0,
                "kafka_offset": 16,
            },
        )
    consumer = Effects(
        settings(group_id=group, topics=(topic,), inbox=True, db_url=db_url, inbox_batch=batch),
        engine,
    )
    with _commits(engine) as commits, run_consumer(consumer) as running:
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 21}, 30, what="21 committed"
        )
        assert running.stop() == 0

    handled = [f"ev-{n}" for n in range(20) if n not in (12, 15)]
    assert _effect_ids(engine) == Counter(handled)  # each exactly once, ev-12 rolled back
    assert _inbox_ids(engine) == {*handled, "ev-15"}
    assert consumer.gave_up == [13]  # on_failure once, for ev-12 (offset 13)
    letters = read_all(kafka_bootstrap, dlq, expect=1)
    assert len(letters) == 1
    h = headers_of(letters[0])
    assert (h["dlq.original.offset"], h["dlq.attempts"]) == ("13", "1")  # as without batching
    sample = consumer.registry.get_sample_value
    counts = {
        r: sample("worker_messages_total", {"result": r})
        for r in ("success", "duplicate", "retry", "dlq")
    }
    assert counts == {"success": 18, "duplicate": 2, "retry": 1, "dlq": 1}
    if batch == 1:
        assert commits[0] >= 18
    else:
        # Grouped: fewer transactions than handled messages (13 when all 21 come in
        # one fetch: the failed groups are redone one per transaction).
        assert commits[0] < 18, commits[0]


@on_both_databases
def test_held_messages_commit_before_their_offsets_and_count_as_running_in_a_drain(
    db_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    engine: sa.Engine,
    run_consumer: Any,
) -> None:
    """A drain that begins while a group of ten (0..9) runs message 4: the whole
    group was started, so it is finished and committed, its ten offsets are
    committed, the other ten are released, and until the group's COMMIT neither
    its effects nor its offsets were visible."""
    apply_schema(engine, shards=8)
    effects.metadata.create_all(engine)
    topic = kafka_topics(1)
    group = f"g-{topic}"
    produce(kafka_bootstrap, topic, [(b"k", b"ok", f"ev-{n}") for n in range(20)])
    consumer = Effects(
        settings(
            group_id=group,
            topics=(topic,),
            inbox=True,
            db_url=db_url,
            inbox_batch=10,
            commit_interval=0.1,
        ),
        engine,
    )
    called, go = threading.Event(), threading.Event()
    consumer.gates[4] = (called, go)
    with run_consumer(consumer) as running:
        assert called.wait(30)
        # Give the periodic commit (every 0.1 s) many chances to commit too early.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert sum(_effect_ids(engine).values()) == 0, "the group committed early"
            assert committed(kafka_bootstrap, group, topic, 1) == {0: -1001}
        stopper = threading.Thread(target=running.stop)
        stopper.start()
        loop = consumer._loop
        assert loop is not None
        wait_for(lambda: loop._watch is not None, 10, what="the drain began")
        go.set()
        stopper.join(30)
        assert running.exit_code == 0

    report = consumer.report
    assert report is not None
    assert (report.batch_size, report.succeeded, report.released) == (20, 10, 10)
    assert report.unknown == 0
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 10}
    assert _effect_ids(engine) == Counter(f"ev-{n}" for n in range(10))


def test_a_database_out_of_reach_sends_the_message_down_the_normal_path() -> None:
    """No group can begin: nothing is held (a held message would keep its lane busy
    and a drain waiting forever); the message stays current, to be handled alone,
    where the connection error is classified and retried like any outage."""
    unreachable = sa.create_engine(
        "mysql+pymysql://u:p@127.0.0.1:1/x", connect_args={"connect_timeout": 2}
    )
    dispatcher = Dispatcher()
    tp = ("t", 0)
    gen = dispatcher.open(tp)
    items = [
        WorkItem(Message(topic="t", partition=0, offset=n, key=None, value=b"v"), tp, tp, gen)
        for n in range(3)
    ]
    dispatcher.submit_many(items)
    run = dispatcher.take(timeout=1)
    assert run is not None
    first = dispatcher.next(run)
    assert first is items[0]
    groups = InboxGroups(
        dispatcher=dispatcher,
        inbox=Inbox(unreachable, group_id="g", table="outbox_inbox"),
        handler=lambda m: None,
        size=3,
    )
    times = HandleTimes(ConsumerMetrics(CollectorRegistry()).handle_seconds)
    assert groups.handle(run, first, times) == (first, 1)
    assert dispatcher.running() == [first] and run.held == []
    assert dispatcher.results() == []
    unreachable.dispose()
