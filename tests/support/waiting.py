"""Bounds for the suite's waits.

Every wait in the tests polls a condition and gives up at a bound. The bounds
are written for an idle machine and multiplied here by ``WAIT_SCALE``
(``OUTBOXKIT_TEST_WAIT_SCALE``, default 3), because CI may share its two cores
with other work: a wait that passes costs no more, and only a failing one takes
longer to report. Assertions about how fast the product reacts (a latency the
test measures) are not scaled.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["WAIT_SCALE", "bound", "wait_for"]

WAIT_SCALE = float(os.environ.get("OUTBOXKIT_TEST_WAIT_SCALE", "3"))

T = TypeVar("T")


def bound(seconds: float) -> float:
    """``seconds`` as a bound on a wait, scaled for a busy machine."""
    return seconds * WAIT_SCALE


def wait_for(
    predicate: Callable[[], T], *, timeout: float, interval: float = 0.05, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns a true value (returned), for at most
    ``bound(timeout)`` seconds."""
    limit = bound(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit:g} s waiting for {what or predicate}")
        time.sleep(interval)
