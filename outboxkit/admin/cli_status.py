"""``outboxkit admin status``: its parser, and the table, leases, relays and shard
owners it prints as text or JSON."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from outboxkit.admin.cli_common import print_json, print_table, run, safe
from outboxkit.admin.settings import AdminSettings
from outboxkit.admin.status import (
    RelayView,
    ShardView,
    TableStatus,
    read_relay,
    read_shards,
    read_table_status,
)
from outboxkit.runtime.exitcodes import EXIT_OK
from outboxkit.runtime.logs import redact, redact_url
from outboxkit.runtime.parse import format_ts
from outboxkit.schema.table import STATUSES


def add_status_parser(actions: Any, common: argparse.ArgumentParser) -> None:
    """``outboxkit admin status``; ``common`` holds the connection flags and ``--json``."""
    p = actions.add_parser(
        "status",
        parents=[common],
        help="rows per status and topic, backlog age, leases, paused topics, shard owners",
    )
    p.add_argument(
        "--relay-url",
        action="append",
        default=[],
        metavar="URL",
        help="a relay's health port, e.g. http://relay-1:8080 (repeatable); "
        "shows its state and paused topics",
    )
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    def body(settings: AdminSettings, engine: sa.Engine) -> int:
        table = read_table_status(engine, table=settings.table)
        relays = [read_relay(url) for url in args.relay_url]
        shards: ShardView | None = None
        shard_error: str | None = None
        if settings.redis_url:
            import redis

            try:
                shards = read_shards(
                    engine, settings.redis_url, table=settings.table, prefix=settings.redis_prefix
                )
            except redis.RedisError as exc:
                shard_error = f"redis {redact_url(settings.redis_url)}: {redact(str(exc))}"
        if args.json:
            print_json(_status_json(settings, table, relays, shards, shard_error))
        else:
            _status_text(settings, table, relays, shards, shard_error)
        return EXIT_OK

    return run(body)(args)


def _status_json(
    settings: AdminSettings,
    t: TableStatus,
    relays: list[RelayView],
    shards: ShardView | None,
    shard_error: str | None,
) -> dict[str, object]:
    return {
        "database": redact_url(settings.db_url),
        "table": t.table,
        "db_now": format_ts(t.db_now),
        "schema_version": t.schema_version,
        "applied_by": t.applied_by,
        "counts": t.counts,
        "topics": t.by_topic,
        "oldest_pending_age_s": t.oldest_pending_age_s,
        "oldest_undelivered_age_s": t.oldest_undelivered_age_s,
        "shard_out_of_range": t.shard_out_of_range,
        "invalid_status": t.invalid_status,
        "leases": {
            "live": t.leases_live,
            "expired": t.leases_expired,
            "owners": [
                {"owner": o.owner, "live": o.live, "expired": o.expired} for o in t.lease_owners
            ],
        },
        "relays": [
            {
                "url": r.url,
                "state": r.state,
                "ready": r.ready,
                "paused_topics": r.paused_topics,
                "error": r.error,
            }
            for r in relays
        ],
        "shards": None
        if shards is None
        else {"count": shards.shard_count, "owners": shards.owners, "unowned": shards.unowned},
        "shards_error": shard_error,
    }


def _ranges(shards: Sequence[int]) -> str:
    parts: list[str] = []
    start = prev = None
    for s in [*shards, None]:
        if s is not None and prev is not None and s == prev + 1:
            prev = s
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = s
    return ", ".join(parts)


def _status_text(
    settings: AdminSettings,
    t: TableStatus,
    relays: list[RelayView],
    shards: ShardView | None,
    shard_error: str | None,
) -> None:
    where = safe(redact_url(settings.db_url))
    print(f"table {t.table} in {where} (db time {format_ts(t.db_now)})")
    applied = (
        f"outboxkit {safe(t.applied_by)}"
        if t.applied_by
        else "unknown (outboxkit before 0.4.0 did not record it)"
    )
    print(f"schema version {t.schema_version}, last applied by {applied}")
    print()
    print_table(["status", "rows"], [[s, t.counts[s]] for s in STATUSES])
    print()
    print(f"oldest pending:     {_age_text(t.oldest_pending_age_s)}")
    print(f"oldest undelivered: {_age_text(t.oldest_undelivered_age_s)}")
    print(
        f"leases: {t.leases_live} live, {t.leases_expired} expired"
        + (" (a relay reclaims expired leases on its next claim)" if t.leases_expired else "")
    )
    for o in t.lease_owners:
        print(f"  {safe(o.owner)}: {o.live} live, {o.expired} expired")
    if t.shard_out_of_range:
        print(
            f"shard out of range: {t.shard_out_of_range} undelivered rows have a shard outside "
            f"0..{(t.shard_count or 1) - 1} (another writer's; relays claim them under "
            "CRC-32 of their key mod the shard count)"
        )
    if t.invalid_status:
        print(
            f"status outside the enum: {t.invalid_status} rows (stored without strict "
            "sql_mode; never claimed, each holds its key's later rows back): "
            "`outboxkit admin requeue --id ...` or --all-failed makes them pending"
        )
    if t.by_topic:
        print()
        print_table(
            ["topic", *STATUSES],
            [[topic, *(counts[s] for s in STATUSES)] for topic, counts in t.by_topic.items()],
        )
    for r in relays:
        print()
        if r.error:
            print(f"relay {safe(r.url)}: unreachable ({safe(r.error)})")
            continue
        state = safe(r.state or "unknown state")
        print(f"relay {safe(r.url)}: {state}, {'ready' if r.ready else 'not ready'}")
        if not r.paused_topics:
            print("  no paused topics")
        for topic, reason in r.paused_topics.items():
            print(f"  paused {safe(topic)}: {safe(reason or 'no reason given')}")
    if shard_error:
        print()
        print(f"shard owners: unavailable ({safe(shard_error)})")
    elif shards is not None:
        print()
        print(f"shard owners ({shards.shard_count} shards):")
        for node, owned in shards.owners.items():
            print(f"  {safe(node)}: {_ranges(owned)} ({len(owned)})")
        if shards.unowned:
            print(f"  unowned: {_ranges(shards.unowned)} ({len(shards.unowned)})")


def _age_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
