"""Hand messages to worker threads: one worker per message, in order per lane.

A *lane* is what must stay in order: the partition (``concurrency=1``), or the
partition and the message key (``concurrency > 1``; messages without a key share
their partition's ``None`` lane). A lane's next message starts only when the
previous one has finished, including any retry waits, so:

* one message is never run by two workers at once, not even after its
  partition was revoked and assigned back while an abandoned handler still
  runs: the lane stays busy until that handler returns;
* per-key (or per-partition) order holds across retries.

A message waiting for a retry (or for the dead-letter topic) gives its worker
back: the other lanes keep moving, on every partition.

Partitions are *opened* when assigned and *closed* when revoked, lost, or at
drain; a closed partition's queued and waiting messages are released (their
offsets are not stored, Kafka redelivers them), and a running one finishes
without being retried here.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from outboxkit.consumer.message import Message

__all__ = ["Dispatcher", "TopicPartition", "WorkItem"]

TopicPartition = tuple[str, int]


@dataclass(eq=False, slots=True)
class WorkItem:
    """A message on its way through a worker, with its retry state."""

    message: Message
    lane: Hashable
    tp: TopicPartition
    generation: int = 0
    attempts: int = 0
    first_attempt_at: float | None = None
    failure: object | None = None  # set once the handler gave up: the DLQ write is pending
    dlq_attempts: int = 0
    outages: int = 0  # failures a dependency caused in a row (not counted as attempts)
    dlq_blocked: bool = False  # owned by the poll loop


class Dispatcher:
    """Thread-safe lanes, a ready queue and a timer heap for deferred retries."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queued: dict[Hashable, deque[WorkItem]] = {}
        self._busy: dict[Hashable, WorkItem] = {}  # running, or waiting for a retry
        self._ready: deque[Hashable] = deque()
        self._delayed: list[tuple[float, int, WorkItem]] = []
        self._running: set[WorkItem] = set()
        self._live: dict[TopicPartition, int] = {}
        self._generations: dict[TopicPartition, int] = {}
        self._seq = itertools.count()
        self._stopped = False
        self._draining = False
        self._releasing: set[TopicPartition] = set()

    # -- partitions (poll loop) ----------------------------------------------

    def open(self, tp: TopicPartition) -> int:
        with self._cond:
            gen = self._generations.get(tp, 0) + 1
            self._generations[tp] = gen
            self._live[tp] = gen
            self._releasing.discard(tp)
            return gen

    def release(self, tps: Iterable[TopicPartition]) -> list[WorkItem]:
        """Stop new work on ``tps``: return their queued and waiting messages (released).

        What is running keeps its partition open (:meth:`is_live`) so its offset
        can still be stored and committed before :meth:`close`.
        """
        closing = set(tps)
        with self._cond:
            self._releasing |= closing
            released: list[WorkItem] = []
            for lane in list(self._queued):
                items = self._queued[lane]
                keep = deque(i for i in items if i.tp not in closing)
                released.extend(i for i in items if i.tp in closing)
                if keep:
                    self._queued[lane] = keep
                else:
                    del self._queued[lane]
            waiting = [entry for entry in self._delayed if entry[2].tp in closing]
            if waiting:
                self._delayed = [e for e in self._delayed if e[2].tp not in closing]
                heapq.heapify(self._delayed)
                for _, _, item in waiting:
                    released.append(item)
                    self._free_lane(item)
            self._ready = deque(lane for lane in self._ready if lane in self._queued)
            self._cond.notify_all()
            return released

    def close(self, tps: Iterable[TopicPartition]) -> list[WorkItem]:
        """:meth:`release`, then forget the partitions: a result that comes later is stale."""
        tps = set(tps)
        released = self.release(tps)
        with self._cond:
            for tp in tps:
                self._live.pop(tp, None)
                self._releasing.discard(tp)
        return released

    def drain(self) -> list[WorkItem]:
        """Hand out no new work: return every queued and waiting message (released).

        Partitions stay open, so what is running now still counts when it finishes.
        """
        with self._cond:
            self._draining = True
            released = [i for q in self._queued.values() for i in q]
            released.extend(item for _, _, item in self._delayed)
            for _, _, item in self._delayed:
                self._free_lane(item)
            self._queued.clear()
            self._delayed.clear()
            self._ready.clear()
            self._cond.notify_all()
            return released

    def is_live(self, item: WorkItem) -> bool:
        with self._cond:
            return self._live.get(item.tp) == item.generation

    def live_generations(self) -> dict[TopicPartition, int]:
        """A snapshot of the open partitions' generations (for checking many results at once)."""
        with self._cond:
            return dict(self._live)

    def submit(self, item: WorkItem) -> None:
        self.submit_many((item,))

    def submit_many(self, items: Iterable[WorkItem]) -> None:
        """Queue ``items`` (in offset order per lane) under one lock, waking workers once."""
        woken = 0
        with self._cond:
            if self._draining:
                return
            for item in items:
                tp = item.tp
                if tp in self._releasing:
                    continue
                item.generation = self._live.get(tp, -1)
                lane = item.lane
                queue = self._queued.get(lane)
                if queue is None:
                    queue = self._queued[lane] = deque()
                queue.append(item)
                if len(queue) == 1 and lane not in self._busy:
                    self._ready.append(lane)
                    woken += 1
            if woken:
                self._cond.notify(woken)

    def stop(self) -> None:
        """No more work is handed out; waiting workers return None from :meth:`take`."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped

    # -- workers ------------------------------------------------------------

    def take(self, timeout: float) -> WorkItem | None:
        """The next message to run, or None after ``timeout`` s or once stopped."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                if self._delayed and self._delayed[0][0] <= now:
                    _, _, item = heapq.heappop(self._delayed)
                    self._running.add(item)
                    return item
                if self._ready:
                    return self._start_next(self._ready.popleft())
                wait = deadline - now
                if self._delayed:
                    wait = min(wait, self._delayed[0][0] - now)
                if wait <= 0 and now >= deadline:
                    return None
                self._cond.wait(max(wait, 0.001))
            return None

    def finish(self, item: WorkItem, *, take_next: bool = False) -> WorkItem | None:
        """The worker is done with ``item`` (for good); its lane may move on.

        With ``take_next``, the lane's next message is handed straight to the same
        worker (one lock instead of a finish and a take), unless a retry is due or
        no work is handed out any more. The caller bounds such streaks so the
        other lanes get their turn.
        """
        with self._cond:
            self._running.discard(item)
            lane = item.lane
            if (
                take_next
                and self._busy.get(lane) is item
                and lane in self._queued
                and not self._stopped
                and not (self._delayed and self._delayed[0][0] <= time.monotonic())
            ):
                return self._start_next(lane)
            if self._free_lane(item):
                # One lane became ready: one worker is enough (often this one).
                self._cond.notify()
            return None

    def defer(self, item: WorkItem, delay: float) -> bool:
        """Run ``item`` again after ``delay`` s, keeping its lane busy.

        False (and nothing deferred) if its partition was closed meanwhile:
        the caller finishes it as released.
        """
        with self._cond:
            if (
                self._stopped
                or self._draining
                or item.tp in self._releasing
                or self._live.get(item.tp) != item.generation
            ):
                return False
            self._running.discard(item)
            heapq.heappush(self._delayed, (time.monotonic() + delay, next(self._seq), item))
            self._cond.notify_all()
            return True

    # -- views ----------------------------------------------------------------

    def running(self, where: Callable[[WorkItem], bool] | None = None) -> list[WorkItem]:
        with self._cond:
            return [i for i in self._running if where is None or where(i)]

    def counts(self) -> tuple[int, int, int]:
        """(running, waiting for a retry, queued)."""
        with self._cond:
            queued = sum(len(q) for q in self._queued.values())
            return len(self._running), len(self._delayed), queued

    def _start_next(self, lane: Hashable) -> WorkItem:
        """Hand out ``lane``'s next queued message: the lane is busy with it (lock held)."""
        queue = self._queued[lane]
        item = queue.popleft()
        if not queue:
            del self._queued[lane]
        self._busy[lane] = item
        self._running.add(item)
        return item

    def _free_lane(self, item: WorkItem) -> bool:
        """Free ``item``'s lane; True if the lane has queued work again (it is ready)."""
        lane = item.lane
        if self._busy.get(lane) is item:
            del self._busy[lane]
            if lane in self._queued:
                self._ready.append(lane)
                return True
        return False
