"""PostgreSQL wake-ups: ``NOTIFY`` sent by the writer, delivered at commit.

On PostgreSQL, :func:`outboxkit.enqueue` (and its batch and async forms) calls
``pg_notify(channel, shard)`` inside the caller's transaction, once per shard it
wrote to. PostgreSQL holds a transaction's notifications until it commits and
drops them when it rolls back, so a listener hears about exactly the rows that
became visible, at the moment they did, with no Redis and no after-commit hook.
Identical notifications of one transaction are sent once, so a batch costs one
notification per distinct shard.

The channel is ``outboxkit:<table>`` (quoted when listened to:
``LISTEN "outboxkit:outbox_events"``); the payload is the shard number in
decimal. Wake-ups are an optimisation only: a notification nobody listens to is
discarded, and relays keep polling.

MySQL/MariaDB and SQLite have nothing like it; there the writer sends nothing
and Redis hints (``outboxkit.wakeup``) remain the way to wake relays.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outboxkit.schema.table import validate_identifier

__all__ = ["NOTIFY_DIALECTS", "notify_at_commit", "notify_channel"]

#: Dialects whose writer sends ``NOTIFY``.
NOTIFY_DIALECTS = frozenset({"postgresql"})

#: PostgreSQL refuses channel names of NAMEDATALEN (64) bytes or more.
_MAX_CHANNEL_BYTES = 63
_PREFIX = "outboxkit:"

_NOTIFY = sa.text("SELECT pg_notify(:channel, s) FROM unnest(CAST(:shards AS text[])) AS s")


def notify_channel(table: str) -> str:
    """The ``NOTIFY`` channel of ``table``'s wake-ups: ``outboxkit:<table>``.

    A name too long for a PostgreSQL channel (over 53 characters) keeps its
    first 44 characters and gets a CRC-32 of the whole name, so it stays
    distinct and stable in every process.
    """
    validate_identifier(table)
    channel = _PREFIX + table
    if len(channel) <= _MAX_CHANNEL_BYTES:
        return channel
    digest = f"{zlib.crc32(table.encode('ascii')):08x}"
    return f"{_PREFIX}{table[: _MAX_CHANNEL_BYTES - len(_PREFIX) - 9]}:{digest}"


def notify_at_commit(conn: Connection, table: str, shards: Iterable[int]) -> None:
    """Queue one notification per shard in ``conn``'s transaction (PostgreSQL only).

    Sent when that transaction commits, never if it rolls back. A no-op on other
    databases.
    """
    if conn.dialect.name not in NOTIFY_DIALECTS:
        return
    payloads = sorted({str(int(s)) for s in shards}, key=int)
    if payloads:
        conn.execute(_NOTIFY, {"channel": notify_channel(table), "shards": payloads})
