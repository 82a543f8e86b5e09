"""What a relay logs at start, at work and at stop: results, not one line per shard.

* Shard ownership: a relay that starts alone takes all 64 shards and logs one
  ``shard-acquired`` line (``count`` 64, ``shards`` ``0-63``), and one
  ``shard-released`` line when it stops, with PostgreSQL advisory locks
  (``db_epoch_ms``, the server's clock) and with Redis leases on MariaDB alike.
  Before, 64 lines of each.
* ``relay-progress``: every ``--progress-interval`` the rows delivered, failed
  and retrying since the last line, and the backlog.
* ``relay-exit``: the run's totals (``run_delivered`` ...) beside the counts of
  the batches in flight at the drain (``counts_of``).
* ``secret-too-short``: not for the local stack's ``outboxkit:outboxkit``
  URL, a password equal to its user name (a default, not a secret); still for a
  short password that is one.

Real relay processes (JSON logs on stderr) on the real services.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from relay_support import (
    RelayProcess,
    add_events,
    cli_args,
    fast_settings,
    status_counts,
    wait_for,
)
from sqlalchemy.engine import make_url

from outboxkit import Event
from outboxkit.schema import apply_schema

pytestmark = pytest.mark.integration

SHARDS = 64


def _shard_lines(relay: RelayProcess) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return relay.events("shard-acquired"), relay.events("shard-released")


def _start_and_stop(relay: RelayProcess) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    relay.wait_event("relay-started", timeout=30)
    wait_for(
        lambda: sum(r["count"] for r in relay.events("shard-acquired")) >= SHARDS,
        timeout=30,
        what="every shard owned",
    )
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=30) == 0
    return _shard_lines(relay)


def _assert_one_line_each_way(relay: RelayProcess, *, clock: str, old_name: str) -> None:
    """One ``shard-acquired`` line for every shard at start and one ``shard-released``
    at the drain, each with the server's clock under ``clock`` (not ``old_name``)."""
    acquired, released = _start_and_stop(relay)
    assert [(r["count"], r["shards"]) for r in acquired] == [(SHARDS, f"0-{SHARDS - 1}")]
    assert [(r["count"], r["shards"], r["reason"]) for r in released] == [
        (SHARDS, f"0-{SHARDS - 1}", "drain")
    ]
    for line in acquired + released:
        assert isinstance(line[clock], int) and old_name not in line, line


def test_a_postgresql_relay_logs_one_shard_line_at_start_and_one_at_stop(
    pg_url: str, kafka_bootstrap: str, relay_process: Callable[..., RelayProcess]
) -> None:
    engine = sa.create_engine(pg_url)
    try:
        apply_schema(engine, shards=SHARDS)
    finally:
        engine.dispose()
    relay = relay_process(cli_args(fast_settings(pg_url, kafka_bootstrap)))
    _assert_one_line_each_way(relay, clock="db_epoch_ms", old_name="db_ms")


def test_a_mariadb_relay_with_redis_logs_one_shard_line_at_start_and_one_at_stop(
    db_url: str,
    engine: sa.Engine,
    kafka_bootstrap: str,
    redis_url: str,
    redis_prefix: str,
    relay_process: Callable[..., RelayProcess],
) -> None:
    apply_schema(engine, shards=SHARDS)
    settings = fast_settings(
        db_url, kafka_bootstrap, redis_url=redis_url, redis_prefix=redis_prefix
    )
    relay = relay_process(cli_args(settings))
    _assert_one_line_each_way(relay, clock="redis_epoch_ms", old_name="redis_ms")


def test_progress_line_counts_what_was_delivered_and_what_waits(
    db_url: str,
    engine: sa.Engine,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    topic = kafka_topics(partitions=1)
    relay = relay_process(cli_args(fast_settings(db_url, kafka_bootstrap, progress_interval=1.0)))
    relay.wait_event("relay-started", timeout=30)
    add_events(engine, outbox, [Event(topic=topic, payload={"n": i}) for i in range(7)])
    wait_for(lambda: status_counts(engine, outbox) == {"delivered": 7}, timeout=30, what="7 rows")
    # Each line covers what happened since the one before: together, the 7 rows.
    wait_for(
        lambda: sum(r["delivered"] for r in relay.events("relay-progress")) >= 7,
        timeout=30,
        what="relay-progress lines adding up to the 7 deliveries",
    )
    lines = relay.events("relay-progress")
    assert sum(r["delivered"] for r in lines) == 7, lines
    assert sum(r["failed"] for r in lines) == 0 and sum(r["retrying"] for r in lines) == 0
    assert set(lines[-1]["backlog"]) == {"pending", "retryable", "delivering", "failed"}
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=30) == 0
    # A line is written only when something happened or rows wait: never all zeros.
    for r in relay.events("relay-progress"):
        waiting = [n for status, n in r["backlog"].items() if status != "failed"]
        assert any((r["delivered"], r["failed"], r["retrying"], *waiting)), r


def test_exit_record_counts_the_run_beside_the_drain_batches(
    db_url: str,
    engine: sa.Engine,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """A relay that delivered 20 rows and then got SIGTERM said ``"delivered": 0``
    and nothing else: its counts are of the batches in flight at the drain. The
    record now says so (``counts_of``) and carries the run's totals beside them."""
    topic = kafka_topics(partitions=1)
    relay = relay_process(cli_args(fast_settings(db_url, kafka_bootstrap)))
    relay.wait_event("relay-started", timeout=30)
    add_events(engine, outbox, [Event(topic=topic, payload={"n": i}) for i in range(20)])
    wait_for(lambda: status_counts(engine, outbox) == {"delivered": 20}, timeout=60, what="20 rows")
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=30) == 0
    (record,) = relay.events("relay-exit")
    assert record["result"] == "clean", record
    assert record["counts_of"] == "drain-batches", record
    assert record["batch_size"] == record["delivered"] == 0, record
    assert record["run_delivered"] == 20, record
    assert record["run_claimed"] == 20, record
    assert record["run_failed"] == record["run_retried"] == 0, record


def _secret_warnings(db_url: str, *args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    res = subprocess.run(
        [sys.executable, "-m", "outboxkit", *args],
        env={**env, "OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_LOG_FORMAT": "json"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return [line for line in res.stderr.splitlines() if "secret-too-short" in line]


def test_no_secret_warning_for_the_local_stack_password(db_url: str, outbox: str) -> None:
    url = make_url(db_url)
    # The local stack's convention: user and password alike (deploy/local).
    assert url.username == url.password, "the local stack's URL is user:user@"
    assert _secret_warnings(db_url, "admin", "status") == []
    assert _secret_warnings(db_url, "schema", "apply") == []


def test_a_short_password_that_is_a_secret_is_still_warned_about(db_url: str) -> None:
    other = make_url(db_url).set(password="s3cr3t")  # wrong, and short: nothing connects
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    res = subprocess.run(
        [sys.executable, "-m", "outboxkit", "admin", "status"],
        env={
            **env,
            "OUTBOXKIT_DB_URL": other.render_as_string(hide_password=False),
            "OUTBOXKIT_LOG_FORMAT": "json",
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "secret-too-short" in res.stderr, res.stderr[-2000:]
    assert "s3cr3t" not in res.stderr
