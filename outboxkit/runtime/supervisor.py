"""Restart worker loops that crash, with capped backoff, never once draining.

A loop is a function that runs until the lifecycle drains and then returns.
An unexpected exception in it is a bug or an outage the loop did not handle;
the supervisor logs it with the worker's name and traceback and runs the loop
again after 1, 2, 4, 8, 16, 30, 30... seconds. The series starts over once a
run has lasted 60 s. Once draining, a crash is logged and the loop is not
restarted: the entry point goes on with the shutdown.

A worker is *crash-looping* once it crashed ``crash_loop_after`` (3) times in a
row for reasons other than a dependency's outage (``is_infrastructure_error``:
a database restarting or a lost connection restarts the loop with the same
backoff, but neither counts nor ends the series), until a run of it lasts the
same 60 s that resets the series (a worker that crashes on every run, say on
a row it cannot handle, spends its life in backoff while restarts alone hide
it in a counter). While any worker is,
:meth:`Supervisor.readiness` says ``"ready": false`` with the worker, the
error's class and the count (``ServiceRuntime`` merges it into the readiness
answer: 503), and one ``worker-crash-loop`` line is logged when it begins.
When the drain begins while a worker is crash-looping, the lifecycle's exit
code becomes ``EXIT_FAILURE`` and :attr:`Supervisor.crash_loops_at_drain`
keeps what was looping, for the service's exit record (``result`` is
``crash-loop``, never ``clean``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from outboxkit.runtime.errors import is_infrastructure_error
from outboxkit.runtime.exitcodes import EXIT_FAILURE
from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.runtime.logs import log_event, redact
from outboxkit.runtime.metrics import ServiceMetrics

__all__ = ["DEFAULT_BACKOFF", "DEFAULT_CRASH_LOOP_AFTER", "CrashLoop", "Supervisor"]

DEFAULT_BACKOFF: tuple[float, ...] = (1, 2, 4, 8, 16, 30)
#: Consecutive crashes after which a worker counts as crash-looping.
DEFAULT_CRASH_LOOP_AFTER = 3


@dataclasses.dataclass(frozen=True, slots=True)
class CrashLoop:
    """A worker that crashed ``crashes`` times in a row, the last with ``error``
    (the exception's class name; ``detail`` is its redacted message)."""

    worker: str
    crashes: int
    error: str
    detail: str

    def describe(self) -> dict[str, object]:
        """The readiness and exit-record form."""
        return {
            "worker": self.worker,
            "error": self.error,
            "consecutive_crashes": self.crashes,
            "detail": self.detail,
        }


@dataclasses.dataclass(slots=True)
class _Worker:
    """One named loop's crash history (guarded by the supervisor's lock)."""

    consecutive: int = 0
    error: str = ""
    detail: str = ""
    #: When the current run started (supervisor clock); None while in backoff.
    run_started: float | None = None


class Supervisor:
    """Runs named loops and restarts them after unexpected exceptions.

    ``sleep(delay)`` waits between restarts and returns True if the drain
    started meanwhile; it defaults to ``lifecycle.wait_draining``. ``clock``
    measures how long a run lasted (for the 60 s reset); both are injectable
    for tests.
    """

    def __init__(
        self,
        lifecycle: Lifecycle,
        *,
        logger: logging.Logger | None = None,
        metrics: ServiceMetrics | None = None,
        backoff: Sequence[float] = DEFAULT_BACKOFF,
        sleep: Callable[[float], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        reset_after: float = 60.0,
        crash_loop_after: int = DEFAULT_CRASH_LOOP_AFTER,
    ) -> None:
        if not backoff:
            raise ValueError("backoff must have at least one delay")
        self.lifecycle = lifecycle
        self.log = logger or logging.getLogger("outboxkit.runtime.supervisor")
        self.metrics = metrics
        self.backoff = tuple(float(d) for d in backoff)
        self._sleep = sleep if sleep is not None else lifecycle.wait_draining
        self._clock = clock
        self.reset_after = reset_after
        self._lock = threading.Lock()
        self.crashes = 0
        """Total unexpected exceptions seen, across all workers."""
        self.crash_loop_after = max(1, crash_loop_after)
        self._workers: dict[str, _Worker] = {}
        self.crash_loops_at_drain: tuple[CrashLoop, ...] = ()
        """The workers crash-looping when the drain began (see the module docstring)."""
        lifecycle.on_drain(self._note_drain)

    def crash_loops(self) -> tuple[CrashLoop, ...]:
        """The workers crash-looping now: ``crash_loop_after`` crashes in a row and
        no run since that lasted ``reset_after``."""
        now = self._clock()
        with self._lock:
            return tuple(
                CrashLoop(worker=name, crashes=w.consecutive, error=w.error, detail=w.detail)
                for name, w in self._workers.items()
                if w.consecutive >= self.crash_loop_after
                and (w.run_started is None or now - w.run_started < self.reset_after)
            )

    def readiness(self) -> dict[str, object]:
        """Readiness fields: ``{"ready": False, "crash_loop": [...]}`` while a worker
        is crash-looping, else nothing."""
        loops = self.crash_loops()
        if not loops:
            return {}
        return {"ready": False, "crash_loop": [c.describe() for c in loops]}

    def _note_drain(self) -> None:
        loops = self.crash_loops()
        self.crash_loops_at_drain = loops
        if loops:
            self.lifecycle.note_exit_code(EXIT_FAILURE)

    def run(self, name: str, loop: Callable[[], None]) -> None:
        """Run ``loop`` in the calling thread until it returns or a crash happens while draining.

        ``KeyboardInterrupt``/``SystemExit`` and other non-``Exception`` errors propagate.
        """
        consecutive = 0
        looping = 0  # crashes in a row that were not a dependency's outage
        with self._lock:
            self._workers[name] = state = _Worker()
        while True:
            started = self._clock()
            with self._lock:
                state.run_started = started
            try:
                loop()
                with self._lock:
                    state.consecutive = 0
                return
            except Exception as exc:
                ran_for = self._clock() - started
                error = redact(f"{type(exc).__name__}: {exc}")
                with self._lock:
                    self.crashes += 1
                # A crash while draining is logged and ends the worker: no restart.
                draining = self.lifecycle.draining.is_set()
                restart: dict[str, object] = {}
                # A dependency's outage (the database restarting, a lost
                # connection) restarts the loop with the same backoff but is no
                # crash loop: it is not the code's, it ends by itself, and it has
                # its own reports. It neither counts nor ends a loop's series.
                outage = is_infrastructure_error(exc)
                if not draining:
                    if ran_for >= self.reset_after:
                        consecutive = looping = 0
                    delay = self.backoff[min(consecutive, len(self.backoff) - 1)]
                    consecutive += 1
                    if not outage:
                        looping += 1
                    restart = {
                        "restart_in_s": delay,
                        "restarts": consecutive,
                        "ran_for_s": round(ran_for, 3),
                    }
                    with self._lock:
                        state.consecutive = looping
                        if not outage:
                            state.error, state.detail = type(exc).__name__, error
                        state.run_started = None
                log_event(
                    self.log,
                    "worker-crashed-during-drain" if draining else "worker-crashed",
                    level=logging.ERROR,
                    worker=name,
                    error=error,
                    exc_info=exc,
                    **restart,
                )
                if draining:
                    return
                if not outage and looping == self.crash_loop_after:
                    log_event(
                        self.log,
                        "worker-crash-loop",
                        level=logging.ERROR,
                        worker=name,
                        error=type(exc).__name__,
                        consecutive_crashes=looping,
                        effect=f"readiness answers 503 until a run lasts {self.reset_after:g} s; "
                        "a stop now exits with result crash-loop",
                    )
            # Outside the except block so the traceback of the crash is not
            # chained to anything that happens while waiting.
            if self._sleep(delay) or self.lifecycle.draining.is_set():
                log_event(self.log, "worker-restart-cancelled", worker=name, reason="draining")
                return
            self._count_restart(name)

    def spawn(self, name: str, loop: Callable[[], None]) -> threading.Thread:
        """:meth:`run` in a new non-daemon thread called ``name`` (started)."""
        thread = threading.Thread(target=self.run, args=(name, loop), name=name, daemon=False)
        thread.start()
        return thread

    def _count_restart(self, name: str) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.worker_restarts.labels(worker=name).inc()
        except Exception as exc:  # a metrics hook never breaks the loop
            log_event(self.log, "metrics-update-failed", level=logging.WARNING, error=str(exc))
