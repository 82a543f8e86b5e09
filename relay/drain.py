"""Draining: the way out of a relay, in order, within its deadlines.

Everything the relay does once the drain begins is here: :func:`on_drain`
(the first signal or :meth:`Relay.drain`), :func:`batch_deadline` (how long the
batch in flight may still wait for Kafka), :func:`stop` (the shutdown order),
:func:`on_hurry`, the watchdog's :func:`cut` and :func:`on_forced`, and the
exit record. Each of them is given the relay's :class:`Resources` (what it
opened, the batches it holds, the exit record so far) and reads nothing else of
the relay, so the way out can be read, and changed, on its own.

Drain order (see :func:`stop`): the loop stops claiming, the batch in flight
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
import threading
import time
from collections.abc import Callable, Iterable
from typing import ClassVar, Protocol

import sqlalchemy as sa
import tenacity
from sqlalchemy.engine import Engine

from outboxkit.relay.finalize import Decision, Fate, FinalizeResult, finalize
from outboxkit.relay.metrics import RelayMetrics, counter_value
from outboxkit.relay.pg_wakeup import PgNotifyWaker
from outboxkit.relay.publish import Publisher
from outboxkit.relay.rows import Batch, ClaimedRow
from outboxkit.relay.settings import RelaySettings
from outboxkit.relay.shards import ShardOwnership
from outboxkit.relay.wakeup import RedisWaker, Waker
from outboxkit.runtime.errors import is_infrastructure_error
from outboxkit.runtime.exitcodes import EXIT_DEPENDENCY, EXIT_FAILURE, EXIT_FORCED, EXIT_OK
from outboxkit.runtime.exitrecord import CLEAN, CRASH_LOOP
from outboxkit.runtime.exitrecord import ExitRecord as ServiceExitRecord
from outboxkit.runtime.health import HealthServer
from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.runtime.logs import log_event, redact
from outboxkit.runtime.metrics import ServiceMetrics, push_exit_metrics
from outboxkit.runtime.supervisor import Supervisor

__all__ = [
    "ExitRecord",
    "LeasedBatches",
    "Resources",
    "batch_deadline",
    "close_resources",
    "cut",
    "failed_start",
    "finish_record",
    "log_exit_record",
    "on_drain",
    "on_forced",
    "on_hurry",
    "produce_deadline",
    "release",
    "stop",
]

log = logging.getLogger("outboxkit.relay")

_CLOSE_BUDGET = 5.0
#: Seconds of the shutdown budget kept for disposing the pool, the exit record and
#: the metrics push after waiting for workers.
_RECORD_RESERVE = 0.5


def release(
    engine: Engine, table: str, batch: Batch, rows: Iterable[ClaimedRow], *, refund: bool
) -> FinalizeResult:
    """Give rows back under the batch's token: ``retryable``, due now, lease cleared,
    the claim's attempt refunded when ``refund``. Rows no longer ours are left alone.
    """
    decisions = [Decision(r, Fate.RELEASED, refund=refund) for r in rows]
    return finalize(engine, table, batch, decisions, backoff=None, delete_on_deliver=False)


@dataclasses.dataclass
class ExitRecord(ServiceExitRecord):
    """The one line an operator reads after a relay stopped (``relay-exit``).

    The row counts ``batch_size`` to ``lease_lost`` describe the batches in
    flight when the drain began (two with ``pipeline`` on), as ``counts_of``
    says in the line itself:
    ``batch_size = delivered + failed + retryable + unknown + left_leased + lease_lost``.
    ``unknown`` rows were released (no outcome known); ``left_leased`` rows could
    not be released (database unreachable) and wait for their lease to expire;
    that number is also ``outbox_shutdown_pending``. The ``run_*`` counts are
    the whole run's, drain batches included: the ``outbox_rows_*_total``
    counters' values at exit (``run_retried``: set back to ``retryable``).
    """

    signal: str | None
    state: str
    #: What ``batch_size`` ... ``lease_lost`` count: the batches in flight when
    #: the drain began, not the run (that is ``run_*``).
    counts_of: str = "drain-batches"
    batch_size: int = 0
    delivered: int = 0
    failed: int = 0
    retryable: int = 0
    unknown: int = 0
    left_leased: int = 0
    lease_lost: int = 0
    run_claimed: int = 0
    run_delivered: int = 0
    run_failed: int = 0
    run_retried: int = 0
    shutdown_deadline_ms: int = 0
    duration_ms: int = 0
    #: What the shutdown gave up on: workers still running when the budget ran out
    #: (their threads are abandoned), or on a forced exit the resources cut.
    abandoned: list[str] = dataclasses.field(default_factory=list)
    result: str = CLEAN
    exit_code: int = 0
    metrics_pushed: bool | None = None
    #: Workers crash-looping when the drain began (``result`` ``crash-loop``).
    crash_loop: list[dict[str, object]] = dataclasses.field(default_factory=list)

    event: ClassVar[str] = "relay-exit"
    clean_results: ClassVar[frozenset[str] | None] = frozenset({CLEAN})

    def add(self, batch_size: int, result: FinalizeResult) -> None:
        self.batch_size += batch_size
        self.delivered += result.counts[Fate.DELIVERED]
        self.failed += result.counts[Fate.FAILED]
        self.retryable += result.counts[Fate.RETRYABLE] + result.counts[Fate.PAUSED]
        self.unknown += result.counts[Fate.RELEASED]
        self.lease_lost += len(result.lease_lost)

    def add_run_totals(self, metrics: RelayMetrics) -> None:
        """The run's totals, read from the relay's counters as it exits."""
        self.run_claimed = round(counter_value(metrics.claimed))
        self.run_delivered = round(counter_value(metrics.delivered))
        self.run_failed = round(counter_value(metrics.failed))
        self.run_retried = round(counter_value(metrics.retryable))


def log_exit_record(record: ExitRecord) -> None:
    """``relay-exit``: the one place the relay writes its exit record."""
    record.write(log)


class LeasedBatches(Protocol):
    """What the drain asks of the batches leased to the relay (the relay's
    pipeline, :class:`~outboxkit.relay.pipeline.Pipeline`)."""

    def held_rows(self) -> int:
        """Rows leased to the relay and not yet finalized or released."""
        ...

    def unfinished_rows(self) -> int:
        """Rows whose delivery reports are still missing (the whole batch if unsent)."""
        ...

    def settle_leftover(self) -> None:
        """Settle what the loop could not (raises while the database is gone)."""
        ...

    def close_finalizer(self) -> None:
        """Wait for an outcome write still running, then stop its thread."""
        ...


@dataclasses.dataclass(eq=False, kw_only=True)
class Resources:
    """What a relay opened and what its way out reads: the drain reads nothing else.

    The relay builds it with its runtime and fills it in as it starts (engine,
    producer, shard ownership, waker, retention, the batches it holds), so a
    drain that begins at any point of the start closes exactly what was opened;
    ``opened`` names those resources in the order they were opened.
    """

    settings: RelaySettings
    lifecycle: Lifecycle
    supervisor: Supervisor
    health: HealthServer
    metrics: RelayMetrics
    service_metrics: ServiceMetrics
    waker: Waker
    #: The outbox's identity key once read at start, else the table name: the
    #: grouping of the exit metrics.
    outbox: str
    #: The pool is the relay's own (built from ``db_url``): disposed at exit.
    own_engine: bool
    engine: Engine | None = None
    publisher: Publisher | None = None
    ownership: ShardOwnership | None = None
    retention: threading.Thread | None = None
    held: LeasedBatches | None = None
    opened: list[str] = dataclasses.field(default_factory=list)
    #: Workers given up on when the shutdown budget ran out.
    abandoned: list[str] = dataclasses.field(default_factory=list)
    exit: ExitRecord = dataclasses.field(
        default_factory=lambda: ExitRecord(signal=None, state="starting")
    )
    #: Worker crashes before the drain began: more at the end are the drain's.
    crashes_before_drain: int = 0

    def held_rows(self) -> int:
        """Rows leased to the relay and not yet finalized or released."""
        return self.held.held_rows() if self.held is not None else 0


# -- the drain, in order --------------------------------------------------------


def on_drain(res: Resources) -> None:
    """The drain began: note the crash count (crashes after this are the drain's)
    and end the idle wait at once."""
    res.crashes_before_drain = res.supervisor.crashes
    wake = getattr(res.waker, "wake", None)
    if callable(wake):
        wake()


def batch_deadline(lifecycle: Lifecycle, settings: RelaySettings, batch: Batch) -> float:
    """When to stop waiting for this batch's reports (monotonic); moves on drain/hurry."""
    if lifecycle.hurry.is_set():
        return 0.0
    limit = batch.claimed_mono + settings.effective_batch_deadline()
    started = lifecycle.drain_started_at
    if started is not None:
        limit = min(limit, started + settings.flush_timeout)
    return limit


def produce_deadline(lifecycle: Lifecycle, settings: RelaySettings, batch: Batch) -> float:
    """Until when a row of this batch that finds the producer's queue full may wait
    for room (monotonic): the batch deadline less ``message.timeout.ms``, so that
    every message handed over by then is reported (acknowledged or timed out) by
    the batch deadline. It moves with the batch deadline: once draining it is
    usually past (``--flush-timeout`` below the message timeout), on a hurry at once.
    """
    return batch_deadline(lifecycle, settings, batch) - settings.message_timeout_ms() / 1000


def stop(res: Resources) -> int:
    """The drain, in order. Each step says why it comes where it does."""
    # 1. Rows first: the loop finalized or released its batch unless it crashed;
    #    try again while the budget lasts, so nothing waits for lease expiry
    #    without need.
    release_leftover(res)
    if res.held is not None:
        res.held.close_finalizer()
    left = res.held_rows()
    # 2-4. Kafka (flush what is acknowledged-to-be, purge released rows' copies),
    #    then Redis (shard leases: the next owner must find our rows settled and
    #    no copy of them left in our producer), then the DB pool.
    close_resources(res)
    res.lifecycle.set_stopped()
    record = res.exit
    record.left_leased = left
    record.batch_size += left
    record.abandoned = list(res.abandoned)
    record.crash_loop = [c.describe() for c in res.supervisor.crash_loops_at_drain]
    if left:
        record.result, record.exit_code = "left-leased", EXIT_DEPENDENCY
    elif res.abandoned:  # the budget ran out for a worker: not a clean exit
        record.result, record.exit_code = "forced", EXIT_FORCED
    elif res.supervisor.crashes > res.crashes_before_drain:
        record.result, record.exit_code = "error", EXIT_FAILURE
    elif res.supervisor.crash_loops_at_drain:
        record.result, record.exit_code = CRASH_LOOP, EXIT_FAILURE
    elif res.lifecycle.exit_code() != EXIT_OK:
        record.result, record.exit_code = "fatal", res.lifecycle.exit_code()
    finish_record(res, record)
    res.health.stop()
    return record.exit_code


def release_leftover(res: Resources) -> None:
    """Release a batch the loop could not settle, retrying while the database is
    unreachable for as long as the shutdown budget leaves time to close the rest
    (a database blip during a redeploy must not leave rows leased)."""
    held, rows = res.held, res.held_rows()
    if held is None or not rows:
        return
    reserve = _CLOSE_BUDGET + 1.0 + _RECORD_RESERVE
    tries = 0

    def retry_logged(state: tenacity.RetryCallState) -> None:
        nonlocal tries
        tries = state.attempt_number
        if tries == 1:
            exc = state.outcome.exception() if state.outcome else None
            log_event(
                log,
                "release-retrying",
                level=logging.WARNING,
                rows=rows,
                error=redact(f"{type(exc).__name__}: {exc}"),
                budget_s=round(max(0.0, res.lifecycle.remaining() - reserve), 3),
            )

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_infrastructure_error),
        wait=tenacity.wait_exponential(multiplier=0.1, max=1.0),
        stop=lambda _state: res.lifecycle.remaining() <= reserve,
        before_sleep=retry_logged,
        reraise=True,
    )
    try:
        retrying(held.settle_leftover)
    except Exception as exc:
        log_event(
            log,
            "release-failed",
            level=logging.ERROR,
            rows=rows,
            attempts=tries + 1,
            error=redact(f"{type(exc).__name__}: {exc}"),
            effect="rows stay leased until their lease expires",
        )
    else:
        if tries:
            log_event(log, "release-recovered", rows=rows, attempts=tries + 1)


