"""Which shards this relay may claim from, and how it waits between claims.

Per-key order needs one claimer per shard at a time: every row of a key lands
in the same shard (``schema.codec.shard_for``), so a relay that owns a shard is
the only one that can deliver that key. :class:`ShardOwnership` is the seam:
:class:`AllShards` owns every shard (one relay per table; two such relays never
double-claim a row, but give up per-key order). Redis leases
(:mod:`outboxkit.relay.ownership.redis_leases`) and, on PostgreSQL, session
advisory locks (:mod:`outboxkit.relay.ownership.advisory_locks`) plug in through
the same protocol, on one shared base (:mod:`outboxkit.relay.ownership`);
``--shard-ownership`` picks one (:func:`default_ownership`).

The wakers (:class:`Waker`, :class:`PollWaker`) live in
:mod:`outboxkit.relay.wakeup`; they are re-exported here for older imports.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from outboxkit.relay.foreign import ForeignRelayMonitor, OutsiderMonitor
from outboxkit.relay.ownership.redis_leases import LeaseSettings, RedisShardLeases
from outboxkit.relay.wakeup import PollWaker, Waker

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from outboxkit.relay.conflicts import OwnershipConflicts
    from outboxkit.relay.rows import ClaimFence
    from outboxkit.relay.settings import RelaySettings
    from outboxkit.runtime.identity import OutboxIdentity

__all__ = [
    "AllShards",
    "PollWaker",
    "ShardOwnership",
    "Waker",
    "claim_fence",
    "claiming",
    "default_ownership",
]


@runtime_checkable
class ShardOwnership(Protocol):
    """Decides which shards the relay may claim from at any moment."""

    def start(self, inflight_shards: Callable[[], frozenset[int]]) -> None:
        """Begin owning shards. ``inflight_shards()`` returns the shards in which the
        relay holds ``delivering`` rows right now: a shard must not be handed to
        another relay while it is in that set (its rows' order is still open).
        """

    def claimable(self) -> frozenset[int]:
        """Shards the relay may claim from now. An empty set means "claim nothing".

        An ownership that hands shards over (Redis leases) should also offer
        ``claiming()``, a context manager yielding these shards and holding them
        until the block ends; the relay claims inside it and registers the rows
        in ``inflight_shards()`` before leaving it (see :func:`claiming`).
        """

    def release_all(self) -> None:
        """Give up every shard. Called during drain, after the relay's rows were
        finalized or released and its Kafka producer closed, so the next owner
        starts from settled rows and no stale copy of them can follow its sends.
        """

    def close(self) -> None:
        """Free resources (connections); called after :meth:`release_all`."""


class AllShards:
    """Owns every shard ``0..shard_count-1``: the single-relay default without Redis."""

    def __init__(self, shard_count: int) -> None:
        if shard_count < 1:
            raise ValueError(f"shard_count must be >= 1 (got {shard_count})")
        self._all = frozenset(range(shard_count))

    def start(self, inflight_shards: Callable[[], frozenset[int]]) -> None:
        pass

    def claimable(self) -> frozenset[int]:
        return self._all

    @contextlib.contextmanager
    def claiming(self) -> Iterator[frozenset[int]]:
        yield self._all

    def release_all(self) -> None:
        pass

    def close(self) -> None:
        pass


def claiming(ownership: ShardOwnership) -> AbstractContextManager[frozenset[int]]:
    """The claim<->lease handshake: ``with claiming(ownership) as shards:`` claim
    from ``shards`` and register the claimed rows as in flight before the block
    ends; no shard yielded is handed to another relay while the block is open.

    Ownerships without a ``claiming()`` method (custom ones written against the
    older protocol) get ``claimable()`` and its contract: rows registered
    before the next call.
    """
    method = getattr(ownership, "claiming", None)
    if callable(method):
        return method()  # type: ignore[no-any-return]
    return contextlib.nullcontext(ownership.claimable())


def claim_fence(ownership: ShardOwnership, shards: frozenset[int]) -> ClaimFence | None:
    """The condition a claim from ``shards`` (yielded by :func:`claiming`) has the
    database check before it leases anything, for an ownership whose holds live
    on the database server and can end before it hears of it (PostgreSQL
    advisory locks: ``claim_fence(shards)``); None for the others."""
    method = getattr(ownership, "claim_fence", None)
    return method(shards) if callable(method) else None


def default_ownership(
    s: RelaySettings,
    shard_count: int,
    *,
    registry: CollectorRegistry,
    logger: logging.Logger,
    identity: OutboxIdentity | None = None,
    fingerprint: str | None = None,
    conflicts: OwnershipConflicts | None = None,
) -> tuple[ShardOwnership, ForeignRelayMonitor | OutsiderMonitor | None]:
    """What ``--shard-ownership`` asks for (:meth:`RelaySettings.effective_shard_ownership`):
    Redis shard leases, PostgreSQL advisory locks, or every shard and a watch for
    a second relay on the table (which would give up per-key order). Returns the
    ownership, and the monitor to check with each backlog sample.

    Leases and locks are named by ``identity`` (read from the database, see
    :mod:`outboxkit.runtime.identity`); ``fingerprint`` (the database server) is
    recorded beside a Redis membership and a member on another server reported
    to ``conflicts``."""
    kind = s.effective_shard_ownership()
    outbox = identity.key if identity is not None else None
    if kind == "advisory" and s.db_url:
        # psycopg only on PostgreSQL
        from outboxkit.relay.ownership.advisory_locks import PgAdvisoryShards

        ownership = PgAdvisoryShards(
            s.db_url,
            table=s.table,
            node_id=s.node_id,
            shard_count=shard_count,
            connect_timeout=s.connect_timeout,
            registry=registry,
            owned_gauge=False,  # the relay's own outbox_shards_owned counts claimable shards
            logger=logger,
            outbox=outbox,
        )
        return ownership, _outsiders(s, "advisory locks", ownership.is_member, conflicts)
    if kind != "redis" or not s.redis_url:
        monitor = ForeignRelayMonitor(s.table, s.node_id, logger, conflicts=conflicts)
        return AllShards(shard_count), monitor
    leases = RedisShardLeases(
        s.redis_url,
        table=s.table,
        node_id=s.node_id,
        shard_count=shard_count,
        settings=LeaseSettings(
            ttl=s.shard_lease_ttl,
            renew_interval=s.shard_renew_interval,
            batch_budget=s.shard_batch_budget(),
            prefix=s.redis_prefix,
        ),
        registry=registry,
        owned_gauge=False,  # the relay's own outbox_shards_owned counts claimable shards
        logger=logger,
        outbox=outbox,
        fingerprint=fingerprint,
        conflicts=conflicts,
    )
    leases.check_reachable(s.connect_timeout)
    return leases, _outsiders(s, "Redis leases", leases.is_member, conflicts)


def _outsiders(
    s: RelaySettings,
    mode: str,
    is_member: Callable[[str], bool | None],
    conflicts: OwnershipConflicts | None,
) -> OutsiderMonitor | None:
    if conflicts is None:
        return None
    return OutsiderMonitor(s.table, s.node_id, mode=mode, is_member=is_member, conflicts=conflicts)
