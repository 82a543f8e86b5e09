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

Ctrl-C (SIGINT to the whole process group, as a terminal sends it) stops the
run's processes at once (:func:`stop_children_on_interrupt`): the session and
each pytest-xdist worker SIGKILL every process of this run that is not one of
the run's pytest processes (relays, consumers, writers, proxies, the scripts
that start them), keep doing so for whatever a test or a fixture starts
afterwards, and then interrupt pytest as usual. The session then waits
:data:`INTERRUPTED_WORKER_GRACE` seconds (pytest-xdist's own wait is 10) for its
workers' fixtures to clean up (test databases, topics) before it kills them: a
clean-up cut short leaves its test database or topics (``okt_...``) behind,
never a running process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from types import FrameType

__all__ = [
    "HARNESS_ENV",
    "INTERRUPTED_WORKER_GRACE",
    "kill_run_children",
    "mark_this_run",
    "reap_orphans",
    "stop_children_on_interrupt",
]

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


#: Seconds an interrupted session waits for its xdist workers (pytest-xdist's own
#: wait is 10 s) before it kills them.
INTERRUPTED_WORKER_GRACE = 2.0
#: How pytest-xdist (execnet) starts a worker: ``python -u -c "<this>"``. Its
#: ``PYTEST_XDIST_WORKER`` variable is set later, so /proc cannot show it.
_WORKER_BOOTSTRAP = b"exec(eval(sys.stdin.readline()))"


def _parent(pid: int) -> int | None:
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _is_worker(pid: int, root: int) -> bool:
    """Is ``pid`` an xdist worker of the session ``root`` (its child, started by execnet)?"""
    try:
        cmdline = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    return _WORKER_BOOTSTRAP in cmdline and _parent(pid) == root


def kill_run_children() -> list[int]:
    """SIGKILL every live process marked with this run's mark except the run's
    pytest processes (the session, whose pid the mark names, and its xdist
    workers); returns their pids."""
    marker = os.environ.get(HARNESS_ENV, "")
    root = marker.partition(":")[0]
    if not _PROC.is_dir() or not root.isdigit():
        return []
    mark = f"{HARNESS_ENV}={marker}".encode()
    killed = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or entry.name == root or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark not in environ:
            continue
        pid = int(entry.name)
        if _is_worker(pid, int(root)):
            continue  # it stops through pytest
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def _keep_killing(stop: threading.Event) -> None:
    # What a test or a fixture starts after the interrupt (a worker finishing
    # its current step) is killed too, until this process exits.
    while not stop.wait(0.1):
        kill_run_children()


def stop_children_on_interrupt() -> None:
    """On SIGINT: kill this run's other processes (:func:`kill_run_children`),
    keep killing new ones until this process exits, then raise
    KeyboardInterrupt as pytest expects. Installed by the session and by each
    xdist worker (SIGINT reaches all of them at a terminal); only from the main
    thread, where Python allows it."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGINT)
    stop = threading.Event()

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        kill_run_children()
        if not any(t.name == "outboxkit-interrupt-reaper" for t in threading.enumerate()):
            threading.Thread(
                target=_keep_killing, args=(stop,), name="outboxkit-interrupt-reaper", daemon=True
            ).start()
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
