"""Fuzz: records from any producer against a real consumer, with and without the inbox.

Hypothesis writes batches of foreign records straight through librdkafka
(``rawkafka``): random key and value bytes or none, valid and invalid JSON,
header names that are not UTF-8, header values that are null, ``event_id``
missing, empty, repeated, not UTF-8 or too long, values near the size
limit, and JSON whose decoded text holds lone surrogates, line and paragraph
separators, bidirectional overrides and control characters, which the handler
logs and puts into its exception (``unknown order type <text>``), as services
do. Whatever arrives, the consumer never crashes, never stalls the partition,
handles or dead-letters each record exactly once, and commits the offset past
the last one; every log line is one JSON object with none of those characters
raw, and every dead-letter error header is UTF-8 that names the text escaped.

``OUTBOXKIT_FUZZ_EXAMPLES`` (default 3 per case) runs more batches.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from consumer_apps import effects
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafkahelp import committed, read_all, wait_for
from rawkafka import RawRecord, produce_raw

from outboxkit.consumer import Consumer, ConsumerSettings, Message, PermanentError
from outboxkit.runtime.logs import log_event, safe_text
from outboxkit.runtime.testing import capture_json_logs
from outboxkit.schema import apply_schema

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("OUTBOXKIT_FUZZ_EXAMPLES", "3"))

_bytes = st.binary(max_size=40)
#: Text a record's JSON can decode to that no log line or header may carry raw.
_hostile_text = st.text(
    alphabet=st.sampled_from(
        ["a", "é", "\ud800", "\udfff", "\u2028", "\u2029", "\x85", "\u202e", "\u2066",
         "\u200f", "\x1b", "\n", "\r", "\x00", "\x7f"]
    ),
    min_size=1,
    max_size=8,
)  # fmt: skip
RAW_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_name = st.one_of(
    st.sampled_from([b"event_id", b"traceparent", b"\xff\xfe", b"caf\xc3\xa9", b"\xc3("]),
    st.binary(min_size=1, max_size=12).filter(lambda b: b"\0" not in b),
)
_header = st.tuples(
    _name,
    st.one_of(
        st.none(),
        _bytes,
        _hostile_text.map(lambda t: t.encode("utf-8", "surrogatepass")),  # CESU-8 for a surrogate
    ),
)
_json_value = st.one_of(
    st.just(b'{"ok": true}'),
    st.just(b'{"fail": "permanent"}'),
    st.just(b"[1, 2, 3]"),
    st.just(b'"\\ud800"'),  # valid JSON, a lone surrogate once decoded
    _hostile_text.map(lambda t: json.dumps({"fail": t}).encode()),  # \ud800 escapes and all
)
_value = st.one_of(
    st.none(),
    _bytes,
    _json_value,
    st.sampled_from([990_000, 1_040_000]).map(lambda n: b"{" + b"x" * n),  # near the limit
)
_record = st.builds(
    RawRecord,
    key=st.one_of(st.none(), _bytes, st.just(b"k" * 5000)),
    value=_value,
    headers=st.lists(_header, max_size=4),
)


_log = logging.getLogger("fuzz")


class Foreign(Consumer):
    """What a service would do: read the headers and event id, parse JSON, write an effect."""

    def __init__(self, settings: ConsumerSettings, engine: sa.Engine | None = None) -> None:
        super().__init__(settings, engine=engine)
        self.handled: list[int] = []
        self.lock = threading.Lock()

    def handle(self, message: Message) -> None:
        event_id = message.event_id
        names = [name for name, _ in message.headers]
        data = message.json()
        if isinstance(data, dict) and data.get("fail") == "permanent":
            raise PermanentError("the payload asks to fail")
        if isinstance(data, dict) and "fail" in data:
            log_event(_log, "order-type-unknown", type=data["fail"], event_id=event_id)
            logging.getLogger("fuzz").warning("unknown order type %s", data["fail"])
            raise PermanentError(f"unknown order type {data['fail']}")
        if self.settings.inbox:
            message.tx.execute(
                effects.insert().values(
                    event_id=(event_id or "")[:64],
                    kafka_partition=message.partition,
                    kafka_offset=message.offset,
                    pid=len(names),
                )
            )
        json.dumps(data)  # the parsed value is usable
        with self.lock:
            self.handled.append(message.offset)


def _dlq_offsets(bootstrap: str, dlq: str, expect: int, records: list[RawRecord]) -> list[int]:
    """The original offsets of the dead-letter copies; checks each copy's error
    headers: UTF-8, nothing raw that splits or drives a line, the text escaped."""
    letters = read_all(bootstrap, dlq, expect=expect, timeout=30)
    out = []
    for letter in letters:
        headers = dict(letter.headers() or [])
        offset = int(headers["dlq.original.offset"])
        out.append(offset)
        error = headers["dlq.error.message"].decode("utf-8")
        assert not RAW_UNSAFE.findall(error + headers["dlq.error.class"].decode("utf-8")), error
        data = _decoded(records[offset].value)
        if error.startswith("unknown order type") and isinstance(data, dict):
            assert error == safe_text(f"unknown order type {data['fail']}"), error
    return out


def _decoded(value: bytes | None) -> object:
    try:
        return json.loads(value or b"")
    except ValueError:
        return None


@pytest.mark.parametrize(("inbox", "concurrency"), [(False, 1), (True, 2)], ids=["plain", "inbox"])
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(records=st.lists(_record, min_size=1, max_size=25))
def test_foreign_records_are_handled_or_dead_lettered_and_the_offset_reaches_the_end(
    kafka_bootstrap: str,
    kafka_topics: Callable[..., str],
    settings: Callable[..., ConsumerSettings],
    run_consumer: Any,
    db_url: str,
    inbox: bool,
    concurrency: int,
    records: list[RawRecord],
) -> None:
    topic = kafka_topics(1, config={"max.message.bytes": "2000000"})
    dlq = kafka_topics(1, name=f"{topic}.dlq")
    group = f"g-{topic}"
    n = len(records)
    produce_raw(kafka_bootstrap, topic, records)
    engine = sa.create_engine(db_url) if inbox else None
    if engine is not None:
        apply_schema(engine, shards=8)
        effects.metadata.create_all(engine)
    overrides: dict[str, Any] = {"group_id": group, "topics": (topic,), "concurrency": concurrency}
    if inbox:
        overrides.update(inbox=True, max_attempts=2)
    consumer = Foreign(settings(**overrides), engine)
    try:
        with capture_json_logs(level="INFO") as logs, run_consumer(consumer) as running:
            wait_for(
                lambda: committed(kafka_bootstrap, group, topic, 1) == {0: n},
                60,
                0.2,
                what=f"offset {n} committed",
            )
            assert running.thread.is_alive()
            assert consumer.supervisor.crashes == 0
            assert running.stop() == 0
    finally:
        if engine is not None:
            engine.dispose()

    duplicates = int(
        consumer.registry.get_sample_value("worker_messages_total", {"result": "duplicate"}) or 0
    )
    for line in logs.text.splitlines():  # one JSON object each, nothing raw
        assert not RAW_UNSAFE.findall(line), line
        json.loads(line)
    dead = _dlq_offsets(
        kafka_bootstrap, dlq, expect=n - len(consumer.handled) - duplicates, records=records
    )
    handled = consumer.handled
    assert len(set(handled)) == len(handled)  # handled once each
    assert len(set(dead)) == len(dead)  # dead-lettered once each
    assert not set(handled) & set(dead)
    assert len(handled) + len(dead) + duplicates == n
    assert set(handled) | set(dead) <= set(range(n))
