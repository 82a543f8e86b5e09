"""Processes under test and the CPU they use.

Relays (and consumers) run as their own processes through the real CLI, as
they do in a pod: several of them are not serialised by one interpreter lock,
and SIGTERM reaches them the way Kubernetes sends it.  They are configured
through ``OUTBOXKIT_*`` variables, which every setting has.

CPU time comes from ``/proc/<pid>/stat``, for the processes under test and
for the co-located MariaDB and Kafka, so a table can say which one was busy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (and its reaped children), None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # Fields after the command: state is [0]; utime [11], stime [12], cutime [13], cstime [14].
    return sum(int(x) for x in fields[11:15]) / _CLK_TCK


def _env(settings: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _is_setting(k)}
    env.update(settings)
    return env


def _is_setting(name: str) -> bool:
    # OUTBOXKIT_TEST_* are the test suite's service addresses, not settings.
    return name.startswith("OUTBOXKIT_") and not name.startswith("OUTBOXKIT_TEST_")


@dataclass
class Proc:
    """One ``outboxkit <command>`` process with its output in a log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    started: float
    _log: IO[bytes] | None = None
    cpu_at_start: float = 0.0
    exit_seconds: float | None = None
    cpu_total: float | None = None

    @classmethod
    def start(cls, name: str, argv: list[str], settings: dict[str, str], log_dir: Path) -> Proc:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        log = log_path.open("wb")
        popen = subprocess.Popen(
            [sys.executable, "-m", "outboxkit", *argv],
            env=_env(settings),
            # Not the checkout: its outboxkit/ folder would shadow the installed package.
            cwd=tempfile.gettempdir(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        return cls(name, popen, log_path, time.perf_counter(), log)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu(self) -> float | None:
        return cpu_seconds(self.pid)

    def wait_for_log(self, text: str, timeout: float) -> None:
        """Wait until the process logged ``text`` (e.g. its started event)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if text in self.log_path.read_text(errors="replace"):
                    return
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not log {text!r} in {timeout}s:\n{self.log_tail()}")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the exit; return the exit code and record how long it took."""
        last_cpu = self.cpu()
        t0 = time.perf_counter()
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait(10)
            raise RuntimeError(f"{self.name} did not exit {timeout}s after SIGTERM") from None
        finally:
            self.exit_seconds = time.perf_counter() - t0
            self.cpu_total = last_cpu
            if self._log is not None:
                self._log.close()
                self._log = None
        return code

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def relay_settings(
    *,
    db_url: str,
    bootstrap: str,
    table: str,
    node_id: str,
    batch_size: int | None = None,
    delete_on_deliver: bool = False,
    redis_url: str | None = None,
    redis_prefix: str | None = None,
    pipeline: bool | None = None,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    settings = {
        "OUTBOXKIT_DB_URL": db_url,
        "OUTBOXKIT_KAFKA_BOOTSTRAP": bootstrap,
        "OUTBOXKIT_TABLE": table,
        "OUTBOXKIT_NODE_ID": node_id,
        "OUTBOXKIT_SERVICE": "bench-relay",
        "OUTBOXKIT_HEALTH_PORT": "0",
        "OUTBOXKIT_START_JITTER": "0",
        "OUTBOXKIT_LOG_LEVEL": "INFO",
        "OUTBOXKIT_DELETE_ON_DELIVER": "true" if delete_on_deliver else "false",
    }
    if batch_size:
        settings["OUTBOXKIT_BATCH_SIZE"] = str(batch_size)
    if pipeline is not None:
        settings["OUTBOXKIT_PIPELINE"] = "true" if pipeline else "false"
    if redis_url:
        settings["OUTBOXKIT_REDIS_URL"] = redis_url
        if redis_prefix:
            settings["OUTBOXKIT_REDIS_PREFIX"] = redis_prefix
    settings.update(extra or {})
    return settings


@dataclass
class ServiceCpu:
    """CPU seconds of the co-located database and broker over an interval."""

    pids: dict[str, int]
    start: dict[str, float] = field(default_factory=dict)

    @classmethod
    def find(cls, engine: sa.Engine, bootstrap: str) -> ServiceCpu:
        pids: dict[str, int] = {}
        db = _mariadb_pid(engine)
        if db:
            pids["mariadb"] = db
        kafka = _kafka_pid(bootstrap)
        if kafka:
            pids["kafka"] = kafka
        return cls(pids)

    def begin(self) -> None:
        self.start = {k: cpu_seconds(p) or 0.0 for k, p in self.pids.items()}

    def used(self) -> dict[str, float]:
        out = {}
        for k, p in self.pids.items():
            now = cpu_seconds(p)
            if now is not None:
                out[k] = now - self.start.get(k, 0.0)
        return out


def _mariadb_pid(engine: sa.Engine) -> int | None:
    with contextlib.suppress(Exception), engine.connect() as conn:
        path = conn.execute(sa.text("SELECT @@pid_file")).scalar_one()
        return int(Path(str(path)).read_text().split()[0])
    return None


def _kafka_pid(bootstrap: str) -> int | None:
    """The broker process whose config listens on the bootstrap port (not a test's instance)."""
    port = bootstrap.rsplit(":", 1)[-1].split(",")[0]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kafka.Kafka" not in argv:
            continue
        props = argv[argv.index(b"kafka.Kafka") + 1 :]
        with contextlib.suppress(OSError, IndexError):
            text = Path(props[0].decode()).read_text()
            if f"PLAINTEXT://127.0.0.1:{port}" in text or f"PLAINTEXT://localhost:{port}" in text:
                return int(proc.name)
    return None


def cpu_share(seconds: float | None, wall: float) -> Any:
    """CPU seconds as a share of one core over ``wall`` seconds (1.0 = one core busy)."""
    if seconds is None or wall <= 0:
        return None
    return seconds / wall
