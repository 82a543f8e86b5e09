"""When to try a failed message again: tenacity's stop and wait strategies.

A transient failure does not sleep inside the worker: the message goes back to
its lane with a due time, so the worker serves other partitions meanwhile and
the lane (its partition, or its key with ``concurrency > 1``) keeps its order.
This module only answers "retry after how long, or give up?", with
tenacity's strategies driven through a :class:`tenacity.RetryCallState`.
"""

from __future__ import annotations

import tenacity

__all__ = ["RetryPolicy"]


class RetryPolicy:
    """Exponential backoff with full jitter, bounded by attempts and total time."""

    def __init__(self, *, max_attempts: int, base: float, cap: float, max_time: float) -> None:
        self.max_attempts = max_attempts
        self._stop = tenacity.stop_after_attempt(max_attempts) | tenacity.stop_before_delay(
            max_time
        )
        self._wait = tenacity.wait_random_exponential(multiplier=base, max=cap)
        self._retrying = tenacity.Retrying(stop=self._stop, wait=self._wait)

    def next_delay(self, *, attempts: int, started_at: float, now: float) -> float | None:
        """Seconds to wait before attempt ``attempts + 1``, or None to give up.

        ``started_at``/``now`` are ``time.monotonic()`` values of the first
        attempt and of the failure just seen.
        """
        state = tenacity.RetryCallState(self._retrying, None, (), {})
        state.start_time = started_at
        state.attempt_number = attempts
        state.outcome_timestamp = now
        delay = float(self._wait(state))
        state.upcoming_sleep = delay
        if self._stop(state):
            return None
        return delay

    def backoff(self, attempts: int) -> float:
        """A delay for the ``attempts``-th wait with no stop (dead-letter write retries)."""
        state = tenacity.RetryCallState(self._retrying, None, (), {})
        state.attempt_number = max(1, attempts)
        return float(self._wait(state))
