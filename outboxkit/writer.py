"""The writer API: put events into the outbox inside the caller's transaction.

``enqueue`` and ``enqueue_many`` never commit, roll back or flush anything of the
caller's: the INSERT joins whatever transaction the given ``Connection`` or
``Session`` is in, so the event exists exactly when the business change does.
Every event is validated *before* anything is written; a bad one raises an
``EnqueueError`` (a ``ValueError``) and writes nothing, not even the good events
of the same ``enqueue_many`` call.

``enqueue_async`` and ``enqueue_many_async`` are the same for asyncio code: they
take SQLAlchemy's ``AsyncConnection`` or ``AsyncSession`` and are awaited. They
validate on the event loop with the very same code, then run the same INSERT on
the caller's connection through ``run_sync``, so guarantees and errors are
identical. They are separate names rather than overloads of ``enqueue`` so a
forgotten ``await`` cannot pass for a write: ``enqueue`` always returns the id,
``enqueue_async`` always returns a coroutine, and strict mypy checks both
without overload tricks. Each refuses the other kind of target with a
``TypeError`` naming the right function.

On PostgreSQL the INSERT is followed by ``pg_notify`` in the same transaction
(``outboxkit.notify``): listeners hear about the rows when, and only if, the
caller commits.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard, cast

from sqlalchemy.engine import Connection

from outboxkit.errors import (
    DuplicateEventIdError,
    EnqueueError,
    InvalidEventIdError,
    InvalidHeadersError,
    InvalidKeyError,
    InvalidTopicError,
    PayloadTooLargeError,
    UnserializablePayloadError,
)
from outboxkit.inserts import ROW_COLUMNS, insert_notifying, insert_rows
from outboxkit.notify import NOTIFY_DIALECTS, notify_at_commit
from outboxkit.runtime.identity import OutboxIdentity, read_identity
from outboxkit.runtime.tracing import trace_headers, with_trace_headers
from outboxkit.schema.codec import HeaderValue, encode_headers, shard_for
from outboxkit.schema.meta import read_table_meta
from outboxkit.schema.table import (
    DEFAULT_TABLE,
    MAX_EVENT_ID_LENGTH,
    MAX_KEY_BYTES,
    MAX_TOPIC_LENGTH,
    MYSQL_DIALECTS,
    PAYLOAD_ASIDE_VERSION,
    validate_identifier,
)
from outboxkit.wakeup import mark_enqueued

if TYPE_CHECKING:
    # Not at run time: sqlalchemy.ext.asyncio needs greenlet (the ``async`` extra),
    # and sqlalchemy.orm is for services that use it (see _is_session).
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Event",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "kafka_record_size",
    "uuid7",
]

#: librdkafka's default ``message.max.bytes``, which the relay's producer keeps
#: unless ``--kafka-config`` sets it: the largest record the relay can send.
#: A row over it would only ever end ``failed``.
DEFAULT_MAX_MESSAGE_BYTES = 1_000_000
#: librdkafka's worst-case framing of one v2 record (length, attributes, timestamp
#: and offset deltas, key/value lengths, header count: RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD),
#: counted in its ``message.max.bytes`` check along with key, value and headers.
_RECORD_OVERHEAD = 36
#: Serialised headers live in a TEXT column.
MAX_HEADERS_BYTES = 60_000
RESERVED_HEADERS = frozenset({"event_id"})

_TOPIC = re.compile(r"[a-zA-Z0-9._-]+")
_EVENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")

Payload = bytes | bytearray | memoryview | str | object
Target: TypeAlias = "Connection | Session"


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One event for ``enqueue_many``."""

    topic: str
    payload: Payload
    key: str | bytes | None = None
    headers: Mapping[str, HeaderValue] | None = None
    event_id: str | uuid.UUID | None = None


