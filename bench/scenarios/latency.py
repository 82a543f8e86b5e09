"""Scenario 5, latency: a writer at a steady rate with one relay running.

commit→ack latency: the writer records each event's commit time
(``time.time()`` right after ``COMMIT`` returned); the topic stores the broker's
append time as the message timestamp (``LogAppendTime``), which is when the
broker acknowledged the write (one replica, ``acks=all``).  Both clocks are
this machine's, so the difference is commit→ack without a consumer's delay in it.

Warm-up: the writer first runs at the rate for ``latency_warmup_seconds`` (2 s),
and the percentiles are those of the events committed after that, at the steady
rate. The warm-up's events are the relay's first batches on a new table and a
new topic: its first lock and lease statements, the producer's first messages
to each partition, the broker's first appends. They are reported apart ("warm-up
p99 ms"): in 10 s runs without a warm-up they were one event in ten, so the
first second set the p99 (on PostgreSQL at 1,000/s, p99 30 to 100 ms for the
whole run; per second from the third second on, mostly 18 to 22 ms).

The writer commits whatever is due at each step (one event per transaction at
low rates, a few at 5,000/s), as many request threads of a service would.  Runs
*without* wake-ups rely on the relay's poll interval; runs *with* them enable
``outboxkit.wakeup`` on the writer's engine and give the relay Redis; on
PostgreSQL the writer's ``NOTIFY`` (sent at commit) wakes the relay, which
listens unless wake-ups are off.

The writer's own insert rate (one event per transaction, as fast as one thread
goes) is measured without a relay and with one draining the same table.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME
from prometheus_client.parser import text_string_to_metric_families

from bench import data
from bench.activity import DbActivity
from bench.context import BenchContext
from bench.kafka import Progress, read_all
from bench.procs import Proc, ServiceCpu, cpu_share, relay_settings
from bench.report import Row, ScenarioResult, percentile
from bench.scenarios import Results
from bench.scenarios.common import batch_size
from bench.scenarios.relay_runs import require_relay
from outboxkit import Event, enqueue, enqueue_many
from outboxkit.schema import apply_schema

#: Upper bound on events in one writer transaction when it falls behind.
_MAX_PER_COMMIT = 200


def wakeups_available(ctx: BenchContext) -> str | None:
    """None if wake-ups can be measured, else why not."""
    if ctx.postgresql:
        return None  # NOTIFY: the writer sends it, the relay listens; no Redis involved
    if not ctx.services.redis_url:
        return "no Redis URL given"
    if importlib.util.find_spec("outboxkit.wakeup") is None:
        return "wake-up hints (outboxkit.wakeup) are not there yet"
    return None


class RelayBatches:
    """Batches a relay process claimed so far and their rows, read from its
    ``/metrics`` (``outbox_batch_size``).

    The relay binds its health server to a port of its own choosing (port 0) and
    logs it in ``relay-started``; :func:`relay` sets :attr:`port` from that line.
    (Picking a free port here and handing it over raced with every other process
    that bound one meanwhile.)"""

    def __init__(self) -> None:
        self.port: int | None = None

    def read(self) -> tuple[float, float] | None:
        """``(batches, rows)``, or None when the relay did not answer."""
        if self.port is None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        found = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "outbox_batch_size"
            for sample in family.samples
            if sample.name in ("outbox_batch_size_count", "outbox_batch_size_sum")
        }
        if len(found) < 2:
            return None
        return found["outbox_batch_size_count"], found["outbox_batch_size_sum"]


@contextmanager
def relay(
    ctx: BenchContext,
    table: str,
    label: str,
    *,
    wakeups: bool,
    pipeline: bool = False,
    batches: RelayBatches | None = None,
) -> Iterator[Proc]:
    extra = {"OUTBOXKIT_WAKEUPS": "true" if wakeups else "false"}
    if batches is not None:
        extra["OUTBOXKIT_HEALTH_PORT"] = "0"  # the relay picks it; see RelayBatches
    settings = relay_settings(
        db_url=ctx.db_url,
        bootstrap=ctx.services.kafka_bootstrap,
        table=table,
        node_id=f"bench-{label}",
        batch_size=batch_size(ctx.config),
        # PostgreSQL: the relay listens for the writer's NOTIFY unless wake-ups are off.
        redis_url=ctx.services.redis_url if wakeups and not ctx.postgresql else None,
        redis_prefix=ctx.redis_prefix,
        pipeline=pipeline,
        extra=extra,
    )
    proc = Proc.start("relay", ["relay"], settings, ctx.log_dir / label)
    try:
        proc.wait_for_log("relay-started", 60)
        if batches is not None:
            started = proc.logged("relay-started")
            if started is None or not isinstance(started.get("health_port"), int):
                raise RuntimeError(f"{label}: no health port in relay-started:\n{proc.log_tail()}")
            batches.port = started["health_port"]
        yield proc
        code = proc.terminate()
        if code != 0:
            raise RuntimeError(f"{label}: relay exited with {code}:\n{proc.log_tail()}")
    finally:
        proc.kill()


@contextmanager
def writer_engine(ctx: BenchContext, *, wakeups: bool) -> Iterator[sa.Engine]:
    engine = sa.create_engine(ctx.db_url, pool_size=2)
    hook: Any = None
    if wakeups and not ctx.postgresql:  # on PostgreSQL enqueue always sends NOTIFY
        wakeup = importlib.import_module("outboxkit.wakeup")
        hook = wakeup.enable_wakeups(engine, ctx.services.redis_url, prefix=ctx.redis_prefix)
    try:
        yield engine
    finally:
        if hook is not None:
            hook.disable()
        engine.dispose()


def insert_rate(
    engine: sa.Engine, table: str, topic: str, keys: int, size: int, *, seconds: float
) -> float:
    """One event per transaction, back to back, for ``seconds``: events/s."""
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        with engine.begin() as conn:
            enqueue(
                conn,
                topic=topic,
                payload=data.payload_for(n, size),
                key=data.key_for(n, keys),
                headers=data.HEADERS,
                table=table,
            )
        n += 1
    return n / (time.perf_counter() - start)


@dataclass
class SteadyWindow:
    """CPU of the relay, the services and the machine while the writer runs at its
    steady rate (after the warm-up), and what the database server did meanwhile:
    what a slow run's p99 is read against."""

    relay: Proc
    services: ServiceCpu
    activity: DbActivity
    batches: RelayBatches
    started: float | None = None
    wall: float = 0.0
    relay_cpu: float | None = None
    used: dict[str, float] = field(default_factory=dict)
    machine: float | None = None
    claimed: tuple[float, float] | None = None
    _relay_start: float | None = None
    _claimed_start: tuple[float, float] | None = None

    def begin(self) -> None:
        self.started = time.monotonic()
        self._relay_start = self.relay.cpu()
        self._claimed_start = self.batches.read()
        self.services.begin()

    def end(self) -> None:
        if self.started is None:
            return
        self.wall = time.monotonic() - self.started
        now = self.relay.cpu()
        if now is not None and self._relay_start is not None:
            self.relay_cpu = now - self._relay_start
        self.used = self.services.used()
        self.machine = self.services.machine_used()
        now_claimed = self.batches.read()
        if now_claimed is not None and self._claimed_start is not None:
            self.claimed = (
                now_claimed[0] - self._claimed_start[0],
                now_claimed[1] - self._claimed_start[1],
            )

    def row(self) -> Row:
        out: Row = {}
        if self.claimed is not None and self.wall > 0:
            batches, rows = self.claimed
            out["batches/s"] = batches / self.wall
            out["rows per batch"] = rows / batches if batches else None
        out["relay cpu"] = cpu_share(self.relay_cpu, self.wall)
        for name, used in self.used.items():
            if name != "redis":
                out[f"{name} cpu"] = cpu_share(used, self.wall)
        out["machine cpu"] = cpu_share(self.machine, self.wall)
        if self.started is not None:
            bounds = [self.started, self.started + self.wall]
            for stretch in self.activity.by_stretch(bounds, ["steady"]):
                out["autovacuum share"] = stretch["autovacuum share"]
                out["checkpoint share"] = stretch["checkpoint share"]
        return out


