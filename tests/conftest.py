"""Fixtures for real services.

Service addresses come from ``OUTBOXKIT_TEST_DB_URL`` (MariaDB/MySQL),
``OUTBOXKIT_TEST_PG_URL`` (PostgreSQL), ``OUTBOXKIT_TEST_KAFKA_BOOTSTRAP`` and
``OUTBOXKIT_TEST_REDIS_URL`` (``eval "$(deploy/local/up.sh)"`` prints them).
Without them, a Docker engine is tried through testcontainers.  When neither
answers, the test is skipped locally with the reason, and **fails** under CI
(``CI=true``): a missing service must never look like a pass.

Every test gets its own database, its own Kafka topics and its own Redis key
prefix, so tests cannot see each other's data.

``db_url`` (and so ``engine`` and ``outbox``) is a MariaDB database unless the
test is marked ``support.databases.on_both_databases``, which runs it once on
MariaDB and once on PostgreSQL (ids ``[mariadb]`` and ``[postgresql]``).
``pg_url`` is a PostgreSQL database for PostgreSQL-only tests.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from support.collecting import CollectionProgress, record_module
from support.databases import MARIADB, MARIADB_MYSQLDB, POSTGRESQL, with_mysqldb
from support.lifeline import (
    INTERRUPTED_WORKER_GRACE,
    mark_this_run,
    reap_orphans,
    stop_children_on_interrupt,
)
from support.naming import missing_service, unique_name

from bench.context import drop_database
from outboxkit.schema import apply_schema

#: The session's config (the root process only), for the interrupt hook.
_SESSION_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    """The session's root (not an xdist worker) first kills what an earlier,
    killed run left running, then marks everything this one starts
    (support.lifeline), and prints progress while the suite is collected
    (support.collecting). The root and each worker stop what the run started
    at Ctrl-C."""
    stop_children_on_interrupt()
    if hasattr(config, "workerinput"):
        return
    reaped = reap_orphans()
    if reaped:
        print(f"killed {len(reaped)} process(es) a killed earlier run left running: {reaped}")
    mark_this_run()
    config.pluginmanager.register(CollectionProgress(config), "outboxkit-collect-progress")
    _SESSION_CONFIG.append(config)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    record_module(report, os.environ.get("PYTEST_XDIST_WORKER", "main"))


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    """Interrupted: the session waits a short grace for its xdist workers' own
    clean-up, then kills them (support.lifeline)."""
    for config in _SESSION_CONFIG:
        dsession = config.pluginmanager.getplugin("dsession")
        nodes = getattr(dsession, "nodemanager", None)
        if nodes is not None:
            nodes.EXIT_TIMEOUT = INTERRUPTED_WORKER_GRACE


#: What sets the services' addresses in the shell that runs the tests (``up.sh``
#: alone only prints them).
UP_COMMAND = 'eval "$(deploy/local/up.sh)"'


def _utf8_safe(text: str) -> str:
    """``text`` as it is when it encodes as UTF-8, else with the characters that do
    not (lone surrogates) written as ``\\udXXX``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Tests feed lone surrogates to the code on purpose (record text, event ids),
    and the captured log then holds them; a pytest-xdist worker cannot send such a
    report to the controller (UTF-8 only) and dies, ending the whole run with an
    internal error. The report's captured sections and failure text are escaped
    instead; what a test asserts is unchanged."""
    outcome: Any = yield
    report = outcome.get_result()
    report.sections = [(title, _utf8_safe(text)) for title, text in report.sections]
    if report.longrepr is not None:
        shown = str(report.longrepr)
        if _utf8_safe(shown) != shown:
            report.longrepr = _utf8_safe(shown)


@functools.cache
def _docker_answers() -> bool:
    """Does a Docker engine answer ``/_ping``?  (A client binary alone is not enough.)"""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: Any = host.removeprefix("unix://")
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            parsed = urllib.parse.urlsplit(host)
            address = (parsed.hostname or "127.0.0.1", parsed.port or 2375)
        with sock:
            sock.settimeout(2)
            sock.connect(address)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in sock.recv(64)
    except OSError:
        return False


@pytest.fixture(scope="session")
def _containers() -> Iterator[dict[str, Any]]:
    """testcontainers, started lazily and only where a Docker engine answers."""
    started: dict[str, Any] = {}
    yield started
    for container in started.values():
        container.stop()


def _service_url(env: str, kind: str, containers: dict[str, Any]) -> str:
    url = os.environ.get(env)
    if url:
        return url
    if not _docker_answers():
        missing_service(f"{env} is not set and no Docker engine answers (run: {UP_COMMAND})")
    if kind not in containers:
        if kind == "db":
            from testcontainers.mysql import MySqlContainer

            c: Any = MySqlContainer(
                "mysql:8.4", username="outboxkit", password="outboxkit", dbname="outboxkit_test"
            )
            containers[kind] = c.start()
        elif kind == "pg":
            from testcontainers.postgres import PostgresContainer

            c = PostgresContainer(
                "postgres:15",
                username="outboxkit",
                password="outboxkit",
                dbname="outboxkit_test",
                driver="psycopg",
            )
            containers[kind] = c.start()
        elif kind == "kafka":
            from testcontainers.kafka import KafkaContainer

            containers[kind] = KafkaContainer().with_kraft().start()
        else:
            from testcontainers.redis import RedisContainer

            containers[kind] = RedisContainer().start()
    c = containers[kind]
    if kind == "db":
        return str(c.get_connection_url()).replace("mysql://", "mysql+pymysql://", 1)
    if kind == "pg":
        return str(c.get_connection_url())
    if kind == "kafka":
        return str(c.get_bootstrap_server())
    return f"redis://{c.get_container_host_ip()}:{c.get_exposed_port(6379)}/0"


@pytest.fixture(scope="session")
def db_server_url(_containers: dict[str, Any]) -> str:
    return _service_url("OUTBOXKIT_TEST_DB_URL", "db", _containers)


@pytest.fixture(scope="session")
def pg_server_url(_containers: dict[str, Any]) -> str:
    return _service_url("OUTBOXKIT_TEST_PG_URL", "pg", _containers)


@pytest.fixture(scope="session")
def kafka_bootstrap(_containers: dict[str, Any]) -> str:
    return _service_url("OUTBOXKIT_TEST_KAFKA_BOOTSTRAP", "kafka", _containers)


@pytest.fixture(scope="session")
def redis_url(_containers: dict[str, Any]) -> str:
    return _service_url("OUTBOXKIT_TEST_REDIS_URL", "redis", _containers)


@contextlib.contextmanager
def _fresh_database(server_url: str) -> Iterator[str]:
    """A new, empty database on the server of ``server_url``, dropped afterwards."""
    server = sa.make_url(server_url)
    name = unique_name("okt")
    postgres = server.get_backend_name() == "postgresql"
    try:
        # PostgreSQL runs CREATE/DROP DATABASE only outside a transaction block.
        admin = sa.create_engine(server, isolation_level="AUTOCOMMIT" if postgres else None)
    except ImportError as exc:  # the driver extra is not installed
        missing_service(f"no driver for {server.drivername}: {exc}")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        missing_service(f"database server unreachable: {type(exc.orig).__name__}")
    url = server.set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            drop_database(conn, name, postgresql=postgres)
        admin.dispose()


@pytest.fixture
def pg_url(pg_server_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test (dropped afterwards)."""
    with _fresh_database(pg_server_url) as url:
        yield url


