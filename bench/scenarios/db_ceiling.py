"""Scenario 1, the DB ceiling: the relay's own claim and finalize, no Kafka.

The loop calls ``outboxkit.relay.claim.claim_batch`` and
``outboxkit.relay.finalize.finalize`` (every row "acknowledged" at a made-up
offset) on a copy of the benchmark backlog until nothing is due, one batch
after the other on one connection pool, as one relay does.  It imports the
relay's functions rather than copying their SQL, so the ceiling moves with the
relay's queries: rows/s here is the most a relay can reach on this database,
Python overhead of those two functions included.  It passes what the relay
passes: every shard owned and the table's shard count (so the candidates carry
no shard condition, as the relay's do).

The **floor** row is no relay code at all: the least any relay that keeps
per-row states must ask of this table. Per batch of ``batch_size`` rows taken
by primary-key range, three statements, each its own transaction: one
``UPDATE`` to ``delivering`` (the attempt counted, a lease: owner, token,
expiry), one ``SELECT`` of the rows' topic, key, payload and headers, one
``UPDATE`` to ``delivered`` (lease cleared, delivery time), every value the
same for the whole batch (no per-row partition and offset). Its rows/s (``rate_floor``) is
set by the table's shape and the database's configuration (with the binary
log on, each status change logs the whole row twice); every relay figure has
its "x floor" beside it. The floor is measured on four shapes of the table
(``FLOOR_SHAPES``), each on its own copy: today's (payloads aside, in the
payload table), and beside it delivered rows deleted, lease columns presized
and 0.2.0's table with the payload in the row (``rate_floor_delete``,
``rate_floor_presized``, ``rate_floor_inline``),
with the server's CPU and log bytes per event beside each; with the binary log
on, also today's table with the floor's sessions logging ``NOBLOB`` row images
(``rate_floor_noblob``), as ``--binlog-row-image noblob`` has the relay's.

A third row runs the same claims and finalizes as the pipelined relay does
(``--pipeline``): batch N+1 claimed while N is finalized on a second thread and
connection, the claim bounded by ``id_upper`` as the relay bounds it, and
looking for expired leases once per ``poll_interval`` as the relay does beside a
leased batch. Its rows/s is what overlapping the two gains on this database
before any Kafka work: the bound of the pipelined relay here.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa

from bench import data
from bench.context import BenchContext
from bench.dblog import LogMeter
from bench.procs import ServiceCpu, wait_database_quiet
from bench.report import ScenarioResult
from bench.scenarios import Results, Unavailable
from bench.scenarios.common import batch_size, relay_default, template
from outboxkit.schema.table import payload_table_name


def relay_modules() -> tuple[Any, Any]:
    try:
        claim = importlib.import_module("outboxkit.relay.claim")
        finalize = importlib.import_module("outboxkit.relay.finalize")
    except ImportError as exc:
        raise Unavailable(f"the relay's claim/finalize are not importable: {exc}") from None
    return claim, finalize


def relay_engine(ctx: BenchContext) -> sa.Engine:
    """An engine configured as the relay configures its own (isolation, pool, timeouts)."""
    try:
        engine_module = importlib.import_module("outboxkit.relay.engine")
        settings = importlib.import_module("outboxkit.relay.settings")
        create: Any = engine_module.create_engine
    except (ImportError, AttributeError):
        return sa.create_engine(
            ctx.db_url, pool_pre_ping=True, pool_size=2, isolation_level="READ COMMITTED"
        )
    engine: sa.Engine = create(settings.RelaySettings(db_url=ctx.db_url, kafka_bootstrap="-"))
    return engine


def drain_without_kafka(
    ctx: BenchContext,
    table: str,
    *,
    batch: int,
    delete_on_deliver: bool = False,
    overlap: bool = False,
) -> dict[str, float]:
    claim, finalize = relay_modules()
    engine = relay_engine(ctx)
    try:
        return _drain(ctx, engine, claim, finalize, table, batch, delete_on_deliver, overlap)
    finally:
        engine.dispose()


def _drain(
    ctx: BenchContext,
    engine: sa.Engine,
    claim: Any,
    finalize: Any,
    table: str,
    batch: int,
    delete_on_deliver: bool,
    overlap: bool,
) -> dict[str, float]:
    shard_count = ctx.config.shards
    shards = range(shard_count)
    rows = 0
    batches = 0
    claim_s = finalize_s = 0.0
    poll_interval = relay_default("poll_interval", 1.0)
    looked = -poll_interval  # when a claim last looked for expired leases

    def claim_next(id_upper: int | None) -> Any:
        nonlocal looked
        now = time.monotonic()
        reclaim = claim.reclaims_due(
            in_flight=id_upper is not None, looked=looked, now=now, poll_interval=poll_interval
        )
        if reclaim:
            looked = now
        return claim.claim_batch(
            engine,
            table,
            owner="bench-db-ceiling",
            shards=shards,
            limit=batch,
            lease_ttl=60.0,
            shard_count=shard_count,
            id_upper=id_upper,
            reclaim=reclaim,
        )

    def write(claimed: Any) -> float:
        """Finalize ``claimed``; the seconds it took."""
        t0 = time.perf_counter()
        decisions = [
            finalize.Decision(row, finalize.Fate.DELIVERED, partition=0, offset=row.id)
            for row in claimed.rows
        ]
        finalize.finalize(
            engine,
            table,
            claimed,
            decisions,
            backoff=None,
            delete_on_deliver=delete_on_deliver,
        )
        return time.perf_counter() - t0

    pool = ThreadPoolExecutor(1, thread_name_prefix="bench-finalize") if overlap else None
    held: Any = None  # overlapped: the batch finalized beside the next claim
    start = time.perf_counter()
    try:
        while True:
            pending: Future[float] | None = None
            id_upper = None
            if held is not None:
                assert pool is not None
                pending = pool.submit(write, held)
                # As the relay bounds a claim beside its leased batch (all shards ours).
                id_upper = held.rows[-1].id + batch
            t0 = time.perf_counter()
            claimed = claim_next(id_upper)
            claim_s += time.perf_counter() - t0
            if pending is not None:
                finalize_s += pending.result()
                if claimed is None:  # nothing within the bound: settled, claim unbounded
                    held = None
                    continue
            if claimed is None:
                break
            rows += len(claimed)
            batches += 1
            if overlap:
                held = claimed
            else:
                finalize_s += write(claimed)
    finally:
        if pool is not None:
            pool.shutdown()
    return {
        **_rates(rows, batches, time.perf_counter() - start),
        "claim ms/batch": 1000 * claim_s / max(1, batches),
        "finalize ms/batch": 1000 * finalize_s / max(1, batches),
    }


#: The table shapes the floor is measured on (``FLOOR_SHAPES``): today's table,
#: and others beside it, each on a copy of the same backlog.
#: Today's table: the payloads in the payload table, as ``enqueue`` writes them.
TODAY = "today"
#: Delivered rows deleted, their payload rows with them (the relay's delete-on-deliver).
DELETE = "delete"
#: The lease columns written by the writer at the size a claim gives them
#: (owner, a 32-character token, an expiry in the past), and put back to that
#: size instead of NULL when the lease ends: InnoDB then updates the claimed
#: row in place, where a column growing from NULL makes it rebuild the record.
PRESIZED = "presized"
#: 0.2.0's table: the payload and headers in the row itself, so every status
#: change rewrites (and, with full row images, logs) them too.
INLINE = "inline"
#: Today's table, the relay's sessions logging row images without the payload
#: and headers a status change leaves as they were (``binlog_row_image=NOBLOB``,
#: MariaDB/MySQL with the binary log on; the server's default stays FULL).
NOBLOB = "noblob"
FLOOR_SHAPES: dict[str, str] = {
    TODAY: "today's table (payload aside)",
    DELETE: "delivered rows deleted",
    PRESIZED: "lease columns written at their claimed size",
    INLINE: "0.2.0's table (payload in the row)",
    NOBLOB: "today's table, relay sessions log NOBLOB row images",
}
_FLOOR_OWNER = "bench-floor"
_NO_TOKEN = "-" * 32
_PAST = datetime.datetime(1970, 1, 2)


def floor(engine: sa.Engine, table: str, *, batch: int, shape: str = TODAY) -> dict[str, float]:
    """The floor loop (see the module): three set-based statements per batch, on
    ``table`` copied as ``shape`` (one of ``FLOOR_SHAPES``: see ``_on_a_copy``)."""
    with engine.connect() as conn:
        lo, hi = conn.execute(sa.text(f"SELECT MIN(id), MAX(id) FROM {table}")).one()
    if shape == PRESIZED:
        ended = "lease_token = :no_token, lease_expires_at = :past"  # owner stays, as delivered
    else:
        ended = "lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL"
    in_range = "id >= :lo AND id < :hi"
    claim = sa.text(
        f"UPDATE {table} SET status = 'delivering', attempts = attempts + 1,"
        " lease_owner = :owner, lease_token = :token, lease_expires_at = :expires,"
        f" updated_at = :now WHERE {in_range} AND status = 'pending'"
    )
    aside = payload_table_name(table)
    if shape == INLINE:
        read = sa.text(
            f"SELECT id, event_id, topic, message_key, payload, headers FROM {table}"
            f" WHERE {in_range} AND status = 'delivering'"
        )
    else:  # as the relay reads them: from the row, else from its payload row
        read = sa.text(
            "SELECT o.id, o.event_id, o.topic, o.message_key, COALESCE(o.payload, p.payload),"
            " CASE WHEN o.payload IS NULL THEN p.headers ELSE o.headers END"
            f" FROM {table} o LEFT JOIN {aside} p ON p.event_id = o.event_id"
            " WHERE o.id >= :lo AND o.id < :hi AND o.status = 'delivering'"
        )
    done: list[sa.TextClause] = []
    if shape == DELETE:  # the rows, then their payload rows by the event ids read
        done.append(sa.text(f"DELETE FROM {table} WHERE {in_range} AND status = 'delivering'"))
        done.append(
            sa.text(f"DELETE FROM {aside} WHERE event_id IN :event_ids").bindparams(
                sa.bindparam("event_ids", expanding=True)
            )
        )
    else:
        done.append(
            sa.text(
                f"UPDATE {table} SET status = 'delivered', {ended}, delivered_at = :now,"
                f" updated_at = :now WHERE {in_range} AND status = 'delivering'"
            )
        )
    rows = batches = 0
    start = time.perf_counter()
    for first in range(int(lo or 0), int(hi or -1) + 1, batch):
        bounds = {"lo": first, "hi": first + batch}
        now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
        lease = {
            "owner": _FLOOR_OWNER,
            "token": secrets.token_hex(16),
            "expires": now + datetime.timedelta(seconds=60),
            "now": now,
        }
        with engine.begin() as conn:
            conn.execute(claim, {**bounds, **lease})
        with engine.begin() as conn:
            got = conn.execute(read, bounds).all()
        values = {**bounds, "now": now, "no_token": _NO_TOKEN, "past": _PAST}
        if shape == DELETE:
            values["event_ids"] = [r[1] for r in got] or [""]
        with engine.begin() as conn:
            for statement in done:
                conn.execute(statement, values)
        rows += len(got)
        batches += 1
    return _rates(rows, batches, time.perf_counter() - start)


def _noblob_session(dbapi_conn: Any, _record: Any) -> None:
    """The ``noblob`` floor's sessions (only made with the binary log on: MySQL/MariaDB)."""
    with dbapi_conn.cursor() as cursor:
        cursor.execute("SET SESSION binlog_row_image = 'NOBLOB'")


