"""A worker that crashes on every try at a record shows on readiness and in the
exit record (docs/operations.md, *Crash loops*), not only in a restart counter."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kafkahelp import http_get, produce, wait_for

from outboxkit.consumer import Consumer, ConsumerSettings, Message, PermanentError
from outboxkit.consumer.dlq import DeadLetters
from outboxkit.runtime.testing import capture_json_logs

pytestmark = pytest.mark.integration


class Refuses(Consumer):
    def handle(self, message: Message) -> None:
        raise PermanentError(f"unknown order type {(message.value or b'').decode()}")


def test_a_worker_crashing_on_the_handler_path_is_not_ready_and_does_not_exit_ok(
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
    kafka_topics: Callable[..., str],
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A crash after the handler (here the dead-letter write, as a text it cannot
    encode made it) restarts the worker, which meets the same record again:
    after three crashes in a row readiness answers 503 naming the worker and the
    error's class, and the exit record says ``crash-loop`` with exit code 1."""

    def broken(self: DeadLetters, message: Message, failure: Any) -> str:
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(DeadLetters, "send", broken)
    topic = kafka_topics(1)
    produce(kafka_bootstrap, topic, [(b"k", b"gift", "ev-0"), (b"k", b"ok", "ev-1")])
    consumer = Refuses(
        settings(group_id=f"g-{uuid.uuid4().hex[:8]}", topics=(topic,), concurrency=1)
    )
    with capture_json_logs(level="INFO") as logs, run_consumer(consumer) as running:
        wait_for(lambda: consumer.health.port != 0, 20, what="the health server")
        ready = consumer.health.url + "/healthz/ready"
        wait_for(lambda: consumer.supervisor.crashes >= 3, 60, what="three crashes")
        status, body = http_get(ready)
        assert status == 503, body
        assert isinstance(body, dict) and body["state"] == "running"
        (loop,) = body["crash_loop"]
        assert loop["worker"] == "consumer-worker-0"
        assert loop["error"] == "UnicodeEncodeError" and loop["consecutive_crashes"] >= 3
        assert running.stop() == 1
    (line,) = logs.events("consumer-exit")
    assert line["result"] == "crash-loop" and line["exit_code"] == 1
    assert [c["worker"] for c in line["crash_loop"]] == ["consumer-worker-0"]
