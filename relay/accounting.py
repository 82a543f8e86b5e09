"""What a finalized batch changes besides its rows: counters, warnings, pauses.

The relay calls these after every finalize (``Pipeline._account``), in this
order for each decision: the out-of-order warning, then, for a delivered row
still ours, its latency and the end of its topic's pause; then the pauses the
batch asks for; then the outcome counters (``count_outcomes``), so a reader of
the metrics never finds a row counted delivered whose latency is not yet
observed. The exit record's counts are added by the pipeline itself, and only
once the drain began (see :mod:`outboxkit.relay.drain`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError

from outboxkit.relay.finalize import Decision, Fate, FinalizeResult
from outboxkit.relay.metrics import RelayMetrics
from outboxkit.relay.pauses import PausedTopics
from outboxkit.relay.rows import Batch
from outboxkit.runtime.logs import MAX_IDS_LOGGED, log_event

__all__ = [
    "POSSIBLY_WRITTEN",
    "RetryReporter",
    "count_outcomes",
    "delivered",
    "pause_topics",
    "warn_acked_out_of_order",
]

log = logging.getLogger("outboxkit.relay")


def count_outcomes(m: RelayMetrics, result: FinalizeResult) -> None:
    """The outcome counters: what the finalize wrote, and the rows whose lease was lost."""
    m.delivered.inc(result.counts[Fate.DELIVERED])
    m.failed.inc(result.counts[Fate.FAILED])
    m.retryable.inc(result.counts[Fate.RETRYABLE] + result.counts[Fate.PAUSED])
    m.released.inc(result.counts[Fate.RELEASED])
    m.lease_lost.inc(len(result.lease_lost))


def warn_acked_out_of_order(m: RelayMetrics, d: Decision) -> None:
    """``acked-out-of-order``: Kafka acknowledged ``d`` although an earlier event of
    its key was not; the relay sends it again after that one."""
    if d.acked_ahead_of is None:
        return
    earlier, error = d.acked_ahead_of
    m.acked_out_of_order.inc()
    log_event(
        log,
        "acked-out-of-order",
        level=logging.WARNING,
        row_id=d.row.id,
        event_id=d.row.event_id,
        topic=d.row.topic,
        partition=d.partition,
        offset=d.offset,
        earlier_row_id=earlier,
        earlier_error=error,
        note=(
            "this event is in the partition ahead of the earlier event of its "
            "key; it is sent again after it, so the last copies are in order"
        ),
    )


def delivered(m: RelayMetrics, paused: PausedTopics, batch: Batch, d: Decision) -> None:
    """A row delivered (and still ours): its enqueue-to-ack latency (database clock),
    and a paused topic that delivers again is resumed."""
    if d.acked_mono is not None:
        m.publish_latency.observe(max(0.0, batch.age(d.row, d.acked_mono)))
    if d.row.topic in paused:
        paused.resume(d.row.topic)


def pause_topics(paused: PausedTopics, decisions: list[Decision], lost: set[int]) -> None:
    """Pause each topic the batch found misconfigured (its first row gives the reason)."""
    by_topic: dict[str, list[Decision]] = {}
    for d in decisions:
        if d.fate is Fate.PAUSED and d.row.id not in lost:
            by_topic.setdefault(d.row.topic, []).append(d)
    for topic, rows in by_topic.items():
        paused.pause(topic, rows[0].pause_reason or "config", rows[0].error or "", len(rows))


#: Seconds between two ``delivery-retry`` lines of one topic (the counter counts every row).
RETRY_LOG_INTERVAL = 10.0


#: Delivery errors after which the message may still have been written: it
#: reached a broker, and no answer came back (librdkafka's "possibly persisted";
#: the Python client does not expose a message's status). A row with one of
#: them is sent again (or failed, past --max-attempts), and Kafka may then hold
#: two copies of it. NOT_ENOUGH_REPLICAS is not one: the leader refused the
#: write before appending it.
POSSIBLY_WRITTEN = frozenset(
    {
        "_MSG_TIMED_OUT",
        "_TIMED_OUT",
        "REQUEST_TIMED_OUT",
        "_TRANSPORT",
        "NETWORK_EXCEPTION",
        "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
    }
)


def _error_name(d: Decision) -> str:
    """librdkafka's name of the error behind ``d`` (``_MSG_TIMED_OUT``...), from
    the report's code; ``unknown`` for an error no report gave."""
    if d.error_code is None:
        return "unknown"
    return str(KafkaError(d.error_code).name())


def _sent_error_name(d: Decision) -> str:
    """The name of the error librdkafka reported for ``d`` (before the relay named
    the cluster's state as its cause, see relay/outage.py)."""
    if d.sent_code is None:
        return _error_name(d)
    return str(KafkaError(d.sent_code).name())


