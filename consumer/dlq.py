"""The dead-letter topic: where a message goes when its handler gives up.

:meth:`DeadLetters.send` returns only once Kafka acknowledged the write
(``acks=all``, idempotent producer); only then may the source offset be stored.
When the write fails or is not acknowledged in time it raises
:class:`DeadLetterUnavailable`: the caller keeps the message, pauses its
partition and tries again later. Nothing is skipped.

A **fatal** producer error (the idempotent producer was refused
``InitProducerId``, e.g. the principal lacks ``WRITE``/``IDEMPOTENT_WRITE``)
makes that producer useless for good: the send that meets it raises
:class:`DeadLetterUnavailable`, a ``dlq-producer-fatal`` line is logged, and the
next send builds a new producer (a new idempotent session). The caller's
backoff spaces the rebuilds; once the operator fixes the ACL, the partition
resumes on its own.

The dead-lettered record keeps the original key, value and headers and adds:

=======================  =====================================================
``dlq.original.topic``   topic of the failed message
``dlq.original.partition`` its partition (decimal)
``dlq.original.offset``  its offset (decimal)
``dlq.group_id``         the consumer group that gave up
``dlq.error.class``      ``module.QualName`` of the exception
``dlq.error.message``    the exception text, redacted, at most 1000 characters
``dlq.attempts``         handler attempts made (decimal)
``dlq.failed_at``        UTC time of the give-up, ISO 8601
``event_id``             the original ``event_id`` (kept from the original headers)
=======================  =====================================================
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from outboxkit.consumer.message import Message
from outboxkit.errors import TransientError
from outboxkit.runtime.logs import log_event, redact

__all__ = ["DeadLetterUnavailable", "DeadLetters", "Failure"]

MAX_ERROR_MESSAGE = 1000

_log = logging.getLogger("outboxkit.consumer.dlq")


class DeadLetterUnavailable(TransientError):
    """The dead-letter write was refused or not acknowledged in time."""


@dataclass(frozen=True)
class Failure:
    """Why a handler gave up on a message."""

    error_class: str
    error_message: str
    attempts: int
    permanent: bool
    failed_at: str

    @classmethod
    def of(cls, exc: BaseException, *, attempts: int, permanent: bool) -> Failure:
        kind = type(exc)
        text = redact(str(exc))
        if len(text) > MAX_ERROR_MESSAGE:
            text = text[: MAX_ERROR_MESSAGE - 3] + "..."
        return cls(
            error_class=f"{kind.__module__}.{kind.__qualname__}",
            error_message=text,
            attempts=attempts,
            permanent=permanent,
            failed_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        )


class DeadLetters:
    """A small idempotent producer for dead-letter writes, shared by the workers."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        group_id: str,
        timeout: float,
        topic_override: str | None,
        suffix: str,
    ) -> None:
        self.group_id = group_id
        self.timeout = timeout
        self.topic_override = topic_override
        self.suffix = suffix
        self._config: dict[str, Any] = {
            **config,
            "enable.idempotence": True,
            "acks": "all",
            "message.timeout.ms": max(1, int(timeout * 1000)),
        }
        self._lock = threading.Lock()
        self._producer = Producer(self._config)
        #: The producer that hit a fatal error (replaced at the next send).
        self._fatal: Producer | None = None
        #: Producers built to replace one that hit a fatal error.
        self.rebuilds = 0

    def _current(self) -> Producer:
        """The producer to send with; builds a new one if the current one is fatal."""
        with self._lock:
            if self._fatal is not None and self._fatal is self._producer:
                old = self._producer
                self._producer = Producer(self._config)
                self._fatal = None
                self.rebuilds += 1
                try:
                    old.purge(in_queue=True, in_flight=True, blocking=False)
                    old.flush(0)
                except KafkaException:
                    pass  # it may raise its fatal error once more; it is dropped anyway
                log_event(_log, "dlq-producer-rebuilt", rebuilds=self.rebuilds)
            return self._producer

    def _mark_fatal(self, producer: Producer, err: KafkaError | None) -> None:
        with self._lock:
            if self._fatal is producer or producer is not self._producer:
                return
            self._fatal = producer
        log_event(
            _log,
            "dlq-producer-fatal",
            level=logging.ERROR,
            code=err.name() if err is not None else "_FATAL",
            error=redact(err.str()) if err is not None else "fatal error",
            action="the next dead-letter write builds a new producer; if this is an "
            "authorization error, grant the consumer's principal WRITE on the dead-letter topic",
        )

    def _poll(self, producer: Producer, timeout: float) -> None:
        try:
            producer.poll(timeout)
        except KafkaException as exc:  # confluent-kafka raises fatal errors from poll()
            err = exc.args[0] if exc.args else None
            if not isinstance(err, KafkaError) or not err.fatal():
                raise
            self._mark_fatal(producer, err)

    def topic_for(self, source_topic: str) -> str:
        return self.topic_override or f"{source_topic}{self.suffix}"

    def send(self, message: Message, failure: Failure) -> str:
        """Write ``message`` to its dead-letter topic and wait for the ack; the topic."""
        topic = self.topic_for(message.topic)
        headers: list[tuple[str, str | bytes | None]] = [
            *message.headers,
            ("dlq.original.topic", message.topic.encode()),
            ("dlq.original.partition", str(message.partition).encode()),
            ("dlq.original.offset", str(message.offset).encode()),
            ("dlq.group_id", self.group_id.encode()),
            ("dlq.error.class", failure.error_class.encode()),
            ("dlq.error.message", failure.error_message.encode()),
            ("dlq.attempts", str(failure.attempts).encode()),
            ("dlq.failed_at", failure.failed_at.encode()),
        ]
        done = threading.Event()
        outcome: list[object] = []

        def on_delivery(err: Any, _msg: Any) -> None:
            outcome.append(err)
            done.set()

        producer = self._current()
        try:
            producer.produce(
                topic,
                key=message.key,
                value=message.value,
                headers=headers,
                on_delivery=on_delivery,
            )
        except (BufferError, KafkaException) as exc:
            err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
            if isinstance(err, KafkaError) and (err.fatal() or err.code() == KafkaError._FATAL):
                self._mark_fatal(producer, err)
            raise DeadLetterUnavailable(f"dead-letter write to {topic} refused: {exc}") from None
        # Every worker polls: whichever serves the callback, each waits for its own.
        deadline = time.monotonic() + self.timeout + 1.0
        while not done.is_set() and time.monotonic() < deadline:
            self._poll(producer, 0.05)
            if self._fatal is producer:
                raise DeadLetterUnavailable(
                    f"dead-letter write to {topic} failed: the producer hit a fatal error"
                )
        if not done.is_set():
            raise DeadLetterUnavailable(
                f"no acknowledgement from {topic} within {self.timeout:g} s"
            )
        error = outcome[0]
        if error is not None:
            if isinstance(error, KafkaError) and error.code() == KafkaError._FATAL:
                self._mark_fatal(producer, None)
            raise DeadLetterUnavailable(f"dead-letter write to {topic} failed: {error}")
        return topic

    def close(self, timeout: float) -> int:
        """Flush (nothing should be pending: every send waits); messages left unsent."""
        producer = self._producer
        if self._fatal is producer:
            return 0
        try:
            return int(producer.flush(timeout))
        except KafkaException:
            return len(producer)
