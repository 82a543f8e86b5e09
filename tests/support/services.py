"""Dedicated local service instances for fault tests.

Each instance is started and stopped through the ``deploy/local/*.sh`` scripts
with its own ``--name`` and ports, so a test can stop, kill or pause it without
disturbing the shared default instances that other tests use::

    with KafkaInstance("kafka-fault", *free_ports(2)) as kafka:
        ...  # kafka.bootstrap
        kafka.kill()
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCAL_DIR = REPO_ROOT / "deploy" / "local"
STATE_DIR = Path(os.environ.get("OUTBOXKIT_LOCAL_STATE", LOCAL_DIR / ".state"))

SCRIPT_TIMEOUT_S = 300.0


#: Ports for the suite's own instances and servers come from below the kernel's
#: ephemeral range (32768-60999 by default on Linux), split evenly between the
#: pytest-xdist workers. ``bind(("127.0.0.1", 0))`` would hand out a port from
#: that range and free it again at once: between then and the service's own
#: bind, any outgoing connection of any process may take it as its local port,
#: and the other worker, probing the same way, may be handed it too. Below the
#: range the kernel assigns no port on its own, and the blocks keep the workers
#: apart.
TEST_PORTS = range(20000, 32000)
MIN_PORT_BLOCK = 100


def port_block(worker: str | None = None, workers: int | None = None) -> range:
    """The ports this test process hands out: its pytest-xdist worker's block.

    ``worker`` and ``workers`` default to ``PYTEST_XDIST_WORKER`` (``gw0``,
    ``gw1``, ...) and ``PYTEST_XDIST_WORKER_COUNT``; a run without workers, and
    the chaos runner on its own, have all of :data:`TEST_PORTS`.
    """
    if worker is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    if workers is None:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not (worker.startswith("gw") and worker[2:].isdigit()):
        raise ValueError(f"not a pytest-xdist worker id: {worker!r}")
    most = len(TEST_PORTS) // MIN_PORT_BLOCK
    if not 1 <= workers <= most:
        raise ValueError(f"the suite's ports are shared by 1 to {most} workers, not {workers}")
    index = int(worker[2:])
    if index >= workers:
        raise ValueError(f"worker {worker} is not one of {workers} workers")
    size = len(TEST_PORTS) // workers
    start = TEST_PORTS.start + index * size
    return range(start, start + size)


_port_cursor: itertools.count[int] | None = None


def _port_is_free(port: int) -> bool:
    """Nothing is bound to ``port`` on 127.0.0.1 (or on every address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` free ports from this process's block, none handed out before.

    The block is walked in turn from a random start, so ports are not reused
    until it wraps (6,000 ports with two workers; a whole run hands out a few
    hundred), and a port something is bound to is passed over.
    """
    global _port_cursor
    block = port_block()
    if _port_cursor is None:
        _port_cursor = itertools.count(random.randrange(len(block)))
    ports: list[int] = []
    for _ in range(len(block)):
        port = block[next(_port_cursor) % len(block)]
        if _port_is_free(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(
        f"fewer than {count} free ports in {block.start}-{block.stop - 1} on 127.0.0.1"
    )


class ServiceInstance:
    """One named instance of a service managed by ``deploy/local/<service>.sh``."""

    service: ClassVar[str]

    def __init__(self, name: str, port: int) -> None:
        if name == "default":
            raise ValueError("the default instance is shared; use a dedicated name")
        self.name = name
        self.port = port

    # -- scripts -----------------------------------------------------------
    def _extra_args(self) -> list[str]:
        return []

    def _script(self, command: str, *, check: bool = True) -> int:
        args = [
            str(LOCAL_DIR / f"{self.service}.sh"),
            command,
            "--name",
            self.name,
            "--port",
            str(self.port),
            *self._extra_args(),
        ]
        proc = subprocess.run(
            args,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
            check=False,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args[:4])} failed with exit {proc.returncode}:\n{proc.stderr}"
            )
        return proc.returncode

    @property
    def state_dir(self) -> Path:
        return STATE_DIR / f"{self.service}-{self.name}"

    @property
    def pid(self) -> int | None:
        try:
            return int((self.state_dir / "pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def start(self, *, fresh: bool = False) -> Self:
        """Start (or keep) the instance and wait until it answers.

        ``fresh=True`` first stops it and deletes its data (topics, databases).
        """
        if fresh:
            self.stop()
            shutil.rmtree(self.state_dir / "data", ignore_errors=True)
        self._script("start")
        return self

    def stop(self) -> None:
        """Clean shutdown (SIGTERM, SIGKILL after a timeout)."""
        self.resume()
        self._script("stop")

    def kill(self) -> None:
        """Hard crash: SIGKILL, no shutdown work."""
        self.resume()
        self._script("kill")

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): connections stay open but nothing answers."""
        pid = self.pid
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def is_running(self) -> bool:
        return self._script("status", check=False) == 0

    def wait_port_closed(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
            except OSError:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.service} {self.name} still listens on {self.port}")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class KafkaInstance(ServiceInstance):
    """A single-node KRaft broker; ``message_max_bytes`` caps the broker's record batch size.

    ``proxied_port`` adds a second listener that advertises ``proxied_advertised_port``:
    clients bootstrapping through a TCP proxy on that port stay behind the proxy.
    ``sasl_port``: also listen there with SASL PLAIN and an authorizer (see
    ``deploy/local/kafka.sh``); :meth:`sasl_config` logs in as ``limited`` (no ACLs
    until granted) or ``admin``. The plain port stays open as super user.
    """

    service = "kafka"

    def __init__(
        self,
        name: str,
        port: int,
        controller_port: int,
        message_max_bytes: int | None = None,
        *,
        proxied_port: int | None = None,
        proxied_advertised_port: int | None = None,
        sasl_port: int | None = None,
    ) -> None:
        super().__init__(name, port)
        self.controller_port = controller_port
        self.message_max_bytes = message_max_bytes
        self.proxied_port = proxied_port
        self.proxied_advertised_port = proxied_advertised_port
        self.sasl_port = sasl_port

    def _extra_args(self) -> list[str]:
        mmb = "" if self.message_max_bytes is None else str(self.message_max_bytes)
        sasl = "" if self.sasl_port is None else str(self.sasl_port)
        args = [
            "--controller-port",
            str(self.controller_port),
            "--message-max-bytes",
            mmb,
            "--sasl-port",
            sasl,
        ]
        if self.proxied_port is not None:
            advertised = self.proxied_advertised_port or self.proxied_port
            args += [
                "--proxied-port",
                str(self.proxied_port),
                "--proxied-advertised-port",
                str(advertised),
            ]
        return args

    @property
    def sasl_bootstrap(self) -> str:
        assert self.sasl_port is not None, "started without sasl_port"
        return f"127.0.0.1:{self.sasl_port}"

    def sasl_config(self, user: str = "limited") -> dict[str, str]:
        """librdkafka properties to log in on the SASL listener as ``user``."""
        return {
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "PLAIN",
            "sasl.username": user,
            "sasl.password": f"{user}-secret",
        }

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"


class RedisInstance(ServiceInstance):
    service = "redis"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class PushgatewayInstance(ServiceInstance):
    service = "pushgateway"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class MariaDBInstance(ServiceInstance):
    """``binlog``: the binary log on, row format, full row images
    (``mariadb.sh --binlog on``), as production runs MariaDB."""

    service = "mariadb"

    def __init__(self, name: str, port: int, *, binlog: bool = False) -> None:
        super().__init__(name, port)
        self.binlog = binlog

    def _extra_args(self) -> list[str]:
        return ["--binlog", "on" if self.binlog else "off"]

    @property
    def url(self) -> str:
        return f"mysql+pymysql://outboxkit:outboxkit@127.0.0.1:{self.port}/outboxkit_test"


class PostgresInstance(ServiceInstance):
    """PostgreSQL 15; ``kill()`` SIGKILLs the postmaster and every backend.
    ``wal_level`` and ``full_page_writes`` as ``postgres.sh`` takes them (its
    defaults: replica, off)."""

    service = "postgres"

    def __init__(
        self, name: str, port: int, *, wal_level: str = "replica", full_page_writes: bool = False
    ) -> None:
        super().__init__(name, port)
        self.wal_level = wal_level
        self.full_page_writes = full_page_writes

    def _extra_args(self) -> list[str]:
        return [
            "--wal-level",
            self.wal_level,
            "--full-page-writes",
            "on" if self.full_page_writes else "off",
        ]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://outboxkit:outboxkit@127.0.0.1:{self.port}/outboxkit_test"
