"""Scenario 7, drain time: SIGTERM → process exit, under load, over many runs.

Each relay run copies a fresh backlog, starts ``outboxkit relay``, waits until
it has delivered part of it (so a batch is in flight when the signal comes),
sends SIGTERM and times the exit.  After the exit no row may be left
``delivering`` (the drain finalizes or releases everything it held); the exit
code must be 0.  The time is what Kubernetes waits between SIGTERM and the
container's end, interpreter teardown included.
"""

from __future__ import annotations

import importlib.util
import os
import time

from bench import data
from bench.context import REPO_ROOT, BenchContext
from bench.kafka import Progress
from bench.procs import Proc, relay_settings
from bench.report import Row, ScenarioResult, percentile
from bench.scenarios import Results
from bench.scenarios.common import batch_size, template
from bench.scenarios.consumer import prepare_topic
from bench.scenarios.consumer_base import dlq_topic
from bench.scenarios.relay_runs import require_relay

#: Signal once this share of the run's backlog reached the topic.
_SIGNAL_AT = 0.2
#: Seconds a consumer handles messages before it is signalled.
_CONSUMER_LOAD_S = 1.0


def relay_drains(ctx: BenchContext) -> tuple[list[float], list[str]]:
    cfg = ctx.config
    source = template(ctx, cfg.drain_rows)
    topic = ctx.topic("drain")
    table = "bench_drain"
    times: list[float] = []
    problems: list[str] = []
    progress = Progress(ctx.services.kafka_bootstrap, topic, cfg.partitions, interval=0.02).start()
    try:
        for i in range(cfg.drain_runs):
            data.copy_backlog(
                ctx.engine, source, table, topic=topic, rows=cfg.drain_rows, shards=cfg.shards
            )
            before = progress.latest()
            settings = relay_settings(
                db_url=ctx.db_url,
                bootstrap=ctx.services.kafka_bootstrap,
                table=table,
                node_id=f"bench-drain-{i}",
                batch_size=batch_size(cfg),
            )
            proc = Proc.start(f"relay-{i}", ["relay"], settings, ctx.log_dir / "drain")
            try:
                progress.wait_for(
                    before + max(1, int(cfg.drain_rows * _SIGNAL_AT)),
                    cfg.timeout_seconds,
                    alive=proc.alive,
                )
                code = proc.terminate()
            finally:
                proc.kill()
            assert proc.exit_seconds is not None
            times.append(proc.exit_seconds)
            after = data.count_by_status(ctx.engine, table)
            if code != 0:
                problems.append(f"run {i}: exit code {code}")
            if after.get("delivering"):
                problems.append(f"run {i}: {after['delivering']} rows left delivering")
            data.drop_table(ctx.engine, table)
    finally:
        progress.stop()
    ctx.delete_topic(topic)
    return times, problems


def consumer_drains(ctx: BenchContext) -> tuple[list[float], list[str]]:
    """``outboxkit consume bench.apps:Trivial`` on the pre-filled topic, a fresh group
    each run, SIGTERM once it has been handling messages for ``_CONSUMER_LOAD_S``."""
    cfg = ctx.config
    topic = prepare_topic(ctx)
    dlq_topic(ctx, topic)
    times: list[float] = []
    problems: list[str] = []
    for i in range(cfg.drain_runs):
        settings = {
            "OUTBOXKIT_KAFKA_BOOTSTRAP": ctx.services.kafka_bootstrap,
            "OUTBOXKIT_GROUP_ID": f"bench-drain-{ctx.run_id}-{i}",
            "OUTBOXKIT_TOPICS": topic,
            "OUTBOXKIT_HEALTH_PORT": "0",
            "OUTBOXKIT_SERVICE": "bench-consumer",
            "OUTBOXKIT_NODE_ID": f"bench-consumer-{i}",
            # bench.apps must be importable by the child; the root goes last (see bench/__init__).
            "PYTHONPATH": os.pathsep.join(
                p for p in (os.environ.get("PYTHONPATH"), str(REPO_ROOT)) if p
            ),
        }
        proc = Proc.start(
            f"consumer-{i}", ["consume", "bench.apps:Trivial"], settings, ctx.log_dir / "drain"
        )
        try:
            proc.wait_for_log('"to": "running"', 60)
            time.sleep(_CONSUMER_LOAD_S)
            code = proc.terminate()
        finally:
            proc.kill()
        assert proc.exit_seconds is not None
        times.append(proc.exit_seconds)
        if code != 0:
            problems.append(f"consumer run {i}: exit code {code}\n{proc.log_tail(10)}")
    return times, problems


def summary(component: str, times: list[float]) -> Row:
    ms = [t * 1000 for t in times]
    return {
        "component": component,
        "runs": len(ms),
        "p50 ms": percentile(ms, 50),
        "p99 ms": percentile(ms, 99),
        "max ms": max(ms),
    }


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    require_relay()
    cfg = ctx.config
    res = ScenarioResult("drain", "SIGTERM → exit under load")
    res.settings = {
        "consumer": "bench.apps:Trivial, fresh group per run, signalled after "
        f"{_CONSUMER_LOAD_S:g} s of handling",
        "runs": cfg.drain_runs,
        "backlog_rows": cfg.drain_rows,
        "signal_after_share_delivered": _SIGNAL_AT,
        "batch_size": batch_size(cfg),
    }
    t0 = time.perf_counter()
    times, problems = relay_drains(ctx)
    row = summary("relay", times)
    res.rows.append(row)
    res.figures["relay_p50_ms"] = row["p50 ms"]
    res.figures["relay_p99_ms"] = row["p99 ms"]
    res.notes.append(f"relay runs took {time.perf_counter() - t0:.0f} s in all")
    if importlib.util.find_spec("outboxkit.consumer") is None:
        res.notes.append("consumer: not measured, outboxkit.consumer is not there yet")
    else:
        t0 = time.perf_counter()
        ctimes, cproblems = consumer_drains(ctx)
        row = summary("consumer", ctimes)
        res.rows.append(row)
        res.figures["consumer_p50_ms"] = row["p50 ms"]
        res.figures["consumer_p99_ms"] = row["p99 ms"]
        problems += cproblems
        res.notes.append(f"consumer runs took {time.perf_counter() - t0:.0f} s in all")
    res.notes.extend(problems)
    if problems:
        raise RuntimeError("; ".join(problems))
    return res
