"""The message a handler receives."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection

from outboxkit.consumer.errors import InvalidMessageError

__all__ = ["EVENT_ID_HEADER", "Message"]

#: The header the outbox relay puts on every event.
EVENT_ID_HEADER = "event_id"


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One Kafka record, read-only.

    ``headers`` keeps every header in order (Kafka allows repeats);
    :meth:`header` returns the last value of a name. ``event_id`` is the
    ``event_id`` header decoded as UTF-8, or None when the producer sent none.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int | None = None
    _tx: Connection | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_kafka(cls, record: Any) -> Message:
        raw: Sequence[tuple[str, bytes | None]] = record.headers() or ()
        ts_type, ts = record.timestamp()
        return cls(
            topic=record.topic(),
            partition=record.partition(),
            offset=record.offset(),
            key=record.key(),
            value=record.value(),
            headers=tuple([(name, value or b"") for name, value in raw]) if raw else (),
            timestamp_ms=ts if ts_type else None,
        )

    def header(self, name: str) -> bytes | None:
        """The last value of header ``name``, or None."""
        found: bytes | None = None
        for key, value in self.headers:
            if key == name:
                found = value
        return found

    @property
    def event_id(self) -> str | None:
        raw = self.header(EVENT_ID_HEADER)
        if not raw:
            return None
        return raw.decode("utf-8", errors="replace")

    @property
    def identity(self) -> str:
        """What the inbox deduplicates on: ``event_id``, else ``topic/partition/offset``.

        The fallback only catches redelivery of the *same record*; a producer that
        sends the same event twice without an ``event_id`` is not deduplicated.
        """
        return self.event_id or f"{self.topic}/{self.partition}/{self.offset}"

    @property
    def tx(self) -> Connection:
        """The database connection whose transaction also records this message in the inbox.

        Write through it so your changes and the inbox row commit together (or not
        at all). Only available with the inbox on; do not commit or roll it back
        yourself, raise instead.
        """
        if self._tx is None:
            raise RuntimeError("message.tx needs the inbox: set inbox=true and a database")
        return self._tx

    def with_tx(self, tx: Connection | None) -> Message:
        return Message(
            topic=self.topic,
            partition=self.partition,
            offset=self.offset,
            key=self.key,
            value=self.value,
            headers=self.headers,
            timestamp_ms=self.timestamp_ms,
            _tx=tx,
        )

    def text(self) -> str:
        """The value decoded as UTF-8; :class:`InvalidMessageError` if it is not."""
        if self.value is None:
            raise InvalidMessageError(f"{self._where()}: no value (tombstone)")
        try:
            return self.value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidMessageError(
                f"{self._where()}: value is not UTF-8 ({exc.reason})"
            ) from None

    def json(self) -> Any:
        """The value parsed as JSON; :class:`InvalidMessageError` (permanent) if it is not."""
        text = self.text()
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidMessageError(
                f"{self._where()}: value is not JSON ({exc.msg} at char {exc.pos})"
            ) from None

    def _where(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"