def steady_writer(
    engine: sa.Engine,
    table: str,
    topic: str,
    rate: float,
    seconds: float,
    keys: int,
    size: int,
    *,
    warmup: float = 0.0,
    on_steady: Callable[[], None] | None = None,
) -> tuple[dict[str, float], float]:
    """Write at ``rate`` events/s for ``seconds``; return commit times (ms) by event id.
    ``on_steady`` is called once, when the first ``warmup`` seconds are over."""
    committed: dict[str, float] = {}
    n = 0
    start = time.perf_counter()
    total = int(rate * seconds)
    while n < total:
        if on_steady is not None and time.perf_counter() - start >= warmup:
            on_steady()
            on_steady = None
        due = min(total, int((time.perf_counter() - start) * rate) + 1) - n
        if due > 0:
            batch = [
                Event(
                    topic=topic,
                    payload=data.payload_for(i, size),
                    key=data.key_for(i, keys),
                    headers=data.HEADERS,
                )
                for i in range(n, n + min(due, _MAX_PER_COMMIT))
            ]
            with engine.begin() as conn:
                ids = enqueue_many(conn, batch, table=table)
            at = time.time() * 1000
            for event_id in ids:
                committed[event_id] = at
            n += len(ids)
        pause = start + n / rate - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    return committed, n / (time.perf_counter() - start)