def close_resources(res: Resources) -> None:
    # Kafka first: once a shard lease is released, the next owner claims the
    # rows we released and sends them; a copy still in our producer's queue
    # could then land after the new owner's later events of the same key.
    if "kafka-producer" in res.opened and res.publisher is not None:
        publisher = res.publisher
        budget = min(_CLOSE_BUDGET, max(0.0, res.lifecycle.remaining() - 1.0))
        _step("kafka-producer", lambda: _log_unsent(publisher.close(budget)))
    # Then the shard ownership (Redis leases or the advisory-lock session: the
    # rows are settled, our copies are flushed or purged), then the wake-ups.
    if "shard-ownership" in res.opened and res.ownership is not None:
        _step("shard-ownership", res.ownership.release_all)
        _step("shard-ownership", res.ownership.close)
    if "redis-wakeups" in res.opened and isinstance(res.waker, RedisWaker):
        _step("redis-wakeups", res.waker.close)
    if "pg-wakeups" in res.opened and isinstance(res.waker, PgNotifyWaker):
        _step("pg-wakeups", res.waker.close)
    # Retention needs only the database: it stops within one batch once
    # draining; wait for it (within the budget) before the pool goes away.
    join_retention(res)
    if "database" in res.opened and res.engine is not None and res.own_engine:
        _step("database", res.engine.dispose)
    res.opened.clear()


