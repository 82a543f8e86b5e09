"""CRC-32 of a row's key in SQL: the database's half of ``codec.shard_for``.

A row whose stored shard is out of range (another writer stored it) belongs to
the shard ``enqueue`` would have given it, ``CRC-32(key, or event id) mod
shard_count``; the claim computes that in SQL so it can pick such rows by
shard. MySQL/MariaDB have ``CRC32()``, zlib's CRC-32. PostgreSQL has no CRC-32,
so ``outboxkit schema apply`` creates one on PostgreSQL, ``outboxkit_crc32(bytea)
-> bigint`` (the same polynomial, reflected, as zlib; tests compare it with
``zlib.crc32``). It is ``IMMUTABLE`` and ``PARALLEL SAFE`` and reads nothing
but its argument; the claim calls it only for rows whose shard is out of range.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

__all__ = ["PG_CRC32_FUNCTION", "has_pg_crc32", "key_crc32", "pg_crc32_ddl"]

#: The PostgreSQL function's name (in the schema the tables are created in).
PG_CRC32_FUNCTION = "outboxkit_crc32"

# Bitwise CRC-32 (polynomial 0xEDB88320 reflected, initial and final XOR
# 0xFFFFFFFF), in bigint so no step overflows: 8 shifts per byte of the key.
_PG_CRC32_BODY = """\
DECLARE
    crc bigint := 4294967295;
BEGIN
    FOR i IN 0 .. length(data) - 1 LOOP
        crc := crc # get_byte(data, i);
        FOR k IN 1 .. 8 LOOP
            crc := (crc >> 1) # (3988292384 & -(crc & 1));
        END LOOP;
    END LOOP;
    RETURN crc # 4294967295;
END"""


def pg_crc32_ddl() -> str:
    """``CREATE OR REPLACE FUNCTION outboxkit_crc32(bytea)``: safe to run again."""
    return (
        f"CREATE OR REPLACE FUNCTION {PG_CRC32_FUNCTION}(data bytea) RETURNS bigint\n"
        "LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $crc32$\n"
        f"{_PG_CRC32_BODY}\n$crc32$"
    )


def has_pg_crc32(conn: Connection) -> bool:
    """Is ``outboxkit_crc32(bytea)`` visible on this PostgreSQL connection's search path?"""
    found = conn.execute(
        sa.text("SELECT to_regprocedure(:sig) IS NOT NULL"),
        {"sig": f"{PG_CRC32_FUNCTION}(bytea)"},
    ).scalar_one()
    return bool(found)


class key_crc32(FunctionElement[Any]):
    """CRC-32 of ``key``, or of ``event_id`` (UTF-8) when the key is NULL."""

    type = sa.BigInteger()
    inherit_cache = True
    name = "key_crc32"

    def __init__(self, key: ColumnElement[Any], event_id: ColumnElement[Any]) -> None:
        super().__init__(key, event_id)


@compiles(key_crc32, "mysql")
@compiles(key_crc32, "mariadb")
def _mysql(element: key_crc32, compiler: Any, **kw: Any) -> str:
    key, event_id = (compiler.process(c, **kw) for c in element.clauses)
    return f"CRC32(COALESCE({key}, {event_id}))"


@compiles(key_crc32, "postgresql")
def _postgresql(element: key_crc32, compiler: Any, **kw: Any) -> str:
    key, event_id = (compiler.process(c, **kw) for c in element.clauses)
    return f"{PG_CRC32_FUNCTION}(COALESCE({key}, convert_to({event_id}, 'UTF8')))"
