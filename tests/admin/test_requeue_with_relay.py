"""End to end: failed rows requeued while a real relay runs reach Kafka exactly once."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases
from support.services import free_port
from support.waiting import bound

from outboxkit.schema import outbox_table

pytestmark = [pytest.mark.integration, on_both_databases]


@pytest.fixture
def relay(db_url: str, kafka_bootstrap: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``outboxkit relay`` as a subprocess; drained with SIGTERM afterwards (exit 0)."""
    env = {
        **os.environ,
        "OUTBOXKIT_DB_URL": db_url,
        "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "OUTBOXKIT_HEALTH_PORT": str(free_port()),
        "OUTBOXKIT_NODE_ID": "e2e-relay",
        "OUTBOXKIT_POLL_INTERVAL": "0.2",
        "OUTBOXKIT_START_JITTER": "0",
    }
    env.pop("OUTBOXKIT_REDIS_URL", None)  # one relay, all shards
    log = tmp_path / "relay.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "outboxkit", "relay"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        assert code == 0, log.read_text()[-3000:]


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + bound(timeout)
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def event_ids_in(topic: str, bootstrap: str, expected: int, settle_s: float = 3.0) -> list[str]:
    """Every ``event_id`` header in ``topic``, read from the start, duplicates kept."""
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"e2e-{os.getpid()}-{time.monotonic_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    seen: list[str] = []
    deadline = time.monotonic() + 60
    quiet_until: float | None = None
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                if quiet_until is not None and time.monotonic() > quiet_until:
                    break
                continue
            assert msg.error() is None, msg.error()
            headers = dict(msg.headers() or [])
            seen.append(headers["event_id"].decode())
            if len(seen) >= expected and quiet_until is None:
                quiet_until = time.monotonic() + settle_s  # keep reading: any duplicate?
    finally:
        consumer.close()
    return seen


def test_requeued_failed_rows_are_delivered_once_by_a_running_relay(
    engine: sa.Engine,
    outbox: str,
    make_rows: Any,
    read_rows: Any,
    admin: Any,
    kafka_topics: Any,
    kafka_bootstrap: str,
    relay: subprocess.Popen[bytes],
) -> None:
    t = outbox_table(outbox)
    topic = kafka_topics(partitions=3)
    failed = make_rows(20, status="failed", topic=topic, key="k-failed")
    pending = make_rows(10, status="pending", topic=topic)

    def delivered(ids: list[int]) -> bool:
        return all(r.status == "delivered" for r in read_rows(ids).values())

    wait_for(lambda: delivered(pending), 60, "the relay to deliver the pending rows")
    assert {r.status for r in read_rows(failed).values()} == {"failed"}, "relay leaves failed rows"

    # Requeue in two steps while the relay keeps claiming.
    assert admin("requeue", "--id", ",".join(map(str, failed[:5]))).code == 0
    res = admin("requeue", "--all-failed", "--topic", topic)
    assert res.code == 0, res.err
    assert "requeued 15 rows" in res.out
    wait_for(lambda: delivered(failed), 60, "the relay to deliver the requeued rows")

    rows = read_rows(failed)
    assert all(r.attempts == 1 and r.kafka_offset is not None for r in rows.values())
    with engine.connect() as conn:
        wanted = dict(conn.execute(sa.select(t.c.event_id, t.c.id).where(t.c.topic == topic)).all())
    seen = collections.Counter(event_ids_in(topic, kafka_bootstrap, expected=len(wanted)))
    assert set(seen) == set(wanted)
    assert [e for e, n in seen.items() if n != 1] == [], "every event exactly once"
    assert relay.poll() is None, "the relay kept running"
