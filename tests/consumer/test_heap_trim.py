"""The consumer hands the C heap's free pages back to the OS now and then
(``HeapTrimmer``, outboxkit/runtime/heap.py): its peak memory crept up while it
worked off a backlog (docs/performance.md), Python's heap did not."""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable
from typing import Any

import pytest
from kafkahelp import produce, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message
from outboxkit.runtime import heap
from outboxkit.runtime.heap import HeapTrimmer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_a_trim_at_most_once_per_interval() -> None:
    clock, calls = Clock(), []
    trimmer = HeapTrimmer(2.0, trim=lambda pad: calls.append(pad) or 1, clock=clock)
    trimmer.maybe_trim()
    assert calls == []  # not at start: the first interval runs from construction
    for now in (101.9, 102.0, 102.5, 103.9, 104.1, 110.0):
        clock.now = now
        trimmer.maybe_trim()
    assert calls == [0, 0, 0]  # at 102.0, 104.1 and 110.0; pad 0: keep nothing spare
    assert trimmer.trims == 3


@pytest.mark.unit
def test_a_slow_trim_stretches_the_wait_so_trims_take_at_most_one_percent() -> None:
    # In a large host process a trim can take tens of milliseconds; trimming
    # every second would then take several percent of the poll loop.
    clock, starts = Clock(), []
    durations = iter([0.05, 0.002, 0.0])

    def slow_trim(pad: int) -> int:
        starts.append(clock.now)
        clock.now += next(durations)
        return 1

    trimmer = HeapTrimmer(1.0, trim=slow_trim, clock=clock)
    clock.now = 101.0
    trimmer.maybe_trim()  # takes 50 ms: the next one no sooner than 5 s after it ends
    for now in (102.1, 105.9, 106.06):
        clock.now = now
        trimmer.maybe_trim()
    assert starts == [101.0, 106.06]
    clock.now = 106.062 + 0.3  # that one took 2 ms: the wait is back to 1 s, not 0.2 s
    trimmer.maybe_trim()
    clock.now = 107.07
    trimmer.maybe_trim()
    assert starts == [101.0, 106.06, 107.07]
    assert heap.MAX_SHARE == 0.01


@pytest.mark.unit
def test_interval_zero_never_trims() -> None:
    clock, calls = Clock(), []
    trimmer = HeapTrimmer(0, trim=lambda pad: calls.append(pad) or 1, clock=clock)
    for now in (100.0, 1e6):
        clock.now = now
        trimmer.maybe_trim()
    assert not trimmer.enabled and calls == [] and trimmer.trims == 0


@pytest.mark.unit
def test_without_malloc_trim_the_trimmer_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "malloc_trim", None)  # musl, macOS
    trimmer = HeapTrimmer(0.001, clock=lambda: 1e9)
    trimmer.maybe_trim()
    assert not trimmer.enabled and trimmer.trims == 0


@pytest.mark.unit
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="not a glibc system")
def test_glibc_malloc_trim_is_found_and_runs() -> None:
    # Debian and the container image (python:*-slim) use glibc.
    assert heap.malloc_trim is not None
    assert heap.malloc_trim(0) in (0, 1)


class Counting(Consumer):
    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.handled = 0

    def handle(self, message: Message) -> None:
        self.handled += 1


@pytest.mark.integration
@pytest.mark.parametrize("interval", [0.05, 0.0])
def test_a_running_consumer_trims_from_its_poll_loop(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
    monkeypatch: pytest.MonkeyPatch,
    interval: float,
) -> None:
    real = heap.malloc_trim or (lambda pad: 0)  # no glibc: the loop's calls still count
    threads: list[str] = []

    def counted(pad: int) -> int:
        threads.append(threading.current_thread().name)
        return real(pad)

    monkeypatch.setattr(heap, "malloc_trim", counted)
    topic = kafka_topics(1)
    produce(kafka_bootstrap, topic, [(b"k", b"v", f"e-{i}") for i in range(3)])
    consumer = Counting(
        settings(group_id=f"g-{topic}", topics=(topic,), heap_trim_interval=interval)
    )
    with run_consumer(consumer) as running:
        wait_for(lambda: consumer.handled == 3, 30, what="handled")
        if interval:
            wait_for(lambda: consumer.heap.trims >= 3, 30, what="three trims")
        assert running.stop() == 0
    if interval:
        assert len(threads) == consumer.heap.trims >= 3
        assert not any(t.startswith("consumer-worker") for t in threads), threads
    else:
        assert not consumer.heap.enabled and threads == []
