"""Draining the consumer: the shutdown order, the exit record, the metrics push.

:func:`shutdown` runs once the poll loop has stopped (signal, :meth:`Consumer.stop`,
or a fatal error); :func:`on_hurry`, :func:`cut` and :func:`on_forced` are the
second signal's and the watchdog's callbacks. The exit record is the
``consumer-exit`` line (see :mod:`outboxkit.runtime.exitrecord` for how it
differs from the relay's ``relay-exit``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, ClassVar

from outboxkit.consumer.offsets import commit_and_close
from outboxkit.consumer.report import DrainReport
from outboxkit.runtime.exitcodes import EXIT_DEPENDENCY, EXIT_OK
from outboxkit.runtime.exitrecord import CRASH_LOOP, ExitRecord
from outboxkit.runtime.logs import log_event
from outboxkit.runtime.metrics import push_exit_metrics

if TYPE_CHECKING:
    from outboxkit.consumer.base import Consumer

__all__ = [
    "ConsumerExitRecord",
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


@dataclasses.dataclass
class ConsumerExitRecord(ExitRecord):
    """The ``consumer-exit`` line: the drain batch (messages in flight when the drain
    began) and what became of it, the offsets committed at exit, the run's totals."""

    signal: str | None
    state: str
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


def shutdown(consumer: Consumer) -> int:
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
    lc = consumer.lifecycle
    s = consumer.settings
    loop = consumer._loop
    report = DrainReport()
    if loop is not None and consumer._kafka is not None:
        loop.begin_drain()
        started = lc.drain_started_at or time.monotonic()
        loop.wait_drained(started + s.worker_drain_timeout, lc.hurry.is_set)
        report = loop.end_drain()
        if consumer._async is not None:
            consumer._async.cancel_running()  # after end_drain counted them unknown
        # The commit may find the group rebalancing (a new member joined as this
        # one was told to stop): it is retried, the group served meanwhile, with
        # what the drain's budget left (none once hurried), plus the close's.
        committed = commit_and_close(
            loop.commits,
            s.close_timeout,
            consumer._mark_closed,
            consumer._mark_committed,
            budget_until=None if lc.hurry.is_set() else started + s.worker_drain_timeout,
        )
        report.committed = committed
    consumer.report = report
    if consumer._dead_letters is not None:
        consumer._dead_letters.close(1.0)
    if consumer._owns_engine and consumer._engine is not None:
        consumer._engine.dispose()
    if consumer._async is not None:
        consumer._async.close()
    consumer._call_hook("on_stop")
    consumer.metrics.shutdown_released.set(report.released + report.unknown)
    consumer.metrics.shutdown_committed.set(report.committed_messages)
    result = result_of(consumer, report)
    code = exit_code_of(consumer, result)
    write_exit_record(consumer, report, result=result, exit_code=code)
    push_metrics(consumer)
    consumer.health.stop()
    lc.set_stopped()
    return code


def result_of(consumer: Consumer, report: DrainReport) -> str:
    """The drain's result, the worst first: ``crash-loop`` (a worker kept crashing
    until the drain), ``failed`` (a fatal error), ``commit-incomplete`` (finished
    messages whose offsets the group does not hold: the next owner handles them
    again), ``unknown-left`` (handlers that did not finish: redelivered, as they
    must be), ``ok``."""
    if consumer.supervisor.crash_loops_at_drain:
        return CRASH_LOOP
    if consumer.lifecycle.exit_code() != EXIT_OK:
        return "failed"
    # Only the commit decides: a close that timed out after it (leaving the group
    # while the broker is away; close-timed-out, ERROR) puts no offset at risk.
    if not consumer._commit_finished or report.commit_error:
        return "commit-incomplete"
    if report.unknown:
        return "unknown-left"
    return "ok"


def exit_code_of(consumer: Consumer, result: str) -> int:
    """The process exit code for ``result``: the lifecycle's (a fatal error's code,
    else 0), except that an exit commit that did not complete is
    ``EXIT_DEPENDENCY``: Kafka did not take what this process finished, and an
    exit code of 0 would read as a clean drain."""
    code = consumer.lifecycle.exit_code()
    if code == EXIT_OK and result == "commit-incomplete":
        return EXIT_DEPENDENCY
    return code


def write_exit_record(
    consumer: Consumer, report: DrainReport, *, result: str, exit_code: int | None = None
) -> None:
    """``consumer-exit``: the one place the consumer writes its exit record
    (``exit_code``: what the process returns; default the lifecycle's)."""
    lc = consumer.lifecycle
    started = lc.drain_started_at or time.monotonic()
    totals = dict(consumer._loop.totals) if consumer._loop is not None else {}
    ConsumerExitRecord(
        signal=lc.signal_name,
        state=lc.state.value,
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
        crash_loop=[c.describe() for c in consumer.supervisor.crash_loops_at_drain],
    ).write(_log)


def push_metrics(consumer: Consumer) -> None:
    url = consumer.settings.pushgateway_url
    if url:
        # The drain's duration so far: the push comes before set_stopped(), which
        # would set it only afterwards (the push said 0 for every exit).
        started = consumer.lifecycle.drain_started_at
        if started is not None:
            consumer.service_metrics.shutdown_duration.set(time.monotonic() - started)
        # Exit metrics only: a pushed worker_consumer_lag would stay in the
        # Pushgateway after this process is gone and keep a lag alert firing.
        m = consumer.metrics
        push_exit_metrics(
            url,
            component="consumer",
            node_id=consumer.settings.node_id,
            metrics=(
                m.shutdown_released,
                m.shutdown_committed,
                *consumer.service_metrics.exit_metrics(),
            ),
        )


def cut(consumer: Consumer) -> list[str]:
    cut = []
    running = len(consumer._dispatcher.running())
    if running:
        cut.append(f"handlers ({running} running)")
    if consumer._kafka is not None and not consumer._closed:
        cut.append("kafka consumer (not closed)")
    return cut


def on_forced(consumer: Consumer) -> None:
    report = consumer.report or DrainReport(unknown=len(consumer._dispatcher.running()))
    consumer.metrics.shutdown_released.set(report.released + report.unknown)
    write_exit_record(consumer, report, result="forced")
    push_metrics(consumer)


def on_hurry(consumer: Consumer) -> None:
    running = len(consumer._dispatcher.running())
    log_event(
        _log,
        "drain-hurried",
        level=logging.WARNING,
        unfinished=running,
        note="handlers still running are left unknown: not committed, redelivered",
    )
