"""Draining a backlog with real relay processes, measured from the topic.

Shared by the throughput, scaling and drain scenarios: copy the backlog into a
fresh table for a fresh topic, start N ``outboxkit relay`` processes, follow
the topic's message count until every row arrived, SIGTERM them, check that
the table holds what it should, and report rates, CPU, peak memory and
duplicates.
"""

from __future__ import annotations

import importlib.util
import subprocess
import time
from dataclasses import dataclass, field

from bench import data, profile
from bench.context import BenchContext
from bench.dblog import LogMeter
from bench.kafka import Progress
from bench.procs import (
    Proc,
    ServiceCpu,
    cpu_share,
    relay_settings,
    wait_database_quiet,
)
from bench.scenarios import Unavailable
from bench.scenarios.common import batch_size


def require_relay() -> None:
    if importlib.util.find_spec("outboxkit.relay.relay") is None:
        raise Unavailable("the relay (outboxkit.relay.relay) is not there yet")


def require_shard_leases(ctx: BenchContext) -> None:
    if ctx.postgresql:
        return  # relays share shards through session advisory locks, no Redis needed
    if not ctx.services.redis_url:
        raise Unavailable("several relays need Redis for shard leases: no Redis URL given")
    # Either home: the ownership family, or the leases module of older revisions.
    homes = ("outboxkit.relay.ownership", "outboxkit.relay.leases")
    if not any(importlib.util.find_spec(home) for home in homes):
        raise Unavailable("shard leases (outboxkit.relay.ownership) are not there yet")


@dataclass
class DrainRun:
    relays: int
    rows: int
    progress: Progress
    wall: float
    cpu_wall: float
    relay_cpu: float
    #: Rows delivered while ``relay_cpu`` was counted: from the first progress
    #: sample that saw a message to the last row.
    counted_rows: int
    services_cpu: dict[str, float]
    #: Busy CPU seconds of the whole machine over the same interval (None: no /proc/stat).
    machine_cpu: float | None
    #: The largest peak resident set (VmHWM) of the relays, MB.
    peak_rss_mb: float | None
    exit_codes: list[int]
    messages: int
    table_after: dict[str, int]
    notes: list[str] = field(default_factory=list)
    #: Hottest functions of relay 0's loop (``--profile``).
    profile: list[dict[str, object]] = field(default_factory=list)
    #: Bytes the database added to its binary log / WAL from the relays' start
    #: to their exit (None: no such log, the binary log is off).
    log_bytes: int | None = None

    @property
    def first(self) -> float:
        return self.progress.first_nonzero()

    @property
    def last(self) -> float:
        return self.progress.time_at(self.rows)

    @property
    def seconds(self) -> float:
        return self.last - self.first

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def relay_cpu_per_1k(self) -> float | None:
        """The relays' CPU seconds per 1,000 events delivered while it was counted
        (all relays together); None when the drain was too short to count any: no
        row after the first sample, or less CPU than one clock tick of ``/proc``."""
        if self.counted_rows <= 0 or self.relay_cpu <= 0:
            return None
        return self.relay_cpu / self.counted_rows * 1000

    @property
    def db_cpu_per_100k(self) -> float | None:
        """The database server's CPU seconds per 100,000 events delivered while
        it was counted (as ``relay_cpu_per_1k``)."""
        used = self.services_cpu.get("mariadb", self.services_cpu.get("postgresql"))
        if used is None or used <= 0 or self.counted_rows <= 0:
            return None
        return used / self.counted_rows * 100_000

    @property
    def log_bytes_per_event(self) -> float | None:
        return None if self.log_bytes is None else self.log_bytes / self.rows

    def cpu_row(self) -> dict[str, float | None]:
        wall = self.cpu_wall
        out: dict[str, float | None] = {"relay cpu": cpu_share(self.relay_cpu, wall)}
        for name, used in self.services_cpu.items():
            out[f"{name} cpu"] = cpu_share(used, wall)
        out["machine cpu"] = cpu_share(self.machine_cpu, wall)
        out["relay cpu s/1k events"] = self.relay_cpu_per_1k
        out["db cpu s/100k events"] = self.db_cpu_per_100k
        out["db log bytes/event"] = self.log_bytes_per_event
        out["relay peak MB"] = self.peak_rss_mb
        return out


def table_for(label: str) -> str:
    """The outbox table a drain labelled ``label`` copies its backlog into."""
    return f"bench_{label.replace('-', '_')}"


