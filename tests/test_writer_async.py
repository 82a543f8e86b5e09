"""The async writer against a real database: what an asyncio service sees.

MariaDB through asyncmy and, for tests marked ``on_both_databases``, PostgreSQL
through psycopg's own asyncio connection (the same ``postgresql+psycopg`` URL).

pytest has no asyncio plugin here: each test drives its coroutines on one
``asyncio.Runner`` (the ``run`` fixture), which also disposes of the engine on
the loop its connections belong to.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
import zlib
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from support.databases import on_both_databases
from test_writer import (
    BAD_INPUTS,
    SCHEMA_SHARDS,
    assert_rows_sharded_by_their_own_table,
    headers,
    make_schemas,
    payloads,
    rows,
    set_search_path_on_connect,
    topics,
)

import outboxkit
from outboxkit import Event, enqueue, enqueue_async, enqueue_many, enqueue_many_async
from outboxkit.schema import apply_schema, decode_headers
from outboxkit.schema.codec import shard_for

pytestmark = pytest.mark.integration

T = TypeVar("T")
Run = Callable[[Coroutine[Any, Any, T]], T]


#: Sync driver -> asyncio driver: asyncmy (``outboxkit[async]``) for MySQL/MariaDB;
#: psycopg 3 (``outboxkit[postgres]``) is both, under one name.
ASYNC_DRIVERS = {"mysql+pymysql": "mysql+asyncmy", "postgresql+psycopg": "postgresql+psycopg"}


def async_url(db_url: str) -> str:
    """The test database's URL with its asyncio driver."""
    url = sa.make_url(db_url)
    return url.set(drivername=ASYNC_DRIVERS[url.drivername]).render_as_string(hide_password=False)


@pytest.fixture
def run() -> Iterator[Run[Any]]:
    with asyncio.Runner() as runner:
        yield runner.run


@pytest.fixture
def aengine(db_url: str, outbox: str, run: Run[Any]) -> Iterator[AsyncEngine]:
    eng = create_async_engine(async_url(db_url), pool_size=25, max_overflow=5)
    yield eng
    run(eng.dispose())


@on_both_databases
def test_async_connection_commit_keeps_the_row(
    engine: sa.Engine, aengine: AsyncEngine, run: Run[Any]
) -> None:
    async def write() -> str:
        async with aengine.connect() as conn:
            event_id = await enqueue_async(
                conn, topic="orders", payload={"order": 1}, key="order-1", headers={"h": "v"}
            )
            # another connection sees nothing before the caller commits
            assert rows(engine) == []
            assert conn.in_transaction()
            await conn.commit()
        return event_id

    event_id = run(write())
    [row] = rows(engine)
    assert row.event_id == event_id and uuid.UUID(event_id).version == 7
    assert (row.status, row.attempts, row.topic) == ("pending", 0, "orders")
    assert row.message_key == b"order-1" and row.payload == b'{"order":1}'
    assert decode_headers(row.headers) == {"h": "v"}
    assert row.shard == zlib.crc32(b"order-1") % 8
    assert row.next_attempt_at is not None and row.created_at is not None


@on_both_databases
def test_async_connection_rollback_leaves_no_row(
    engine: sa.Engine, aengine: AsyncEngine, run: Run[Any]
) -> None:
    async def write() -> None:
        async with aengine.connect() as conn:
            await enqueue_many_async(conn, [Event(topic="t", payload=i) for i in range(3)])
            await conn.rollback()
        with pytest.raises(RuntimeError):
            async with aengine.begin() as conn:
                await enqueue_async(conn, topic="t", payload="x")
                raise RuntimeError("business logic failed")

    run(write())
    assert rows(engine) == []


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    total: Mapped[int]


@on_both_databases
def test_async_session_joins_the_business_transaction(
    engine: sa.Engine, aengine: AsyncEngine, run: Run[Any]
) -> None:
    Base.metadata.create_all(engine)

    async def write() -> None:
        async with AsyncSession(aengine) as session:
            session.add(Order(id=1, total=100))
            await enqueue_async(session, topic="orders", payload={"id": 1}, key="1")
            # the caller's pending work is neither flushed nor committed
            assert len(session.new) == 1
            assert rows(engine) == []
            await session.rollback()
        async with AsyncSession(aengine) as session, session.begin():
            session.add(Order(id=2, total=200))
            await enqueue_many_async(session, [{"topic": "orders", "payload": {"id": 2}}])
            assert len(session.new) == 1
        async with AsyncSession(aengine, autoflush=False) as session:
            await enqueue_async(session, topic="orders", payload={"id": 3})
            assert len(rows(engine)) == 1, "visible before the commit"
            await session.commit()

    run(write())
    assert [r.payload for r in rows(engine)] == [b'{"id":2}', b'{"id":3}']
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id FROM orders")).scalars().all() == [2]


