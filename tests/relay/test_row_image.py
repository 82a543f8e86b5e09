"""``--binlog-row-image``: what the relay's status changes write to the binary log.

With the binary log on in row format and full row images (production's usual
MySQL/MariaDB), each status change logs the whole row before and after it. A
row as ``enqueue`` writes it keeps its payload in the payload table, so that is
small; a row with the payload in it (release 2's, or another writer's) logs the
payload each time. ``noblob`` and ``minimal``, set on the relay's own sessions,
leave the unchanged payload out; the writer's inserts are its own sessions and
log as the server says.

Real MariaDB (one instance with the binary log on, row format, full images),
Kafka.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay, add_events, consume, fast_settings, status_counts, wait_for
from support.services import MariaDBInstance, free_port

from bench.dblog import LogMeter
from outboxkit import Event
from outboxkit.relay.engine import check_row_image, create_engine
from outboxkit.relay.settings import RelaySettings
from outboxkit.schema import apply_schema, payload_table

pytestmark = pytest.mark.integration

ROWS = 120
PAYLOAD = 2000  # random bytes per event (nothing compresses them): the row images' bulk


@pytest.fixture(scope="module")
def binlog_url() -> Iterator[str]:
    db = MariaDBInstance(f"rowimg-{uuid.uuid4().hex[:6]}", free_port(), binlog=True)
    db.start(fresh=True)
    try:
        yield db.url
    finally:
        db.stop()
        shutil.rmtree(db.state_dir, ignore_errors=True)


def _events(topic: str) -> list[Event]:
    return [
        Event(topic=topic, key=f"k{i % 7}", payload=secrets.token_bytes(PAYLOAD))
        for i in range(ROWS)
    ]


def _into_the_rows(engine: sa.Engine, table: str) -> None:
    """Move every payload (and headers) from the payload table into its row, as
    release 2's writer stored them."""
    aside = payload_table(table).name
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"UPDATE {table} o JOIN {aside} p ON p.event_id = o.event_id"
                " SET o.payload = p.payload, o.headers = p.headers"
            )
        )
        conn.execute(sa.text(f"DELETE FROM {aside}"))


@pytest.mark.parametrize("layout", ["aside", "in-row"])
@pytest.mark.parametrize("image", ["server", "noblob", "minimal"])
def test_the_relay_logs_the_row_images_it_is_told_to(
    binlog_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
    image: str,
    layout: str,
) -> None:
    engine = sa.create_engine(binlog_url)
    table = f"outbox_{image}_{layout.replace('-', '_')}"
    try:
        apply_schema(engine, table=table, shards=4)
        topic = kafka_topics(partitions=2)
        events = _events(topic)
        writer = LogMeter(engine).begin()
        add_events(engine, table, events)
        written = writer.bytes()
        assert written is not None and written >= ROWS * PAYLOAD
        if layout == "in-row":
            _into_the_rows(engine, table)

        relay_log = LogMeter(engine).begin()
        settings = fast_settings(binlog_url, kafka_bootstrap, table=table, binlog_row_image=image)
        relay = embedded(settings)
        wait_for(
            lambda: status_counts(engine, table) == {"delivered": ROWS},
            timeout=30,
            what="every row delivered",
        )
        assert relay.stop() == 0
        logged = relay_log.bytes()
        assert logged is not None

        # Every event reached Kafka whole, whatever the log kept of the row.
        got = consume(kafka_bootstrap, topic, expected=ROWS)
        assert sorted(m.value for m in got) == sorted(e.payload for e in events)
        if image == "server" and layout == "in-row":
            # Two status changes, each logging the row before and after: the
            # payload four times over.
            assert logged >= 2 * ROWS * PAYLOAD, (logged, written)
        else:
            # The payload is in the writer's insert alone (the payload row, or
            # the row as inserted): the relay's images together are smaller
            # than half of one payload per row.
            assert logged < ROWS * PAYLOAD // 2, (logged, written)
    finally:
        engine.dispose()


def test_a_session_set_to_the_image_asked_for(binlog_url: str, kafka_bootstrap: str) -> None:
    for image, expected in (("noblob", "NOBLOB"), ("minimal", "MINIMAL"), ("server", "FULL")):
        engine = create_engine(
            RelaySettings(
                db_url=binlog_url, kafka_bootstrap=kafka_bootstrap, binlog_row_image=image
            )
        )
        try:
            with engine.connect() as conn:
                got = conn.execute(sa.text("SELECT @@session.binlog_row_image")).scalar_one()
            assert got == expected
        finally:
            engine.dispose()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "outboxkit_event", None) == "engine-settings"]


@dataclass
class RelayUser:
    """A database user with DML grants on the instance's database (and, with
    ``binlog_admin``, the privilege to set its sessions' row image)."""

    url: str
    password: str
    grantee: str


@pytest.fixture
def admin(binlog_url: str) -> Iterator[sa.Engine]:
    """The instance's administrator (all privileges): schema, users, grants, rows."""
    engine = sa.create_engine(binlog_url)
    yield engine
    engine.dispose()


