"""Shard ownership: which relay may claim from which shard, one module per backend.

Per-key order across relays rests on one rule: a shard (and so every key hashed
to it) is claimed from by at most one relay at a time. Each backend implements
:class:`~outboxkit.relay.shards.ShardOwnership`:

* :mod:`~outboxkit.relay.ownership.redis_leases`: ``RedisShardLeases``, leases
  in Redis (compare-and-set Lua scripts, heartbeats, local proof deadlines).
* :mod:`~outboxkit.relay.ownership.advisory_locks`: ``PgAdvisoryShards``,
  PostgreSQL session advisory locks on a dedicated session.

The backends are not imported here: the advisory locks need psycopg, which only
a PostgreSQL relay installs. ``--shard-ownership`` picks one
(:func:`outboxkit.relay.shards.default_ownership`).
"""
