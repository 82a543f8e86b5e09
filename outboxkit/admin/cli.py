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
from typing import Any

from outboxkit.admin import cli_change, cli_read, cli_status
from outboxkit.admin.settings import AdminSettings
from outboxkit.runtime.settings import add_arguments

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add ``admin`` to ``sub``, with the connection flags every action shares."""
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
    # Each action's parser is built next to its handler; this order is --help's.
    cli_status.add_status_parser(asub, common)
    cli_read.add_failed_parser(asub, common)
    cli_read.add_show_parser(asub, common)
    cli_change.add_requeue_parser(asub, common)
    cli_change.add_discard_parser(asub, common)
    cli_change.add_purge_parser(asub, common)
    cli_read.add_recovery_parser(asub, common)
