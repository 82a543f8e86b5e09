"""The outbox, metadata and inbox tables, defined once in SQLAlchemy Core.

Every timestamp is written from the database clock in UTC (``db_now()``), never
from the pod clock and never from the session time zone, so relays in different
zones compare the same instants.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from outboxkit.errors import InvalidIdentifierError

DEFAULT_TABLE = "outbox_events"
DEFAULT_INBOX_TABLE = "outbox_inbox"
META_TABLE = "outboxkit_meta"
RECOVERY_TABLE = "outboxkit_recovery_events"
DEFAULT_SHARDS = 64
MAX_SHARDS = 4096
#: ``outboxkit_meta.package_version``: a release (``0.4.0``) or a local build
#: (``0.4.1.dev3+g1a2b3c4.d20261207``); longer ones are stored cut.
MAX_PACKAGE_VERSION_LENGTH = 64
#: SQLAlchemy's dialect names for MySQL and MariaDB: one SQL family here (types,
#: index hints, multi-row INSERTs, DDL), told apart only where the servers differ.
MYSQL_DIALECTS = ("mysql", "mariadb")
#: 2: identifiers compare byte for byte (``Identifier``); 3: payloads aside
#: (:func:`payload_table`). ``schema apply`` upgrades.
SCHEMA_VERSION = 3
#: From this version on, ``enqueue`` writes each payload aside (:func:`payload_table`).
PAYLOAD_ASIDE_VERSION = 3

#: Kafka's own limit on topic names.
MAX_TOPIC_LENGTH = 249
#: Message keys are indexed (per-key ordering), so they are bounded.
MAX_KEY_BYTES = 512
MAX_EVENT_ID_LENGTH = 64
MAX_LAST_ERROR = 1000
MAX_OWNER_LENGTH = 255
#: Inbox ``group_id`` and ``event_id`` (characters); longer ids are stored hashed.
MAX_INBOX_ID_LENGTH = 255

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class Status(enum.StrEnum):
    """Row states; stored by name (a MySQL ENUM) so SQL reads naturally."""

    PENDING = "pending"
    DELIVERING = "delivering"
    DELIVERED = "delivered"
    RETRYABLE = "retryable"
    FAILED = "failed"


STATUSES: tuple[str, ...] = tuple(s.value for s in Status)


def validate_identifier(name: str, *, what: str = "table name") -> str:
    """Return ``name`` if it is a plain SQL identifier, else raise InvalidIdentifierError."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise InvalidIdentifierError(
            f"invalid {what} {name!r}: "
            "use 1-64 characters of [A-Za-z0-9_], not starting with a digit"
        )
    return name


def identifier_problem(name: str) -> str | None:
    """``validate_identifier`` as a settings validator: the problem, or None."""
    try:
        validate_identifier(name)
    except InvalidIdentifierError as exc:
        return str(exc)
    return None


class db_now(FunctionElement[Any]):
    """The database's current UTC time with microseconds."""

    type = sa.DateTime()
    inherit_cache = True
    name = "db_now"


@compiles(db_now)
def _db_now_default(element: db_now, compiler: Any, **kw: Any) -> str:
    return "CURRENT_TIMESTAMP"


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _db_now_mysql(element: db_now, compiler: Any, **kw: Any) -> str:
    return "UTC_TIMESTAMP(6)"


@compiles(db_now, "postgresql")
def _db_now_pg(element: db_now, compiler: Any, **kw: Any) -> str:
    return "(CURRENT_TIMESTAMP AT TIME ZONE 'UTC')"


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: db_now, compiler: Any, **kw: Any) -> str:
    return "strftime('%Y-%m-%d %H:%M:%f', 'now')"


