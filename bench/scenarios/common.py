"""Pieces several scenarios share: the relay's batch size, the backlog template."""

from __future__ import annotations

import importlib

from bench import data
from bench.config import BenchConfig
from bench.context import BenchContext

TEMPLATE_TABLE = "bench_template"
#: The relay's default claim batch until its settings can be imported.
FALLBACK_BATCH_SIZE = 500


def batch_size(cfg: BenchConfig) -> int:
    if cfg.batch_size:
        return cfg.batch_size
    try:
        settings = importlib.import_module("outboxkit.relay.settings")
    except ImportError:
        return FALLBACK_BATCH_SIZE
    fields = getattr(getattr(settings, "RelaySettings", None), "__dataclass_fields__", {})
    default = fields.get("batch_size")
    value = getattr(default, "default", None)
    return value if isinstance(value, int) else FALLBACK_BATCH_SIZE


def template(ctx: BenchContext, rows: int) -> str:
    """A table with at least ``rows`` pending rows, written once through the writer API.

    Scenarios copy their backlog from it (``data.copy_backlog``), so each gets
    the very same rows without paying the writer's cost again.
    """
    have = int(ctx.cache.get("template_rows", 0))
    if have < rows:
        out = data.fill(
            ctx.engine,
            TEMPLATE_TABLE,
            topic="bench-template",
            rows=rows - have,
            start=have,
            keys=ctx.config.keys,
            payload_bytes=ctx.config.payload_bytes,
            shards=ctx.config.shards,
        )
        ctx.cache["template_rows"] = rows
        ctx.cache.setdefault("template_fills", []).append(
            {"rows": out.rows, "seconds": round(out.seconds, 2), "rows_per_s": round(out.rate)}
        )
    return TEMPLATE_TABLE
