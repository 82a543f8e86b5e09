"""Several relays on one table with Redis shard leases: order, fairness, failures.

Real MariaDB (and PostgreSQL: ``on_both_databases``), Kafka and Redis; relays
run as ``outboxkit relay`` subprocesses (signals and kills are real) except
where a test needs to look inside one.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)
from relay_support import (
    EmbeddedRelay,
    RelayProcess,
    add_events,
    cli_args,
    consume,
    db_time,
    fast_settings,
    http_get,
    outbox_key,
    rows,
    status_counts,
    wait_for,
)
from support.databases import on_both_databases
from support.ownership import assert_never_owned_twice as never_owned_twice

from outboxkit import Event, enable_wakeups, enqueue
from outboxkit.relay import RelaySettings
from outboxkit.runtime.rediskeys import lease_key
from outboxkit.schema import apply_schema, outbox_table
from outboxkit.schema.codec import shard_for

pytestmark = pytest.mark.integration

SHARDS = 64
KEYS = 2000
#: Batch budget of the fast settings is 4 s + 1 s; the TTL must exceed 2 x renew + that.
LEASE = {"shard_lease_ttl": 8.0, "shard_renew_interval": 0.5}


@pytest.fixture
def table(engine: sa.Engine) -> str:
    apply_schema(engine, shards=SHARDS)
    return "outbox_events"


def relay_settings(
    db_url: str, bootstrap: str, redis_url: str, prefix: str, node_id: str, **kw: Any
) -> RelaySettings:
    values = {**LEASE, "batch_size": 500, **kw}
    return fast_settings(
        db_url, bootstrap, redis_url=redis_url, redis_prefix=prefix, node_id=node_id, **values
    )


def keyed_events(topic: str, count: int, keys: int = KEYS, *, start: int = 0) -> list[Event]:
    """Row i is event number i // keys of key i % keys: id order is per-key order
    (``start``: the first i, for rows written after earlier ones)."""
    return [
        Event(topic=topic, key=f"k{i % keys}", payload={"k": i % keys, "n": i // keys})
        for i in range(start, start + count)
    ]


def assert_key_order(messages: list[Any]) -> dict[str, int]:
    """Per key, first occurrences must come in event order; returns duplicates per event."""
    seen: dict[tuple[int, int], int] = Counter()
    firsts: dict[int, list[int]] = defaultdict(list)
    for m in messages:
        body = json.loads(m.value)
        ident = (body["k"], body["n"])
        seen[ident] += 1
        if seen[ident] == 1:
            firsts[body["k"]].append(body["n"])
    for key, order in firsts.items():
        assert order == sorted(order), f"key k{key} overtook itself: {order[:20]}"
    return {f"k{k}/{n}": c for (k, n), c in seen.items() if c > 1}


def lease_owners(client: redis.Redis[bytes], prefix: str, table: str) -> list[str | None]:
    values = client.mget([lease_key(prefix, table, s) for s in range(SHARDS)])
    return [v.decode().rsplit(":", 1)[0] if v else None for v in values]


def assert_fair(owners: list[str | None], live: int) -> None:
    counts = Counter(owners)
    assert None not in counts, f"unowned shards: {counts[None]}"
    assert len(counts) == live, counts
    fair = SHARDS / live
    assert all(math.floor(fair) <= c <= math.ceil(fair) for c in counts.values()), counts


def fair_now(client: redis.Redis[bytes], prefix: str, table: str, live: int) -> bool:
    try:
        assert_fair(lease_owners(client, prefix, table), live)
    except AssertionError:
        return False
    return True


def assert_never_owned_twice(procs: list[Any]) -> int:
    """No two relays' ownership intervals of a shard overlap on Redis's clock
    (``support.ownership``); returns the number of intervals."""
    return never_owned_twice(r for p in procs for r in p.records)


@pytest.mark.unit
def test_the_ownership_check_sees_an_overlap_only_in_redis_time() -> None:
    def rec(
        node: str, event: str, ts: str, redis_epoch_ms: int | None, **kw: Any
    ) -> dict[str, Any]:
        r = {"event": event, "node_id": node, "shard": 7, "ts": f"2026-01-01T00:00:{ts}Z", **kw}
        return r if redis_epoch_ms is None else {**r, "redis_epoch_ms": redis_epoch_ms}

    def procs(*records: dict[str, Any]) -> list[Any]:
        return [SimpleNamespace(records=list(records))]

    # b logged its acquisition before a logged the release, but Redis ran them in order.
    late_log = procs(
        rec("a", "shard-acquired", "00.000", 1000),
        rec("b", "shard-acquired", "01.000", 1500),
        rec("a", "shard-released", "01.700", 1400),
    )
    assert assert_never_owned_twice(late_log) == 2
    with pytest.raises(AssertionError, match="shard 7"):
        assert_never_owned_twice(
            procs(
                rec("a", "shard-acquired", "00.000", 1000),
                rec("b", "shard-acquired", "01.000", 1500),
                rec("a", "shard-released", "01.700", 1600),
            )
        )
    with pytest.raises(AssertionError, match="shard 7"):  # never released
        assert_never_owned_twice(
            procs(
                rec("a", "shard-acquired", "00.000", 1000),
                rec("b", "shard-acquired", "02.000", 2000),
            )
        )


def start_relays(
    relay_process: Callable[..., RelayProcess], settings: list[RelaySettings]
) -> list[RelayProcess]:
    procs = [relay_process(cli_args(s)) for s in settings]
    for p in procs:
        p.wait_event("relay-started")
    return procs


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis[bytes]]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@on_both_databases
def test_three_relays_deliver_every_row_in_key_order_with_a_fair_split(
    engine: sa.Engine,
    db_url: str,
    table: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    redis_client: redis.Redis[bytes],
    relay_process: Callable[..., RelayProcess],
) -> None:
    total = 30_000  # 20 batches of 500 per relay
    topic = kafka_topics(partitions=6)
    add_events(engine, table, keyed_events(topic, total))
    settings = [
        relay_settings(db_url, kafka_bootstrap, redis_url, redis_prefix, f"relay-{i}")
        for i in range(3)
    ]
    started = time.monotonic()
    procs = start_relays(relay_process, settings)
    wait_for(
        lambda: fair_now(redis_client, redis_prefix, outbox_key(engine, table), 3),
        timeout=20,
        what="a fair split",
    )
    wait_for(
        lambda: status_counts(engine, table).get("delivered") == total,
        timeout=300,
        interval=0.5,
        what="all rows delivered",
    )
    took = time.monotonic() - started
    assert_fair(lease_owners(redis_client, redis_prefix, outbox_key(engine, table)), 3)
    for p in procs:
        p.signal(signal.SIGTERM)
    assert [p.wait(30) for p in procs] == [0, 0, 0]

    messages = consume(kafka_bootstrap, topic, expected=total, timeout=120)
    assert {(json.loads(m.value)["k"], json.loads(m.value)["n"]) for m in messages} == {
        (i % KEYS, i // KEYS) for i in range(total)
    }
    duplicates = assert_key_order(messages)
    assert not duplicates, "no faults, so no duplicates"
    assert assert_never_owned_twice(procs) >= SHARDS
    delivered_by = Counter(r.lease_owner for r in rows(engine, table))
    print(f"\n{total:,} rows, 3 relays: {took:.1f} s; rows per relay {dict(delivered_by)}")


@pytest.mark.timeout(600)
@on_both_databases
def test_rolling_restart_keeps_order_loses_nothing_and_burns_no_attempt(
    engine: sa.Engine,
    db_url: str,
    table: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    redis_client: redis.Redis[bytes],
    relay_process: Callable[..., RelayProcess],
) -> None:
    topic = kafka_topics(partitions=6)
    written = [3_000]
    add_events(engine, table, keyed_events(topic, written[0]))
    # The restarts happen while rows keep coming (1,000/s), as in production:
    # the relays have work at every restart however fast or busy the machine.
    writing = threading.Event()
    writing.set()

    def write_steadily() -> None:
        while writing.is_set():
            add_events(engine, table, keyed_events(topic, 100, start=written[0]))
            written[0] += 100
            time.sleep(0.1)

    writer = threading.Thread(target=write_steadily, daemon=True)
    writer.start()
    # A long TTL: handovers that waited for it would show at once.
    slow_ttl = {"shard_lease_ttl": 60.0, "shard_renew_interval": 0.5, "batch_size": 50}

    def settings(name: str) -> RelaySettings:
        return relay_settings(db_url, kafka_bootstrap, redis_url, redis_prefix, name, **slow_ttl)

    procs = start_relays(relay_process, [settings(f"relay-{i}-a") for i in range(3)])
    every = list(procs)
    wait_for(lambda: fair_now(redis_client, redis_prefix, outbox_key(engine, table), 3), timeout=20)
    handovers = []
    for i in range(3):
        assert writer.is_alive(), "rows keep coming during every restart"
        procs[i].signal(signal.SIGTERM)
        assert procs[i].wait(30) == 0
        stopped = time.monotonic()
        wait_for(
            lambda: fair_now(redis_client, redis_prefix, outbox_key(engine, table), 2), timeout=20
        )
        handovers.append(time.monotonic() - stopped)
        procs[i] = start_relays(relay_process, [settings(f"relay-{i}-b")])[0]
        every.append(procs[i])
        wait_for(
            lambda: fair_now(redis_client, redis_prefix, outbox_key(engine, table), 3), timeout=20
        )
    assert max(handovers) < 5.0, f"handovers waited for the TTL: {handovers}"
    writing.clear()
    writer.join(30)
    total = written[0]

    wait_for(
        lambda: status_counts(engine, table).get("delivered") == total,
        timeout=300,
        interval=0.5,
        what="all rows delivered",
    )
    for p in procs:
        p.signal(signal.SIGTERM)
    assert [p.wait(30) for p in procs] == [0, 0, 0]
    assert {r.attempts for r in rows(engine, table)} == {1}, "a restart burnt an attempt"
    messages = consume(kafka_bootstrap, topic, expected=total, timeout=120)
    assert len({m.headers["event_id"] for m in messages}) == total
    assert_key_order(messages)
    assert_never_owned_twice(every)
    exits = [e for p in every for e in p.events("relay-exit")]
    assert all(e["left_leased"] == 0 and e["result"] == "clean" for e in exits)
    print(f"\nrolling restart: shards handed over {[round(h, 2) for h in handovers]} s after exit")


@on_both_databases
def test_sigkill_shards_taken_over_within_ttl_plus_renew_period(
    engine: sa.Engine,
    db_url: str,
    table: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    redis_client: redis.Redis[bytes],
    relay_process: Callable[..., RelayProcess],
) -> None:
    total = 40_000
    topic = kafka_topics(partitions=6)
    add_events(engine, table, keyed_events(topic, total))
    settings = [
        relay_settings(
            db_url, kafka_bootstrap, redis_url, redis_prefix, f"relay-{i}", batch_size=200
        )
        for i in range(3)
    ]
    procs = start_relays(relay_process, settings)
    wait_for(lambda: fair_now(redis_client, redis_prefix, outbox_key(engine, table), 3), timeout=20)
    assert status_counts(engine, table).get("delivered", 0) < total
    victim = procs[0]
    owners = lease_owners(redis_client, redis_prefix, outbox_key(engine, table))
    victim_shards = [s for s, o in enumerate(owners) if o == "relay-0"]
    victim.proc.kill()
    killed = time.monotonic()

    def taken_over() -> bool:
        now = lease_owners(redis_client, redis_prefix, outbox_key(engine, table))
        return all(now[s] not in (None, "relay-0") for s in victim_shards)

    wait_for(taken_over, timeout=30, interval=0.02, what="takeover")
    took = time.monotonic() - killed
    ttl, renew = LEASE["shard_lease_ttl"], LEASE["shard_renew_interval"]
    assert took <= ttl + renew + 0.5, f"takeover took {took:.2f} s"
    wait_for(lambda: fair_now(redis_client, redis_prefix, outbox_key(engine, table), 2), timeout=10)

    wait_for(
        lambda: status_counts(engine, table).get("delivered") == total,
        timeout=300,
        interval=0.5,
        what="all rows delivered",
    )
    for p in procs[1:]:
        p.signal(signal.SIGTERM)
    assert [p.wait(30) for p in procs[1:]] == [0, 0]
    messages = consume(kafka_bootstrap, topic, expected=total, timeout=120)
    duplicates = assert_key_order(messages)
    reclaimed = {f"k{json.loads(r.payload)['k']}/{json.loads(r.payload)['n']}"
                 for r in rows(engine, table) if r.attempts > 1}  # fmt: skip
    assert set(duplicates) <= reclaimed, "duplicates beyond the rows the killed relay held"
    # What the killed relay held: one batch, or two when it pipelines (PostgreSQL's
    # default), both unwritten if the kill came after the claim of the second and
    # before the first's outcomes were committed.
    held = settings[0].batch_size * (
        2 if settings[0].effective_pipeline(engine.dialect.name) else 1
    )
    assert len(reclaimed) <= held, f"more reclaimed rows than the {held} the killed relay held"
    print(f"\nSIGKILL: shards taken over after {took:.2f} s; {len(duplicates)} duplicates")


@pytest.mark.fault
def test_redis_stopped_for_10_s_stops_claiming_then_resumes(
    engine: sa.Engine,
    db_url: str,
    table: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    from support.services import RedisInstance, free_port

    total = 40_000
    topic = kafka_topics(partitions=6)
    add_events(engine, table, keyed_events(topic, total))
    with RedisInstance("many-relays-fault", free_port()) as instance:
        settings = [
            relay_settings(db_url, kafka_bootstrap, instance.url, "", f"relay-{i}", batch_size=100)
            for i in range(3)
        ]
        procs = start_relays(relay_process, settings)
        client = redis.Redis.from_url(instance.url)
        wait_for(lambda: fair_now(client, "", outbox_key(engine, table), 3), timeout=20)
        client.close()
        assert status_counts(engine, table).get("delivered", 0) < total
        instance.kill()
        stopped = time.monotonic()
        # Claiming stops once leases cannot be proven (ttl - renew - budget = 2.5 s);
        # the last batch then has its budget (5 s) to settle.
        time.sleep(8.0)
        frozen = status_counts(engine, table)
        time.sleep(10.0 - (time.monotonic() - stopped))
        assert status_counts(engine, table) == frozen, "a relay claimed without a lease"
        assert frozen.get("delivered", 0) < total
        assert "delivering" not in frozen, "in-flight rows were settled"
        instance.start()
        wait_for(
            lambda: status_counts(engine, table).get("delivered") == total,
            timeout=300,
            interval=0.5,
            what="all rows delivered after Redis came back",
        )
        for p in procs:
            assert p.proc.poll() is None, "a relay exited during the outage"
            p.signal(signal.SIGTERM)
        assert [p.wait(30) for p in procs] == [0, 0, 0]
    messages = consume(kafka_bootstrap, topic, expected=total, timeout=120)
    assert len({m.headers["event_id"] for m in messages}) == total
    assert_key_order(messages)
    assert_never_owned_twice(procs)
    lost = [e for p in procs for e in p.events("shard-lost")]
    assert {e["reason"] for e in lost} >= {"lease-unproven"}


@on_both_databases
def test_a_failing_first_row_holds_its_key_back_while_the_shard_flows(
    engine: sa.Engine,
    db_url: str,
    table: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """The first row of one key keeps failing with a retriable error: it stays
    ``retryable`` with its next attempt ahead (what finalize writes after each
    failure; injected here, as a single-broker Kafka offers no per-row retriable
    fault). Its later rows wait; other keys of the same shard are delivered."""
    topic = kafka_topics(partitions=3)
    stuck_key = "stuck"
    shard = shard_for(stuck_key.encode(), "", SHARDS)
    neighbours = [f"n{i}" for i in range(5000) if shard_for(f"n{i}".encode(), "", SHARDS) == shard]
    neighbours = neighbours[:20]
    t = outbox_table(table)
    with engine.begin() as conn:
        enqueue(conn, topic=topic, key=stuck_key, payload={"k": stuck_key, "n": 0}, table=table)
        first_id = conn.execute(sa.select(sa.func.max(t.c.id))).scalar_one()
        fail_again(conn, t, first_id)
        for n in range(1, 6):
            enqueue(conn, topic=topic, key=stuck_key, payload={"k": stuck_key, "n": n}, table=table)
        for k in neighbours:
            for n in range(3):
                enqueue(conn, topic=topic, key=k, payload={"k": k, "n": n}, table=table)
    stop = threading.Event()

    def keep_failing() -> None:
        while not stop.wait(0.2):
            with engine.begin() as conn:
                fail_again(conn, t, first_id)

    injector = threading.Thread(target=keep_failing, daemon=True)
    injector.start()
    relays = [
        embedded(relay_settings(db_url, kafka_bootstrap, redis_url, redis_prefix, f"relay-{i}"))
        for i in range(2)
    ]

    def by_key() -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = defaultdict(list)
        for r in rows(engine, table):
            out[json.loads(r.payload)["k"]].append(r)
        return out

    try:
        wait_for(
            lambda: all(r.status == "delivered" for k in neighbours for r in by_key()[k]),
            timeout=60,
            what="the other keys of the shard delivered",
        )
        time.sleep(3.0)
        stuck = by_key()[stuck_key]
        assert stuck[0].status == "retryable"
        assert all(r.status == "pending" for r in stuck[1:]), [r.status for r in stuck]
    finally:
        stop.set()
        injector.join()
    wait_for(
        lambda: all(r.status == "delivered" for r in by_key()[stuck_key]),
        timeout=60,
        what="the held-back key delivered once its first row went through",
    )
    # (The first row may share a batch with its key's later rows: same partition,
    # produced in id order; the Kafka order below is the proof.)
    times = [r.delivered_at for r in by_key()[stuck_key]]
    assert times == sorted(times)
    messages = consume(kafka_bootstrap, topic, expected=6 + 3 * len(neighbours), timeout=60)
    assert_key_order(messages)
    for r in relays:
        assert r.stop() == 0


def fail_again(conn: sa.Connection, t: sa.Table, row_id: int) -> None:
    """What finalize writes after a retriable error: retryable, next attempt ahead."""
    conn.execute(
        t.update()
        .where(t.c.id == row_id, t.c.status != "delivering")
        .values(
            status="retryable",
            attempts=1,
            last_error="injected: retriable broker error",
            next_attempt_at=db_time(2),
        )
    )


def test_wakeups_deliver_well_before_the_poll_interval(
    engine: sa.Engine,
    db_url: str,
    table: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """200 events/s from a writer, poll interval 1 s: commit -> Kafka ack latency."""
    topic = kafka_topics(partitions=3)
    poll = 1.0
    relays = [
        embedded(
            relay_settings(
                db_url, kafka_bootstrap, redis_url, redis_prefix, f"relay-{i}", poll_interval=poll
            )
        )
        for i in range(2)
    ]
    hook = enable_wakeups(engine, redis_url, prefix=redis_prefix)
    rate, seconds = 200, 10
    try:
        start = time.monotonic()
        for i in range(rate * seconds):
            with engine.begin() as conn:
                enqueue(conn, topic=topic, key=f"k{i % 50}", payload={"i": i}, table=table)
            delay = start + (i + 1) / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        wait_for(
            lambda: status_counts(engine, table).get("delivered") == rate * seconds,
            timeout=60,
            what="all delivered",
        )
    finally:
        hook.disable()
    # created_at is stamped by the INSERT just before the commit, delivered_at by
    # the finalize after Kafka's ack (both DB clock): an upper bound of commit -> ack.
    latencies = sorted((r.delivered_at - r.created_at).total_seconds() for r in rows(engine, table))
    p50 = statistics.median(latencies)
    p99 = latencies[math.ceil(len(latencies) * 0.99) - 1]
    under = sum(1 for x in latencies if x < poll / 2) / len(latencies)
    figures = f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
    print(f"\nwake-ups at {rate}/s, poll interval {poll} s: commit -> ack {figures}")
    assert under >= 0.9, f"only {under:.0%} delivered within half the poll interval"
    for r in relays:
        assert r.stop() == 0


def _held_keys_metric(proc: RelayProcess) -> float | None:
    """``outbox_keys_held_by_failed`` as the relay's /metrics shows it now."""
    _, text = http_get(proc.health_url() + "/metrics")
    for line in str(text).splitlines():
        if line.startswith("outbox_keys_held_by_failed "):
            return float(line.split()[1])
    return None


