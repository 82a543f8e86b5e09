"""No process outlives the run that started it by accident.

A test session, a chaos run or a benchmark starts relays, consumers, writers
and proxies as child processes. When the run itself is killed (a CI job
cancelled, a timeout's SIGKILL, a session that ends), those children are not:
a relay or a consumer polls forever, and the next run on the same two cores
takes twice as long and fails its timing bounds. So each run marks every
process it starts (``OUTBOXKIT_TEST_HARNESS=<pid>:<start time>`` in the
environment, inherited by all descendants) and, when it starts, kills the
marked processes whose run is gone.

Service daemons (``deploy/local``: MariaDB, PostgreSQL, Kafka, Redis) are
started without the mark (``spawn_daemon`` in ``deploy/local/lib.sh``): they
are meant to outlive a run, and their scripts stop them by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

__all__ = ["HARNESS_ENV", "mark_this_run", "reap_orphans"]

HARNESS_ENV = "OUTBOXKIT_TEST_HARNESS"

_PROC = Path("/proc")


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), or None if it is gone:
    with the pid, it names one process even after its pid is reused."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after it.
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(marker: str) -> bool:
    pid, _, started = marker.partition(":")
    return pid.isdigit() and _started(int(pid)) == started


def mark_this_run() -> str:
    """Mark this process as a run's root, unless a run above it already did
    (the chaos runner under a test session keeps the session's mark)."""
    if not os.environ.get(HARNESS_ENV):
        os.environ[HARNESS_ENV] = f"{os.getpid()}:{_started(os.getpid())}"
    return os.environ[HARNESS_ENV]


def reap_orphans() -> list[int]:
    """SIGKILL every process marked by a run that is no longer running; returns
    their pids. Nothing outside Linux's ``/proc`` is touched."""
    if not _PROC.is_dir():
        return []
    killed = []
    prefix = f"{HARNESS_ENV}=".encode()
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        marks = [v[len(prefix) :] for v in environ.split(b"\0") if v.startswith(prefix)]
        if not marks or _alive(marks[0].decode(errors="replace")):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(entry.name), signal.SIGKILL)
            killed.append(int(entry.name))
    return killed
