"""Wake-up hints against real MariaDB and Redis: sent after commit only; wake the relay."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from test_writer_async import async_url

from outboxkit import enable_wakeups, enqueue, enqueue_async, notify_relays
from outboxkit.relay.wakeup import RedisWaker
from outboxkit.runtime.identity import read_identity
from outboxkit.wakeup import WakeupPublisher, wakeup_channel

pytestmark = pytest.mark.integration


class Listener:
    """A raw subscriber that records hints as they arrive."""

    def __init__(self, url: str, channel: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pubsub = self.client.pubsub()
        self.pubsub.subscribe(channel)
        # Wait for the subscription to be live before anything is published.
        while (msg := self.pubsub.get_message(timeout=1)) is None or msg["type"] != "subscribe":
            pass

    def count(self, within: float) -> int:
        n = 0
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            msg = self.pubsub.get_message(timeout=left)
            if msg is not None and msg["type"] == "message":
                n += 1
        return n

    def close(self) -> None:
        self.pubsub.close()
        self.client.close()


@pytest.fixture
def listener(
    redis_url: str, redis_prefix: str, outbox: str, engine: sa.Engine
) -> Iterator[Listener]:
    lst = Listener(redis_url, _channel(engine, outbox, redis_prefix))
    yield lst
    lst.close()


def _channel(engine: sa.Engine, outbox: str, prefix: str) -> str:
    """The channel the writer's hints for ``outbox`` go to: named by its identity."""
    with engine.connect() as conn:
        return wakeup_channel(outbox, prefix, outbox=read_identity(conn, outbox).key)


def _enqueue(target: Any, outbox: str) -> None:
    enqueue(target, topic="orders", payload={"n": 1}, key="k1", table=outbox)


def test_session_hint_after_commit_only(
    engine: sa.Engine, outbox: str, redis_url: str, redis_prefix: str, listener: Listener
) -> None:
    factory = sessionmaker(engine)
    hook = enable_wakeups(factory, redis_url, prefix=redis_prefix)
    try:
        with factory() as session:
            _enqueue(session, outbox)
            assert listener.count(0.3) == 0, "a hint before the commit"
            session.commit()
        assert listener.count(1.0) == 1

        with factory() as session:
            _enqueue(session, outbox)
            session.rollback()
        with factory() as session:  # a transaction that enqueued nothing
            session.execute(sa.text("SELECT 1"))
            session.commit()
        with factory() as session:  # the rollback of the failed one must not leak
            session.execute(sa.text("SELECT 1"))
            session.commit()
        assert listener.count(0.5) == 0

        with pytest.raises(RuntimeError), factory.begin() as session:
            _enqueue(session, outbox)
            raise RuntimeError("business logic failed")
        assert listener.count(0.5) == 0
    finally:
        hook.disable()


def test_engine_hint_after_commit_only(
    engine: sa.Engine, outbox: str, redis_url: str, redis_prefix: str, listener: Listener
) -> None:
    hook = enable_wakeups(engine, redis_url, prefix=redis_prefix)
    try:
        with engine.begin() as conn:
            _enqueue(conn, outbox)
            assert listener.count(0.3) == 0, "a hint before the commit"
        assert listener.count(1.0) == 1

        with engine.connect() as conn:  # commit, then keep using the connection
            _enqueue(conn, outbox)
            conn.commit()
            conn.execute(sa.text("SELECT 1"))
            assert listener.count(1.0) == 1
            conn.rollback()

        with pytest.raises(RuntimeError), engine.begin() as conn:
            _enqueue(conn, outbox)
            raise RuntimeError("business logic failed")
        with engine.connect() as conn:  # enqueued, never committed, returned to the pool
            _enqueue(conn, outbox)
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT 1"))
        assert listener.count(0.5) == 0

        with Session(engine) as session:  # a session on the same engine is covered too
            _enqueue(session, outbox)
            session.commit()
        assert listener.count(1.0) == 1
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT COUNT(*) FROM {outbox}")).scalar_one()
        assert rows == 3
    finally:
        hook.disable()


