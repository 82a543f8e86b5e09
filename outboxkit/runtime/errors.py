"""The exception tree shared by every outboxkit component.

``TransientError`` means "retrying may help" and ``PermanentError`` means it
will not, so retry policies can be written as
``retry_if_exception_type(TransientError)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlalchemy as sa

__all__ = [
    "ConfigError",
    "DependencyError",
    "OutboxError",
    "PermanentError",
    "TransientError",
    "database_unreachable",
    "is_infrastructure_error",
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


# DB-API (PEP 249) classes that mean "the connection, not the statement": every
# driver names them so, wrapped by SQLAlchemy or not.
_DBAPI_CONNECTION_ERRORS = frozenset({"OperationalError", "InterfaceError"})
# Code that only runs while a connection is being made, checked out or pinged. A
# driver may raise anything there; PyMySQL raises a bare RuntimeError when a
# caching_sha2_password login needs `cryptography` and it is missing (MySQL 8's
# default authentication, after a server restart empties its cache), and
# SQLAlchemy does not wrap it.
_CONNECTING_MODULES = ("sqlalchemy.pool", "pymysql._auth")
_CONNECTING_FUNCTIONS = frozenset(
    {
        ("pymysql.connections", "connect"),
        ("pymysql.connections", "_request_authentication"),
        ("psycopg.connection", "connect"),
    }
)


def is_infrastructure_error(exc: BaseException) -> bool:
    """Is ``exc`` a dependency's failure (cannot connect, cannot log in, server gone)?

    True for :class:`DependencyError`, for DB-API ``OperationalError`` /
    ``InterfaceError`` (wrapped by SQLAlchemy or raw from the driver), for
    SQLAlchemy's ``DisconnectionError``, pool ``TimeoutError`` and errors that
    invalidated the connection, and for **any** exception raised while a
    database connection was being established, checked out or pinged (the
    traceback passes through SQLAlchemy's pool or the driver's connect code).
    Such an error is never the fault of the message or row being worked on.
    """
    if isinstance(exc, DependencyError):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _DBAPI_CONNECTION_ERRORS and type(exc).__module__ != "builtins":
        return True
    if type(exc).__module__.startswith("sqlalchemy") and (
        names & {"DisconnectionError", "TimeoutError"}
        or getattr(exc, "connection_invalidated", False)
    ):
        return True
    return _raised_while_connecting(exc.__traceback__)


def _raised_while_connecting(tb: TracebackType | None) -> bool:
    while tb is not None:
        code = tb.tb_frame.f_code
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if (
            module.startswith(_CONNECTING_MODULES)
            or (module, code.co_name) in _CONNECTING_FUNCTIONS
        ):
            return True
        tb = tb.tb_next
    return False


def database_unreachable(
    exc: BaseException, url: str | sa.URL | None = None
) -> DependencyError | ConfigError:
    """The error for a database that failed a start-up check: the driver's own
    error (unwrapped from SQLAlchemy's), secrets masked. A :class:`DependencyError`
    (the server is away or failing: a restart may find it back), or, given the
    ``url`` (a string or ``sqlalchemy.URL``) and an error that says the URL is
    wrong (a login refused, a database that does not exist), a
    :class:`ConfigError` that says what to fix: no restart mends those."""
    from outboxkit.runtime.db import database_url_problem
    from outboxkit.runtime.logs import redact

    if url is not None:
        problem = database_url_problem(exc, url)
        if problem is not None:
            return ConfigError(problem)
    cause = getattr(exc, "orig", None) or exc
    return DependencyError(f"database unreachable: {redact(f'{type(cause).__name__}: {cause}')}")
