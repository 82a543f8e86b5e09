"""Consume outbox events: a base class that commits an offset only after processing.

See ``docs/consumer.md``.
"""

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
