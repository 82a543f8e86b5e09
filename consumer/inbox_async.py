"""The inbox for async handlers: one ``AsyncConnection`` transaction per message.

The same transaction as the sync inbox (``consumer/inbox.py``), on the
consumer's event loop:

1. ``INSERT`` the inbox row (the sync inbox's own code, run through
   ``AsyncConnection.run_sync``, so the identity, duplicate and 0.1.0 rules
   are one implementation);
2. ``await handle(message)`` with ``message.async_tx`` bound to this
   ``AsyncConnection``;
3. ``COMMIT``.

A handler that raises, or is cancelled at the drain deadline, rolls the
transaction back: neither its writes nor the inbox row are kept. As in the
sync inbox, each worker keeps its connection from one message to the next and
hands it back after a failure or ``_IDLE_RECHECK`` seconds idle; all of them
are closed on the loop when the consumer stops, and the engine's pool is
disposed there too (an asyncio driver's connection belongs to the loop that
opened it), also for an engine passed in.

The engine is the ``AsyncEngine`` passed as ``engine=``, or one built from
``db_url`` with the driver swapped for its asyncio twin
(``mysql+pymysql`` → ``mysql+asyncmy``, the ``outboxkit[async]`` extra). A
``postgresql+psycopg`` URL stays as it is: psycopg 3 is an asyncio driver too
(``postgresql`` and ``postgresql+psycopg2`` become ``postgresql+psycopg``).
The PostgreSQL rules of the sync inbox (``ON CONFLICT DO NOTHING``, a
transaction the handler let abort is rolled back and retried, never reported
as handled) hold here too: both run the same code.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outboxkit.consumer.inbox import _IDLE_RECHECK, Inbox, check_not_aborted
from outboxkit.consumer.loop_thread import AsyncHandler, HandlerCancelled, LoopThread
from outboxkit.consumer.message import Message
from outboxkit.runtime.errors import (
    ConfigError,
    database_unreachable,
    is_infrastructure_error,
)
from outboxkit.runtime.logs import redact

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

__all__ = ["AsyncInbox", "async_db_url"]

#: Sync drivers and the asyncio driver the async inbox uses in their place.
_ASYNC_DRIVERS = {
    "mysql": "mysql+asyncmy",
    "mysql+pymysql": "mysql+asyncmy",
    "mysql+mysqldb": "mysql+asyncmy",
    "mariadb": "mariadb+asyncmy",
    "mariadb+pymysql": "mariadb+asyncmy",
    "postgresql": "postgresql+psycopg",
    "postgresql+psycopg2": "postgresql+psycopg",
}


def async_db_url(db_url: str) -> sa.URL:
    """``db_url`` with an asyncio driver: a sync MySQL/MariaDB URL gets ``asyncmy``,
    a PostgreSQL one ``psycopg`` (3)."""
    url = sa.make_url(db_url)
    driver = _ASYNC_DRIVERS.get(url.drivername)
    return url.set(drivername=driver) if driver else url


@dataclass
class _Held:
    conn: AsyncConnection
    used_at: float


class AsyncInbox:
    """The inbox of an async consumer; :meth:`run` is called from worker threads."""

    def __init__(
        self,
        loop_thread: LoopThread,
        engine: AsyncEngine,
        *,
        group_id: str,
        table: str,
    ) -> None:
        self.loop_thread = loop_thread
        self.engine = engine
        self.group_id = group_id
        self._inbox = Inbox(engine.sync_engine, group_id=group_id, table=table)
        # Keyed by worker thread; only touched by coroutines on the loop, and each
        # worker has at most one coroutine at a time.
        self._held: dict[int, _Held] = {}
        # Workers whose transaction coroutine has not ended yet: a worker whose
        # coroutine was cancelled at the drain deadline stops waiting for it at
        # once, while the coroutine still rolls back on the worker's connection.
        self._in_use: set[int] = set()

    @classmethod
    def open(
        cls,
        loop_thread: LoopThread,
        engine: Engine | AsyncEngine | None,
        db_url: str | None,
        *,
        group_id: str,
        table: str,
        pool_size: int,
    ) -> AsyncInbox:
        from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

        if isinstance(engine, Engine):
            raise ConfigError(
                "an async handler with the inbox needs an AsyncEngine (engine=), not a sync Engine"
            )
        if engine is None:
            assert db_url is not None
            try:
                engine = create_async_engine(
                    async_db_url(db_url),
                    pool_pre_ping=True,
                    pool_size=pool_size,
                    max_overflow=2,
                )
            except (sa.exc.ArgumentError, sa.exc.InvalidRequestError, ImportError) as exc:
                raise ConfigError(
                    "invalid --db-url / OUTBOXKIT_DB_URL for an async handler "
                    "(an asyncio driver is needed, e.g. mysql+asyncmy from outboxkit[async] "
                    f"or postgresql+psycopg from outboxkit[postgres]): "
                    f"{type(exc).__name__}: {redact(str(exc))}"
                ) from None
        assert isinstance(engine, AsyncEngine)
        inbox = cls(loop_thread, engine, group_id=group_id, table=table)
        try:
            present = loop_thread.run(inbox._has_table)
        except Exception as exc:
            loop_thread.run(engine.dispose)
            if not is_infrastructure_error(exc):
                raise
            raise database_unreachable(exc, engine.url) from None
        if not present:
            loop_thread.run(engine.dispose)
            raise ConfigError(f"inbox table {table} does not exist: run outboxkit schema apply")
        return inbox

    async def _has_table(self) -> bool:
        name = self._inbox.table.name
        async with self.engine.connect() as conn:
            return await conn.run_sync(lambda c: sa.inspect(c).has_table(name))

    # -- called from worker threads ------------------------------------------------

    def run(self, message: Message, handler: Callable[[Message], None]) -> bool:
        """Run the async handler once per ``(group_id, identity)``. True if a duplicate."""
        if not isinstance(handler, AsyncHandler):
            raise TypeError("the async inbox runs async handlers only")
        handle = handler.coroutine_function
        worker = threading.get_ident()
        return self.loop_thread.run(lambda: self._run(worker, message, handle))

    def release(self) -> None:
        """Hand the calling worker's connection back (when the worker stops).

        Not while the worker's transaction coroutine still runs: a worker whose
        handler was cancelled at the drain deadline gets here at once, while the
        coroutine still awaits its ``ROLLBACK`` on that connection; closing it
        underneath left asyncmy's rollback waiting forever (the loop, and the
        pool's disposal, were then abandoned). That coroutine hands the
        connection back itself once its rollback is done.
        """
        worker = threading.get_ident()
        if worker not in self._held:
            return
        # HandlerCancelled: the loop is stopping, and aclose() closes it.
        with contextlib.suppress(HandlerCancelled):
            self.loop_thread.run(lambda: self._release_idle(worker))

    # -- on the loop ----------------------------------------------------------------

    async def _run(
        self, worker: int, message: Message, handle: Callable[[Message], Awaitable[None]]
    ) -> bool:
        self._in_use.add(worker)
        try:
            conn = await self._connection(worker)
            try:
                if await conn.run_sync(self._inbox.claim, message):
                    self._held[worker].used_at = time.monotonic()
                    return True
                try:
                    await handle(message.with_tx(conn))
                    assert conn.sync_connection is not None
                    check_not_aborted(conn.sync_connection)
                except BaseException:
                    await conn.rollback()
                    raise
                await conn.commit()
            except BaseException:
                await self._release(worker)  # whatever state it is in, the pool sorts it out
                raise
            self._held[worker].used_at = time.monotonic()
            return False
        finally:
            self._in_use.discard(worker)

    async def _connection(self, worker: int) -> AsyncConnection:
        held = self._held.get(worker)
        if held is not None and time.monotonic() - held.used_at > _IDLE_RECHECK:
            await self._release(worker)
            held = None
        if held is None:
            held = self._held[worker] = _Held(await self.engine.connect(), time.monotonic())
        return held.conn

    async def _release_idle(self, worker: int) -> None:
        """:meth:`_release`, unless the worker's transaction coroutine still runs
        (it releases the connection itself when it ends)."""
        if worker not in self._in_use:
            await self._release(worker)

    async def _release(self, worker: int) -> None:
        held = self._held.pop(worker, None)
        if held is not None:
            await held.conn.close()

    async def aclose(self) -> None:
        """Close every held connection, then the engine's pooled ones.

        Also for an engine passed in: an asyncio driver's connections belong to
        the loop that opened them, the consumer's, which stops next, so they
        could never be used again. ``dispose()`` leaves the engine usable (a new
        pool, connections opened on demand).
        """
        for worker in list(self._held):
            await self._release(worker)
        await self.engine.dispose()