def join_retention(res: Resources) -> None:
    """Wait for retention to stop (it checks the drain between batches) while the
    shutdown budget lasts; past that it is abandoned, and the exit record says so."""
    thread = res.retention
    if thread is None:
        return
    thread.join(timeout=max(0.0, res.lifecycle.remaining() - _RECORD_RESERVE))
    if thread.is_alive():
        what = "retention (a database statement did not return)"
        res.abandoned.append(what)
        log_event(
            log,
            "worker-abandoned",
            level=logging.ERROR,
            worker="retention",
            detail=what,
            effect="the statement's transaction is rolled back by the database when "
            "the connection drops with the process",
        )


def finish_record(res: Resources, record: ExitRecord) -> None:
    lc = res.lifecycle
    record.signal = lc.signal_name
    record.state = lc.state.value
    record.shutdown_deadline_ms = round(lc.shutdown_timeout * 1000)
    record.add_run_totals(res.metrics)
    started = lc.drain_started_at
    if started is not None:
        record.duration_ms = round((time.monotonic() - started) * 1000)
    if res.settings.pushgateway_url:
        record.metrics_pushed = push_exit_metrics(
            res.settings.pushgateway_url,
            component="relay",
            node_id=res.settings.node_id,
            # The outbox's identity (the table when the relay never read it):
            # relays of two outboxes never replace each other's group.
            grouping={"outbox": res.outbox},
            metrics=(res.metrics.shutdown_pending, *res.service_metrics.exit_metrics()),
            # Within what is left of the shutdown budget (the watchdog is
            # already disarmed here), but at least a moment to try.
            timeout=max(0.5, min(5.0, lc.remaining())),
        )
    log_exit_record(record)


