"""Create or upgrade the outbox schema, idempotently and safely from many pods.

``apply_schema`` takes a database-wide named lock (MySQL/MariaDB ``GET_LOCK``,
PostgreSQL session advisory lock), waiting at most 60 s for it, so that several
pods running ``outboxkit schema apply`` at once serialise: the first creates,
the others find everything in place. Each of its DDL statements then waits at
most 10 s for its lock on a table (``_table_lock_bound``). On PostgreSQL the
status ENUM is a type of its own (``outbox_status``, shared by every outbox
table of the database), created before the first table that uses it, and so
is the function ``outboxkit_crc32(bytea)`` the relay's claim needs there
(``schema.crc32``). An upgrade adds what is missing (columns, indexes) and, on
MySQL/MariaDB, moves identifier columns to their byte-exact collation (``ALTER
TABLE ... MODIFY``, one statement per table, reported one line per column). It
never drops a column, an index or a row, and never changes a value: a binary
collation only tells apart values that the old one took for equal, so no
unique index can break.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable

from outboxkit._version import __version__
from outboxkit.errors import SchemaError, SchemaNotAppliedError
from outboxkit.runtime.db import lock_wait_bound, lock_wait_timed_out
from outboxkit.schema.crc32 import PG_CRC32_FUNCTION, has_pg_crc32, pg_crc32_ddl
from outboxkit.schema.meta import check_meta_row
from outboxkit.schema.table import (
    DEFAULT_INBOX_TABLE,
    DEFAULT_SHARDS,
    DEFAULT_TABLE,
    MAX_PACKAGE_VERSION_LENGTH,
    MAX_SHARDS,
    META_TABLE,
    MYSQL_DIALECTS,
    SCHEMA_VERSION,
    Identifier,
    binary_collation,
    db_now,
    inbox_table,
    key_status_index,
    meta_table,
    outbox_table,
    payload_table,
    recovery_table,
    validate_identifier,
)

log = logging.getLogger("outboxkit.schema")

_LOCK_NAME = "outboxkit_schema_apply"
_LOCK_TIMEOUT_S = 60
#: How long one DDL statement waits for its lock on a table (see ``_table_lock_bound``).
_TABLE_LOCK_TIMEOUT_S = 10


@dataclass
class ApplyReport:
    """What ``apply_schema`` did; empty ``actions`` means everything was in place."""

    table: str
    shard_count: int
    actions: list[str] = field(default_factory=list)


def validate_shards(shards: int) -> int:
    if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= MAX_SHARDS:
        raise SchemaError(f"invalid shard count {shards!r}: must be an integer in 1..{MAX_SHARDS}")
    return shards


def apply_schema(
    engine: Engine,
    *,
    table: str = DEFAULT_TABLE,
    shards: int = DEFAULT_SHARDS,
    inbox: str | None = DEFAULT_INBOX_TABLE,
) -> ApplyReport:
    """Create or upgrade the meta, outbox and inbox tables.

    The shard count is fixed when the table is first created; a later call with
    another count keeps the stored one and logs a warning (changing it would move
    keys between shards and break per-key order).
    """
    validate_identifier(table)
    validate_shards(shards)
    tables = _tables(table, inbox)
    report = ApplyReport(table=table, shard_count=shards)
    with engine.connect() as conn:
        for t in tables:
            _check_name_lengths(conn.dialect, t)
    with engine.connect() as conn, _schema_lock(conn), _table_lock_bound(conn):
        _check_stored_meta(conn, table)
        _create_functions(conn, report)
        for t in tables:
            try:
                _create_or_upgrade(conn, t, report)
            except sa.exc.OperationalError as exc:
                if not lock_wait_timed_out(exc):
                    raise
                conn.rollback()
                done = "; ".join(report.actions) or "nothing"
                raise SchemaError(
                    f"could not lock table {t.name} within {_TABLE_LOCK_TIMEOUT_S} s to change "
                    "it: another session holds it (a long transaction; on PostgreSQL also a "
                    "VACUUM run to prevent wraparound, which does not give way). Done before: "
                    f"{done}. Run `outboxkit schema apply` again once it is over"
                ) from None
        report.shard_count = _ensure_meta_row(conn, table, shards, report)
    return report


def _check_stored_meta(conn: Connection, table: str) -> None:
    """Refuse, before changing anything, a table whose meta row this code cannot
    work with (``check_table_meta``): one a later outboxkit upgraded, or one whose
    shard count was changed by hand."""
    if not sa.inspect(conn).has_table(META_TABLE):
        return
    row = conn.execute(
        sa.select(meta_table.c.shard_count, meta_table.c.schema_version).where(
            meta_table.c.table_name == table
        )
    ).first()
    if row is not None:
        check_meta_row(conn, table, int(row[0]), int(row[1]))
    conn.rollback()


def _tables(table: str, inbox: str | None) -> list[sa.Table]:
    """What ``apply_schema`` creates, in order: the payload table after its outbox."""
    tables = [meta_table, recovery_table(), outbox_table(table), payload_table(table)]
    if inbox is not None:
        tables.append(inbox_table(validate_identifier(inbox, what="inbox table name")))
    return tables


def _check_name_lengths(dialect: sa.engine.Dialect, table: sa.Table) -> None:
    """Refuse a table whose own or derived names (``ix_<table>_key_status``, ...) the
    database cannot hold, before anything is created.

    MySQL/MariaDB allow 64 characters per name, PostgreSQL 63 (it would otherwise
    cut them short, and two index names could end up the same).
    """
    index_limit = dialect.max_index_name_length or dialect.max_identifier_length
    constraint_limit = dialect.max_constraint_name_length or dialect.max_identifier_length
    names = [(str(i.name), index_limit) for i in table.indexes]
    names += [(str(c.name), constraint_limit) for c in table.constraints if c.name]
    names.append((table.name, min(dialect.max_identifier_length, 64)))
    # The name with the least room decides the longest table name possible.
    name, limit = min(names, key=lambda n: n[1] - len(n[0]))
    if len(name) > limit:
        longest = len(table.name) - (len(name) - limit)
        what = "it is" if name == table.name else f"its index or constraint {name} would be"
        raise SchemaError(
            f"table name {table.name!r} is too long for {dialect.name}: {what} "
            f"{len(name)} characters, over the limit of {limit}; use at most {longest} characters"
        )


def _enum_types(table: sa.Table) -> list[sa.Enum]:
    """The table's named ENUM types (the status), once each."""
    found: dict[str, sa.Enum] = {}
    for column in table.columns:
        if isinstance(column.type, sa.Enum) and column.type.name:
            found.setdefault(column.type.name, column.type)
    return list(found.values())


