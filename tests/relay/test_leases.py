"""Shard leases against a real Redis: CAS, fair split, handover, takeover, outage."""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from support.waiting import bound

from outboxkit.errors import ConfigError
from outboxkit.relay.leases import (
    ForeignRelayMonitor,
    LeaseSettings,
    RedisShardLeases,
    assign_shards,
    detect_foreign_relays,
    lease_key,
)
from outboxkit.schema.table import outbox_table

TABLE = "outbox_events"
# Short timings keep the suite quick; the proportions are those of production.
FAST = LeaseSettings(ttl=1.5, renew_interval=0.25, batch_budget=0.4)

LeasesFactory = Callable[..., RedisShardLeases]


class Inflight:
    """The relay's view of shards holding rows it is delivering (a test double)."""

    def __init__(self) -> None:
        self.shards: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self.shards)

    def set(self, shards: set[int]) -> None:
        with self._lock:
            self.shards = set(shards)


@pytest.fixture
def make_leases(redis_url: str, redis_prefix: str) -> Iterator[LeasesFactory]:
    made: list[RedisShardLeases] = []

    def make(
        node_id: str,
        *,
        shards: int = 64,
        settings: LeaseSettings = FAST,
        url: str | None = None,
        inflight: Callable[[], frozenset[int]] | None = None,
        registry: CollectorRegistry | None = None,
        start: bool = True,
        logger: logging.Logger | None = None,
    ) -> RedisShardLeases:
        s = LeaseSettings(
            ttl=settings.ttl,
            renew_interval=settings.renew_interval,
            batch_budget=settings.batch_budget,
            prefix=redis_prefix,
        )
        leases = RedisShardLeases(
            url or redis_url,
            table=TABLE,
            node_id=node_id,
            shard_count=shards,
            settings=s,
            registry=registry,
            logger=logger,
        )
        made.append(leases)
        if start:
            leases.start(inflight or Inflight())
        return leases

    yield make
    for leases in made:
        leases.close()


def wait_until(
    cond: Callable[[], bool], timeout: float, *, tick: Callable[[], Any] | None = None
) -> float:
    """Poll ``cond``; return the seconds it took. ``tick`` runs each round (the loop's
    claimable() calls, which handovers wait for)."""
    start = time.monotonic()
    while True:
        if tick is not None:
            tick()
        if cond():
            return time.monotonic() - start
        if time.monotonic() - start > bound(timeout):
            raise AssertionError(f"condition not met within {bound(timeout):g} s")
        time.sleep(0.02)


def claimable_of(relays: list[RedisShardLeases]) -> list[frozenset[int]]:
    views = [r.claimable() for r in relays]
    for i, a in enumerate(views):
        for b in views[i + 1 :]:
            assert not (a & b), f"shards claimable by two relays at once: {sorted(a & b)}"
    return views


def settled(relays: list[RedisShardLeases], shards: int) -> bool:
    views = claimable_of(relays)
    counts = [len(v) for v in views]
    fair = shards / len(relays)
    return (
        sum(counts) == shards
        and all(math.floor(fair) <= c <= math.ceil(fair) for c in counts)
        and all(r.members == tuple(sorted(x.node_id for x in relays)) for r in relays)
    )


def sample(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name)
    return 0.0 if value is None else value


# -- the split ------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("members", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("shards", [1, 8, 64, 100])
def test_assign_shards_is_complete_and_fair(members: int, shards: int) -> None:
    names = [f"relay-{i}" for i in range(members)]
    split = assign_shards(shards, names)
    assert sorted(s for owned in split.values() for s in owned) == list(range(shards))
    for owned in split.values():
        assert shards // members <= len(owned) <= math.ceil(shards / members)
    assert split == assign_shards(shards, reversed(names)), "every relay must compute the same"


@pytest.mark.unit
def test_assign_shards_moves_few_shards_when_one_joins() -> None:
    names = [f"relay-{i}" for i in range(4)]
    before = assign_shards(64, names)
    after = assign_shards(64, [*names, "relay-new"])
    moved = sum(len(before[m] - after[m]) for m in names)
    # The newcomer's share must move; rendezvous keeps the rest mostly in place.
    assert len(after["relay-new"]) <= moved <= len(after["relay-new"]) + 6


@pytest.mark.unit
def test_settings_refuse_a_ttl_that_cannot_cover_the_margin() -> None:
    with pytest.raises(ConfigError, match="ttl"):
        LeaseSettings(ttl=5, renew_interval=2, batch_budget=2).validate()
    LeaseSettings(ttl=7, renew_interval=2, batch_budget=2).validate()


# -- leases on a real Redis --------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_relays_split_64_shards_within_one_of_fair(make_leases: LeasesFactory, count: int) -> None:
    relays = [make_leases(f"relay-{i}") for i in range(count)]
    wait_until(lambda: settled(relays, 64), timeout=10)
    for r in relays:
        assert r.held() == r.claimable() == r.targets