@pytest.fixture
def relay_user(binlog_url: str, admin: sa.Engine) -> Iterator[Callable[[bool], RelayUser]]:
    made: list[str] = []

    def make(binlog_admin: bool) -> RelayUser:
        user, password = f"relay_{uuid.uuid4().hex[:8]}", secrets.token_hex(8)
        grantee = f"'{user}'@'127.0.0.1'"
        database = sa.make_url(binlog_url).database
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE USER {grantee} IDENTIFIED BY '{password}'"))
            made.append(grantee)
            conn.execute(
                sa.text(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {database}.* TO {grantee}")
            )
            if binlog_admin:
                conn.execute(sa.text(f"GRANT BINLOG ADMIN ON *.* TO {grantee}"))
        url = sa.make_url(binlog_url).set(username=user, password=password)
        return RelayUser(url.render_as_string(hide_password=False), password, grantee)

    yield make
    with admin.begin() as conn:
        for grantee in made:
            conn.execute(sa.text(f"DROP USER IF EXISTS {grantee}"))


@pytest.fixture
def noblob_relay(
    admin: sa.Engine,
    kafka_bootstrap: str,
    embedded: Callable[..., EmbeddedRelay],
    caplog: pytest.LogCaptureFixture,
) -> Callable[[str, RelayUser], EmbeddedRelay]:
    """Start a relay as ``user`` on a new outbox ``table``, asking for NOBLOB images."""
    caplog.set_level(logging.INFO, logger="outboxkit")

    def start(table: str, user: RelayUser) -> EmbeddedRelay:
        apply_schema(admin, table=table, shards=4)
        return embedded(
            fast_settings(user.url, kafka_bootstrap, table=table, binlog_row_image="noblob")
        )

    return start


def _deliver(engine: sa.Engine, table: str, events: list[Event], total: int) -> None:
    add_events(engine, table, events)
    wait_for(
        lambda: status_counts(engine, table) == {"delivered": total},
        timeout=30,
        what="every row delivered",
    )


def _said_refused(warned: logging.LogRecord, password: str) -> None:
    fields = warned.outboxkit_fields  # type: ignore[attr-defined]
    assert fields["differing"] == {"binlog_row_image": "FULL"}
    assert fields["wanted"] == {"binlog_row_image": "NOBLOB"}
    assert "BINLOG ADMIN" in fields["advice"]
    assert password not in warned.getMessage()


def test_a_user_without_the_privilege_runs_with_the_servers_image_and_is_told(
    admin: sa.Engine,
    kafka_topics: Callable[..., str],
    relay_user: Callable[[bool], RelayUser],
    noblob_relay: Callable[[str, RelayUser], EmbeddedRelay],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The relay's user may not set the session's image (BINLOG ADMIN on
    MariaDB): the relay starts and delivers as with ``server``, and says once,
    at start, what it could not set and the grant that would."""
    table, user = "outbox_plain_user", relay_user(False)
    relay = noblob_relay(table, user)
    _deliver(admin, table, _events(kafka_topics(partitions=1))[:10], 10)
    assert relay.stop() == 0
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    _said_refused(warned[0], user.password)


def test_a_privilege_revoked_while_the_relay_runs_is_said_when_a_session_reconnects(
    admin: sa.Engine,
    kafka_topics: Callable[..., str],
    relay_user: Callable[[bool], RelayUser],
    noblob_relay: Callable[[str, RelayUser], EmbeddedRelay],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Started with the privilege, the relay says nothing; once it is revoked,
    the next new session (here: after the pool was emptied, as after a
    database restart) keeps the server's image, and the relay says so once and
    goes on delivering."""
    table, user = "outbox_revoked", relay_user(True)
    events = _events(kafka_topics(partitions=1))[:20]
    relay = noblob_relay(table, user)
    _deliver(admin, table, events[:10], 10)
    assert _warnings(caplog) == []
    with admin.begin() as conn:
        conn.execute(sa.text(f"REVOKE BINLOG ADMIN ON *.* FROM {user.grantee}"))
    relay.relay.engine.dispose()  # every later statement opens a new session
    _deliver(admin, table, events[10:], 20)
    assert relay.stop() == 0
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    _said_refused(warned[0], user.password)


@pytest.mark.parametrize("init", [False, True])
def test_an_engine_passed_in_is_checked_not_changed(
    binlog_url: str, caplog: pytest.LogCaptureFixture, init: bool
) -> None:
    """An engine given to ``Relay(..., engine=...)`` is the caller's: the relay
    does not set its sessions, it says at start how to (``init_command``)."""
    caplog.set_level(logging.INFO, logger="outboxkit")
    args = {"init_command": "SET SESSION binlog_row_image='NOBLOB'"} if init else {}
    given = sa.create_engine(binlog_url, connect_args=args)
    try:
        with given.connect() as conn:
            check_row_image(conn, wanted="noblob", own_engine=False)
    finally:
        given.dispose()
    warned = _warnings(caplog)
    if init:
        assert warned == []
    else:
        assert len(warned) == 1
        advice = warned[0].outboxkit_fields["advice"]  # type: ignore[attr-defined]
        assert "init_command" in advice and "NOBLOB" in advice


def test_postgresql_has_no_binary_log_to_set() -> None:
    problems = RelaySettings(
        db_url="postgresql+psycopg://relay@db/app",
        kafka_bootstrap="127.0.0.1:9092",
        binlog_row_image="noblob",
    ).validate()
    assert problems == [
        "invalid --binlog-row-image / OUTBOXKIT_BINLOG_ROW_IMAGE: MySQL/MariaDB only: "
        "PostgreSQL has no binary log (leave it at server)"
    ]
