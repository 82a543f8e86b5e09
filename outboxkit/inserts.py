"""The writer's INSERT statements: outbox rows and, from schema version 3, their
payload rows (``schema.table.payload_table``), in the caller's transaction.

On MySQL/MariaDB each chunk of rows goes as a few multi-row ``INSERT``
statements (text compiled once per size); on PostgreSQL as an executemany,
which psycopg 3 pipelines, and one event with its ``NOTIFY`` as one statement.
The payload rows' ``INSERT`` replaces a payload row an outbox row deleted by
hand left behind (see ``_insert_payload_sql``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outboxkit.notify import channel_sql
from outboxkit.schema.table import MYSQL_DIALECTS, Status, db_now, outbox_table, payload_table

__all__ = ["ROW_COLUMNS", "insert_notifying", "insert_rows"]

#: Rows per INSERT statement, and a byte budget so one statement stays well under
#: the server's max_allowed_packet.
_CHUNK_ROWS = 1000
_CHUNK_BYTES = 4 * 1024 * 1024
#: The budget of one multi-row INSERT (MySQL/MariaDB), whose escaped binary
#: payloads may take up to twice their size on the wire: under MySQL 5.7's
#: default max_allowed_packet of 4 MiB, as PyMySQL keeps its own multi-row
#: statements under 1,024,000 bytes.
_STATEMENT_BYTES = 1024 * 1024


def insert_rows(conn: Connection, table: str, rows: list[dict[str, Any]], aside: bool) -> None:
    """Insert ``rows`` (``ROW_COLUMNS`` each, validated) as pending outbox rows on
    ``conn``; with the payload ``aside``, the outbox rows first, then their
    payload rows (the sweep of payload rows left without an outbox row,
    ``relay.orphans``, relies on that order to spare a writer's open insert).

    On MySQL/MariaDB an executemany goes row by row (PyMySQL, when VALUES holds
    SQL functions), so ``enqueue_many`` sends multi-row INSERTs instead. psycopg 3
    pipelines an executemany, which measured faster than one long statement."""
    multi_row = conn.dialect.name in MYSQL_DIALECTS
    columns = _event_columns(aside)
    for chunk in _chunks(rows, _STATEMENT_BYTES if multi_row else _CHUNK_BYTES):
        if not multi_row:
            conn.execute(_insert_row(table, aside), [_pick(r, columns) for r in chunk])
            if aside:
                conn.execute(
                    _upsert_payload_row(table), [_pick(r, _PAYLOAD_COLUMNS) for r in chunk]
                )
            continue
        start = 0
        for size in _insert_sizes(len(chunk)):
            part = chunk[start : start + size]
            start += size
            # Each statement is given only its own values: the driver escapes all it is given.
            conn.execute(_insert_rows(conn.dialect, table, size, aside), _numbered(part, columns))
            if aside:
                conn.execute(
                    _insert_payload_rows(conn.dialect, table, size),
                    _numbered(part, _PAYLOAD_COLUMNS),
                )


#: The columns an event fills; the rest are set by the database (id) or fixed.
ROW_COLUMNS = ("topic", "payload", "message_key", "headers", "event_id", "shard")


#: The columns of a payload row (``payload_table``), from the event's.
_PAYLOAD_COLUMNS = ("event_id", "payload", "headers")


def _fixed_values(t: sa.Table, aside: bool = False) -> dict[str, sa.ColumnElement[Any]]:
    """What every new row of ``t`` holds besides the event's columns
    (``ROW_COLUMNS``): pending, no attempt yet, due now by the database's clock;
    with the payload ``aside``, no payload or headers (they are in the payload
    table)."""
    fixed: dict[str, sa.ColumnElement[Any]] = {
        "status": sa.literal(Status.PENDING.value, t.c.status.type),
        "attempts": sa.literal(0, t.c.attempts.type),
        "next_attempt_at": db_now(),
        "created_at": db_now(),
        "updated_at": db_now(),
    }
    if aside:
        fixed["payload"] = sa.null()
        fixed["headers"] = sa.null()
    return fixed


def _event_columns(aside: bool) -> tuple[str, ...]:
    """The event's columns an outbox row takes (without payload and headers aside)."""
    return tuple(c for c in ROW_COLUMNS if not aside or c not in ("payload", "headers"))


def _pick(row: Mapping[str, Any], columns: tuple[str, ...]) -> dict[str, Any]:
    return {c: row[c] for c in columns}


def _numbered(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> dict[str, Any]:
    """The parameters of a multi-row INSERT: ``<column>_<n>`` for the n-th row."""
    return {f"{col}_{n}": row[col] for n, row in enumerate(rows) for col in columns}


@functools.lru_cache(maxsize=32)
def _insert_row(table: str, aside: bool) -> sa.Insert:
    """The one-row INSERT an executemany repeats (cached by SQLAlchemy)."""
    t = outbox_table(table)
    return t.insert().values(**_fixed_values(t, aside))


def _insert_sizes(count: int) -> list[int]:
    """``count`` as a sum of powers of two, largest first (13 -> 8, 4, 1).

    One multi-row INSERT per part: a few statements per chunk instead of one
    per row (an executemany whose VALUES hold SQL functions is sent row by row
    by PyMySQL), and at most one statement text per power of two to compile."""
    return [1 << bit for bit in range(count.bit_length() - 1, -1, -1) if count >> bit & 1]


@functools.lru_cache(maxsize=64)
def _insert_rows(dialect: sa.Dialect, table: str, count: int, aside: bool) -> sa.TextClause:
    """``INSERT ... VALUES (...), (...)`` of ``count`` pending rows, parameters
    ``<column>_<n>`` for the n-th row; the rows get their ids in this order.

    Text, compiled for ``dialect`` once: SQLAlchemy caches no multi-VALUES
    INSERT, and compiling one for every call cost more than the round trips it
    saved."""
    sql, binds = _insert_sql(dialect, table, count, aside)
    return sa.text(sql).bindparams(*binds)


@functools.lru_cache(maxsize=64)
def _insert_payload_rows(dialect: sa.Dialect, table: str, count: int) -> sa.TextClause:
    """``INSERT ... VALUES`` of ``count`` payload rows, parameters as ``_insert_rows``."""
    sql, binds = _insert_payload_sql(dialect, table, count)
    return sa.text(sql).bindparams(*binds)


@functools.lru_cache(maxsize=32)
def insert_notifying(dialect: sa.Dialect, table: str, aside: bool) -> sa.TextClause:
    """PostgreSQL: one pending row (parameters ``<column>_0``), its payload row
    when ``aside``, and the ``NOTIFY`` of its shard (as
    :func:`outboxkit.notify.notify_at_commit`), in one statement."""
    sql, binds = _insert_sql(dialect, table, 1, aside)
    parts = [f"ins AS ({sql} RETURNING shard)"]
    if aside:
        payload_sql, payload_binds = _insert_payload_sql(dialect, table, 1)
        parts.append(f"payload AS ({payload_sql})")
        binds += [b for b in payload_binds if b.key not in {x.key for x in binds}]
    return sa.text(
        f"WITH {', '.join(parts)} "
        f"SELECT pg_notify({channel_sql(table)}, CAST(shard AS text)) FROM ins"
    ).bindparams(*binds)


def _insert_sql(
    dialect: sa.Dialect, table: str, count: int, aside: bool
) -> tuple[str, list[sa.BindParameter[Any]]]:
    t = outbox_table(table)
    fixed = {
        col: str(value.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
        for col, value in _fixed_values(t, aside).items()
    }
    return _values_sql(dialect, t, _event_columns(aside), count, fixed)


def _insert_payload_sql(
    dialect: sa.Dialect, table: str, count: int
) -> tuple[str, list[sa.BindParameter[Any]]]:
    """The payload rows' INSERT, which replaces a payload row left behind by an
    outbox row deleted without it (a manual ``DELETE``): the outbox row of the
    same event id was inserted just before, so none can own it any more."""
    sql, binds = _values_sql(dialect, payload_table(table), _PAYLOAD_COLUMNS, count, {})
    if dialect.name in MYSQL_DIALECTS:
        # VALUES(col) is the form MariaDB knows; MySQL 8.0.20+ keeps it, deprecated
        # (a note on the session, not an error) in favour of a row alias MariaDB lacks.
        sql += " ON DUPLICATE KEY UPDATE payload = VALUES(payload), headers = VALUES(headers)"
    else:
        sql += (
            " ON CONFLICT (event_id) DO UPDATE"
            " SET payload = EXCLUDED.payload, headers = EXCLUDED.headers"
        )
    return sql, binds


@functools.lru_cache(maxsize=32)
def _upsert_payload_row(table: str) -> sa.Insert:
    """PostgreSQL: the one-row payload INSERT an executemany repeats, replacing a
    payload row left behind (see ``_insert_payload_sql``)."""
    from sqlalchemy.dialects.postgresql import insert

    p = payload_table(table)
    stmt = insert(p)
    return stmt.on_conflict_do_update(
        index_elements=[p.c.event_id],
        set_={"payload": stmt.excluded.payload, "headers": stmt.excluded.headers},
    )


def _values_sql(
    dialect: sa.Dialect,
    t: sa.Table,
    columns: tuple[str, ...],
    count: int,
    fixed: Mapping[str, str],
) -> tuple[str, list[sa.BindParameter[Any]]]:
    """``INSERT INTO t (...) VALUES`` of ``count`` rows: ``columns`` bound as
    ``<column>_<n>``, then the ``fixed`` SQL of each row."""
    quote = dialect.identifier_preparer.quote
    names = ", ".join(quote(col) for col in (*columns, *fixed))
    rows = ", ".join(
        "(" + ", ".join([*(f":{col}_{n}" for col in columns), *fixed.values()]) + ")"
        for n in range(count)
    )
    sql = f"INSERT INTO {dialect.identifier_preparer.format_table(t)} ({names}) VALUES {rows}"
    binds = [
        sa.bindparam(f"{col}_{n}", type_=t.c[col].type) for n in range(count) for col in columns
    ]
    return sql, binds


def _chunks(rows: list[dict[str, Any]], max_bytes: int) -> Iterable[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    size = 0
    for row in rows:
        row_size = len(row["payload"]) + len(row["headers"] or "") + 200
        if chunk and (len(chunk) >= _CHUNK_ROWS or size + row_size > max_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(row)
        size += row_size
    if chunk:
        yield chunk
