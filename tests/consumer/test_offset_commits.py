"""OffsetCommits on its own: given a Kafka client, trackers and a report, no poll loop.

The poll loop's behaviour around commits (rebalances, the drain) is the drain
model's (``test_drain_model.py``); these pin what the commits decide by
themselves: what is committed, what a refusal leaves in the report, and when.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition

from outboxkit.consumer.offsets import OffsetCommits, PartitionOffsets
from outboxkit.consumer.report import DrainReport
from outboxkit.consumer.workers import TopicPartition

pytestmark = pytest.mark.unit

TP: TopicPartition = ("t", 0)


class Group:
    """A consumer group that refuses ``refusals`` commits with ``error``, then takes them."""

    def __init__(self, refusals: int = 0, error: int = KafkaError.REBALANCE_IN_PROGRESS) -> None:
        self.refusals, self.error = refusals, error
        self.commits: list[dict[TopicPartition, int]] = []
        self.polls = 0

    def commit(self, offsets: list[Any], asynchronous: bool = False) -> list[Any]:
        if self.refusals:
            self.refusals -= 1
            raise KafkaException(KafkaError(self.error))
        self.commits.append({(p.topic, p.partition): p.offset for p in offsets})
        return [KafkaTopicPartition(p.topic, p.partition, p.offset) for p in offsets]

    def consume(self, num_messages: int = 1, timeout: float = 0.0) -> list[Any]:
        self.polls += 1
        return []


def commits_of(group: Group, *, finished: int, draining: bool) -> OffsetCommits:
    """Commits over one partition whose offsets 0 .. ``finished - 1`` finished."""
    tracker = PartitionOffsets()
    tracker.received_many(list(range(finished + 1)))
    tracker.finished_many(range(finished))
    return OffsetCommits(
        kafka=group, offsets={TP: tracker}, report=DrainReport(), draining=lambda: draining
    )


def test_the_exit_commit_serves_the_group_until_it_takes_the_commit() -> None:
    group = Group(refusals=2)
    commits = commits_of(group, finished=3, draining=True)
    assert commits.commit_at_exit(time.monotonic() + 10.0) == {"t/0": 3}
    assert group.commits == [{TP: 3}] and group.polls >= 2
    assert commits.closing  # a revocation meanwhile no longer waits for handlers
    assert commits.report.committed_messages == 3 and commits.report.commit_error is None
    assert commits.committed_offsets() == {"t/0": 3}


@pytest.mark.parametrize("draining", [True, False])
def test_a_refused_commit_is_the_exit_records_only_once_the_drain_began(draining: bool) -> None:
    commits = commits_of(
        Group(refusals=1, error=KafkaError.OFFSET_METADATA_TOO_LARGE), finished=2, draining=draining
    )
    assert commits.commit() == {}
    assert (commits.report.commit_error is not None) is draining
    assert commits.offsets[TP].uncommitted  # kept for the next commit


def test_nothing_finished_is_nothing_to_commit() -> None:
    group = Group()
    commits = commits_of(group, finished=0, draining=True)
    assert commits.commit() == {} and group.commits == []
