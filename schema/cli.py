"""``outboxkit schema apply|sql``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import sqlalchemy as sa

from outboxkit.errors import ConfigError, SchemaError
from outboxkit.runtime.exitcodes import EXIT_CONFIG, EXIT_DEPENDENCY, EXIT_OK
from outboxkit.runtime.logs import redact_url
from outboxkit.schema.apply import apply_schema, schema_sql
from outboxkit.schema.table import DEFAULT_INBOX_TABLE, DEFAULT_SHARDS, DEFAULT_TABLE


def register(sub: Any) -> None:
    p = sub.add_parser("schema", help="create, upgrade or print the outbox schema")
    ssub = p.add_subparsers(dest="schema_command", metavar="ACTION", required=True)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--table",
        default=os.environ.get("OUTBOXKIT_TABLE", DEFAULT_TABLE),
        help="outbox table name [env OUTBOXKIT_TABLE, default %(default)s]",
    )
    common.add_argument(
        "--inbox-table",
        default=os.environ.get("OUTBOXKIT_INBOX_TABLE", DEFAULT_INBOX_TABLE),
        help="consumer inbox table name [env OUTBOXKIT_INBOX_TABLE, default %(default)s]",
    )

    apply_p = ssub.add_parser(
        "apply",
        parents=[common],
        help="create or upgrade the tables (idempotent, safe from several pods at once)",
    )
    apply_p.add_argument(
        "--db-url",
        "--db",
        dest="db_url",
        default=os.environ.get("OUTBOXKIT_DB_URL"),
        help="SQLAlchemy URL, e.g. mysql+pymysql://user:pass@host/db [env OUTBOXKIT_DB_URL]",
    )
    apply_p.add_argument(
        "--shards",
        type=int,
        default=int(os.environ.get("OUTBOXKIT_SHARDS", DEFAULT_SHARDS)),
        help="shard count, fixed when the table is created [env OUTBOXKIT_SHARDS, "
        "default %(default)s]",
    )
    apply_p.set_defaults(func=_apply)

    sql_p = ssub.add_parser("sql", parents=[common], help="print the DDL")
    sql_p.add_argument(
        "--dialect",
        default="mysql",
        choices=["mysql", "mariadb", "postgresql", "sqlite"],
        help="SQL dialect [default %(default)s]",
    )
    sql_p.set_defaults(func=_sql)


def _apply(args: argparse.Namespace) -> int:
    if not args.db_url:
        raise ConfigError("missing --db-url / OUTBOXKIT_DB_URL")
    try:
        engine = sa.create_engine(args.db_url, pool_pre_ping=True)
    except (sa.exc.ArgumentError, ImportError) as exc:
        raise ConfigError(f"invalid --db-url / OUTBOXKIT_DB_URL: {exc}") from None
    try:
        report = apply_schema(
            engine, table=args.table, shards=args.shards, inbox=args.inbox_table or None
        )
    except SchemaError as exc:
        print(f"outboxkit schema apply: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except sa.exc.OperationalError as exc:
        print(
            f"outboxkit schema apply: cannot reach {redact_url(args.db_url)}: "
            f"{type(exc.orig).__name__ if exc.orig else 'error'}",
            file=sys.stderr,
        )
        return EXIT_DEPENDENCY
    finally:
        engine.dispose()
    for action in report.actions or ["schema up to date"]:
        print(action)
    print(f"table {report.table}: {report.shard_count} shards")
    return EXIT_OK


def _sql(args: argparse.Namespace) -> int:
    sys.stdout.write(schema_sql(args.dialect, table=args.table, inbox=args.inbox_table or None))
    return EXIT_OK
