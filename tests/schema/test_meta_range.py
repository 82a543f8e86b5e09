"""The meta row's range: every value ``schema apply`` can store passes, nothing else."""

from __future__ import annotations

import pytest

from outboxkit.errors import SchemaMetaError
from outboxkit.schema.apply import validate_shards
from outboxkit.schema.meta import check_table_meta
from outboxkit.schema.table import MAX_SHARDS, SCHEMA_VERSION

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shards", [1, 2, 64, MAX_SHARDS])
@pytest.mark.parametrize("version", [1, 2, SCHEMA_VERSION])
def test_what_apply_stores_passes(shards: int, version: int) -> None:
    assert validate_shards(shards) == shards
    assert check_table_meta("t", shards, version) == (shards, version)


@pytest.mark.parametrize("shards", [0, -1, MAX_SHARDS + 1, 32_767, 65_536, 2**31 - 1])
def test_a_shard_count_apply_refuses_is_refused(shards: int) -> None:
    with pytest.raises(SchemaMetaError, match=rf"holds shard_count={shards}, outside 1\.\.4096"):
        check_table_meta("t", shards, SCHEMA_VERSION)


def test_a_newer_schema_version_is_refused() -> None:
    with pytest.raises(SchemaMetaError, match=rf"holds schema_version={SCHEMA_VERSION + 1}:"):
        check_table_meta("t", 8, SCHEMA_VERSION + 1)
