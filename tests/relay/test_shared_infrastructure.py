"""Two outboxes that share infrastructure must not meet.

Services share one Redis and one database server in production, each with its
own outbox and the default table name. Every name the relays coordinate under
(shard leases and their member set, advisory locks, wake-up channels) carries
the outbox's identity, read from the database itself: two outboxes never split
each other's shards, and each relay delivers all of its own table.

Real MariaDB, PostgreSQL, Kafka and Redis.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from relay_support import (
    EmbeddedRelay,
    Pushgateway,
    add_events,
    fast_settings,
    outbox_key,
    status_counts,
    wait_for,
)
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.relay.conflicts import OwnershipConflicts
from outboxkit.relay.ownership.redis_leases import LeaseSettings, RedisShardLeases
from outboxkit.relay.retention import _retention_lock
from outboxkit.schema import apply_schema

pytestmark = pytest.mark.integration

SHARDS = 8
ROWS = 40
LEASE = {"shard_lease_ttl": 8.0, "shard_renew_interval": 0.5}


def _events(topic: str) -> list[Event]:
    return [Event(topic=topic, key=f"k{i}", payload={"n": i}) for i in range(ROWS)]


def _all_delivered(engines: list[sa.Engine]) -> bool:
    return all(status_counts(e, "outbox_events") == {"delivered": ROWS} for e in engines)


def wait_all_delivered(engines: list[sa.Engine], timeout: float = 20) -> None:
    try:
        wait_for(lambda: _all_delivered(engines), timeout=timeout, what="every table delivered")
    except AssertionError as exc:
        now = [status_counts(e, "outbox_events") for e in engines]
        raise AssertionError(f"{exc}; rows by status: {now}") from None


@contextlib.contextmanager
def _engine(url: str, **kw: Any) -> Iterator[sa.Engine]:
    eng = sa.create_engine(url, **kw)
    try:
        yield eng
    finally:
        eng.dispose()


def test_two_databases_sharing_one_redis_each_deliver_their_whole_table(
    db_url: str,
    second_db_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Two MariaDB databases, each with ``outbox_events``, one Redis, one prefix
    (the default settings of two services): each relay owns every shard of its
    own table."""
    with _engine(db_url) as one, _engine(second_db_url) as two:
        engines = [one, two]
        relays = []
        for url, eng in ((db_url, one), (second_db_url, two)):
            apply_schema(eng, shards=SHARDS)
            add_events(eng, "outbox_events", _events(kafka_topics(1)))
            relays.append(
                embedded(
                    fast_settings(
                        url,
                        kafka_bootstrap,
                        redis_url=redis_url,
                        redis_prefix=redis_prefix,
                        **LEASE,
                    )
                )
            )
        wait_all_delivered(engines)
        for r in relays:
            assert r.relay._resources.ownership is not None
            assert r.relay._resources.ownership.claimable() == frozenset(range(SHARDS))


def _in_schema(pg_url: str, schema: str) -> str:
    """``pg_url`` with ``search_path`` set to ``schema`` (as a service that keeps
    its tables in a schema of its own connects)."""
    return (
        sa.make_url(pg_url)
        .update_query_dict({"options": f"-csearch_path={schema}"})
        .render_as_string(hide_password=False)
    )


