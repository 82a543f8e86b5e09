"""The read-only row commands of ``outboxkit admin``: ``failed``, ``show`` and
``recovery``, each parser next to its handler."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import sqlalchemy as sa

from outboxkit.admin.cli_common import (
    non_negative_int,
    positive_int,
    print_json,
    print_table,
    run,
    safe,
)
from outboxkit.admin.rows import bytes_text, list_failed, read_recovery, show_row
from outboxkit.admin.settings import AdminSettings
from outboxkit.runtime.exitcodes import EXIT_OK

# -- failed ------------------------------------------------------------------------


def add_failed_parser(actions: Any, common: argparse.ArgumentParser) -> None:
    """``outboxkit admin failed``; ``common`` holds the connection flags and ``--json``."""
    p = actions.add_parser("failed", parents=[common], help="list failed rows with their errors")
    p.add_argument("--limit", type=positive_int, default=50, help="rows per page [50]")
    p.add_argument(
        "--after-id", type=non_negative_int, default=0, help="start after this row id (paging)"
    )
    p.add_argument("--topic", action="append", default=[], help="only this topic (repeatable)")
    p.add_argument(
        "--show-payload",
        action="store_true",
        help="include the payloads (as show --show-payload shows them)",
    )
    p.set_defaults(func=_failed)


def _failed(args: argparse.Namespace) -> int:
    def body(settings: AdminSettings, engine: sa.Engine) -> int:
        rows = list_failed(
            engine,
            table=settings.table,
            limit=args.limit,
            after_id=args.after_id,
            topics=tuple(args.topic),
            show_payload=args.show_payload,
        )
        next_after = rows[-1].id if len(rows) == args.limit else None
        if args.json:
            print_json({"rows": [r.as_dict() for r in rows], "next_after_id": next_after})
            return EXIT_OK
        if not rows:
            print("no failed rows" + (" after that id" if args.after_id else ""))
            return EXIT_OK
        print_table(
            ["id", "event_id", "topic", "key", "attempts", "updated_at", "last_error"],
            [
                [r.id, r.event_id, r.topic, r.key, r.attempts, r.updated_at, r.last_error]
                for r in rows
            ],
        )
        if args.show_payload:
            print()
            for r in rows:
                print(f"payload of {r.id}: {safe(bytes_text(r.payload))}")
        if next_after is not None:
            print(f"\nmore may follow: --after-id {next_after}")
        return EXIT_OK

    return run(body)(args)


# -- show --------------------------------------------------------------------------


def add_show_parser(actions: Any, common: argparse.ArgumentParser) -> None:
    """``outboxkit admin show``; ``common`` holds the connection flags and ``--json``."""
    p = actions.add_parser("show", parents=[common], help="one row, every column")
    p.add_argument("event_id", metavar="EVENT_ID")
    p.add_argument(
        "--show-payload",
        action="store_true",
        help="include the payload: text output shows it as text when it is UTF-8, else "
        'as base64:<base64>; --json as {"text": ...} or {"base64": ...}',
    )
    p.set_defaults(func=_show)


def _show(args: argparse.Namespace) -> int:
    def body(settings: AdminSettings, engine: sa.Engine) -> int:
        row = show_row(
            engine, table=settings.table, event_id=args.event_id, show_payload=args.show_payload
        )
        if args.json:
            print_json(row)
            return EXIT_OK
        width = max(len(k) for k in row)
        for key, value in row.items():
            if key == "payload":
                shown = bytes_text(value)  # the text itself, or base64:... (as the key)
            else:
                shown = json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value
            print(f"{key.ljust(width)}  {safe(shown)}")
        return EXIT_OK

    return run(body)(args)


# -- recovery ----------------------------------------------------------------------


def add_recovery_parser(actions: Any, common: argparse.ArgumentParser) -> None:
    """``outboxkit admin recovery``; ``common`` holds the connection flags and ``--json``."""
    p = actions.add_parser(
        "recovery",
        parents=[common],
        help="recent recovery events: lease reclaims, out-of-order acks, requeues, discards, "
        "purges",
    )
    p.add_argument("--limit", type=positive_int, default=20, help="events to show [20]")
    p.add_argument(
        "--kind",
        help="only this kind: lease-reclaimed, acked-out-of-order, requeue, discard, purge",
    )
    p.add_argument(
        "--all-tables", action="store_true", help="events of every outbox table, not just --table"
    )
    p.set_defaults(func=_recovery)


def _recovery(args: argparse.Namespace) -> int:
    def body(settings: AdminSettings, engine: sa.Engine) -> int:
        events = read_recovery(
            engine,
            table=None if args.all_tables else settings.table,
            limit=args.limit,
            kind=args.kind,
        )
        if args.json:
            print_json([dataclasses.asdict(e) for e in events])
            return EXIT_OK
        if not events:
            print("no recovery events")
            return EXIT_OK
        print_table(
            ["at", "kind", "node", "table", "detail"],
            [
                [e.at, e.kind, e.node_id, e.table, json.dumps(e.detail, separators=(",", ":"))]
                for e in events
            ],
        )
        return EXIT_OK

    return run(body)(args)
