"""Database-clock arithmetic: "now + n microseconds" evaluated by the server.

Leases and retry times are compared with ``db_now()`` on other relays, so they
are computed from the same clock, never from the pod's. On PostgreSQL "now" is
``CURRENT_TIMESTAMP AT TIME ZONE 'UTC'`` (``db_now()``: the transaction's start,
a ``timestamp`` without time zone, microseconds), the column type the schema
gives there.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

from outboxkit.schema.table import db_now

__all__ = ["db_now_plus", "micros", "micros_between"]


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
    return f"(EXTRACT(EPOCH FROM ({end}) - ({start})) * 1000000)"


def micros(seconds: float) -> int:
    return max(0, round(seconds * 1_000_000))
