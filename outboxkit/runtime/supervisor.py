"""Restart worker loops that crash, with capped backoff, never once draining.

A loop is a function that runs until the lifecycle drains and then returns.
An unexpected exception in it is a bug or an outage the loop did not handle;
the supervisor logs it with the worker's name and traceback and runs the loop
again after 1, 2, 4, 8, 16, 30, 30... seconds. The series starts over once a
run has lasted 60 s. Once draining, a crash is logged and the loop is not
restarted: the entry point goes on with the shutdown.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from outboxkit.runtime.lifecycle import Lifecycle
from outboxkit.runtime.logs import log_event, redact
from outboxkit.runtime.metrics import ServiceMetrics

__all__ = ["DEFAULT_BACKOFF", "Supervisor"]

DEFAULT_BACKOFF: tuple[float, ...] = (1, 2, 4, 8, 16, 30)


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

    def run(self, name: str, loop: Callable[[], None]) -> None:
        """Run ``loop`` in the calling thread until it returns or a crash happens while draining.

        ``KeyboardInterrupt``/``SystemExit`` and other non-``Exception`` errors propagate.
        """
        consecutive = 0
        while True:
            started = self._clock()
            try:
                loop()
                return
            except Exception as exc:
                ran_for = self._clock() - started
                error = redact(f"{type(exc).__name__}: {exc}")
                with self._lock:
                    self.crashes += 1
                # A crash while draining is logged and ends the worker: no restart.
                draining = self.lifecycle.draining.is_set()
                restart: dict[str, object] = {}
                if not draining:
                    if ran_for >= self.reset_after:
                        consecutive = 0
                    delay = self.backoff[min(consecutive, len(self.backoff) - 1)]
                    consecutive += 1
                    restart = {
                        "restart_in_s": delay,
                        "restarts": consecutive,
                        "ran_for_s": round(ran_for, 3),
                    }
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
