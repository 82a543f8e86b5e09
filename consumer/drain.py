"""Draining the consumer: the shutdown order, the exit record, the metrics push.

:func:`shutdown` runs once the poll loop has stopped (signal, :meth:`Consumer.stop`,
or a fatal error); :func:`on_hurry`, :func:`cut` and :func:`on_forced` are the
second signal's and the watchdog's callbacks. The exit record is the
``consumer-exit`` line (see :mod:`outboxkit.runtime.exitrecord` for how it
differs from the relay's ``relay-exit``).

Each takes a :class:`DrainParts`: what the drain works on and closes, handed
over by the consumer. The drain reads nothing else of the service, so it can
be read (and changed) without it; what it leaves for the service to read
afterwards (the report, whether the commit and the close finished) is the
:class:`ExitState` the consumer keeps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

from sqlalchemy.engine import Engine

from outboxkit.consumer.asyncio_handler import AsyncHandlers
from outboxkit.consumer.dlq import DeadLetters
from outboxkit.consumer.loop import PollLoop
from outboxkit.consumer.metrics import ConsumerMetrics
from outboxkit.consumer.offsets import commit_and_close
from outboxkit.consumer.report import DrainReport
from outboxkit.consumer.settings import ConsumerSettings
from outboxkit.consumer.workers import Dispatcher
from outboxkit.runtime.exitcodes import EXIT_DEPENDENCY, EXIT_OK
from outboxkit.runtime.exitrecord import CLEAN, CRASH_LOOP, ExitRecord
from outboxkit.runtime.health import HealthServer
from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.runtime.logs import log_event
from outboxkit.runtime.metrics import ServiceMetrics, push_exit_metrics
from outboxkit.runtime.supervisor import Supervisor

__all__ = [
    "PUSH_GROUP_LABEL",
    "ConsumerExitRecord",
    "DrainParts",
    "ExitState",
    "cut",
    "exit_code_of",
    "on_forced",
    "on_hurry",
    "push_metrics",
    "result_of",
    "shutdown",
    "write_exit_record",
]

_log = logging.getLogger("outboxkit.consumer")

#: The grouping label beside ``instance`` in the consumer's Pushgateway group:
#: its consumer group (``group_id``).
PUSH_GROUP_LABEL = "consumer_group"


@dataclasses.dataclass
class ConsumerExitRecord(ExitRecord):
    """The ``consumer-exit`` line: the drain batch (messages in flight when the drain
    began) and what became of it, the offsets committed at exit, the run's totals.
    ``counts_of`` (``drain-batch``) says in the line what ``batch_size`` ...
    ``released`` count; ``totals`` are the whole run's."""

    signal: str | None
    state: str
    counts_of: str
    batch_size: int
    succeeded: int
    duplicate: int
    failed: int
    unknown: int
    released: int
    committed: dict[str, int]
    committed_messages: int
    totals: dict[str, int]
    duration_ms: int
    result: str
    exit_code: int
    #: Workers crash-looping when the drain began (``result`` ``crash-loop``).
    crash_loop: list[dict[str, object]] = dataclasses.field(default_factory=list)

    event: ClassVar[str] = "consumer-exit"


@dataclasses.dataclass
class ExitState:
    """What the drain reached, kept by the consumer across the drain's callbacks:
    the report (:attr:`Consumer.report`), whether the exit commit returned (an
    exit without it is ``commit-incomplete``) and whether the Kafka consumer
    closed (:attr:`Consumer.closed_cleanly`)."""

    report: DrainReport | None = None
    committed: bool = False
    closed: bool = False

    def commit_returned(self) -> None:
        self.committed = True

    def kafka_closed(self) -> None:
        self.closed = True


@dataclasses.dataclass(frozen=True, slots=True)
class DrainParts:
    """What the drain of one consumer works on, handed over by the consumer as it
    stands when the drain (or a callback of it) runs: the Kafka side and what the
    start opened are None while not made yet."""

    settings: ConsumerSettings
    lifecycle: Lifecycle
    supervisor: Supervisor
    health: HealthServer
    metrics: ConsumerMetrics
    service_metrics: ServiceMetrics
    dispatcher: Dispatcher
    state: ExitState
    #: The ``on_stop`` hook, whose exception is logged, never raised.
    on_stop: Callable[[], None]
    loop: PollLoop | None
    #: The Kafka consumer (closed by the exit commit: :func:`commit_and_close`).
    kafka: Any
    async_handlers: AsyncHandlers | None
    dead_letters: DeadLetters | None
    #: The inbox engine the consumer built from ``db_url`` (disposed); None for
    #: one passed in, which is the application's.
    owned_engine: Engine | None
    #: The consumer group (settings or the class's ``group_id``): the exit push's
    #: ``consumer_group`` label.
    group_id: str = ""


