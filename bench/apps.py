"""Consumer classes the benchmark runs, embedded or as ``outboxkit consume bench.apps:NAME``.

``Trivial`` touches the value and counts; ``Sleepy`` sleeps ``BENCH_SLEEP_MS``
(default 1 ms) per message, a stand-in for a handler waiting on I/O.  Both
call ``on_message`` (set by the embedding benchmark) so it can time the first
and the last message and stop the consumer when all arrived.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar

from outboxkit.consumer import Consumer, Message


class Counting(Consumer):
    on_message: ClassVar[Callable[[], None] | None] = None

    def _count(self) -> None:
        hook = type(self).on_message
        if hook is not None:
            hook()


class Trivial(Counting):
    def handle(self, message: Message) -> None:
        _ = len(message.value or b"")
        self._count()


class ReadsEventId(Counting):
    """The trivial handler that also reads ``message.event_id``, as most outbox
    consumers do: the first read of a record's headers checks and decodes them."""

    def handle(self, message: Message) -> None:
        _ = len(message.value or b"")
        _ = message.event_id
        self._count()


class Sleepy(Counting):
    sleep_s: ClassVar[float] = float(os.environ.get("BENCH_SLEEP_MS", "1")) / 1000

    def handle(self, message: Message) -> None:
        time.sleep(type(self).sleep_s)
        self._count()


class Meter:
    """Counts handled messages across worker threads; times the first and the last.

    As cheap per message as the raw loops' own counting (they read the clock
    only for the first and the last message): ``next()`` on an
    ``itertools.count`` is atomic, so no lock is needed.  The process's CPU time
    (every thread) is read at the same two moments, for CPU per message.
    """

    def __init__(self, expected: int, on_done: Callable[[], Any]) -> None:
        self.expected = expected
        self.first: float | None = None
        self.last: float | None = None
        self.cpu_first: float | None = None
        self.cpu_last: float | None = None
        self._counter = itertools.count(1)
        self._seen = 0  # the latest count some thread saw: exact once all arrived
        self._on_done = on_done

    @property
    def cpu_seconds(self) -> float | None:
        """CPU seconds of this process from the first message to the last."""
        if self.cpu_first is None or self.cpu_last is None:
            return None
        return self.cpu_last - self.cpu_first

    @property
    def count(self) -> int:
        return self.expected if self.last is not None else self._seen

    def __call__(self) -> None:
        n = next(self._counter)
        self._seen = n
        if n == 1:
            self.first = time.perf_counter()
            self.cpu_first = time.process_time()
        if n == self.expected:
            self.last = time.perf_counter()
            self.cpu_last = time.process_time()
            self._on_done()
