"""The poll loop fetches only what the workers need next (consumer/workers.py,
``Dispatcher.wait_for_room``): with handlers slower than fetching, the messages
waiting for a worker stay near two fetches (the ``worker_buffered_messages``
gauge) instead of filling ``max_buffered`` per partition; with several workers
and one busy key, the other keys are still fetched and handled meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from kafkahelp import committed, produce, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message

pytestmark = pytest.mark.integration


class Slow(Consumer):
    """Sleeps ``pause`` s per message; records the order of what it handled."""

    pause = 0.0003

    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.lock = threading.Lock()
        self.handled: list[tuple[bytes | None, int]] = []

    def handle(self, message: Message) -> None:
        time.sleep(self.pause if message.key != b"fast" else 0)
        with self.lock:
            self.handled.append((message.key, message.offset))


def _gauge(consumer: Consumer, name: str) -> float:
    value = consumer.registry.get_sample_value(name)
    return 0.0 if value is None else value


def test_messages_waiting_for_a_worker_stay_near_two_fetches(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(1)
    group = f"g-{topic}"
    n = 6000
    produce(kafka_bootstrap, topic, [(b"k", b"v", f"e-{i}") for i in range(n)])
    consumer = Slow(settings(group_id=group, topics=(topic,)))  # max_buffered 5000
    peak = 0.0
    with run_consumer(consumer) as running:
        deadline = time.monotonic() + 120
        while len(consumer.handled) < n and time.monotonic() < deadline:
            peak = max(peak, _gauge(consumer, "worker_buffered_messages"))
            time.sleep(0.005)
        assert len(consumer.handled) == n
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: n},
            30,
            0.2,
            what="everything committed",
        )
        assert running.stop() == 0
    assert [o for _, o in consumer.handled] == list(range(n))
    # Two fetches ahead (1,000), the fetch that crossed it (500) and the worker's
    # run not started yet (64): 1,564; a wait that runs out (0.5 s, a busy
    # machine) fetches one message only. Fetching without waiting for the worker
    # queued nearly all the window allows (5,495 before this change).
    assert 0 < peak <= 1600, peak


def test_an_idle_worker_is_fed_while_one_key_keeps_another_busy(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    """4,000 messages of one slow key, then 400 of another that take no time (all
    within ``max_buffered``): the queue is over two fetches, all of it one busy
    lane. Waiting for room there would fetch 500 more per wait (0.5 s), so the
    other key would wait about 2.5 s, with three of four workers idle."""
    topic = kafka_topics(1)
    slow, fast = 4000, 400
    records: list[tuple[bytes | None, bytes | None, str | None]] = [
        (b"slow", b"v", f"s-{i}") for i in range(slow)
    ]
    records += [(b"fast", f"{i}".encode(), f"f-{i}") for i in range(fast)]
    produce(kafka_bootstrap, topic, records)
    consumer = Slow(settings(group_id=f"g-{topic}", topics=(topic,), concurrency=4))
    consumer.pause = 0.004
    with run_consumer(consumer) as running:
        wait_for(
            lambda: sum(1 for k, _ in list(consumer.handled) if k == b"fast") == fast,
            60,
            what="the other key handled",
        )
        with consumer.lock:
            slow_done = sum(1 for k, _ in consumer.handled if k == b"slow")
        assert running.stop() == 0
    # The other key was fetched and handled while the slow one had barely started
    # (at 4 ms per message, 300 take at least 1.2 s; waiting for room: about 625).
    assert slow_done < 300, slow_done
    handled_slow = [o for k, o in consumer.handled if k == b"slow"]
    assert handled_slow == list(range(len(handled_slow)))  # in order, none skipped


def test_a_worker_slower_than_one_fetch_per_wait_does_not_grow_the_queue(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    """At 2 ms a message the worker takes fewer than 500 messages per wait (0.5 s):
    a round whose wait ran out must not fetch a whole batch, or the queue grows
    by the difference until ``max_buffered`` pauses the partition."""
    topic = kafka_topics(1)
    n = 4000
    produce(kafka_bootstrap, topic, [(b"k", b"v", f"e-{i}") for i in range(n)])
    consumer = Slow(settings(group_id=f"g-{topic}", topics=(topic,)))
    consumer.pause = 0.002
    peak = 0.0
    with run_consumer(consumer) as running:
        deadline = time.monotonic() + 6.0  # 3,000 messages at most meanwhile
        while time.monotonic() < deadline:
            peak = max(peak, _gauge(consumer, "worker_buffered_messages"))
            time.sleep(0.01)
        assert running.stop() == 0
    handled = [o for _, o in consumer.handled]
    assert handled == list(range(len(handled))) and handled  # in order, none skipped
    # A whole batch per timed-out wait reached about 3,000 here.
    assert 0 < peak <= 1600, peak
