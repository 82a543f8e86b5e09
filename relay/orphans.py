"""Payload rows whose outbox row is gone (orphans): found and deleted in small batches.

A payload row (``schema.table.payload_table``) is deleted with its outbox row, in
the transaction that deletes that row. Whatever deletes outbox rows without
knowing the payload table leaves their payload rows behind for ever: an
``admin purge`` of 0.2.x (or a purge job built on it), a 0.2.x relay with
retention, a hand-written ``DELETE``. :func:`sweep_orphans` finds and deletes
them; :func:`outboxkit.relay.retention.purge` (``outboxkit admin purge`` and the
relay's retention) runs it after its own batches.

Guarantees:

* bounded and gentle: a walk over the payload table in ``event_id`` order, to
  its end or ``limit`` rows (then the next run resumes where it stopped, and
  starts again from the start once a walk reached the end), ``batch_size``
  rows per step (a range of the primary key, then one lookup of
  those ids in the outbox table's unique index); each deleting batch is its own
  short transaction followed by ``pause_s``; ``stop()`` is checked before every
  step and in every pause (a draining relay starts no further step);
* a payload row whose outbox row exists, committed or inserted by a transaction
  still open, is never deleted, nor one a writer wrote (a writer whose open
  outbox row's event id has an orphan may see the orphan's old payload row
  deleted before its own INSERT writes it again). The writer inserts the outbox row first and its
  payload row after it, in the caller's transaction, and a payload row it
  inserts is invisible to the sweep until it commits, its outbox row with it.
  The one case left is a writer that reuses the event id of an orphan (its
  INSERT then rewrites the orphan):

  - MySQL/MariaDB: each batch first locks its candidates' payload rows
    (``FOR UPDATE SKIP LOCKED``: one an open writer rewrote is skipped, left
    for the next run), then reads their outbox rows and deletes the locked
    rows that still have none. A writer that rewrites one of them after the
    lock waits for the batch's commit and then inserts its payload row again;
    one that committed before the lock has its outbox row seen by the read.
    The read is not a locking one: it would wait for a writer's open outbox
    insert while that writer waits for the batch's payload locks;
  - PostgreSQL, where a locking read does not wait for another transaction's
    insert: each batch runs at REPEATABLE READ and locks its payload rows with
    ``SKIP LOCKED``, so a payload row an open writer rewrote is skipped, and
    one rewritten and committed after the batch's snapshot makes the batch
    fail (serialization failure) instead of being deleted.

  A batch that waited too long or failed so (PostgreSQL; on MySQL/MariaDB a
  deadlock or a lock wait over ``LOCK_WAIT_S``, which the skipped locks leave
  unlikely) is done again row by row: only the contended row is left, for the
  next run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outboxkit.runtime.db import (
    deadlocked,
    lock_wait_bound,
    lock_wait_timed_out,
    serialization_failed,
)
from outboxkit.runtime.logs import log_event
from outboxkit.schema.table import (
    MYSQL_DIALECTS,
    outbox_table,
    payload_table,
    validate_identifier,
)

__all__ = ["LOCK_WAIT_S", "SweepResult", "sweep_orphans"]

_log = logging.getLogger("outboxkit.relay.retention")

#: How long a batch's locking read waits for a writer's open transaction
#: (MySQL/MariaDB) before the batch is done again row by row.
LOCK_WAIT_S = 2
#: How often a pause looks at ``stop()``.
_STOP_POLL_S = 0.05


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SweepResult:
    """What one sweep did: payload rows ``deleted`` of the ``scanned`` ones."""

    deleted: int
    scanned: int
    #: Orphans left for the next run: a writer's open transaction held them.
    left: int
    stopped: bool
    #: Where the next run resumes: after this event id ("": from the start, the
    #: walk reached the end of the table).
    resume_after: str = ""


def sweep_orphans(
    engine: Engine,
    table: str,
    *,
    batch_size: int = 1000,
    pause_s: float = 0.2,
    stop: Callable[[], bool] = lambda: False,
    limit: int | None = None,
    start_after: str = "",
) -> SweepResult:
    """Delete the payload rows of ``table`` whose outbox row is gone (see the
    module docstring for what is never deleted); log ``payload-orphans-swept``
    when it deleted or left any.

    The walk starts after the event id ``start_after`` ("": at the start) and
    scans at most ``limit`` payload rows (None: to the end of the table); the
    result's ``resume_after`` is where the next run goes on ("" once the walk
    reached the end: the next run starts again from the start)."""
    validate_identifier(table)
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if limit is not None and limit < 1:
        raise ValueError("limit must be >= 1")
    t, p = outbox_table(table), payload_table(table)
    started = time.monotonic()
    deleted = scanned = left = 0
    after = start_after  # "": every event id sorts after it, ids are not empty
    stopped = False
    with _sweep_connection(engine) as conn:
        while True:
            if stop():
                stopped = True
                break
            want = batch_size if limit is None else min(batch_size, limit - scanned)
            if want < 1:
                # This run's share is scanned: the next run goes on after ``after``,
                # or from the start when nothing is left after it.
                more = conn.execute(
                    sa.select(p.c.event_id).where(p.c.event_id > after).limit(1)
                ).first()
                conn.commit()
                after = after if more is not None else ""
                break
            ids = list(
                conn.execute(
                    sa.select(p.c.event_id)
                    .where(p.c.event_id > after)
                    .order_by(p.c.event_id)
                    .limit(want)
                ).scalars()
            )
            live = set(conn.execute(sa.select(t.c.event_id).where(t.c.event_id.in_(ids))).scalars())
            conn.commit()
            if not ids:
                after = ""  # the end of the table: the next run starts from the start
                break
            after, scanned = ids[-1], scanned + len(ids)
            candidates = [i for i in ids if i not in live]
            if candidates:
                n, held = _delete(conn, t, p, candidates, stop)
                deleted, left = deleted + n, left + held
            if len(ids) < want:
                after = ""
                break
            if candidates and _pause(pause_s, stop):
                stopped = True
                break
    if deleted or left:
        log_event(
            _log,
            "payload-orphans-swept",
            table=table,
            deleted=deleted,
            left=left,
            scanned=scanned,
            stopped=stopped,
            duration_ms=round((time.monotonic() - started) * 1000),
        )
    return SweepResult(
        deleted=deleted, scanned=scanned, left=left, stopped=stopped, resume_after=after
    )


@contextmanager
def _sweep_connection(engine: Engine) -> Iterator[Connection]:
    """A connection at the isolation level the sweep's safety rests on (module
    docstring): REPEATABLE READ on PostgreSQL; READ COMMITTED on MySQL/MariaDB,
    where the locking read decides and no gap lock should stop inserts."""
    with engine.connect() as conn:
        dialect = conn.dialect.name
        if dialect == "postgresql":
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        elif dialect in MYSQL_DIALECTS:
            conn = conn.execution_options(isolation_level="READ COMMITTED")
        with lock_wait_bound(conn, LOCK_WAIT_S, mysql_variable="innodb_lock_wait_timeout"):
            yield conn


def _delete(
    conn: Connection,
    t: sa.Table,
    p: sa.Table,
    candidates: Sequence[str],
    stop: Callable[[], bool],
) -> tuple[int, int]:
    """Delete the orphans among ``candidates``: (deleted, left). A batch that met
    a writer's transaction is done again row by row, until ``stop()``; a single
    row that meets one is left."""
    try:
        return _delete_batch(conn, t, p, candidates)
    except sa.exc.DBAPIError as exc:
        conn.rollback()
        if not (lock_wait_timed_out(exc) or deadlocked(exc) or serialization_failed(exc)):
            raise
    if len(candidates) == 1:
        return 0, 1
    deleted = left = 0
    for n, candidate in enumerate(candidates):
        if stop():
            return deleted, left + len(candidates) - n
        done, held = _delete(conn, t, p, [candidate], stop)
        deleted, left = deleted + done, left + held
    return deleted, left


def _delete_batch(
    conn: Connection, t: sa.Table, p: sa.Table, candidates: Sequence[str]
) -> tuple[int, int]:
    """(deleted, left): on MySQL/MariaDB ``left`` counts the candidates a
    writer's open transaction held (skipped)."""
    ids = list(candidates)
    skipped = 0
    if conn.dialect.name == "postgresql":
        # At REPEATABLE READ: a row an open writer holds is skipped, one changed
        # and committed since the snapshot fails the batch (serialization failure).
        free = (
            sa.select(p.c.event_id)
            .where(p.c.event_id.in_(ids), ~sa.exists().where(t.c.event_id == p.c.event_id))
            .with_for_update(skip_locked=True)
        )
        n = conn.execute(p.delete().where(p.c.event_id.in_(free))).rowcount
    else:
        # Lock the payload rows first, skipping those an open writer rewrote: a
        # writer that rewrites one after this waits for the batch's commit and
        # inserts its payload row again. Then read their outbox rows (a plain
        # read at READ COMMITTED: a locking one would wait for a writer's open
        # insert while that writer waits for these locks) and delete the
        # locked rows still without one. Deciding before locking lost the
        # payload a writer committed in between (the delete then removed it).
        locked = list(
            conn.execute(
                sa.select(p.c.event_id)
                .where(p.c.event_id.in_(ids))
                .with_for_update(skip_locked=True)
            ).scalars()
        )
        present = set(
            conn.execute(sa.select(t.c.event_id).where(t.c.event_id.in_(locked))).scalars()
            if locked
            else ()
        )
        gone = [i for i in locked if i not in present]
        skipped = len(ids) - len(locked)
        n = conn.execute(p.delete().where(p.c.event_id.in_(gone))).rowcount if gone else 0
    conn.commit()
    return int(n), skipped


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
