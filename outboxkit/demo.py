"""A tiny example consumer: ``outboxkit consume outboxkit.demo:OrderConsumer``.

It reads the ``orders`` topic and logs each event; the deployment examples run it.
"""

from __future__ import annotations

import logging

from outboxkit.consumer import Consumer, Message
from outboxkit.runtime.logs import log_event

__all__ = ["OrderConsumer"]

_log = logging.getLogger("outboxkit.demo")


class OrderConsumer(Consumer):
    """Logs every order event it receives (group ``outboxkit-demo``)."""

    topics = ("orders",)
    group_id = "outboxkit-demo"

    def handle(self, message: Message) -> None:
        order = message.json()
        log_event(
            _log,
            "order-received",
            event_id=message.event_id,
            partition=message.partition,
            offset=message.offset,
            order_id=order.get("id") if isinstance(order, dict) else None,
        )
