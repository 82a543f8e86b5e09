"""Offset bookkeeping stays bounded when commits are not confirmed (a coordinator
outage, or commits turned off) and when one message holds its partition back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafkahelp import committed, produce, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.consumer.offsets import PartitionOffsets
from outboxkit.runtime.errors import DependencyError


def held(tracker: PartitionOffsets) -> int:
    """Entries the tracker holds in all its containers (what its memory grows with)."""
    return sum(
        len(v)
        for v in vars(tracker).values()
        if isinstance(v, (list, set, dict)) or hasattr(v, "maxlen")
    )


@pytest.mark.unit
@settings(max_examples=20, derandomize=True, deadline=None)
@given(n=st.integers(2_000, 20_000), confirm_every=st.sampled_from([None, 7, 1000]))
def test_a_tracker_holds_a_bounded_number_of_entries_whatever_is_confirmed(
    n: int, confirm_every: int | None
) -> None:
    tracker = PartitionOffsets()
    covered = 0
    for offset in range(n):
        tracker.received(offset)
        stored = tracker.finished(offset)
        assert stored == offset + 1
        if confirm_every and offset % confirm_every == 0:
            covered += tracker.confirmed(stored)
        assert held(tracker) <= 200
    covered += tracker.confirmed(n)
    assert covered == n  # every message counted once in the end


class Counting(Consumer):
    """Handles everything; a message whose value is ``stuck`` fails (its database is
    "down") until ``release`` is set, so it holds its partition's offset back."""

    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.done = 0
        self.release = threading.Event()
        self.lock = threading.Lock()

    def handle(self, message: Message) -> None:
        if message.value == b"stuck" and not self.release.is_set():
            raise DependencyError("the database is down")
        with self.lock:
            self.done += 1

    def _on_commit(self, err: Any, partitions: list[Any]) -> None:
        # The coordinator never confirms a commit (an outage; or no periodic commits).
        return


@pytest.mark.integration
def test_unconfirmed_commits_and_a_stuck_message_keep_the_bookkeeping_bounded(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(1)
    group = f"g-{topic}"
    n = 3000
    records: list[tuple[bytes | None, bytes | None, str | None]] = [(b"s", b"stuck", "e-0")]
    records += [(f"k{i % 50}".encode(), b"ok", f"e-{i}") for i in range(1, n)]
    produce(kafka_bootstrap, topic, records)
    consumer = Counting(settings(group_id=group, topics=(topic,), concurrency=4, max_buffered=100))
    with run_consumer(consumer) as running:
        wait_for(lambda: consumer._loop is not None, 20, what="connected")
        loop = consumer._loop
        assert loop is not None
        wait_for(lambda: (topic, 0) in loop.offsets, 20, what="assigned")
        tracker = loop.offsets[(topic, 0)]
        # Messages behind the stuck one finish on other keys until the partition pauses
        # for good (only the stuck one unfinished), or, unbounded, all of them are taken.
        wait_for(
            lambda: (
                ((topic, 0) in loop.paused and tracker.unfinished == 1) or consumer.done >= n - 1
            ),
            60,
            what="the partition paused behind the stuck message",
        )
        seen = consumer.done
        # The window: max_buffered plus one fetched batch (500), each offset at most
        # twice (received, finished), plus the commit marks.
        assert tracker.window <= 100 + 500
        assert held(tracker) <= 2 * (100 + 500) + 64
        assert seen < 100 + 500
        assert committed(kafka_bootstrap, group, topic, 1) == {0: -1001}
        consumer.release.set()
        wait_for(lambda: consumer.done == n, 60, what="all handled")
        wait_for(lambda: tracker.stored == n, 20, what="all stored")
        assert seen <= consumer.done
        # Commits are made but never confirmed: nothing to forget them by.
        assert held(tracker) <= 200
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: n},
            20,
            0.2,
            what="everything committed",
        )
        assert running.stop() == 0
