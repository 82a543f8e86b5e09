"""The relay's PostgreSQL coordination end to end, on real PostgreSQL and Kafka:
``NOTIFY`` wake-ups and shard ownership by session advisory locks.

The relay-level tests need the relay's PostgreSQL SQL (claim, finalize,
release); the wiring tests at the top need only the database.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from relay_support import (
    FAST,
    EmbeddedRelay,
    RelayProcess,
    add_events,
    cli_args,
    consume,
    fast_settings,
    outbox_key,
    wait_for,
)
from test_pg_shards import Unnoticing, server_owners, terminate

from outboxkit import Event
from outboxkit.relay import RelaySettings
from outboxkit.relay.ownership.advisory_locks import PgAdvisoryShards
from outboxkit.relay.ownership.redis_leases import RedisShardLeases
from outboxkit.relay.pg_wakeup import PgNotifyWaker
from outboxkit.relay.shards import default_ownership
from outboxkit.relay.wakeup import default_waker
from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.schema import apply_schema

pytestmark = pytest.mark.integration

TABLE = "outbox_events"
SHARDS = 8
#: Long enough that only a wake-up explains a delivery well before it.
LONG_POLL_S = 20.0


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(pg_url)
    apply_schema(engine, shards=SHARDS)
    yield engine
    engine.dispose()


def _ownership(relay: EmbeddedRelay) -> PgAdvisoryShards:
    ownership = relay.relay._resources.ownership
    assert isinstance(ownership, PgAdvisoryShards), type(ownership)
    return ownership


def _split(relays: list[EmbeddedRelay]) -> bool:
    owned = [_ownership(r).claimable() for r in relays]
    union = frozenset().union(*owned)
    return sum(len(o) for o in owned) == SHARDS == len(union) and all(owned)


def _first_delivery_order(messages: list[object]) -> dict[bytes | None, list[int]]:
    seen: set[str] = set()
    order: dict[bytes | None, list[int]] = defaultdict(list)
    for m in messages:
        event_id = m.headers["event_id"].decode()  # type: ignore[attr-defined]
        if event_id in seen:
            continue  # a duplicate (at least once) may follow later
        seen.add(event_id)
        order[m.key].append(json.loads(m.value)["n"])  # type: ignore[attr-defined]
    return order


# -- wiring (database only) ------------------------------------------------------


def test_postgresql_without_redis_gets_advisory_locks_and_notify(
    pg_engine: sa.Engine, pg_url: str, kafka_bootstrap: str
) -> None:
    s = fast_settings(pg_url, kafka_bootstrap)
    assert s.effective_shard_ownership() == "advisory"
    ownership, monitor = default_ownership(
        s, SHARDS, registry=CollectorRegistry(), logger=logging.getLogger("t")
    )
    assert isinstance(ownership, PgAdvisoryShards) and monitor is None
    try:
        ownership.start(frozenset)
        wait_for(lambda: len(ownership.claimable()) == SHARDS, timeout=10, what="all shards")
    finally:
        ownership.release_all()
        ownership.close()
    lifecycle = Lifecycle(service="t", node_id="n", shutdown_timeout=5.0)
    waker, opened = default_waker(s, lifecycle, logger=logging.getLogger("t"))
    try:
        assert isinstance(waker, PgNotifyWaker) and opened == "pg-wakeups"
        wait_for(waker.listening.is_set, timeout=10, what="LISTEN")
    finally:
        waker.close()


def test_postgresql_with_redis_gets_redis_leases_and_still_notify(
    pg_engine: sa.Engine, pg_url: str, kafka_bootstrap: str, redis_url: str, redis_prefix: str
) -> None:
    s = fast_settings(pg_url, kafka_bootstrap, redis_url=redis_url, redis_prefix=redis_prefix)
    ownership, monitor = default_ownership(
        s, SHARDS, registry=CollectorRegistry(), logger=logging.getLogger("t")
    )
    try:
        assert isinstance(ownership, RedisShardLeases) and monitor is None
    finally:
        ownership.close()
    lifecycle = Lifecycle(service="t", node_id="n", shutdown_timeout=5.0)
    waker, opened = default_waker(s, lifecycle, logger=logging.getLogger("t"))
    try:  # NOTIFY is sent at commit by enqueue itself: preferred over Redis hints
        assert isinstance(waker, PgNotifyWaker) and opened == "pg-wakeups"
    finally:
        waker.close()


# -- the relay (needs the relay's PostgreSQL SQL) ----------------------------------


def test_a_committed_event_is_delivered_long_before_the_poll_interval(
    pg_engine: sa.Engine,
    pg_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=1)
    relay = embedded(fast_settings(pg_url, kafka_bootstrap, poll_interval=LONG_POLL_S))
    waker = relay.relay._resources.waker
    assert isinstance(waker, PgNotifyWaker)
    wait_for(waker.listening.is_set, timeout=10, what="the relay listening")
    time.sleep(0.5)  # let the claim that follows LISTEN find nothing and wait
    committed = time.monotonic()
    add_events(pg_engine, TABLE, [Event(topic=topic, key="k", payload={"n": 0})])
    wait_for(
        lambda: relay.metric("outbox_rows_delivered_total") >= 1,
        timeout=LONG_POLL_S,
        interval=0.01,
        what="the delivery",
    )
    took = time.monotonic() - committed
    assert took < LONG_POLL_S / 4, f"delivered {took:.2f} s after the commit: no wake-up"
    assert waker.hints >= 1
    assert relay.stop() == 0


def test_two_relays_split_the_shards_and_deliver_every_event_in_key_order(
    pg_engine: sa.Engine,
    pg_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=3)
    events = [Event(topic=topic, key=f"key-{i % 40}", payload={"n": i}) for i in range(2000)]
    add_events(pg_engine, TABLE, events[:1000])
    a = embedded(fast_settings(pg_url, kafka_bootstrap, batch_size=100))
    b = embedded(fast_settings(pg_url, kafka_bootstrap, batch_size=100))
    wait_for(lambda: _split([a, b]), timeout=15, what="a disjoint split over both relays")
    add_events(pg_engine, TABLE, events[1000:])
    wait_for(
        lambda: (
            a.metric("outbox_rows_delivered_total") + b.metric("outbox_rows_delivered_total")
            >= 2000
        ),
        timeout=60,
        what="every delivery",
    )
    assert a.metric("outbox_rows_delivered_total") > 0 < b.metric("outbox_rows_delivered_total")
    assert a.stop() == 0 and b.stop() == 0
    messages = consume(kafka_bootstrap, topic, expected=2000)
    order = _first_delivery_order(messages)
    assert sum(len(v) for v in order.values()) == 2000
    for key, ns in order.items():
        assert ns == sorted(ns), f"{key!r} out of order"


def test_a_draining_relay_hands_its_shards_over(
    pg_engine: sa.Engine,
    pg_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=1)
    a = embedded(fast_settings(pg_url, kafka_bootstrap))
    b = embedded(fast_settings(pg_url, kafka_bootstrap))
    wait_for(lambda: _split([a, b]), timeout=15, what="a split")
    assert a.stop() == 0
    wait_for(lambda: len(_ownership(b).claimable()) == SHARDS, timeout=10, what="b owns all")
    add_events(
        pg_engine, TABLE, [Event(topic=topic, key=f"k{i}", payload={"n": i}) for i in range(50)]
    )
    wait_for(lambda: b.metric("outbox_rows_delivered_total") >= 50, timeout=30, what="b delivers")
    assert b.stop() == 0


def test_a_relay_whose_session_dies_stops_claiming_then_comes_back(
    pg_engine: sa.Engine,
    pg_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=1)
    a = embedded(fast_settings(pg_url, kafka_bootstrap))
    b = embedded(fast_settings(pg_url, kafka_bootstrap))
    wait_for(lambda: _split([a, b]), timeout=15, what="a split")
    pid = _ownership(a).backend_pid
    with pg_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    wait_for(
        lambda: _ownership(a).claimable() == frozenset(), timeout=1, interval=0.005, what="a stops"
    )
    add_events(
        pg_engine, TABLE, [Event(topic=topic, key=f"k{i}", payload={"n": i}) for i in range(200)]
    )
    wait_for(lambda: _split([a, b]), timeout=20, what="a back with a new session")
    assert _ownership(a).backend_pid != pid
    wait_for(
        lambda: (
            a.metric("outbox_rows_delivered_total") + b.metric("outbox_rows_delivered_total") >= 200
        ),
        timeout=30,
        what="every delivery",
    )
    assert a.stop() == 0 and b.stop() == 0
    assert len(_first_delivery_order(consume(kafka_bootstrap, topic, expected=200))) == 200


def test_a_relay_that_has_not_heard_its_session_died_leases_nothing(
    pg_engine: sa.Engine,
    pg_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Between the server ending a relay's ownership session (and with it the
    shard locks another relay may take at once) and the relay hearing of it,
    the relay still believes it owns its shards. Its claims check the session
    on the server after locking their rows, and lease nothing."""
    caplog.set_level(logging.INFO, logger="outboxkit")
    topic = kafka_topics(partitions=1)
    settings = fast_settings(pg_url, kafka_bootstrap)
    a = embedded(settings)
    ownership = _ownership(a)
    wait_for(lambda: len(ownership.claimable()) == SHARDS, timeout=15, what="a owns every shard")
    unnoticing = Unnoticing()
    unnoticing.install(monkeypatch, ownership)
    terminate(pg_engine, ownership.backend_pid)
    events = [Event(topic=topic, key=f"k{i % 4}", payload={"n": i}) for i in range(20)]
    add_events(pg_engine, TABLE, events)

    def fenced() -> bool:
        return any(getattr(r, "outboxkit_event", None) == "claim-fenced" for r in caplog.records)

    wait_for(fenced, timeout=15, what="a claim fenced off")
    with pg_engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT status, attempts, lease_owner FROM {TABLE}")).all()
    assert len(rows) == 20
    assert {tuple(r) for r in rows} == {("pending", 0, None)}, rows
    assert a.metric("outbox_rows_claimed_total") == 0
    assert len(ownership.claimable()) == SHARDS  # still unheard: only the fence held
    unnoticing.gate.set()
    wait_for(lambda: a.metric("outbox_rows_delivered_total") >= 20, timeout=30, what="delivery")
    assert a.stop() == 0
    with pg_engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT status, attempts FROM {TABLE}")).all()
    assert {tuple(r) for r in rows} == {("delivered", 1)}, rows
    assert len(_first_delivery_order(consume(kafka_bootstrap, topic, expected=20))) == 4


