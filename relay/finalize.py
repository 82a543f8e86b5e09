"""Turn a batch's delivery reports into row states, under the lease token.

:func:`decide` maps each row to a :class:`Fate` (pure, no I/O);
:func:`finalize` writes the fates in one transaction, one statement per
group of rows with the same outcome (not one round trip per row).

Every statement is guarded by ``lease_owner`` **and** ``lease_token`` **and**
``status='delivering'``: a relay whose lease expired and whose rows another
relay reclaimed (new token) can no longer change them. Rows that fail the guard
are counted and logged as *lease lost*; that is never an error.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from confluent_kafka import KafkaError
from sqlalchemy.engine import Connection, Engine

from outboxkit.relay._dbtime import micros
from outboxkit.relay.backoff import Backoff
from outboxkit.relay.delivery import ErrorKind, Report, config_fault_reason
from outboxkit.relay.rows import Batch, ClaimedRow
from outboxkit.runtime.logs import MAX_IDS_LOGGED, log_event, redact
from outboxkit.schema.codec import StoredRowError, kafka_headers, topic_problem
from outboxkit.schema.recovery import record_recovery
from outboxkit.schema.table import MAX_LAST_ERROR, Status, db_now, delete_payloads, outbox_table

__all__ = ["Decision", "Fate", "FinalizeResult", "decide", "exhausted", "finalize", "spent_rows"]

log = logging.getLogger("outboxkit.relay.finalize")

#: The code of a row the publisher fails as stored (``delivery.row_fault``).
_INVALID_ARG = KafkaError._INVALID_ARG
#: Rows per statement (bounds the IN lists and the JSON parameter).
_CHUNK = 1000


class Fate(enum.Enum):
    DELIVERED = "delivered"
    RETRYABLE = "retryable"
    FAILED = "failed"
    PAUSED = "paused"  # relay configuration fault: retryable, attempt refunded
    RELEASED = "released"  # no outcome known: retryable now, lease cleared


# Not frozen: built once per row (see rows.ClaimedRow).
@dataclass(slots=True)
class Decision:
    row: ClaimedRow
    fate: Fate
    error: str | None = None
    #: The Kafka error code of the delivery report behind ``error`` (None when
    #: the row was acknowledged, or its error did not come from a report).
    error_code: int | None = None
    #: What librdkafka reported when ``error_code`` is the cause the relay found.
    sent_code: int | None = None
    partition: int | None = None
    offset: int | None = None
    #: Give the claim's attempt back (released/paused rows, cluster faults).
    refund: bool = False
    #: The attempt number the retry's backoff is computed for, when not the
    #: row's own (a refunded cluster fault backs off as the outage lasts).
    backoff_attempts: int | None = None
    #: Ack time on the relay's monotonic clock (delivered rows).
    acked_mono: float | None = None
    #: Label for ``outbox_topic_paused{reason}`` (paused rows).
    pause_reason: str | None = None
    #: Kafka acknowledged this row although an earlier row of its key in the
    #: batch failed to send (released rows): the acknowledged copy may sit in
    #: the partition ahead of that earlier event. ``(row id, error)`` of it.
    acked_ahead_of: tuple[int, str] | None = None


@dataclass
class FinalizeResult:
    counts: dict[Fate, int] = field(default_factory=lambda: dict.fromkeys(Fate, 0))
    lease_lost: list[int] = field(default_factory=list)

    def add(self, other: FinalizeResult) -> None:
        for fate, n in other.counts.items():
            self.counts[fate] += n
        self.lease_lost.extend(other.lease_lost)


def exhausted(row: ClaimedRow, max_attempts: int) -> Decision | None:
    """A row claimed more than ``max_attempts`` times without an outcome (it crashed
    relays, or their leases expired) fails without being sent again.
    """
    if row.attempts <= max_attempts:
        return None
    return Decision(
        row,
        Fate.FAILED,
        error=f"claimed {row.attempts} times without a delivery outcome "
        f"(max_attempts={max_attempts}): crashed or stalled relays",
    )


def spent_rows(
    rows: Sequence[ClaimedRow], max_attempts: int, *, failed_holds: bool
) -> tuple[list[Decision], list[ClaimedRow]]:
    """Split a claimed batch before it is sent: the decisions of the rows that are
    not sent, and the rows to send, in id order.

    :func:`exhausted` rows fail unsent. With ``failed_holds`` so does a row that
    cannot be sent as stored (:func:`_unsendable`) when a later row of its key
    is in the batch, and those later rows are released unsent (attempt
    refunded) to wait behind it: sent, Kafka would hold them ahead of it."""
    known: list[Decision] = []
    to_send: list[ClaimedRow] = []
    failed_keys: set[bytes] = set()
    last_of_key = {row.key: row.id for row in rows if row.key is not None}
    for row in rows:
        if row.key is not None and row.key in failed_keys:
            error = "held back: an earlier row of this key failed"
            known.append(Decision(row, Fate.RELEASED, error=error, refund=True))
            continue
        spent = exhausted(row, max_attempts)
        if (
            spent is None
            and failed_holds
            and row.key is not None
            and last_of_key[row.key] != row.id
        ):
            spent = _unsendable(row)
        if spent is None:
            to_send.append(row)
            continue
        known.append(spent)
        if failed_holds and row.key is not None:
            failed_keys.add(row.key)
    return known, to_send


def _unsendable(row: ClaimedRow) -> Decision | None:
    """The failure the publisher would give ``row`` before producing it (the same
    checks, the same text), or None. Asked only for a row with a later row of
    its key in the batch: its headers are then decoded twice."""
    try:
        problem = row.unsendable or topic_problem(row.topic)
        if problem is None:
            kafka_headers(row.headers, row.event_id)
            return None
    except StoredRowError as exc:
        problem = str(exc)
    except Exception:  # anything else is the publisher's to report, with the row
        return None
    return Decision(row, Fate.FAILED, error=f"invalid row: {problem}", error_code=_INVALID_ARG)


def decide(
    rows: Sequence[ClaimedRow],
    reports: Mapping[int, Report],
    *,
    max_attempts: int,
    refund_unknown: bool,
    failed_holds: bool = True,
) -> list[Decision]:
    """One decision per row, walking the batch in id order.

    Per-key order: once a row of a key is not delivered (retryable, paused,
    released, or failed while ``failed_holds``), a later row of that key in the
    batch is not marked delivered even if Kafka acknowledged it; it is released
    (attempt refunded) and sent again after its predecessor. Without
    ``failed_holds`` (``--failed-rows skip``) a ``failed`` row does not hold its
    key back.

    A row that was certainly not sent (``NOT_SENT``: never handed to the
    producer, or purged from its queue unsent) is released with its attempt
    refunded, even after a crash; one the cluster refused or never answered
    (``CLUSTER``) is retried, attempt refunded, whatever ``max_attempts`` says.

    When the earlier row's send *failed* (it has an error report) and the later
    one was acknowledged, the later event is already in the partition ahead of
    the earlier one: librdkafka's idempotent producer skips messages that hit
    ``message.timeout.ms`` and goes on with the next. The released row's
    decision says so (``acked_ahead_of``) so the relay can report it.
    """
    decisions: list[Decision] = []
    open_keys: dict[bytes, tuple[int, str] | None] = {}  # key -> failed send, if any
    for row in rows:
        report = reports.get(row.id)
        held = row.key is not None and row.key in open_keys
        if report is None:
            d = Decision(row, Fate.RELEASED, refund=refund_unknown)
        elif report.kind is ErrorKind.NOT_SENT:
            # Certainly not written (never handed over, or purged unsent): no
            # attempt was used, whatever happened to the batch.
            d = Decision(
                row, Fate.RELEASED, error=report.error, error_code=report.code, refund=True
            )
        elif report.ok and held:
            assert row.key is not None
            d = Decision(
                row,
                Fate.RELEASED,
                error="held back: an earlier row of this key was not delivered",
                refund=True,
                partition=report.partition,  # where the acknowledged copy went
                offset=report.offset,
                acked_ahead_of=open_keys[row.key],
            )
        elif report.ok:
            d = Decision(
                row,
                Fate.DELIVERED,
                partition=report.partition,
                offset=report.offset,
                acked_mono=report.mono,
            )
        elif report.kind is ErrorKind.ROW_FAULT:
            d = Decision(row, Fate.FAILED, error=report.error, error_code=report.code)
        elif report.kind is ErrorKind.CONFIG_FAULT:
            reason = config_fault_reason(report.code or 0)
            d = Decision(
                row,
                Fate.PAUSED,
                error=report.error,
                error_code=report.code,
                refund=True,
                pause_reason=reason,
            )
        elif report.kind is ErrorKind.CLUSTER:  # an outage of any length fails no row
            d = Decision(row, Fate.RETRYABLE, report.error, report.code, report.sent_code)
            d.refund = True
        elif row.attempts >= max_attempts:
            d = Decision(
                row,
                Fate.FAILED,
                error=f"{report.error} (attempt {row.attempts}/{max_attempts})",
                error_code=report.code,
            )
        else:
            d = Decision(row, Fate.RETRYABLE, error=report.error, error_code=report.code)
        opens = d.fate is not Fate.DELIVERED and (failed_holds or d.fate is not Fate.FAILED)
        if row.key is not None and opens:
            failed_send = None
            if report is not None and not report.ok:
                failed_send = (row.id, report.error or "")
            open_keys[row.key] = open_keys.get(row.key) or failed_send
        decisions.append(d)
    return decisions


def finalize(
    engine: Engine,
    table: str,
    batch: Batch,
    decisions: Sequence[Decision],
    *,
    backoff: Backoff | None,
    delete_on_deliver: bool,
) -> FinalizeResult:
    """Write ``decisions`` in one transaction; rows whose lease is no longer ours
    are left alone and returned in ``lease_lost``.

    The guarded writes go first; when their matched-row counts show that a row
    failed the guard, that transaction is rolled back and a second one locks the
    rows still held (``FOR UPDATE``) and writes only those.
    """
    result = FinalizeResult()
    if not decisions:
        return result
    t = outbox_table(table)
    ids = [d.row.id for d in decisions]
    groups = _groups(decisions)
    with engine.connect() as conn:
        # Usually every row is still ours: write first and check the matched-row
        # counts, which saves the locking read of the batch. If a row fails the
        # guard, roll back and take the careful path, which learns which ones.
        with conn.begin() as tx:
            if _write_groups(conn, t, batch, groups, backoff, delete_on_deliver) == len(ids):
                held = set(ids)
                _record_acked_ahead(conn, table, batch, decisions)
            else:
                tx.rollback()
                held = set()
        if not held:
            with conn.begin():
                for chunk in _chunks(ids):
                    held.update(conn.scalars(_lock_statement(table), {"ids": chunk, **_who(batch)}))
                mine = [d for d in decisions if d.row.id in held]
                groups = _groups(mine)
                _write_groups(conn, t, batch, groups, backoff, delete_on_deliver)
                # All of them, held or not: what this relay put in the partition does
                # not depend on whether its lease survived.
                _record_acked_ahead(conn, table, batch, decisions)
    for (fate, _, _), group in groups.items():
        result.counts[fate] += len(group)
    result.lease_lost = [i for i in ids if i not in held]
    if result.lease_lost:
        log_event(
            log,
            "lease-lost",
            level=logging.WARNING,
            table=table,
            rows=len(result.lease_lost),
            row_ids=result.lease_lost[:MAX_IDS_LOGGED],
            reason="the rows were reclaimed or changed by someone else; left as they are",
        )
    return result


def _record_acked_ahead(
    conn: Connection, table: str, batch: Batch, decisions: Sequence[Decision]
) -> None:
    """One ``acked-out-of-order`` recovery event for the batch's rows that Kafka
    holds ahead of an earlier row of their key, in the finalize transaction: the
    operator's durable record of which events a first-copy consumer saw early."""
    ahead = [(d, d.acked_ahead_of) for d in decisions if d.acked_ahead_of is not None]
    if not ahead:
        return
    rows = [
        {
            "row_id": d.row.id,
            "event_id": d.row.event_id,
            "topic": d.row.topic,
            "partition": d.partition,
            "offset": d.offset,
            "earlier_row_id": earlier,
            "earlier_error": error,
        }
        for d, (earlier, error) in ahead[:MAX_IDS_LOGGED]
    ]
    detail = {"count": len(ahead), "rows": rows}
    record_recovery(
        conn, kind="acked-out-of-order", node_id=batch.owner, table=table, detail=detail
    )


