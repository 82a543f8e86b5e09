"""The shard-ownership family without services: the former module paths still
import, both backends share the base and its metric names, and the base's
hand-over waits for open claims and rows in flight."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

import outboxkit.relay.leases as former_leases
import outboxkit.relay.pg_shards as former_pg_shards
from outboxkit.relay import assignment, foreign
from outboxkit.relay.ownership import advisory_locks, redis_leases
from outboxkit.relay.ownership.base import Held, ShardOwnershipBase
from outboxkit.relay.shards import ShardOwnership
from outboxkit.runtime import rediskeys

pytestmark = pytest.mark.unit

OWNERSHIP_METRICS = {
    "outbox_shards_owned",
    "outbox_shard_lease_acquired",
    "outbox_shard_lease_lost",
    "outbox_shard_handovers",
    "outbox_rebalances",
}


def test_the_former_modules_re_export_the_same_objects() -> None:
    homes = {
        "ForeignRelayMonitor": foreign,
        "LeaseSettings": redis_leases,
        "RedisShardLeases": redis_leases,
        "ShardLeaseMetrics": redis_leases,
        "assign_shards": assignment,
        "detect_foreign_relays": foreign,
        "lease_key": rediskeys,
        "members_key": rediskeys,
    }
    assert sorted(former_leases.__all__) == sorted(homes)
    for name, home in homes.items():
        assert getattr(former_leases, name) is getattr(home, name), name
    for name in former_pg_shards.__all__:
        assert getattr(former_pg_shards, name) is getattr(advisory_locks, name), name


def _families(registry: CollectorRegistry) -> set[str]:
    return {family.name for family in registry.collect()}


def test_both_backends_are_one_family_under_the_same_metric_names() -> None:
    redis_registry, pg_registry = CollectorRegistry(), CollectorRegistry()
    leases = redis_leases.RedisShardLeases(
        "redis://127.0.0.1:1",  # never connected: nothing is started
        table="outbox_events",
        node_id="relay-a",
        shard_count=4,
        registry=redis_registry,
    )
    locks = advisory_locks.PgAdvisoryShards(
        "postgresql+psycopg://u@127.0.0.1:1/db",
        table="outbox_events",
        node_id="relay-a",
        shard_count=4,
        registry=pg_registry,
    )
    try:
        for ownership in (leases, locks):
            assert isinstance(ownership, ShardOwnershipBase)
            assert isinstance(ownership, ShardOwnership)
            assert ownership.claimable() == frozenset()
        assert _families(redis_registry) == OWNERSHIP_METRICS | {"outbox_shard_grants_fenced"}
        assert _families(pg_registry) == OWNERSHIP_METRICS
        assert leases.log.name == locks.log.name == "outboxkit.relay.leases"
    finally:
        leases.close()
        locks.close()


class _Memory(ShardOwnershipBase[Held, str]):
    """A backend that holds whatever it is told to: the base's logic alone."""

    _thread_kind = "memory"

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(
            table="outbox_events", node_id="relay-a", shard_count=4, logger=None, outbox=None
        )
        self.metrics = redis_leases.ShardLeaseMetrics(registry)
        self.inflight: frozenset[int] = frozenset()
        self._inflight = lambda: self.inflight

    def is_member(self, node_id: str) -> bool | None:
        return node_id in self._members

    def take_targets(self) -> None:
        with self._lock:
            for shard in self._targets - self._held.keys():
                self._held[shard] = Held()


def test_a_surplus_shard_is_ready_only_once_no_claim_and_no_row_holds_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="outboxkit.relay.leases")
    ownership = _Memory(CollectorRegistry())
    ownership._follow(("relay-a",), "relay-a")
    ownership.take_targets()
    assert ownership.claimable() == frozenset(range(4))

    with ownership.claiming() as shards:
        assert shards == frozenset(range(4))
        ownership._follow(("relay-a", "relay-b"), "relay-a")  # a second relay joins
        given = frozenset(range(4)) - ownership.targets
        assert given, "the split gives relay-b some shards"
        assert ownership._surplus_ready() == {}, "an open claim holds them"
        assert ownership.claimable() == ownership.targets, "marked: no new claim gets them"
        ownership.inflight = frozenset(given)  # the claim registers its rows

    assert ownership._surplus_ready() == {}, "their rows are still in flight"
    ownership.inflight = frozenset()
    assert set(ownership._surplus_ready()) == given
    rebalances = [r for r in caplog.records if r.getMessage().startswith("rebalance")]
    assert len(rebalances) == 2
