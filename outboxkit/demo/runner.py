"""``outboxkit demo``: the whole flow on one machine, with live counts.

Steps, in order:

1. services: MariaDB, Kafka and Redis from ``deploy/local/up.sh`` (installed and
   started when missing), unless ``--db-url``/``--kafka-bootstrap``/``--redis-url``
   point at running ones;
2. the database ``outboxkit_demo`` (created if missing), the outbox schema, the
   demo tables, and the topics ``orders`` and ``orders.dlq``;
3. two ``outboxkit relay`` processes (shards shared through Redis) and one
   ``outboxkit consume outboxkit.demo:OrderConsumer`` with its inbox on;
4. the order service writes orders and their events (one transaction each) at
   ``--rate`` per second for ``--duration`` seconds, while a line shows
   written / delivered / consumed and the rates;
5. once everything written is delivered and consumed (or ``--settle-timeout``
   passed), every process gets one SIGTERM and drains; a summary follows.

Every count belongs to this run (a run id on the order rows), so runs can follow
each other on the same database. Ctrl-C stops writing and goes on with step 5
(waiting a little for what is in flight); a second Ctrl-C drains at once. The
child processes run in their own session, so the terminal's Ctrl-C reaches only
this process, and each child gets exactly one SIGTERM: a clean drain, not a hurry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outboxkit.demo.service import place_order
from outboxkit.demo.tables import create_tables, orders, shipments
from outboxkit.runtime.db import database_url_problem, driver_message
from outboxkit.runtime.errors import ConfigError, DependencyError
from outboxkit.runtime.logs import redact, redact_url
from outboxkit.schema.apply import apply_schema
from outboxkit.schema.table import DEFAULT_TABLE, Status, outbox_table

__all__ = ["DemoOptions", "Summary", "run_demo"]

DEMO_DATABASE = "outboxkit_demo"
DLQ_SUFFIX = ".dlq"
#: Short enough for a demo, long enough for a drain (the relays' flush timeout is 5 s).
CHILD_SHUTDOWN_TIMEOUT = 20.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoOptions:
    db_url: str | None = None
    kafka_bootstrap: str | None = None
    redis_url: str | None = None
    duration: float = 20.0
    rate: float = 200.0
    relays: int = 2
    topic: str = "orders"
    settle_timeout: float = 60.0
    state_dir: Path | None = None
    #: OUTBOXKIT_LOG_FORMAT of the children (their logs go to files: auto means json).
    log_format: str = "json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Summary:
    run_id: str
    written: int
    delivered: int
    consumed: int
    seconds: float
    writing_s: float
    settled_s: float | None
    exit_codes: dict[str, int | None]
    metrics_urls: dict[str, str]
    logs: Path
    interrupted: bool

    @property
    def ok(self) -> bool:
        return self.written == self.delivered == self.consumed and all(
            code == 0 for code in self.exit_codes.values()
        )


@dataclasses.dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path


class _Interrupts:
    """Ctrl-C / SIGTERM: the first stops writing, the second skips the wait."""

    def __init__(self) -> None:
        self.stop_writing = threading.Event()
        self.hurry = threading.Event()

    def handler(self, signum: int, frame: object) -> None:
        if self.stop_writing.is_set():
            self.hurry.set()
        self.stop_writing.set()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        previous = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def run_demo(options: DemoOptions, *, out: TextIO = sys.stdout) -> Summary:
    """Run the demo and return its summary (also printed to ``out``)."""
    interrupts = _Interrupts()
    with interrupts.installed():
        return _Demo(options, out, interrupts).run()


class _Demo:
    def __init__(self, options: DemoOptions, out: TextIO, interrupts: _Interrupts) -> None:
        self.o = options
        self.out = out
        self.interrupts = interrupts
        self.run_id = secrets.token_hex(4)
        self.children: list[_Child] = []
        self.written = 0
        self._writer_finished = False
        self._sample: tuple[float, int, int, int] | None = None
        self._watch_started = 0.0
        self.writing_s = 0.0
        self.settled_s: float | None = None
        self.write_errors: list[BaseException] = []

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    # -- the steps ---------------------------------------------------------------------

    def run(self) -> Summary:
        db_url, kafka, redis_url = self._services()
        state = self._state_dir()
        engine = self._prepare_database(db_url)
        try:
            self._create_topics(kafka)
            started = time.monotonic()
            try:
                self._start_children(db_url, kafka, redis_url, state)
                self._wait_ready()
                self._write_and_watch(engine)
                self._settle(engine)
            finally:
                codes = self._drain_children()
            seconds = time.monotonic() - started
            written, delivered, consumed = self._counts(engine)
        finally:
            engine.dispose()
        summary = Summary(
            run_id=self.run_id,
            written=written,
            delivered=delivered,
            consumed=consumed,
            seconds=seconds,
            writing_s=self.writing_s,
            settled_s=self.settled_s,
            exit_codes=codes,
            metrics_urls={c.name: f"http://127.0.0.1:{c.port}/metrics" for c in self.children},
            logs=state,
            interrupted=not self._writer_finished,
        )
        self._print_summary(summary, db_url)
        return summary

    def _services(self) -> tuple[str, str, str]:
        o = self.o
        if o.db_url and o.kafka_bootstrap and o.redis_url:
            return _with_database(o.db_url), o.kafka_bootstrap, o.redis_url
        up = _find_up_script()
        self.say(f"starting local services with {up} (first run installs them; takes a while)")
        proc = subprocess.run(
            [str(up)], stdout=subprocess.PIPE, stderr=sys.stderr, text=True, check=False
        )
        if proc.returncode != 0:
            raise DependencyError(f"{up} failed with exit code {proc.returncode}")
        found: dict[str, str] = {}
        for line in proc.stdout.splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            found[name.strip()] = value.strip().strip("'\"")
        db = o.db_url or found.get("OUTBOXKIT_TEST_DB_URL")
        kafka = o.kafka_bootstrap or found.get("OUTBOXKIT_TEST_KAFKA_BOOTSTRAP")
        redis_url = o.redis_url or found.get("OUTBOXKIT_TEST_REDIS_URL")
        if not (db and kafka and redis_url):
            raise DependencyError(f"{up} did not print the service addresses")
        return _with_database(db), kafka, redis_url

    def _state_dir(self) -> Path:
        base = self.o.state_dir or Path.cwd() / ".outboxkit-demo"
        path = base / self.run_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _prepare_database(self, db_url: str) -> Engine:
        url = sa.make_url(db_url)
        server = sa.create_engine(url.set(database=""))
        try:
            with server.begin() as conn:
                conn.execute(sa.text(f"CREATE DATABASE IF NOT EXISTS {url.database}"))
        except sa.exc.OperationalError as exc:
            problem = database_url_problem(exc, db_url)
            if problem is not None:  # a refused login: the URL's fault (exit 2)
                raise ConfigError(f"invalid --db-url: {problem}") from None
            raise DependencyError(
                f"database {redact_url(db_url)} unreachable: {redact(driver_message(exc))}"
            ) from None
        finally:
            server.dispose()
        engine = sa.create_engine(db_url, pool_size=4, pool_pre_ping=True)
        report = apply_schema(engine)
        create_tables(engine)
        self.say(
            f"database {redact_url(db_url)}: outbox table {report.table} "
            f"({report.shard_count} shards), outboxkit_demo_orders, outboxkit_demo_shipments"
        )
        return engine

    def _create_topics(self, bootstrap: str) -> None:
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient({"bootstrap.servers": bootstrap})
        topics = [self.o.topic, self.o.topic + DLQ_SUFFIX]
        futures = admin.create_topics(
            [NewTopic(t, num_partitions=3, replication_factor=1) for t in topics],
            operation_timeout=20,
            request_timeout=20,
        )
        for name, fut in futures.items():
            try:
                fut.result(timeout=30)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise DependencyError(
                        f"Kafka at {bootstrap}: cannot create {name}: {exc}"
                    ) from None
        self.say(f"kafka {bootstrap}: topics {', '.join(topics)}")

    def _start_children(self, db_url: str, kafka: str, redis_url: str, state: Path) -> None:
        common = {
            "OUTBOXKIT_DB_URL": db_url,
            "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka,
            "OUTBOXKIT_SHUTDOWN_TIMEOUT": str(CHILD_SHUTDOWN_TIMEOUT),
            "OUTBOXKIT_LOG_LEVEL": "INFO",
            "OUTBOXKIT_LOG_FORMAT": self.o.log_format,
        }
        for n in range(1, self.o.relays + 1):
            self._spawn(
                f"relay-{n}",
                ["relay"],
                {
                    **common,
                    "OUTBOXKIT_SERVICE": "demo-relay",
                    "OUTBOXKIT_NODE_ID": f"demo-relay-{n}",
                    "OUTBOXKIT_REDIS_URL": redis_url,
                    "OUTBOXKIT_POLL_INTERVAL": "0.2",
                    "OUTBOXKIT_FLUSH_TIMEOUT": "5",
                    # This run's shard leases only: never shared with other relays on
                    # the same Redis that relay a table of the same name elsewhere.
                    "OUTBOXKIT_REDIS_PREFIX": f"outboxkit-demo-{self.run_id}:",
                },
                state,
            )
        self._spawn(
            "consumer",
            ["consume", "outboxkit.demo:OrderConsumer"],
            {
                **common,
                "OUTBOXKIT_SERVICE": "demo-consumer",
                "OUTBOXKIT_NODE_ID": "demo-consumer-1",
                "OUTBOXKIT_INBOX": "true",
                "OUTBOXKIT_TOPICS": self.o.topic,
                "OUTBOXKIT_WORKER_DRAIN_TIMEOUT": "5",
            },
            state,
        )

    def _spawn(self, name: str, args: list[str], env: dict[str, str], state: Path) -> None:
        port = _free_port()
        log = state / f"{name}.log"
        full_env = {**os.environ, **env, "OUTBOXKIT_HEALTH_PORT": str(port)}
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "outboxkit", *args],
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                cwd=state,
                # Own session: the terminal's Ctrl-C reaches the demo only, which then
                # sends each child exactly one SIGTERM (a drain, not a hurry).
                start_new_session=True,
            )
        self.children.append(_Child(name, proc, port, log))
        self.say(f"started {name} (pid {proc.pid}): metrics http://127.0.0.1:{port}/metrics")

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        waiting = {c.name: c for c in self.children}
        while waiting:
            for name, child in list(waiting.items()):
                if child.proc.poll() is not None:
                    raise DependencyError(
                        f"{name} exited with code {child.proc.returncode} at start; see {child.log}"
                    )
                url = f"http://127.0.0.1:{child.port}/healthz/ready"
                with (
                    contextlib.suppress(OSError, urllib.error.URLError),
                    urllib.request.urlopen(url, timeout=1) as resp,
                ):
                    if resp.status == 200:
                        del waiting[name]
            if self.interrupts.stop_writing.is_set():
                return
            if time.monotonic() > deadline:
                raise DependencyError(f"not ready after {timeout:.0f}s: {', '.join(waiting)}")
            time.sleep(0.2)
        self.say("relays and consumer are ready")

    def _write_and_watch(self, engine: Engine) -> None:
        self.say(
            f"writing orders at {self.o.rate:g}/s for {self.o.duration:g}s "
            f"(run {self.run_id}; Ctrl-C stops writing and drains)"
        )
        writer = threading.Thread(target=self._writer, args=(engine,), name="order-service")
        writer.start()
        try:
            self._watch(engine, until=lambda: not writer.is_alive())
        finally:
            self.interrupts.stop_writing.set()
            writer.join()
        if not self._writer_finished:
            self.say(
                "interrupted: stopped writing; waiting up to 15s for what is in flight, "
                "then draining (Ctrl-C again: drain now)"
            )
        if self.write_errors:
            raise self.write_errors[0]

    def _writer(self, engine: Engine) -> None:
        """The order service: one transaction per order, paced to ``rate``."""
        try:
            interval = 1.0 / self.o.rate
            started = time.monotonic()
            end = started + self.o.duration
            next_at = time.monotonic()
            while not self.interrupts.stop_writing.is_set() and time.monotonic() < end:
                with engine.begin() as conn:
                    place_order(conn, run_id=self.run_id, topic=self.o.topic, table=DEFAULT_TABLE)
                self.written += 1
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    self.interrupts.stop_writing.wait(delay)
            self._writer_finished = not self.interrupts.stop_writing.is_set()
            self.writing_s = time.monotonic() - started
        except BaseException as exc:  # reported by _write_and_watch
            self.write_errors.append(exc)

    def _settle(self, engine: Engine) -> None:
        """Wait until everything written is delivered and consumed."""
        if self.interrupts.hurry.is_set():
            return
        timeout = self.o.settle_timeout
        if self.interrupts.stop_writing.is_set() and not self._writer_finished:
            timeout = min(timeout, 15.0)  # interrupted: wait a little for what is in flight
        started = time.monotonic()
        deadline = started + timeout

        def done() -> bool:
            written, delivered, consumed = self._counts(engine)
            if delivered >= written and consumed >= written:
                self.settled_s = time.monotonic() - started
                return True
            return time.monotonic() > deadline or self.interrupts.hurry.is_set()

        if not done():
            self._watch(engine, until=done)

    def _watch(self, engine: Engine, *, until: Callable[[], bool]) -> None:
        """Every second, print the counts and the rates since the previous line; check
        ``until`` four times a second."""
        tty = self.out.isatty()
        if self._sample is None:
            self._sample = (time.monotonic(), 0, 0, 0)
            self._watch_started = self._sample[0]
        while True:
            time.sleep(0.25)
            self._check_children()
            stop = until()
            now = time.monotonic()
            last_at, *last = self._sample
            if now - last_at < 1.0 and not stop:
                continue
            counts = self._counts(engine)
            rates = [(v - p) / max(now - last_at, 1e-6) for v, p in zip(counts, last, strict=True)]
            written, delivered, consumed = counts
            line = (
                f"[{now - self._watch_started:5.1f}s] written {written:6d}  "
                f"delivered {delivered:6d}  consumed {consumed:6d}  |  per second: "
                f"{rates[0]:5.0f} / {rates[1]:5.0f} / {rates[2]:5.0f}"
            )
            end = "" if tty else "\n"
            print(("\r" + line) if tty else line, end=end, file=self.out, flush=True)
            self._sample = (now, written, delivered, consumed)
            if stop:
                break
        if tty:
            print(file=self.out)

    def _check_children(self) -> None:
        for c in self.children:
            if c.proc.poll() is not None:
                raise DependencyError(
                    f"{c.name} exited early with code {c.proc.returncode}; see {c.log}"
                )

    def _counts(self, engine: Engine) -> tuple[int, int, int]:
        t = outbox_table(DEFAULT_TABLE)
        mine = orders.c.run_id == self.run_id
        with engine.connect() as conn:
            written = conn.execute(sa.select(sa.func.count()).select_from(orders).where(mine))
            delivered = conn.execute(
                sa.select(sa.func.count())
                .select_from(orders.join(t, t.c.event_id == orders.c.event_id))
                .where(mine, t.c.status == Status.DELIVERED.value)
            )
            consumed = conn.execute(
                sa.select(sa.func.count())
                .select_from(orders.join(shipments, shipments.c.order_id == orders.c.order_id))
                .where(mine)
            )
            return written.scalar_one(), delivered.scalar_one(), consumed.scalar_one()

    def _drain_children(self) -> dict[str, int | None]:
        """One SIGTERM each, all at once (each drains on its own), then wait for all."""
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        if self.children:
            self.say("draining: SIGTERM sent to " + ", ".join(c.name for c in self.children))
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + CHILD_SHUTDOWN_TIMEOUT + 10
        for c in self.children:
            try:
                codes[c.name] = c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()  # its own watchdog should have ended it; never leave orphans
                codes[c.name] = c.proc.wait()
        return codes

    def _print_summary(self, s: Summary, db_url: str) -> None:
        rate = s.written / s.writing_s if s.writing_s > 0 else 0.0
        self.say("")
        self.say(f"summary of run {s.run_id}" + (" (interrupted)" if s.interrupted else ""))
        self.say(
            f"  written   {s.written} orders with their events "
            f"({rate:.0f}/s for {s.writing_s:.1f}s)"
        )
        self.say(f"  delivered {s.delivered}")
        self.say(f"  consumed  {s.consumed}")
        if s.settled_s is not None:
            self.say(f"  caught up {s.settled_s:.1f}s after the last write")
        verdict = "delivered = consumed = written" if s.ok else "counts differ or a process failed"
        self.say(f"  result    {'OK' if s.ok else 'FAILED'}: {verdict}")
        self.say(
            "  exits     " + ", ".join(f"{name} {code}" for name, code in s.exit_codes.items())
        )
        self.say("  metrics   /metrics of each process (while it ran):")
        for name, url in s.metrics_urls.items():
            self.say(f"              {name:9s} {url}")
        kind = "readable lines" if self.o.log_format == "console" else "JSON lines"
        self.say(f"  logs      {s.logs} ({kind}; the exit record is the last line)")
        if s.delivered < s.written:
            self.say(
                f"  {s.written - s.delivered} events are still in the outbox, not lost: "
                "the next relay run delivers them"
            )
        command = _outboxkit_command()
        if self.o.db_url:
            # The operator's own URL: its password stays out of the terminal.
            self.say(
                f"  inspect   {command} admin status --db-url '{redact_url(db_url)}' "
                "(with the password of your --db-url in place of ***)"
            )
        else:
            # The local stack's account (deploy/local), the same on every machine:
            # printed in full, so the line can be pasted as it is.
            self.say(f"  inspect   {command} admin status --db-url '{db_url}'")
            self.say("            (the local stack's own account: its password is no secret)")
        if command != "outboxkit":
            self.say(
                "            (plain `outboxkit` once the virtual environment is active: "
                f". {_relative(Path(sys.executable).parent / 'activate')})"
            )


def _relative(path: Path) -> str:
    """``path`` from the current directory when under it (``.venv/bin/outboxkit``)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _outboxkit_command() -> str:
    """How to run ``outboxkit`` from this terminal: the bare name when PATH finds
    this installation's script, else the script's path (``.venv/bin/outboxkit``:
    demo.sh installs into ``.venv/`` without activating it)."""
    script = Path(sys.executable).parent / "outboxkit"
    if not script.is_file():
        return f"{sys.executable} -m outboxkit"
    found = shutil.which("outboxkit")
    if found is not None and Path(found).resolve() == script.resolve():
        return "outboxkit"
    return _relative(script)


def _with_database(url: str) -> str:
    """The demo's own database on the given server (never the test database)."""
    parsed = sa.make_url(url)
    if parsed.database and parsed.database != "outboxkit_test":
        return url
    return parsed.set(database=DEMO_DATABASE).render_as_string(hide_password=False)


def _find_up_script() -> Path:
    here = Path(__file__).resolve()
    for root in (*here.parents, Path.cwd()):
        candidate = root / "deploy" / "local" / "up.sh"
        if candidate.is_file():
            return candidate
    raise ConfigError(
        "deploy/local/up.sh not found: run the demo from a clone of outboxkit, or give "
        "--db-url, --kafka-bootstrap and --redis-url of running services"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
