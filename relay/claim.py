"""Claim a batch: due rows in id order, leased to this relay under a fresh token.

Eligible rows are ``pending``/``retryable`` rows whose ``next_attempt_at`` has
passed, and ``delivering`` rows whose lease expired or was never set (a
*reclaim*: the previous owner died or stalled, or another writer stored it so).

Per-key order: a candidate is held back while an earlier row of the same key
is ``pending`` or ``retryable`` and not yet due, ``delivering`` under a live
lease, ``failed`` (unless the relay runs with ``--failed-rows skip``: then a
failed row holds nothing), or in a paused topic in any state but
``delivered``/``failed`` (also ``delivering`` under an expired lease: a paused
topic's rows are not reclaimed until its next probe, so they must hold their
key meanwhile). A failed row holds until an operator requeues it (it is then
``pending``, due, and goes first) or discards it (the row is deleted). An earlier row that is itself
eligible does not hold it back: it has a smaller id, so it is in the same batch
and produced first; if it cannot be locked (another claimer holds it), or if it
goes to another topic (Kafka orders nothing across topics), the later rows of
its key are dropped from the batch. So a key never overtakes itself, and a
reclaimed batch comes back whole instead of one row per key per claim.

Shards: a row belongs to the shard stored in its ``shard`` column. A row whose
stored shard is outside ``0..shard_count-1`` (written by another writer) belongs
to the shard ``enqueue`` would have given it, ``CRC32(key, or event id) mod
shard_count``, computed by the database (PostgreSQL: the ``outboxkit_crc32``
function ``schema apply`` creates; see ``schema.crc32``): the shard of its
key's other rows, so the same relay claims them all, in id order. Such rows are logged
(``shard-out-of-range``) when claimed.

Cost: one index-ordered sub-select per status over ``(status, id)``, each
``ORDER BY id LIMIT batch_size``, merged and cut to ``batch_size``. None of
them reads ``delivered`` rows, so the claim does not slow down as history grows
(an ``ORDER BY id`` over ``status IN (...)`` could make MySQL sort the whole
backlog). Each candidate's per-key check is one probe per status that seeks
``(message_key, status, id)`` by key and status, so it reads that key's
leased or waiting rows only (see ``claim_sql.candidates_query``). On PostgreSQL each
probe is a subplan run per candidate, written so only that index serves it
(``key_probe``, ``key_rows``), and the ``delivering`` probe runs only for a
candidate whose key is among the keys held in flight, read once per claim
(``_leased_keys``): planned from statistics taken before any row was leased,
PostgreSQL had compared every candidate with every leased row instead. The
``retryable`` probe runs only while some retry holds a key back, the
``failed`` one only while some row is failed (``_any_holding``). On
MySQL/MariaDB the probes of a status run only while some row is in that
status at all (``_none_in_status``, one seek per claim). A ``pending`` row not
yet due is rare and cannot be gated so (no index holds ``next_attempt_at``):
the candidates are read again with that probe only when one sits below the
last candidate (``claim_sql.scheduled_below``).
The candidates are then locked by primary key with
``FOR UPDATE SKIP LOCKED`` and re-checked, so two relays racing for a row
cannot both get it: the loser either skips the locked row or, once the winner
committed, sees it ``delivering`` with a live lease.

A claim made while this relay's previous batch is still leased (``id_upper``,
the pipelined relay) looks only at rows with ``id <= id_upper`` (a prefix of
the table by id, so a row's earlier rows of its key are inside it too) and
keeps those no earlier row holds back: the previous batch's keys block
their later rows, and with a few hot keys an unbounded search for unblocked
rows would read the whole backlog. The bound is one more range condition on
the ``(status, id)`` scans, which then stop at ``id_upper``. Such a claim may
come back empty; the relay then settles its batch and claims without it.

Reclaims beside a leased batch (``reclaim=False``): the ``delivering`` rows a
claim reads to find expired leases are, beside our own batch in flight, that
batch's rows, which the finalize of the batch before it is changing at that very
moment (on MariaDB the claim beside a finalize took about a fifth longer with
that read than without it, see docs/performance.md; InnoDB looks at an older
version of each row an open transaction changed). Such a claim may leave expired leases
alone: it then claims no ``delivering`` row, and *every* earlier ``delivering``
row of a key holds the key back, expired or not, so nothing overtakes a row
left for the next claim that looks (the relay looks at least once per
``poll_interval``, and whenever nothing of its own is in flight).

Payloads: the lock statement reads each row's payload and headers from the
row, or, where its ``payload`` is NULL, from its payload row (the payload table,
outer-joined on ``event_id``; ``schema.table.payload_table``), with their sizes
for the byte budget. A row with neither is failed unsent (``_missing_payloads``).
Only the outbox row is leased; its payload row never changes.

Everything runs in one short READ COMMITTED transaction (no gap locks that
would block writers' inserts), on MySQL/MariaDB and PostgreSQL alike.

Fence: an ownership whose hold lives on the server (PostgreSQL advisory locks)
learns of its loss late, when the news reaches its own session's socket; a
:class:`ClaimFence` makes the lease statement itself check that the hold is
still there, after the rows were locked. If it is not, nothing is leased
(``claim-fenced``), so no row is claimed after the server ended the hold,
however late the relay hears of it.

Where the parts are: the SQL of the candidates and of the per-key probes is in
:mod:`outboxkit.relay.claim_sql`; the rows a claim returns and the fence and
byte budget it is given in :mod:`outboxkit.relay.rows`; the relay's engine (READ
COMMITTED, timeouts, PostgreSQL's session settings) in
:mod:`outboxkit.relay.engine`. This module locks and leases: ``claim_batch``.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
import zlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outboxkit.relay._dbtime import db_now_plus, micros, micros_between, time_passed
from outboxkit.relay.claim_sql import candidates, id_in, lease_over
from outboxkit.relay.rows import Batch, ByteBudget, ClaimedRow, ClaimFence
from outboxkit.runtime.logs import MAX_IDS_LOGGED, log_event
from outboxkit.schema.recovery import record_recovery
from outboxkit.schema.table import (
    Status,
    db_now,
    outbox_table,
    payload_table,
    payload_table_name,
    stored_payload,
)

__all__ = [
    # Moved to outboxkit.relay.rows; still exported here, as outboxkit.relay
    # exports them and code outside this repository may import them from here.
    "Batch",
    "ClaimedRow",
    "claim_batch",
]

log = logging.getLogger("outboxkit.relay.claim")

#: The ``attempts`` column is a signed 32-bit INT.
_MAX_ATTEMPTS_STORED = 2**31 - 1


#: Without a budget every row comes with the lock statement.
_ALL_INLINE = 2**62


class _Fenced(Exception):
    """The fence was false: roll the claim back."""


def reclaims_due(*, in_flight: bool, looked: float, now: float, poll_interval: float) -> bool:
    """Whether a claim looks for expired leases (``reclaim``): always with nothing
    of the claimer's in flight, and beside its leased batch once per
    ``poll_interval`` since it ``looked`` last (monotonic seconds; see the module
    docstring). The relay's rule, and the DB ceiling's that copies the relay."""
    return not in_flight or now - looked >= poll_interval


def claim_batch(
    engine: Engine,
    table: str,
    *,
    owner: str,
    shards: Collection[int],
    limit: int,
    lease_ttl: float,
    excluded_topics: Collection[str] = (),
    shard_count: int | None = None,
    id_upper: int | None = None,
    fence: ClaimFence | None = None,
    reclaim: bool = True,
    budget: ByteBudget | None = None,
    failed_holds: bool = True,
) -> Batch | None:
    """Lease up to ``limit`` due rows to ``owner``; None when nothing was due,
    or when ``fence`` was false (logged as ``claim-fenced``; nothing changed).

    ``budget``: load at most that many bytes of payloads and headers (see
    :func:`_within_budget`: rows left out hold their keys back, a payload the
    producer can never send is not loaded); None loads every row claimed.

    ``id_upper``: look only at rows with ``id <= id_upper`` (a claim
    made while an earlier batch of ours is leased; see the module docstring).
    ``reclaim=False``: leave ``delivering`` rows alone, expired or not, and hold
    their keys back (see the module docstring). ``failed_holds``: a ``failed``
    row holds its key's later rows back (``--failed-rows hold``, the default).

    Reclaimed rows are logged (``lease-reclaimed``) and recorded in the recovery
    log in the same transaction. ``attempts`` goes up by one for every row.
    With ``shard_count``, rows whose stored shard is out of range are claimed
    under their home shard (see the module docstring) and logged.
    """
    if not shards or limit < 1:
        return None
    token = secrets.token_hex(16)
    lock, lease = _claim_statements(table, engine.dialect.name)
    params: dict[str, Any] = {"owner": owner, "token": token, "ttl_us": micros(lease_ttl)}
    if fence is not None:
        lease = _fenced_lease(lease, fence.clause)
        params.update(fence.params)
    try:
        with engine.begin() as conn:
            found = candidates(
                conn,
                table,
                shards=shards,
                limit=limit,
                excluded_topics=excluded_topics,
                shard_count=shard_count,
                id_upper=id_upper,
                reclaim=reclaim,
                failed_holds=failed_holds,
            )
            if not found:
                return None
            inline_max = _ALL_INLINE if budget is None else budget.inline_max(limit)
            locked_rows = conn.execute(
                lock, {"ids": [i for i, _ in found], "inline_max": inline_max}
            ).all()
            locked = _keep_key_order(found, locked_rows)
            unsendable = _missing_payloads(locked, table)
            if budget is not None:
                locked, over = _within_budget(locked, budget)
                unsendable.update(over)
            if not locked:
                return None
            claimed_mono = time.monotonic()
            leased = conn.execute(lease, {"ids": [r[0] for r in locked], **params})
            if fence is not None and leased.rowcount == 0:
                raise _Fenced(len(locked))  # rolls the transaction back
            rows = tuple(_claimed(r[:_SIZES_AT], shard_count) for r in locked)
            _load_deferred(conn, table, rows, unsendable)
            reclaims = _record_reclaims(conn, table, owner, rows)
    except _Fenced as fenced:
        assert fence is not None
        log_event(
            log,
            "claim-fenced",
            level=logging.WARNING,
            table=table,
            rows=fenced.args[0],
            hold=fence.what,
            effect="nothing leased: the shard hold had ended on the server; "
            "the rows stay for their next owner",
        )
        return None
    misplaced = [r for r in rows if r.misplaced_shard is not None]
    if misplaced:
        log_event(
            log,
            "shard-out-of-range",
            level=logging.WARNING,
            table=table,
            shard_count=shard_count,
            rows=len(misplaced),
            row_ids=[r.id for r in misplaced][:MAX_IDS_LOGGED],
            stored_shards=[r.misplaced_shard for r in misplaced][:MAX_IDS_LOGGED],
            claimed_as=[r.shard for r in misplaced][:MAX_IDS_LOGGED],
            action="claimed under CRC-32 of the key (or event id) mod shard_count; "
            "fix the writer that stored these shards",
        )
    for previous, reclaimed in reclaims.items():  # logged once committed
        log_event(
            log,
            "lease-reclaimed",
            level=logging.WARNING,
            table=table,
            previous_owner=previous,
            rows=len(reclaimed),
            row_ids=reclaimed[:MAX_IDS_LOGGED],
        )
    return Batch(owner=owner, token=token, rows=rows, claimed_mono=claimed_mono)


#: The lock statement's columns, in order (``_claimed`` unpacks them by position).
_LOCKED_COLUMNS = (
    "id",
    "event_id",
    "topic",
    "message_key",
    "payload",
    "headers",
    "shard",
    "attempts",
    "age_us",
    "status",
    "lease_owner",
)
_DELIVERING = Status.DELIVERING.value


def _claimed(row: Sequence[Any], shard_count: int | None) -> ClaimedRow:
    """A locked row (``_LOCKED_COLUMNS``) as leased by this claim.

    By position, not by name: 500 rows of named access to SQLAlchemy rows took
    about 7 ms of the claim's client CPU, more than the rest of building them."""
    (row_id, event_id, topic, key, payload, headers, stored, attempts, age_us, status, owner) = row
    shard = _effective_shard(stored, key, event_id, shard_count)
    return ClaimedRow(
        id=row_id,
        event_id=event_id,
        topic=topic,
        key=key,
        payload=payload,
        headers=headers,
        shard=shard,
        attempts=attempts + 1,
        # NULL when created_at is not a time (a zero date, an infinity): age 0.
        age_at_claim=0.0 if age_us is None else max(0, age_us) / 1_000_000,
        reclaimed_from=(owner or "(no owner)") if status == _DELIVERING else None,
        misplaced_shard=None if stored == shard else stored,
    )