def test_an_embedded_relay_given_only_a_postgresql_engine_coordinates_the_same_way(
    pg_engine: sa.Engine,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=1)
    settings = RelaySettings(  # no db_url: the engine is all the relay gets
        kafka_bootstrap=kafka_bootstrap, kafka_config={"message.timeout.ms": "2000"}, **FAST
    )
    relay = embedded(settings, engine=pg_engine)
    assert len(_ownership(relay).claimable()) == SHARDS
    waker = relay.relay._resources.waker
    assert isinstance(waker, PgNotifyWaker)
    wait_for(waker.listening.is_set, timeout=10, what="the relay listening")
    add_events(pg_engine, TABLE, [Event(topic=topic, key="k", payload={"n": 0})])
    wait_for(lambda: relay.metric("outbox_rows_delivered_total") >= 1, timeout=10, what="delivery")
    assert relay.stop() == 0


_BOTH = "-c plan_cache_mode=force_custom_plan -c jit=off"


@pytest.mark.parametrize(
    ("options", "differing"),
    [
        (None, {"plan_cache_mode", "jit", "statement_timeout"}),
        ("-c jit=off -c statement_timeout=2s", {"plan_cache_mode"}),
        (_BOTH, {"statement_timeout"}),
        # Bounded, but past the lease (FAST: 6 s): as good as none for the relay.
        (f"{_BOTH} -c statement_timeout=10min", {"statement_timeout"}),
        (f"{_BOTH} -c statement_timeout=6000ms", set()),
    ],
)
def test_a_relay_given_a_postgresql_engine_says_which_session_settings_it_lacks(
    pg_url: str,
    pg_engine: sa.Engine,
    kafka_bootstrap: str,
    embedded: Callable[..., EmbeddedRelay],
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
    options: str | None,
    differing: set[str],
) -> None:
    """The relay's own engine opens its sessions with custom plans, no JIT and a
    statement timeout of the lease (docs/postgresql.md); an engine passed in is
    the caller's, so the relay does not change it, but says at start what
    differs and how to set it."""
    caplog.set_level(logging.INFO, logger="outboxkit")
    given = sa.create_engine(pg_url, connect_args={"options": options} if options else {})
    request.addfinalizer(given.dispose)
    settings = RelaySettings(kafka_bootstrap=kafka_bootstrap, **FAST)
    relay = embedded(settings, engine=given)

    def events(name: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "outboxkit_event", None) == name]

    wait_for(lambda: events("relay-started"), timeout=15, what="the relay started")
    warned = events("engine-settings")
    if not differing:
        assert warned == []
    else:
        assert len(warned) == 1, warned
        record = warned[0]
        assert record.levelno == logging.WARNING
        found = record.outboxkit_fields  # type: ignore[attr-defined]
        assert set(found["differing"]) == differing, found
        for name in differing:
            assert f"-c {name}=" in found["advice"], found
        if "statement_timeout" in differing:
            assert f"-c statement_timeout={settings.lease_ttl:.0f}s" in found["advice"], found
        assert pg_url.split("@")[0].split(":")[-1] not in record.getMessage()  # no password
    assert relay.stop() == 0


