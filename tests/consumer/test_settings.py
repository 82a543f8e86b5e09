"""Consumer settings: the Kafka properties the offset guarantees depend on are
forced or refused at load time (exit 2 naming --kafka-config), and librdkafka
itself vets the rest before anything connects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from procs import HERE

import outboxkit
from outboxkit.consumer import Consumer, Message
from outboxkit.consumer.settings import ConsumerSettings
from outboxkit.runtime import ConfigError, load
from outboxkit.runtime.kafkaconf import CONSUMER_GUARDED, librdkafka_problem

pytestmark = pytest.mark.unit

_WHERE = "--kafka-config / OUTBOXKIT_KAFKA_CONFIG"


class Noop(Consumer):
    topics = ("t",)
    group_id = "g"

    def handle(self, message: Message) -> None:
        pass


def _refused_value(name: str) -> str:
    return {
        "enable.auto.commit": "false",
        "enable.auto.offset.store": "true",
        "partition.assignment.strategy": "range",
        "group.protocol": "consumer",
    }.get(name, "x")


@pytest.mark.parametrize("name", sorted(CONSUMER_GUARDED))
def test_guarded_properties_are_refused_with_the_reason(name: str) -> None:
    value = _refused_value(name)
    with pytest.raises(ConfigError) as info:
        load(ConsumerSettings, environ={"OUTBOXKIT_KAFKA_CONFIG": f"{name}={value}"})
    message = str(info.value)
    assert _WHERE in message and name in message
    assert CONSUMER_GUARDED[name].reason in message


@pytest.mark.parametrize(
    "props",
    [
        "enable.auto.commit=true",
        "enable.auto.offset.store=false",
        "partition.assignment.strategy=cooperative-sticky",
        "isolation.level=read_uncommitted",
        "isolation.level=read_committed",
        "group.protocol=classic",
        "session.timeout.ms=10000",
    ],
)
def test_values_that_change_nothing_are_accepted(props: str) -> None:
    load(ConsumerSettings, environ={"OUTBOXKIT_KAFKA_CONFIG": props})


@pytest.mark.parametrize(
    "props",
    ["no.such.property=1", "session.timeout.ms=soon", "fetch.min.bytes=-5"],
)
def test_librdkafka_refuses_unknown_properties_and_bad_values_at_load(props: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(ConsumerSettings, environ={"OUTBOXKIT_KAFKA_CONFIG": props})
    assert _WHERE in str(info.value)


def test_the_console_exits_2_before_connecting(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    for prop in ("enable.auto.commit=false", "no.such.property=1"):
        done = subprocess.run(
            [
                sys.executable, "-m", "outboxkit", "consume", "consumer_apps:Sleepy",
                "--kafka-bootstrap", "127.0.0.1:1", "--group-id", "g", "--topics", "t",
                "--kafka-config", prop, "--health-port", "0",
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert _WHERE in done.stderr and prop.split("=")[0] in done.stderr


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    commit=st.floats(min_value=0.001, max_value=604800),
    stats=st.floats(min_value=0, max_value=604800),
    dlq=st.floats(min_value=0.001, max_value=604800),
)
def test_accepted_intervals_are_values_librdkafka_takes(
    commit: float, stats: float, dlq: float
) -> None:
    """What the consumer derives from its settings must be a valid librdkafka config,
    or the consumer would pass validation and then fail when it connects."""
    try:
        s = load(
            ConsumerSettings,
            environ={
                "OUTBOXKIT_COMMIT_INTERVAL": f"{commit:.3f}",
                "OUTBOXKIT_STATS_INTERVAL": f"{stats:.3f}",
                "OUTBOXKIT_DLQ_TIMEOUT": f"{dlq:.3f}",
            },
        )
    except ConfigError:
        return
    derived = {
        "auto.commit.interval.ms": str(int(s.commit_interval * 1000)),
        "statistics.interval.ms": str(int(s.stats_interval * 1000)),
    }
    assert librdkafka_problem(derived, "consumer") is None, derived
    dlq_timeout = {"message.timeout.ms": str(max(1, int(s.dlq_timeout * 1000)))}
    assert librdkafka_problem(dlq_timeout, "producer") is None, dlq_timeout


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    session_ms=st.one_of(st.none(), st.integers(1, 3_600_000)),
    revoke=st.floats(min_value=0, max_value=10**6),
    explicit_ms=st.one_of(st.none(), st.integers(1, 86_400_000)),
)
def test_the_poll_interval_is_short_valid_and_the_users_when_set(
    session_ms: int | None, revoke: float, explicit_ms: int | None
) -> None:
    """The broker waits max.poll.interval.ms for members to rejoin a rebalance;
    librdkafka's 300 s left the chaos suite's group idle for five minutes after a
    broker restart. The default follows the session timeout (and the revoke
    budget); what the user sets wins; librdkafka must accept the result."""
    props = {}
    if session_ms is not None:
        props["session.timeout.ms"] = str(session_ms)
    if explicit_ms is not None:
        props["max.poll.interval.ms"] = str(explicit_ms)
    try:
        s = load(
            ConsumerSettings,
            environ={
                "OUTBOXKIT_REVOKE_TIMEOUT": f"{revoke:.3f}",
                "OUTBOXKIT_KAFKA_CONFIG": ",".join(f"{k}={v}" for k, v in props.items()),
            },
        )
    except ConfigError:
        return  # e.g. a session timeout above the explicit poll interval
    interval = s.max_poll_interval_ms()
    if explicit_ms is not None:
        assert interval == explicit_ms
        return
    assert interval >= (session_ms or 45_000)
    assert interval >= min(86_400_000, int((s.revoke_timeout + 20) * 1000))
    if session_ms is None and s.revoke_timeout <= 25:
        assert interval == 45_000, "not librdkafka's 300 s"
    derived = {**props, "max.poll.interval.ms": str(interval)}
    assert librdkafka_problem(derived, "consumer") is None, derived


_PEM_KEY = (
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcw\nKeyBodyLine2xyz\n"
    "-----END PRIVATE KEY-----"
)


@pytest.mark.integration
def test_consumer_start_line_masks_key_material(
    kafka_bootstrap: str, kafka_topics: Any, tmp_path: Path
) -> None:
    """The consumer's start line, as the operator reads it, never shows a TLS key or
    SASL secret, and a short DB password does not cut words."""
    from procs import ConsumerProcess

    topic = kafka_topics(partitions=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env["OUTBOXKIT_DB_URL"] = "mysql+pymysql://app:short@127.0.0.1:3306/db"
    proc = ConsumerProcess(
        "consumer_apps:Sleepy",
        env=env,
        args=[
            "--kafka-bootstrap", kafka_bootstrap, "--group-id", f"g-{topic}", "--topics", topic,
            "--health-port", "0", "--service", "orders-consumer",
            "--kafka-config", f"ssl.key.pem={_PEM_KEY}",
            "--kafka-config", "ssl.key.password=KeyPassphrase-123",
            "--kafka-config", "sasl.oauthbearer.client.secret=OauthSecret-456",
        ],
        cwd=tmp_path,
    )  # fmt: skip
    try:
        started = proc.wait_event("consumer-starting", timeout=30)
        proc.health_url(timeout=30)
        proc.signal()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    text = "".join(proc.raw)
    for leaked in ("KeyBodyLine2xyz", "MIIEvQIBADAN", "KeyPassphrase-123", "OauthSecret-456"):
        assert leaked not in text
    assert started["version"] == outboxkit.__version__
    config = started["settings"]["kafka_config"]
    assert config["ssl.key.pem"] == config["ssl.key.password"] == "***"
    assert config["sasl.oauthbearer.client.secret"] == "***"
    assert started["settings"]["db_url"] == "mysql+pymysql://app:***@127.0.0.1:3306/db"
    assert all(r["service"] == "orders-consumer" for r in proc.lines)
    assert [r["setting"] for r in proc.events("secret-too-short")] == [
        "--db-url / OUTBOXKIT_DB_URL (URL password)"
    ]


# -- which databases the inbox runs on ---------------------------------------------------

_PG_URL = "postgresql+psycopg://app:pg-secret@127.0.0.1:1/shop"


@pytest.mark.parametrize(
    "url",
    [_PG_URL, "postgresql://app:pw@db/shop", "mysql+pymysql://app:pw@db/shop"],
)
def test_the_inbox_takes_a_mysql_or_postgresql_url(url: str) -> None:
    loaded = load(ConsumerSettings, environ={"OUTBOXKIT_DB_URL": url, "OUTBOXKIT_INBOX": "true"})
    assert loaded.db_url == url and loaded.inbox


def test_the_inbox_refuses_another_database_naming_the_setting() -> None:
    with pytest.raises(ConfigError) as info:
        load(
            ConsumerSettings,
            environ={"OUTBOXKIT_DB_URL": "sqlite:///inbox.db", "OUTBOXKIT_INBOX": "true"},
        )
    message = str(info.value)
    assert "--db-url / OUTBOXKIT_DB_URL" in message
    assert "MySQL/MariaDB or PostgreSQL" in message and "sqlite" in message
    # Without the inbox the consumer does not use the database: nothing to refuse.
    load(ConsumerSettings, environ={"OUTBOXKIT_DB_URL": "sqlite:///inbox.db"})


def test_the_console_refuses_an_sqlite_inbox_with_exit_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [
            sys.executable, "-m", "outboxkit", "consume", "consumer_apps:Sleepy",
            "--kafka-bootstrap", "127.0.0.1:1", "--group-id", "g", "--topics", "t",
            "--health-port", "0", "--inbox", "--db-url", f"sqlite:///{tmp_path}/inbox.db",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "health-server-started" not in done.stderr
    assert "--db-url / OUTBOXKIT_DB_URL" in done.stderr
    assert "MySQL/MariaDB or PostgreSQL" in done.stderr


def test_an_embedded_consumer_takes_a_postgresql_inbox_engine_and_refuses_sqlite() -> None:
    import sqlalchemy as sa

    settings = ConsumerSettings(kafka_bootstrap="127.0.0.1:1", inbox=True, health_port=0)
    postgres, sqlite = sa.create_engine(_PG_URL), sa.create_engine("sqlite://")
    try:
        Noop(settings, engine=postgres)  # nothing connects before run()
        with pytest.raises(ConfigError, match=r"engine=.*MySQL/MariaDB or PostgreSQL.*sqlite"):
            Noop(settings, engine=sqlite)
        Noop(ConsumerSettings(kafka_bootstrap="127.0.0.1:1", health_port=0), engine=sqlite)
    finally:
        postgres.dispose()
        sqlite.dispose()


_BATCH = "--inbox-batch / OUTBOXKIT_INBOX_BATCH"


@settings(max_examples=40, derandomize=True, deadline=None)
@given(size=st.integers(min_value=-5, max_value=5000))
def test_the_inbox_batch_is_1_to_1000_and_needs_the_inbox(size: int) -> None:
    environ = {"OUTBOXKIT_INBOX_BATCH": str(size), "OUTBOXKIT_INBOX": "true"}
    if 1 <= size <= 1000:
        assert load(ConsumerSettings, environ=environ).inbox_batch == size
    else:
        with pytest.raises(ConfigError) as info:
            load(ConsumerSettings, environ=environ)
        assert _BATCH in str(info.value)
    if 1 < size <= 1000:
        with pytest.raises(ConfigError) as info:
            load(ConsumerSettings, environ={"OUTBOXKIT_INBOX_BATCH": str(size)})
        assert _BATCH in str(info.value) and "--inbox / OUTBOXKIT_INBOX" in str(info.value)


def test_the_inbox_batch_defaults_to_one_per_transaction_and_refuses_async_handlers() -> None:
    assert ConsumerSettings().inbox_batch == 1

    class Async(Consumer):
        topics = ("t",)
        group_id = "g"

        async def handle(self, message: Message) -> None:  # type: ignore[override]
            pass

    base = {"kafka_bootstrap": "127.0.0.1:1", "inbox": True, "health_port": 0}
    url = "mysql+pymysql://app:pw@db/shop"
    Async(ConsumerSettings(**base, db_url=url))  # nothing connects before run()
    with pytest.raises(ConfigError) as info:
        Async(ConsumerSettings(**base, db_url=url, inbox_batch=2))
    assert _BATCH in str(info.value) and "async def handle" in str(info.value)


def test_the_console_refuses_a_bad_inbox_batch_with_exit_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    for value in ("0", "1001", "many"):
        done = subprocess.run(
            [
                sys.executable, "-m", "outboxkit", "consume", "consumer_apps:Sleepy",
                "--kafka-bootstrap", "127.0.0.1:1", "--group-id", "g", "--topics", "t",
                "--health-port", "0", "--inbox", "--db-url", "mysql+pymysql://a:b@127.0.0.1:1/x",
                "--inbox-batch", value,
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and _BATCH in done.stderr, done.stderr


class _Built(Exception):
    """Raised by the stand-in client once it has seen its configuration."""


@pytest.mark.parametrize(
    ("kafka_config", "expected"),
    [
        ({}, {"queued.max.messages.kbytes": 8192, "fetch.queue.backoff.ms": 50}),
        (
            {"queued.max.messages.kbytes": "65536"},
            {"queued.max.messages.kbytes": "65536", "fetch.queue.backoff.ms": 50},
        ),
        (
            {"fetch.queue.backoff.ms": "1000"},
            {"queued.max.messages.kbytes": 8192, "fetch.queue.backoff.ms": "1000"},
        ),
    ],
)
def test_librdkafka_prefetch_is_capped_unless_kafka_config_says_otherwise(
    monkeypatch: pytest.MonkeyPatch, kafka_config: dict[str, str], expected: dict[str, Any]
) -> None:
    """librdkafka's own prefetch cap (64 MB) let the consumer's memory grow with the
    backlog it reads (bench: 166 MB at 50,000 messages, 294 MB at 200,000); the
    consumer caps it at 8 MB (16 MB still grew: 172 and 202 MB; 8 MB: 154 and
    156), and an operator's --kafka-config still wins."""
    from outboxkit.consumer import base as consumer_base

    seen: list[dict[str, Any]] = []

    def client(config: dict[str, Any]) -> None:
        seen.append(config)
        raise _Built

    monkeypatch.setattr(consumer_base, "KafkaConsumer", client)
    consumer = Noop(
        ConsumerSettings(kafka_bootstrap="127.0.0.1:1", health_port=0, kafka_config=kafka_config)
    )
    with pytest.raises(_Built):
        consumer._connect()
    assert {k: seen[0][k] for k in expected} == expected
