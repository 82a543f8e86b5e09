"""The recovery log keeps valid, bounded JSON: ``admin recovery --json`` reads it back."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st
from support.databases import on_both_databases

from outboxkit.relay.finalize import _record_acked_ahead, decide
from outboxkit.relay.publish import ErrorKind, Report
from outboxkit.relay.rows import Batch, ClaimedRow
from outboxkit.schema.recovery import MAX_DETAIL_BYTES, detail_text, record_recovery
from outboxkit.schema.table import MAX_LAST_ERROR, recovery_table

pytestmark = pytest.mark.integration


def _claimed(row_id: int) -> ClaimedRow:
    return ClaimedRow(
        id=row_id,
        event_id=str(uuid.uuid4()),
        topic="orders.payment-events.v1",
        key=b"order-42",
        payload=b"",
        headers=None,
        shard=0,
        attempts=1,
        age_at_claim=0.0,
        reclaimed_from=None,
    )


@on_both_databases
def test_an_out_of_order_record_of_200_rows_round_trips_as_json(
    engine: sa.Engine, outbox: str, admin: Any
) -> None:
    # Row 1 of a key fails with the longest error a row can carry; Kafka
    # acknowledges the key's next 200 rows ahead of it: the relay records all 200.
    error = "Local: Message timed out; " + "x" * (MAX_LAST_ERROR - 26)
    rows = [_claimed(i) for i in range(1, 202)]
    reports = {1: Report(1, -192, error, ErrorKind.RETRIABLE, None, None, 0.0)}
    reports.update({i: Report(i, None, None, None, 0, 1000 + i, 0.0) for i in range(2, 202)})
    decisions = decide(rows, reports, max_attempts=10, refund_unknown=True)
    batch = Batch("relay-a", "token", tuple(rows), 0.0)
    with engine.begin() as conn:
        _record_acked_ahead(conn, outbox, batch, decisions)

    res = admin("recovery", "--kind", "acked-out-of-order", "--json")
    assert res.code == 0, res.err
    [event] = json.loads(res.out)
    detail = event["detail"]
    assert isinstance(detail, dict), f"stored detail is not valid JSON: {str(detail)[-80:]!r}"
    assert detail["count"] == 200
    assert [r["row_id"] for r in detail["rows"]] == list(range(2, 202))
    by_id = {r.id: r for r in rows}
    for r in detail["rows"]:
        assert r["event_id"] == by_id[r["row_id"]].event_id
        assert (r["topic"], r["partition"], r["offset"]) == (
            "orders.payment-events.v1",
            0,
            1000 + r["row_id"],
        )
        assert r["earlier_row_id"] == 1
        assert error.startswith(r["earlier_error"].rstrip("…")), "shortened, never garbled"
    with engine.connect() as conn:
        stored = conn.execute(sa.select(recovery_table().c.detail)).scalar_one()
    assert len(stored.encode()) <= MAX_DETAIL_BYTES


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    # long strings cheaply: a short text repeated
    | st.builds(lambda t, n: t * n, st.text(min_size=1, max_size=3), st.integers(1, 300)),
    lambda inner: st.lists(inner, max_size=30) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=60,
)


@pytest.mark.unit
@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    detail=st.dictionaries(st.text(max_size=10), json_values, max_size=6),
    max_bytes=st.integers(200, 6000),
)
def test_any_detail_becomes_valid_json_within_the_bound(
    detail: dict[str, Any], max_bytes: int
) -> None:
    text = detail_text(detail, max_bytes)
    assert len(text.encode()) <= max_bytes
    parsed = json.loads(text)  # valid JSON, whatever was cut
    if len(json.dumps(detail, separators=(",", ":"))) <= max_bytes:
        assert parsed == detail, "a detail that fits is kept exactly"
    else:
        assert parsed["truncated"] is True


@on_both_databases
def test_an_oversized_detail_is_stored_whole_and_valid(
    engine: sa.Engine, outbox: str, admin: Any
) -> None:
    detail = {"count": 3, "ids": list(range(20_000)), "note": "é" * 70_000}
    with engine.begin() as conn:
        record_recovery(conn, kind="requeue", node_id="n", table=outbox, detail=detail)
    [event] = json.loads(admin("recovery", "--json").out)
    got = event["detail"]
    assert got["count"] == 3 and got["truncated"] is True
    assert got["note"] == "é" * 40 + "…"
    assert got["ids"] == list(range(len(got["ids"]))) and len(got["ids"]) > 1000
    assert got["ids_omitted"] == 20_000 - len(got["ids"])