def _write_groups(
    conn: Connection,
    t: sa.Table,
    batch: Batch,
    groups: Mapping[tuple[Fate, str | None, bool], Sequence[Decision]],
    backoff: Backoff | None,
    delete_on_deliver: bool,
) -> int:
    """Write every group; the number of rows matched (found under our lease)."""
    matched = 0
    for (fate, error, refund), group in groups.items():
        for chunk in _chunks(group):
            matched += _write(
                conn, t, batch, fate, error, refund, chunk, backoff, delete_on_deliver
            )
    return matched


def _who(batch: Batch) -> dict[str, str]:
    return {"owner": batch.owner, "token": batch.token}


def _guarded(t: sa.Table, group: Sequence[Decision]) -> sa.ColumnElement[bool]:
    """The group's rows, only while they are leased under the batch's token
    (``owner`` and ``token`` bound as in :func:`_who`). Built only for the fates
    written without :func:`_per_row_update`: building it for every batch was
    about a tenth of a small finalize's CPU."""
    return sa.and_(
        t.c.id.in_([d.row.id for d in group]),
        t.c.lease_owner == sa.bindparam("owner"),
        t.c.lease_token == sa.bindparam("token"),
        t.c.status == Status.DELIVERING.value,
    )


@functools.lru_cache(maxsize=32)
def _lock_statement(table: str) -> sa.Select[tuple[int]]:
    t = outbox_table(table)
    return (
        sa.select(t.c.id)
        .where(
            t.c.id.in_(sa.bindparam("ids", expanding=True)),
            t.c.lease_owner == sa.bindparam("owner"),
            t.c.lease_token == sa.bindparam("token"),
            t.c.status == Status.DELIVERING.value,
        )
        .with_for_update()
    )