@functools.lru_cache(maxsize=32)
def _claim_statements(table: str, dialect: str) -> tuple[sa.Select[Any], sa.Update]:
    """The lock and lease statements of a claim, built once per table and dialect.

    Everything that changes per claim is a bound parameter (``ids``), so
    SQLAlchemy compiles each statement once and not per batch.
    """
    t = outbox_table(table)
    now = db_now()
    eligible = sa.or_(
        sa.and_(
            t.c.status.in_([Status.PENDING.value, Status.RETRYABLE.value]),
            time_passed(t.c.next_attempt_at, now),
        ),
        sa.and_(t.c.status == Status.DELIVERING.value, lease_over(t, now)),
    )
    columns: dict[str, sa.ColumnElement[Any]] = {c.name: c for c in t.c}
    # The row's age at the claim, computed by the server as an integer: cheaper to
    # read than the two timestamps it comes from, and on the database clock.
    columns["age_us"] = sa.cast(micros_between(t.c.created_at, now), sa.BigInteger).label("age_us")
    # Payload and headers from the outbox row, or from its payload row when the
    # row's own are NULL (schema.table.payload_table); NULL sizes when neither
    # has them (a foreign row: see _missing_payloads).
    p = payload_table(table)
    payload, headers = stored_payload(t, p)
    # Payload and headers only for rows up to ``inline_max`` bytes (see ByteBudget);
    # the sizes of every row, which the server knows without sending the bytes.
    payload_bytes = sa.func.octet_length(payload)
    headers_bytes = sa.func.coalesce(sa.func.octet_length(headers), 0)
    inline = payload_bytes + headers_bytes <= sa.bindparam(
        "inline_max", _ALL_INLINE, type_=sa.BigInteger()
    )
    columns["payload"] = sa.case((inline, payload), else_=sa.null()).label("payload")
    columns["headers"] = sa.case((inline, headers), else_=sa.null()).label("headers")
    sizes = (payload_bytes.label("payload_bytes"), headers_bytes.label("headers_bytes"))
    # Only the outbox row is locked where the server can say so (PostgreSQL,
    # MySQL 8: ``FOR UPDATE OF``); MariaDB locks the payload row with it, which
    # nothing else locks while the outbox row is due.
    lock = (
        sa.select(*(columns[name] for name in _LOCKED_COLUMNS), *sizes)
        .select_from(t.outerjoin(p, p.c.event_id == t.c.event_id))
        .where(id_in(t.c.id, dialect), eligible)
        .order_by(t.c.id)
        .with_for_update(skip_locked=True, of=t)
    )
    lease = (
        t.update()
        .where(id_in(t.c.id, dialect))
        .values(
            status=Status.DELIVERING.value,
            lease_owner=sa.bindparam("owner"),
            lease_token=sa.bindparam("token"),
            # Server-side, from the same clock every relay compares against.
            lease_expires_at=db_now_plus(sa.bindparam("ttl_us", type_=sa.BigInteger())),
            # A foreign writer may have stored the column's maximum: "+ 1" must not
            # overflow (that fails the whole claim, every claim); such a row is
            # failed as exhausted without being sent.
            attempts=sa.func.least(t.c.attempts, _MAX_ATTEMPTS_STORED - 1) + 1,
            updated_at=now,
        )
    )
    return lock, lease


