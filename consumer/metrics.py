"""Consumer metrics (the alert rules use these names)."""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from outboxkit.runtime.logs import log_event

__all__ = ["RESULTS", "ConsumerMetrics", "HandleTimes"]

RESULTS = ("success", "retry", "dlq", "duplicate")

_log = logging.getLogger("outboxkit.consumer.metrics")


class ConsumerMetrics:
    def __init__(self, registry: CollectorRegistry, *, group: str = "") -> None:
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
        self.handle_seconds = _Histogram(
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
        # A member of a group whose rebalance never completes (a coordinator that
        # does not answer) has nothing assigned and stays live and ready: these
        # two show it, and the ConsumerGroupUnassigned alert fires on them.
        self.assigned = Gauge(
            "worker_assigned_partitions",
            "Partitions assigned to this consumer now (0 until the group assigns it any)",
            ["group"],
            registry=registry,
        ).labels(group=group)
        self.rebalanced_at = Gauge(
            "worker_last_rebalance_timestamp_seconds",
            "Unix time of this consumer's last rebalance (partitions assigned, revoked or "
            "lost, or an assignment left as it was), or of its subscription before the first",
            ["group"],
            registry=registry,
        ).labels(group=group)
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


class _Histogram(Histogram):
    """A :class:`Histogram` that also takes many observations at once (:class:`HandleTimes`)."""

    def add(self, counts: list[int], total: float) -> None:
        """Add ``counts[i]`` observations to bucket ``i`` (not cumulative) and ``total``
        to the sum: what as many :meth:`observe` calls would have done."""
        self._sum.inc(total)
        for bucket, n in zip(self._buckets, counts, strict=True):
            if n:
                bucket.inc(n)


class HandleTimes:
    """One worker's handler times, added to ``worker_handle_seconds`` in batches.

    ``observe`` costs a few list operations instead of the histogram's two locked
    updates; :meth:`flush` adds what was observed. The worker flushes at the end
    of each run and at least every ``_FLUSH_EVERY`` seconds, so the metric lags a
    scrape by at most that (or one slow handler). Not thread-safe: one per worker.
    """

    _FLUSH_EVERY = 1.0

    def __init__(self, histogram: _Histogram) -> None:
        self._histogram = histogram
        self._bounds = list(histogram._upper_bounds)
        self._counts = [0] * len(self._bounds)
        self._total = 0.0
        self._pending = 0
        self._flush_at = time.monotonic() + self._FLUSH_EVERY

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._total += seconds
        self._pending += 1

    def flush(self, *, due_only: bool = False) -> None:
        """Add what was observed; with ``due_only``, only once ``_FLUSH_EVERY`` passed."""
        if not self._pending:
            return
        now = time.monotonic()
        if due_only and now < self._flush_at:
            return
        counts, total = self._counts, self._total
        self._counts, self._total, self._pending = [0] * len(self._bounds), 0.0, 0
        self._flush_at = now + self._FLUSH_EVERY
        self._histogram.add(counts, total)