def _row_events(topic: str, rounds: range, keys: int, big: tuple[int, int] | None) -> list[Event]:
    """Round n's row of key k for n in ``rounds`` (id order is per-key order);
    the row ``big`` (key, n) is over the topic's max.message.bytes, compressed
    too (random bytes)."""
    return [
        Event(
            topic=topic,
            key=f"k{k}",
            payload={"k": k, "n": n, **({"pad": os.urandom(4000).hex()} if (k, n) == big else {})},
        )
        for n in rounds
        for k in range(keys)
    ]


@on_both_databases
@pytest.mark.parametrize("failed_rows", ["hold", "skip"])
def test_a_failed_row_holds_its_key_across_relays_and_restarts_until_requeued(
    engine: sa.Engine,
    db_url: str,
    table: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    relay_process: Callable[..., RelayProcess],
    failed_rows: str,
) -> None:
    """Two relays with Redis leases; key k0's second row is over the topic's
    max.message.bytes and fails as the row's fault. ``hold`` (the default):
    k0's later rows stay pending through both relays and a restart of both,
    while other keys flow; after ``outboxkit admin requeue`` of the failed row
    (the topic's limit raised) it is delivered first, then k0's later rows, in
    order. ``skip``: k0's later rows are delivered past it, as chosen."""
    keys = 8
    topic = kafka_topics(partitions=3, config={"max.message.bytes": "2000"})
    settings = [
        relay_settings(
            db_url,
            kafka_bootstrap,
            redis_url,
            redis_prefix,
            f"relay-{failed_rows}-{i}",
            failed_rows=failed_rows,
            # Producer batches stay under the topic's limit: only the big row is refused.
            kafka_config={"batch.size": "1500"},
        )
        for i in range(2)
    ]
    t = outbox_table(table)
    add_events(engine, table, _row_events(topic, range(2), keys, big=(0, 1)))
    procs = start_relays(relay_process, settings)
    wait_for(
        lambda: (
            status_counts(engine, table).get("failed") == 1
            and status_counts(engine, table).get("delivered") == 2 * keys - 1
        ),
        timeout=60,
        what="k0's big row failed, the rest delivered",
    )
    with engine.connect() as conn:
        failed_id = conn.execute(sa.select(t.c.id).where(t.c.status == "failed")).scalar_one()
    # The key's later rows, written after its row failed.
    add_events(engine, table, _row_events(topic, range(2, 4), keys, big=None))
    k0_later = [r.id for r in rows(engine, table) if r.message_key == b"k0" and r.id > failed_id]
    assert len(k0_later) == 2

    def k0_later_statuses() -> list[str]:
        return [r.status for r in rows(engine, table) if r.id in k0_later]

    if failed_rows == "skip":
        wait_for(
            lambda: status_counts(engine, table).get("delivered") == 4 * keys - 1,
            timeout=60,
            what="every row but the failed one delivered",
        )
        assert k0_later_statuses() == ["delivered"] * 2
    else:
        wait_for(
            lambda: status_counts(engine, table).get("delivered") == 4 * keys - 3,
            timeout=60,
            what="every row of the other keys delivered",
        )
        wait_for(lambda: _held_keys_metric(procs[0]) == 1, timeout=20, what="k0 counted held")
        assert k0_later_statuses() == ["pending"] * 2
        for p in procs:  # a restart of both: the failed row still holds its key
            p.signal(signal.SIGTERM)
        assert [p.wait(30) for p in procs] == [0, 0]
        procs = start_relays(relay_process, settings)
        add_events(engine, table, _row_events(topic, range(4, 5), keys, big=None))
        wait_for(
            lambda: status_counts(engine, table).get("delivered") == 5 * keys - 4,
            timeout=60,
            what="the new rows of the other keys delivered after the restart",
        )
        wait_for(lambda: _held_keys_metric(procs[1]) == 1, timeout=20, what="k0 counted held")
        assert k0_later_statuses() == ["pending"] * 2
        assert status_counts(engine, table).get("pending") == 3

    # The operator's way out: fix the cause (raise the topic's limit), requeue the row.
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    raised = ConfigEntry(
        "max.message.bytes", "1000000", incremental_operation=AlterConfigOpType.SET
    )
    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[raised])
    admin.incremental_alter_configs([resource])[resource].result(timeout=20)
    requeued = subprocess.run(
        [
            sys.executable,
            "-m",
            "outboxkit",
            "admin",
            "requeue",
            "--db-url",
            db_url,
            "--id",
            str(failed_id),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert requeued.returncode == 0, requeued.stderr
    total = sum(status_counts(engine, table).values())
    wait_for(
        lambda: status_counts(engine, table).get("delivered") == total,
        timeout=60,
        what="every row delivered",
    )
    for p in procs:
        p.signal(signal.SIGTERM)
    assert [p.wait(30) for p in procs] == [0, 0]
    messages = consume(kafka_bootstrap, topic, expected=total)
    firsts: list[int] = []
    for m in messages:
        body = json.loads(m.value)
        if body["k"] == 0 and body["n"] not in firsts:
            firsts.append(body["n"])
    if failed_rows == "hold":
        assert firsts == sorted(firsts) == list(range(len(firsts))), firsts
        assert_key_order(messages)
    else:
        assert firsts == [0, 2, 3, 1], "skip: k0's later rows went past the failed one"
