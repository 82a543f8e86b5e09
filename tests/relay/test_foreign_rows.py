"""Rows the relay did not write: every row-level fault fails that row, with a reason,
never its batch, its key or the relay."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer
from foreign import insert_foreign
from relay_support import (
    EmbeddedRelay,
    RelayProcess,
    cli_args,
    consume,
    fast_settings,
    rows,
    status_counts,
    wait_for,
)
from support.databases import on_both_databases

from outboxkit.cli import main
from outboxkit.relay import publish
from outboxkit.relay.rows import ClaimedRow
from outboxkit.runtime.testing import capture_json_logs

pytestmark = pytest.mark.integration

#: (case id, columns of the bad row, fragment its last_error must contain)
Case = tuple[str, dict[str, Any], str]

HEADER_SHAPES: list[Case] = [
    ("list", {"headers": "[1]"}, "headers must be a JSON object"),
    ("null", {"headers": "null"}, "headers must be a JSON object"),
    ("string", {"headers": '"x"'}, "headers must be a JSON object"),
    ("number", {"headers": "3"}, "headers must be a JSON object"),
    ("bool", {"headers": "true"}, "headers must be a JSON object"),
    ("not-json", {"headers": "{"}, "headers are not valid JSON"),
    ("too-deep", {"headers": "[" * 5000 + "]" * 5000}, "headers are not valid JSON"),
]
HEADER_VALUES: list[Case] = [
    ("null", {"headers": '{"h":null}'}, "header 'h'"),
    ("list", {"headers": '{"h":[1]}'}, "header 'h'"),
    ("int", {"headers": '{"h":3}'}, "header 'h'"),
    ("float", {"headers": '{"h":1.5}'}, "header 'h'"),
    ("bool", {"headers": '{"h":true}'}, "header 'h'"),
    ("object", {"headers": '{"h":{}}'}, "header 'h'"),
    ("bad-base64", {"headers": '{"h":{"b64":"!!"}}'}, "header 'h'"),
    ("base64-not-str", {"headers": '{"h":{"b64":3}}'}, "header 'h'"),
    ("base64-extra-field", {"headers": '{"h":{"b64":"eA==","x":1}}'}, "header 'h'"),
    ("lone-surrogate-value", {"headers": '{"h":"\\ud800"}'}, "header 'h'"),
]
HEADER_NAMES: list[Case] = [
    ("nul", {"headers": '{"a\\u0000b":"x"}'}, "NUL"),
    ("empty", {"headers": '{"":"x"}'}, "header name"),
    ("reserved", {"headers": '{"event_id":"x"}'}, "reserved"),
]
TOPICS: list[Case] = [
    ("nul", {"topic": "a\x00b"}, "topic"),
    ("space-bang", {"topic": "bad topic!"}, "topic"),
    ("empty", {"topic": ""}, "topic"),
    ("non-ascii", {"topic": "ordérs"}, "topic"),
    ("trailing-newline", {"topic": "orders\n"}, "topic"),
    ("dot", {"topic": "."}, "topic"),
    ("dotdot", {"topic": ".."}, "topic"),
    ("slash", {"topic": "a/b"}, "topic"),
]
EVENT_IDS: list[Case] = [
    ("empty", {"event_id": ""}, "event_id"),
    ("non-ascii", {"event_id": "é-1"}, "event_id"),
    ("space", {"event_id": "a b"}, "event_id"),
    ("newline", {"event_id": "a\nb"}, "event_id"),
    ("nul", {"event_id": "a\x00b"}, "event_id"),
]


@dataclass
class CliResult:
    code: int
    out: str
    err: str


def run_cli(argv: list[str]) -> CliResult:
    """``outboxkit ARGV`` in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


def settle(
    engine: sa.Engine, table: str, expected: dict[str, int], *, timeout: float, waiting: int = 0
) -> None:
    """Wait until the rows per status are ``expected``, and ``waiting`` rows more
    are ``pending`` or ``retryable``; say what they are if not."""

    def settled() -> bool:
        counts = status_counts(engine, table)
        left = counts.pop("pending", 0) + counts.pop("retryable", 0)
        return counts == expected and left == waiting

    try:
        wait_for(settled, timeout=timeout)
    except AssertionError:
        raise AssertionError(
            f"rows per status {status_counts(engine, table)} after {timeout} s, not {expected}"
        ) from None


