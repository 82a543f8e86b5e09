"""Kafka helpers for the consumer tests: produce, read back, committed offsets."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from confluent_kafka import Consumer as KafkaConsumer
from confluent_kafka import Producer, TopicPartition
from support import waiting

FAST_GROUP = {
    "session.timeout.ms": "6000",
    "heartbeat.interval.ms": "500",
    "topic.metadata.refresh.interval.ms": "2000",
}


def produce(
    bootstrap: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None, str | None] | dict[str, Any]],
    *,
    partition: int | None = None,
) -> list[str]:
    """Produce ``(key, value, event_id)`` tuples (or dicts of produce kwargs); the event ids."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"})
    ids: list[str] = []
    errors: list[Any] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    for n, record in enumerate(records):
        if isinstance(record, dict):
            kwargs = dict(record)
        else:
            key, value, event_id = record
            headers = [("event_id", event_id.encode())] if event_id else []
            kwargs = {"key": key, "value": value, "headers": headers}
            ids.append(event_id or "")
        if partition is not None:
            kwargs.setdefault("partition", partition)
        while True:
            try:
                producer.produce(topic, on_delivery=on_delivery, **kwargs)
                break
            except BufferError:
                producer.poll(0.1)
        if n % 1000 == 0:
            producer.poll(0)
    left = producer.flush(30)
    assert left == 0 and not errors, (left, errors[:3])
    return ids


def make_events(n: int, *, keys: int = 10) -> list[tuple[bytes, bytes, str]]:
    """``n`` JSON events over ``keys`` keys, each with a ``seq`` per key and an event id."""
    seq: dict[int, int] = {}
    out = []
    for i in range(n):
        k = i % keys
        seq[k] = seq.get(k, 0) + 1
        body = f'{{"n": {i}, "key": "k{k}", "seq": {seq[k]}}}'.encode()
        out.append((f"k{k}".encode(), body, str(uuid.uuid4())))
    return out


def committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    """The group's committed offsets per partition (-1001 when none), asked by another client."""
    c = KafkaConsumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        result = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
    finally:
        c.close()
    return {tp.partition: tp.offset for tp in result}


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    c = KafkaConsumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4().hex}"})
    try:
        return {
            p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(partitions)
        }
    finally:
        c.close()


def read_all(bootstrap: str, topic: str, *, expect: int, timeout: float = 20.0) -> list[Any]:
    """Read ``topic`` from the start until ``expect`` records arrived (or ``timeout``)."""
    c = KafkaConsumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    out: list[Any] = []
    try:
        c.subscribe([topic])
        deadline = time.monotonic() + timeout
        while len(out) < expect and time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is None or msg.error():
                continue
            out.append(msg)
        if expect == 0:
            # Prove absence: give the reader a moment to see anything there is.
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                msg = c.poll(0.2)
                if msg is not None and not msg.error():
                    out.append(msg)
    finally:
        c.close()
    return out


def headers_of(msg: Any) -> dict[str, str]:
    return {k: (v or b"").decode() for k, v in (msg.headers() or [])}


def wait_for(predicate: Any, timeout: float, interval: float = 0.05, what: str = "") -> Any:
    return waiting.wait_for(predicate, timeout=timeout, interval=interval, what=what)


def offsets_all_below(offsets: dict[int, int], done: dict[int, set[int]]) -> list[str]:
    """Problems: committed offsets with an unprocessed message below them."""
    problems = []
    for p, off in offsets.items():
        if off < 0:
            continue
        missing = [o for o in range(off) if o not in done.get(p, set())]
        if missing:
            problems.append(f"partition {p}: committed {off}, unprocessed {missing[:5]}")
    return problems


def partitions_of(items: Sequence[Any]) -> set[int]:
    return {m.partition() for m in items}


def http_get(url: str, timeout: float = 2.0) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a health endpoint; 503 is an answer, not an error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (http only)
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
