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

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from outboxkit.consumer.inbox_async import AsyncInbox
from outboxkit.consumer.loop_thread import CANCEL_GRACE, AsyncHandler, HandlerCancelled, LoopThread
from outboxkit.consumer.message import Message
from outboxkit.runtime.logs import log_event

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine
    from sqlalchemy.ext.asyncio import AsyncEngine

# The loop thread's names stay importable from here, where they were first defined.
__all__ = ["AsyncHandler", "AsyncHandlers", "HandlerCancelled", "LoopThread", "is_async_handler"]

_log = logging.getLogger("outboxkit.consumer")


def is_async_handler(handle: Callable[..., object]) -> bool:
    """Is ``handle`` an ``async def`` (checked once, at start; nothing per message)?"""
    return inspect.iscoroutinefunction(handle)


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

    def close(self, grace: float = CANCEL_GRACE) -> None:
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
