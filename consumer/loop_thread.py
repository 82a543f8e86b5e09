"""The consumer's event loop thread, and the adapter workers call an ``async def handle`` through.

Both sides of an async consumer use these: :mod:`outboxkit.consumer.asyncio_handler`
(which starts the loop, cancels at the drain deadline and closes) and the async
inbox (:mod:`outboxkit.consumer.inbox_async`, which runs its transaction on the
loop and needs the user's coroutine function behind the adapter). Kept apart
from both, so neither imports the other to reach them. Why a loop thread and
why the worker waits: see :mod:`outboxkit.consumer.asyncio_handler`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from outboxkit.consumer.message import Message
from outboxkit.runtime.logs import describe_exception, log_event, redact

__all__ = ["CANCEL_GRACE", "AsyncHandler", "HandlerCancelled", "LoopThread"]

_log = logging.getLogger("outboxkit.consumer")

T = TypeVar("T")

#: How long stopping the loop waits for cancelled coroutines to run their cleanup.
CANCEL_GRACE = 2.0


class HandlerCancelled(BaseException):
    """The handler's coroutine was cancelled at the drain deadline.

    A ``BaseException`` on purpose: it must never be classified as a handler
    failure (retried or dead-lettered). The message was already counted
    unknown; Kafka redelivers it.
    """


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
        grace: float = CANCEL_GRACE,
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
