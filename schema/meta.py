"""The ``outboxkit_meta`` row of an outbox table, read and checked: its shard
count and schema version are range-checked here, before the relay, the writer,
``admin`` or ``schema apply`` build anything from them."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outboxkit._version import __version__
from outboxkit.errors import SchemaMetaError, SchemaNotAppliedError
from outboxkit.schema.table import MAX_SHARDS, META_TABLE, SCHEMA_VERSION, meta_table


def read_applied_by(conn: Connection, table: str) -> str | None:
    """The outboxkit version whose ``schema apply`` last ran on the table, or None:
    none of 0.4.0 or later has (the column is missing, or NULL in its row)."""
    columns = {c["name"] for c in sa.inspect(conn).get_columns(META_TABLE)}
    if meta_table.c.package_version.name not in columns:
        return None
    value = conn.execute(
        sa.select(meta_table.c.package_version).where(meta_table.c.table_name == table)
    ).scalar()
    return None if value is None else str(value)


def read_shard_count(conn: Connection, table: str) -> int:
    """The table's shard count from the meta table, or SchemaNotAppliedError."""
    return read_table_meta(conn, table)[0]


def read_table_meta(conn: Connection, table: str) -> tuple[int, int]:
    """The table's shard count and schema version from the meta table, or
    SchemaNotAppliedError."""
    try:
        value = conn.execute(
            sa.select(meta_table.c.shard_count, meta_table.c.schema_version).where(
                meta_table.c.table_name == table
            )
        ).first()
    except sa.exc.ProgrammingError as exc:  # meta table missing
        raise SchemaNotAppliedError(
            f"no outbox schema for table {table!r}: run `outboxkit schema apply` first"
        ) from exc
    if value is None:
        raise SchemaNotAppliedError(
            f"no outbox schema for table {table!r}: run `outboxkit schema apply` first"
        )
    return check_meta_row(conn, table, int(value[0]), int(value[1]))


def check_meta_row(
    conn: Connection, table: str, shard_count: int, schema_version: int
) -> tuple[int, int]:
    """``check_table_meta``, naming the version that upgraded a newer table when its
    row says (read only then: a table of this version is not asked)."""
    newer = schema_version > SCHEMA_VERSION
    applied_by = read_applied_by(conn, table) if newer else None
    if applied_by == __version__:  # the row was changed by hand after our own apply
        applied_by = None
    return check_table_meta(table, shard_count, schema_version, applied_by=applied_by)


def check_table_meta(
    table: str, shard_count: int, schema_version: int, *, applied_by: str | None = None
) -> tuple[int, int]:
    """``(shard_count, schema_version)`` as read from the table's meta row, if this
    code can work with them; else SchemaMetaError naming the row, the value and the fix.

    Checked before anything is built from them: a shard count of 2**31-1 would
    otherwise become a set of two billion shards at the relay's start, 0 a
    division by zero in ``enqueue``, and one above ``MAX_SHARDS`` (which ``schema
    apply`` refuses to create) shard numbers past what the relays were measured and
    sized for, up to more than the ``shard`` column (SMALLINT) holds. The range is
    ``apply``'s own, so every count it ever stored passes. A schema version newer than
    ``SCHEMA_VERSION`` means a later outboxkit upgraded the table, and this code
    does not know what it changed.
    """
    row = f"{META_TABLE} row (table_name={table!r})"
    if not 1 <= shard_count <= MAX_SHARDS:
        raise SchemaMetaError(
            f"{row} holds shard_count={shard_count}, outside 1..{MAX_SHARDS}: the shard "
            "count is fixed when `outboxkit schema apply` creates the table, and every "
            "row's shard was computed with it, so it was changed by hand. Put back the "
            f"count the table was created with (UPDATE {META_TABLE} SET shard_count = <n> "
            f"WHERE table_name = '{table}'; the `shards` of an earlier `relay-started` "
            "log line, or of `outboxkit schema apply`'s last report)"
        )
    if schema_version > SCHEMA_VERSION:
        raise SchemaMetaError(
            f"{row} holds schema_version={schema_version}: table {table!r} was upgraded "
            f"by a later outboxkit, and outboxkit {__version__} reads and writes schema "
            f"version {SCHEMA_VERSION} only. Upgrade the outboxkit package to "
            + (f"{applied_by}, which" if applied_by else "the version that")
            + " last ran `outboxkit schema apply` on it (see CHANGELOG.md)"
        )
    return shard_count, schema_version
