"""``outboxkit relay`` as an operator runs it: help, settings errors, exit codes, secrets."""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from relay_support import (
    REPO,
    EmbeddedRelay,
    Pushgateway,
    RelayProcess,
    add_events,
    fast_settings,
    http_get,
    rows,
    status_counts,
    wait_for,
)
from support.databases import on_both_databases
from support.services import free_port

import outboxkit
from outboxkit import Event
from outboxkit.relay import RelaySettings
from outboxkit.runtime import EXIT_CONFIG, EXIT_DEPENDENCY
from outboxkit.runtime.settings import env_name, flag_name
from outboxkit.schema import apply_schema


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    full_env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-P", "-m", "outboxkit", "relay", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO,
        timeout=60,
        check=False,
    )


@pytest.mark.unit
def test_help_documents_every_setting_and_its_environment_variable() -> None:
    result = _cli("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for f in dataclasses.fields(RelaySettings):
        assert flag_name(f.name) in text, f.name
        assert env_name(f.name) in text, f.name
    assert "exit codes" in text and "4 forced exit" in text


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "env", "names"),
    [
        ([], {"OUTBOXKIT_BATCH_SIZE": "many"}, "--batch-size / OUTBOXKIT_BATCH_SIZE"),
        (["--lease-ttl", "10"], {}, "--lease-ttl / OUTBOXKIT_LEASE_TTL"),
        (["--flush-timeout", "40"], {}, "--flush-timeout / OUTBOXKIT_FLUSH_TIMEOUT"),
        (["--compression", "brotli"], {}, "--compression / OUTBOXKIT_COMPRESSION"),
        (["--table", "drop table;"], {}, "--table / OUTBOXKIT_TABLE"),
        (
            ["--retry-backoff-base", "5", "--retry-backoff-cap", "1"],
            {},
            "--retry-backoff-cap / OUTBOXKIT_RETRY_BACKOFF_CAP: must be >= --retry-backoff-base",
        ),
        (
            ["--backoff-base", "1", "--retry-backoff-base", "2"],
            {},
            "--retry-backoff-base and its old name --backoff-base are both given",
        ),
        (
            [],
            {"OUTBOXKIT_BACKOFF_CAP": "0"},
            "OUTBOXKIT_BACKOFF_CAP (old name of OUTBOXKIT_RETRY_BACKOFF_CAP): must be > 0",
        ),
    ],
)
def test_bad_settings_exit_2_naming_the_setting(
    args: list[str], env: dict[str, str], names: str
) -> None:
    base = {
        "OUTBOXKIT_DB_URL": "mysql+pymysql://u:p@127.0.0.1:1/db",
        "OUTBOXKIT_KAFKA_BOOTSTRAP": "x:1",
    }
    result = _cli(*args, env={**base, **env})
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert names in result.stderr


@pytest.mark.unit
def test_missing_database_url_exits_2() -> None:
    result = _cli(env={"OUTBOXKIT_KAFKA_BOOTSTRAP": "x:1"})
    assert result.returncode == EXIT_CONFIG
    assert "--db-url / OUTBOXKIT_DB_URL" in result.stderr


@pytest.mark.unit
@pytest.mark.parametrize(
    ("url", "backend"),
    [("sqlite:///relay.db", "sqlite"), ("oracle://u:pw-never-shown@h/db", "oracle")],
)
def test_a_database_the_relay_cannot_run_on_exits_2_naming_it(url: str, backend: str) -> None:
    result = _cli(
        "--health-port", "0", env={"OUTBOXKIT_DB_URL": url, "OUTBOXKIT_KAFKA_BOOTSTRAP": "x:1"}
    )
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert (
        f"--db-url / OUTBOXKIT_DB_URL: the relay runs on MySQL/MariaDB or PostgreSQL, not {backend}"
    ) in result.stderr
    assert "health-server-started" not in result.stderr, "refused before starting anything"
    assert "pw-never-shown" not in result.stderr


