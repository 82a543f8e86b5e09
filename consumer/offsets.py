"""Which offset of a partition may be stored: the at-least-once bookkeeping.

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

from collections import deque

__all__ = ["PartitionOffsets"]

_MAX_MARKS = 64


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

    def finished(self, offset: int) -> int | None:
        """Mark ``offset`` finished; return the new offset to store, or None if unchanged."""
        self._finished.add(offset)
        moved = 0
        while self._pending and self._pending[0] in self._finished:
            done = self._pending.popleft()
            self._finished.discard(done)
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
