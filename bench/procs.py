"""Processes under test and the CPU they use.

Relays (and consumers) run as their own processes through the real CLI, as
they do in a pod: several of them are not serialised by one interpreter lock,
and SIGTERM reaches them the way Kubernetes sends it.  They are configured
through ``OUTBOXKIT_*`` variables, which every setting has.

CPU time comes from ``/proc/<pid>/stat``, for the processes under test and
for the co-located MariaDB, Kafka and Redis, so a table can say which one was
busy; ``/proc/stat`` gives the whole machine's.  Peak memory is the kernel's
high-water mark of a process's resident set (``VmHWM`` in ``/proc/<pid>/status``),
read while the process is still alive.
"""

from __future__ import annotations

import contextlib
import json
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


def tree_cpu_seconds(pid: int) -> float | None:
    """:func:`cpu_seconds` of ``pid`` plus that of its live children.

    PostgreSQL serves each connection from a child process of the postmaster;
    a child's CPU joins the postmaster's own count only once it has exited.
    """
    own = cpu_seconds(pid)
    if own is None:
        return None
    children = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError, ValueError):
        for child in children.read_text().split():
            own += cpu_seconds(int(child)) or 0.0
    return own


def peak_rss_mb(pid: int) -> float | None:
    """Peak resident set (``VmHWM``) of ``pid`` in MB (10^6 bytes), None if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    except (OSError, ValueError, IndexError):
        return None
    return None


def machine_cpu_seconds() -> float | None:
    """CPU seconds all cores spent busy since boot (``/proc/stat``: not idle, not iowait)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if first[0] != "cpu":
        return None
    ticks = [int(x) for x in first[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / _CLK_TCK


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

    def peak_rss_mb(self) -> float | None:
        """Peak resident set so far; read it before :meth:`terminate`."""
        return peak_rss_mb(self.pid)

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

    def logged(self, event: str) -> dict[str, Any] | None:
        """The first JSON log line of ``event`` (e.g. ``relay-started``), or None."""
        with contextlib.suppress(OSError):
            for line in self.log_path.read_text(errors="replace").splitlines():
                if f'"{event}"' not in line:
                    continue
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("event") == event:
                        return record
        return None

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
    """CPU seconds of the co-located database, broker and Redis over an interval,
    and of the whole machine (``machine``: every process, the benchmark's own and
    anything else running, as a shared machine has)."""

    pids: dict[str, int]
    start: dict[str, float] = field(default_factory=dict)
    machine_start: float | None = None

    @classmethod
    def find(cls, engine: sa.Engine, bootstrap: str, redis_url: str | None = None) -> ServiceCpu:
        pids = cls.database(engine).pids
        kafka = _kafka_pid(bootstrap)
        if kafka:
            pids["kafka"] = kafka
        redis = _redis_pid(redis_url) if redis_url else None
        if redis:
            pids["redis"] = redis
        return cls(pids)

    @classmethod
    def database(cls, engine: sa.Engine) -> ServiceCpu:
        """The database server's process alone (none when it is not on this machine)."""
        name = engine.dialect.name
        pid = _postgres_pid(engine) if name == "postgresql" else _mariadb_pid(engine)
        return cls({"postgresql" if name == "postgresql" else "mariadb": pid} if pid else {})

    def begin(self) -> None:
        self.start = {k: tree_cpu_seconds(p) or 0.0 for k, p in self.pids.items()}
        self.machine_start = machine_cpu_seconds()

    def used(self) -> dict[str, float]:
        out = {}
        for k, p in self.pids.items():
            now = tree_cpu_seconds(p)
            if now is not None:
                out[k] = now - self.start.get(k, 0.0)
        return out

    def machine_used(self) -> float | None:
        now = machine_cpu_seconds()
        if now is None or self.machine_start is None:
            return None
        return now - self.machine_start


#: The database server counts as quiet below this share of one core.
QUIET_SHARE = 0.05


def wait_database_quiet(engine: sa.Engine, *, timeout: float, window: float = 1.0) -> float:
    """Wait until the database server (this machine's) used under ``QUIET_SHARE``
    of a core over ``window`` seconds, at most ``timeout`` (0: no wait; a server
    that never goes quiet is measured anyway); the seconds waited.

    Before a measured drain: the work a scenario leaves behind (InnoDB purging
    the undo of millions of status changes, dropping a table's pages, flushing a
    fresh copy's pages) otherwise runs during the next drain, and its rate and
    CPU per event are then partly the previous scenario's. Seen: the first
    relay drain after the DB ceiling's copies at 10,649 events/s and 7.71 CPU
    s/100k, the same configuration at 12,881 and 6.18 later in the same run,
    and at 13,035 and 6.19 as the first drain of a run without the ceiling."""
    meter = ServiceCpu.database(engine)
    if not meter.pids or timeout <= 0:
        return 0.0
    t0 = time.perf_counter()
    while True:
        meter.begin()
        time.sleep(window)
        if sum(meter.used().values()) < QUIET_SHARE * window:
            break
        if time.perf_counter() - t0 >= timeout:
            break
    return time.perf_counter() - t0


def _mariadb_pid(engine: sa.Engine) -> int | None:
    with contextlib.suppress(Exception), engine.connect() as conn:
        path = conn.execute(sa.text("SELECT @@pid_file")).scalar_one()
        return int(Path(str(path)).read_text().split()[0])
    return None


def _postgres_pid(engine: sa.Engine) -> int | None:
    """The postmaster: the parent of this connection's backend process, if on this machine."""
    with contextlib.suppress(Exception), engine.connect() as conn:
        backend = int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        parent = int(Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if b"postgres" in Path(f"/proc/{parent}/cmdline").read_bytes():
            return parent
    return None


def _redis_pid(url: str) -> int | None:
    """The Redis server's own pid (``INFO server``), if it runs on this machine."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        pid = int(client.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()
    with contextlib.suppress(OSError):
        if b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    return None  # another machine's, or a pid this machine does not know


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
