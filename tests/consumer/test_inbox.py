"""The inbox: the handler's writes and the inbox row commit together; duplicates skipped."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from consumer_apps import effects
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from kafkahelp import committed, produce, wait_for
from support.databases import on_both_databases
from support.dbsql import connection_id, kill_connection

from outboxkit.consumer import (
    Consumer,
    ConsumerSettings,
    InboxTransactionAborted,
    Message,
    RetryableError,
)
from outboxkit.consumer.errors import Classification, classify
from outboxkit.consumer.inbox import Inbox, inbox_group_key, inbox_key
from outboxkit.schema import apply_schema
from outboxkit.schema.table import db_now, inbox_table

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


class AsyncWriteThenMaybeFail(WriteThenMaybeFail):
    """:class:`WriteThenMaybeFail` as an ``async def handle`` writing through
    ``message.async_tx``; its inbox builds an asyncmy engine from ``db_url``."""

    def __init__(self, settings: ConsumerSettings, engine: sa.Engine) -> None:
        Consumer.__init__(self, settings)
        self.calls = 0
        self.failed_once = False

    async def handle(self, message: Message) -> None:  # type: ignore[override]
        self.calls += 1
        await message.async_tx.execute(
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


@on_both_databases
@pytest.mark.parametrize(
    "consumer_class", [WriteThenMaybeFail, AsyncWriteThenMaybeFail], ids=["sync", "async"]
)
def test_duplicates_are_skipped_failed_attempts_roll_back_and_ids_fall_back(
    consumer_class: type[WriteThenMaybeFail],
    db_url: str,
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
    consumer = consumer_class(
        settings(group_id=group, topics=(topic,), inbox=True, db_url=db_url), engine
    )
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
        (group, f"outboxkit:record:0:3:{topic}", 3),
        (group, f"outboxkit:record:0:4:{topic}", 4),
    ]
    sample = consumer.registry.get_sample_value
    assert sample("worker_messages_total", {"result": "duplicate"}) == 1
    assert sample("worker_messages_total", {"result": "success"}) == 4
    assert sample("worker_messages_total", {"result": "retry"}) == 1


def test_tx_without_the_inbox_is_a_clear_error() -> None:
    message = Message(topic="t", partition=0, offset=0, key=None, value=b"{}")
    with pytest.raises(RuntimeError, match="inbox"):
        _ = message.tx


@on_both_databases
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
        conn_id = connection_id(held)
        held.rollback()
        kill_connection(admin, conn_id)
    with pytest.raises(sa.exc.OperationalError):
        inbox.run(msg(3), handler)
    assert inbox.run(msg(3), handler) is False
    inbox.release()
    assert pool.checkedout() == 0
    rows = _rows(engine, "SELECT kafka_offset FROM outbox_inbox WHERE group_id = 'g-held'")
    assert sorted(r[0] for r in rows) == [0, 1, 2, 3]


# -- identity: exact and unambiguous ---------------------------------------------------

#: Event ids that a case- or accent-insensitive, PAD SPACE, truncating or
#: replacement-decoding inbox takes for one another.
_LONG = "L" * 255
_HOSTILE_IDS: list[bytes] = [
    b"order-1",
    b"Order-1",
    b"cafe",
    "café".encode(),
    b"x",
    b"x ",
    (_LONG + "1").encode(),
    (_LONG + "2").encode(),
    b"\xff",  # not UTF-8: both decode to U+FFFD with errors="replace"
    b"\xfe",
]

Coordinates = tuple[str, int, int]


def _message(coords: Coordinates, event_id: bytes | None) -> Message:
    topic, partition, offset = coords
    headers = [("event_id", event_id)] if event_id is not None else []
    return Message(
        topic=topic, partition=partition, offset=offset, key=None, value=b"v", headers=headers
    )


_coordinates = st.tuples(
    st.sampled_from(["orders", "ORDERS", "Orders"]), st.just(0), st.integers(0, 3)
)


def _fallback_like(coords: Coordinates) -> list[bytes]:
    """Ids equal to a record's fallback identity, old and new spelling."""
    topic, partition, offset = coords
    return [
        f"{topic}/{partition}/{offset}".encode(),
        f"outboxkit:record:{partition}:{offset}:{topic}".encode(),
    ]


_event_ids = st.one_of(
    st.none(),
    st.sampled_from(_HOSTILE_IDS),
    _coordinates.flatmap(lambda c: st.sampled_from(_fallback_like(c))),
    st.binary(min_size=1, max_size=3),
    st.text(alphabet="aAéE \u0301", min_size=1, max_size=3).map(str.encode),
)


