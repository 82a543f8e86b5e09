"""Retention: delete ``delivered`` rows older than a cutoff, gently.

Used by ``outboxkit admin purge`` and meant for the relay's periodic retention.

Guarantees:

* only rows with ``status = 'delivered'`` and ``delivered_at`` before the cutoff
  are deleted; the DELETE re-checks both, so a row that changed after it was
  selected is left alone. Pending, delivering, retryable and failed rows are
  never touched;
* the cutoff is computed once, from the database clock, when the run starts;
  rows that age past it during the run wait for the next run, so a run is finite;
* each batch is its own short transaction that deletes by primary key (record
  locks only, no gap locks in front of the service's inserts), followed by a
  pause, so the service's own writes keep flowing;
* each DELETE waits at most ``LOCK_WAIT_S`` for a row another transaction
  holds (an operator's open session, a report reading ``FOR UPDATE``), then the
  batch is rolled back and tried again, up to three times in all;
* ``stop()`` is checked before every batch, during every pause and before a
  batch is tried again: once it is true no further batch starts (the relay
  passes "draining", so retention never runs during shutdown). A batch already
  running commits or rolls back as a whole; nothing is left half done;
* a run that was not stopped then sweeps the payload rows whose outbox row is
  gone (deleted by a 0.2.x purge, which knew no payload table), with the same
  batch size and pause (the relay's runs scan ``ORPHAN_SCAN_PER_RUN`` payload
  rows each, resuming where the last stopped; ``admin purge`` scans them all):
  ``relay.orphans``, which never deletes a payload row whose outbox row exists
  or is being inserted.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import random
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec

import sqlalchemy as sa
import tenacity
from sqlalchemy.engine import Connection, Engine

from outboxkit.relay.orphans import sweep_orphans
from outboxkit.relay.settings import RelaySettings
from outboxkit.runtime.db import (
    deadlocked,
    gentle_connection,
    lock_wait_bound,
    lock_wait_timed_out,
)
from outboxkit.runtime.identity import read_identity
from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.runtime.logs import log_event
from outboxkit.runtime.metrics import ServiceMetrics
from outboxkit.runtime.supervisor import Supervisor
from outboxkit.schema.recovery import record_recovery
from outboxkit.schema.table import (
    MYSQL_DIALECTS,
    Status,
    db_now,
    delete_payloads,
    outbox_table,
    validate_identifier,
)

__all__ = [
    "ORPHAN_SCAN_PER_RUN",
    "PurgeResult",
    "count_purgeable",
    "purge",
    "purge_delivered",
    "run_retention",
    "start_retention",
]

_log = logging.getLogger("outboxkit.relay.retention")
P = ParamSpec("P")

_BATCH_RETRIES = 3
#: How long one DELETE waits for a row lock (a shorter bound of the session is
#: kept). Without it the wait is PostgreSQL's statement timeout (the relay's
#: lease, 60 s by default; none at all for ``admin purge``) or MySQL's
#: ``innodb_lock_wait_timeout`` (50 s): longer than the relay's shutdown budget.
LOCK_WAIT_S = 2
#: Payload rows one retention run of the relay scans for orphans at most; the
#: next run goes on from there (``run_retention``). ``admin purge`` scans all.
ORPHAN_SCAN_PER_RUN = 100_000
#: How often a pause looks at ``stop()``.
_STOP_POLL_S = 0.05


def _admin_node_id() -> str:
    return f"admin@{socket.gethostname()}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PurgeResult:
    """What one purge run did."""

    deleted: int
    batches: int
    cutoff: dt.datetime
    stopped: bool
    #: Payload rows deleted whose outbox row was gone (``relay.orphans``).
    orphans: int = 0
    #: Where the next sweep of orphans resumes (``SweepResult.resume_after``).
    orphans_resume_after: str = ""


def purge(
    engine: Engine,
    table: str,
    older_than_s: float,
    batch_size: int = 1000,
    pause_s: float = 0.2,
    stop: Callable[[], bool] = lambda: False,
    *,
    node_id: str | None = None,
    on_batch: Callable[[int], None] | None = None,
    record_empty: bool = False,
    orphan_limit: int | None = None,
    orphan_start_after: str = "",
) -> PurgeResult:
    """Run one purge; record a ``purge`` recovery event when rows were deleted.

    ``on_batch(n)`` is called after each committed batch with the rows it deleted.
    ``record_empty`` also records a run that deleted nothing (the CLI does, as an
    audit trail of the operator's action; the periodic retention does not, so it
    does not fill the recovery log with empty runs).

    The sweep of orphaned payload rows that follows scans at most
    ``orphan_limit`` payload rows (None: the whole table, as ``admin purge``
    does) from after ``orphan_start_after``; the result's
    ``orphans_resume_after`` is where the next run's sweep goes on.
    """
    validate_identifier(table)
    if older_than_s <= 0:
        raise ValueError("older_than_s must be > 0")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if pause_s < 0:
        raise ValueError("pause_s must be >= 0")
    t = outbox_table(table)
    started = time.monotonic()
    cutoff = _cutoff(engine, older_than_s)
    deleted = batches = 0
    last_id = 0
    stopped = False
    with (
        gentle_connection(engine) as conn,
        lock_wait_bound(conn, LOCK_WAIT_S, mysql_variable="innodb_lock_wait_timeout"),
    ):
        while True:
            if stop():
                stopped = True
                break
            rows = conn.execute(
                sa.select(t.c.id, t.c.event_id)
                .where(
                    t.c.status == Status.DELIVERED.value,
                    t.c.delivered_at < cutoff,
                    t.c.id > last_id,
                )
                .order_by(t.c.id)
                .limit(batch_size)
            ).all()
            conn.commit()  # end the read's snapshot; the DELETE is its own transaction
            if not rows:
                break
            ids = [r[0] for r in rows]
            last_id = ids[-1]
            n = _delete_batch(conn, t, ids, [r[1] for r in rows], cutoff, stop)
            if n is None:
                stopped = True
                break
            deleted += n
            batches += 1
            if on_batch is not None:
                on_batch(n)
            if len(ids) < batch_size:
                break
            if _pause(pause_s, stop):
                stopped = True
                break
    orphans = 0
    resume_after = orphan_start_after
    if not stopped:
        # Payload rows whose outbox row something else deleted (a 0.2.x purge).
        swept = sweep_orphans(
            engine,
            table,
            batch_size=batch_size,
            pause_s=pause_s,
            stop=stop,
            limit=orphan_limit,
            start_after=orphan_start_after,
        )
        orphans, stopped, resume_after = swept.deleted, swept.stopped, swept.resume_after
    result = PurgeResult(
        deleted=deleted,
        batches=batches,
        cutoff=cutoff,
        stopped=stopped,
        orphans=orphans,
        orphans_resume_after=resume_after,
    )
    if deleted or orphans or record_empty:
        with engine.begin() as conn:
            record_recovery(
                conn,
                kind="purge",
                node_id=node_id or _admin_node_id(),
                table=table,
                detail={
                    "deleted": deleted,
                    "batches": batches,
                    "older_than_s": older_than_s,
                    "cutoff": cutoff.isoformat() + "Z",
                    "stopped": stopped,
                    "payload_orphans": orphans,
                },
            )
    log_event(
        _log,
        "purge-finished",
        table=table,
        deleted=deleted,
        batches=batches,
        payload_orphans=orphans,
        stopped=stopped,
        duration_ms=round((time.monotonic() - started) * 1000),
    )
    return result


def _rows_deleted(run: Callable[P, PurgeResult]) -> Callable[P, int]:
    def purge_delivered(*args: P.args, **kwargs: P.kwargs) -> int:
        """Delete ``delivered`` rows whose ``delivered_at`` is older than ``older_than_s``.

        Takes what :func:`purge` takes and returns the number of rows deleted;
        :func:`purge` returns the full :class:`PurgeResult`.
        """
        return run(*args, **kwargs).deleted

    return purge_delivered


purge_delivered = _rows_deleted(purge)


def count_purgeable(engine: Engine, *, table: str, older_than_s: float) -> tuple[int, dt.datetime]:
    """How many rows a purge started now would delete, and its cutoff (for ``--dry-run``)."""
    t = outbox_table(validate_identifier(table))
    cutoff = _cutoff(engine, older_than_s)
    with engine.connect() as conn:
        n = conn.execute(
            sa.select(sa.func.count())
            .select_from(t)
            .where(t.c.status == Status.DELIVERED.value, t.c.delivered_at < cutoff)
        ).scalar_one()
    return int(n), cutoff


def run_retention(
    engine: Engine,
    *,
    table: str,
    retention_s: float,
    interval_s: float,
    stop: Callable[[], bool],
    batch_size: int = 1000,
    pause_s: float = 0.2,
    node_id: str | None = None,
    orphan_limit: int | None = ORPHAN_SCAN_PER_RUN,
) -> None:
    """The relay's periodic retention loop: purge every ``interval_s`` until ``stop()``.

    Meant to run in its own worker thread under the relay's supervisor, off the
    claim/publish path. The first run waits a random part of one interval, so
    relays started together do not purge together; a named lock (MySQL/MariaDB
    ``GET_LOCK``, PostgreSQL session advisory lock) lets only one relay per
    table purge at a time (the others skip that round). Returns as soon as
    ``stop()`` is true, including in the middle of a run; an exception
    (database gone) propagates to the supervisor.

    Each run's sweep of orphaned payload rows scans at most ``orphan_limit``
    payload rows, resuming after the last one the previous run of this loop
    scanned (kept in memory: a restarted relay starts from the start) and
    starting again from the start once a walk reached the end of the table.
    """
    wait = random.uniform(0.0, interval_s)
    position = ""
    while not _pause(wait, stop):
        with _retention_lock(engine, table) as acquired:
            if acquired:
                position = purge(
                    engine,
                    table=table,
                    older_than_s=retention_s,
                    batch_size=batch_size,
                    pause_s=pause_s,
                    stop=stop,
                    node_id=node_id,
                    orphan_limit=orphan_limit,
                    orphan_start_after=position,
                ).orphans_resume_after
        wait = interval_s


def _cutoff(engine: Engine, older_than_s: float) -> dt.datetime:
    with engine.connect() as conn:
        now: dt.datetime = conn.execute(sa.select(db_now())).scalar_one()
    if isinstance(now, str):  # SQLite returns the text it was given
        now = dt.datetime.fromisoformat(now)
    return now - dt.timedelta(seconds=older_than_s)


def _is_lock_conflict(exc: BaseException) -> bool:
    """A lock wait timeout or deadlock: the same batch may simply be tried again."""
    return lock_wait_timed_out(exc) or deadlocked(exc)


def _log_batch_retry(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    log_event(
        _log,
        "purge-batch-retry",
        level=logging.WARNING,
        error=type(exc).__name__,
        attempts_left=_BATCH_RETRIES - state.attempt_number,
    )


_BATCH_RETRY = tenacity.Retrying(
    retry=tenacity.retry_if_exception(_is_lock_conflict),
    stop=tenacity.stop_after_attempt(_BATCH_RETRIES),
    wait=tenacity.wait_exponential(multiplier=0.1, max=1.0),
    before_sleep=_log_batch_retry,
    reraise=True,
)


class _Stopping(tenacity.stop.stop_base):
    """Retry no more once ``stop()`` is true."""

    def __init__(self, stop: Callable[[], bool]) -> None:
        self._stop = stop

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._stop()


def _delete_batch(
    conn: Connection,
    t: sa.Table,
    ids: list[int],
    event_ids: list[str],
    cutoff: dt.datetime,
    stop: Callable[[], bool],
) -> int | None:
    """Delete one batch, and the payload rows of those deleted (``event_ids``: of
    ``ids``); None when ``stop()`` came true while it waited for a lock (rolled
    back, left for the next run), so a drain does not wait for retries."""
    stmt = t.delete().where(
        t.c.id.in_(ids),
        t.c.status == Status.DELIVERED.value,
        t.c.delivered_at < cutoff,
    )

    def attempt() -> int:
        try:
            n = conn.execute(stmt).rowcount
            delete_payloads(conn, t.name, event_ids)
            conn.commit()
        except sa.exc.OperationalError:
            conn.rollback()
            raise
        return int(n)

    retrying = _BATCH_RETRY.copy(stop=tenacity.stop_after_attempt(_BATCH_RETRIES) | _Stopping(stop))
    try:
        return retrying(attempt)
    except sa.exc.OperationalError as exc:
        if _is_lock_conflict(exc) and stop():
            log_event(_log, "purge-batch-left", reason="stopping", error=type(exc).__name__)
            return None
        raise


def _pause(seconds: float, stop: Callable[[], bool]) -> bool:
    """Sleep up to ``seconds``; True (at once) when ``stop()`` becomes true."""
    deadline = time.monotonic() + seconds
    while True:
        if stop():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(_STOP_POLL_S, left))


@contextmanager
def _retention_lock(engine: Engine, table: str) -> Iterator[bool]:
    """Try a named lock per outbox; yields whether this process got it.

    MySQL/MariaDB: ``GET_LOCK``; PostgreSQL: a session advisory lock on the
    name's hash. Either is held by this connection while the purge runs on
    others, and released by the server if the process dies. The name is the
    outbox's identity (database, schema, table: :mod:`outboxkit.runtime.identity`),
    not the table name alone: MySQL's named locks are server-wide and
    PostgreSQL's advisory locks span the schemas of a database, and two
    services each with an ``outbox_events`` skipped each other's rounds."""
    with engine.connect() as conn:
        dialect = conn.dialect.name
        if dialect not in MYSQL_DIALECTS and dialect != "postgresql":
            yield True
            return
        name = f"outboxkit_retention_{read_identity(conn, table).key}"
        if dialect in MYSQL_DIALECTS:
            if len(name) > 64:  # MySQL's limit on lock names
                name = f"outboxkit_retention_{zlib.crc32(name.encode()):08x}"
            take, give = "SELECT GET_LOCK(:n, 0)", "SELECT RELEASE_LOCK(:n)"
        else:
            take = "SELECT CAST(pg_try_advisory_lock(hashtext(:n)) AS INTEGER)"
            give = "SELECT pg_advisory_unlock(hashtext(:n))"
        got = conn.execute(sa.text(take), {"n": name}).scalar()
        conn.commit()
        try:
            yield got == 1
        finally:
            if got == 1:
                conn.execute(sa.text(give), {"n": name})
                conn.commit()


