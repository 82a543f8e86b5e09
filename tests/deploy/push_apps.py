"""Consumer classes the push-convention tests run with ``outboxkit consume``."""

from __future__ import annotations

import asyncio
import time

from outboxkit.consumer import Consumer, Message


class StuckOnStop(Consumer):
    """Handles slowly (a backlog builds up) and hangs in ``on_stop``, so the drain
    overruns ``shutdown_timeout`` and the process is forced to exit (code 4)."""

    def handle(self, message: Message) -> None:
        time.sleep(0.5)

    def on_stop(self) -> None:
        time.sleep(120)


class Idle(Consumer):
    """Handles nothing in particular; drains and exits cleanly (code 0)."""

    def handle(self, message: Message) -> None:
        pass


class IdleAsync(Consumer):
    """:class:`Idle` as an ``async def handle``: the async consumer's start and drain
    (the event loop thread, the cancellation grace) under shipped settings."""

    topics = ("orders",)
    group_id = "outboxkit-shipped-async"

    async def handle(self, message: Message) -> None:
        await asyncio.sleep(0)
