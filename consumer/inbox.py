"""Idempotent handling: the handler's writes and the inbox row commit together.

For each message, one transaction:

1. ``INSERT`` ``(group_id, identity)`` into the inbox table. The primary key
   makes a second consumer of the same event (the old and the new owner of a
   partition after a rebalance) wait for the first one's transaction: if it
   commits, the second sees a duplicate and skips the message; if it rolls
   back, the second inserts and handles it. MySQL/MariaDB report the duplicate
   as a key error (the statement fails, the transaction is rolled back here);
   PostgreSQL's ``INSERT ... ON CONFLICT DO NOTHING`` inserts nothing instead
   of failing, since there an error would abort the whole transaction and log
   an error on the server for every redelivery;
2. run the handler with ``message.tx`` bound to this transaction;
3. ``COMMIT``.

PostgreSQL aborts a transaction at its first error, and its ``COMMIT`` then
rolls back without an error. A handler that catches a database error and
returns would have its message counted as handled with neither its writes nor
the inbox row stored; so before committing, an aborted transaction is rolled
back and raised as :class:`InboxTransactionAborted` (transient: retried, then
dead-lettered). A handler that must go on after a failed statement runs it in
a savepoint, ``with message.tx.begin_nested(): ...``.

The isolation level is the engine's (MySQL/MariaDB: REPEATABLE READ,
PostgreSQL: READ COMMITTED by default). Under PostgreSQL's REPEATABLE READ or
SERIALIZABLE, the insert that waited for a first consumer that committed fails
with a serialization error instead of inserting nothing; it is treated the
same way, as a duplicate once the row is seen.

A crash anywhere before the commit leaves neither the effects nor the inbox
row; a crash after it leaves both, and the redelivered message is then a
duplicate: the handler is skipped. A commit whose outcome is unknown (the
connection dropped during ``COMMIT``) is retried as transient and resolved the
same way.

The identity is exact and unambiguous (:func:`inbox_key`): the ``event_id``
header's bytes, else the record's topic, partition and offset, each kept apart
from the other and stored in a binary column, so two keys are equal only when
their events are the same.

Each worker thread keeps its connection between messages (checked out of the
pool once, not per message): a checkout costs a pre-ping and a check-in a reset
``ROLLBACK``, two round trips that doubled the cost of a message. The held
connection is handed back after any failure (a broken one is then replaced,
pre-pinged, on the next message), when it sat idle longer than
``_IDLE_RECHECK`` seconds (so a server-side idle timeout does not turn into a
handler retry), and when the worker stops (:meth:`release`).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine

from outboxkit.consumer.errors import InboxTransactionAborted
from outboxkit.consumer.message import EVENT_ID_HEADER, Message
from outboxkit.errors import TransientError
from outboxkit.schema.table import MAX_INBOX_ID_LENGTH, db_now, inbox_table

__all__ = ["Inbox", "check_not_aborted", "inbox_group_key", "inbox_key"]

_IDLE_RECHECK = 10.0
#: ``(event_id, topic, kafka_partition, kafka_offset)`` of an inbox row.
_InboxRow = sa.Row[Any, Any, Any, Any]
#: Keys the inbox makes itself start with this; an event id that does is hashed.
RESERVED_PREFIX = "outboxkit:"


def inbox_key(message: Message) -> str:
    """The inbox row's ``event_id`` for ``message``: equal only for the same event.

    * the ``event_id`` header, verbatim, when it is UTF-8 without NUL, fits the
      column (255 characters) and does not start with ``outboxkit:`` (the common
      case, and what earlier releases stored);
    * without an ``event_id`` (absent or empty): the record itself,
      ``outboxkit:record:<partition>:<offset>:<topic>``, so no event id can equal it;
    * anything else (an id too long, not UTF-8, with NUL, or starting with
      ``outboxkit:``; a fallback too long): ``outboxkit:sha256:<hex>``, the SHA-256
      of the raw bytes tagged with their kind. Never truncated, never decoded with
      replacement characters, so two different ids cannot share a key.
    """
    raw = message.header(EVENT_ID_HEADER)
    if raw:
        text = _plain(raw)
        if text is not None and not text.startswith(RESERVED_PREFIX):
            return text
        return _hashed(b"id\x00" + raw)
    topic, partition, offset = message.topic, message.partition, message.offset
    key = f"{RESERVED_PREFIX}record:{partition}:{offset}:{topic}"
    if _plain(key.encode("utf-8", "surrogatepass")) == key:
        return key
    return _hashed(
        f"record\x00{partition}:{offset}:".encode() + topic.encode("utf-8", "surrogatepass")
    )


def inbox_group_key(group_id: str) -> str:
    """The inbox row's ``group_id``: the group id verbatim, or hashed like an event id."""
    raw = group_id.encode("utf-8", "surrogatepass")
    text = _plain(raw)
    if text is not None and not text.startswith(RESERVED_PREFIX):
        return text
    return _hashed(b"group\x00" + raw)


