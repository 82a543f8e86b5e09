"""Which outbox this is: the name every shared coordination key carries.

Services share one Redis and one database server, each with its own outbox and,
usually, the default table name. Shard leases and their member set, advisory
locks and wake-up channels are therefore named by the outbox's **identity**,
read from the database the process is connected to, never from the URL text:

* MySQL/MariaDB: ``DATABASE()`` and the table (``orders.outbox_events``);
* PostgreSQL: ``current_database()``, the schema the table resolves to on the
  session's ``search_path`` and the table (``orders.public.outbox_events``).

Two URLs for one server (a proxy and a direct address, a DNS alias) give one
identity, so their relays share ownership and per-key order holds. The
server itself is deliberately *not* part of the name: it changes on a failover
to a replica, which must not split ownership either. It is the
**fingerprint** instead (PostgreSQL's ``system_identifier``, MySQL's
``@@server_uuid``, MariaDB's ``@@server_uid``, else ``hostname:port:server_id``):
relays record it beside their membership, and one that finds a member of its
ownership with another fingerprint reports the ambiguity (two servers whose
outboxes have the same database and table names sharing one Redis and prefix;
or, for a moment, a failover) instead of silently splitting shards with it.

:attr:`OutboxIdentity.key` is the text used in names: each part keeps
``[A-Za-z0-9_$-]`` and percent-encodes every other byte, so ``.`` and ``:``
separate parts and never occur inside one.
"""

from __future__ import annotations

import dataclasses

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outboxkit.runtime.errors import ConfigError
from outboxkit.schema.table import validate_identifier

__all__ = ["OutboxIdentity", "escape_part", "read_fingerprint", "read_identity"]

_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_$-")


def escape_part(part: str) -> str:
    """``part`` with every character outside ``[A-Za-z0-9_$-]`` percent-encoded
    (its UTF-8 bytes), so it can sit between ``.`` and ``:`` separators."""
    return "".join(
        c if c in _PLAIN else "".join(f"%{b:02X}" for b in c.encode("utf-8")) for c in part
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OutboxIdentity:
    """An outbox as the database names it; see the module docstring."""

    database: str
    #: The table's schema on PostgreSQL; None on MySQL/MariaDB (a database is one).
    schema: str | None
    table: str

    @property
    def key(self) -> str:
        """``database.table`` or ``database.schema.table``, each part escaped."""
        parts = [self.database, *(() if self.schema is None else (self.schema,)), self.table]
        return ".".join(escape_part(p) for p in parts)

    def __str__(self) -> str:
        return self.key


_PG_IDENTITY = sa.text(
    "SELECT current_database(), COALESCE("
    "(SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
    " WHERE c.oid = to_regclass(quote_ident(:t))), current_schema())"
)


def read_identity(conn: Connection, table: str) -> OutboxIdentity:
    """The identity of the outbox ``table`` as ``conn``'s session sees it.

    Raises :class:`ConfigError` when the session has no current database (a
    MySQL URL without a database name): an unqualified outbox table would not
    resolve either.
    """
    validate_identifier(table)
    if conn.dialect.name == "postgresql":
        row = conn.execute(_PG_IDENTITY, {"t": table}).one()
        return OutboxIdentity(database=str(row[0]), schema=str(row[1]), table=table)
    if conn.dialect.name == "sqlite":  # one file, one writer: the table is the outbox
        return OutboxIdentity(database="main", schema=None, table=table)
    database = conn.execute(sa.text("SELECT DATABASE()")).scalar()
    if not database:
        raise ConfigError("the database URL names no database: the outbox table cannot resolve")
    return OutboxIdentity(database=str(database), schema=None, table=table)


def _first(conn: Connection, *statements: str) -> str | None:
    """The first non-empty answer of ``statements``, each in a savepoint (an error
    must not end the caller's transaction on PostgreSQL); None if none answers."""
    for statement in statements:
        try:
            with conn.begin_nested():
                value = conn.execute(sa.text(statement)).scalar()
        except sa.exc.DBAPIError:
            continue
        if value not in (None, ""):
            return str(value)
    return None


def read_fingerprint(conn: Connection) -> str | None:
    """Which server ``conn`` reached, stably across reconnects and addresses; None
    when the server will not say. Changes on a failover (that is its purpose)."""
    if conn.dialect.name == "postgresql":
        return _first(conn, "SELECT system_identifier::text FROM pg_control_system()")
    if conn.dialect.name != "mysql":
        return None
    return _first(
        conn,
        "SELECT @@server_uuid",  # MySQL
        "SELECT @@server_uid",  # MariaDB >= 10.3
        "SELECT CONCAT(@@hostname, ':', @@port, ':', @@server_id)",
    )
