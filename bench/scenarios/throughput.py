"""Scenario 3, relay throughput and scale-out: the backlog drained by 1, 2, 3 and 4
relay processes (more than one share the shards through Redis leases), next to
the DB and producer ceilings measured earlier in the same run.

One relay also drains it with each batch size (``batch_size`` and
``batch_sizes``) and the pipeline on and off (``pipeline_modes``), alternating,
so the comparison shares the run's conditions; several relays with the pipeline
on and off at ``batch_size``. ``rate_N`` is the drain of N relays with the
relay's own defaults (or ``batch_size``). On MySQL/MariaDB with the binary log
on, one relay also drains it with ``--binlog-row-image noblob``
(``rate_1_noblob``, with its database CPU and log bytes beside it).

Rates count from just before the first message reached the topic to the moment
the last row's message did, so process start-up is left out.  ``relay cpu`` is
the relays' CPU time, summed, as a share of one core over that interval (2 cores
on the reference machine); ``mariadb cpu``, ``kafka cpu`` and ``redis cpu``
likewise, and ``machine cpu`` is every process on the machine (the benchmark's
own and anything else running), so the table shows which service tops out first.
``relay cpu s/1k events`` is what the relays spend per 1,000 events delivered.
"""

from __future__ import annotations

from bench.context import BenchContext
from bench.dblog import log_settings
from bench.report import ScenarioResult
from bench.scenarios import Results, Unavailable
from bench.scenarios.common import batch_size, template
from bench.scenarios.relay_runs import (
    DrainRun,
    drain_backlog,
    require_relay,
    require_shard_leases,
)

TITLE = "a pre-filled backlog drained by 1 to N relays: throughput and scale-out"


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    require_relay()
    cfg = ctx.config
    res = ScenarioResult("relay-throughput", TITLE)
    res.settings = {
        "rows": cfg.rows,
        "keys": cfg.keys,
        "payload_bytes": cfg.payload_bytes,
        "batch_size": batch_size(cfg),
        "shards": cfg.shards,
        "partitions": cfg.partitions,
        "relay_counts": list(cfg.relay_counts),
        "batch_sizes": [batch_size(cfg), *cfg.batch_sizes],
        "pipeline_modes": list(cfg.pipeline_modes),
    }
    db = results.get("db-ceiling")
    producer = results.get("producer-ceiling")
    db_rate = db.figures.get("rate") if db else None
    floor_rate = db.figures.get("rate_floor") if db else None
    producer_rate = producer.figures.get("rate") if producer else None
    source = template(ctx, cfg.rows)
    # What the writer's own inserts logged per event, for the relay's to read against.
    fills = [f for f in ctx.cache.get("template_fills", []) if f["log_bytes_per_event"]]
    if fills:
        logged = sum(f["log_bytes_per_event"] * f["rows"] for f in fills)
        res.figures["writer_log_bytes_per_event"] = logged / sum(f["rows"] for f in fills)
    one: float | None = None
    binlog = log_settings(ctx.engine).get("log") == "binlog"
    for n in cfg.relay_counts:
        if n > 1:
            try:
                require_shard_leases(ctx)
            except Unavailable as exc:
                res.notes.append(f"{n} relays: skipped, {exc}")
                continue
        variants: list[tuple[int | None, bool | None, str]] = [(None, None, "server")]
        # One relay: every batch size, pipeline on and off. Several: the default
        # size, on and off (with several relays more rows are leased at once).
        sizes = dict.fromkeys([batch_size(cfg), *(cfg.batch_sizes if n == 1 else ())])
        variants += [(b, bool(p), "server") for b in sizes for p in cfg.pipeline_modes]
        if n == 1 and binlog:
            variants.append((None, None, "noblob"))
        for batch, pipeline, image in variants:
            label = f"relay{n}" if batch is None else f"relay{n}-b{batch}-p{int(bool(pipeline))}"
            if image != "server":
                label += f"-{image}"
            out = drain_backlog(
                ctx,
                source=source,
                rows=cfg.rows,
                relays=n,
                label=label,
                batch=batch,
                pipeline=pipeline,
                extra={"OUTBOXKIT_BINLOG_ROW_IMAGE": image} if image != "server" else None,
            )
            if n == 1 and batch is None and image == "server":
                one = out.rate
            _add_row(res, n, batch, pipeline, out, one, db_rate, producer_rate, floor_rate, image)
            if image != "server":
                res.figures[f"rate_{n}_{image}"] = out.rate
                for figure, value in (
                    ("db_cpu_per_100k", out.db_cpu_per_100k),
                    ("log_bytes_per_event", out.log_bytes_per_event),
                ):
                    if value is not None:
                        res.figures[f"{figure}_{n}_{image}"] = value
            elif batch is None:
                res.figures[f"rate_{n}"] = out.rate
                if (per_1k := out.relay_cpu_per_1k) is not None:
                    res.figures[f"relay_cpu_per_1k_{n}"] = per_1k
                if (db_cpu := out.db_cpu_per_100k) is not None:
                    res.figures[f"db_cpu_per_100k_{n}"] = db_cpu
                if (logged := out.log_bytes_per_event) is not None:
                    res.figures[f"log_bytes_per_event_{n}"] = logged
            else:
                res.figures[f"rate_{n}_b{batch}_p{int(bool(pipeline))}"] = out.rate
                if batch == batch_size(cfg):  # the goals compare these two
                    res.figures[f"rate_{n}_p{int(bool(pipeline))}"] = out.rate
            res.notes.extend(out.notes)
            if out.profile:
                title = f"profile of relay 0 of {n} ({label}), share of its loop's wall time"
                res.tables[title] = out.profile
    return res


def _add_row(
    res: ScenarioResult,
    n: int,
    batch: int | None,
    pipeline: bool | None,
    out: DrainRun,
    one: float | None,
    db_rate: float | None,
    producer_rate: float | None,
    floor_rate: float | None = None,
    image: str = "server",
) -> None:
    res.rows.append(
        {
            "relays": n,
            "batch": batch if batch is not None else "default",
            "pipeline": "default" if pipeline is None else ("on" if pipeline else "off"),
            "row image": image,
            "rows": out.rows,
            "seconds": out.seconds,
            "events/s": out.rate,
            "vs 1 relay": out.rate / one if one else None,
            "vs DB ceiling": out.rate / db_rate if db_rate else None,
            "x floor": out.rate / floor_rate if floor_rate else None,
            "vs producer ceiling": out.rate / producer_rate if producer_rate else None,
            "duplicates": out.messages - out.rows,
            **out.cpu_row(),
        }
    )