class Identifier(sa.String):
    """A VARCHAR compared byte for byte: an identifier, not prose.

    A database's default collation folds case and accents, and MySQL's ``PAD SPACE``
    collations (``utf8mb4_bin`` among them) ignore trailing spaces, so ``'ORDERS'``
    would equal ``'orders'`` and ``'x '`` would equal ``'x'`` in every ``=``, ``IN``,
    unique index and primary key. On MySQL/MariaDB the column gets a binary
    collation without padding (:func:`binary_collation`); PostgreSQL's deterministic
    collations and SQLite's ``BINARY`` already compare bytes.
    """

    cache_ok = True


def binary_collation(dialect: sa.engine.Dialect) -> str:
    """The byte-exact, NO PAD utf8mb4 collation of a MySQL or MariaDB server.

    MariaDB (10.2+) calls it ``utf8mb4_nopad_bin``; MySQL (8.0.17+) calls it
    ``utf8mb4_0900_bin``. Neither server knows the other's name.
    """
    return "utf8mb4_nopad_bin" if getattr(dialect, "is_mariadb", False) else "utf8mb4_0900_bin"


@compiles(Identifier, "mysql")
@compiles(Identifier, "mariadb")
def _identifier_mysql(element: Identifier, compiler: Any, **kw: Any) -> str:
    collation = binary_collation(compiler.dialect)
    return f"VARCHAR({element.length}) CHARACTER SET utf8mb4 COLLATE {collation}"


def _micros() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), *MYSQL_DIALECTS)


def _blob() -> sa.types.TypeEngine[Any]:
    return sa.LargeBinary().with_variant(mysql.LONGBLOB(), *MYSQL_DIALECTS)


def _status() -> sa.types.TypeEngine[Any]:
    return sa.Enum(*STATUSES, name="outbox_status", native_enum=True, create_constraint=False)


_METADATA = sa.MetaData()

meta_table = sa.Table(
    META_TABLE,
    _METADATA,
    sa.Column("table_name", Identifier(64), primary_key=True),
    sa.Column("shard_count", sa.Integer, nullable=False),
    sa.Column("schema_version", sa.Integer, nullable=False),
    sa.Column("created_at", _micros(), nullable=False),
    # The outboxkit version whose `schema apply` last ran on the table (from 0.4.0;
    # NULL when none since). NULL-able and read by name only where shown (admin
    # status), so relays and writers of 0.3.0 and earlier, which select the
    # columns above by name and insert without it, work beside it unchanged.
    sa.Column("package_version", sa.String(MAX_PACKAGE_VERSION_LENGTH), nullable=True),
)


def key_status_index(table: str) -> str:
    """The name of the outbox table's ``(message_key, status, id)`` index."""
    return f"ix_{table}_key_status"


#: PostgreSQL storage parameters of the outbox table: vacuum it every 20,000
#: dead row versions, unthrottled, instead of every 20 % of the table, slowly.
#:
#: Each status change leaves a dead row version and dead entries in both status
#: indexes; the claim's ``(status, id)`` range scans and its reads of the
#: leased keys step over them until VACUUM removes them. With the server's
#: defaults (scale factor 0.2, cost delay 2 ms) a 1,000,000-row drain piled up
#: 1.3 million dead rows and its last 10 % went at 0.80 x the rate of its first
#: (docs/performance.md, round eleven). ``schema apply`` sets the ones a table
#: lacks and leaves any value an operator set alone.
PG_OUTBOX_AUTOVACUUM: dict[str, str] = {
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "20000",
    "autovacuum_vacuum_cost_delay": "0",
}


