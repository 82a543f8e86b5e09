"""outboxkit: the transactional outbox for MySQL/MariaDB and Kafka.

Services call :func:`enqueue` inside their own transaction; ``outboxkit relay``
publishes the rows to Kafka at least once, in per-key order; consumers subclass
``outboxkit.consumer.Consumer``.
"""

from outboxkit._version import __version__
from outboxkit.errors import (
    ConfigError,
    DuplicateEventIdError,
    EnqueueError,
    InvalidEventIdError,
    InvalidHeadersError,
    InvalidKeyError,
    InvalidTopicError,
    OutboxError,
    PayloadTooLargeError,
    PermanentError,
    SchemaNotAppliedError,
    TransientError,
    UnserializablePayloadError,
)
from outboxkit.wakeup import enable_wakeups, notify_relays
from outboxkit.writer import (
    Event,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
    uuid7,
)

__all__ = [
    "ConfigError",
    "DuplicateEventIdError",
    "EnqueueError",
    "Event",
    "InvalidEventIdError",
    "InvalidHeadersError",
    "InvalidKeyError",
    "InvalidTopicError",
    "OutboxError",
    "PayloadTooLargeError",
    "PermanentError",
    "SchemaNotAppliedError",
    "TransientError",
    "UnserializablePayloadError",
    "__version__",
    "enable_wakeups",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "notify_relays",
    "uuid7",
]
