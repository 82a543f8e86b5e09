"""A status outside the enum: MariaDB stores ``''`` for any unknown ENUM value
from a session without strict mode. Such a row is counted and reported, holds
its key's later rows back, and ``admin requeue`` repairs it (PostgreSQL's
native enum refuses the value: MariaDB only)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from foreign import insert_foreign
from relay_support import EmbeddedRelay, consume, fast_settings, status_counts, wait_for
from test_foreign_rows import run_cli

from outboxkit.runtime.testing import capture_json_logs
from outboxkit.schema import outbox_table

pytestmark = pytest.mark.integration


def store_status(engine: sa.Engine, table: str, row_id: int, status: str) -> None:
    """``UPDATE ... SET status = <status>`` from a session without strict mode: an
    unknown value is stored as ``''`` with a warning, not refused."""
    t = outbox_table(table)
    with engine.begin() as conn:
        conn.exec_driver_sql("SET SESSION sql_mode = ''")
        conn.execute(t.update().where(t.c.id == row_id).values(status=sa.literal(status)))


def delivered(engine: sa.Engine, table: str) -> int:
    return status_counts(engine, table).get("delivered", 0)


def status_of(engine: sa.Engine, table: str, row_id: int) -> str:
    t = outbox_table(table)
    with engine.connect() as conn:
        return str(conn.execute(sa.select(t.c.status).where(t.c.id == row_id)).scalar_one())


def test_a_row_with_a_status_outside_the_enum_is_counted_holds_its_key_and_can_be_requeued(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Before: the row was never relayed, not counted by ``admin status``, could not
    be requeued, and the next row of its key was delivered ahead of it."""
    topic = kafka_topics(partitions=1)
    insert_foreign(engine, outbox, topic=topic, key=b"k", payload=b"1")
    odd = insert_foreign(engine, outbox, topic=topic, key=b"k", payload=b"2", event_id="odd-1")
    after = insert_foreign(engine, outbox, topic=topic, key=b"k", payload=b"3")
    insert_foreign(engine, outbox, topic=topic, key=b"other", payload=b"o")
    store_status(engine, outbox, odd, "sent")
    assert status_counts(engine, outbox) == {"": 1, "pending": 3}

    with capture_json_logs(level="INFO") as logs:
        relay = embedded(fast_settings(db_url, kafka_bootstrap))
        wait_for(lambda: delivered(engine, outbox) >= 2, timeout=30, what="two rows delivered")
        # A later row of another key, delivered: the relay claimed after the held row
        # was due, and left it.
        probe = insert_foreign(engine, outbox, topic=topic, key=b"other", payload=b"o2")
        wait_for(lambda: status_of(engine, outbox, probe) == "delivered", timeout=30, what="o2")
        assert status_of(engine, outbox, after) == "pending", "the row after it waits"
        wait_for(
            lambda: relay.metric("outbox_backlog_rows", {"status": "invalid"}) == 1,
            timeout=30,
            what="the backlog gauge counts it",
        )
        warned = wait_for(lambda: logs.events("status-invalid"), timeout=30, what="a warning")
        assert warned[0]["rows"] == 1 and warned[0]["level"] == "WARNING"

        status = run_cli(["admin", "status", "--json", "--db-url", db_url])
        assert status.code == 0, status.err
        assert json.loads(status.out)["invalid_status"] == 1
        text = run_cli(["admin", "status", "--db-url", db_url])
        assert "status outside the enum: 1" in text.out, text.out

        requeued = run_cli(["admin", "requeue", "--json", "--id", str(odd), "--db-url", db_url])
        assert requeued.code == 0, requeued.err
        assert json.loads(requeued.out)["count"] == 1
        wait_for(
            lambda: status_counts(engine, outbox) == {"delivered": 5},
            timeout=30,
            what=f"the repaired row and the row it held; {status_counts(engine, outbox)}",
        )
        assert relay.stop() == 0
    by_key: dict[bytes | None, list[bytes]] = {}
    for m in consume(kafka_bootstrap, topic, expected=5):
        by_key.setdefault(m.key, []).append(m.value)
    assert by_key == {b"k": [b"1", b"2", b"3"], b"other": [b"o", b"o2"]}
