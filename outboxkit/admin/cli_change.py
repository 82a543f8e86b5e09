"""The ``outboxkit admin`` commands that change rows: ``requeue`` and ``discard``
(failed rows, chosen by the same selectors) and ``purge`` (delivered rows past a
retention), each parser next to its handler. Each takes ``--dry-run``, and bad
input fails before a connection is made."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa

from outboxkit.admin.cli_common import (
    SHOWN_IDS,
    id_list,
    ids_text,
    positive_int,
    print_json,
    run,
    safe,
)
from outboxkit.admin.discard import discard
from outboxkit.admin.requeue import RequeueResult, Selection, Skipped, requeue
from outboxkit.admin.settings import AdminSettings
from outboxkit.relay.retention import count_purgeable, purge
from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.exitcodes import EXIT_OK
from outboxkit.runtime.parse import format_ts, parse_retention, parse_time
from outboxkit.runtime.settings import parse_duration

_PROGRESS_EVERY_S = 5.0
#: Longest pause between purge batches (a longer one holds the purge for hours).
_MAX_PAUSE_S = 60.0


# -- requeue -----------------------------------------------------------------------


def _selection(args: argparse.Namespace) -> Selection:
    return Selection(
        ids=tuple(i for chunk in args.id for i in chunk),
        event_ids=tuple(args.event_id),
        topics=tuple(args.topic),
        since=parse_time(args.since, what="--since") if args.since is not None else None,
        until=parse_time(args.until, what="--until") if args.until is not None else None,
        all_failed=args.all_failed,
        include_retryable=args.include_retryable,
    )


def _add_selectors(p: argparse.ArgumentParser) -> None:
    """The flags :func:`_selection` reads: requeue and discard choose rows alike."""
    p.add_argument("--id", action="append", type=id_list, default=[], help="row id(s), 1,2,3")
    p.add_argument("--event-id", action="append", default=[], help="event id (repeatable)")
    p.add_argument("--topic", action="append", default=[], help="rows of this topic (repeatable)")
    p.add_argument("--since", help="created at or after this time (ISO 8601)")
    p.add_argument("--until", help="created before this time (ISO 8601)")
    p.add_argument("--all-failed", action="store_true", help="every failed row")


def add_requeue_parser(actions: Any, common: argparse.ArgumentParser) -> None:
    """``outboxkit admin requeue``; ``common`` holds the connection flags and ``--json``."""
    p = actions.add_parser(
        "requeue",
        parents=[common],
        help="set failed rows back to pending with a fresh retry budget",
        description=(
            "Set selected failed rows (and retryable ones with --include-retryable, and "
            "rows whose status is outside the enum) to pending, attempts 0, eligible now. "
            "Rows a relay holds (delivering) are never changed; rows locked at that "
            "instant are skipped and reported. "
            "--id/--event-id select rows exactly; --topic, --since/--until (created_at, "
            "ISO 8601, UTC unless an offset is given) and --all-failed select sets and "
            "combine with AND."
        ),
    )
    _add_selectors(p)
    p.add_argument("--include-retryable", action="store_true", help="also reset retryable rows")
    p.add_argument("--dry-run", action="store_true", help="print what would change; change nothing")
    p.set_defaults(func=_requeue)


def _requeue(args: argparse.Namespace) -> int:
    selection = _selection(args)
    selection.validate()  # bad input fails before any connection is made

    def body(settings: AdminSettings, engine: sa.Engine) -> int:
        result = requeue(engine, table=settings.table, selection=selection, dry_run=args.dry_run)
        if args.json:
            print_json(
                {
                    "dry_run": result.dry_run,
                    "count": result.count,
                    "ids": result.ids,
                    "skipped": [dataclasses.asdict(s) for s in result.skipped],
                }
            )
        else:
            _requeue_text(settings.table, selection, result)
        return EXIT_OK

    return run(body)(args)


def _requeue_text(table: str, selection: Selection, result: RequeueResult) -> None:
    statuses = "/".join(selection.statuses)
    if result.count == 0:
        print(
            f"no {statuses} rows matched in {table}: nothing "
            + ("would be " if result.dry_run else "")
            + "requeued"
        )
    else:
        verb = "would requeue" if result.dry_run else "requeued"
        prefix = "dry run: " if result.dry_run else ""
        print(
            f"{prefix}{verb} {result.count} row{'s' if result.count != 1 else ''} in {table} "
            f"({statuses} -> pending, attempts 0): ids {ids_text(result.ids, result.count)}"
        )
    _skipped_text(result.skipped)


def _skipped_text(skipped: Sequence[Skipped]) -> None:
    if skipped:
        print(f"skipped {len(skipped)} selected row(s):")
        for s in skipped[:SHOWN_IDS]:
            print(f"  id {s.id} (event {safe(s.event_id)}): {safe(s.reason)}")
        if len(skipped) > SHOWN_IDS:
            print(f"  (+{len(skipped) - SHOWN_IDS} more)")


# -- discard -------------------------------------------------------------------------


def add_discard_parser(actions: Any, common: argparse.ArgumentParser) -> None:
    """``outboxkit admin discard``; ``common`` holds the connection flags and ``--json``."""
    p = actions.add_parser(
        "discard",
        parents=[common],
        help="delete failed rows for good, each recorded in the recovery log",
        description=(
            "Delete selected failed rows: their events are never sent. Only rows with "
            "status failed are deleted; rows a relay holds (delivering) and every other "
            "status are never touched, rows locked at that instant are skipped and "
            "reported. Each chunk of deleted rows is recorded, in the same transaction, "
            "as a 'discard' recovery event (ids, event ids, topics, keys, errors, "
            "--reason): see `outboxkit admin recovery --kind discard`. Selectors as for "
            "requeue."
        ),
    )
    _add_selectors(p)
    p.add_argument("--reason", help="why, kept in the recovery log (e.g. a ticket)")
    p.add_argument("--dry-run", action="store_true", help="print what would go; change nothing")
    p.set_defaults(func=_discard, include_retryable=False)


def _discard(args: argparse.Namespace) -> int:
    selection = _selection(args)
    selection.validate()  # bad input fails before any connection is made

    def body(settings: AdminSettings, engine: sa.Engine) -> int:
        result = discard(
            engine,
            table=settings.table,
            selection=selection,
            reason=args.reason,
            dry_run=args.dry_run,
        )
        if args.json:
            print_json(
                {
                    "dry_run": result.dry_run,
                    "count": result.count,
                    "ids": result.ids,
                    "skipped": [dataclasses.asdict(s) for s in result.skipped],
                }
            )
            return EXIT_OK
        table = settings.table
        if result.count == 0:
            print(
                f"no failed rows matched in {table}: nothing "
                + ("would be " if result.dry_run else "")
                + "discarded"
            )
        elif result.dry_run:
            print(
                f"dry run: would discard {result.count} failed row"
                f"{'s' if result.count != 1 else ''} from {table}: ids "
                f"{ids_text(result.ids, result.count)}"
            )
        else:
            print(
                f"discarded {result.count} failed row{'s' if result.count != 1 else ''} "
                f"from {table} for good: ids {ids_text(result.ids, result.count)}; "
                "recorded in the recovery log (outboxkit admin recovery --kind discard)"
            )
        _skipped_text(result.skipped)
        return EXIT_OK

    return run(body)(args)


# -- purge ---------------------------------------------------------------------------


def add_purge_parser(actions: Any, common: argparse.ArgumentParser) -> None:
    """``outboxkit admin purge``; ``common`` holds the connection flags and ``--json``."""
    p = actions.add_parser(
        "purge",
        parents=[common],
        help="delete delivered rows older than a retention, in small batches",
        description=(
            "Delete rows with status delivered whose delivered_at is older than "
            "--older-than, in batches of --batch-size with --pause between them, "
            "then the payload rows whose outbox row is gone (left by a 0.2.x purge). "
            "Never touches other statuses. Ctrl-C stops after the current batch."
        ),
    )
    p.add_argument(
        "--older-than",
        required=True,
        help="retention, e.g. 7d, 12h, 30m (delivered_at before now minus this)",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=1000, help="rows per transaction [1000]"
    )
    p.add_argument(
        "--pause", default="0.2", help="pause between batches, seconds or 200ms, at most 60 s [0.2]"
    )
    p.add_argument("--dry-run", action="store_true", help="count what would be deleted")
    p.set_defaults(func=_purge)


@contextlib.contextmanager
def _stop_on_signal() -> Iterator[threading.Event]:
    """Ctrl-C / SIGTERM end the purge after the current batch instead of mid-statement."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _purge(args: argparse.Namespace) -> int:
    try:
        older_than = parse_retention(args.older_than)
    except ValueError as exc:
        raise ConfigError(f"invalid --older-than: {exc} (got {args.older_than!r})") from None
    try:
        pause = parse_duration(args.pause)
    except ValueError as exc:
        raise ConfigError(f"invalid --pause: {exc} (got {args.pause!r})") from None
    if not 0 <= pause <= _MAX_PAUSE_S:
        raise ConfigError(
            f"invalid --pause: must be between 0 and {_MAX_PAUSE_S:g} s, or the purge holds "
            f"for hours between batches (got {args.pause!r})"
        )

    def body(settings: AdminSettings, engine: sa.Engine) -> int:
        if args.dry_run:
            n, cutoff = count_purgeable(engine, table=settings.table, older_than_s=older_than)
            if args.json:
                print_json({"dry_run": True, "would_delete": n, "cutoff": format_ts(cutoff)})
            else:
                print(
                    f"dry run: would delete {n} delivered rows from {settings.table} "
                    f"(delivered before {format_ts(cutoff)})"
                )
            return EXIT_OK
        deleted = 0
        last_report = time.monotonic()

        def progress(n: int) -> None:
            nonlocal deleted, last_report
            deleted += n
            if not args.json and time.monotonic() - last_report >= _PROGRESS_EVERY_S:
                last_report = time.monotonic()
                print(f"  ... {deleted} rows deleted so far", file=sys.stderr, flush=True)

        with _stop_on_signal() as stop:
            result = purge(
                engine,
                table=settings.table,
                older_than_s=older_than,
                batch_size=args.batch_size,
                pause_s=pause,
                stop=stop.is_set,
                on_batch=progress,
                record_empty=True,
            )
        if args.json:
            print_json(
                {
                    "deleted": result.deleted,
                    "batches": result.batches,
                    "cutoff": format_ts(result.cutoff),
                    "stopped": result.stopped,
                    "payload_orphans": result.orphans,
                }
            )
        else:
            print(
                f"{'stopped early: ' if result.stopped else ''}deleted {result.deleted} "
                f"delivered rows from {settings.table} (delivered before "
                f"{format_ts(result.cutoff)}) in {result.batches} batches"
                + (
                    f", and {result.orphans} payload rows whose outbox row was gone"
                    if result.orphans
                    else ""
                )
            )
        return EXIT_OK

    return run(body)(args)
