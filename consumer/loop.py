"""The poll loop: the one thread that talks to the Kafka consumer.

Workers never touch the Kafka consumer; they report through a queue, and this
loop turns finished messages into stored offsets (``store_offsets``, one past
the last contiguous finished message of each partition). It keeps polling even
when every partition is paused (full, or its dead-letter topic is down), so a
slow handler never exceeds ``max.poll.interval.ms``.

Storing and committing offsets, with their bookkeeping, is the work of
:mod:`outboxkit.consumer.offsets`: the loop holds one
:class:`~outboxkit.consumer.offsets.OffsetCommits` (:attr:`PollLoop.commits`)
and calls it.

Rebalances (cooperative-sticky) arrive as callbacks inside ``consume()`` (or
``close()``), here:

* assigned: the partitions are opened for work;
* revoked: queued messages of those partitions are released, running ones get
  up to ``revoke_timeout`` to finish, the finished offsets are committed
  synchronously, then the partitions are unassigned. A handler still running
  after that is abandoned: its result is dropped and the new owner gets the
  message again;
* lost: nothing is committed (the partitions may already have a new owner).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, cast

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition

from outboxkit.consumer.handling import Outcome
from outboxkit.consumer.message import Message
from outboxkit.consumer.metrics import ConsumerMetrics
from outboxkit.consumer.offsets import OffsetCommits, PartitionOffsets
from outboxkit.consumer.report import DrainReport
from outboxkit.consumer.workers import Dispatcher, TopicPartition, WorkItem
from outboxkit.runtime.kafkaclient import log_kafka_error
from outboxkit.runtime.logs import log_event

__all__ = ["Completion", "PollLoop"]

_log = logging.getLogger("outboxkit.consumer")

_FETCH_BATCH = 500
_POLL_TIMEOUT = 0.1
#: Fetch again once at most this many messages are queued for the workers (or a
#: worker is idle): two fetches ahead, and at least two runs per worker.
_FETCH_AHEAD = 2 * _FETCH_BATCH
#: ... but wait no longer than this for it: ``consume()`` serves the rebalance
#: callbacks (a stop ends the wait at once: ``Dispatcher.wake_poll``). A round
#: whose wait ran out fetches one message only, so a worker slower than one
#: fetch per wait does not let the queue grow.
_ROOM_WAIT = 0.5


#: A worker's report on one message: the item, its outcome, an error text
#: (:data:`outboxkit.consumer.workers.Result`, with the outcome typed).
Completion = tuple[WorkItem, Outcome, str | None]


class PollLoop:
    """The poll thread's state: fetch, hand out, collect, pause, and the rebalance
    callbacks; offsets are stored and committed through :attr:`commits`."""

    def __init__(
        self,
        *,
        kafka: Any,
        dispatcher: Dispatcher,
        metrics: ConsumerMetrics,
        lane_of: Callable[[Message], Hashable] | None,  # None: the partition is the lane
        max_buffered: int,
        revoke_timeout: float,
        workers: int = 1,
        run_limit: int = 64,
    ) -> None:
        self.kafka = kafka
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.lane_of = lane_of
        self.max_buffered = max_buffered
        self.fetch_ahead = max(_FETCH_AHEAD, 2 * run_limit * workers)
        self.revoke_timeout = revoke_timeout
        self.offsets: dict[TopicPartition, PartitionOffsets] = {}
        self.paused: dict[TopicPartition, set[str]] = {}
        self.dlq_blocked: dict[TopicPartition, int] = defaultdict(int)
        self.totals: dict[str, int] = defaultdict(int)
        self.last_batch = 0
        self.draining = False
        self._watch: set[WorkItem] | None = None  # the drain batch
        self._report = DrainReport()
        self.commits = OffsetCommits(
            kafka=kafka, offsets=self.offsets, report=self._report, draining=self._is_draining
        )
        self._rebalanced = time.monotonic()
        self._rebalanced_now()  # the subscription, before the first rebalance

    # -- the loop ---------------------------------------------------------------

    def step(self) -> None:
        """One round: wait until the workers need more (bounded), fetch, hand out,
        collect what finished, store offsets."""
        room = self.dispatcher.wait_for_room(self.fetch_ahead, _ROOM_WAIT)
        records = self.kafka.consume(
            num_messages=_FETCH_BATCH if room else 1, timeout=_POLL_TIMEOUT
        )
        if records:
            self.last_batch = len(records)
            self._accept(records)
        self.collect()

    def _accept(self, records: list[Any]) -> None:
        """Track and hand out one fetched batch: one dispatcher lock for all of it.

        A batch holds runs of records of one partition: the partition's tuple,
        tracker and received offsets are handled once per run, not per record.
        """
        items: list[WorkItem] = []
        touched: list[TopicPartition] = []
        lane_of = self.lane_of
        from_kafka = Message.from_kafka
        offsets = self.offsets
        draining = self.draining
        topic: str | None = None
        partition = -1
        tp: TopicPartition = ("", -1)
        tracker: PartitionOffsets | None = None
        received: list[int] = []
        for record in records:
            err = record.error()
            if err is not None:
                self._kafka_error(err)
                continue
            if draining:
                continue  # Kafka redelivers it
            if record.partition() != partition or record.topic() != topic:
                if tracker is not None and received:
                    tracker.received_many(received)
                topic, partition = record.topic(), record.partition()
                tp = (topic, partition)
                tracker = offsets.get(tp)
                received = []
                if tracker is not None:
                    touched.append(tp)
            if tracker is None:
                continue  # not ours any more: Kafka redelivers it
            received.append(record.offset())
            message = from_kafka(record)
            items.append(WorkItem(message, tp if lane_of is None else lane_of(message), tp))
        if tracker is not None and received:
            tracker.received_many(received)
        if not items:
            return
        self.dispatcher.submit_many(items)
        for tp in touched:
            tracker = self.offsets.get(tp)
            if tracker is not None and tracker.window >= self.max_buffered:
                self._pause(tp, "full")  # bounds memory: see offsets.py

    def collect(self) -> None:
        """Apply what the workers reported; store the offsets that moved.

        A success of a live partition outside a drain (nearly every result) takes
        the short path: counted, and its offset marked finished with the others
        of its partition at once.
        """
        to_store: dict[TopicPartition, int] = {}
        counts: dict[str, int] = defaultdict(int)
        results = cast(list[Completion], self.dispatcher.results())
        if results:
            # Partitions open and close only on this thread: one snapshot serves
            # every result collected now.
            live = self.dispatcher.live_generations()
            finished: dict[TopicPartition, list[int]] = {}
            success, succeeded = Outcome.SUCCESS, 0
            short = self._watch is None
            for done in results:
                item = done[0]
                if done[1] is success and short and not item.dlq_blocked:
                    succeeded += 1
                    tp = item.tp
                    if live.get(tp) == item.generation:
                        offsets = finished.get(tp)
                        if offsets is None:
                            finished[tp] = [item.message.offset]
                        else:
                            offsets.append(item.message.offset)
                else:
                    self._apply(done, to_store, counts, live)
            if succeeded:
                counts[success._value_] += succeeded
            for tp, offsets in finished.items():
                self._finished(tp, offsets, to_store)
        for result, n in counts.items():  # one metric update per result, not per message
            self.metrics.messages.labels(result=result).inc(n)
            self.totals[result] += n
        if to_store:
            self.commits.store(to_store)
        running, waiting, queued = self.dispatcher.counts()
        self.metrics.inflight.set(running + waiting)
        self.metrics.buffered.set(queued)

    def _finished(
        self, tp: TopicPartition, offsets: list[int], to_store: dict[TopicPartition, int]
    ) -> None:
        """``offsets`` of ``tp`` (still live) finished: store what moved, resume if room."""
        tracker = self.offsets.get(tp)
        if tracker is None:
            return
        stored = tracker.finished_many(offsets)
        if stored is not None:
            to_store[tp] = stored
        if tp in self.paused and tracker.window < max(1, self.max_buffered // 2):
            self._resume(tp, "full")

    def _apply(
        self,
        done: Completion,
        to_store: dict[TopicPartition, int],
        counts: dict[str, int],
        generations: dict[TopicPartition, int],
    ) -> None:
        item, outcome, error = done
        tp = item.tp
        live = generations.get(tp) == item.generation
        if outcome is Outcome.DLQ_BLOCKED:
            if live and not item.dlq_blocked:
                item.dlq_blocked = True
                self.dlq_blocked[tp] += 1
                self._pause(tp, "dlq", error=error)
            return
        if item.dlq_blocked:
            item.dlq_blocked = False
            self.dlq_blocked[tp] -= 1
            if self.dlq_blocked[tp] <= 0:
                del self.dlq_blocked[tp]
                self._resume(tp, "dlq")
        if outcome.final:
            counts[outcome._value_] += 1  # the plain attribute behind ``.value``
        if self._watch is not None and item in self._watch:
            self._watch.discard(item)
            self._count_drained(outcome)
        if not live or not outcome.final:
            return  # revoked meanwhile: the new owner handles the message again
        self._finished(tp, [item.message.offset], to_store)

    def _kafka_error(self, err: Any) -> None:
        if err.code() == KafkaError._PARTITION_EOF:
            return
        log_kafka_error(_log, err)
        if err.fatal():
            raise KafkaException(err)

    # -- rebalances (called inside consume(), or close()) -------------------------

    def on_assign(self, kafka: Any, partitions: list[Any]) -> None:
        kafka.incremental_assign(partitions)
        if partitions and not self.draining:
            # librdkafka keeps a partition's pause across assignments, while this
            # consumer forgot it had paused it when it was revoked or lost: a
            # partition paused then would never be fetched again once assigned back.
            try:
                kafka.resume(partitions)
            except KafkaException as exc:
                log_event(_log, "resume-failed", level=logging.WARNING, error=str(exc))
        tps = [(p.topic, p.partition) for p in partitions]
        for tp in tps:
            self.dispatcher.open(tp)
            self.offsets[tp] = PartitionOffsets()
            if self.draining:
                self._pause(tp, "draining")
        if tps:
            log_event(_log, "partitions-assigned", partitions=_names(tps))
        self._rebalanced_now()

    def on_revoke(self, kafka: Any, partitions: list[Any]) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        released = self.dispatcher.release(tps)
        self._count_released(released)
        if not self.commits.closing:
            deadline = time.monotonic() + self.revoke_timeout
            while self.dispatcher.running(lambda i: i.tp in tps) and time.monotonic() < deadline:
                time.sleep(0.02)
                self.collect()
        self.collect()
        abandoned = len(self.dispatcher.running(lambda i: i.tp in tps))
        committed = self.commits.commit(tps)
        self.dispatcher.close(tps)
        self._forget(tps)
        kafka.incremental_unassign(partitions)
        self._rebalanced_now()
        log_event(
            _log,
            "partitions-revoked",
            partitions=_names(tps),
            committed=committed,
            released=len(released),
            abandoned=abandoned,
        )

    def on_lost(self, kafka: Any, partitions: list[Any]) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        behind = [tp for tp in tps if (t := self.offsets.get(tp)) is not None and t.uncommitted]
        if behind and self.draining:
            # The exit commit cannot cover them any more: what finished there
            # since the last commit is handled again by the next owner.
            self._report.commit_error = f"lost before their commit: {', '.join(_names(behind))}"
        released = self.dispatcher.close(tps)
        self._count_released(released)
        self._forget(tps)
        kafka.incremental_unassign(partitions)
        self._rebalanced_now()
        log_event(
            _log,
            "partitions-lost",
            level=logging.WARNING,
            partitions=_names(tps),
            released=len(released),
            note="nothing committed: the partitions may have a new owner",
        )

    def _rebalanced_now(self) -> None:
        """A rebalance ended here (or the subscription began): the assigned count
        and the time, for ``worker_assigned_partitions`` and the alert on a group
        that never assigns anything (a coordinator that does not answer)."""
        self._rebalanced = time.monotonic()
        self.metrics.assigned.set(len(self.offsets))
        self.metrics.rebalanced_at.set(time.time())

    def since_rebalance(self) -> float:
        """Seconds since the last rebalance (or the subscription), for readiness."""
        return time.monotonic() - self._rebalanced

    # -- pausing ----------------------------------------------------------------

    def _pause(self, tp: TopicPartition, reason: str, **fields: object) -> None:
        reasons = self.paused.setdefault(tp, set())
        if reason in reasons:
            return
        if not reasons:
            try:
                self.kafka.pause([KafkaTopicPartition(*tp)])
            except KafkaException as exc:
                log_event(_log, "pause-failed", level=logging.WARNING, error=str(exc))
        reasons.add(reason)
        self.metrics.paused.labels(reason=reason).inc()
        if reason != "full":
            log_event(
                _log,
                "partition-paused",
                level=logging.WARNING if reason == "dlq" else logging.INFO,
                topic=tp[0],
                partition=tp[1],
                reason=reason,
                **fields,
            )

    def _resume(self, tp: TopicPartition, reason: str) -> None:
        reasons = self.paused.get(tp)
        if not reasons or reason not in reasons:
            return
        reasons.discard(reason)
        self.metrics.paused.labels(reason=reason).dec()
        if reason != "full":
            log_event(_log, "partition-resumed", topic=tp[0], partition=tp[1], reason=reason)
        if not reasons and not self.draining:
            del self.paused[tp]
            try:
                self.kafka.resume([KafkaTopicPartition(*tp)])
            except KafkaException as exc:
                log_event(_log, "resume-failed", level=logging.WARNING, error=str(exc))

    def _forget(self, tps: Iterable[TopicPartition]) -> None:
        for tp in tps:
            self.offsets.pop(tp, None)
            for reason in self.paused.pop(tp, set()):
                self.metrics.paused.labels(reason=reason).dec()
            self.dlq_blocked.pop(tp, None)
            self.metrics.forget_partition(*tp)

    # -- drain ---------------------------------------------------------------------

    def _is_draining(self) -> bool:
        return self.draining

    def begin_drain(self) -> None:
        """Stop taking work: pause everything, release what has not started."""
        self.collect()
        self.draining = True
        for tp in list(self.offsets):
            self._pause(tp, "draining")
        released, running = self.dispatcher.drain()
        self._watch = set(running)
        self._report.batch_size = len(running) + len(released)
        self._report.released += len(released)

    def wait_drained(self, deadline: float, hurry: Callable[[], bool]) -> None:
        """Serve callbacks and collect results until the drain batch is done."""
        while self._watch and time.monotonic() < deadline and not hurry():
            # Every partition is paused: consume() serves callbacks; a record it
            # still returns is dropped and redelivered later.
            self.kafka.consume(num_messages=_FETCH_BATCH, timeout=0.05)
            self.collect()
        self.collect()

    def end_drain(self) -> DrainReport:
        """Whatever still runs is unknown: not committed, redelivered."""
        self.dispatcher.stop()
        self.collect()
        report = self._report
        report.unknown = len(self._watch or ())
        self._watch = set()
        return report

    def _count_released(self, items: list[WorkItem]) -> None:
        """Messages handed back by a revocation or a loss: those of the drain batch
        count as released, and leave it, so that none is also counted unknown at
        its end (a group rolled back during the drain puts its messages back in
        the run's queue, where a revocation then releases them)."""
        watch = self._watch
        if not watch:
            return
        for item in items:
            if item in watch:
                watch.discard(item)
                self._report.released += 1

    def _count_drained(self, outcome: Outcome) -> None:
        if outcome is Outcome.SUCCESS:
            self._report.succeeded += 1
        elif outcome is Outcome.DUPLICATE:
            self._report.duplicate += 1
        elif outcome is Outcome.DEAD_LETTERED:
            self._report.failed += 1
        else:
            self._report.released += 1


def _names(tps: Iterable[TopicPartition]) -> list[str]:
    return sorted(f"{t}/{p}" for t, p in tps)
