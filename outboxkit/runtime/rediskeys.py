"""Every Redis key and channel name outboxkit uses, in one place.

The relay's shard leases write these keys, the writer's wake-up hints publish on
the channel, and ``outboxkit admin status`` reads the lease keys back: a name
changed here changes for all of them at once, so ``admin status`` cannot drift
from what the relays write.

``prefix`` is the operator's ``OUTBOXKIT_REDIS_PREFIX`` (a ``{hash tag}`` for
Redis Cluster). ``outbox`` is the outbox's identity
(:attr:`outboxkit.runtime.identity.OutboxIdentity.key`, e.g.
``orders.outbox_events`` or ``orders.public.outbox_events``): two outboxes that
share one Redis never share a name, whatever their table is called.

Before names carried the identity they carried the bare table name
(``outboxkit:outbox_events:shard:3``). Those *legacy* names are the same
functions called with the table name; relays of this version read the legacy
member set and take the legacy lease beside their own while relays of an older
version are live, so a rolling upgrade never gives a shard two owners
(docs/operations.md, "Upgrading across a change of names").
"""

from __future__ import annotations

__all__ = ["lease_key", "lease_owner", "members_key", "servers_key", "wakeup_channel"]


def lease_key(prefix: str, outbox: str, shard: int) -> str:
    """The lease of one shard: value ``node_id:token``, with a PX TTL."""
    return f"{prefix}outboxkit:{outbox}:shard:{shard}"


def lease_owner(value: str) -> str:
    """The ``node_id`` part of a lease value ``node_id:token``."""
    return value.rsplit(":", 1)[0] if ":" in value else value


def members_key(prefix: str, outbox: str) -> str:
    """The sorted set of live relays, scored with their heartbeat expiry."""
    return f"{prefix}outboxkit:{outbox}:members"


def servers_key(prefix: str, outbox: str) -> str:
    """The hash ``node_id -> server fingerprint`` of the live relays: which database
    server each member is connected to (see :mod:`outboxkit.runtime.identity`)."""
    return f"{prefix}outboxkit:{outbox}:servers"


def wakeup_channel(prefix: str, outbox: str) -> str:
    """The pub/sub channel on which wake-up hints for ``outbox`` are sent."""
    return f"{prefix}outboxkit:{outbox}:wakeup"
