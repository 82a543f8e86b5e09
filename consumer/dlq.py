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
``dlq.attempts``         handler attempts made (decimal)
``dlq.failed_at``        UTC time of the give-up, ISO 8601
``event_id``             the original ``event_id`` (kept from the original headers)
``dlq.headers.dropped``  only when the original headers could not be decoded (a
                         header name that is not UTF-8): why they are missing
=======================  =====================================================

confluent-kafka cannot hand out header names that are not UTF-8, so such a
record's copy carries its key and value byte for byte but not its headers.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException, Producer

from outboxkit.consumer.message import Message
from outboxkit.errors import TransientError
from outboxkit.runtime.logs import redact

__all__ = ["DeadLetterUnavailable", "DeadLetters", "Failure"]

MAX_ERROR_MESSAGE = 1000
_UNDECODABLE = b"the original headers could not be decoded (a header name is not UTF-8)"


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
        self._producer = Producer(
            {
                **config,
                "enable.idempotence": True,
                "acks": "all",
                "message.timeout.ms": max(1, int(timeout * 1000)),
            }
        )

    def topic_for(self, source_topic: str) -> str:
        return self.topic_override or f"{source_topic}{self.suffix}"

    def send(self, message: Message, failure: Failure) -> str:
        """Write ``message`` to its dead-letter topic and wait for the ack; the topic."""
        topic = self.topic_for(message.topic)
        original = message._readable_headers()
        headers: list[tuple[str, str | bytes | None]] = [
            *(original if original is not None else [("dlq.headers.dropped", _UNDECODABLE)]),
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

        try:
            self._producer.produce(
                topic,
                key=message.key,
                value=message.value,
                headers=headers,
                on_delivery=on_delivery,
            )
        except (BufferError, KafkaException) as exc:
            raise DeadLetterUnavailable(f"dead-letter write to {topic} refused: {exc}") from None
        # Every worker polls: whichever serves the callback, each waits for its own.
        deadline = time.monotonic() + self.timeout + 1.0
        while not done.is_set() and time.monotonic() < deadline:
            self._producer.poll(0.05)
        if not done.is_set():
            raise DeadLetterUnavailable(
                f"no acknowledgement from {topic} within {self.timeout:g} s"
            )
        if outcome[0] is not None:
            raise DeadLetterUnavailable(f"dead-letter write to {topic} failed: {outcome[0]}")
        return topic

    def close(self, timeout: float) -> int:
        """Flush (nothing should be pending: every send waits); messages left unsent."""
        return int(self._producer.flush(timeout))
