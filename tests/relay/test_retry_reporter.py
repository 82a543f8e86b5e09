"""``delivery-retry``: which topic the Kafka cluster refuses rows for, and why."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from confluent_kafka import KafkaError
from prometheus_client import CollectorRegistry

from outboxkit.relay.accounting import RetryReporter
from outboxkit.relay.finalize import Decision, Fate
from outboxkit.relay.metrics import RelayMetrics
from outboxkit.relay.rows import ClaimedRow
from outboxkit.runtime.testing import capture_json_logs

pytestmark = pytest.mark.unit

TIMEOUT = "_MSG_TIMED_OUT: Local: Message timed out"


def decision(row_id: int, topic: str, fate: Fate, error: str | None = TIMEOUT) -> Decision:
    """As ``finalize.decide`` makes it from a report: the text, and the code of
    the error it names (none for a text no report gave)."""
    row = ClaimedRow(row_id, f"e{row_id}", topic, b"k", b"{}", None, 0, 1, 0.0, None)
    name = (error or "").split(":", 1)[0]
    code = getattr(KafkaError, name, None) if name.isupper() or name.startswith("_") else None
    return Decision(row, fate, error=error, error_code=code)


def test_retryable_rows_count_per_topic_and_error_and_log_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="outboxkit.relay")
    registry = CollectorRegistry()
    probed: list[str] = []

    def probe(topic: str) -> list[dict[str, Any]]:
        probed.append(topic)
        return [{"partition": 0, "leader": 1, "isr": [1], "replicas": [1, 3]}]

    reporter = RetryReporter(RelayMetrics(registry), probe, interval=3600, background=False)
    batch = [
        decision(1, "orders", Fate.RETRYABLE),
        decision(2, "orders", Fate.RETRYABLE, "NOT_ENOUGH_REPLICAS: Broker: Not enough replicas"),
        decision(3, "orders", Fate.DELIVERED, None),
        decision(4, "audit", Fate.FAILED, "MSG_SIZE_TOO_LARGE: too large"),
        decision(5, "orders", Fate.RETRYABLE),
    ]
    reporter.report(batch, lost={5})
    reporter.report(batch[:1], lost=set())

    def count(topic: str, error: str) -> float:
        labels = {"topic": topic, "error": error}
        return registry.get_sample_value("outbox_kafka_delivery_errors_total", labels) or 0.0

    assert count("orders", "_MSG_TIMED_OUT") == 2  # row 5's lease was lost: not ours to count
    assert count("orders", "NOT_ENOUGH_REPLICAS") == 1
    assert count("audit", "MSG_SIZE_TOO_LARGE") == 0  # failed rows are the row's fault
    lines = [r.getMessage() for r in caplog.records if "delivery-retry" in r.getMessage()]
    assert len(lines) == 1, lines  # the second batch is inside the interval
    assert "topic=orders" in lines[0] and "'isr': [1]" in lines[0], lines[0]
    assert "rows=2" in lines[0] and "not paused" in lines[0]
    assert probed == ["orders"]


def test_every_batch_names_the_rows_a_broker_may_have_written_without_answering() -> None:
    reporter = RetryReporter(RelayMetrics(CollectorRegistry()), lambda _: None, background=False)
    batch = [
        decision(1, "orders", Fate.RETRYABLE),  # timed out in flight: maybe written
        decision(2, "orders", Fate.RETRYABLE, "NOT_LEADER_OR_FOLLOWER: not the leader"),
        decision(3, "orders", Fate.FAILED, f"{TIMEOUT} (attempt 5/5)"),
        decision(4, "orders", Fate.DELIVERED, None),
        decision(5, "orders", Fate.RETRYABLE, "_TRANSPORT: connection reset"),
        decision(6, "orders", Fate.RELEASED, "not sent: the queue stayed full"),
    ]
    with capture_json_logs(level="INFO") as logs:
        reporter.report(batch, lost={5})  # a lost lease does not unwrite a copy
        reporter.report(batch[:1], lost=set())  # not rate limited: the ids are the point
        reporter.report([decision(7, "orders", Fate.DELIVERED, None)], lost=set())
    lines = logs.events("possibly-written")
    assert [line["row_ids"] for line in lines] == [[1, 3, 5], [1]]
    assert lines[0]["rows"] == 3
    assert lines[0]["errors"] == {"_MSG_TIMED_OUT": 2, "_TRANSPORT": 1}


def test_the_error_is_named_by_its_code_not_by_its_text() -> None:
    """An error text that begins with another word (a broker's message quoted
    first, a prefix added on the way) still counts under the report's code."""
    registry = CollectorRegistry()
    reporter = RetryReporter(RelayMetrics(registry), lambda _: None, background=False)
    row = ClaimedRow(1, "e1", "orders", b"k", b"{}", None, 0, 1, 0.0, None)
    reworded = Decision(
        row,
        Fate.RETRYABLE,
        error="timed out: no reply from broker 2",
        error_code=KafkaError._MSG_TIMED_OUT,
    )
    with capture_json_logs(level="INFO") as logs:
        reporter.report([reworded], lost=set())
    labels = {"topic": "orders", "error": "_MSG_TIMED_OUT"}
    assert registry.get_sample_value("outbox_kafka_delivery_errors_total", labels) == 1.0
    assert [line["row_ids"] for line in logs.events("possibly-written")] == [[1]]