@pytest.fixture
def db_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty database for this test (dropped afterwards).

    MariaDB/MySQL, or PostgreSQL for the ``[postgresql]`` run of a test marked
    ``on_both_databases``, or MariaDB through mysqlclient for the
    ``[mariadb-mysqldb]`` run of a test marked ``on_every_driver``.
    """
    kind = getattr(request, "param", MARIADB)
    if kind == POSTGRESQL:
        yield request.getfixturevalue("pg_url")
        return
    server_url = request.getfixturevalue("db_server_url")
    if kind == MARIADB_MYSQLDB:
        server_url = with_mysqldb(server_url)
    else:
        assert kind == MARIADB, kind
    with _fresh_database(server_url) as url:
        yield url


@pytest.fixture
def second_db_url(db_url: str) -> Iterator[str]:
    """Another fresh, empty database on the server of ``db_url`` (dropped
    afterwards): for tests of two outboxes sharing one server."""
    with _fresh_database(db_url) as url:
        yield url


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = sa.create_engine(db_url, pool_size=10, max_overflow=10)
    yield eng
    eng.dispose()


@pytest.fixture
def outbox(engine: sa.Engine) -> str:
    """An applied outbox schema (8 shards) in this test's database; returns the table name."""
    apply_schema(engine, shards=8)
    return "outbox_events"


@pytest.fixture
def kafka_topics(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """Factory: ``kafka_topics(partitions=3)`` creates a uniquely named topic."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    created: list[str] = []

    def make(
        partitions: int = 3, *, name: str | None = None, config: dict[str, str] | None = None
    ) -> str:
        topic = name or unique_name("okt")
        futures = admin.create_topics(
            [NewTopic(topic, num_partitions=partitions, replication_factor=1, config=config or {})],
            operation_timeout=15,
            request_timeout=15,
        )
        try:
            futures[topic].result(timeout=20)
        except Exception as exc:
            missing_service(f"Kafka at {kafka_bootstrap} did not create a topic: {exc}")
        created.append(topic)
        return topic

    yield make
    if created:
        for fut in admin.delete_topics(created, operation_timeout=15).values():
            with contextlib.suppress(Exception):  # best-effort cleanup
                fut.result(timeout=20)


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix for this test; its keys are deleted afterwards."""
    import redis

    client = redis.Redis.from_url(redis_url)
    prefix = unique_name("okt") + ":"
    try:
        client.ping()
    except redis.RedisError as exc:
        missing_service(f"Redis at {redis_url} unreachable: {exc}")
    yield prefix
    for key in client.scan_iter(match=prefix + "*", count=500):
        client.delete(key)
    client.close()