@on_both_databases
def test_bad_input_raises_the_sync_error_before_anything_is_written(
    engine: sa.Engine, aengine: AsyncEngine, run: Run[Any]
) -> None:
    async def attempt(conn: Any, override: dict[str, Any], error: type[Exception]) -> None:
        kwargs: dict[str, Any] = {"topic": "orders", "payload": {"ok": True}, **override}
        with pytest.raises(error) as info:
            await enqueue_async(conn, **kwargs)
        assert isinstance(info.value, outboxkit.EnqueueError), override
        # validated before the caller's connection was even used
        assert not conn.in_transaction(), override
        with pytest.raises(error):
            event = Event(**{"topic": "ok", "payload": 1, **override})
            await enqueue_many_async(conn, [Event(topic="ok", payload=0), event])

    async def write() -> None:
        async with aengine.connect() as conn:
            for override, error, _ in BAD_INPUTS:
                await attempt(conn, override, error)
            await conn.commit()
        async with AsyncSession(aengine) as session:
            for override, error, _ in BAD_INPUTS:
                await attempt(session, override, error)
            await session.commit()

    run(write())
    assert rows(engine) == []


@on_both_databases
def test_duplicate_ids_in_one_batch_raise_before_writing(
    engine: sa.Engine, aengine: AsyncEngine, run: Run[Any]
) -> None:
    events = [Event(topic="t", payload=i, event_id=f"ev-{i}") for i in range(1000)]
    events.append(Event(topic="t", payload="again", event_id="ev-0"))

    async def write() -> BaseException:
        async with aengine.connect() as conn:
            try:
                await enqueue_many_async(conn, events)
            except Exception as exc:  # what a careless caller does: swallow and commit
                caught = exc
            await conn.commit()
        return caught

    caught = run(write())
    assert rows(engine) == []
    assert isinstance(caught, outboxkit.DuplicateEventIdError), repr(caught)
    assert "ev-0" in str(caught) and "0 and 1000" in str(caught)


@on_both_databases
def test_wrong_kind_of_target_names_the_right_function(
    engine: sa.Engine, aengine: AsyncEngine, run: Run[Any]
) -> None:
    async def write() -> None:
        async with aengine.connect() as conn:
            with pytest.raises(TypeError, match="enqueue_async"):
                enqueue(conn, topic="t", payload=1)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="enqueue_many_async"):
                enqueue_many(conn, [Event(topic="t", payload=1)])  # type: ignore[arg-type]
            assert not conn.in_transaction()

    run(write())
    with engine.connect() as conn:
        with pytest.raises(TypeError, match=r"\benqueue\b"):
            run(enqueue_async(conn, topic="t", payload=1))  # type: ignore[arg-type]
        conn.commit()
    assert rows(engine) == []


@on_both_databases
def test_concurrent_writers_all_land_with_distinct_ids_and_sync_shards(
    engine: sa.Engine, aengine: AsyncEngine, run: Run[Any]
) -> None:
    tasks, per_task = 20, 5
    keys = [None if i % 3 == 0 else f"key-{i % 7}" for i in range(per_task)]

    async def writer(n: int, barrier: asyncio.Barrier) -> list[str]:
        events = [Event(topic="t", payload={"task": n, "i": i}, key=k) for i, k in enumerate(keys)]
        if n % 2:
            async with AsyncSession(aengine) as session, session.begin():
                ids = await enqueue_many_async(session, events)
                await barrier.wait()  # every transaction is open at the same time
        else:
            async with aengine.begin() as conn:
                ids = await enqueue_many_async(conn, events)
                await barrier.wait()
        return ids

    async def write() -> list[list[str]]:
        barrier = asyncio.Barrier(tasks)
        return await asyncio.gather(*(writer(n, barrier) for n in range(tasks)))

    ids = [i for batch in run(write()) for i in batch]
    assert len(set(ids)) == tasks * per_task
    got = rows(engine)
    assert sorted(r.event_id for r in got) == sorted(ids)
    for r in got:
        assert r.shard == shard_for(r.message_key, r.event_id, 8)
    per_writer: dict[int, list[int]] = {}
    for r in got:  # within one transaction, id order is the order given
        per_writer.setdefault(json.loads(r.payload)["task"], []).append(json.loads(r.payload)["i"])
    assert all(v == list(range(per_task)) for v in per_writer.values())