def test_relay_processes_killed_and_restarted_keep_every_event_and_key_order(
    pg_engine: sa.Engine,
    pg_url: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """Three ``outboxkit relay`` processes; one is SIGKILLed (its session dies with
    it, so its shards are free at once), one is restarted with SIGTERM."""
    topic = kafka_topics(partitions=3)
    events = [Event(topic=topic, key=f"key-{i % 30}", payload={"n": i}) for i in range(900)]

    def start() -> RelayProcess:
        return relay_process(cli_args(fast_settings(pg_url, kafka_bootstrap, batch_size=20)))

    def holders() -> set[int]:
        owners = server_owners(pg_engine, outbox=outbox_key(pg_engine))
        return set(owners.values()) if len(owners) == SHARDS else set()

    relays = [start() for _ in range(3)]
    wait_for(lambda: len(holders()) == 3, timeout=30, what="three relays sharing the shards")
    add_events(pg_engine, TABLE, events[:300])
    before = holders()
    relays[0].proc.kill()  # SIGKILL: no drain, no release
    relays[0].wait(10)
    killed = time.monotonic()
    wait_for(lambda: len(holders()) == 2 and holders() < before, timeout=10, what="takeover")
    takeover = time.monotonic() - killed
    # No lease TTL to wait out: the server freed the locks with the session.
    assert takeover < FAST["lease_ttl"], f"shards taken over after {takeover:.1f} s"
    add_events(pg_engine, TABLE, events[300:600])
    relays[1].signal(signal.SIGTERM)  # a rolling restart
    assert relays[1].wait(30) == 0
    relays.append(start())
    add_events(pg_engine, TABLE, events[600:])
    wait_for(lambda: len(holders()) == 2 and relays[3].events("shard-acquired"), timeout=30,
             what="the restarted relay's share")  # fmt: skip
    messages = consume(kafka_bootstrap, topic, expected=900, timeout=90)
    order = _first_delivery_order(messages)
    assert sum(len(v) for v in order.values()) == 900, "an event was lost"
    for key, ns in order.items():
        assert ns == sorted(ns), f"{key!r} out of order"
    for r in (relays[2], relays[3]):
        r.signal(signal.SIGTERM)
        assert r.wait(30) == 0
