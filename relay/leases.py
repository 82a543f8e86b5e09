"""Former home of the Redis shard leases, kept for a release so imports keep working.

The leases are :mod:`outboxkit.relay.ownership.redis_leases` now, one backend
of the shard-ownership family (:mod:`outboxkit.relay.ownership`). The names
below are re-exported from where they live; import them from there.
"""

from outboxkit.relay.assignment import assign_shards
from outboxkit.relay.foreign import ForeignRelayMonitor, detect_foreign_relays
from outboxkit.relay.ownership.redis_leases import (
    LeaseSettings,
    RedisShardLeases,
    ShardLeaseMetrics,
)
from outboxkit.runtime.rediskeys import lease_key, members_key

__all__ = [
    "ForeignRelayMonitor",
    "LeaseSettings",
    "RedisShardLeases",
    "ShardLeaseMetrics",
    "assign_shards",
    "detect_foreign_relays",
    "lease_key",
    "members_key",
]
