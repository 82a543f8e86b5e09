"""Async handlers: what only an ``async def handle`` has (the loop thread, cancellation
at the drain deadline, the async inbox transaction).

The scenarios shared with sync handlers (SIGKILL, SIGTERM drain, rebalance, retries,
DLQ, per-key order with concurrency, inbox duplicates and rollback) are the existing
tests, parametrised ``sync``/``async`` in their own modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from consumer_apps import effects
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from kafkahelp import committed, produce, read_all, wait_for
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from support.databases import on_both_databases
from support.dbsql import kill_connection

from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.consumer.asyncio_handler import HandlerCancelled, LoopThread
from outboxkit.consumer.inbox_async import async_db_url
from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.exitcodes import EXIT_CONFIG
from outboxkit.runtime.testing import capture_json_logs
from outboxkit.schema import apply_schema

# -- the loop thread ---------------------------------------------------------------


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread("test-loop")
    lt.start()
    yield lt
    lt.stop(grace=1.0)


@pytest.mark.unit
def test_run_returns_the_result_raises_the_handlers_own_exception_and_keeps_the_context(
    loop_thread: LoopThread,
) -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    var.set("worker's")

    async def read() -> tuple[str, bool]:
        await asyncio.sleep(0)
        return var.get(), threading.current_thread().name == "test-loop"

    assert loop_thread.run(read) == ("worker's", True)

    async def fail() -> None:
        raise KeyError("a handler bug")

    # The same exception (not wrapped): classify() sees what the handler raised.
    with pytest.raises(KeyError, match="a handler bug"):
        loop_thread.run(fail)


@pytest.mark.unit
@hypothesis_settings(max_examples=10, deadline=None, derandomize=True)
@given(running=st.integers(0, 6), finishing=st.integers(0, 6))
def test_cancel_pending_cancels_exactly_the_unfinished_coroutines(
    running: int, finishing: int
) -> None:
    """Each waiting worker gets HandlerCancelled (never an Exception a retry or the DLQ
    would act on); the coroutine's cleanup runs; finished ones keep their result."""
    lt = LoopThread("test-loop")
    lt.start()
    started: list[int] = []
    cleaned: list[int] = []
    outcomes: dict[int, str] = {}

    def worker(n: int, forever: bool) -> None:
        async def handler() -> None:
            started.append(n)
            if forever:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    cleaned.append(n)
                    raise

        try:
            lt.run(handler)
            outcomes[n] = "done"
        except HandlerCancelled:
            outcomes[n] = "cancelled"

    threads = [
        threading.Thread(target=worker, args=(n, n < running)) for n in range(running + finishing)
    ]
    for t in threads:
        t.start()
    wait_for(
        lambda: len(started) == running + finishing and len(outcomes) == finishing,
        10,
        what="all started, the finishing ones done",
    )
    assert lt.cancel_pending() == running
    for t in threads:
        t.join(10)
    assert outcomes == {
        n: "cancelled" if n < running else "done" for n in range(running + finishing)
    }
    wait_for(lambda: sorted(cleaned) == list(range(running)), 5, what="cleanup ran")
    assert lt.stop(grace=1.0) is True
    # Once stopped, nothing starts: the call is not even made.
    calls: list[int] = []

    async def never() -> None:
        calls.append(1)

    with pytest.raises(HandlerCancelled):
        lt.run(never)
    assert calls == []


@pytest.mark.unit
def test_stop_reports_a_coroutine_that_refuses_to_be_cancelled() -> None:
    lt = LoopThread("test-loop")
    lt.start()
    release = threading.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue  # swallows cancellation

    threading.Thread(target=lambda: _ignore_cancel(lt, stubborn), daemon=True).start()
    time.sleep(0.1)
    assert lt.stop(grace=0.3) is False
    release.set()  # let the loop thread end


def _ignore_cancel(lt: LoopThread, call: Any) -> None:
    with contextlib.suppress(HandlerCancelled):
        lt.run(call)


# -- configuration -------------------------------------------------------------------


