"""The recovery log: what was recovered or changed by hand, for operators.

Lease reclaims (a relay died holding rows), requeues and purges each leave one
row here, so that after a restart an operator can see what happened.  The log is
bounded: ``record_recovery`` trims it to the newest ``MAX_RECOVERY_EVENTS`` rows.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outboxkit.schema.table import db_now, recovery_table

MAX_RECOVERY_EVENTS = 10_000
#: Trimming costs a DELETE; doing it on about one insert in 50 keeps the log bounded
#: (at most ~50 rows over the limit) without a second statement per event.
_TRIM_EVERY = 50


def record_recovery(
    conn: Connection,
    *,
    kind: str,
    node_id: str,
    table: str,
    detail: Mapping[str, object],
    keep: int = MAX_RECOVERY_EVENTS,
) -> None:
    """Insert one recovery event in the caller's transaction (never commits)."""
    t = recovery_table()
    text = json.dumps(dict(detail), separators=(",", ":"), default=str)[:8000]
    conn.execute(
        t.insert().values(
            at=db_now(), kind=kind[:64], node_id=node_id[:255], table_name=table, detail=text
        )
    )
    if random.randrange(_TRIM_EVERY) == 0:
        trim_recovery(conn, keep=keep)


def trim_recovery(conn: Connection, *, keep: int = MAX_RECOVERY_EVENTS) -> int:
    t = recovery_table()
    cutoff = conn.execute(sa.select(t.c.id).order_by(t.c.id.desc()).offset(keep).limit(1)).scalar()
    if cutoff is None:
        return 0
    return conn.execute(t.delete().where(t.c.id <= cutoff)).rowcount