def _run_bad_rows(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    topic: str,
    embedded: Callable[..., EmbeddedRelay],
    cases: list[Case],
) -> EmbeddedRelay:
    """Each bad row sits between two good rows of its key, all in one batch; the
    bad ones fail unsent with their reason, the rows before them arrive, and the
    rows after them wait behind them (``--failed-rows hold``): never sent, so
    Kafka holds nothing of a key ahead of its failed row."""
    bad: dict[int, tuple[str, str]] = {}
    for i, (name, columns, fragment) in enumerate(cases):
        key = f"k{i}".encode()
        insert_foreign(engine, outbox, topic=topic, key=key, payload=b"before")
        row_id = insert_foreign(
            engine, outbox, **{"topic": topic, "key": key, "payload": b"bad", **columns}
        )
        bad[row_id] = (name, fragment)
        insert_foreign(engine, outbox, topic=topic, key=key, payload=b"after")
    relay = embedded(fast_settings(db_url, kafka_bootstrap))
    n = len(cases)
    settle(engine, outbox, {"delivered": n, "failed": n}, timeout=30, waiting=n)
    assert relay.relay.supervisor.crashes == 0, "no bad row crashes the relay"
    for row in rows(engine, outbox):
        if row.id in bad:
            name, fragment = bad[row.id]
            assert row.status == "failed", name
            assert fragment in (row.last_error or ""), (name, row.last_error)
            assert row.attempts == 1 and row.lease_owner is None, name
    assert relay.metric("outbox_rows_failed_total") == n
    assert relay.metric("outbox_rows_acked_out_of_order_total") == 0
    wait_for(lambda: relay.metric("outbox_keys_held_by_failed") == n, timeout=10, what="held keys")
    messages = consume(kafka_bootstrap, topic, expected=n)
    by_key: dict[bytes | None, list[bytes]] = {}
    for m in messages:
        by_key.setdefault(m.key, []).append(m.value)
    assert by_key == {f"k{i}".encode(): [b"before"] for i in range(n)}
    return relay


@pytest.mark.parametrize(
    "cases",
    [
        pytest.param(HEADER_SHAPES, id="headers-not-an-object"),
        pytest.param(HEADER_VALUES, id="header-values-that-cannot-travel"),
        pytest.param(HEADER_NAMES, id="header-names-that-cannot-travel"),
        pytest.param(TOPICS, id="topics-kafka-never-accepts"),
        pytest.param(EVENT_IDS, id="event-ids-that-cannot-travel"),
    ],
)
def test_a_bad_row_fails_alone_with_a_reason(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
    cases: list[Case],
) -> None:
    topic = kafka_topics(partitions=1)
    relay = _run_bad_rows(engine, db_url, outbox, kafka_bootstrap, topic, embedded, cases)
    assert not relay.relay.paused.paused_topics(), "an illegal topic name is not a pause"
    assert relay.stop() == 0