class AsyncNoop(Consumer):
    async def handle(self, message: Message) -> None:
        await asyncio.sleep(0)


class SyncNoop(Consumer):
    def handle(self, message: Message) -> None:
        pass


@pytest.mark.unit
def test_an_engine_of_the_wrong_kind_is_refused_at_construction() -> None:
    base = ConsumerSettings(
        kafka_bootstrap="127.0.0.1:1", group_id="g", topics=("t",), inbox=True, health_port=0
    )
    sync_engine = sa.create_engine("sqlite://")
    async_engine = create_async_engine("mysql+asyncmy://u:p@127.0.0.1:1/db")
    with pytest.raises(ConfigError, match="async def handle needs an AsyncEngine"):
        AsyncNoop(base, engine=sync_engine)
    with pytest.raises(ConfigError, match="async def handle needs an AsyncEngine"):
        SyncNoop(base, engine=async_engine)
    sync_engine.dispose()


@pytest.mark.unit
def test_the_inbox_url_gets_the_asyncio_driver() -> None:
    assert async_db_url("mysql+pymysql://u:p@h/db").drivername == "mysql+asyncmy"
    # psycopg 3 is an asyncio driver too: create_async_engine takes the same URL.
    assert async_db_url("postgresql+psycopg://u:p@h/db").drivername == "postgresql+psycopg"
    assert async_db_url("postgresql://u:p@h/db").drivername == "postgresql+psycopg"
    assert async_db_url("postgresql+psycopg2://u:p@h/db").drivername == "postgresql+psycopg"
    assert async_db_url("mysql://u:p@h/db").drivername == "mysql+asyncmy"
    assert async_db_url("mysql+asyncmy://u:p@h/db").drivername == "mysql+asyncmy"
    assert async_db_url("mysql+pymysql://u:p@h/db").password == "p"


@pytest.mark.integration
def test_async_inbox_without_the_table_exits_2(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    db_url: str,
) -> None:
    topic = kafka_topics(1)
    consumer = AsyncNoop(
        settings(group_id=f"g-{topic}", topics=(topic,), inbox=True, db_url=db_url)
    )
    assert consumer.run(handle_signals=False) == EXIT_CONFIG


# -- the async inbox transaction and cancellation at the drain deadline ---------------


class WriteThenHang(Consumer):
    """Writes its effect through ``message.async_tx``; the value ``hang`` then waits forever."""

    hang: bytes | None = b"hang"

    def __init__(self, settings: ConsumerSettings, engine: AsyncEngine | None = None) -> None:
        super().__init__(settings, engine=engine)
        self.handled: list[int] = []
        self.hanging = threading.Event()
        self.cancelled: list[int] = []

    async def handle(self, message: Message) -> None:
        await message.async_tx.execute(
            effects.insert().values(
                event_id=message.identity[:64],
                kafka_partition=message.partition,
                kafka_offset=message.offset,
                pid=0,
            )
        )
        if message.value == self.hang:
            self.hanging.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.append(message.offset)
                raise
        self.handled.append(message.offset)


def _count(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar_one())


