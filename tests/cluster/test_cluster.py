"""Kafka as production runs it: three brokers, replication factor 3,
``min.insync.replicas=2``. The relay and the consumer against leader
failover, an ISR below ``min.insync.replicas``, a rolling restart of every
broker and a move of the consumer group's coordinator.

The cluster is shared by the tests of this folder (``conftest.py``); each test
breaks one node at a time and the ``cluster`` fixture makes it whole again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import KafkaException
from relay_support import EmbeddedRelay, add_events, consume, fast_settings, rows, wait_for
from support.cluster import KafkaCluster

from outboxkit import Event
from outboxkit.schema import outbox_table

pytestmark = [pytest.mark.integration, pytest.mark.fault]


def keyed_events(topic: str, count: int, keys: int, start: int = 0) -> list[Event]:
    """Event ``i`` is number ``i // keys`` of key ``i % keys``: id order is per-key order."""
    return [
        Event(topic=topic, key=f"k{i % keys}", payload={"k": i % keys, "n": i // keys})
        for i in range(start, start + count)
    ]


def first_deliveries_in_key_order(messages: list[Any]) -> Counter[tuple[int, int]]:
    """Assert that per key the first copy of each event comes in event order;
    the copies of each event."""
    seen: Counter[tuple[int, int]] = Counter()
    firsts: dict[int, list[int]] = defaultdict(list)
    for m in messages:
        body = json.loads(m.value)
        ident = (body["k"], body["n"])
        seen[ident] += 1
        if seen[ident] == 1:
            firsts[body["k"]].append(body["n"])
    for key, order in firsts.items():
        assert order == sorted(order), f"key k{key} overtook itself: {order[:20]}"
    return seen


def count_status(engine: sa.Engine, table: str, status: str) -> int:
    t = outbox_table(table)
    with engine.connect() as conn:
        n = conn.scalar(sa.select(sa.func.count()).where(t.c.status == status))
    return int(n or 0)


def test_leader_killed_mid_backlog_loses_nothing_reorders_nothing_and_counts_no_attempt(
    cluster: KafkaCluster,
    cluster_topic: Callable[..., str],
    db_url: str,
    engine: sa.Engine,
    outbox: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """kill -9 of the node that leads every partition the relay produces to.

    The idempotent producer (acks=all) keeps its sequence numbers across the
    leader change: a request whose answer died with the old leader is sent
    again to the new one, which holds the replicated producer state and
    acknowledges a batch it already has as a duplicate instead of appending it
    twice. With the message timeout longer than the failover, no delivery
    report is an error: every row is delivered on its first attempt, once.
    """
    leader, events_n, keys = 2, 3000, 30
    topic = cluster_topic(assignment=[[leader, 1, 3], [leader, 3, 1]])
    add_events(engine, outbox, keyed_events(topic, events_n, keys))
    relay = embedded(
        fast_settings(
            db_url,
            cluster.bootstrap,
            batch_size=50,
            lease_ttl=40.0,
            kafka_config={"message.timeout.ms": "20000"},
        )
    )
    wait_for(lambda: count_status(engine, outbox, "delivered") >= 300, timeout=60, what="300")
    cluster.node(leader).kill()
    at_kill = count_status(engine, outbox, "delivered")
    wait_for(
        lambda: count_status(engine, outbox, "delivered") == events_n,
        timeout=120,
        interval=0.5,
        what="every row delivered after the leader's kill",
    )
    assert at_kill < events_n, "the relay finished before the kill: nothing was tested"
    parts = cluster.partitions(topic, exclude=[leader])
    assert all(p.leader not in (leader, -1) for p in parts.values()), parts

    stored = rows(engine, outbox)
    assert Counter(r.status for r in stored) == {"delivered": events_n}
    assert Counter(r.attempts for r in stored) == {1: events_n}, "an attempt was counted"
    assert relay.metric("outbox_rows_retryable_total") == 0
    assert relay.metric("outbox_rows_failed_total") == 0

    messages = consume(cluster.up_bootstrap([leader]), topic, expected=events_n, timeout=60)
    copies = first_deliveries_in_key_order(messages)
    assert len(copies) == events_n, "an event is missing"
    assert max(copies.values()) == 1, f"duplicates: {[k for k, n in copies.items() if n > 1]}"
    print(f"killed leader {leader} at {at_kill}/{events_n} delivered; {len(messages)} messages")


@pytest.mark.timeout(600)
def test_isr_below_min_insync_is_a_dependency_fault_and_delivery_resumes_in_order(
    cluster: KafkaCluster,
    cluster_topic: Callable[..., str],
    db_url: str,
    engine: sa.Engine,
    outbox: str,
    embedded: Callable[..., EmbeddedRelay],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGSTOP of a follower: the partition's ISR shrinks to its leader alone,
    below ``min.insync.replicas=2``, and every acks=all write is refused with
    NOT_ENOUGH_REPLICAS until the follower is back.

    The topic has two replicas (leader and the frozen follower): with three
    combined broker+controller nodes, an ISR of one on a three-replica topic
    needs two nodes gone, which also takes the controller quorum away. Two
    replicas and a min ISR of 2 is the state a production topic (RF 3, min
    ISR 2) is in once a second replica falls behind.
    """
    caplog.set_level(logging.INFO, logger="outboxkit.relay")
    leader, follower, keys = 1, 3, 10
    topic = cluster_topic(assignment=[[leader, follower]], config={"min.insync.replicas": "2"})
    add_events(engine, outbox, keyed_events(topic, 100, keys))
    relay = embedded(
        fast_settings(
            db_url,
            cluster.bootstrap,
            lease_ttl=20.0,
            max_attempts=2,
            kafka_config={"message.timeout.ms": "4000"},
        )
    )
    wait_for(lambda: count_status(engine, outbox, "delivered") == 100, timeout=60, what="100")

    cluster.freeze(follower)
    cluster.wait_isr(topic, 0, 1)
    add_events(engine, outbox, keyed_events(topic, 100, keys, start=100))

    def retry_lines() -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if getattr(r, "outboxkit_event", None) == "delivery-retry"
            or r.getMessage().startswith("delivery-retry")
        ]

    wait_for(
        lambda: [r for r in retry_lines() if f"topic={topic}" in r.getMessage()],
        timeout=60,
        interval=0.2,
        what="a delivery-retry line naming the topic",
    )
    line = next(r.getMessage() for r in retry_lines() if f"topic={topic}" in r.getMessage())
    assert "isr" in line and f"{[leader]}" in line, line
    # librdkafka reports a message timeout; the relay names the cause from the ISR.
    errors = relay.metric(
        "outbox_kafka_delivery_errors_total", {"topic": topic, "error": "NOT_ENOUGH_REPLICAS"}
    )
    assert errors > 0
    assert count_status(engine, outbox, "failed") == 0
    assert relay.metric("outbox_topic_paused", {"topic": topic, "reason": "unknown-topic"}) == 0
    assert not [r for r in caplog.records if "topic-paused" in r.getMessage()]

    # A second round of refusals (max_attempts is 2): none costs an attempt, so
    # no row holds more than the one of a claim in flight and none is failed.
    # Counting them would leave the rows at 2 attempts and fail them at the next
    # claim.
    def refused_twice_or_failed() -> bool:
        refused = relay.metric(
            "outbox_kafka_delivery_errors_total", {"topic": topic, "error": "NOT_ENOUGH_REPLICAS"}
        )
        return refused >= 150 or count_status(engine, outbox, "failed") > 0

    wait_for(refused_twice_or_failed, timeout=240, interval=0.5, what="a second round refused")
    assert count_status(engine, outbox, "failed") == 0, "the outage burnt rows to failed"
    most = max(r.attempts for r in rows(engine, outbox))
    assert most <= 1, f"a refusal cost an attempt: a row has {most}"

    cluster.resume(follower)
    wait_for(
        lambda: count_status(engine, outbox, "delivered") == 200,
        timeout=90,
        interval=0.5,
        what="delivery resumed by itself once the follower returned",
    )
    assert count_status(engine, outbox, "failed") == 0
    messages = consume(cluster.bootstrap, topic, expected=200, timeout=60)
    copies = first_deliveries_in_key_order(messages)
    assert len(copies) == 200, "an event is missing"
    retried = max(r.attempts for r in rows(engine, outbox))
    print(f"{sum(copies.values()) - 200} duplicates; most attempts of a row {retried}")


# -- consumers on the cluster --------------------------------------------------------


def consumer_env(cluster: KafkaCluster, topic: str, group: str, db_url: str) -> dict[str, str]:
    from kafkahelp import FAST_GROUP

    return {
        "OUTBOXKIT_KAFKA_BOOTSTRAP": cluster.bootstrap,
        "OUTBOXKIT_KAFKA_CONFIG": ",".join(f"{k}={v}" for k, v in FAST_GROUP.items()),
        "OUTBOXKIT_HEALTH_PORT": "0",
        "OUTBOXKIT_TOPICS": topic,
        "OUTBOXKIT_GROUP_ID": group,
        "OUTBOXKIT_DB_URL": db_url,
        "OUTBOXKIT_INBOX": "true",
        "OUTBOXKIT_CONCURRENCY": "4",
        "OUTBOXKIT_COMMIT_INTERVAL": "0.5",
        "OUTBOXKIT_LOG_LEVEL": "INFO",
        "OUTBOXKIT_WORKER_DRAIN_TIMEOUT": "10",
        "OUTBOXKIT_CLOSE_TIMEOUT": "20",
        "OUTBOXKIT_SHUTDOWN_TIMEOUT": "40",
    }


def effects_done(engine: sa.Engine) -> tuple[int, int, dict[int, set[int]]]:
    """(effect rows, distinct event ids, processed offsets per partition)."""
    from consumer_apps import effects

    with engine.connect() as conn:
        found = conn.execute(
            sa.select(effects.c.event_id, effects.c.kafka_partition, effects.c.kafka_offset)
        ).all()
    done: dict[int, set[int]] = defaultdict(set)
    for _, p, o in found:
        done[p].add(o)
    return len(found), len({r[0] for r in found}), done


class Writer:
    """Enqueues keyed events in small transactions until stopped (a service at work)."""

    def __init__(self, engine: sa.Engine, table: str, topic: str, keys: int) -> None:
        self.engine, self.table, self.topic, self.keys = engine, table, topic, keys
        self.written = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                add_events(
                    self.engine, self.table, keyed_events(self.topic, 20, self.keys, self.written)
                )
                self.written += 20
            except Exception as exc:  # the test fails on it
                self.errors.append(exc)
                return
            self._stop.wait(0.1)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(30)
        assert not self.errors, self.errors
        return self.written


@pytest.mark.timeout(1200)
def test_rolling_restart_of_every_broker_under_writer_relays_and_consumers(
    cluster: KafkaCluster,
    cluster_topic: Callable[..., str],
    db_url: str,
    engine: sa.Engine,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Any,
) -> None:
    """An upgrade's rolling restart: SIGTERM one broker, wait until it is back and
    every ISR is full, then the next, while a writer, two relays and two inbox
    consumers run. Nothing is lost, no key overtakes itself, each event has
    exactly one effect, and no process restarts or needs a drain."""
    from consumer_apps import effects
    from procs import ConsumerProcess
    from relay_support import RelayProcess, cli_args

    from outboxkit.schema import apply_schema

    apply_schema(engine, shards=8)
    effects.metadata.create_all(engine)
    table, keys = "outbox_events", 20
    topic = cluster_topic(partitions=3)
    group = f"g-{topic}"
    relays = [
        RelayProcess(
            cli_args(
                fast_settings(
                    db_url,
                    cluster.bootstrap,
                    redis_url=redis_url,
                    redis_prefix=redis_prefix,
                    node_id=f"roll-relay-{i}",
                    lease_ttl=40.0,
                    shard_lease_ttl=30.0,
                    shard_renew_interval=0.5,
                    kafka_config={"message.timeout.ms": "20000"},
                )
            )
        )
        for i in (1, 2)
    ]
    env = consumer_env(cluster, topic, group, db_url)
    consumers = [
        ConsumerProcess("consumer_apps:RecordEffects", env=env, cwd=tmp_path) for _ in (1, 2)
    ]
    writer = None
    try:
        for c in consumers:
            c.wait_event("partitions-assigned", 60)
        writer = Writer(engine, table, topic, keys)
        wait_for(lambda: effects_done(engine)[0] >= 100, timeout=60, what="effects before the roll")
        for k in sorted(cluster.nodes):
            cluster.node(k).stop()
            cluster.node(k).start()
            cluster.wait_full_isr([topic])
        written = writer.stop()
        writer = None
        wait_for(
            lambda: count_status(engine, table, "delivered") == written,
            timeout=120,
            interval=0.5,
            what=f"all {written} rows delivered",
        )
        wait_for(
            lambda: effects_done(engine)[1] == written,
            timeout=120,
            interval=0.5,
            what=f"an effect for each of {written} events",
        )
        running = [p.proc.poll() for p in relays] + [c.proc.poll() for c in consumers]
        assert running == [None] * 4, f"a process exited during the roll: {running}"
        for p in relays:
            assert not p.events("worker-crashed"), p.events("worker-crashed")
        for c in consumers:
            assert not c.events("worker-crashed"), c.events("worker-crashed")
    finally:
        if writer is not None:
            writer.stop()
        for p in relays:
            p.signal(signal.SIGTERM)
        for c in consumers:
            c.signal()
        codes = [p.wait(60) for p in relays] + [c.wait(60) for c in consumers]
        for p in relays:
            p.stop()
        for c in consumers:
            c.kill()
    assert codes == [0, 0, 0, 0], codes

    stored = rows(engine, table)
    assert Counter(r.status for r in stored) == {"delivered": written}
    rows_n, distinct, _ = effects_done(engine)
    assert rows_n == distinct == written, "an event's effect was applied twice or never"
    # Per key, effects in event order (each event has one effect: the first delivery).
    by_event = {r.event_id: json.loads(r.payload) for r in stored}
    with engine.connect() as conn:
        order = conn.scalars(sa.select(effects.c.event_id).order_by(effects.c.id)).all()
    per_key: dict[int, list[int]] = defaultdict(list)
    for event_id in order:
        body = by_event[event_id]
        per_key[body["k"]].append(body["n"])
    for key, seq in per_key.items():
        assert seq == sorted(seq), f"key k{key}'s effects out of order: {seq[:20]}"
    messages = consume(cluster.bootstrap, topic, expected=written, timeout=60)
    copies = first_deliveries_in_key_order(messages)
    assert len(copies) == written
    print(
        f"{written} events through a rolling restart; {len(messages) - written} duplicates in Kafka"
    )


@pytest.mark.timeout(900)
def test_coordinator_killed_while_the_consumer_commits(
    cluster: KafkaCluster,
    cluster_topic: Callable[..., str],
    db_url: str,
    engine: sa.Engine,
    tmp_path: Any,
) -> None:
    """kill -9 of the broker coordinating the group while the consumer commits
    every 0.5 s, then once more with a drain started right after the kill.

    Committed offsets never pass a message that was not processed; the consumer
    commits again once the coordinator moved (the offsets partition's new leader,
    after the dead broker's session expires: 4 s here, 9 s by default); the
    drain during the move ends with its commit, and what it says it committed
    is what the group holds."""
    from consumer_apps import effects
    from kafkahelp import committed, offsets_all_below
    from procs import ConsumerProcess

    from outboxkit.schema import apply_schema

    apply_schema(engine, shards=8)
    effects.metadata.create_all(engine)
    topic = cluster_topic(partitions=3)
    group = f"g-{topic}"
    stop = threading.Event()

    def produce_steadily() -> None:
        """50 new events every 0.1 s through an idempotent producer: a retry across
        the broker's kill never writes a message twice, so every offset holds a
        distinct event and has its own effect once processed."""
        import uuid

        from confluent_kafka import Producer

        producer = Producer(
            {"bootstrap.servers": cluster.bootstrap, "enable.idempotence": True, "log_level": 0}
        )
        n = 0
        while not stop.is_set():
            for _ in range(50):
                n += 1
                headers = [("event_id", str(uuid.uuid4()).encode())]
                with contextlib.suppress(BufferError):
                    producer.produce(topic, key=f"k{n % 10}".encode(), value=b"{}", headers=headers)
            producer.poll(0)
            stop.wait(0.1)
        producer.flush(60)

    producer = threading.Thread(target=produce_steadily, daemon=True)
    producer.start()
    env = consumer_env(cluster, topic, group, db_url)
    # The group session outlasts the coordinator's move (the dead broker's session,
    # 4 s, then a new leader of its offsets partitions), as Kafka's default 45 s
    # does: with the 6 s of the other tests the member is dropped first and its
    # partitions are lost, with nothing to commit.
    env["OUTBOXKIT_KAFKA_CONFIG"] = env["OUTBOXKIT_KAFKA_CONFIG"].replace(
        "session.timeout.ms=6000", "session.timeout.ms=20000"
    )
    consumer = ConsumerProcess("consumer_apps:RecordEffects", env=env, cwd=tmp_path)
    try:
        wait_for(
            lambda: effects_done(engine)[0] >= 200 or consumer.proc.poll() is not None,
            timeout=60,
            what="first effects",
        )
        assert consumer.proc.poll() is None, "".join(consumer.raw[-20:])
        coordinator = cluster.coordinator(group)
        before = committed(cluster.up_bootstrap([coordinator]), group, topic, 3)
        cluster.node(coordinator).kill()
        killed_at = time.monotonic()
        moved = cluster.coordinator(group, exclude=[coordinator])
        assert moved != coordinator

        def advanced() -> dict[int, int] | None:
            try:
                now = committed(cluster.up_bootstrap([coordinator]), group, topic, 3)
            except KafkaException:  # the probe asked the old coordinator: ask again
                return None
            _, _, done = effects_done(engine)
            assert offsets_all_below(now, done) == [], "a committed offset ran ahead"
            return now if sum(now.values()) > sum(before.values()) else None

        wait_for(advanced, timeout=30, interval=0.5, what="a commit after the coordinator moved")
        recovered_s = time.monotonic() - killed_at
        assert consumer.proc.poll() is None

        # A drain that starts while the coordinator moves again.
        cluster.node(coordinator).start()
        cluster.wait_full_isr([topic])
        second = cluster.coordinator(group)
        stop.set()
        producer.join(30)
        cluster.node(second).kill()
        consumer.signal()
        assert consumer.wait(60) == 0
        record = consumer.exit_record()
        held = committed(cluster.up_bootstrap([second]), group, topic, 3)
        _, _, done = effects_done(engine)
        assert offsets_all_below(held, done) == []
        if record["result"] != "clean":
            print("\n".join(json.dumps(r) for r in consumer.lines[-25:]))
        assert record["result"] == "clean", record
        claimed = {int(k.rsplit("/", 1)[1]): v for k, v in record["committed"].items()}
        if not claimed:
            # On a slow machine the move can outlast the member's session: the
            # group takes its partitions back (nothing was left uncommitted, or
            # the result would be commit-incomplete) and the exit names none,
            # or only ones assigned again with nothing new to commit.
            moved_away = consumer.events("partitions-lost") + consumer.events("partitions-revoked")
            assert moved_away, (record, held)
        else:
            assert claimed == {p: o for p, o in held.items() if o >= 0}, (record, held)
        print(f"commits resumed {recovered_s:.1f} s after the coordinator's kill; exit {record}")
    finally:
        stop.set()
        consumer.kill()


@pytest.mark.timeout(600)
def test_active_controller_killed_while_a_relay_delivers_and_a_consumer_consumes(
    cluster: KafkaCluster,
    cluster_topic: Callable[..., str],
    db_url: str,
    engine: sa.Engine,
    outbox: str,
    embedded: Callable[..., EmbeddedRelay],
    tmp_path: Any,
) -> None:
    """kill -9 of the node that is the active KRaft controller, while a relay
    delivers a backlog and an inbox consumer consumes it.

    The topic's partitions are led by the two other nodes (the controller's node
    holds the last replica of each), so what changes is the metadata quorum's
    leader: the two remaining controllers elect a new one and the brokers carry
    on. Neither process sees more than a pause (the acks=all writes wait until
    the dead follower leaves the ISR): every row is delivered once on its first
    attempt, no key overtakes itself, the consumer applies each event once and
    commits everything, and both keep running. Then the node comes back.
    """
    from consumer_apps import effects
    from kafkahelp import committed, end_offsets
    from procs import ConsumerProcess

    effects.metadata.create_all(engine)
    controller = cluster.active_controller()
    a, b = sorted(set(cluster.nodes) - {controller})
    topic = cluster_topic(assignment=[[a, b, controller], [b, a, controller], [a, b, controller]])
    group = f"g-{topic}"
    events_n, keys = 900, 15
    add_events(engine, outbox, keyed_events(topic, events_n, keys))
    env = consumer_env(cluster, topic, group, db_url)
    # The session outlasts a coordinator move, should the group's coordinator
    # live on the controller's node (see the coordinator test).
    env["OUTBOXKIT_KAFKA_CONFIG"] = env["OUTBOXKIT_KAFKA_CONFIG"].replace(
        "session.timeout.ms=6000", "session.timeout.ms=20000"
    )
    consumer = ConsumerProcess("consumer_apps:RecordEffects", env=env, cwd=tmp_path)
    try:
        consumer.wait_event("partitions-assigned", 60)
        relay = embedded(
            fast_settings(
                db_url,
                cluster.bootstrap,
                batch_size=50,
                lease_ttl=40.0,
                kafka_config={"message.timeout.ms": "20000"},
            )
        )
        wait_for(lambda: count_status(engine, outbox, "delivered") >= 150, timeout=60, what="150")
        cluster.node(controller).kill()
        at_kill = count_status(engine, outbox, "delivered")
        elected = cluster.active_controller(exclude=[controller])
        assert elected != controller
        wait_for(
            lambda: count_status(engine, outbox, "delivered") == events_n,
            timeout=120,
            interval=0.5,
            what="every row delivered after the controller's kill",
        )
        assert at_kill < events_n, "the relay finished before the kill: nothing was tested"
        wait_for(
            lambda: effects_done(engine)[1] == events_n,
            timeout=120,
            interval=0.5,
            what=f"an effect for each of {events_n} events",
        )
        up = cluster.up_bootstrap([controller])
        ends = end_offsets(up, topic, 3)
        assert sum(ends.values()) == events_n, f"a message was written twice: {ends}"
        wait_for(
            lambda: committed(up, group, topic, 3) == ends,
            timeout=60,
            interval=0.5,
            what=f"the group committed {ends}",
        )
        assert relay.thread.is_alive() and consumer.proc.poll() is None
        assert not consumer.events("worker-crashed"), consumer.events("worker-crashed")
    finally:
        consumer.signal()
        code = consumer.wait(60)
        consumer.kill()
    assert code == 0, "".join(consumer.raw[-20:])

    stored = rows(engine, outbox)
    assert Counter(r.status for r in stored) == {"delivered": events_n}
    assert Counter(r.attempts for r in stored) == {1: events_n}, "an attempt was counted"
    assert relay.metric("outbox_rows_retryable_total") == 0
    assert relay.metric("outbox_rows_failed_total") == 0
    rows_n, distinct, _ = effects_done(engine)
    assert rows_n == distinct == events_n, "an event's effect was applied twice or never"
    copies = first_deliveries_in_key_order(consume(up, topic, expected=events_n, timeout=60))
    assert len(copies) == events_n and max(copies.values()) == 1

    cluster.node(controller).start()
    cluster.wait_full_isr([topic])
    print(f"killed controller {controller} at {at_kill}/{events_n}; node {elected} took over")
