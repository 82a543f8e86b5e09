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
from typing import NoReturn

from outboxkit import __version__
from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.exitcodes import EXIT_CONFIG
from outboxkit.schema.table import SCHEMA_VERSION

#: Modules that contribute a subcommand, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "outboxkit.schema.cli",
    "outboxkit.topics",
    "outboxkit.relay.cli",
    "outboxkit.consumer.cli",
    "outboxkit.admin.cli",
    "outboxkit.demo.cli",
)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``outboxkit relay: error: ... (see --help)``), exit 2.

    Subcommand parsers inherit the class, so every command answers the same way.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {message} (see --help)\n")


def _not_utf8(argv: Sequence[str]) -> str | None:
    """The first argument that is not valid UTF-8 text (decoded with surrogateescape)."""
    for n, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            before = argv[n - 2] if n >= 2 else ""
            return f"argument {n}" + (
                f" (the value of {before})" if before.startswith("--") else ""
            )
        if "\x00" in arg:
            return f"argument {n}"
    return None


def version_text() -> str:
    """What ``outboxkit --version`` prints."""
    return f"outboxkit {__version__} (outbox schema {SCHEMA_VERSION})"


def _asks_version(argv: Sequence[str]) -> bool:
    """Does ``argv`` ask for ``--version`` before any command, as the parser would
    read it (an abbreviation such as ``--vers`` too, help not asked first)?"""
    for arg in argv:
        if arg == "--" or not arg.startswith("-"):
            return False
        if len(arg) > 2 and "--version".startswith(arg) and not "--help".startswith(arg):
            return True
        if arg == "-h" or (len(arg) > 2 and "--help".startswith(arg)):
            return False
    return False


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="outboxkit",
        description="Transactional outbox for MySQL/MariaDB and Kafka.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=version_text(),
        help="print the package version and the outbox schema version it writes and reads",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    bad = _not_utf8(arguments)
    if bad:
        # The value itself is not printed: it may be a secret, and it cannot be shown.
        print(f"outboxkit: {bad} is not valid UTF-8 text", file=sys.stderr)
        return EXIT_CONFIG
    if _asks_version(arguments):
        # Answered before the commands' modules (the relay, the consumer, Kafka,
        # Prometheus) are imported to build the parser: a probe or a script asking
        # for the version pays for the package alone.
        print(version_text())
        return 0
    parser = build_parser()
    args = parser.parse_args(arguments)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"outboxkit {args.command}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
