"""Rows written by something other than ``enqueue`` (a foreign writer, a manual fix,
a migration): inserted with plain SQL, any value in any column a writer sets."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from outboxkit.schema import outbox_table, shard_for
from outboxkit.schema.table import db_now

SHARDS = 8


def insert_foreign(
    engine: sa.Engine,
    table: str,
    *,
    topic: str,
    key: bytes | None = b"k",
    payload: bytes = b"p",
    headers: str | None = None,
    event_id: str | None = None,
    shard: int | None = None,
    **values: Any,
) -> int:
    """Insert one ``pending`` row exactly as given; returns its id.

    ``shard`` defaults to what ``enqueue`` would compute (for an ASCII event id).
    """
    eid = event_id if event_id is not None else uuid.uuid4().hex
    if shard is None:
        shard = shard_for(key, eid if eid.isascii() else "x", SHARDS)
    t = outbox_table(table)
    now = db_now()
    with engine.begin() as conn:
        result = conn.execute(
            t.insert().values(
                event_id=eid,
                topic=topic,
                message_key=key,
                payload=payload,
                headers=headers,
                shard=shard,
                status=values.pop("status", "pending"),
                attempts=values.pop("attempts", 0),
                next_attempt_at=now,
                created_at=now,
                updated_at=now,
                **values,
            )
        )
        return int(result.inserted_primary_key[0])