@functools.lru_cache(maxsize=8)
def _fenced_lease(lease: sa.Update, clause: sa.ColumnElement[bool]) -> sa.Update:
    """The lease statement that changes nothing unless ``clause`` holds (one
    statement object per fence clause, so it is compiled once)."""
    return lease.where(clause)


def _effective_shard(stored: int, key: bytes | None, event_id: str, shard_count: int | None) -> int:
    """The stored shard, or for one out of range the home shard (as ``claim_sql.home_shard``)."""
    shard = int(stored)
    if shard_count is None or 0 <= shard < shard_count:
        return shard
    data = bytes(key) if key is not None else str(event_id).encode("utf-8")
    return zlib.crc32(data) % shard_count


def _keep_key_order(
    found: list[tuple[int, bytes | None]], locked: Sequence[Sequence[Any]]
) -> list[Sequence[Any]]:
    """Drop locked rows that could overtake an earlier row of their key.

    A row is dropped (with the rest of its key) when an earlier candidate of its
    key could not be locked, or when an earlier row of its key in this batch goes
    to another topic: Kafka orders nothing across topics, so that earlier row must
    be acknowledged before this one is even sent.
    """
    by_id = {r[0]: r for r in locked}  # _LOCKED_COLUMNS: id first, topic third
    blocked: set[bytes] = set()
    first_topic: dict[bytes, str] = {}
    kept: list[Sequence[Any]] = []
    for row_id, key in found:
        row = by_id.get(row_id)
        if key is not None:
            if key in blocked:
                continue
            if row is None or first_topic.setdefault(key, row[2]) != row[2]:
                blocked.add(key)
                continue
        if row is not None:
            kept.append(row)
    return kept


