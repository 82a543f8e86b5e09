"""Wake-up hints: tell relays, right after a commit, that rows are waiting.

Relays poll the outbox every ``poll_interval``; a hint on the Redis channel
``{prefix}outboxkit:{outbox}:wakeup`` makes them claim at once, so a quiet system
delivers in milliseconds without hot polling. Hints are an optimisation only: a
lost hint (Redis down, a relay reconnecting) costs at most one poll interval,
never a row.

``{outbox}`` is the outbox's identity (``orders.outbox_events``; see
:mod:`outboxkit.runtime.identity`), read from the database, so two services
sharing one Redis never wake each other's relays. The writer reads it once per
database connection (one ``SELECT DATABASE()`` or catalog lookup when the
connection first enqueues with wake-ups enabled) and keeps it in the
connection's ``info``.

Two ways to send them, both opt-in:

* :func:`enable_wakeups` on an ``Engine`` or a ``sessionmaker`` / ``Session``:
  the writer marks the transaction when ``enqueue`` writes rows, and a listener
  sends one hint per table after that transaction **commits** (nothing on
  rollback, nothing for transactions that enqueued nothing). Hints go out from a
  background thread, so a commit never waits for Redis, and a burst of commits
  coalesces into fewer hints while one is being sent.
* :func:`notify_relays` called by the application after its own commit.

Asyncio code passes its ``AsyncEngine`` (the listeners go on its
``sync_engine``: SQLAlchemy has no async events), an ``AsyncSession``, or an
``async_sessionmaker`` (its sessions get a private subclass of their sync
session class that carries the listeners; :meth:`WakeupHook.disable` puts the
original class back). The hint is sent from the same thread either way.

With an ``Engine``, a Core connection publishes when it begins its next
transaction or goes back to the pool after the commit (SQLAlchemy has no
after-commit event for connections); a connection kept idle after ``commit()``
sends its hint late. Sessions publish from ``after_commit``. Enable wake-ups on
one of the two for the same database, or each commit sends two hints.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from outboxkit.runtime import rediskeys
from outboxkit.runtime.identity import read_identity
from outboxkit.schema.table import DEFAULT_TABLE, validate_identifier

if TYPE_CHECKING:
    # redis is imported where a hint is sent: the writer records tables without it.
    import redis

    # Not at run time: sqlalchemy.ext.asyncio needs greenlet (the ``async`` extra),
    # and sqlalchemy.orm is imported by the services that use sessions.
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
    from sqlalchemy.orm import Session, scoped_session, sessionmaker

__all__ = [
    "WakeupHook",
    "WakeupPublisher",
    "enable_wakeups",
    "mark_enqueued",
    "notify_relays",
    "wakeup_channel",
]

_log = logging.getLogger("outboxkit.wakeup")

#: ``info`` key (of a Session or a Connection) holding the tables written to in
#: the current transaction.
ENQUEUED = "outboxkit.wakeup.enqueued"
# Tables of a Core transaction whose commit was sent; published once it is known
# to have succeeded (the connection begins again or goes back to the pool).
_COMMITTED = "outboxkit.wakeup.committed"

_HINT = b"1"


#: Seconds between two rounds of hints: far below a relay's turn (10 ms or more
#: for a claim, produce and finalize), so a busy relay misses nothing by it.
DEFAULT_HINT_INTERVAL = 0.002


def wakeup_channel(
    table: str = DEFAULT_TABLE, prefix: str = "", *, outbox: str | None = None
) -> str:
    """The pub/sub channel relays of the outbox ``outbox`` (an identity key such as
    ``orders.outbox_events``) listen on. Without ``outbox``: the legacy channel
    named by the bare ``table``, on which relays still listen for writers of
    older versions."""
    validate_identifier(table)
    return rediskeys.wakeup_channel(prefix, outbox or table)


#: How many wake-up hooks are installed in this process: without one, the writer
#: records table names and reads nothing from the database.
_hooks = 0
_IDENTITY = "outboxkit.wakeup.identity"


def outbox_key(conn: Connection, table: str) -> str:
    """The identity key of ``table`` on ``conn``'s database, read once per database
    connection (kept in its ``info``, which lives as long as the connection)."""
    cache: dict[str, str] = conn.info.setdefault(_IDENTITY, {})
    key = cache.get(table)
    if key is None:
        key = cache[table] = read_identity(conn, table).key
    return key


def mark_enqueued(target: Connection | Session, conn: Connection, table: str) -> None:
    """Record that this transaction wrote rows to ``table`` (called by the writer).

    Costs a dict update; with :func:`enable_wakeups` listening, the first call on
    a database connection also reads the outbox's identity (one query).
    """
    outbox = outbox_key(conn, table) if _hooks else table
    orm = sys.modules.get("sqlalchemy.orm")  # a Session's holder has imported it
    if orm is not None and isinstance(target, orm.Session):
        target.info.setdefault(ENQUEUED, set()).add(outbox)
    conn.info.setdefault(ENQUEUED, set()).add(outbox)


def notify_relays(
    redis_client: redis.Redis[Any],
    table: str = DEFAULT_TABLE,
    *,
    prefix: str = "",
    bind: Engine | Connection | None = None,
) -> bool:
    """Publish one hint for ``table`` now; call it after your commit.

    ``bind``: the engine or connection the rows were written through; the hint
    goes to the channel of the outbox's identity read from it (cached per
    connection). Without it the hint goes to the legacy channel of the bare
    table, which relays still listen on, but which every outbox of that table
    name sharing the Redis hears too (a wasted claim each, never a lost row).

    Returns False (and logs at debug level) when Redis cannot be reached: the
    relays will still find the rows at their next poll.
    """
    import redis

    try:
        if isinstance(bind, Engine):
            with bind.connect() as conn:
                outbox: str | None = outbox_key(conn, table)
        else:
            outbox = outbox_key(bind, table) if bind is not None else None
        redis_client.publish(wakeup_channel(table, prefix, outbox=outbox), _HINT)
    except (redis.RedisError, sa_exc.DBAPIError) as exc:
        _log.debug("wake-up hint not sent: %s: %s", type(exc).__name__, exc)
        return False
    return True


class WakeupPublisher:
    """Sends hints from a background thread so callers never wait for Redis.

    :meth:`hint` only records the tables; the thread publishes one hint per
    table for everything recorded since its last publish. After publishing it
    waits ``min_interval`` seconds before the next round, so a service
    committing a thousand times a second sends a few hundred hints, not a
    thousand: each one is a Redis round trip and a thread wake-up in the
    service, and a message for every relay to read. The first hint after a
    quiet spell goes out at once. Failures are logged once per outage and the
    hints dropped.
    """

    def __init__(
        self,
        redis_client: str | redis.Redis[Any],
        *,
        prefix: str = "",
        timeout: float = 1.0,
        min_interval: float = DEFAULT_HINT_INTERVAL,
    ) -> None:
        if not 0 <= min_interval <= 1:  # also refuses NaN
            raise ValueError(f"min_interval must be 0-1 seconds, got {min_interval!r}")
        if isinstance(redis_client, str):
            import redis

            self._redis: redis.Redis[Any] = redis.Redis.from_url(
                redis_client, socket_timeout=timeout, socket_connect_timeout=timeout
            )
            self._own_client = True
        else:
            self._redis = redis_client
            self._own_client = False
        self.prefix = prefix
        self._cond = threading.Condition()
        self._pending: set[str] = set()
        self._busy = False
        self._closed = False
        self._failing = False
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._min_interval = min_interval
        self._stopping = threading.Event()  # ends the pause between rounds at close
        self.sent = 0

    def hint(self, tables: Iterable[str]) -> None:
        """Queue a hint for each outbox (identity key, or a bare table for the legacy
        channel); never blocks, never raises."""
        with self._cond:
            if self._closed:
                return
            self._pending.update(tables)
            self._ensure_thread()
            self._cond.notify()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued hint was sent (or dropped); True if it was."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._stopping.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        if self._own_client:
            self._redis.close()

    def _ensure_thread(self) -> None:
        # Caller holds the condition. A forked child has no thread: start its own.
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="outboxkit-wakeup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed and not self._pending:
                    return
                tables, self._pending = sorted(self._pending), set()
                self._busy = True
            try:
                for table in tables:
                    self._publish(table)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            # Not on the condition: hint() would wake it. What is recorded
            # meanwhile goes out in the next round, one hint per table.
            if self._min_interval:
                self._stopping.wait(self._min_interval)

    def _publish(self, table: str) -> None:
        try:
            self._redis.publish(rediskeys.wakeup_channel(self.prefix, table), _HINT)
        except Exception as exc:  # a hint must never break anything
            if not self._failing:
                self._failing = True
                _log.warning(
                    "wake-up hints cannot be sent (relays fall back to polling): %s: %s",
                    type(exc).__name__,
                    exc,
                )
            return
        if self._failing:
            self._failing = False
            _log.info("wake-up hints are sent again")
        self.sent += 1


SessionTarget: TypeAlias = "Session | sessionmaker[Any] | scoped_session[Any] | type[Session]"
AsyncTarget: TypeAlias = "AsyncEngine | AsyncSession | async_sessionmaker[Any]"


class WakeupHook:
    """What :func:`enable_wakeups` installed; :meth:`disable` removes it."""

    def __init__(
        self, target: Engine | SessionTarget | AsyncTarget, publisher: WakeupPublisher
    ) -> None:
        self.target = target
        self.publisher = publisher
        self._listeners: list[tuple[Any, str, Any]] = []
        self._undo: list[Callable[[], None]] = []

    def _listen(self, target: Any, name: str, fn: Any) -> None:
        event.listen(target, name, fn)
        self._listeners.append((target, name, fn))

    def disable(self) -> None:
        """Remove the listeners and stop the publisher (after sending what is queued)."""
        global _hooks
        if self._listeners:
            _hooks -= 1
        for target, name, fn in self._listeners:
            event.remove(target, name, fn)
        self._listeners.clear()
        while self._undo:
            self._undo.pop()()
        self.publisher.flush(timeout=2.0)
        self.publisher.close()


def enable_wakeups(
    target: Engine | SessionTarget | AsyncTarget,
    redis_client: str | redis.Redis[Any],
    *,
    prefix: str = "",
    min_interval: float = DEFAULT_HINT_INTERVAL,
) -> WakeupHook:
    """Publish a wake-up hint after every commit that enqueued rows.

    ``target`` is the ``Engine`` the service writes through, or its
    ``sessionmaker`` / ``scoped_session`` / ``Session`` (class or instance);
    for asyncio code its ``AsyncEngine``, ``async_sessionmaker`` or
    ``AsyncSession``. ``prefix`` must match the relays' Redis prefix
    (``OUTBOXKIT_REDIS_PREFIX``). ``min_interval``: seconds between two rounds
    of hints (0-1; see :class:`WakeupPublisher`); 0 sends one per commit.
    """
    global _hooks
    publisher = WakeupPublisher(redis_client, prefix=prefix, min_interval=min_interval)
    hook = WakeupHook(target, publisher)
    _hooks += 1
    if isinstance(target, Engine):
        _listen_engine(hook, target)
    elif "sqlalchemy.ext.asyncio" in sys.modules:  # imported by whoever holds an async target
        from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

        if isinstance(target, AsyncEngine):
            _listen_engine(hook, target.sync_engine)
        elif isinstance(target, AsyncSession):
            _listen_session(hook, target.sync_session)
        elif isinstance(target, async_sessionmaker):
            _listen_async_sessionmaker(hook, target)
        else:
            _listen_session(hook, target)
    else:  # without that module there can be no async target
        _listen_session(hook, cast("SessionTarget", target))
    return hook


def _listen_async_sessionmaker(hook: WakeupHook, factory: async_sessionmaker[Any]) -> None:
    # Session events cannot be set on an async_sessionmaker, and setting them on
    # its sync session class (by default Session itself) would hook every Session
    # in the process. Its sessions get a private subclass that carries them.
    from sqlalchemy.orm import Session

    base: type[Session] = factory.kw.get("sync_session_class", Session)
    hooked = type(base.__name__, (base,), {"__module__": base.__module__})
    factory.configure(sync_session_class=hooked)
    hook._undo.append(lambda: factory.configure(sync_session_class=base))
    _listen_session(hook, hooked)


def _listen_session(hook: WakeupHook, target: SessionTarget) -> None:
    publisher = hook.publisher

    def after_commit(session: Session) -> None:
        tables = session.info.pop(ENQUEUED, None)
        if tables:
            publisher.hint(tables)

    def after_rollback(session: Session) -> None:
        session.info.pop(ENQUEUED, None)

    hook._listen(target, "after_commit", after_commit)
    hook._listen(target, "after_rollback", after_rollback)


def _listen_engine(hook: WakeupHook, engine: Engine) -> None:
    publisher = hook.publisher

    def publish_committed(info: dict[Any, Any]) -> None:
        tables = info.pop(_COMMITTED, None)
        if tables:
            publisher.hint(tables)

    def on_commit(conn: Connection) -> None:
        # Fired *before* the DBAPI commit: hold the tables until it succeeded.
        tables = conn.info.pop(ENQUEUED, None)
        if tables:
            conn.info.setdefault(_COMMITTED, set()).update(tables)

    def on_rollback(conn: Connection) -> None:
        # Also fired when the commit itself failed: nothing was committed.
        conn.info.pop(ENQUEUED, None)
        conn.info.pop(_COMMITTED, None)

    def on_begin(conn: Connection) -> None:
        publish_committed(conn.info)

    def on_checkin(dbapi_connection: Any, record: Any) -> None:
        if record is None:
            return
        publish_committed(record.info)
        record.info.pop(ENQUEUED, None)  # never committed; the pool rolls it back

    hook._listen(engine, "commit", on_commit)
    hook._listen(engine, "rollback", on_rollback)
    hook._listen(engine, "begin", on_begin)
    hook._listen(engine, "checkin", on_checkin)
