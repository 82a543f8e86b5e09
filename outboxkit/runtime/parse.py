"""Parsers for what operators type: retention durations and ISO times."""

from __future__ import annotations

import datetime as dt
import math
import re

from outboxkit.runtime.errors import ConfigError

__all__ = ["format_ts", "parse_retention", "parse_time"]

_DURATION = re.compile(r"\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>ms|s|m|h|d|w)?\s*", re.ASCII)
_UNIT_SECONDS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_UNIT_SECONDS["w"] = 7 * 86400.0
#: Longest retention: the cutoff (now minus it) must stay a valid database time.
MAX_RETENTION_S = 3650 * 86400.0
#: What a DATETIME column holds; a time outside it cannot select anything.
_EARLIEST = dt.datetime(1000, 1, 1)
_LATEST = dt.datetime(9999, 12, 31, 23, 59, 59)


def parse_retention(text: str) -> float:
    """Seconds from ``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"`` or a bare number.

    Raises ``ValueError`` with the accepted forms (the settings framework and the
    CLI turn it into a message naming the setting).
    """
    m = _DURATION.fullmatch(text)
    if not m:
        raise ValueError("must be a duration like 7d, 12h, 30m, 90s or a number of seconds")
    seconds = float(m.group("num")) * _UNIT_SECONDS[m.group("unit")]
    if seconds <= 0:
        raise ValueError("must be > 0")
    if not math.isfinite(seconds) or seconds > MAX_RETENTION_S:
        raise ValueError("must be at most 3650d (10 years)")
    return seconds


def parse_time(text: str, *, what: str) -> dt.datetime:
    """An ISO 8601 time as a naive UTC datetime, the way the outbox stores times.

    A time without an offset is taken as UTC (the database clock is UTC); one with
    an offset (``+02:00``, ``Z``) is converted.
    """
    raw = text.strip()
    try:
        value = dt.datetime.fromisoformat(raw)
    except ValueError:
        raise ConfigError(
            f"{what}: cannot parse {text!r} as an ISO 8601 time "
            "(e.g. 2024-05-01T12:00:00Z or 2024-05-01 12:00)"
        ) from None
    try:
        if value.tzinfo is not None:
            value = value.astimezone(dt.UTC).replace(tzinfo=None)
    except OverflowError:
        value = dt.datetime.min
    if not _EARLIEST <= value <= _LATEST:
        raise ConfigError(
            f"{what}: {text!r} is out of range (1000-01-01 .. 9999-12-31 23:59:59 UTC)"
        )
    return value


def format_ts(value: dt.datetime | str | None) -> str | None:
    """A stored (naive UTC) time as ISO 8601 with a ``Z``. A value that is not a
    time (MariaDB's zero date, which PyMySQL returns as text; PostgreSQL's
    ``infinity``, see ``admin.rows.readable_edge_times``) is shown as stored."""
    if value is None:
        return None
    if not isinstance(value, dt.datetime):
        return str(value)
    if value.tzinfo is not None:
        value = value.astimezone(dt.UTC).replace(tzinfo=None)
    return value.isoformat(timespec="microseconds") + "Z"
