"""Dedicated PostgreSQL sessions of the relay: the ``LISTEN`` connection and the
shard-ownership connection (see :mod:`outboxkit.relay.pg_wakeup` and
:mod:`outboxkit.relay.ownership.advisory_locks`).

Both are one psycopg connection each, in autocommit, outside the relay's
SQLAlchemy pool: a pooled connection could be handed back and reused, and
``LISTEN`` and session advisory locks belong to one server session for its whole
life. Behind PgBouncer in transaction pooling mode neither works (the server
session changes under the client); point these at the server or a
session-pooling port.

TCP keepalives and a user timeout let a session whose network path broke be
noticed in seconds rather than after the kernel's two-hour default.

Reconnects back off exponentially from ``min_s`` to ``max_s`` (tenacity), and
the backoff starts again from ``min_s`` after the session was up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import sqlalchemy as sa
import tenacity

from outboxkit.runtime.logs import Episode, redact, redact_url

if TYPE_CHECKING:
    import psycopg

__all__ = ["ReconnectLoop", "connect", "describe_error", "log_closing_failure", "masked_url"]

#: Bounded so a stale session is noticed within about ten seconds.
_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}
#: PostgreSQL's limit for application_name (longer names are truncated).
_MAX_APP_NAME = 63


def _conninfo(db_url: str) -> str:
    """A libpq URI from a SQLAlchemy URL (``postgresql+psycopg://`` -> ``postgresql://``)."""
    url = sa.make_url(db_url)
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def masked_url(db_url: str) -> str:
    """The URL as it may appear in logs: the password masked."""
    return redact_url(db_url)


def describe_error(exc: BaseException) -> str:
    return redact(f"{type(exc).__name__}: {exc}".strip())


def connect(db_url: str, *, application_name: str, connect_timeout: float) -> psycopg.Connection:
    """A new autocommit session to the database of ``db_url``."""
    import psycopg

    return psycopg.connect(
        _conninfo(db_url),
        autocommit=True,
        connect_timeout=max(1, round(connect_timeout)),
        application_name=application_name[:_MAX_APP_NAME],
        **_KEEPALIVES,  # type: ignore[arg-type]
    )


class ReconnectLoop:
    """Run ``session()`` until ``stop`` is set; when it raises, log the outage once
    (``down`` episode), wait with exponential backoff (reset by :meth:`up`), and
    run it again. ``session`` returns normally only when it was asked to stop."""

    def __init__(
        self,
        session: Callable[[], None],
        *,
        stop: threading.Event,
        down: Episode,
        fields: Callable[[], dict[str, object]],
        min_s: float = 0.1,
        max_s: float = 5.0,
    ) -> None:
        self._session = session
        self._stop = stop
        self._down = down
        self._fields = fields
        self._min_s = min_s
        self._max_s = max_s
        self._failures = 0

    def up(self, **fields: object) -> None:
        """The session is established: reset the backoff and close the outage."""
        self._failures = 0
        self._down.end(**fields)

    def _wait(self, _state: tenacity.RetryCallState) -> float:
        return float(min(self._max_s, self._min_s * 2.0**self._failures))

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        self._failures += 1
        exc = state.outcome.exception() if state.outcome is not None else None
        error = describe_error(exc) if exc is not None else "unknown"
        self._down.begin(error=error, **self._fields())

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)  # a stop ends the wait (and the retries)

    def run(self) -> None:
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(Exception),
            wait=self._wait,
            stop=lambda _state: self._stop.is_set(),
            sleep=self._sleep,
            before_sleep=self._before_sleep,
            retry_error_callback=lambda _state: None,
        )
        retrying(self._session)


def log_closing_failure(logger: logging.Logger, what: str, exc: BaseException) -> None:
    logger.debug("closing the %s session failed: %s", what, describe_error(exc))
