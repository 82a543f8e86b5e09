"""One benchmark run's private resources: its database, its topics, its Redis prefix.

Everything is named after the run id and removed when the run ends (unless
``keep`` is set, for poking at the rows afterwards), so runs never see each
other's data and never touch a test's.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import queue
import re
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.config import BenchConfig
from bench.dblog import log_settings

REPO_ROOT = Path(__file__).resolve().parent.parent


def drop_database(conn: sa.Connection, name: str, *, postgresql: bool) -> None:
    """Drop a database the run (or a test) made, whoever is still connected to it.

    ``conn`` must be in AUTOCOMMIT: PostgreSQL drops databases outside a
    transaction only.
    """
    drop = f"DROP DATABASE IF EXISTS {name}"
    if not postgresql:
        conn.execute(sa.text(drop))
        return
    try:
        # FORCE: a relay killed by a failed scenario, a test's LISTEN or a
        # leaked pool may still hold a session.
        conn.execute(sa.text(f"{drop} WITH (FORCE)"))
    except sa.exc.ProgrammingError as exc:
        # FORCE may not end a backend of another role: an autovacuum worker
        # that started on the run's tables (full runs failed so, in the suite
        # and in the bench). A plain DROP stops autovacuum workers itself.
        if "must be a member of the role" not in str(exc.orig):
            raise
        conn.execute(sa.text(drop))


@dataclass(frozen=True, kw_only=True)
class Services:
    """Where the services are: a DB *server* URL (its database part is ignored)."""

    db_url: str
    kafka_bootstrap: str
    redis_url: str | None = None

    @classmethod
    def from_env(cls) -> Services:
        """From the ``OUTBOXKIT_TEST_*`` variables that ``deploy/local/up.sh`` prints."""
        try:
            return cls(
                db_url=os.environ["OUTBOXKIT_TEST_DB_URL"],
                kafka_bootstrap=os.environ["OUTBOXKIT_TEST_KAFKA_BOOTSTRAP"],
                redis_url=os.environ.get("OUTBOXKIT_TEST_REDIS_URL") or None,
            )
        except KeyError as exc:
            raise SystemExit(
                f"{exc.args[0]} is not set: run ./bench/run.sh, or "
                'eval "$(deploy/local/up.sh)" first'
            ) from None


def is_postgresql(url: str) -> bool:
    return sa.make_url(url).get_backend_name() == "postgresql"


def new_run_id() -> str:
    return time.strftime("%Y%m%d_%H%M%S") + "_" + secrets.token_hex(2)


@dataclass
class BenchContext:
    """Resources of one run; use as a context manager so they are cleaned up."""

    config: BenchConfig
    services: Services
    run_id: str = field(default_factory=new_run_id)
    keep: bool = False
    #: Attach py-spy to the first relay of each drain (see bench/profile.py).
    profile: bool = False
    results_dir: Path = REPO_ROOT / "bench" / "results"
    engine: sa.Engine = field(init=False)
    db_url: str = field(init=False)
    #: Things scenarios build once per run and share (e.g. the backlog template).
    cache: dict[str, Any] = field(default_factory=dict, init=False)
    _topics: list[str] = field(default_factory=list, init=False)
    _admin: Any = field(default=None, init=False)

    @property
    def database(self) -> str:
        return f"outboxkit_bench_{self.run_id}"

    @property
    def postgresql(self) -> bool:
        """The run's database is PostgreSQL (else MySQL/MariaDB)."""
        return is_postgresql(self.services.db_url)

    @property
    def log_dir(self) -> Path:
        """Logs of the processes under test (kept after the run, for a look when one fails)."""
        return self.results_dir / "logs" / self.run_id

    @property
    def redis_prefix(self) -> str:
        return f"outboxkit-bench:{self.run_id}:"

    def __enter__(self) -> BenchContext:
        server = sa.make_url(self.services.db_url)
        # AUTOCOMMIT: PostgreSQL creates and drops databases outside a transaction only.
        admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f"CREATE DATABASE {self.database}"))
        finally:
            admin.dispose()
        self.db_url = server.set(database=self.database).render_as_string(hide_password=False)
        self.engine = sa.create_engine(self.db_url, pool_size=8, max_overflow=8)
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.dispose()
        if self.keep:
            print(f"kept database {self.database} and topics {self._topics}")
            return
        self._delete_topics()
        self._delete_redis_keys()
        admin = sa.create_engine(sa.make_url(self.services.db_url), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                drop_database(conn, self.database, postgresql=self.postgresql)
        finally:
            admin.dispose()

    # -- Kafka ---------------------------------------------------------------

    @property
    def admin(self) -> Any:
        if self._admin is None:
            from confluent_kafka.admin import AdminClient

            # log_level 4: no notices about the run's own topics being deleted.
            self._admin = AdminClient(
                {"bootstrap.servers": self.services.kafka_bootstrap, "log_level": 4}
            )
        return self._admin

    def topic(self, suffix: str, *, partitions: int | None = None, name: str | None = None) -> str:
        """Create a topic for this run (Kafka's auto-create is off).

        Broker append time is the message timestamp, so a message's timestamp is
        when the broker acknowledged it, on the same clock as the writer.
        """
        from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

        name = name or f"bench-{self.run_id.replace('_', '-')}-{suffix}"
        spec = NewTopic(
            name,
            num_partitions=partitions or self.config.partitions,
            replication_factor=1,
            config={"message.timestamp.type": "LogAppendTime"},
        )
        futures = self.admin.create_topics([spec], operation_timeout=30, request_timeout=30)
        futures[name].result(timeout=40)
        self._topics.append(name)
        _wait_for_topic(self.admin, name, 30.0)
        return name

    def delete_topic(self, name: str) -> None:
        if name in self._topics:
            self._topics.remove(name)
        with contextlib.suppress(Exception):  # best effort: the run's end retries nothing
            self.admin.delete_topics([name], operation_timeout=30)[name].result(timeout=40)

    def _delete_topics(self) -> None:
        if not self._topics:
            return
        futures = self.admin.delete_topics(list(self._topics), operation_timeout=30)
        for fut in futures.values():
            with contextlib.suppress(Exception):
                fut.result(timeout=40)
        self._topics.clear()

    def _delete_redis_keys(self) -> None:
        if not self.services.redis_url:
            return
        import redis

        client = redis.Redis.from_url(self.services.redis_url)
        try:
            for key in client.scan_iter(match=self.redis_prefix + "*", count=1000):
                client.delete(key)
        except redis.RedisError:
            pass
        finally:
            client.close()

    # -- versions ------------------------------------------------------------

    def versions(self) -> dict[str, Any]:
        import confluent_kafka

        with self.engine.connect() as conn:
            db_version = conn.execute(sa.text("SELECT VERSION()")).scalar_one()
            if self.postgresql:
                db_vars = {
                    str(name): str(value)
                    for name, value in conn.execute(
                        sa.text(
                            "SELECT name, setting FROM pg_settings WHERE name IN ("
                            "'shared_buffers', 'synchronous_commit', 'fsync', 'wal_level',"
                            " 'full_page_writes')"
                        )
                    )
                }
            else:
                db_vars = {
                    str(name): str(value)
                    for name, value in conn.execute(
                        sa.text(
                            "SHOW VARIABLES WHERE Variable_name IN ('innodb_buffer_pool_size',"
                            " 'innodb_flush_log_at_trx_commit', 'sync_binlog', 'log_bin')"
                        )
                    )
                }
        return {
            "python": platform.python_version(),
            "confluent_kafka": _dist_version("confluent-kafka"),
            "librdkafka": confluent_kafka.libversion()[0],
            "sqlalchemy": sa.__version__,
            # Distribution versions: pymysql.__version__ is a MySQLdb-compatibility string.
            "pymysql": _dist_version("PyMySQL"),
            "psycopg": _dist_version("psycopg"),
            "database_kind": "postgresql" if self.postgresql else "mysql",
            "database": db_version,
            "database_settings": db_vars,
            "database_log": log_settings(self.engine),
            "kafka": kafka_version(),
            "outboxkit_commit": git_commit(),
        }


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "memory_gib": _memory_gib(),
        "loadavg_at_start": [round(x, 2) for x in load],
        "services": "co-located on this machine",
        **thread_handoff(),
    }


