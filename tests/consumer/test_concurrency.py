"""concurrency=N: order per key, more throughput, offsets never past an unfinished message."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from kafkahelp import committed, make_events, produce, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message

pytestmark = pytest.mark.integration


class Sleeper(Consumer):
    def __init__(self, settings: ConsumerSettings, *, sleep: float) -> None:
        super().__init__(settings)
        self.sleep = sleep
        self.lock = threading.Lock()
        self.by_key: dict[str, list[int]] = {}
        self.active_keys: set[str] = set()
        self.key_overlaps: list[str] = []
        self.max_parallel = 0
        self.done = 0

    def handle(self, message: Message) -> None:
        body = message.json()
        key = body["key"]
        with self.lock:
            if key in self.active_keys:
                self.key_overlaps.append(key)
            self.active_keys.add(key)
            self.max_parallel = max(self.max_parallel, len(self.active_keys))
        time.sleep(self.sleep if body.get("slow") is None else body["slow"])
        with self.lock:
            self.active_keys.discard(key)
            self.by_key.setdefault(key, []).append(body["seq"])
            self.done += 1


class AsyncSleeper(Sleeper):
    """:class:`Sleeper` with an ``async def handle``: the coroutines share one event loop."""

    async def handle(self, message: Message) -> None:  # type: ignore[override]
        body = message.json()
        key = body["key"]
        with self.lock:
            if key in self.active_keys:
                self.key_overlaps.append(key)
            self.active_keys.add(key)
            self.max_parallel = max(self.max_parallel, len(self.active_keys))
        await asyncio.sleep(self.sleep if body.get("slow") is None else body["slow"])
        with self.lock:
            self.active_keys.discard(key)
            self.by_key.setdefault(key, []).append(body["seq"])
            self.done += 1


SLEEPERS = pytest.mark.parametrize("sleeper", [Sleeper, AsyncSleeper], ids=["sync", "async"])


def _run(consumer: Sleeper, n: int, run_consumer: Any) -> float:
    with run_consumer(consumer) as running:
        wait_for(lambda: consumer.done >= 1, 30, 0.005, "first message")
        started = time.monotonic()
        wait_for(lambda: consumer.done >= n, 60, 0.005, f"{n} messages")
        took = time.monotonic() - started
        assert running.stop() == 0
    return took


@SLEEPERS
def test_concurrency_8_keeps_per_key_order_and_is_faster(
    sleeper: type[Sleeper],
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(2)
    produce(kafka_bootstrap, topic, make_events(161, keys=16))
    serial = sleeper(settings(group_id=f"g1-{topic}", topics=(topic,)), sleep=0.02)
    t1 = _run(serial, 161, run_consumer)
    parallel = sleeper(settings(group_id=f"g8-{topic}", topics=(topic,), concurrency=8), sleep=0.02)
    t8 = _run(parallel, 161, run_consumer)

    assert serial.max_parallel == 1
    assert parallel.max_parallel > 4
    assert t8 < t1 / 3, (t1, t8)
    for c in (serial, parallel):
        assert c.key_overlaps == []
        for seqs in c.by_key.values():
            assert seqs == list(range(1, len(seqs) + 1))  # in order, each once
        assert sum(len(s) for s in c.by_key.values()) == 161
    print(f"160 x 20 ms after the first: concurrency=1 {t1:.2f} s, concurrency=8 {t8:.2f} s")


@SLEEPERS
def test_committed_offset_never_passes_an_unfinished_message(
    sleeper: type[Sleeper],
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(1)
    group = f"g-{topic}"
    slow = (b"slow", b'{"key": "slow", "seq": 1, "slow": 3}', "e-slow")
    produce(kafka_bootstrap, topic, [slow, *make_events(20, keys=5)])
    consumer = sleeper(settings(group_id=group, topics=(topic,), concurrency=8), sleep=0.0)
    with run_consumer(consumer) as running:
        wait_for(lambda: consumer.done >= 20, 10, 0.01, "the 20 fast messages")
        assert consumer.by_key.get("slow") is None  # offset 0 still running
        time.sleep(1.2)  # more than two commit intervals
        assert committed(kafka_bootstrap, group, topic, 1)[0] < 1
        wait_for(lambda: consumer.done == 21, 10, 0.01, "the slow message")
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 21},
            5,
            what="all 21 committed",
        )
        assert running.stop() == 0