def enqueue(
    target: Target,
    *,
    topic: str,
    payload: Payload,
    key: str | bytes | None = None,
    headers: Mapping[str, HeaderValue] | None = None,
    event_id: str | uuid.UUID | None = None,
    table: str = DEFAULT_TABLE,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_payload_bytes: int | None = None,
) -> str:
    """Write one event into the outbox in the caller's transaction; return its event id.

    ``payload`` is bytes (sent as is), str (UTF-8) or any JSON-serialisable object
    (compact JSON, UTF-8).  ``key`` decides the Kafka partition and the ordering
    domain; events of one key are delivered in id order.

    ``max_message_bytes`` is the relay producer's ``message.max.bytes``: the Kafka
    record as librdkafka counts it (payload, key, headers including the
    ``event_id`` header the relay adds, and 36 bytes of framing) must fit in it.
    Set it to the relay's value if you raise that.  ``max_payload_bytes``
    optionally caps the payload alone, lower.
    """
    _refuse_async(target, "enqueue")
    ev = Event(topic=topic, payload=payload, key=key, headers=headers, event_id=event_id)
    return enqueue_many(
        target,
        [ev],
        table=table,
        max_message_bytes=max_message_bytes,
        max_payload_bytes=max_payload_bytes,
    )[0]


def enqueue_many(
    target: Target,
    events: Iterable[Event | Mapping[str, Any]],
    *,
    table: str = DEFAULT_TABLE,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_payload_bytes: int | None = None,
) -> list[str]:
    """Write many events in the caller's transaction, in the given order (= id order).

    The limits are those of :func:`enqueue`, per event.
    """
    _refuse_async(target, "enqueue_many")
    rows = _prepare(events, table, max_message_bytes, max_payload_bytes)
    if rows:
        _write(target, rows, table)
    return [row["event_id"] for row in rows]


async def enqueue_async(
    target: AsyncConnection | AsyncSession,
    *,
    topic: str,
    payload: Payload,
    key: str | bytes | None = None,
    headers: Mapping[str, HeaderValue] | None = None,
    event_id: str | uuid.UUID | None = None,
    table: str = DEFAULT_TABLE,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_payload_bytes: int | None = None,
) -> str:
    """:func:`enqueue` for an ``AsyncConnection`` or ``AsyncSession``; await it.

    Joins the caller's transaction, never commits or flushes, validates before
    writing and raises the same errors as :func:`enqueue`.
    """
    _refuse_sync(target, "enqueue_async")
    ev = Event(topic=topic, payload=payload, key=key, headers=headers, event_id=event_id)
    ids = await enqueue_many_async(
        target,
        [ev],
        table=table,
        max_message_bytes=max_message_bytes,
        max_payload_bytes=max_payload_bytes,
    )
    return ids[0]


async def enqueue_many_async(
    target: AsyncConnection | AsyncSession,
    events: Iterable[Event | Mapping[str, Any]],
    *,
    table: str = DEFAULT_TABLE,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_payload_bytes: int | None = None,
) -> list[str]:
    """:func:`enqueue_many` for an ``AsyncConnection`` or ``AsyncSession``; await it."""
    _refuse_sync(target, "enqueue_many_async")
    # Validation touches no connection, so it runs here; only the INSERT needs
    # the driver, and run_sync hands it the caller's own (sync-facing) connection.
    rows = _prepare(events, table, max_message_bytes, max_payload_bytes)
    if rows:
        await target.run_sync(_write, rows, table)
    return [row["event_id"] for row in rows]


def _is_session(target: object) -> TypeGuard[Session]:
    """Is ``target`` an ORM ``Session``? Whoever holds one has imported
    sqlalchemy.orm; the writer does not import it for services that use Core."""
    module = sys.modules.get("sqlalchemy.orm")
    return module is not None and isinstance(target, module.Session)


def _is_async_target(target: object) -> bool:
    # Whoever holds an AsyncConnection or AsyncSession has imported their module;
    # looking it up keeps the import (and greenlet) out of sync-only services.
    module = sys.modules.get("sqlalchemy.ext.asyncio")
    return module is not None and isinstance(target, module.AsyncConnection | module.AsyncSession)


def _refuse_async(target: object, name: str) -> None:
    if not (isinstance(target, Connection) or _is_session(target)) and _is_async_target(target):
        raise TypeError(
            f"{name}() takes a Connection or Session; for {type(target).__name__} "
            f"use 'await outboxkit.{name}_async(...)'"
        )


