"""Kafka helpers: the relay's producer settings, producing from memory, progress.

Progress is read from the topic's high watermarks (a cheap metadata request, no
load on the database), so the same measurement works whether the relay marks
rows delivered or deletes them.
"""

from __future__ import annotations

import importlib
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from bench.data import Message

#: The relay's publishing settings as the design fixes them; ``relay_producer_config``
#: prefers the relay's own when it can be imported.
DEFAULT_PRODUCER_CONFIG: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "compression.type": "lz4",
    "linger.ms": 5,
    "partitioner": "murmur2_random",
    "message.timeout.ms": 30_000,
}


def relay_producer_config(bootstrap: str) -> dict[str, Any]:
    """The producer settings the relay really uses, so the ceiling is like for like."""
    config = dict(DEFAULT_PRODUCER_CONFIG)
    try:
        publish = importlib.import_module("outboxkit.relay.publish")
        settings = importlib.import_module("outboxkit.relay.settings")
    except ImportError:
        pass
    else:
        relay_settings = settings.RelaySettings(
            db_url="mysql+pymysql://unused@127.0.0.1/unused", kafka_bootstrap=bootstrap
        )
        config = dict(publish.producer_config(relay_settings, error_cb=lambda _err: None))
        # Hooks into the relay's logging; they do not change what is sent.
        config.pop("logger", None)
        config.pop("client.id", None)
    config["bootstrap.servers"] = bootstrap
    return config


@dataclass
class ProduceResult:
    sent: int
    acked: int
    errors: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.acked / self.seconds if self.seconds else 0.0


def produce(
    config: dict[str, Any],
    topic: str,
    msgs: Sequence[Message],
    *,
    flush_every: int | None = None,
) -> ProduceResult:
    """Produce ``msgs`` and wait for every delivery report.

    ``flush_every=N`` waits for all reports after every N messages: the lock-step
    of a loop that publishes a batch and waits for it before the next.
    """
    producer = Producer(config)
    acked = 0
    errors = 0

    def on_delivery(err: KafkaError | None, _msg: Any) -> None:
        nonlocal acked, errors
        if err is None:
            acked += 1
        else:
            errors += 1

    # Connect and fetch metadata before the clock starts, as a running relay has.
    producer.list_topics(topic, timeout=10)
    start = time.perf_counter()
    for i, m in enumerate(msgs, 1):
        while True:
            try:
                producer.produce(topic, m.value, m.key, headers=m.headers, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.01)
        if flush_every and i % flush_every == 0:
            producer.flush(60)
        elif i % 1000 == 0:
            producer.poll(0)
    remaining = producer.flush(120)
    seconds = time.perf_counter() - start
    return ProduceResult(len(msgs), acked, errors + remaining, seconds)


def high_watermarks(consumer: Consumer, topic: str, partitions: int) -> int:
    total = 0
    for p in range(partitions):
        _low, high = consumer.get_watermark_offsets(
            TopicPartition(topic, p), timeout=10, cached=False
        )
        total += high
    return total


def metadata_consumer(bootstrap: str) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-meta-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
        }
    )


@dataclass
class Progress:
    """Samples a topic's message count in a thread: ``(monotonic seconds, count)``."""

    bootstrap: str
    topic: str
    partitions: int
    interval: float = 0.1
    samples: list[tuple[float, int]] = field(default_factory=list)
    last_error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Progress:
        self._thread = threading.Thread(target=self._run, name="bench-progress", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        consumer = metadata_consumer(self.bootstrap)
        try:
            while not self._stop.is_set():
                try:
                    count = high_watermarks(consumer, self.topic, self.partitions)
                except KafkaException as exc:
                    # A client that has just met a new topic may not know its leaders
                    # yet; a dead sampler would read as "no progress" until the timeout.
                    self.last_error = str(exc)
                else:
                    self.samples.append((time.monotonic(), count))
                self._stop.wait(self.interval)
        finally:
            consumer.close()

    def latest(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def wait_for(
        self, count: int, timeout: float, *, alive: Callable[[], bool] | None = None
    ) -> None:
        deadline = time.monotonic() + timeout
        while self.latest() < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.topic}: {self.latest()} of {count} messages after {timeout}s"
                    + (f" (last sampling error: {self.last_error})" if self.last_error else "")
                )
            if alive is not None and not alive():
                raise RuntimeError(f"{self.topic}: the process under test exited early")
            time.sleep(self.interval / 2)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def time_at(self, count: float) -> float:
        """When the topic held ``count`` messages, interpolated between samples."""
        prev_t, prev_c = self.samples[0]
        for t, c in self.samples:
            if c >= count:
                if c == prev_c:
                    return t
                return prev_t + (t - prev_t) * (count - prev_c) / (c - prev_c)
            prev_t, prev_c = t, c
        raise ValueError(f"the topic never held {count} messages")

    def rate_between(self, lo: float, hi: float) -> float:
        """Messages per second between the ``lo`` and ``hi`` counts."""
        seconds = self.time_at(hi) - self.time_at(lo)
        return (hi - lo) / seconds if seconds > 0 else float("inf")

    def first_nonzero(self) -> float:
        """Just before the first message: the last sample that still saw none."""
        last_zero = self.samples[0][0]
        for t, c in self.samples:
            if c > 0:
                return last_zero
            last_zero = t
        raise ValueError("no message was ever seen")


def read_all(
    bootstrap: str,
    topic: str,
    expected: int,
    *,
    timeout: float,
    on_message: Callable[[Any], None],
) -> int:
    """Read a topic from the start with a throw-away group until ``expected`` messages."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-read-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    seen = 0
    deadline = time.monotonic() + timeout
    try:
        consumer.subscribe([topic])
        while seen < expected and time.monotonic() < deadline:
            for msg in consumer.consume(1000, timeout=0.5):
                if msg.error():
                    continue
                on_message(msg)
                seen += 1
    finally:
        consumer.close()
    return seen
