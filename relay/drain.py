"""The way out: give held rows back, and write the exit record.

Drain order (see ``Relay._stop``): the loop stops claiming, the batch in flight
gets ``flush_timeout`` for its delivery reports, known outcomes are finalized
and the rest **released** here; then the producer is closed (copies of
released rows purged), only then are shard leases released (the next owner
must find settled rows and no copy of them left in our producer), and the DB
pool goes last.
A released row is ``retryable``, due now, with its lease cleared and, on a
drain, the claim's attempt refunded: a redeploy must not use up retry budget.
After a crash inside a batch the attempt is kept, so a row that crashes the
relay every time still reaches ``failed``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from sqlalchemy.engine import Engine

from outboxkit.relay.claim import Batch, ClaimedRow
from outboxkit.relay.finalize import Decision, Fate, FinalizeResult, finalize
from outboxkit.runtime.logs import log_event

__all__ = ["ExitRecord", "log_exit_record", "release"]

log = logging.getLogger("outboxkit.relay")


def release(
    engine: Engine, table: str, batch: Batch, rows: Iterable[ClaimedRow], *, refund: bool
) -> FinalizeResult:
    """Give rows back under the batch's token: ``retryable``, due now, lease cleared,
    the claim's attempt refunded when ``refund``. Rows no longer ours are left alone.
    """
    decisions = [Decision(r, Fate.RELEASED, refund=refund) for r in rows]
    return finalize(engine, table, batch, decisions, backoff=None, delete_on_deliver=False)


@dataclasses.dataclass
class ExitRecord:
    """The one line an operator reads after a relay stopped.

    The row counts describe the batch in flight when the drain began:
    ``batch_size = delivered + failed + retryable + unknown + left_leased + lease_lost``.
    ``unknown`` rows were released (no outcome known); ``left_leased`` rows could
    not be released (database unreachable) and wait for their lease to expire;
    that number is also ``outbox_shutdown_pending``.
    """

    signal: str | None
    state: str
    batch_size: int = 0
    delivered: int = 0
    failed: int = 0
    retryable: int = 0
    unknown: int = 0
    left_leased: int = 0
    lease_lost: int = 0
    shutdown_deadline_ms: int = 0
    duration_ms: int = 0
    #: What the shutdown gave up on: workers still running when the budget ran out
    #: (their threads are abandoned), or on a forced exit the resources cut.
    abandoned: list[str] = dataclasses.field(default_factory=list)
    result: str = "clean"
    exit_code: int = 0
    metrics_pushed: bool | None = None

    def add(self, batch_size: int, result: FinalizeResult) -> None:
        self.batch_size += batch_size
        self.delivered += result.counts[Fate.DELIVERED]
        self.failed += result.counts[Fate.FAILED]
        self.retryable += result.counts[Fate.RETRYABLE] + result.counts[Fate.PAUSED]
        self.unknown += result.counts[Fate.RELEASED]
        self.lease_lost += len(result.lease_lost)


def log_exit_record(record: ExitRecord) -> None:
    """``relay-exit``: service and node_id are in every line's envelope."""
    level = logging.INFO if record.result == "clean" else logging.ERROR
    log_event(log, "relay-exit", level=level, **dataclasses.asdict(record))
