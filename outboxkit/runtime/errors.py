"""The exception tree shared by every outboxkit component.

``TransientError`` means "retrying may help" and ``PermanentError`` means it
will not, so retry policies can be written as
``retry_if_exception_type(TransientError)``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ConfigError",
    "DependencyError",
    "OutboxError",
    "PermanentError",
    "TransientError",
]


class OutboxError(Exception):
    """Root of every exception outboxkit raises on purpose."""


class TransientError(OutboxError):
    """A failure that a later retry may not see (timeouts, broker failover)."""


class PermanentError(OutboxError):
    """A failure that retrying cannot fix (bad input, a row that cannot be sent)."""


class ConfigError(OutboxError, ValueError):
    """Bad settings or CLI input; entry points exit with ``EXIT_CONFIG``.

    ``errors`` holds one message per bad setting, each naming the flag and the
    environment variable, so all problems are reported in one go.
    """

    def __init__(self, *args: object, errors: Sequence[str] | None = None) -> None:
        if not args and errors:
            args = ("\n".join(errors),)
        super().__init__(*args)
        self.errors: list[str] = list(errors) if errors else [str(args[0]) if args else ""]


class DependencyError(TransientError):
    """A dependency is unreachable: database, Kafka, Redis, or a port already in use."""