@st.composite
def _deliveries(draw: st.DrawFn) -> list[tuple[Coordinates, bytes | None]]:
    """Distinct records (a record is its coordinates), delivered in some order, with repeats."""
    records = draw(
        st.lists(
            st.tuples(_coordinates, _event_ids), min_size=1, max_size=10, unique_by=lambda r: r[0]
        )
    )
    order = draw(st.lists(st.integers(0, len(records) - 1), min_size=1, max_size=20))
    return [records[i] for i in order]


@on_both_databases
@hypothesis_settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(deliveries=_deliveries(), group=st.sampled_from(["billing", "BILLING", "Billing "]))
def test_a_record_is_a_duplicate_exactly_when_its_event_was_handled_before(
    engine: sa.Engine, deliveries: list[tuple[Coordinates, bytes | None]], group: str
) -> None:
    """Identity is the event id's bytes, else the record's coordinates, nothing else."""
    apply_schema(engine, shards=8)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_inbox"))
    # Another group, whose name differs only in case or a trailing space, handled
    # every event already: that must not count for this group.
    other = Inbox(engine, group_id=group.strip().lower(), table="outbox_inbox")
    if other.group_id != group:
        for coords, event_id in deliveries:
            other.run(_message(coords, event_id), lambda m: None)
        other.release()
    inbox = Inbox(engine, group_id=group, table="outbox_inbox")
    seen: set[object] = set()
    try:
        for coords, event_id in deliveries:
            identity: object = event_id if event_id else coords
            handled: list[Message] = []
            duplicate = inbox.run(_message(coords, event_id), handled.append)
            assert duplicate is (identity in seen), (coords, event_id)
            assert len(handled) == (0 if duplicate else 1)
            seen.add(identity)
    finally:
        inbox.release()


@on_both_databases
def test_cursor_event_hooks_see_the_inbox_insert(engine: sa.Engine) -> None:
    """The inbox's INSERT runs as the driver's SQL: statement logging and
    tracing hooked on cursor events (docs/consumer.md) still see it, once per
    message, a duplicate's included."""
    apply_schema(engine, shards=8)
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "outbox_inbox" in statement and statement.lstrip().upper().startswith("INSERT"):
            seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    inbox = Inbox(engine, group_id="billing", table="outbox_inbox")
    try:
        handled: list[Message] = []
        assert inbox.run(_message(("orders", 0, 1), b"e-1"), handled.append) is False
        assert inbox.run(_message(("orders", 0, 1), b"e-1"), handled.append) is True
        assert len(handled) == 1
    finally:
        inbox.release()
        sa.event.remove(engine, "before_cursor_execute", record)
    assert len(seen) == 2, seen
    with engine.connect() as conn:
        count = conn.execute(sa.select(sa.func.count()).select_from(inbox_table())).scalar()
    assert count == 1


def test_a_record_handled_before_the_upgrade_is_still_a_duplicate(engine: sa.Engine) -> None:
    """Release 1 keyed a record without event id as ``topic/partition/offset``."""
    apply_schema(engine, shards=8)
    with engine.begin() as conn:
        conn.execute(
            inbox_table().insert().values(processed_at=db_now()),
            {
                "group_id": "billing",
                "event_id": "orders/0/3",
                "topic": "orders",
                "kafka_partition": 0,
                "kafka_offset": 3,
            },
        )
    inbox = Inbox(engine, group_id="billing", table="outbox_inbox")
    handled: list[Message] = []
    try:
        assert inbox.run(_message(("orders", 0, 3), None), handled.append) is True
        # An event whose id merely spells that key is another event.
        assert inbox.run(_message(("orders", 0, 4), b"orders/0/3"), handled.append) is False
        assert inbox.run(_message(("ORDERS", 0, 3), None), handled.append) is False
        # The old row was re-keyed for it, and still marks its record as handled.
        assert inbox.run(_message(("orders", 0, 3), None), handled.append) is True
    finally:
        inbox.release()
    assert [(m.topic, m.offset) for m in handled] == [("orders", 4), ("ORDERS", 3)]
    rows = _rows(engine, "SELECT event_id, topic, kafka_offset FROM outbox_inbox ORDER BY 1")
    assert rows == [
        ("orders/0/3", "orders", 4),
        ("outboxkit:record:0:3:ORDERS", "ORDERS", 3),
        ("outboxkit:record:0:3:orders", "orders", 3),
    ]


