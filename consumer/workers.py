"""Hand messages to worker threads: runs of a lane's messages, in order per lane.

A *lane* is what must stay in order: the partition (``concurrency=1``), or the
partition and the message key (``concurrency > 1``; messages without a key share
their partition's ``None`` lane). A lane's next message starts only when the
previous one has finished, including any retry waits, so:

* one message is never run by two workers at once, not even after its
  partition was revoked and assigned back while an abandoned handler still
  runs: the lane stays busy until that handler returns;
* per-key (or per-partition) order holds across retries.

A worker takes a *run*: up to ``limit`` queued messages of one lane, handled
one after the other. Each message of a run still starts, finishes and is
reported on its own (:meth:`Dispatcher.next` reports one and starts the next
under one lock), so what the rest of the consumer sees is per message:

* only the message being handled is *running*; the run's messages not started
  yet are queued work, handed back (released) when their partition is revoked
  or the consumer drains, exactly like messages still in the lane's queue;
* a result is visible to the poll loop as soon as the handler returned (the
  poll loop takes every result reported since its last round at once:
  :meth:`Dispatcher.results`), so offsets move as they did per message;
* a message that must wait for a retry (or for the dead-letter topic) ends
  the run: the run's remaining messages go back to the front of the lane's
  queue, behind the retry, and the worker is free for other lanes.

Bounding a run to ``limit`` messages keeps one busy lane from starving the
others: the lane goes to the back of the ready queue between runs.

The poll loop fetches only what the workers need next: before each fetch it
waits (:meth:`Dispatcher.wait_for_room`, bounded) while more than a given
number of messages are queued and no worker is idle. Without that the poll
thread, faster than the workers, filled the queues up to ``max_buffered`` per
partition: tens of thousands of Python objects that each garbage collection
walked again, and that had to take the interpreter lock from the workers to be
built. Messages not fetched yet wait in librdkafka's prefetch queue instead.

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
from dataclasses import dataclass, field

from outboxkit.consumer.message import Message

__all__ = ["Dispatcher", "Run", "TopicPartition", "WorkItem"]

TopicPartition = tuple[str, int]

#: A worker's report on one message: the item, its outcome (an ``Outcome`` of
#: ``consumer.handling``, opaque here), an error text. A plain tuple: one is
#: built per message, and a NamedTuple costs several times more.
Result = tuple["WorkItem", object, "str | None"]


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
    #: What the handler raised in a group transaction that was rolled back (the
    #: batched inbox): the next attempt's outcome, without running it again.
    group_error: BaseException | None = None


@dataclass(eq=False, slots=True)
class Run:
    """Messages of one lane that one worker handles back to back, in order.

    ``todo`` is not started yet (the dispatcher takes it back on release and
    drain); ``current`` is the message being handled, if any; ``held`` are
    messages handled in a group transaction that has not committed yet (see
    :meth:`Dispatcher.hold`): they count as running until reported.
    """

    lane: Hashable
    tp: TopicPartition
    todo: deque[WorkItem]
    current: WorkItem | None = None
    over: bool = field(default=False)
    held: list[WorkItem] = field(default_factory=list)


class Dispatcher:
    """Thread-safe lanes, a ready queue, a timer heap for deferred retries, and
    the results workers reported since the poll loop last looked."""

    def __init__(self) -> None:
        # One plain lock: the per-message paths take it with ``with self._mutex``
        # (no Python-level Condition methods); waits and notifies use the condition.
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        # The poll loop waits on this one for room (:meth:`wait_for_room`).
        self._room = threading.Condition(self._mutex)
        self._room_below: int | None = None  # the poll loop waits for queued <= this
        self._poll_woken = False  # :meth:`wake_poll` was called: end the next wait
        self._queued: dict[Hashable, deque[WorkItem]] = {}
        self._queued_n = 0  # messages in ``_queued`` (a run's ``todo`` not counted)
        self._idle = 0  # workers waiting in :meth:`take`
        self._busy: dict[Hashable, Run | WorkItem] = {}  # a run, or a message waiting to retry
        self._ready: deque[Hashable] = deque()
        self._delayed: list[tuple[float, int, WorkItem]] = []
        self._runs: set[Run] = set()
        self._results: list[Result] = []
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
            for run in self._runs:
                if run.tp in closing:
                    released.extend(run.todo)
                    run.todo.clear()
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
                    self._free_lane(item.lane, item)
            self._ready = deque(lane for lane in self._ready if lane in self._queued)
            self._queued_n = sum(len(q) for q in self._queued.values())
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

    def drain(self) -> tuple[list[WorkItem], list[WorkItem]]:
        """Hand out no new work: return every queued and waiting message (released),
        and what is running, under one lock: a group rolled back in between would
        be in neither (its messages no longer held, not yet queued).

        Partitions stay open, so what is running now still counts when it finishes.
        """
        with self._cond:
            self._draining = True
            released = [i for q in self._queued.values() for i in q]
            for run in self._runs:
                released.extend(run.todo)
                run.todo.clear()
            released.extend(item for _, _, item in self._delayed)
            for _, _, item in self._delayed:
                self._free_lane(item.lane, item)
            self._queued.clear()
            self._queued_n = 0
            self._delayed.clear()
            self._ready.clear()
            self._cond.notify_all()
            self._room.notify_all()
            return released, self._running(None)

    def is_live(self, item: WorkItem) -> bool:
        with self._mutex:
            return self._live.get(item.tp) == item.generation

    def live_generations(self) -> dict[TopicPartition, int]:
        """A snapshot of the open partitions' generations (for checking many results at once)."""
        with self._mutex:
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
                self._queued_n += 1
                if len(queue) == 1 and lane not in self._busy:
                    self._ready.append(lane)
                    woken += 1
            if woken:
                self._cond.notify(woken)

    def wait_for_room(self, queued: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s while more than ``queued`` messages are queued
        and every worker is busy (poll loop, before it fetches more); False if
        the time ran out with the queue still full.

        Returns True at once when a worker waits with no lane ready for it (more
        messages may be what it needs: with ``concurrency > 1`` the queue can be
        one busy lane; a worker merely not woken yet does not count), when
        nothing is handed out any more, and as soon as the workers have taken
        the queue down to ``queued``.
        """
        deadline: float | None = None
        with self._mutex:
            try:
                while (
                    self._queued_n > queued
                    and not (self._idle and not self._ready)
                    and not self._stopped
                    and not self._draining
                    and not self._poll_woken
                ):
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + timeout
                    elif now >= deadline:
                        return False
                    self._room_below = queued
                    self._room.wait(deadline - now)
                return True
            finally:
                self._room_below = None
                self._poll_woken = False

    def wake_poll(self) -> None:
        """End the poll loop's wait for room now (or its next one): it has
        something else to do, such as noticing a stop. Any thread."""
        with self._mutex:
            self._poll_woken = True
            self._room.notify_all()

    def _room_made(self) -> None:
        """Wake the poll loop if it waits for room and there is some (lock held)."""
        below = self._room_below
        if below is not None and (self._queued_n <= below or (self._idle and not self._ready)):
            self._room_below = None
            self._room.notify()

    def results(self) -> list[Result]:
        """Every result reported since the last call, in the order reported (poll loop)."""
        with self._mutex:
            results = self._results
            if results:
                self._results = []
            return results

    def stop(self) -> None:
        """No more work is handed out; waiting workers return None from :meth:`take`."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            self._room.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped

    # -- workers ------------------------------------------------------------

    def take(self, timeout: float, limit: int = 64) -> Run | None:
        """The next run to handle (a due retry alone, or up to ``limit`` queued
        messages of a ready lane), or None after ``timeout`` s or once stopped.
        Start its messages with :meth:`next`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                if self._delayed and self._delayed[0][0] <= now:
                    _, _, item = heapq.heappop(self._delayed)
                    return self._start(item.lane, deque((item,)))
                if self._ready:
                    lane = self._ready.popleft()
                    queue = self._queued[lane]
                    if len(queue) <= limit:
                        del self._queued[lane]
                        self._queued_n -= len(queue)
                        run = self._start(lane, queue)
                    else:
                        self._queued_n -= limit
                        run = self._start(lane, deque(queue.popleft() for _ in range(limit)))
                    self._room_made()
                    return run
                wait = deadline - now
                if self._delayed:
                    wait = min(wait, self._delayed[0][0] - now)
                if wait <= 0 and now >= deadline:
                    return None
                self._idle += 1
                self._room_made()
                try:
                    self._cond.wait(max(wait, 0.001))
                finally:
                    self._idle -= 1
            return None

    def next(self, run: Run, outcome: object = None) -> WorkItem | None:
        """Report the run's current message as done with ``outcome`` (if one is
        running) and start its next one; None when the run is over (its lane is
        free again). One lock for both: this is the per-message path."""
        with self._mutex:
            current = run.current
            if current is not None:
                self._results.append((current, outcome, None))
            todo = run.todo
            if todo and not self._stopped:
                item = run.current = todo.popleft()
                return item
            run.current = None
            self._end(run)
            return None

    def defer(
        self, run: Run, delay: float, report: tuple[object, str | None] | None = None
    ) -> bool:
        """Run the run's current message again after ``delay`` s, keeping its lane
        busy, and end the run: its messages not started go back to the front of
        the lane's queue. ``report`` (outcome, error) is reported with it, so the
        poll loop sees it before any later result of the same message.

        False (nothing deferred, nothing reported) if its partition was closed
        meanwhile, or no work is handed out any more: the caller then ends the
        run with :meth:`give_up`.
        """
        item = run.current
        assert item is not None
        with self._cond:
            if (
                self._stopped
                or self._draining
                or item.tp in self._releasing
                or self._live.get(item.tp) != item.generation
            ):
                return False
            run.current = None
            if report is not None:
                self._results.append((item, report[0], report[1]))
            heapq.heappush(self._delayed, (time.monotonic() + delay, next(self._seq), item))
            self._busy[run.lane] = item  # first: ending the run must not free the lane
            self._end(run)
            self._cond.notify_all()
            return True

    def give_up(self, run: Run, outcome: object, error: str | None) -> None:
        """Report the run's current message with ``outcome`` (released: Kafka
        redelivers it) and end the run."""
        with self._cond:
            item = run.current
            if item is not None:
                self._results.append((item, outcome, error))
            run.current = None
            self._end(run)

    # -- group transactions (the batched inbox) ------------------------------

    def hold(self, run: Run, *, start_next: bool = True) -> WorkItem | None:
        """Keep the run's current message *held*: handled, but its transaction has
        not committed, so it is not reported (its offset must not move yet) and
        still counts as running for a revoke or a drain. Then start the run's next
        message (unless ``start_next`` is False, or no work is handed out any
        more); None if there is none. The run does not end here: the caller
        settles the held messages with :meth:`report_held` or :meth:`unhold`.
        """
        with self._mutex:
            current = run.current
            assert current is not None
            run.held.append(current)
            run.current = None
            if start_next and run.todo and not self._stopped:
                item = run.current = run.todo.popleft()
                return item
            return None

    def start_group(
        self, run: Run, limit: int, may_join: Callable[[WorkItem], bool]
    ) -> list[WorkItem]:
        """Start the run's current message and up to ``limit - 1`` of the next ones
        (while ``may_join`` says so) at once, all held (see :meth:`hold`): they are
        running from now on, so a revoke or a drain waits for them instead of
        handing back a message whose inbox row the group already inserted."""
        with self._mutex:
            current = run.current
            assert current is not None
            group = [current]
            todo = run.todo
            if not self._stopped:
                while todo and len(group) < limit and may_join(todo[0]):
                    group.append(todo.popleft())
            run.held.extend(group)
            run.current = None
            return group

    def report_held(self, run: Run, outcome: object) -> None:
        """The group committed: report every held message with ``outcome``."""
        with self._mutex:
            self._results.extend((item, outcome, None) for item in run.held)
            run.held.clear()

    def unhold(self, run: Run, released: object) -> int:
        """The group rolled back: its held messages, and the current one, go back to
        the front of the run's ``todo`` in order, to be handled again (one per
        transaction). Those of a partition being released or closed meanwhile are
        reported ``released`` instead (Kafka redelivers them). Returns how many
        went back."""
        with self._mutex:
            again = list(run.held)
            run.held.clear()
            if run.current is not None:
                again.append(run.current)
                run.current = None
            back = [
                i
                for i in again
                if i.tp not in self._releasing and self._live.get(i.tp) == i.generation
            ]
            self._results.extend((i, released, None) for i in again if i not in back)
            run.todo.extendleft(reversed(back))
            return len(back)

    # -- views ----------------------------------------------------------------

    def running(self, where: Callable[[WorkItem], bool] | None = None) -> list[WorkItem]:
        """Messages started and not reported: the current ones and the held ones."""
        with self._mutex:
            return self._running(where)

    def _running(self, where: Callable[[WorkItem], bool] | None) -> list[WorkItem]:
        found = []
        for run in self._runs:
            if run.current is not None and (where is None or where(run.current)):
                found.append(run.current)
            found.extend(i for i in run.held if where is None or where(i))
        return found

    def counts(self) -> tuple[int, int, int]:
        """(running, waiting for a retry, queued)."""
        with self._mutex:
            queued = self._queued_n  # every lane's queue, kept by hand (per round: no walk)
            running = 0
            for run in self._runs:
                queued += len(run.todo)
                running += (run.current is not None) + len(run.held)
            return running, len(self._delayed), queued

    def _start(self, lane: Hashable, todo: deque[WorkItem]) -> Run:
        """``lane`` is busy with a new run of ``todo`` (lock held)."""
        run = Run(lane, todo[0].tp, todo)
        self._busy[lane] = run
        self._runs.add(run)
        return run

    def _end(self, run: Run) -> None:
        """The run is over (lock held): what it did not start goes back to the front
        of its lane's queue; the lane is free unless a retry holds it."""
        if run.over:
            return
        run.over = True
        self._runs.discard(run)
        lane = run.lane
        if run.todo:
            self._queued_n += len(run.todo)
            queue = self._queued.get(lane)
            if queue:
                queue.extendleft(reversed(run.todo))
            else:
                self._queued[lane] = run.todo
            run.todo = deque()
        if self._free_lane(lane, run):
            # One lane became ready: one worker is enough (often this one).
            self._cond.notify()

    def _free_lane(self, lane: Hashable, holder: Run | WorkItem) -> bool:
        """Free ``lane`` if ``holder`` holds it; True if the lane has queued work
        again (it is ready)."""
        if self._busy.get(lane) is holder:
            del self._busy[lane]
            if lane in self._queued:
                self._ready.append(lane)
                return True
        return False
