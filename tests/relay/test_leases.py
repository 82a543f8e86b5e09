"""Shard leases against a real Redis: CAS, fair split, handover, takeover, outage."""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from support.databases import on_both_databases
from support.ownership import assert_never_owned_twice, parse_shard_ranges
from support.services import RedisInstance, free_port
from support.waiting import bound

from outboxkit.errors import ConfigError
from outboxkit.relay.assignment import assign_shards
from outboxkit.relay.foreign import ForeignRelayMonitor, detect_foreign_relays
from outboxkit.relay.ownership.redis_leases import LeaseSettings, RedisShardLeases
from outboxkit.runtime.rediskeys import lease_key
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
    """Each relay logs when it gets to it; ``redis_epoch_ms`` is when Redis ran the
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
                for shard in parse_shard_ranges(fields["shards"]):
                    found[shard] = int(fields["redis_epoch_ms"])
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
        # A fresh Redis lends nothing before it has been up for one lease TTL.
        wait_until(lambda: a.claimable() == frozenset(range(8)), timeout=settings.ttl + 5)
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
        took = wait_until(lambda: a.claimable() == frozenset(range(8)), timeout=15)
        assert took < settings.ttl + 3  # the restart fence (one TTL of uptime), then a tick
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
@on_both_databases
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


class _OpenClaim:
    """A claim in progress: ``claiming()`` entered and not yet left (or, for an
    ownership with only the older protocol, ``claimable()`` called and nothing
    registered yet)."""

    def __init__(self, leases: RedisShardLeases) -> None:
        self._cm = leases.claiming() if hasattr(leases, "claiming") else None
        self.shards = self._cm.__enter__() if self._cm is not None else leases.claimable()

    def close(self) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)


@pytest.mark.integration
@pytest.mark.parametrize("moment", ["during-the-mark", "before-the-join"])
def test_a_claim_open_during_a_handover_keeps_its_shards_until_it_ends(
    moment: str,
    make_leases: LeasesFactory,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay loop starts a claim, and a second relay joins. ``during-the-mark``:
    the claim starts at the worst moment, while the lease thread is between reading
    the clock and marking shards for handover. ``before-the-join``: the claim is
    open before the rebalance. Either way, the shards that claim got stay this
    relay's until it ends and its rows are finished."""
    # The hand-over reads the clock, under the lock, where the base marks the shards.
    import outboxkit.relay.ownership.base as base_module

    inflight = Inflight()
    a = make_leases("relay-a", shards=16, inflight=inflight)
    claims: list[_OpenClaim] = []
    armed = threading.Event()
    real_time = base_module.time

    class SlippingClock:
        def __getattr__(self, name: str) -> Any:
            return getattr(real_time, name)

        def monotonic(self) -> float:
            now = real_time.monotonic()
            if (
                armed.is_set()
                and sys._getframe(1).f_code.co_name == "_surplus_ready"
                and a.targets != frozenset(range(16))  # the rebalance happened
            ):
                armed.clear()
                # The loop thread claims right now; give it a moment (it may have
                # to wait for the lease thread's lock, which is the point).
                t = threading.Thread(target=lambda: claims.append(_OpenClaim(a)))
                t.start()
                t.join(0.3)
            return now

    monkeypatch.setattr(base_module, "time", SlippingClock())
    b_future = assign_shards(16, ["relay-a", "relay-b"])["relay-b"]
    if moment == "during-the-mark":
        armed.set()
    else:
        claims.append(_OpenClaim(a))
    b = make_leases("relay-b", shards=16)
    wait_until(lambda: bool(claims), timeout=5)
    claim = claims[0]
    taken = claim.shards & b_future  # shards the open claim may be using
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 6 * FAST.renew_interval
        while time.monotonic() < deadline:  # several handover ticks while it is open
            for s in taken:
                value = client.get(lease_key(redis_prefix, TABLE, s)) or b""
                assert value.startswith(b"relay-a:"), f"shard {s} released during its claim"
            assert not taken & b.claimable(), "two relays may claim the same shard"
            time.sleep(0.02)
        # The claim registers its rows (one shard keeps rows in flight) and ends.
        busy = set(sorted(taken)[:1])
        inflight.set(busy)
        claim.close()
        relays = [a, b]
        wait_until(
            lambda: b.claimable() == b_future - busy, timeout=5, tick=lambda: claimable_of(relays)
        )
        assert busy <= a.held()
        inflight.set(set())
        wait_until(lambda: settled(relays, 16), timeout=5, tick=lambda: claimable_of(relays))
    finally:
        client.close()


