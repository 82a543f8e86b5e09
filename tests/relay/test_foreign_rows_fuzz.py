"""Fuzz: random bytes and JSON shapes in every column a foreign writer sets (headers,
message_key, payload, topic, event_id, shard, attempts, status, and times at
their type's edges: zero dates, times years ahead), inserted with plain SQL
beside good rows, against one running relay and real Kafka.

After each example: the relay never crashed (no supervisor restart), nothing is
left waiting (no key stalled), every bad row is ``failed`` with a reason, every
good row is ``delivered`` and arrived exactly as stored, and each key's rows
arrived in id order. Some examples store their rows on the last ids a BIGINT
holds (ending on 2^63-1, as a foreign writer with its own sequence may), then
delete them once settled so the table's own ids go on from where they were.
The relay's producer queue holds two messages: a batch of more sendable rows
fills it and waits for room (the full-queue path of the publisher).
``OUTBOXKIT_FUZZ_EXAMPLES`` raises the number of examples (and turns
derandomization off) for a longer run.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, TopicPartition
from foreign import insert_foreign
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relay_support import EmbeddedRelay, fast_settings, rows, wait_for

from outboxkit.schema.codec import decode_headers, encode_headers, topic_problem

pytestmark = pytest.mark.integration

_EXAMPLES = int(os.environ.get("OUTBOXKIT_FUZZ_EXAMPLES", "0") or 0)
_UNSETTLED = ("pending", "retryable", "delivering")

#: Text a utf8mb4 column can hold (no lone surrogates).
_CHARS = st.characters(blacklist_categories=("Cs",))
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(_CHARS, max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(_CHARS, max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_GOOD_NAME = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=8,
).filter(lambda n: n != "event_id")
_GOOD_HEADERS = st.dictionaries(_GOOD_NAME, st.text(_CHARS, max_size=8) | st.binary(max_size=8))
_BAD_VALUE = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.lists(_JSON, max_size=2)
    | st.dictionaries(st.text(_CHARS, max_size=4), _JSON, max_size=2).filter(
        lambda d: set(d) != {"b64"}
    )
    | st.just({"b64": "!!"})
    | st.just({"b64": 3})
    | st.just("\ud800")
)
_BAD_NAME = st.sampled_from(["", "event_id", "a\x00b", "\x00", "\ud800", "x\udfff"])


def _headers_json(value: Any, ascii_only: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_only)


@st.composite
def _bad_headers(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["shape", "value", "name", "text"]))
    if kind == "shape":
        value = draw(_JSON.filter(lambda v: not isinstance(v, dict)))
        return _headers_json(value, draw(st.booleans()))
    if kind == "text":  # not JSON at all, or nested deeper than any parser goes
        return draw(st.sampled_from(["{", "{'a': 'b'}", "[" * 3000 + "]" * 3000, '{"a": "b"} x']))
    good = draw(st.dictionaries(_GOOD_NAME, st.text(_CHARS, max_size=4), max_size=2))
    if kind == "value":
        good[draw(_GOOD_NAME)] = draw(_BAD_VALUE)
    else:
        good[draw(_BAD_NAME)] = draw(st.text(_CHARS, max_size=4))
    return _headers_json(good, True)  # lone surrogates survive only as \u escapes


_BAD_TOPIC = st.sampled_from(
    ["", "bad topic!", "ordérs", "orders\n", "a\x00b", ".", "..", "a/b", "\t"]
) | st.text(_CHARS, max_size=12).filter(lambda t: topic_problem(t) is not None)
_BAD_EVENT_ID = st.sampled_from(["", "a b", "é", "a\nb", "a\x00b", "x\t"]) | st.text(
    _CHARS, min_size=1, max_size=20
).filter(lambda e: not all(0x21 <= ord(c) <= 0x7E for c in e))
_KEYS = st.sampled_from([b"a", b"b", b"c", b""]) | st.none() | st.binary(min_size=1, max_size=16)
_SHARDS = st.integers(-40, 40) | st.sampled_from([-32768, 32767])
_ATTEMPTS = st.sampled_from([0, 0, 0, 0, 0, 1, 9, 10, -1, -(2**31), 2**31 - 1])
_GOOD_EVENT_ID = st.from_regex(r"[\x21-\x7e]{1,20}", fullmatch=True)
#: The largest id the BIGINT ``id`` column holds.
MAX_ID = 2**63 - 1


#: A time at its type's edge, stored from a session without strict mode (zero
#: dates; a time past the 7-day horizon counts as passed): the row is delivered.
_EDGE_TIME = st.none() | st.sampled_from(
    [
        ("created_at", "0000-00-00 00:00:00"),
        ("created_at", "2024-00-00 00:00:00"),
        ("next_attempt_at", "0000-00-00 00:00:00"),
        ("next_attempt_at", "9999-12-31 23:59:59"),
        ("lease_expires_at", "0000-00-00 00:00:00"),
        ("lease_expires_at", "9999-12-31 23:59:59"),
    ]
)


@dataclass
class Foreign:
    columns: dict[str, Any]
    expect: str  # "delivered", "failed", or "either"
    #: (column, value as SQL text) stored after the insert, or None.
    edge: tuple[str, str] | None = None


def store_edge(engine: sa.Engine, table: str, row_id: int, edge: tuple[str, str]) -> None:
    column, value = edge
    with engine.begin() as conn:
        conn.exec_driver_sql("SET SESSION sql_mode = ''")
        conn.exec_driver_sql(f"UPDATE {table} SET {column} = '{value}' WHERE id = {int(row_id)}")
        conn.exec_driver_sql("SET SESSION sql_mode = DEFAULT")


@st.composite
def _rows(draw: st.DrawFn, topics: list[str]) -> list[Foreign]:
    out: list[Foreign] = []
    for _ in range(draw(st.integers(1, 10))):
        columns: dict[str, Any] = {
            "topic": draw(st.sampled_from(topics)),
            "key": draw(_KEYS),
            "payload": draw(st.binary(max_size=64)),
            "headers": encode_headers(draw(_GOOD_HEADERS)),
            # Any printable ASCII, made unique (the column is) by a suffix.
            "event_id": draw(_GOOD_EVENT_ID) + "-" + uuid.uuid4().hex,
            "shard": draw(_SHARDS),
            "attempts": draw(_ATTEMPTS),
            # delivering: as another writer may store it, without a lease
            "status": draw(st.sampled_from(["pending"] * 4 + ["retryable", "delivering"])),
        }
        fault = draw(
            st.sampled_from([None, None, None, "topic", "event_id", "headers", "wild-headers"])
        )
        # More claims than max_attempts (10): failed as exhausted, never sent.
        expect = "failed" if columns["attempts"] >= 10 else "delivered"
        if fault == "topic":
            columns["topic"], expect = draw(_BAD_TOPIC), "failed"
        elif fault == "event_id":
            suffix = uuid.uuid4().hex[:8]  # unique (the column is), and still bad
            columns["event_id"], expect = draw(_BAD_EVENT_ID) + " " + suffix, "failed"
        elif fault == "headers":
            columns["headers"], expect = draw(_bad_headers()), "failed"
        elif fault == "wild-headers" and expect != "failed":
            wild = draw(st.text(_CHARS, max_size=30) | _JSON.map(lambda v: json.dumps(v)))
            columns["headers"], expect = wild, "either"
        out.append(Foreign(columns, expect, draw(_EDGE_TIME)))
    return out


class Collector:
    """Every message of the given topics, by event id (first copy), read as it arrives."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"fuzz-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
            }
        )
        meta = self.consumer.list_topics(timeout=10)
        self.consumer.assign(
            [
                TopicPartition(t, p, 0)
                for t in topics
                for p in meta.topics[t].partitions  # type: ignore[union-attr]
            ]
        )
        self.first: dict[bytes, Any] = {}

    def poll_for(self, event_ids: set[bytes], timeout: float) -> None:
        def seen() -> bool:
            for msg in self.consumer.consume(500, timeout=0.1):
                if msg.error():
                    continue
                eid = dict(msg.headers() or [])["event_id"]
                self.first.setdefault(eid, msg)
            return event_ids <= set(self.first)

        wait_for(seen, timeout=timeout, interval=0, what="the delivered rows in Kafka")

    def close(self) -> None:
        self.consumer.close()