def ack_times(ctx: BenchContext, topic: str, expected: int) -> dict[str, float]:
    """First broker append time (ms) of every event id on ``topic``."""
    acked: dict[str, float] = {}

    def on_message(msg: Any) -> None:
        kind, ts = msg.timestamp()
        if kind != TIMESTAMP_LOG_APPEND_TIME:
            raise RuntimeError(f"{topic}: message timestamps are not the broker's append time")
        event_id = dict(msg.headers() or ())["event_id"].decode()
        acked[event_id] = min(ts, acked.get(event_id, ts))

    read_all(
        ctx.services.kafka_bootstrap,
        topic,
        expected,
        timeout=ctx.config.timeout_seconds,
        on_message=on_message,
    )
    return acked


def latency_run(ctx: BenchContext, rate: int, *, wakeups: bool, pipeline: bool = False) -> Row:
    cfg = ctx.config
    label = f"lat{rate}{'w' if wakeups else 'p'}{'p' if pipeline else ''}"
    table = f"bench_{label}"
    topic = ctx.topic(label)
    apply_schema(ctx.engine, table=table, shards=cfg.shards, inbox=None)
    progress = Progress(ctx.services.kafka_bootstrap, topic, cfg.partitions).start()
    services = ServiceCpu.find(ctx.engine, ctx.services.kafka_bootstrap, ctx.services.redis_url)
    batches = RelayBatches()
    try:
        with (
            writer_engine(ctx, wakeups=wakeups) as engine,
            relay(ctx, table, label, wakeups=wakeups, pipeline=pipeline, batches=batches) as proc,
            DbActivity(ctx.engine) as activity,
        ):
            window = SteadyWindow(proc, services, activity, batches)
            seconds = cfg.latency_warmup_seconds + cfg.latency_seconds
            committed, achieved = steady_writer(
                engine,
                table,
                topic,
                rate,
                seconds,
                cfg.keys,
                cfg.payload_bytes,
                warmup=cfg.latency_warmup_seconds,
                on_steady=window.begin,
            )
            window.end()
            progress.wait_for(len(committed), cfg.timeout_seconds)
    finally:
        progress.stop()
    acked = ack_times(ctx, topic, len(committed))
    missing = set(committed) - set(acked)
    if missing:
        raise RuntimeError(f"{label}: {len(missing)} committed events never reached {topic}")
    steady_from = min(committed.values()) + cfg.latency_warmup_seconds * 1000
    lat: list[float] = []
    warmup: list[float] = []
    last_written = last_acked = steady_from
    for event_id, at in committed.items():
        (lat if at >= steady_from else warmup).append(max(0.0, acked[event_id] - at))
        if at >= steady_from:
            last_written = max(last_written, at)
            last_acked = max(last_acked, acked[event_id])
    data.drop_table(ctx.engine, table)
    ctx.delete_topic(topic)
    return {
        "wake-ups": wakeups,
        "pipeline": pipeline,
        "target/s": rate,
        "achieved/s": achieved,
        "events": len(lat),
        "p50 ms": percentile(lat, 50),
        "p95 ms": percentile(lat, 95),
        "p99 ms": percentile(lat, 99),
        "max ms": max(lat),
        "warm-up events": len(warmup),
        "warm-up p99 ms": percentile(warmup, 99) if warmup else None,
        # The steady window's writing span over its delivery span: 1.0 when the
        # last event written reached Kafka at once, lower as the relay fell behind.
        "kept up": (last_written - steady_from) / (last_acked - steady_from)
        if last_acked > steady_from
        else None,
        **window.row(),
    }


