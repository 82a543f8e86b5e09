"""The demo's business tables: the order service's and the shipping side's."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Engine

__all__ = ["create_tables", "orders", "shipments"]

_MD = sa.MetaData()


def _micros() -> sa.types.TypeEngine[Any]:
    return sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


#: Written by the order service, in the same transaction as the order's outbox event.
orders = sa.Table(
    "outboxkit_demo_orders",
    _MD,
    sa.Column("order_id", sa.String(64), primary_key=True),
    sa.Column("run_id", sa.String(32), nullable=False, index=True),
    sa.Column("customer", sa.String(64), nullable=False),
    sa.Column("amount_cents", sa.Integer, nullable=False),
    sa.Column("event_id", sa.String(64), nullable=False, unique=True),
    sa.Column("created_at", _micros(), nullable=False),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

#: Written by the consumer, in the same transaction as its inbox row (so exactly once).
shipments = sa.Table(
    "outboxkit_demo_shipments",
    _MD,
    sa.Column("order_id", sa.String(64), primary_key=True),
    sa.Column("event_id", sa.String(64), nullable=False),
    sa.Column("kafka_partition", sa.Integer, nullable=False),
    sa.Column("kafka_offset", sa.BigInteger, nullable=False),
    sa.Column("shipped_at", _micros(), nullable=False),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)


def create_tables(engine: Engine) -> None:
    _MD.create_all(engine, checkfirst=True)
