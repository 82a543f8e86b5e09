"""Outcomes of a batch: decisions (unit), row faults, paused topics, lease tokens.

The database-touching tests run on MariaDB and on PostgreSQL (``on_both_databases``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from psycopg import sql as psycopg_sql
from relay_support import (
    EmbeddedRelay,
    add_events,
    consume,
    db_time,
    fast_settings,
    http_get,
    pg_positional,
    pg_rows_touched,
    rows,
    status_counts,
    wait_for,
)
from support.databases import on_both_databases

from outboxkit import Event
from outboxkit.relay import Relay
from outboxkit.relay.backoff import Backoff
from outboxkit.relay.claim import claim_batch
from outboxkit.relay.drain import release
from outboxkit.relay.finalize import Decision, Fate, _per_row_write, decide, finalize, spent_rows
from outboxkit.relay.pipeline import Pipeline
from outboxkit.relay.publish import ErrorKind, InFlight, Report
from outboxkit.relay.rows import Batch, ClaimedRow
from outboxkit.runtime.testing import capture_json_logs
from outboxkit.schema import apply_schema
from outboxkit.schema.table import outbox_table, recovery_table


def _row(row_id: int, key: bytes | None, attempts: int = 1) -> ClaimedRow:
    return ClaimedRow(
        id=row_id,
        event_id=f"e{row_id}",
        topic="t",
        key=key,
        payload=b"",
        headers=None,
        shard=0,
        attempts=attempts,
        age_at_claim=0.0,
        reclaimed_from=None,
    )


def _ok(row_id: int) -> Report:
    return Report(row_id, None, None, None, 0, row_id, 0.0)


def _err(row_id: int, kind: ErrorKind, code: int = -192) -> Report:
    return Report(row_id, code, f"error {code}", kind, None, None, 0.0)


@pytest.mark.unit
def test_later_row_of_a_key_is_not_delivered_before_its_predecessor() -> None:
    rows_ = [_row(1, b"a"), _row(2, b"a"), _row(3, b"b"), _row(4, None), _row(5, b"a")]
    reports = {1: _err(1, ErrorKind.RETRIABLE), 2: _ok(2), 3: _ok(3), 4: _ok(4)}
    fates = {d.row.id: d for d in decide(rows_, reports, max_attempts=10, refund_unknown=True)}
    assert fates[1].fate is Fate.RETRYABLE and fates[1].error_code == -192
    assert fates[2].fate is Fate.RELEASED and fates[2].refund, "acked, but its key is open"
    assert fates[3].fate is Fate.DELIVERED and fates[4].fate is Fate.DELIVERED
    assert fates[5].fate is Fate.RELEASED and fates[5].refund, "no report: released"


@pytest.mark.unit
def test_an_ack_after_a_failed_send_of_the_same_key_is_flagged() -> None:
    rows_ = [_row(1, b"a"), _row(2, b"a"), _row(3, b"a"), _row(4, b"b"), _row(5, b"b")]
    reports = {1: _err(1, ErrorKind.RETRIABLE), 2: _ok(2), 3: _ok(3), 5: _ok(5)}
    d = {x.row.id: x for x in decide(rows_, reports, max_attempts=10, refund_unknown=True)}
    assert d[2].fate is Fate.RELEASED and d[2].acked_ahead_of == (1, "error -192")
    assert (d[2].partition, d[2].offset) == (0, 2), "where the acknowledged copy went"
    assert d[3].acked_ahead_of == (1, "error -192"), "ahead of row 1 as well"
    # Row 4 has no report (not sent, or not awaited): row 5 is held back, but
    # Kafka keeps produce order, so nothing landed ahead of row 4.
    assert d[5].fate is Fate.RELEASED and d[5].acked_ahead_of is None
    # A failed row holds its key (--failed-rows hold): what Kafka acknowledged
    # after it is released, not delivered, and flagged as ahead of it.
    rows_ = [_row(1, b"a"), _row(2, b"a")]
    reports = {1: _err(1, ErrorKind.ROW_FAULT, 10), 2: _ok(2)}
    d1, d2 = decide(rows_, reports, max_attempts=10, refund_unknown=True)
    assert d1.fate is Fate.FAILED and d2.fate is Fate.RELEASED and d2.refund
    assert d2.acked_ahead_of == (1, "error 10")
    # With skip it does not: what follows it is delivered, not flagged.
    d1, d2 = decide(rows_, reports, max_attempts=10, refund_unknown=True, failed_holds=False)
    assert d1.fate is Fate.FAILED and d2.fate is Fate.DELIVERED and d2.acked_ahead_of is None


@pytest.mark.unit
def test_a_row_failed_before_sending_holds_its_keys_later_rows_in_the_batch() -> None:
    """Out of attempts, a row fails unsent; with hold, its key's later rows in the
    batch are not sent either (released, attempt refunded) and other keys go."""
    rows_ = [_row(1, b"a", attempts=11), _row(2, b"a"), _row(3, b"b"), _row(4, None)]
    known, to_send = spent_rows(rows_, 10, failed_holds=True)
    assert [(d.row.id, d.fate, d.refund) for d in known] == [
        (1, Fate.FAILED, False),
        (2, Fate.RELEASED, True),
    ]
    assert [r.id for r in to_send] == [3, 4]
    known, to_send = spent_rows(rows_, 10, failed_holds=False)
    assert [d.row.id for d in known] == [1] and [r.id for r in to_send] == [2, 3, 4]
    # A row the publisher would fail as stored (here: a topic Kafka never takes)
    # fails unsent when a later row of its key is in the batch, with the
    # publisher's words; the last row of a key is left to the publisher.
    bad = _row(5, b"c")
    bad.topic = ""
    rows_ = [bad, _row(6, b"c"), _row(7, b"d")]
    known, to_send = spent_rows(rows_, 10, failed_holds=True)
    assert [(d.row.id, d.fate) for d in known] == [(5, Fate.FAILED), (6, Fate.RELEASED)]
    assert (known[0].error or "").startswith("invalid row: ") and [r.id for r in to_send] == [7]
    assert spent_rows([bad], 10, failed_holds=True) == ([], [bad])


@pytest.mark.integration
@on_both_databases
def test_an_ack_ahead_of_a_timed_out_row_is_reported_and_sent_again_after_it(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka skips a message that hit ``message.timeout.ms`` and goes on with
    the next, so a key's later event can be acknowledged while the earlier one
    failed. A single broker cannot be made to time out one message and not the
    next, so the first row's report is replaced by a timeout; rows, Kafka and
    the relay are real."""
    topic = kafka_topics(partitions=1)
    ids = add_events(
        engine, outbox, [Event(topic=topic, key="k", payload=f"n{i}".encode()) for i in range(3)]
    )
    row_ids = [r.id for r in rows(engine, outbox)]
    relay = Relay(fast_settings(db_url, kafka_bootstrap))
    real_reports = Pipeline._reports
    faked: list[int] = []

    def first_row_times_out(self: Pipeline, inflight: InFlight) -> dict[int, Report]:
        reports = real_reports(self, inflight)
        if not faked and row_ids[0] in reports:
            faked.append(row_ids[0])
            reports[row_ids[0]] = Report(
                row_ids[0], -192, "Local: Message timed out", ErrorKind.RETRIABLE, None, None, 0.0
            )
        return reports

    monkeypatch.setattr(Pipeline, "_reports", first_row_times_out)
    with capture_json_logs(level="INFO") as logs:
        er = EmbeddedRelay(relay).start()
        try:
            wait_for(
                lambda: status_counts(engine, outbox) == {"delivered": 3}, timeout=30, what="all"
            )
        finally:
            assert er.stop() == 0
    assert er.metric("outbox_rows_acked_out_of_order_total") == 2
    warned = logs.events("acked-out-of-order")
    assert [(e["event_id"], e["earlier_row_id"]) for e in warned] == [
        (ids[1], row_ids[0]),
        (ids[2], row_ids[0]),
    ]
    assert all(e["level"] == "WARNING" and e["partition"] == 0 for e in warned)
    assert "timed out" in str(warned[0]["earlier_error"])
    values = [m.value for m in consume(kafka_bootstrap, topic, expected=6)]
    # First sends n0 n1 n2 (n0's ack was replaced), then n0 again and the two
    # released rows after it: the last copy of each event is in order.
    assert values == [b"n0", b"n1", b"n2", b"n0", b"n1", b"n2"]
    by_id = {r.event_id: r for r in rows(engine, outbox)}
    assert [by_id[i].attempts for i in ids] == [2, 1, 1], "released rows got their attempt back"
    r = recovery_table()
    with engine.connect() as conn:
        (record,) = conn.execute(
            sa.select(r).where(r.c.kind == "acked-out-of-order", r.c.table_name == outbox)
        ).all()
    detail = json.loads(record.detail)
    assert record.node_id == relay.settings.node_id and detail["count"] == 2
    assert [(x["event_id"], x["earlier_row_id"], x["partition"]) for x in detail["rows"]] == [
        (ids[1], row_ids[0], 0),
        (ids[2], row_ids[0], 0),
    ]


