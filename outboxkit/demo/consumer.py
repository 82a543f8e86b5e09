"""The example consumer: ships each placed order exactly once.

Run it as ``outboxkit consume outboxkit.demo:OrderConsumer``. With the inbox on
(``OUTBOXKIT_INBOX=true`` and ``OUTBOXKIT_DB_URL``) each message writes its
shipment through ``message.tx``, the same transaction as the inbox row, so a
redelivered event is skipped rather than shipped twice. Without the inbox it only
validates the event (a stateless consumer; nothing to deduplicate).
"""

from __future__ import annotations

import logging

import sqlalchemy as sa

from outboxkit.consumer import Consumer, InvalidMessageError, Message
from outboxkit.demo.tables import create_tables, shipments
from outboxkit.schema.table import db_now

__all__ = ["OrderConsumer"]

_log = logging.getLogger("outboxkit.demo.consumer")


class OrderConsumer(Consumer):
    topics = ("orders",)
    group_id = "outboxkit-demo"

    def on_start(self) -> None:
        """With the inbox on, make sure the shipments table exists (idempotent)."""
        if self.settings.inbox and self.settings.db_url:
            engine = sa.create_engine(self.settings.db_url)
            try:
                create_tables(engine)
            finally:
                engine.dispose()

    def handle(self, message: Message) -> None:
        event = message.json()
        if not isinstance(event, dict) or not isinstance(event.get("order_id"), str):
            # The message's fault: retrying cannot help, so it goes to orders.dlq.
            raise InvalidMessageError("not an order-placed event: no order_id")
        if not self.settings.inbox:
            return
        message.tx.execute(
            shipments.insert().values(
                order_id=event["order_id"],
                event_id=message.event_id or "",
                kafka_partition=message.partition,
                kafka_offset=message.offset,
                shipped_at=db_now(),
            )
        )
