"""Every Redis key and channel name outboxkit uses, in one place.

The relay's shard leases write these keys, the writer's wake-up hints publish on
the channel, and ``outboxkit admin status`` reads the lease keys back: a name
changed here changes for all of them at once, so ``admin status`` cannot drift
from what the relays write.

``prefix`` is the operator's ``OUTBOXKIT_REDIS_PREFIX`` (a ``{hash tag}`` for
Redis Cluster); ``table`` is an already validated outbox table name.
"""

from __future__ import annotations

__all__ = ["lease_key", "lease_owner", "members_key", "wakeup_channel"]


def lease_key(prefix: str, table: str, shard: int) -> str:
    """The lease of one shard: value ``node_id:token``, with a PX TTL."""
    return f"{prefix}outboxkit:{table}:shard:{shard}"


def lease_owner(value: str) -> str:
    """The ``node_id`` part of a lease value ``node_id:token``."""
    return value.rsplit(":", 1)[0] if ":" in value else value


def members_key(prefix: str, table: str) -> str:
    """The sorted set of live relays, scored with their heartbeat expiry."""
    return f"{prefix}outboxkit:{table}:members"


def wakeup_channel(prefix: str, table: str) -> str:
    """The pub/sub channel on which wake-up hints for ``table`` are sent."""
    return f"{prefix}outboxkit:{table}:wakeup"