class Recorder(Consumer):
    """Records which records its handler ran for."""

    def __init__(self, settings: ConsumerSettings, engine: sa.Engine) -> None:
        super().__init__(settings, engine=engine)
        self.handled: list[tuple[str, int]] = []

    def handle(self, message: Message) -> None:
        self.handled.append((message.topic, message.offset))


@on_both_databases
def test_events_that_only_look_alike_are_each_handled_once_on_kafka(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    engine: sa.Engine,
    run_consumer: Any,
) -> None:
    apply_schema(engine, shards=8)
    lower = kafka_topics(1)
    upper = kafka_topics(1, name=lower.upper())  # Kafka topic names are case-sensitive
    records: list[bytes | None] = [
        None,  # offset 0: fallback identity lower/0/0
        *_HOSTILE_IDS,
        f"{lower}/0/0".encode(),  # the old spelling of offset 0's fallback identity
        f"outboxkit:record:0:0:{lower}".encode(),  # the new one
        b"order-1",  # a true duplicate of offset 1
    ]
    produce(
        kafka_bootstrap,
        lower,
        [{"value": b"v", "headers": [("event_id", r)] if r else []} for r in records],
    )
    produce(kafka_bootstrap, upper, [{"value": b"v"}])  # fallback identity LOWER/0/0
    everything = {(lower, n) for n in range(len(records))} | {(upper, 0)}
    duplicate = (lower, len(records) - 1)

    for group in (f"g-{lower}", f"G-{lower.upper()}"):  # one group's name is the other's upper case
        consumer = Recorder(settings(group_id=group, topics=(lower, upper), inbox=True), engine)
        with run_consumer(consumer) as running:
            wait_for(
                lambda g=group: (
                    committed(kafka_bootstrap, g, lower, 1) == {0: len(records)}
                    and committed(kafka_bootstrap, g, upper, 1) == {0: 1}
                ),
                30,
                what=f"{group}: every offset committed",
            )
            assert running.stop() == 0
        assert sorted(consumer.handled) == sorted(everything - {duplicate}), group
        sample = consumer.registry.get_sample_value
        assert sample("worker_messages_total", {"result": "duplicate"}) == 1, group
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT event_id FROM outbox_inbox")).scalars().all()
    assert len(keys) == 2 * (len(everything) - 1)
    assert all(len(k) <= 255 and "\ufffd" not in k for k in keys)


_any_topic = st.one_of(st.sampled_from(["orders", "ORDERS"]), st.text(max_size=300))
_any_record = st.tuples(
    st.tuples(_any_topic, st.integers(0, 3), st.integers(0, 2**63 - 1)),
    st.one_of(st.none(), st.sampled_from(_HOSTILE_IDS), st.binary(max_size=300)),
)


@pytest.mark.unit
@hypothesis_settings(max_examples=500, deadline=None, derandomize=True)
@given(a=_any_record, b=_any_record, group=st.text(max_size=300))
def test_inbox_keys_are_equal_only_for_the_same_event_and_always_storable(
    a: tuple[Coordinates, bytes | None], b: tuple[Coordinates, bytes | None], group: str
) -> None:
    def identity(record: tuple[Coordinates, bytes | None]) -> object:
        coords, event_id = record
        return event_id if event_id else coords

    ka, kb = inbox_key(_message(*a)), inbox_key(_message(*b))
    assert (ka == kb) is (identity(a) == identity(b))
    for key in (ka, kb, inbox_group_key(group)):
        assert len(key) <= 255 and "\x00" not in key
        key.encode("utf-8")  # storable: no lone surrogates
    assert (inbox_group_key(group) == inbox_group_key(group + "x")) is False


# -- concurrency and transaction rules on each database ----------------------------------


def _inbox_inserts_waiting(engine: sa.Engine) -> int:
    """Sessions of this test's database in the middle of an inbox INSERT.

    A one-row INSERT that is still running is one that waits for a row lock. (Not
    ``information_schema.innodb_trx``: MariaDB refreshes it only after 100 ms
    without a read, so polling it can keep seeing the past.)
    """
    if engine.dialect.name == "postgresql":
        query = (
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO outbox_inbox%%'"
        )
    else:
        query = (
            "SELECT COUNT(*) FROM information_schema.processlist "
            "WHERE db = DATABASE() AND info LIKE 'INSERT INTO outbox_inbox%%'"
        )
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(query).scalar_one())


def _write_effect(message: Message, pid: int) -> None:
    message.tx.execute(
        effects.insert().values(
            event_id=message.identity[:64],
            kafka_partition=message.partition,
            kafka_offset=message.offset,
            pid=pid,
        )
    )


