"""Async handlers: an ``async def handle`` runs on one event loop thread per consumer.

The worker threads, lanes, offsets, retries, dead-lettering and drain are the
sync consumer's, unchanged: a worker that takes a message submits the handler's
coroutine to the consumer's event loop (``asyncio.run_coroutine_threadsafe``)
and waits for it, so the message counts as finished only once the coroutine
has returned, and everything downstream of "the handler returned or raised"
is the same code path. ``concurrency = N`` lets up to N coroutines (one per
worker, one per lane) run on the loop at once.

Why a loop thread and not a loop per worker: the handler's own async
resources (an ``AsyncEngine``'s pool, an HTTP client) belong to one loop, so
every coroutine of the consumer must run on the same one.

Why the worker waits: a coroutine that still runs holds its lane and its
offset exactly as a running sync handler does, so per-key order and "offset
stored only after the handler finished" need no second implementation.

At the drain deadline (``worker_drain_timeout``, or at once on a second
signal) the sync consumer leaves a still-running handler thread behind; an
async consumer **cancels** its coroutines instead, after the exit report has
counted them *unknown* (not committed, so Kafka redelivers them). Cancellation
runs the coroutine's ``except``/``finally`` blocks: an inbox transaction rolls
back, ``async with`` resources close. The loop is then given a short bound to
let them finish before it is stopped.

The context of the worker (``contextvars``: a tracing span, for instance)
travels into the coroutine: ``run_coroutine_threadsafe`` schedules it with a
copy of the calling thread's context.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from outboxkit.consumer.message import Message
from outboxkit.runtime.logs import describe_exception, log_event, redact

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine
    from sqlalchemy.ext.asyncio import AsyncEngine

    from outboxkit.consumer.inbox_async import AsyncInbox

__all__ = ["AsyncHandler", "AsyncHandlers", "HandlerCancelled", "LoopThread", "is_async_handler"]

_log = logging.getLogger("outboxkit.consumer")

T = TypeVar("T")

#: How long stopping the loop waits for cancelled coroutines to run their cleanup.
_CANCEL_GRACE = 2.0


class HandlerCancelled(BaseException):
    """The handler's coroutine was cancelled at the drain deadline.

    A ``BaseException`` on purpose: it must never be classified as a handler
    failure (retried or dead-lettered). The message was already counted
    unknown; Kafka redelivers it.
    """


def is_async_handler(handle: Callable[..., object]) -> bool:
    """Is ``handle`` an ``async def`` (checked once, at start; nothing per message)?"""
    return inspect.iscoroutinefunction(handle)


class LoopThread:
    """One asyncio event loop running in a daemon thread, fed from worker threads.

    The loop is made in :meth:`start`: a consumer that is built but never run
    leaves no loop to close.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closing = False

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, call: Callable[[], Awaitable[T]]) -> T:
        """Await ``call()`` on the loop and wait for its result (from any other thread).

        ``call`` is invoked on the loop, so nothing is created when the loop is
        already stopping. :class:`HandlerCancelled` if it was cancelled by
        :meth:`cancel_pending`, or if the loop is stopping.
        """
        with self._lock:
            if self._closing or self._thread.ident is None:
                raise HandlerCancelled("the consumer's event loop is stopping (or not started)")
            future = asyncio.run_coroutine_threadsafe(_awaited(call), self.loop)
            self._pending.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise HandlerCancelled("cancelled at the drain deadline") from None
        finally:
            with self._lock:
                self._pending.discard(future)

    def cancel_pending(self) -> int:
        """Cancel every coroutine submitted and not finished; how many were cancelled."""
        with self._lock:
            pending = list(self._pending)
        return sum(1 for future in pending if future.cancel())

    def stop(
        self,
        grace: float = _CANCEL_GRACE,
        *,
        last: Callable[[], Awaitable[None]] | None = None,
    ) -> bool:
        """Refuse new work, cancel what still runs and let it clean up within
        ``grace`` seconds, then await ``last()`` (closing what the coroutines
        used, bounded by ``grace`` too), stop and close the loop.

        False if a coroutine outlived the grace: then ``last`` is not run (what
        it closes may still be in use) and the loop thread is left running, as
        a sync handler thread would be.
        """
        with self._lock:
            self._closing = True
        if not self._thread.is_alive():
            if self._thread.ident is not None:  # started, and its loop already ended
                self.loop.close()
            return True
        self.cancel_pending()

        async def settle() -> bool:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                if not task.cancelling():  # one already cancelled is cleaning up
                    task.cancel()
            if tasks:
                _, late = await asyncio.wait(tasks, timeout=grace)
                if late:
                    return False
            if last is not None:
                try:
                    await asyncio.wait_for(last(), grace)
                except Exception as exc:  # closing is best effort; the loop still stops
                    log_event(
                        _log,
                        "event-loop-close-failed",
                        level=logging.WARNING,
                        error=redact(describe_exception(exc)),
                    )
            await self.loop.shutdown_asyncgens()
            return True

        try:
            bound = 2 * grace + 1.0
            done = asyncio.run_coroutine_threadsafe(settle(), self.loop).result(bound)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            done = False
        if not done:
            return False
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(1.0)
        if not self._thread.is_alive():
            self.loop.close()
        return True


