"""What every ``outboxkit admin`` command shares: the argument types, loading the
settings and opening the database with its failures mapped to exit codes, and the
terminal-safe output.

Each command's parser and handler live together in a module of their group
(``cli_status``, ``cli_read``, ``cli_change``); :mod:`outboxkit.admin.cli`
assembles them into ``outboxkit admin``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence

import sqlalchemy as sa

from outboxkit.admin.rows import readable_edge_times
from outboxkit.admin.settings import AdminSettings
from outboxkit.errors import SchemaMetaError, SchemaNotAppliedError
from outboxkit.runtime.db import database_url_problem
from outboxkit.runtime.errors import ConfigError
from outboxkit.runtime.exitcodes import EXIT_CONFIG, EXIT_DEPENDENCY
from outboxkit.runtime.logs import UNSAFE_TEXT, logging_configured, redact, redact_url
from outboxkit.runtime.settings import default_node_id, invalid, load

SHOWN_IDS = 20
#: What a terminal acts on or splits lines on (controls, separators, bidirectional
#: marks): the log formatters' set, so both show foreign text the same way.
_UNSAFE = UNSAFE_TEXT


# -- argument types ------------------------------------------------------------


#: Row counts (LIMIT, batch sizes) fit MySQL's signed INT; row ids its BIGINT.
_MAX_COUNT = 2**31 - 1
_MAX_ID = 2**63 - 1
_INT = re.compile(r"\s*[0-9]+\s*", re.ASCII)


def _int_in(text: str, low: int, high: int) -> int:
    if not _INT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
    value = int(text)
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low} (got {value})")
    if value > high:
        raise argparse.ArgumentTypeError(f"must be <= {high} (got {value})")
    return value


def positive_int(text: str) -> int:
    return _int_in(text, 1, _MAX_COUNT)


def non_negative_int(text: str) -> int:
    return _int_in(text, 0, _MAX_ID)


def id_list(text: str) -> list[int]:
    return [_int_in(part, 1, _MAX_ID) for part in text.split(",") if part.strip()]


# -- plumbing --------------------------------------------------------------------


def run(body: Callable[[AdminSettings, sa.Engine], int]) -> Callable[[argparse.Namespace], int]:
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
        except (SchemaNotAppliedError, SchemaMetaError) as exc:
            return fail(str(exc), EXIT_CONFIG)
        except sa.exc.ProgrammingError as exc:
            return fail(
                f"table {settings.table!r} or its schema is missing in "
                f"{redact_url(settings.db_url)} ({_orig(exc)}): run `outboxkit schema apply`",
                EXIT_CONFIG,
            )
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            # An unknown database or a refused login is the URL's fault (exit 2).
            problem = database_url_problem(exc, settings.db_url)
            if problem is not None:
                return fail(invalid("db_url", problem), EXIT_CONFIG)
            return fail(
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


def safe(value: object) -> str:
    """``value`` as terminal-safe text (``-`` for None); see the module docstring."""
    return _UNSAFE.sub(_escape, "-" if value is None else str(value))


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def fail(message: str, code: int) -> int:
    print(f"outboxkit admin: {safe(redact(message))}", file=sys.stderr)
    return code


def print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=False, default=str))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[safe(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def ids_text(ids: Sequence[int], total: int) -> str:
    shown = ", ".join(str(i) for i in ids[:SHOWN_IDS])
    more = total - min(len(ids), SHOWN_IDS)
    return shown + (f" (+{more} more)" if more > 0 else "")
