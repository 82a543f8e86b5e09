"""Give the C heap's free memory back to the operating system now and then.

A consumer working off a backlog allocates each message's key and value on the
poll thread (confluent-kafka copies them out of librdkafka's buffers) and frees
them on a worker, while librdkafka's threads allocate and free fetch buffers
of their own. glibc's allocator keeps what was freed in its heaps for reuse,
and the heaps' free pages between live chunks stay resident: the process's
peak memory crept up as it read more of a backlog (docs/performance.md, "The
consumer's peak memory"), though Python's own heap did not grow.
``malloc_trim(0)`` hands those free pages back (``madvise``) without moving
anything that is alive.

Only glibc has ``malloc_trim``; elsewhere (musl, macOS) :class:`HeapTrimmer`
does nothing.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

__all__ = ["MAX_SHARE", "HeapTrimmer", "malloc_trim"]

#: The largest share of the calling thread's time that trims may take.
MAX_SHARE = 0.01


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


#: glibc's ``malloc_trim``, or None where the C library has none.
malloc_trim: Callable[[int], int] | None = _load_malloc_trim()


class HeapTrimmer:
    """Call :data:`malloc_trim` at most once per ``interval`` seconds, from
    whichever thread calls :meth:`maybe_trim` (a loop that runs anyway).

    ``interval`` 0 turns it off. One trim of a consumer's heap took about half a
    millisecond on the benchmark's machine, 5.6 ms at most (docs/consumer.md).
    A trim's time grows with the heap (it walks the free chunks), and in a large
    host process it could stall the calling loop for longer: the wait after a
    trim stretches so that trimming takes at most :data:`MAX_SHARE` of the
    caller's time (a 50 ms trim is followed by at least 5 s without one).
    """

    def __init__(
        self,
        interval: float,
        *,
        trim: Callable[[int], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._trim = (trim or malloc_trim) if interval > 0 else None
        self._interval = interval
        self._clock = clock
        self._next = clock() + interval
        #: Trims done so far.
        self.trims = 0

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> None:
        if self._trim is None:
            return
        now = self._clock()
        if now < self._next:
            return
        self._trim(0)
        done = self._clock()
        self._next = done + max(self._interval, (done - now) / MAX_SHARE)
        self.trims += 1