class AsyncHandler:
    """The sync callable the workers call: runs ``handle(message)`` on the loop and waits.

    ``coroutine_function`` is the user's ``async def handle``; the async inbox
    runs it inside its transaction instead of calling this adapter.
    """

    __slots__ = ("coroutine_function", "loop_thread")

    def __init__(
        self, coroutine_function: Callable[[Message], Awaitable[None]], loop_thread: LoopThread
    ) -> None:
        self.coroutine_function = coroutine_function
        self.loop_thread = loop_thread

    def __call__(self, message: Message) -> None:
        self.loop_thread.run(lambda: self.coroutine_function(message))


async def _awaited(call: Callable[[], Awaitable[T]]) -> T:
    return await call()


class AsyncHandlers:
    """What an async consumer adds to the sync one: the loop thread, the adapter, the inbox."""

    def __init__(self, handle: Callable[[Message], Awaitable[None]], *, name: str) -> None:
        self.loop_thread = LoopThread(f"{name}-loop")
        self.handler = AsyncHandler(handle, self.loop_thread)
        self.inbox: AsyncInbox | None = None
        self.cancelled = 0

    def start(self) -> None:
        self.loop_thread.start()

    def open_inbox(
        self,
        engine: Engine | AsyncEngine | None,
        db_url: str | None,
        *,
        group_id: str,
        table: str,
        pool_size: int,
    ) -> AsyncInbox:
        """The async inbox (checked: the table exists; ``DependencyError`` if the
        database cannot be reached, ``ConfigError`` if the table is missing)."""
        from outboxkit.consumer.inbox_async import AsyncInbox

        self.inbox = AsyncInbox.open(
            self.loop_thread,
            engine,
            db_url,
            group_id=group_id,
            table=table,
            pool_size=pool_size,
        )
        return self.inbox

    def cancel_running(self) -> int:
        """At the drain deadline, after the report counted them unknown: cancel the
        coroutines still running. Logs ``handlers-cancelled`` when there were any."""
        n = self.loop_thread.cancel_pending()
        self.cancelled += n
        if n:
            log_event(
                _log,
                "handlers-cancelled",
                level=logging.WARNING,
                cancelled=n,
                note="async handlers still running at the drain deadline: counted unknown, "
                "not committed, redelivered",
            )
        return n

    def close(self, grace: float = _CANCEL_GRACE) -> None:
        """Stop the loop: cancelled coroutines get ``grace`` seconds to finish, then
        the inbox's connections and pool are closed on the loop (``grace`` more at
        most). Logs ``event-loop-abandoned`` if a coroutine would not finish."""
        started = time.monotonic()
        inbox = self.inbox
        if not self.loop_thread.stop(grace, last=inbox.aclose if inbox is not None else None):
            log_event(
                _log,
                "event-loop-abandoned",
                level=logging.WARNING,
                waited_s=round(time.monotonic() - started, 3),
                note="a cancelled async handler did not finish; its thread is left behind",
            )