def drain_backlog(
    ctx: BenchContext,
    *,
    source: str,
    rows: int,
    relays: int,
    label: str,
    delete_on_deliver: bool = False,
    batch: int | None = None,
    pipeline: bool | None = None,
    extra: dict[str, str] | None = None,
    db_url: str | None = None,
) -> DrainRun:
    """Copy ``rows`` rows of ``source`` and drain them with ``relays`` relay processes
    (``extra``: more of the relays' environment, ``OUTBOXKIT_*`` settings;
    ``db_url``: the relays' database URL, the run's database through another
    driver, instead of the run's own)."""
    cfg = ctx.config
    topic = ctx.topic(label)
    table = table_for(label)
    data.copy_backlog(ctx.engine, source, table, topic=topic, rows=rows, shards=cfg.shards)
    # Nothing left over from before runs beside the drain.
    waited = wait_database_quiet(ctx.engine, timeout=cfg.quiet_timeout)
    progress = Progress(ctx.services.kafka_bootstrap, topic, cfg.partitions).start()
    services = ServiceCpu.find(ctx.engine, ctx.services.kafka_bootstrap, ctx.services.redis_url)
    procs: list[Proc] = []
    spy: subprocess.Popen[bytes] | None = None
    log_dir = ctx.log_dir / label
    logged = LogMeter(ctx.engine).begin()
    try:
        t0 = time.perf_counter()
        for i in range(relays):
            settings = relay_settings(
                db_url=db_url or ctx.db_url,
                bootstrap=ctx.services.kafka_bootstrap,
                table=table,
                node_id=f"{label}-{i}",
                batch_size=batch or batch_size(cfg),
                delete_on_deliver=delete_on_deliver,
                # PostgreSQL: several relays own shards by advisory locks (no Redis).
                redis_url=ctx.services.redis_url if relays > 1 and not ctx.postgresql else None,
                redis_prefix=ctx.redis_prefix,
                pipeline=pipeline,
                extra=extra,
            )
            procs.append(Proc.start(f"relay-{i}", ["relay"], settings, log_dir))
        if ctx.profile:
            spy = profile.attach(procs[0].pid, log_dir / "relay-0.pyspy")
        alive = lambda: all(p.alive() for p in procs)  # noqa: E731
        try:
            # CPU is counted from the first message on, leaving out interpreter start-up.
            progress.wait_for(1, cfg.timeout_seconds, alive=alive)
            services.begin()
            relay_cpu_start = sum(p.cpu() or 0.0 for p in procs)
            rows_before_cpu = progress.latest()
            cpu_t0 = time.perf_counter()
            progress.wait_for(rows, cfg.timeout_seconds, alive=alive)
        except (TimeoutError, RuntimeError) as exc:
            tails = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in procs)
            raise RuntimeError(f"{exc}\n{tails}") from None
        cpu_wall = time.perf_counter() - cpu_t0
        services_cpu = services.used()
        machine_cpu = services.machine_used()
        relay_cpu = sum(p.cpu() or 0.0 for p in procs) - relay_cpu_start
        # The high-water mark covers the whole drain; read before the processes go.
        peaks = [m for m in (p.peak_rss_mb() for p in procs) if m is not None]
        codes = [p.terminate() for p in procs]
        wall = time.perf_counter() - t0
        time.sleep(progress.interval * 2)  # a last sample: duplicates sent at the end
    finally:
        for p in procs:
            p.kill()
        progress.stop()
        if spy is not None:
            spy.wait(30)
    log_bytes = logged.bytes()
    after = data.count_by_status(ctx.engine, table)
    run = DrainRun(
        relays=relays,
        rows=rows,
        progress=progress,
        wall=wall,
        cpu_wall=cpu_wall,
        relay_cpu=relay_cpu,
        counted_rows=rows - rows_before_cpu,
        services_cpu=services_cpu,
        machine_cpu=machine_cpu,
        peak_rss_mb=max(peaks) if peaks else None,
        exit_codes=codes,
        messages=progress.latest(),
        table_after=after,
        log_bytes=log_bytes,
    )
    if spy is not None and (log_dir / "relay-0.pyspy").exists():
        run.profile = profile.summary(log_dir / "relay-0.pyspy", within="Relay._loop")
    expected = {} if delete_on_deliver else {"delivered": rows}
    if after != expected:
        raise RuntimeError(f"{label}: table holds {after} after the drain, expected {expected}")
    if any(codes):
        run.notes.append(f"{label}: relay exit codes {codes}")
    if waited >= cfg.quiet_timeout > 0:
        run.notes.append(
            f"{label}: the database server was still busy {waited:.0f} s after the copy; "
            "measured anyway"
        )
    if run.relay_cpu_per_1k is None:
        run.notes.append(
            f"{label}: relay CPU per 1,000 events not measured: {run.counted_rows:,} of "
            f"{rows:,} rows and {relay_cpu:.2f} CPU s after the first sample (too short a drain)"
        )
    data.drop_table(ctx.engine, table)
    ctx.delete_topic(topic)
    return run
