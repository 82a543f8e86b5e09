"""The real services the suite stands on answer, end to end."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
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