def _v1_fallback_of_another_record(row: _InboxRow, message: Message) -> bool:
    """Is ``row`` 0.1.0's key for a record without event id, other than ``message``?

    0.1.0 keyed such a record ``topic/partition/offset``, a string an event id
    may equal. A row whose key spells its own coordinates that way is such a row (an
    event id cannot know the offset its record will get).
    """
    if row.topic is None or row.kafka_partition is None or row.kafka_offset is None:
        return False
    spelled = f"{row.topic}/{row.kafka_partition}/{row.kafka_offset}"[:MAX_INBOX_ID_LENGTH]
    same_record = (row.topic, row.kafka_partition, row.kafka_offset) == (
        message.topic,
        message.partition,
        message.offset,
    )
    return row.event_id == spelled and not same_record


#: libpq's ``PQTRANS_INERROR``: in a transaction that failed (psycopg 3 and 2 alike).
_PQTRANS_INERROR = 3
#: SQLSTATE ``serialization_failure``. PyMySQL gives MySQL's SQLSTATE too, and a
#: MySQL/MariaDB deadlock (1213) has this one: the inbox insert runs before the
#: handler, so the rolled-back transaction held nothing else, and "not inserted"
#: (a duplicate if the row is there, else retried) is right for it as well.
_SERIALIZATION_FAILURE = "40001"


