"""Start-up time: the CPU a fresh interpreter spends to import outboxkit.

Services import ``outboxkit`` in every web worker to call ``enqueue``, and every
CLI call, probe and test subprocess pays the start of ``outboxkit``. Each command
below runs in a fresh subprocess, in turns (one of each per round, so the
machine's noise falls on all of them alike), and the table shows the median CPU
time (user + system, from the kernel's accounting of the child) of the rounds:

* a bare interpreter (``python -c pass``), the floor every command pays;
* ``import sqlalchemy``, the one import the writer cannot do without;
* ``import outboxkit``, what a service pays to call ``enqueue``;
* ``outboxkit --version``, the console script;
* ``import outboxkit.relay``.

When the run's database is MySQL/MariaDB, two start-to-work figures follow,
each the median of ``startup_service_runs`` fresh processes (CPU of the process
itself, from ``/proc``, and wall time from the spawn):

* ``outboxkit relay`` (start jitter 0) from its spawn to its first claim of the
  one pending row of a fresh outbox table: the first moment the row is no
  longer ``pending``, polled every 10 ms; then it gets SIGTERM;
* ``outboxkit consume`` of a tiny consumer class (a handler that does nothing)
  from its spawn to its first poll: its ``partitions-assigned`` log line, which
  the consumer logs from inside its first poll; then it gets SIGTERM.

The goals are ratios taken in one run, each beyond the bare interpreter:
``(X - bare) / (sqlalchemy - bare)``. The import commands use no service and
run in an empty folder so the repository's own folders cannot shadow the
install. The relay's and the consumer's goals compare their ratios with
0.3.0's, a figure recorded once on this benchmark's host (bench/goals.py), not
one measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from bench.config import BenchConfig
from bench.context import BenchContext, Services
from bench.data import drop_table
from bench.procs import cpu_seconds as process_cpu_seconds
from bench.procs import relay_settings
from bench.report import ScenarioResult
from bench.scenarios import Results

TITLE = "CPU to start: import outboxkit, outboxkit --version, vs import sqlalchemy"


def commands(python: str | None = None) -> dict[str, list[str]]:
    """What is measured, by figure name: each a fresh process of ``python``
    (default: this interpreter)."""
    python = python or sys.executable
    script = Path(python).with_name("outboxkit")  # the console script, as users run it
    cli = [str(script)] if script.exists() else [python, "-m", "outboxkit"]
    return {
        "bare": [python, "-c", "pass"],
        "sqlalchemy": [python, "-c", "import sqlalchemy"],
        "outboxkit": [python, "-c", "import outboxkit"],
        "version": [*cli, "--version"],
        "relay": [python, "-c", "import outboxkit.relay"],
    }


LABELS = {
    "bare": "bare interpreter (python -c pass)",
    "sqlalchemy": "import sqlalchemy",
    "outboxkit": "import outboxkit",
    "version": "outboxkit --version",
    "relay": "import outboxkit.relay",
}


def cpu_seconds(args: list[str], *, cwd: str, env: dict[str, str]) -> float:
    """User + system CPU of one run of ``args`` to its end (exit 0 required)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(args, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(runs: int, python: str | None = None) -> dict[str, list[float]]:
    """CPU seconds of each command, ``runs`` rounds of one run each."""
    cmds = commands(python)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    samples: dict[str, list[float]] = {name: [] for name in cmds}
    with tempfile.TemporaryDirectory(prefix="outboxkit-startup-") as cwd:
        for args in cmds.values():  # a first round unmeasured: warm file caches
            cpu_seconds(args, cwd=cwd, env=env)
        for _ in range(runs):
            for name, args in cmds.items():
                samples[name].append(cpu_seconds(args, cwd=cwd, env=env))
    return samples


def ratio(x: float, base: float, bare: float) -> float:
    """``(x - bare) / (base - bare)``: the cost of ``x`` beyond the interpreter, in
    units of ``base``'s."""
    return (x - bare) / (base - bare)


# -- start to work: the relay's first claim, the consumer's first poll ----------

#: The tiny consumer the start-to-first-poll figure runs (``startup_app:Noop``).
_APP = """from outboxkit.consumer import Consumer


class Noop(Consumer):
    def handle(self, message):
        pass
"""

#: Run by the measured interpreter: the outbox table (one shard) and its one
#: pending row, through that interpreter's own outboxkit (0.3.0's for the baseline).
_SETUP = """import sys
import sqlalchemy as sa
from outboxkit import enqueue
from outboxkit.schema import apply_schema

url, table, topic = sys.argv[1:4]
engine = sa.create_engine(url)
apply_schema(engine, table=table, shards=1, inbox=None)
with engine.begin() as conn:
    enqueue(conn, topic=topic, payload=b"{}", key="k", table=table)
engine.dispose()
"""

_POLL_S = 0.01


@dataclass(frozen=True)
class StartToWork:
    """CPU (of the process itself) and wall seconds from spawn to its first work."""

    cpu: float
    wall: float


def _spawn(python: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [python, "-m", "outboxkit", *argv],
            env=env,
            cwd=log.parent,  # an empty folder: the checkout cannot shadow the install
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _until(
    proc: subprocess.Popen[bytes], done: Callable[[], bool], log: Path, timeout: float
) -> StartToWork:
    """Wait for ``done()``; the process's CPU and wall time at that moment. SIGTERM
    it afterwards in any case."""
    started = time.perf_counter()
    try:
        while not done():
            if proc.poll() is not None:
                raise RuntimeError(f"exited early ({proc.returncode}):\n{_tail(log)}")
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"no first work in {timeout:.0f}s:\n{_tail(log)}")
            time.sleep(_POLL_S)
        wall = time.perf_counter() - started
        cpu = process_cpu_seconds(proc.pid)
        if cpu is None:
            raise RuntimeError(f"exited at its first work:\n{_tail(log)}")
        return StartToWork(cpu, wall)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _tail(log: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _logged(log: Path, event: str) -> bool:
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if f'"{event}"' in line:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("event") == event:
                        return True
    return False


def _env(settings: dict[str, str], pythonpath: str | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYTHON")
        and not (k.startswith("OUTBOXKIT_") and not k.startswith("OUTBOXKIT_TEST_"))
    }
    env.update(settings)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def relay_to_first_claim(
    python: str, engine: sa.Engine, db_url: str, bootstrap: str, topic: str, run: int, folder: Path
) -> StartToWork:
    """``outboxkit relay`` from its spawn to its first claim of a fresh table's one
    pending row (the row is no longer ``pending``)."""
    table = f"bench_startup_{run}"
    subprocess.run(
        [python, "-c", _SETUP, db_url, table, topic],
        cwd=folder,
        env=_env({}),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    settings = relay_settings(
        db_url=db_url, bootstrap=bootstrap, table=table, node_id=f"bench-startup-{run}"
    )
    query = sa.text(f"SELECT COUNT(*) FROM {table} WHERE status <> 'pending'")

    def claimed() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(query).scalar())

    log = folder / f"relay-{run}.log"
    try:
        proc = _spawn(python, ["relay", "--start-jitter", "0"], _env(settings), log)
        return _until(proc, claimed, log, 120.0)
    finally:
        drop_table(engine, table)


def consumer_to_first_poll(
    python: str, bootstrap: str, topic: str, group: str, run: int, folder: Path
) -> StartToWork:
    """``outboxkit consume startup_app:Noop`` from its spawn to its first poll (its
    ``partitions-assigned`` line, logged from inside the first poll)."""
    (folder / "startup_app.py").write_text(_APP)
    settings = {
        "OUTBOXKIT_KAFKA_BOOTSTRAP": bootstrap,
        "OUTBOXKIT_GROUP_ID": f"{group}-{run}",
        "OUTBOXKIT_TOPICS": topic,
        "OUTBOXKIT_HEALTH_PORT": "0",
        "OUTBOXKIT_SERVICE": "bench-consumer",
        "OUTBOXKIT_NODE_ID": f"bench-startup-consumer-{run}",
    }
    log = folder / f"consumer-{run}.log"
    proc = _spawn(python, ["consume", "startup_app:Noop"], _env(settings, str(folder)), log)
    return _until(proc, lambda: _logged(log, "partitions-assigned"), log, 120.0)


def measure_services(
    runs: int,
    *,
    python: str,
    engine: sa.Engine,
    db_url: str,
    bootstrap: str,
    topic: str,
    group: str,
) -> dict[str, list[StartToWork]]:
    """``runs`` of each, in turns (relay, consumer, relay, ...)."""
    out: dict[str, list[StartToWork]] = {"relay_claim": [], "consumer_poll": []}
    with tempfile.TemporaryDirectory(prefix="outboxkit-startup-") as tmp:
        folder = Path(tmp)
        for i in range(runs):
            out["relay_claim"].append(
                relay_to_first_claim(python, engine, db_url, bootstrap, topic, i, folder)
            )
            out["consumer_poll"].append(
                consumer_to_first_poll(python, bootstrap, topic, group, i, folder)
            )
    return out


SERVICE_LABELS = {
    "relay_claim": "outboxkit relay: spawn -> first claim",
    "consumer_poll": "outboxkit consume: spawn -> first poll",
}


def service_figures(
    samples: dict[str, list[StartToWork]], base: float, bare: float
) -> dict[str, float]:
    """Median CPU and wall (ms) of each, and the CPU's ratio beyond the bare interpreter."""
    figures: dict[str, float] = {}
    for name, values in samples.items():
        cpu = statistics.median(v.cpu for v in values)
        figures[f"{name}_cpu_ms"] = cpu * 1000
        figures[f"{name}_wall_ms"] = statistics.median(v.wall for v in values) * 1000
        figures[f"{name}_ratio"] = ratio(cpu, base, bare)
    return figures


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    runs = ctx.config.startup_runs
    res = ScenarioResult("startup", TITLE)
    samples = measure(runs)
    median = {name: statistics.median(values) for name, values in samples.items()}
    bare, base = median["bare"], median["sqlalchemy"]
    for name, value in median.items():
        res.rows.append(
            {
                "command": LABELS[name],
                "CPU ms (median)": value * 1000,
                "min ms": min(samples[name]) * 1000,
                "max ms": max(samples[name]) * 1000,
                "x sqlalchemy beyond bare": None
                if name in ("bare", "sqlalchemy")
                else ratio(value, base, bare),
            }
        )
        res.figures[f"{name}_cpu_ms"] = value * 1000
    for name in ("outboxkit", "version", "relay"):
        res.figures[f"{name}_ratio"] = ratio(median[name], base, bare)
    res.settings = {"runs": runs, "python": sys.version.split()[0]}
    res.notes.append(
        f"median of {runs} fresh processes each, in turns; CPU is user + system of the child"
    )
    service_runs = ctx.config.startup_service_runs
    if ctx.postgresql:
        res.notes.append("relay and consumer start-to-work: MySQL/MariaDB only, not measured")
        return res
    topic = ctx.topic("startup", partitions=1)
    services = measure_services(
        service_runs,
        python=sys.executable,
        engine=ctx.engine,
        db_url=ctx.db_url,
        bootstrap=ctx.services.kafka_bootstrap,
        topic=topic,
        group=f"bench-startup-{ctx.run_id}",
    )
    ctx.delete_topic(topic)
    figures = service_figures(services, base, bare)
    res.figures.update(figures)
    for name, values in services.items():
        res.rows.append(
            {
                "command": SERVICE_LABELS[name],
                "CPU ms (median)": figures[f"{name}_cpu_ms"],
                "min ms": min(v.cpu for v in values) * 1000,
                "max ms": max(v.cpu for v in values) * 1000,
                "x sqlalchemy beyond bare": figures[f"{name}_ratio"],
                "wall ms (median)": figures[f"{name}_wall_ms"],
            }
        )
    res.settings["service_runs"] = service_runs
    res.notes.append(
        f"relay and consumer: median of {service_runs} fresh processes each; CPU of the "
        "process from /proc at its first claim / first poll, wall from its spawn"
    )
    return res


def main() -> None:
    """``python -m bench.scenarios.startup [RUNS]``: the import table without a
    benchmark run (no database, no Kafka). With ``--services SERVICE_RUNS`` (and the
    ``OUTBOXKIT_TEST_*`` addresses, MySQL/MariaDB), also the relay's and the
    consumer's start-to-work figures; ``--python`` measures another install (how
    0.3.0's baseline in bench/goals.py was taken)."""
    parser = argparse.ArgumentParser(prog="python -m bench.scenarios.startup")
    parser.add_argument("runs", nargs="?", type=int, default=20)
    parser.add_argument("--services", type=int, default=0, metavar="SERVICE_RUNS")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    runs = args.runs
    samples = measure(runs, args.python)
    median = {name: statistics.median(values) for name, values in samples.items()}
    for name, value in median.items():
        extra = ""
        if name not in ("bare", "sqlalchemy"):
            extra = f"  {ratio(value, median['sqlalchemy'], median['bare']):.2f}x sqlalchemy"
        print(f"{LABELS[name]:40} {value * 1000:7.1f} ms CPU (median of {runs}){extra}")
    if not args.services:
        return
    config = BenchConfig(startup_service_runs=args.services)
    with BenchContext(config, Services.from_env()) as ctx:
        topic = ctx.topic("startup", partitions=1)
        services = measure_services(
            args.services,
            python=args.python,
            engine=ctx.engine,
            db_url=ctx.db_url,
            bootstrap=ctx.services.kafka_bootstrap,
            topic=topic,
            group=f"bench-startup-{ctx.run_id}",
        )
    figures = service_figures(services, median["sqlalchemy"], median["bare"])
    for name in services:
        print(
            f"{SERVICE_LABELS[name]:40} {figures[f'{name}_cpu_ms']:7.1f} ms CPU, "
            f"{figures[f'{name}_wall_ms']:7.1f} ms wall (median of {args.services})  "
            f"{figures[f'{name}_ratio']:.2f}x sqlalchemy"
        )


if __name__ == "__main__":
    main()
