"""Scenario 2, the producer ceiling: confluent-kafka publishing the benchmark's
events from memory with the relay's producer settings (acks, idempotence,
compression, linger), no database anywhere.

Two modes: *streaming* keeps the producer's queue full (the most Kafka can take
from one Python process), *lock-step* waits for every report after each
``batch_size`` messages, which is what a claim → publish → finalize loop without
overlap would see.
"""

from __future__ import annotations

from bench import data
from bench.context import BenchContext
from bench.kafka import produce, relay_producer_config
from bench.report import ScenarioResult
from bench.scenarios import Results
from bench.scenarios.common import batch_size


def run(ctx: BenchContext, results: Results) -> ScenarioResult:
    cfg = ctx.config
    res = ScenarioResult("producer-ceiling", "confluent-kafka alone, from memory")
    msgs = data.messages(cfg.rows, keys=cfg.keys, payload_bytes=cfg.payload_bytes)
    config = relay_producer_config(ctx.services.kafka_bootstrap)
    batch = batch_size(cfg)
    res.settings = {
        "producer": {k: v for k, v in config.items() if k != "bootstrap.servers"},
        "messages": len(msgs),
        "payload_bytes": cfg.payload_bytes,
        "keys": cfg.keys,
        "partitions": cfg.partitions,
        "lockstep_batch": batch,
    }
    for mode, flush_every in (("streaming", None), (f"lock-step, batches of {batch}", batch)):
        topic = ctx.topic("producer")
        out = produce(config, topic, msgs, flush_every=flush_every)
        ctx.delete_topic(topic)
        res.rows.append(
            {
                "mode": mode,
                "messages": out.acked,
                "errors": out.errors,
                "seconds": out.seconds,
                "msgs/s": out.rate,
                "MB/s": out.acked * cfg.payload_bytes / out.seconds / 1e6,
            }
        )
        key = "rate" if flush_every is None else "lockstep_rate"
        res.figures[key] = out.rate
        if out.errors:
            res.notes.append(f"{mode}: {out.errors} delivery errors")
    return res