#: Where the lock statement's size columns start (after ``_LOCKED_COLUMNS``):
#: ``payload_bytes``, ``headers_bytes``.
_SIZES_AT = len(_LOCKED_COLUMNS)


def _within_budget(
    locked: Sequence[Sequence[Any]], budget: ByteBudget
) -> tuple[list[Sequence[Any]], dict[int, str]]:
    """The locked rows (in id order) a claim keeps under ``budget``, and why each
    kept row that can never be sent cannot (by row id).

    - A row whose payload and key alone are over ``max_message_bytes`` can never
      be produced (librdkafka refuses a record over ``message.max.bytes``): it
      is kept, to be failed in id order with its key, but nothing of it is loaded
      and it costs the budget nothing.
    - Other rows are kept while the bytes of their payloads and headers fit in
      ``max_bytes``; the first one always (a row bigger than the budget goes
      alone, or it would never go). A row left out is not leased: it stays due
      for the next claim, and, as a row another claimer holds, it takes its key's
      later rows out of this batch, so they cannot overtake it.

    So a claim loads at most ``max(max_bytes, max_message_bytes)``, plus the
    rows under ``inline_max`` the lock statement brought and the claim left out
    (``max_bytes`` in all, see :meth:`ByteBudget.inline_max`)."""
    kept: list[Sequence[Any]] = []
    unsendable: dict[int, str] = {}
    blocked: set[bytes] = set()
    used = 0
    loading = False
    for row in locked:
        row_id, key = row[0], row[3]  # _LOCKED_COLUMNS: id, event_id, topic, message_key
        if key is not None and key in blocked:
            continue
        if row[_SIZES_AT] is None:  # no payload (_missing_payloads): nothing to load
            kept.append(row)
            continue
        payload_bytes, headers_bytes = int(row[_SIZES_AT]), int(row[_SIZES_AT + 1])
        if payload_bytes + len(key or b"") > budget.max_message_bytes:
            unsendable[row_id] = (
                f"payload of {payload_bytes} bytes is over the producer's message.max.bytes "
                f"({budget.max_message_bytes}): Kafka never takes it; not sent (raise "
                "message.max.bytes on the relay and max.message.bytes on the topic, then "
                "requeue it)"
            )
            kept.append(row)
            continue
        size = payload_bytes + headers_bytes
        if loading and used + size > budget.max_bytes:
            if key is not None:
                blocked.add(key)
            continue
        loading = True
        used += size
        kept.append(row)
    return kept, unsendable