def check_not_aborted(conn: sa.Connection) -> None:
    """Raise :class:`InboxTransactionAborted` if PostgreSQL gave up on ``conn``'s transaction.

    Its ``COMMIT`` would roll back without a word (see the module docstring).
    MySQL/MariaDB roll back only the failed statement, so nothing is checked there.
    """
    if conn.dialect.name != "postgresql":
        return
    info = getattr(conn.connection.driver_connection, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is not None and int(status) == _PQTRANS_INERROR:
        raise InboxTransactionAborted(
            "the inbox transaction was aborted by a database error the handler caught: "
            "nothing was committed (on PostgreSQL, run a statement that may fail in a "
            "savepoint: with message.tx.begin_nested(): ...)"
        )


def _is_serialization_failure(exc: sa.exc.DBAPIError) -> bool:
    return getattr(exc.orig, "sqlstate", None) == _SERIALIZATION_FAILURE


def _plain(raw: bytes) -> str | None:
    """``raw`` as text when it can be stored and compared as is, else None."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if len(text) > MAX_INBOX_ID_LENGTH or "\x00" in text:
        return None
    return text


def _hashed(tagged: bytes) -> str:
    return f"{RESERVED_PREFIX}sha256:{hashlib.sha256(tagged).hexdigest()}"


class _Held(threading.local):
    conn: sa.Connection | None = None
    used_at: float = 0.0


class Inbox:
    """One consumer group's inbox on ``engine``: each event is handled once.

    :meth:`run` runs the handler and inserts the ``(group_id, identity)`` row in
    one transaction (the module's text above says how and what a crash leaves).
    The consumer builds it when its ``inbox`` setting is on; the handler sees the
    transaction as ``message.tx``.
    """

    def __init__(self, engine: Engine, *, group_id: str, table: str) -> None:
        self.engine = engine
        self.group_id = group_id
        self._group_key = inbox_group_key(group_id)
        self.table = inbox_table(table)
        self._held = _Held()
        #: (rows, PostgreSQL?) -> the n-row INSERT of inbox rows, 1 for one message.
        self._inserts: dict[tuple[int, bool], tuple[str, tuple[str, ...] | None]] = {}

    def run(self, message: Message, handler: Callable[[Message], None]) -> bool:
        """Run ``handler`` once per ``(group_id, identity)``. True if it was a duplicate."""
        conn = self._connection()
        try:
            duplicate = self._run(conn, message, handler)
        except BaseException:
            self.release()  # whatever state it is in, the pool sorts it out
            raise
        self._held.used_at = time.monotonic()
        return duplicate

    # -- group transactions (--inbox-batch, see outboxkit.consumer.batching) ----------

    def begin_group(self) -> sa.Connection:
        """The calling thread's connection with a transaction begun for a group."""
        conn = self._connection()
        conn.begin()
        return conn

    def claim_all(self, conn: sa.Connection, messages: list[Message]) -> bool:
        """Insert every message's inbox row with one statement in the open group
        transaction; True if all went in.

        False (nothing to keep: the caller rolls back and claims them one by one,
        :meth:`claim_in_group`) when any of them is a duplicate, twice in the
        list, or has a key the inbox made itself. MySQL/MariaDB fail the whole
        statement on a duplicate; PostgreSQL's ``ON CONFLICT DO NOTHING`` inserts
        the others, which is why the caller must roll back then.
        """
        keys = [inbox_key(message) for message in messages]
        if any(key.startswith(RESERVED_PREFIX) for key in keys):
            return False
        try:
            return self._insert_rows(conn, messages, keys) == len(messages)
        except sa.exc.IntegrityError:
            return False

    def _insert_rows(self, conn: sa.Connection, messages: list[Message], keys: list[str]) -> int:
        """Insert the messages' inbox rows (``keys`` their inbox keys) with one
        statement; the number that went in. PostgreSQL skips a duplicate (``ON
        CONFLICT DO NOTHING``; ``RETURNING`` counts the others, the driver's
        rowcount may be -1); MySQL/MariaDB raise ``IntegrityError`` for it.

        The driver's SQL is run as it is (:meth:`_insert_many`): the engine's
        cursor events (statement logging, tracing) still fire, and its
        statement-level path is skipped, about 25 µs of a single message's
        290 µs on MariaDB (docs/performance.md, *The single-message inbox*)."""
        params: dict[str, object] = {}
        for n, (message, key) in enumerate(zip(messages, keys, strict=True)):
            params[f"g{n}"] = self._group_key
            params[f"e{n}"] = key
            params[f"t{n}"] = message.topic
            params[f"p{n}"] = message.partition
            params[f"o{n}"] = message.offset
        sql, order = self._insert_many(conn, len(messages))
        args: Any = params if order is None else tuple(params[name] for name in order)
        if conn.dialect.name == "postgresql":
            return len(conn.exec_driver_sql(sql, args).all())
        conn.exec_driver_sql(sql, args)
        return len(messages)

    def _insert_many(self, conn: sa.Connection, n: int) -> tuple[str, tuple[str, ...] | None]:
        """The ``n``-row ``INSERT`` of :meth:`claim_all` as the driver's SQL, and the
        order of its parameters if they are positional; compiled once per size and
        dialect: SQLAlchemy compiles a multi-row ``VALUES`` anew on every execution,
        about 0.1 ms per row."""
        postgres = conn.dialect.name == "postgresql"
        cached = self._inserts.get((n, postgres))
        if cached is not None:
            return cached
        rows = [
            {
                "group_id": sa.bindparam(f"g{i}"),
                "event_id": sa.bindparam(f"e{i}"),
                "topic": sa.bindparam(f"t{i}"),
                "kafka_partition": sa.bindparam(f"p{i}"),
                "kafka_offset": sa.bindparam(f"o{i}"),
                "processed_at": db_now(),
            }
            for i in range(n)
        ]
        stmt: sa.Insert
        if postgres:
            stmt = (
                postgresql.insert(self.table)
                .values(rows)
                .on_conflict_do_nothing()
                .returning(self.table.c.group_id)
            )
        else:
            stmt = self.table.insert().values(rows)
        compiled = stmt.compile(dialect=conn.dialect)
        order = tuple(compiled.positiontup or ()) if compiled.positional else None
        cached = self._inserts[(n, postgres)] = (compiled.string, order)
        return cached

    def claim_in_group(self, conn: sa.Connection, message: Message) -> bool:
        """Insert ``message``'s inbox row in the open group transaction.

        False when it did not go in (a duplicate, or a row another transaction
        holds and rolled back), and for a key the inbox itself made (``outboxkit:``:
        the 0.1.0 rules need their own transaction): the group ends before
        this message, which is then claimed in a transaction of its own
        (:meth:`run`). A plain read here would see the group's snapshot, not the
        row as it is now. A duplicate key error ends only the statement on
        MySQL/MariaDB and ``ON CONFLICT DO NOTHING`` raises none on PostgreSQL, so
        the rows already inserted stay and the group can still commit. Any other
        database error is raised: the caller rolls the whole group back.
        """
        return self.claim_all(conn, [message])

    def commit_group(self, conn: sa.Connection) -> None:
        """Commit the group (refused, as :meth:`run` does, if PostgreSQL aborted it)."""
        check_not_aborted(conn)
        conn.commit()
        self._held.used_at = time.monotonic()

    def end_group(self, conn: sa.Connection) -> None:
        """Roll back a group with nothing to keep (its first claim did not go in)."""
        conn.rollback()
        self._held.used_at = time.monotonic()

    def release(self) -> None:
        """Hand the calling thread's connection back to the pool (rolled back)."""
        conn, self._held.conn = self._held.conn, None
        if conn is not None:
            conn.close()

    def _connection(self) -> sa.Connection:
        held = self._held
        if held.conn is not None and time.monotonic() - held.used_at > _IDLE_RECHECK:
            self.release()
        if held.conn is None:
            held.conn = self.engine.connect()
        return held.conn

    def _run(
        self, conn: sa.Connection, message: Message, handler: Callable[[Message], None]
    ) -> bool:
        if self.claim(conn, message):
            return True
        try:
            handler(message.with_tx(conn))
            check_not_aborted(conn)
        except BaseException:
            conn.rollback()
            raise
        conn.commit()
        return False

    def claim(self, conn: sa.Connection, message: Message) -> bool:
        """Begin the message's transaction on ``conn`` and insert its inbox row.

        True: a duplicate (seen before), and no transaction is left open. False:
        the row is inserted and the transaction stays open for the handler; the
        caller commits or rolls it back. The async inbox calls this too, through
        ``AsyncConnection.run_sync``.
        """
        key = inbox_key(message)
        while True:
            tx = conn.begin()
            if key.startswith(RESERVED_PREFIX) and self._seen_as_v1_fallback(conn, message):
                tx.rollback()
                return True
            try:
                inserted = self._insert_rows(conn, [message], [key]) == 1
            except sa.exc.IntegrityError:
                inserted = False
            except sa.exc.OperationalError as exc:
                if not _is_serialization_failure(exc):
                    raise
                inserted = False
            if not inserted:
                tx.rollback()
                seen = self._seen(conn, key)
                if seen is not None and _v1_fallback_of_another_record(seen, message):
                    self._rekey_v1_row(conn, seen)
                    continue  # the row no longer clashes
                if seen is not None:
                    return True
                # The row that clashed was rolled back meanwhile: try again later.
                raise TransientError(
                    "inbox insert clashed with a transaction that rolled back"
                ) from None
            return False

    def _seen(self, conn: sa.Connection, key: str) -> _InboxRow | None:
        t = self.table
        row = conn.execute(
            sa.select(t.c.event_id, t.c.topic, t.c.kafka_partition, t.c.kafka_offset).where(
                t.c.group_id == self._group_key, t.c.event_id == key
            )
        ).first()
        conn.rollback()
        return row

    def _rekey_v1_row(self, conn: sa.Connection, row: _InboxRow) -> None:
        """Give a 0.1.0 fallback row its current key, so an event id can use the old one.

        If the record was also handled since the upgrade (a row under the current key
        exists), the old row is redundant and goes.
        """
        t = self.table
        record = Message(
            topic=row.topic,
            partition=row.kafka_partition,
            offset=row.kafka_offset,
            key=None,
            value=None,
        )
        this = sa.and_(t.c.group_id == self._group_key, t.c.event_id == row.event_id)
        try:
            with conn.begin():
                conn.execute(t.update().where(this).values(event_id=inbox_key(record)))
        except sa.exc.IntegrityError:
            with conn.begin():
                conn.execute(t.delete().where(this))

    def _seen_as_v1_fallback(self, conn: sa.Connection, message: Message) -> bool:
        """Was this very record handled by a release that spelled its key differently?

        0.1.0 stored a record without ``event_id`` as ``topic/partition/offset``,
        which an event id could equal. A row with that key *and* this record's own
        topic, partition and offset can only be this record, so a redelivery across
        the upgrade is still recognised. Only records without a plain event id pay
        this lookup (one primary-key read).
        """
        if message.header(EVENT_ID_HEADER):
            return False
        t = self.table
        legacy = f"{message.topic}/{message.partition}/{message.offset}"[:MAX_INBOX_ID_LENGTH]
        row = conn.execute(
            sa.select(t.c.event_id).where(
                t.c.group_id == self._group_key,
                t.c.event_id == legacy,
                t.c.topic == message.topic,
                t.c.kafka_partition == message.partition,
                t.c.kafka_offset == message.offset,
            )
        ).first()
        return row is not None
