"""SQL that tests need and each database spells its own way.

For tests that run on MariaDB and PostgreSQL (:data:`support.databases.on_both_databases`):
a point of the database's UTC clock, and a server connection's id and how to kill it.
"""

from __future__ import annotations

import sqlalchemy as sa

__all__ = ["connection_id", "db_time", "kill_connection"]


def db_time(bind: sa.Engine | sa.Connection, offset_s: float = 0.0) -> sa.TextClause:
    """The database's UTC time (microseconds) plus ``offset_s`` (negative: in the past)."""
    micros = int(offset_s * 1_000_000)
    if bind.dialect.name == "postgresql":
        return sa.text(
            f"((CURRENT_TIMESTAMP AT TIME ZONE 'UTC') + INTERVAL '{micros} microseconds')"
        )
    return sa.text(f"(UTC_TIMESTAMP(6) + INTERVAL {micros} MICROSECOND)")


def connection_id(conn: sa.Connection) -> int:
    """The server's id of ``conn``'s session (a thread id, or a backend pid)."""
    postgres = conn.dialect.name == "postgresql"
    query = "SELECT pg_backend_pid()" if postgres else "SELECT CONNECTION_ID()"
    return int(conn.exec_driver_sql(query).scalar_one())


def kill_connection(admin: sa.Connection, conn_id: int) -> None:
    """Make the server drop session ``conn_id`` (from :func:`connection_id`)."""
    if admin.dialect.name == "postgresql":
        admin.exec_driver_sql(f"SELECT pg_terminate_backend({int(conn_id)})")
    else:
        admin.exec_driver_sql(f"KILL {int(conn_id)}")