def _missing_payloads(locked: Sequence[Sequence[Any]], table: str) -> dict[int, str]:
    """Why each locked row with no payload cannot be sent, by row id: its
    ``payload`` is NULL and the payload table has no row for its event id (a
    writer stored neither). Such a row fails; it is never sent without one."""
    return {
        row[0]: (
            f"no payload: its payload column is NULL and {payload_table_name(table)} has no "
            "row for its event id; store the payload there (or in the row), then requeue it"
        )
        for row in locked
        if row[_SIZES_AT] is None
    }


def _load_deferred(
    conn: Connection, table: str, rows: Sequence[ClaimedRow], unsendable: Mapping[int, str]
) -> None:
    """Give ``rows`` the payloads and headers the lock statement left on the
    server (rows over ``inline_max``): one more statement, only when a batch has
    such rows. The rows are locked, so these are the values the claim saw.
    A row in ``unsendable`` gets an empty payload and its reason instead."""
    deferred: list[ClaimedRow] = []
    for row in rows:
        reason = unsendable.get(row.id)
        if reason is not None:
            row.payload, row.headers, row.unsendable = b"", None, reason
        elif row.payload is None:
            deferred.append(row)
    if not deferred:
        return
    ids = [r.id for r in deferred]
    if conn.dialect.name == "postgresql":
        loaded = _pg_binary_rows(conn, table, ids)
    else:
        loaded = {
            r[0]: r
            for r in conn.execute(_payloads_statement(table, conn.dialect.name), {"ids": ids})
        }
    for row in deferred:
        _, row.payload, row.headers = loaded[row.id]


