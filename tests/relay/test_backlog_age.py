"""One "oldest pending": the relay's gauge and ``outboxkit admin status`` agree.

Both count a row as pending while it waits to be delivered, ``pending`` or
``retryable`` (docs/admin.md, docs/operations.md#outboxbacklogold). A retryable
row older than every pending row is where the two used to part: the gauge saw
it, ``admin status`` did not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay, add_events, db_time, fast_settings, rows, wait_for
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.schema import outbox_table

pytestmark = [pytest.mark.integration, on_both_databases]


def _admin_status(db_url: str, table: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    res = subprocess.run(
        [sys.executable, "-m", "outboxkit", "admin", "status", "--json"],
        env={**env, "OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_TABLE": table},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert isinstance(data, dict)
    return data


def test_gauge_and_admin_status_report_the_same_oldest_pending_age(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=1)
    # One key: the retryable row (not due for an hour) holds its key's later rows
    # back (per-key order), so the pending row stays pending while the relay runs.
    retryable, pending = add_events(
        engine,
        outbox,
        [
            Event(topic=topic, key="k", payload={"n": 1}),
            Event(topic=topic, key="k", payload={"n": 2}),
        ],
    )
    t = outbox_table(outbox)
    with engine.begin() as conn:
        # Retryable and older than every pending row.
        conn.execute(
            sa.update(t)
            .where(t.c.event_id == retryable)
            .values(
                status="retryable",
                attempts=1,
                created_at=db_time(-3600),
                next_attempt_at=db_time(3600),
            )
        )
        conn.execute(sa.update(t).where(t.c.event_id == pending).values(created_at=db_time(-600)))

    relay = embedded(fast_settings(db_url, kafka_bootstrap))
    wait_for(
        lambda: relay.metric("outbox_backlog_rows", {"status": "retryable"}) == 1,
        timeout=30,
        what="a backlog sample",
    )
    gauge = relay.metric("outbox_oldest_pending_age_seconds")
    status = _admin_status(db_url, outbox)
    assert relay.stop() == 0
    # Nothing moved: the same rows were judged by both.
    assert {r.event_id: r.status for r in rows(engine, outbox)} == {
        pending: "pending",
        retryable: "retryable",
    }
    admin_age = status["oldest_pending_age_s"]
    assert isinstance(admin_age, float | int)
    # Both about 3600 s (the retryable row); the pending row alone is 600 s old.
    assert gauge >= 3600 and admin_age >= 3600, (gauge, admin_age)
    assert abs(gauge - admin_age) < 300, (gauge, admin_age)