def _binlog_on(engine: sa.Engine) -> bool:
    if engine.dialect.name == "postgresql":
        return False
    with engine.connect() as conn:
        return bool(int(conn.execute(sa.text("SELECT @@log_bin")).scalar_one()))


#: How the ``presized`` shape's rows are copied: as a writer would insert them,
#: with the lease columns at the size a claim gives them (an UPDATE of the copy
#: instead left the server purging 200,000 old row versions during the drain).
PRESIZED_VALUES = {
    "lease_owner": f"'{_FLOOR_OWNER}'",
    "lease_token": f"'{_NO_TOKEN}'",
    "lease_expires_at": f"'{_PAST.isoformat(sep=' ')}'",
}


def _on_a_copy(
    ctx: BenchContext,
    src: str,
    table: str,
    drain: Callable[[str], dict[str, float]],
    *,
    expected_left: dict[str, int],
    values: dict[str, str] | None = None,
    inline: bool = False,
) -> dict[str, float]:
    """Copy the backlog into ``table`` (``values``, ``inline``: see
    ``data.copy_backlog``), ``drain`` it, check what is left, drop it; the
    drain's figures and what the drain alone cost the database server per row."""
    rows = ctx.config.rows
    data.copy_backlog(
        ctx.engine,
        src,
        table,
        topic="unused",
        rows=rows,
        shards=ctx.config.shards,
        values=values,
        inline=inline,
    )
    # Nothing left over from before runs beside the drain.
    wait_database_quiet(ctx.engine, timeout=ctx.config.quiet_timeout)
    server = DatabaseCost(ctx.engine).begin()
    out = {**drain(table), **server.per_row(rows)}
    left = data.count_by_status(ctx.engine, table)
    data.drop_table(ctx.engine, table)
    if out["rows"] != rows or left != expected_left:
        raise RuntimeError(f"{table}: drained {out['rows']} of {rows} rows; table now {left}")
    return out