def _create_types(conn: Connection, table: sa.Table, report: ApplyReport) -> None:
    """PostgreSQL: the table's ENUM types are their own objects, created first.

    (MySQL/MariaDB declare an ENUM inline in the column.) One type serves every
    outbox table of the database; the schema lock makes the check-then-create safe.
    """
    if conn.dialect.name != "postgresql":
        return
    for enum_type in _enum_types(table):
        if not conn.dialect.has_type(conn, str(enum_type.name)):  # type: ignore[attr-defined]
            enum_type.create(conn)
            report.actions.append(f"created type {enum_type.name}")


def _create_functions(conn: Connection, report: ApplyReport) -> None:
    """PostgreSQL: the CRC-32 function the relay's claim calls (see ``schema.crc32``);
    created when missing (the schema lock makes the check-then-create safe)."""
    if conn.dialect.name != "postgresql" or has_pg_crc32(conn):
        return
    conn.exec_driver_sql(pg_crc32_ddl())
    conn.commit()
    report.actions.append(f"created function {PG_CRC32_FUNCTION}(bytea)")


def require_claim_schema(conn: Connection, table: str) -> None:
    """What the relay's claim names is there, else SchemaNotAppliedError.

    PostgreSQL: the function ``outboxkit_crc32`` (a schema applied by an older
    release lacks it). MySQL/MariaDB: the index ``ix_<table>_key_status``, which
    the claim names in an index hint (a table made by hand may lack it, and
    every claim would then fail). Both: the payload table (``payload_table``),
    which the claim reads payloads from (0.2.0's tables lack it), and every
    column of the outbox and payload tables the claim reads."""
    aside = payload_table(table).name
    if not sa.inspect(conn).has_table(aside):
        raise SchemaNotAppliedError(
            f"the payload table {aside} of table {table!r} is missing: run "
            "`outboxkit schema apply` (outboxkit 0.3.0 and later read payloads from it; see "
            "'Upgrading to the payload table' in docs/schema.md)"
        )
    require_outbox_columns(conn, table)
    require_payload_columns(conn, table)
    if conn.dialect.name == "postgresql" and not has_pg_crc32(conn):
        raise SchemaNotAppliedError(
            f"the function {PG_CRC32_FUNCTION}(bytea) is missing: run `outboxkit schema apply` "
            "(outboxkit 0.2.0 and later create it on PostgreSQL)"
        )
    if conn.dialect.name in MYSQL_DIALECTS:
        index = key_status_index(table)
        if index not in {i["name"] for i in sa.inspect(conn).get_indexes(table)}:
            raise SchemaNotAppliedError(
                f"the index {index} of table {table!r} is missing: run `outboxkit schema apply`"
            )