@pytest.fixture
def own_redis() -> Iterator[RedisInstance]:
    instance = RedisInstance(f"leases-{uuid.uuid4().hex[:6]}", free_port())
    try:
        instance.start(fresh=True)
    except Exception as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            raise
        pytest.skip(f"dedicated Redis did not start: {exc}")
    yield instance
    instance.stop()
    shutil.rmtree(instance.state_dir, ignore_errors=True)


class _Grants:
    """Every successful acquire/renew/release of each relay, on Redis's clock."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, str, int]] = []  # node, shard, kind, redis_epoch_ms
        self._lock = threading.Lock()

    def watch(self, leases: RedisShardLeases) -> None:
        real = leases._call_cas
        kinds = {
            id(leases._acquire): "acquire",
            id(leases._renew): "renew",
            id(leases._release): "release",
        }

        def recording(
            script: Any, values: dict[int, str], companions: set[int] | None = None
        ) -> tuple[dict[int, int], int]:
            results, redis_epoch_ms = real(script, values, companions)
            with self._lock:
                for shard, result in results.items():
                    if result == 1:
                        self.events.append(
                            (leases.node_id, shard, kinds[id(script)], redis_epoch_ms)
                        )
            return results, redis_epoch_ms

        leases._call_cas = recording  # type: ignore[method-assign]

    def overlaps(self, ttl_ms: int) -> list[str]:
        """Two nodes holding one shard at the same Redis moment. A node holds a shard
        from an acquire until a release, or until TTL after its last acquire/renew."""
        with self._lock:
            events = sorted(self.events, key=lambda e: e[3])
        spans: dict[int, list[tuple[str, int, int]]] = {}
        open_: dict[tuple[str, int], tuple[int, int]] = {}  # (node, shard) -> (start, proof)
        for node, shard, kind, ms in events:
            key = (node, shard)
            if kind == "acquire":
                if key in open_:
                    start, proof = open_.pop(key)
                    spans.setdefault(shard, []).append((node, start, min(ms, proof + ttl_ms)))
                open_[key] = (ms, ms)
            elif kind == "renew" and key in open_:
                open_[key] = (open_[key][0], ms)
            elif kind == "release" and key in open_:
                start, _ = open_.pop(key)
                spans.setdefault(shard, []).append((node, start, ms))
        for (node, shard), (start, proof) in open_.items():
            spans.setdefault(shard, []).append((node, start, proof + ttl_ms))
        found = []
        for shard, items in spans.items():
            for i, (n1, s1, e1) in enumerate(items):
                for n2, s2, e2 in items[i + 1 :]:
                    if n1 != n2 and s1 < e2 and s2 < e1:
                        found.append(f"shard {shard}: {n1} [{s1}, {e1}] and {n2} [{s2}, {e2}]")
        return found


@pytest.mark.integration
@pytest.mark.fault
def test_a_restarted_redis_lends_no_shard_that_an_old_owner_may_still_hold(
    own_redis: RedisInstance,
) -> None:
    """Redis restarted without persistence forgets every lease. The relays must not
    take shards from it until the previous owners' leases could have run out, so
    no two relays ever hold one shard at the same moment by Redis's clock."""
    timing = LeaseSettings(ttl=3.0, renew_interval=0.3, batch_budget=0.8, prefix="t:")
    inflight = Inflight()
    grants = _Grants()
    made: list[RedisShardLeases] = []

    def start(node_id: str) -> RedisShardLeases:
        leases = RedisShardLeases(
            own_redis.url, table=TABLE, node_id=node_id, shard_count=8, settings=timing
        )
        grants.watch(leases)
        made.append(leases)
        leases.start(inflight)
        return leases

    try:
        a = start("relay-a")
        b = start("relay-b")
        relays = [a, b]
        wait_until(lambda: settled(relays, 8), timeout=15, tick=lambda: claimable_of(relays))
        own_redis.kill()
        # The fence counts Redis's uptime from its process start, which comes after
        # this and may be well before start() returns on a busy machine.
        restarted = time.monotonic()
        own_redis.start()
        # Both come back to a fair split; meanwhile no shard is claimable twice.
        wait_until(
            lambda: time.monotonic() - restarted > 1.0 and settled(relays, 8),
            timeout=20,
            tick=lambda: claimable_of(relays),
        )
        ttl_ms = round(timing.ttl * 1000)
        assert grants.overlaps(ttl_ms) == []
        assert time.monotonic() - restarted >= timing.ttl - 1.0, "granted before the fence"
    finally:
        for leases in made:
            leases.close()


