"""Consumer metrics (the alert rules use these names)."""

from __future__ import annotations

import contextlib
import json
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from outboxkit.runtime.logs import log_event

__all__ = ["RESULTS", "ConsumerMetrics"]

RESULTS = ("success", "retry", "dlq", "duplicate")

_log = logging.getLogger("outboxkit.consumer.metrics")


class ConsumerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.inflight = Gauge(
            "worker_inflight_messages",
            "Messages taken by a worker and not finished (running or waiting for a retry)",
            registry=registry,
        )
        self.buffered = Gauge(
            "worker_buffered_messages",
            "Messages fetched and waiting for a worker",
            registry=registry,
        )
        self.shutdown_released = Gauge(
            "worker_shutdown_released_messages",
            "At the last drain: messages handed back uncommitted (not started, or still "
            "running at the deadline); Kafka redelivers them",
            registry=registry,
        )
        self.shutdown_committed = Gauge(
            "worker_shutdown_committed_messages",
            "At the last drain: processed messages whose offsets the final commit covered",
            registry=registry,
        )
        self.messages = Counter(
            "worker_messages",
            "Messages by result: success, retry (a transient failure retried), dlq, duplicate",
            ["result"],
            registry=registry,
        )
        for result in RESULTS:
            self.messages.labels(result=result)
        self.handle_seconds = Histogram(
            "worker_handle_seconds",
            "Time of one handler attempt (with the inbox: the whole transaction)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.lag = Gauge(
            "worker_consumer_lag",
            "Messages between the group's committed offset (or the log start, before the "
            "first commit) and the end of the partition",
            ["topic", "partition"],
            registry=registry,
        )
        self.paused = Gauge(
            "worker_paused_partitions",
            "Assigned partitions paused, by reason (full, dlq, draining)",
            ["reason"],
            registry=registry,
        )
        self.dlq_unavailable = Counter(
            "worker_dlq_unavailable",
            "Dead-letter writes that failed or were not acknowledged (retried later)",
            registry=registry,
        )

    def on_stats(self, stats_json: str) -> None:
        """librdkafka statistics callback: per-partition consumer lag."""
        try:
            stats = json.loads(stats_json)
            for topic, tdata in stats.get("topics", {}).items():
                for pid, pdata in tdata.get("partitions", {}).items():
                    if pid == "-1" or pdata.get("fetch_state") in (None, "none"):
                        continue
                    # librdkafka reports -1 until the group has committed; count from
                    # the log start then, so a group that never commits shows its lag.
                    hi = int(pdata.get("hi_offset", -1))
                    committed = int(pdata.get("committed_offset", -1001))
                    start = committed if committed >= 0 else int(pdata.get("lo_offset", -1))
                    if hi >= 0 and start >= 0:
                        self.lag.labels(topic=topic, partition=pid).set(max(0, hi - start))
        except Exception as exc:  # a metrics hook never breaks the loop
            log_event(_log, "stats-failed", level=logging.WARNING, error=str(exc))

    def forget_partition(self, topic: str, partition: int) -> None:
        with contextlib.suppress(KeyError):
            self.lag.remove(topic, str(partition))
