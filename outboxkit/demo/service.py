"""The example order service: an order and its event, committed together.

This is the whole point of the outbox: ``place_order`` inserts the order row and
enqueues the ``orders`` event in *one* database transaction. Either both exist
or neither does, so no order is ever missing its event and no event announces an
order that was rolled back; the relays publish the event afterwards.
"""

from __future__ import annotations

import random
import uuid

from sqlalchemy.engine import Connection

from outboxkit.demo.tables import orders
from outboxkit.schema.table import DEFAULT_TABLE, db_now
from outboxkit.writer import enqueue

__all__ = ["place_order"]


def place_order(
    conn: Connection,
    *,
    run_id: str,
    customer: str | None = None,
    topic: str = "orders",
    table: str = DEFAULT_TABLE,
) -> str:
    """Insert one order and its ``order-placed`` event in the caller's transaction.

    The event is keyed by customer, so one customer's orders are delivered in the
    order they were placed. Returns the order id.
    """
    order_id = str(uuid.uuid4())
    who = customer or f"customer-{random.randrange(100)}"
    amount = random.randrange(100, 100_000)
    event_id = enqueue(
        conn,
        topic=topic,
        key=who,
        payload={
            "type": "order-placed",
            "order_id": order_id,
            "customer": who,
            "amount_cents": amount,
            "run_id": run_id,
        },
        headers={"type": "order-placed"},
        table=table,
    )
    conn.execute(
        orders.insert().values(
            order_id=order_id,
            run_id=run_id,
            customer=who,
            amount_cents=amount,
            event_id=event_id,
            created_at=db_now(),
        )
    )
    return order_id
