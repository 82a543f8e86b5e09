"""The base class end to end, embedded: process, commit after processing, exit report."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from kafkahelp import committed, end_offsets, http_get, make_events, produce, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.errors import ConfigError

pytestmark = pytest.mark.integration


class Recorder(Consumer):
    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.seen: list[tuple[int, int, Any]] = []
        self.lock = threading.Lock()
        self.started = self.stopped = False

    def on_start(self) -> None:
        self.started = True

    def on_stop(self) -> None:
        self.stopped = True

    def handle(self, message: Message) -> None:
        body = message.json()
        with self.lock:
            self.seen.append((message.partition, message.offset, body))


def test_processes_in_partition_order_and_commits_everything_at_exit(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(3)
    produce(kafka_bootstrap, topic, make_events(60, keys=6))
    consumer = Recorder(settings(group_id=f"g-{topic}", topics=(topic,), commit_interval=30.0))
    with run_consumer(consumer) as running:
        wait_for(lambda: len(consumer.seen) >= 60, 30, what="60 messages handled")
        health = consumer.health.url
        assert http_get(f"{health}/healthz/ready")[0] == 200
        lag = consumer.registry.get_sample_value
        labels = [{"topic": topic, "partition": str(p)} for p in range(3)]
        # Nothing committed yet (commit_interval is 30 s): the lag is the whole partition.
        ends = end_offsets(kafka_bootstrap, topic, 3)
        wait_for(
            lambda: [lag("worker_consumer_lag", x) for x in labels] == [ends[p] for p in range(3)],
            5,
            what="consumer lag from librdkafka statistics",
        )
        assert running.stop() == 0

    assert consumer.started and consumer.stopped
    by_partition: dict[int, list[int]] = {}
    for p, off, _ in consumer.seen:
        by_partition.setdefault(p, []).append(off)
    for offs in by_partition.values():
        assert offs == sorted(offs)
    # commit_interval is 30 s: everything committed was committed by the exit commit.
    assert committed(kafka_bootstrap, f"g-{topic}", topic, 3) == ends
    report = consumer.report
    assert report is not None
    assert report.unknown == 0
    assert report.committed == {f"{topic}/{p}": o for p, o in ends.items() if o > 0}
    assert report.committed_messages == 60
    metrics = consumer.registry.get_sample_value("worker_messages_total", {"result": "success"})
    assert metrics == 60


def test_missing_group_or_topics_is_a_config_error(
    settings: Callable[..., ConsumerSettings],
) -> None:
    with pytest.raises(ConfigError) as info:
        Recorder(settings())
    assert "--group-id / OUTBOXKIT_GROUP_ID" in str(info.value)
    assert "--topics / OUTBOXKIT_TOPICS" in str(info.value)


def test_worker_drain_timeout_must_fit_in_shutdown_timeout(
    settings: Callable[..., ConsumerSettings],
) -> None:
    with pytest.raises(ConfigError, match="OUTBOXKIT_WORKER_DRAIN_TIMEOUT"):
        Recorder(
            settings(group_id="g", topics=("t",), worker_drain_timeout=30, shutdown_timeout=30)
        )
