"""A worker takes a run of a lane's messages at once (consumer/workers.py): what a
user observes stays per message, at the edges of a run.

* a failure in the middle of a run: the messages before it are handled and
  committed, the failing one is retried (or dead-lettered) before anything
  after it of the same lane, and the offset reaches the end;
* a drain in the middle of a run: the messages of the run not started yet are
  released, not handled; what is committed covers exactly the handled ones;
  the exit counts add up; the next consumer starts where this one stopped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafkahelp import committed, produce, read_all, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message, PermanentError, TransientError

pytestmark = pytest.mark.integration


class Planned(Consumer):
    """Fails each message as its value says on the first attempt (``transient`` or
    ``permanent``); sleeps ``sleep:S`` seconds; records every attempt in order."""

    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.lock = threading.Lock()
        self.attempts: list[tuple[bytes | None, int]] = []
        self.handled: list[int] = []

    def handle(self, message: Message) -> None:
        value = (message.value or b"").decode()
        with self.lock:
            first = all(o != message.offset for _, o in self.attempts)
            self.attempts.append((message.key, message.offset))
        if value.startswith("sleep:"):
            time.sleep(float(value.split(":")[1]))
        if first and value == "transient":
            raise TransientError("the first attempt fails")
        if value == "permanent":
            raise PermanentError("never handled")
        with self.lock:
            self.handled.append(message.offset)


_plan = st.lists(
    st.tuples(
        st.sampled_from([b"a", b"b"]), st.sampled_from(["ok"] * 6 + ["transient", "permanent"])
    ),
    min_size=2,
    max_size=40,
)


@pytest.mark.parametrize("concurrency", [1, 3])
@settings(
    max_examples=3,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=_plan)
def test_a_failure_inside_a_run_keeps_lane_order_and_the_offsets_reach_the_end(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
    concurrency: int,
    plan: list[tuple[bytes, str]],
) -> None:
    topic = kafka_topics(1)
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    group = f"g-{topic}"
    n = len(plan)
    produce(
        kafka_bootstrap,
        topic,
        [(key, value.encode(), f"e{i}") for i, (key, value) in enumerate(plan)],
    )
    consumer = Planned(settings(group_id=group, topics=(topic,), concurrency=concurrency))
    with run_consumer(consumer) as running:
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: n},
            60,
            0.2,
            what=f"offset {n} committed",
        )
        assert running.stop() == 0

    permanent = [i for i, (_, value) in enumerate(plan) if value == "permanent"]
    assert sorted(consumer.handled) == [i for i in range(n) if i not in permanent]
    # The lane is the partition (concurrency 1) or the key: within a lane, every
    # attempt of a message comes before any attempt of a later one.
    lanes: dict[bytes | None, list[int]] = {}
    for key, offset in consumer.attempts:
        lanes.setdefault(key if concurrency > 1 else None, []).append(offset)
    for lane, offsets in lanes.items():
        assert offsets == sorted(offsets), f"lane {lane!r} out of order: {offsets}"
    expected_attempts = sum(2 if value == "transient" else 1 for _, value in plan)
    assert len(consumer.attempts) == expected_attempts
    # Handler times are added per run: every attempt is in the histogram at the end.
    count = consumer.registry.get_sample_value("worker_handle_seconds_count")
    assert count == expected_attempts
    if permanent:
        letters = read_all(kafka_bootstrap, dlq, expect=len(permanent))
        originals = sorted(int(dict(r.headers())["dlq.original.offset"]) for r in letters)
        assert originals == permanent


@pytest.mark.parametrize("concurrency", [1, 2])
def test_a_drain_in_the_middle_of_a_run_commits_only_what_was_handled(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
    concurrency: int,
) -> None:
    topic = kafka_topics(1)
    kafka_topics(1, name=f"{topic}.dlq")
    group = f"g-{topic}"
    n = 40  # one key: one lane, so one run holds them all
    produce(kafka_bootstrap, topic, [(b"k", b"sleep:0.05", f"e{i}") for i in range(n)])
    consumer = Planned(settings(group_id=group, topics=(topic,), concurrency=concurrency))
    with run_consumer(consumer) as running:
        wait_for(lambda: len(consumer.handled) >= 5, 30, what="a few handled")
        assert running.stop() == 0
    report = consumer.report
    assert report is not None

    handled = consumer.handled
    k = len(handled)
    assert handled == list(range(k)) and 5 <= k < n  # in order; the rest not handled
    assert [o for _, o in consumer.attempts] == handled  # nothing started and dropped
    assert report.unknown == 0
    assert report.released == n - k  # the run's messages not started were handed back
    assert report.batch_size == report.succeeded + report.released
    assert report.committed == {f"{topic}/0": k}
    assert committed(kafka_bootstrap, group, topic, 1) == {0: k}

    nxt = Planned(settings(group_id=group, topics=(topic,), concurrency=concurrency))
    with run_consumer(nxt) as running:
        wait_for(lambda: len(nxt.handled) == n - k, 30, what="the rest redelivered")
        assert running.stop() == 0
    assert nxt.handled == list(range(k, n))