class DatabaseCost:
    """The database server's CPU seconds and replication-log bytes over one drain
    (the server must be this machine's and the run's alone, as it is here)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.cpu = ServiceCpu.database(engine)
        self.log = LogMeter(engine)

    def begin(self) -> DatabaseCost:
        self.cpu.begin()
        self.log.begin()
        return self

    def per_row(self, rows: int) -> dict[str, float]:
        """Per row drained; a figure this server cannot give (no log, not on this
        machine) is left out."""
        used = sum(self.cpu.used().values()) if self.cpu.pids else 0.0
        logged = self.log.bytes()
        out = {}
        if used > 0 and rows:
            out["db cpu s/100k events"] = used / rows * 100_000
        if logged is not None and rows:
            out["db log bytes/event"] = logged / rows
        return out


def _rates(rows: int, batches: int, seconds: float) -> dict[str, float]:
    return {
        "rows": rows,
        "batches": batches,
        "seconds": seconds,
        "rows/s": rows / seconds if seconds else 0.0,
    }


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    relay_modules()
    cfg = ctx.config
    res = ScenarioResult("db-ceiling", "the relay's claim + finalize SQL, no Kafka")
    batch = batch_size(cfg)
    res.settings = {"rows": cfg.rows, "batch_size": batch, "shards": cfg.shards}
    src = template(ctx, cfg.rows)
    # (finalize, overlapped): the serial loop both ways, then claim beside finalize.
    for delete, overlap in ((False, False), (True, False), (False, True)):
        table = "bench_ceiling_delete" if delete else "bench_ceiling"
        out = _on_a_copy(
            ctx,
            src,
            table,
            functools.partial(
                drain_without_kafka, ctx, batch=batch, delete_on_deliver=delete, overlap=overlap
            ),
            expected_left={} if delete else {"delivered": cfg.rows},
        )
        label = "delete" if delete else "mark delivered"
        res.rows.append({"finalize": f"{label}, claim beside it" if overlap else label, **out})
        key = "rate_overlapped" if overlap else "rate_delete" if delete else "rate"
        res.figures[key] = out["rows/s"]
    engine = relay_engine(ctx)
    noblob = relay_engine(ctx)
    sa.event.listen(noblob, "connect", _noblob_session)
    floors: dict[str, dict[str, float]] = {}
    try:
        for shape, label in FLOOR_SHAPES.items():
            if shape == NOBLOB and not _binlog_on(engine):
                continue
            out = floors[shape] = _on_a_copy(
                ctx,
                src,
                "bench_floor",
                functools.partial(
                    floor, noblob if shape == NOBLOB else engine, batch=batch, shape=shape
                ),
                expected_left={} if shape == DELETE else {"delivered": cfg.rows},
                values=PRESIZED_VALUES if shape == PRESIZED else None,
                inline=shape == INLINE,
            )
            res.rows.append({"finalize": f"floor, {label}: 3 set-based statements", **out})
            suffix = "" if shape == TODAY else f"_{shape}"
            res.figures[f"rate_floor{suffix}"] = out["rows/s"]
            for column, figure in (
                ("db cpu s/100k events", "floor_db_cpu_per_100k"),
                ("db log bytes/event", "floor_log_bytes_per_event"),
            ):
                if column in out:
                    res.figures[figure + suffix] = out[column]
    finally:
        engine.dispose()
        noblob.dispose()
    res.notes.append(
        f"claim beside the finalize vs one after the other: "
        f"{res.figures['rate_overlapped'] / res.figures['rate']:.2f}x"
    )
    res.notes.append(
        "the relay's claim + finalize vs the floor: "
        f"{res.figures['rate'] / floors[TODAY]['rows/s']:.2f}x"
    )
    for shape in (DELETE, PRESIZED, INLINE, NOBLOB):
        if shape not in floors:
            continue
        res.notes.append(
            f"floor, {FLOOR_SHAPES[shape]} vs {FLOOR_SHAPES[TODAY]}: "
            f"{floors[shape]['rows/s'] / floors[TODAY]['rows/s']:.2f}x"
        )
    return res
