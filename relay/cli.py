"""``outboxkit relay``: run one relay process until SIGTERM/SIGINT.

Exit codes: 0 clean drain; 1 unexpected error; 2 bad settings (the message
names the flag and the environment variable); 3 a dependency unreachable at
start, or rows left leased because the database was gone during the drain;
4 forced exit after ``--shutdown-timeout``.
"""

from __future__ import annotations

import argparse
from typing import Any

from outboxkit.relay.settings import RelaySettings
from outboxkit.runtime.logs import configure_logging
from outboxkit.runtime.settings import add_arguments, load

__all__ = ["register"]

_DESCRIPTION = """\
Move outbox rows to Kafka: claim a batch of due rows (id order, per-key order
kept), publish it with an idempotent producer, mark each row delivered,
retryable or failed under its lease token. The first SIGTERM/SIGINT drains
(readiness 503, no new claim, in-flight reports awaited for --flush-timeout,
the rest released with the attempt refunded); a second one hurries; after
--shutdown-timeout the exit is forced (code 4).

Every option can also be set through the environment variable shown with it;
flags win over the environment.

exit codes: 0 clean drain, 1 unexpected error, 2 bad settings, 3 dependency
unreachable at start (or rows left leased: database gone during the drain),
4 forced exit.
"""


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "relay",
        help="publish outbox rows to Kafka (runs until SIGTERM)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, RelaySettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load settings (ConfigError -> exit 2 via the main CLI), then run the relay."""
    from outboxkit.relay.relay import Relay  # Kafka, Redis: only for this command

    settings = load(RelaySettings, args=args)
    configure_logging(
        level=settings.log_level,
        service=settings.service,
        node_id=settings.node_id,
        log_format=settings.log_format,
    )
    return Relay(settings).run(handle_signals=True)
