"""Two consumers in one group: one joins mid-run, one leaves; nothing lost, nothing doubled."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from kafkahelp import committed, end_offsets, make_events, offsets_all_below, produce, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message

pytestmark = pytest.mark.integration

PARTITIONS = 4


class Ledger:
    """Shared by both consumers: what ran where, and any message run twice at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: set[tuple[int, int]] = set()
        self.done: dict[int, set[int]] = {}
        self.runs: list[tuple[str, int, int]] = []
        self.overlaps: list[tuple[int, int]] = []

    def count(self) -> int:
        with self.lock:
            return len(self.runs)

    def processed(self) -> dict[int, set[int]]:
        with self.lock:
            return {p: set(o) for p, o in self.done.items()}


class Member(Consumer):
    ledger: Ledger

    def __init__(self, settings: ConsumerSettings, name: str, ledger: Ledger) -> None:
        super().__init__(settings)
        self.name = name
        self.ledger = ledger

    def handle(self, message: Message) -> None:
        where = (message.partition, message.offset)
        with self.ledger.lock:
            if where in self.ledger.active:
                self.ledger.overlaps.append(where)
            self.ledger.active.add(where)
        time.sleep(0.004)
        with self.ledger.lock:
            self.ledger.active.discard(where)
            self.ledger.done.setdefault(message.partition, set()).add(message.offset)
            self.ledger.runs.append((self.name, *where))


class AsyncMember(Member):
    """:class:`Member` with an ``async def handle``."""

    async def handle(self, message: Message) -> None:  # type: ignore[override]
        where = (message.partition, message.offset)
        with self.ledger.lock:
            if where in self.ledger.active:
                self.ledger.overlaps.append(where)
            self.ledger.active.add(where)
        await asyncio.sleep(0.004)
        with self.ledger.lock:
            self.ledger.active.discard(where)
            self.ledger.done.setdefault(message.partition, set()).add(message.offset)
            self.ledger.runs.append((self.name, *where))


@pytest.mark.parametrize("member", [Member, AsyncMember], ids=["sync", "async"])
def test_join_then_leave_loses_nothing_and_commits_consistently(
    member: type[Member],
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(PARTITIONS)
    group = f"g-{topic}"
    ledger = Ledger()
    make = lambda name: member(settings(group_id=group, topics=(topic,)), name, ledger)  # noqa: E731

    def consistent() -> list[str]:
        return offsets_all_below(
            committed(kafka_bootstrap, group, topic, PARTITIONS), ledger.processed()
        )

    produce(kafka_bootstrap, topic, make_events(600, keys=24))
    a, b = make("a"), make("b")
    with run_consumer(a) as run_a:
        wait_for(lambda: ledger.count() >= 150, 30, what="a under way")
        with run_consumer(b) as run_b:
            wait_for(
                lambda: any(name == "b" for name, _, _ in ledger.runs), 30, what="b has partitions"
            )
            assert consistent() == []  # right after the rebalance that gave b its share
            produce(kafka_bootstrap, topic, make_events(600, keys=24))
            wait_for(lambda: ledger.count() >= 900, 30, what="both under way")
            assert run_a.stop() == 0  # a leaves the group
            assert consistent() == []  # a's exit commit, b still running
            produce(kafka_bootstrap, topic, make_events(300, keys=24))
            wait_for(
                lambda: sum(len(o) for o in ledger.processed().values()) >= 1500,
                60,
                what="all 1500 messages",
            )
            wait_for(
                lambda: (
                    committed(kafka_bootstrap, group, topic, PARTITIONS)
                    == end_offsets(kafka_bootstrap, topic, PARTITIONS)
                ),
                15,
                what="everything committed",
            )
            assert run_b.stop() == 0

    ends = end_offsets(kafka_bootstrap, topic, PARTITIONS)
    assert {p: set(range(n)) for p, n in ends.items()} == ledger.processed()  # none lost
    assert ledger.overlaps == []  # never on two workers at once
    handled_by = {name for name, _, _ in ledger.runs}
    assert handled_by == {"a", "b"}
    # Revocations commit what is done and hand over the rest unstarted: no redelivery.
    seen: dict[tuple[int, int], list[str]] = {}
    for name, p, o in ledger.runs:
        seen.setdefault((p, o), []).append(name)
    twice = {k: v for k, v in seen.items() if len(v) > 1}
    assert len(ledger.runs) == 1500, twice


class SlowMember(Member):
    """Slow enough that its partitions sit paused (window full) most of the time."""

    def handle(self, message: Message) -> None:
        time.sleep(0.01)
        super().handle(message)


def test_a_partition_paused_when_revoked_is_consumed_when_assigned_back(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    """Found by the chaos suite's full run: a partition paused (window full) when it
    was revoked or lost stayed paused in librdkafka, which keeps a partition's pause
    across assignments, while the consumer forgot it had paused it; assigned back
    to the same consumer, it was never fetched again (31,000 messages behind, lag
    flat, every worker idle). ``a`` pauses all the time (window of 2, slow
    handler); ``b`` joins, takes some of ``a``'s partitions while they are paused,
    and leaves again: ``a`` must consume everything."""
    topic = kafka_topics(PARTITIONS)
    group = f"g-{topic}"
    ledger = Ledger()
    produce(kafka_bootstrap, topic, make_events(800, keys=24))
    a = SlowMember(settings(group_id=group, topics=(topic,), max_buffered=2), "a", ledger)
    b = Member(settings(group_id=group, topics=(topic,)), "b", ledger)
    with run_consumer(a) as run_a:
        wait_for(lambda: ledger.count() >= 40, 30, what="a under way")
        with run_consumer(b) as run_b:
            wait_for(lambda: any(n == "b" for n, _, _ in ledger.runs), 30, what="b's share")
            assert run_b.stop() == 0  # a gets b's partitions back
        produce(kafka_bootstrap, topic, make_events(200, keys=24))
        wait_for(
            lambda: sum(len(o) for o in ledger.processed().values()) >= 1000,
            90,
            what="every message, including those of the partitions a got back",
        )
        assert run_a.stop() == 0
    ends = end_offsets(kafka_bootstrap, topic, PARTITIONS)
    assert {p: set(range(n)) for p, n in ends.items()} == ledger.processed()
