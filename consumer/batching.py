"""The batched inbox (``--inbox-batch N``): several messages of a lane in one transaction.

Without it, each message is one transaction: its inbox row, the handler's
writes, ``COMMIT``. With ``N > 1`` a worker starts up to ``N`` messages of the
run it took (one lane, in offset order) as a group: one statement inserts all
their inbox rows, the handlers run one after the other in the same
transaction, and one ``COMMIT`` ends it. What stays
true:

* **exactly once**: a message's writes and its inbox row are in the same
  transaction, so they commit or vanish together, as without batching;
* **commit after processing**: the group's messages are *held* by the
  dispatcher (:meth:`~outboxkit.consumer.workers.Dispatcher.start_group`) until
  the ``COMMIT`` returned; only then are they reported and may their offsets be
  stored. They are started together, so until then they all count as running
  for a revoke and a drain (none is handed back with its inbox row inserted);
* **a failure costs the group, not correctness**: there are no savepoints on
  the way (each would cost a round trip per message, as much as the
  ``COMMIT`` it saves). A handler that raises, a database error (a MySQL
  deadlock rolls back the whole transaction anyway), or a ``COMMIT`` that fails
  rolls the **whole group** back and its messages go back to the front of the
  run. A handler's exception is kept as its message's attempt
  (:attr:`WorkItem.group_error`): that message cannot join a group again, so
  the messages before it are redone (as a new group) and it is then
  classified, retried or dead-lettered alone with the same attempts as without
  batching, without running again at once. The others' writes were rolled back
  with the group, so they are done once; their handler code runs twice. After
  a database error or a failed ``COMMIT`` every message of the group is redone
  one per transaction (the inbox recognises as duplicates the ones whose
  ``COMMIT`` did land);
* **a duplicate ends the group**: when the one ``INSERT`` does not take every
  row (MySQL/MariaDB fail it on a duplicate; PostgreSQL skips the duplicate),
  the group is rolled back and its rows are inserted one at a time; the group
  commits what comes before the first one that does not go in (seen before, or
  a key the 0.1.0 rules must look up), and that message is claimed in a
  transaction of its own, which sees the committed row (a read inside the
  group's snapshot might not).

Only messages on their first attempt are grouped; a retry, a dead-letter write
and a record whose headers cannot be decoded take the normal path. A group never
waits for messages: it takes what the run already holds, so a lane's latency
grows by the handlers of the messages ahead of it in the group, at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa

from outboxkit.consumer.errors import InvalidMessageError
from outboxkit.consumer.handling import Outcome
from outboxkit.consumer.inbox import Inbox, check_not_aborted
from outboxkit.consumer.message import Message
from outboxkit.consumer.metrics import HandleTimes
from outboxkit.consumer.workers import Dispatcher, Run, WorkItem
from outboxkit.runtime.tracing import ConsumerTracing

__all__ = ["InboxGroups", "groupable"]


def groupable(item: WorkItem) -> bool:
    """May ``item`` join a group? Only a message on its first, plain attempt."""
    if item.attempts or item.failure is not None or item.outages or item.group_error:
        return False
    try:
        item.message._check_headers()
    except InvalidMessageError:
        return False  # the normal path dead-letters it
    return True


class InboxGroups:
    """Handles groups of a run's messages in one inbox transaction each."""

    def __init__(
        self,
        *,
        dispatcher: Dispatcher,
        inbox: Inbox,
        handler: Callable[[Message], None],
        size: int,
        tracing: ConsumerTracing | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.inbox = inbox
        self.handler = handler
        self.size = size
        self.tracing = tracing

    def handle(self, run: Run, first: WorkItem, times: HandleTimes) -> tuple[WorkItem | None, int]:
        """Handle a group starting at ``first`` (the run's current message).

        Returns the run's current message afterwards (not handled yet; None when
        the run is over) and how many messages from it on must be handled one per
        transaction (after a database error, or at a duplicate).

        The common case costs one statement for all the group's inbox rows, the
        handlers, and one ``COMMIT``. When that statement does not insert every
        row (a duplicate), the group is rolled back and its messages are claimed
        one at a time (:meth:`_row_by_row`), which ends the group at the duplicate.
        """
        dispatcher, inbox = self.dispatcher, self.inbox
        conn = self._begin()
        if conn is None:
            return first, 1
        group = dispatcher.start_group(run, self.size, groupable)
        try:
            if not inbox.claim_all(conn, [item.message for item in group]):
                inbox.end_group(conn)
                dispatcher.unhold(run, Outcome.RELEASED)
                again = dispatcher.next(run)
                return (None, 0) if again is None else self._row_by_row(run, again, times)
            for item in group:
                self._attempt(conn, item, times)
            inbox.commit_group(conn)
        except BaseException:
            failed = any(item.group_error is not None for item in group)
            return self._rolled_back(run, handler_failed=failed)
        dispatcher.report_held(run, Outcome.SUCCESS)
        return dispatcher.next(run), 0

    def _row_by_row(
        self, run: Run, first: WorkItem, times: HandleTimes
    ) -> tuple[WorkItem | None, int]:
        """A group whose inbox rows are inserted one at a time: it ends before the
        first message whose row does not go in (a duplicate), handled alone next."""
        dispatcher, inbox = self.dispatcher, self.inbox
        conn = self._begin()
        if conn is None:
            return first, 1
        item: WorkItem | None = first
        handled = 0
        try:
            while item is not None:
                if handled and not groupable(item):
                    break
                if not inbox.claim_in_group(conn, item.message):
                    break
                self._attempt(conn, item, times)
                handled += 1
                item = dispatcher.hold(run, start_next=handled < self.size)
            if handled:
                inbox.commit_group(conn)
            else:
                inbox.end_group(conn)
        except BaseException:
            return self._rolled_back(
                run, handler_failed=item is not None and item.group_error is not None
            )
        dispatcher.report_held(run, Outcome.SUCCESS)
        if item is None:
            return dispatcher.next(run), 0
        return item, 1

    def _begin(self) -> sa.Connection | None:
        """A connection with a group transaction begun; None if the database cannot
        be reached: the message then takes the normal path, which classifies the
        error (a dependency outage: retried without using up its attempts)."""
        try:
            return self.inbox.begin_group()
        except Exception:
            self.inbox.release()
            return None

    def _attempt(self, conn: sa.Connection, item: WorkItem, times: HandleTimes) -> None:
        try:
            self._call(item.message.with_tx(conn), times)
            check_not_aborted(conn)
        except Exception as exc:
            item.group_error = exc  # this message's attempt, settled on its own
            raise

    def _rolled_back(self, run: Run, *, handler_failed: bool) -> tuple[WorkItem | None, int]:
        """The group is rolled back: its messages go back to the front of the run.

        After a handler's failure the messages before it may form a new group
        (the failing one cannot join one: it is settled alone, with its error);
        after a database error or a failed ``COMMIT`` each goes one per
        transaction."""
        self.inbox.release()  # rolled back; the pool replaces a broken connection
        again = self.dispatcher.unhold(run, Outcome.RELEASED)
        nxt = self.dispatcher.next(run)
        if nxt is None:
            return None, 0
        return nxt, 0 if handler_failed else again

    def _call(self, message: Message, times: HandleTimes) -> None:
        timer = time.perf_counter()
        try:
            if self.tracing is None:
                self.handler(message)
            else:
                with self.tracing.span(message):
                    self.handler(message)
        finally:
            times.observe(time.perf_counter() - timer)