def require_outbox_columns(conn: Connection, table: str) -> None:
    """The outbox table ``table`` has every column the claim reads, else
    SchemaNotAppliedError: one missing (a table made or altered by hand) fails
    every claim with an unknown column."""
    _require_columns(conn, outbox_table(table), f"table {table!r}")


def require_payload_columns(conn: Connection, table: str) -> None:
    """The payload table of ``table`` has every column the claim reads (it joins
    ``event_id`` and reads ``payload`` and ``headers``), else
    SchemaNotAppliedError: with one missing every claim failed, rows that keep
    their payload in the outbox row included."""
    aside = payload_table(table)
    _require_columns(conn, aside, f"the payload table {aside.name} of table {table!r}")


def _require_columns(conn: Connection, table: sa.Table, what: str) -> None:
    try:
        present = {c["name"] for c in sa.inspect(conn).get_columns(table.name)}
    except sa.exc.NoSuchTableError:
        raise SchemaNotAppliedError(f"{what} is missing: run `outboxkit schema apply`") from None
    missing = [c.name for c in table.columns if c.name not in present]
    if missing:
        raise SchemaNotAppliedError(
            f"{what} lacks the column{'s' if len(missing) > 1 else ''} {', '.join(missing)}: "
            "run `outboxkit schema apply`"
        )


def _create_or_upgrade(conn: Connection, table: sa.Table, report: ApplyReport) -> None:
    """Create ``table`` or bring it up to date; ``report`` gets only what was done.

    Each step is noted once its statement ran, and moves to ``report`` when it is
    committed: MySQL/MariaDB commit every DDL statement at once, so if a later
    statement fails (a table lock not granted in time) the steps before it are
    done; PostgreSQL (and SQLite) run DDL in the transaction, whose rollback
    undoes them, so they are not reported.
    """
    step = ApplyReport(table=report.table, shard_count=report.shard_count)

    def commit() -> None:
        conn.commit()
        report.actions.extend(step.actions)
        step.actions.clear()

    try:
        _create_or_upgrade_steps(conn, table, step, commit)
    except BaseException:
        if conn.dialect.name in MYSQL_DIALECTS:
            report.actions.extend(step.actions)  # committed by the server, statement by statement
        raise


