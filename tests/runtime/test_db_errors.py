"""Which database errors mean "a lock conflict": read from errors the servers
really raise, so a driver or server that reports them differently shows here."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases

from outboxkit.runtime.db import deadlocked, lock_wait_timed_out

pytestmark = [pytest.mark.integration, on_both_databases]


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


def test_other_errors_are_neither(engine: sa.Engine, two_rows: str) -> None:
    with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as caught:
        conn.execute(sa.text("SELECT no_such_column FROM lock_probe"))
    for exc in (caught.value, ValueError("1205"), RuntimeError()):
        assert not lock_wait_timed_out(exc)
        assert not deadlocked(exc)
