"""PostgreSQL ``NOTIFY`` from the writer, seen by a real ``LISTEN`` connection.

Absence is proven without waiting and hoping: notifications reach a listener in
commit order, so after the transaction under test the test commits a marker
notification of its own and reads until the marker. Whatever the transaction
sent arrives before it; what is not there by then was never sent.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from sqlalchemy.orm import Session

from outboxkit import Event, enqueue, enqueue_async, enqueue_many
from outboxkit.notify import notify_channel
from outboxkit.schema import apply_schema, outbox_rows_query, outbox_table, shard_for
from outboxkit.schema.table import validate_identifier

pytestmark = pytest.mark.integration


TABLE = "outbox_events"
CHANNEL = notify_channel(TABLE)


class Listener:
    """A dedicated ``LISTEN`` connection, as a relay will hold one."""

    def __init__(self, url: str, channel: str) -> None:
        dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.channel = channel
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    def until_marker(self, engine: sa.Engine, timeout_s: float = 20.0) -> list[str]:
        """Commit a marker notification, then return every payload received before it."""
        marker = f"marker-{uuid.uuid4().hex}"
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_notify(:c, :p)"), {"c": self.channel, "p": marker})
        got: list[str] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for n in self.conn.notifies(timeout=max(0.0, deadline - time.monotonic())):
                assert n.channel == self.channel
                if n.payload == marker:
                    return got
                got.append(n.payload)
        pytest.fail(f"marker notification not received within {timeout_s} s; got {got}")

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(pg_url)
    apply_schema(engine, shards=8)
    yield engine
    engine.dispose()


@pytest.fixture
def listener(pg_url: str) -> Iterator[Listener]:
    listening = Listener(pg_url, CHANNEL)
    yield listening
    listening.close()


def _shards_written(engine: sa.Engine) -> set[str]:
    t = outbox_table(TABLE)
    with engine.connect() as conn:
        return {str(s) for s in conn.execute(sa.select(t.c.shard).distinct()).scalars()}


def _enqueue_connection(engine: sa.Engine, events: list[Event], commit: bool) -> None:
    with engine.connect() as conn:
        enqueue_many(conn, events)
        conn.commit() if commit else conn.rollback()


def _enqueue_session(engine: sa.Engine, events: list[Event], commit: bool) -> None:
    with Session(engine) as session:
        for ev in events:
            enqueue(session, topic=ev.topic, payload=ev.payload, key=ev.key)
        session.commit() if commit else session.rollback()


def _enqueue_async(engine: sa.Engine, events: list[Event], commit: bool) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    async def write() -> None:
        aengine = create_async_engine(engine.url)
        try:
            async with aengine.connect() as conn:
                for ev in events:
                    await enqueue_async(conn, topic=ev.topic, payload=ev.payload, key=ev.key)
                await (conn.commit() if commit else conn.rollback())
        finally:
            await aengine.dispose()

    asyncio.run(write())


WRITERS: dict[str, Callable[[sa.Engine, list[Event], bool], None]] = {
    "connection": _enqueue_connection,
    "session": _enqueue_session,
    "async": _enqueue_async,
}
EVENTS = [Event(topic="orders", payload={"n": n}, key=f"order-{n}") for n in range(6)]


@pytest.mark.parametrize("writer", WRITERS)
def test_commit_notifies_each_shard_written_and_rollback_nothing(
    pg_engine: sa.Engine, listener: Listener, writer: str
) -> None:
    WRITERS[writer](pg_engine, EVENTS, False)
    assert listener.until_marker(pg_engine) == []  # rolled back: not a word

    WRITERS[writer](pg_engine, EVENTS, True)
    got = listener.until_marker(pg_engine)
    expected = {str(shard_for(ev.key.encode(), "", 8)) for ev in EVENTS if isinstance(ev.key, str)}
    assert len(got) == len(set(got))  # one per shard, not one per row
    assert set(got) == expected == _shards_written(pg_engine)


def test_nothing_is_sent_before_the_commit(pg_engine: sa.Engine, listener: Listener) -> None:
    with pg_engine.connect() as conn:
        enqueue(conn, topic="orders", payload="x", key="k")
        # another transaction commits meanwhile: the open one's notification waits
        assert listener.until_marker(pg_engine) == []
        conn.commit()
    assert listener.until_marker(pg_engine) == [str(shard_for(b"k", "", 8))]


def test_one_event_is_one_statement_with_its_notification(
    pg_engine: sa.Engine, listener: Listener
) -> None:
    # enqueue() of one event sent its INSERT and then a SELECT pg_notify(...):
    # two round trips where one does, in every single-event transaction.
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        sent.append(statement)

    with pg_engine.begin() as conn:
        enqueue(conn, topic="orders", payload="warm-up", key="w")  # reads the shard count
    listener.until_marker(pg_engine)
    sa.event.listen(pg_engine, "before_cursor_execute", record)
    try:
        with pg_engine.begin() as conn:
            enqueue(conn, topic="orders", payload="x", key="k")
        with pg_engine.connect() as conn:
            enqueue(conn, topic="orders", payload="y", key="k")
            conn.rollback()
    finally:
        sa.event.remove(pg_engine, "before_cursor_execute", record)
    assert len(sent) == 2 and all("pg_notify" in text for text in sent), sent
    assert listener.until_marker(pg_engine) == [str(shard_for(b"k", "", 8))]  # not the rollback
    with pg_engine.connect() as conn:
        stored = conn.execute(outbox_rows_query(TABLE).order_by(outbox_table(TABLE).c.id))
        assert [bytes(r.payload) for r in stored] == [b"warm-up", b"x"]


@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    keys=st.lists(st.one_of(st.none(), st.binary(min_size=1, max_size=8)), min_size=1, max_size=40)
)
def test_a_batch_notifies_exactly_the_shards_of_its_rows(
    pg_engine: sa.Engine, listener: Listener, keys: list[bytes | None]
) -> None:
    with pg_engine.begin() as conn:
        conn.execute(sa.delete(outbox_table(TABLE)))
        ids = enqueue_many(conn, [Event(topic="t", payload=b"p", key=k) for k in keys])
    got = listener.until_marker(pg_engine)
    assert sorted(got, key=int) == sorted(
        {str(shard_for(k, i, 8)) for k, i in zip(keys, ids, strict=True)}, key=int
    )


def test_mariadb_enqueue_sends_nothing_and_needs_nothing(engine: sa.Engine, outbox: str) -> None:
    with engine.begin() as conn:
        enqueue(conn, topic="orders", payload="x", key="k")
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(outbox_table(outbox))).scalar()


@pytest.mark.unit
@given(table=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,63}", fullmatch=True))
@settings(max_examples=200, derandomize=True)
def test_every_table_name_has_a_valid_stable_channel(table: str) -> None:
    validate_identifier(table)
    channel = notify_channel(table)
    assert channel == notify_channel(table)
    assert len(channel.encode()) <= 63  # PostgreSQL's limit for a channel name
    if len(table) <= 46:
        assert channel == f"outboxkit:public.{table}"
    else:
        assert channel.startswith(f"outboxkit:{table[:35]}:") and channel != notify_channel(
            table[:-1] + ("a" if table[-1] != "a" else "b")
        )
    assert notify_channel(table, "svc_a") != channel, "another schema, another channel"


@pytest.mark.parametrize(
    "schema", ["public", "svc_a", "Mixed Case", "ünïcode", "s" * 60, "a.b:c", "_x$1"]
)
@pytest.mark.parametrize("table", ["outbox_events", "t" * 49])
def test_the_channel_the_writer_computes_in_sql_is_the_one_in_python(
    pg_url: str, schema: str, table: str
) -> None:
    """The writer names the channel in its statement (the schema its table resolves
    to); :func:`notify_channel` must give the same name for every schema name."""
    from outboxkit.notify import channel_sql

    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            quoted = conn.dialect.identifier_preparer.quote_identifier(schema)
            conn.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {quoted}"))
            conn.execute(sa.text(f"CREATE TABLE {quoted}.{table} (id int)"))
            conn.execute(sa.text(f"SET LOCAL search_path = {quoted}"))
            in_sql = conn.execute(sa.text(f"SELECT {channel_sql(table)}")).scalar()
        assert in_sql == notify_channel(table, schema)
        assert len(str(in_sql).encode()) <= 63
    finally:
        engine.dispose()


def test_a_long_table_name_notifies_on_its_shortened_channel(pg_url: str) -> None:
    table = "t" * 49
    engine = sa.create_engine(pg_url)
    listening = Listener(pg_url, notify_channel(table))
    try:
        apply_schema(engine, table=table, shards=2, inbox=None)
        with engine.begin() as conn:
            enqueue(conn, topic="orders", payload="x", key="k", table=table)
        assert listening.until_marker(engine) == [str(shard_for(b"k", "", 2))]
    finally:
        listening.close()
        engine.dispose()
