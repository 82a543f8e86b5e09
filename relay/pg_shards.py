"""Former home of the PostgreSQL advisory-lock shard ownership, kept for a release
so imports keep working.

It is :mod:`outboxkit.relay.ownership.advisory_locks` now, one backend of the
shard-ownership family (:mod:`outboxkit.relay.ownership`). The names below are
re-exported from there; import them from there.
"""

from outboxkit.relay.ownership.advisory_locks import (
    MEMBER_KEY,
    AdvisoryShardMetrics,
    PgAdvisoryShards,
    lock_keys,
)

__all__ = ["MEMBER_KEY", "AdvisoryShardMetrics", "PgAdvisoryShards", "lock_keys"]
