"""Scenario 6, second half: the consumer base class on the topic the raw loops read.

Each variant runs the class embedded (``run(handle_signals=False)`` in a
thread, as the raw loops run in this process) with a fresh group, and stops it
once every message was handled.  Variants: the trivial handler; the same with
the inbox on MariaDB (each message in its own transaction with an inbox row);
``concurrency=N`` with a handler that sleeps 1 ms.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa

from bench.apps import Counting, Meter, Sleepy, Trivial
from bench.context import BenchContext
from bench.report import Row, ScenarioResult
from outboxkit.consumer.settings import ConsumerSettings
from outboxkit.schema import DEFAULT_INBOX_TABLE, inbox_table


def dlq_topic(ctx: BenchContext, topic: str) -> None:
    """The default dead-letter topic must exist: the consumer checks it at start."""
    if not ctx.cache.get(f"dlq:{topic}"):
        ctx.topic("dlq", name=f"{topic}.dlq", partitions=1)
        ctx.cache[f"dlq:{topic}"] = True


def embedded(
    ctx: BenchContext,
    cls: type[Counting],
    topic: str,
    *,
    label: str,
    concurrency: int = 1,
    inbox: bool = False,
    engine: sa.Engine | None = None,
    **overrides: Any,
) -> Row:
    cfg = ctx.config
    expected = cfg.consumer_messages
    settings = ConsumerSettings(
        service="bench-consumer",
        kafka_bootstrap=ctx.services.kafka_bootstrap,
        group_id=f"bench-{label}-{uuid.uuid4().hex[:8]}",
        topics=(topic,),
        health_port=0,
        concurrency=concurrency,
        inbox=inbox,
        db_url=ctx.db_url if inbox else None,
        log_level="WARNING",
        **overrides,
    )
    consumer: Any = None
    meter = Meter(expected, on_done=lambda: consumer.stop())
    attrs = {"on_message": staticmethod(meter), "sleep_s": cfg.consumer_sleep_ms / 1000}
    subclass = type(cls.__name__, (cls,), attrs)
    consumer = subclass(settings, engine=engine)
    started = time.perf_counter()
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(consumer.run(handle_signals=False)), daemon=True
    )
    thread.start()
    thread.join(cfg.timeout_seconds)
    if thread.is_alive():
        consumer.stop()
        thread.join(60)
        raise RuntimeError(f"{label}: {meter.count} of {expected} messages before the timeout")
    if codes != [0] or meter.first is None or meter.last is None:
        raise RuntimeError(f"{label}: exit code {codes}, {meter.count} of {expected} messages")
    seconds = meter.last - meter.first
    return {
        "variant": label,
        "messages": meter.count,
        "join_s": meter.first - started,
        "seconds": seconds,
        "msgs/s": meter.count / seconds if seconds > 0 else float("inf"),
    }


def run_variants(ctx: BenchContext, res: ScenarioResult, topic: str) -> None:
    cfg = ctx.config
    dlq_topic(ctx, topic)
    raw = res.figures["raw_rate"]

    base = embedded(ctx, Trivial, topic, label="base class")
    base["vs raw poll"] = base["msgs/s"] / raw
    res.rows.append(base)
    res.figures["base_rate"] = base["msgs/s"]

    # The default (200) pauses partitions so often that librdkafka's prefetch is
    # thrown away and fetched again; this row shows what a larger buffer gives.
    tuned = embedded(ctx, Trivial, topic, label="base class, max_buffered=5000", max_buffered=5000)
    tuned["vs raw poll"] = tuned["msgs/s"] / raw
    res.rows.append(tuned)
    res.figures["base_rate_buffered"] = tuned["msgs/s"]

    inbox_table(DEFAULT_INBOX_TABLE).create(ctx.engine, checkfirst=True)
    inbox = embedded(ctx, Trivial, topic, label="base class + inbox", inbox=True)
    inbox["vs raw poll"] = inbox["msgs/s"] / raw
    res.rows.append(inbox)
    res.figures["inbox_rate"] = inbox["msgs/s"]

    n = cfg.consumer_concurrency
    sleepy = embedded(
        ctx,
        Sleepy,
        topic,
        label=f"concurrency={n}, {cfg.consumer_sleep_ms:g} ms handler",
        concurrency=n,
    )
    ideal = n * 1000 / cfg.consumer_sleep_ms
    sleepy["vs ideal"] = sleepy["msgs/s"] / ideal
    res.rows.append(sleepy)
    res.figures["concurrent_rate"] = sleepy["msgs/s"]
    res.notes.append(
        f"ideal for concurrency={n} and a {cfg.consumer_sleep_ms:g} ms handler: {ideal:,.0f} msgs/s"
    )
