"""The real services the suite stands on answer, end to end."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.integration


def test_database_answers(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        version = str(conn.execute(sa.text("SELECT VERSION()")).scalar())
    assert version


def test_kafka_message_round_trip(kafka_bootstrap: str, kafka_topics: Callable[..., str]) -> None:
    from confluent_kafka import Consumer, Producer

    topic = kafka_topics(partitions=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    producer.produce(topic, key=b"k", value=b"hello", headers=[("event_id", b"e1")])
    assert producer.flush(20) == 0
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": topic,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([topic])
    try:
        msg = None
        for _ in range(60):
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                break
        assert msg is not None and msg.error() is None
        assert (msg.key(), msg.value(), msg.headers()) == (b"k", b"hello", [("event_id", b"e1")])
    finally:
        consumer.close()


def test_redis_answers(redis_url: str, redis_prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    assert client.ping()
    client.set(redis_prefix + "x", "1", px=10_000)
    assert client.get(redis_prefix + "x") == b"1"
    client.close()
