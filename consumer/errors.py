"""Consumer errors and how a handler's exception is classified.

The tree, rooted in :class:`~outboxkit.errors.OutboxError`::

    OutboxError
    ├── TransientError          retried in place with backoff
    │   ├── RetryableError      (alias, reads better in handlers)
    │   └── InboxTransactionAborted  the handler caught a database error and
    │                           PostgreSQL aborted the inbox transaction
    └── PermanentError          dead-lettered at once
        └── InvalidMessageError the message cannot be decoded (bad JSON, no value,
                                header names that are not UTF-8)

A handler raises whatever it likes. :func:`classify` decides:

1. a class listed in the consumer's ``permanent_errors`` -> permanent;
2. a class listed in the consumer's ``transient_errors`` -> transient;
3. :class:`PermanentError` -> permanent;
4. infrastructure (:func:`~outboxkit.runtime.errors.is_infrastructure_error`:
   cannot connect, cannot log in, server gone; DB-API ``OperationalError`` /
   ``InterfaceError``, anything raised while a database connection is made,
   such as PyMySQL's ``RuntimeError`` for a MySQL 8 login without
   ``cryptography``) -> unavailable: retried with capped backoff for as long as
   it lasts, **never** dead-lettered, since it is not the message's fault;
5. :class:`TransientError`, ``OSError`` (``ConnectionError``, ``TimeoutError``)
   -> transient;
6. anything else (a bug, a ``KeyError`` on a missing field) -> permanent: a retry
   would fail the same way, and the message waits in the dead-letter topic for a
   fix instead of blocking its partition.
"""

from __future__ import annotations

import enum

from outboxkit.errors import PermanentError, TransientError
from outboxkit.runtime.errors import is_infrastructure_error

__all__ = [
    "Classification",
    "InboxTransactionAborted",
    "InvalidMessageError",
    "RetryableError",
    "classify",
]

RetryableError = TransientError


class InboxTransactionAborted(TransientError):
    """The database aborted the message's inbox transaction after an error the
    handler caught and went past; nothing was committed (``consumer/inbox.py``)."""


class InvalidMessageError(PermanentError, ValueError):
    """The message cannot be decoded as asked (not UTF-8, not JSON, no value)."""


class Classification(enum.Enum):
    TRANSIENT = "transient"  # retried, up to max_attempts / retry_max_time, then dead-lettered
    PERMANENT = "permanent"  # dead-lettered at once
    UNAVAILABLE = "unavailable"  # a dependency is down: retried while it lasts, never dead-lettered


_TRANSIENT_BY_DEFAULT: tuple[type[BaseException], ...] = (TransientError, OSError)


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
    if is_infrastructure_error(exc):
        return Classification.UNAVAILABLE
    if isinstance(exc, _TRANSIENT_BY_DEFAULT):
        return Classification.TRANSIENT
    return Classification.PERMANENT