@on_both_databases
@pytest.mark.parametrize("isolation", ["default", "SERIALIZABLE"])
@pytest.mark.parametrize("first_outcome", ["commits", "fails"])
def test_two_consumers_racing_one_message_apply_it_once(
    db_url: str, engine: sa.Engine, first_outcome: str, isolation: str
) -> None:
    """After a rebalance, the old and the new owner may handle the same record at once.

    The second one's inbox insert waits for the first one's transaction: it skips the
    message if the first commits, and handles it if the first rolls back. Never both.
    Also with the service's engines at SERIALIZABLE (on PostgreSQL the waiting insert
    then fails with a serialization error instead of inserting nothing).
    """
    apply_schema(engine, shards=8)
    effects.metadata.create_all(engine)
    # Two consumer processes: two engines, two pools, two sessions.
    options = {} if isolation == "default" else {"isolation_level": isolation}
    other_engine = sa.create_engine(db_url, **options)
    first = Inbox(engine.execution_options(**options), group_id="billing", table="outbox_inbox")
    second = Inbox(other_engine, group_id="billing", table="outbox_inbox")
    message = Message(
        topic="orders",
        partition=0,
        offset=7,
        key=b"k",
        value=b"v",
        headers=[("event_id", b"ev-race")],
    )
    inside, go = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def slow_handler(m: Message) -> None:
        _write_effect(m, 1)
        inside.set()
        assert go.wait(30)
        if first_outcome == "fails":
            raise RuntimeError("the first owner's handler failed after writing")

    def run(name: str, inbox: Inbox, handler: Callable[[Message], None]) -> None:
        try:
            results[name] = inbox.run(message, handler)
        except Exception as exc:
            results[name] = exc
        finally:
            inbox.release()

    a = threading.Thread(target=run, args=("first", first, slow_handler))
    b = threading.Thread(target=run, args=("second", second, lambda m: _write_effect(m, 2)))
    try:
        a.start()
        assert inside.wait(20)
        b.start()
        wait_for(
            lambda: _inbox_inserts_waiting(engine) == 1, 20, what="the second waits on the row"
        )
        assert "second" not in results
    finally:
        go.set()
        a.join(30)
        b.join(30)
        other_engine.dispose()
    pids = [r[0] for r in _rows(engine, "SELECT pid FROM effects")]
    inbox_rows = _rows(engine, "SELECT event_id FROM outbox_inbox")
    if first_outcome == "commits":
        assert results == {"first": False, "second": True}
        assert pids == [1]
    else:
        assert isinstance(results["first"], RuntimeError)
        assert results["second"] is False
        assert pids == [2]
    assert [r[0] for r in inbox_rows] == ["ev-race"]


def test_on_postgresql_a_handler_that_swallows_a_database_error_commits_nothing(
    pg_url: str,
) -> None:
    """PostgreSQL aborts the whole transaction on an error; its COMMIT then rolls back
    without a word. A handler that catches the error and returns must not have its
    message counted as handled with neither its effects nor its inbox row stored."""
    engine = sa.create_engine(pg_url)
    try:
        apply_schema(engine, shards=8)
        effects.metadata.create_all(engine)
        inbox = Inbox(engine, group_id="billing", table="outbox_inbox")

        def swallows(m: Message) -> None:
            _write_effect(m, 1)
            # A handler that goes on after a database error.
            with contextlib.suppress(sa.exc.DBAPIError):
                m.tx.exec_driver_sql("SELECT 1 / 0")

        def savepoint(m: Message) -> None:
            _write_effect(m, 2)
            # Rolled back to the savepoint: the transaction goes on.
            with contextlib.suppress(sa.exc.DBAPIError), m.tx.begin_nested():
                m.tx.exec_driver_sql("SELECT 1 / 0")

        message = Message(topic="orders", partition=0, offset=1, key=None, value=b"v")
        try:
            with pytest.raises(InboxTransactionAborted, match="transaction was aborted") as info:
                inbox.run(message, swallows)
            # Retried with backoff, then dead-lettered: never counted as handled.
            assert classify(info.value) is Classification.TRANSIENT
            assert _rows(engine, "SELECT pid FROM effects") == []
            assert inbox.run(message, savepoint) is False  # not a duplicate: handled now
            assert inbox.run(message, swallows) is True
        finally:
            inbox.release()
        assert [r[0] for r in _rows(engine, "SELECT pid FROM effects")] == [2]
        assert len(_rows(engine, "SELECT event_id FROM outbox_inbox")) == 1
    finally:
        engine.dispose()