def _pg_binary_rows(conn: Connection, table: str, ids: list[int]) -> dict[int, Sequence[Any]]:
    """PostgreSQL: ``id, payload, headers`` of ``ids`` in the binary protocol, in
    the claim's transaction. In text, the default, a ``bytea`` travels as hex: the
    driver held twice each payload's size before decoding it."""
    driver = conn.connection.driver_connection
    with driver.cursor(binary=True) as cursor:  # type: ignore[union-attr]
        cursor.execute(_pg_payloads_sql(table, conn.dialect), {"ids": ids})
        return {r[0]: r for r in cursor.fetchall()}


@functools.lru_cache(maxsize=32)
def _pg_payloads_sql(table: str, dialect: sa.Dialect) -> str:
    """:func:`_payloads_statement` as the text psycopg's cursor takes (``%(ids)s``):
    the same SQL as the other databases', compiled once per table."""
    return str(_payloads_statement(table, "postgresql").compile(dialect=dialect))


@functools.lru_cache(maxsize=32)
def _payloads_statement(table: str, dialect: str) -> sa.Select[Any]:
    t = outbox_table(table)
    p = payload_table(table)
    return (
        sa.select(t.c.id, *stored_payload(t, p))
        .select_from(t.outerjoin(p, p.c.event_id == t.c.event_id))
        .where(id_in(t.c.id, dialect))
    )


def _record_reclaims(
    conn: Connection, table: str, owner: str, rows: tuple[ClaimedRow, ...]
) -> dict[str, list[int]]:
    by_owner: dict[str, list[int]] = {}
    for r in rows:
        if r.reclaimed_from is not None:
            by_owner.setdefault(r.reclaimed_from, []).append(r.id)
    for previous, ids in by_owner.items():
        detail = {
            "previous_owner": previous,
            "rows": len(ids),
            "row_ids": ids[:MAX_IDS_LOGGED],
        }
        record_recovery(conn, kind="lease-reclaimed", node_id=owner, table=table, detail=detail)
    return by_owner
