"""Connection habits shared by the code that changes rows outside the relay loop
(admin commands and retention)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.engine import Connection, Engine

__all__ = ["gentle_connection"]


@contextmanager
def gentle_connection(engine: Engine) -> Iterator[Connection]:
    """A connection at READ COMMITTED where the database has it.

    Under InnoDB's default REPEATABLE READ, locking reads and DELETEs take gap
    locks that can make the service's inserts and the relay's status changes
    wait; READ COMMITTED locks only the rows actually read or changed.
    """
    with engine.connect() as conn:
        if conn.dialect.name in ("mysql", "mariadb", "postgresql"):
            conn = conn.execution_options(isolation_level="READ COMMITTED")
        yield conn
