"""Fuzz, the edges the other row fuzzers never reach: stored headers that give a
name twice (at the top, inside a ``{"b64": ...}``, spelled with escapes), and
payloads around the claim's byte budget and over the producer's
``message.max.bytes``, among ordinary rows of a few keys, on both databases,
against one running relay and real Kafka.

Scaled down so an example takes a second: the producer's limit is 300,000 bytes
and the claim budget 150,000 (tests/relay/test_claim_bytes.py measures memory
with MiB-sized rows). After each example: the relay never restarted, no row
is left waiting, a row with a repeated header name or a payload over the limit
is ``failed`` with its reason, every other row is ``delivered`` and arrived
exactly as stored, and each key's rows arrived in id order. Some examples
store their rows on the last ids a BIGINT holds (ending on 2^63-1), deleted
once settled so the table's own ids go on from where they were.
``OUTBOXKIT_FUZZ_EXAMPLES`` raises the number of examples (and turns
derandomization off).
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
from foreign import insert_foreign
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relay_support import EmbeddedRelay, consume, fast_settings, rows, wait_for
from support.databases import on_both_databases

from outboxkit.schema.codec import encode_headers

pytestmark = [pytest.mark.integration, on_both_databases]

_EXAMPLES = int(os.environ.get("OUTBOXKIT_FUZZ_EXAMPLES", "0") or 0)
_UNSETTLED = ("pending", "retryable", "delivering")
MESSAGE_MAX = 300_000
BUDGET = 150_000
#: The largest id the BIGINT ``id`` column holds.
MAX_ID = 2**63 - 1

_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
_NAME = st.text(_CHARS, min_size=1, max_size=6).filter(lambda n: n != "event_id")
_VALUE = st.text(_CHARS, max_size=6)
_KEYS = st.sampled_from([b"a", b"b", b"c"]) | st.none()
#: Payload sizes: ordinary, around the budget (one row may be bigger than the
#: whole budget and still go, alone), and over the producer's limit.
_SIZES = st.sampled_from(["small"] * 3 + ["budget", "over"]).flatmap(
    lambda kind: {
        "small": st.integers(0, 64),
        "budget": st.integers(BUDGET // 2, MESSAGE_MAX - 1_000),
        "over": st.integers(MESSAGE_MAX + 1, 2 * MESSAGE_MAX),
    }[kind]
)


def _spelled(name: str, escaped: bool) -> str:
    """``name`` as a JSON string, with every character escaped or none."""
    if not escaped:
        return json.dumps(name, ensure_ascii=False)
    return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c for c in name) + '"'


@st.composite
def _repeated_headers(draw: st.DrawFn) -> str:
    """A stored headers text that gives one name twice, somewhere."""
    pairs = draw(
        st.lists(st.tuples(_NAME, _VALUE), min_size=1, max_size=3, unique_by=lambda p: p[0])
    )
    if draw(st.booleans()):  # a b64 object with two "b64"
        name = draw(_NAME)
        inner = '{"b64":"QQ==","b64":"Qg=="}'
        body = [f"{json.dumps(n)}:{json.dumps(v)}" for n, v in pairs if n != name]
        return "{" + ",".join([*body, f"{json.dumps(name)}:{inner}"]) + "}"
    name, _ = draw(st.sampled_from(pairs))
    again = f"{_spelled(name, draw(st.booleans()))}:{json.dumps(draw(_VALUE))}"
    body = [f"{_spelled(n, draw(st.booleans()))}:{json.dumps(v)}" for n, v in pairs]
    body.insert(draw(st.integers(0, len(body))), again)
    return "{" + ",".join(body) + "}"


@dataclass
class Edge:
    key: bytes | None
    size: int
    headers: str | None
    expect: str  # "delivered" or the fragment of last_error of a failed row


@st.composite
def _rows(draw: st.DrawFn) -> list[Edge]:
    out = []
    for _ in range(draw(st.integers(1, 8))):
        size = draw(_SIZES)
        if draw(st.integers(0, 3)) == 0:
            headers, expect = draw(_repeated_headers()), "more than once"
        else:
            headers = encode_headers(draw(st.dictionaries(_NAME, _VALUE, max_size=2)))
            expect = "delivered"
        if size > MESSAGE_MAX:
            expect = "message.max.bytes"
        out.append(Edge(draw(_KEYS), size, headers, expect))
    return out


def _payload(event_id: str, size: int) -> bytes:
    return (event_id.encode() + b":" + b"p" * size)[: max(size, 0)] if size else b""


def test_repeated_header_names_and_big_payloads_never_crash_stall_or_reorder(
    engine: sa.Engine,
    db_url: str,
    outbox: str,
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    embedded: Callable[..., EmbeddedRelay],
) -> None:
    topic = kafka_topics(partitions=1)
    relay = embedded(
        fast_settings(
            db_url,
            kafka_bootstrap,
            kafka_config={
                "message.max.bytes": str(MESSAGE_MAX),
                "queue.buffering.max.messages": "2",
            },
            batch_max_bytes=BUDGET,
            # skip: a bad row fails and the good rows of its key go on (the hold
            # rule is the protocol model's and test_claim.py's).
            failed_rows="skip",
        )
    )
    delivered_so_far: list[str] = []
    outcomes = {"delivered": 0, "failed": 0}

    @settings(
        max_examples=_EXAMPLES or 6,
        derandomize=not _EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_rows())
    def check(edges: list[Edge]) -> None:
        expected: dict[int, Edge] = {}
        # Chosen from the rows rather than drawn, so the derandomized examples
        # (and their mix of outcomes the test counts) stay what they were.
        at_the_top = len(edges) % 2 == 0
        top_ids = iter(range(MAX_ID - len(edges) + 1, MAX_ID + 1))
        for edge in edges:
            event_id = uuid.uuid4().hex
            row_id = insert_foreign(
                engine,
                outbox,
                topic=topic,
                key=edge.key,
                payload=_payload(event_id, edge.size),
                headers=edge.headers,
                event_id=event_id,
                **({"id": next(top_ids)} if at_the_top else {}),
            )
            expected[row_id] = edge

        def settled() -> list[sa.Row[Any]]:
            mine = [r for r in rows(engine, outbox) if r.id in expected]
            return [] if any(r.status in _UNSETTLED for r in mine) else mine

        try:
            table = wait_for(settled, timeout=30, what="every row delivered or failed")
        except AssertionError:
            left = [
                (r.id, r.status, r.last_error) for r in rows(engine, outbox) if r.id in expected
            ]
            raise AssertionError(f"rows left waiting (a stall): {left}") from None
        assert relay.relay.supervisor.crashes == 0, "an edge row crashed the relay"
        for r in table:
            edge = expected[r.id]
            if edge.expect == "delivered":
                assert r.status == "delivered", (r.status, r.last_error, r.headers, edge.size)
                delivered_so_far.append(r.event_id)
            else:
                assert r.status == "failed", (r.status, r.headers, edge.size)
                assert edge.expect in (r.last_error or ""), r.last_error
                assert "p" * 50 not in (r.last_error or ""), "no payload bytes in last_error"
            outcomes[r.status] += 1
        messages = consume(kafka_bootstrap, topic, expected=len(delivered_so_far))
        first: dict[bytes, Any] = {}
        for m in messages:
            first.setdefault(m.headers["event_id"], m)
        assert {e.encode() for e in delivered_so_far} <= set(first)
        by_key: dict[bytes, list[int]] = {}
        for r in table:
            if r.status != "delivered":
                continue
            m = first[r.event_id.encode()]
            assert m.value == r.payload and m.key == r.message_key
            if r.message_key is not None:
                by_key.setdefault(r.message_key, []).append(m.offset)
        for offsets in by_key.values():  # table rows are in id order
            assert offsets == sorted(offsets), "a key's rows are in id order in Kafka"
        if at_the_top:  # settled: make room for the next example's rows up there
            with engine.begin() as conn:
                conn.execute(sa.text(f"DELETE FROM {outbox} WHERE id > :low"), {"low": MAX_ID // 2})
                if engine.dialect.name != "postgresql":  # a sequence never moved
                    conn.exec_driver_sql(f"ALTER TABLE {outbox} AUTO_INCREMENT = 1")

    check()
    assert outcomes["delivered"] > 5 and outcomes["failed"] > 3, outcomes
    assert relay.stop() == 0
