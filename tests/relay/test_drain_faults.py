"""Drains that cannot finish cleanly: the database is gone or hangs.

A dedicated MariaDB instance is killed or frozen (SIGSTOP), so the shared one
keeps serving the other tests.
"""

from __future__ import annotations

import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from relay_support import (
    FAST,
    Pushgateway,
    RelayProcess,
    add_events,
    cli_args,
    fast_settings,
    missing_service,
    status_counts,
    wait_for,
)
from support.services import MariaDBInstance, free_port

from outboxkit import Event
from outboxkit.runtime import EXIT_DEPENDENCY, EXIT_FORCED
from outboxkit.schema import apply_schema

pytestmark = [pytest.mark.integration, pytest.mark.fault]

#: A batch of 100 whose tail lingers in the producer for 8 s (see test_drain.py).
SLOW_KAFKA = {"linger.ms": "8000", "batch.num.messages": "10", "message.timeout.ms": "10000"}
#: Rows leased while that batch lingers: the pipelined relay claims (and sends) the
#: next batch of 100 meanwhile, so both are in flight when the drain starts.
IN_FLIGHT = 200 if FAST.get("pipeline") else 100


def _three_batches(kafka_topics: Callable[..., str]) -> list[Event]:
    """300 rows of distinct keys: batches of 100 alternate between two topics.
    In one topic the second batch's messages (the pipelined relay produces it at
    once) would fill the producer batches where the first one's tail lingers and
    carry it out: the first batch would settle at once and a third be claimed."""
    topics = (kafka_topics(partitions=3), kafka_topics(partitions=3))
    return [Event(topic=topics[(i // 100) % 2], key=f"k{i}", payload=b"x") for i in range(300)]


@pytest.fixture(scope="module")
def mariadb() -> Iterator[MariaDBInstance]:
    db = MariaDBInstance(f"relay-{uuid.uuid4().hex[:6]}", free_port())
    try:
        db.start(fresh=True)
    except Exception as exc:
        missing_service(f"dedicated MariaDB did not start: {exc}")
    yield db
    db.stop()
    shutil.rmtree(db.state_dir, ignore_errors=True)  # a fresh name per run


@pytest.fixture
def fault_db(mariadb: MariaDBInstance) -> Iterator[tuple[str, sa.Engine]]:
    """A fresh database with the outbox schema in the dedicated instance."""
    mariadb.start()
    name = f"okt_{uuid.uuid4().hex[:10]}"
    server = sa.create_engine(mariadb.url)
    with server.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    server.dispose()
    url = sa.make_url(mariadb.url).set(database=name).render_as_string(hide_password=False)
    engine = sa.create_engine(url)
    apply_schema(engine, shards=8)
    yield url, engine
    engine.dispose()


def _start_slow_relay(
    relay_process: Callable[..., RelayProcess],
    db_url: str,
    bootstrap: str,
    *extra: str,
    **kw: object,
) -> tuple[RelayProcess, str]:
    settings = fast_settings(
        db_url,
        bootstrap,
        batch_size=100,
        lease_ttl=20.0,
        flush_timeout=2.0,
        kafka_config=SLOW_KAFKA,
        **kw,
    )
    return relay_process([*cli_args(settings), *extra]), settings.node_id


def test_database_gone_during_drain_leaves_rows_leased_and_reports_them(
    fault_db: tuple[str, sa.Engine],
    mariadb: MariaDBInstance,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
    pushgateway: Pushgateway,
) -> None:
    db_url, engine = fault_db
    add_events(engine, "outbox_events", _three_batches(kafka_topics))
    relay, node_id = _start_slow_relay(
        relay_process, db_url, kafka_bootstrap, "--pushgateway-url", pushgateway.url
    )
    pushgateway.track(node_id)
    wait_for(
        lambda: status_counts(engine, "outbox_events").get("delivering") == IN_FLIGHT,
        timeout=20,
        what="a batch in flight",
    )
    engine.dispose()
    relay.signal(signal.SIGTERM)
    mariadb.kill()

    # the release is retried while the budget lasts (15 s, less the close reserve)
    assert relay.wait(timeout=45) == EXIT_DEPENDENCY
    exit_line = relay.events("relay-exit")[0]
    assert exit_line["result"] == "left-leased"
    assert exit_line["left_leased"] == IN_FLIGHT == exit_line["batch_size"]
    assert relay.events("release-failed")
    assert pushgateway.value("outbox_shutdown_pending", node_id) == IN_FLIGHT

    mariadb.start()
    assert status_counts(engine, "outbox_events") == {
        "delivering": IN_FLIGHT,
        "pending": 300 - IN_FLIGHT,
    }, "held rows wait for their lease to expire"


def test_a_database_blip_during_the_drain_is_waited_out_and_the_exit_is_clean(
    fault_db: tuple[str, sa.Engine],
    mariadb: MariaDBInstance,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """A redeploy during a database restart (found by the chaos suite's full run:
    the relay gave up on its first failed write and exited 3 with 200 rows left
    leased). The drain retries while its budget lasts: acknowledged rows end
    delivered, the rest released with the attempt refunded, exit 0."""
    db_url, engine = fault_db
    add_events(engine, "outbox_events", _three_batches(kafka_topics))
    relay, _ = _start_slow_relay(relay_process, db_url, kafka_bootstrap, shutdown_timeout=60.0)
    wait_for(
        lambda: status_counts(engine, "outbox_events").get("delivering") == IN_FLIGHT,
        timeout=20,
        what="a batch in flight",
    )
    engine.dispose()
    relay.signal(signal.SIGTERM)
    mariadb.kill()
    relay.wait_event("release-retrying", timeout=30)
    mariadb.start()

    assert relay.wait(timeout=90) == 0, "\n".join(relay.lines[-20:])
    exit_line = relay.events("relay-exit")[0]
    assert exit_line["result"] == "clean" and exit_line["left_leased"] == 0
    assert exit_line["batch_size"] == IN_FLIGHT
    assert exit_line["delivered"] + exit_line["unknown"] == IN_FLIGHT and exit_line["unknown"] > 0
    assert relay.events("release-recovered")
    counts = status_counts(engine, "outbox_events")
    assert counts.get("delivering", 0) == 0
    assert counts.get("delivered", 0) == exit_line["delivered"]
    with engine.connect() as conn:
        attempts = conn.execute(
            sa.text("SELECT attempts FROM outbox_events WHERE status != 'delivered'")
        ).scalars()
        assert set(attempts) == {0}, "a drain must not use up an attempt"


def test_a_database_restarting_at_start_is_waited_for(
    fault_db: tuple[str, sa.Engine],
    mariadb: MariaDBInstance,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """A relay that starts while the database restarts waits up to connect_timeout,
    as it does for Kafka and Redis (the chaos suite's full run saw replacements exit
    3 on the first refused connection)."""
    db_url, engine = fault_db
    topic = kafka_topics(partitions=1)
    add_events(engine, "outbox_events", [Event(topic=topic, key="k", payload=b"x")])
    engine.dispose()
    mariadb.kill()
    relay, _ = _start_slow_relay(relay_process, db_url, kafka_bootstrap, connect_timeout=90.0)
    waiting = relay.wait_event("database-waiting", timeout=30)
    assert waiting["connect_timeout_s"] == 90.0
    mariadb.start()
    relay.wait_event("relay-started", timeout=90)
    wait_for(
        lambda: status_counts(engine, "outbox_events") == {"delivered": 1},
        timeout=30,
        what="the row delivered",
    )
    relay.signal(signal.SIGTERM)
    assert relay.wait(timeout=30) == 0


def test_hung_database_during_drain_ends_in_a_forced_exit(
    fault_db: tuple[str, sa.Engine],
    mariadb: MariaDBInstance,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
    pushgateway: Pushgateway,
) -> None:
    db_url, engine = fault_db
    add_events(engine, "outbox_events", _three_batches(kafka_topics))
    relay, node_id = _start_slow_relay(
        relay_process,
        db_url,
        kafka_bootstrap,
        "--pushgateway-url",
        pushgateway.url,
        shutdown_timeout=4.0,
    )
    pushgateway.track(node_id)
    wait_for(
        lambda: status_counts(engine, "outbox_events").get("delivering") == IN_FLIGHT,
        timeout=20,
        what="a batch in flight",
    )
    engine.dispose()
    mariadb.pause()
    try:
        relay.signal(signal.SIGTERM)
        assert relay.wait(timeout=20) == EXIT_FORCED
    finally:
        mariadb.resume()
    forced = relay.events("forced-shutdown")[0]
    assert forced["exit_code"] == EXIT_FORCED and forced["shutdown_timeout_s"] == 4.0
    assert "database" in forced["cut"] and "kafka-producer" in forced["cut"]
    assert any(f"{IN_FLIGHT} leased rows" in c for c in forced["cut"])
    exit_line = relay.events("relay-exit")[0]
    assert exit_line["result"] == "forced" and exit_line["left_leased"] == IN_FLIGHT
    assert exit_line["exit_code"] == EXIT_FORCED
    assert exit_line["metrics_pushed"] is True
    assert pushgateway.value("outbox_shutdown_pending", node_id) == IN_FLIGHT
    assert pushgateway.value("service_forced_shutdowns_total", node_id) == 1.0
    assert (pushgateway.value("service_shutdown_duration_seconds", node_id) or 0) >= 4.0


def test_retention_stuck_on_a_frozen_database_cannot_outlive_the_budget(
    fault_db: tuple[str, sa.Engine],
    mariadb: MariaDBInstance,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """A retention statement stalled on a frozen database (the statement timeout is
    the 30 s lease) must not keep the process alive past ``shutdown_timeout``, and
    the exit record must not call that exit clean."""
    db_url, engine = fault_db
    add_events(engine, "outbox_events", [Event(topic=kafka_topics(1), payload=b"x")])
    settings = fast_settings(
        db_url,
        kafka_bootstrap,
        lease_ttl=30.0,  # also the read timeout of every statement
        shutdown_timeout=4.0,
        poll_interval=30.0,  # the relay loop idles: only retention talks to the DB
        metrics_interval=3600.0,
        retention=3600.0,
        retention_interval=0.2,
    )
    relay = relay_process(cli_args(settings))
    # Once the row is delivered the loop makes one more (empty) claim and then
    # idles for the poll interval: it is not inside a statement when the DB freezes.
    wait_for(
        lambda: status_counts(engine, "outbox_events") == {"delivered": 1},
        timeout=30,
        what="the row delivered",
    )
    engine.dispose()
    time.sleep(0.5)
    mariadb.pause()
    try:
        # Retention starts a run every 0.2 s; give it time to be inside a statement.
        time.sleep(1.5)
        relay.signal(signal.SIGTERM)
        started = time.monotonic()
        # Before the fix the process lived on until the statement's 30 s timeout.
        code = relay.wait(timeout=20.0)
        took = time.monotonic() - started
    finally:
        mariadb.resume()
    assert took < 4.0 + 5.0, f"exited {took:.1f} s after SIGTERM (budget 4 s, slack for load)"
    exit_line = relay.events("relay-exit")[0]
    assert exit_line["result"] != "clean" and code != 0, (code, exit_line)
    assert exit_line["exit_code"] == code == EXIT_FORCED
    assert any("retention" in c for c in exit_line["abandoned"]), exit_line