def _create_or_upgrade_steps(
    conn: Connection, table: sa.Table, step: ApplyReport, commit: Callable[[], None]
) -> None:
    _create_types(conn, table, step)
    inspector = sa.inspect(conn)
    created = not inspector.has_table(table.name)
    if created:
        # Indexes are created below, without IF NOT EXISTS (MySQL 8 lacks it); the
        # schema lock makes the check-then-create safe.
        conn.execute(CreateTable(table, if_not_exists=True))
        step.actions.append(f"created table {table.name}")
        commit()
        inspector = sa.inspect(conn)
    present = {c["name"] for c in inspector.get_columns(table.name)}
    for column in table.columns:
        if column.name not in present:
            spec = CreateColumn(column).compile(dialect=conn.dialect)
            conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {spec}"))
            step.actions.append(f"added column {table.name}.{column.name}")
    if not created:
        _allow_nulls(conn, table, step)
        _upgrade_collations(conn, table, step)
        _add_storage_parameters(conn, table, step)
        _advise_partial_indexes(conn, table)
    indexes = {i["name"] for i in inspector.get_indexes(table.name)}
    for index in table.indexes:
        if index.name not in indexes:
            conn.execute(CreateIndex(index))
            if not created:
                step.actions.append(f"added index {index.name}")
    commit()


def _advise_partial_indexes(conn: Connection, table: sa.Table) -> None:
    """PostgreSQL: warn of an index that outboxkit 0.2.0 and later make partial and
    an earlier build made whole (``ix_<table>_key_status``, which now leaves delivered
    rows out). The whole one still serves every query, so it is kept (an apply
    drops no index); docs/postgresql.md gives the online swap."""
    if conn.dialect.name != "postgresql":
        return
    wanted = {
        str(i.name) for i in table.indexes if i.dialect_options["postgresql"]["where"] is not None
    }
    if not wanted:
        return
    whole = conn.execute(
        sa.text(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE i.indrelid = to_regclass(:table) AND i.indpred IS NULL"
        ),
        {"table": table.name},
    ).scalars()
    for name in sorted(wanted.intersection(whole)):
        log.warning(
            "index %s of %s also holds delivered rows; outboxkit 0.2.0 and later make it "
            "partial, which writes less per delivered row: see 'A partial key index' in "
            "docs/postgresql.md to swap it online",
            name,
            table.name,
        )


def _add_storage_parameters(conn: Connection, table: sa.Table, report: ApplyReport) -> None:
    """PostgreSQL: set the storage parameters the table definition gives
    (``postgresql_with``, e.g. the outbox's autovacuum settings) that an existing
    table lacks; a value already set, by an operator or an earlier apply, stays."""
    wanted: dict[str, str] = table.dialect_kwargs.get("postgresql_with") or {}
    if conn.dialect.name != "postgresql" or not wanted:
        return
    options = conn.execute(
        sa.text("SELECT reloptions FROM pg_class WHERE oid = to_regclass(:name)"),
        {"name": table.name},
    ).scalar()
    present = {o.split("=", 1)[0] for o in options or ()}
    missing = {k: v for k, v in wanted.items() if k not in present}
    if not missing:
        return
    for name, value in missing.items():  # our own constants: nothing to quote
        assert name.replace("_", "").isalpha() and value.replace(".", "").isdigit(), (name, value)
    settings = ", ".join(f"{k} = {v}" for k, v in missing.items())
    conn.execute(sa.text(f"ALTER TABLE {table.name} SET ({settings})"))
    report.actions.append(f"set {settings} on {table.name}")


