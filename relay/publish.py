"""Publish a batch with one long-lived idempotent producer and collect its delivery reports.

The producer is created once per relay process with ``enable.idempotence=true``
and ``acks=all``: Kafka writes each partition's messages once and in produce
order, even across internal retries, so producing a batch in id order keeps the
order of every key (one key, one partition).

Errors are classified by what should happen to the row (:class:`ErrorKind`):

* ``CLUSTER``: the cluster, not the row: no leader, too few in-sync replicas,
  a broker unreachable or silent (the error says so, or a message timeout is
  explained by the partition's state, :mod:`outboxkit.relay.outage`); the row
  is retried later with backoff and its attempt refunded, so an outage of any
  length fails no row;
* ``RETRIABLE``: a message timeout with no such evidence, anything librdkafka
  flags ``retriable()``; the row is retried later with backoff (attempt used);
* ``ROW_FAULT``: the row itself cannot be sent (too large, invalid record, a
  topic name Kafka never accepts, stored headers or an event id that cannot
  travel intact, anything ``produce`` raises for it); the row is failed;
* ``CONFIG_FAULT``: the relay's configuration is wrong, not the row
  (authentication, authorization, unknown topic with auto-create off); the
  topic is paused and no attempt is used;
* ``UNKNOWN``: anything else; retried with backoff, so ``max_attempts`` bounds it;
* ``NOT_SENT``: the row certainly never reached Kafka: it was never handed to
  the producer (its queue stayed full until the produce deadline, or the queue
  was purged while the batch was produced), or it was purged from the
  producer's queue before any send (``_PURGE_QUEUE``); the row is released,
  its attempt refunded.

**A full producer queue** (``queue.buffering.max.messages``/``kbytes``, large
rows, a slow or absent broker): :meth:`Publisher.publish` waits for room, serving
delivery reports, only until the batch's *produce deadline* (the batch deadline
less ``message.timeout.ms``, moved by a drain or a hurry like the batch
deadline): every message handed over by then has its report by the batch
deadline. The row that found no room and every later row of the batch are not
handed over at all (``NOT_SENT``), so what went out is a prefix of the batch in
id order. A row that does not fit into the *empty* queue never will: it fails as
the row's fault. When :meth:`Publisher.wait` gives up on a batch, the messages
still queued in the producer are purged before any row is released (a released
row is claimed and sent again: a stale queued copy of it would reach the
partition ahead of its key's earlier rows sent again). A purge takes every
queued message of the producer, also of the next batch being produced beside
it (``--pipeline``): that batch stops producing at once, so per partition the
purged messages are always the tail, and a later row of a key is never sent
when an earlier one was purged. Messages already in flight to a broker cannot
be taken back: their rows are released and, should Kafka acknowledge one later,
``acked-after-release`` is logged (the row is also sent again; see docs/relay.md).

**A missing topic** is found before its rows are produced: librdkafka reports an
unknown topic only after ``topic.metadata.propagation.max.ms``, and the batch,
whose other rows were acknowledged long before, would wait for it. So a topic
this producer has not yet seen in the broker's metadata is looked up first (one metadata
request, bounded by :data:`_TOPIC_CHECK_S`); a topic the broker says does not
exist gets config-fault reports for its rows at once, without a produce, and is
paused like any unknown topic. Topics known to exist are not looked up again;
one that is then reported unknown (deleted) is forgotten.

A **fatal** error (librdkafka gives up on the producer instance: an idempotent
producer refused ``InitProducerId`` for lack of ``IDEMPOTENT_WRITE``/``WRITE``,
a fenced producer, a broken sequence) is not any row's fault. The publisher
records it (:attr:`Publisher.fatal`), stops waiting for the batch, and turns the
batch's unsent rows into config-fault reports (authorization, authentication:
the topics are paused) or drops their reports (released, attempt refunded).
The relay then builds a new producer (:meth:`Publisher.rebuild`), a new
idempotent session, with backoff. confluent-kafka raises a fatal error from
``poll()`` instead of calling ``error_cb``; both paths are handled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from outboxkit.relay.delivery import (
    TOO_LARGE_FOR_QUEUE,
    ErrorKind,
    InFlight,
    Report,
    classify,
    config_fault_reason,
    delivery_callback,
    local_report,
    not_sent,
    row_fault,
)
from outboxkit.relay.outage import ClusterProbe, explain
from outboxkit.relay.rows import ClaimedRow
from outboxkit.relay.settings import RelaySettings
from outboxkit.runtime.errors import ConfigError, DependencyError
from outboxkit.runtime.kafkaclient import check_forced, client_config, log_kafka_error
from outboxkit.runtime.kafkaconf import RELAY_GUARDED
from outboxkit.runtime.logs import MAX_IDS_LOGGED, log_event, redact
from outboxkit.runtime.tracing import producer_tracing
from outboxkit.schema.codec import StoredRowError, kafka_headers, shown, topic_problem

__all__ = [
    "ErrorKind",
    "FatalProducerError",
    "InFlight",
    "ProducerFatal",
    "Publisher",
    "Report",
    "classify",
    "config_fault_reason",
    "producer_config",
]

log = logging.getLogger("outboxkit.relay.publish")


#: Seconds after a producer-level authentication error during which message
#: timeouts are blamed on it (the messages never had a chance).
_AUTH_BLAME_WINDOW = 120.0
#: After a fatal error, how long to keep serving reports of the batch (messages
#: acknowledged just before it still report success); the rest are unsent.
_FATAL_GRACE_S = 1.0
#: After building a new producer, how long to watch it for a fatal error
#: (InitProducerId is sent as soon as a broker connection is up).
_REBUILD_SETTLE_S = 1.0
#: Longest wait for the metadata of one topic not yet known to exist; past it
#: (a slow or absent broker) the batch's rows are produced without the check.
_TOPIC_CHECK_S = 1.0
#: Topics remembered as existing (a bound, not a tuning knob).
_MAX_KNOWN_TOPICS = 10_000
_UNKNOWN_TOPIC_CODES = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})
#: How long to wait for room in a full producer queue before trying again
#: (delivery reports are served meanwhile, which is what makes room).
_QUEUE_FULL_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class ProducerFatal:
    """A fatal error of the producer instance: it can send nothing any more."""

    code: int
    name: str
    error: str
    mono: float

    @property
    def config_fault(self) -> bool:
        """Authorization/authentication: the relay's configuration, so pause topics."""
        return classify(self.code) is ErrorKind.CONFIG_FAULT

    @property
    def reason(self) -> str:
        """``authorization``, ``authentication``... or ``fatal`` (metric label)."""
        return config_fault_reason(self.code, "fatal")

    def __str__(self) -> str:
        return f"fatal {self.name}: {self.error}"


