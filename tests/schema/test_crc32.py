"""The database's CRC-32 of a key is zlib's: rows whose stored shard is out of
range are claimed under the shard ``enqueue`` gives their key (``shard_for``).

MySQL/MariaDB have ``CRC32()``; on PostgreSQL ``schema apply`` creates
``outboxkit_crc32(bytea)``. Both are checked against ``zlib.crc32``.
"""

from __future__ import annotations

import zlib

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.databases import on_both_databases

from outboxkit.schema import apply_schema, schema_sql
from outboxkit.schema.crc32 import key_crc32

pytestmark = pytest.mark.integration


@on_both_databases
def test_the_databases_crc32_of_a_key_or_event_id_is_zlibs(engine: sa.Engine) -> None:
    apply_schema(engine, shards=8)

    @settings(
        max_examples=60,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.one_of(st.none(), st.binary(max_size=512)),
        st.text(st.characters(codec="utf-8"), min_size=1, max_size=64),
    )
    @example(b"", "e")
    @example(b"\xff" * 512, "e")
    @example(None, "\u00e9v\u00e9nement-\U0001f600")
    def check(key: bytes | None, event_id: str) -> None:
        expr = key_crc32(sa.literal(key, sa.LargeBinary()), sa.literal(event_id, sa.String()))
        with engine.connect() as conn:
            got = conn.execute(sa.select(expr)).scalar_one()
        data = key if key is not None else event_id.encode("utf-8")
        assert int(got) == zlib.crc32(data)

    check()


def test_apply_creates_the_function_once_and_the_printed_ddl_has_it(pg_url: str) -> None:
    engine = sa.create_engine(pg_url)
    try:
        first = apply_schema(engine, shards=8)
        assert "created function outboxkit_crc32(bytea)" in first.actions
        assert not apply_schema(engine, shards=8).actions, "in place: nothing to do"
    finally:
        engine.dispose()
    assert "CREATE OR REPLACE FUNCTION outboxkit_crc32(data bytea)" in schema_sql("postgresql")
    assert "outboxkit_crc32" not in schema_sql("mysql")