def _allow_nulls(conn: Connection, table: sa.Table, report: ApplyReport) -> None:
    """Let a column take NULL that an older release made NOT NULL (the outbox's
    ``payload``, NULL since its payload table, schema version 3, for rows whose
    payload is there). Loosening a constraint changes no value: PostgreSQL only
    changes its catalog; MySQL/MariaDB rebuild the table in place and online,
    reads and writes going on meanwhile (MariaDB 10.11: 1.7 s for 200,000 rows
    of 512 B). SQLite cannot; ``enqueue`` keeps payloads in the outbox table there."""
    if conn.dialect.name not in (*MYSQL_DIALECTS, "postgresql"):
        return
    not_null = {c["name"] for c in sa.inspect(conn).get_columns(table.name) if not c["nullable"]}
    for column in table.columns:
        if not column.nullable or column.name not in not_null:
            continue
        if conn.dialect.name == "postgresql":
            conn.execute(
                sa.text(f"ALTER TABLE {table.name} ALTER COLUMN {column.name} DROP NOT NULL")
            )
        else:
            spec = CreateColumn(column).compile(dialect=conn.dialect)
            conn.execute(sa.text(f"ALTER TABLE {table.name} MODIFY COLUMN {spec}"))
        report.actions.append(f"column {table.name}.{column.name} takes NULL")


def _upgrade_collations(conn: Connection, table: sa.Table, report: ApplyReport) -> None:
    """Move identifier columns created by an older release to the byte-exact collation.

    One ``ALTER TABLE`` for all of a table's columns (one table rebuild, not one per
    column). MySQL/MariaDB rebuild the table for it: writes to it wait until it is
    done, so run the upgrade when the table is small or traffic is low.
    """
    if conn.dialect.name not in MYSQL_DIALECTS:
        return  # PostgreSQL and SQLite compare bytes already
    want = binary_collation(conn.dialect)
    rows = conn.execute(
        sa.text(
            "SELECT COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :t"
        ),
        {"t": table.name},
    )
    actual: dict[str, str | None] = {str(r[0]): r[1] for r in rows}
    changes: list[str] = []
    done: list[str] = []
    for column in table.columns:
        if not isinstance(column.type, Identifier):
            continue
        found = actual.get(column.name)
        if found is None or found.lower() == want:
            continue
        spec = CreateColumn(column).compile(dialect=conn.dialect)
        changes.append(f"MODIFY COLUMN {spec}")
        done.append(f"changed column {table.name}.{column.name}: collation {found} -> {want}")
    if changes:
        conn.execute(sa.text(f"ALTER TABLE {table.name} {', '.join(changes)}"))
        report.actions.extend(done)  # only once the ALTER went through


def _meta_row(table: str, shards: int) -> dict[str, object]:
    """The ``outboxkit_meta`` row of a new outbox table (``apply_schema`` inserts it,
    ``schema_sql`` prints its INSERT): the writer and the relay refuse a table without it."""
    return {
        "table_name": table,
        "shard_count": shards,
        "schema_version": SCHEMA_VERSION,
        "created_at": db_now(),
        "package_version": __version__[:MAX_PACKAGE_VERSION_LENGTH],
    }


def _ensure_meta_row(conn: Connection, table: str, shards: int, report: ApplyReport) -> int:
    applied_by = __version__[:MAX_PACKAGE_VERSION_LENGTH]
    row = conn.execute(
        sa.select(
            meta_table.c.shard_count, meta_table.c.schema_version, meta_table.c.package_version
        ).where(meta_table.c.table_name == table)
    ).first()
    if row is None:
        conn.execute(meta_table.insert().values(**_meta_row(table, shards)))
        conn.commit()
        report.actions.append(f"recorded {table}: {shards} shards")
        return shards
    stored = int(row.shard_count)
    if stored != shards:
        log.warning(
            "shard count of %s is fixed at creation: keeping %d, ignoring requested %d",
            table,
            stored,
            shards,
        )
    if int(row.schema_version) < SCHEMA_VERSION:
        conn.execute(
            meta_table.update()
            .where(meta_table.c.table_name == table)
            .values(schema_version=SCHEMA_VERSION)
        )
        conn.commit()
        report.actions.append(f"schema version of {table} -> {SCHEMA_VERSION}")
    if row.package_version != applied_by:
        conn.execute(
            meta_table.update()
            .where(meta_table.c.table_name == table)
            .values(package_version=applied_by)
        )
        conn.commit()
        report.actions.append(f"recorded {table} as applied by outboxkit {applied_by}")
    return stored