def _groups(
    decisions: Iterable[Decision],
) -> dict[tuple[Fate, str | None, bool], list[Decision]]:
    groups: dict[tuple[Fate, str | None, bool], list[Decision]] = {}
    for d in decisions:
        error = _bounded(d.error) if d.error is not None else None
        groups.setdefault((d.fate, error, d.refund), []).append(d)
    # Written in one order whatever the batch's first rows were: the same statements
    # in the same order every batch (and the same lock order for every relay).
    fates = list(Fate)
    return dict(
        sorted(groups.items(), key=lambda g: (fates.index(g[0][0]), g[0][1] or "", g[0][2]))
    )


def _write(
    conn: Connection,
    t: sa.Table,
    batch: Batch,
    fate: Fate,
    error: str | None,
    refund: bool,
    group: Sequence[Decision],
    backoff: Backoff | None,
    delete_on_deliver: bool,
) -> int:
    """Write one group of at most ``_CHUNK`` rows; the number of rows matched."""
    if fate is Fate.DELIVERED and delete_on_deliver:
        deleted = conn.execute(t.delete().where(_guarded(t, group)), _who(batch)).rowcount
        delete_payloads(conn, t.name, [d.row.event_id for d in group])
        return deleted
    if fate is Fate.DELIVERED:
        per_row = [(d.row.id, d.partition, d.offset) for d in group]
    elif fate is Fate.RETRYABLE:
        if backoff is None:
            raise ValueError("retryable rows need a backoff")
        per_row = [
            (d.row.id, micros(backoff.delay(d.backoff_attempts or d.row.attempts)), None)
            for d in group
        ]
    else:
        now = db_now()
        values: dict[str, Any] = {
            "updated_at": now,
            "lease_token": None,
            "lease_expires_at": None,
            # PAUSED, RELEASED, FAILED: eligible again at once (a paused topic is
            # not claimed) or never again.
            "status": Status.FAILED.value if fate is Fate.FAILED else Status.RETRYABLE.value,
            "lease_owner": None,
        }
        if fate is not Fate.FAILED:
            values["next_attempt_at"] = now
        if error is not None:
            values["last_error"] = error
        if refund:
            values["attempts"] = sa.case((t.c.attempts > 0, t.c.attempts - 1), else_=0)
        update = t.update().where(_guarded(t, group)).values(values)
        return conn.execute(update, _who(batch)).rowcount
    statement, params = _per_row_write(conn, t, batch, fate, error, refund, per_row)
    return conn.execute(statement, params).rowcount


