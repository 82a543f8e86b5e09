"""The batched inbox (``--inbox-batch N``): several messages of a lane in one transaction.

Without it, each message is one transaction: its inbox row, the handler's
writes, ``COMMIT``. With ``N > 1`` a worker handles up to ``N`` messages of the
run it took (one lane, in offset order) in one transaction, each message's
inbox row inserted just before its handler runs, and commits once. What stays
true:

* **exactly once**: a message's writes and its inbox row are in the same
  transaction, so they commit or vanish together, as without batching;
* **commit after processing**: the group's messages are *held* by the
  dispatcher (:meth:`~outboxkit.consumer.workers.Dispatcher.hold`) until the
  ``COMMIT`` returned; only then are they reported and may their offsets be
  stored. Until then they count as running for a revoke and a drain;
* **a failure costs the group, not correctness**: there are no savepoints on
  the way (each would cost a round trip per message, as much as the
  ``COMMIT`` it saves). A handler that raises, a database error (a MySQL
  deadlock rolls back the whole transaction anyway), or a ``COMMIT`` that fails
  rolls the **whole group** back. Its messages go back to the front of the run
  and are handled again **one per transaction**, the normal path. A handler's
  exception is kept as its message's attempt (:attr:`WorkItem.group_error`):
  that message is not run again at once but classified, retried or
  dead-lettered with the same attempts as without batching, after the messages
  before it were redone (lane order). The others' writes were rolled back with
  the group, so they are done once; their handler code runs twice. After a
  database error or a failed ``COMMIT`` every message is redone (the inbox
  recognises as duplicates the ones whose ``COMMIT`` did land);
* **a duplicate ends the group**: a message whose inbox row does not go in
  (seen before, or a key the release-1 rules must look up) is not handled in
  the group; the group commits what it has, and that message is claimed in a
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
        transaction (after a rollback, or a duplicate: 1).
        """
        dispatcher = self.dispatcher
        inbox = self.inbox
        conn = inbox.begin_group()
        item: WorkItem | None = first
        handled = 0
        try:
            while item is not None:
                if handled and not groupable(item):
                    break
                if not inbox.claim_in_group(conn, item.message):
                    break
                try:
                    self._call(item.message.with_tx(conn), times)
                    check_not_aborted(conn)
                except Exception as exc:
                    item.group_error = exc  # this message's attempt, settled on its own
                    raise
                handled += 1
                item = dispatcher.hold(run, start_next=handled < self.size)
            if handled:
                inbox.commit_group(conn)
            else:
                inbox.end_group(conn)
        except BaseException:
            inbox.release()  # rolled back; the pool replaces a broken connection
            again = dispatcher.unhold(run, Outcome.RELEASED)
            nxt = dispatcher.next(run)
            if nxt is None:
                return None, 0
            return nxt, again
        dispatcher.report_held(run, Outcome.SUCCESS)
        if item is None:
            return dispatcher.next(run), 0
        return item, 1

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