def test_async_engine_hint_after_commit_only(
    db_url: str, outbox: str, redis_url: str, redis_prefix: str, listener: Listener
) -> None:
    async def scenario() -> None:
        aengine = create_async_engine(async_url(db_url))
        hook = enable_wakeups(aengine, redis_url, prefix=redis_prefix)
        try:
            async with aengine.begin() as conn:
                await enqueue_async(conn, topic="orders", payload={"n": 1}, table=outbox)
                assert listener.count(0.3) == 0, "a hint before the commit"
            assert listener.count(1.0) == 1

            async with AsyncSession(aengine) as session:
                await enqueue_async(session, topic="orders", payload={"n": 2}, table=outbox)
                await session.commit()
            assert listener.count(1.0) == 1

            async with aengine.connect() as conn:
                await enqueue_async(conn, topic="orders", payload={"n": 3}, table=outbox)
                await conn.rollback()
            with pytest.raises(RuntimeError):
                async with AsyncSession(aengine) as session, session.begin():
                    await enqueue_async(session, topic="orders", payload={"n": 4}, table=outbox)
                    raise RuntimeError("business logic failed")
            async with aengine.begin() as conn:  # a transaction that enqueued nothing
                await conn.execute(sa.text("SELECT 1"))
            assert listener.count(0.5) == 0
        finally:
            hook.disable()
            await aengine.dispose()

    asyncio.run(scenario())


def test_async_sessionmaker_hint_after_commit_only(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    redis_url: str,
    redis_prefix: str,
    listener: Listener,
) -> None:
    async def scenario() -> None:
        aengine = create_async_engine(async_url(db_url))
        factory = async_sessionmaker(aengine, expire_on_commit=False)
        hook = enable_wakeups(factory, redis_url, prefix=redis_prefix)
        try:
            async with factory() as session:
                await enqueue_async(session, topic="orders", payload={"n": 1}, table=outbox)
                assert listener.count(0.3) == 0, "a hint before the commit"
                await session.commit()
            assert listener.count(1.0) == 1

            async with factory() as session:
                await enqueue_async(session, topic="orders", payload={"n": 2}, table=outbox)
                await session.rollback()
            async with factory.begin() as session:
                await session.execute(sa.text("SELECT 1"))
            assert listener.count(0.5) == 0
        finally:
            hook.disable()
        # Disabled: the factory is as it was, and its sessions send nothing.
        async with factory.begin() as session:
            await enqueue_async(session, topic="orders", payload={"n": 3}, table=outbox)
        await aengine.dispose()
        assert listener.count(0.5) == 0

    asyncio.run(scenario())
    # A plain sync Session elsewhere in the process is not hooked by the factory's hint.
    with Session(engine) as session:
        _enqueue(session, outbox)
        session.commit()
    assert listener.count(0.5) == 0


def test_without_enable_no_hint_and_explicit_notify(
    engine: sa.Engine, outbox: str, redis_url: str, redis_prefix: str, listener: Listener
) -> None:
    with engine.begin() as conn:
        _enqueue(conn, outbox)
    assert listener.count(0.3) == 0
    client = redis.Redis.from_url(redis_url)
    assert notify_relays(client, outbox, prefix=redis_prefix, bind=engine)
    assert listener.count(1.0) == 1
    assert notify_relays(client, outbox, prefix=redis_prefix)  # the legacy channel
    assert listener.count(0.3) == 0, "without bind the hint goes to the legacy channel"
    client.close()
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    assert notify_relays(dead, outbox) is False, "a hint that cannot be sent never raises"


def test_hints_of_frequent_commits_are_coalesced(
    redis_url: str, redis_prefix: str, outbox: str, listener: Listener, engine: sa.Engine
) -> None:
    # One hint at once, then at most one per min_interval, whatever the commit rate.
    publisher = WakeupPublisher(redis_url, prefix=redis_prefix, min_interval=1.0)
    with engine.connect() as conn:
        outbox = read_identity(conn, outbox).key  # what the writer records
    try:
        start = time.monotonic()
        publisher.hint([outbox])
        assert listener.count(0.25) == 1, "the first hint after a quiet spell waits for nothing"
        for _ in range(10):  # ten more commits, 10 ms apart: within the pause
            time.sleep(0.01)
            publisher.hint([outbox])
        assert publisher.flush(timeout=5)
        assert time.monotonic() - start >= 0.9, "the second round did not wait for the pause"
        assert listener.count(0.5) == 1, "the ten commits of the pause share one hint"
        assert publisher.sent == 2
    finally:
        publisher.close()
    with pytest.raises(ValueError, match="min_interval"):
        WakeupPublisher(redis_url, min_interval=-1)
    with pytest.raises(ValueError, match="min_interval"):
        WakeupPublisher(redis_url, min_interval=float("nan"))


