"""``outboxkit demo``: the whole outbox flow on this machine; see ``docs/demo.md``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from outboxkit.runtime.errors import ConfigError, DependencyError
from outboxkit.runtime.exitcodes import EXIT_DEPENDENCY, EXIT_FAILURE, EXIT_OK
from outboxkit.runtime.logs import LOG_FORMATS, redact
from outboxkit.runtime.settings import parse_duration, valid_database_url, valid_redis_url
from outboxkit.writer import validate_topic

__all__ = ["register"]

#: A laptop demo: more relays or a higher rate only measures the laptop.
_MAX_RELAYS = 16
_MAX_RATE = 100_000.0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run an order service, two relays and a consumer end to end, with live counts",
        description=(
            "Start MariaDB, Kafka and Redis (deploy/local/up.sh) unless their URLs are "
            "given, apply the schema, start two relays and the example consumer, write "
            "orders and their events for --duration seconds, show written / delivered / "
            "consumed, then drain everything and print a summary. Ctrl-C stops writing "
            "and drains; a second Ctrl-C drains at once. Exit 0 when delivered = consumed "
            "= written and every process exited cleanly. Settings come from these flags "
            "only (never from OUTBOXKIT_* variables, so the demo cannot write into a "
            "database configured for something else)."
        ),
    )
    p.add_argument("--duration", default="20", help="seconds of writing orders [20]")
    p.add_argument("--rate", type=float, default=200.0, help="orders per second [200]")
    p.add_argument("--relays", type=int, default=2, help="relay processes [2]")
    p.add_argument("--topic", default="orders", help="topic of the order events [orders]")
    p.add_argument(
        "--settle-timeout",
        default="60",
        help="after writing, how long to wait for delivery and consumption [60]",
    )
    p.add_argument("--db-url", help="use this database server instead of the local one")
    p.add_argument("--kafka-bootstrap", help="use this Kafka instead of the local one")
    p.add_argument("--redis-url", help="use this Redis instead of the local one")
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="json",
        help="format of the relays' and the consumer's log files: json or console "
        "(readable lines) [json]",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        help="where the processes' logs go [./.outboxkit-demo/<run id>]",
    )
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from outboxkit.demo.runner import DemoOptions, run_demo

    try:
        duration = parse_duration(args.duration)
        settle = parse_duration(args.settle_timeout)
    except ValueError as exc:
        raise ConfigError(f"invalid --duration or --settle-timeout: {exc}") from None
    if duration <= 0 or settle <= 0:
        raise ConfigError("invalid --duration or --settle-timeout: must be > 0")
    if not 0 < args.rate <= _MAX_RATE:  # also refuses nan
        raise ConfigError(f"invalid --rate: must be > 0 and at most {_MAX_RATE:g} orders/s")
    if not 1 <= args.relays <= _MAX_RELAYS:
        raise ConfigError(f"invalid --relays: must be between 1 and {_MAX_RELAYS}")
    try:
        validate_topic(args.topic)
    except ValueError as exc:
        raise ConfigError(f"invalid --topic: {exc}") from None
    for flag, url in (("--db-url", args.db_url), ("--redis-url", args.redis_url)):
        check = valid_database_url if flag == "--db-url" else valid_redis_url
        problem = check(url)
        if problem:
            raise ConfigError(f"invalid {flag}: {problem}")
    try:
        summary = run_demo(
            DemoOptions(
                db_url=args.db_url,
                kafka_bootstrap=args.kafka_bootstrap,
                redis_url=args.redis_url,
                duration=duration,
                rate=args.rate,
                relays=args.relays,
                topic=args.topic,
                settle_timeout=settle,
                state_dir=args.state_dir,
                log_format=args.log_format,
            )
        )
    except DependencyError as exc:
        print(f"outboxkit demo: {redact(str(exc))}", file=sys.stderr)
        return EXIT_DEPENDENCY
    return EXIT_OK if summary.ok else EXIT_FAILURE
