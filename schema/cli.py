"""``outboxkit schema apply|sql``.

``sql`` prints what ``apply`` does on an empty database, meta row included.

Settings are flags or ``OUTBOXKIT_*`` variables (``--shards`` /
``OUTBOXKIT_SHARDS``), parsed and validated when the command runs, never when the
parser is built: a bad variable exits 2 naming it and cannot break ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import sqlalchemy as sa

from outboxkit.errors import ConfigError, SchemaError
from outboxkit.runtime.db import database_url_problem, driver_message
from outboxkit.runtime.exitcodes import EXIT_CONFIG, EXIT_DEPENDENCY, EXIT_OK
from outboxkit.runtime.logs import redact, redact_url
from outboxkit.runtime.settings import (
    add_arguments,
    invalid,
    load,
    setting,
    valid_database_url,
)
from outboxkit.schema.apply import apply_schema, schema_sql, server_dialect
from outboxkit.schema.table import (
    DEFAULT_INBOX_TABLE,
    DEFAULT_SHARDS,
    DEFAULT_TABLE,
    MAX_SHARDS,
    identifier_problem,
)

DIALECTS = ("mysql", "mariadb", "postgresql", "sqlite")


def _optional_identifier(value: str | None) -> str | None:
    return None if value is None else identifier_problem(value)


def _shard_count(value: int) -> str | None:
    if 1 <= value <= MAX_SHARDS:
        return None
    return f"the shard count must be between 1 and {MAX_SHARDS}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchemaSqlSettings:
    """What ``schema sql`` prints: tables and dialect (no connection)."""

    table: str = setting(DEFAULT_TABLE, help="outbox table name", validate=identifier_problem)
    inbox_table: str | None = setting(
        DEFAULT_INBOX_TABLE,
        help="consumer inbox table name (empty: no inbox table)",
        validate=_optional_identifier,
    )
    dialect: str | None = setting(
        None,
        help="SQL dialect of the server that runs the script: mysql = MySQL 8, "
        "mariadb = MariaDB (its collation names differ: a mysql script stops on "
        "MariaDB saying so), postgresql, sqlite",
        default_help="the server's, read from --db-url; without one, mysql",
        choices=DIALECTS,
    )
    db_url: str | None = setting(
        None,
        help="the server the script is for: when --dialect is not given, its dialect "
        "(MySQL 8 or MariaDB, PostgreSQL, SQLite) is read from it; nothing is written",
        validate=valid_database_url,
    )
    shards: int = setting(
        DEFAULT_SHARDS,
        help="shard count recorded for the table (fixed at creation)",
        validate=_shard_count,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchemaApplySettings:
    """Where and what ``schema apply`` creates or upgrades."""

    db_url: str = setting(
        help="SQLAlchemy URL, e.g. mysql+pymysql://user:pass@host/db (also --db)",
        validate=valid_database_url,
    )
    table: str = setting(DEFAULT_TABLE, help="outbox table name", validate=identifier_problem)
    inbox_table: str | None = setting(
        DEFAULT_INBOX_TABLE,
        help="consumer inbox table name (empty: no inbox table)",
        validate=_optional_identifier,
    )
    shards: int = setting(
        DEFAULT_SHARDS,
        help="shard count, fixed when the table is created",
        validate=_shard_count,
    )


def register(sub: Any) -> None:
    p = sub.add_parser("schema", help="create, upgrade or print the outbox schema")
    ssub = p.add_subparsers(dest="schema_command", metavar="ACTION", required=True)

    apply_p = ssub.add_parser(
        "apply",
        help="create or upgrade the tables (idempotent, safe from several pods at once)",
    )
    add_arguments(apply_p, SchemaApplySettings)
    apply_p.add_argument("--db", dest="db_url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    apply_p.set_defaults(func=_apply)

    sql_p = ssub.add_parser(
        "sql",
        help="print the script that creates the schema on an empty database "
        "(tables, indexes and the outboxkit_meta row), for a DBA or a migration tool",
    )
    add_arguments(sql_p, SchemaSqlSettings)
    sql_p.set_defaults(func=_sql)


def _apply(args: argparse.Namespace) -> int:
    settings = load(SchemaApplySettings, args=args)
    try:
        engine = sa.create_engine(settings.db_url, pool_pre_ping=True)
    except (sa.exc.ArgumentError, ImportError) as exc:
        raise ConfigError(f"invalid --db-url / OUTBOXKIT_DB_URL: {redact(str(exc))}") from None
    try:
        report = apply_schema(
            engine, table=settings.table, shards=settings.shards, inbox=settings.inbox_table
        )
    except SchemaError as exc:
        print(f"outboxkit schema apply: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except sa.exc.OperationalError as exc:
        # A database that does not exist or a refused login is the URL's fault
        # (exit 2, the fix named); only a server that cannot be reached is exit 3.
        problem = database_url_problem(exc, settings.db_url)
        if problem is not None:
            print(f"outboxkit schema apply: {invalid('db_url', problem)}", file=sys.stderr)
            return EXIT_CONFIG
        print(
            f"outboxkit schema apply: cannot reach {redact_url(settings.db_url)}: "
            f"{redact(driver_message(exc))}",
            file=sys.stderr,
        )
        return EXIT_DEPENDENCY
    finally:
        engine.dispose()
    for action in report.actions or ["schema up to date"]:
        print(action)
    print(f"table {report.table}: {report.shard_count} shards")
    return EXIT_OK


class _Refused(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _server_dialect(db_url: str) -> str:
    """The ``schema sql`` dialect of the server at ``db_url``: it is asked, since a
    ``mysql+pymysql://`` URL names MySQL and MariaDB alike."""
    try:
        engine = sa.create_engine(db_url)
    except (sa.exc.ArgumentError, ImportError) as exc:
        raise ConfigError(f"invalid --db-url / OUTBOXKIT_DB_URL: {redact(str(exc))}") from None
    try:
        return server_dialect(engine)
    except sa.exc.OperationalError as exc:
        problem = database_url_problem(exc, db_url)
        if problem is not None:
            raise _Refused(invalid("db_url", problem), EXIT_CONFIG) from None
        raise _Refused(
            f"cannot reach {redact_url(db_url)}: {redact(driver_message(exc))}", EXIT_DEPENDENCY
        ) from None
    except SchemaError as exc:
        raise _Refused(invalid("db_url", str(exc)), EXIT_CONFIG) from None
    finally:
        engine.dispose()


def _sql(args: argparse.Namespace) -> int:
    settings = load(SchemaSqlSettings, args=args)
    dialect = settings.dialect
    if dialect is None and settings.db_url is not None:
        try:
            dialect = _server_dialect(settings.db_url)
        except _Refused as exc:
            print(f"outboxkit schema sql: {exc}", file=sys.stderr)
            return exc.code
        print(
            f"outboxkit schema sql: --dialect {dialect}, the server at "
            f"{redact_url(settings.db_url)}",
            file=sys.stderr,
        )
    sys.stdout.write(
        schema_sql(
            dialect or "mysql",
            table=settings.table,
            inbox=settings.inbox_table,
            shards=settings.shards,
        )
    )
    return EXIT_OK