def _per_row_write(
    conn: Connection,
    t: sa.Table,
    batch: Batch,
    fate: Fate,
    error: str | None,
    refund: bool,
    per_row: Sequence[tuple[int, int | None, int | None]],
) -> tuple[sa.TextClause, dict[str, Any]]:
    """The statement and parameters that write ``per_row`` (``(id, a, b)``, see
    :func:`_per_row_update`) under the batch's lease."""
    postgresql = conn.dialect.name == "postgresql"
    params: dict[str, Any] = {"owner": batch.owner, "token": batch.token}
    if postgresql:
        params["ids"] = [row_id for row_id, _, _ in per_row]
        values: object = {str(row_id): [a, b] for row_id, a, b in per_row}
    else:
        values = per_row
    params["per_row"] = json.dumps(values, separators=(",", ":"))
    if error is not None:
        params["error"] = error
    table = conn.dialect.identifier_preparer.quote(t.name)
    return _per_row_update(table, fate, error is not None, refund, postgresql), params


@functools.lru_cache(maxsize=64)
def _per_row_update(
    table: str, fate: Fate, has_error: bool, refund: bool, postgresql: bool = False
) -> sa.TextClause:
    """One UPDATE, built once per table and shape, for fates whose values differ per row.

    The per-row values (``a`` and ``b``: partition and offset of a delivered row,
    the backoff in microseconds of a retryable one) arrive as one JSON parameter
    read by the database, so the statement text is the same every batch: no
    per-batch SQL to build, compile or parse. (It replaced a literal ``CASE id
    WHEN ...`` of 500 arms that made every batch a new statement.)

    MySQL 8 and MariaDB 10.6+: ``[[id, a, b], ...]`` joined as ``JSON_TABLE``,
    which their optimizers read first, then each row by primary key.

    PostgreSQL: ``{"id": [a, b], ...}`` looked up by each row's id, and the rows
    found by ``id = ANY(:ids)``: no join. Joined to ``jsonb_array_elements``, the
    statement was planned as a nested loop with the table outside whenever the
    statistics promised one row under the lease guard (a relay's batch of a few
    hundred rows ``delivering`` when the table was last analyzed, the usual
    picture of a busy outbox): every row of the batch then read every per-row
    value again, 250,000 JSON look-ups for 500 rows, 125-293 ms a batch instead
    of 10-20. Without a join there is no such plan to pick; a JSON object's keys
    are sorted, so each look-up is a binary search.
    """
    if postgresql:
        now, col = "(CURRENT_TIMESTAMP AT TIME ZONE 'UTC')", ""
        a = "CAST(CAST(:per_row AS JSONB) -> CAST(t.id AS TEXT) ->> 0 AS BIGINT)"
        b = "CAST(CAST(:per_row AS JSONB) -> CAST(t.id AS TEXT) ->> 1 AS BIGINT)"
        retry_at = f"{now} + {a} * INTERVAL '1 microsecond'"
    else:
        now, col = "UTC_TIMESTAMP(6)", "t."
        a, b = "j.a", "j.b"
        retry_at = f"DATE_ADD({now}, INTERVAL j.a MICROSECOND)"
    sets = [f"updated_at = {now}", "lease_token = NULL", "lease_expires_at = NULL"]
    if fate is Fate.DELIVERED:
        # lease_owner stays: it records which relay delivered the row.
        sets += [
            f"status = '{Status.DELIVERED.value}'",
            f"delivered_at = {now}",
            f"kafka_partition = {a}",
            f"kafka_offset = {b}",
        ]
    elif fate is Fate.RETRYABLE:
        sets += [
            f"status = '{Status.RETRYABLE.value}'",
            "lease_owner = NULL",
            f"next_attempt_at = {retry_at}",
        ]
    else:
        raise ValueError(f"no per-row values for {fate}")
    if has_error:
        sets.append("last_error = :error")
    if refund:
        sets.append("attempts = CASE WHEN t.attempts > 0 THEN t.attempts - 1 ELSE 0 END")
    assignments = ", ".join(col + s for s in sets)
    guard = (
        "t.lease_owner = :owner AND t.lease_token = :token"
        f" AND t.status = '{Status.DELIVERING.value}'"
    )
    if postgresql:
        return sa.text(
            f"UPDATE {table} AS t SET {assignments}"
            f" WHERE t.id = ANY(CAST(:ids AS BIGINT[])) AND {guard}"
        )
    return sa.text(
        f"UPDATE {table} AS t JOIN JSON_TABLE(:per_row, '$[*]' COLUMNS ("
        "row_id BIGINT PATH '$[0]', a BIGINT PATH '$[1]', b BIGINT PATH '$[2]')) AS j"
        " ON t.id = j.row_id"
        f" SET {assignments}"
        f" WHERE {guard}"
    )


def _bounded(text: str) -> str:
    """``last_error`` as the column can hold it: redacted, bounded, and encodable
    (an error about a foreign row may quote a lone surrogate, which no UTF-8
    column accepts; it is written as ``\\udxxx`` instead of failing the batch)."""
    clean = redact(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return clean if len(clean) <= MAX_LAST_ERROR else clean[: MAX_LAST_ERROR - 3] + "..."


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]