@pytest.mark.integration
def test_lease_values_and_metrics(
    make_leases: LeasesFactory, redis_url: str, redis_prefix: str
) -> None:
    registry = CollectorRegistry()
    a = make_leases("relay-a", shards=8, registry=registry)
    assert a.claimable() == frozenset(range(8)), "the first tick runs inside start()"
    client = redis.Redis.from_url(redis_url)
    value = client.get(lease_key(redis_prefix, TABLE, 3))
    assert value is not None and value.decode().startswith("relay-a:")
    assert 0 < client.pttl(lease_key(redis_prefix, TABLE, 3)) <= 1500
    assert sample(registry, "outbox_shards_owned") == 8
    assert sample(registry, "outbox_shard_lease_acquired_total") == 8
    assert sample(registry, "outbox_rebalances_total") == 1
    client.close()


@pytest.mark.integration
def test_a_relay_cannot_renew_or_release_a_lease_another_now_holds(
    make_leases: LeasesFactory, redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    a = make_leases("relay-a", shards=4, registry=registry)
    assert 2 in a.claimable()
    key = lease_key(redis_prefix, TABLE, 2)
    client = redis.Redis.from_url(redis_url)
    # Force the expiry (as if relay-a had stalled past its TTL), then another relay acquires.
    client.delete(key)
    assert client.set(key, "relay-b:othertoken", nx=True, px=5000)

    caplog.set_level(logging.INFO, logger="outboxkit.relay.leases")
    wait_until(lambda: 2 not in a.held(), timeout=3)
    assert 2 not in a.claimable()
    time.sleep(3 * FAST.renew_interval)  # several renewals later ...
    assert client.get(key) == b"relay-b:othertoken", "relay-a overwrote a foreign lease"
    assert client.pttl(key) < 5000 - 500, "relay-a extended a lease that is not its own"
    assert sample(registry, "outbox_shard_lease_lost_total") == 1
    assert any("shard-lost" in r.getMessage() and "taken" in r.getMessage() for r in caplog.records)

    a.release_all()  # must delete its own three leases and leave relay-b's alone
    assert client.get(key) == b"relay-b:othertoken"
    assert [client.exists(lease_key(redis_prefix, TABLE, s)) for s in (0, 1, 3)] == [0, 0, 0]
    client.close()


@pytest.mark.integration
def test_handover_on_join_waits_for_inflight_rows(make_leases: LeasesFactory) -> None:
    inflight = Inflight()
    a = make_leases("relay-a", shards=16, inflight=inflight)
    assert a.claimable() == frozenset(range(16))
    b_future = assign_shards(16, ["relay-a", "relay-b"])["relay-b"]
    busy = set(sorted(b_future)[:3])  # relay-a is still delivering rows of these
    inflight.set(busy)

    b = make_leases("relay-b", shards=16)
    relays = [a, b]
    # relay-a stops claiming b's shards at once, hands over the idle ones ...
    wait_until(
        lambda: b.claimable() == b_future - busy, timeout=5, tick=lambda: claimable_of(relays)
    )
    assert a.claimable() == frozenset(range(16)) - b_future
    assert busy <= a.held(), "a shard with rows in flight was released"
    time.sleep(5 * FAST.renew_interval)
    claimable_of(relays)
    assert busy <= a.held() and not busy & b.held()

    # ... and the busy ones once their rows are finished.
    inflight.set(set())
    wait_until(lambda: settled(relays, 16), timeout=5, tick=lambda: claimable_of(relays))
    assert not a.held() & b.held()


@pytest.mark.integration
def test_lease_events_carry_redis_time_that_orders_a_handover(
    make_leases: LeasesFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Each relay logs when it gets to it; ``redis_ms`` is when Redis ran the
    script, so the release of a shard always sorts before its next acquisition."""
    caplog.set_level(logging.INFO, logger="outboxkit.relay.leases")
    before = time.time() * 1000
    a = make_leases("relay-a", shards=16, logger=logging.getLogger("outboxkit.relay.leases.a"))
    b = make_leases("relay-b", shards=16, logger=logging.getLogger("outboxkit.relay.leases.b"))
    relays = [a, b]
    wait_until(lambda: settled(relays, 16), timeout=5, tick=lambda: claimable_of(relays))
    after = time.time() * 1000

    def lease_events(name: str, event: str) -> dict[int, int]:
        found = {}
        for r in caplog.records:
            fields = getattr(r, "outboxkit_fields", {})
            if r.name.endswith(name) and getattr(r, "outboxkit_event", None) == event:
                found[int(fields["shard"])] = int(fields["redis_ms"])
        return found

    released = lease_events(".a", "shard-released")
    acquired = lease_events(".b", "shard-acquired")
    assert set(released) == set(acquired) == b.claimable() != frozenset()
    for shard, at in acquired.items():
        assert released[shard] <= at, f"shard {shard}: acquired at {at}, released later"
    every = [*lease_events(".a", "shard-acquired").values(), *released.values()]
    assert all(before - 1000 <= at <= after + 1000 for at in every + list(acquired.values()))


@pytest.mark.integration
def test_release_all_hands_shards_over_without_waiting_for_the_ttl(
    make_leases: LeasesFactory,
) -> None:
    slow = LeaseSettings(ttl=30, renew_interval=0.5, batch_budget=1)
    a = make_leases("relay-a", settings=slow)
    b = make_leases("relay-b", settings=slow)
    wait_until(lambda: settled([a, b], 64), timeout=10)
    a.release_all()
    assert a.claimable() == frozenset()
    took = wait_until(lambda: b.claimable() == frozenset(range(64)), timeout=10)
    assert took < slow.renew_interval + 1.0


@pytest.mark.integration
def test_a_dead_relays_shards_are_taken_over_within_ttl_plus_renew_period(
    make_leases: LeasesFactory,
) -> None:
    settings = LeaseSettings(ttl=2.0, renew_interval=0.3, batch_budget=0.5)
    a = make_leases("relay-a", settings=settings)
    b = make_leases("relay-b", settings=settings)
    wait_until(lambda: settled([a, b], 64), timeout=10)
    b_shards = b.held()
    b.close()  # a crash: renewals stop, nothing is released
    took = wait_until(lambda: b_shards <= a.claimable(), timeout=10)
    assert took <= settings.ttl + settings.renew_interval + 0.2, took
    assert a.claimable() == frozenset(range(64))
    assert a.members == ("relay-a",)
    # b renewed at most one renew period before it died.
    assert took >= settings.ttl - settings.renew_interval - 0.1, "taken before the lease expired"


@pytest.mark.fault
def test_redis_down_stops_claiming_before_lease_expiry_and_recovers(
    make_leases: LeasesFactory, caplog: pytest.LogCaptureFixture
) -> None:
    from support.services import RedisInstance, free_port

    settings = LeaseSettings(ttl=4.0, renew_interval=0.5, batch_budget=1.0)
    caplog.set_level(logging.INFO, logger="outboxkit.relay.leases")
    with RedisInstance("shard-leases-fault", free_port()) as instance:
        registry = CollectorRegistry()
        a = make_leases("relay-a", shards=8, settings=settings, url=instance.url, registry=registry)
        assert a.claimable() == frozenset(range(8))
        stopping = time.monotonic()
        instance.kill()
        stopped = time.monotonic()
        # Every lease was renewed within one renew period before ``stopping``, so
        # none expires before this; claiming must have ended well before it.
        expiry_floor = stopping - settings.renew_interval + settings.ttl
        took = wait_until(lambda: a.claimable() == frozenset(), timeout=settings.ttl)
        assert stopped + took < expiry_floor - 0.5, (stopped - stopping, took)
        while time.monotonic() < stopped + settings.ttl + 1:
            assert a.claimable() == frozenset()
            time.sleep(0.05)
        assert sample(registry, "outbox_shards_owned") == 0
        assert sample(registry, "outbox_shard_lease_lost_total") == 8

        instance.start()  # a fresh Redis: the old leases are gone
        took = wait_until(lambda: a.claimable() == frozenset(range(8)), timeout=10)
        assert took < 5
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("redis-unreachable") for m in messages)
    assert any(m.startswith("redis-reachable") for m in messages)


# -- two relays without Redis -----------------------------------------------------------


def _delivering(engine: sa.Engine, owner: str, expires_in_s: float, count: int = 2) -> None:
    t = outbox_table(TABLE)
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    rows = [
        {
            "event_id": f"{owner}-{i}-{time.monotonic_ns()}",
            "topic": "t",
            "message_key": b"k",
            "payload": b"p",
            "shard": 0,
            "status": "delivering",
            "attempts": 1,
            "next_attempt_at": now,
            "lease_owner": owner,
            "lease_token": "x" * 32,
            "lease_expires_at": now + dt.timedelta(seconds=expires_in_s),
            "created_at": now,
            "updated_at": now,
        }
        for i in range(count)
    ]
    with engine.begin() as conn:
        conn.execute(t.insert(), rows)


@pytest.mark.integration
def test_a_second_relay_without_redis_is_reported_once(
    engine: sa.Engine, outbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    _delivering(engine, "relay-me", 60)
    _delivering(engine, "crashed-predecessor", 60)
    _delivering(engine, "long-gone", -60)
    caplog.set_level(logging.INFO, logger="outboxkit.relay.leases")
    monitor = ForeignRelayMonitor(outbox, "relay-me")
    with engine.connect() as conn:
        assert set(detect_foreign_relays(conn, outbox, "relay-me")) == {"crashed-predecessor"}
        assert monitor.check(conn) == set()
        assert monitor.check(conn) == set(), "leftover leases that never move are no relay"
    _delivering(engine, "other-relay", 60)
    with engine.connect() as conn:
        monitor.check(conn)
    _delivering(engine, "other-relay", 120)  # it keeps claiming
    with engine.connect() as conn:
        assert monitor.check(conn) == {"other-relay"}
        monitor.check(conn)
    warnings = [r for r in caplog.records if "multiple-relays-without-redis" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "other-relay" in warnings[0].getMessage()