def _refuse_sync(target: object, name: str) -> None:
    if not _is_async_target(target):
        raise TypeError(
            f"{name}() takes an AsyncConnection or AsyncSession, not "
            f"{type(target).__name__}; for sync code use outboxkit.{name.removesuffix('_async')}()"
        )


def _prepare(
    events: Iterable[Event | Mapping[str, Any]],
    table: str,
    max_message_bytes: int,
    max_payload_bytes: int | None,
) -> list[dict[str, Any]]:
    """Every check that can refuse the batch, before any connection is touched."""
    validate_identifier(table)
    # Inside a span, every event carries its W3C context (docs/tracing.md).
    trace = trace_headers()
    rows = [_row(_as_event(e), max_message_bytes, max_payload_bytes, trace) for e in events]
    _refuse_repeated_ids(rows)
    return rows


def _write(target: Target, rows: list[dict[str, Any]], table: str) -> None:
    conn = target.connection() if _is_session(target) else cast(Connection, target)
    shard_count, aside = _table_layout(conn, table)
    for row in rows:
        row["shard"] = shard_for(row["message_key"], row["event_id"], shard_count)
    if len(rows) == 1 and conn.dialect.name in NOTIFY_DIALECTS:
        # One event (``enqueue``): the INSERT (payload aside too) and its NOTIFY
        # in one statement, a round trip less per transaction; the NOTIFY is
        # still sent at commit.
        params = {f"{col}_0": rows[0][col] for col in ROW_COLUMNS}
        conn.execute(insert_notifying(conn.dialect, table, aside), params)
    else:
        insert_rows(conn, table, rows, aside)
        # PostgreSQL: NOTIFY in the caller's transaction, so sent exactly at its commit.
        notify_at_commit(conn, table, (row["shard"] for row in rows))
    mark_enqueued(target, conn, table)  # for Redis wake-up hints after commit, when enabled


def _refuse_repeated_ids(rows: list[dict[str, Any]]) -> None:
    # The unique index would refuse the repeat, but only when its chunk is sent:
    # earlier chunks would already sit in the caller's transaction.
    first: dict[str, int] = {}
    for n, row in enumerate(rows):
        seen = first.setdefault(row["event_id"], n)
        if seen != n:
            raise DuplicateEventIdError(
                f"event id {row['event_id']!r} is given more than once in one batch "
                f"(events {seen} and {n}); nothing was written"
            )


def _as_event(e: Event | Mapping[str, Any]) -> Event:
    if isinstance(e, Event):
        return e
    if isinstance(e, Mapping):
        try:
            return Event(**e)
        except TypeError as exc:
            raise EnqueueError(f"not an event: {exc}") from None
    raise TypeError(f"events must be Event or mappings, not {type(e).__name__}")


def _row(
    ev: Event,
    max_message_bytes: int,
    max_payload_bytes: int | None,
    trace: Mapping[str, str] | None,
) -> dict[str, Any]:
    headers = with_trace_headers(ev.headers, trace) if trace else ev.headers
    row = {
        "topic": validate_topic(ev.topic),
        "payload": serialise_payload(ev.payload, max_payload_bytes),
        "message_key": _key_bytes(ev.key),
        "headers": _headers_text(headers),
        "event_id": _event_id(ev.event_id),
    }
    _check_record_size(row, headers or {}, max_message_bytes)
    return row


def _check_record_size(
    row: dict[str, Any], headers: Mapping[str, HeaderValue], max_message_bytes: int
) -> None:
    pairs = [
        (name, value.encode() if isinstance(value, str) else bytes(value))
        for name, value in headers.items()
    ]
    pairs.append(("event_id", row["event_id"].encode("ascii")))
    size = kafka_record_size(row["payload"], row["message_key"], pairs)
    if size > max_message_bytes:
        key_len = len(row["message_key"] or b"")
        payload_len = len(row["payload"])
        raise PayloadTooLargeError(
            f"the Kafka record would be {size} bytes (payload {payload_len}, key {key_len}, "
            f"headers incl. event_id {size - _RECORD_OVERHEAD - key_len - payload_len}, "
            f"framing {_RECORD_OVERHEAD}); the relay's producer sends at most "
            f"{max_message_bytes} (its message.max.bytes, max_message_bytes here)"
        )