class _StandingClock:
    """The ``time`` of the shard-ownership modules, whose monotonic clock stands still while
    :meth:`stand` is on and then goes on from where it stood, as in a virtual
    machine that is stopped and resumed (a snapshot, a live migration). The wall
    clock and Redis's clock count the whole time."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._lost = 0.0
        self._since: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def monotonic(self) -> float:
        since = self._since
        return (since if since is not None else self._real.monotonic()) - self._lost

    def stand(self) -> None:
        self._since = self._real.monotonic()

    def resume(self) -> None:
        assert self._since is not None
        self._lost += self._real.monotonic() - self._since
        self._since = None


class _Gate:
    """Holds a relay's lease thread before its next tick while closed."""

    def __init__(self, leases: RedisShardLeases) -> None:
        self.open = threading.Event()
        self.open.set()
        self.parked = threading.Event()
        tick = leases._tick

        def gated() -> None:
            if not self.open.is_set():
                self.parked.set()
                self.open.wait()
                self.parked.clear()
            tick()

        leases._tick = gated  # type: ignore[method-assign]

    def close(self) -> None:
        self.open.clear()
        wait_until(self.parked.is_set, timeout=5)


@pytest.mark.integration
def test_a_pause_of_the_machine_ends_the_proof_before_another_relay_takes_the_shards(
    make_leases: LeasesFactory,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The whole machine stops for longer than the lease TTL; its monotonic clock
    does not count the pause, Redis's TTLs do. On resume the relay that held the
    shards must not claim from them: by the time it learns from Redis that they
    were taken, the other relay may already claim from them."""
    import outboxkit.relay.ownership.base as base_module
    import outboxkit.relay.ownership.redis_leases as leases_module

    clock = _StandingClock(leases_module.time)
    for module in (leases_module, base_module):  # the proofs, and the hand-over's marks
        monkeypatch.setattr(module, "time", clock)
    caplog.set_level(logging.INFO, logger="outboxkit.relay.leases")
    # A proof lasts ttl - renew - budget = 3 s after each renewal: longer than a
    # renewal period plus the time the checks below take, shorter than the pause.
    slow = LeaseSettings(ttl=4.0, renew_interval=0.5, batch_budget=0.5)
    log_a = logging.getLogger("outboxkit.relay.leases.a")
    a = make_leases("relay-a", shards=16, settings=slow, logger=log_a)
    b = make_leases(
        "relay-b", shards=16, settings=slow, logger=logging.getLogger("outboxkit.relay.leases.b")
    )
    relays = [a, b]
    wait_until(lambda: settled(relays, 16), timeout=10, tick=lambda: claimable_of(relays))
    held_by_a = a.claimable()
    gates = [_Gate(a), _Gate(b)]
    for gate in gates:
        gate.close()

    clock.stand()  # the machine stops; Redis's clock runs on
    client = redis.Redis.from_url(redis_url)
    try:
        keys = [lease_key(redis_prefix, TABLE, s) for s in range(16)]
        wait_until(lambda: client.exists(*keys) == 0, timeout=10)  # every lease expired
    finally:
        client.close()
    clock.resume()

    assert a.claimable() == frozenset(), "a lease Redis let expire during the pause"
    gates[1].open.set()  # b resumes first and takes every shard
    wait_until(
        lambda: b.claimable() == frozenset(range(16)), timeout=10, tick=lambda: claimable_of(relays)
    )
    gates[0].open.set()
    wait_until(lambda: settled(relays, 16), timeout=10, tick=lambda: claimable_of(relays))

    records = []
    for r in caplog.records:
        if r.name.startswith("outboxkit.relay.leases.") and hasattr(r, "outboxkit_event"):
            records.append(
                {
                    "event": r.outboxkit_event,
                    "node_id": "relay-" + r.name.rsplit(".", 1)[1],
                    "ts": dt.datetime.fromtimestamp(r.created, dt.UTC).strftime(
                        "%Y-%m-%dT%H:%M:%S.%fZ"
                    ),
                    **getattr(r, "outboxkit_fields", {}),
                }
            )
    unproven = {
        int(r["shard"]): int(r["trusted_until_ms"])
        for r in records
        if r["node_id"] == "relay-a" and r.get("reason") == "lease-unproven"
    }
    assert set(unproven) == held_by_a
    assert assert_never_owned_twice(records) > 0