@contextmanager
def _table_lock_bound(conn: Connection) -> Iterator[None]:
    """Bound how long each DDL statement waits for its lock on a table.

    Left alone, an ``ALTER TABLE`` or ``CREATE INDEX`` on a table that another
    session holds (an open transaction that wrote to it; on PostgreSQL a VACUUM
    run to prevent wraparound, which, unlike an ordinary autovacuum, does not
    give way) waits as long as that lasts: on MySQL/MariaDB up to
    ``lock_wait_timeout``, a day or a year by default, and on PostgreSQL with no
    bound at all. Worse, while a statement that needs the table to itself waits,
    both databases queue the service's own reads and writes of the table behind
    it. So each waits at most ``_TABLE_LOCK_TIMEOUT_S``, then ``apply`` fails
    saying so. Set for the session while the schema lock is held, and the
    session's own value put back before the connection returns to the pool.
    """
    with lock_wait_bound(conn, _TABLE_LOCK_TIMEOUT_S, mysql_variable="lock_wait_timeout"):
        yield


@contextmanager
def _schema_lock(conn: Connection) -> Iterator[None]:
    dialect = conn.dialect.name
    if dialect in MYSQL_DIALECTS:
        got = conn.execute(
            sa.text("SELECT GET_LOCK(:n, :t)"), {"n": _LOCK_NAME, "t": _LOCK_TIMEOUT_S}
        ).scalar()
        if got != 1:
            raise SchemaError(f"could not take the schema lock within {_LOCK_TIMEOUT_S} s")
        try:
            yield
        finally:
            conn.rollback()
            conn.execute(sa.text("SELECT RELEASE_LOCK(:n)"), {"n": _LOCK_NAME})
            conn.commit()
    elif dialect == "postgresql":
        # A session-level advisory lock: held across the commits below, released
        # at the end (or by the server if this session dies). lock_timeout bounds
        # the wait like GET_LOCK's timeout; SET LOCAL ends with this transaction.
        conn.execute(sa.text(f"SET LOCAL lock_timeout = '{int(_LOCK_TIMEOUT_S)}s'"))
        try:
            conn.execute(sa.text("SELECT pg_advisory_lock(hashtext(:n))"), {"n": _LOCK_NAME})
        except sa.exc.OperationalError as exc:
            if not lock_wait_timed_out(exc):
                raise
            conn.rollback()
            raise SchemaError(
                f"could not take the schema lock within {_LOCK_TIMEOUT_S} s"
            ) from None
        conn.commit()
        try:
            yield
        finally:
            conn.rollback()
            conn.execute(sa.text("SELECT pg_advisory_unlock(hashtext(:n))"), {"n": _LOCK_NAME})
            conn.commit()
    else:
        yield


#: First statement of the ``mysql`` script: a no-op on MySQL, and on MariaDB (which
#: runs ``/*M!...*/`` and MySQL does not) an error that names the right dialect, before
#: the first CREATE TABLE fails on MySQL's collation name (``utf8mb4_0900_bin``).
MARIADB_GUARD = (
    "DO 1 /*M!100000 + `This script is for MySQL 8. For MariaDB print it with: "
    "outboxkit schema sql --dialect mariadb` */"
)


