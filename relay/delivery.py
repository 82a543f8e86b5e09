"""What a send came back as: the error kinds, one row's delivery report, a
batch's reports in flight.

:class:`~outboxkit.relay.publish.Publisher` fills these; the finalize, the
accounting and the drain read them. They are apart from the producer so that a
module deciding a row's fate does not import librdkafka's session.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError

from outboxkit.relay.rows import ClaimedRow
from outboxkit.runtime.logs import log_event

__all__ = [
    "CLUSTER_CODES",
    "TOO_LARGE_FOR_QUEUE",
    "ErrorKind",
    "InFlight",
    "Report",
    "classify",
    "config_fault_reason",
    "delivery_callback",
    "local_report",
    "not_sent",
    "row_fault",
]

#: The logger of the producer's lines (``acked-after-release`` included).
log = logging.getLogger("outboxkit.relay.publish")


class ErrorKind(enum.Enum):
    RETRIABLE = "retriable"
    #: The cluster, not the row: no leader, too few in-sync replicas, brokers
    #: unreachable (see :mod:`outboxkit.relay.outage`). Retried, attempt refunded.
    CLUSTER = "cluster"
    ROW_FAULT = "row-fault"
    CONFIG_FAULT = "config-fault"
    UNKNOWN = "unknown"
    NOT_SENT = "not-sent"


_ROW_FAULTS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_TIMESTAMP,
        KafkaError._BAD_MSG,
        KafkaError._INVALID_ARG,
        # The broker says the topic name is illegal: no configuration fixes that.
        KafkaError.TOPIC_EXCEPTION,
    }
)
_CONFIG_FAULTS = {
    KafkaError.UNKNOWN_TOPIC_OR_PART: "unknown-topic",
    KafkaError._UNKNOWN_TOPIC: "unknown-topic",
    KafkaError._UNKNOWN_PARTITION: "unknown-topic",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "authorization",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "authorization",
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "authorization",
    KafkaError.SASL_AUTHENTICATION_FAILED: "authentication",
    KafkaError._AUTHENTICATION: "authentication",
    KafkaError._SSL: "authentication",
}
#: Errors that name a state of the cluster, never of the row: the partition has
#: no leader or too few in-sync replicas, a broker is unreachable or did not
#: answer. They cost no attempt (an outage of any length must not fail rows).
CLUSTER_CODES = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.BROKER_NOT_AVAILABLE,
        KafkaError.REPLICA_NOT_AVAILABLE,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.NOT_ENOUGH_REPLICAS,
        KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        KafkaError.KAFKA_STORAGE_ERROR,
    }
)
#: Retriable, but by themselves no proof of the cause: a message timeout is the
#: cluster's fault only with evidence (see :mod:`outboxkit.relay.outage`).
_RETRIABLE = frozenset(
    {
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._QUEUE_FULL,
    }
)


def classify(code: int, *, retriable: bool = False) -> ErrorKind:
    if code == KafkaError._PURGE_QUEUE:  # removed from the queue before any send
        return ErrorKind.NOT_SENT
    if code in _ROW_FAULTS:
        return ErrorKind.ROW_FAULT
    if code in _CONFIG_FAULTS:
        return ErrorKind.CONFIG_FAULT
    if code in CLUSTER_CODES:
        return ErrorKind.CLUSTER
    if retriable or code in _RETRIABLE:
        return ErrorKind.RETRIABLE
    return ErrorKind.UNKNOWN


def config_fault_reason(code: int, default: str = "config") -> str:
    """Short label for the ``reason`` of ``outbox_topic_paused`` (``default`` for a
    code that is no configuration fault)."""
    return _CONFIG_FAULTS.get(code, default)


# Not frozen: built once per row (see rows.ClaimedRow).
@dataclass(slots=True)
class Report:
    """One delivery report. ``code`` is None when Kafka acknowledged the message.

    ``partition`` is where the message went (or was to go: librdkafka names it
    for a failed message too, None before one was chosen). ``sent_code`` is the
    code librdkafka reported when the relay named the cause itself (a message
    timeout explained by the partition's state, see :mod:`outboxkit.relay.outage`).
    """

    row_id: int
    code: int | None
    error: str | None
    kind: ErrorKind | None
    partition: int | None
    offset: int | None
    mono: float
    sent_code: int | None = None

    @property
    def ok(self) -> bool:
        return self.code is None


class InFlight:
    """The delivery reports of one batch; callbacks of an older batch never land here."""

    def __init__(self, rows: list[ClaimedRow]) -> None:
        self.rows = rows
        self.expected = {r.id for r in rows}
        self.reports: dict[int, Report] = {}
        #: Producer spans waiting for their report (only with tracing on).
        self.spans: dict[int, Any] = {}
        #: The rows' outcomes were decided (:meth:`Publisher.settle_reports`): a
        #: report arriving now is late, its row was released meanwhile.
        self.settled = False
        self._lock = threading.Lock()

    def add(self, report: Report) -> None:
        with self._lock:
            if report.row_id not in self.expected or report.row_id in self.reports:
                return
            self.reports[report.row_id] = report
            late = self.settled
        if late and report.ok:
            # In flight when the batch gave up on it: the row was released (and is
            # sent again), but this copy made it. The idempotent producer writes a
            # partition in produce order, so the key's later rows this batch sent
            # are behind it; only an earlier row of its key whose own send failed
            # can now sit behind it too.
            log_event(
                log,
                "acked-after-release",
                level=logging.WARNING,
                row_id=report.row_id,
                partition=report.partition,
                offset=report.offset,
                note="a copy of a released row reached Kafka after its batch gave up on it; "
                "the row is sent again (a duplicate)",
            )

    def settle(self) -> None:
        """The batch's outcomes are being decided: later reports are late."""
        with self._lock:
            self.settled = True

    def done(self) -> bool:
        with self._lock:
            return len(self.reports) >= len(self.expected)

    def missing(self) -> int:
        with self._lock:
            return len(self.expected) - len(self.reports)

    def missing_ids(self) -> list[int]:
        """The rows with no report yet, in id order."""
        with self._lock:
            return sorted(self.expected - self.reports.keys())

    def snapshot(self) -> dict[int, Report]:
        with self._lock:
            return dict(self.reports)


def delivery_callback(inflight: InFlight, row_id: int) -> Callable[[KafkaError | None, Any], None]:
    def on_delivery(err: KafkaError | None, msg: Any) -> None:
        now = time.monotonic()
        if err is None:
            inflight.add(Report(row_id, None, None, None, msg.partition(), msg.offset(), now))
        else:
            kind = classify(err.code(), retriable=err.retriable())
            text = f"{err.name()}: {err.str()}"
            partition = msg.partition() if msg is not None else None
            if partition is not None and partition < 0:  # RD_KAFKA_PARTITION_UA
                partition = None
            inflight.add(Report(row_id, err.code(), text, kind, partition, None, now))

    return on_delivery


TOO_LARGE_FOR_QUEUE = (
    "the message does not fit into the producer's empty queue: it is larger than "
    "queue.buffering.max.kbytes (--kafka-config)"
)


def not_sent(row_id: int, why: str) -> Report:
    """The row was never handed to the producer: certainly not written."""
    return Report(
        row_id,
        KafkaError._QUEUE_FULL,
        f"not sent: {why}",
        ErrorKind.NOT_SENT,
        None,
        None,
        time.monotonic(),
    )


def row_fault(row_id: int, text: str) -> Report:
    """The row cannot be sent as stored: fail it (no Kafka error code to name)."""
    return Report(
        row_id, KafkaError._INVALID_ARG, text, ErrorKind.ROW_FAULT, None, None, time.monotonic()
    )


def local_report(row_id: int, code: int, text: str) -> Report:
    name = KafkaError(code).name()
    return Report(row_id, code, f"{name}: {text}", classify(code), None, None, time.monotonic())
