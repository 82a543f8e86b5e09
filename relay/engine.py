"""The relay's database engine, and the check of an engine it is given.

:func:`create_engine` sets up the relay's own: READ COMMITTED (no gap locks in
the claim), a connect timeout, statement timeouts no longer than a lease, and on
PostgreSQL the session settings the claim's plans rely on
(:data:`PG_SESSION_SETTINGS`). :func:`check_session_settings` says at start what
an engine passed to ``Relay(..., engine=...)`` lacks of those.

Apart from the claim (:mod:`outboxkit.relay.claim`): these run once, when the
relay starts, and decide how every statement of the relay runs, not only the
claim's; the claim only relies on them.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outboxkit.relay.settings import RelaySettings
from outboxkit.runtime.db import create_loop_engine
from outboxkit.runtime.logs import log_event
from outboxkit.schema.table import MYSQL_DIALECTS

__all__ = [
    "PG_SESSION_SETTINGS",
    "check_row_image",
    "check_session_settings",
    "create_engine",
    "statement_timeout_s",
]

# The claim's logger, where ``engine-settings`` was logged before these moved
# out of the claim: filters and alerts on the logger's name keep matching.
log = logging.getLogger("outboxkit.relay.claim")


#: What the relay's own engine sets on its PostgreSQL sessions, besides the
#: statement timeout: plans for each run's values (see :func:`create_engine`) and
#: no JIT compilation (``runtime.db.without_jit``).
PG_SESSION_SETTINGS = {"plan_cache_mode": "force_custom_plan", "jit": "off"}
_PG_CUSTOM_PLANS = f"-c plan_cache_mode={PG_SESSION_SETTINGS['plan_cache_mode']}"


def check_session_settings(conn: Connection, *, lease_ttl: float) -> None:
    """Log ``engine-settings`` (a warning) when a PostgreSQL session of an engine
    passed to ``Relay(..., engine=...)`` lacks :data:`PG_SESSION_SETTINGS`, or
    bounds no statement by the lease (``statement_timeout`` off or longer than
    the relay's own engine sets, :func:`statement_timeout_s`).

    That engine is the caller's (other code may share its pool), so the relay
    does not change it; it says once, at start, what differs and the
    ``connect_args`` that set it. Without them the claim can keep a plan made for
    a table that has since grown (docs/postgresql.md, *What differs from MySQL*),
    and a statement stuck on the server can hold the relay past its rows' lease.
    MySQL/MariaDB bound statements on the client (the driver's read timeout),
    which a session cannot report: not checked there."""
    if conn.dialect.name != "postgresql":
        return
    # One read of the session's values; a setting this server does not have is
    # absent (nothing to advise). statement_timeout is in milliseconds there,
    # whatever unit it was set in.
    read = sa.text("SELECT name, setting FROM pg_settings WHERE name IN :names").bindparams(
        sa.bindparam("names", expanding=True)
    )
    current = {
        str(name): str(value)
        for name, value in conn.execute(
            read, {"names": [*PG_SESSION_SETTINGS, "statement_timeout"]}
        )
    }
    wanted = {**PG_SESSION_SETTINGS}
    differing = {
        name: current[name]
        for name in sorted(PG_SESSION_SETTINGS)
        if name in current and current[name] != wanted[name]
    }
    timeout_ms = current.get("statement_timeout")
    limit_s = statement_timeout_s(lease_ttl)
    if timeout_ms is not None and not 0 < int(timeout_ms) <= limit_s * 1000:
        differing["statement_timeout"] = "0 (none)" if int(timeout_ms) == 0 else f"{timeout_ms}ms"
        wanted["statement_timeout"] = f"{limit_s}s"
    if not differing:
        return
    options = " ".join(f"-c {name}={wanted[name]}" for name in differing)
    log_event(
        log,
        "engine-settings",
        level=logging.WARNING,
        differing=differing,
        advice=f'create the engine with connect_args={{"options": "{options}"}}',
        effect="the relay runs; without these its claims may keep plans made for an "
        "emptier table (plan_cache_mode), be compiled on every run at large batches (jit), "
        "or wait on a stuck statement past their rows' lease (statement_timeout)",
    )


def statement_timeout_s(lease_ttl: float) -> int:
    """The longest a relay's statement may run, in whole seconds: a statement that
    outlives a lease is pointless, and a hung server must not hang the loop."""
    return max(1, math.ceil(lease_ttl))


def create_engine(settings: RelaySettings) -> Engine:
    """The relay's engine: READ COMMITTED (no gap locks in the claim), a connect
    timeout, and statement timeouts no longer than a lease.

    MySQL/MariaDB: the driver's ``read_timeout``/``write_timeout`` (client side:
    they also end a wait on a hung server). PostgreSQL: the server's
    ``statement_timeout`` for the relay's sessions (the server cancels the
    statement; the client sets no read timeout of its own).

    PostgreSQL also plans each run of a statement with parameters for its values
    (``plan_cache_mode = force_custom_plan``). psycopg prepares a statement it ran
    five times, and PostgreSQL may then keep one plan for any values, made from
    the table as it was then: on a new table (or one that grew faster than
    autovacuum analyzed it) that plan scanned the whole table to lock and lease a
    batch by primary key, and went on doing so as the table grew, until the next
    ANALYZE (claims 2 ms at first, 6 ms after 10,000 rows). Planning the lock and
    lease statements costs about 0.05 ms each; the candidates statement, which
    has no parameters unless the pipelined relay bounds it, keeps its one plan."""
    assert settings.db_url is not None
    url = sa.make_url(settings.db_url)
    connect_args: dict[str, object] = {}
    timeout = statement_timeout_s(settings.lease_ttl)
    connect_timeout = max(1, math.ceil(settings.connect_timeout))
    backend = url.get_backend_name()
    if backend in MYSQL_DIALECTS:
        connect_args = {
            "connect_timeout": connect_timeout,
            "read_timeout": timeout,
            "write_timeout": timeout,
        }
    elif backend == "postgresql":
        # Appended to any options the URL gives (``?options=...``).
        options = url.query.get("options", "")
        if not isinstance(options, str):
            options = " ".join(options)
        connect_args = {
            "connect_timeout": connect_timeout,
            # Plans made for each run's values (see the docstring).
            "options": f"{options} -c statement_timeout={timeout}s {_PG_CUSTOM_PLANS}".strip(),
        }
    engine = create_loop_engine(
        url,
        pool_size=2,
        max_overflow=2,
        isolation_level="READ COMMITTED",
        connect_args=connect_args,
    )
    if backend in MYSQL_DIALECTS and settings.binlog_row_image != "server":
        sa.event.listen(engine, "connect", _RowImage(settings.binlog_row_image))
    return engine


#: MySQL and MariaDB's "Access denied; you need (at least one of) the ... privilege(s)".
_ER_SPECIFIC_ACCESS_DENIED = 1227

_GRANT_ADVICE = (
    "grant the relay's database user BINLOG ADMIN (MariaDB) or "
    "SESSION_VARIABLES_ADMIN (MySQL 8), or leave --binlog-row-image at server"
)


class _RowImage:
    """Sets ``binlog_row_image`` on each new session of the relay's own engine
    (``--binlog-row-image``). A server that refuses it (the relay's user lacks
    the privilege) keeps its own image for that session, and the relay runs as
    it would without the setting. The first refusal logs ``engine-settings``
    (at start, or later if the privilege is revoked and a session reconnects);
    later ones do not repeat it."""

    def __init__(self, image: str) -> None:
        self.wanted = image
        self.statement = f"SET SESSION binlog_row_image = '{image.upper()}'"
        self._said = threading.Event()

    def __call__(self, dbapi_conn: Any, _record: object) -> None:
        cursor = dbapi_conn.cursor()
        try:
            try:
                cursor.execute(self.statement)
            except Exception as exc:
                if getattr(exc, "args", (None,))[:1] != (_ER_SPECIFIC_ACCESS_DENIED,):
                    raise
                if self._said.is_set():
                    return
                self._said.set()
                cursor.execute("SELECT @@session.binlog_row_image")
                _say_row_image(str(cursor.fetchone()[0]), self.wanted, _GRANT_ADVICE)
        finally:
            cursor.close()


def check_row_image(conn: Connection, *, wanted: str, own_engine: bool) -> None:
    """Log ``engine-settings`` (a warning) when an engine passed to
    ``Relay(..., engine=...)``, which the relay does not change, does not log the
    image ``--binlog-row-image`` asks for. The relay's own engine sets it on
    every session and says itself when the server refuses (:class:`_RowImage`).
    Nothing on PostgreSQL or with ``server``."""
    if own_engine or wanted == "server" or conn.dialect.name not in MYSQL_DIALECTS:
        return
    current = str(conn.execute(sa.text("SELECT @@session.binlog_row_image")).scalar_one())
    if current.lower() == wanted:
        return
    statement = _RowImage(wanted).statement
    advice = f'create the engine with connect_args={{"init_command": "{statement}"}}'
    _say_row_image(current, wanted, advice)


def _say_row_image(current: str, wanted: str, advice: str) -> None:
    log_event(
        log,
        "engine-settings",
        level=logging.WARNING,
        differing={"binlog_row_image": current},
        wanted={"binlog_row_image": wanted.upper()},
        advice=advice,
        effect="the relay runs; its status changes write the server's row images to "
        "the binary log (payload included with FULL)",
    )
