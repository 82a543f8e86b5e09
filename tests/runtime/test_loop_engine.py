"""The loop engine (relay claim and finalize, the consumer's inbox): a pooled
connection is pinged only after it sat idle, and rolled back on return only
while the server says a transaction is open. Real MariaDB and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases
from support.dbsql import connection_id, kill_connection
from support.waiting import wait_for

from outboxkit.runtime.db import create_loop_engine, transaction_open

pytestmark = [pytest.mark.integration, on_both_databases]

IDLE = 0.3


@pytest.fixture
def loop_engine(db_url: str) -> Iterator[sa.Engine]:
    eng = create_loop_engine(db_url, ping_after_idle=IDLE, pool_size=1, max_overflow=0)
    yield eng
    eng.dispose()


@pytest.fixture
def admin(db_url: str) -> Iterator[sa.Engine]:
    eng = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
    yield eng
    eng.dispose()


def _kill(admin: sa.Engine, session: int) -> None:
    with admin.connect() as conn:
        kill_connection(conn, session)
        postgres = conn.dialect.name == "postgresql"
        alive = (
            "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = :s"
            if postgres
            else "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = :s"
        )
        wait_for(
            lambda: conn.execute(sa.text(alive), {"s": session}).scalar_one() == 0,
            timeout=10,
            what=f"session {session} to end",
        )


def _session(engine: sa.Engine) -> int:
    with engine.begin() as conn:
        return connection_id(conn)


def test_a_connection_killed_while_idle_is_replaced_before_use(
    loop_engine: sa.Engine, admin: sa.Engine
) -> None:
    first = _session(loop_engine)
    returned = time.monotonic()
    _kill(admin, first)
    time.sleep(max(0.0, returned + IDLE * 2 - time.monotonic()))  # idle past the bound
    second = _session(loop_engine)  # pinged, found dead, replaced: no error
    assert second != first


def test_a_connection_used_a_moment_ago_is_not_pinged(db_url: str, admin: sa.Engine) -> None:
    # The price of skipping the ping: a server that dropped a hot connection is
    # seen by the next statement, as a disconnect, and the pool starts afresh.
    eng = create_loop_engine(db_url, ping_after_idle=3600, pool_size=1, max_overflow=0)
    try:
        first = _session(eng)
        _kill(admin, first)
        with pytest.raises(sa.exc.OperationalError) as raised:
            _session(eng)
        assert raised.value.connection_invalidated
        assert _session(eng) != first
    finally:
        eng.dispose()


def test_a_committed_transaction_is_not_rolled_back_on_return(
    loop_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with loop_engine.connect() as conn:
        driver = type(conn.connection.dbapi_connection)
    rollbacks: list[object] = []
    original = driver.rollback

    def counting(self: Any) -> None:
        rollbacks.append(self)
        original(self)

    monkeypatch.setattr(driver, "rollback", counting)
    for _ in range(5):
        with loop_engine.begin() as conn:
            conn.execute(sa.text("SELECT 1"))
    assert rollbacks == []
    with pytest.raises(RuntimeError), loop_engine.begin() as conn:  # still rolls back
        conn.execute(sa.text("SELECT 1"))
        raise RuntimeError("boom")
    assert len(rollbacks) == 1


def test_an_open_transaction_is_rolled_back_on_return(
    loop_engine: sa.Engine, admin: sa.Engine
) -> None:
    with admin.connect() as conn:
        conn.execute(sa.text("CREATE TABLE loop_engine_t (id INTEGER PRIMARY KEY)"))
    raw = loop_engine.raw_connection()  # no Connection to roll it back
    cursor = raw.cursor()
    cursor.execute("INSERT INTO loop_engine_t (id) VALUES (1)")
    cursor.close()
    assert transaction_open(raw.dbapi_connection) is True
    raw.close()  # back to the pool: the reset must roll the INSERT back
    with loop_engine.begin() as conn:  # the same connection (pool of one), then COMMIT
        conn.execute(sa.text("SELECT 1"))
    with admin.connect() as conn:
        assert conn.execute(sa.text("SELECT COUNT(*) FROM loop_engine_t")).scalar_one() == 0
