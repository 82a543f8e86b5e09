"""A dead-letter topic that does not exist: the paused partition's error names it.

With the topic missing (broker auto-creation off), librdkafka waits for the
topic until the write's ``message.timeout.ms`` and then reports ``_MSG_TIMED_OUT``,
which reads like a slow cluster. The runbook (docs/operations.md,
``ConsumerDeadLetterBlocked``) tells operators to look for the missing topic, so
the logged error must say so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from kafkahelp import produce
from procs import ConsumerProcess

pytestmark = pytest.mark.integration


def test_a_missing_dead_letter_topic_is_named_in_the_paused_partitions_error(
    kafka_bootstrap: str, kafka_topics: Callable[..., str], tmp_path: Path
) -> None:
    """On main the ``partition-paused`` line said only "dead-letter write to
    <topic>.dlq failed: KafkaError{code=_MSG_TIMED_OUT,...}"."""
    topic = kafka_topics(1)
    produce(kafka_bootstrap, topic, [(b"k", b"poison", "ev-0")])
    proc = ConsumerProcess(
        "consumer_apps:GivesUp",
        env={
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "OUTBOXKIT_TOPICS": topic,
            "OUTBOXKIT_GROUP_ID": f"g-{topic}",
            "OUTBOXKIT_HEALTH_PORT": "0",
            "OUTBOXKIT_DLQ_TIMEOUT": "1",
            "OUTBOXKIT_LOG_FORMAT": "json",
            "OUTBOXKIT_KAFKA_CONFIG": "session.timeout.ms=6000,heartbeat.interval.ms=500",
        },
        cwd=tmp_path,
    )
    try:
        paused = proc.wait_event("partition-paused", 60, where=lambda r: r.get("reason") == "dlq")
        error = str(paused.get("error"))
        assert f"dead-letter topic {topic}.dlq does not exist" in error, paused
        assert "UNKNOWN_TOPIC_OR_PART" in error, paused
        assert f"create {topic}.dlq" in error, paused
        proc.signal()
        assert proc.wait(30) == 0, "".join(proc.raw[-20:])
    finally:
        proc.kill()
