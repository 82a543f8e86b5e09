"""Checks of the URL settings: databases, Redis, HTTP endpoints.

A URL setting can carry a password, so every message here says what is wrong
without repeating the URL. The database checks also know which backends each
component runs on (:data:`SERVER_DATABASES`) and which extra installs a missing
driver. Apart from the other value checks because they import SQLAlchemy (lazily)
and are the ones an operator's typo in a password trips over. Re-exported from
:mod:`outboxkit.runtime.settings`.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

_HOST_RE = re.compile(r"[A-Za-z0-9_.\-]*|\[[0-9A-Fa-f:.]+\]", re.ASCII)
_ENCODE_HINT = "percent-encode @ : / ? # in the user name and password (%40 %3A %2F %3F %23)"


def _url_parts_problem(value: str, schemes: tuple[str, ...] | None) -> str | None:
    """Scheme, host and port of a URL; the messages never repeat the URL (a password)."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return f"the port must be a number between 0 and 65535, or {_ENCODE_HINT}"
    if not parts.scheme or not parts.netloc:
        return "must be a URL like scheme://user:password@host:port/path"
    if schemes is not None and parts.scheme.lower() not in schemes:
        return f"unknown scheme {parts.scheme!r}: use {', '.join(schemes)}"
    host = parts.netloc.rpartition("@")[2]
    if port is not None:
        host = host[: host.rfind(":")]
    if not _HOST_RE.fullmatch(host):
        return f"the host part is not a host name: {_ENCODE_HINT}"
    return None


def optional_url(value: str | None) -> str | None:
    if value is None:
        return None
    return _url_parts_problem(value, None)


#: The extra that brings a URL scheme's driver.
_DRIVER_EXTRAS = {
    "postgresql+psycopg": "postgres",
    "mysql+mysqldb": "mysqlclient",
    "mariadb+mysqldb": "mysqlclient",
    "mysql+asyncmy": "async",
    "mariadb+asyncmy": "async",
}


def valid_database_url(value: str | None) -> str | None:
    """A SQLAlchemy URL whose dialect and driver are installed, with a plain host.

    An unencoded ``@`` in the password makes SQLAlchemy take the rest of the
    password for the host (and print it in errors); that is refused here with
    a message that never repeats the URL.
    """
    if value is None:
        return None
    import sqlalchemy as sa
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = sa.make_url(value)
    except ValueError:  # a port that is not a number
        return f"the port must be a number between 0 and 65535, or {_ENCODE_HINT}"
    except ArgumentError:
        return f"not a SQLAlchemy URL like mysql+pymysql://user:pw@host:3306/db; {_ENCODE_HINT}"
    if url.host is not None and not _HOST_RE.fullmatch(url.host):
        return f"the host part is not a host name: {_ENCODE_HINT}"
    if url.port is not None and not 0 <= url.port <= 65535:
        return "the port must be a number between 0 and 65535"
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        return (
            f"unknown database scheme {url.drivername!r} "
            "(e.g. mysql+pymysql, postgresql+psycopg, sqlite)"
        )
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        extra = _DRIVER_EXTRAS.get(url.drivername)
        # outboxkit is not on the package index yet: name the extra and the
        # command that works from a clone (README, "Installing").
        hint = (
            f"; install outboxkit with its {extra!r} extra (in a clone: pip install '.[{extra}]')"
            if extra
            else ""
        )
        return f"the driver of {url.drivername!r} is not installed ({exc.name or exc}){hint}"
    return None


#: The databases the relay, the consumer inbox and ``outboxkit admin`` run on
#: (SQLAlchemy backend names). SQLite serves ``schema apply`` and the writer only:
#: the claim needs ``FOR UPDATE SKIP LOCKED`` and server-clock arithmetic.
SERVER_DATABASES = ("mysql", "mariadb", "postgresql")


def is_postgresql_url(value: str) -> bool:
    """Does this SQLAlchemy URL name PostgreSQL (any driver)? False if it is not a URL."""
    return database_backend(value) == "postgresql"


def database_backend(value: str) -> str | None:
    """The backend a SQLAlchemy URL names (``mysql``, ``postgresql``...); None if no URL."""
    import sqlalchemy as sa
    from sqlalchemy.exc import ArgumentError

    try:
        return sa.make_url(value).get_backend_name()
    except (ArgumentError, ValueError):
        return None


def unsupported_database(backend: str, component: str) -> str | None:
    """Why ``component`` cannot use a ``backend`` database, or None when it can."""
    if backend in SERVER_DATABASES:
        return None
    return (
        f"{component} runs on MySQL/MariaDB or PostgreSQL, not {backend} "
        "(e.g. mysql+pymysql://user:pw@host:3306/db, postgresql+psycopg://user:pw@host:5432/db)"
    )


def _valid_server_database_url(value: str | None, component: str) -> str | None:
    """:func:`valid_database_url` for a server component: another database (SQLite)
    is refused by name, before its driver is even looked for."""
    if value is not None and _known_dialect(value):
        backend = database_backend(value)
        if backend is not None:
            problem = unsupported_database(backend, component)
            if problem is not None:
                return problem
    return valid_database_url(value)


def _known_dialect(value: str) -> bool:
    """SQLAlchemy knows the URL's database (its driver may still be missing); an
    unknown scheme is left to :func:`valid_database_url`'s message."""
    import sqlalchemy as sa
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        sa.make_url(value).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError, ImportError):
        return False
    return True


def valid_relay_database_url(value: str | None) -> str | None:
    return _valid_server_database_url(value, "the relay")


def valid_server_database_url(value: str | None) -> str | None:
    """For ``outboxkit admin``."""
    return _valid_server_database_url(value, "outboxkit admin")


def valid_redis_url(value: str | None) -> str | None:
    if value is None:
        return None
    return _url_parts_problem(value, ("redis", "rediss", "unix"))


def valid_http_url(value: str | None) -> str | None:
    if value is None:
        return None
    return _url_parts_problem(value, ("http", "https"))