def writer_rates(ctx: BenchContext, *, wakeups: bool) -> list[Row]:
    cfg = ctx.config
    rows: list[Row] = []
    for with_relay in (False, True):
        label = f"writer{'r' if with_relay else ''}{'w' if wakeups else 'p'}"
        table = f"bench_{label}"
        topic = ctx.topic(label)
        apply_schema(ctx.engine, table=table, shards=cfg.shards, inbox=None)
        with writer_engine(ctx, wakeups=wakeups) as engine:
            args = (engine, table, topic, cfg.keys, cfg.payload_bytes)
            with relay(ctx, table, label, wakeups=wakeups) if with_relay else nullcontext():
                insert_rate(*args, seconds=cfg.writer_seconds / 5)  # warm-up: pool, caches
                rate = insert_rate(*args, seconds=cfg.writer_seconds)
        data.drop_table(ctx.engine, table)
        ctx.delete_topic(topic)
        rows.append({"wake-ups": wakeups, "relay running": with_relay, "inserts/s": rate})
    return rows


def _add_figures(res: ScenarioResult, row: Row, rate: int, suffix: str) -> None:
    res.figures[f"p99_ms_{rate}{suffix}"] = row["p99 ms"]
    res.figures[f"p50_ms_{rate}{suffix}"] = row["p50 ms"]
    if row["kept up"] is not None:
        res.figures[f"kept_up_{rate}{suffix}"] = row["kept up"]
    if row["warm-up p99 ms"] is not None:
        res.figures[f"warmup_p99_ms_{rate}{suffix}"] = row["warm-up p99 ms"]
    if row.get("batches/s"):
        # The relay's mean time between two claims at this rate (its cycle:
        # claim, produce, acks, finalize; half of it with the pipeline).
        res.figures[f"cycle_ms_{rate}{suffix}"] = 1000.0 / row["batches/s"]


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    require_relay()
    cfg = ctx.config
    res = ScenarioResult("latency", "commit→ack latency at steady writer rates; writer rate")
    res.settings = {
        "rates": list(cfg.latency_rates),
        "seconds_per_rate": cfg.latency_seconds,
        "warmup_seconds_per_rate": cfg.latency_warmup_seconds,
        "writer_seconds": cfg.writer_seconds,
        "batch_size": batch_size(cfg),
        "relay_poll_interval": "relay default",
    }
    variants = [False]
    why_not = wakeups_available(ctx)
    if why_not is None:
        variants.append(True)
    else:
        res.notes.append(f"with wake-ups: not measured, {why_not}")
    runs = [(False, False)]
    if len(variants) > 1:
        runs += [(True, bool(mode)) for mode in cfg.latency_pipeline_modes]
    # The relay's own default: the pipeline on PostgreSQL, not on MySQL/MariaDB
    # (RelaySettings.effective_pipeline). The goals judge that configuration.
    default_pipeline = ctx.postgresql
    for wakeups, pipeline in runs:
        for rate in cfg.latency_rates:
            row = latency_run(ctx, rate, wakeups=wakeups, pipeline=pipeline)
            res.rows.append(row)
            suffixes = [("_wakeups" if wakeups else "_poll") + ("_pipeline" if pipeline else "")]
            if wakeups and pipeline == default_pipeline:
                suffixes.append("_wakeups_default")
            for suffix in suffixes:
                _add_figures(res, row, rate, suffix)
    writer = writer_rates(ctx, wakeups=variants[-1])
    res.tables["writer insert rate, one event per transaction"] = writer
    alone = writer[0]["inserts/s"]
    beside = writer[1]["inserts/s"]
    res.figures["writer_rate"] = alone
    res.figures["writer_rate_with_relay"] = beside
    res.figures["writer_ratio"] = beside / alone if alone else 0.0
    return res
