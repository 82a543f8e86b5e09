"""Failures: transient retried in place, permanent dead-lettered, DLQ down pauses the partition."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from kafkahelp import committed, end_offsets, headers_of, http_get, produce, read_all, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message, PermanentError

pytestmark = pytest.mark.integration


class FlakyUpstream(Exception):
    """A user's own exception class, declared transient on the consumer."""


class Scripted(Consumer):
    """Fails as the message value says: ``transient:N`` (first N attempts), ``permanent``,
    ``always-transient``; anything else succeeds (values starting with ``{`` must be JSON).
    """

    transient_errors = (FlakyUpstream,)

    def __init__(self, settings: ConsumerSettings) -> None:
        super().__init__(settings)
        self.attempts: Counter[int] = Counter()
        self.succeeded: list[int] = []
        self.failures: list[tuple[int, str]] = []
        self.lock = threading.Lock()

    def handle(self, message: Message) -> None:
        text = (message.value or b"").decode()
        with self.lock:
            self.attempts[message.offset] += 1
            attempt = self.attempts[message.offset]
        if text.startswith("transient:") and attempt <= int(text.split(":")[1]):
            raise FlakyUpstream(f"upstream busy (attempt {attempt})")
        if text == "always-transient":
            raise FlakyUpstream("still busy")
        if text == "permanent":
            raise PermanentError("order 42 refers to an unknown customer")
        if text.startswith("{"):
            message.json()
        with self.lock:
            self.succeeded.append(message.offset)

    def on_failure(self, message: Message, error: BaseException) -> None:
        self.failures.append((message.offset, type(error).__name__))


class AsyncScripted(Scripted):
    """:class:`Scripted` with an ``async def handle``: the same script, raised from a coroutine."""

    async def handle(self, message: Message) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        Scripted.handle(self, message)


#: Every scenario runs with a sync and an async handler.
SCRIPTED = pytest.mark.parametrize("scripted", [Scripted, AsyncScripted], ids=["sync", "async"])


def _value(consumer: Consumer, name: str, **labels: str) -> float:
    return consumer.registry.get_sample_value(name, labels) or 0.0


@SCRIPTED
def test_transient_twice_then_success_is_processed_once_committed_no_dlq(
    scripted: type[Scripted],
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(1)
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    produce(kafka_bootstrap, topic, [(b"k", b"transient:2", "e-1"), (b"k", b"ok", "e-2")])
    consumer = scripted(settings(group_id=f"g-{topic}", topics=(topic,), max_attempts=5))
    with run_consumer(consumer) as running:
        wait_for(lambda: len(consumer.succeeded) == 2, 20, what="both handled")
        assert running.stop() == 0

    assert consumer.attempts[0] == 3
    assert consumer.succeeded == [0, 1]  # order kept: offset 1 waited for the retries of 0
    assert consumer.failures == []
    assert committed(kafka_bootstrap, f"g-{topic}", topic, 1) == {0: 2}
    assert read_all(kafka_bootstrap, dlq, expect=0) == []
    assert _value(consumer, "worker_messages_total", result="retry") == 2
    assert _value(consumer, "worker_messages_total", result="success") == 2
    assert _value(consumer, "worker_messages_total", result="dlq") == 0


@SCRIPTED
def test_permanent_error_bad_json_and_exhausted_retries_go_to_the_dlq_with_headers(
    scripted: type[Scripted],
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(1)
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    produce(
        kafka_bootstrap,
        topic,
        [
            (b"k1", b"permanent", "ev-perm"),
            (b"k2", b"{not json", "ev-json"),
            (b"k3", b"always-transient", "ev-exhausted"),
            (b"k4", b'{"ok": true}', "ev-ok"),
        ],
    )
    consumer = scripted(settings(group_id=f"g-{topic}", topics=(topic,), max_attempts=3))
    with run_consumer(consumer) as running:
        wait_for(lambda: consumer.succeeded == [3], 20, what="the good message")
        wait_for(
            lambda: committed(kafka_bootstrap, f"g-{topic}", topic, 1) == {0: 4},
            10,
            what="offset 4 committed",
        )
        assert running.stop() == 0

    letters = read_all(kafka_bootstrap, dlq, expect=3)
    assert len(letters) == 3
    by_event = {headers_of(m)["event_id"]: m for m in letters}
    perm = by_event["ev-perm"]
    h = headers_of(perm)
    assert perm.key() == b"k1" and perm.value() == b"permanent"
    assert h["dlq.original.topic"] == topic
    assert h["dlq.original.partition"] == "0"
    assert h["dlq.original.offset"] == "0"
    assert h["dlq.error.class"] == "outboxkit.runtime.errors.PermanentError"
    assert h["dlq.error.message"] == "order 42 refers to an unknown customer"
    assert h["dlq.attempts"] == "1"
    assert h["dlq.group_id"] == f"g-{topic}"
    assert h["dlq.failed_at"]

    bad_json = headers_of(by_event["ev-json"])
    assert bad_json["dlq.error.class"] == "outboxkit.consumer.errors.InvalidMessageError"
    assert "not JSON" in bad_json["dlq.error.message"]
    assert bad_json["dlq.attempts"] == "1"  # permanent: not retried

    exhausted = headers_of(by_event["ev-exhausted"])
    assert exhausted["dlq.error.class"].endswith("FlakyUpstream")
    assert exhausted["dlq.attempts"] == "3"
    assert consumer.attempts[2] == 3

    assert sorted(consumer.failures) == [
        (0, "PermanentError"),
        (1, "InvalidMessageError"),
        (2, "FlakyUpstream"),
    ]
    assert _value(consumer, "worker_messages_total", result="dlq") == 3


@SCRIPTED
def test_dlq_unavailable_holds_the_offset_pauses_then_recovers(
    scripted: type[Scripted],
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = kafka_topics(1)
    group = f"g-{topic}"
    produce(
        kafka_bootstrap,
        topic,
        [(b"a", b"permanent", "ev-0"), (b"b", b"ok", "ev-1"), (b"c", b"ok", "ev-2")],
    )
    # No dead-letter topic yet (auto-create is off): the DLQ write cannot succeed.
    consumer = scripted(settings(group_id=group, topics=(topic,), dlq_timeout=1.0))
    with run_consumer(consumer) as running:
        wait_for(
            lambda: _value(consumer, "worker_dlq_unavailable_total") >= 2,
            20,
            what="two failed dead-letter writes",
        )
        assert _value(consumer, "worker_paused_partitions", reason="dlq") == 1
        # Nothing skipped: the later messages wait behind the failed one, nothing committed.
        assert consumer.succeeded == []
        assert committed(kafka_bootstrap, group, topic, 1)[0] < 0
        _, body = http_get(f"{consumer.health.url}/healthz/ready")
        assert body["dlq_blocked"] == [f"{topic}/0"]

        dlq = kafka_topics(1, name=f"{topic}.dlq")
        wait_for(lambda: consumer.succeeded == [1, 2], 30, what="recovery after the DLQ appears")
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic, 1) == {0: 3},
            10,
            what="offset 3 committed",
        )
        assert _value(consumer, "worker_paused_partitions", reason="dlq") == 0
        assert running.stop() == 0

    letters = read_all(kafka_bootstrap, dlq, expect=1)
    assert [headers_of(m)["event_id"] for m in letters] == ["ev-0"]
    assert end_offsets(kafka_bootstrap, topic, 1) == {0: 3}
