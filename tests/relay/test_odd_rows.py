"""Rows whose columns sit at their type's edges (another writer's, a non-strict
MariaDB session's): zero dates, infinities. None stops the relay, its admin
commands or its backlog sampler; each is delivered in its key's order under
the rules in docs/operations.md (*What a foreign row turns into*)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from foreign import insert_foreign
from relay_support import EmbeddedRelay, consume, fast_settings, status_counts, wait_for
from support.databases import on_both_databases
from test_foreign_rows import run_cli

from outboxkit import enqueue
from outboxkit.relay.metrics import sample_backlog
from outboxkit.runtime.testing import capture_json_logs
from outboxkit.schema import outbox_table

pytestmark = [pytest.mark.integration, on_both_databases]

#: (column, stored value) per database: what another writer can store there.
EDGE_TIMES: dict[str, list[tuple[str, str]]] = {
    "mariadb": [
        ("created_at", "0000-00-00 00:00:00"),
        ("created_at", "2024-00-00 00:00:00"),
        ("next_attempt_at", "0000-00-00 00:00:00"),
        ("next_attempt_at", "9999-12-31 23:59:59"),
        ("lease_expires_at", "0000-00-00 00:00:00"),
        ("lease_expires_at", "9999-12-31 23:59:59"),
    ],
    "postgresql": [
        ("created_at", "infinity"),
        ("created_at", "-infinity"),
        ("next_attempt_at", "-infinity"),
        ("next_attempt_at", "infinity"),
        ("lease_expires_at", "-infinity"),
        ("lease_expires_at", "infinity"),
    ],
}


def store_raw(engine: sa.Engine, table: str, row_id: int, **values: str) -> None:
    """Set columns to values as the database takes them from SQL text, from a
    MariaDB session without strict mode (zero dates allowed), as another writer would."""
    t = outbox_table(table)
    with engine.begin() as conn:
        if conn.dialect.name != "postgresql":
            conn.exec_driver_sql("SET SESSION sql_mode = ''")
        sets = ", ".join(f"{name} = '{value}'" for name, value in values.items())
        conn.exec_driver_sql(f"UPDATE {t.name} SET {sets} WHERE id = {int(row_id)}")


def edge_row(
    engine: sa.Engine, table: str, topic: str, key: bytes, column: str, value: str, event_id: str
) -> int:
    """A row with ``column`` at ``value``; a ``lease_expires_at`` one is ``delivering``
    (leased by a relay long gone)."""
    extra: dict[str, Any] = {}
    if column == "lease_expires_at":
        extra = {"status": "delivering", "lease_owner": "gone", "lease_token": "t" * 32}
    row_id = insert_foreign(
        engine, table, topic=topic, key=key, payload=b"edge", event_id=event_id, **extra
    )
    store_raw(engine, table, row_id, **{column: value})
    return row_id


def test_rows_with_times_at_the_edges_are_delivered_in_key_order(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Each edge row sits between two good rows of its key. Before, one such row
    failed every claim (``TypeError`` on MariaDB's zero date, ``cannot subtract
    infinite timestamps`` on PostgreSQL) and no row was delivered; a lease or a
    retry time "until infinity" kept its row, and its key, waiting for good."""
    topic = kafka_topics(partitions=1)
    cases = EDGE_TIMES["postgresql" if engine.dialect.name == "postgresql" else "mariadb"]
    for i, (column, value) in enumerate(cases):
        key = f"k{i}".encode()
        insert_foreign(engine, outbox, topic=topic, key=key, payload=b"before")
        edge_row(engine, outbox, topic, key, column, value, f"edge-{i}")
        insert_foreign(engine, outbox, topic=topic, key=key, payload=b"after")
    with engine.connect() as conn:
        counts, age = sample_backlog(conn, outbox)  # the sampler survives them too
    assert counts and age >= 0
    status = run_cli(["admin", "status", "--json", "--db-url", db_url])
    assert status.code == 0, status.err
    assert json.loads(status.out)["counts"]["pending"] >= 2 * len(cases)
    for i, (column, value) in enumerate(cases):
        shown = run_cli(["admin", "show", "--json", f"edge-{i}", "--db-url", db_url])
        assert shown.code == 0, shown.err
        assert json.loads(shown.out)[column].startswith(value[:4]), shown.out

    with capture_json_logs(level="INFO") as logs:
        relay = embedded(fast_settings(db_url, kafka_bootstrap))
        n = len(cases)
        wait_for(
            lambda: status_counts(engine, outbox) == {"delivered": 3 * n},
            timeout=30,
            what=f"every row delivered; rows per status {status_counts(engine, outbox)}",
        )
        assert relay.relay.supervisor.crashes == 0, "no edge row crashes the relay"
        assert relay.stop() == 0
    assert not logs.events("backlog-sample-failed")
    assert logs.events("relay-exit")[0]["result"] == "clean"
    by_key: dict[bytes | None, list[bytes]] = {}
    for m in consume(kafka_bootstrap, topic, expected=3 * n):
        by_key.setdefault(m.key, []).append(m.value)
    assert by_key == {f"k{i}".encode(): [b"before", b"edge", b"after"] for i in range(n)}
    status = run_cli(["admin", "status", "--json", "--db-url", db_url])
    assert status.code == 0, status.err


