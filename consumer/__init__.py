"""Consume outbox events: a base class that commits an offset only after processing.

See ``docs/consumer.md``.
"""

from typing import TYPE_CHECKING

# Imported on first use (outboxkit._lazy): the command line needs the settings,
# not the consumer with Kafka, tenacity and Prometheus.
if TYPE_CHECKING:
    from outboxkit.consumer.base import Consumer
    from outboxkit.consumer.dlq import DeadLetterUnavailable
    from outboxkit.consumer.errors import (
        Classification,
        InboxTransactionAborted,
        InvalidMessageError,
        RetryableError,
    )
    from outboxkit.consumer.message import EVENT_ID_HEADER, Message
    from outboxkit.consumer.settings import ConsumerSettings
    from outboxkit.errors import PermanentError, TransientError
else:
    from outboxkit._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            "outboxkit.consumer.base": ("Consumer",),
            "outboxkit.consumer.dlq": ("DeadLetterUnavailable",),
            "outboxkit.consumer.errors": (
                "Classification",
                "InboxTransactionAborted",
                "InvalidMessageError",
                "RetryableError",
            ),
            "outboxkit.consumer.message": ("EVENT_ID_HEADER", "Message"),
            "outboxkit.consumer.settings": ("ConsumerSettings",),
            "outboxkit.errors": ("PermanentError", "TransientError"),
        },
    )

__all__ = [
    "EVENT_ID_HEADER",
    "Classification",
    "Consumer",
    "ConsumerSettings",
    "DeadLetterUnavailable",
    "InboxTransactionAborted",
    "InvalidMessageError",
    "Message",
    "PermanentError",
    "RetryableError",
    "TransientError",
]