# -- the relay's retention worker ---------------------------------------------------

# The relay's own logger: the worker's crashes and restarts are the relay's lines.
_relay_log = logging.getLogger("outboxkit.relay")


def start_retention(
    engine: Engine,
    settings: RelaySettings,
    lifecycle: Lifecycle,
    metrics: ServiceMetrics,
) -> threading.Thread | None:
    """Purge old delivered rows in a worker of its own (its own supervisor, so its
    crashes never count as the relay loop's), stopping at once when draining.
    Returns the started thread (None with retention off): the drain waits for it."""
    s = settings
    if s.retention is None:
        return None
    retention_s = s.retention
    supervisor = Supervisor(lifecycle, logger=_relay_log, metrics=metrics)

    def loop() -> None:
        run_retention(
            engine,
            table=s.table,
            retention_s=retention_s,
            interval_s=s.retention_interval,
            stop=lifecycle.draining.is_set,
            batch_size=s.retention_batch_size,
            pause_s=s.retention_pause,
            node_id=s.node_id,
        )

    # A daemon thread: a statement stalled on a frozen database must not keep
    # the process alive after the drain gave up on it (see drain.join_retention).
    thread = threading.Thread(
        target=supervisor.run, args=("retention", loop), name="retention", daemon=True
    )
    thread.start()
    return thread
