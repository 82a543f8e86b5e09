"""The payload table (schema version 3): ``enqueue`` writes each payload and its
headers aside, the relay reads them from wherever a row keeps them, every path
that deletes a row deletes its payload row too, and ``schema apply`` upgrades a
release-2 table in place with its rows."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from foreign import insert_foreign
from relay_support import EmbeddedRelay, consume, fast_settings, rows, wait_for
from support.databases import on_both_databases

from outboxkit import Event, enqueue, enqueue_many
from outboxkit import writer as writer_module
from outboxkit.cli import main
from outboxkit.relay.retention import purge
from outboxkit.schema import apply_schema, meta_table, outbox_table, payload_table

pytestmark = [pytest.mark.integration, on_both_databases]


def payload_rows(engine: sa.Engine, table: str) -> dict[str, tuple[bytes, str | None]]:
    """The payload table's rows: event id -> (payload, headers)."""
    p = payload_table(table)
    with engine.connect() as conn:
        return {r.event_id: (bytes(r.payload), r.headers) for r in conn.execute(sa.select(p))}


def own_columns(engine: sa.Engine, table: str) -> dict[str, tuple[Any, Any]]:
    """The outbox table's own payload and headers columns, by event id."""
    t = outbox_table(table)
    with engine.connect() as conn:
        query = sa.select(t.c.event_id, t.c.payload, t.c.headers)
        return {r.event_id: (r.payload, r.headers) for r in conn.execute(query)}


def as_release_2(engine: sa.Engine, table: str) -> None:
    """Turn the applied schema into what release 2 made: no payload table, a
    ``payload`` column that refuses NULL, schema version 2."""
    t = outbox_table(table)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {payload_table(table).name}"))
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text(f"ALTER TABLE {table} ALTER COLUMN payload SET NOT NULL"))
        else:
            conn.execute(sa.text(f"ALTER TABLE {table} MODIFY COLUMN payload LONGBLOB NOT NULL"))
        conn.execute(
            meta_table.update().where(meta_table.c.table_name == t.name).values(schema_version=2)
        )


def test_enqueue_writes_the_payload_and_headers_aside(engine: sa.Engine, outbox: str) -> None:
    with engine.begin() as conn:
        one = enqueue(conn, topic="orders", payload={"n": 1}, key="k", headers={"h": "v"})
        many = enqueue_many(
            conn, [Event(topic="orders", payload=f"p{i}", key="k") for i in range(3)]
        )
    assert own_columns(engine, outbox) == {e: (None, None) for e in (one, *many)}
    aside = payload_rows(engine, outbox)
    assert aside[one] == (b'{"n":1}', '{"h":"v"}')
    assert [aside[e] for e in many] == [(f"p{i}".encode(), None) for i in range(3)]
    # What a query of the table showed before: outbox_rows_query, as the tests' rows().
    assert [(r.payload, r.headers) for r in rows(engine, outbox)] == [
        (b'{"n":1}', '{"h":"v"}'),
        *((f"p{i}".encode(), None) for i in range(3)),
    ]


def test_release_2_tables_are_upgraded_in_place_and_both_layouts_relayed_in_key_order(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=3)
    as_release_2(engine, outbox)
    writer_module._layout_cache.clear()  # a writer of release 2's table
    old = [
        Event(topic=topic, key=f"k{i % 4}", payload={"n": i}, headers={"seq": str(i)})
        for i in range(20)
    ]
    with engine.begin() as conn:
        old_ids = enqueue_many(conn, old)
    with engine.connect() as conn:
        before = conn.execute(sa.select(outbox_table(outbox))).all()
    assert all(r.payload is not None for r in before), "release 2 keeps payloads in the row"

    report = apply_schema(engine, shards=8)

    assert report.actions == [
        f"column {outbox}.payload takes NULL",
        f"created table {outbox}_payload",
        f"schema version of {outbox} -> 3",
    ]
    with engine.connect() as conn:
        assert conn.execute(sa.select(outbox_table(outbox))).all() == before, "rows kept"
    assert apply_schema(engine, shards=8).actions == [], "idempotent"

    writer_module._layout_cache.clear()  # a writer started after the upgrade
    new = [
        Event(topic=topic, key=f"k{i % 4}", payload={"n": i}, headers={"seq": str(i)})
        for i in range(20, 40)
    ]
    with engine.begin() as conn:
        new_ids = enqueue_many(conn, new)
    assert set(payload_rows(engine, outbox)) == set(new_ids)

    relay = embedded(fast_settings(db_url, kafka_bootstrap, batch_size=7))
    wait_for(lambda: relay.metric("outbox_rows_delivered_total") >= 40, timeout=60, what="40 sent")
    assert relay.stop() == 0
    messages = consume(kafka_bootstrap, topic, expected=40)
    assert len(messages) == 40
    sent = {m.headers["event_id"].decode(): m for m in messages}
    assert set(sent) == set(old_ids) | set(new_ids)
    by_key: dict[bytes, list[int]] = defaultdict(list)
    for event_id, event in zip([*old_ids, *new_ids], [*old, *new], strict=True):
        m = sent[event_id]
        assert json.loads(m.value) == event.payload
        assert m.headers["seq"] == str(event.payload["n"]).encode()  # type: ignore[index]
        assert m.key is not None
        by_key[m.key].append(m.offset)
    assert all(offsets == sorted(offsets) for offsets in by_key.values()), "key order"
    assert {r.status for r in rows(engine, outbox)} == {"delivered"}


