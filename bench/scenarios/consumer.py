"""Scenario 6, the consumer: a raw confluent-kafka poll loop next to the consumer
base class, on the same pre-filled topic, each with a fresh group.

The raw loop is the at-least-once loop one would write by hand: ``poll``,
handle, ``store_offsets`` after the handler, auto-commit of stored offsets, a
synchronous commit at the end.  Rates count from the first message received to
the last one handled, so the group join (seconds, the same for everybody) is
reported separately and does not blur the comparison.  ``cpu s/1k msgs`` is
the benchmark process's CPU time (all its threads) from the first message to
the last, per 1,000 messages.

Then ``outboxkit consume`` with the inbox runs as its own process on this topic
and on one ``memory_scale`` times smaller, for its peak resident set (VmHWM):
does a consumer's memory grow with the backlog it reads?
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from confluent_kafka import Consumer

from bench import data
from bench.context import BenchContext
from bench.kafka import produce, relay_producer_config
from bench.report import Row, ScenarioResult
from bench.scenarios import Results


def prepare_topic(ctx: BenchContext) -> str:
    """A topic holding ``consumer_messages`` benchmark events (made once per run)."""
    topic = ctx.cache.get("consumer_topic")
    if topic is None:
        cfg = ctx.config
        topic = ctx.topic("consume")
        msgs = data.messages(cfg.consumer_messages, keys=cfg.keys, payload_bytes=cfg.payload_bytes)
        out = produce(relay_producer_config(ctx.services.kafka_bootstrap), topic, msgs)
        if out.acked != len(msgs):
            raise RuntimeError(f"pre-filling {topic}: {out.acked} of {len(msgs)} acked")
        ctx.cache["consumer_topic"] = topic
    return str(topic)


def raw_config(bootstrap: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": f"bench-raw-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest",
        "enable.auto.commit": True,
        "enable.auto.offset.store": False,
        "partition.assignment.strategy": "cooperative-sticky",
    }


def handle(msg: Any) -> int:
    """The trivial handler every variant runs: touch the value."""
    value = msg.value()
    return len(value) if value is not None else 0


def raw_poll_loop(bootstrap: str, topic: str, expected: int, timeout: float) -> Row:
    consumer = Consumer(raw_config(bootstrap))
    n = 0
    started = time.perf_counter()
    first: float | None = None
    cpu_first = 0.0
    deadline = time.monotonic() + timeout
    try:
        consumer.subscribe([topic])
        while n < expected and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None or msg.error():
                continue
            if first is None:
                first = time.perf_counter()
                cpu_first = time.process_time()
            handle(msg)
            consumer.store_offsets(msg)
            n += 1
        last = time.perf_counter()
        cpu = time.process_time() - cpu_first
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    return _row("raw poll loop", n, started, first, last, cpu)


def raw_batch_loop(bootstrap: str, topic: str, expected: int, timeout: float) -> Row:
    """``consume(500)`` instead of ``poll``: what batching the C calls alone buys."""
    consumer = Consumer(raw_config(bootstrap))
    n = 0
    started = time.perf_counter()
    first: float | None = None
    cpu_first = 0.0
    deadline = time.monotonic() + timeout
    try:
        consumer.subscribe([topic])
        while n < expected and time.monotonic() < deadline:
            for msg in consumer.consume(500, timeout=1.0):
                if msg.error():
                    continue
                if first is None:
                    first = time.perf_counter()
                    cpu_first = time.process_time()
                handle(msg)
                consumer.store_offsets(msg)
                n += 1
        last = time.perf_counter()
        cpu = time.process_time() - cpu_first
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    return _row("raw consume(500) loop", n, started, first, last, cpu)


def _row(variant: str, n: int, started: float, first: float | None, last: float, cpu: float) -> Row:
    if first is None or n == 0:
        raise RuntimeError(f"{variant}: no message received")
    return {
        "variant": variant,
        "messages": n,
        "join_s": first - started,
        "seconds": last - first,
        "msgs/s": n / (last - first),
        "cpu s/1k msgs": cpu / n * 1000,
    }


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    cfg = ctx.config
    res = ScenarioResult("consumer", "raw poll loop vs the consumer base class")
    topic = prepare_topic(ctx)
    bootstrap = ctx.services.kafka_bootstrap
    res.settings = {
        "messages": cfg.consumer_messages,
        "partitions": cfg.partitions,
        "payload_bytes": cfg.payload_bytes,
        "concurrency": cfg.consumer_concurrency,
        "sleep_handler_ms": cfg.consumer_sleep_ms,
    }
    raw = raw_poll_loop(bootstrap, topic, cfg.consumer_messages, cfg.timeout_seconds)
    res.rows.append(raw)
    res.figures["raw_rate"] = raw["msgs/s"]
    res.figures["raw_cpu_per_1k"] = raw["cpu s/1k msgs"]
    batch = raw_batch_loop(bootstrap, topic, cfg.consumer_messages, cfg.timeout_seconds)
    res.rows.append(batch)
    res.figures["raw_batch_rate"] = batch["msgs/s"]
    from bench.scenarios import consumer_base  # needs outboxkit.consumer

    consumer_base.run_variants(ctx, res, topic)
    consumer_base.memory_rows(ctx, res, topic)
    return res