def test_an_exception_while_producing_one_row_fails_that_row_and_names_it(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever ``produce`` raises for one row (here: a RuntimeError it was never
    expected to raise) is that row's failure, logged with the row's id."""

    class Exploding(Producer):  # type: ignore[misc]
        def produce(self, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("value") == b"boom":
                raise RuntimeError("produce exploded")
            super().produce(*args, **kwargs)

    monkeypatch.setattr(publish, "Producer", Exploding)
    topic = kafka_topics(partitions=1)
    insert_foreign(engine, outbox, topic=topic, payload=b"1")
    boom = insert_foreign(engine, outbox, topic=topic, payload=b"boom")
    insert_foreign(engine, outbox, topic=topic, payload=b"2")
    with capture_json_logs(level="INFO") as logs:
        relay = embedded(fast_settings(db_url, kafka_bootstrap, failed_rows="skip"))
        settle(engine, outbox, {"delivered": 2, "failed": 1}, timeout=20)
        assert relay.stop() == 0
    assert relay.relay.supervisor.crashes == 0
    (failed,) = [r for r in rows(engine, outbox) if r.status == "failed"]
    assert failed.id == boom and "RuntimeError: produce exploded" in failed.last_error
    (line,) = logs.events("row-produce-error")
    assert line["row_id"] == boom and line["topic"] == topic
    assert "RuntimeError" in str(line.get("exc", ""))
    assert [m.value for m in consume(kafka_bootstrap, topic, expected=2)] == [b"1", b"2"]


def test_a_header_name_with_a_lone_surrogate_fails_the_row_not_the_process(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """``{"\\ud800":"x"}`` stored as plain-ASCII JSON used to crash the process inside
    librdkafka's produce (SIGSEGV): run the real CLI so a crash cannot hide."""
    topic = kafka_topics(partitions=1)
    insert_foreign(engine, outbox, topic=topic, payload=b"1")
    bad = insert_foreign(engine, outbox, topic=topic, payload=b"bad", headers='{"\\ud800":"x"}')
    bad_value = insert_foreign(engine, outbox, topic=topic, headers='{"h\\udfff":"\\ud800"}')
    insert_foreign(engine, outbox, topic=topic, payload=b"2")
    proc = relay_process(cli_args(fast_settings(db_url, kafka_bootstrap, failed_rows="skip")))
    wait_for(
        lambda: (
            status_counts(engine, outbox) == {"delivered": 2, "failed": 2}
            or proc.proc.poll() is not None
        ),
        timeout=30,
        what="rows settled",
    )
    assert proc.proc.poll() is None, f"relay died: {proc.proc.returncode}"
    assert status_counts(engine, outbox) == {"delivered": 2, "failed": 2}
    by_id = {r.id: r for r in rows(engine, outbox)}
    assert "not valid UTF-8" in by_id[bad].last_error
    assert "not valid UTF-8" in by_id[bad_value].last_error
    assert not proc.events("worker-crashed")
    proc.signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert [m.value for m in consume(kafka_bootstrap, topic, expected=2)] == [b"1", b"2"]


@on_both_databases
def test_rows_with_a_shard_out_of_range_are_reported_and_delivered_in_key_order(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """Shards 100 and -3 in an 8-shard table: ``admin status`` counts them, the relay
    claims them under their key's shard, counts and logs them, and the key's later
    row (a normal shard) is not delivered ahead of them."""
    topic = kafka_topics(partitions=1)
    first = insert_foreign(engine, outbox, topic=topic, key=b"k", payload=b"1", shard=100)
    insert_foreign(engine, outbox, topic=topic, key=b"k", payload=b"2")
    insert_foreign(engine, outbox, topic=topic, key=b"n", payload=b"n1", shard=-3)
    insert_foreign(engine, outbox, topic=topic, key=b"n", payload=b"n2")
    res = run_cli(["admin", "status", "--json", "--db-url", db_url])
    assert res.code == 0, res.err
    assert json.loads(res.out)["shard_out_of_range"] == 2
    text = run_cli(["admin", "status", "--db-url", db_url]).out
    assert "shard out of range: 2 undelivered rows have a shard outside 0..7" in text
    with capture_json_logs(level="INFO") as logs:
        relay = embedded(fast_settings(db_url, kafka_bootstrap))
        settle(engine, outbox, {"delivered": 4}, timeout=20)
        assert relay.metric("outbox_rows_shard_out_of_range_total") == 2
        assert relay.stop() == 0
    (line,) = logs.events("shard-out-of-range")
    assert line["rows"] == 2 and first in line["row_ids"]  # type: ignore[operator]
    assert line["stored_shards"] == [100, -3]
    by_key: dict[bytes | None, list[bytes]] = {}
    for m in consume(kafka_bootstrap, topic, expected=4):
        by_key.setdefault(m.key, []).append(m.value)
    assert by_key == {b"k": [b"1", b"2"], b"n": [b"n1", b"n2"]}
    assert (
        json.loads(run_cli(["admin", "status", "--json", "--db-url", db_url]).out)[
            "shard_out_of_range"
        ]
        == 0
    )


@on_both_databases
def test_a_row_with_extreme_attempts_does_not_stop_the_claim(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    """``attempts`` at the column's maximum: the claim's ``attempts + 1`` must not
    overflow (that failed every claim, for every key); the row is failed as
    exhausted, and a negative count is merely more retries."""
    topic = kafka_topics(partitions=1)
    insert_foreign(engine, outbox, topic=topic, payload=b"1")
    top = insert_foreign(engine, outbox, topic=topic, payload=b"top", attempts=2**31 - 1)
    insert_foreign(engine, outbox, topic=topic, payload=b"low", attempts=-(2**31))
    insert_foreign(engine, outbox, topic=topic, key=b"other", payload=b"o")
    relay = embedded(fast_settings(db_url, kafka_bootstrap, failed_rows="skip"))
    settle(engine, outbox, {"delivered": 3, "failed": 1}, timeout=20)
    assert relay.relay.supervisor.crashes == 0
    failed = next(r for r in rows(engine, outbox) if r.status == "failed")
    assert failed.id == top and "without a delivery outcome" in failed.last_error
    assert relay.stop() == 0
    assert sorted(m.value for m in consume(kafka_bootstrap, topic, expected=3)) == [
        b"1",
        b"low",
        b"o",
    ]


def test_an_exception_escaping_the_per_row_handling_names_the_row(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a BaseException (an interrupt) gets past the per-row handling; its
    traceback, which the supervisor logs, says which row was being produced.
    The topic exists: a topic the broker does not know yet (auto-creation still
    under way on a busy broker) fails the row before any produce."""

    class Interrupted(Producer):  # type: ignore[misc]
        def produce(self, *args: Any, **kwargs: Any) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(publish, "Producer", Interrupted)
    publisher = publish.Publisher(fast_settings("mysql+pymysql://u@h/db", kafka_bootstrap))
    row = ClaimedRow(
        id=4711,
        event_id="e-1",
        topic=kafka_topics(partitions=1),
        key=b"k",
        payload=b"p",
        headers=None,
        shard=0,
        attempts=1,
        age_at_claim=0.0,
        reclaimed_from=None,
    )
    with pytest.raises(KeyboardInterrupt) as caught:
        publisher.publish([row], until=lambda: float("inf"))
    text = "".join(traceback.format_exception(caught.value))
    assert "while producing outbox row id=4711" in text
    publisher.close(0)
