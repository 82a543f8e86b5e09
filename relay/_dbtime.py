"""Database-clock arithmetic: "now + n microseconds" evaluated by the server.

Leases and retry times are compared with ``db_now()`` on other relays, so they
are computed from the same clock, never from the pod's.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

__all__ = ["db_now_plus", "micros"]


class db_now_plus(FunctionElement[Any]):
    """``UTC_TIMESTAMP(6) + INTERVAL <expr> MICROSECOND``; ``expr`` may be a CASE."""

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


def micros(seconds: float) -> int:
    return max(0, round(seconds * 1_000_000))
