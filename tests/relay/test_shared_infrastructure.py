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
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from relay_support import EmbeddedRelay, add_events, fast_settings, status_counts, wait_for

from outboxkit import Event
from outboxkit.relay.conflicts import OwnershipConflicts
from outboxkit.relay.leases import LeaseSettings, RedisShardLeases
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
            assert r.relay._ownership is not None
            assert r.relay._ownership.claimable() == frozenset(range(SHARDS))


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
            assert r.relay._ownership is not None
            assert r.relay._ownership.claimable() == frozenset(range(SHARDS))


# -- wake-ups ------------------------------------------------------------------


def _hints(er: EmbeddedRelay) -> int:
    return int(getattr(er.relay._waker, "hints", 0))


def _flag(er: EmbeddedRelay, name: str) -> bool:
    """Whether the relay's waker has set its event ``name`` (subscribed, listening)."""
    return bool(getattr(er.relay._waker, name).is_set())


def _channel(er: EmbeddedRelay) -> str:
    return str(getattr(er.relay._waker, "channel", ""))


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