def test_foreign_rows_never_crash_stall_or_reorder(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topics = [kafka_topics(partitions=2), kafka_topics(partitions=1)]
    # skip: a bad row fails and its key's good rows go on, so every example
    # settles whatever keys it shares with the bad rows of earlier ones (the
    # hold rule is the protocol model's and test_claim.py's).
    # A producer queue of two messages: a batch of more rows finds it full after
    # its second row and waits for room, row by row (BufferError, then polls).
    relay = embedded(
        fast_settings(
            db_url,
            kafka_bootstrap,
            failed_rows="skip",
            kafka_config={"queue.buffering.max.messages": "2"},
        )
    )
    collector = Collector(kafka_bootstrap, topics)
    outcomes: dict[str, int] = {"delivered": 0, "failed": 0}

    @settings(
        max_examples=_EXAMPLES or 12,
        derandomize=not _EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_rows(topics), st.sampled_from([False, False, True]))
    def check(foreign: list[Foreign], at_the_top: bool) -> None:
        expected: dict[int, str] = {}
        top_ids = iter(range(MAX_ID - len(foreign) + 1, MAX_ID + 1))
        for row in foreign:
            cols = dict(row.columns)
            if at_the_top:
                cols["id"] = next(top_ids)
            row_id = insert_foreign(engine, outbox, **cols)
            if row.edge is not None:
                store_edge(engine, outbox, row_id, row.edge)
            expected[row_id] = row.expect
        ids = set(expected)

        def settled() -> list[sa.Row[Any]]:
            mine = [r for r in rows(engine, outbox) if r.id in ids]
            return [] if any(r.status in _UNSETTLED for r in mine) else mine

        try:
            table = wait_for(settled, timeout=30, what="every row delivered or failed")
        except AssertionError:
            left = [(r.id, r.status, r.last_error) for r in rows(engine, outbox) if r.id in ids]
            raise AssertionError(f"rows left waiting (a stall): {left}") from None
        assert relay.relay.supervisor.crashes == 0, "a foreign row crashed the relay"
        assert relay.thread.is_alive()
        for r in table:
            assert r.status in ("delivered", "failed"), r
            if expected[r.id] != "either":
                assert r.status == expected[r.id], (r.status, r.last_error, r.headers, r.topic)
            if r.status == "failed":
                assert r.last_error, "a failed row says why"
            outcomes[r.status] += 1
        delivered = [r for r in table if r.status == "delivered"]
        collector.poll_for({r.event_id.encode() for r in delivered}, timeout=20)
        for r in delivered:  # arrived exactly as stored
            msg = collector.first[r.event_id.encode()]
            assert msg.topic() == r.topic
            assert msg.key() == r.message_key, r  # b"" stays b"", None stays None
            assert msg.value() == r.payload, r
            sent = list(msg.headers() or [])
            stored = [
                (n, v.encode() if isinstance(v, str) else v)
                for n, v in decode_headers(r.headers).items()
            ]
            assert sent == [*stored, ("event_id", r.event_id.encode())], r
        by_key: dict[bytes, list[sa.Row[Any]]] = {}
        for r in delivered:
            if r.message_key is not None:
                by_key.setdefault(r.message_key, []).append(r)
        for key_rows in by_key.values():  # table rows are in id order
            at = [r.delivered_at for r in key_rows]
            assert at == sorted(at), "a key's rows were delivered in id order"
            for topic in topics:
                places = [
                    (
                        collector.first[r.event_id.encode()].partition(),
                        collector.first[r.event_id.encode()].offset(),
                    )
                    for r in key_rows
                    if r.topic == topic
                ]
                assert places == sorted(places), "a key's rows are in id order in Kafka"
        if at_the_top:  # settled: make room for the next example's rows up there
            with engine.begin() as conn:
                conn.execute(sa.text(f"DELETE FROM {outbox} WHERE id > :low"), {"low": MAX_ID // 2})
                conn.exec_driver_sql(f"ALTER TABLE {outbox} AUTO_INCREMENT = 1")

    try:
        check()
    finally:
        collector.close()
    assert outcomes["delivered"] > 10 and outcomes["failed"] > 10, outcomes
    assert relay.stop() == 0
