"""The example's own tables: orders (the service's) and invoices (the consumer's).

The outbox and inbox tables come from ``outboxkit schema apply``.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

orders = sa.Table(
    "example_orders",
    metadata,
    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
    sa.Column("customer", sa.String(64), nullable=False),
    sa.Column("amount_cents", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.DateTime, nullable=False, server_default=sa.func.now()),
)

# No unique key on order_id on purpose: the consumer's inbox is what keeps a
# redelivered event from invoicing an order twice, and the example's test counts
# the rows to prove it.
invoices = sa.Table(
    "example_invoices",
    metadata,
    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.BigInteger, nullable=False, index=True),
    sa.Column("customer", sa.String(64), nullable=False),
    sa.Column("amount_cents", sa.BigInteger, nullable=False),
    sa.Column("event_id", sa.String(64), nullable=False),
)