def failed_start(res: Resources, kind: str, code: int, exc: BaseException) -> int:
    error = exc.orig if isinstance(exc, sa.exc.DBAPIError) and exc.orig else exc
    log_event(
        log,
        "start-failed",
        level=logging.ERROR,
        kind=kind,
        error=redact(f"{type(error).__name__}: {error}"),
        exit_code=code,
    )
    res.lifecycle.drain("start-failed")
    close_resources(res)
    res.lifecycle.set_stopped()
    res.health.stop()
    res.exit.state = "stopped"
    res.exit.signal = res.lifecycle.signal_name
    res.exit.result = f"{kind}-error"
    res.exit.exit_code = code
    res.exit.add_run_totals(res.metrics)
    log_exit_record(res.exit)
    return code


def on_hurry(res: Resources) -> None:
    unfinished = res.held.unfinished_rows() if res.held is not None else 0
    log_event(log, "drain-hurried", level=logging.WARNING, unfinished_rows=unfinished)


def cut(res: Resources) -> list[str]:
    """Watchdog: the drain overran shutdown_timeout; name what is being abandoned."""
    cut = list(res.opened)
    retention = res.retention
    if retention is not None and retention.is_alive():
        cut.append("retention")
    held = res.held_rows()
    if held:
        cut.append(f"{held} leased rows (back after lease expiry)")
    return cut


def on_forced(res: Resources) -> None:
    started = res.lifecycle.drain_started_at
    if started is not None:  # set_stopped() will not run: record the duration here
        res.service_metrics.shutdown_duration.set(time.monotonic() - started)
    record = res.exit
    record.left_leased = res.held_rows()
    record.batch_size += record.left_leased
    record.abandoned = cut(res)
    record.result, record.exit_code = "forced", EXIT_FORCED
    finish_record(res, record)


def _step(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:
        log_event(
            log,
            "close-failed",
            level=logging.ERROR,
            resource=name,
            error=redact(f"{type(exc).__name__}: {exc}"),
        )


def _log_unsent(unsent: int) -> None:
    if unsent:
        log_event(log, "kafka-unsent-at-close", level=logging.WARNING, messages=unsent)