def _varint_size(n: int) -> int:
    """Bytes of a non-negative length as Kafka's zigzag varint."""
    zigzag, size = n << 1, 1
    while zigzag >= 0x80:
        zigzag >>= 7
        size += 1
    return size


def kafka_record_size(
    payload: bytes, key: bytes | None, headers: Iterable[tuple[str, bytes]]
) -> int:
    """The size librdkafka checks against ``message.max.bytes`` when producing.

    Framing (36 bytes, its worst case) plus key, value, and per header the name
    and value with their varint lengths.  ``headers`` are those sent, so include
    the ``event_id`` header the relay adds.
    """
    size = _RECORD_OVERHEAD + len(payload) + len(key or b"")
    for name, value in headers:
        raw = name.encode("utf-8")
        size += _varint_size(len(raw)) + len(raw) + _varint_size(len(value)) + len(value)
    return size


def validate_topic(topic: object) -> str:
    """Kafka's rules: 1-249 chars of ``[a-zA-Z0-9._-]``, not ``.`` or ``..``."""
    if not isinstance(topic, str) or not topic:
        raise InvalidTopicError(f"topic must be a non-empty str, got {topic!r}")
    if len(topic) > MAX_TOPIC_LENGTH:
        raise InvalidTopicError(
            f"topic is {len(topic)} chars long; Kafka allows {MAX_TOPIC_LENGTH}"
        )
    if topic in (".", "..") or not _TOPIC.fullmatch(topic):
        raise InvalidTopicError(
            f"illegal topic name {topic!r}: use [a-zA-Z0-9._-], and not '.' or '..'"
        )
    return topic


def serialise_payload(payload: Payload, max_bytes: int | None = None) -> bytes:
    if isinstance(payload, bytes | bytearray | memoryview):
        data = bytes(payload)
    elif isinstance(payload, str):
        try:
            data = payload.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnserializablePayloadError(f"payload str is not valid UTF-8: {exc}") from None
    elif payload is None:
        raise UnserializablePayloadError("payload is required: pass bytes, str or a JSON value")
    else:
        try:
            text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            data = text.encode("utf-8")
        except (TypeError, ValueError, RecursionError, UnicodeEncodeError) as exc:
            raise UnserializablePayloadError(
                f"payload of type {type(payload).__name__} is not JSON-serialisable: {exc}"
            ) from None
    if max_bytes is not None and len(data) > max_bytes:
        raise PayloadTooLargeError(
            f"payload is {len(data)} bytes; max_payload_bytes is {max_bytes}"
        )
    return data


def _key_bytes(key: str | bytes | None) -> bytes | None:
    if key is None:
        return None
    if isinstance(key, str):
        try:
            data = key.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKeyError("key str is not valid UTF-8") from None
    elif isinstance(key, bytes | bytearray | memoryview):
        data = bytes(key)
    else:
        raise InvalidKeyError(f"key must be str, bytes or None, not {type(key).__name__}")
    if len(data) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"key is {len(data)} bytes; the limit is {MAX_KEY_BYTES}")
    return data


def _headers_text(headers: Mapping[str, HeaderValue] | None) -> str | None:
    if headers is None:
        return None
    if not isinstance(headers, Mapping):
        raise InvalidHeadersError(f"headers must be a mapping, not {type(headers).__name__}")
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise InvalidHeadersError(f"header names must be non-empty str, got {name!r}")
        if "\x00" in name:
            # librdkafka takes header names as C strings: the name would arrive cut short.
            raise InvalidHeadersError(f"header name {name!r} contains a NUL character")
        if name in RESERVED_HEADERS:
            raise InvalidHeadersError(f"header {name!r} is set by outboxkit itself")
        if not isinstance(value, str | bytes | bytearray | memoryview):
            raise InvalidHeadersError(
                f"header {name!r} must be str or bytes, not {type(value).__name__}"
            )
        try:
            name.encode("utf-8")
            if isinstance(value, str):
                value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidHeadersError(
                f"header {name!r} is not valid UTF-8 (a lone surrogate cannot be sent)"
            ) from None
    text = encode_headers({k: v if isinstance(v, str) else bytes(v) for k, v in headers.items()})
    if text is not None and len(text.encode("utf-8")) > MAX_HEADERS_BYTES:
        raise InvalidHeadersError(f"headers exceed {MAX_HEADERS_BYTES} bytes once serialised")
    return text


