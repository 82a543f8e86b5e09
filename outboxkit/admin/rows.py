"""Reading rows for operators: the failed list, one row, the recovery log.

Payloads are never read unless asked for, so a listing cannot leak business data
into a terminal or a ticket by accident.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.parse import format_ts
from outboxkit.schema.codec import decode_headers
from outboxkit.schema.table import (
    Status,
    outbox_table,
    payload_table,
    recovery_table,
    stored_payload,
    validate_identifier,
)

__all__ = [
    "FailedRow",
    "RecoveryEvent",
    "UnknownEventError",
    "list_failed",
    "printable_bytes",
    "read_recovery",
    "readable_edge_times",
    "show_row",
]


class UnknownEventError(ConfigError):
    """``show`` was given an event id that is not in the table."""


def printable_bytes(data: bytes | None) -> dict[str, str] | None:
    """Bytes for display: ``{"text": ...}`` when valid UTF-8, else ``{"base64": ...}``."""
    if data is None:
        return None
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def bytes_text(shown: dict[str, str] | None) -> str | None:
    """What :func:`printable_bytes` gave, as one line of text output: the text
    itself, or ``base64:`` and the base64 (``--json`` keeps the two apart)."""
    if shown is None:
        return None
    return shown["text"] if "text" in shown else "base64:" + shown["base64"]


def _key_text(data: bytes | None) -> str | None:
    return bytes_text(printable_bytes(data))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FailedRow:
    id: int
    event_id: str
    topic: str
    key: str | None
    attempts: int
    last_error: str | None
    updated_at: str | None
    payload: dict[str, str] | None = None

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        if self.payload is None:
            del out["payload"]
        return out


def list_failed(
    engine: Engine,
    *,
    table: str,
    limit: int = 50,
    after_id: int = 0,
    topics: tuple[str, ...] = (),
    show_payload: bool = False,
) -> list[FailedRow]:
    """One page of ``failed`` rows in id order, starting after ``after_id``."""
    t = outbox_table(validate_identifier(table))
    cols: list[sa.ColumnElement[Any]] = [
        t.c.id,
        t.c.event_id,
        t.c.topic,
        t.c.message_key,
        t.c.attempts,
        t.c.last_error,
    ]
    cols.append(t.c.updated_at)
    source: sa.FromClause = t
    if show_payload:
        source, payload, _ = _with_payload(table)
        cols.append(payload)
    query = (
        sa.select(*cols)
        .select_from(source)
        .where(t.c.status == Status.FAILED.value, t.c.id > after_id)
        .order_by(t.c.id)
        .limit(limit)
    )
    if topics:
        query = query.where(t.c.topic.in_(topics))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [
        FailedRow(
            id=r.id,
            event_id=r.event_id,
            topic=r.topic,
            key=_key_text(r.message_key),
            attempts=r.attempts,
            last_error=r.last_error,
            updated_at=format_ts(r.updated_at),
            payload=printable_bytes(r.payload) if show_payload else None,
        )
        for r in rows
    ]


def _with_payload(
    table: str,
) -> tuple[sa.FromClause, sa.ColumnElement[Any], sa.ColumnElement[Any]]:
    """The outbox table joined to its payload table, and the rows' payload and
    headers (labelled so) wherever each row keeps them."""
    t = outbox_table(table)
    p = payload_table(table)
    payload, headers = stored_payload(t, p)
    source = t.outerjoin(p, p.c.event_id == t.c.event_id)
    return source, payload.label("payload"), headers.label("headers")


def show_row(
    engine: Engine, *, table: str, event_id: str, show_payload: bool = False
) -> dict[str, Any]:
    """Every column of one row, for display; raises UnknownEventError if absent."""
    t = outbox_table(validate_identifier(table))
    source, payload, headers = _with_payload(table)
    cols: list[sa.ColumnElement[Any]] = []
    for c in t.columns:
        if c.name == "payload":
            if show_payload:
                cols.append(payload)
        else:
            cols.append(headers if c.name == "headers" else c)
    with engine.connect() as conn:
        row = (
            conn.execute(sa.select(*cols).select_from(source).where(t.c.event_id == event_id))
            .mappings()
            .first()
        )
    if row is None:
        raise UnknownEventError(f"no event with event_id {event_id!r} in table {table}")
    out: dict[str, Any] = {}
    for name, value in row.items():
        if name == "message_key":
            out["key"] = _key_text(value)
        elif name == "payload":
            out["payload"] = printable_bytes(value)
        elif name == "headers":
            out["headers"] = _headers_view(value)
        elif isinstance(value, dt.datetime):
            out[name] = format_ts(value)
        else:
            out[name] = value
    return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryEvent:
    id: int
    at: str | None
    kind: str
    node_id: str
    table: str
    detail: object


def read_recovery(
    engine: Engine, *, table: str | None, limit: int = 20, kind: str | None = None
) -> list[RecoveryEvent]:
    """The newest recovery events first; ``table=None`` reads every outbox table's."""
    r = recovery_table()
    query = sa.select(r).order_by(r.c.id.desc()).limit(limit)
    if table is not None:
        query = query.where(r.c.table_name == table)
    if kind is not None:
        query = query.where(r.c.kind == kind)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    out = []
    for row in rows:
        try:
            detail: object = json.loads(row.detail)
        except ValueError:
            detail = row.detail
        out.append(
            RecoveryEvent(
                id=row.id,
                at=format_ts(row.at),
                kind=row.kind,
                node_id=row.node_id,
                table=row.table_name,
                detail=detail,
            )
        )
    return out


def _headers_view(stored: str | None) -> dict[str, Any]:
    """Headers as the operator should see them; stored text that does not decode
    (a foreign writer) is shown raw instead of failing the whole ``show``."""
    try:
        return {
            k: v if isinstance(v, str) else {"base64": base64.b64encode(v).decode("ascii")}
            for k, v in decode_headers(stored).items()
        }
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        return {"undecodable": str(stored), "error": f"{type(exc).__name__}: {exc}"[:200]}


def readable_edge_times(engine: Engine) -> None:
    """Let ``engine`` read PostgreSQL's ``infinity``/``-infinity`` timestamps (as
    those words): psycopg refuses to load them as ``datetime`` and the command
    would fail on a row another writer stored so. (PyMySQL already returns a
    MariaDB zero date as text.)"""
    if engine.dialect.name != "postgresql":
        return
    from psycopg.types.datetime import TimestampLoader

    class EdgeTimestampLoader(TimestampLoader):
        def load(self, data: Any) -> Any:
            text = bytes(data)
            if text in (b"infinity", b"-infinity"):
                return text.decode()
            return super().load(data)

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.adapters.register_loader("timestamp", EdgeTimestampLoader)

    sa.event.listen(engine, "connect", on_connect)
