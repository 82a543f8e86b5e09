"""Shard ownership: which relay may claim from which shard, one family of backends.

Per-key order across relays rests on one rule: a shard (and so every key hashed
to it) is claimed from by at most one relay at a time. Every backend implements
:class:`~outboxkit.relay.shards.ShardOwnership` on the same base, so the part a
fix to the hand-over touches exists once:

* :mod:`~outboxkit.relay.ownership.base`: :class:`ShardOwnershipBase`, the
  held and target shards under one lock, ``claiming()``, the rebalance when the
  live members change, the hand-over of surplus shards once no claim holds them,
  the metrics and the background thread's start and stop.
* :mod:`~outboxkit.relay.ownership.redis_leases`: ``RedisShardLeases``, leases
  in Redis (compare-and-set Lua scripts, heartbeats, local proof deadlines).
* :mod:`~outboxkit.relay.ownership.advisory_locks`: ``PgAdvisoryShards``,
  PostgreSQL session advisory locks on a dedicated session.

The backends are not imported here: the advisory locks need psycopg, which only
a PostgreSQL relay installs. ``--shard-ownership`` picks one
(:func:`outboxkit.relay.shards.default_ownership`).
"""

from outboxkit.relay.ownership.base import ShardOwnershipBase, ShardOwnershipMetrics

__all__ = ["ShardOwnershipBase", "ShardOwnershipMetrics"]
