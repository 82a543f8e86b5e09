"""Processes of a run (relays, consumers, the writer): started through the real
CLI, output in one log file each, JSON records parsed back for the checks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from support.lifeline import HARNESS_ENV

PATH_DIR = Path(__file__).resolve().parent / ".path"


def _env(settings: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OUTBOXKIT_") or k == HARNESS_ENV  # support.lifeline's mark
    }
    env["PYTHONPATH"] = str(PATH_DIR)
    env.update(settings)
    return env


@dataclass
class Proc:
    role: str  # relay, consumer, writer
    slot: str  # relay-0, consumer-1, writer
    node_id: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    started: float
    _log: IO[bytes] | None = None
    #: what the harness did to it: "kill", "term", "stop" (pending SIGCONT), None
    fate: str | None = None
    exit_code: int | None = None
    stopped_at: float | None = None
    _records: list[dict[str, Any]] | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls, role: str, slot: str, node_id: str, argv: list[str], env: dict[str, str], logs: Path
    ) -> Proc:
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{node_id}.log"
        log = log_path.open("ab")
        popen = subprocess.Popen(
            [sys.executable, *argv],
            env=_env(env),
            cwd=PATH_DIR,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        return cls(role, slot, node_id, popen, log_path, time.time(), log)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._close()
        self.exit_code = code
        return code

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.wait(10)

    def _close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def wait_for_event(self, event: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r.get("event") == event for r in self.read_records()):
                return True
            if not self.alive():
                return False
            time.sleep(0.1)
        return False

    def read_records(self) -> list[dict[str, Any]]:
        """The JSON log records so far (non-JSON lines, e.g. tracebacks, skipped)."""
        if self._records is not None:
            return self._records
        out = []
        with contextlib.suppress(OSError), self.log_path.open("rb") as f:
            for line in f:
                if line.startswith(b"{"):
                    with contextlib.suppress(ValueError):
                        out.append(json.loads(line))
        if not self.alive():
            self._records = out
        return out

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.read_records() if r.get("event") == name]

    def assigned(self) -> set[str]:
        """A consumer's partitions now, from its logged incremental (cooperative)
        assignments, revocations and losses."""
        held: set[str] = set()
        for r in self.read_records():
            event = r.get("event")
            if event == "partitions-assigned":
                held.update(str(tp) for tp in r.get("partitions", []))
            elif event in ("partitions-revoked", "partitions-lost"):
                held.difference_update(str(tp) for tp in r.get("partitions", []))
        return held

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""