class FatalProducerError(DependencyError):
    """A freshly built producer hit a fatal error too (or could not be built)."""

    def __init__(self, fatal: ProducerFatal | None, text: str | None = None) -> None:
        super().__init__(text or str(fatal))
        self.fatal = fatal


def producer_config(
    settings: RelaySettings, *, error_cb: Callable[[KafkaError], None]
) -> dict[str, Any]:
    """librdkafka configuration: safe defaults, then ``kafka_config``, then the
    two properties the delivery guarantees depend on, which cannot be overridden.
    """
    message_timeout = settings.message_timeout_ms()
    config: dict[str, Any] = {
        "client.id": settings.node_id,
        "compression.type": settings.compression,
        "message.timeout.ms": message_timeout,
        # A produce request to a hung leader is given up after this, not after
        # the whole message timeout, and sent again to the partition's new
        # leader: one stuck partition does not hold the batch (docs/relay.md).
        "socket.timeout.ms": settings.socket_timeout_ms(),
        # The broker's wait for the in-sync replicas' acks, answered before the
        # client's own wait above runs out.
        "request.timeout.ms": settings.request_timeout_ms(),
        # Unknown topics fail within the batch deadline instead of after 30 s.
        "topic.metadata.propagation.max.ms": min(30_000, max(1, message_timeout // 2)),
        # Same key -> same partition as Java producers (murmur2), keyless spread.
        "partitioner": "murmur2_random",
        # The loop produces a whole batch and then waits for it: lingering only
        # delays the first request (the rest queue up behind it anyway).
        "linger.ms": 1,
    }
    # The properties below are the relay's own: refused from --kafka-config by the
    # same check that validated the settings (settings built without load() too).
    check_forced(settings.kafka_config, RELAY_GUARDED)
    config.update(client_config(settings, logger=logging.getLogger("outboxkit.relay.kafka")))
    config.update({"enable.idempotence": True, "acks": "all", "error_cb": error_cb})
    return config


class Publisher:
    """The relay's producer: produce a batch in id order, wait for its reports, close."""

    def __init__(self, settings: RelaySettings) -> None:
        self._auth_error: tuple[float, int, str] | None = None
        #: When the producer last reported every broker down (monotonic).
        self._all_down_mono = -float("inf")
        self._last_error_logged: tuple[int, float] | None = None
        self._settings = settings
        #: Set when librdkafka reports a fatal error; cleared by :meth:`rebuild`.
        self.fatal: ProducerFatal | None = None
        #: Producers built so far (1 + rebuilds).
        self.sessions = 0
        #: Purges of the producer's queue so far: a batch being produced stops
        #: when it changes (see :meth:`publish`). Read and changed under the lock,
        #: which also covers every ``produce`` call.
        self._purges = 0
        self._produce_lock = threading.Lock()
        #: Topics the broker's metadata said exist (see :meth:`_missing_topics`).
        self._known_topics: set[str] = set()
        #: What the cluster says of a topic's partitions (relay/outage.py).
        self._cluster = ClusterProbe(settings, lambda: self.producer)
        # Decided once: None (no OpenTelemetry or no tracer provider) costs one
        # attribute test per row.
        self._tracing = producer_tracing(client_id=settings.node_id)
        self.producer = self._build()

    def _build(self) -> Producer:
        try:
            producer = Producer(producer_config(self._settings, error_cb=self._on_error))
        except KafkaException as exc:
            raise ConfigError(
                f"invalid --kafka-config / OUTBOXKIT_KAFKA_CONFIG: {redact(str(exc))}"
            ) from None
        self.sessions += 1
        return producer

    def rebuild(self, timeout: float) -> None:
        """Drop the producer (fatal: it can send nothing) and build a new one, a new
        idempotent session. Raises :class:`FatalProducerError` if the new one is not
        reachable within ``timeout`` s or hits a fatal error while it settles.

        Only call it with no batch in flight: the old producer's queue is purged.
        """
        old = self.producer
        try:
            old.purge(in_queue=True, in_flight=True, blocking=False)
            old.flush(0)
        except KafkaException:
            pass  # a fatal producer may raise its error once more; it is gone anyway
        self.fatal = None
        self.producer = self._build()
        try:
            self.producer.list_topics(timeout=timeout)
        except KafkaException as exc:
            if not self._record_fatal(exc):
                raise FatalProducerError(None, f"Kafka unreachable: {redact(str(exc))}") from None
        settle_until = time.monotonic() + _REBUILD_SETTLE_S
        while self.fatal is None and time.monotonic() < settle_until:
            self._poll(0.05)
        if self.fatal is not None:
            raise FatalProducerError(self.fatal)

    def _poll(self, timeout: float) -> None:
        """``producer.poll`` that records a fatal error instead of raising it."""
        try:
            self.producer.poll(timeout)
        except KafkaException as exc:
            if not self._record_fatal(exc):
                raise

    def _record_fatal(self, exc: KafkaException) -> bool:
        err = exc.args[0] if exc.args else None
        if not isinstance(err, KafkaError) or not err.fatal():
            return False
        self._set_fatal(err)
        return True

    def _set_fatal(self, err: KafkaError) -> None:
        now = time.monotonic()
        fatal = ProducerFatal(err.code(), err.name(), redact(err.str()), now)
        if fatal.config_fault:
            self._auth_error = (now, fatal.code, f"{fatal.name}: {fatal.error}")
        if self.fatal is None:
            self.fatal = fatal

    def check_reachable(self, timeout: float) -> None:
        """Raise DependencyError unless a broker answers within ``timeout`` s."""
        try:
            self.producer.list_topics(timeout=timeout)
        except KafkaException as exc:
            raise DependencyError(f"Kafka unreachable: {redact(str(exc))}") from None

    def publish(self, rows: Iterable[ClaimedRow], until: Callable[[], float]) -> InFlight:
        """Produce ``rows`` in the given (id) order; reports land in the returned InFlight.

        ``until()`` (monotonic, re-read on every turn: a drain or a hurry moves it
        closer) is the produce deadline: a row that finds the producer's queue full
        waits for room only until then. That row and every later row of the batch
        are then not handed over (``NOT_SENT``: released, the attempt refunded), nor
        are they once the queue was purged for an older batch (see the module).
        """
        rows = list(rows)
        inflight = InFlight(rows)
        missing = self._missing_topics(rows)
        with self._produce_lock:
            generation = self._purges
        stopped: str | None = None
        for row in rows:
            if row.topic in missing:
                inflight.add(
                    local_report(row.id, KafkaError.UNKNOWN_TOPIC_OR_PART, missing[row.topic])
                )
                continue
            if stopped is None:
                try:
                    stopped = self._produce(row, inflight, until, generation)
                except BaseException as exc:  # not a row fault (an interrupt): name the row
                    exc.add_note(f"while producing outbox row id={row.id}")
                    raise
            if stopped is not None:
                inflight.add(not_sent(row.id, stopped))
        if stopped is not None:
            log_event(
                log,
                "batch-produce-stopped",
                level=logging.WARNING,
                rows=len(rows),
                unsent=sum(1 for r in inflight.snapshot().values() if r.kind is ErrorKind.NOT_SENT),
                reason=stopped,
                effect="the unsent rows are released (attempt refunded) and claimed again",
            )
        self._poll(0)
        return inflight

    def _missing_topics(self, rows: list[ClaimedRow]) -> dict[str, str]:
        """The batch's topics that the broker says do not exist, with its error text.

        Only topics not yet known to exist are looked up, one metadata request
        each, bounded by :data:`_TOPIC_CHECK_S`; after one that does not answer in
        time the rest are produced unchecked (librdkafka's own wait applies).
        With auto-create on, the lookup creates the topic, as a produce would.
        """
        unseen = {r.topic for r in rows} - self._known_topics
        missing: dict[str, str] = {}
        for topic in sorted(unseen):
            if topic_problem(topic):
                continue  # never a valid name: the row check fails the row
            try:
                metadata = self.producer.list_topics(topic=topic, timeout=_TOPIC_CHECK_S)
            except KafkaException as exc:  # no answer in time: produce as usual
                self._record_fatal(exc)
                break
            except Exception:  # noqa: S112 (a name librdkafka refuses: the produce decides)
                continue
            found = metadata.topics.get(topic)
            if found is None:
                continue
            if found.error is None:
                if found.partitions:
                    self._remember_topic(topic)
            elif found.error.code() in _UNKNOWN_TOPIC_CODES:
                missing[topic] = found.error.str()
        return missing

    def _remember_topic(self, topic: str) -> None:
        if len(self._known_topics) >= _MAX_KNOWN_TOPICS:
            self._known_topics.clear()
        self._known_topics.add(topic)

    def _produce(
        self, row: ClaimedRow, inflight: InFlight, until: Callable[[], float], generation: int
    ) -> str | None:
        """Produce one row; whatever about this row cannot be sent fails this row only.

        Returns None when the row is done with (handed to the producer, or given
        its report), else why the batch stops producing here (this row included).

        The row's columns are checked first (a foreign writer may have stored
        anything): librdkafka takes the topic and header names as C strings, so a
        NUL, a lone surrogate or an illegal name must never reach it.
        """
        try:
            problem = row.unsendable or topic_problem(row.topic)
            if problem:
                raise StoredRowError(problem)
            headers: list[tuple[str, str | bytes | None]] = list(
                kafka_headers(row.headers, row.event_id)
            )
        except StoredRowError as exc:
            inflight.add(row_fault(row.id, f"invalid row: {exc}"))
            return None
        except Exception as exc:  # a decoder bug must not take the batch down
            self._log_row_error(row, exc)
            inflight.add(row_fault(row.id, f"invalid row: {type(exc).__name__}: {exc}"))
            return None
        callback = delivery_callback(inflight, row.id)
        if self._tracing is not None:
            headers, callback = self._tracing.send(
                row.topic, row.event_id, headers, callback, inflight.spans, row.id
            )
        while True:
            try:
                with self._produce_lock:
                    if self._purges != generation:
                        return "the producer's queue was purged for an older batch"
                    self.producer.produce(
                        row.topic,
                        value=row.payload,
                        key=row.key,
                        headers=headers,
                        on_delivery=callback,
                    )
                return None
            except BufferError:  # local queue full: serve reports, then retry
                if len(self.producer) == 0:  # nothing to wait for: it never fits
                    inflight.add(row_fault(row.id, TOO_LARGE_FOR_QUEUE))
                    return None
                left = until() - time.monotonic()
                if left <= 0:
                    return "the producer's queue stayed full until the produce deadline"
                self._poll(min(_QUEUE_FULL_POLL_S, left))
                if self.fatal is not None:  # nothing more can be sent with it
                    inflight.add(local_report(row.id, KafkaError._FATAL, "producer fatal"))
                    return None
            except KafkaException as exc:
                err = exc.args[0]
                inflight.add(local_report(row.id, err.code(), err.str()))
                return None
            except Exception as exc:  # TypeError, ValueError...: this row's input
                self._log_row_error(row, exc)
                inflight.add(row_fault(row.id, f"produce raised {type(exc).__name__}: {exc}"))
                return None

    def _log_row_error(self, row: ClaimedRow, exc: Exception) -> None:
        log_event(
            log,
            "row-produce-error",
            level=logging.ERROR,
            row_id=row.id,
            event_id=shown(row.event_id),
            topic=row.topic,
            error=f"{type(exc).__name__}: {exc}",
            action="the row is failed; fix or requeue it by hand",
            exc_info=exc,
        )

    def wait(self, inflight: InFlight, deadline: Callable[[], float]) -> None:
        """Serve delivery reports until all arrived or ``deadline()`` (monotonic) passed.

        ``deadline`` is re-read on every turn: a drain or a hurry moves it closer.
        After a fatal error only a short grace is left (nothing more will be sent).

        Giving up with reports missing, it first purges what is still queued in
        the producer (their reports say ``_PURGE_QUEUE``: never sent): a row must
        not be released while a copy of it can still leave this producer. What is
        then still missing was in flight to a broker.
        """
        while not inflight.done():
            limit = deadline()
            fatal = self.fatal
            if fatal is not None:
                limit = min(limit, fatal.mono + _FATAL_GRACE_S)
            left = limit - time.monotonic()
            if left <= 0:
                break
            self._poll(min(0.05, left))
        if not inflight.done() and self.fatal is None:
            self._purge_queued(inflight)

    def _purge_queued(self, inflight: InFlight) -> None:
        """Take back every message not yet sent, and serve the reports that say so."""
        with self._produce_lock:
            self._purges += 1
            try:
                self.producer.purge(in_queue=True, in_flight=False, blocking=True)
            except KafkaException as exc:
                if not self._record_fatal(exc):
                    raise
        # The purge's reports are queued for the next poll (another thread polling
        # beside this one may serve some of them: they land in their batches).
        for _ in range(10):
            before = inflight.missing()
            self._poll(0.01)
            if inflight.done() or inflight.missing() == before:
                break
        missing = inflight.missing_ids()
        if missing:
            log_event(
                log,
                "released-in-flight",
                level=logging.WARNING,
                rows=len(missing),
                row_ids=missing[:MAX_IDS_LOGGED],
                effect="no delivery report by the batch deadline while in flight to a broker: "
                "released and sent again; a copy may still be written (acked-after-release)",
            )

    def settle_reports(self, inflight: InFlight) -> dict[int, Report]:
        """The batch's reports as the finalize step should see them.

        Timeouts after an authentication failure are blamed on it (:meth:`blame`).
        After a fatal error, rows that were not acknowledged were not sent by any
        fault of theirs: with an authorization/authentication cause they get a
        config-fault report (the topic is paused, the attempt refunded), otherwise
        no report (released, the attempt refunded).
        """
        if self._tracing is not None:
            self._tracing.abandon(inflight.spans)
        inflight.settle()
        reports = {i: self.blame(r) for i, r in inflight.snapshot().items()}
        if any(r.code in _UNKNOWN_TOPIC_CODES for r in reports.values()):
            # Deleted since it was known to exist: look it up again next time.
            topics = {r.id: r.topic for r in inflight.rows}
            for row_id, gone in reports.items():
                if gone.code in _UNKNOWN_TOPIC_CODES:
                    self._known_topics.discard(topics[row_id])
        fatal = self.fatal
        if fatal is None:
            # Timeouts the cluster caused cost no attempt, and are named by it.
            window = self._settings.effective_batch_deadline()
            all_down = time.monotonic() - self._all_down_mono < window
            return explain(
                reports,
                inflight.rows,
                self._cluster.partitions,
                min_isr=self._cluster.min_insync_replicas,
                all_brokers_down=all_down,
            )
        out: dict[int, Report] = {}
        for row_id in inflight.expected:
            report = reports.get(row_id)
            if report is not None and (report.ok or report.code != KafkaError._FATAL):
                out[row_id] = report
            elif fatal.config_fault:
                error = f"{report.error} after {fatal}" if report is not None else str(fatal)
                out[row_id] = Report(
                    row_id, fatal.code, error, ErrorKind.CONFIG_FAULT, None, None, fatal.mono
                )
        return out

    def blame(self, report: Report) -> Report:
        """A timeout shortly after an authentication failure is the relay's config."""
        auth = self._auth_error
        if (
            report.kind in (ErrorKind.RETRIABLE, ErrorKind.CLUSTER, ErrorKind.UNKNOWN)
            and auth is not None
            and report.mono - auth[0] < _AUTH_BLAME_WINDOW
        ):
            return Report(
                row_id=report.row_id,
                code=auth[1],
                error=f"{report.error} after {auth[2]}",
                kind=ErrorKind.CONFIG_FAULT,
                partition=None,
                offset=None,
                mono=report.mono,
            )
        return report

    def queued(self) -> int:
        return len(self.producer)

    def close(self, timeout: float) -> int:
        """Drop messages whose rows were already released, flush the rest within
        ``timeout`` s; returns the messages still unsent (0 after a clean drain).
        """
        if self.fatal is not None:  # nothing can be sent any more
            self.producer.purge(in_queue=True, in_flight=True, blocking=False)
            return len(self.producer)
        self.producer.purge(in_queue=True, in_flight=False, blocking=False)
        try:
            return int(self.producer.flush(max(0.0, timeout)))
        except KafkaException as exc:
            if not self._record_fatal(exc):
                raise
            return len(self.producer)

    def _on_error(self, err: KafkaError) -> None:
        code = err.code()
        now = time.monotonic()
        if err.fatal():  # today confluent-kafka raises these from poll() instead
            self._set_fatal(err)
        if classify(code) is ErrorKind.CONFIG_FAULT:
            self._auth_error = (now, code, f"{err.name()}: {err.str()}")
        if code == KafkaError._ALL_BROKERS_DOWN:
            self._all_down_mono = now
        last = self._last_error_logged
        if last is not None and last[0] == code and now - last[1] < 30:
            return  # librdkafka repeats broker-down errors; one line per code per 30 s
        self._last_error_logged = (code, now)
        log_kafka_error(log, err)