@pytest.mark.unit
def test_failed_row_does_not_hold_its_key_and_attempts_bound_retries() -> None:
    rows_ = [_row(1, b"a"), _row(2, b"a", attempts=3), _row(3, b"a", attempts=3)]
    reports = {
        1: _err(1, ErrorKind.ROW_FAULT, 10),
        2: _err(2, ErrorKind.RETRIABLE),
        3: _err(3, ErrorKind.CONFIG_FAULT, 3),
    }
    d1, d2, d3 = decide(rows_, reports, max_attempts=3, refund_unknown=False)
    assert d1.fate is Fate.FAILED
    assert d2.fate is Fate.FAILED and "attempt 3/3" in (d2.error or "")
    assert d3.fate is Fate.PAUSED and d3.refund and d3.pause_reason == "unknown-topic"
    # Each carries its report's code: metrics and logs name the error by it.
    assert [d.error_code for d in (d1, d2, d3)] == [10, -192, 3]


@pytest.mark.integration
@on_both_databases
@pytest.mark.parametrize("failed_rows", ["hold", "skip"])
def test_oversized_row_fails_with_reason_and_its_key_waits_or_goes_on_as_set(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
    failed_rows: str,
) -> None:
    """The big row fails as the row's fault. ``--failed-rows hold`` (the default):
    its key's later rows, in the same batch or claimed after, stay pending and
    the relay counts the key as held; ``skip``: they are delivered past it."""
    topic = kafka_topics(partitions=1, config={"max.message.bytes": "2000"})
    events = [Event(topic=topic, key="k", payload=f"small-{i}") for i in range(3)]
    events.append(Event(topic=topic, key="k", payload=os.urandom(5000)))
    events += [Event(topic=topic, key="k", payload=f"small-{i}") for i in range(3, 6)]
    events.append(Event(topic=topic, key="other", payload="other"))
    add_events(engine, outbox, events)
    # Producer batches must stay under the topic limit, so only the big row is rejected;
    # it ends the first claimed batch, so the key's later rows are claimed after it
    # failed (in one batch with it they would be acknowledged ahead of it, which
    # the relay reports as acked-out-of-order).
    settings = fast_settings(
        db_url,
        kafka_bootstrap,
        kafka_config={"batch.size": "1500"},
        failed_rows=failed_rows,
        batch_size=4,
    )
    relay = embedded(settings)
    delivered = 7 if failed_rows == "skip" else 4
    wait_for(
        lambda: relay.metric("outbox_rows_delivered_total") == delivered,
        timeout=20,
        what=f"{delivered} rows",
    )
    table = rows(engine, outbox)
    big = table[3]
    assert big.status == "failed" and big.lease_owner is None
    assert "MSG_SIZE_TOO_LARGE" in big.last_error
    assert relay.metric("outbox_rows_failed_total") == 1
    sent = [f"small-{i}".encode() for i in range(3)]
    if failed_rows == "skip":
        assert [r.status for r in table if r.id != big.id] == ["delivered"] * 7
        sent += [f"small-{i}".encode() for i in range(3, 6)]
    else:
        assert [r.status for r in table[4:7]] == ["pending"] * 3, "k's later rows wait"
        wait_for(
            lambda: relay.metric("outbox_keys_held_by_failed") == 1,
            timeout=10,
            what="the held key counted",
        )
    messages = consume(kafka_bootstrap, topic, expected=len(sent) + 1)
    assert [m.value for m in messages if m.key == b"k"] == sent

    # A failed row is never touched again, nor (hold) are the rows behind it.
    time.sleep(1.0)
    assert rows(engine, outbox)[3:7] == table[3:7]
    assert relay.stop() == 0


