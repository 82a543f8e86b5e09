"""outboxkit admin: inspect the outbox, requeue failed rows, purge old ones.

Exit codes: 0 done, 2 bad input (unknown event id, bad time range, conflicting
selectors, bad settings), 3 database or Redis unreachable. Passwords from URLs
never reach the output.

Text output escapes control characters (C0, DEL, C1) and bidirectional
overrides in every string as ``\\xNN``/``\\uNNNN``: topics, event ids, keys and
errors come from rows anyone may have written, and must not drive the
operator's terminal. ``--json`` output is escaped by the JSON encoder.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa

from outboxkit.admin.discard import discard
from outboxkit.admin.requeue import RequeueResult, Selection, Skipped, requeue
from outboxkit.admin.rows import list_failed, read_recovery, readable_edge_times, show_row
from outboxkit.admin.settings import AdminSettings
from outboxkit.admin.status import (
    RelayView,
    ShardView,
    TableStatus,
    read_relay,
    read_shards,
    read_table_status,
)
from outboxkit.errors import SchemaNotAppliedError
from outboxkit.relay.retention import count_purgeable, purge
from outboxkit.runtime.db import database_url_problem
from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.exitcodes import EXIT_CONFIG, EXIT_DEPENDENCY, EXIT_OK
from outboxkit.runtime.logs import UNSAFE_TEXT, logging_configured, redact, redact_url
from outboxkit.runtime.parse import format_ts, parse_retention, parse_time
from outboxkit.runtime.settings import (
    add_arguments,
    default_node_id,
    invalid,
    load,
    parse_duration,
)
from outboxkit.schema.table import STATUSES

__all__ = ["register"]

_SHOWN_IDS = 20
#: What a terminal acts on or splits lines on (controls, separators, bidirectional
#: marks): the log formatters' set, so both show foreign text the same way.
_UNSAFE = UNSAFE_TEXT
_PROGRESS_EVERY_S = 5.0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "admin",
        help="inspect the outbox, requeue failed rows, purge delivered ones",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    asub = p.add_subparsers(dest="admin_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    add_arguments(common.add_argument_group("connection"), AdminSettings)
    common.add_argument("--json", action="store_true", help="print JSON instead of text")

    s = asub.add_parser(
        "status",
        parents=[common],
        help="rows per status and topic, backlog age, leases, paused topics, shard owners",
    )
    s.add_argument(
        "--relay-url",
        action="append",
        default=[],
        metavar="URL",
        help="a relay's health port, e.g. http://relay-1:8080 (repeatable); "
        "shows its state and paused topics",
    )
    s.set_defaults(func=_status)

    f = asub.add_parser("failed", parents=[common], help="list failed rows with their errors")
    f.add_argument("--limit", type=_positive_int, default=50, help="rows per page [50]")
    f.add_argument(
        "--after-id", type=_non_negative_int, default=0, help="start after this row id (paging)"
    )
    f.add_argument("--topic", action="append", default=[], help="only this topic (repeatable)")
    f.add_argument("--show-payload", action="store_true", help="include the payloads")
    f.set_defaults(func=_failed)

    sh = asub.add_parser("show", parents=[common], help="one row, every column")
    sh.add_argument("event_id", metavar="EVENT_ID")
    sh.add_argument(
        "--show-payload",
        action="store_true",
        help="include the payload (as text when UTF-8, else base64)",
    )
    sh.set_defaults(func=_show)

    r = asub.add_parser(
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
    r.add_argument("--id", action="append", type=_id_list, default=[], help="row id(s), 1,2,3")
    r.add_argument("--event-id", action="append", default=[], help="event id (repeatable)")
    r.add_argument("--topic", action="append", default=[], help="rows of this topic (repeatable)")
    r.add_argument("--since", help="created at or after this time (ISO 8601)")
    r.add_argument("--until", help="created before this time (ISO 8601)")
    r.add_argument("--all-failed", action="store_true", help="every failed row")
    r.add_argument("--include-retryable", action="store_true", help="also reset retryable rows")
    r.add_argument("--dry-run", action="store_true", help="print what would change; change nothing")
    r.set_defaults(func=_requeue)

    d = asub.add_parser(
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
    d.add_argument("--id", action="append", type=_id_list, default=[], help="row id(s), 1,2,3")
    d.add_argument("--event-id", action="append", default=[], help="event id (repeatable)")
    d.add_argument("--topic", action="append", default=[], help="rows of this topic (repeatable)")
    d.add_argument("--since", help="created at or after this time (ISO 8601)")
    d.add_argument("--until", help="created before this time (ISO 8601)")
    d.add_argument("--all-failed", action="store_true", help="every failed row")
    d.add_argument("--reason", help="why, kept in the recovery log (e.g. a ticket)")
    d.add_argument("--dry-run", action="store_true", help="print what would go; change nothing")
    d.set_defaults(func=_discard, include_retryable=False)

    pu = asub.add_parser(
        "purge",
        parents=[common],
        help="delete delivered rows older than a retention, in small batches",
        description=(
            "Delete rows with status delivered whose delivered_at is older than "
            "--older-than, in batches of --batch-size with --pause between them. "
            "Never touches other statuses. Ctrl-C stops after the current batch."
        ),
    )
    pu.add_argument(
        "--older-than",
        required=True,
        help="retention, e.g. 7d, 12h, 30m (delivered_at before now minus this)",
    )
    pu.add_argument(
        "--batch-size", type=_positive_int, default=1000, help="rows per transaction [1000]"
    )
    pu.add_argument(
        "--pause", default="0.2", help="pause between batches, seconds or 200ms, at most 60 s [0.2]"
    )
    pu.add_argument("--dry-run", action="store_true", help="count what would be deleted")
    pu.set_defaults(func=_purge)

    rc = asub.add_parser(
        "recovery",
        parents=[common],
        help="recent recovery events: lease reclaims, out-of-order acks, requeues, discards, "
        "purges",
    )
    rc.add_argument("--limit", type=_positive_int, default=20, help="events to show [20]")
    rc.add_argument(
        "--kind",
        help="only this kind: lease-reclaimed, acked-out-of-order, requeue, discard, purge",
    )
    rc.add_argument(
        "--all-tables", action="store_true", help="events of every outbox table, not just --table"
    )
    rc.set_defaults(func=_recovery)


# -- argument types ------------------------------------------------------------


#: Row counts (LIMIT, batch sizes) fit MySQL's signed INT; row ids its BIGINT.
_MAX_COUNT = 2**31 - 1
_MAX_ID = 2**63 - 1
_INT = re.compile(r"\s*[0-9]+\s*", re.ASCII)
#: Longest pause between purge batches (a longer one holds the purge for hours).
_MAX_PAUSE_S = 60.0


def _int_in(text: str, low: int, high: int) -> int:
    if not _INT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
    value = int(text)
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low} (got {value})")
    if value > high:
        raise argparse.ArgumentTypeError(f"must be <= {high} (got {value})")
    return value


def _positive_int(text: str) -> int:
    return _int_in(text, 1, _MAX_COUNT)


def _non_negative_int(text: str) -> int:
    return _int_in(text, 0, _MAX_ID)


def _id_list(text: str) -> list[int]:
    return [_int_in(part, 1, _MAX_ID) for part in text.split(",") if part.strip()]


# -- plumbing --------------------------------------------------------------------


def _run(body: Callable[[AdminSettings, sa.Engine], int]) -> Callable[[argparse.Namespace], int]:
    """Load settings, open the engine, map database trouble to exit codes."""

    def wrapped(args: argparse.Namespace) -> int:
        settings = load(AdminSettings, args=args)
        try:
            engine = sa.create_engine(settings.db_url, pool_pre_ping=True)
        except (sa.exc.ArgumentError, ImportError) as exc:
            raise ConfigError(f"invalid --db-url / OUTBOXKIT_DB_URL: {redact(str(exc))}") from None
        readable_edge_times(engine)
        try:
            # Warnings only (a retried purge batch): the command's output is its text.
            with logging_configured(
                level="WARNING",
                service="outboxkit-admin",
                node_id=default_node_id(),
                log_format=settings.log_format,
            ):
                return body(settings, engine)
        except SchemaNotAppliedError as exc:
            return _fail(str(exc), EXIT_CONFIG)
        except sa.exc.ProgrammingError as exc:
            return _fail(
                f"table {settings.table!r} or its schema is missing in "
                f"{redact_url(settings.db_url)} ({_orig(exc)}): run `outboxkit schema apply`",
                EXIT_CONFIG,
            )
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            # An unknown database or a refused login is the URL's fault (exit 2).
            problem = database_url_problem(exc, settings.db_url)
            if problem is not None:
                return _fail(invalid("db_url", problem), EXIT_CONFIG)
            return _fail(
                f"database {redact_url(settings.db_url)} failed: {_orig(exc)}", EXIT_DEPENDENCY
            )
        finally:
            engine.dispose()

    return wrapped


def _orig(exc: sa.exc.DBAPIError) -> str:
    orig = exc.orig
    if orig is None:
        return type(exc).__name__
    return redact(f"{type(orig).__name__}: {orig}")


def _safe(value: object) -> str:
    """``value`` as terminal-safe text (``-`` for None); see the module docstring."""
    return _UNSAFE.sub(_escape, "-" if value is None else str(value))


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _fail(message: str, code: int) -> int:
    print(f"outboxkit admin: {_safe(redact(message))}", file=sys.stderr)
    return code


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=False, default=str))


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_safe(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _ids_text(ids: Sequence[int], total: int) -> str:
    shown = ", ".join(str(i) for i in ids[:_SHOWN_IDS])
    more = total - min(len(ids), _SHOWN_IDS)
    return shown + (f" (+{more} more)" if more > 0 else "")


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


# -- status ----------------------------------------------------------------------


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
            _print_json(_status_json(settings, table, relays, shards, shard_error))
        else:
            _status_text(settings, table, relays, shards, shard_error)
        return EXIT_OK

    return _run(body)(args)


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
    where = _safe(redact_url(settings.db_url))
    print(f"table {t.table} in {where} (db time {format_ts(t.db_now)})")
    print()
    _print_table(["status", "rows"], [[s, t.counts[s]] for s in STATUSES])
    print()
    print(f"oldest pending:     {_age_text(t.oldest_pending_age_s)}")
    print(f"oldest undelivered: {_age_text(t.oldest_undelivered_age_s)}")
    print(
        f"leases: {t.leases_live} live, {t.leases_expired} expired"
        + (" (a relay reclaims expired leases on its next claim)" if t.leases_expired else "")
    )
    for o in t.lease_owners:
        print(f"  {_safe(o.owner)}: {o.live} live, {o.expired} expired")
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
        _print_table(
            ["topic", *STATUSES],
            [[topic, *(counts[s] for s in STATUSES)] for topic, counts in t.by_topic.items()],
        )
    for r in relays:
        print()
        if r.error:
            print(f"relay {_safe(r.url)}: unreachable ({_safe(r.error)})")
            continue
        state = _safe(r.state or "unknown state")
        print(f"relay {_safe(r.url)}: {state}, {'ready' if r.ready else 'not ready'}")
        if not r.paused_topics:
            print("  no paused topics")
        for topic, reason in r.paused_topics.items():
            print(f"  paused {_safe(topic)}: {_safe(reason or 'no reason given')}")
    if shard_error:
        print()
        print(f"shard owners: unavailable ({_safe(shard_error)})")
    elif shards is not None:
        print()
        print(f"shard owners ({shards.shard_count} shards):")
        for node, owned in shards.owners.items():
            print(f"  {_safe(node)}: {_ranges(owned)} ({len(owned)})")
        if shards.unowned:
            print(f"  unowned: {_ranges(shards.unowned)} ({len(shards.unowned)})")


# -- failed, show, recovery ----------------------------------------------------------


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
            _print_json({"rows": [r.as_dict() for r in rows], "next_after_id": next_after})
            return EXIT_OK
        if not rows:
            print("no failed rows" + (" after that id" if args.after_id else ""))
            return EXIT_OK
        _print_table(
            ["id", "event_id", "topic", "key", "attempts", "updated_at", "last_error"],
            [
                [r.id, r.event_id, r.topic, r.key, r.attempts, r.updated_at, r.last_error]
                for r in rows
            ],
        )
        if args.show_payload:
            print()
            for r in rows:
                print(f"payload of {r.id}: {_safe(json.dumps(r.payload, ensure_ascii=False))}")
        if next_after is not None:
            print(f"\nmore may follow: --after-id {next_after}")
        return EXIT_OK

    return _run(body)(args)


def _show(args: argparse.Namespace) -> int:
    def body(settings: AdminSettings, engine: sa.Engine) -> int:
        row = show_row(
            engine, table=settings.table, event_id=args.event_id, show_payload=args.show_payload
        )
        if args.json:
            _print_json(row)
            return EXIT_OK
        width = max(len(k) for k in row)
        for key, value in row.items():
            shown = json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value
            print(f"{key.ljust(width)}  {_safe(shown)}")
        return EXIT_OK

    return _run(body)(args)


def _recovery(args: argparse.Namespace) -> int:
    def body(settings: AdminSettings, engine: sa.Engine) -> int:
        events = read_recovery(
            engine,
            table=None if args.all_tables else settings.table,
            limit=args.limit,
            kind=args.kind,
        )
        if args.json:
            _print_json([dataclasses.asdict(e) for e in events])
            return EXIT_OK
        if not events:
            print("no recovery events")
            return EXIT_OK
        _print_table(
            ["at", "kind", "node", "table", "detail"],
            [
                [e.at, e.kind, e.node_id, e.table, json.dumps(e.detail, separators=(",", ":"))]
                for e in events
            ],
        )
        return EXIT_OK

    return _run(body)(args)


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


def _requeue(args: argparse.Namespace) -> int:
    selection = _selection(args)
    selection.validate()  # bad input fails before any connection is made

    def body(settings: AdminSettings, engine: sa.Engine) -> int:
        result = requeue(engine, table=settings.table, selection=selection, dry_run=args.dry_run)
        if args.json:
            _print_json(
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

    return _run(body)(args)


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
            f"({statuses} -> pending, attempts 0): ids {_ids_text(result.ids, result.count)}"
        )
    _skipped_text(result.skipped)


def _skipped_text(skipped: Sequence[Skipped]) -> None:
    if skipped:
        print(f"skipped {len(skipped)} selected row(s):")
        for s in skipped[:_SHOWN_IDS]:
            print(f"  id {s.id} (event {_safe(s.event_id)}): {_safe(s.reason)}")
        if len(skipped) > _SHOWN_IDS:
            print(f"  (+{len(skipped) - _SHOWN_IDS} more)")


# -- discard -------------------------------------------------------------------------


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
            _print_json(
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
                f"{_ids_text(result.ids, result.count)}"
            )
        else:
            print(
                f"discarded {result.count} failed row{'s' if result.count != 1 else ''} "
                f"from {table} for good: ids {_ids_text(result.ids, result.count)}; "
                "recorded in the recovery log (outboxkit admin recovery --kind discard)"
            )
        _skipped_text(result.skipped)
        return EXIT_OK

    return _run(body)(args)


# -- purge ---------------------------------------------------------------------------


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
                _print_json({"dry_run": True, "would_delete": n, "cutoff": format_ts(cutoff)})
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
            _print_json(
                {
                    "deleted": result.deleted,
                    "batches": result.batches,
                    "cutoff": format_ts(result.cutoff),
                    "stopped": result.stopped,
                }
            )
        else:
            print(
                f"{'stopped early: ' if result.stopped else ''}deleted {result.deleted} "
                f"delivered rows from {settings.table} (delivered before "
                f"{format_ts(result.cutoff)}) in {result.batches} batches"
            )
        return EXIT_OK

    return _run(body)(args)
