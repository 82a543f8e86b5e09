"""Which database errors mean "a lock conflict" or "the connection is gone": read
from errors the servers really raise, through every driver (PyMySQL and
mysqlclient on MariaDB, psycopg on PostgreSQL), so a driver or server that
reports them differently shows here; and the bound that makes a lock wait give up."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from support.databases import on_every_driver

from outboxkit.runtime.db import deadlocked, lock_wait_bound, lock_wait_timed_out
from outboxkit.runtime.errors import is_infrastructure_error

pytestmark = [pytest.mark.integration, on_every_driver]


def _short_lock_wait(conn: sa.Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SET lock_timeout = '200ms'"))
    else:
        conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))


@pytest.fixture
def two_rows(engine: sa.Engine) -> str:
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE IF EXISTS lock_probe"))
        conn.execute(sa.text("CREATE TABLE lock_probe (id INT PRIMARY KEY, n INT)"))
        conn.execute(sa.text("INSERT INTO lock_probe VALUES (1, 0), (2, 0)"))
    return "lock_probe"


def _bump(conn: sa.Connection, row: int) -> None:
    conn.execute(sa.text("UPDATE lock_probe SET n = n + 1 WHERE id = :id"), {"id": row})


def test_a_lock_wait_that_gives_up_is_told_apart(engine: sa.Engine, two_rows: str) -> None:
    with engine.connect() as holder, engine.connect() as waiter:
        _bump(holder, 1)
        _short_lock_wait(waiter)
        with pytest.raises(sa.exc.DBAPIError) as caught:
            _bump(waiter, 1)
        holder.rollback()
        waiter.rollback()
    assert lock_wait_timed_out(caught.value)
    assert not deadlocked(caught.value)


def test_a_deadlock_is_told_apart(engine: sa.Engine, two_rows: str) -> None:
    both_hold_one = threading.Barrier(2, timeout=30)

    def side(first: int, second: int) -> BaseException | None:
        with engine.connect() as conn:
            try:
                _bump(conn, first)
                both_hold_one.wait()
                _bump(conn, second)
                conn.commit()
            except sa.exc.DBAPIError as exc:
                conn.rollback()
                return exc
        return None

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(side, 1, 2), pool.submit(side, 2, 1)
        errors = [e for e in (a.result(timeout=60), b.result(timeout=60)) if e is not None]
    assert len(errors) == 1, errors  # the server fails one side; the other commits
    assert deadlocked(errors[0])
    assert not lock_wait_timed_out(errors[0])


def test_a_connection_the_server_killed_is_a_dependency_failure(
    engine: sa.Engine, two_rows: str
) -> None:
    with engine.connect() as victim, engine.connect() as killer:
        if engine.dialect.name == "postgresql":
            pid = victim.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            killer.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        else:
            pid = victim.execute(sa.text("SELECT CONNECTION_ID()")).scalar_one()
            killer.execute(sa.text(f"KILL CONNECTION {int(pid)}"))
        killer.commit()
        with pytest.raises(sa.exc.DBAPIError) as caught:
            _bump(victim, 1)
    assert is_infrastructure_error(caught.value)
    assert is_infrastructure_error(caught.value.orig)  # the driver's own, unwrapped
    assert not lock_wait_timed_out(caught.value)
    assert not deadlocked(caught.value)


def test_other_errors_are_neither(engine: sa.Engine, two_rows: str) -> None:
    with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as caught:
        conn.execute(sa.text("SELECT no_such_column FROM lock_probe"))
    for exc in (caught.value, ValueError("1205"), RuntimeError()):
        assert not lock_wait_timed_out(exc)
        assert not deadlocked(exc)


def _row_lock_wait(conn: sa.Connection) -> int:
    """The session's row-lock wait: seconds (MySQL/MariaDB), ms (PostgreSQL, 0: none)."""
    if conn.dialect.name == "postgresql":
        query = "SELECT setting FROM pg_settings WHERE name = 'lock_timeout'"
    else:
        query = "SELECT @@SESSION.innodb_lock_wait_timeout"
    return int(conn.execute(sa.text(query)).scalar_one())


def _one_session(engine: sa.Engine, row_lock_wait: int) -> sa.Engine:
    """An engine of one pooled session whose own row-lock wait is ``row_lock_wait``."""
    args = (
        {"options": f"-c lock_timeout={row_lock_wait}"}
        if engine.dialect.name == "postgresql"
        else {"init_command": f"SET SESSION innodb_lock_wait_timeout = {row_lock_wait}"}
    )
    return sa.create_engine(engine.url, connect_args=args, pool_size=1, max_overflow=0)


def test_a_lock_wait_bound_ends_the_wait_then_gives_the_session_its_own_back(
    engine: sa.Engine, two_rows: str
) -> None:
    """PostgreSQL waits with no bound by default (0), MySQL/MariaDB 50 s; with
    the bound a waiting statement gives up after it, and the pooled session gets
    its own setting back afterwards (a rollback inside the block keeps the bound)."""
    pg = engine.dialect.name == "postgresql"
    setting = 0 if pg else 90  # PostgreSQL: none; MySQL/MariaDB: longer than the default
    waiter = _one_session(engine, setting)
    try:
        with engine.connect() as holder, waiter.connect() as conn:
            _bump(holder, 1)
            with lock_wait_bound(conn, 1, mysql_variable="innodb_lock_wait_timeout"):
                assert _row_lock_wait(conn) == (1000 if pg else 1)
                conn.rollback()
                with pytest.raises(sa.exc.DBAPIError) as caught:
                    _bump(conn, 1)
            holder.rollback()
        assert lock_wait_timed_out(caught.value)
        with waiter.connect() as again:  # the same session, back from the pool
            assert _row_lock_wait(again) == setting
    finally:
        waiter.dispose()


def test_a_shorter_lock_wait_of_the_session_is_kept(engine: sa.Engine) -> None:
    short = 300 if engine.dialect.name == "postgresql" else 1
    waiter = _one_session(engine, short)
    try:
        with waiter.connect() as conn:
            with lock_wait_bound(conn, 5, mysql_variable="innodb_lock_wait_timeout"):
                assert _row_lock_wait(conn) == short
            assert _row_lock_wait(conn) == short
    finally:
        waiter.dispose()


@pytest.mark.parametrize(
    ("seconds", "variable"),
    [
        (0, "innodb_lock_wait_timeout"),
        (1.5, "lock_wait_timeout"),
        (True, "lock_wait_timeout"),
        (2, "wait_timeout"),
        (2, "innodb_lock_wait_timeout; DROP TABLE x"),
    ],
)
def test_a_lock_wait_bound_refuses_what_it_cannot_set(
    engine: sa.Engine, seconds: object, variable: str
) -> None:
    with (
        engine.connect() as conn,
        pytest.raises(ValueError),
        lock_wait_bound(conn, seconds, mysql_variable=variable),  # type: ignore[arg-type]
    ):
        pass
