"""Discard beside a running relay: the failed rows go, the alert's gauge drops to 0,
no discarded event reaches Kafka, and the relay's own work is untouched."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from admin.test_requeue_with_relay import event_ids_in, wait_for
from support.databases import on_both_databases
from support.services import free_port

from outboxkit.schema import outbox_table

pytestmark = [pytest.mark.integration, on_both_databases]


@pytest.fixture
def relay_port(db_url: str, kafka_bootstrap: str, tmp_path: Path) -> Iterator[int]:
    """``outboxkit relay`` as a subprocess; its health port. Drained with SIGTERM (exit 0)."""
    port = free_port()
    env = {
        **os.environ,
        "OUTBOXKIT_DB_URL": db_url,
        "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "OUTBOXKIT_HEALTH_PORT": str(port),
        "OUTBOXKIT_NODE_ID": "discard-relay",
        "OUTBOXKIT_POLL_INTERVAL": "0.2",
        "OUTBOXKIT_METRICS_INTERVAL": "0.3",
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
        yield port
        assert proc.poll() is None, "the relay kept running"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        assert code == 0, log.read_text()[-3000:]


def failed_gauge(port: int) -> float | None:
    """The relay's ``outbox_backlog_rows{status="failed"}``: what OutboxFailedRows alerts on."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    m = re.search(r'^outbox_backlog_rows\{[^}]*status="failed"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def held_keys_gauge(port: int) -> float | None:
    """The relay's ``outbox_keys_held_by_failed``: what OutboxKeysHeldByFailedRows
    alerts on."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    m = re.search(r"^outbox_keys_held_by_failed (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_discarded_rows_stop_the_alert_and_never_reach_kafka(
    engine: sa.Engine,
    outbox: str,
    make_rows: Any,
    read_rows: Any,
    admin: Any,
    kafka_topics: Any,
    kafka_bootstrap: str,
    relay_port: int,
) -> None:
    t = outbox_table(outbox)
    topic = kafka_topics(partitions=3)
    failed = make_rows(12, status="failed", topic=topic, key="k")
    pending = make_rows(10, status="pending", topic=topic, key="k")

    def delivered(ids: list[int]) -> bool:
        rows = read_rows(ids)
        return len(rows) == len(ids) and all(r.status == "delivered" for r in rows.values())

    wait_for(lambda: failed_gauge(relay_port) == 12, 30, "the failed gauge to show 12")
    # The failed rows hold their key (--failed-rows hold): its later rows wait.
    wait_for(lambda: held_keys_gauge(relay_port) == 1, 30, "the held key counted")
    assert {r.status for r in read_rows(pending).values()} == {"pending"}

    # Discard in two steps while new rows of the same key are enqueued.
    more = make_rows(10, status="pending", topic=topic, key="k")
    res = admin("discard", "--id", ",".join(map(str, failed[:4])), "--reason", "INC-7")
    assert res.code == 0 and "discarded 4 failed rows" in res.out, res.out + res.err
    res = admin("discard", "--topic", topic, "--reason", "INC-7")
    assert res.code == 0 and "discarded 8 failed rows" in res.out, res.out + res.err

    # Discarded, the rows are gone and hold nothing: the key's rows go on, in order.
    wait_for(lambda: delivered(pending + more), 60, "the relay to deliver the key's rows")
    wait_for(lambda: failed_gauge(relay_port) == 0, 30, "the failed gauge to drop to 0")
    assert held_keys_gauge(relay_port) == 0
    assert read_rows(failed) == {}
    with engine.connect() as conn:
        kept = set(conn.execute(sa.select(t.c.event_id).where(t.c.topic == topic)).scalars())
    seen = event_ids_in(topic, kafka_bootstrap, expected=len(kept))
    assert set(seen) == kept, "only the kept events reached Kafka; no discarded one"
    events = json.loads(admin("recovery", "--kind", "discard", "--json").out)
    assert sorted(r["id"] for e in events for r in e["detail"]["rows"]) == failed
    assert {e["detail"]["reason"] for e in events} == {"INC-7"}
