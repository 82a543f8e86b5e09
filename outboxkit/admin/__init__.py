"""Operator tools: status, the failed list, requeue, discard, purge and the recovery log.

``outboxkit admin`` is the command line over these functions; the relay reuses
:func:`purge_delivered` / :func:`run_retention` for its periodic retention.
See ``docs/admin.md``.
"""

from outboxkit.admin.discard import DiscardResult, discard
from outboxkit.admin.requeue import RequeueResult, Selection, Skipped, UnknownRowError, requeue
from outboxkit.admin.rows import (
    FailedRow,
    RecoveryEvent,
    UnknownEventError,
    list_failed,
    read_recovery,
    show_row,
)
from outboxkit.admin.status import (
    RelayView,
    ShardView,
    TableStatus,
    read_relay,
    read_shards,
    read_table_status,
    shard_key,
)
from outboxkit.relay.retention import (
    PurgeResult,
    count_purgeable,
    purge,
    purge_delivered,
    run_retention,
)
from outboxkit.runtime.parse import parse_retention, parse_time

__all__ = [
    "DiscardResult",
    "FailedRow",
    "PurgeResult",
    "RecoveryEvent",
    "RelayView",
    "RequeueResult",
    "Selection",
    "ShardView",
    "Skipped",
    "TableStatus",
    "UnknownEventError",
    "UnknownRowError",
    "count_purgeable",
    "discard",
    "list_failed",
    "parse_retention",
    "parse_time",
    "purge",
    "purge_delivered",
    "read_recovery",
    "read_relay",
    "read_shards",
    "read_table_status",
    "requeue",
    "run_retention",
    "shard_key",
    "show_row",
]
