"""The message a handler receives."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection

from outboxkit.consumer._rawheaders import header_names_decodable
from outboxkit.consumer.errors import InvalidMessageError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = ["EVENT_ID_HEADER", "Message"]

#: The header the outbox relay puts on every event.
EVENT_ID_HEADER = "event_id"

# confluent-kafka decodes header names as UTF-8 and does not check the result: a
# name that is not UTF-8 makes ``headers()`` raise SystemError, or return NULL
# entries that crash the interpreter when used. So the names are checked first
# (``_rawheaders``), ``headers()`` is called at most once per record, under this
# lock, and a failure is remembered.
_HEADERS_ONCE = threading.Lock()


class Message:
    """One Kafka record, read-only.

    ``headers`` keeps every header in order (Kafka allows repeats);
    :meth:`header` returns the last value of a name. ``event_id`` is the
    ``event_id`` header decoded as UTF-8, or None when the producer sent none.
    Messages compare equal when every field but ``tx`` is.
    """

    __slots__ = (
        "_headers",
        "_key",
        "_offset",
        "_partition",
        "_timestamp_ms",
        "_topic",
        "_tx",
        "_value",
    )

    def __init__(
        self,
        *,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] = (),
        timestamp_ms: int | None = None,
        _tx: Connection | AsyncConnection | None = None,
    ) -> None:
        self._topic = topic
        self._partition = partition
        self._offset = offset
        self._key = key
        self._value = value
        self._headers: tuple[tuple[str, bytes], ...] | None = tuple(headers)
        self._timestamp_ms = timestamp_ms
        self._tx = _tx

    @staticmethod
    def from_kafka(record: Any) -> Message:
        """The message of a confluent-kafka record."""
        m = _KafkaMessage.__new__(_KafkaMessage)
        m._record = record
        m._headers = None
        m._header_error = None
        m._names_checked = False
        m._tx = None
        return m

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def partition(self) -> int:
        return self._partition

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def key(self) -> bytes | None:
        return self._key

    @property
    def value(self) -> bytes | None:
        return self._value

    @property
    def timestamp_ms(self) -> int | None:
        return self._timestamp_ms

    @property
    def headers(self) -> tuple[tuple[str, bytes], ...]:
        assert self._headers is not None
        return self._headers

    def _readable_headers(self) -> tuple[tuple[str, bytes], ...] | None:
        """The headers, or None when they cannot be decoded (never raises)."""
        return self.headers

    def _check_headers(self) -> None:
        """:class:`InvalidMessageError` if the headers cannot be decoded, found
        without decoding them when that can be avoided (before a message joins an
        inbox group)."""

    def _headers_invalid(self) -> bool:
        """Were the headers found undecodable (by a read or a check) so far?"""
        return False

    def _fields(self) -> tuple[object, ...]:
        return (
            self.topic,
            self.partition,
            self.offset,
            self.key,
            self.value,
            self._readable_headers(),
            self.timestamp_ms,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (
            f"Message(topic={self.topic!r}, partition={self.partition!r}, "
            f"offset={self.offset!r}, key={self.key!r}, value={self.value!r}, "
            f"headers={self._readable_headers()!r}, timestamp_ms={self.timestamp_ms!r})"
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
        """``event_id``, else ``topic/partition/offset``: for logs and your own records.

        The inbox keys on the exact bytes instead (``consumer.inbox.inbox_key``).

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
        tx = self._tx
        if tx is None:
            raise RuntimeError("message.tx needs the inbox: set inbox=true and a database")
        if not isinstance(tx, Connection):
            raise RuntimeError("an async handler's transaction is message.async_tx")
        return tx

    @property
    def async_tx(self) -> AsyncConnection:
        """:attr:`tx` for an ``async def handle``: the ``AsyncConnection`` whose
        transaction also records this message in the inbox (``await
        message.async_tx.execute(...)``). Do not commit or roll it back; raise."""
        tx = self._tx
        if tx is None:
            raise RuntimeError("message.async_tx needs the inbox: set inbox=true and a database")
        if isinstance(tx, Connection):
            raise RuntimeError("a sync handler's transaction is message.tx")
        return tx

    def with_tx(self, tx: Connection | AsyncConnection | None) -> Message:
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


class _KafkaMessage(Message):
    """A :class:`Message` that reads its fields from the confluent-kafka record
    when asked. The poll loop builds one per record and most handlers read a
    field or two: copying every field (and decoding the headers) up front was
    the largest per-message cost of the loop."""

    __slots__ = ("_header_error", "_names_checked", "_record")

    _record: Any
    _header_error: str | None
    _names_checked: bool  # every header name is UTF-8: headers() is safe to call

    @property
    def topic(self) -> str:
        topic: str = self._record.topic()
        return topic

    @property
    def partition(self) -> int:
        partition: int = self._record.partition()
        return partition

    @property
    def offset(self) -> int:
        offset: int = self._record.offset()
        return offset

    @property
    def key(self) -> bytes | None:
        key: bytes | None = self._record.key()
        return key

    @property
    def value(self) -> bytes | None:
        value: bytes | None = self._record.value()
        return value

    @property
    def timestamp_ms(self) -> int | None:
        ts_type, ts = self._record.timestamp()
        timestamp_ms: int | None = ts if ts_type else None
        return timestamp_ms

    @property
    def headers(self) -> tuple[tuple[str, bytes], ...]:
        """The headers; :class:`InvalidMessageError` (permanent) if a name is not UTF-8."""
        headers = self._readable_headers()
        if headers is None:
            raise InvalidMessageError(f"{self._where()}: {self._header_error}")
        return headers

    def _readable_headers(self) -> tuple[tuple[str, bytes], ...] | None:
        if self._headers is None and self._header_error is None:
            with _HEADERS_ONCE:
                if self._headers is None and self._header_error is None:
                    self._decode_headers()
        return self._headers

    def _check_headers(self) -> None:
        # Most handlers never read the headers: checking the names is enough to
        # know that they can be decoded, and costs less than decoding them.
        if not self._names_checked and self._headers is None and self._header_error is None:
            with _HEADERS_ONCE:
                if self._headers is None and self._header_error is None:
                    self._check_names()
        if self._header_error is not None:
            raise InvalidMessageError(f"{self._where()}: {self._header_error}")

    def _headers_invalid(self) -> bool:
        return self._header_error is not None

    def _check_names(self) -> None:
        """Check the names once (lock held); when that cannot be told, decode."""
        if self._names_checked:
            return
        decodable = header_names_decodable(self._record)
        if decodable is None:
            self._decode_headers()
        elif decodable:
            self._names_checked = True
        else:
            self._header_error = "header names are not UTF-8"

    def _decode_headers(self) -> None:
        """Call the record's ``headers()`` exactly once, and only when every name is
        UTF-8 (see ``_rawheaders``); keep the result or the failure (lock held)."""
        if not self._names_checked and header_names_decodable(self._record) is False:
            self._header_error = "header names are not UTF-8"
            return
        try:
            raw: Sequence[tuple[str, bytes | None]] = self._record.headers() or ()
            headers = tuple([(name, value or b"") for name, value in raw])
        except Exception as exc:  # SystemError/UnicodeDecodeError from the client
            self._header_error = f"header names are not UTF-8 ({type(exc).__name__})"
            return
        self._headers = headers

    def with_tx(self, tx: Connection | AsyncConnection | None) -> Message:
        self._readable_headers()  # decoded here, once, not again by the copy
        m = _KafkaMessage.__new__(_KafkaMessage)
        m._record, m._headers, m._tx = self._record, self._headers, tx
        m._header_error = self._header_error
        m._names_checked = self._names_checked
        return m
