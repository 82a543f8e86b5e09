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
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outboxkit.consumer.message import Message
from outboxkit.errors import TransientError
from outboxkit.schema.table import db_now, inbox_table

__all__ = ["Inbox"]

_MAX_ID = 255


class Inbox:
    def __init__(self, engine: Engine, *, group_id: str, table: str) -> None:
        self.engine = engine
        self.group_id = group_id
        self.table = inbox_table(table)

    def run(self, message: Message, handler: Callable[[Message], None]) -> bool:
        """Run ``handler`` once per ``(group_id, identity)``. True if it was a duplicate."""
        identity = message.identity[:_MAX_ID]
        with self.engine.connect() as conn:
            tx = conn.begin()
            try:
                conn.execute(
                    self.table.insert().values(
                        group_id=self.group_id,
                        event_id=identity,
                        topic=message.topic,
                        kafka_partition=message.partition,
                        kafka_offset=message.offset,
                        processed_at=db_now(),
                    )
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