@on_both_databases
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(topic=topics, hdrs=headers, payload=payloads, key=st.one_of(st.none(), st.binary()))
def test_async_and_sync_writers_agree(
    engine: sa.Engine,
    aengine: AsyncEngine,
    run: Run[Any],
    topic: str,
    hdrs: Any,
    payload: Any,
    key: bytes | None,
) -> None:
    """Same input, same outcome: the same row, or the same EnqueueError subclass."""
    kwargs: dict[str, Any] = {"topic": topic, "payload": payload, "key": key, "headers": hdrs}

    def outcome(write: Callable[[], str]) -> Any:
        try:
            event_id = write()
        except outboxkit.EnqueueError as exc:
            return type(exc)
        t = sa.table("outbox_events", sa.column("event_id"))
        with engine.begin() as conn:
            [row] = rows(engine)
            conn.execute(sa.delete(t))
        assert row.event_id == event_id
        return (
            row.topic,
            row.payload,
            row.message_key,
            row.headers,
            row.shard == (shard_for(row.message_key, event_id, 8)),
        )

    def sync_write() -> str:
        with engine.begin() as conn:
            return enqueue(conn, **kwargs)

    async def async_write() -> str:
        async with aengine.begin() as conn:
            return await enqueue_async(conn, **kwargs)

    assert outcome(lambda: run(async_write())) == outcome(sync_write)


@pytest.mark.unit
def test_package_imports_without_the_async_extra() -> None:
    probe = (
        "import sys\n"
        "for name in ('greenlet', 'aiomysql', 'asyncmy'):\n"
        "    sys.modules[name] = None  # as if not installed\n"
        "import outboxkit\n"
        "assert callable(outboxkit.enqueue_async) and callable(outboxkit.enable_wakeups)\n"
        "assert 'greenlet' not in sys.modules or sys.modules['greenlet'] is None\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.unit
def test_the_async_extra_brings_what_the_async_writer_needs() -> None:
    import importlib.metadata as md

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in md.requires("outboxkit") or ()]
    in_extra = {
        r.name.lower(): r
        for r in reqs
        if r.marker is not None and r.marker.evaluate({"extra": "async"})
    }
    assert "asyncio" in in_extra["sqlalchemy"].extras  # greenlet: SQLAlchemy 2.1 needs it asked
    assert "asyncmy" in in_extra
    dev = [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "dev"})]
    assert any(r.name == "outboxkit" and "async" in r.extras for r in dev)
    import asyncmy  # noqa: F401  (installed: the suite tests the async writer for real)
    import greenlet  # noqa: F401


def test_two_schemas_behind_one_url_each_shard_by_their_own_count(
    pg_url: str, run: Run[Any]
) -> None:
    """The async writer: as ``test_writer``'s test of the same name, through
    psycopg's asyncio connection."""
    make_schemas(pg_url)
    sync_engines = {s: sa.create_engine(pg_url) for s in SCHEMA_SHARDS}
    engines = {
        "svc_a": create_async_engine(
            async_url(pg_url), connect_args={"options": "-csearch_path=svc_a"}
        ),
        "svc_b": create_async_engine(async_url(pg_url)),
    }
    set_search_path_on_connect(engines["svc_b"].sync_engine, "svc_b")
    for schema, engine in sync_engines.items():
        set_search_path_on_connect(engine, schema)

    async def write() -> None:
        for engine in engines.values():
            async with engine.begin() as conn:
                events = [Event(topic="t", payload="1", key=f"k{n}") for n in range(49)]
                await enqueue_many_async(conn, events)
            async with AsyncSession(engine) as session, session.begin():
                await enqueue_async(session, topic="t", payload="1", key="one")
        for engine in engines.values():
            await engine.dispose()

    try:
        for schema, engine in sync_engines.items():
            apply_schema(engine, shards=SCHEMA_SHARDS[schema])
        run(write())
        assert_rows_sharded_by_their_own_table(sync_engines)
    finally:
        for engine in sync_engines.values():
            engine.dispose()
