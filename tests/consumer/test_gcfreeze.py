"""A running consumer leaves the objects that existed at its start out of garbage
collection (``frozen_while_running``, outboxkit/runtime/service.py) and gives
them back when it stops; it never undoes a freeze someone else took."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kafkahelp import produce, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.runtime.service import frozen_while_running


@pytest.fixture(autouse=True)
def _nothing_frozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


@pytest.mark.unit
def test_the_freeze_lasts_while_any_consumer_runs() -> None:
    with frozen_while_running(True) as first:
        assert first and gc.get_freeze_count() > 0
        with frozen_while_running(True) as second:
            assert second
        assert gc.get_freeze_count() > 0  # the first one still runs
    assert gc.get_freeze_count() == 0
    with frozen_while_running(False) as joined:
        assert not joined and gc.get_freeze_count() == 0


@pytest.mark.unit
def test_a_freeze_taken_by_someone_else_is_left_alone() -> None:
    gc.freeze()
    before = gc.get_freeze_count()
    with frozen_while_running(True) as joined:
        assert not joined
    assert gc.get_freeze_count() == before  # not undone


@pytest.mark.unit
def test_garbage_is_collected_before_the_freeze_and_cycles_after_it() -> None:
    class Node:
        other: Any = None

    def cycle() -> weakref.ref[Node]:
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)  # garbage once returned, until a collection

    gc.disable()  # no collection but the consumer's own
    try:
        before = cycle()
        held = [Node()]
        held[0].other = held[0]
        old = weakref.ref(held[0])
        with frozen_while_running(True):
            assert before() is None  # collected before the freeze, not frozen
            during = cycle()
            gc.collect()
            assert during() is None  # new garbage is still collected
            del held[:]  # a cycle that lived at the start is garbage now
            gc.collect()
            assert old() is not None  # frozen: the cost, until the freeze ends
        gc.collect()
        assert old() is None  # given back, and collected
    finally:
        gc.enable()


class Recording(Consumer):
    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.freeze_counts: list[int] = []

    def handle(self, message: Message) -> None:
        self.freeze_counts.append(gc.get_freeze_count())


@pytest.mark.integration
@pytest.mark.parametrize("gc_freeze", [True, False])
def test_a_running_consumer_freezes_and_gives_back(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
    gc_freeze: bool,
) -> None:
    topic = kafka_topics(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v", f"e-{i}") for i in range(3)])
    consumer = Recording(settings(group_id=f"g-{topic}", topics=(topic,), gc_freeze=gc_freeze))
    with run_consumer(consumer) as running:
        wait_for(lambda: len(consumer.freeze_counts) == 3, 30, what="handled")
        assert running.stop() == 0
    assert all((n > 0) == gc_freeze for n in consumer.freeze_counts), consumer.freeze_counts
    assert gc.get_freeze_count() == 0
