"""The recovery log: what was recovered or changed by hand, for operators.

Lease reclaims (a relay died holding rows), out-of-order acknowledgements,
requeues, discards and purges each leave one row here, so that after a restart
an operator can see what happened.  The log is bounded: ``record_recovery``
trims it to the newest ``MAX_RECOVERY_EVENTS`` rows.

Each event's ``detail`` is valid JSON of at most ``MAX_DETAIL_BYTES`` bytes (the
column is a TEXT, 65,535 bytes).  A detail that fits is stored exactly.  One that
does not is made to fit, always as valid JSON, in this order: strings longer
than 500, then 200, 100, 40 characters are shortened (ending in ``…``;
``"shortened_to"`` says the length), then the last items of its top-level lists
are left out (``"<name>_omitted"`` says how many); ``"truncated": true`` marks
any such record.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outboxkit.schema.table import db_now, recovery_table

MAX_RECOVERY_EVENTS = 10_000
#: Largest stored ``detail``, in bytes of JSON (ASCII: ``\u`` escapes for the rest).
MAX_DETAIL_BYTES = 60_000
_SHORTEN_TO = (500, 200, 100, 40)
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
    text = detail_text(detail)
    conn.execute(
        t.insert().values(
            at=db_now(), kind=kind[:64], node_id=node_id[:255], table_name=table, detail=text
        )
    )
    if random.randrange(_TRIM_EVERY) == 0:
        trim_recovery(conn, keep=keep)


def detail_text(detail: Mapping[str, object], max_bytes: int = MAX_DETAIL_BYTES) -> str:
    """``detail`` as JSON text of at most ``max_bytes``; see the module docstring."""
    full = _dumps(dict(detail))
    if len(full) <= max_bytes:
        return full
    plain: dict[str, object] = json.loads(full)  # JSON types only from here on
    for limit in _SHORTEN_TO:
        out = {**cast(dict[str, object], _shorten(plain, limit))}
        out.update(truncated=True, shortened_to=limit)
        text = _dumps(out)
        if len(text) <= max_bytes:
            return text
    # Still too long: leave out the last items of the top-level lists, longest first.
    lists = sorted(
        (k for k, v in out.items() if isinstance(v, list)), key=lambda k: -len(_dumps(out[k]))
    )
    for name in lists:
        items = cast(list[object], out[name])
        out[f"{name}_omitted"] = len(items)
        out[name] = []
        if len(_dumps(out)) > max_bytes:
            continue  # even empty it does not fit: the next list must give way too
        lo, hi = 0, len(items)  # the longest prefix that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            out[name], out[f"{name}_omitted"] = items[:mid], len(items) - mid
            if len(_dumps(out)) <= max_bytes:
                lo = mid
            else:
                hi = mid - 1
        out[name], out[f"{name}_omitted"] = items[:lo], len(items) - lo
        return _dumps(out)
    return _dumps({"truncated": True, "detail_bytes": len(full)})


def _dumps(value: object) -> str:
    # ensure_ascii: one character is one byte, so the bound is in bytes too.
    return json.dumps(value, separators=(",", ":"), default=str, ensure_ascii=True)


def _shorten(value: object, limit: int) -> object:
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "…"
    if isinstance(value, list):
        return [_shorten(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: _shorten(v, limit) for k, v in value.items()}
    return value


def trim_recovery(conn: Connection, *, keep: int = MAX_RECOVERY_EVENTS) -> int:
    """Delete all but the newest ``keep`` recovery events; how many were deleted.

    Runs on ``conn`` inside the caller's transaction and commits nothing.
    ``record_recovery`` calls it now and then, so the log stays bounded.
    """
    t = recovery_table()
    cutoff = conn.execute(sa.select(t.c.id).order_by(t.c.id.desc()).offset(keep).limit(1)).scalar()
    if cutoff is None:
        return 0
    return conn.execute(t.delete().where(t.c.id <= cutoff)).rowcount
