"""The base of the wakers that a hint ends early: a wait that the drain ends for good.

:class:`~outboxkit.relay.wakeup.RedisWaker` and
:class:`~outboxkit.relay.pg_wakeup.PgNotifyWaker` share it. It lives apart from
both so that :mod:`outboxkit.relay.wakeup`, which chooses between them
(``default_waker``), can import the PostgreSQL one without that one importing
it back.
"""

from __future__ import annotations

import threading
import time

from outboxkit.runtime.lifecycle import Lifecycle

__all__ = ["DrainAware"]

# A plain Event cannot call us back when it is set: poll it at this pace.
_EVENT_SLICE_S = 0.05


class DrainAware:
    """Waits up to the timeout; a subclass's listener thread sets ``_wake`` on a
    hint to end the wait early. Once the relay drains (``wake()``, the
    ``Lifecycle``'s drain, or a watched ``threading.Event``) every wait returns
    at once, so an idle relay never delays its own shutdown."""

    def __init__(self, lifecycle_or_event: Lifecycle | threading.Event | None) -> None:
        self._wake = threading.Event()
        self._draining: threading.Event | None = None
        self._watch_draining = False
        if isinstance(lifecycle_or_event, Lifecycle):
            self._draining = lifecycle_or_event.draining
            lifecycle_or_event.on_drain(self._wake.set)
        elif lifecycle_or_event is not None:
            # A bare Event cannot call us back when it is set: watch it.
            self._draining = lifecycle_or_event
            self._watch_draining = True

    _woken_for_good = False

    def _is_draining(self) -> bool:
        return self._woken_for_good or (self._draining is not None and self._draining.is_set())

    def wait(self, timeout: float) -> None:
        self._sleep(timeout)
        if not self._is_draining():
            # Cleared before the caller claims: a wake-up for a row committed after
            # this point wakes the next wait; a row committed before is seen by the claim.
            self._wake.clear()

    def wake(self) -> None:
        """The drain began: this and every later :meth:`wait` return at once."""
        self._woken_for_good = True
        self._wake.set()

    def _sleep(self, timeout: float) -> None:
        if timeout <= 0 or self._is_draining():
            return
        if not self._watch_draining:
            self._wake.wait(timeout)
            return
        deadline = time.monotonic() + timeout
        while not self._is_draining():
            left = deadline - time.monotonic()
            if left <= 0 or self._wake.wait(min(left, _EVENT_SLICE_S)):
                return
