"""Claim a batch: due rows in id order, leased to this relay under a fresh token.

Eligible rows are ``pending``/``retryable`` rows whose ``next_attempt_at`` has
passed, and ``delivering`` rows whose lease expired or was never set (a
*reclaim*: the previous owner died or stalled, or another writer stored it so).

Per-key order: a candidate is held back while an earlier row of the same key
is ``retryable`` and not yet due, ``delivering`` under a live lease, or in a
paused topic in any state but ``delivered``/``failed`` (also ``delivering``
under an expired lease: a paused topic's rows are not reclaimed until its next
probe, so they must hold their key meanwhile). An earlier row that is itself
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
leased or waiting rows only (see ``candidates_query``). On PostgreSQL each
probe is a subplan run per candidate, written so only that index serves it
(``key_probe``, ``key_rows``), and the ``delivering`` probe runs only for a
candidate whose key is among the keys held in flight, read once per claim
(``_leased_keys``): planned from statistics taken before any row was leased,
PostgreSQL had compared every candidate with every leased row instead. The
``retryable`` probe runs only while some retry holds a key back
(``_any_holding``). The candidates are then locked by primary key with
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

Everything runs in one short READ COMMITTED transaction (no gap locks that
would block writers' inserts), on MySQL/MariaDB and PostgreSQL alike.

Fence: an ownership whose hold lives on the server (PostgreSQL advisory locks)
learns of its loss late, when the news reaches its own session's socket; a
:class:`ClaimFence` makes the lease statement itself check that the hold is
still there, after the rows were locked. If it is not, nothing is leased
(``claim-fenced``), so no row is claimed after the server ended the hold,
however late the relay hears of it.
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
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection, Engine

from outboxkit.relay._dbtime import db_now_plus, micros, micros_between, time_ahead, time_passed
from outboxkit.relay.rows import Batch, ByteBudget, ClaimedRow, ClaimFence
from outboxkit.runtime.logs import MAX_IDS_LOGGED, log_event
from outboxkit.schema.crc32 import key_crc32
from outboxkit.schema.recovery import record_recovery
from outboxkit.schema.table import (
    MYSQL_DIALECTS,
    Status,
    db_now,
    key_status_index,
    outbox_table,
    undelivered,
)

__all__ = [
    # Moved to outboxkit.relay.rows; still exported here, as outboxkit.relay
    # exports them and code outside this repository may import them from here.
    "Batch",
    "ClaimedRow",
    "candidates",
    "claim_batch",
]

log = logging.getLogger("outboxkit.relay.claim")

#: The ``attempts`` column is a signed 32-bit INT.
_MAX_ATTEMPTS_STORED = 2**31 - 1


#: Without a budget every row comes with the lock statement.
_ALL_INLINE = 2**62


class _Fenced(Exception):
    """The fence was false: roll the claim back."""


def candidates(
    conn: Connection,
    table: str,
    *,
    shards: Collection[int],
    limit: int,
    excluded_topics: Collection[str] = (),
    shard_count: int | None = None,
    id_upper: int | None = None,
    reclaim: bool = True,
) -> list[tuple[int, bytes | None]]:
    """``(id, message_key)`` of due rows in id order (at most ``limit``), read without locks.

    ``id_upper``: consider only rows with ``id <= id_upper``. ``reclaim``: include
    ``delivering`` rows whose lease is over (see the module docstring)."""
    bounded = id_upper is not None
    query = _cached_candidates_query(
        table,
        tuple(sorted(shards)),
        limit,
        tuple(sorted(excluded_topics)),
        shard_count,
        bounded,
        conn.dialect.name,
        reclaim,
    )
    params = {"id_upper": id_upper} if bounded else {}
    return [(r.id, r.message_key) for r in conn.execute(query, params)]


def reclaims_due(*, in_flight: bool, looked: float, now: float, poll_interval: float) -> bool:
    """Whether a claim looks for expired leases (``reclaim``): always with nothing
    of the claimer's in flight, and beside its leased batch once per
    ``poll_interval`` since it ``looked`` last (monotonic seconds; see the module
    docstring). The relay's rule, and the DB ceiling's that copies the relay."""
    return not in_flight or now - looked >= poll_interval


@functools.lru_cache(maxsize=32)
def _cached_candidates_query(
    table: str,
    shards: tuple[int, ...],
    limit: int,
    excluded_topics: tuple[str, ...],
    shard_count: int | None,
    bounded: bool,
    dialect: str,
    reclaim: bool,
) -> sa.Select[tuple[int, bytes | None]]:
    # Built once per shard set and paused-topic set (they rarely change): building
    # it took 18% of the loop at 1,000 events/s, and the same object keeps its
    # SQLAlchemy cache key, so it is not compiled again either.
    return candidates_query(
        table,
        shards,
        limit,
        excluded_topics,
        shard_count=shard_count,
        bounded=bounded,
        dialect=dialect,
        reclaim=reclaim,
    )


def _lease_over(t: sa.Table, now: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """A ``delivering`` row's lease is over: expired, or never set (another writer
    stored ``delivering`` without a lease; nothing protects it, and left alone it
    would neither be claimed nor hold its key back); or ending further ahead than
    any relay leases (``infinity``, year 9999: see ``_dbtime.time_passed``)."""
    return sa.or_(time_passed(t.c.lease_expires_at, now), t.c.lease_expires_at.is_(None))


def home_shard(t: sa.Table | sa.Alias, shard_count: int) -> sa.ColumnElement[int]:
    """The shard ``enqueue`` gives a row, computed by the database:
    ``CRC32(message_key, or event_id when keyless) MOD shard_count`` (zlib's CRC-32,
    as in :func:`outboxkit.schema.codec.shard_for`: MySQL's ``CRC32()``,
    PostgreSQL's ``outboxkit_crc32()``)."""
    return sa.func.mod(key_crc32(t.c.message_key, t.c.event_id), sql_int(shard_count))


def sql_int(value: int) -> sa.ColumnElement[int]:
    """An integer written into the statement, not bound (see :func:`candidates_query`)."""
    return sa.literal_column(str(int(value)), sa.Integer())


def sql_status(status: Status) -> sa.ColumnElement[str]:
    """A status written into the statement as a string literal, not bound."""
    value = status.value
    assert value.isalpha(), value  # our own enum: nothing to quote
    return sa.literal_column(f"'{value}'", sa.String())


def in_list(
    column: sa.ColumnElement[Any], values: Collection[int], dialect: str | None
) -> sa.ColumnElement[bool]:
    """``column IN values``, the integers written into the statement, which is
    built once per shard set (see ``_cached_candidates_query``).

    As parameters, an expanding ``IN`` of 64 shards was 64 of them in each of
    the claim's three arms: PyMySQL escaped them on every claim, and psycopg
    parsed the statement anew on every call (its query cache stops at 50),
    about 2-4 ms of client CPU per claim, more than the claim's own SQL. As one
    array parameter on PostgreSQL, the plan PostgreSQL may settle on for a
    prepared statement (a generic one, for any value) could not see which
    shards it was given (see :func:`candidates_query`)."""
    return column.in_([sql_int(v) for v in sorted(values)])


def _owned(
    t: sa.Table, shards: Collection[int], shard_count: int | None, dialect: str | None
) -> sa.ColumnElement[bool] | None:
    """Rows this claim may take: stored shard owned, or stored shard out of range
    and home shard owned. None when that is every row (every shard owned), on
    MySQL/MariaDB: no condition to evaluate for each row."""
    stored = in_list(t.c.shard, shards, dialect)
    if shard_count is None:
        return stored
    out_of_range = sa.or_(t.c.shard < sql_int(0), t.c.shard >= sql_int(shard_count))
    if set(shards) >= set(range(shard_count)):
        return None
    return sa.or_(
        stored, sa.and_(out_of_range, in_list(home_shard(t, shard_count), shards, dialect))
    )


def candidates_query(
    table: str,
    shards: Collection[int],
    limit: int,
    excluded_topics: Collection[str] = (),
    *,
    shard_count: int | None = None,
    bounded: bool = False,
    dialect: str | None = None,
    reclaim: bool = True,
) -> sa.Select[tuple[int, bytes | None]]:
    """The candidates of a claim. ``shard_count``: the table's shard count; without
    it, rows whose stored shard is out of range are never candidates. ``bounded``:
    only rows with ``id <=`` the bound parameter ``id_upper`` are considered.
    ``dialect``: the database's (``engine.dialect.name``), for :func:`in_list`.
    ``reclaim``: also ``delivering`` rows whose lease is over; without it, none,
    and any earlier ``delivering`` row holds its key back.

    Statuses, shards, limits and the other constants are written into the
    statement (it is built once per shard set and paused-topic set); only
    ``id_upper`` and paused topics are bound. On PostgreSQL psycopg prepares a
    statement it ran five times, and after five more runs PostgreSQL may keep a
    *generic* plan, made for any parameter values. With the statuses bound
    (``status = $1``), that plan could not tell ``pending`` from ``delivered``:
    it walked the primary key through the whole table and scanned it for each
    per-key check, 4-8 ms per claim instead of 0.5-1, for the relay's life. In
    latency runs at 1,000 events/s that was p50 16 ms instead of 4-5 and p99
    31-39 ms instead of 8-13, in about half the runs: those whose relay
    happened to settle on the generic plan."""
    t = outbox_table(table)
    earlier = t.alias("earlier")
    now = db_now()
    # What holds a key's later rows back, per status of the earlier row.
    holds: dict[Status, sa.ColumnElement[bool]] = {
        Status.RETRYABLE: time_ahead(earlier.c.next_attempt_at, now),
        # Without the reclaim arm, a row left delivering under an expired lease is
        # not claimed now, so it must hold its key like a live one.
        Status.DELIVERING: time_ahead(earlier.c.lease_expires_at, now) if reclaim else sa.true(),
    }
    owned = _owned(t, shards, shard_count, dialect)
    common: list[sa.ColumnElement[bool]] = [] if owned is None else [owned]
    if bounded:
        common.append(t.c.id <= sa.bindparam("id_upper", type_=sa.BigInteger()))
    if excluded_topics:
        # A row of a paused topic is not claimed (nor reclaimed once its lease
        # expired), so it cannot ride ahead of its key's later rows in the batch:
        # while it waits, so do they (also on other topics).
        topics = sorted(excluded_topics)
        common.append(t.c.topic.not_in(topics))
        paused = earlier.c.topic.in_(topics)
        holds = {
            Status.PENDING: paused,
            Status.RETRYABLE: sa.or_(holds[Status.RETRYABLE], paused),
            Status.DELIVERING: sa.or_(holds[Status.DELIVERING], paused),
        }
    # One probe per status, each ``status = <constant>``, so it seeks
    # ``(message_key, status, id)`` by both columns and reads only the key's rows
    # in that status (see key_probe).
    for status, hold in holds.items():
        unheld = (
            ~key_probe(sql_int(1), earlier, table, dialect)
            .where(*key_rows(earlier, t.c.message_key, status, dialect, before=t.c.id), hold)
            .exists()
        )
        if dialect == "postgresql" and status is Status.DELIVERING:
            unheld = sa.or_(t.c.message_key.not_in(_leased_keys(earlier, hold)), unheld)
        elif dialect == "postgresql" and status is Status.RETRYABLE:
            unheld = sa.or_(~_any_holding(earlier, status, hold), unheld)
        common.append(unheld)
    if dialect in MYSQL_DIALECTS:
        common.append(_unheld_by_invalid_status(t, table, dialect))

    def by_status(
        status: Status, due: sa.ColumnElement[bool]
    ) -> sa.Select[tuple[int, bytes | None]]:
        order: tuple[sa.ColumnElement[Any], ...]
        if dialect == "postgresql":
            where, order = _status_range(t, status), (t.c.status, t.c.id)
        else:
            where, order = (t.c.status == sql_status(status),), (t.c.id,)
        return (
            sa.select(t.c.id, t.c.message_key)
            .where(*where, due, *common)
            .order_by(*order)
            .limit(sql_int(limit))
        )

    arms = [
        by_status(Status.PENDING, time_passed(t.c.next_attempt_at, now)),
        by_status(Status.RETRYABLE, time_passed(t.c.next_attempt_at, now)),
    ]
    if reclaim:
        arms.append(by_status(Status.DELIVERING, _lease_over(t, now)))
    merged = sa.union_all(*arms).subquery("candidates")
    return sa.select(merged.c.id, merged.c.message_key).order_by(merged.c.id).limit(sql_int(limit))


#: What MariaDB/MySQL store for a status outside the enum, written from a session
#: without strict mode (an ENUM's error value). PostgreSQL's enum refuses it.
INVALID_STATUS = ""


def invalid_status(t: sa.FromClause) -> sa.ColumnElement[bool]:
    """``t.status`` is the ENUM's error value: a status outside the enum."""
    return t.c.status == sa.literal_column(f"'{INVALID_STATUS}'", sa.String())


def _unheld_by_invalid_status(t: sa.Table, table: str, dialect: str) -> sa.ColumnElement[bool]:
    """MariaDB/MySQL: no earlier row of the candidate's key has a status outside
    the enum. Such a row is never claimed (nothing says what it is) and waits for
    an operator (``admin requeue`` makes it ``pending``), so it holds its key's
    later rows back. Asked first once per claim (an uncorrelated ``NOT EXISTS``,
    one seek of ``(status, id)``): with no such row in the table, as always
    after a strict writer, no candidate pays for the per-key probe."""
    anywhere = t.alias("invalid_anywhere")
    invalid = t.alias("invalid_earlier")
    none_at_all = (
        ~sa.select(sql_int(1)).select_from(anywhere).where(invalid_status(anywhere)).exists()
    )
    none_earlier = (
        ~key_probe(sql_int(1), invalid, table, dialect)
        .where(
            invalid.c.message_key == t.c.message_key,
            invalid_status(invalid),
            invalid.c.id < t.c.id,
        )
        .exists()
    )
    return sa.or_(none_at_all, none_earlier)


def _leased_keys(
    earlier: sa.FromClause, hold: sa.ColumnElement[bool]
) -> sa.Select[tuple[bytes | None]]:
    """PostgreSQL: the keys of the ``delivering`` rows that hold their keys back
    (``hold``), read once per claim into a hash table (an uncorrelated ``NOT IN``
    is a *hashed subplan*), so only a candidate whose key is among them pays for
    its per-key probe.

    They are what relays hold in flight (a batch or two each), few; a probe of
    the key index costs about 3 µs, and beside a leased batch it was one per
    candidate: the pipelined relay's claim of batch N+1, which meets N leased.
    Keyless rows never hold anything back and are left out (a NULL in a ``NOT
    IN`` list makes it unknown for every key)."""
    return sa.select(earlier.c.message_key).where(
        *_status_range(earlier, Status.DELIVERING), earlier.c.message_key.is_not(None), hold
    )


def _any_holding(earlier: sa.FromClause, status: Status, hold: sa.ColumnElement[bool]) -> sa.Exists:
    """PostgreSQL: whether any row in ``status`` holds its key back (``hold``), asked
    once per claim (an uncorrelated ``EXISTS`` is an *initplan*): while none does,
    as in a healthy drain with no retry waiting, no candidate pays for its
    per-key probe in that status (2-3 ms per 500-row claim).

    For ``retryable`` only: finding no such row reads the retryable rows, which
    the claim reads anyway. The ``pending`` hold (a paused topic's rows) is not
    gated: with none of them pending, the question would read the whole backlog."""
    return (
        sa.select(sql_int(1))
        .select_from(earlier)
        .where(*_status_range(earlier, status), hold)
        .exists()
    )


def _status_range(t: sa.FromClause, status: Status) -> tuple[sa.ColumnElement[bool], ...]:
    """``status`` as the closed range ``status >= s AND status <= s`` (PostgreSQL).

    With ``status = s`` PostgreSQL treats the status as a constant, so ``ORDER BY
    id`` can be served by the primary key as well as by ``(status, id)``; with
    statistics taken while most rows were pending (a backlog, then its drain)
    it walked the primary key through every row delivered since, filtering them
    out one by one: the candidates took 25.5 ms per 500-row batch on average
    over a 60,000-row drain (3 ms without the delivered rows), more the further
    it went, until autovacuum analyzed the table. A range is not a
    constant: ``ORDER BY status, id`` then comes from ``(status, id)`` alone, and
    the primary key would need a sort of every row it matches."""
    value = sql_status(status)
    return (t.c.status >= value, t.c.status <= value)


def key_probe(
    column: sa.ColumnElement[Any], alias: sa.FromClause, table: str, dialect: str | None
) -> sa.Select[Any]:
    """``SELECT column FROM alias`` for a probe of one key's rows in one status
    (the range :func:`key_rows` gives), made to seek ``(message_key, status, id)``.

    On a table that grew after the server opened it (a new outbox filling up)
    the databases know no row counts per key and chose ``(status, id)`` instead,
    reading every row in that status for each probe (20 million row reads and
    39 s for one claim beside 3,000 leased rows on MariaDB). MySQL/MariaDB are
    told to use the key index (``schema.apply.require_claim_schema`` checks at
    start that it exists); PostgreSQL, which takes no hints, is given a range
    only that index serves (:func:`key_rows`).
    """
    probe = sa.select(column).select_from(alias)
    if dialect in MYSQL_DIALECTS:
        probe = probe.with_hint(alias, f"FORCE INDEX ({key_status_index(table)})", dialect)
    elif dialect == "postgresql":
        # OFFSET 0 keeps a NOT EXISTS probe a subplan run for each candidate
        # (PostgreSQL makes a join of it otherwise): believing the rows a probe
        # may match few (statistics taken before they were leased), the join
        # read them once and compared each candidate with every one of them.
        probe = probe.offset(sql_int(0))
    return probe


def key_rows(
    alias: sa.FromClause,
    key: sa.ColumnElement[Any],
    status: Status,
    dialect: str | None,
    *,
    before: sa.ColumnElement[int] | None = None,
    after: sa.ColumnElement[int] | None = None,
) -> tuple[sa.ColumnElement[bool], ...]:
    """The rows of ``alias`` with message key ``key`` in ``status`` whose id is
    below ``before`` or above ``after`` (give one): one range of the key index
    ``(message_key, status, id)``, for a :func:`key_probe`.

    On PostgreSQL the range is written as row comparisons, ``(message_key,
    status) >= (key, s) AND (message_key, status, id) < (key, s, before)``, which
    only an index leading with those columns can serve; ``status = s`` could
    be served by ``(status, id)`` too, and was:

    - without statistics, a probe read every row in the status (32 million row
      reads for one claim in test_claim.py);
    - with statistics taken while no row was ``delivering`` (a backlog, then its
      drain), PostgreSQL read the leased rows once and compared every candidate
      with each of them: 500 x 500 rows, 32 ms of a pipelined relay's 50 ms per
      batch, when its claim met the batch in flight.
    """
    assert (before is None) != (after is None)
    value = sql_status(status)
    if dialect != "postgresql":
        bound = alias.c.id < before if after is None else alias.c.id > after
        return (alias.c.message_key == key, alias.c.status == value, bound)
    columns = (alias.c.message_key, alias.c.status)
    this_key = (key, value)
    ends: tuple[sa.ColumnElement[bool], ...]
    if after is None:
        ends = (
            sa.tuple_(*columns) >= sa.tuple_(*this_key),
            sa.tuple_(*columns, alias.c.id) < sa.tuple_(*this_key, before),
        )
    else:
        ends = (
            sa.tuple_(*columns, alias.c.id) > sa.tuple_(*this_key, after),
            sa.tuple_(*columns) <= sa.tuple_(*this_key),
        )
    # The key's equality too: it gives the estimate of a probe (rows per key),
    # which the row comparisons do not; and the index's predicate, which they
    # do not imply either (the index holds no delivered row).
    return (alias.c.message_key == key, *ends, undelivered(alias))


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
) -> Batch | None:
    """Lease up to ``limit`` due rows to ``owner``; None when nothing was due,
    or when ``fence`` was false (logged as ``claim-fenced``; nothing changed).

    ``budget``: load at most that many bytes of payloads and headers (see
    :func:`_within_budget`: rows left out hold their keys back, a payload the
    producer can never send is not loaded); None loads every row claimed.

    ``id_upper``: look only at rows with ``id <= id_upper`` (a claim
    made while an earlier batch of ours is leased; see the module docstring).
    ``reclaim=False``: leave ``delivering`` rows alone, expired or not, and hold
    their keys back (see the module docstring).

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
            )
            if not found:
                return None
            inline_max = _ALL_INLINE if budget is None else budget.inline_max(limit)
            locked_rows = conn.execute(
                lock, {"ids": [i for i, _ in found], "inline_max": inline_max}
            ).all()
            locked = _keep_key_order(found, locked_rows)
            unsendable: dict[int, str] = {}
            if budget is not None:
                locked, unsendable = _within_budget(locked, budget)
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


def id_in(column: sa.ColumnElement[int], dialect: str) -> sa.ColumnElement[bool]:
    """``column`` is one of the ids bound as ``ids`` (a list): ``= ANY(array)`` on
    PostgreSQL, one parameter and one statement text whatever the batch size (an
    expanding ``IN`` of 500 ids is 500 parameters for psycopg to parse on every
    call, and a new text per batch size); an expanding ``IN`` elsewhere."""
    if dialect == "postgresql":
        return column == sa.any_(sa.bindparam("ids", type_=ARRAY(sa.BigInteger())))
    return column.in_(sa.bindparam("ids", expanding=True))


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
        sa.and_(t.c.status == Status.DELIVERING.value, _lease_over(t, now)),
    )
    columns: dict[str, sa.ColumnElement[Any]] = {c.name: c for c in t.c}
    # The row's age at the claim, computed by the server as an integer: cheaper to
    # read than the two timestamps it comes from, and on the database clock.
    columns["age_us"] = sa.cast(micros_between(t.c.created_at, now), sa.BigInteger).label("age_us")
    # Payload and headers only for rows up to ``inline_max`` bytes (see ByteBudget);
    # the sizes of every row, which the server knows without sending the bytes.
    payload_bytes = sa.func.octet_length(t.c.payload)
    headers_bytes = sa.func.coalesce(sa.func.octet_length(t.c.headers), 0)
    inline = payload_bytes + headers_bytes <= sa.bindparam(
        "inline_max", _ALL_INLINE, type_=sa.BigInteger()
    )
    columns["payload"] = sa.case((inline, t.c.payload), else_=sa.null()).label("payload")
    columns["headers"] = sa.case((inline, t.c.headers), else_=sa.null()).label("headers")
    sizes = (payload_bytes.label("payload_bytes"), headers_bytes.label("headers_bytes"))
    lock = (
        sa.select(*(columns[name] for name in _LOCKED_COLUMNS), *sizes)
        .where(id_in(t.c.id, dialect), eligible)
        .order_by(t.c.id)
        .with_for_update(skip_locked=True)
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
    """The stored shard, or for one out of range the home shard (as ``home_shard``)."""
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
    # Quoted as SQLAlchemy quotes it (a mixed-case name is not folded).
    name = conn.dialect.identifier_preparer.quote(table)
    query = f"SELECT id, payload, headers FROM {name} WHERE id = ANY(%s)"
    with driver.cursor(binary=True) as cursor:  # type: ignore[union-attr]
        cursor.execute(query, [ids])
        return {r[0]: r for r in cursor.fetchall()}


@functools.lru_cache(maxsize=32)
def _payloads_statement(table: str, dialect: str) -> sa.Select[Any]:
    t = outbox_table(table)
    return sa.select(t.c.id, t.c.payload, t.c.headers).where(id_in(t.c.id, dialect))


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
