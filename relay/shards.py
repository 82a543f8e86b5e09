"""Which shards a relay may claim from: the contract between the loop and ownership.

The relay asks :meth:`ShardOwnership.claimable` before every claim and limits the
claim to those shards. Without Redis one relay owns every shard
(:class:`AllShards`); with Redis, :class:`outboxkit.relay.leases.RedisShardLeases`
hands shards out through leases so that one shard is served by one relay at a
time, which is what keeps per-key order across relays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["AllShards", "ShardOwnership", "Waker"]


class ShardOwnership(Protocol):
    def start(self, inflight_shards: Callable[[], frozenset[int]]) -> None:
        """Begin owning shards; ``inflight_shards`` tells which shards hold rows this
        relay is delivering right now (a shard is given up only once it is absent)."""

    def claimable(self) -> frozenset[int]:
        """Shards the relay may claim from at this moment; called before every claim."""

    def release_all(self) -> None:
        """Give every shard up; called on drain after rows are finalized or released."""

    def close(self) -> None:
        """Free resources; after :meth:`release_all` when draining."""


class AllShards:
    """Single relay, no coordination: every shard is always claimable."""

    def __init__(self, shard_count: int) -> None:
        if shard_count < 1:
            raise ValueError(f"shard_count must be >= 1 (got {shard_count})")
        self._all = frozenset(range(shard_count))
        self._released = False

    def start(self, inflight_shards: Callable[[], frozenset[int]]) -> None:
        self._released = False

    def claimable(self) -> frozenset[int]:
        return frozenset() if self._released else self._all

    def release_all(self) -> None:
        self._released = True

    def close(self) -> None:
        self._released = True


class Waker(Protocol):
    def wait(self, timeout: float) -> None:
        """Return after ``timeout`` s, earlier on a wake-up hint or when draining."""
