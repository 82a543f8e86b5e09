"""Offset committing: which offset may be stored, and when it is committed.

Everything between "a message finished" and "the group holds its offset" is
here: :class:`PartitionOffsets` (the bookkeeping below), :class:`OffsetCommits`
(``store_offsets``, the commit callback, the synchronous commit a revocation
asks for, the exit commit) and :func:`commit_and_close` (the final commit and
close at exit). The poll loop (:mod:`outboxkit.consumer.loop`) holds one
:class:`OffsetCommits` and calls it, from its rebalance callbacks too.
librdkafka commits stored offsets every ``commit_interval``; revocations and
the exit commit synchronously. The exit commit may find the group rebalancing
(a rolling deploy's new member joined, this one gave up partitions and has not
rejoined yet: ``ILLEGAL_GENERATION``, ``REBALANCE_IN_PROGRESS``); it then keeps
serving the group, which completes the rejoin, and tries again within the
drain's budget (:meth:`OffsetCommits.commit_at_exit`).

Which offset of a partition may be stored: the at-least-once bookkeeping.

Kafka commits one number per partition: "everything below this was handled".
With several workers, messages of one partition finish out of order, so the
number to store is one past the longest run of *finished* messages starting at
the oldest unfinished one. A message still running (or waiting for a retry, or
for the dead-letter topic) holds the partition's offset back, however many
later messages have finished.

Offsets are tracked as received, not as a numeric range: compaction and
transaction markers leave gaps, and a gap must not hold the offset back.

**Bounded memory.** What a tracker holds never depends on how many messages a
partition has seen, or on whether commits are confirmed:

* received offsets above the stored mark (:attr:`PartitionOffsets.window`,
  running, finished or queued): the poll loop pauses the partition once the
  window reaches ``max_buffered`` (plus at most one fetched batch), even when
  all but the oldest are finished — one stuck message cannot make the window
  grow without end;
* for counting what a confirmed commit covered, at most ``_MAX_MARKS``
  (stored offset, running total) pairs; older ones are forgotten, which can
  only delay a count (the next confirmed commit includes it), never lose or
  double it. Nothing else is kept per finished message, so a coordinator that
  never confirms a commit (an outage, or periodic commits switched off) costs
  no memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import tenacity
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition

from outboxkit.consumer.report import DrainReport
from outboxkit.consumer.workers import TopicPartition
from outboxkit.runtime.logs import log_event

__all__ = ["CommitRefused", "OffsetCommits", "PartitionOffsets", "commit_and_close"]

_log = logging.getLogger("outboxkit.consumer")

_MAX_MARKS = 64

#: Commit errors that serving the group for a moment cures: the group is
#: rebalancing, or moved to a generation this member has not joined yet (it gave
#: up partitions in a cooperative rebalance and must poll to rejoin), or forgot
#: this member; or its coordinator is loading, moving or not reached yet (after
#: a broker restart or freeze). librdkafka flags none of these retriable on a
#: synchronous commit.
_TRANSIENT_COMMIT_ERRORS = frozenset(
    {
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._WAIT_COORD,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
    }
)


class CommitRefused(Exception):
    """A commit was not accepted. ``retriable``: only for now (the group is
    rebalancing, the coordinator is moving): the same offsets may be committed
    once this member rejoined."""

    def __init__(self, message: str, *, retriable: bool) -> None:
        super().__init__(message)
        self.retriable = retriable


def _curable(err: object) -> bool:
    """A commit error that serving the group (a rejoin) or a retry can cure."""
    if not isinstance(err, KafkaError):
        return False
    return err.code() in _TRANSIENT_COMMIT_ERRORS or bool(err.retriable())


class PartitionOffsets:
    """Received and finished offsets of one partition (single-threaded: the poll loop)."""

    def __init__(self) -> None:
        self._pending: deque[int] = deque()  # received, in order, not yet below the mark
        self._finished: set[int] = set()
        # (stored offset, messages moved below the mark so far), newest last.
        self._marks: deque[tuple[int, int]] = deque(maxlen=_MAX_MARKS)
        self._moved = 0  # messages moved below the stored mark, ever
        self._counted = 0  # of those, covered by a confirmed commit
        self.stored: int | None = None  # next offset to consume, as last stored
        self.committed: int | None = None  # as last confirmed by the broker

    def received(self, offset: int) -> None:
        if self._pending and offset <= self._pending[-1]:
            # The same record again (a seek after a rebalance): it is already tracked.
            return
        if self.stored is not None and offset < self.stored:
            return
        self._pending.append(offset)

    def received_many(self, offsets: list[int]) -> None:
        """:meth:`received` for each of ``offsets`` (ascending, one fetch of the partition)."""
        pending = self._pending
        if (not pending or offsets[0] > pending[-1]) and (
            self.stored is None or offsets[0] >= self.stored
        ):
            pending.extend(offsets)  # the usual case: all new, none below the mark
            return
        for offset in offsets:
            self.received(offset)

    def finished(self, offset: int) -> int | None:
        """Mark ``offset`` finished; return the new offset to store, or None if unchanged."""
        return self.finished_many((offset,))

    def finished_many(self, offsets: Iterable[int]) -> int | None:
        """Mark ``offsets`` finished; return the new offset to store, or None if unchanged."""
        pending, finished = self._pending, self._finished
        moved = 0
        for offset in offsets:
            if not finished and pending and pending[0] == offset:
                # In order (the usual case): straight below the mark, no set.
                pending.popleft()
                self.stored = offset + 1
                moved += 1
            else:
                finished.add(offset)
        while pending and pending[0] in finished:
            done = pending.popleft()
            finished.discard(done)
            self.stored = done + 1
            moved += 1
        if not moved:
            return None
        self._moved += moved
        assert self.stored is not None
        self._marks.append((self.stored, self._moved))
        return self.stored

    def confirmed(self, offset: int) -> int:
        """The broker confirmed a commit of ``offset``; return how many messages it covered."""
        if self.committed is None or offset > self.committed:
            self.committed = offset
        total = None
        while self._marks and self._marks[0][0] <= offset:
            total = self._marks.popleft()[1]
        if total is None or total <= self._counted:
            return 0
        covered, self._counted = total - self._counted, total
        return covered

    @property
    def uncommitted(self) -> bool:
        """An offset was stored that no confirmed commit covers yet."""
        return self.stored is not None and (self.committed is None or self.stored > self.committed)

    @property
    def window(self) -> int:
        """Messages received and not yet below the stored mark (finished or not)."""
        return len(self._pending)

    @property
    def unfinished(self) -> int:
        """Messages received and not yet finished (running, retrying, queued)."""
        return len(self._pending) - len(self._finished)

    @property
    def oldest_unfinished(self) -> int | None:
        for offset in self._pending:
            if offset not in self._finished:
                return offset
        return None


class OffsetCommits:
    """Storing and committing the offsets of the poll loop's partitions.

    Runs on the poll thread only, like the loop that holds it (``PollLoop.commits``
    in :mod:`outboxkit.consumer.loop`). Given what it
    works on: the Kafka consumer; the loop's trackers (the loop adds a
    partition's at assignment and drops it at revocation or loss; this reads
    them); the drain report, where the exit commit's outcome goes; and whether
    the drain began (a failed commit is the exit record's only then).
    """

    def __init__(
        self,
        *,
        kafka: Any,
        offsets: dict[TopicPartition, PartitionOffsets],
        report: DrainReport,
        draining: Callable[[], bool],
    ) -> None:
        self.kafka = kafka
        self.offsets = offsets
        self.report = report
        self._draining = draining
        #: The exit commit began: a revocation then commits without waiting for
        #: handlers (what still runs now is unknown).
        self.closing = False

    def on_commit(self, err: Any, partitions: list[Any]) -> None:
        """Commit callback (periodic commits): count what the broker confirmed."""
        if err is not None and err.code() != KafkaError._NO_OFFSET:
            log_event(_log, "commit-failed", level=logging.WARNING, error=str(err))
            return
        for p in partitions or ():
            tracker = self.offsets.get((p.topic, p.partition))
            if tracker is not None and p.error is None and p.offset >= 0:
                tracker.confirmed(p.offset)

    def commit(self, tps: Iterable[TopicPartition] | None = None) -> dict[str, int]:
        """Synchronously commit the stored offsets of ``tps`` (default: all assigned).

        Returns ``{"topic/partition": offset}`` of what the broker confirmed.
        Nothing to commit (``_NO_OFFSET``) is not an error; any other error is
        logged and kept for the exit record (``commit_error``).
        """
        try:
            return self._commit_once(tps)
        except CommitRefused as exc:
            self._commit_failed(str(exc))
            return {}

    def commit_at_exit(self, until: float) -> dict[str, int]:
        """The exit commit: :meth:`commit` every assigned partition, and while the
        group refuses it for now (:class:`CommitRefused`), serve the group and
        try again, until ``until`` (monotonic).

        Serving is ``consume()`` with every partition paused (the drain paused
        them, and a partition assigned meanwhile is paused as it comes): it runs
        the rejoin the rebalance waits for and its callbacks. A record it still
        returns is dropped, never handed out or stored: Kafka redelivers it. A
        revocation meanwhile commits its partitions as usual, without waiting
        for handlers (what still runs now is unknown).
        """
        self.closing = True
        tries = 0

        def retry_logged(state: tenacity.RetryCallState) -> None:
            nonlocal tries
            tries = state.attempt_number
            if tries == 1:
                exc = state.outcome.exception() if state.outcome else None
                log_event(
                    _log,
                    "commit-retrying",
                    level=logging.WARNING,
                    error=str(exc),
                    budget_s=round(max(0.0, until - time.monotonic()), 3),
                    note="serving the group until it accepts the exit commit",
                )

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(
                lambda exc: isinstance(exc, CommitRefused) and exc.retriable
            ),
            wait=tenacity.wait_exponential(multiplier=0.05, max=0.5),
            stop=lambda _state: time.monotonic() >= until,
            sleep=lambda seconds: self._serve_group(min(seconds, until - time.monotonic())),
            before_sleep=retry_logged,
            reraise=True,
        )
        try:
            confirmed = retrying(self._commit_once)
        except CommitRefused as exc:
            self._commit_failed(str(exc), attempts=tries + 1)
            return {}
        if tries:
            log_event(_log, "commit-recovered", attempts=tries + 1, committed=confirmed)
        return confirmed

    def _commit_once(self, tps: Iterable[TopicPartition] | None = None) -> dict[str, int]:
        """One synchronous commit; :class:`CommitRefused` if any wanted offset was not
        committed (what was committed is recorded first)."""
        wanted = []
        for tp in self.offsets if tps is None else tps:
            tracker = self.offsets.get(tp)
            if tracker is None or not tracker.uncommitted:
                continue
            assert tracker.stored is not None
            wanted.append(KafkaTopicPartition(tp[0], tp[1], tracker.stored))
        if not wanted:
            return {}
        try:
            result = self.kafka.commit(offsets=wanted, asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError._NO_OFFSET:
                return {}
            raise CommitRefused(str(exc), retriable=_curable(err)) from None
        confirmed: dict[str, int] = {}
        refused: list[str] = []
        curable = True
        for p in result or ():
            if p.error is not None:
                refused.append(f"{p.topic}/{p.partition}: {p.error}")
                curable = curable and _curable(p.error)
                continue
            tracker = self.offsets.get((p.topic, p.partition))
            if tracker is not None:
                self.report.committed_messages += tracker.confirmed(p.offset)
            confirmed[f"{p.topic}/{p.partition}"] = p.offset
        if refused:
            raise CommitRefused("; ".join(refused), retriable=curable)
        return confirmed

    def _commit_failed(self, error: str, **fields: object) -> None:
        log_event(_log, "commit-failed", level=logging.ERROR, error=error, **fields)
        if self._draining():
            # The exit record describes the drain: a revocation's failed commit
            # long before it is not the exit's (the new owner redid that work).
            self.report.commit_error = error

    def _serve_group(self, seconds: float) -> None:
        """Poll for ``seconds`` so the group's rebalance can complete; take no work."""
        deadline = time.monotonic() + max(0.0, seconds)
        while True:
            try:
                self.kafka.consume(num_messages=500, timeout=0.05)
            except KafkaException as exc:
                log_event(_log, "commit-retry-poll-failed", level=logging.WARNING, error=str(exc))
                return
            if time.monotonic() >= deadline:
                return

    def committed_offsets(self) -> dict[str, int]:
        """``{"topic/partition": offset}`` confirmed committed, for assigned partitions."""
        return {
            f"{t}/{p}": tracker.committed
            for (t, p), tracker in sorted(self.offsets.items())
            if tracker.committed is not None
        }

    def store(self, offsets: dict[TopicPartition, int]) -> None:
        """``store_offsets``: librdkafka commits them with the next periodic commit."""
        try:
            self.kafka.store_offsets(
                offsets=[KafkaTopicPartition(t, p, o) for (t, p), o in offsets.items()]
            )
        except KafkaException as exc:
            # Only on a partition just revoked; its offsets are the new owner's business.
            log_event(_log, "store-offsets-failed", level=logging.WARNING, error=str(exc))


def commit_and_close(
    commits: OffsetCommits,
    close_timeout: float,
    on_closed: Callable[[], None],
    on_committed: Callable[[], None] = lambda: None,
    *,
    budget_until: float | None = None,
) -> dict[str, int]:
    """The final commit at exit: commit synchronously what is done, then close the
    consumer (leaving the group). Returns what the group holds for this
    process's partitions; ``on_committed`` runs once the commit returned,
    ``on_closed`` once closed.

    A commit the group refuses for now (a rebalance this member has to rejoin)
    is retried while the group is served, until ``budget_until`` (monotonic:
    what the drain's budget leaves; default now) plus half of ``close_timeout``;
    the close gets the other half at least. Both run on one thread joined
    within ``budget_until + close_timeout``, so a sick cluster cannot hang the
    exit (a commit or close stuck inside librdkafka is left behind, logged).
    """
    box: dict[str, int] = {}
    start = time.monotonic()
    until = max(start, budget_until or start) + close_timeout

    def commit_and_close() -> None:
        commits.commit_at_exit(until - close_timeout / 2)
        # What the group holds now for the partitions this process had, whether
        # the periodic commit or this one wrote it.
        box.update(commits.committed_offsets())
        on_committed()
        commits.closing = True
        commits.kafka.close()
        on_closed()

    thread = threading.Thread(target=commit_and_close, name="consumer-close", daemon=True)
    thread.start()
    thread.join(max(0.0, until - time.monotonic()))
    if thread.is_alive():
        log_event(
            _log,
            "close-timed-out",
            level=logging.ERROR,
            close_timeout_s=close_timeout,
            note="the group notices this member is gone after session.timeout.ms",
        )
    return dict(box)
