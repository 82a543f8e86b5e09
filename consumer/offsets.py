"""Which offset of a partition may be stored: the at-least-once bookkeeping.

Kafka commits one number per partition: "everything below this was handled".
With several workers, messages of one partition finish out of order, so the
number to store is one past the longest run of *finished* messages starting at
the oldest unfinished one. A message still running (or waiting for a retry, or
for the dead-letter topic) holds the partition's offset back, however many
later messages have finished.

Offsets are tracked as received, not as a numeric range: compaction and
transaction markers leave gaps, and a gap must not hold the offset back.
"""

from __future__ import annotations

from collections import deque

__all__ = ["PartitionOffsets"]


class PartitionOffsets:
    """Received and finished offsets of one partition (single-threaded: the poll loop)."""

    def __init__(self) -> None:
        self._pending: deque[int] = deque()  # received, in order, not yet below the mark
        self._finished: set[int] = set()
        self._uncommitted: deque[int] = deque()  # finished and stored, awaiting a commit
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
        advanced = False
        while self._pending and self._pending[0] in self._finished:
            done = self._pending.popleft()
            self._finished.discard(done)
            self._uncommitted.append(done)
            self.stored = done + 1
            advanced = True
        return self.stored if advanced else None

    def confirmed(self, offset: int) -> int:
        """The broker confirmed a commit of ``offset``; return how many messages it covered."""
        if self.committed is None or offset > self.committed:
            self.committed = offset
        covered = 0
        while self._uncommitted and self._uncommitted[0] < offset:
            self._uncommitted.popleft()
            covered += 1
        return covered

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
