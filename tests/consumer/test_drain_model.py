"""The drain's bookkeeping as a model: the poll loop and the dispatcher driven one
step at a time, with a drain starting at any point and rebalances, group
rollbacks, retries and results arriving during it.

The workers are played by the test (take, finish, hold a group, roll it back,
defer a retry), Kafka by :class:`FakeKafka`: what is checked is the
consumer's own bookkeeping, whatever the order of events:

* the exit record adds up: every message of the drain batch is counted once,
  as succeeded, failed (dead-lettered), unknown or released;
* no stored or committed offset passes a message that was never finished;
* the exit commit lands once the group lets it (it refuses until this member
  polled: the rejoin of a cooperative rebalance), or the drain says it did not.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from outboxkit.consumer.handling import Outcome
from outboxkit.consumer.loop import PollLoop
from outboxkit.consumer.metrics import ConsumerMetrics
from outboxkit.consumer.workers import Dispatcher, Run

pytestmark = pytest.mark.unit

TopicPartition = tuple[str, int]
TPS: list[TopicPartition] = [("t", 0), ("t", 1)]


class FakeRecord:
    """The confluent-kafka record methods the poll loop and a Message read."""

    def __init__(self, tp: TopicPartition, offset: int) -> None:
        self._tp, self._offset = tp, offset

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._tp[0]

    def partition(self) -> int:
        return self._tp[1]

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return b"k%d" % (self._offset % 3)

    def value(self) -> bytes:
        return b"{}"

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)

    def headers(self) -> list[tuple[str, bytes | None]]:
        return []


class FakeKafka:
    """Offsets stored and committed per partition. ``rebalancing``: the group
    refuses commits (``ILLEGAL_GENERATION``) until this member polls again."""

    def __init__(self) -> None:
        self.stored: dict[TopicPartition, int] = {}
        self.committed: dict[TopicPartition, int] = {}
        self.paused: set[TopicPartition] = set()
        self.rebalancing = False
        self.refusal = KafkaError.ILLEGAL_GENERATION

    @staticmethod
    def _tps(parts: Iterable[Any]) -> set[TopicPartition]:
        return {(p.topic, p.partition) for p in parts}

    def pause(self, parts: list[Any]) -> None:
        self.paused |= self._tps(parts)

    def resume(self, parts: list[Any]) -> None:
        self.paused -= self._tps(parts)

    def incremental_assign(self, parts: list[Any]) -> None:
        pass

    def incremental_unassign(self, parts: list[Any]) -> None:
        self.paused -= self._tps(parts)

    def store_offsets(self, offsets: list[Any]) -> None:
        for p in offsets:
            self.stored[(p.topic, p.partition)] = p.offset

    def consume(self, num_messages: int = 1, timeout: float = 0.0) -> list[Any]:
        self.rebalancing = False  # polling completes the rejoin
        return []

    def commit(self, offsets: list[Any], asynchronous: bool = False) -> list[Any]:
        if self.rebalancing:
            raise KafkaException(KafkaError(self.refusal))
        for p in offsets:
            self.committed[(p.topic, p.partition)] = p.offset
        return [KafkaTopicPartition(p.topic, p.partition, p.offset) for p in offsets]


OPS = [
    "fetch",
    "take",
    "finish",
    "group",
    "group-commit",
    "rollback",
    "retry",
    "collect",
    "commit",
    "assign",
    "revoke",
    "lost",
    "drain",
]
#: What happens while the drain goes on: mostly what a worker or a rebalance does.
DURING = [
    "rollback",
    "revoke",
    "lost",
    "assign",
    "finish",
    "group-commit",
    "retry",
    "collect",
    "fetch",
    "take",
    "commit",
]
_ops = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 5)), max_size=40)
_during = st.lists(st.tuples(st.sampled_from(DURING), st.integers(0, 5)), max_size=30)
_FINAL = [Outcome.SUCCESS, Outcome.DUPLICATE, Outcome.DEAD_LETTERED]


class Model:
    def __init__(self) -> None:
        self.kafka = FakeKafka()
        self.d = Dispatcher()
        self.loop = PollLoop(
            kafka=self.kafka,
            dispatcher=self.d,
            metrics=ConsumerMetrics(CollectorRegistry()),
            lane_of=None,  # the partition is the lane: runs (and groups) as long as they get
            max_buffered=1000,
            revoke_timeout=0.0,
            workers=2,
        )
        self.position: dict[TopicPartition, int] = {}
        self.runs: list[Run] = []
        self.finished: set[tuple[TopicPartition, int]] = set()
        self.lost_uncommitted = False

    def part(self, tp: TopicPartition) -> KafkaTopicPartition:
        return KafkaTopicPartition(*tp)

    def pick(self, n: int, *, holding: bool) -> Run | None:
        """A run a worker could act on: one handling a message, or one holding a group."""
        able = [r for r in self.runs if (bool(r.held) if holding else r.current is not None)]
        return able[n % len(able)] if able else None

    def step(self, op: str, n: int) -> None:
        d, loop, tp = self.d, self.loop, TPS[n % 2]
        run = self.pick(n, holding=op in ("group-commit", "rollback"))
        if op == "fetch" and tp in loop.offsets:
            start = self.position[tp]
            loop._accept([FakeRecord(tp, o) for o in range(start, start + n + 1)])
            self.position[tp] = start + n + 1
        elif op == "take":
            taken = d.take(0.0, limit=n + 1)
            if taken is not None:
                self.runs.append(taken)
                self._next(taken)
        elif op == "finish" and run is not None:
            item = run.current
            self._next(run, _FINAL[n % 3])
            self.finished.add((item.tp, item.message.offset))
        elif op == "group" and run is not None and not run.held:
            d.start_group(run, n + 1, lambda item: True)
        elif op == "group-commit" and run is not None and run.held:
            self.finished |= {(i.tp, i.message.offset) for i in run.held}
            d.report_held(run, Outcome.SUCCESS)
            self._next(run)
        elif op == "rollback" and run is not None and run.held:
            d.unhold(run, Outcome.RELEASED)
            self._next(run)
        elif op == "retry" and run is not None:
            # As a worker's Consumer._wait: a refused deferral releases the message.
            if not d.defer(run, 0.0):
                d.give_up(run, Outcome.RELEASED, None)
            self.runs.remove(run)
        elif op == "collect":
            loop.collect()
        elif op == "commit":
            loop.commits.commit()
        elif op == "assign" and tp not in loop.offsets:
            loop.on_assign(self.kafka, [self.part(tp)])
            self.position[tp] = self.kafka.committed.get(tp, 0)  # where Kafka resumes
        elif op == "revoke" and tp in loop.offsets:
            loop.on_revoke(self.kafka, [self.part(tp)])
        elif op == "lost" and tp in loop.offsets:
            if loop.draining and loop.offsets[tp].uncommitted:
                self.lost_uncommitted = True
            loop.on_lost(self.kafka, [self.part(tp)])
        elif op == "drain" and not loop.draining:
            loop.begin_drain()

    def _next(self, run: Run, outcome: Outcome | None = None) -> None:
        if self.d.next(run, outcome) is None and run in self.runs:
            self.runs.remove(run)

    def never_past_unfinished(self, offsets: dict[TopicPartition, int], what: str) -> None:
        for tp, upto in offsets.items():
            missing = [o for o in range(upto) if (tp, o) not in self.finished]
            assert not missing, f"{what} {tp} at {upto} passes unfinished {missing[:5]}"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    ops=_ops,
    group_at_drain=st.none() | st.integers(0, 5),
    during=_during,
    rebalancing=st.booleans(),
    refusal=st.sampled_from(
        [
            KafkaError.ILLEGAL_GENERATION,
            KafkaError.REBALANCE_IN_PROGRESS,
            # the coordinator just after a broker restart or freeze (seen in the chaos suite)
            KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        ]
    ),
)
# A group rolled back during the drain, its messages then released by a
# revocation: they were counted released and unknown.
@example(
    ops=[("fetch", 4), ("take", 5), ("group", 2)],
    group_at_drain=None,
    during=[("rollback", 0), ("revoke", 0)],
    rebalancing=False,
    refusal=KafkaError.ILLEGAL_GENERATION,
)
def test_the_drain_counts_each_message_once_whatever_happens_during_it(
    ops: list[tuple[str, int]],
    group_at_drain: int | None,
    during: list[tuple[str, int]],
    rebalancing: bool,
    refusal: int,
) -> None:
    """``group_at_drain``: a worker starts a group transaction just before the
    drain (so that rollbacks and revocations during it meet one); ``rebalancing``:
    the exit commit finds the group rebalancing (``refusal``: the error it
    answers with until this member polled)."""
    model = Model()
    model.step("assign", 0)
    model.step("assign", 1)
    for op, n in ops:
        model.step(op, n)
    if group_at_drain is not None:
        for op in ("fetch", "take", "group"):
            model.step(op, group_at_drain)
    model.step("drain", 0)
    for op, n in during:  # the drain goes on: rebalances, rollbacks, results
        model.step(op, n)
    loop, kafka = model.loop, model.kafka
    report = loop.end_drain()
    parts = report.succeeded + report.duplicate + report.failed + report.unknown
    assert report.batch_size == parts + report.released, report
    model.never_past_unfinished(kafka.stored, "stored")

    kafka.rebalancing, kafka.refusal = rebalancing, refusal
    loop.commits.commit_at_exit(time.monotonic() + 30.0)
    model.never_past_unfinished(kafka.committed, "committed")
    for tp, tracker in loop.offsets.items():
        if tracker.stored is not None:
            assert kafka.committed.get(tp) == tracker.stored, tp
    assert (report.commit_error is not None) is model.lost_uncommitted, report.commit_error