@pytest.mark.integration
@on_both_databases
def test_unknown_topic_is_paused_without_burning_attempts_and_resumes_once_created(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    good = kafka_topics(partitions=1)
    missing = f"okt_missing_{os.urandom(4).hex()}"
    add_events(
        engine,
        outbox,
        [Event(topic=missing, key=f"m{i}", payload=b"m") for i in range(5)]
        + [Event(topic=good, key=f"g{i}", payload=b"g") for i in range(5)],
    )
    with capture_json_logs(level="INFO") as logs:
        relay = embedded(fast_settings(db_url, kafka_bootstrap, paused_topic_retry=1.0))
        wait_for(lambda: logs.events("topic-paused"), timeout=20, what="topic-paused")
        wait_for(lambda: relay.metric("outbox_rows_delivered_total") == 5, timeout=20, what="good")
        paused = logs.events("topic-paused")[0]
        assert paused["topic"] == missing and paused["reason"] == "unknown-topic"
        assert "create it" in str(paused["action"])
        assert (
            relay.metric("outbox_topic_paused", {"topic": missing, "reason": "unknown-topic"}) == 1
        )
        status, body = http_get(relay.relay.health.url + "/healthz/ready")
        assert status == 200, "paused topics do not make the relay unready"
        assert isinstance(body, dict) and missing in body["paused_topics"]
        time.sleep(2.5)  # at least one more probe
        waiting = [r for r in rows(engine, outbox) if r.topic == missing]
        assert {r.status for r in waiting} <= {"retryable", "delivering"}
        assert {r.attempts for r in waiting if r.status == "retryable"} == {0}, "not burnt"
        assert "UNKNOWN_TOPIC" in waiting[0].last_error

        kafka_topics(partitions=1, name=missing)
        wait_for(
            lambda: relay.metric("outbox_rows_delivered_total") == 10, timeout=30, what="resume"
        )
        assert logs.events("topic-resumed")[0]["topic"] == missing
        assert (
            relay.metric("outbox_topic_paused", {"topic": missing, "reason": "unknown-topic"}) == 0
        )
        assert relay.stop() == 0
    assert len(consume(kafka_bootstrap, missing, expected=5)) >= 5
    assert {r.attempts for r in rows(engine, outbox) if r.topic == missing} == {1}


@pytest.mark.integration
@on_both_databases
def test_stale_relay_cannot_finalize_or_release_reclaimed_rows(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=1)
    add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"x") for _ in range(10)])
    # Every shard to both relays: the second must reach the stalled relay's rows
    # (with advisory locks, PostgreSQL's default, the stalled one keeps its shard).
    fast = {
        "lease_ttl": 4.0,
        "flush_timeout": 0.5,
        "kafka_config": {"message.timeout.ms": "1000"},
        "shard_ownership": "all",
    }

    stalled: list[Batch] = []

    def stall(batch: Batch) -> None:  # relay A stops answering past its lease
        stalled.append(batch)
        time.sleep(5.5)

    with capture_json_logs(level="INFO") as logs:
        a = embedded(
            fast_settings(db_url, kafka_bootstrap, node_id="relay-a", **fast), on_batch=stall
        )
        wait_for(lambda: stalled, timeout=10, what="relay A's claim")
        b = embedded(fast_settings(db_url, kafka_bootstrap, node_id="relay-b", **fast))
        wait_for(lambda: b.metric("outbox_rows_delivered_total") == 10, timeout=20, what="B")
        assert b.metric("outbox_rows_reclaimed_total") == 10
        wait_for(lambda: a.metric("outbox_lease_lost_total") == 10, timeout=10, what="A's finalize")
        assert a.metric("outbox_rows_delivered_total") == 0
        lost = logs.events("lease-lost")
        assert lost and lost[0]["rows"] == 10
        assert a.stop() == 0 and b.stop() == 0

    after = rows(engine, outbox)
    assert all(r.status == "delivered" and r.lease_owner == "relay-b" for r in after)
    assert all(r.attempts == 2 for r in after)

    # A's release (its drain path) is refused by the token check as well.
    result = release(engine, outbox, stalled[0], stalled[0].rows, refund=True)
    assert len(result.lease_lost) == 10 and result.counts[Fate.RELEASED] == 0
    assert rows(engine, outbox) == after


