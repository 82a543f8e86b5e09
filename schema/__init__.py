"""The outbox schema: table definitions, DDL, and idempotent apply."""

from outboxkit.schema.apply import ApplyReport, apply_schema, schema_sql
from outboxkit.schema.codec import decode_headers, encode_headers, kafka_headers, shard_for
from outboxkit.schema.meta import read_shard_count
from outboxkit.schema.recovery import record_recovery, trim_recovery
from outboxkit.schema.table import (
    DEFAULT_INBOX_TABLE,
    DEFAULT_SHARDS,
    DEFAULT_TABLE,
    MAX_KEY_BYTES,
    STATUSES,
    Status,
    db_now,
    inbox_table,
    meta_table,
    outbox_rows_query,
    outbox_table,
    payload_table,
    recovery_table,
    validate_identifier,
)

__all__ = [
    "DEFAULT_INBOX_TABLE",
    "DEFAULT_SHARDS",
    "DEFAULT_TABLE",
    "MAX_KEY_BYTES",
    "STATUSES",
    "ApplyReport",
    "Status",
    "apply_schema",
    "db_now",
    "decode_headers",
    "encode_headers",
    "inbox_table",
    "kafka_headers",
    "meta_table",
    "outbox_rows_query",
    "outbox_table",
    "payload_table",
    "read_shard_count",
    "record_recovery",
    "recovery_table",
    "schema_sql",
    "shard_for",
    "trim_recovery",
    "validate_identifier",
]