@pytest.mark.integration
def test_a_postgresql_schema_without_the_crc32_function_exits_3_saying_apply(
    pg_url: str, kafka_bootstrap: str
) -> None:
    """A schema applied by a release before the PostgreSQL relay lacks the claim's
    CRC-32 function: the relay says to run ``schema apply`` instead of failing claims."""
    engine = sa.create_engine(pg_url)
    try:
        apply_schema(engine, shards=8)
        with engine.begin() as conn:
            conn.execute(sa.text("DROP FUNCTION outboxkit_crc32(bytea)"))
    finally:
        engine.dispose()
    result = _cli(
        "--health-port", "0", "--connect-timeout", "2",
        env={"OUTBOXKIT_DB_URL": pg_url, "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap},
    )  # fmt: skip
    assert result.returncode == EXIT_DEPENDENCY, result.stderr
    assert "outboxkit_crc32(bytea) is missing: run `outboxkit schema apply`" in result.stderr


@pytest.mark.integration
@on_both_databases
def test_a_release_2_table_without_its_payload_table_exits_3_saying_apply(
    db_url: str, kafka_bootstrap: str
) -> None:
    """Release 2's tables have no payload table, which this release's claim reads:
    the relay says to run ``schema apply`` (which adds it) instead of failing
    every claim."""
    engine = sa.create_engine(db_url)
    try:
        apply_schema(engine, shards=8)
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE outbox_events_payload"))
        result = _cli(
            "--health-port", "0", "--connect-timeout", "2",
            env={"OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap},
        )  # fmt: skip
        assert result.returncode == EXIT_DEPENDENCY, result.stderr
        assert (
            "the payload table outbox_events_payload of table 'outbox_events' is missing: "
            "run `outboxkit schema apply`"
        ) in result.stderr
        assert [a for a in apply_schema(engine, shards=8).actions if "payload" in a] == [
            "created table outbox_events_payload"
        ]
    finally:
        engine.dispose()


@pytest.mark.integration
@on_both_databases
def test_a_payload_table_missing_a_column_exits_3_saying_apply(
    db_url: str, kafka_bootstrap: str
) -> None:
    """A payload table of the wrong shape (a column dropped by hand) made every
    claim fail with an unknown column, the worker restarting over and over and
    nothing delivered: the relay refuses to start instead, naming the column."""
    engine = sa.create_engine(db_url)
    try:
        apply_schema(engine, shards=8)
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE outbox_events_payload DROP COLUMN headers"))
        result = _cli(
            "--health-port", "0", "--connect-timeout", "2",
            env={"OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap},
        )  # fmt: skip
        assert result.returncode == EXIT_DEPENDENCY, result.stderr
        assert (
            "the payload table outbox_events_payload of table 'outbox_events' lacks the "
            "column headers: run `outboxkit schema apply`"
        ) in result.stderr
        assert "relay-started" not in result.stderr
        assert "added column outbox_events_payload.headers" in apply_schema(engine).actions
    finally:
        engine.dispose()


@pytest.mark.integration
def test_an_outbox_table_missing_a_column_exits_3_saying_apply(
    engine: sa.Engine, db_url: str, outbox: str, kafka_bootstrap: str
) -> None:
    """The outbox table's columns are checked as the payload table's are: one
    dropped by hand would fail every claim."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {outbox} DROP COLUMN kafka_offset"))
    result = _cli(
        "--health-port", "0", "--connect-timeout", "2",
        env={"OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap},
    )  # fmt: skip
    assert result.returncode == EXIT_DEPENDENCY, result.stderr
    assert (
        f"table '{outbox}' lacks the column kafka_offset: run `outboxkit schema apply`"
    ) in result.stderr


@pytest.mark.integration
def test_a_mysql_table_without_the_key_index_exits_3_saying_apply(
    engine: sa.Engine, db_url: str, outbox: str, kafka_bootstrap: str
) -> None:
    """The claim names ``ix_<table>_key_status`` in an index hint; on a table made
    by hand without it every claim would fail, so the relay refuses to start."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP INDEX ix_{outbox}_key_status ON {outbox}"))
    result = _cli(
        "--health-port", "0", "--connect-timeout", "2",
        env={"OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap},
    )  # fmt: skip
    assert result.returncode == EXIT_DEPENDENCY, result.stderr
    assert (
        f"the index ix_{outbox}_key_status of table '{outbox}' is missing: "
        "run `outboxkit schema apply`"
    ) in result.stderr


@pytest.mark.integration
def test_non_idempotent_producer_config_is_refused_with_exit_2(
    db_url: str, outbox: str, kafka_bootstrap: str
) -> None:
    result = _cli(
        "--kafka-config", "acks=1", "--health-port", "0",
        env={"OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap},
    )  # fmt: skip
    assert result.returncode == EXIT_CONFIG, result.stderr
    # Refused when the settings load, like every other bad setting: one line, the
    # property, the value it needs and why.
    assert result.stderr.count("\n") == 1, result.stderr
    assert "--kafka-config / OUTBOXKIT_KAFKA_CONFIG: acks=1 is refused" in result.stderr
    assert "acks=all" in result.stderr


@pytest.mark.integration
@on_both_databases
def test_unreachable_database_or_kafka_at_start_exits_3(
    db_url: str, outbox: str, kafka_bootstrap: str
) -> None:
    closed = f"127.0.0.1:{free_port()}"
    scheme = sa.make_url(db_url).drivername
    no_db = _cli(
        "--connect-timeout", "2", "--health-port", "0",
        env={
            "OUTBOXKIT_DB_URL": f"{scheme}://user:unused-pw@{closed}/db",
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
        },
    )  # fmt: skip
    assert no_db.returncode == EXIT_DEPENDENCY, no_db.stderr
    assert '"event": "start-failed"' in no_db.stderr and '"kind": "dependency"' in no_db.stderr

    no_kafka = _cli(
        "--connect-timeout", "2", "--health-port", "0",
        env={"OUTBOXKIT_DB_URL": db_url, "OUTBOXKIT_KAFKA_BOOTSTRAP": closed},
    )  # fmt: skip
    assert no_kafka.returncode == EXIT_DEPENDENCY, no_kafka.stderr
    assert "Kafka unreachable" in no_kafka.stderr


@pytest.fixture
def secret_db_user(engine: sa.Engine, db_url: str, outbox: str) -> Iterator[tuple[str, str]]:
    """A database user whose password appears nowhere else: (url, password)."""
    user = f"okt_{uuid.uuid4().hex[:8]}"
    password = f"Pw-{uuid.uuid4().hex}-Zz"
    database = sa.make_url(db_url).database
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'"))
        conn.execute(sa.text(f"GRANT ALL ON {database}.* TO '{user}'@'%'"))
        conn.execute(sa.text(f"GRANT ALL ON outboxkit_test.* TO '{user}'@'%'"))
    url = sa.make_url(db_url).set(username=user, password=password)
    yield url.render_as_string(hide_password=False), password
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP USER '{user}'@'%'"))


@pytest.mark.integration
def test_no_password_or_sasl_secret_in_logs_rows_or_metrics(
    engine: sa.Engine,
    outbox: str,
    secret_db_user: tuple[str, str],
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
    pushgateway: Pushgateway,
) -> None:
    url, db_password = secret_db_user
    sasl_secret = f"Sasl-{uuid.uuid4().hex}"
    topic = kafka_topics(partitions=1)
    missing = f"okt_missing_{uuid.uuid4().hex[:8]}"
    add_events(engine, outbox, [Event(topic=topic, payload=b"ok") for _ in range(3)])
    add_events(engine, outbox, [Event(topic=missing, payload=b"nope")])
    node_id = pushgateway.track(fast_settings(url, kafka_bootstrap).node_id)
    env = {"OUTBOXKIT_DB_URL": url, "OUTBOXKIT_KAFKA_CONFIG": f"sasl.password={sasl_secret}"}
    relay = relay_process(
        [
            "--kafka-bootstrap", kafka_bootstrap, "--node-id", node_id, "--health-port", "0",
            "--log-level", "DEBUG", "--start-jitter", "0", "--poll-interval", "0.05",
            "--metrics-interval", "0.2", "--lease-ttl", "6", "--flush-timeout", "1",
            "--kafka-config", "message.timeout.ms=2000", "--kafka-config", "sasl.username=relay",
            "--pushgateway-url", pushgateway.url,
        ],
        env=env,
    )  # fmt: skip
    url_base = relay.health_url()
    wait_for(lambda: relay.events("topic-paused"), timeout=20, what="topic-paused")
    wait_for(
        lambda: status_counts(engine, outbox).get("delivered") == 3, timeout=20, what="delivery"
    )
    _, metrics_text = http_get(f"{url_base}/metrics")
    _, ready = http_get(f"{url_base}/healthz/ready")
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=15) == 0

    # A failed start with a wrong password must not print that password either;
    # a login the server refuses is the URL's fault: exit 2 with what to fix.
    wrong = sa.make_url(url).set(password=db_password + "-wrong")
    bad = _cli(
        "--kafka-bootstrap", kafka_bootstrap, "--health-port", "0",
        env={"OUTBOXKIT_DB_URL": wrong.render_as_string(hide_password=False)},
    )  # fmt: skip
    assert bad.returncode == EXIT_CONFIG, bad.stderr[-2000:]
    assert f"refused the login of user '{wrong.username}'" in bad.stderr

    started = relay.events("relay-started")[0]
    assert started["version"] == outboxkit.__version__  # what an operator checks upgrades by
    assert "***" in started["settings"]["db_url"]
    assert started["settings"]["kafka_config"]["sasl.password"] == "***"
    with urllib.request.urlopen(f"{pushgateway.url}/metrics", timeout=5) as resp:  # noqa: S310
        pushed = resp.read().decode()
    table_text = "\n".join(repr(tuple(r)) for r in rows(engine, outbox))
    everything = {
        "relay log": "\n".join(relay.lines),
        "failed start log": bad.stderr + bad.stdout,
        "rows": table_text,
        "metrics": str(metrics_text),
        "readiness": str(ready),
        "pushgateway": pushed,
    }
    assert relay.events("relay-exit") and "UNKNOWN_TOPIC" in table_text
    for secret in (db_password, sasl_secret):
        for where, text in everything.items():
            assert secret not in text, f"secret leaked into {where}"


_PEM_KEY = (
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcw\nKeyBodyLine2xyz\n"
    "-----END PRIVATE KEY-----"
)


@pytest.mark.integration
def test_a_relay_started_with_the_old_backoff_variable_keeps_its_value_and_says_so(
    db_url: str, outbox: str, kafka_bootstrap: str, relay_process: Callable[..., RelayProcess]
) -> None:
    """A ConfigMap shared with consumers sets OUTBOXKIT_RETRY_BACKOFF_BASE for them;
    the relay's own OUTBOXKIT_BACKOFF_BASE (the old name) still decides its value."""
    relay = relay_process(
        ["--kafka-bootstrap", kafka_bootstrap, "--health-port", "0", "--start-jitter", "0",
         "--lease-ttl", "6", "--flush-timeout", "1", "--kafka-config", "message.timeout.ms=2000",
         "--backoff-cap", "45"],
        env={
            "OUTBOXKIT_DB_URL": db_url,
            "OUTBOXKIT_BACKOFF_BASE": "2",
            "OUTBOXKIT_RETRY_BACKOFF_BASE": "0.7",
        },
    )  # fmt: skip
    started = relay.wait_event("relay-started")
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=15) == 0
    assert started["settings"]["retry_backoff_base"] == 2.0
    assert started["settings"]["retry_backoff_cap"] == 45.0
    # No --pipeline given: the line says what the database's default made of it.
    assert started["settings"]["pipeline"] is None
    assert started["pipeline"] is sa.make_url(db_url).get_backend_name().startswith("postgres")
    renamed = sorted((r["old"], r["new"], r["level"]) for r in relay.events("setting-renamed"))
    assert renamed == [
        ("--backoff-cap", "--retry-backoff-cap", "WARNING"),
        ("OUTBOXKIT_BACKOFF_BASE", "OUTBOXKIT_RETRY_BACKOFF_BASE", "WARNING"),
    ]


def test_key_material_is_masked_and_short_passwords_do_not_garble_the_log(
    db_url: str, outbox: str, kafka_bootstrap: str, relay_process: Callable[..., RelayProcess]
) -> None:
    """The test server's DB password is ``outboxkit``: it must not turn the service name
    into ``***-relay``; ssl.key.pem and the other key properties never appear."""
    password = sa.make_url(db_url).password
    assert password and len(password) < 12  # the case from the report
    relay = relay_process(
        [
            "--kafka-bootstrap", kafka_bootstrap, "--health-port", "0", "--start-jitter", "0",
            "--lease-ttl", "6", "--flush-timeout", "1",
            "--kafka-config", "message.timeout.ms=2000",
            "--kafka-config", f"ssl.key.pem={_PEM_KEY}",
            "--kafka-config", "ssl.key.password=KeyPassphrase-123",
            "--kafka-config", "sasl.oauthbearer.client.secret=OauthSecret-456",
        ],
        env={"OUTBOXKIT_DB_URL": db_url},
    )  # fmt: skip
    started = relay.wait_event("relay-started")
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=15) == 0
    text = "\n".join(relay.lines)
    for leaked in ("KeyBodyLine2xyz", "MIIEvQIBADAN", "KeyPassphrase-123", "OauthSecret-456"):
        assert leaked not in text
    config = started["settings"]["kafka_config"]
    assert config["ssl.key.pem"] == "***"
    assert config["ssl.key.password"] == "***"
    assert config["sasl.oauthbearer.client.secret"] == "***"
    assert config["message.timeout.ms"] == "2000"
    assert started["settings"]["db_url"] == db_url.replace(f":{password}@", ":***@")
    records = relay.records
    assert records and all(r["service"] == "outboxkit-relay" for r in records)
    # The test server's password equals its user name: a default, not a secret, so
    # no warning (tests/relay/test_quiet_logs.py); a short one that is, is warned of.
    assert relay.events("secret-too-short") == []
    # Outside the masked fields, nothing is masked: no word was cut by the password.
    unmasked = [
        line
        for line in relay.lines
        if "***" in line and '"relay-started"' not in line and "secret-too-short" not in line
    ]
    assert unmasked == []
    assert relay.events("relay-exit")[0]["result"] == "clean"