def undelivered(t: sa.FromClause) -> sa.ColumnElement[bool]:
    """``t.status IS DISTINCT FROM 'delivered'``, the status written as a constant:
    on PostgreSQL the predicate of the per-key index ``(message_key, status, id)``,
    and the condition the per-key probes state to use it.

    The index then holds only rows not yet delivered: marking a row delivered
    writes no entry into it, and it stays the size of the backlog however much
    delivered history the table keeps.

    A query can use a partial index only when the planner proves its conditions
    imply the predicate, and with statistics taken while no row was waiting
    PostgreSQL believes a partial index empty and scans all of it for anything
    it may: written ``status <> 'delivered'``, the ordering sample's blockers
    (``status = 'retryable' OR ...``) read every waiting row through it. Written
    ``IS DISTINCT FROM``, which the planner does not derive from comparisons of
    the status, only the probes reach it, stating this expression word for word.
    The ``(status, id)`` index stays whole for the same reason (a probe must not
    be able to scan it), and the purge reads delivered rows through it.
    """
    return t.c.status.is_distinct_from(
        sa.literal_column(f"'{Status.DELIVERED.value}'", sa.String())
    )


@functools.cache
def outbox_table(name: str = DEFAULT_TABLE) -> sa.Table:
    """The outbox table called ``name`` (one shared definition, cached per name).

    Indexes:

    * ``(status, id)``: the claim scans each eligible status in id order and stops
      after ``batch_size`` rows, so its cost does not grow with delivered history;
    * ``(message_key, status, id)``: "is there an earlier undelivered row for this
      key?", the per-key ordering check; on PostgreSQL only of undelivered rows
      (see :func:`undelivered`);
    * unique ``event_id``: the idempotency key.
    """
    validate_identifier(name)
    md = sa.MetaData()
    t = sa.Table(
        name,
        md,
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("event_id", Identifier(MAX_EVENT_ID_LENGTH), nullable=False),
        sa.Column("topic", Identifier(MAX_TOPIC_LENGTH), nullable=False),
        sa.Column(
            "message_key",
            sa.LargeBinary(MAX_KEY_BYTES).with_variant(
                mysql.VARBINARY(MAX_KEY_BYTES), *MYSQL_DIALECTS
            ),
            nullable=True,
        ),
        # NULL: the payload and headers are in the payload table (payload_table).
        sa.Column("payload", _blob(), nullable=True),
        sa.Column("headers", sa.Text(), nullable=True),
        sa.Column("shard", sa.SmallInteger(), nullable=False),
        sa.Column("status", _status(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_attempt_at", _micros(), nullable=False),
        sa.Column("lease_owner", Identifier(MAX_OWNER_LENGTH), nullable=True),
        sa.Column("lease_token", Identifier(32), nullable=True),
        sa.Column("lease_expires_at", _micros(), nullable=True),
        sa.Column("last_error", sa.String(MAX_LAST_ERROR), nullable=True),
        sa.Column("created_at", _micros(), nullable=False),
        sa.Column("updated_at", _micros(), nullable=False),
        sa.Column("delivered_at", _micros(), nullable=True),
        sa.Column("kafka_partition", sa.Integer(), nullable=True),
        sa.Column("kafka_offset", sa.BigInteger(), nullable=True),
        sa.UniqueConstraint("event_id", name=f"uq_{name}_event_id"),
        sa.Index(f"ix_{name}_status_id", "status", "id"),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
        postgresql_with=dict(PG_OUTBOX_AUTOVACUUM),
    )
    # The probes state the predicate with the same function (see undelivered).
    sa.Index(
        key_status_index(name),
        t.c.message_key,
        t.c.status,
        t.c.id,
        postgresql_where=undelivered(t),
    )
    return t


def payload_table_name(table: str) -> str:
    """The name of the payload table of the outbox table ``table``."""
    return f"{validate_identifier(table)}_payload"


@functools.cache
def payload_table(table: str = DEFAULT_TABLE) -> sa.Table:
    """The payloads and headers of the outbox table ``table``'s rows, by event id.

    ``enqueue`` writes an event's row with ``payload`` and ``headers`` NULL and
    puts them here, in the same transaction. A status change then rewrites and
    logs only the narrow state row, never the payload: with the binary log on in
    row format and full images, each status change logged the whole row, payload
    included, before and after (docs/performance.md). Nothing here changes
    after the insert; the row goes when its event's row is deleted (delete on
    deliver, the retention purge, ``admin discard``), in the same transaction.

    Rows written before this table existed, or by another writer, keep their
    payload in the outbox table's own columns: a row whose ``payload`` is not
    NULL is read from there. Keyed by ``event_id`` (the writer knows it before
    the insert; the row's ``id`` only after it)."""
    t = outbox_table(table)
    md = sa.MetaData()
    return sa.Table(
        payload_table_name(table),
        md,
        sa.Column("event_id", Identifier(MAX_EVENT_ID_LENGTH), primary_key=True),
        sa.Column("payload", t.c.payload.type, nullable=False),
        sa.Column("headers", sa.Text(), nullable=True),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


def stored_payload(
    t: sa.FromClause, p: sa.FromClause
) -> tuple[sa.ColumnElement[Any], sa.ColumnElement[Any]]:
    """An outbox row's payload and headers, of ``t`` outer-joined to its payload
    table ``p`` on ``event_id``: the row's own when its ``payload`` is not NULL,
    else its payload row's (NULL when it has none)."""
    in_row = t.c.payload.is_not(None)
    return (
        sa.func.coalesce(t.c.payload, p.c.payload),
        sa.case((in_row, t.c.headers), else_=p.c.headers),
    )


def outbox_rows_query(table: str = DEFAULT_TABLE) -> sa.Select[Any]:
    """Every column of the outbox table ``table`` (in its order), each row's
    ``payload`` and ``headers`` read wherever it keeps them (see
    :func:`stored_payload`): what a query of the table showed before the payload
    table existed. Add ``where``/``order_by`` as needed."""
    t = outbox_table(table)
    p = payload_table(table)
    payload, headers = stored_payload(t, p)
    resolved = {"payload": payload.label("payload"), "headers": headers.label("headers")}
    return sa.select(*(resolved.get(c.name, c) for c in t.columns)).select_from(
        t.outerjoin(p, p.c.event_id == t.c.event_id)
    )


def delete_payloads(conn: sa.Connection, table: str, event_ids: Sequence[str]) -> int:
    """Delete the payload rows of ``event_ids`` whose outbox row is gone; call it in
    the transaction that deleted those outbox rows, after the DELETE. A payload
    row whose event's row is still there (a DELETE that did not match it) stays.
    Returns the number deleted."""
    if not event_ids:
        return 0
    t = outbox_table(table)
    p = payload_table(table)
    gone = ~sa.exists().where(t.c.event_id == p.c.event_id)
    stmt = p.delete().where(p.c.event_id.in_(sa.bindparam("event_ids", expanding=True)), gone)
    return int(conn.execute(stmt, {"event_ids": list(event_ids)}).rowcount)


@functools.cache
def inbox_table(name: str = DEFAULT_INBOX_TABLE) -> sa.Table:
    """Consumer-side dedup: one row per ``(group_id, event_id)`` processed."""
    validate_identifier(name)
    md = sa.MetaData()
    return sa.Table(
        name,
        md,
        sa.Column("group_id", Identifier(MAX_INBOX_ID_LENGTH), primary_key=True),
        sa.Column("event_id", Identifier(MAX_INBOX_ID_LENGTH), primary_key=True),
        sa.Column("topic", Identifier(MAX_TOPIC_LENGTH), nullable=True),
        sa.Column("kafka_partition", sa.Integer(), nullable=True),
        sa.Column("kafka_offset", sa.BigInteger(), nullable=True),
        sa.Column("processed_at", _micros(), nullable=False),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


@functools.cache
def recovery_table() -> sa.Table:
    """Recovery events (lease reclaims, requeues, purges); see ``schema.recovery``."""
    md = sa.MetaData()
    return sa.Table(
        RECOVERY_TABLE,
        md,
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("at", _micros(), nullable=False),
        sa.Column("kind", Identifier(64), nullable=False),
        sa.Column("node_id", Identifier(MAX_OWNER_LENGTH), nullable=False),
        sa.Column("table_name", Identifier(64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )
