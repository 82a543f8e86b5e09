"""Public exception tree.

``OutboxError`` is the root.  Writer validation errors derive from
``EnqueueError``, which is also a ``ValueError``: they are raised *before*
anything is written, so the caller's transaction is left untouched.
"""

from __future__ import annotations

from outboxkit.runtime.errors import (
    ConfigError,
    DependencyError,
    OutboxError,
    PermanentError,
    TransientError,
)

__all__ = [
    "ConfigError",
    "DependencyError",
    "DuplicateEventIdError",
    "EnqueueError",
    "InvalidEventIdError",
    "InvalidHeadersError",
    "InvalidIdentifierError",
    "InvalidKeyError",
    "InvalidTopicError",
    "OutboxError",
    "PayloadTooLargeError",
    "PermanentError",
    "SchemaError",
    "SchemaMetaError",
    "SchemaNotAppliedError",
    "TransientError",
    "UnserializablePayloadError",
]


class EnqueueError(OutboxError, ValueError):
    """An event handed to ``enqueue`` is invalid; nothing was written."""


class InvalidTopicError(EnqueueError):
    """Empty topic, a character outside ``[a-zA-Z0-9._-]``, over 249 chars, or ``.``/``..``."""


class PayloadTooLargeError(EnqueueError):
    """The serialised payload is larger than the configured limit."""


class UnserializablePayloadError(EnqueueError):
    """The payload is not bytes, str, or a JSON-serialisable object."""


class InvalidHeadersError(EnqueueError):
    """Headers are not a mapping of non-empty str names to str/bytes values."""


class InvalidKeyError(EnqueueError):
    """The message key is not str/bytes/None or is longer than its column."""


class InvalidEventIdError(EnqueueError):
    """A caller-supplied event id is malformed."""


class DuplicateEventIdError(InvalidEventIdError):
    """One ``enqueue_many`` call names the same event id twice; nothing was written."""


class SchemaError(OutboxError):
    """Base for problems with the outbox schema itself."""


class InvalidIdentifierError(SchemaError, ConfigError):
    """A table name is not a safe SQL identifier."""


class SchemaNotAppliedError(SchemaError, PermanentError):
    """The outbox table (or its metadata row) does not exist: run ``outboxkit schema apply``."""


class SchemaMetaError(SchemaError, ConfigError):
    """A table's row in ``outboxkit_meta`` holds what this code cannot work with.

    A shard count outside ``1..MAX_SHARDS`` (``schema apply`` never stores one: the
    row was changed by hand), or a schema version newer than this package knows
    (a later outboxkit upgraded the table: upgrade this package). The message
    names the row, the value and the fix. Entry points exit with ``EXIT_CONFIG``.
    """
