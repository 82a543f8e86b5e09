"""Pieces several scenarios share: the relay's batch size, the backlog template."""

from __future__ import annotations

import importlib
from typing import TypeVar

from bench import data
from bench.config import BenchConfig
from bench.context import BenchContext
from bench.dblog import LogMeter

TEMPLATE_TABLE = "bench_template"
#: The relay's default claim batch until its settings can be imported.
FALLBACK_BATCH_SIZE = 500

T = TypeVar("T")


def batch_size(cfg: BenchConfig) -> int:
    return cfg.batch_size or relay_default("batch_size", FALLBACK_BATCH_SIZE)


def relay_default(name: str, fallback: T) -> T:
    """The default of the relay setting ``name`` (a ``RelaySettings`` field), or
    ``fallback`` until the relay's settings can be imported."""
    try:
        settings = importlib.import_module("outboxkit.relay.settings")
    except ImportError:
        return fallback
    fields = getattr(getattr(settings, "RelaySettings", None), "__dataclass_fields__", {})
    value = getattr(fields.get(name), "default", None)
    return value if isinstance(value, type(fallback)) else fallback


def template(ctx: BenchContext, rows: int) -> str:
    """A table with at least ``rows`` pending rows, written once through the writer API.

    Scenarios copy their backlog from it (``data.copy_backlog``), so each gets
    the very same rows without paying the writer's cost again.
    """
    have = int(ctx.cache.get("template_rows", 0))
    if have < rows:
        logged = LogMeter(ctx.engine).begin()
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
        written = logged.bytes()
        ctx.cache.setdefault("template_fills", []).append(
            {
                "rows": out.rows,
                "seconds": round(out.seconds, 2),
                "rows_per_s": round(out.rate),
                # what the writer's own inserts add to the binary log / WAL
                "log_bytes_per_event": None if written is None else round(written / out.rows, 1),
            }
        )
    return TEMPLATE_TABLE
