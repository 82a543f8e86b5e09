"""PostgreSQL wake-ups: ``NOTIFY`` sent by the writer, delivered at commit.

On PostgreSQL, :func:`outboxkit.enqueue` (and its batch and async forms) calls
``pg_notify(channel, shard)`` inside the caller's transaction, once per shard it
wrote to. PostgreSQL holds a transaction's notifications until it commits and
drops them when it rolls back, so a listener hears about exactly the rows that
became visible, at the moment they did, with no Redis and no after-commit hook.
Identical notifications of one transaction are sent once, so a batch costs one
notification per distinct shard.

The channel is ``outboxkit:<schema>.<table>``, the schema being the one the
table resolves to on the writer's ``search_path`` (quoted when listened to:
``LISTEN "outboxkit:public.outbox_events"``): notifications are per database
already, and the schema keeps two outboxes of one database apart. The writer
computes it in the statement itself (:func:`channel_sql`), so it names exactly
the table the INSERT wrote to, with no cache to go stale. The payload is the
shard number in decimal. Wake-ups are an optimisation only: a notification nobody listens to is
discarded, and relays keep polling.

MySQL/MariaDB and SQLite have nothing like it; there the writer sends nothing
and Redis hints (``outboxkit.wakeup``) remain the way to wake relays.
"""

from __future__ import annotations

import functools
import hashlib
import re
import zlib
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outboxkit.schema.table import validate_identifier

__all__ = ["NOTIFY_DIALECTS", "channel_sql", "legacy_channel", "notify_at_commit", "notify_channel"]

#: Dialects whose writer sends ``NOTIFY``.
NOTIFY_DIALECTS = frozenset({"postgresql"})

#: PostgreSQL refuses channel names of NAMEDATALEN (64) bytes or more.
_MAX_CHANNEL_BYTES = 63
_PREFIX = "outboxkit:"

#: Schemas that appear in the channel as they are; any other gets the digest form.
_PLAIN_SCHEMA = re.compile(r"[a-z_][a-z0-9_]*")
#: Characters of the table kept in the digest form: 10 + 35 + 1 + 16 = 62 bytes.
_DIGEST_TABLE_CHARS = 35


def notify_channel(table: str, schema: str = "public") -> str:
    """The ``NOTIFY`` channel of the outbox ``schema.table``: ``outboxkit:<schema>.<table>``.

    A schema outside ``[a-z_][a-z0-9_]*``, or a name too long for a PostgreSQL
    channel (63 bytes), gives ``outboxkit:<first 35 characters of the table>:<16
    hex digits of md5("<schema>.<table>")>``: distinct, stable, and computed the
    same way in SQL (:func:`channel_sql`).
    """
    validate_identifier(table)
    if _PLAIN_SCHEMA.fullmatch(schema) and len(_PREFIX) + len(schema) + 1 + len(table) <= (
        _MAX_CHANNEL_BYTES
    ):
        return f"{_PREFIX}{schema}.{table}"
    digest = hashlib.md5(f"{schema}.{table}".encode(), usedforsecurity=False).hexdigest()[:16]
    return f"{_PREFIX}{table[:_DIGEST_TABLE_CHARS]}:{digest}"


def legacy_channel(table: str) -> str:
    """The channel of versions before the schema was part of it, ``outboxkit:<table>``
    (CRC-32 form when long): relays still listen on it during an upgrade."""
    validate_identifier(table)
    channel = _PREFIX + table
    if len(channel) <= _MAX_CHANNEL_BYTES:
        return channel
    digest = f"{zlib.crc32(table.encode('ascii')):08x}"
    return f"{_PREFIX}{table[: _MAX_CHANNEL_BYTES - len(_PREFIX) - 9]}:{digest}"


def channel_sql(table: str) -> str:
    """An SQL expression giving :func:`notify_channel` of ``table`` on the session
    that evaluates it: the schema is the one ``table`` resolves to there
    (``current_schema()`` while it does not exist)."""
    validate_identifier(table)  # so it can be inlined
    room = _MAX_CHANNEL_BYTES - len(_PREFIX) - 1 - len(table)
    schema = (
        "COALESCE((SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n"
        f" ON n.oid = c.relnamespace WHERE c.oid = to_regclass(quote_ident('{table}'))),"
        " current_schema()::text)"
    )
    return (
        f"(SELECT CASE WHEN s ~ '^[a-z_][a-z0-9_]*$' AND octet_length(s) <= {room}"
        f" THEN '{_PREFIX}' || s || '.{table}'"
        f" ELSE '{_PREFIX}{table[:_DIGEST_TABLE_CHARS]}:' || left(md5(s || '.{table}'), 16) END"
        f" FROM (SELECT {schema} AS s) AS outboxkit_schema)"
    )


@functools.lru_cache(maxsize=64)
def _notify(table: str) -> sa.TextClause:
    return sa.text(
        f"SELECT pg_notify({channel_sql(table)}, s) FROM unnest(CAST(:shards AS text[])) AS s"
    )


def notify_at_commit(conn: Connection, table: str, shards: Iterable[int]) -> None:
    """Queue one notification per shard in ``conn``'s transaction (PostgreSQL only).

    Sent when that transaction commits, never if it rolls back. A no-op on other
    databases.
    """
    if conn.dialect.name not in NOTIFY_DIALECTS:
        return
    payloads = sorted({str(int(s)) for s in shards}, key=int)
    if payloads:
        conn.execute(_notify(table), {"shards": payloads})
