"""SIGKILL mid-run: nothing lost, nothing committed ahead of its effect, nothing applied twice."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from consumer_apps import effects
from kafkahelp import FAST_GROUP, committed, make_events, offsets_all_below, produce, wait_for
from procs import ConsumerProcess
from support.databases import on_both_databases

from outboxkit.schema import apply_schema

pytestmark = pytest.mark.integration

#: Enough that the kill lands with work in flight on every partition and a
#: backlog left for the second process; the inbox applies a few thousand a second.
MESSAGES = 8_000
PARTITIONS = 4
#: The same consumer with a sync handler (``message.tx``), an async one
#: (``message.async_tx`` on the event loop thread), and the sync one with up to 50
#: messages per inbox transaction (``--inbox-batch``): (app, inbox batch).
APPS = [
    ("consumer_apps:RecordEffects", 1),
    ("consumer_apps:RecordEffectsAsync", 1),
    ("consumer_apps:RecordEffects", 50),
]


def _effects(engine: sa.Engine) -> tuple[int, int, dict[int, set[int]]]:
    """(rows, distinct event ids, {partition: offsets with an effect})."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(sa.func.count()).select_from(effects)).scalar_one()
        distinct = conn.execute(
            sa.select(sa.func.count(sa.distinct(effects.c.event_id)))
        ).scalar_one()
        done: dict[int, set[int]] = {}
        for p, o in conn.execute(sa.select(effects.c.kafka_partition, effects.c.kafka_offset)):
            done.setdefault(p, set()).add(o)
    return rows, distinct, done


def _count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(effects)).scalar_one())


@on_both_databases
@pytest.mark.parametrize(("app", "batch"), APPS, ids=["sync", "async", "sync-batch-50"])
def test_sigkill_at_a_random_point_loses_nothing_and_the_inbox_applies_each_event_once(
    app: str,
    batch: int,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    engine: sa.Engine,
    db_url: str,
    tmp_path: Path,
) -> None:
    apply_schema(engine, shards=8)
    effects.metadata.create_all(engine)
    topic = kafka_topics(PARTITIONS)
    group = f"g-{topic}"
    events = make_events(MESSAGES, keys=200)
    produce(kafka_bootstrap, topic, events)
    env = {
        "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "OUTBOXKIT_KAFKA_CONFIG": ",".join(f"{k}={v}" for k, v in FAST_GROUP.items()),
        "OUTBOXKIT_HEALTH_PORT": "0",
        "OUTBOXKIT_TOPICS": topic,
        "OUTBOXKIT_GROUP_ID": group,
        "OUTBOXKIT_DB_URL": db_url,
        "OUTBOXKIT_INBOX": "true",
        "OUTBOXKIT_INBOX_BATCH": str(batch),
        "OUTBOXKIT_CONCURRENCY": "4",
        "OUTBOXKIT_COMMIT_INTERVAL": "0.5",
        "OUTBOXKIT_LOG_LEVEL": "WARNING",
    }
    kill_at = random.randint(1_000, 5_000)

    first = ConsumerProcess(app, env=env, cwd=tmp_path)
    try:
        wait_for(lambda: _count(engine) >= kill_at, 120, 0.01, f"{kill_at} effects")
        first.proc.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        first.kill()
    # A COMMIT (DB or Kafka) already on the wire when the process died may still land.
    time.sleep(1.0)
    offsets = committed(kafka_bootstrap, group, topic, PARTITIONS)
    rows, distinct, done = _effects(engine)
    assert rows == distinct, "an effect was applied twice before the kill"
    assert offsets_all_below(offsets, done) == [], (kill_at, offsets)
    committed_total = sum(max(o, 0) for o in offsets.values())
    assert committed_total <= rows

    second = ConsumerProcess(app, env={**env, "OUTBOXKIT_LOG_LEVEL": "INFO"}, cwd=tmp_path)
    try:
        wait_for(lambda: _count(engine) >= MESSAGES, 180, 0.1, "all effects")
        wait_for(
            lambda: sum(committed(kafka_bootstrap, group, topic, PARTITIONS).values()) == MESSAGES,
            30,
            0.2,
            "every offset committed",
        )
        second.signal(signal.SIGTERM)
        assert second.wait(30) == 0
    finally:
        second.kill()

    rows_after, distinct_after, _ = _effects(engine)
    assert distinct_after == MESSAGES  # every message's effect is present
    assert rows_after == MESSAGES  # and none was applied twice
    with engine.connect() as conn:
        inbox_rows = conn.execute(sa.text("SELECT COUNT(*) FROM outbox_inbox")).scalar_one()
    assert inbox_rows == MESSAGES
    # Everything the first process handled past its committed offsets came back and was
    # recognised by the inbox, not re-applied.
    totals: dict[str, Any] = second.exit_record()["totals"]
    assert totals.get("duplicate", 0) == rows - committed_total, (rows, committed_total)
    assert totals.get("success", 0) == MESSAGES - rows
    print(
        f"killed at {rows} effects, {committed_total} committed; "
        f"{totals.get('duplicate', 0)} redelivered duplicates skipped by the inbox"
    )
