"""Consumer errors and how a handler's exception is classified.

The tree, rooted in :class:`~outboxkit.errors.OutboxError`::

    OutboxError
    ├── TransientError          retried in place with backoff
    │   └── RetryableError      (alias, reads better in handlers)
    └── PermanentError          dead-lettered at once
        └── InvalidMessageError the message cannot be decoded (bad JSON, no value)

A handler raises whatever it likes. :func:`classify` decides:

1. a class listed in the consumer's ``permanent_errors`` -> permanent;
2. a class listed in the consumer's ``transient_errors`` -> transient;
3. :class:`PermanentError` -> permanent, :class:`TransientError` -> transient;
4. connection trouble: ``OSError`` (``ConnectionError``, ``TimeoutError``) and
   SQLAlchemy's ``OperationalError``/``DisconnectionError``/pool ``TimeoutError``
   -> transient;
5. anything else (a bug, a ``KeyError`` on a missing field) -> permanent: a retry
   would fail the same way, and the message waits in the dead-letter topic for a
   fix instead of blocking its partition.
"""

from __future__ import annotations

import enum

import sqlalchemy.exc as sa_exc

from outboxkit.errors import PermanentError, TransientError

__all__ = [
    "Classification",
    "InvalidMessageError",
    "RetryableError",
    "classify",
]

RetryableError = TransientError


class InvalidMessageError(PermanentError, ValueError):
    """The message cannot be decoded as asked (not UTF-8, not JSON, no value)."""


class Classification(enum.Enum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"


_TRANSIENT_BY_DEFAULT: tuple[type[BaseException], ...] = (
    TransientError,
    OSError,
    sa_exc.OperationalError,
    sa_exc.DisconnectionError,
    sa_exc.TimeoutError,
)


def classify(
    exc: BaseException,
    *,
    transient: tuple[type[BaseException], ...] = (),
    permanent: tuple[type[BaseException], ...] = (),
) -> Classification:
    """Transient or permanent, by the rules in the module docstring (first match wins)."""
    if permanent and isinstance(exc, permanent):
        return Classification.PERMANENT
    if transient and isinstance(exc, transient):
        return Classification.TRANSIENT
    if isinstance(exc, PermanentError):
        return Classification.PERMANENT
    if isinstance(exc, _TRANSIENT_BY_DEFAULT):
        return Classification.TRANSIENT
    return Classification.PERMANENT
