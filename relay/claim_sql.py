"""The SQL of a claim's candidates and of its per-key probes, and the small
builders they share.

:func:`candidates` reads, without locks, the due rows a claim may take
(:func:`candidates_query`): one index-ordered arm per status, and per candidate
a probe of its key's earlier rows (:func:`key_probe`, :func:`key_rows`) for
anything that holds the key back. The rules this SQL implements (what holds a
key back, reclaims, the ``id_upper`` bound, out-of-range shards) and what each
part costs are in :mod:`outboxkit.relay.claim`, which locks and leases what
these find.

Apart from the claim because it is more than the claim's: the ordering-blocked
sampler (``relay/metrics.py``) probes keys as the claim does, and the metrics
and ``admin requeue`` recognize a status outside the enum by the same
:func:`invalid_status`. They need this SQL, not the claim's transaction.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from outboxkit.relay._dbtime import time_ahead, time_passed
from outboxkit.schema.crc32 import key_crc32
from outboxkit.schema.table import (
    MYSQL_DIALECTS,
    Status,
    db_now,
    key_status_index,
    outbox_table,
    undelivered,
)

__all__ = [
    "INVALID_STATUS",
    "candidates",
    "candidates_query",
    "home_shard",
    "id_in",
    "in_list",
    "invalid_status",
    "key_probe",
    "key_rows",
    "lease_over",
    "scheduled_below",
    "sql_int",
    "sql_status",
]


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
    failed_holds: bool = True,
) -> list[tuple[int, bytes | None]]:
    """``(id, message_key)`` of due rows in id order (at most ``limit``), read without locks.

    ``id_upper``: consider only rows with ``id <= id_upper``. ``reclaim``: include
    ``delivering`` rows whose lease is over (see :mod:`outboxkit.relay.claim`).
    ``failed_holds``: a ``failed`` row holds its key's later rows back.

    A ``pending`` row not yet due holds its key's later rows back too. The
    candidates are read first without that probe; only when a pending row
    ahead of its time sits below the last candidate's id (:func:`scheduled_below`,
    one range of ``(status, id)`` no longer than the pending arm's own scan) are
    they read again with it (see :func:`candidates_query`, ``scheduled``)."""
    bounded = id_upper is not None
    args = (
        table,
        tuple(sorted(shards)),
        limit,
        tuple(sorted(excluded_topics)),
        shard_count,
        bounded,
        conn.dialect.name,
        reclaim,
        failed_holds,
    )
    params = {"id_upper": id_upper} if bounded else {}
    found = [(r.id, r.message_key) for r in conn.execute(_cached_candidates_query(*args), params)]
    ahead = _cached_scheduled_below(table, args[1], shard_count, conn.dialect.name)
    if found and conn.execute(ahead, {"below": found[-1][0]}).first():
        query = _cached_candidates_query(*args, scheduled=True)
        found = [(r.id, r.message_key) for r in conn.execute(query, params)]
    return found


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
    failed_holds: bool,
    scheduled: bool = False,
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
        failed_holds=failed_holds,
        scheduled=scheduled,
    )


@functools.lru_cache(maxsize=32)
def _cached_scheduled_below(
    table: str, shards: tuple[int, ...], shard_count: int | None, dialect: str
) -> sa.Select[Any]:
    return scheduled_below(table, shards, shard_count=shard_count, dialect=dialect)


def scheduled_below(
    table: str,
    shards: Collection[int],
    *,
    shard_count: int | None = None,
    dialect: str | None = None,
) -> sa.Select[Any]:
    """A keyed ``pending`` row of the claim's shards that is not yet due
    (``next_attempt_at`` ahead: another writer's scheduled row, a database clock
    stepped back), with an id below the bound parameter ``below`` (the last
    candidate's): one exists only if it may hold a candidate's key back.

    One range of ``(status, id)`` up to ``below``: the rows the pending arm of
    the candidates has just read, no more, so a healthy drain pays a short
    index range per claim and not a per-key probe per candidate. A gate over
    all pending rows (as for the other statuses, :func:`_none_in_status`) would
    read the whole backlog whenever none is ahead, which is always: no index
    holds ``next_attempt_at``."""
    t = outbox_table(table)
    pending = (
        _status_range(t, Status.PENDING)
        if dialect == "postgresql"
        else (t.c.status == sql_status(Status.PENDING),)
    )
    where: list[sa.ColumnElement[bool]] = [
        *pending,
        t.c.id < sa.bindparam("below", type_=sa.BigInteger()),
        t.c.message_key.is_not(None),
        time_ahead(t.c.next_attempt_at, db_now()),
    ]
    owned = _owned(t, shards, shard_count, dialect)
    if owned is not None:
        where.append(owned)
    # In the arms' order, so only ``(status, id)`` serves it, never the primary
    # key through the delivered history (see _status_range).
    order = (t.c.status, t.c.id) if dialect == "postgresql" else (t.c.id,)
    return sa.select(sql_int(1)).where(*where).order_by(*order).limit(sql_int(1))


def lease_over(t: sa.Table, now: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
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
    failed_holds: bool = True,
    scheduled: bool = False,
) -> sa.Select[tuple[int, bytes | None]]:
    """The candidates of a claim. ``shard_count``: the table's shard count; without
    it, rows whose stored shard is out of range are never candidates. ``bounded``:
    only rows with ``id <=`` the bound parameter ``id_upper`` are considered.
    ``dialect``: the database's (``engine.dialect.name``), for :func:`in_list`.
    ``reclaim``: also ``delivering`` rows whose lease is over; without it, none,
    and any earlier ``delivering`` row holds its key back. ``failed_holds``: any
    earlier ``failed`` row holds its key back (``--failed-rows hold``; its probe
    runs only while some row is failed at all). ``scheduled``: an earlier
    ``pending`` row not yet due holds its key back (asked for by
    :func:`candidates` only when :func:`scheduled_below` found one that may).

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
    if scheduled:
        holds[Status.PENDING] = time_ahead(earlier.c.next_attempt_at, now)
    if failed_holds:
        # A failed row waits for an operator (requeue or discard); its key waits with it.
        holds[Status.FAILED] = sa.true()
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
            **holds,
            Status.PENDING: sa.or_(holds[Status.PENDING], paused)
            if Status.PENDING in holds
            else paused,
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
        elif dialect == "postgresql" and status in (Status.RETRYABLE, Status.FAILED):
            unheld = sa.or_(~_any_holding(earlier, status, hold), unheld)
        elif dialect in MYSQL_DIALECTS and status is not Status.PENDING:
            unheld = sa.or_(_none_in_status(t, status), unheld)
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
        arms.append(by_status(Status.DELIVERING, lease_over(t, now)))
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
    none_at_all = _no_row_where(anywhere, invalid_status(anywhere))
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


def _none_in_status(t: sa.Table, status: Status) -> sa.ColumnElement[bool]:
    """MySQL/MariaDB: no row of the table is in ``status``, asked once per claim
    (an uncorrelated ``NOT EXISTS``, one seek of ``(status, id)``, which the
    server evaluates once and keeps): while none is, as in a healthy drain with
    no retry waiting and nothing in flight, no candidate pays for its per-key
    probe in that status. Any row in it, held or not, and every candidate
    probes as before (a gate that read the rows to find one that holds its key
    could read every retryable row of an outage on each claim).

    On a binary-log MariaDB the two probes took 1.7 ms of the candidates' 3 ms
    per 500 (ANALYZE); with the gate, an unpipelined claim-and-finalize loop
    without Kafka spent about 0.3 database CPU seconds less per 100k rows and
    its claims 2-3 ms less. Beside a leased batch (the pipeline) the
    ``delivering`` probes still run: that batch is in ``delivering``. A
    ``NOT IN`` of the leased keys, as on PostgreSQL (:func:`_leased_keys`),
    was read by MariaDB through a temporary table built on every claim and
    showed no gain there."""
    anywhere = t.alias(f"{status.value}_anywhere")
    return _no_row_where(anywhere, anywhere.c.status == sql_status(status))


def _no_row_where(
    anywhere: sa.FromClause, condition: sa.ColumnElement[bool]
) -> sa.ColumnElement[bool]:
    """``NOT EXISTS`` a row of ``anywhere`` (an alias of its own, so the subquery
    correlates with nothing) meeting ``condition``: a gate the server asks once
    per claim (see :func:`_none_in_status`)."""
    return ~sa.select(sql_int(1)).select_from(anywhere).where(condition).exists()


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

    For ``retryable`` and ``failed`` only: finding no retryable row that holds
    reads the retryable rows, which the claim reads anyway; every failed row
    holds (``--failed-rows hold``), so the first one found answers. The
    ``pending`` hold (a paused topic's rows) is not gated: with none of them
    pending, the question would read the whole backlog."""
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


def id_in(column: sa.ColumnElement[int], dialect: str) -> sa.ColumnElement[bool]:
    """``column`` is one of the ids bound as ``ids`` (a list): ``= ANY(array)`` on
    PostgreSQL, one parameter and one statement text whatever the batch size (an
    expanding ``IN`` of 500 ids is 500 parameters for psycopg to parse on every
    call, and a new text per batch size); an expanding ``IN`` elsewhere."""
    if dialect == "postgresql":
        return column == sa.any_(sa.bindparam("ids", type_=ARRAY(sa.BigInteger())))
    return column.in_(sa.bindparam("ids", expanding=True))