@pytest.mark.parametrize("ownership", ["advisory", "redis"])
def test_two_schemas_of_one_postgresql_database_each_deliver_their_whole_table(
    ownership: str,
    pg_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Two schemas, each with its own ``outbox_events``, in one database: advisory
    locks (and Redis leases) of one never cover the other's shards."""
    with _engine(pg_url, isolation_level="AUTOCOMMIT") as admin, admin.connect() as conn:
        for schema in ("svc_a", "svc_b"):
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    urls = [_in_schema(pg_url, s) for s in ("svc_a", "svc_b")]
    redis = {"redis_url": redis_url, "redis_prefix": redis_prefix} if ownership == "redis" else {}
    with _engine(urls[0]) as one, _engine(urls[1]) as two:
        engines = [one, two]
        relays = []
        for url, eng in zip(urls, engines, strict=True):
            apply_schema(eng, shards=SHARDS)
            add_events(eng, "outbox_events", _events(kafka_topics(1)))
            settings = fast_settings(
                url, kafka_bootstrap, shard_ownership=ownership, **redis, **LEASE
            )
            relays.append(embedded(settings))
        wait_all_delivered(engines)
        for r in relays:
            assert r.relay._resources.ownership is not None
            assert r.relay._resources.ownership.claimable() == frozenset(range(SHARDS))


# -- wake-ups ------------------------------------------------------------------


def _hints(er: EmbeddedRelay) -> int:
    return int(getattr(er.relay._resources.waker, "hints", 0))


def _flag(er: EmbeddedRelay, name: str) -> bool:
    """Whether the relay's waker has set its event ``name`` (subscribed, listening)."""
    return bool(getattr(er.relay._resources.waker, name).is_set())


def _channel(er: EmbeddedRelay) -> str:
    return str(getattr(er.relay._resources.waker, "channel", ""))


def test_a_redis_hint_wakes_only_the_relays_of_its_own_outbox(
    db_url: str,
    second_db_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Two MariaDB databases, one Redis and prefix: a commit in one outbox sends a
    hint that the other outbox's relay never receives. Absence is proven with a
    marker published on the other relay's channel after the hint arrived where
    it belongs: Redis delivers in the order it published."""
    import redis as redis_lib

    from outboxkit import enable_wakeups, enqueue

    topic = kafka_topics(1)
    with _engine(db_url) as one, _engine(second_db_url) as two:
        relays = []
        for url, eng in ((db_url, one), (second_db_url, two)):
            apply_schema(eng, shards=SHARDS)
            relays.append(
                embedded(
                    fast_settings(
                        url,
                        kafka_bootstrap,
                        redis_url=redis_url,
                        redis_prefix=redis_prefix,
                        poll_interval=30.0,
                        **LEASE,
                    )
                )
            )
        mine, other = relays
        for r in relays:
            wait_for(lambda r=r: _flag(r, "subscribed"), timeout=10)
        before_mine, before_other = _hints(mine), _hints(other)
        hook = enable_wakeups(one, redis_url, prefix=redis_prefix)
        try:
            with one.begin() as conn:
                enqueue(conn, topic=topic, payload={"n": 1}, key="k")
            wait_for(lambda: _hints(mine) > before_mine, timeout=10, what="the hint of its outbox")
        finally:
            hook.disable()
        client = redis_lib.Redis.from_url(redis_url)
        try:
            client.publish(_channel(other), b"marker")
        finally:
            client.close()
        wait_for(lambda: _hints(other) > before_other, timeout=10, what="the marker")
        assert _hints(other) == before_other + 1, "the other outbox's relay got the hint too"
        wait_all_delivered_rows(one, 1)


def wait_all_delivered_rows(engine: sa.Engine, count: int) -> None:
    wait_for(
        lambda: status_counts(engine, "outbox_events") == {"delivered": count},
        timeout=20,
        what=f"{count} rows delivered",
    )


def test_a_notify_wakes_only_the_relays_of_its_own_schema(
    pg_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Two schemas of one PostgreSQL database: the writer's ``NOTIFY`` for one
    never reaches the other's relay (absence proven by a marker notification
    on that relay's channel, delivered in commit order)."""
    from outboxkit import enqueue

    with _engine(pg_url, isolation_level="AUTOCOMMIT") as admin, admin.connect() as conn:
        for schema in ("svc_a", "svc_b"):
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    urls = [_in_schema(pg_url, s) for s in ("svc_a", "svc_b")]
    topic = kafka_topics(1)
    with _engine(urls[0]) as one, _engine(urls[1]) as two:
        relays = []
        for url, eng in zip(urls, (one, two), strict=True):
            apply_schema(eng, shards=SHARDS)
            relays.append(embedded(fast_settings(url, kafka_bootstrap, poll_interval=30.0)))
        mine, other = relays
        for r in relays:
            wait_for(lambda r=r: _flag(r, "listening"), timeout=10)
        assert _channel(mine) != _channel(other)
        before_mine, before_other = _hints(mine), _hints(other)
        with one.begin() as conn:
            enqueue(conn, topic=topic, payload={"n": 1}, key="k")
        wait_for(lambda: _hints(mine) > before_mine, timeout=10, what="the NOTIFY of its schema")
        with two.begin() as conn:
            conn.execute(sa.text("SELECT pg_notify(:c, 'marker')"), {"c": _channel(other)})
        wait_for(lambda: _hints(other) > before_other, timeout=10, what="the marker")
        assert _hints(other) == before_other + 1, "the other schema's relay was woken too"
        wait_all_delivered_rows(one, 1)


# -- what naming cannot rule out is reported -------------------------------------


def _leases(
    redis_url: str, prefix: str, node_id: str, *, outbox: str | None, **kw: Any
) -> RedisShardLeases:
    return RedisShardLeases(
        redis_url,
        table="outbox_events",
        node_id=node_id,
        shard_count=SHARDS,
        settings=LeaseSettings(ttl=3.0, renew_interval=0.2, batch_budget=1.0, prefix=prefix),
        outbox=outbox,
        **kw,
    )


def test_a_member_connected_to_another_database_server_is_reported(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two servers whose outboxes have the same database and table names, one Redis
    and prefix: the names meet, and each relay says so (an ERROR line naming both
    servers, the gauge, the readiness details) instead of silently splitting
    shards. It ends when the other relay leaves."""
    caplog.set_level(logging.INFO)
    registries = [CollectorRegistry(), CollectorRegistry()]
    log = logging.getLogger("outboxkit.relay")
    conflicts = [OwnershipConflicts(r, log, outbox="orders.outbox_events") for r in registries]
    a = _leases(
        redis_url, redis_prefix, "relay-a", outbox="orders.outbox_events",
        fingerprint="server-a", conflicts=conflicts[0],
    )  # fmt: skip
    b = _leases(
        redis_url, redis_prefix, "relay-b", outbox="orders.outbox_events",
        fingerprint="server-b", conflicts=conflicts[1],
    )  # fmt: skip
    try:
        a.start(frozenset)
        b.start(frozenset)
        for c in conflicts:
            wait_for(lambda c=c: "server" in c.details(), timeout=10, what="the conflict")
        assert conflicts[0].details()["server"]["others"] == {"relay-b": "server-b"}
        assert conflicts[1].details()["server"]["others"] == {"relay-a": "server-a"}
        for r in registries:
            assert r.get_sample_value("outbox_ownership_conflicts", {"kind": "server"}) == 1
        lines = [r for r in caplog.records if "ownership-conflict" in r.getMessage()]
        assert lines and all(r.levelno == logging.ERROR for r in lines)
        assert any("server-a" in r.getMessage() and "server-b" in r.getMessage() for r in lines)
        b.release_all()
        wait_for(lambda: "server" not in conflicts[0].details(), timeout=10, what="the end")
        assert registries[0].get_sample_value("outbox_ownership_conflicts", {"kind": "server"}) == 0
    finally:
        a.close()
        b.close()


def test_members_on_one_server_are_no_conflict(redis_url: str, redis_prefix: str) -> None:
    registry = CollectorRegistry()
    conflicts = OwnershipConflicts(registry, logging.getLogger("t"), outbox="o.t")
    made = [
        _leases(
            redis_url,
            redis_prefix,
            f"relay-{i}",
            outbox="o.outbox_events",
            fingerprint="server-a",
            conflicts=conflicts,
        )
        for i in range(2)
    ]
    try:
        for leases in made:
            leases.start(frozenset)
        wait_for(lambda: len(made[0].members) == 2, timeout=10, what="both members")
        made[0]._tick()
        assert conflicts.details() == {}
        assert registry.get_sample_value("outbox_ownership_conflicts", {"kind": "server"}) == 0
    finally:
        for leases in made:
            leases.close()


# -- mixed ownership modes on one outbox -------------------------------------------


def _slow_batches(batch: Any) -> None:
    """Each batch stays leased a moment (as with a slow broker), so the other relay's
    backlog sample sees its rows ``delivering``."""
    time.sleep(0.3)


@contextlib.contextmanager
def _writing(engine: sa.Engine, topic: str) -> Iterator[None]:
    """Rows keep arriving (every 50 ms) while the block runs."""
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            add_events(engine, "outbox_events", [Event(topic=topic, key=f"k{n % 7}", payload=n)])
            n += 1
            stop.wait(0.05)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def _outsider(er: EmbeddedRelay) -> float:
    return er.metric("outbox_ownership_conflicts", {"kind": "outsider"})


@on_both_databases
def test_a_relay_with_redis_and_one_without_on_one_outbox_are_reported(
    db_url: str,
    engine: sa.Engine,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    embedded: Callable[..., EmbeddedRelay],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under ``auto``, one relay with a Redis URL (leases) and one without (advisory
    locks on PostgreSQL, every shard on MariaDB) on one table: each owns shards
    the other does not know of. Both say so: the ERROR line, the gauge and the
    readiness details of each name the other relay."""
    caplog.set_level(logging.INFO)
    apply_schema(engine, shards=SHARDS)
    topic = kafka_topics(1)
    with_redis = embedded(
        fast_settings(
            db_url, kafka_bootstrap, redis_url=redis_url, redis_prefix=redis_prefix,
            node_id="relay-leases", **LEASE,
        ),
        on_batch=_slow_batches,
    )  # fmt: skip
    without = embedded(
        fast_settings(db_url, kafka_bootstrap, node_id="relay-no-redis"), on_batch=_slow_batches
    )
    with _writing(engine, topic):
        wait_for(
            lambda: _outsider(with_redis) == 1 and _outsider(without) == 1,
            timeout=30,
            what="both relays report the other",
        )
    assert with_redis.relay._ready_details()["ownership_conflicts"]["outsider"]["others"] == [
        "relay-no-redis"
    ]
    assert without.relay._ready_details()["ownership_conflicts"]["outsider"]["others"] == [
        "relay-leases"
    ]
    lines = [
        r.getMessage()
        for r in caplog.records
        if "ownership-conflict" in r.getMessage() and r.levelno == logging.ERROR
    ]
    assert any("relay-no-redis" in line for line in lines), lines
    assert any("relay-leases" in line for line in lines), lines


def test_relays_of_one_mode_are_no_outsiders(
    db_url: str,
    engine: sa.Engine,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Two relays sharing the shards through Redis see each other claim and report
    nothing."""
    apply_schema(engine, shards=SHARDS)
    topic = kafka_topics(1)
    relays = [
        embedded(
            fast_settings(
                db_url,
                kafka_bootstrap,
                redis_url=redis_url,
                redis_prefix=redis_prefix,
                node_id=f"relay-{i}",
                **LEASE,
            ),
            on_batch=_slow_batches,
        )
        for i in range(2)
    ]
    with _writing(engine, topic):
        time.sleep(6)  # a dozen backlog samples each, both relays claiming
    for r in relays:
        assert _outsider(r) == 0
        assert "ownership_conflicts" not in r.relay._ready_details()
    assert status_counts(engine, "outbox_events").get("delivered", 0) > 0


# -- upgrade from table-named keys ---------------------------------------------------
#
# An older relay names its leases and locks by the bare table. Its stand-in here is
# the same ownership built without an identity (``outbox=None``): it writes exactly
# the legacy names (``{prefix}outboxkit:outbox_events:shard:3``, the advisory lock
# keyed by crc32("outboxkit-shards:outbox_events")) that the older relay writes.


def _never_both(
    old: Any, new: Any, *, seconds: float, until: Callable[[], bool] | None = None
) -> int:
    """Sample both relays' claimable shards for ``seconds`` (or until ``until()``);
    fail if a shard is ever claimable by both. Returns the samples taken."""
    samples = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (until is not None and until()):
        both = old.claimable() & new.claimable()
        assert not both, f"shards {sorted(both)} claimable by an old and a new relay at once"
        samples += 1
        time.sleep(0.01)
    return samples


def test_an_older_relay_and_a_new_one_never_hold_one_lease_at_once(
    redis_url: str, redis_prefix: str
) -> None:
    """A rolling upgrade: the older relay holds every shard under the legacy keys;
    the new one, seeing it live, takes the legacy key beside its own for every
    lease, so it gets nothing the older one holds, and everything once that one
    drains. After that no legacy key is taken any more."""
    import redis as redis_lib

    from outboxkit.runtime.rediskeys import lease_key

    old = _leases(redis_url, redis_prefix, "relay-old", outbox=None)
    new = _leases(redis_url, redis_prefix, "relay-new", outbox="orders.outbox_events")
    client = redis_lib.Redis.from_url(redis_url)
    try:
        old.start(frozenset)
        wait_for(lambda: old.claimable() == frozenset(range(SHARDS)), timeout=10)
        new.start(frozenset)
        assert _never_both(old, new, seconds=2.0) > 0
        assert new.held() == frozenset(), "the new relay took a shard the older one holds"
        assert new.is_member("relay-old"), "an older relay that respects the keys is no outsider"
        old.release_all()
        _never_both(old, new, seconds=15, until=lambda: len(new.claimable()) == SHARDS)
        assert new.claimable() == frozenset(range(SHARDS))
        wait_for(lambda: not new._legacy_members, timeout=10, what="the older relay gone")
        # Leases taken while the older relay was live keep their companion until
        # released; drop them and take every shard again: no legacy key now.
        new.release_all()
        again = _leases(redis_url, redis_prefix, "relay-new-2", outbox="orders.outbox_events")
        try:
            again.start(frozenset)
            wait_for(lambda: len(again.claimable()) == SHARDS, timeout=15)
            legacy = [lease_key(redis_prefix, "outbox_events", s) for s in range(SHARDS)]
            assert client.exists(*legacy) == 0, "legacy keys taken with no older relay live"
        finally:
            again.close()
    finally:
        client.close()
        old.close()
        new.close()


def test_an_older_relay_and_a_new_one_never_hold_one_advisory_lock_at_once(pg_url: str) -> None:
    """The same upgrade with PostgreSQL advisory locks."""
    from outboxkit.relay.ownership.advisory_locks import PgAdvisoryShards

    def shards(node_id: str, outbox: str | None) -> PgAdvisoryShards:
        return PgAdvisoryShards(
            pg_url,
            table="outbox_events",
            node_id=node_id,
            shard_count=SHARDS,
            tick_interval=0.1,
            registry=CollectorRegistry(),
            outbox=outbox,
        )

    old = shards("relay-old", None)
    new = shards("relay-new", "db.public.outbox_events")
    try:
        old.start(frozenset)
        wait_for(lambda: old.claimable() == frozenset(range(SHARDS)), timeout=10)
        new.start(frozenset)
        assert _never_both(old, new, seconds=2.0) > 0
        assert new.held() == frozenset(), "the new relay took a shard the older one holds"
        assert new.is_member("relay-old")
        old.release_all()
        _never_both(old, new, seconds=15, until=lambda: len(new.claimable()) == SHARDS)
        assert new.claimable() == frozenset(range(SHARDS))
    finally:
        old.close()
        new.close()


# -- Pushgateway groups ---------------------------------------------------------------


def test_relays_of_two_outboxes_push_to_groups_of_their_own(
    db_url: str,
    second_db_url: str,
    kafka_bootstrap: str,
    embedded: Callable[..., EmbeddedRelay],
    pushgateway: Pushgateway,
) -> None:
    """Two relays of two outboxes under one node id (an operator's fixed
    OUTBOXKIT_NODE_ID in two services) push their exit metrics: each to a group
    of its own, named by the outbox, so neither replaces the other's."""
    node_id = pushgateway.track(f"relay-{uuid.uuid4().hex[:8]}")
    outboxes = []
    for url in (db_url, second_db_url):
        with _engine(url) as eng:
            apply_schema(eng, shards=SHARDS)
            outboxes.append(outbox_key(eng))
        er = embedded(
            fast_settings(url, kafka_bootstrap, node_id=node_id, pushgateway_url=pushgateway.url)
        )
        assert er.stop() == 0
    with urllib.request.urlopen(f"{pushgateway.url}/metrics", timeout=5) as resp:  # noqa: S310
        text = resp.read().decode()
    lines = [
        line
        for line in text.splitlines()
        if line.startswith("outbox_shutdown_pending{") and f'instance="{node_id}"' in line
    ]
    groups = {m.group(1) for line in lines if (m := re.search(r'outbox="([^"]*)"', line))}
    assert groups == set(outboxes), f"pushed {lines}, outboxes {outboxes}"


def test_two_outboxes_of_one_server_purge_at_once(db_url: str, second_db_url: str) -> None:
    """Two services' databases on one MariaDB, each with ``outbox_events``: the
    lock is named by the outbox (database and table), not the table alone, so
    neither skips the other's rounds (MariaDB's named locks are server-wide)."""
    one, two = sa.create_engine(db_url), sa.create_engine(second_db_url)
    try:
        with _retention_lock(one, "outbox_events") as first:
            assert first
            with _retention_lock(two, "outbox_events") as second:
                assert second, "another database's outbox shares the lock"
    finally:
        one.dispose()
        two.dispose()


def test_two_schemas_of_one_postgresql_database_purge_at_once(pg_url: str) -> None:
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        for schema in ("svc_a", "svc_b"):
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
            conn.execute(sa.text(f"CREATE TABLE {schema}.outbox_events (id int)"))
    admin.dispose()
    engines = [
        sa.create_engine(
            sa.make_url(pg_url).update_query_dict({"options": f"-csearch_path={schema}"})
        )
        for schema in ("svc_a", "svc_b")
    ]
    try:
        with _retention_lock(engines[0], "outbox_events") as first:
            assert first
            with _retention_lock(engines[1], "outbox_events") as second:
                assert second, "another schema's outbox shares the lock"
            with _retention_lock(engines[0], "outbox_events") as same:
                assert not same
    finally:
        for e in engines:
            e.dispose()
