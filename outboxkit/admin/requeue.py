"""Requeue: give ``failed`` (and optionally ``retryable``) rows a fresh start.

A requeued row becomes ``pending`` with ``attempts = 0``, ``next_attempt_at`` =
now (database clock), its lease and ``last_error`` cleared, so the next relay
claim publishes it again with the full retry budget.

Safety against running relays:

* only rows whose status is one of the selected statuses (``failed``, plus
  ``retryable`` when asked, plus on MariaDB/MySQL a status outside the enum,
  stored as ``''`` from a session without strict mode: never claimed, such a
  row is repaired like a failed one) are changed; ``delivering`` rows, live lease or not,
  are never touched (an expired lease is reclaimed by the relay itself), nor are
  ``pending`` or ``delivered`` rows;
* rows are changed in chunks, each one transaction: the candidates are locked
  with ``SELECT ... FOR UPDATE SKIP LOCKED`` (a locking read, so it sees the
  latest committed status, not a snapshot), then updated with the status check
  repeated in the UPDATE's WHERE. A row that a relay is claiming at that moment
  (or that another session holds locked) is *skipped* and reported, never
  waited for: requeue cannot deadlock with a relay, and cannot change a row a
  relay just claimed. Running the same requeue again picks up skipped rows that
  are still eligible;
* each chunk records a ``requeue`` recovery event in its own transaction, so the
  log says exactly what was changed even if the run is interrupted.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outboxkit.relay._dbtime import time_ahead
from outboxkit.relay.claim_sql import INVALID_STATUS
from outboxkit.runtime.db import gentle_connection
from outboxkit.runtime.errors import ConfigError
from outboxkit.schema.recovery import record_recovery
from outboxkit.schema.table import (
    MYSQL_DIALECTS,
    Status,
    db_now,
    outbox_table,
    validate_identifier,
)

__all__ = [
    "RequeueResult",
    "Selection",
    "Skipped",
    "UnknownRowError",
    "named_rows_left_alone",
    "requeue",
    "selection_filters",
]

#: Rows per transaction: short lock times, bounded statement size.
DEFAULT_CHUNK = 500
#: Ids kept in a result (and in one recovery event); the counts are always exact.
_KEEP_IDS = 1000
_RECORD_IDS = 50


class UnknownRowError(ConfigError):
    """An ``--id`` or ``--event-id`` names no row of the table."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    """Which rows to requeue.

    Either *rows by identity* (``ids`` and/or ``event_ids``), or *a set* narrowed
    by ``topics``, a ``created_at`` range (``since`` inclusive, ``until``
    exclusive, naive UTC) and/or ``all_failed``. Mixing the two kinds is refused
    as ambiguous. ``include_retryable`` adds ``retryable`` rows to ``failed``.
    """

    ids: tuple[int, ...] = ()
    event_ids: tuple[str, ...] = ()
    topics: tuple[str, ...] = ()
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    all_failed: bool = False
    include_retryable: bool = False

    def validate(self) -> None:
        by_identity = bool(self.ids or self.event_ids)
        narrowing = [
            name
            for name, given in (
                ("--topic", bool(self.topics)),
                ("--since", self.since is not None),
                ("--until", self.until is not None),
                ("--all-failed", self.all_failed),
            )
            if given
        ]
        if not by_identity and not narrowing:
            raise ConfigError(
                "nothing selected: give --id, --event-id, --topic, --since/--until or --all-failed"
            )
        if by_identity and narrowing:
            raise ConfigError(
                f"conflicting selectors: --id/--event-id name rows exactly; "
                f"do not combine them with {', '.join(narrowing)}"
            )
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ConfigError(
                f"bad time range: --since ({self.since.isoformat()}Z) must be before "
                f"--until ({self.until.isoformat()}Z)"
            )
        if any(i < 1 for i in self.ids):
            raise ConfigError("--id must be a positive row id")

    @property
    def statuses(self) -> tuple[str, ...]:
        if self.include_retryable:
            return (Status.FAILED.value, Status.RETRYABLE.value)
        return (Status.FAILED.value,)

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {"statuses": list(self.statuses)}
        if self.ids:
            out["ids"] = list(self.ids[:_RECORD_IDS])
        if self.event_ids:
            out["event_ids"] = list(self.event_ids[:_RECORD_IDS])
        if self.topics:
            out["topics"] = list(self.topics)
        if self.since is not None:
            out["since"] = self.since.isoformat() + "Z"
        if self.until is not None:
            out["until"] = self.until.isoformat() + "Z"
        if self.all_failed:
            out["all_failed"] = True
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class Skipped:
    """A selected row that was not changed, and why."""

    id: int
    event_id: str
    reason: str


@dataclasses.dataclass(slots=True)
class RequeueResult:
    """What a requeue changed (or, with ``dry_run``, would change).

    ``count`` is exact; ``ids`` holds the first ``_KEEP_IDS`` of them.
    """

    dry_run: bool
    count: int = 0
    ids: list[int] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)

    def _add(self, ids: Sequence[int]) -> None:
        self.count += len(ids)
        room = _KEEP_IDS - len(self.ids)
        if room > 0:
            self.ids.extend(ids[:room])


def requeue(
    engine: Engine,
    *,
    table: str,
    selection: Selection,
    dry_run: bool = False,
    node_id: str | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> RequeueResult:
    """Requeue the selected rows; see the module docstring for the guarantees.

    Raises :class:`UnknownRowError` (nothing changed) when an id or event id does
    not exist, ``ConfigError`` for an invalid selection.
    """
    validate_identifier(table)
    selection.validate()
    t = outbox_table(table)
    result = RequeueResult(dry_run=dry_run)
    allowed = selection.statuses
    if engine.dialect.name in MYSQL_DIALECTS:
        # A status outside the enum (stored as '' without strict mode) is never
        # claimed: requeued like a failed row, it is relayed in its key's order.
        allowed = (*allowed, INVALID_STATUS)
    if selection.ids or selection.event_ids:
        result.skipped.extend(named_rows_left_alone(engine, t, selection, allowed, "requeued"))
    filters = [*selection_filters(t, selection), t.c.status.in_(allowed)]
    who = node_id or f"admin@{socket.gethostname()}"
    for conn, candidates in selected_chunks(engine, t, filters, chunk_size):
        ids = [row.id for row in candidates]
        if dry_run:
            result._add(ids)
            continue
        # Locking read: the latest committed status, and rows someone else holds
        # (a relay's claim in progress) are skipped rather than waited for.
        locked = set(
            conn.execute(
                sa.select(t.c.id)
                .where(t.c.id.in_(ids), t.c.status.in_(allowed))
                .with_for_update(skip_locked=True)
            ).scalars()
        )
        changed = [i for i in ids if i in locked]
        if changed:
            # One statement per row on the primary key: an IN list may be run as
            # an index scan that would wait on rows someone else holds.
            conn.execute(
                t.update()
                .where(
                    t.c.id == sa.bindparam("row_id"),
                    sa.or_(*(t.c.status == s for s in allowed)),
                )
                .values(
                    status=Status.PENDING.value,
                    attempts=0,
                    next_attempt_at=db_now(),
                    lease_owner=None,
                    lease_token=None,
                    lease_expires_at=None,
                    last_error=None,
                    updated_at=db_now(),
                ),
                [{"row_id": i} for i in changed],
            )
            record_recovery(
                conn,
                kind="requeue",
                node_id=who,
                table=table,
                detail={
                    "count": len(changed),
                    "ids": changed[:_RECORD_IDS],
                    "selection": selection.describe(),
                },
            )
        conn.commit()
        result._add(changed)
        result.skipped.extend(
            Skipped(
                row.id,
                row.event_id,
                "locked by another transaction or changed meanwhile; run again",
            )
            for row in candidates
            if row.id not in locked
        )
    return result


def selected_chunks(
    engine: Engine, t: sa.Table, filters: Sequence[sa.ColumnElement[bool]], chunk_size: int
) -> Iterator[tuple[Connection, Sequence[Any]]]:
    """The selected rows' ``(id, event_id)`` in id order, ``chunk_size`` at a time,
    each chunk with its own gentle connection (commit it before asking for the next)."""
    last_id = 0
    while True:
        with gentle_connection(engine) as conn:
            candidates = conn.execute(
                sa.select(t.c.id, t.c.event_id)
                .where(*filters, t.c.id > last_id)
                .order_by(t.c.id)
                .limit(chunk_size)
            ).all()
            if not candidates:
                return
            last_id = candidates[-1].id
            yield conn, candidates


def selection_filters(t: sa.Table, s: Selection) -> list[sa.ColumnElement[bool]]:
    out: list[sa.ColumnElement[bool]] = []
    if s.ids:
        out.append(t.c.id.in_(s.ids))
    if s.event_ids:
        out.append(t.c.event_id.in_(s.event_ids))
    if s.topics:
        out.append(t.c.topic.in_(s.topics))
    if s.since is not None:
        out.append(t.c.created_at >= s.since)
    if s.until is not None:
        out.append(t.c.created_at < s.until)
    return out


def named_rows_left_alone(
    engine: Engine, t: sa.Table, s: Selection, statuses: Sequence[str], done: str
) -> list[Skipped]:
    """Refuse unknown ids/event ids up front; explain named rows whose status is not
    one of ``statuses`` (``done``: what happens to the others, e.g. "requeued")."""
    conds: list[sa.ColumnElement[bool]] = []
    if s.ids:
        conds.append(t.c.id.in_(s.ids))
    if s.event_ids:
        conds.append(t.c.event_id.in_(s.event_ids))
    with engine.connect() as conn:
        # Whether a lease is live, judged by the server as the claim judges it
        # (a zero date or a lease "until infinity" is over: relay/_dbtime.py).
        live_lease = time_ahead(t.c.lease_expires_at, db_now())
        rows = conn.execute(
            sa.select(t.c.id, t.c.event_id, t.c.status, live_lease.label("live")).where(
                sa.or_(*conds)
            )
        ).all()
    unknown = [str(i) for i in s.ids if i not in {r.id for r in rows}]
    unknown += [e for e in s.event_ids if e not in {r.event_id for r in rows}]
    if unknown:
        shown = ", ".join(unknown[:20]) + (
            f" (+{len(unknown) - 20} more)" if len(unknown) > 20 else ""
        )
        raise UnknownRowError(f"no such row in {t.name}: {shown}; nothing was changed")
    skipped: list[Skipped] = []
    for r in rows:
        if r.status in statuses:
            continue
        if r.status == Status.DELIVERING.value:
            live = bool(r.live)
            why = (
                f"delivering: a relay holds its lease; never {done}"
                if live
                else "delivering with an expired lease: the next relay claim reclaims it"
            )
        elif r.status == Status.RETRYABLE.value and done == "requeued":
            why = "retryable: a relay retries it; add --include-retryable to reset its attempts"
        else:
            why = f"{r.status}: only failed rows are {done}"
        skipped.append(Skipped(r.id, r.event_id, why))
    return sorted(skipped, key=lambda sk: sk.id)
