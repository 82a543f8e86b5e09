"""The one line every service writes when it stops: the exit record.

Relay and consumer each subclass :class:`ExitRecord` with the counts that make
sense for them, fill it in during their shutdown and call :meth:`ExitRecord.write`
from one place (``relay/drain.py``'s ``log_exit_record``, the consumer's
``_exit_record``). The field names and values are a contract: alert runbooks,
log queries and tests read them.

Both services spell a clean stop the same way, :data:`CLEAN` (``clean``; the
consumer wrote ``ok`` before 0.2.0):

* ``relay-exit``: ``result`` is ``clean`` on a clean stop; any other result
  (``left-leased``, ``forced``, ``error``, ``fatal``, ``config-error`` ...) is
  logged at ERROR;
* ``consumer-exit``: ``result`` is ``clean`` on a clean stop (else ``failed``,
  ``unknown-left``, ``commit-incomplete``, ``forced``); the line is always
  logged at INFO, the exit code says whether the stop was clean.

Both write ``result`` :data:`CRASH_LOOP` (exit code 1) when a worker was
crash-looping as the drain began (see ``runtime.supervisor``), with the
workers and their errors in the record's ``crash_loop`` field: a process whose
loop spent its life restarting did not stop cleanly, whatever its last batch did.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

from outboxkit.runtime.logs import log_event

__all__ = ["CLEAN", "CRASH_LOOP", "ExitRecord"]

#: The ``result`` of a clean stop, for both services.
CLEAN = "clean"

#: The ``result`` of a stop that found a worker crash-looping.
CRASH_LOOP = "crash-loop"


@dataclasses.dataclass
class ExitRecord:
    """Base of the services' exit records; subclasses are dataclasses whose fields,
    in declaration order, are the fields of the line."""

    #: The event name of the line.
    event: ClassVar[str]
    #: Results logged at INFO; any other at ERROR. None: always INFO.
    clean_results: ClassVar[frozenset[str] | None] = None

    def level(self) -> int:
        clean = self.clean_results
        if clean is None or getattr(self, "result", None) in clean:
            return logging.INFO
        return logging.ERROR

    def write(self, logger: logging.Logger) -> None:
        """Log the record: one structured line (service and node_id are in every
        line's envelope)."""
        log_event(logger, self.event, level=self.level(), **dataclasses.asdict(self))
