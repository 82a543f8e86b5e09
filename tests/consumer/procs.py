"""Run ``python -m outboxkit consume`` as a child process and read its JSON log lines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from support.waiting import bound

HERE = Path(__file__).resolve().parent


class ConsumerProcess:
    def __init__(
        self, target: str, *, env: dict[str, str], args: Sequence[str] = (), cwd: Path
    ) -> None:
        child_env = {
            **os.environ,
            **env,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            # A child that hangs is sent SIGABRT (see wait): it then writes every
            # thread's Python stack to stderr, even while a C call holds the GIL.
            "PYTHONFAULTHANDLER": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "outboxkit", "consume", target, *args],
            env=child_env,
            cwd=cwd,  # not the repository: its outboxkit/ folder would shadow the package
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.raw.append(line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                self.lines.append(record)
        self.proc.stderr.close()

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in list(self.lines) if r.get("event") == name]

    def wait_event(
        self,
        name: str,
        timeout: float,
        where: Callable[[dict[str, Any]], bool] = lambda r: True,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + bound(timeout)
        while time.monotonic() < deadline:
            for record in self.events(name):
                if where(record):
                    return record
            if self.proc.poll() is not None and self._reader.is_alive() is False:
                break
            time.sleep(0.02)
        raise AssertionError(
            f"no {name!r} log line within {timeout} s; exit={self.proc.poll()}; "
            f"last lines:\n{''.join(self.raw[-15:])}"
        )

    def health_url(self, timeout: float = 15.0) -> str:
        record = self.wait_event("health-server-started", timeout)
        return f"http://127.0.0.1:{record['port']}"

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit code; a child still running after ``timeout`` (bounded) is
        aborted, and the failure shows the stacks its threads were in."""
        try:
            code = self.proc.wait(bound(timeout))
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self._reader.join(5)
            raise AssertionError(
                f"still running {bound(timeout):g} s after the wait began; its threads "
                f"when aborted:\n{''.join(self.raw[-120:])}"
            ) from None
        self._reader.join(5)
        return code

    def exit_record(self) -> dict[str, Any]:
        records = self.events("consumer-exit")
        assert len(records) == 1, f"expected one exit record, got {len(records)}"
        return records[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)
