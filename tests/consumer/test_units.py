"""Unit tests: offset bookkeeping, lanes, message decoding, error classification."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy.exc as sa_exc
from hypothesis import given
from hypothesis import strategies as st

from outboxkit.consumer import InvalidMessageError, Message, PermanentError, TransientError
from outboxkit.consumer.errors import Classification, classify
from outboxkit.consumer.offsets import PartitionOffsets
from outboxkit.consumer.retry import RetryPolicy
from outboxkit.consumer.workers import Dispatcher, WorkItem

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


def test_a_lane_runs_one_message_at_a_time_in_order() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o, key in enumerate([b"a", b"a", b"b"]):
        d.submit(_item(tp, key, o))
    first = d.take(0.1)
    second = d.take(0.1)
    assert first is not None and second is not None
    assert (first.message.offset, second.message.offset) == (0, 2)  # lane a is busy
    assert d.take(0.05) is None
    d.finish(first)
    third = d.take(0.1)
    assert third is not None and third.message.offset == 1


def test_a_deferred_retry_keeps_its_lane_and_frees_the_worker() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    d.submit(_item(tp, b"a", 0))
    d.submit(_item(tp, b"a", 1))
    d.submit(_item(tp, b"b", 2))
    item = d.take(0.1)
    assert item is not None and d.defer(item, 0.2)
    other = d.take(0.1)
    assert other is not None and other.message.offset == 2  # not offset 1: lane a waits
    started = time.monotonic()
    again = d.take(1.0)
    assert again is item and time.monotonic() - started >= 0.15


def test_released_partitions_hand_back_queued_work_and_refuse_retries() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o in range(3):
        d.submit(_item(tp, b"a", o))
    running = d.take(0.1)
    assert running is not None
    released = d.release([tp])
    assert [i.message.offset for i in released] == [1, 2]
    assert d.is_live(running)  # its offset may still be stored before the commit
    assert not d.defer(running, 0.1)  # but it is not retried here
    d.close([tp])
    assert not d.is_live(running)


def test_finishing_can_hand_over_the_lanes_next_message_only() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o, key in enumerate([b"a", b"b", b"a"]):
        d.submit(_item(tp, key, o))
    a0, b1 = d.take(0.1), d.take(0.1)
    assert a0 is not None and b1 is not None
    a2 = d.finish(a0, take_next=True)
    assert a2 is not None and a2.message.offset == 2  # same lane, in order
    assert d.finish(b1, take_next=True) is None  # lane b has nothing queued
    assert d.running() == [a2] and d.take(0.05) is None

    d.submit(_item(tp, b"a", 3))
    d.submit(_item(tp, b"a", 4))
    assert d.finish(a2) is None  # without take_next the lane goes back to the queue
    a3 = d.take(0.1)
    assert a3 is not None and a3.message.offset == 3
    d.drain()  # draining: queued work is released, nothing more is handed over
    assert d.finish(a3, take_next=True) is None


def test_a_due_retry_goes_before_the_lanes_next_message() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    for o, key in enumerate([b"r", b"a", b"a"]):
        d.submit(_item(tp, key, o))
    retry, a1 = d.take(0.1), d.take(0.1)
    assert retry is not None and a1 is not None and d.defer(retry, 0.0)
    assert d.finish(a1, take_next=True) is None
    assert d.take(0.1) is retry


def test_take_wakes_when_work_arrives() -> None:
    d = Dispatcher()
    tp = ("t", 0)
    d.open(tp)
    got: list[WorkItem | None] = []
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
