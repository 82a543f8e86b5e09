"""``outboxkit admin requeue`` and ``outboxkit.admin.requeue`` against a real MariaDB."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from support.databases import on_both_databases
from support.dbsql import db_time

from outboxkit.admin import Selection, requeue
from outboxkit.schema import outbox_table, recovery_table

pytestmark = [pytest.mark.integration, on_both_databases]

ReadRows = Callable[..., dict[int, sa.Row[Any]]]


def recovery_events(engine: sa.Engine, kind: str = "requeue") -> list[dict[str, Any]]:
    r = recovery_table()
    with engine.connect() as conn:
        rows = conn.execute(sa.select(r).where(r.c.kind == kind).order_by(r.c.id)).all()
    return [json.loads(row.detail) | {"node_id": row.node_id} for row in rows]


def db_now(engine: sa.Engine) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(db_time(conn))).scalar_one()


def test_requeue_all_failed_resets_rows_and_records_it(
    engine: sa.Engine, make_rows: Any, read_rows: ReadRows, admin: Any
) -> None:
    failed = make_rows(3, status="failed")
    others = make_rows(1, status="pending") + make_rows(1, status="delivered")
    others += make_rows(1, status="retryable")
    before = read_rows(others)

    res = admin("requeue", "--all-failed")

    assert res.code == 0, res.err
    assert (
        f"requeued 3 rows in outbox_events (failed -> pending, attempts 0): ids {failed[0]}, "
        in res.out
    )
    now = db_now(engine)
    for row in read_rows(failed).values():
        assert row.status == "pending"
        assert row.attempts == 0
        assert row.next_attempt_at <= now
        assert row.last_error is None
        assert row.lease_owner is row.lease_token is row.lease_expires_at is None
    assert read_rows(others) == before
    [event] = recovery_events(engine)
    assert event["count"] == 3
    assert event["ids"] == failed
    assert event["selection"] == {"statuses": ["failed"], "all_failed": True}
    assert event["node_id"].startswith("admin@")


def test_requeue_by_id_event_id_topic_and_time_range(
    engine: sa.Engine, make_rows: Any, read_rows: ReadRows, admin: Any
) -> None:
    a, b, c = make_rows(3, status="failed", topic="orders")
    [d] = make_rows(1, status="failed", topic="payments")
    [old] = make_rows(1, status="failed", topic="payments", age_s=7200)

    assert admin("requeue", "--id", f"{a}").code == 0
    assert read_rows([a])[a].status == "pending"
    assert read_rows([b])[b].status == "failed"

    event_b = read_rows([b])[b].event_id
    assert admin("requeue", "--event-id", event_b).code == 0
    assert read_rows([b])[b].status == "pending"

    # created_at range: only the two-hour-old payments row is before this cut.
    cut = (db_now(engine) - __import__("datetime").timedelta(hours=1)).isoformat() + "Z"
    res = admin("requeue", "--topic", "payments", "--until", cut)
    assert res.code == 0, res.err
    states = {i: r.status for i, r in read_rows([c, d, old]).items()}
    assert states == {c: "failed", d: "failed", old: "pending"}

    res = admin("requeue", "--topic", "payments", "--since", cut)
    assert res.code == 0
    assert read_rows([d])[d].status == "pending"
    assert read_rows([c])[c].status == "failed"


def test_retryable_rows_only_with_include_retryable(
    make_rows: Any, read_rows: ReadRows, admin: Any
) -> None:
    [r] = make_rows(1, status="retryable")
    res = admin("requeue", "--id", str(r))
    assert res.code == 0
    assert "add --include-retryable" in res.out
    assert read_rows([r])[r].status == "retryable"
    assert admin("requeue", "--id", str(r), "--include-retryable").code == 0
    row = read_rows([r])[r]
    assert (row.status, row.attempts) == ("pending", 0)


def test_never_changes_a_row_a_relay_holds(
    engine: sa.Engine, make_rows: Any, read_rows: ReadRows, admin: Any
) -> None:
    held = make_rows(2, status="delivering", topic="orders", lease_s=60)
    expired = make_rows(1, status="delivering", topic="orders", lease_s=-60)
    failed = make_rows(2, status="failed", topic="orders")
    before = read_rows(held + expired)

    res = admin("requeue", "--all-failed", "--topic", "orders", "--include-retryable")
    assert res.code == 0, res.err
    assert read_rows(held + expired) == before
    assert {r.status for r in read_rows(failed).values()} == {"pending"}

    # Named explicitly: still refused, with the reason.
    res = admin("requeue", "--id", ",".join(map(str, held + expired)))
    assert res.code == 0
    assert "nothing requeued" in res.out
    assert f"id {held[0]} (event {before[held[0]].event_id}): delivering: a relay holds" in res.out
    assert "expired lease: the next relay claim reclaims it" in res.out
    assert read_rows(held + expired) == before


def test_dry_run_changes_nothing(
    engine: sa.Engine, make_rows: Any, read_rows: ReadRows, admin: Any
) -> None:
    failed = make_rows(25, status="failed")
    before = read_rows()
    res = admin("requeue", "--all-failed", "--dry-run")
    assert res.code == 0, res.err
    assert res.out.startswith("dry run: would requeue 25 rows")
    assert "(+5 more)" in res.out
    assert read_rows() == before
    assert recovery_events(engine) == []
    res = admin("requeue", "--all-failed", "--dry-run", "--json")
    assert json.loads(res.out) == {"dry_run": True, "count": 25, "ids": failed, "skipped": []}


def test_chunks_each_record_their_rows(engine: sa.Engine, make_rows: Any, outbox: str) -> None:
    failed = make_rows(7, status="failed")
    result = requeue(
        engine, table=outbox, selection=Selection(all_failed=True), chunk_size=3, node_id="ops"
    )
    assert (result.count, result.ids) == (7, failed)
    events = recovery_events(engine)
    assert [e["count"] for e in events] == [3, 3, 1]
    assert [i for e in events for i in e["ids"]] == failed
    assert {e["node_id"] for e in events} == {"ops"}


def test_a_row_locked_by_another_transaction_is_skipped_not_waited_for(
    engine: sa.Engine, make_rows: Any, read_rows: ReadRows, admin: Any, outbox: str
) -> None:
    """Defined behaviour: requeue never waits for a row lock (so it cannot deadlock with
    a relay); it skips the locked row, reports it, and changes it on a later run only
    if it is then still eligible. No row is ever changed twice."""
    t = outbox_table(outbox)
    failed = make_rows(4, status="failed")
    busy = failed[1]
    locked = threading.Event()
    release = threading.Event()

    def claim_like_a_relay() -> None:
        with engine.begin() as conn:
            conn.execute(sa.select(t.c.id).where(t.c.id == busy).with_for_update())
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=claim_like_a_relay)
    holder.start()
    try:
        assert locked.wait(10)
        started = time.monotonic()
        res = admin("requeue", "--all-failed")
        elapsed = time.monotonic() - started
    finally:
        release.set()
        holder.join(30)
    assert res.code == 0, res.err
    assert elapsed < 5, f"requeue waited {elapsed:.1f}s for a lock"
    assert "requeued 3 rows" in res.out
    assert f"id {busy} " in res.out and "locked by another transaction" in res.out
    states = {i: r.status for i, r in read_rows(failed).items()}
    assert states == {i: ("failed" if i == busy else "pending") for i in failed}

    # Released unchanged: the next run takes exactly that row, the others are not touched again.
    res = admin("requeue", "--all-failed")
    assert f"requeued 1 row in outbox_events (failed -> pending, attempts 0): ids {busy}" in res.out
    changed = [i for e in recovery_events(engine) for i in e["ids"]]
    assert sorted(changed) == sorted(failed)


def test_a_row_claimed_while_requeue_runs_stays_with_the_relay(
    engine: sa.Engine, make_rows: Any, read_rows: ReadRows, outbox: str
) -> None:
    """The relay's claim holds the row lock and flips it to delivering; requeue (which
    saw it as retryable a moment earlier) must not reset it under the relay's lease."""
    t = outbox_table(outbox)
    [row_id] = make_rows(1, status="retryable")
    locked = threading.Event()
    requeue_done = threading.Event()

    def relay_claim() -> None:
        with engine.begin() as conn:
            conn.execute(
                sa.select(t.c.id)
                .where(t.c.id == row_id, t.c.status == "retryable")
                .with_for_update(skip_locked=True)
            )
            locked.set()
            requeue_done.wait(30)
            conn.execute(
                t.update()
                .where(t.c.id == row_id)
                .values(
                    status="delivering",
                    lease_owner="relay-b",
                    lease_token="b" * 32,
                    lease_expires_at=db_time(conn, 30),
                )
            )

    relay = threading.Thread(target=relay_claim)
    relay.start()
    try:
        assert locked.wait(10)
        result = requeue(
            engine, table=outbox, selection=Selection(ids=(row_id,), include_retryable=True)
        )
    finally:
        requeue_done.set()
        relay.join(30)
    assert result.count == 0
    assert [s.id for s in result.skipped] == [row_id]
    row = read_rows([row_id])[row_id]
    assert (row.status, row.lease_owner, row.lease_token) == ("delivering", "relay-b", "b" * 32)


def test_requeue_and_show_match_topics_and_event_ids_byte_for_byte(
    make_rows: Any, read_rows: ReadRows, admin: Any
) -> None:
    """Topics and event ids are case-sensitive: ``ORDERS`` is not ``orders``."""
    lower = make_rows(2, status="failed", topic="orders")
    upper = make_rows(2, status="failed", topic="ORDERS")
    [named] = make_rows(1, status="failed", topic="orders", event_id="order-1")

    res = admin("requeue", "--topic", "ORDERS")

    assert res.code == 0, res.err
    assert {i: r.status for i, r in read_rows().items()} == {
        **dict.fromkeys([*lower, named], "failed"),
        **dict.fromkeys(upper, "pending"),
    }
    missing = admin("requeue", "--event-id", "Order-1")
    assert missing.code == 2
    assert "no such row in outbox_events: Order-1" in missing.err
    shown = admin("show", "Order-1")
    assert shown.code == 2
    assert "no event with event_id 'Order-1'" in shown.err
    assert "order-1" in admin("show", "order-1").out
    assert admin("requeue", "--event-id", "order-1").code == 0
    assert read_rows([named])[named].status == "pending"
