"""Connection habits: the engine of the relay's and the inbox's loops
(:func:`create_loop_engine`), and the connection of the code that changes rows
outside the relay loop (admin commands and retention)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import PoolResetState

__all__ = [
    "PING_AFTER_IDLE_S",
    "create_loop_engine",
    "database_url_problem",
    "deadlocked",
    "driver_message",
    "gentle_connection",
    "lock_wait_bound",
    "lock_wait_timed_out",
    "serialization_failed",
    "transaction_open",
    "without_jit",
]


@contextmanager
def gentle_connection(engine: Engine) -> Iterator[Connection]:
    """A connection at READ COMMITTED where the database has it.

    Under InnoDB's default REPEATABLE READ, locking reads and DELETEs take gap
    locks that can make the service's inserts and the relay's status changes
    wait; READ COMMITTED locks only the rows actually read or changed.
    """
    with engine.connect() as conn:
        if conn.dialect.name in ("mysql", "mariadb", "postgresql"):
            conn = conn.execution_options(isolation_level="READ COMMITTED")
        yield conn


#: The MySQL/MariaDB variables that bound a lock wait: row locks, metadata (table) locks.
_MYSQL_LOCK_WAITS = ("innodb_lock_wait_timeout", "lock_wait_timeout")


@contextmanager
def lock_wait_bound(conn: Connection, seconds: int, *, mysql_variable: str) -> Iterator[None]:
    """Within the block, this session waits at most ``seconds`` for any one lock
    another session holds; the statement then fails (:func:`lock_wait_timed_out`).

    PostgreSQL: ``lock_timeout`` (row and table locks alike; none by default).
    MySQL/MariaDB: ``mysql_variable``, ``innodb_lock_wait_timeout`` for row locks
    (50 s by default) or ``lock_wait_timeout`` for table locks (a year). A
    shorter bound the session already has is kept. The setting is the
    session's and committed, so a rollback inside the block keeps it; at the end
    the session's own value is put back, before the connection returns to the
    pool. Other dialects: nothing.
    """
    if mysql_variable not in _MYSQL_LOCK_WAITS:
        raise ValueError(f"mysql_variable must be one of {_MYSQL_LOCK_WAITS}")
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 1:
        raise ValueError(f"seconds must be an integer >= 1 (got {seconds!r})")
    dialect = conn.dialect.name
    if dialect in ("mysql", "mariadb"):
        read, unit = f"SELECT @@SESSION.{mysql_variable}", 1
        assign = f"SET SESSION {mysql_variable} = {{}}"
    elif dialect == "postgresql":  # pg_settings gives milliseconds, 0 for none
        read, unit = "SELECT setting FROM pg_settings WHERE name = 'lock_timeout'", 1000
        assign = "SET lock_timeout = {}"
    else:
        yield
        return
    before = int(conn.execute(sa.text(read)).scalar_one())
    bound = seconds * unit
    if 0 < before <= bound:
        conn.commit()
        yield
        return
    conn.execute(sa.text(assign.format(bound)))
    conn.commit()
    try:
        yield
    finally:
        conn.rollback()
        conn.execute(sa.text(assign.format(before)))
        conn.commit()


#: A pooled connection that sat in the pool longer than this is pinged before use:
#: shorter than the relay's idle poll (1 s), so a quiet relay pings as before;
#: longer than the gaps of a busy loop (milliseconds), which skips it.
PING_AFTER_IDLE_S = 0.25

_IDLE_SINCE = "outboxkit_idle_since"


def create_loop_engine(
    url: str | sa.URL, *, ping_after_idle: float = PING_AFTER_IDLE_S, **kwargs: Any
) -> Engine:
    """``sqlalchemy.create_engine`` for a loop that takes a connection from the
    pool for every short transaction (the relay's claim and finalize, the
    consumer's inbox), many times a second.

    Two habits of the default pool cost a round trip each per transaction, and on
    a virtual machine a round trip is mostly system CPU (about 0.7 ms of the
    relay's 2 ms of CPU per small finalize on PostgreSQL):

    - ``pool_pre_ping`` pings on every checkout. Here only a connection that sat
      in the pool for more than ``ping_after_idle`` seconds is pinged; a dead one
      is replaced before use (``DisconnectionError`` makes the pool reconnect).
      A connection used a moment ago is not: if the server went away in between,
      the first statement fails like any statement of a server that goes away
      mid-transaction, and the pool is invalidated as usual.
    - Reset on return sends ``ROLLBACK`` even after a commit. Here the driver is
      asked whether a transaction is open (PyMySQL's server status flags,
      psycopg's transaction status, both from the server's last reply) and the
      connection is rolled back only then, or when the driver cannot tell.

    On PostgreSQL its sessions run with ``jit = off`` (:func:`without_jit`).
    """
    engine = sa.create_engine(url, pool_pre_ping=False, pool_reset_on_return=None, **kwargs)
    dialect = engine.dialect
    if dialect.name == "postgresql":
        sa.event.listen(engine, "do_connect", without_jit)

    def on_checkin(dbapi_connection: Any, record: Any) -> None:
        if record is not None:
            record.info[_IDLE_SINCE] = time.monotonic()

    def on_checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.get(_IDLE_SINCE)
        idle = time.monotonic() - since if since is not None else 0.0
        if idle < ping_after_idle:
            return
        try:
            dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise sa.exc.DisconnectionError(
                f"a pooled connection idle for {idle:.1f} s failed its ping "
                f"({type(exc).__name__}); reconnecting"
            ) from exc

    def on_reset(dbapi_connection: Any, record: Any, state: PoolResetState) -> None:
        if state.transaction_was_reset or not state.asyncio_safe:
            return  # rolled back by the Connection already / no I/O allowed here
        if transaction_open(dbapi_connection) is False:
            return
        dbapi_connection.rollback()

    sa.event.listen(engine.pool, "checkin", on_checkin)
    sa.event.listen(engine.pool, "checkout", on_checkout)
    sa.event.listen(engine.pool, "reset", on_reset)
    return engine


def without_jit(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
    """``do_connect``: open the PostgreSQL session with ``jit = off``, after any
    ``options`` of the URL (a later ``-c`` wins).

    PostgreSQL compiles a statement whose estimated cost passes
    ``jit_above_cost`` (100,000 by default) to machine code, on every run: 0.5-1 s
    for the claim's candidates statement, which runs in a few milliseconds. Its
    per-key checks are subplans run once per candidate, so its estimate grows
    with the batch size (about 46 per row on a 100,000-row table: past 100,000
    from about 2,200 rows).
    """
    extra = "-c jit=off"
    given = cparams.get("options")
    cparams["options"] = f"{given} {extra}" if given else extra


def transaction_open(dbapi_connection: Any) -> bool | None:
    """Whether the server said, in its last reply, that a transaction is open on
    this DBAPI connection; None when the driver does not tell (then assume so)."""
    status = getattr(dbapi_connection, "server_status", None)  # PyMySQL
    if isinstance(status, int):
        return bool(status & _MYSQL_IN_TRANS)
    info = getattr(dbapi_connection, "info", None)  # psycopg 3
    state = getattr(info, "transaction_status", None)
    if state is not None:
        return bool(state != 0)  # psycopg.pq.TransactionStatus.IDLE
    return None


#: MySQL protocol ``SERVER_STATUS_IN_TRANS``.
_MYSQL_IN_TRANS = 0x0001


#: MySQL/MariaDB error numbers (PyMySQL, asyncmy): a lock wait that gave up (row and
#: metadata locks alike), a deadlock.
_MYSQL_LOCK_WAIT_TIMEOUT, _MYSQL_DEADLOCK = 1205, 1213
#: PostgreSQL SQLSTATEs (psycopg): ``lock_not_available`` (``lock_timeout``), ``deadlock_detected``.
_PG_LOCK_NOT_AVAILABLE, _PG_DEADLOCK = "55P03", "40P01"
#: PostgreSQL's ``serialization_failure``; MySQL's deadlock shares the SQLSTATE,
#: which is why ``_server_code`` gives MySQL's error number instead.
_PG_SERIALIZATION_FAILURE = "40001"


def lock_wait_timed_out(exc: BaseException) -> bool:
    """``exc`` is a statement that gave up waiting for a lock another session holds:
    MySQL/MariaDB error 1205 (``innodb_lock_wait_timeout``, ``lock_wait_timeout``),
    PostgreSQL's ``lock_timeout``. Nothing of the statement was done."""
    return _server_code(exc) in (_MYSQL_LOCK_WAIT_TIMEOUT, _PG_LOCK_NOT_AVAILABLE)


def deadlocked(exc: BaseException) -> bool:
    """``exc`` is the server ending a deadlock by failing this side of it (both
    databases roll back that side's transaction)."""
    return _server_code(exc) in (_MYSQL_DEADLOCK, _PG_DEADLOCK)


def serialization_failed(exc: BaseException) -> bool:
    """``exc`` is PostgreSQL refusing, at REPEATABLE READ, to change a row another
    transaction changed and committed after this one's snapshot was taken
    (SQLSTATE ``40001``); the transaction is rolled back."""
    return _server_code(exc) == _PG_SERIALIZATION_FAILURE


def _server_code(exc: BaseException) -> int | str | None:
    """The database's code for a driver error wrapped by SQLAlchemy: MySQL's error
    number (an int), else PostgreSQL's SQLSTATE (a string); None for anything else.

    The number comes first: PyMySQL (from 1.1) also gives MySQL's SQLSTATE, which
    is ``HY000`` for most errors (a lock wait timeout among them) and ``40001``
    for a deadlock, so it cannot tell them apart from PostgreSQL's codes.
    """
    if not isinstance(exc, sa.exc.DBAPIError) or exc.orig is None:
        return None
    args: tuple[object, ...] = getattr(exc.orig, "args", ())
    if args and isinstance(args[0], int):  # PyMySQL, asyncmy: (errno, message)
        return args[0]
    sqlstate = getattr(exc.orig, "sqlstate", None)  # psycopg
    return sqlstate if isinstance(sqlstate, str) else None


#: Errors that mean the URL is wrong, not the server away: a database that does not
#: exist (MySQL/MariaDB 1049, PostgreSQL 3D000), a login refused (1045 bad user or
#: password, 1044 no access to that database, 1698 an account that cannot log in
#: with a password; PostgreSQL 28P01 bad password, 28000 no such role or no
#: pg_hba.conf entry).
_UNKNOWN_DATABASE: frozenset[int | str] = frozenset({1049, "3D000"})
_LOGIN_REFUSED: frozenset[int | str] = frozenset({1044, 1045, 1698, "28P01", "28000"})
#: psycopg raises a failed connection without its SQLSTATE (libpq keeps it only for
#: results), so for those the server's FATAL message is matched instead: libpq's
#: text for the codes above (in English, the server's default lc_messages).
_PG_CONNECT_FAILURES = (
    ("3D000", re.compile(r'FATAL:\s+database "[^"]*" does not exist')),
    ("28P01", re.compile(r"FATAL:\s+password authentication failed for user")),
    ("28000", re.compile(r'FATAL:\s+(role "[^"]*" does not exist|no pg_hba\.conf entry)')),
)


def database_url_problem(exc: BaseException, url: str | sa.URL) -> str | None:
    """What is wrong with ``url`` when ``exc`` says the database it names does not
    exist or the server refused its login: a configuration error, with the fix
    and the driver's own message (secrets masked). None for anything else: a
    server that cannot be reached, or fails, is a dependency's problem.
    """
    from outboxkit.runtime.logs import redact

    code = _server_code(exc)
    text = driver_message(exc)
    orig = getattr(exc, "orig", None) or exc
    if code is None and "psycopg" in type(orig).__module__:
        code = next(
            (state for state, pattern in _PG_CONNECT_FAILURES if pattern.search(text)), None
        )
    if code not in _UNKNOWN_DATABASE and code not in _LOGIN_REFUSED:
        return None
    parsed = sa.make_url(url)
    server = f"{parsed.host or 'localhost'}" + (f":{parsed.port}" if parsed.port else "")
    said = redact(text)
    if code in _UNKNOWN_DATABASE:
        return (
            f"database {parsed.database!r} does not exist on {server} ({said}): create it "
            f"(CREATE DATABASE {parsed.database}) or correct the database name in the URL"
        )
    return (
        f"the server at {server} refused the login of user {parsed.username!r} ({said}): "
        "correct the user and password in the URL, or grant that user access to the "
        "database from this host"
    )


def driver_message(exc: BaseException) -> str:
    """The database driver's own message for ``exc`` (unwrapped from SQLAlchemy's),
    on one line: ``error 1049: Unknown database 'x'`` (MySQL/MariaDB), libpq's text
    (PostgreSQL). Not redacted: pass it through ``redact`` before showing it."""
    orig = getattr(exc, "orig", None) or exc
    args: tuple[object, ...] = getattr(orig, "args", ())
    if len(args) >= 2 and isinstance(args[0], int):  # PyMySQL, asyncmy: (errno, message)
        text = f"error {args[0]}: {args[1]}"
    else:
        text = str(orig) or type(orig).__name__
    return " ".join(text.split())