def shutdown(parts: DrainParts) -> int:
    """Shutdown, in this order, and why:

    1. drain: pause every partition and release what has not started, then let
       running handlers finish within ``worker_drain_timeout`` (a second
       signal cuts it short), still serving Kafka callbacks so a rebalance
       meanwhile is answered;
    2. stop the workers: a handler still running is *unknown*, its offset is
       never stored, Kafka redelivers it;
    3. commit synchronously what is done, then close the consumer (leaving the
       group moves the partitions at once instead of after
       ``session.timeout.ms``). A commit the group refuses while it rebalances
       is retried, serving the group so the rebalance completes, within what
       the drain's budget left; the close gets ``close_timeout``, so a sick
       cluster cannot hang the exit;
    4. close the dead-letter producer (nothing is pending: every write was
       awaited) and the inbox engine;
    5. ``on_stop``, the exit record, the metrics push, the health server.

    Returns the exit code (:func:`exit_code_of`).
    """
    lc = parts.lifecycle
    s = parts.settings
    loop = parts.loop
    report = DrainReport()
    if loop is not None and parts.kafka is not None:
        loop.begin_drain()
        started = lc.drain_started_at or time.monotonic()
        loop.wait_drained(started + s.worker_drain_timeout, lc.hurry.is_set)
        report = loop.end_drain()
        if parts.async_handlers is not None:
            parts.async_handlers.cancel_running()  # after end_drain counted them unknown
        # The commit may find the group rebalancing (a new member joined as this
        # one was told to stop): it is retried, the group served meanwhile, with
        # what the drain's budget left (none once hurried), plus the close's.
        committed = commit_and_close(
            loop.commits,
            s.close_timeout,
            parts.state.kafka_closed,
            parts.state.commit_returned,
            budget_until=None if lc.hurry.is_set() else started + s.worker_drain_timeout,
        )
        report.committed = committed
    parts.state.report = report
    if parts.dead_letters is not None:
        parts.dead_letters.close(1.0)
    if parts.owned_engine is not None:
        parts.owned_engine.dispose()
    if parts.async_handlers is not None:
        parts.async_handlers.close()
    parts.on_stop()
    parts.metrics.shutdown_released.set(report.released + report.unknown)
    parts.metrics.shutdown_committed.set(report.committed_messages)
    result = result_of(parts, report)
    code = exit_code_of(parts, result)
    write_exit_record(parts, report, result=result, exit_code=code)
    push_metrics(parts)
    parts.health.stop()
    lc.set_stopped()
    return code


def result_of(parts: DrainParts, report: DrainReport) -> str:
    """The drain's result, the worst first: ``crash-loop`` (a worker kept crashing
    until the drain), ``failed`` (a fatal error), ``commit-incomplete`` (finished
    messages whose offsets the group does not hold: the next owner handles them
    again), ``unknown-left`` (handlers that did not finish: redelivered, as they
    must be), ``clean`` (:data:`~outboxkit.runtime.exitrecord.CLEAN`)."""
    if parts.supervisor.crash_loops_at_drain:
        return CRASH_LOOP
    if parts.lifecycle.exit_code() != EXIT_OK:
        return "failed"
    # Only the commit decides: a close that timed out after it (leaving the group
    # while the broker is away; close-timed-out, ERROR) puts no offset at risk.
    if not parts.state.committed or report.commit_error:
        return "commit-incomplete"
    if report.unknown:
        return "unknown-left"
    return CLEAN


def exit_code_of(parts: DrainParts, result: str) -> int:
    """The process exit code for ``result``: the lifecycle's (a fatal error's code,
    else 0), except that an exit commit that did not complete is
    ``EXIT_DEPENDENCY``: Kafka did not take what this process finished, and an
    exit code of 0 would read as a clean drain."""
    code = parts.lifecycle.exit_code()
    if code == EXIT_OK and result == "commit-incomplete":
        return EXIT_DEPENDENCY
    return code


def write_exit_record(
    parts: DrainParts, report: DrainReport, *, result: str, exit_code: int | None = None
) -> None:
    """``consumer-exit``: the one place the consumer writes its exit record
    (``exit_code``: what the process returns; default the lifecycle's)."""
    lc = parts.lifecycle
    started = lc.drain_started_at or time.monotonic()
    totals = dict(parts.loop.totals) if parts.loop is not None else {}
    ConsumerExitRecord(
        signal=lc.signal_name,
        state=lc.state.value,
        counts_of="drain-batch",
        batch_size=report.batch_size,
        succeeded=report.succeeded + report.duplicate,
        duplicate=report.duplicate,
        failed=report.failed,
        unknown=report.unknown,
        released=report.released,
        committed=report.committed,
        committed_messages=report.committed_messages,
        totals=totals,
        duration_ms=round((time.monotonic() - started) * 1000),
        result=result,
        exit_code=lc.exit_code() if exit_code is None else exit_code,
        crash_loop=[c.describe() for c in parts.supervisor.crash_loops_at_drain],
    ).write(_log)


def push_metrics(parts: DrainParts) -> None:
    url = parts.settings.pushgateway_url
    if url:
        # The drain's duration so far: the push comes before set_stopped(), which
        # would set it only afterwards (the push said 0 for every exit).
        started = parts.lifecycle.drain_started_at
        if started is not None:
            parts.service_metrics.shutdown_duration.set(time.monotonic() - started)
        # Exit metrics only: a pushed worker_consumer_lag would stay in the
        # Pushgateway after this process is gone and keep a lag alert firing.
        m = parts.metrics
        push_exit_metrics(
            url,
            component="consumer",
            node_id=parts.settings.node_id,
            # The consumer group: members of two groups never replace each
            # other's group, and each prunes only its own (base.py).
            grouping={PUSH_GROUP_LABEL: parts.group_id},
            metrics=(
                m.shutdown_released,
                m.shutdown_committed,
                *parts.service_metrics.exit_metrics(),
            ),
        )


def cut(parts: DrainParts) -> list[str]:
    cut = []
    running = len(parts.dispatcher.running())
    if running:
        cut.append(f"handlers ({running} running)")
    if parts.kafka is not None and not parts.state.closed:
        cut.append("kafka consumer (not closed)")
    return cut


def on_forced(parts: DrainParts) -> None:
    report = parts.state.report or DrainReport(unknown=len(parts.dispatcher.running()))
    parts.metrics.shutdown_released.set(report.released + report.unknown)
    write_exit_record(parts, report, result="forced")
    push_metrics(parts)


def on_hurry(parts: DrainParts) -> None:
    running = len(parts.dispatcher.running())
    log_event(
        _log,
        "drain-hurried",
        level=logging.WARNING,
        unfinished=running,
        note="handlers still running are left unknown: not committed, redelivered",
    )
