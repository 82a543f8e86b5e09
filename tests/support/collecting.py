"""A line on the terminal every few seconds while the suite is collected.

Collecting imports every test module (and the package, Kafka, SQLAlchemy, ...
behind them); with pytest-xdist the workers do it and the session prints nothing
until all of them are done, so a run looked hung for a minute. Every
``OUTBOXKIT_TEST_PROGRESS_INTERVAL`` seconds (default 5; 0 turns it off) the
session prints ``collecting: N test modules imported (...), T s``.

Whoever collects (each xdist worker, or the session itself with ``-n 0``)
appends one line per module it imported to a file the session made
(``OUTBOXKIT_TEST_COLLECT_PROGRESS``, inherited by the workers); the session
reads it. Nothing is printed once the first worker has finished collecting.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

__all__ = ["PROGRESS_ENV", "CollectionProgress", "record_module"]

PROGRESS_ENV = "OUTBOXKIT_TEST_COLLECT_PROGRESS"
INTERVAL_ENV = "OUTBOXKIT_TEST_PROGRESS_INTERVAL"


def interval() -> float:
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, "5")))
    except ValueError:
        return 5.0


def record_module(report: pytest.CollectReport, worker: str) -> None:
    """Called by whoever collects, once per collect report: a module imported."""
    path = os.environ.get(PROGRESS_ENV)
    if not path or not report.nodeid.endswith(".py"):
        return
    with contextlib.suppress(OSError), open(path, "a") as f:
        f.write(f"{worker} {report.nodeid}\n")


class CollectionProgress:
    """The session's side: a plugin that prints the progress lines."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._every = interval()
        fd, name = tempfile.mkstemp(prefix="outboxkit-collect-", suffix=".txt")
        os.close(fd)
        self._path = Path(name)
        os.environ[PROGRESS_ENV] = name
        self._started = time.monotonic()
        self._last = self._started
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _line(self) -> str | None:
        try:
            lines = self._path.read_text().splitlines()
        except OSError:
            return None
        per_worker: dict[str, int] = {}
        last = ""
        for line in lines:
            worker, _, nodeid = line.partition(" ")
            per_worker[worker] = per_worker.get(worker, 0) + 1
            last = nodeid
        count = max(per_worker.values(), default=0)
        where = f", now in {os.path.dirname(last) or '.'}/" if last else ""
        return (
            f"collecting: {count} test modules imported{where}, "
            f"{time.monotonic() - self._started:.0f} s"
        )

    def _write(self) -> None:
        line = self._line()
        reporter: Any = self._config.pluginmanager.getplugin("terminalreporter")
        if line and reporter is not None and not self._done.is_set():
            reporter.write_line(line)

    def _run(self) -> None:
        while not self._done.wait(self._every):
            self._write()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # With xdist the workers collect while this process waits in its loop,
        # not capturing: a thread may write. With -n 0 this process collects
        # itself, capturing each module's import: it writes between modules.
        if self._every and self._config.pluginmanager.has_plugin("dsession"):
            self._thread = threading.Thread(target=self._run, name="collect-progress", daemon=True)
            self._thread.start()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if self._thread is None and self._every and not self._done.is_set():
            now = time.monotonic()
            if now - self._last >= self._every:
                self._last = now
                self._write()

    def _stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(5)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._stop()

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: Any) -> None:
        self._stop()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self._stop()
        with contextlib.suppress(OSError):
            self._path.unlink()
