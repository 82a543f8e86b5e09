"""Database-clock arithmetic: "now + n microseconds" evaluated by the server.

Leases and retry times are compared with ``db_now()`` on other relays, so they
are computed from the same clock, never from the pod's. On PostgreSQL "now" is
``CURRENT_TIMESTAMP AT TIME ZONE 'UTC'`` (``db_now()``: the transaction's start,
a ``timestamp`` without time zone, microseconds), the column type the schema
gives there.

Times another writer stored (docs/operations.md, *What a foreign row turns
into*): MariaDB/MySQL keep zero dates (``'0000-00-00'``, allowed without
``NO_ZERO_DATE``), PostgreSQL ``infinity`` and ``-infinity``. Here:

* an elapsed time (:func:`micros_between`) from or to such a value is NULL,
  not an error (PostgreSQL refuses to subtract infinities; ``TIMESTAMPDIFF``
  gives NULL for a zero date);
* a zero date or ``-infinity`` is in the past (it compares below every date);
* a time further ahead than :data:`HORIZON_S` (``infinity``, year 9999) is
  not one a relay wrote: every lease and retry time a relay sets is at most
  the longest duration any setting accepts from now. :func:`time_passed`
  treats it as passed and :func:`time_ahead` as not ahead, so a row leased or
  delayed "forever" is reclaimed or retried instead of waiting for good.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

from outboxkit.runtime.settings import MAX_DURATION_S
from outboxkit.schema.table import db_now

__all__ = [
    "HORIZON_S",
    "db_now_plus",
    "micros",
    "micros_between",
    "time_ahead",
    "time_passed",
]

#: The furthest ahead of now a relay sets a lease or a retry time (the longest
#: duration any setting accepts); a stored time past it is another writer's.
HORIZON_S = MAX_DURATION_S


class db_now_plus(FunctionElement[Any]):
    """``db_now() + <expr> microseconds``; ``expr`` may be a CASE (or negative)."""

    type = sa.DateTime()
    inherit_cache = True
    name = "db_now_plus"

    def __init__(self, micros_expr: ColumnElement[Any]) -> None:
        super().__init__(micros_expr)


@compiles(db_now_plus, "mysql")
@compiles(db_now_plus, "mariadb")
def _mysql(element: db_now_plus, compiler: Any, **kw: Any) -> str:
    (expr,) = element.clauses
    return f"DATE_ADD(UTC_TIMESTAMP(6), INTERVAL {compiler.process(expr, **kw)} MICROSECOND)"


@compiles(db_now_plus, "postgresql")
def _postgresql(element: db_now_plus, compiler: Any, **kw: Any) -> str:
    (expr,) = element.clauses
    now = compiler.process(db_now(), **kw)
    return f"({now} + ({compiler.process(expr, **kw)}) * INTERVAL '1 microsecond')"


class micros_between(FunctionElement[Any]):
    """Microseconds from ``start`` to ``end`` (two timestamps), as a number."""

    type = sa.Numeric()
    inherit_cache = True
    name = "micros_between"

    def __init__(self, start: ColumnElement[Any], end: ColumnElement[Any]) -> None:
        super().__init__(start, end)


@compiles(micros_between, "mysql")
@compiles(micros_between, "mariadb")
def _mysql_between(element: micros_between, compiler: Any, **kw: Any) -> str:
    start, end = (compiler.process(c, **kw) for c in element.clauses)
    return f"TIMESTAMPDIFF(MICROSECOND, {start}, {end})"


@compiles(micros_between, "postgresql")
def _postgresql_between(element: micros_between, compiler: Any, **kw: Any) -> str:
    start, end = (compiler.process(c, **kw) for c in element.clauses)
    # NULL for an infinite end: subtracting one raises, and fails the statement.
    return (
        f"(CASE WHEN isfinite({start}) AND isfinite({end}) "
        f"THEN EXTRACT(EPOCH FROM ({end}) - ({start})) * 1000000 END)"
    )


def _horizon(now: ColumnElement[Any]) -> ColumnElement[Any]:
    return db_now_plus(sa.literal_column(str(micros(HORIZON_S)), sa.BigInteger()))


def time_passed(column: ColumnElement[Any], now: ColumnElement[Any]) -> ColumnElement[bool]:
    """``column <= now``, or ``column`` further ahead than :data:`HORIZON_S` (see
    the module docstring). NULL stays NULL (not passed)."""
    return sa.or_(column <= now, column > _horizon(now))


def time_ahead(column: ColumnElement[Any], now: ColumnElement[Any]) -> ColumnElement[bool]:
    """``column > now`` and no further ahead than :data:`HORIZON_S`: the negation of
    :func:`time_passed` for a stored time."""
    return sa.and_(column > now, column <= _horizon(now))


def micros(seconds: float) -> int:
    return max(0, round(seconds * 1_000_000))