@pytest.mark.integration
@on_both_databases
def test_a_handler_cancelled_at_the_drain_deadline_rolls_back_is_unknown_and_redelivered(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    engine: sa.Engine,
    db_url: str,
    run_consumer: Any,
) -> None:
    apply_schema(engine, shards=8)
    effects.metadata.create_all(engine)
    topic = kafka_topics(1)
    group = f"g-{topic}"
    produce(kafka_bootstrap, topic, [(b"k", b"ok", "ev-0"), (b"k", b"hang", "ev-1")])
    # An engine of the service's own, passed in: the consumer uses it on its loop.
    aengine = create_async_engine(async_db_url(db_url), pool_size=2)
    first = WriteThenHang(
        settings(group_id=group, topics=(topic,), inbox=True, worker_drain_timeout=1.0),
        engine=aengine,
    )
    with capture_json_logs(level="INFO") as logs, run_consumer(first) as running:
        assert first.hanging.wait(20)
        assert _count(engine, "effects") == 1  # ev-0 committed; ev-1 in an open transaction
        started = time.monotonic()
        assert running.stop() == 0
        assert time.monotonic() - started < 1.0 + 5.0  # drain timeout + close, not the hour
    # The cancelled coroutine's ROLLBACK finished before its connection was handed
    # back: the worker, which stops waiting for it at once, does not close that
    # connection underneath it (on MariaDB the rollback then never returned, the
    # loop was abandoned and the engine's pool never disposed).
    assert logs.events("event-loop-abandoned") == []
    report = first.report
    assert report is not None
    assert (report.batch_size, report.unknown, report.succeeded) == (1, 1, 0)
    assert first.cancelled == [1]  # the coroutine was cancelled, not left behind
    # Its transaction rolled back: neither its effect nor its inbox row, and the
    # group's offset stays on it.
    assert _count(engine, "effects") == 1
    assert _count(engine, "outbox_inbox") == 1
    assert committed(kafka_bootstrap, group, topic, 1) == {0: 1}
    # The engine passed in is still usable (its loop-bound connections were disposed).
    assert aengine.pool.checkedout() == 0

    second = WriteThenHang(settings(group_id=group, topics=(topic,), inbox=True, db_url=db_url))
    second.hang = None
    with run_consumer(second) as running:
        wait_for(lambda: second.handled == [1], 20, what="redelivery of ev-1")
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 2}, 10, what="2 committed"
        )
        assert running.stop() == 0
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT event_id FROM effects ORDER BY id")).scalars().all()
    assert rows == ["ev-0", "ev-1"]  # each effect exactly once
    assert _count(engine, "outbox_inbox") == 2


class RecordsConnection(Consumer):
    """Writes its effect through ``message.async_tx`` and notes the server connection id."""

    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.connections: list[int] = []

    async def handle(self, message: Message) -> None:
        postgres = message.async_tx.dialect.name == "postgresql"
        query = "SELECT pg_backend_pid()" if postgres else "SELECT CONNECTION_ID()"
        result = await message.async_tx.exec_driver_sql(query)
        self.connections.append(int(result.scalar_one()))
        await message.async_tx.execute(
            effects.insert().values(
                event_id=message.identity[:64],
                kafka_partition=message.partition,
                kafka_offset=message.offset,
                pid=0,
            )
        )


@pytest.mark.integration
@on_both_databases
def test_a_lost_async_inbox_connection_is_retried_and_replaced_never_dead_lettered(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    engine: sa.Engine,
    db_url: str,
    run_consumer: Any,
) -> None:
    apply_schema(engine, shards=8)
    effects.metadata.create_all(engine)
    topic = kafka_topics(1)
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    group = f"g-{topic}"
    consumer = RecordsConnection(
        settings(group_id=group, topics=(topic,), inbox=True, db_url=db_url, max_attempts=1)
    )
    with run_consumer(consumer) as running:
        produce(kafka_bootstrap, topic, [(b"k", b"a", "e-1")])
        wait_for(lambda: len(consumer.connections) == 1, 20, what="the first message")
        # The server drops the worker's held connection between two messages.
        with engine.connect() as admin:
            kill_connection(admin, consumer.connections[0])
        produce(kafka_bootstrap, topic, [(b"k", b"b", "e-2")])
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 2}, 30, what="2 committed"
        )
        assert running.stop() == 0
    # One failed attempt on the dead connection (a dependency failure: retried even with
    # max_attempts=1, not dead-lettered), then a new connection.
    assert consumer.connections[-1] != consumer.connections[0]
    assert consumer.registry.get_sample_value("worker_messages_total", {"result": "retry"}) >= 1
    assert consumer.registry.get_sample_value("worker_messages_total", {"result": "dlq"}) in (
        None,
        0.0,
    )
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT event_id FROM effects ORDER BY id")).scalars().all()
    assert rows == ["e-1", "e-2"]
    assert read_all(kafka_bootstrap, dlq, expect=0) == []
