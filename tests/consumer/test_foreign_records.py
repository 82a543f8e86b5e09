"""Records from producers outboxkit does not control: never a crash, never a stalled partition.

Header names that are not UTF-8 cannot be produced with confluent-kafka's Python
producer; ``rawkafka`` writes them through librdkafka's C API, as any other
client could.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer as KafkaConsumer
from kafkahelp import FAST_GROUP, committed, end_offsets, headers_of, produce, read_all, wait_for
from procs import ConsumerProcess
from rawkafka import RawRecord, produce_raw

from outboxkit.consumer import (
    Consumer,
    ConsumerSettings,
    InvalidMessageError,
    Message,
    PermanentError,
)
from outboxkit.consumer._rawheaders import header_names_decodable
from outboxkit.consumer.errors import Classification

pytestmark = pytest.mark.integration


def _env(bootstrap: str, topic: str, group: str) -> dict[str, str]:
    return {
        "OUTBOXKIT_KAFKA_BOOTSTRAP": bootstrap,
        "OUTBOXKIT_KAFKA_CONFIG": ",".join(f"{k}={v}" for k, v in FAST_GROUP.items()),
        "OUTBOXKIT_HEALTH_PORT": "0",
        "OUTBOXKIT_TOPICS": topic,
        "OUTBOXKIT_GROUP_ID": group,
        "OUTBOXKIT_COMMIT_INTERVAL": "0.5",
        "OUTBOXKIT_DLQ_TIMEOUT": "5",
    }


def test_a_header_name_that_is_not_utf8_is_dead_lettered_with_its_bytes_not_a_crash(
    kafka_bootstrap: str, kafka_topics: Callable[..., str], tmp_path: Path
) -> None:
    topic = kafka_topics(1)
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    group = f"g-{topic}"
    produce_raw(
        kafka_bootstrap,
        topic,
        [
            RawRecord(b"k\xff", b"\x00raw\xfe", [(b"\xff\xfename", b"x"), (b"event_id", b"e-0")]),
            RawRecord(b"k", b"fine", [(b"event_id", b"e-1")]),
        ],
    )
    proc = ConsumerProcess(
        "consumer_apps:ReadsHeaders", env=_env(kafka_bootstrap, topic, group), cwd=tmp_path
    )
    try:
        handled = proc.wait_event("handled", 60, lambda r: r["offset"] == 1)
        assert handled["event_id"] == "e-1"
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 2},
            30,
            0.2,
            "offset 2 committed",
        )
        assert proc.proc.poll() is None, "the consumer died"
        assert [r["offset"] for r in proc.events("handled")] == [1]
        assert proc.events("worker-crashed") == []
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()

    letters = read_all(kafka_bootstrap, dlq, expect=1)
    assert len(letters) == 1
    letter = letters[0]
    assert (letter.key(), letter.value()) == (b"k\xff", b"\x00raw\xfe")  # the raw bytes
    h = headers_of(letter)
    assert h["dlq.error.class"] == "outboxkit.consumer.errors.InvalidMessageError"
    assert "not UTF-8" in h["dlq.error.message"]
    assert h["dlq.original.offset"] == "0"
    assert "dlq.headers.dropped" in h


class EverythingTransient(Consumer):
    """Classifies every error as transient; reads the event id only if told to."""

    reads_headers = False

    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.handled: list[tuple[int, bytes | None]] = []
        self.attempts = 0

    def classify(self, error: BaseException) -> Classification:
        return Classification.TRANSIENT

    def handle(self, message: Message) -> None:
        self.attempts += 1
        event_id = message.event_id if self.reads_headers else None
        self.handled.append((message.offset, message.value if event_id is None else b"?"))


@pytest.mark.parametrize("reads_headers", [False, True], ids=["ignores-headers", "reads-them"])
def test_a_bad_header_name_matters_only_to_a_handler_that_reads_the_headers(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
    reads_headers: bool,
) -> None:
    """The names are checked when the headers are read, not before every handler: a
    handler that reads only the key and value handles such a record like any other;
    one that reads the headers gets InvalidMessageError, and the record is
    dead-lettered at once (no retry), whatever the consumer's classify says."""
    topic = kafka_topics(1)
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    group = f"g-{topic}"
    produce_raw(
        kafka_bootstrap,
        topic,
        [
            RawRecord(b"k", b"bad-names", [(b"\xff\xfename", b"x"), (b"event_id", b"e-0")]),
            RawRecord(b"k", b"fine", [(b"event_id", b"e-1")]),
        ],
    )
    consumer = EverythingTransient(settings(group_id=group, topics=(topic,), dlq_timeout=5.0))
    consumer.reads_headers = reads_headers
    with run_consumer(consumer) as running:
        wait_for(lambda: len(consumer.handled) == 2 - reads_headers, 30, what="handled")
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 2},
            20,
            0.2,
            what="offset 2 committed",
        )
        assert running.stop() == 0
    if not reads_headers:
        assert consumer.handled == [(0, b"bad-names"), (1, b"fine")]
        assert end_offsets(kafka_bootstrap, dlq, 1) == {0: 0}  # nothing dead-lettered
        return
    assert consumer.handled == [(1, b"?")] and consumer.attempts == 2  # no retry
    letters = read_all(kafka_bootstrap, dlq, expect=1)
    assert [letter.value() for letter in letters] == [b"bad-names"]
    h = headers_of(letters[0])
    assert h["dlq.error.class"] == "outboxkit.consumer.errors.InvalidMessageError"
    assert h["dlq.attempts"] == "1"


