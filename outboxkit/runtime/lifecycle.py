"""Process lifecycle: ``starting -> running -> draining -> stopped``.

One :class:`Lifecycle` per process. Loops observe ``lifecycle.draining`` (and
``lifecycle.hurry``); nothing else stops them. The rules:

* **Signals only change state.** The entry point calls
  :meth:`Lifecycle.install_signal_handlers` (never a library, never a test that
  embeds a component). The first SIGTERM/SIGINT starts the drain, the second
  sets ``hurry``; later ones are logged and otherwise ignored.
  The signal number travels through a pipe registered with
  :func:`signal.set_wakeup_fd`, which the interpreter writes from its C-level
  handler the moment the signal arrives, even while the main thread is blocked
  inside a C call (a Kafka flush). A watcher thread reads it, changes the state
  and logs. The Python-level handler takes no lock and does no I/O (at most one
  ``os.write`` of a byte, only when another library already owns the wakeup
  fd), so it cannot deadlock with the thread it interrupts.
* **A fatal failure drains like a signal.** :meth:`Lifecycle.fatal` records the
  exit code intent and enters the same drain path; nothing calls ``sys.exit``
  from deep inside a loop.
* **The drain is bounded.** :meth:`Lifecycle.start_watchdog` forces the exit
  with ``EXIT_FORCED`` once ``shutdown_timeout`` has passed since the drain
  began, after logging which resources it cut.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from outboxkit.runtime.exitcodes import EXIT_DEPENDENCY, EXIT_FORCED, EXIT_OK
from outboxkit.runtime.logs import flush_logging, log_event, redact
from outboxkit.runtime.metrics import ServiceMetrics

__all__ = ["HurryEvent", "Lifecycle", "State"]

_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# A cut() or on_forced() that hangs must not keep a forced exit from happening.
_FORCED_STEP_TIMEOUT = 5.0


class HurryEvent(threading.Event):
    """The ``hurry`` event, callable as ``lifecycle.hurry()``.

    The contract has both ``lifecycle.hurry`` (an Event loops check) and
    ``lifecycle.hurry()`` (the API that sets it); one attribute cannot be both a
    plain Event and a method, so it is an Event whose call triggers the hurry.
    """

    def __init__(self, trigger: Callable[[], None]) -> None:
        super().__init__()
        self._trigger = trigger

    def __call__(self) -> None:
        self._trigger()


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class Lifecycle:
    """Thread-safe lifecycle state, drain/hurry events and the forced-exit watchdog."""

    def __init__(
        self,
        *,
        service: str,
        node_id: str,
        shutdown_timeout: float,
        logger: logging.Logger | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        if not shutdown_timeout > 0 or math.isinf(shutdown_timeout):
            raise ValueError(
                f"shutdown_timeout must be a finite number > 0 (got {shutdown_timeout!r})"
            )
        self.service = service
        self.node_id = node_id
        self.shutdown_timeout = float(shutdown_timeout)
        self.log = logger or logging.getLogger("outboxkit.runtime.lifecycle")
        self.metrics: ServiceMetrics | None = None

        self.draining = threading.Event()
        self.hurry = HurryEvent(self.hurry_up)
        self.signal_name: str | None = None
        self.drain_started_at: float | None = None
        self.stopped_at: float | None = None
        self.exit_code_hint: int | None = None

        self._lock = threading.Lock()
        self._state = State.STARTING
        self._stopped = threading.Event()
        self._drain_callbacks: list[Callable[[], None]] = []
        self._hurry_callbacks: list[Callable[[], None]] = []
        self._signals_seen = 0
        self._watchdog: threading.Thread | None = None

        # Signal plumbing (see module docstring); created on install.
        self._rfd: int | None = None
        self._wfd: int | None = None
        self._watcher: threading.Thread | None = None
        self._handler_writes = False
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd: int | None = None
        if metrics is not None:
            self.attach_metrics(metrics)

    # -- state ---------------------------------------------------------------

    @property
    def state(self) -> State:
        with self._lock:
            return self._state

    def attach_metrics(self, metrics: ServiceMetrics) -> None:
        """Keep ``metrics`` in step with the state from now on (and set it now)."""
        self.metrics = metrics
        self._update_metrics(self.state)

    def set_running(self) -> None:
        """STARTING -> RUNNING. A no-op once draining or stopped."""
        with self._lock:
            if self._state is not State.STARTING:
                return
            self._state = State.RUNNING
        self._changed(State.STARTING, State.RUNNING, reason="started")

    def drain(self, reason: str = "api") -> None:
        """Start the drain. Idempotent: only the first call changes anything.

        ``reason`` becomes :attr:`signal_name` (``"SIGTERM"``, ``"api"``, ``"fatal"``...).
        """
        with self._lock:
            if self._state not in (State.STARTING, State.RUNNING):
                return
            before = self._state
            self._state = State.DRAINING
            self.signal_name = reason
            self.drain_started_at = time.monotonic()
            # Set inside the lock so that anyone who reads state == DRAINING also
            # sees the event set.
            self.draining.set()
        self._changed(before, State.DRAINING, reason=reason)
        self._run_callbacks(self._drain_callbacks, "drain")

    def hurry_up(self) -> None:
        """Cut the soft drain short: set ``hurry`` (and start the drain if not yet).

        Also reachable as ``lifecycle.hurry()``. Loops react by abandoning
        optional waits; the exit path still releases what it holds.
        """
        self.drain("api")
        with self._lock:
            if self.hurry.is_set():
                return
            self.hurry.set()
        log_event(
            self.log,
            "hurry",
            level=logging.WARNING,
            signal=self.signal_name,
            remaining_s=round(self.remaining(), 3),
        )
        self._run_callbacks(self._hurry_callbacks, "hurry")

    def fatal(
        self, reason: str, exc: BaseException | None = None, *, exit_code: int = EXIT_DEPENDENCY
    ) -> None:
        """A failure that makes the process unusable: log it, record the exit
        code intent (the first one wins) and enter the same drain path as a signal.
        """
        fields: dict[str, object] = {"reason": reason, "exit_code": exit_code}
        if exc is not None:
            fields["error"] = redact(f"{type(exc).__name__}: {exc}")
        log_event(
            self.log,
            "fatal",
            level=logging.ERROR,
            exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None,
            **fields,
        )
        with self._lock:
            if self.exit_code_hint is None:
                self.exit_code_hint = exit_code
        self.drain("fatal")

    def note_exit_code(self, exit_code: int) -> None:
        """Record an exit code intent without draining (the first one wins, as
        with :meth:`fatal`): the process goes on, and exits with it."""
        with self._lock:
            if self.exit_code_hint is None:
                self.exit_code_hint = exit_code

    def set_stopped(self) -> None:
        """Final state: everything is closed. Cancels the watchdog; live probe turns 503."""
        with self._lock:
            if self._state is State.STOPPED:
                return
            before = self._state
            self._state = State.STOPPED
            self.stopped_at = time.monotonic()
            if self.drain_started_at is None:
                self.drain_started_at = self.stopped_at
            self.draining.set()
            self._stopped.set()
        duration = self.stopped_at - self.drain_started_at
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                self.metrics.shutdown_duration.set(duration)
        self._changed(before, State.STOPPED, reason=self.signal_name, duration_s=round(duration, 3))

    @property
    def stopped(self) -> threading.Event:
        """Set by :meth:`set_stopped`."""
        return self._stopped

    def wait_draining(self, timeout: float | None) -> bool:
        """Sleep up to ``timeout`` s, waking at once when the drain starts. True if draining."""
        return self.draining.wait(timeout)

    def remaining(self) -> float:
        """Seconds left before the forced exit; ``inf`` before the drain starts."""
        started = self.drain_started_at
        if started is None:
            return math.inf
        return max(0.0, started + self.shutdown_timeout - time.monotonic())

    def exit_code(self) -> int:
        """What a normal exit should return: the :meth:`fatal` hint, else ``EXIT_OK``."""
        return self.exit_code_hint if self.exit_code_hint is not None else EXIT_OK

    def on_drain(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (in the thread that starts the drain) when draining begins.

        Use it to wake something blocked outside Python's reach. Called at once if
        already draining. Exceptions are logged, never raised.
        """
        self._drain_callbacks.append(callback)
        if self.draining.is_set():
            self._run_callbacks([callback], "drain")

    def on_hurry(self, callback: Callable[[], None]) -> None:
        """Like :meth:`on_drain`, for hurry (e.g. log the count of unfinished work)."""
        self._hurry_callbacks.append(callback)
        if self.hurry.is_set():
            self._run_callbacks([callback], "hurry")

    def _changed(self, before: State, after: State, **fields: object) -> None:
        self._update_metrics(after)
        payload: dict[str, Any] = {"from": before.value, "to": after.value, **fields}
        log_event(self.log, "state-changed", **payload)

    def _update_metrics(self, state: State) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        try:
            metrics.state.state(state.value)
            metrics.draining.set(1 if state in (State.DRAINING, State.STOPPED) else 0)
        except Exception as exc:  # a metrics hook must never break a state change
            log_event(self.log, "metrics-update-failed", level=logging.WARNING, error=str(exc))

    def _run_callbacks(self, callbacks: list[Callable[[], None]], what: str) -> None:
        for cb in list(callbacks):
            try:
                cb()
            except Exception as exc:
                log_event(
                    self.log,
                    "lifecycle-callback-failed",
                    level=logging.ERROR,
                    on=what,
                    error=f"{type(exc).__name__}: {exc}",
                    exc_info=True,
                )

    # -- signals -------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """Route SIGTERM/SIGINT to this lifecycle. Main thread only; entry points only."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_signal_handlers() must be called from the main thread")
        if self._old_handlers:
            return
        if self._rfd is None:
            rfd, wfd = os.pipe()
            flags = fcntl.fcntl(wfd, fcntl.F_GETFL)
            fcntl.fcntl(wfd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
            self._rfd, self._wfd = rfd, wfd
            self._watcher = threading.Thread(
                target=self._watch_signals, args=(rfd,), name="outboxkit-signals", daemon=True
            )
            self._watcher.start()
        assert self._wfd is not None
        old_fd = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        if old_fd != -1:
            # Someone (an event loop) owns the wakeup fd: leave it to them and
            # have our handler write the byte itself.
            signal.set_wakeup_fd(old_fd)
            self._handler_writes = True
            self._old_wakeup_fd = None
        else:
            self._handler_writes = False
            self._old_wakeup_fd = old_fd
        for sig in _HANDLED_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    @contextlib.contextmanager
    def process_signals(
        self,
        install: bool,
        *,
        cut: Callable[[], list[str]],
        on_forced: Callable[[], None] | None = None,
    ) -> Iterator[None]:
        """The one lifecycle surface of a service's ``run(handle_signals=...)``.

        With ``install`` (entry points that own the process): SIGTERM/SIGINT drain,
        a second one hurries, and a watchdog forces the exit past
        ``shutdown_timeout`` (see :meth:`start_watchdog`). When the block ends the
        signal handlers are removed again, whether installed here or before it
        (an entry point's :meth:`install_signal_handlers`), so a stopped service
        leaves the process's signal handling as it found it. Embedded services
        pass ``install=False`` and drain through the API.
        """
        if install:
            self.install_signal_handlers()
            if self._watchdog is None:
                self.start_watchdog(cut, on_forced=on_forced)
        try:
            yield
        finally:
            if self._old_handlers and threading.current_thread() is threading.main_thread():
                self.uninstall_signal_handlers()

    def uninstall_signal_handlers(self) -> None:
        """Restore the handlers (and wakeup fd) that were in place before install."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("uninstall_signal_handlers() must be called from the main thread")
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old_handlers.clear()
        if self._old_wakeup_fd is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
            self._old_wakeup_fd = None
        # Closing the write end ends the watcher thread, which closes the read end.
        wfd, self._wfd = self._wfd, None
        self._rfd, self._watcher = None, None
        if wfd is not None:
            with contextlib.suppress(OSError):
                os.close(wfd)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes of whatever it was doing:
        # no locks, no logging. The wakeup fd already carried the signal number to
        # the watcher; write it ourselves only if another library owns that fd.
        wfd = self._wfd
        if self._handler_writes and wfd is not None:
            with contextlib.suppress(OSError):
                os.write(wfd, bytes([signum]))

    def _watch_signals(self, rfd: int) -> None:
        try:
            while True:
                try:
                    data = os.read(rfd, 64)
                except InterruptedError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                for signum in data:
                    # Other signals with Python handlers also show up on the wakeup fd.
                    if signum in _HANDLED_SIGNALS:
                        self._handle_signal(signal.Signals(signum).name)
        finally:
            with contextlib.suppress(OSError):
                os.close(rfd)

    def _handle_signal(self, name: str) -> None:
        self._signals_seen += 1
        n = self._signals_seen
        action = "drain" if n == 1 else "hurry" if n == 2 else "ignored"
        log_event(
            self.log,
            "signal-received",
            level=logging.WARNING if n > 1 else logging.INFO,
            signal=name,
            count=n,
            action=action,
            state=self.state.value,
        )
        if n == 1:
            self.drain(name)
        elif n == 2:
            self.hurry_up()

    # -- forced exit ---------------------------------------------------------

    def start_watchdog(
        self, cut: Callable[[], list[str]], on_forced: Callable[[], None] | None = None
    ) -> None:
        """Force the exit if the drain outlives ``shutdown_timeout``.

        A daemon thread waits for the drain, then for :meth:`set_stopped` until
        ``drain_started_at + shutdown_timeout``. If that passes it calls ``cut()``
        (returns the names of the resources it abandoned), logs
        ``forced-shutdown`` at ERROR, counts it in the metrics, calls
        ``on_forced()`` (write an exit record, push metrics), flushes the logs and
        ``os._exit(EXIT_FORCED)``. ``cut`` and ``on_forced`` are each given
        5 s; their exceptions are logged, never raised.
        """
        if self._watchdog is not None:
            raise RuntimeError("the watchdog is already running")
        self._watchdog = threading.Thread(
            target=self._watchdog_main,
            args=(cut, on_forced),
            name="outboxkit-watchdog",
            daemon=True,
        )
        self._watchdog.start()

    def _watchdog_main(
        self, cut: Callable[[], list[str]], on_forced: Callable[[], None] | None
    ) -> None:
        self.draining.wait()
        while not self._stopped.is_set():
            left = self.remaining()
            if left <= 0:
                break
            self._stopped.wait(left)
        if self._stopped.is_set():
            return
        self._force_exit(cut, on_forced)

    def _force_exit(
        self, cut: Callable[[], list[str]], on_forced: Callable[[], None] | None
    ) -> None:
        result: list[str] = []

        def do_cut() -> None:
            result.extend(str(name) for name in cut())

        finished, error = _bounded(do_cut, _FORCED_STEP_TIMEOUT)
        cut_names = list(result)
        if not finished:
            cut_names.append("<cut timed out>")
        log_event(
            self.log,
            "forced-shutdown",
            level=logging.ERROR,
            cut=cut_names,
            shutdown_timeout_s=self.shutdown_timeout,
            signal=self.signal_name,
            state=self.state.value,
            hurry=self.hurry.is_set(),
            exit_code=EXIT_FORCED,
            **({"cut_error": error} if error else {}),
        )
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                self.metrics.forced_shutdowns.inc()
        if on_forced is not None:
            finished, error = _bounded(on_forced, _FORCED_STEP_TIMEOUT)
            if error or not finished:
                log_event(
                    self.log,
                    "on-forced-failed",
                    level=logging.ERROR,
                    error=error or "timed out",
                )
        flush_logging()
        os._exit(EXIT_FORCED)


def _bounded(fn: Callable[[], None], timeout: float) -> tuple[bool, str | None]:
    """Run ``fn`` in a daemon thread for at most ``timeout`` s: (finished, error)."""
    errors: list[str] = []

    def target() -> None:
        try:
            fn()
        except Exception as exc:
            errors.append(redact(f"{type(exc).__name__}: {exc}"))

    t = threading.Thread(target=target, name="outboxkit-forced-step", daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), (errors[0] if errors else None)
