"""A fatal producer error (librdkafka gives up on the producer instance for good).

The real case: a dedicated broker with an authorizer, and a relay principal
without the ACLs an idempotent producer needs (no WRITE on any topic, no
IDEMPOTENT_WRITE): InitProducerId fails with CLUSTER_AUTHORIZATION_FAILED,
which librdkafka makes fatal. The relay must not burn the rows' attempts, must
pause the topic with an authorization reason, and must recover on its own by
building a new producer once the operator grants the ACL.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from relay_support import (
    EmbeddedRelay,
    add_events,
    consume,
    fast_settings,
    http_get,
    missing_service,
    rows,
    status_counts,
    wait_for,
)
from support.kafka_acl import authz_kafka, create_topic, grant
from support.services import KafkaInstance

from outboxkit import Event
from outboxkit.relay import Relay

pytestmark = [pytest.mark.integration, pytest.mark.fault]


@pytest.fixture(scope="module")
def authz_broker() -> Iterator[KafkaInstance]:
    try:
        with authz_kafka() as kafka:
            yield kafka
    except RuntimeError as exc:
        missing_service(f"dedicated Kafka with an authorizer did not start: {exc}")


def test_fatal_authorization_error_pauses_rebuilds_and_recovers(
    authz_broker: KafkaInstance, db_url: str, engine: sa.Engine, outbox: str
) -> None:
    topic = f"okt-authz-{uuid.uuid4().hex[:8]}"
    create_topic(authz_broker, topic, 3)
    events = [Event(topic=topic, payload={"n": i}, key=f"k{i % 3}") for i in range(6)]
    add_events(engine, outbox, events)
    settings = fast_settings(
        db_url,
        authz_broker.sasl_bootstrap,
        kafka_config=authz_broker.sasl_config("limited"),
        max_attempts=2,  # the old relay burnt a row to failed in two claims
        paused_topic_retry=0.5,
    )
    er = EmbeddedRelay(Relay(settings)).start()
    try:
        labels = {"topic": topic, "reason": "authorization"}
        wait_for(
            lambda: er.metric("outbox_topic_paused", labels) == 1,
            timeout=30,
            what="topic paused for authorization",
        )
        # Several rebuilds, each hitting the same fatal error: the rows keep
        # every attempt, none is failed, and readiness says what is wrong.
        wait_for(
            lambda: (
                er.metric("outbox_kafka_producer_fatal_total", {"reason": "authorization"}) >= 3
            ),
            timeout=60,
            what="three fatal errors (rebuilt producers hitting it again)",
        )
        assert er.metric("outbox_kafka_producer_rebuilds_total") >= 2
        assert "failed" not in status_counts(engine, outbox)
        assert all(r.attempts == 0 for r in rows(engine, outbox)), [
            (r.id, r.status, r.attempts, r.last_error) for r in rows(engine, outbox)
        ]
        status, body = http_get(f"http://127.0.0.1:{er.relay.health.port}/healthz/ready")
        assert status == 200, body
        assert isinstance(body, dict)
        details = body.get("details", body)
        assert topic in str(details), body
        assert "CLUSTER_AUTHORIZATION_FAILED" in str(details), body

        grant(authz_broker, "TOPIC", topic, "WRITE")
        wait_for(
            lambda: status_counts(engine, outbox) == {"delivered": len(events)},
            timeout=60,
            what="every row delivered after the grant",
        )
        wait_for(
            lambda: er.metric("outbox_topic_paused", labels) == 0,
            timeout=10,
            what="the pause gauge cleared",
        )
    finally:
        code = er.stop()
    assert code == 0
    got = consume(authz_broker.bootstrap, topic, expected=len(events))
    assert len(got) == len(events) == len({m.value for m in got})