def _subscribed_waker(url: str, channel: str, draining: Any = None) -> RedisWaker:
    waker = RedisWaker(url, channel, draining)
    assert waker.subscribed.wait(5)
    waker.wait(0.5)  # consume the wake-up given on (re)subscription
    return waker


def test_waker_returns_early_on_a_hint(redis_url: str, redis_prefix: str, outbox: str) -> None:
    channel = wakeup_channel(outbox, redis_prefix)
    waker = _subscribed_waker(redis_url, channel)
    client = redis.Redis.from_url(redis_url)
    try:
        t0 = time.monotonic()
        waker.wait(0.3)
        assert time.monotonic() - t0 >= 0.29, "no hint: waits the whole poll interval"

        threading.Timer(0.2, lambda: client.publish(channel, b"1")).start()
        t0 = time.monotonic()
        waker.wait(10)
        assert 0.15 < time.monotonic() - t0 < 1.0

        for _ in range(100):  # a burst coalesces into one early return
            client.publish(channel, b"1")
        deadline = time.monotonic() + 10  # a busy machine reads the burst slowly
        while waker.hints < 101 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waker.hints >= 101, "every hint of the burst arrived"
        t0 = time.monotonic()
        waker.wait(10)
        assert time.monotonic() - t0 < 0.1
        t0 = time.monotonic()
        waker.wait(0.3)
        assert time.monotonic() - t0 >= 0.29
    finally:
        waker.close()
        client.close()


def test_waker_returns_at_once_when_draining(redis_url: str, redis_prefix: str) -> None:
    channel = wakeup_channel("outbox_events", redis_prefix)
    draining = threading.Event()
    watched = _subscribed_waker(redis_url, channel, draining)
    called = _subscribed_waker(redis_url, channel)
    try:
        threading.Timer(0.2, draining.set).start()
        threading.Timer(0.2, called.wake).start()
        for waker in (watched, called):
            t0 = time.monotonic()
            waker.wait(10)
            assert time.monotonic() - t0 < 1.0
            t0 = time.monotonic()
            waker.wait(10)
            waker.wait(10)
            assert time.monotonic() - t0 < 0.1, "every wait after the drain returns at once"
    finally:
        watched.close()
        called.close()


def test_commit_wakes_a_waiting_relay(
    engine: sa.Engine, outbox: str, redis_url: str, redis_prefix: str
) -> None:
    hook = enable_wakeups(engine, redis_url, prefix=redis_prefix)
    waker = _subscribed_waker(redis_url, _channel(engine, outbox, redis_prefix))
    try:
        latencies = []
        committed: list[float] = []

        def write() -> None:
            with engine.begin() as conn:
                _enqueue(conn, outbox)
            committed.append(time.monotonic())

        for i in range(5):
            timer = threading.Timer(0.1, write)
            timer.start()
            waker.wait(5)
            woke = time.monotonic()
            timer.join()
            # (The writer thread may record its commit a moment after the hint landed.)
            latencies.append(woke - committed[i])
        assert max(latencies) < 0.5, latencies
    finally:
        waker.close()
        hook.disable()


@pytest.mark.fault
def test_waker_resubscribes_after_redis_restarts(outbox: str) -> None:
    from support.services import RedisInstance, free_port

    with RedisInstance("wakeup-fault", free_port()) as instance:
        channel = wakeup_channel(outbox)
        waker = _subscribed_waker(instance.url, channel)
        try:
            instance.kill()
            t0 = time.monotonic()
            waker.wait(1.0)  # polling goes on while Redis is away
            assert time.monotonic() - t0 >= 0.9
            instance.start()
            assert waker.subscribed.wait(15), "did not resubscribe on its own"
            waker.wait(0.5)
            client = redis.Redis.from_url(instance.url)
            hints = waker.hints
            timer = threading.Timer(0.2, lambda: client.publish(channel, b"1"))
            timer.start()
            t0 = time.monotonic()
            waker.wait(10)
            assert time.monotonic() - t0 < 5.0, "the hint did not end the wait"
            timer.join()
            assert waker.hints > hints
            client.close()
        finally:
            waker.close()
