"""When a row that hit a retriable error becomes due again.

The delay is tenacity's ``wait_random_exponential`` ("full jitter"): uniform in
``[0, min(cap, base * 2 ** (attempts - 1))]``. The jitter spreads the retries of
a batch that failed together (a broker outage) instead of sending them back in
one burst. The delay only sets ``next_attempt_at``; the relay never sleeps on it.
"""

from __future__ import annotations

import tenacity

__all__ = ["Backoff"]


class Backoff:
    """Seconds until the next attempt of a row that has used ``attempts`` claims."""

    def __init__(self, *, base: float, cap: float) -> None:
        self._wait = tenacity.wait_random_exponential(multiplier=base, max=cap)
        self._retrying = tenacity.Retrying()
        self.base = base
        self.cap = cap

    def delay(self, attempts: int) -> float:
        state = tenacity.RetryCallState(self._retrying, None, (), {})
        state.attempt_number = max(1, attempts)
        return float(self._wait(state))
