"""The order of the way out: Kafka flushed and closed, then Redis (shard leases
released), then the database.

Why it matters: once a shard lease is released, the next owner claims the rows
this relay just released and sends them. If this relay's producer still holds
copies of those rows (a message still queued or in flight), they could land
after the new owner's later events of the same key. So the leases go only once
the producer is closed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
import sqlalchemy as sa
from relay_support import (
    EmbeddedRelay,
    add_events,
    fast_settings,
    outbox_key,
    status_counts,
    wait_for,
)

from outboxkit import Event
from outboxkit.relay import RelaySettings
from outboxkit.runtime.rediskeys import lease_key


def test_kafka_closes_before_shard_leases_go_and_the_database_last(
    db_url: str,
    engine: sa.Engine,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    redis_url: str,
    redis_prefix: str,
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(1)
    add_events(engine, outbox, [Event(topic=topic, payload={"n": i}, key="k") for i in range(5)])
    settings: RelaySettings = fast_settings(
        db_url,
        kafka_bootstrap,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        shard_lease_ttl=20.0,
        shard_renew_interval=1.0,
    )
    er = embedded(settings)
    wait_for(lambda: status_counts(engine, outbox) == {"delivered": 5}, timeout=30)
    relay = er.relay
    client = redis.Redis.from_url(redis_url)
    shards = range(8)
    key = outbox_key(engine, outbox)

    def leases_held() -> int:
        values = client.mget([lease_key(redis_prefix, key, s) for s in shards])
        return sum(1 for v in values if v and v.decode().startswith(settings.node_id + ":"))

    assert leases_held() > 0
    timeline: list[tuple[str, int]] = []

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            timeline.append((name, leases_held()))
            return fn(*args, **kwargs)

        return wrapped

    publisher, ownership = relay._resources.publisher, relay._resources.ownership
    assert publisher is not None and ownership is not None
    publisher.close = spy("kafka", publisher.close)  # type: ignore[method-assign]
    ownership.release_all = spy("redis", ownership.release_all)  # type: ignore[method-assign]
    relay.engine.dispose = spy("database", relay.engine.dispose)  # type: ignore[method-assign]
    assert er.stop() == 0
    client.close()
    assert [name for name, _ in timeline] == ["kafka", "redis", "database"], timeline
    # The producer closed while this relay still held its shard leases; the
    # database went after they were released.
    assert timeline[0][1] > 0 and timeline[2][1] == 0, timeline
