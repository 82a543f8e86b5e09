"""The async consumer of the example: one invoice per placed order, exactly once.

``async def handle`` runs on the consumer's event loop; with the inbox on, the
invoice is written through ``message.async_tx`` and commits together with the
inbox row, so a redelivered event (a crash, a rebalance) is recognised and
skipped instead of invoicing the order twice.

Run it with ``outboxkit consume invoicing:Invoicing --inbox --db-url ...``
(a ``mysql+pymysql://`` URL is turned into ``mysql+asyncmy://`` for it).
"""

from __future__ import annotations

from order_tables import invoices

from outboxkit.consumer import Consumer, Message


class Invoicing(Consumer):
    topics = ("orders",)
    group_id = "invoicing"
    concurrency = 4  # up to 4 customers at once; each customer's events in order

    async def handle(self, message: Message) -> None:
        event = message.json()
        if event.get("type") != "order-placed":
            return  # not ours to invoice; the offset still moves on
        await message.async_tx.execute(
            invoices.insert().values(
                order_id=event["order_id"],
                customer=event["customer"],
                amount_cents=event["amount_cents"],
                event_id=message.event_id or "",
            )
        )
