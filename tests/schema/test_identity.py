"""Identifiers compare byte for byte in every table, on a real database.

A database's default collation folds case and accents and (``PAD SPACE``) ignores
trailing spaces, so ``'ORDERS' = 'orders'`` and ``'cafe' = 'café '`` would be true.
Topics, event ids, lease owners and tokens, group ids and table names are
identifiers: two of them are the same only when their bytes are.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from outboxkit.relay.claim_sql import candidates
from outboxkit.schema import apply_schema, meta_table, outbox_table

pytestmark = pytest.mark.integration


def _strip_accents(text: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFD", text) if not unicodedata.combining(c))


#: Changes a case- or accent-insensitive, PAD SPACE collation does not see.
_BLIND_SPOTS: dict[str, Callable[[str], str]] = {
    "upper": str.upper,
    "lower": str.lower,
    "swapcase": str.swapcase,
    "trailing space": lambda s: s + " ",
    "strip accents": _strip_accents,
    "add accent": lambda s: s[0] + "\u0301" + s[1:],
    "NFD": lambda s: unicodedata.normalize("NFD", s),
}

#: Letters whose case or accent folding collations treat specially (long s, dotless i).
_ALPHABET = "abcxyzABCXYZéèÉüÜß\u017f\u0131\u0130-._ 0123"
_TEXT = st.text(alphabet=st.sampled_from(_ALPHABET), min_size=1, max_size=20).filter(
    lambda s: s.strip() == s
)


def _insert(conn: sa.Connection, table: str, event_id: str, topic: str) -> None:
    t = outbox_table(table)
    conn.execute(
        t.insert().values(
            event_id=event_id,
            topic=topic,
            message_key=None,
            payload=b"x",
            shard=0,
            status="pending",
            attempts=0,
            next_attempt_at=sa.text("UTC_TIMESTAMP(6) - INTERVAL 1 SECOND"),
            lease_owner=event_id,
            lease_token=event_id[:32],
            created_at=sa.text("UTC_TIMESTAMP(6)"),
            updated_at=sa.text("UTC_TIMESTAMP(6)"),
        )
    )


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(base=_TEXT, change=st.sampled_from(sorted(_BLIND_SPOTS)))
@example(base="orders", change="upper")  # the paused missing topic ORDERS vs the real orders
@example(base="Order-1", change="lower")
@example(base="cafe", change="add accent")
@example(base="x", change="trailing space")
def test_identifiers_that_differ_in_any_byte_are_different_rows(
    engine: sa.Engine, outbox: str, base: str, change: str
) -> None:
    other = _BLIND_SPOTS[change](base)
    if other == base or len(other) > 64:
        return
    t = outbox_table(outbox)
    with engine.begin() as conn:
        conn.execute(t.delete())
        _insert(conn, outbox, base, base)
        _insert(conn, outbox, other, other)  # unique event_id: must not clash
    with engine.connect() as conn:

        def matching(column: str, value: str) -> list[str]:
            c = t.c[column]
            return list(conn.execute(sa.select(t.c.event_id).where(c == value)).scalars())

        for value in (base, other):
            assert matching("event_id", value) == [value]
            assert matching("topic", value) == [value]
            assert matching("lease_owner", value) == [value]
        ids = {r.event_id: r.id for r in conn.execute(sa.select(t.c.event_id, t.c.id))}
        # A paused topic excludes its own rows from the claim, and no other topic's.
        claimable = candidates(conn, outbox, shards=range(8), limit=10, excluded_topics={base})
        assert [i for i, _ in claimable] == [ids[other]]


def test_table_names_differing_in_case_are_recorded_apart(engine: sa.Engine) -> None:
    """MySQL/MariaDB on Linux keep ``Orders_Outbox`` and ``orders_outbox`` apart; so must
    the meta table, or the second table would get the first one's shard count."""
    assert apply_schema(engine, table="orders_outbox", shards=4).shard_count == 4
    assert apply_schema(engine, table="Orders_Outbox", shards=8).shard_count == 8
    with engine.connect() as conn:
        stored = dict(
            conn.execute(sa.select(meta_table.c.table_name, meta_table.c.shard_count)).all()
        )
    assert stored == {"orders_outbox": 4, "Orders_Outbox": 8}
