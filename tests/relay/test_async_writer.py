"""Rows written by the async writer are delivered by the real relay to real Kafka."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from relay_support import EmbeddedRelay, consume, fast_settings, rows, wait_for
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from test_writer_async import async_url

from outboxkit import Event, enqueue_async, enqueue_many_async

pytestmark = pytest.mark.integration


def test_async_written_rows_reach_kafka_in_key_order(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=3)

    async def write() -> list[str]:
        aengine = create_async_engine(async_url(db_url))
        try:
            async with aengine.begin() as conn:
                first = await enqueue_async(
                    conn, topic=topic, payload={"n": 0}, key="order-1", headers={"h": "v"}
                )
            async with AsyncSession(aengine) as session, session.begin():
                more = await enqueue_many_async(
                    session,
                    [Event(topic=topic, payload={"n": n}, key=f"order-{n % 2}") for n in (1, 2, 3)],
                )
            async with aengine.connect() as conn:  # rolled back: never delivered
                await enqueue_async(conn, topic=topic, payload={"n": -1}, key="order-1")
                await conn.rollback()
        finally:
            await aengine.dispose()
        return [first, *more]

    ids = asyncio.run(write())
    relay = embedded(fast_settings(db_url, kafka_bootstrap))
    wait_for(
        lambda: relay.metric("outbox_rows_delivered_total") >= 4, timeout=30, what="4 deliveries"
    )
    assert relay.stop() == 0

    messages = consume(kafka_bootstrap, topic, expected=4)
    assert sorted(m.headers["event_id"].decode() for m in messages) == sorted(ids)
    first = next(m for m in messages if m.headers["event_id"].decode() == ids[0])
    assert (first.key, first.value, first.headers["h"]) == (b"order-1", b'{"n":0}', b"v")
    by_key: dict[bytes | None, list[int]] = {}
    for m in sorted(messages, key=lambda m: m.offset):
        by_key.setdefault(m.key, []).append(json.loads(m.value)["n"])
    assert by_key == {b"order-1": [0, 1, 3], b"order-0": [2]}
    assert {r.status for r in rows(engine, outbox)} == {"delivered"}
