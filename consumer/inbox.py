"""Idempotent handling: the handler's writes and the inbox row commit together.

For each message, one transaction:

1. ``INSERT`` ``(group_id, identity)`` into the inbox table. The primary key
   makes a second consumer of the same event wait for the first one's
   transaction, then fail with a duplicate key;
2. run the handler with ``message.tx`` bound to this transaction;
3. ``COMMIT``.

A crash anywhere before the commit leaves neither the effects nor the inbox
row; a crash after it leaves both, and the redelivered message is then a
duplicate: the handler is skipped. A commit whose outcome is unknown (the
connection dropped during ``COMMIT``) is retried as transient and resolved the
same way. ``identity`` is the ``event_id`` header, else ``topic/partition/offset``.

Each worker thread keeps its connection between messages (checked out of the
pool once, not per message): a checkout costs a pre-ping and a check-in a reset
``ROLLBACK``, two round trips that doubled the cost of a message. The held
connection is handed back after any failure (a broken one is then replaced,
pre-pinged, on the next message), when it sat idle longer than
``_IDLE_RECHECK`` seconds (so a server-side idle timeout does not turn into a
handler retry), and when the worker stops (:meth:`release`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outboxkit.consumer.message import Message
from outboxkit.errors import TransientError
from outboxkit.schema.table import db_now, inbox_table

__all__ = ["Inbox"]

_MAX_ID = 255
_IDLE_RECHECK = 10.0


class _Held(threading.local):
    conn: sa.Connection | None = None
    used_at: float = 0.0


class Inbox:
    def __init__(self, engine: Engine, *, group_id: str, table: str) -> None:
        self.engine = engine
        self.group_id = group_id
        self.table = inbox_table(table)
        self._insert = self.table.insert().values(processed_at=db_now())
        self._held = _Held()

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
        identity = message.identity[:_MAX_ID]
        tx = conn.begin()
        try:
            conn.execute(
                self._insert,
                {
                    "group_id": self.group_id,
                    "event_id": identity,
                    "topic": message.topic,
                    "kafka_partition": message.partition,
                    "kafka_offset": message.offset,
                },
            )
        except sa.exc.IntegrityError:
            tx.rollback()
            if self.seen(conn, identity):
                return True
            # The row that clashed was rolled back meanwhile: try again later.
            raise TransientError(
                "inbox insert clashed with a transaction that rolled back"
            ) from None
        try:
            handler(message.with_tx(conn))
        except BaseException:
            tx.rollback()
            raise
        tx.commit()
        return False

    def seen(self, conn: sa.Connection, identity: str) -> bool:
        t = self.table
        row = conn.execute(
            sa.select(t.c.event_id).where(t.c.group_id == self.group_id, t.c.event_id == identity)
        ).first()
        conn.rollback()
        return row is not None
