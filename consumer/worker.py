"""A worker thread of the consumer: take runs of one lane's messages, handle them in order.

The consumer starts ``concurrency`` of these; each takes a run from the
:class:`~outboxkit.consumer.workers.Dispatcher`, hands its messages one by one
to :class:`~outboxkit.consumer.handling.Handling` (or a group of them to
:class:`~outboxkit.consumer.batching.InboxGroups`, one inbox transaction), and
reports each result as it comes. A result that must wait (a retry, a
dead-letter write to try again) ends the run.
"""

from __future__ import annotations

from outboxkit.consumer.asyncio_handler import HandlerCancelled
from outboxkit.consumer.batching import InboxGroups, groupable
from outboxkit.consumer.handling import Handling, Outcome, Result
from outboxkit.consumer.metrics import ConsumerMetrics, HandleTimes
from outboxkit.consumer.workers import Dispatcher, Run

__all__ = ["Worker"]


class Worker:
    """What each worker thread runs (:meth:`run`); one instance serves them all."""

    def __init__(
        self,
        *,
        dispatcher: Dispatcher,
        handling: Handling,
        groups: InboxGroups | None,
        metrics: ConsumerMetrics,
        run_limit: int,
    ) -> None:
        self._dispatcher = dispatcher
        self._handling = handling
        self._groups = groups
        self._metrics = metrics
        self._run_limit = run_limit

    def run(self) -> None:
        """Handle runs until the dispatcher stops; then hand back this thread's inbox session."""
        try:
            self._until_stopped()
        except HandlerCancelled:
            pass  # an async handler cancelled at the drain deadline: already counted unknown
        finally:
            if self._handling.inbox is not None:
                self._handling.inbox.release()

    def _until_stopped(self) -> None:
        dispatcher = self._dispatcher
        times = HandleTimes(self._metrics.handle_seconds)
        while True:
            run = dispatcher.take(timeout=0.5, limit=self._run_limit)
            if run is None:
                if dispatcher.stopped:
                    return
                continue
            try:
                self._handle_run(run, times)
            finally:
                times.flush()

    def _handle_run(self, run: Run, times: HandleTimes) -> None:
        """Handle ``run``'s messages in order, each reported as it finishes.

        A result that must wait (a retry, a dead-letter write to try again) ends
        the run: the message keeps its lane and the rest go back to its queue.
        With ``inbox_batch > 1`` groups of the run's messages share one
        transaction and are reported together after its ``COMMIT``
        (:mod:`outboxkit.consumer.batching`); after a rolled-back group, or at a
        duplicate, the messages it names go one per transaction first.
        """
        next_item, process = self._dispatcher.next, self._handling.process
        groups = self._groups
        solo = 0  # messages to handle one per transaction before grouping again
        item = next_item(run)
        while item is not None:
            if groups is not None and not solo and groupable(item):
                item, solo = groups.handle(run, item, times)
                times.flush(due_only=True)
                continue
            solo = max(0, solo - 1)
            try:
                result = process(item, times)
            except BaseException:
                # A bug outside the handler: keep the message (nothing is skipped) and
                # let the supervisor log and restart this worker.
                self._wait(run, Result(Outcome.RETRY, delay=1.0))
                raise
            if result.delay is not None:
                self._wait(run, result)
                return
            times.flush(due_only=True)
            item = next_item(run, result.outcome)

    def _wait(self, run: Run, result: Result) -> None:
        """The run's current message runs again after ``result.delay`` (the run ends)."""
        outcome = result.outcome
        assert result.delay is not None
        report = None if outcome is Outcome.RETRY else (outcome, result.error)
        if not self._dispatcher.defer(run, result.delay, report):
            self._dispatcher.give_up(run, Outcome.RELEASED, result.error)
        elif outcome is Outcome.RETRY:
            self._metrics.messages.labels(result="retry").inc()