def thread_handoff(rounds: int = 5000) -> dict[str, float | None]:
    """Microseconds per round trip of a value between two Python threads (a queue
    each way), on whatever cores the scheduler picks and with both threads on one
    core. Every service here hands work between threads (the relay and its
    producer's threads, the consumer's poll loop and workers, a database's
    connection threads): when a wake-up on another core is dear (a virtual
    machine's cross-core interrupts), all of them slow down together, which the
    load average does not show. Measured once per run so that runs compare."""

    def round_trip_us() -> float:
        there: queue.SimpleQueue[int] = queue.SimpleQueue()
        back: queue.SimpleQueue[int] = queue.SimpleQueue()

        def echo() -> None:
            for _ in range(rounds):
                back.put(there.get())

        t = threading.Thread(target=echo, daemon=True)
        t.start()
        start = time.perf_counter()
        for i in range(rounds):
            there.put(i)
            back.get()
        elapsed = time.perf_counter() - start
        t.join()
        return round(elapsed / rounds * 1e6, 1)

    spread = round_trip_us()
    one_core: float | None = None
    if hasattr(os, "sched_getaffinity"):
        cores = os.sched_getaffinity(0)
        # A thread inherits its creator's affinity: pin this one, start the echo, restore.
        os.sched_setaffinity(0, {min(cores)})
        try:
            one_core = round_trip_us()
        finally:
            os.sched_setaffinity(0, cores)
    return {"thread_handoff_us": spread, "thread_handoff_one_core_us": one_core}


def kafka_version() -> str | None:
    """The broker version that ``deploy/local/kafka.sh`` installs (its pom's property)."""
    pom = REPO_ROOT / "deploy" / "local" / "kafka" / "pom.xml"
    with contextlib.suppress(OSError):
        m = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", pom.read_text())
        if m:
            return m.group(1)
    return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return None


def _wait_for_topic(admin: Any, name: str, timeout: float) -> None:
    """Creation returns before every partition has a leader; producing then errs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        md = admin.list_topics(topic=name, timeout=5)
        t = md.topics.get(name)
        if (
            t is not None
            and t.error is None
            and t.partitions
            and all(p.leader >= 0 for p in t.partitions.values())
        ):
            return
        time.sleep(0.1)
    raise TimeoutError(f"topic {name} has no leaders after {timeout}s")


@contextlib.contextmanager
def timer() -> Iterator[list[float]]:
    """``with timer() as t: ...`` then ``t[0]`` is the elapsed seconds."""
    out: list[float] = []
    start = time.perf_counter()
    try:
        yield out
    finally:
        out.append(time.perf_counter() - start)
