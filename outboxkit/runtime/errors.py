"""The exception tree shared by every outboxkit component.

Transient errors are worth retrying, permanent ones are not; tenacity policies are
driven by ``retry_if_exception_type(TransientError)``.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Root of every error raised by outboxkit."""


class TransientError(OutboxError):
    """A retry may help (a dependency was briefly unreachable, a timeout)."""


class PermanentError(OutboxError):
    """A retry will not help (bad data, a bug, a refused request)."""


class ConfigError(OutboxError, ValueError):
    """A setting or CLI argument is invalid; the CLI exits with EXIT_CONFIG."""


class DependencyError(TransientError):
    """A dependency (DB, Kafka, Redis, the health port) is unreachable."""