def schema_sql(
    dialect_name: str = "mysql",
    *,
    table: str = DEFAULT_TABLE,
    inbox: str | None = DEFAULT_INBOX_TABLE,
    shards: int = DEFAULT_SHARDS,
) -> str:
    """What ``apply_schema`` does on an empty database, as one SQL script.

    The types and functions, the tables and their indexes, then the table's
    ``outboxkit_meta`` row (shard count, schema version): run by hand or by a
    migration tool on an empty database, it leaves what ``schema apply`` leaves,
    and ``enqueue`` and the relay accept the table. Statements end with ``;`` and
    a blank line. The meta row is inserted unless one is there, so the
    PostgreSQL, MariaDB and SQLite scripts run twice without error (MySQL 8 has no
    ``CREATE INDEX IF NOT EXISTS``). It creates; it does not upgrade tables made
    by an earlier version: ``apply_schema`` does (docs/schema.md).
    """
    dialect = _dialect(dialect_name)
    validate_shards(shards)
    tables = _tables(validate_identifier(table), inbox)
    parts: list[str] = []
    if dialect_name == "mysql":
        parts.append(MARIADB_GUARD)
    if dialect_name == "postgresql":
        from sqlalchemy.dialects.postgresql import CreateEnumType

        # No CREATE TYPE IF NOT EXISTS in PostgreSQL: ignore the duplicate instead.
        for enum_type in _enum_types(outbox_table(table)):
            create = str(CreateEnumType(enum_type).compile(dialect=dialect)).strip()
            parts.append(f"DO $$ BEGIN {create}; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        parts.append(pg_crc32_ddl())
    for t in tables:
        parts.append(str(CreateTable(t, if_not_exists=True).compile(dialect=dialect)).strip())
        # MySQL 8 has no CREATE INDEX IF NOT EXISTS; MariaDB, PostgreSQL and SQLite do.
        guard = dialect_name != "mysql"
        parts.extend(
            str(CreateIndex(i, if_not_exists=guard).compile(dialect=dialect)).strip()
            for i in sorted(t.indexes, key=lambda i: str(i.name))
        )
    parts.append(_meta_insert_sql(dialect, table, shards))
    return ";\n\n".join(parts) + ";\n"


def server_dialect(engine: Engine) -> str:
    """Which ``schema_sql`` dialect the server behind ``engine`` takes: ``mysql``
    (MySQL 8), ``mariadb``, ``postgresql`` or ``sqlite``. Connects once; the
    MySQL driver tells the two servers apart only then."""
    with engine.connect() as conn:
        name = conn.dialect.name
        if name in MYSQL_DIALECTS:
            return "mariadb" if getattr(conn.dialect, "is_mariadb", False) else "mysql"
    if name in ("postgresql", "sqlite"):
        return name
    raise SchemaError(f"outboxkit has no schema for {name}: use MySQL 8, MariaDB or PostgreSQL")


def _meta_insert_sql(dialect: sa.engine.Dialect, table: str, shards: int) -> str:
    """The meta row's INSERT, skipped where the table already has one (as
    ``apply_schema`` keeps a stored row: the shard count is fixed at creation)."""
    statement: sa.Insert
    if dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        statement = pg_insert(meta_table).on_conflict_do_nothing()
    elif dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        statement = sqlite_insert(meta_table).on_conflict_do_nothing()
    else:
        statement = meta_table.insert().prefix_with("IGNORE")
    statement = statement.values(**_meta_row(table, shards))
    return str(statement.compile(dialect=dialect, compile_kwargs={"literal_binds": True})).strip()


def _dialect(name: str) -> sa.engine.Dialect:
    from sqlalchemy.dialects import mysql, postgresql, sqlite

    dialects: dict[str, sa.engine.Dialect] = {
        "mysql": mysql.dialect(),
        "mariadb": mysql.dialect(is_mariadb=True),
        "postgresql": postgresql.dialect(),  # type: ignore[no-untyped-call]
        "sqlite": sqlite.dialect(),
    }
    try:
        return dialects[name]
    except KeyError:
        raise SchemaError(
            f"unknown dialect {name!r}: choose one of {', '.join(sorted(dialects))}"
        ) from None
