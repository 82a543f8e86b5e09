"""Helpers for relay tests: fast settings, an embedded relay, a relay subprocess,
reading rows back and consuming topics. Fixtures are in ``conftest.py``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support import waiting
from support.waiting import bound

from outboxkit import Event, enqueue_many
from outboxkit.relay import PUSH_JOB, Relay, RelaySettings
from outboxkit.relay._dbtime import db_now_plus
from outboxkit.runtime.identity import read_identity
from outboxkit.schema import outbox_rows_query, outbox_table

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing_service(reason: str) -> None:
    """Fail under CI, skip elsewhere (as the root conftest does)."""
    if IN_CI:
        pytest.fail(f"service unavailable under CI: {reason}", pytrace=False)
    pytest.skip(reason)


#: Short timeouts so fault tests finish in seconds: message.timeout.ms 2 s, batch
#: deadline 4 s, lease 6 s (> deadline + flush).
FAST: dict[str, Any] = {
    "poll_interval": 0.05,
    "lease_ttl": 6.0,
    "flush_timeout": 1.0,
    "start_jitter": 0.0,
    "retry_backoff_base": 0.2,
    "retry_backoff_cap": 2.0,
    "shutdown_timeout": 15.0,
    "health_port": 0,
    "connect_timeout": 5.0,
    "metrics_interval": 0.5,
}
#: ``OUTBOXKIT_TEST_RELAY_PIPELINE=1`` (``=0``): every relay built from these
#: helpers runs with the pipeline on (off); tests that set ``pipeline``
#: themselves keep their choice. Unset, each relay's own default (on with
#: PostgreSQL, off with MySQL/MariaDB). So the relay suite can be run against
#: either loop as a whole.
_PIPELINE = os.environ.get("OUTBOXKIT_TEST_RELAY_PIPELINE", "").lower()
if _PIPELINE in ("1", "true", "yes"):
    FAST["pipeline"] = True
elif _PIPELINE in ("0", "false", "no"):
    FAST["pipeline"] = False


def fast_settings(db_url: str, bootstrap: str, **overrides: Any) -> RelaySettings:
    kafka_config = {"message.timeout.ms": "2000", **overrides.pop("kafka_config", {})}
    values = {**FAST, **overrides}
    values.setdefault("node_id", f"relay-{uuid.uuid4().hex[:6]}")
    settings = RelaySettings(
        db_url=db_url, kafka_bootstrap=bootstrap, kafka_config=kafka_config, **values
    )
    problems = settings.validate()
    assert not problems, problems
    return settings


def cli_args(settings: RelaySettings) -> list[str]:
    """The same settings as ``outboxkit relay`` flags."""
    args: list[str] = []
    for name, value in vars(settings).items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, dict):
            for k, v in value.items():
                args += ["--kafka-config", f"{k}={v}"]
        else:
            args += [flag, str(value)]
    return args


def add_events(
    engine: sa.Engine, table: str, events: Sequence[Event], *, chunk: int = 2000
) -> list[str]:
    ids: list[str] = []
    for i in range(0, len(events), chunk):
        with engine.begin() as conn:
            ids += enqueue_many(conn, events[i : i + chunk], table=table)
    return ids


def db_time(seconds: float) -> sa.ColumnElement[Any]:
    """The database clock ``seconds`` from now (negative: in the past), in SQL that
    runs on MySQL/MariaDB and PostgreSQL: for tests that age rows or leases."""
    return db_now_plus(sa.literal(round(seconds * 1_000_000), sa.BigInteger()))


def pg_positional(statement: str) -> tuple[str, list[str]]:
    """``statement`` as psycopg sends it to PostgreSQL (its ``%(name)s``
    placeholders numbered ``$1``, ``$2``, ... in order of first use, one number
    per name) and the names in that order: for ``PREPARE`` and for finding a
    statement psycopg prepared in ``pg_prepared_statements``."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
    for i, name in enumerate(names, 1):
        statement = statement.replace(f"%({name})s", f"${i}")
    return statement, names


def pg_rows_touched(plan: dict[str, Any]) -> int:
    """Rows every node of a PostgreSQL ``EXPLAIN (ANALYZE, FORMAT JSON)`` plan
    produced or threw away, over all its loops: scans, joins and materialized
    rows read again alike."""

    def walk(node: dict[str, Any]) -> int:
        own = sum(
            node.get(k, 0)
            for k in ("Actual Rows", "Rows Removed by Filter", "Rows Removed by Join Filter")
        ) * node.get("Actual Loops", 1)
        return own + sum(walk(child) for child in node.get("Plans", []))

    return walk(plan["Plan"])


