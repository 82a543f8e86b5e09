"""Scenario 3, relay throughput: the backlog drained by 1, 2 and 3 relay processes
(more than one share the shards through Redis leases), next to the DB and
producer ceilings measured earlier in the same run.

Rates count from just before the first message reached the topic to the moment
the last row's message did, so process start-up is left out.  ``relay cpu`` is
the relays' CPU time as a share of one core over that interval (2 cores on the
reference machine); ``mariadb cpu`` and ``kafka cpu`` likewise.
"""

from __future__ import annotations

from bench.context import BenchContext
from bench.report import ScenarioResult
from bench.scenarios import Results, Unavailable
from bench.scenarios.common import batch_size, template
from bench.scenarios.relay_runs import drain_backlog, require_relay, require_shard_leases


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    require_relay()
    cfg = ctx.config
    res = ScenarioResult("relay-throughput", "a pre-filled backlog drained by 1, 2, 3 relays")
    res.settings = {
        "rows": cfg.rows,
        "keys": cfg.keys,
        "payload_bytes": cfg.payload_bytes,
        "batch_size": batch_size(cfg),
        "shards": cfg.shards,
        "partitions": cfg.partitions,
        "relay_counts": list(cfg.relay_counts),
    }
    db = results.get("db-ceiling")
    producer = results.get("producer-ceiling")
    db_rate = db.figures.get("rate") if db else None
    producer_rate = producer.figures.get("rate") if producer else None
    source = template(ctx, cfg.rows)
    for n in cfg.relay_counts:
        if n > 1:
            try:
                require_shard_leases(ctx)
            except Unavailable as exc:
                res.notes.append(f"{n} relays: skipped, {exc}")
                continue
        out = drain_backlog(ctx, source=source, rows=cfg.rows, relays=n, label=f"relay{n}")
        res.rows.append(
            {
                "relays": n,
                "rows": out.rows,
                "seconds": out.seconds,
                "events/s": out.rate,
                "vs DB ceiling": out.rate / db_rate if db_rate else None,
                "vs producer ceiling": out.rate / producer_rate if producer_rate else None,
                "duplicates": out.messages - out.rows,
                **out.cpu_row(),
            }
        )
        res.figures[f"rate_{n}"] = out.rate
        res.notes.extend(out.notes)
        if out.profile:
            res.tables[f"profile of relay 0 of {n}, share of its loop's wall time"] = out.profile
    return res
