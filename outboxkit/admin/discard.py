"""Discard: delete ``failed`` rows for good, each one recorded in the recovery log.

For an event that must never be sent (a poison payload, a topic that is gone
for good). Requeue is the usual way out of ``failed``; discard is the other.

Guarantees, the same locking as requeue:

* only rows whose status is ``failed`` are deleted: a row a relay holds is
  ``delivering`` and is never touched, nor are ``pending``, ``retryable`` or
  ``delivered`` rows. A failed row does not hold back its key, so deleting it
  changes nothing for the order of the key's other events;
* rows are deleted in chunks, each one transaction: the candidates are locked
  with ``SELECT ... FOR UPDATE SKIP LOCKED`` (a locking read: the latest
  committed status), the DELETE repeats the status check, and rows someone
  else holds at that instant (a requeue, a manual fix) are skipped and
  reported, never waited for;
* each chunk writes one ``discard`` recovery event in the *same* transaction as
  its DELETE: per row its id, event id, topic, key, attempts, created_at and
  last_error, plus the operator's reason and the selection. A row is never gone
  without its record, and a record never names a row that is still there.
"""

from __future__ import annotations

import socket

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outboxkit.admin.requeue import (
    RequeueResult,
    Selection,
    Skipped,
    named_rows_left_alone,
    selected_chunks,
    selection_filters,
)
from outboxkit.admin.rows import printable_bytes
from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.parse import format_ts
from outboxkit.schema.recovery import record_recovery
from outboxkit.schema.table import Status, delete_payloads, outbox_table, validate_identifier

__all__ = ["DiscardResult", "discard"]

#: Rows per transaction and per recovery event (one event's detail stays small).
DEFAULT_CHUNK = 100
#: Longest ``--reason`` kept.
MAX_REASON = 500

DiscardResult = RequeueResult


def discard(
    engine: Engine,
    *,
    table: str,
    selection: Selection,
    reason: str | None = None,
    dry_run: bool = False,
    node_id: str | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> DiscardResult:
    """Delete the selected ``failed`` rows; see the module docstring.

    Raises ``UnknownRowError`` (nothing changed) when an id or event id does
    not exist, ``ConfigError`` for an invalid selection.
    """
    validate_identifier(table)
    if selection.include_retryable:
        raise ConfigError("discard deletes failed rows only; retryable rows are still being sent")
    selection.validate()
    if reason is not None and len(reason) > MAX_REASON:
        raise ConfigError(f"--reason is {len(reason)} characters long; at most {MAX_REASON}")
    t = outbox_table(table)
    result = DiscardResult(dry_run=dry_run)
    if selection.ids or selection.event_ids:
        result.skipped.extend(
            named_rows_left_alone(engine, t, selection, (Status.FAILED.value,), "discarded")
        )
    filters = [*selection_filters(t, selection), t.c.status == Status.FAILED.value]
    who = node_id or f"admin@{socket.gethostname()}"
    columns = [
        t.c.id,
        t.c.event_id,
        t.c.topic,
        t.c.message_key,
        t.c.attempts,
        t.c.created_at,
        t.c.last_error,
    ]
    for conn, candidates in selected_chunks(engine, t, filters, chunk_size):
        ids = [row.id for row in candidates]
        if dry_run:
            result._add(ids)
            continue
        locked = conn.execute(
            sa.select(*columns)
            .where(t.c.id.in_(ids), t.c.status == Status.FAILED.value)
            .order_by(t.c.id)
            .with_for_update(skip_locked=True)
        ).all()
        if locked:
            # One statement per row on the primary key (no range locks), the
            # status checked again.
            conn.execute(
                t.delete().where(
                    t.c.id == sa.bindparam("row_id"), t.c.status == Status.FAILED.value
                ),
                [{"row_id": row.id} for row in locked],
            )
            delete_payloads(conn, table, [row.event_id for row in locked])
            record_recovery(
                conn,
                kind="discard",
                node_id=who,
                table=table,
                detail={
                    "count": len(locked),
                    "reason": reason,
                    "rows": [_describe(row) for row in locked],
                    "selection": selection.describe(),
                },
            )
        conn.commit()
        done = {row.id for row in locked}
        result._add([row.id for row in locked])
        result.skipped.extend(
            Skipped(
                row.id,
                row.event_id,
                "locked by another transaction or changed meanwhile; run again",
            )
            for row in candidates
            if row.id not in done
        )
    return result


def _describe(row: sa.Row[tuple[object, ...]]) -> dict[str, object]:
    return {
        "id": row.id,
        "event_id": row.event_id,
        "topic": row.topic,
        "key": printable_bytes(row.message_key),
        "attempts": row.attempts,
        "created_at": format_ts(row.created_at),
        "last_error": row.last_error,
    }