MAX_ID = 2**63 - 1


def test_ids_up_to_the_bigint_limit_are_delivered_by_the_pipelined_relay(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Rows another writer stored at the last ids a BIGINT holds. Before, the
    pipelined relay's bound for a claim beside its leased batch (last id + about
    a batch) went past 2^63-1: ``bigint out of range`` on PostgreSQL, every claim."""
    topic = kafka_topics(partitions=1)
    n = 7
    for i in range(n):
        insert_foreign(
            engine,
            outbox,
            topic=topic,
            key=f"k{i % 3}".encode(),
            payload=b"%d" % i,
            id=MAX_ID - n + 1 + i,
        )
    relay = embedded(fast_settings(db_url, kafka_bootstrap, pipeline=True, batch_size=2))
    wait_for(
        lambda: status_counts(engine, outbox) == {"delivered": n},
        timeout=30,
        what=f"every row delivered; rows per status {status_counts(engine, outbox)}",
    )
    assert relay.relay.supervisor.crashes == 0
    assert relay.stop() == 0
    by_key: dict[bytes | None, list[bytes]] = {}
    for m in consume(kafka_bootstrap, topic, expected=n):
        by_key.setdefault(m.key, []).append(m.value)
    assert by_key == {f"k{k}".encode(): [b"%d" % i for i in range(k, n, 3)] for k in range(3)}


def test_a_row_at_the_bigint_limit_and_the_operators_way_back(
    engine: sa.Engine, db_url: str, outbox: str
) -> None:
    """docs/operations.md, *Ids at the BIGINT limit*: on MariaDB a foreign row at
    2^63-1 moves ``AUTO_INCREMENT`` past what the column holds, so every later
    ``enqueue`` fails; ``admin discard`` of the row and ``ALTER TABLE ...
    AUTO_INCREMENT = 1`` bring it back. PostgreSQL's sequence does not move."""

    def enqueue_one() -> None:
        with engine.begin() as conn:
            enqueue(conn, topic="orders", payload=b"x", table=outbox)

    insert_foreign(
        engine, outbox, topic="orders", status="failed", last_error="stored so", id=MAX_ID
    )
    if engine.dialect.name == "postgresql":
        enqueue_one()
        return
    with pytest.raises(sa.exc.DBAPIError, match="Out of range value for column 'id'"):
        enqueue_one()
    discarded = run_cli(
        ["admin", "discard", "--id", str(MAX_ID), "--reason", "id at the limit", "--db-url", db_url]
    )
    assert discarded.code == 0, discarded.err
    with engine.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {outbox} AUTO_INCREMENT = 1")
    enqueue_one()
    t = outbox_table(outbox)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.max(t.c.id))).scalar_one() < 1000
