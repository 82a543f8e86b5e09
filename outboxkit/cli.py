"""``outboxkit`` console script: one subcommand per component.

Each component module registers its own subcommand through ``register(subparsers)``
and sets ``func(args) -> exit code`` on its parser; this module only dispatches.
Signal handlers are installed by the subcommands that run loops, never on import.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from outboxkit import __version__
from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.exitcodes import EXIT_CONFIG

#: Modules that contribute a subcommand, in the order ``--help`` lists them.
COMMAND_MODULES = ("outboxkit.schema.cli", "outboxkit.consumer.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outboxkit",
        description="Transactional outbox for MySQL/MariaDB and Kafka.",
    )
    parser.add_argument("--version", action="version", version=f"outboxkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"outboxkit {args.command}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