@pytest.mark.integration
@on_both_databases
def test_concurrent_claimers_never_hold_the_same_row(engine: sa.Engine, outbox: str) -> None:
    import threading

    claim_engine = engine.execution_options(isolation_level="READ COMMITTED")  # as the relay
    add_events(engine, outbox, [Event(topic="t", key=f"k{i}", payload=b"p") for i in range(3000)])
    claimed: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(6)
    deadline = time.monotonic() + 60

    def claimer(owner: str) -> None:
        ids: list[int] = []
        start.wait(10)
        try:
            while time.monotonic() < deadline:
                batch = claim_batch(
                    claim_engine, outbox, owner=owner, shards=range(8), limit=10, lease_ttl=60
                )
                if batch is not None:
                    ids.extend(r.id for r in batch.rows)
                elif not status_counts(engine, outbox).get("pending"):
                    break  # None can also mean "all my candidates were locked"
        except BaseException as exc:
            errors.append(exc)
        claimed[owner] = ids

    threads = [threading.Thread(target=claimer, args=(f"c{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    every = [i for ids in claimed.values() for i in ids]
    assert len(every) == len(set(every)) == 3000, "each row claimed exactly once"
    assert sum(1 for ids in claimed.values() if ids) > 1, "the claimers really competed"
    owners = {r.id: r.lease_owner for r in rows(engine, outbox)}
    assert all(owners[i] == owner for owner, ids in claimed.items() for i in ids)


@pytest.mark.integration
@on_both_databases
def test_finalize_writes_one_statement_per_outcome_group(engine: sa.Engine, outbox: str) -> None:
    add_events(engine, outbox, [Event(topic="t", key=f"k{i}", payload=b"p") for i in range(300)])
    batch = claim_batch(engine, outbox, owner="o", shards=range(8), limit=300, lease_ttl=60)
    assert batch is not None
    decisions = [
        Decision(r, Fate.DELIVERED, partition=0, offset=r.id)
        if r.id % 3
        else Decision(r, Fate.RELEASED, refund=True)
        for r in batch.rows
    ]
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        result = finalize(engine, outbox, batch, decisions, backoff=None, delete_on_deliver=False)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert result.counts[Fate.DELIVERED] == 200 and result.counts[Fate.RELEASED] == 100
    writes = [s for s in statements if s.lstrip().upper().startswith("UPDATE")]
    assert len(writes) == 2, "one UPDATE per outcome, not one per row"
    table = {r.id: r for r in rows(engine, outbox)}
    assert all(table[r.id].kafka_offset == r.id for r in batch.rows if r.id % 3)
    assert all(table[r.id].attempts == 0 for r in batch.rows if not r.id % 3)


@pytest.mark.integration
@on_both_databases
def test_delete_on_deliver_removes_acknowledged_rows_only(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=1, config={"max.message.bytes": "2000"})
    add_events(engine, outbox, [Event(topic=topic, key="k", payload=b"small") for _ in range(4)])
    add_events(engine, outbox, [Event(topic=topic, key="k", payload=os.urandom(5000))])
    relay = embedded(
        fast_settings(
            db_url, kafka_bootstrap, delete_on_deliver=True, kafka_config={"batch.size": "1500"}
        )
    )
    wait_for(lambda: relay.metric("outbox_rows_failed_total") == 1, timeout=20, what="outcomes")
    assert relay.stop() == 0
    assert relay.metric("outbox_rows_delivered_total") == 4
    assert [r.status for r in rows(engine, outbox)] == ["failed"], "failed rows are kept"
    assert len(consume(kafka_bootstrap, topic, expected=4)) == 4


@pytest.mark.unit
def test_timeouts_after_an_authentication_failure_pause_instead_of_burning() -> None:
    from confluent_kafka import KafkaError

    from outboxkit.relay.publish import Publisher

    publisher = Publisher(fast_settings("mysql+pymysql://u:pw-x@127.0.0.1/db", "127.0.0.1:1"))
    timeout = Report(
        1, KafkaError._MSG_TIMED_OUT, "timed out", ErrorKind.RETRIABLE, None, None, 5.0
    )
    assert publisher.blame(timeout) is timeout, "a plain timeout stays retriable"
    with capture_json_logs(level="INFO") as logs:
        publisher._on_error(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication failed"))
    assert logs.events("kafka-error")[0]["code"] == "_AUTHENTICATION"
    blamed = publisher.blame(
        Report(1, KafkaError._MSG_TIMED_OUT, "timed out", ErrorKind.RETRIABLE, None, None, 1e12)
    )
    assert blamed.kind is ErrorKind.RETRIABLE, "outside the window it is a timeout again"
    now = time.monotonic()
    recent = Report(1, KafkaError._MSG_TIMED_OUT, "t", ErrorKind.RETRIABLE, None, None, now)
    blamed = publisher.blame(recent)
    assert blamed.kind is ErrorKind.CONFIG_FAULT and "_AUTHENTICATION" in (blamed.error or "")
    (decision,) = decide([_row(1, b"k")], {1: blamed}, max_attempts=1, refund_unknown=True)
    assert decision.fate is Fate.PAUSED and decision.pause_reason == "authentication"


@pytest.mark.integration
@on_both_databases
def test_a_paused_first_row_holds_its_key_back_in_other_topics_while_others_flow(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    good = kafka_topics(partitions=1)
    missing = f"okt_missing_{os.urandom(4).hex()}"
    [first_id] = add_events(engine, outbox, [Event(topic=missing, key="k", payload=b"first")])
    with capture_json_logs(level="INFO") as logs:
        # Probes every second: a probe batch carries the paused row but never the
        # later rows of its key, which go to another topic.
        relay = embedded(fast_settings(db_url, kafka_bootstrap, paused_topic_retry=1.0))
        wait_for(lambda: logs.events("topic-paused"), timeout=20, what="topic-paused")
        # Same key (same shard) in another topic, and other keys beside it.
        add_events(
            engine,
            outbox,
            [Event(topic=good, key="k", payload=f"k{i}".encode()) for i in range(3)]
            + [Event(topic=good, key=f"o{i}", payload=b"o") for i in range(20)],
        )
        wait_for(lambda: relay.metric("outbox_rows_delivered_total") == 20, timeout=20, what="o*")
        wait_for(
            lambda: relay.metric("outbox_ordering_blocked_rows") == 3, timeout=10, what="gauge"
        )
        held = [r for r in rows(engine, outbox) if r.topic == good and r.message_key == b"k"]
        assert [(r.status, r.attempts) for r in held] == [("pending", 0)] * 3
        time.sleep(2.5)  # two more probes of the paused topic
        held = [r for r in rows(engine, outbox) if r.topic == good and r.message_key == b"k"]
        assert [(r.status, r.attempts) for r in held] == [("pending", 0)] * 3
        assert all(m.key != b"k" for m in consume(kafka_bootstrap, good, expected=20, timeout=5))

        kafka_topics(partitions=1, name=missing)
        wait_for(lambda: relay.metric("outbox_rows_delivered_total") == 24, timeout=30, what="k")
        wait_for(lambda: relay.metric("outbox_ordering_blocked_rows") == 0, timeout=10, what="0")
        assert relay.stop() == 0
    by_id = {r.event_id: r for r in rows(engine, outbox)}
    assert by_id[first_id].status == "delivered"
    ks = [m for m in consume(kafka_bootstrap, good, expected=23) if m.key == b"k"]
    assert [m.value for m in ks] == [b"k0", b"k1", b"k2"]


def _statements(engine: sa.Engine) -> tuple[list[str], Callable[[], None]]:
    seen: list[str] = []

    def record(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    return seen, lambda: sa.event.remove(engine, "before_cursor_execute", record)


@pytest.mark.integration
@on_both_databases
def test_finalize_statements_are_the_same_text_every_batch(engine: sa.Engine, outbox: str) -> None:
    """No per-batch SQL (per-row values are parameters): SQLAlchemy compiles it once."""
    add_events(engine, outbox, [Event(topic="t", key=f"k{i}", payload=b"p") for i in range(60)])
    texts: list[list[str]] = []
    for size in (20, 40):
        batch = claim_batch(engine, outbox, owner="o", shards=range(8), limit=size, lease_ttl=60)
        assert batch is not None and len(batch) == size
        decisions = [
            Decision(r, Fate.DELIVERED, partition=r.id % 3, offset=1000 + r.id)
            if r.id % 4
            else Decision(r, Fate.RETRYABLE, error="boom")
            for r in batch.rows
        ]
        if size == 40:
            # Whichever fate a batch's first row has, the statements come in one order.
            decisions.reverse()
        seen, stop = _statements(engine)
        try:
            result = finalize(
                engine,
                outbox,
                batch,
                decisions,
                backoff=Backoff(base=10.0, cap=20.0),
                delete_on_deliver=False,
            )
        finally:
            stop()
        assert result.counts[Fate.DELIVERED] + result.counts[Fate.RETRYABLE] == size
        assert not result.lease_lost
        assert not [s for s in seen if s.lstrip().upper().startswith("SELECT")], (
            "no locking read when every row is still ours"
        )
        texts.append(seen)
    assert texts[0] == texts[1]
    table = {r.id: r for r in rows(engine, outbox)}
    delivered = [r for r in table.values() if r.status == "delivered"]
    assert len(delivered) == 45
    assert all(r.kafka_partition == r.id % 3 and r.kafka_offset == 1000 + r.id for r in delivered)
    retryable = [r for r in table.values() if r.status == "retryable"]
    assert len(retryable) == 15
    assert all(r.last_error == "boom" and r.lease_owner is None for r in retryable)
    assert all(r.next_attempt_at > r.updated_at for r in retryable)


@pytest.mark.integration
@on_both_databases
def test_finalize_writes_the_rows_still_held_and_leaves_reclaimed_ones(
    engine: sa.Engine, outbox: str
) -> None:
    add_events(engine, outbox, [Event(topic="t", key=f"k{i}", payload=b"p") for i in range(10)])
    batch = claim_batch(engine, outbox, owner="a", shards=range(8), limit=10, lease_ttl=60)
    assert batch is not None
    stolen = [r.id for r in batch.rows[::3]]
    t = outbox_table(outbox)
    with engine.begin() as conn:  # another relay reclaimed these under its own token
        conn.execute(
            t.update().where(t.c.id.in_(stolen)).values(lease_owner="b", lease_token="other")
        )
    decisions = [Decision(r, Fate.DELIVERED, partition=0, offset=r.id) for r in batch.rows]
    result = finalize(engine, outbox, batch, decisions, backoff=None, delete_on_deliver=False)
    assert sorted(result.lease_lost) == sorted(stolen)
    assert result.counts[Fate.DELIVERED] == 10 - len(stolen)
    for r in rows(engine, outbox):
        if r.id in stolen:
            assert (r.status, r.lease_owner, r.lease_token) == ("delivering", "b", "other")
        else:
            assert (r.status, r.kafka_offset, r.lease_token) == ("delivered", r.id, None)


@pytest.mark.integration
@on_both_databases
def test_a_paused_topics_row_left_by_a_killed_relay_keeps_its_key_in_order(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """A killed relay left key k's first row (a topic now paused) ``delivering``, its
    lease already expired. Until the topic's probe reclaims it, that row must hold
    k's next row (another topic) back; once the topic exists, k arrives in order."""
    good = kafka_topics(partitions=1)
    missing = f"okt_missing_{os.urandom(4).hex()}"
    add_events(engine, outbox, [Event(topic=missing, key="trigger", payload=b"t")])
    with capture_json_logs(level="INFO") as logs:
        relay = embedded(fast_settings(db_url, kafka_bootstrap, paused_topic_retry=4.0))
        wait_for(lambda: logs.events("topic-paused"), timeout=20, what="topic-paused")
        [first_id, second_id] = add_events(
            engine,
            outbox,
            [
                Event(topic=missing, key="k", payload=b"1"),
                Event(topic=good, key="k", payload=b"2"),
            ],
        )
        t = outbox_table(outbox)
        with engine.begin() as conn:  # what a relay killed mid-batch leaves behind
            conn.execute(
                t.update()
                .where(t.c.event_id == first_id)
                .values(
                    status="delivering",
                    attempts=1,
                    lease_owner="killed",
                    lease_token="0" * 32,
                    lease_expires_at=db_time(-1),
                )
            )
        time.sleep(1.5)  # many claims, all before the paused topic's next probe
        second = next(r for r in rows(engine, outbox) if r.event_id == second_id)
        assert (second.status, second.attempts) == ("pending", 0), "k's second row waits"

        kafka_topics(partitions=1, name=missing)
        wait_for(lambda: status_counts(engine, outbox) == {"delivered": 3}, timeout=40, what="all")
        assert relay.stop() == 0
    by_id = {r.event_id: r for r in rows(engine, outbox)}
    assert by_id[first_id].delivered_at < by_id[second_id].delivered_at
    assert [m.value for m in consume(kafka_bootstrap, good, expected=1)] == [b"2"]


def _pg_write_plans(
    conn: sa.Connection, statement: sa.TextClause, params: dict[str, object]
) -> dict[str, dict[str, Any]]:
    """PostgreSQL's plans of a finalize write with ``params``, rolled back: the
    custom plan (made for these values, as for a statement's first runs) and the
    generic one (what PostgreSQL may keep once psycopg prepared it)."""
    compiled = statement.compile(dialect=conn.engine.dialect)
    state = compiled.construct_params(params)
    numbered, names = pg_positional(str(compiled))
    raw = conn.connection.dbapi_connection
    assert raw is not None
    plans: dict[str, dict[str, Any]] = {}
    with raw.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + str(compiled), state)
        plans["custom"] = cur.fetchone()[0][0]  # type: ignore[index]
        cur.execute("ROLLBACK")
        cur.execute("PREPARE outboxkit_write AS " + numbered)
        try:
            cur.execute("SET plan_cache_mode = force_generic_plan")
            args = ", ".join(psycopg_sql.Literal(state[n]).as_string(raw) for n in names)
            cur.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE outboxkit_write({args})")
            plans["generic"] = cur.fetchone()[0][0]  # type: ignore[index]
            cur.execute("ROLLBACK")
        finally:
            cur.execute("RESET plan_cache_mode")
            cur.execute("DEALLOCATE outboxkit_write")
    return plans


@pytest.mark.parametrize("fate", [Fate.DELIVERED, Fate.RETRYABLE])
def test_a_batchs_per_row_write_reads_each_row_once_under_statistics_of_a_running_relay(
    pg_url: str, fate: Fate
) -> None:
    """PostgreSQL, statistics taken while a relay held one batch (about a hundred
    rows ``delivering``, most of the table delivered), as autovacuum takes them
    of a busy outbox: the write that marks a 500-row batch delivered (or
    retryable) reads each of its rows once. With the lease guard's status as an
    index condition, PostgreSQL expected one row from ``(status, id)`` and made
    it the outer side of a nested loop over the batch's 500 per-row values:
    250,000 comparisons, 125-293 ms a batch instead of 10-20 (a 1M-row drain's slow
    tenths)."""
    engine = sa.create_engine(pg_url)
    try:
        apply_schema(engine, shards=8)
        outbox = "outbox_events"
        t = outbox_table(outbox)
        with engine.begin() as conn:
            conn.execute(sa.text(f"ALTER TABLE {outbox} SET (autovacuum_enabled = false)"))
        add_events(
            engine,
            outbox,
            [Event(topic="t", key=f"k{i % 10_000}", payload=b"x" * 100) for i in range(20_000)],
        )
        with engine.begin() as conn:
            conn.execute(t.update().where(t.c.id <= 18_900).values(status="delivered"))
            conn.execute(  # another relay's batch, leased for an hour
                t.update()
                .where(t.c.id > 18_900, t.c.id <= 19_000)
                .values(
                    status="delivering",
                    lease_owner="other",
                    lease_token=sa.cast(t.c.id, sa.String),
                    lease_expires_at=db_time(3600),
                )
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text(f"ANALYZE {outbox}"))
        batch = claim_batch(engine, outbox, owner="me", shards=range(8), limit=500, lease_ttl=60)
        assert batch is not None
        size = len(batch.rows)
        assert size == 500
        if fate is Fate.DELIVERED:
            per_row = [(r.id, 0, i) for i, r in enumerate(batch.rows)]
        else:
            per_row = [(r.id, 1_000_000, None) for r in batch.rows]
        with engine.connect() as conn:
            statement, params = _per_row_write(conn, t, batch, fate, None, False, per_row)
            plans = _pg_write_plans(conn, statement, params)
        touched = {mode: pg_rows_touched(plan) for mode, plan in plans.items()}
        # Each row's value, its index entry and its row version: a few per row.
        assert all(n < 10 * size for n in touched.values()), (touched, plans)
    finally:
        engine.dispose()