def outbox_key(engine: sa.Engine, table: str = "outbox_events") -> str:
    """The identity key the relays of ``table`` on ``engine`` name their shared
    Redis keys and locks by (``outboxkit.runtime.identity``)."""
    with engine.connect() as conn:
        return read_identity(conn, table).key


def rows(engine: sa.Engine, table: str) -> list[sa.Row[Any]]:
    """Every row of the outbox ``table``, payload and headers wherever kept."""
    t = outbox_table(table)
    with engine.connect() as conn:
        return list(conn.execute(outbox_rows_query(table).order_by(t.c.id)))


def status_counts(engine: sa.Engine, table: str) -> dict[str, int]:
    t = outbox_table(table)
    with engine.connect() as conn:
        result = conn.execute(sa.select(t.c.status, sa.func.count()).group_by(t.c.status))
        return {str(s): int(n) for s, n in result}


def wait_for(
    predicate: Callable[[], Any], *, timeout: float, interval: float = 0.05, what: str = ""
) -> Any:
    return waiting.wait_for(predicate, timeout=timeout, interval=interval, what=what)


@dataclass
class Message:
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    partition: int
    offset: int


def consume(bootstrap: str, topic: str, *, expected: int, timeout: float = 30.0) -> list[Message]:
    """Read ``topic`` from the beginning until ``expected`` messages or ``timeout``;
    then a short extra wait catches duplicates beyond ``expected``."""
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"t-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_uncommitted",
        }
    )
    consumer.subscribe([topic])
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    extra_until: float | None = None
    try:
        while time.monotonic() < deadline:
            if extra_until is None and len(out) >= expected:
                extra_until = time.monotonic() + 1.0
            if extra_until is not None and time.monotonic() > extra_until:
                break
            for msg in consumer.consume(500, timeout=0.2):
                if msg.error():
                    continue
                out.append(
                    Message(
                        key=msg.key(),
                        value=msg.value(),
                        headers=dict(msg.headers() or []),
                        partition=msg.partition(),
                        offset=msg.offset(),
                    )
                )
    finally:
        consumer.close()
    return out


class EmbeddedRelay:
    """A Relay running in a thread of the test process."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, name="relay-under-test", daemon=True)

    def _run(self) -> None:
        self.exit_code = self.relay.run()

    def start(self) -> EmbeddedRelay:
        self.thread.start()
        wait_for(
            lambda: self.relay.lifecycle.state.value != "starting" or not self.thread.is_alive(),
            timeout=15,
            what="relay start",
        )
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        self.relay.stop()
        self.thread.join(bound(timeout))
        assert not self.thread.is_alive(), "relay did not stop"
        return self.exit_code

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.relay.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


class RelayProcess:
    """``python -m outboxkit relay ...`` with its JSON log lines collected from stderr."""

    def __init__(self, args: Sequence[str], *, env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, "-P", "-m", "outboxkit", "relay", *args]
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=full_env,
            text=True,
            cwd=REPO,
        )
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    @property
    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            lines = list(self.lines)
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == name]

    def wait_event(self, name: str, timeout: float = 20.0) -> dict[str, Any]:
        found = wait_for(
            lambda: self.events(name) or (self.proc.poll() is not None and self.events(name)),
            timeout=timeout,
            what=f"log event {name!r}; stderr so far:\n" + "\n".join(self.lines[-20:]),
        )
        return found[0]  # type: ignore[no-any-return]

    def health_url(self) -> str:
        port = self.wait_event("health-server-started")["port"]
        return f"http://127.0.0.1:{port}"

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(bound(timeout))
        self._reader.join(5)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def http_get(url: str, timeout: float = 2.0) -> tuple[int, dict[str, Any] | str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310
            body = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        body = exc.read().decode()
        status = exc.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


class Pushgateway:
    """The test Pushgateway; groups of tracked relay instances are deleted afterwards."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.instances: list[str] = []

    def track(self, node_id: str) -> str:
        self.instances.append(node_id)
        return node_id

    def value(self, metric: str, node_id: str) -> float | None:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as resp:  # noqa: S310
            text = resp.read().decode()
        for line in text.splitlines():
            if (
                line.startswith(metric + "{")
                and f'instance="{node_id}"' in line
                and f'job="{PUSH_JOB}"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
        return None