_CONSOLE_LINE = re.compile(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?P<level>[A-Z]+) +(?P<event>[a-z-]+)(?P<rest>.*)"
)


@pytest.mark.integration
def test_console_log_format_gives_readable_lines_with_the_same_masking(
    engine: sa.Engine,
    outbox: str,
    secret_db_user: tuple[str, str],
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    url, db_password = secret_db_user
    topic = kafka_topics(partitions=1)
    add_events(engine, outbox, [Event(topic=topic, payload=b"ok") for _ in range(3)])
    relay = relay_process(
        [
            "--kafka-bootstrap", kafka_bootstrap, "--health-port", "0", "--start-jitter", "0",
            "--poll-interval", "0.05", "--lease-ttl", "6", "--flush-timeout", "1",
            "--kafka-config", "message.timeout.ms=2000", "--node-id", "console-relay",
        ],
        env={"OUTBOXKIT_DB_URL": url, "OUTBOXKIT_LOG_FORMAT": "console"},
    )  # fmt: skip
    wait_for(
        lambda: status_counts(engine, outbox).get("delivered") == 3, timeout=30, what="delivery"
    )
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=15) == 0

    text = "\n".join(relay.lines)
    assert relay.lines and relay.records == [], text  # not one JSON line
    parsed = [m for m in map(_CONSOLE_LINE.fullmatch, relay.lines) if m]
    events = {m["event"]: m for m in parsed}
    assert {"relay-started", "state-changed", "relay-exit"} <= set(events), text
    running = [m for m in parsed if m["event"] == "state-changed" and " to=running" in m["rest"]]
    assert running and running[0]["level"] == "INFO", text
    exit_line = events["relay-exit"]["rest"]
    assert " state=stopped " in exit_line and " result=clean " in exit_line, exit_line
    assert exit_line.endswith(" service=outboxkit-relay node_id=console-relay"), exit_line
    started = events["relay-started"]["rest"]
    assert url.replace(f":{db_password}@", ":***@") in started
    # The command owns its process: the heap it started with is frozen (no full
    # collection walks it again; a 50-90 ms pause in the loop otherwise).
    frozen = re.search(r" heap_frozen=(\d+)", started)
    assert frozen and int(frozen[1]) > 10_000, started
    assert db_password not in text


def test_an_embedded_relay_leaves_the_host_process_heap_alone(
    engine: sa.Engine,
    outbox: str,
    db_url: str,
    kafka_bootstrap: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    # Only the command, which owns its process, freezes the heap: in a host
    # process, cyclic garbage alive at that moment would never be collected.
    before = gc.get_freeze_count()
    relay = embedded(fast_settings(db_url, kafka_bootstrap))
    assert relay.relay.lifecycle.state.value == "running"
    assert gc.get_freeze_count() == before
    assert relay.stop() == 0


@pytest.mark.unit
def test_a_bad_log_format_exits_2_naming_the_setting() -> None:
    out = _cli("--log-format", "xml")
    assert out.returncode == EXIT_CONFIG
    assert "--log-format" in out.stderr
    env_out = _cli(env={"OUTBOXKIT_LOG_FORMAT": "xml", "OUTBOXKIT_DB_URL": "mysql://h/db"})
    assert env_out.returncode == EXIT_CONFIG
    assert "--log-format / OUTBOXKIT_LOG_FORMAT" in env_out.stderr
