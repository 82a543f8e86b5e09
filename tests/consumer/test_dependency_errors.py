"""A dependency's failure (cannot connect, cannot log in, server gone) is never the
message's fault: it is retried for as long as it lasts, never dead-lettered."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pymysql
import pytest
import sqlalchemy as sa
from consumer_apps import effects
from kafkahelp import committed, produce, read_all, wait_for
from support import broken_login

from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.consumer.errors import Classification, classify
from outboxkit.runtime import EXIT_CONFIG, EXIT_DEPENDENCY
from outboxkit.schema import apply_schema


@pytest.fixture
def logins() -> Iterator[None]:
    """PyMySQL logins fail like MySQL 8's without ``cryptography`` while BROKEN is set."""
    undo = broken_login.install()
    broken_login.BROKEN.clear()
    yield
    broken_login.BROKEN.clear()
    undo()


def _raised(call: Callable[[], object]) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("nothing raised")


@pytest.mark.integration
def test_driver_errors_while_connecting_are_unavailable_not_permanent(
    db_url: str, logins: None
) -> None:
    engine = sa.create_engine(db_url)
    url = sa.make_url(db_url)
    try:
        broken_login.BROKEN.set()
        # Through SQLAlchemy's pool: the bare RuntimeError SQLAlchemy does not wrap.
        via_pool = _raised(engine.connect)
        # Straight from the driver.
        raw = _raised(
            lambda: pymysql.connect(
                host=url.host, port=url.port or 3306, user=url.username, password=url.password
            )
        )
        broken_login.BROKEN.clear()
        # Cannot connect: nothing listens there.
        refused = _raised(
            sa.create_engine(
                url.set(host="127.0.0.1", port=1), connect_args={"connect_timeout": 2}
            ).connect
        )
        with engine.connect() as conn:
            bad_sql = _raised(lambda: conn.execute(sa.text("SELECT * FROM no_such_table")))
    finally:
        engine.dispose()
    assert isinstance(via_pool, RuntimeError) and "cryptography" in str(via_pool)
    assert isinstance(raw, RuntimeError)
    for exc in (via_pool, raw, refused):
        assert classify(exc) is Classification.UNAVAILABLE, repr(exc)
    assert classify(bad_sql) is Classification.PERMANENT  # the statement's fault: a bug


class Effects(Consumer):
    """Writes one ``effects`` row per message through ``message.tx``; counts the calls."""

    def __init__(self, settings: ConsumerSettings, engine: sa.Engine) -> None:
        super().__init__(settings, engine=engine)
        self.calls = 0

    def handle(self, message: Message) -> None:
        self.calls += 1
        message.tx.execute(
            effects.insert().values(
                event_id=message.event_id or "",
                kafka_partition=message.partition,
                kafka_offset=message.offset,
                pid=0,
            )
        )


def _count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(effects)).scalar_one())


@pytest.mark.integration
def test_a_failing_database_login_waits_instead_of_dead_lettering_every_message(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    engine: sa.Engine,
    db_url: str,
    run_consumer: Any,
    logins: None,
) -> None:
    apply_schema(engine, shards=8)
    effects.metadata.create_all(engine)
    topic = kafka_topics(1)
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    group = f"g-{topic}"
    own = sa.create_engine(db_url, pool_pre_ping=True)
    consumer = Effects(settings(group_id=group, topics=(topic,), inbox=True, max_attempts=2), own)
    try:
        with run_consumer(consumer) as running:
            wait_for(lambda: consumer.lifecycle.state.value == "running", 20, what="running")
            # "The server restarted": every pooled connection is gone, and each new
            # login fails the way MySQL 8's does without cryptography.
            broken_login.BROKEN.set()
            own.dispose()
            produce(kafka_bootstrap, topic, [(b"k", b"a", "e-1"), (b"k", b"b", "e-2")])
            wait_for(lambda: broken_login.failures >= 6, 30, what="several failed logins")
            assert read_all(kafka_bootstrap, dlq, expect=0) == []
            assert committed(kafka_bootstrap, group, topic, 1) == {0: -1001}
            broken_login.BROKEN.clear()
            wait_for(lambda: _count(engine) == 2, 30, what="both messages handled")
            wait_for(
                lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 2},
                20,
                0.2,
                what="offset 2 committed",
            )
            assert running.stop() == 0
    finally:
        own.dispose()
    assert consumer.calls == 2  # the handler ran once per message, after the recovery
    assert read_all(kafka_bootstrap, dlq, expect=0) == []


@pytest.mark.integration
def test_a_failing_database_login_at_start_is_a_dependency_error(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    engine: sa.Engine,
    db_url: str,
    logins: None,
) -> None:
    apply_schema(engine, shards=8)
    topic = kafka_topics(1)
    broken_login.BROKEN.set()
    consumer = Consumer(settings(group_id=f"g-{topic}", topics=(topic,), inbox=True, db_url=db_url))
    assert consumer.run(handle_signals=False) == EXIT_DEPENDENCY


class _AsyncNoop(Consumer):
    async def handle(self, message: Message) -> None:
        return None


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_login_the_server_refuses_at_start_is_a_config_error(
    kind: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    engine: sa.Engine,
    db_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wrong password is the URL's fault, not the server's: exit 2 with what to
    fix, the password nowhere in it (a refused login is not the driver failing to
    log in at all, as above: that one stays a dependency error)."""
    apply_schema(engine, shards=8)
    topic = kafka_topics(1)
    wrong = f"Wrong-{sa.make_url(db_url).password}-Pw"
    url = sa.make_url(db_url).set(password=wrong).render_as_string(hide_password=False)
    cls = Consumer if kind == "sync" else _AsyncNoop
    consumer = cls(settings(group_id=f"g-{topic}", topics=(topic,), inbox=True, db_url=url))
    assert consumer.run(handle_signals=False) == EXIT_CONFIG
    failed = [r.getMessage() for r in caplog.records if "start-failed" in r.getMessage()]
    assert failed, [r.getMessage() for r in caplog.records][-5:]
    user = sa.make_url(db_url).username
    assert f"refused the login of user '{user}'" in failed[0] and "config" in failed[0]
    assert all(wrong not in r.getMessage() for r in caplog.records)
