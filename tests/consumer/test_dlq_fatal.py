"""The dead-letter producer after a fatal error.

A dedicated broker with an authorizer: the consumer's principal may read its
topic but may not write anywhere, so the idempotent dead-letter producer is
refused ``InitProducerId`` (CLUSTER_AUTHORIZATION_FAILED), which librdkafka
makes fatal. Once the operator grants WRITE on the dead-letter topic, the
consumer must recover on its own: dead-letter the message, commit, go on.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kafkahelp import FAST_GROUP, committed, headers_of, produce, read_all, wait_for
from support.kafka_acl import authz_kafka, create_topic, grant
from support.services import KafkaInstance
from test_failures import Scripted

from outboxkit.consumer import ConsumerSettings

pytestmark = [pytest.mark.integration, pytest.mark.fault]


@pytest.fixture(scope="module")
def authz_broker() -> Iterator[KafkaInstance]:
    kafka = authz_kafka()
    try:
        broker = kafka.__enter__()
    except RuntimeError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            raise
        pytest.skip(f"dedicated Kafka with an authorizer did not start: {exc}")
    yield broker
    kafka.__exit__(None, None, None)


def _value(consumer: Any, name: str, **labels: str) -> float:
    return consumer.registry.get_sample_value(name, labels) or 0.0


def test_fatal_dlq_producer_is_rebuilt_and_the_partition_resumes(
    authz_broker: KafkaInstance,
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
) -> None:
    topic = f"okt-dlqf-{uuid.uuid4().hex[:8]}"
    dlq = f"{topic}.dlq"
    group = f"g-{topic}"
    create_topic(authz_broker, topic)
    create_topic(authz_broker, dlq)
    grant(authz_broker, "TOPIC", topic, "READ")
    grant(authz_broker, "GROUP", group, "READ")
    produce(authz_broker.bootstrap, topic, [(b"a", b"permanent", "ev-0"), (b"b", b"ok", "ev-1")])
    consumer = Scripted(
        settings(
            group_id=group,
            topics=(topic,),
            dlq_timeout=1.0,
            kafka_bootstrap=authz_broker.sasl_bootstrap,
            kafka_config={**FAST_GROUP, **authz_broker.sasl_config("limited")},
        )
    )
    with run_consumer(consumer) as running:
        wait_for(
            lambda: _value(consumer, "worker_dlq_unavailable_total") >= 3,
            60,
            what="three refused dead-letter writes",
        )
        assert consumer.succeeded == []

        grant(authz_broker, "TOPIC", dlq, "WRITE")
        wait_for(lambda: consumer.succeeded == [1], 60, what="recovery after the grant")
        wait_for(
            lambda: committed(authz_broker.bootstrap, group, topic, 1) == {0: 2},
            20,
            what="offset 2 committed",
        )
        assert _value(consumer, "worker_paused_partitions", reason="dlq") == 0
        assert running.stop() == 0
    letters = read_all(authz_broker.bootstrap, dlq, expect=1)
    assert [headers_of(m)["event_id"] for m in letters] == ["ev-0"]
