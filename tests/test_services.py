"""The real services the suite stands on answer, end to end."""

from __future__ import annotations

import itertools
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from support import services
from support.databases import on_both_databases
from support.procs import run_captured

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


@on_both_databases
def test_database_answers(engine: sa.Engine, request: pytest.FixtureRequest) -> None:
    expected = {"mariadb": "MariaDB", "postgresql": "PostgreSQL"}[
        request.node.callspec.params["db_url"]
    ]
    with engine.connect() as conn:
        version = str(conn.execute(sa.text("SELECT VERSION()")).scalar())
        tables = sa.inspect(conn).get_table_names()
    assert expected in version
    assert tables == []  # a fresh database of its own


def test_pg_url_is_a_fresh_postgresql_database_of_its_own(pg_url: str, pg_server_url: str) -> None:
    url = sa.make_url(pg_url)
    assert url.drivername == "postgresql+psycopg"
    assert url.database != sa.make_url(pg_server_url).database
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT current_database()")).scalar() == url.database
            assert sa.inspect(conn).get_table_names() == []
    finally:
        engine.dispose()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("ci", "exit_code", "outcome"), [("", 0, "1 skipped"), ("true", 1, "1 error")]
)
def test_a_missing_postgresql_skips_locally_and_fails_under_ci(
    ci: str, exit_code: int, outcome: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUTBOXKIT_TEST_PG_URL"}
    env.update(CI=ci, DOCKER_HOST="unix:///nonexistent/docker.sock")
    test = "tests/test_services.py::test_pg_url_is_a_fresh_postgresql_database_of_its_own"
    out = run_captured(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", test],
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == exit_code, out.stdout + out.stderr
    assert outcome in out.stdout
    assert "OUTBOXKIT_TEST_PG_URL is not set" in out.stdout


def test_kafka_message_round_trip(kafka_bootstrap: str, kafka_topics: Callable[..., str]) -> None:
    from confluent_kafka import Consumer, Producer

    topic = kafka_topics(partitions=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    producer.produce(topic, key=b"k", value=b"hello", headers=[("event_id", b"e1")])
    assert producer.flush(20) == 0
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": topic,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([topic])
    try:
        msg = None
        for _ in range(60):
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                break
        assert msg is not None and msg.error() is None
        assert (msg.key(), msg.value(), msg.headers()) == (b"k", b"hello", [("event_id", b"e1")])
    finally:
        consumer.close()


def test_redis_answers(redis_url: str, redis_prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    assert client.ping()
    client.set(redis_prefix + "x", "1", px=10_000)
    assert client.get(redis_prefix + "x") == b"1"
    client.close()


# -- ports for the suite's own instances -------------------------------------


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


@pytest.mark.unit
def test_free_ports_lie_below_the_kernels_ephemeral_range() -> None:
    """No outgoing connection can take a port between the probe and the service's bind."""
    low, _ = _ephemeral_range()
    ports = services.free_ports(40)
    assert len(set(ports)) == 40
    assert all(port < low for port in ports), ports
    for port in ports:  # each one free right now
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.unit
@pytest.mark.parametrize("workers", [1, 2, 3, 8, 120])
def test_each_worker_has_a_port_block_of_its_own(workers: int) -> None:
    low, _ = _ephemeral_range()
    seen: set[int] = set()
    for i in range(workers):
        block = services.port_block(f"gw{i}", workers)
        assert len(block) >= services.MIN_PORT_BLOCK
        assert seen.isdisjoint(block)
        seen.update(block)
        assert block.start >= 1024 and block.stop <= low
    with pytest.raises(ValueError, match=f"not one of {workers} workers"):
        services.port_block(f"gw{workers}", workers)


@pytest.mark.unit
def test_port_blocks_refuse_what_they_cannot_split() -> None:
    assert services.port_block() == services.port_block(
        os.environ.get("PYTEST_XDIST_WORKER", "gw0"),
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
    )
    assert services.port_block("gw0", 1) == services.TEST_PORTS
    with pytest.raises(ValueError, match="1 to 120 workers, not 121"):
        services.port_block("gw0", 121)
    with pytest.raises(ValueError, match="not 0"):
        services.port_block("gw0", 0)
    with pytest.raises(ValueError, match="not a pytest-xdist worker id"):
        services.port_block("master", 2)


@pytest.mark.unit
def test_free_ports_pass_over_a_bound_port_and_do_not_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    block = services.port_block()
    monkeypatch.setattr(services, "_port_cursor", itertools.count(0))
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", block[0]))
        taken.listen()
        first = services.free_ports(3)
    second = services.free_ports(3)
    assert block[0] not in first
    assert all(port in block for port in first + second)
    assert len(set(first + second)) == 6
    assert first == sorted(first) and first[0] == min(first + second)