def test_a_row_with_no_payload_anywhere_fails_unsent_and_its_key_goes_on(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """A writer that stored the payload neither in the row nor in the payload
    table: the row fails, saying so; nothing is sent for it (never an empty or
    null message, which a compacted topic would take for a deletion)."""
    topic = kafka_topics(partitions=1)
    bare = insert_foreign(engine, outbox, topic=topic, key=b"k", payload=None)  # type: ignore[arg-type]
    with engine.begin() as conn:
        after = enqueue(conn, topic=topic, key="k", payload="after")

    # skip: the key goes on past its failed row (with hold the next row waits).
    relay = embedded(fast_settings(db_url, kafka_bootstrap, failed_rows="skip"))
    wait_for(
        lambda: relay.metric("outbox_rows_delivered_total") >= 1, timeout=30, what="the next row"
    )
    assert relay.stop() == 0
    messages = consume(kafka_bootstrap, topic, expected=1)
    assert [(m.headers["event_id"].decode(), m.value) for m in messages] == [(after, b"after")]
    stored = {r.id: r for r in rows(engine, outbox)}
    assert stored[bare].status == "failed"
    assert stored[bare].last_error == (
        f"invalid row: no payload: its payload column is NULL and {outbox}_payload has no "
        "row for its event id; store the payload there (or in the row), then requeue it"
    )


def test_each_path_that_deletes_a_row_deletes_its_payload_row(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Delete on deliver, the retention purge and ``admin discard``; a row they
    do not delete keeps its payload row."""
    topic = kafka_topics(partitions=1)
    t = outbox_table(outbox)

    def add(n: int) -> list[str]:
        with engine.begin() as conn:
            return enqueue_many(conn, [Event(topic=topic, payload=f"p{i}") for i in range(n)])

    # Delete on deliver.
    add(3)
    relay = embedded(fast_settings(db_url, kafka_bootstrap, delete_on_deliver=True))
    wait_for(lambda: relay.metric("outbox_rows_delivered_total") >= 3, timeout=30, what="3 sent")
    assert relay.stop() == 0
    assert rows(engine, outbox) == [] and payload_rows(engine, outbox) == {}

    # The purge of delivered rows: only those it deletes.
    add(3)
    relay = embedded(fast_settings(db_url, kafka_bootstrap))
    wait_for(lambda: relay.metric("outbox_rows_delivered_total") >= 3, timeout=30, what="3 sent")
    assert relay.stop() == 0
    kept = add(1)  # pending: not the purge's
    assert purge(engine, outbox, older_than_s=0.001).deleted == 3
    assert set(payload_rows(engine, outbox)) == set(kept)

    # admin discard of failed rows.
    failed = add(2)
    with engine.begin() as conn:
        conn.execute(t.update().where(t.c.event_id.in_(failed)).values(status="failed"))
    out = main(["admin", "discard", "--all-failed", "--reason", "test", "--db-url", db_url])
    assert out == 0
    assert set(payload_rows(engine, outbox)) == set(kept)
    assert [r.event_id for r in rows(engine, outbox)] == kept


def test_a_payload_row_left_by_a_manual_delete_is_replaced_by_the_next_enqueue(
    engine: sa.Engine, outbox: str
) -> None:
    """``DELETE FROM outbox_events`` by hand leaves the payload row behind; the
    event id enqueued again gets its new payload, not the old one."""
    t = outbox_table(outbox)
    with engine.begin() as conn:
        enqueue(conn, topic="orders", payload="old", event_id="ev-1", headers={"h": "1"})
    with engine.begin() as conn:
        conn.execute(t.delete().where(t.c.event_id == "ev-1"))
    assert payload_rows(engine, outbox) == {"ev-1": (b"old", '{"h":"1"}')}
    with engine.begin() as conn:
        enqueue(conn, topic="orders", payload="new", event_id="ev-1")
        enqueue_many(conn, [Event(topic="orders", payload="other", event_id="ev-2")])
    assert payload_rows(engine, outbox) == {"ev-1": (b"new", None), "ev-2": (b"other", None)}
    [one, two] = rows(engine, outbox)
    assert (one.payload, two.payload) == (b"new", b"other")


def test_the_documented_manual_delete_takes_the_payload_row_too(
    engine: sa.Engine, outbox: str
) -> None:
    """docs/schema.md: to delete a row by hand, its payload row first (the
    statement for MySQL/MariaDB or PostgreSQL), then the row."""
    with engine.begin() as conn:
        gone, kept = enqueue_many(
            conn, [Event(topic="orders", payload="a"), Event(topic="orders", payload="b")]
        )
    [row_id] = [r.id for r in rows(engine, outbox) if r.event_id == gone]
    if engine.dialect.name == "postgresql":
        first = (
            "DELETE FROM outbox_events_payload WHERE event_id IN (SELECT event_id FROM "
            f"outbox_events WHERE id = {row_id})"
        )
    else:
        first = (
            "DELETE p FROM outbox_events_payload p JOIN outbox_events o ON "
            f"o.event_id = p.event_id WHERE o.id = {row_id}"
        )
    with engine.begin() as conn:
        conn.execute(sa.text(first))
        conn.execute(sa.text(f"DELETE FROM outbox_events WHERE id = {row_id}"))
    assert list(payload_rows(engine, outbox)) == [kept]
    assert [r.event_id for r in rows(engine, outbox)] == [kept]