def possibly_written(d: Decision) -> bool:
    """``d``'s send failed in a way that may still have written it. Not when the
    cause is an ISR below ``min.insync.replicas``, even behind a message timeout:
    the leader refuses those writes before appending them."""
    if d.fate not in (Fate.RETRYABLE, Fate.FAILED):
        return False
    if _error_name(d) == "NOT_ENOUGH_REPLICAS":
        return False
    return _sent_error_name(d) in POSSIBLY_WRITTEN


def report_possibly_written(decisions: Sequence[Decision]) -> None:
    """One ``possibly-written`` INFO line per batch naming the rows whose send
    failed in a way that may still have written them (:func:`possibly_written`):
    the rows an operator may find twice in the topic. Every batch, not rate
    limited like ``delivery-retry``: the ids are the point. ``errors`` counts
    them by the error librdkafka reported."""
    rows = [d for d in decisions if possibly_written(d)]
    if not rows:
        return
    errors: dict[str, int] = {}
    for d in rows:
        errors[_sent_error_name(d)] = errors.get(_sent_error_name(d), 0) + 1
    log_event(
        log,
        "possibly-written",
        rows=len(rows),
        row_ids=sorted(d.row.id for d in rows)[:MAX_IDS_LOGGED],
        errors=errors,
        effect="no acknowledgement for a message sent to a broker: it may be in the "
        "partition, and the row is sent again (a duplicate) or failed",
    )


class RetryReporter:
    """Says which topic a retryable batch failed on and why: the Kafka cluster's
    fault, not the relay's nor the row's.

    Every row set back to ``retryable`` for a retriable Kafka error counts in
    ``outbox_kafka_delivery_errors{topic, error}``, ``error`` being the cause:
    the error librdkafka reported, or, for a message timeout the partition's
    state explains, that state (``NOT_ENOUGH_REPLICAS``, ``LEADER_NOT_AVAILABLE``,
    see relay/outage.py). At most one ``delivery-retry`` WARNING per topic per
    :data:`RETRY_LOG_INTERVAL` names the topic, the rows, the causes, whether
    their attempts were refunded (``refunded``: the cluster's fault), and the
    partitions' state as the cluster reports it (``probe``): leader and ISR
    against the replicas, so an operator reads "ISR [1] of replicas [1, 3]" or
    "no leader". The topic is not paused: the relay retries with backoff until
    the cluster accepts the rows again.
    """

    def __init__(
        self,
        metrics: RelayMetrics,
        probe: Callable[[str], list[dict[str, Any]] | None],
        *,
        interval: float = RETRY_LOG_INTERVAL,
        background: bool = True,
    ) -> None:
        self._metrics = metrics
        self._probe = probe
        self._interval = interval
        #: Probe and log on a thread of their own: the probe may wait for a
        #: broker (2 s at most), and the loop must not wait with it.
        self._background = background
        self._last: dict[str, float] = {}

    def report(self, decisions: Sequence[Decision], lost: set[int]) -> None:
        report_possibly_written(decisions)
        by_topic: dict[str, list[Decision]] = {}
        for d in decisions:
            if d.fate is Fate.RETRYABLE and d.row.id not in lost:
                by_topic.setdefault(d.row.topic, []).append(d)
        now = time.monotonic()
        for topic, rows in by_topic.items():
            errors: dict[str, int] = {}
            for d in rows:
                name = _error_name(d)
                errors[name] = errors.get(name, 0) + 1
            for name, n in errors.items():
                self._metrics.delivery_errors.labels(topic=topic, error=name).inc(n)
            if now - self._last.get(topic, -float("inf")) < self._interval:
                continue
            self._last[topic] = now
            refunded = sum(1 for d in rows if d.refund)
            args = (topic, len(rows), errors, rows[0].error, refunded)
            if self._background:
                threading.Thread(
                    target=self._log, args=args, name="outboxkit-retry-log", daemon=True
                ).start()
            else:
                self._log(*args)

    def _log(
        self, topic: str, rows: int, errors: dict[str, int], error: str | None, refunded: int = 0
    ) -> None:
        try:
            partitions = self._probe(topic)
        except Exception:  # a probe for a log line never breaks anything
            partitions = None
        log_event(
            log,
            "delivery-retry",
            level=logging.WARNING,
            topic=topic,
            rows=rows,
            errors=errors,
            error=error,
            refunded=refunded,
            partitions=partitions,
            action="retried with backoff (Kafka cluster fault, not the rows'; attempts "
            "refunded where the cluster refused or never answered); the topic is not paused",
        )