class GivesUpOnBig(Consumer):
    """Dead-letters (PermanentError) every value of 10,000 bytes or more; records the rest."""

    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.handled: list[int] = []

    def handle(self, message: Message) -> None:
        if len(message.value or b"") >= 10_000:
            raise PermanentError("no room for this one")
        self.handled.append(message.offset)


@pytest.mark.parametrize(
    ("size", "dlq_limit"),
    [
        # The producer's own message.max.bytes (1,000,000) refuses the copy: its headers
        # push a value that fitted the source topic over the limit.
        (999_700, None),
        # The dead-letter topic's max.message.bytes is lower than the source's: the
        # broker refuses the copy.
        (200_000, "50000"),
    ],
    ids=["producer-limit", "topic-limit"],
)
def test_a_message_too_large_to_copy_is_dead_lettered_trimmed_and_the_partition_moves_on(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
    size: int,
    dlq_limit: str | None,
) -> None:
    topic = kafka_topics(1)
    dlq = kafka_topics(
        1, name=f"{topic}.dlq", config={"max.message.bytes": dlq_limit} if dlq_limit else None
    )
    group = f"g-{topic}"
    big = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    produce(kafka_bootstrap, topic, [(b"big", big, "e-big"), (b"k", b"next", "e-next")])
    consumer = GivesUpOnBig(settings(group_id=group, topics=(topic,), dlq_timeout=5.0))
    with run_consumer(consumer) as running:
        wait_for(lambda: consumer.handled == [1], 30, what="the next message handled")
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 2},
            20,
            0.2,
            what="offset 2 committed",
        )
        assert running.stop() == 0

    letters = read_all(kafka_bootstrap, dlq, expect=1)
    assert len(letters) == 1
    letter = letters[0]
    h = headers_of(letter)
    assert letter.key() == b"big"
    assert h["event_id"] == "e-big"
    assert h["dlq.original.offset"] == "0"
    assert h["dlq.value.truncated"] == str(size)  # the original length
    assert big.startswith(letter.value() or b"")  # a prefix (possibly empty) of the original
    assert len(letter.value() or b"") < size


def test_header_names_are_checked_before_the_client_decodes_them(
    kafka_bootstrap: str, kafka_topics: Callable[..., str]
) -> None:
    """The check reads the client's C struct; a client whose layout changed makes this
    fail (None: cannot tell) instead of silently going back to crashing."""
    topic = kafka_topics(1)
    many = [(f"h{i}".encode(), b"x") for i in range(40)]
    produce_raw(
        kafka_bootstrap,
        topic,
        [
            RawRecord(b"k", b"v", [(b"event_id", b"e"), (b"caf\xc3\xa9", None)]),
            RawRecord(None, None, [(b"ok", b"x"), (b"\xc3(", None)]),
            RawRecord(b"k", None, []),
            # More headers than the check keeps index arguments for (32): the
            # last name is read as well.
            RawRecord(b"k", b"v", [*many, (b"\xff", None)]),
            RawRecord(b"k", b"v", many),
        ],
    )
    records = _consume(kafka_bootstrap, topic, 5)
    assert [header_names_decodable(r) for r in records] == [True, False, True, False, True]
    assert len(Message.from_kafka(records[4]).headers) == 40
    good = Message.from_kafka(records[0])
    assert good.headers == (("event_id", b"e"), ("café", b""))
    bad = Message.from_kafka(records[1])
    for _ in range(3):  # asked again and again: the same clear error, never a crash
        with pytest.raises(InvalidMessageError, match="not UTF-8"):
            bad.headers  # noqa: B018
    assert "headers=None" in repr(bad)


def _consume(bootstrap: str, topic: str, n: int) -> list[Any]:
    c = KafkaConsumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{topic}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    out: list[Any] = []
    try:
        c.subscribe([topic])
        wait_for(
            lambda: out.extend(m for m in c.consume(10, 0.2) if not m.error()) or len(out) >= n,
            30,
            0,
            what=f"{n} records",
        )
    finally:
        c.close()
    return out