def _event_id(event_id: str | uuid.UUID | None) -> str:
    if event_id is None:
        return str(uuid7())
    if isinstance(event_id, uuid.UUID):
        return str(event_id)
    if (
        not isinstance(event_id, str)
        or len(event_id) > MAX_EVENT_ID_LENGTH
        or not _EVENT_ID.fullmatch(event_id)
    ):
        raise InvalidEventIdError(
            f"malformed event id {event_id!r}: 1-{MAX_EVENT_ID_LENGTH} chars of "
            "[A-Za-z0-9._:-] starting with a letter or digit, or a uuid.UUID"
        )
    return event_id


_uuid_lock = threading.Lock()
_uuid_last_ms = 0
_uuid_seq = 0


def uuid7() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit Unix ms, then a counter and randomness.

    Ids made in one process are strictly increasing (a 12-bit counter within one
    millisecond), so they sort like the events were created.
    """
    global _uuid_last_ms, _uuid_seq
    with _uuid_lock:
        ms = time.time_ns() // 1_000_000
        if ms > _uuid_last_ms:
            _uuid_last_ms, _uuid_seq = ms, int.from_bytes(os.urandom(2), "big") & 0x3FF
        else:
            _uuid_seq += 1
            if _uuid_seq > 0xFFF:  # counter spent: borrow the next millisecond
                _uuid_last_ms, _uuid_seq = _uuid_last_ms + 1, 0
            ms = _uuid_last_ms
        seq = _uuid_seq
    rand_b = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | seq << 64 | 0b10 << 62 | rand_b
    return uuid.UUID(int=value)


#: Per server (the URL) and outbox (its identity: database, schema, table): its
#: shard count, and whether payloads go aside.
_layout_cache: dict[tuple[str, str], tuple[int, bool]] = {}
#: Where, in each database connection's ``info``, the identity of each outbox
#: table name as that connection resolves it is kept (see ``_identity``).
_IDENTITIES = "outboxkit.identities"
#: Where the payload table is written (SQLite keeps payloads in the outbox
#: table: it has no relay to speed up, and cannot loosen the column's NOT NULL).
_ASIDE_DIALECTS = (*MYSQL_DIALECTS, "postgresql")


def _table_layout(conn: Connection, table: str) -> tuple[int, bool]:
    """The table's shard count, and whether its payloads go to the payload table
    (schema version 3 and later). Read once per process and outbox: the shard
    count is fixed when the table is created, and a process that read an older
    version keeps writing payloads into the outbox table, which every relay
    reads too.

    The outbox is the table the name resolves to on this connection, as the
    relay names it (:func:`outboxkit.runtime.identity.read_identity`): one URL
    reaches two outboxes when ``search_path`` differs by connection (set in
    ``connect_args`` or by a connect event), and keyed by the URL and the table
    name alone the first one's shard count was used for the other's rows."""
    identity = _identity(conn, table)
    cache_key = (conn.engine.url.render_as_string(hide_password=True), identity.key)
    layout = _layout_cache.get(cache_key)
    if layout is None:
        count, version = read_table_meta(conn, table)
        aside = version >= PAYLOAD_ASIDE_VERSION and conn.dialect.name in _ASIDE_DIALECTS
        layout = _layout_cache[cache_key] = (count, aside)
    return layout


def _identity(conn: Connection, table: str) -> OutboxIdentity:
    """The outbox ``table`` names on ``conn``'s session, read once per database
    connection (kept in its ``info``, which lives as long as the connection):
    what a session resolves a table name to is set when it connects
    (``search_path`` on PostgreSQL, the URL's database on MySQL/MariaDB). A
    session that changes it afterwards (``SET search_path``, ``USE``) must
    give each outbox its own engine (docs/scaling.md)."""
    known: dict[str, OutboxIdentity] = conn.info.setdefault(_IDENTITIES, {})
    identity = known.get(table)
    if identity is None:
        identity = known[table] = read_identity(conn, table)
    return identity
