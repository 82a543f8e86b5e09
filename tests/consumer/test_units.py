"""Unit tests: offset bookkeeping, lanes, message decoding, error classification."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy.exc as sa_exc
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from outboxkit.consumer import InvalidMessageError, Message, PermanentError, TransientError
from outboxkit.consumer.errors import Classification, classify
from outboxkit.consumer.metrics import ConsumerMetrics, HandleTimes
from outboxkit.consumer.offsets import PartitionOffsets
from outboxkit.consumer.retry import RetryPolicy
from outboxkit.consumer.workers import Dispatcher, Run, WorkItem

pytestmark = pytest.mark.unit


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=60, unique=True), st.randoms())
def test_stored_offset_never_passes_an_unfinished_message(offsets: list[int], rnd: object) -> None:
    offsets.sort()
    tracker = PartitionOffsets()
    for o in offsets:
        tracker.received(o)
    order = list(offsets)
    rnd.shuffle(order)  # type: ignore[attr-defined]
    finished: set[int] = set()
    for o in order:
        stored = tracker.finished(o)
        finished.add(o)
        unfinished = [x for x in offsets if x not in finished]
        if stored is not None:
            assert all(x < stored for x in finished if x < (min(unfinished, default=10**9)))
        if tracker.stored is not None:
            assert all(u >= tracker.stored for u in unfinished)
    assert tracker.stored == offsets[-1] + 1
    assert tracker.unfinished == 0


@given(
    st.lists(st.integers(0, 10_000), min_size=1, max_size=60, unique=True),
    st.randoms(),
    st.integers(1, 8),
)
def test_offsets_received_and_finished_in_batches_match_one_at_a_time(
    offsets: list[int], rnd: object, chunk: int
) -> None:
    """The poll loop's batch forms (a fetched run, the results of one round) store
    exactly what the per-message forms store, whatever the order of finishing."""
    offsets.sort()
    one, many = PartitionOffsets(), PartitionOffsets()
    for o in offsets:
        one.received(o)
    for start in range(0, len(offsets), chunk):
        many.received_many(offsets[start : start + chunk])
    many.received_many(offsets[:chunk])  # the same records again (a seek): ignored
    order = list(offsets)
    rnd.shuffle(order)  # type: ignore[attr-defined]
    for start in range(0, len(order), chunk):
        batch = order[start : start + chunk]
        stored = None
        for o in batch:
            stored = one.finished(o) or stored
        assert many.finished_many(batch) == stored
        assert (many.stored, many.window, many.unfinished) == (
            one.stored,
            one.window,
            one.unfinished,
        )
    assert many.stored == offsets[-1] + 1 and many.window == 0


_BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@given(
    st.lists(st.one_of(st.sampled_from(_BOUNDS), st.floats(0, 100, allow_nan=False)), max_size=80),
    st.integers(1, 10),
)
def test_handle_times_in_batches_expose_what_each_observe_would(
    seconds: list[float], chunk: int
) -> None:
    """A worker adds its handler times in batches: the histogram's buckets, count and
    sum are what one ``observe`` per attempt gives (a time on a bound included)."""
    one, batched = CollectorRegistry(), CollectorRegistry()
    reference = ConsumerMetrics(one).handle_seconds
    times = HandleTimes(ConsumerMetrics(batched).handle_seconds)
    for i, s in enumerate(seconds, 1):
        reference.observe(s)
        times.observe(s)
        if i % chunk == 0:
            times.flush()
    times.flush()

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        return {
            (x.name, x.labels.get("le", "")): x.value
            for m in registry.collect()
            if m.name == "worker_handle_seconds"
            for x in m.samples
            if not x.name.endswith("_created")
        }

    assert samples(batched) == pytest.approx(samples(one))


def test_confirmed_commit_counts_covered_messages() -> None:
    tracker = PartitionOffsets()
    for o in (3, 4, 7):  # gaps: compaction or transaction markers
        tracker.received(o)
    tracker.finished(4)
    assert tracker.stored is None  # 3 is not finished
    assert tracker.finished(3) == 5
    assert tracker.confirmed(5) == 2
    assert tracker.finished(7) == 8
    assert tracker.confirmed(8) == 1


def _item(tp: tuple[str, int], key: bytes, offset: int) -> WorkItem:
    msg = Message(topic=tp[0], partition=tp[1], offset=offset, key=key, value=b"")
    return WorkItem(message=msg, lane=(tp, key), tp=tp)


def _started(d: Dispatcher, timeout: float = 0.1, limit: int = 64) -> tuple[Run, WorkItem]:
    """Take a run and start its first message."""
    run = d.take(timeout, limit)
    assert run is not None
    item = d.next(run)
    assert item is not None
    return run, item


def _offsets(items: list[WorkItem]) -> list[int]:
    return [i.message.offset for i in items]


def test_a_lane_runs_one_message_at_a_time_in_order() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o, key in enumerate([b"a", b"a", b"b"]):
        d.submit(_item(tp, key, o))
    run_a, first = _started(d)
    run_b, second = _started(d)
    assert (first.message.offset, second.message.offset) == (0, 2)  # lane a is busy
    assert d.take(0.05) is None
    assert set(d.running()) == {first, second}
    third = d.next(run_a, "success")
    assert third is not None and third.message.offset == 1  # the same run, in order
    assert d.running(lambda i: i.lane == first.lane) == [third]
    assert d.next(run_a, "success") is None and d.next(run_b, "success") is None
    assert [(i.message.offset, o) for i, o, _ in d.results()] == [
        (0, "success"),
        (1, "success"),
        (2, "success"),
    ]
    assert d.results() == [] and d.counts() == (0, 0, 0)


def test_a_run_is_bounded_and_its_lane_goes_back_to_the_ready_queue() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o, key in enumerate([b"a", b"a", b"a", b"b"]):
        d.submit(_item(tp, key, o))
    run_a, a0 = _started(d, limit=2)
    assert d.counts() == (1, 0, 3)  # a1 (in the run, not started), a2 and b3: queued
    a1 = d.next(run_a, "success")
    assert a1 is not None and d.next(run_a, "success") is None
    _, b3 = _started(d, limit=2)  # lane a went behind lane b
    _, a2 = _started(d, limit=2)
    assert (a0.message.offset, a1.message.offset, b3.message.offset, a2.message.offset) == (
        0,
        1,
        3,
        2,
    )


def test_a_deferred_retry_keeps_its_lane_and_frees_the_worker() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    d.submit(_item(tp, b"a", 0))
    d.submit(_item(tp, b"a", 1))
    d.submit(_item(tp, b"b", 2))
    run, item = _started(d)
    assert d.defer(run, 0.2)  # the run ends; offset 1 goes back to lane a's queue
    assert d.running() == [] and d.counts() == (0, 1, 2)
    _, other = _started(d)
    assert other.message.offset == 2  # not offset 1: lane a waits
    started = time.monotonic()
    again, retried = _started(d, timeout=1.0)
    assert retried is item and time.monotonic() - started >= 0.15
    assert d.next(again, "success") is None  # the retry runs alone
    _, after = _started(d)
    assert after.message.offset == 1  # then the lane's queue, in order


def test_released_partitions_hand_back_queued_work_and_refuse_retries() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o in range(3):
        d.submit(_item(tp, b"a", o))
    run, running = _started(d)
    released = d.release([tp])
    assert _offsets(released) == [1, 2]  # not started: handed back, even within the run
    assert d.is_live(running)  # its offset may still be stored before the commit
    assert not d.defer(run, 0.1)  # but it is not retried here
    d.give_up(run, "released", "gone")
    assert [(i, o) for i, o, _ in d.results()] == [(running, "released")]
    d.close([tp])
    assert not d.is_live(running)


def test_draining_hands_back_what_a_run_has_not_started() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o, key in enumerate([b"a", b"a", b"a", b"b"]):
        d.submit(_item(tp, key, o))
    run, a0 = _started(d)
    assert sorted(_offsets(d.drain()[0])) == [1, 2, 3]
    assert d.running() == [a0]  # running: it finishes and counts
    assert d.next(run, "success") is None  # nothing more is started
    assert d.results() == [(a0, "success", None)]
    assert d.take(0.05) is None


def test_a_due_retry_goes_before_the_next_run() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o, key in enumerate([b"r", b"a", b"a"]):
        d.submit(_item(tp, key, o))
    run_r, retry = _started(d)
    run_a, _ = _started(d, limit=1)
    assert d.defer(run_r, 0.0)
    assert d.next(run_a, "success") is None
    _, again = _started(d)
    assert again is retry


def test_take_wakes_when_work_arrives() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    got: list[Run | None] = []
    t = threading.Thread(target=lambda: got.append(d.take(2.0)))
    t.start()
    time.sleep(0.05)
    d.submit(_item(tp, b"a", 0))
    t.join(1.0)
    assert got and got[0] is not None


def test_message_decoding() -> None:
    m = Message(
        topic="orders",
        partition=1,
        offset=7,
        key=b"k",
        value=b'{"id": 1}',
        headers=(("event_id", b"01J"), ("x", b"1"), ("x", b"2")),
    )
    assert m.json() == {"id": 1}
    assert m.event_id == "01J" and m.identity == "01J"
    assert m.header("x") == b"2"
    bad = Message(topic="orders", partition=1, offset=8, key=None, value=b"\xff")
    with pytest.raises(InvalidMessageError, match=r"orders\[1\]@8: value is not UTF-8"):
        bad.json()
    tomb = Message(topic="orders", partition=1, offset=9, key=None, value=None)
    with pytest.raises(InvalidMessageError, match="tombstone"):
        tomb.json()
    assert tomb.event_id is None and tomb.identity == "orders/1/9"
    assert isinstance(InvalidMessageError("x"), PermanentError)


class Mine(Exception):
    pass


def test_classification() -> None:
    assert classify(TransientError()) is Classification.TRANSIENT
    assert classify(PermanentError()) is Classification.PERMANENT
    assert classify(ConnectionResetError()) is Classification.TRANSIENT
    # The database is gone: not the message's fault, retried until it is back.
    assert (
        classify(sa_exc.OperationalError("SELECT 1", {}, Exception("gone")))
        is Classification.UNAVAILABLE
    )
    assert (
        classify(
            sa_exc.OperationalError("SELECT 1", {}, Exception("gone")),
            transient=(sa_exc.OperationalError,),
        )
        is Classification.TRANSIENT
    )  # an explicit choice wins
    assert classify(KeyError("customer")) is Classification.PERMANENT
    assert classify(Mine(), transient=(Mine,)) is Classification.TRANSIENT
    assert classify(ConnectionError(), permanent=(ConnectionError,)) is Classification.PERMANENT


def test_retry_policy_is_bounded_by_attempts_and_time() -> None:
    policy = RetryPolicy(max_attempts=3, base=0.1, cap=1.0, max_time=5.0)
    now = time.monotonic()
    assert policy.next_delay(attempts=1, started_at=now, now=now) is not None
    assert policy.next_delay(attempts=3, started_at=now, now=now) is None
    assert policy.next_delay(attempts=1, started_at=now - 10, now=now) is None
    assert all(
        0 <= policy.next_delay(attempts=2, started_at=now, now=now) <= 1.0 for _ in range(50)
    )  # type: ignore[operator]


class _Record:
    """The confluent-kafka record methods a Message reads (a unit-test stand-in)."""

    def __init__(self) -> None:
        self.header_reads = 0

    def topic(self) -> str:
        return "orders"

    def partition(self) -> int:
        return 2

    def offset(self) -> int:
        return 41

    def key(self) -> bytes:
        return b"k"

    def value(self) -> bytes:
        return b'{"id": 1}'

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)

    def headers(self) -> list[tuple[str, bytes | None]]:
        self.header_reads += 1
        return [("event_id", b"01J"), ("empty", None)]


def test_a_message_from_kafka_reads_its_record_and_decodes_headers_once() -> None:
    record = _Record()
    m = Message.from_kafka(record)
    assert (m.topic, m.partition, m.offset, m.key, m.json()) == ("orders", 2, 41, b"k", {"id": 1})
    assert m.timestamp_ms == 1_700_000_000_000
    assert record.header_reads == 0, "headers are decoded only when read"
    assert m.headers == (("event_id", b"01J"), ("empty", b""))
    assert m.event_id == "01J" and m.header("empty") == b""
    assert record.header_reads == 1
    built = Message(
        topic="orders",
        partition=2,
        offset=41,
        key=b"k",
        value=b'{"id": 1}',
        headers=(("event_id", b"01J"), ("empty", b"")),
        timestamp_ms=1_700_000_000_000,
    )
    assert m == built and hash(m) == hash(built) and repr(m) == repr(built)
    with_tx = m.with_tx(None)
    assert with_tx == m and record.header_reads == 1
    with pytest.raises(AttributeError):
        m.topic = "other"  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="needs the inbox"):
        _ = m.tx


def _queued(d: Dispatcher) -> int:
    return sum(len(q) for q in d._queued.values())


def test_the_poll_loop_waits_for_room_until_a_worker_takes_work() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o in range(10):
        d.submit(_item(tp, b"a", o))
    started = time.monotonic()
    d.wait_for_room(10, 5.0)  # not more than 10 queued: no wait
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    d.wait_for_room(5, 0.2)  # nobody takes work: bounded by the timeout
    assert time.monotonic() - started >= 0.15
    taken: list[Run | None] = []

    def worker() -> None:
        time.sleep(0.1)
        taken.append(d.take(1.0, limit=6))

    t = threading.Thread(target=worker)
    t.start()
    started = time.monotonic()
    d.wait_for_room(5, 30.0)  # 4 left once the worker took a run of 6
    waited = time.monotonic() - started
    t.join(5.0)
    assert taken and taken[0] is not None and len(taken[0].todo) == 6
    assert _queued(d) == 4 and waited < 20.0


def test_an_idle_worker_with_no_ready_lane_ends_the_wait_for_room() -> None:
    """With several workers the queue can be one busy lane: a worker with nothing to
    take needs the poll loop to fetch more, not to wait for that lane."""
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o in range(10):
        d.submit(_item(tp, b"hot", o))
    _started(d, limit=2)  # lane "hot" is busy; 8 of its messages are queued, none ready
    idle = threading.Thread(target=lambda: d.take(2.0))
    started = time.monotonic()
    idle.start()
    d.wait_for_room(1, 30.0)
    assert time.monotonic() - started < 20.0
    d.stop()
    idle.join(5.0)
    assert not idle.is_alive()


_ops = st.lists(
    st.tuples(
        st.sampled_from(["submit", "take", "next", "defer", "give_up", "release", "open"]),
        st.integers(0, 3),
    ),
    max_size=80,
)


@given(_ops)
def test_the_queued_count_matches_the_queues_whatever_happens(
    ops: list[tuple[str, int]],
) -> None:
    """The count the poll loop's wait reads is kept by hand: it must equal the queues."""
    d = Dispatcher()
    tps = [("t", 0), ("t", 1)]
    for tp in tps:
        d.open(tp)
    runs: list[Run] = []
    offset = 0
    for op, n in ops:
        tp = tps[n % 2]
        if op == "submit":
            d.submit_many([_item(tp, bytes([97 + n]), offset + i) for i in range(n + 1)])
            offset += n + 1
        elif op == "take":
            run = d.take(0.0, limit=n + 1)
            if run is not None:
                runs.append(run)
                d.next(run)
        elif op in ("next", "defer", "give_up") and runs:
            run = runs[n % len(runs)]
            if run.current is None:
                continue
            if op == "next":
                if d.next(run, "success") is None:
                    runs.remove(run)
            else:
                if op == "give_up" or not d.defer(run, 0.0):
                    d.give_up(run, "released", None)  # what a refused defer is ended with
                runs.remove(run)
        elif op == "release":
            d.close([tp])
        elif op == "open":
            d.open(tp)
        assert d._queued_n == _queued(d)
    d.drain()
    assert d._queued_n == _queued(d) == 0


def test_a_stop_ends_the_wait_for_room_at_once() -> None:
    """Consumer.stop() (and SIGTERM) call wake_poll through Lifecycle.on_drain: the
    poll loop then sees the drain without waiting for the workers."""
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o in range(10):
        d.submit(_item(tp, b"a", o))
    waited: list[float] = []

    def poll() -> None:
        started = time.monotonic()
        d.wait_for_room(1, 30.0)
        waited.append(time.monotonic() - started)

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.1)
    d.wake_poll()
    t.join(20.0)
    assert waited and waited[0] < 20.0
    d.wake_poll()  # before a wait: that wait ends at once
    started = time.monotonic()
    d.wait_for_room(1, 30.0)
    assert time.monotonic() - started < 20.0
    started = time.monotonic()
    d.wait_for_room(1, 0.2)  # once only
    assert time.monotonic() - started >= 0.15
