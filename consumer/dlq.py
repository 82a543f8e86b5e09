"""The dead-letter topic: where a message goes when its handler gives up.

:meth:`DeadLetters.send` returns only once Kafka acknowledged the write
(``acks=all``, idempotent producer); only then may the source offset be stored.
When the write fails or is not acknowledged in time it raises
:class:`DeadLetterUnavailable`: the caller keeps the message, pauses its
partition and tries again later. Nothing is skipped.

The dead-lettered record keeps the original key, value and headers and adds:

=======================  =====================================================
``dlq.original.topic``   topic of the failed message
``dlq.original.partition`` its partition (decimal)
``dlq.original.offset``  its offset (decimal)
``dlq.group_id``         the consumer group that gave up
``dlq.error.class``      ``module.QualName`` of the exception
``dlq.error.message``    the exception text, redacted, at most 1000 characters
                         (control, line-separator and bidirectional characters
                         and lone surrogates written as ``\\uXXXX``)
``dlq.attempts``         handler attempts made (decimal)
``dlq.failed_at``        UTC time of the give-up, ISO 8601
``event_id``             the original ``event_id`` (kept from the original headers)
``dlq.headers.dropped``  only when the original headers are missing: why (a
                         header name that is not UTF-8, or too large to copy)
``dlq.value.truncated``  only when the copy's value is cut: the original value's
                         length in bytes (decimal); the copy holds a prefix
``dlq.key.dropped``      only when the key did not fit: its length (decimal)
=======================  =====================================================

confluent-kafka cannot hand out header names that are not UTF-8, so such a
record's copy carries its key and value byte for byte but not its headers.

**Size.** The copy is the original plus these headers, so a message near the
size limit cannot be copied whole. It is made to fit instead of blocking its
partition: with the producer's ``message.max.bytes`` as the budget (less
framing), the value is cut to a prefix, and if that is not enough the original
headers (all but a short ``event_id``) and then the key are dropped, each with
its marker header. If the broker refuses the copy as too large anyway (the
dead-letter topic's ``max.message.bytes`` is lower), it is sent once more as a
*reference*: no value, no original headers, the key only up to 1 KiB. The
original stays findable at ``dlq.original.topic/partition/offset`` as long as
the source topic's retention keeps it. Only a reference the broker still
refuses (a dead-letter topic limit below a few KiB: a configuration fault)
leaves the partition paused, loudly (``dead-letter-rejected``).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from outboxkit.consumer.message import EVENT_ID_HEADER, Message
from outboxkit.errors import TransientError
from outboxkit.runtime.logs import exception_text, log_event, redact, safe_text

__all__ = ["DeadLetterUnavailable", "DeadLetters", "Failure", "producer_config"]

MAX_ERROR_MESSAGE = 1000
_UNDECODABLE = b"the original headers could not be decoded (a header name is not UTF-8)"
_log = logging.getLogger("outboxkit.consumer")
# What librdkafka's size check and the record batch add besides the key, value and
# header bytes (about 90 bytes), with room to spare; and per header (length varints).
_FRAMING = 512
_PER_HEADER = 10
_DEFAULT_MAX_BYTES = 1_000_000  # librdkafka's message.max.bytes default
_REFERENCE_KEY_MAX = 1024
_EVENT_ID_MAX = 255

Headers = list[tuple[str, str | bytes | None]]


# Consumer properties a user may pass in kafka_config; the dead-letter producer
# shares the rest (bootstrap, security) and would warn about these.
_CONSUMER_ONLY_PREFIXES = (
    "group.",
    "auto.",
    "enable.auto.",
    "fetch.",
    "session.",
    "heartbeat.",
    "max.poll.",
    "partition.assignment.",
    "queued.",
    "isolation.",
    "check.crcs",
    "enable.partition.eof",
    "coordinator.",
    "consume.",
)


def _consumer_only(key: str) -> bool:
    return key.startswith(_CONSUMER_ONLY_PREFIXES)


def producer_config(consumer_config: dict[str, Any]) -> dict[str, Any]:
    """The dead-letter producer's share of the consumer's Kafka config: bootstrap,
    security and the like, without the consumer-only properties."""
    return {k: v for k, v in consumer_config.items() if not _consumer_only(k)}


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
        # A handler's text is the record's text ("unknown order type \ud800"): made
        # safe before it is cut, so the header is valid UTF-8 on one line.
        text = safe_text(redact(exception_text(exc)))
        if len(text) > MAX_ERROR_MESSAGE:
            text = text[: MAX_ERROR_MESSAGE - 3] + "..."
        return cls(
            error_class=safe_text(f"{kind.__module__}.{kind.__qualname__}"),
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
        self.budget = int(config.get("message.max.bytes", _DEFAULT_MAX_BYTES)) - _FRAMING
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
        """Write ``message`` to its dead-letter topic and wait for the ack; the topic.

        A copy too large for Kafka is cut to fit (see the module docstring);
        anything else that fails raises :class:`DeadLetterUnavailable`.
        """
        topic = self.topic_for(message.topic)
        added: Headers = [
            ("dlq.original.topic", message.topic.encode()),
            ("dlq.original.partition", str(message.partition).encode()),
            ("dlq.original.offset", str(message.offset).encode()),
            ("dlq.group_id", self.group_id.encode()),
            ("dlq.error.class", failure.error_class.encode()),
            ("dlq.error.message", failure.error_message.encode()),
            ("dlq.attempts", str(failure.attempts).encode()),
            ("dlq.failed_at", failure.failed_at.encode()),
        ]
        copy = fit_copy(message, added, budget=self.budget, reference=False)
        error = self._write(topic, copy)
        if _too_large(error):
            # The topic's own max.message.bytes is lower than our budget: a reference.
            copy = fit_copy(message, added, budget=self.budget, reference=True)
            error = self._write(topic, copy)
            if _too_large(error):
                log_event(
                    _log,
                    "dead-letter-rejected",
                    level=logging.ERROR,
                    **_copy_of(message, topic),
                    error=str(error),
                    action=f"raise max.message.bytes of {topic}: it refuses even a "
                    "reference copy without value; the partition stays paused until then",
                )
        if error is not None:
            missing = self._topic_missing(topic, error)
            if missing is not None:
                raise DeadLetterUnavailable(missing)
            raise DeadLetterUnavailable(f"dead-letter write to {topic} failed: {error}")
        if copy.trimmed:
            log_event(
                _log,
                "dead-letter-trimmed",
                level=logging.WARNING,
                **_copy_of(message, topic),
                value_bytes=len(message.value or b""),
                kept_value_bytes=len(copy.value or b""),
                trimmed=copy.trimmed,
            )
        return topic

    def _topic_missing(self, topic: str, error: object) -> str | None:
        """Why the write failed when the cause is a missing topic, else None.

        With the topic missing (and auto-creation off), librdkafka waits for it
        until ``message.timeout.ms`` and reports ``_MSG_TIMED_OUT``, which reads
        like a slow cluster; so after such an error the topic's metadata is
        asked for (bounded by ``dlq_timeout``), and a topic the broker does not
        know is named, with the fix.
        """
        suspicious = (
            KafkaError._MSG_TIMED_OUT,
            KafkaError._UNKNOWN_TOPIC,
            KafkaError.UNKNOWN_TOPIC_OR_PART,
        )
        if not isinstance(error, KafkaError) or error.code() not in suspicious:
            return None
        try:
            metadata = self._current().list_topics(topic, timeout=self.timeout)
        except KafkaException:
            return None  # the cluster does not answer: the write's own error stands
        found = metadata.topics.get(topic)
        code = found.error.code() if found is not None and found.error is not None else None
        if found is not None and code != KafkaError.UNKNOWN_TOPIC_OR_PART:
            return None
        return (
            f"dead-letter topic {topic} does not exist (UNKNOWN_TOPIC_OR_PART in its "
            f"metadata; the write ended in {error.name()}): create {topic}, or point "
            "--dlq-topic / OUTBOXKIT_DLQ_TOPIC at an existing topic; the partition "
            "stays paused until a write succeeds"
        )

    def _write(self, topic: str, copy: _Copy) -> object | None:
        """Produce ``copy`` and wait for its report: None once acknowledged, else the error."""
        done = threading.Event()
        outcome: list[object] = []

        def on_delivery(err: Any, _msg: Any) -> None:
            outcome.append(err)
            done.set()

        producer = self._current()
        try:
            producer.produce(
                topic,
                key=copy.key,
                value=copy.value,
                headers=copy.headers,
                on_delivery=on_delivery,
            )
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and (err.fatal() or err.code() == KafkaError._FATAL):
                self._mark_fatal(producer, err)
                raise DeadLetterUnavailable(
                    f"dead-letter write to {topic} refused: {err}"
                ) from None
            return err if err is not None else exc
        except BufferError as exc:
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
        if isinstance(error, KafkaError) and error.code() == KafkaError._FATAL:
            self._mark_fatal(producer, None)
        return error

    def close(self, timeout: float) -> int:
        """Flush (nothing should be pending: every send waits); messages left unsent."""
        producer = self._producer
        if self._fatal is producer:
            return 0
        try:
            return int(producer.flush(timeout))
        except KafkaException:
            return len(producer)


@dataclass(frozen=True)
class _Copy:
    key: bytes | None
    value: bytes | None
    headers: Headers
    trimmed: tuple[str, ...] = ()  # what was cut: "value", "headers", "key"


def _size(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    """Bytes librdkafka counts against message.max.bytes, less the fixed framing."""
    return (
        len(key or b"")
        + len(value or b"")
        + sum(len(n.encode()) + len(v or b"") + _PER_HEADER for n, v in headers)
    )


def fit_copy(message: Message, added: Headers, *, budget: int, reference: bool) -> _Copy:
    """The dead-letter copy of ``message`` with the ``added`` headers, within ``budget`` bytes.

    Whole if it fits (and not ``reference``); else, in this order until it fits:
    the value cut to a prefix, the original headers dropped (a short ``event_id``
    kept), the key dropped. ``reference``: no value, no original headers, the key
    only up to 1 KiB.
    """
    key, value = message.key, message.value
    readable = message._readable_headers()
    headers: Headers = list(readable) if readable is not None else []
    markers: Headers = [] if readable is not None else [("dlq.headers.dropped", _UNDECODABLE)]
    if not reference and _size(key, value, [*headers, *markers, *added]) <= budget:
        return _Copy(key, value, [*headers, *markers, *added])
    length = len(value or b"")
    cut: Headers = [("dlq.value.truncated", str(length).encode())]
    trimmed: list[str] = []

    def room() -> int:
        return budget - _size(key, None, [*headers, *markers, *added, *cut])

    def copy() -> _Copy:
        if value is None:
            return _Copy(key, None, [*headers, *markers, *added], tuple(trimmed))
        kept = b"" if reference else value[: max(0, room())]
        if len(kept) == length:
            return _Copy(key, kept, [*headers, *markers, *added], tuple(trimmed))
        return _Copy(key, kept, [*headers, *markers, *added, *cut], ("value", *trimmed))

    if not reference and room() >= 0:
        return copy()
    if headers:
        size = sum(len(n.encode()) + len(v or b"") for n, v in headers)
        headers = [
            (n, v) for n, v in headers if n == EVENT_ID_HEADER and len(v or b"") <= _EVENT_ID_MAX
        ][-1:]
        markers = [("dlq.headers.dropped", f"too large to copy ({size} bytes)".encode())]
        trimmed.append("headers")
    if key is not None and (room() < 0 or (reference and len(key) > _REFERENCE_KEY_MAX)):
        markers = [*markers, ("dlq.key.dropped", str(len(key)).encode())]
        key = None
        trimmed.append("key")
    if room() < 0:
        headers = []  # even the event_id does not fit
    return copy()


def _copy_of(message: Message, dlq_topic: str) -> dict[str, object]:
    """The log fields naming a message and the dead-letter topic of its copy."""
    return {
        "topic": message.topic,
        "partition": message.partition,
        "offset": message.offset,
        "dlq_topic": dlq_topic,
    }


def _too_large(error: object | None) -> bool:
    return isinstance(error, KafkaError) and error.code() in (
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.RECORD_LIST_TOO_LARGE,
    )
